"""How each implementation a benchmark compares is built, for a model or a GEMM workload.

``tpp`` (the TPP kernels with default configurations), ``tpp-tuned`` (configurations the
TPP tuner measured, in ``work_dir/tuning.db``: the database ``tvm-tpp tune --work-dir`` and
``tvm_tpp.compile(work_dir=...)`` use), ``tpp-float32`` (``tpp`` on the float32 model or GEMM: the
reference a low-precision run compares with), ``numpy`` (GEMMs only: ``np.matmul``; on an
int8 or bfloat16 GEMM, which numpy cannot multiply in those units, PyTorch's CPU matmul
(oneDNN) if ``torch`` imports: ``bench-gemm``'s ``torch`` row),
``tvm-default`` (TVM's own build without schedules), ``metaschedule`` (TVM's default search
space, :mod:`tvm_tpp.bench.metaschedule`), ``onnxruntime`` (models only), ``openvino`` and
``openvino-f32`` (models only, the optional ``openvino`` extra: OpenVINO's CPU plugin with its
defaults, which run bf16 on CPUs with AVX512-BF16 or AMX, and with ``INFERENCE_PRECISION_HINT``
f32; each row's notes begin with the precision it ran in) and the untimed
``reference`` (ONNX Runtime's outputs).  :func:`build` gives a :class:`Built`: a function
that runs it once, its :data:`~tvm_tpp.bench.timing.Timer` and what building cost.

One rule for tuning time (``tune_seconds``), whoever tunes: the seconds this run spent
searching.  A result already in a database costs 0 (the notes say it was cached and, where
known, what its search took), and one-off process start-up (MetaSchedule's tensor-intrinsic
import) is no search: the notes name it.  ``compile_seconds`` is the rest of the build.

Examples
--------
>>> from tvm_tpp.bench.workloads import GemmWorkload, ModelWorkload
>>> supports("numpy", GemmWorkload(8, 8, 8)), supports("onnxruntime", GemmWorkload(8, 8, 8))
(True, False)
>>> model = ModelWorkload("m.onnx", "i.npz", "o.npz", "m_1")
>>> print(*[i for i in IMPLS if supports(i, model)])  # doctest: +NORMALIZE_WHITESPACE
tpp tpp-tuned tpp-float32 tvm-default metaschedule metaschedule-1x metaschedule-10x
onnxruntime openvino openvino-f32
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import metaschedule
from .timing import Timer, loop_timer, tvm_timer
from .workloads import GemmWorkload, ModelWorkload, Workload

if TYPE_CHECKING:
    from .protocol import Job

__all__ = ["BUDGET_TRIALS_PER_ITER", "IMPLS", "NATIVE_FEATURES", "TIME_MATCHED", "Built",
           "Unavailable", "build", "gemm_problem", "host_llvm", "native_feature", "supports"]

#: Every implementation, in table order (each benchmark shows those its workload supports).
IMPLS = ("tpp", "tpp-tuned", "tpp-float32", "numpy", "torch", "tvm-default", "metaschedule",
         "metaschedule-1x", "metaschedule-10x", "onnxruntime", "openvino", "openvino-f32")
#: MetaSchedule given a multiple of the wall time tpp-tuned searched for (models only): the
#: harness puts tpp-tuned's seconds in ``Job.ms_budget``.
TIME_MATCHED = {"metaschedule-1x": 1.0, "metaschedule-10x": 10.0}

#: ``say(text)``: progress of a long build, shown by the harness.
Say = Callable[[str], None]


class Unavailable(RuntimeError):
    """This implementation does not run this workload here (a skipped row, not an error)."""


@dataclass(frozen=True)
class Built:
    """A built implementation of one workload.

    ``run`` gives its outputs; ``timer`` times it (None: not timed, the reference);
    ``compile_seconds`` is None where the benchmark does not report it (GEMMs);
    ``search_seconds`` is what the searches behind a tuned build took, this run's or, for
    results reused from a database, the earlier runs' (tpp-tuned models: the budget of the
    time-matched MetaSchedule rows);
    ``explain`` is the TPP tuner's model ranking next to its measurements (GEMMs).
    """

    run: Callable[[], list[np.ndarray]]
    timer: Timer | None
    compile_seconds: float | None = None
    tune_seconds: float | None = None
    target: str = ""
    notes: str = ""
    explain: dict[str, Any] | None = None
    search_seconds: float | None = None


def host_llvm(threads: int):
    """TVM's plain LLVM target for this CPU (what tvm-default and MetaSchedule build for)."""
    import tvm

    return tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(),
                              "num-cores": threads})


