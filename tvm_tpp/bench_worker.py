"""Worker process of ``tvm-tpp bench``: builds one implementation of one model and times it.

Each implementation runs in its own process because TVM's, ONNX Runtime's and OpenBLAS's
thread pools disturb each other (2-7x outliers) when they share one.  The harness
(:mod:`tvm_tpp.bench`) starts ``python -m tvm_tpp.bench_worker JOB`` with ``TVM_NUM_THREADS``
already in the environment, ``JOB`` being a :class:`Job` as JSON, and talks JSON lines:

- the worker builds, runs once (writing its outputs to ``job.outputs`` as ``.npz``) and answers
  ``{"ok": true, "compile_seconds", "tune_seconds", "run_seconds", "target", "notes"}``, or
  ``{"ok": false, "error": "..."}``, or ``{"skipped": "reason"}``;
- then, per line ``{"number": n, "warmup": w}`` on stdin, it answers
  ``{"ok": true, "seconds": s}``: the mean latency of ``n`` back-to-back runs, timed after one
  untimed warm-up run if ``w`` (TVM: its ``time_evaluator``; without warm-up a plain loop,
  which the harness asks for when one run takes over a second anyway);
- ``{"quit": true}`` or the end of stdin ends it.

Only the protocol goes to the real stdout: file descriptor 1 is pointed at stderr (a log file)
before anything else loads, so library prints (MetaSchedule, LLVM) cannot corrupt it.

Examples
--------
$ TVM_NUM_THREADS=2 python -m tvm_tpp.bench_worker '{"impl": "tpp", ...}'   # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

__all__ = ["IMPLS", "REFERENCE", "Job", "Unavailable", "main"]

#: The implementations ``tvm-tpp bench`` compares, in table order.
IMPLS = ("tpp", "tpp-tuned", "tvm-default", "metaschedule", "onnxruntime")
#: The job that only computes ONNX Runtime's reference outputs.
REFERENCE = "reference"
#: Runs shorter than this are timed again over about this long (the bench's default sample
#: length) before a sample is sized.
_PROBE_SECONDS = 0.05


class Unavailable(RuntimeError):
    """This implementation cannot run here (a skipped row, not an error)."""


@dataclass(frozen=True)
class Job:
    """What one worker builds and where it reads and writes.

    Parameters
    ----------
    impl
        One of :data:`IMPLS`, or :data:`REFERENCE`.
    model
        Path of the ONNX model.
    inputs
        ``.npz`` of the inputs, keyed by input name.
    outputs
        ``.npz`` the worker writes its outputs to (``out0``, ``out1``, ...).
    threads
        Threads every implementation uses (TVM's pool size comes from the environment).
    work_dir
        Directory of this implementation's tuning database for this model and batch
        (MetaSchedule, tpp-tuned); a later bench with the same settings reuses it.
    input_shapes
        Shapes by input name, for symbolic dimensions.
    ms_trials
        MetaSchedule's total trial budget.
    seed
        Seed of MetaSchedule's search.

    Examples
    --------
    >>> Job("tpp", "m.onnx", "in.npz", "out.npz", 2, "wd").impl
    'tpp'
    """

    impl: str
    model: str
    inputs: str
    outputs: str
    threads: int
    work_dir: str
    input_shapes: dict[str, list[int]] | None = None
    ms_trials: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.impl not in (*IMPLS, REFERENCE):
            raise ValueError(f"unknown implementation {self.impl!r}; known: {', '.join(IMPLS)}")
        if self.threads < 1 or self.ms_trials < 1:
            raise ValueError(f"threads and ms_trials must be >= 1, got {self.threads}, "
                             f"{self.ms_trials}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Job:
        return cls(**json.loads(text))


@dataclass
class _Built:
    """A built implementation: ``run`` gives outputs, ``time(n, warmup)`` seconds per run."""

    run: Callable[[], list[np.ndarray]]
    time: Callable[[int, bool], float]
    compile_seconds: float
    tune_seconds: float | None = None
    target: str = ""
    notes: str = ""


def _mean_seconds(call: Callable[[], object], number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        call()
    return (time.perf_counter() - start) / number


def _tvm_runner(executable, inputs: Sequence[np.ndarray]) -> tuple[Callable, Callable]:
    """Run and time a Relax executable with TVM's own evaluator (one warm-up run per call)."""
    import tvm
    from tvm import relax

    dev = tvm.cpu()
    vm = relax.VirtualMachine(executable, dev)
    args = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in inputs]

    def flatten(result) -> list:
        if isinstance(result, tvm.runtime.Tensor):
            return [result]
        return [leaf for item in result for leaf in flatten(item)]

    def run() -> list[np.ndarray]:
        return [t.numpy() for t in flatten(vm["main"](*args))]

    def timed(number: int, warmup: bool) -> float:
        if warmup:  # time_evaluator always makes one untimed call first
            evaluator = vm.time_evaluator("main", dev, number=number, repeat=1)
            return float(evaluator(*args).results[0])
        return _mean_seconds(lambda: vm["main"](*args), number)

    return run, timed