def _tpp_target(threads: int):
    from ..tpp_target import target

    return target("tpp", num_cores=threads)


# ------------------------------------------------------------------------------------------
# Models.


def _vm_built(executable, inputs: Sequence[np.ndarray], compile_seconds: float,
              **details: Any) -> Built:
    """A Relax executable run in a VM on ``inputs``, timed by TVM's evaluator."""
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

    return Built(run, tvm_timer(vm, "main", args), compile_seconds, **details)


def _relax_module(proto, specs):
    """The ONNX model in Relax with inference-only decompositions (BatchNorm etc.)."""
    from tvm import relax

    from ..onnx_import import to_relax

    return relax.transform.DecomposeOpsForInference()(to_relax(proto, specs))


def _compile_precision(job: Job) -> str:
    """``compile``'s precision for ``job``: int8 is not an option of its own but the model
    file (QDQ dense layers go to the int8 kernels whatever the precision says)."""
    return "bf16" if job.precision == "bf16" else "float32"


def _model_tpp(job: Job, workload: ModelWorkload, say: Say) -> Built:
    from .. import compiler

    proto, _, inputs = workload.load()
    start = time.perf_counter()
    target = f"tpp -num-cores={job.threads}"
    if workload.symbolic_batch:  # one build serves every batch size
        compiled, built_here = _symbolic_build(job, proto, target, workload.fixed_shapes())
        how = "one symbolic-batch build for every batch" + ("" if built_here else " (reused)")
    else:
        compiled = compiler.compile(proto, target=target, input_shapes=workload.input_shapes,
                                    untuned=True, precision=_compile_precision(job))
        how = ""
    routed = sum(1 for o in compiled.report if o.kernel)
    note = compiler.precision_note(_compile_precision(job), compiled.target)
    notes = (f"{job.precision}: {routed}/{len(compiled.report)} matched operators on TPP "
             "kernels" if compiled.report else job.precision) + "".join(
        f"; {text}" for text in (note, compiled.int8_note, how) if text)
    return _vm_built(compiled.executable, inputs, time.perf_counter() - start,
                     target=str(compiled.target), notes=notes)


def _symbolic_build(job: Job, proto, target: str, shapes: dict[str, list[int]] | None):
    """(the model compiled with its batch symbolic, and ``shapes`` for the inputs whose
    shapes the user gave; whether it was built now): exported to
    ``work_dir/builds`` under a hash of the model and the build's settings, so that the
    workers of the other batch sizes load it instead of compiling again."""
    import hashlib

    from .. import compiler
    from ..errors import ModelError

    settings = f"{target}|{job.precision}|{sorted((shapes or {}).items())}".encode()
    digest = hashlib.sha256(proto.SerializeToString() + settings).hexdigest()[:16]
    path = Path(job.work_dir) / "builds" / f"tpp_{digest}.so"
    if path.exists():
        try:
            return compiler.load(path), False
        except ModelError:
            pass  # an interrupted or stale export: built again below
    compiled = compiler.compile(proto, target=target, input_shapes=shapes, untuned=True,
                                precision=_compile_precision(job))
    path.parent.mkdir(parents=True, exist_ok=True)
    compiled.export(path)
    return compiled, True


def _model_tpp_tuned(job: Job, workload: ModelWorkload, say: Say) -> Built:
    from schedules.database import Database, TuningKey

    from .. import compiler

    proto, _, inputs = workload.load()
    cached: list[bool] = []
    searches: list[float] = []
    database = Database(Path(job.work_dir) / compiler.DATABASE)
    target = _tpp_target(job.threads)

    def on_tuned(problem, result) -> None:
        cached.append(result.cached)
        record = database.record(TuningKey.of(problem, target)) if result.cached else None
        searches.append(float((record or {}).get("tune_seconds", 0.0)) if result.cached
                        else result.tune_seconds)

    start = time.perf_counter()
    compiled = compiler.compile(proto, target=f"tpp -num-cores={job.threads}",
                                input_shapes=workload.input_shapes, tune=True,
                                tune_budget=job.tune_budget, work_dir=job.work_dir,
                                on_tuned=on_tuned, precision=_compile_precision(job))
    seconds = time.perf_counter() - start - compiled.tune_seconds
    return _vm_built(compiled.executable, inputs, max(seconds, 0.0),
                     tune_seconds=compiled.tune_seconds, search_seconds=sum(searches),
                     target=str(compiled.target),
                     notes=f"{job.precision}: database {Path(job.work_dir) / compiler.DATABASE}: "
                     f"{cached.count(False)} operators tuned, {sum(cached)} cached" + "".join(
                         f"; {text}" for text in (compiled.precision_note, compiled.int8_note)
                         if text))


def _model_tvm_default(job: Job, workload: ModelWorkload, say: Say) -> Built:
    import tvm
    from tvm import relax

    proto, specs, inputs = workload.load()
    target = host_llvm(job.threads)
    start = time.perf_counter()
    executable = tvm.compile(_relax_module(proto, specs), target=target,
                             relax_pipeline=relax.get_default_pipeline(target))
    return _vm_built(executable, inputs, time.perf_counter() - start, target=str(target),
                     notes="relax.get_default_pipeline: no CPU schedules (naive loops)")


def _needs_metaschedule() -> None:
    missing = metaschedule.missing_packages()
    if missing:
        raise Unavailable(f"MetaSchedule needs {', '.join(missing)}: pip install "
                          "'tvm-tpp[tune]'")


#: Trials per MetaSchedule iteration under a time budget: small batches, so the gradient
#: scheduler's first round reaches every task before the budget runs out (a task without a
#: record is compiled untuned).
BUDGET_TRIALS_PER_ITER = 16
#: The trial cap of a budgeted search: the deadline, not the count, ends it.
_BUDGET_TRIAL_CAP = 1_000_000