def _host_target(threads: int):
    """TVM's plain LLVM target for this CPU (what tvm-default and MetaSchedule build for)."""
    import tvm
    from tvm.target import Target

    mcpu = tvm.target.codegen.llvm_get_system_cpu()
    return Target({"kind": "llvm", "mcpu": mcpu, "num-cores": threads})


def _relax_module(proto, specs):
    """The ONNX model in Relax with inference-only decompositions (BatchNorm etc.)."""
    from tvm import relax

    from .onnx_import import to_relax

    return relax.transform.DecomposeOpsForInference()(to_relax(proto, specs))


def _build_tpp(job: Job, proto, specs, inputs) -> _Built:
    from . import compiler

    start = time.perf_counter()
    compiled = compiler.compile(proto, target=f"tpp -num-cores={job.threads}",
                                input_shapes=job.input_shapes)
    seconds = time.perf_counter() - start
    run, timed = _tvm_runner(compiled.executable, inputs)
    routed = sum(1 for o in compiled.report if o.kernel)
    return _Built(run, timed, seconds, None, str(compiled.target),
                  f"{routed}/{len(compiled.report)} matched operators on TPP kernels"
                  if compiled.report else "")


def _build_tpp_tuned(job: Job, proto, specs, inputs) -> _Built:
    from . import compiler

    work_dir = Path(job.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    compiled = compiler.compile(proto, target=f"tpp -num-cores={job.threads}",
                                input_shapes=job.input_shapes, tune=True, work_dir=str(work_dir))
    seconds = time.perf_counter() - start - compiled.tune_seconds
    run, timed = _tvm_runner(compiled.executable, inputs)
    return _Built(run, timed, max(seconds, 0.0), compiled.tune_seconds, str(compiled.target),
                  f"database {work_dir}")


def _build_tvm_default(job: Job, proto, specs, inputs) -> _Built:
    import tvm
    from tvm import relax

    target = _host_target(job.threads)
    start = time.perf_counter()
    mod = _relax_module(proto, specs)
    executable = tvm.compile(mod, target=target, relax_pipeline=relax.get_default_pipeline(target))
    seconds = time.perf_counter() - start
    run, timed = _tvm_runner(executable, inputs)
    return _Built(run, timed, seconds, None, str(target),
                  "relax.get_default_pipeline: no CPU schedules (naive loops)")


def _build_metaschedule(job: Job, proto, specs, inputs) -> _Built:
    import importlib.util

    missing = [m for m in ("xgboost", "psutil", "cloudpickle") if not importlib.util.find_spec(m)]
    if missing:  # MetaSchedule's cost model and workers: the [tune] extra
        raise Unavailable(f"MetaSchedule needs {', '.join(missing)}: pip install 'tvm-tpp[tune]'")
    import tvm
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    # Builds without importing tvm.s_tir.tensor_intrin: LocalBuilder starts fresh workers for
    # every batch, and that import (30-60 s) in each would dwarf the tuning itself.
    from schedules.ms_space import local_builder

    target = _host_target(job.threads)
    start = time.perf_counter()
    mod = _relax_module(proto, specs)
    # extract_tasks needs legalized, fused TIR; these are compile_relax's own passes, so the
    # database keys it looks up are the ones tuned here.
    fuse = tvm.transform.Sequential([
        *relax.pipeline.library_dispatch_passes(target),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ])
    with target:
        fused = fuse(mod)
    tasks = ms.relax_integration.extract_tasks(fused, target)
    prepare_seconds = time.perf_counter() - start
    if not tasks:
        raise RuntimeError("MetaSchedule found no tasks to tune in this model")
    per_task = max(1, job.ms_trials // len(tasks))
    db_dir = Path(job.work_dir)
    meta_path = db_dir / "bench_meta.json"
    meta = {"trials": job.ms_trials, "tasks": len(tasks), "per_task": per_task,
            "target": str(target), "threads": job.threads, "seed": job.seed}
    old = json.loads(meta_path.read_text()) if meta_path.is_file() else None
    reused = old is not None and {k: old.get(k) for k in meta} == meta
    if reused:
        database = ms.database.JSONDatabase(work_dir=str(db_dir))
        tune_seconds = float(old["tune_seconds"])
    else:
        # A database tuned with another budget or target would mix results: start afresh.
        shutil.rmtree(db_dir, ignore_errors=True)
        db_dir.mkdir(parents=True)
        tune_start = time.perf_counter()
        database = ms.relax_integration.tune_relax(
            mod=fused, params={}, target=target, work_dir=str(db_dir),
            max_trials_global=job.ms_trials, max_trials_per_task=per_task,
            num_trials_per_iter=min(64, per_task),
            builder=local_builder(timeout_sec=600),
            runner=ms.runner.LocalRunner(timeout_sec=120),
            cost_model="xgb", seed=job.seed,
        )
        tune_seconds = time.perf_counter() - tune_start
        meta_path.write_text(json.dumps({**meta, "tune_seconds": tune_seconds}))
    build_start = time.perf_counter()
    executable = ms.relax_integration.compile_relax(database, mod, target, params=None)
    seconds = prepare_seconds + time.perf_counter() - build_start
    run, timed = _tvm_runner(executable, inputs)
    notes = (f"{job.ms_trials} trials over {len(tasks)} tasks = {per_task} per task, xgb; "
             "tune s includes MetaSchedule's one-off tensor-intrinsic import; "
             f"database {db_dir}" + (" (reused; tune s as recorded)" if reused else ""))
    return _Built(run, timed, seconds, tune_seconds, str(target), notes)


def _build_onnxruntime(job: Job, proto, specs, inputs) -> _Built:
    import onnxruntime as ort

    start = time.perf_counter()
    options = ort.SessionOptions()
    options.intra_op_num_threads = job.threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(proto.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    # I/O binding: inputs bound once, so timing excludes Python-side input conversion (as
    # TVM's time_evaluator does).
    binding = session.io_binding()
    for spec, array in zip(specs, inputs, strict=True):
        binding.bind_cpu_input(spec.name, array)
    for output in session.get_outputs():
        binding.bind_output(output.name, "cpu")
    seconds = time.perf_counter() - start

    def run() -> list[np.ndarray]:
        session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()

    def timed(number: int, warmup: bool) -> float:
        if warmup:  # as TVM's time_evaluator does
            session.run_with_iobinding(binding)
        return _mean_seconds(lambda: session.run_with_iobinding(binding), number)

    return _Built(run, timed, seconds, None, f"onnxruntime {ort.__version__} CPU",
                  "run_with_iobinding")


def _build_reference(job: Job, proto, specs, inputs) -> _Built:
    from .reference import run_onnxruntime

    named = {s.name: a for s, a in zip(specs, inputs, strict=True)}

    def unavailable(_: int, __: bool) -> float:
        raise RuntimeError("the reference job is not timed")

    return _Built(lambda: run_onnxruntime(proto, named, job.threads), unavailable, 0.0)


_BUILDERS: dict[str, Callable[..., _Built]] = {
    "tpp": _build_tpp,
    "tpp-tuned": _build_tpp_tuned,
    "tvm-default": _build_tvm_default,
    "metaschedule": _build_metaschedule,
    "onnxruntime": _build_onnxruntime,
    REFERENCE: _build_reference,
}


def _send(channel: IO[str], message: dict[str, Any]) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def _reason(err: BaseException) -> str:
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1].strip() if lines else ''}".rstrip(": ")


def probe_seconds(built: _Built, first: float) -> float:
    """Seconds of one run, from which the bench sizes its samples.

    A run over a second (``first``, the first run) is its own probe.  Faster ones are timed
    again after a warm-up, and those under :data:`_PROBE_SECONDS` over about that long: one
    run may include waking the thread pool, up to 10x a 60-us model's run, and a probe that
    long would shrink the samples to a tenth of the others'.
    """
    if first > 1.0:
        return first
    once = built.time(1, True)
    if once >= _PROBE_SECONDS:
        return once
    return built.time(math.ceil(_PROBE_SECONDS / max(once, 1e-9)), True)


def _setup(job: Job) -> tuple[_Built, dict[str, Any]]:
    from .onnx_import import input_specs, load_onnx

    proto = load_onnx(job.model)
    specs = input_specs(proto, job.input_shapes)
    with np.load(job.inputs) as stored:
        inputs = [np.ascontiguousarray(stored[s.name]) for s in specs]
    built = _BUILDERS[job.impl](job, proto, specs, inputs)
    start = time.perf_counter()
    outputs = built.run()  # also the first warm-up
    first = time.perf_counter() - start
    np.savez(job.outputs, **{f"out{i}": np.asarray(o) for i, o in enumerate(outputs)})
    run_seconds = first if job.impl == REFERENCE else probe_seconds(built, first)
    return built, {
        "ok": True,
        "compile_seconds": built.compile_seconds,
        "tune_seconds": built.tune_seconds,
        "run_seconds": run_seconds,
        "target": built.target,
        "notes": built.notes,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Serve one job (see the module docstring); the exit status is 0 unless setup failed."""
    argv = sys.argv[1:] if argv is None else list(argv)
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else written to stdout goes to the log
    try:
        job = Job.from_json(argv[0])
        built, answer = _setup(job)
    except Unavailable as err:
        _send(channel, {"skipped": str(err)})
        return 0
    except Exception as err:
        traceback.print_exc()
        _send(channel, {"ok": False, "error": _reason(err)})
        return 1
    _send(channel, answer)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            break
        try:
            seconds = built.time(int(request["number"]), bool(request.get("warmup", True)))
        except Exception as err:
            traceback.print_exc()
            _send(channel, {"ok": False, "error": _reason(err)})
            return 1
        _send(channel, {"ok": True, "seconds": seconds if math.isfinite(seconds) else None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