def metaschedule_relax(mod, target, database_dir: Path, trials: int, seed: int, runner,
                       say: Say, budget_seconds: float | None = None
                       ) -> tuple[Any, metaschedule.MetaScheduleDatabase, str]:
    """A Relax module built with MetaSchedule's search (``trials`` over its tasks, timed by
    ``runner``: a ``LocalRunner`` here or an ``RPCRunner`` on a tracker's servers), the
    database searched (or reused) and a note on how the trials were spent.  With
    ``budget_seconds`` the search runs until that wall time is spent instead of for
    ``trials`` (:class:`~tvm_tpp.bench.metaschedule.Deadline`)."""
    import tvm
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    # Builds without importing tvm.s_tir.tensor_intrin: LocalBuilder starts fresh workers for
    # every batch, and that import (30-60 s) in each would dwarf the tuning itself.
    from schedules.ms_space import local_builder

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
    if not tasks:
        raise RuntimeError("MetaSchedule found no tasks to tune in this model")
    if budget_seconds is None:
        per_task = max(1, trials // len(tasks))
        settings = {"trials": trials, "per_task": per_task}
        per_iter, callbacks, deadline = min(64, per_task), "default", None
        say(f"MetaSchedule, {trials} trials")
    else:
        trials = per_task = _BUDGET_TRIAL_CAP
        per_iter = BUDGET_TRIALS_PER_ITER
        settings = {"budget_seconds": round(budget_seconds, 1), "per_iter": per_iter}
        deadline = metaschedule.Deadline(budget_seconds)
        callbacks = [*ms.measure_callback.MeasureCallback.create("default"),
                     deadline.callback()]
        say(f"MetaSchedule, {budget_seconds:.0f} s")

    def run_search(path: str):
        builder = local_builder(timeout_sec=600)
        scheduler = ms.task_scheduler.TaskScheduler.create("gradient")
        if deadline is not None:
            builder = deadline.builder(builder, scheduler)
            deadline.start()
        try:
            return ms.relax_integration.tune_relax(
                mod=fused, params={}, target=target, work_dir=path,
                max_trials_global=trials, max_trials_per_task=per_task,
                num_trials_per_iter=per_iter, builder=builder, runner=runner,
                cost_model="xgb", seed=seed, measure_callbacks=callbacks,
                task_scheduler=scheduler)
        except Exception:  # the deadline's exception comes back through TVM's FFI
            if deadline is None or not deadline.hit:
                raise
            return ms.database.JSONDatabase(work_dir=path)

    searched = metaschedule.search(
        database_dir, {**settings, "tasks": len(tasks), "target": str(target), "seed": seed},
        run_search)
    executable = ms.relax_integration.compile_relax(searched.database, mod, target, params=None)
    if deadline is None:
        spent = f"{trials} trials over {len(tasks)} tasks = {per_task} per task"
    elif searched.earlier_seconds is not None:
        spent = f"a {budget_seconds:.1f} s budget over {len(tasks)} tasks"
    else:
        spent = (f"a {budget_seconds:.1f} s budget: {deadline.trials} trials ({per_iter} per "
                 f"iteration), {len(deadline.measured_tasks)} of {len(tasks)} tasks measured")
    return executable, searched, f"{spent}, xgb; {searched.note()}"


def _model_metaschedule(job: Job, workload: ModelWorkload, say: Say) -> Built:
    _needs_metaschedule()
    from tvm.s_tir import meta_schedule as ms

    budget = None
    if job.impl in TIME_MATCHED:
        if job.ms_budget is None:
            raise ValueError(f"{job.impl} needs the tuning seconds of tpp-tuned (Job.ms_budget)")
        budget = TIME_MATCHED[job.impl] * job.ms_budget
    proto, specs, inputs = workload.load()
    target = host_llvm(job.threads)
    start = time.perf_counter()
    multiple = job.impl.split("-")[-1]  # "1x", "10x": its own database directory and note
    key = workload.key if budget is None else f"{workload.key}_{multiple}"
    executable, searched, note = metaschedule_relax(
        _relax_module(proto, specs), target,
        metaschedule.database_dir(job.work_dir, key, job.threads), job.ms_trials,
        job.seed, ms.runner.LocalRunner(timeout_sec=120), say, budget_seconds=budget)
    if budget is not None:
        note = f"{multiple} tpp-tuned's search, {note}"
    build_seconds = time.perf_counter() - start - searched.tune_seconds - \
        searched.startup_seconds
    return _vm_built(executable, inputs, max(build_seconds, 0.0),
                     tune_seconds=searched.tune_seconds, target=str(target), notes=note)


def _model_onnxruntime(job: Job, workload: ModelWorkload, say: Say) -> Built:
    import onnxruntime as ort

    from ..reference import onnxruntime_session

    proto, specs, inputs = workload.load()
    start = time.perf_counter()
    session = onnxruntime_session(proto, job.threads)
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

    return Built(run, loop_timer(lambda: session.run_with_iobinding(binding)), seconds,
                 target=f"onnxruntime {ort.__version__} CPU", notes="run_with_iobinding")


#: OpenVINO's names of its inference precisions, as the bench's precisions (a row's notes
#: begin with the one it ran in: what its tolerance is chosen by).
_OPENVINO_PRECISIONS = {"f32": "float32", "bf16": "bf16", "f16": "f16"}


def _model_openvino(job: Job, workload: ModelWorkload, say: Say) -> Built:
    """OpenVINO's CPU plugin on the workload's model (an int8 run's QDQ file, which OpenVINO
    runs on its int8 kernels) with ``INFERENCE_NUM_THREADS`` = the job's threads; otherwise
    its defaults (``openvino``: what a user gets, bf16 where the CPU has AVX512-BF16 or AMX)
    or ``INFERENCE_PRECISION_HINT`` f32 (``openvino-f32``).  Inputs are bound once, as the
    onnxruntime row's are.

    Raises
    ------
    Unavailable
        ``openvino`` does not import (``pip install 'tvm-tpp[openvino]'``).
    """
    try:
        import openvino as ov
    except ImportError:
        raise Unavailable("openvino not installed: pip install 'tvm-tpp[openvino]'") from None
    import openvino.properties as props
    import openvino.properties.hint as hints

    from ..reference import openvino_compiled, openvino_request

    proto, specs, inputs = workload.load()
    start = time.perf_counter()
    compiled = openvino_compiled(proto, {spec.name: spec.shape for spec in specs}, job.threads,
                                 f32=job.impl == "openvino-f32")
    request = openvino_request(compiled, {spec.name: array for spec, array
                                          in zip(specs, inputs, strict=True)})
    seconds = time.perf_counter() - start
    hint = compiled.get_property(hints.inference_precision).get_type_name()
    ran = _OPENVINO_PRECISIONS.get(hint, hint)
    threads = compiled.get_property(props.inference_num_threads)
    how = ("INFERENCE_PRECISION_HINT f32" if job.impl == "openvino-f32" else
           f"OpenVINO's defaults (its inference precision here: {hint}"
           + (", so the same build as openvino-f32)" if hint == "f32" else ")"))
    # The first word is the precision it ran in (the harness picks the row's tolerance by it).
    notes = (f"{ran}: {how}; {threads} threads, "
             f"{compiled.get_property(hints.performance_mode)} hint"
             + ("; the int8 file (QDQ) on OpenVINO's int8 kernels" if job.precision == "int8"
                else ""))
    outputs = range(len(compiled.outputs))

    def run() -> list[np.ndarray]:
        request.infer()
        return [np.array(request.get_output_tensor(i).data) for i in outputs]

    return Built(run, loop_timer(request.infer), seconds,
                 target=f"openvino {ov.__version__.split('-')[0]} CPU", notes=notes)


def _model_reference(job: Job, workload: ModelWorkload, say: Say) -> Built:
    from ..reference import run_onnxruntime

    proto, specs, inputs = workload.load()
    named = {s.name: a for s, a in zip(specs, inputs, strict=True)}
    # An int8 model's reference is its QDQ graph as the ONNX spec computes it: ONNX Runtime
    # without the fusions into its integer kernels, whose roundings its own row then shows.
    optimize = job.precision != "int8"
    return Built(lambda: run_onnxruntime(proto, named, job.threads, optimize), None, 0.0)


# ------------------------------------------------------------------------------------------
# GEMMs.


def _executable_built(executable, args: list, **details: Any) -> Built:
    """A TVM GEMM executable on ``args`` (``[X, W, Y]``), timed by TVM's evaluator."""

    def run() -> list[np.ndarray]:
        executable(*args)
        return [args[-1].numpy()]

    return Built(run, tvm_timer(executable.mod, executable.mod.entry_name, args), **details)


def _plain_matmul(m: int, n: int, k: int):
    """TVM's plain ``X @ W`` PrimFunc (no schedule): tvm-default's and MetaSchedule's input."""
    from tvm import te

    x = te.placeholder((m, k), "float32", name="X")
    w = te.placeholder((k, n), "float32", name="W")
    r = te.reduce_axis((0, k), name="k")
    y = te.compute((m, n), lambda i, j: te.sum(x[i, r] * w[r, j], axis=r), name="Y")
    return te.create_prim_func([x, w, y])


def _gemm_args(x: np.ndarray, w: np.ndarray) -> list:
    import tvm

    return [tvm.runtime.tensor(x), tvm.runtime.tensor(w),
            tvm.runtime.empty((x.shape[0], w.shape[1]), "float32")]


#: The CPU features that multiply a low-precision GEMM dtype in its own units (dot products of
#: int8 or bf16 pairs); an ISA with none of them runs that dtype's kernel as an emulation.
NATIVE_FEATURES: dict[str, tuple[str, ...]] = {
    "int8": ("amx_int8", "avx512_vnni", "avx_vnni", "i8mm"),
    "bfloat16": ("amx_bf16", "avx512_bf16", "bf16"),
}


def native_feature(isa, dtype: str) -> str | None:
    """The first of :data:`NATIVE_FEATURES` ``isa`` (a :class:`microkernels.isa.Isa`) has for
    a GEMM ``dtype`` (float32: ``"fma"``); None when its kernel emulates the dtype.

    >>> from microkernels.isa import from_name
    >>> native_feature(from_name("avx512_bf16"), "int8"), native_feature(from_name("avx2"),
    ...                                                                  "bfloat16")
    ('avx512_vnni', None)
    """
    if dtype == "float32":
        return "fma"
    return next((f for f in NATIVE_FEATURES[dtype] if isa.has(f)), None)


def gemm_problem(workload: GemmWorkload):
    """The :class:`schedules.gemm.GemmProblem` of ``workload`` (int8: uint8 X, int8 W)."""
    from schedules.gemm import GemmProblem

    dtype = {"float32": "float32", "int8": "uint8", "bfloat16": "bfloat16"}[workload.dtype]
    return GemmProblem(workload.m, workload.n, workload.k, dtype=dtype)


def _tpp_gemm(job: Job, workload: GemmWorkload, config, target, **details: Any) -> Built:
    """The loop_spec GEMM of ``config``; ``W`` is packed outside the timing (as a model's
    constant weights are)."""
    import tvm

    from microkernels.brgemm import BrgemmShape, find_impl
    from microkernels.machine import machine_of
    from schedules.dynamic_parallel import pipeline_for
    from schedules.gemm import pack_weight, schedule

    m, n = workload.m, workload.n
    problem = gemm_problem(workload)
    isa = machine_of(target).isa
    executable = tvm.compile(schedule(problem, config, isa).mod, target=target,
                             tir_pipeline=pipeline_for(target))  # as models build it
    kernel, _ = find_impl(BrgemmShape(m=config.bm, n=config.bn, k=config.bk,
                                      batch=config.k_step, dtype_a=problem.dtype,
                                      dtype_acc=problem.acc_dtype,
                                      layout=problem.on(isa).layout, isa=isa.name))
    steps = dict(config.candidate.block_steps)
    note = (f"{kernel} kernel, bm x bn x bk x k_step {config.bm}x{config.bn}x{config.bk}"
            f"x{config.k_step} {config.spec}{' ' + str(steps) if steps else ''}"
            f"{'' if config.pack_a is None else f' A packed at depth {config.pack_a}'}")
    if workload.dtype != "float32":
        feature = native_feature(isa, workload.dtype)
        units = (f"{problem.dtype} x {problem.weight_dtype} -> {problem.out_dtype}")
        note = f"{units} " + (f"on {feature}" if feature else
                              f"EMULATED ({isa.name} lacks "
                              f"{'/'.join(NATIVE_FEATURES[workload.dtype])})") + f"; {note}"
    details["notes"] = "; ".join(filter(None, (details.get("notes"), note)))
    x, w = workload.operands(job.seed)
    args = [tvm.runtime.tensor(x),
            tvm.runtime.tensor(pack_weight(w, config.bn, problem, isa=isa)),
            tvm.runtime.empty((m, n), problem.out_dtype)]
    return _executable_built(executable, args, target=str(target), **details)


def _gemm_tpp(job: Job, workload: GemmWorkload, say: Say) -> Built:
    from microkernels.machine import machine_of
    from schedules.gemm import default_config

    target = _tpp_target(job.threads)
    config = default_config(gemm_problem(workload), machine_of(target))
    return _tpp_gemm(job, workload, config, target)


def _gemm_tpp_tuned(job: Job, workload: GemmWorkload, say: Say) -> Built:
    from schedules.tuner import OPS, Database, Measurement, TuningKey, tune

    from ..compiler import DATABASE
    from .report import explanation

    target = _tpp_target(job.threads)
    problem = gemm_problem(workload)
    database = Database(Path(job.work_dir) / DATABASE)
    result = tune(problem, target, database=database, top_k=job.top_k,
                  budget_seconds=job.tune_budget,
                  progress=lambda done, total: say(f"tuning {done}/{total}"))
    record = database.record(TuningKey.of(problem, target)) or {}
    if result.cached:
        earlier = record.get("tune_seconds")
        notes = "database hit (cached" + (f": tuned earlier in {earlier:.1f} s)"
                                          if earlier is not None else ")")
        measurements = [Measurement(OPS["dense"].from_json(m["config"]), m.get("model_rank"),
                                    m.get("predicted_cycles"), m.get("seconds"),
                                    m.get("error"), m.get("model_class"))
                        for m in record.get("measured", [])]
    else:
        notes = f"tuned: default + model top-{len(result.measurements) - 1}"
        if job.tune_budget is not None:
            notes += f" (budget {job.tune_budget:g} s)"
        measurements = list(result.measurements)
    return _tpp_gemm(job, workload, result.best, target, tune_seconds=result.tune_seconds,
                     notes=notes, explain=explanation(measurements, problem, result.best))


def _gemm_numpy(job: Job, workload: GemmWorkload, say: Say) -> Built:
    if workload.dtype != "float32":
        raise ValueError(f"numpy multiplies float32 GEMMs, not {workload.dtype}")
    x, w = workload.operands(job.seed)
    out = np.empty((workload.m, workload.n), "float32")

    def run() -> list[np.ndarray]:
        np.matmul(x, w, out=out)
        return [out]

    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    return Built(run, loop_timer(lambda: np.matmul(x, w, out=out)),
                 notes=f"numpy {np.__version__} with {blas.get('name')} "
                       f"{blas.get('version', '')}".strip())


def _gemm_torch(job: Job, workload: GemmWorkload, say: Say) -> Built:
    """PyTorch's CPU matmul in the workload's units: bf16 ``torch.matmul`` (bf16 out,
    float32 accumulation), int8 ``torch._int_mm`` (s8 x s8 -> s32) on ``X - 128`` with
    ``128 * colsum(W)`` added back outside the timing (a constant of the weights, as oneDNN's
    own u8 compensation is).

    Raises
    ------
    Unavailable
        ``torch`` does not import, or its int8 matmul does not run on this CPU.
    """
    try:
        import torch
    except ImportError:
        raise Unavailable("torch not installed") from None
    torch.set_num_threads(job.threads)
    x, w = workload.operands(job.seed)
    version = f"torch {torch.__version__}"
    if workload.dtype == "bfloat16":
        tx = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)  # exact: bf16 values
        tw = torch.from_numpy(w.astype(np.float32)).to(torch.bfloat16)
        ty = torch.empty((workload.m, workload.n), dtype=torch.bfloat16)

        def matmul() -> None:
            torch.matmul(tx, tw, out=ty)

        def run() -> list[np.ndarray]:
            matmul()
            return [ty.float().numpy()]

        return Built(run, loop_timer(matmul),
                     notes=f"{version} matmul bf16 x bf16 -> bf16 (oneDNN "
                           f"{'on' if torch.backends.mkldnn.is_available() else 'off'})")
    if not hasattr(torch, "_int_mm"):
        raise Unavailable(f"{version} has no torch._int_mm")
    xs = torch.from_numpy((x.astype(np.int16) - 128).astype(np.int8))
    tw = torch.from_numpy(np.ascontiguousarray(w))
    compensation = 128 * w.astype(np.int64).sum(axis=0)
    try:
        ty = torch._int_mm(xs, tw)  # CPU support and shape limits vary by version
    except (RuntimeError, NotImplementedError, TypeError) as err:
        from .protocol import reason

        raise Unavailable(f"{version} torch._int_mm fails on CPU here: {reason(err)}") from None
    try:
        torch._int_mm(xs, tw, out=ty)

        def matmul() -> None:
            torch._int_mm(xs, tw, out=ty)
    except (RuntimeError, TypeError):  # no out= variant: the result is allocated per run
        def matmul() -> None:
            torch._int_mm(xs, tw)

    def run() -> list[np.ndarray]:
        y = torch._int_mm(xs, tw).numpy().astype(np.int64) + compensation
        return [y.astype(np.int32)]

    return Built(run, loop_timer(matmul),
                 notes=f"{version} _int_mm s8 x s8 -> s32 on X - 128; + 128 colsum(W) "
                       "outside the timing")


def _gemm_tvm_default(job: Job, workload: GemmWorkload, say: Say) -> Built:
    if workload.dtype != "float32":
        raise Unavailable(f"float32 GEMMs only, not {workload.dtype}")
    import tvm

    m, n, k = workload.m, workload.n, workload.k
    target = host_llvm(job.threads)
    x, w = workload.operands(job.seed)
    # Rows are independent in the naive loops: a run on a few rows predicts the full one.
    rows = max(1, min(m, 4, int(2e7 // (2 * n * k))))
    if rows < m:
        probe = tvm.compile(_plain_matmul(rows, n, k), target=target)
        args = _gemm_args(x[:rows], w)
        probe(*args)  # warm-up
        predicted = min(tvm_timer(probe.mod, probe.mod.entry_name, args)(1, 3, True)) * m / rows
        if predicted > job.tvm_default_limit:
            raise Unavailable(f"one run would take ~{predicted:.3g} s (> "
                              f"{job.tvm_default_limit:g} s limit; timed on {rows} rows)")
    executable = tvm.compile(_plain_matmul(m, n, k), target=target)
    return _executable_built(executable, _gemm_args(x, w), target=str(target),
                             notes="no schedule: naive serial loops")


def _gemm_metaschedule(job: Job, workload: GemmWorkload, say: Say) -> Built:
    if workload.dtype != "float32":
        raise Unavailable(f"float32 GEMMs only, not {workload.dtype}")
    _needs_metaschedule()
    import tvm
    from tvm.s_tir import meta_schedule as ms

    from schedules.ms_space import local_builder

    target = host_llvm(job.threads)
    func = _plain_matmul(workload.m, workload.n, workload.k)
    say(f"MetaSchedule, {job.ms_trials} trials")
    searched = metaschedule.search(
        metaschedule.database_dir(job.work_dir, workload.key, job.threads),
        {"trials": job.ms_trials, "target": str(target), "seed": job.seed},
        lambda path: ms.tune_tir(mod=func, target=target, work_dir=path,
                                 max_trials_global=job.ms_trials,
                                 num_trials_per_iter=min(64, job.ms_trials),
                                 builder=local_builder(), cost_model="xgb", seed=job.seed))
    sch = ms.tir_integration.compile_tir(searched.database, func, target)
    if sch is None:
        raise RuntimeError(f"MetaSchedule found no valid schedule; logs in {searched.path}/logs")
    x, w = workload.operands(job.seed)
    return _executable_built(tvm.compile(sch.mod, target=target), _gemm_args(x, w),
                             tune_seconds=searched.tune_seconds, target=str(target),
                             notes=f"{job.ms_trials} trials, xgb; {searched.note()}")


_BUILDERS: dict[str, dict[type, Callable[..., Built]]] = {
    "tpp": {ModelWorkload: _model_tpp, GemmWorkload: _gemm_tpp},
    "tpp-tuned": {ModelWorkload: _model_tpp_tuned, GemmWorkload: _gemm_tpp_tuned},
    # The same build as tpp: the harness gives its job the float32 model and precision, or
    # the float32 GEMMs.
    "tpp-float32": {ModelWorkload: _model_tpp, GemmWorkload: _gemm_tpp},
    "numpy": {GemmWorkload: _gemm_numpy},
    "torch": {GemmWorkload: _gemm_torch},
    "tvm-default": {ModelWorkload: _model_tvm_default, GemmWorkload: _gemm_tvm_default},
    "metaschedule": {ModelWorkload: _model_metaschedule, GemmWorkload: _gemm_metaschedule},
    "metaschedule-1x": {ModelWorkload: _model_metaschedule},
    "metaschedule-10x": {ModelWorkload: _model_metaschedule},
    "onnxruntime": {ModelWorkload: _model_onnxruntime},
    "openvino": {ModelWorkload: _model_openvino},
    "openvino-f32": {ModelWorkload: _model_openvino},
    "reference": {ModelWorkload: _model_reference},
}


def supports(impl: str, workload: Workload) -> bool:
    """Whether ``impl`` builds workloads of ``workload``'s kind."""
    return type(workload) in _BUILDERS.get(impl, {})


def build(job: Job, workload: Workload, say: Say) -> Built:
    """``job.impl`` built for ``workload``.

    Raises
    ------
    Unavailable
        It cannot run here (missing packages, a run too slow to time).
    ValueError
        It does not build this kind of workload.
    """
    if not supports(job.impl, workload):
        raise ValueError(f"{job.impl} does not build a {type(workload).__name__}")
    return _BUILDERS[job.impl][type(workload)](job, workload, say)
