"""``tvm-tpp bench``: TPP against TVM's own build, MetaSchedule and ONNX Runtime, fairly.

The rules that keep the comparison fair:

- every implementation builds and runs in its own worker process
  (:mod:`tvm_tpp.bench.protocol`), because thread pools sharing a process disturb each other;
- all use the same number of threads and the same seeded inputs;
- after a warm-up, timed samples alternate round-robin between the live workers (one sample
  per worker per round, in :func:`~tvm_tpp.bench.timing.turn_order`), so drift of the
  machine hits all alike; the median, p10 and p90 of the samples are reported;
- every output is checked against ONNX Runtime; a row whose normwise relative error exceeds
  the tolerance is ``WRONG`` and is not ranked;
- with a low ``precision`` (:data:`TOLERANCES`), every implementation runs at it — ``bf16``:
  the TPP rows build their dense, conv and attention kernels in bf16 (OpenVINO's default row
  runs its own bf16 where the CPU has it); ``int8``: all run one QDQ-quantized
  file (a float model is quantized by :func:`~tvm_tpp.quantized.quantize_static_qdq`, an
  already quantized one is taken as it is), checked against that file's graph run by ONNX
  Runtime without its fusions (the QDQ semantics of the ONNX spec) — and
  the run gets a ``tpp-float32`` row (tpp on the float32 model, checked against ONNX Runtime
  on it with :data:`TOLERANCE`), so each row is also compared with float32 in the same run;
- compile and tuning seconds are reported apart from latency (tuning seconds by the one rule
  of :mod:`tvm_tpp.bench.impls`); ``tpp-tuned`` tunes into ``work_dir/tuning.db``, so a
  model tuned there before (by ``tvm-tpp tune --work-dir``) is not tuned again.

A worker that crashes, fails or times out becomes a row with the reason; the bench goes on.
This module itself never imports TVM or ONNX Runtime.

Examples
--------
>>> cfg = BenchConfig(models=("mlp",), impls=("tpp", "onnxruntime"), repeat=5)  # doctest: +SKIP
>>> rows = run_bench(cfg)                                                        # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import math
import os
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from microkernels import isa as _isa

from .. import models
from ..errors import ModelError
from ..onnx_import import input_specs, load_onnx
from ..quantized import RECIPE, RECIPE_REDUCED, is_quantized, quantize_static_qdq
from ..reference import TOLERANCES as _TOLERANCES
from ..reference import max_errors, random_inputs
from . import impls as _impls
from .progress import Progress
from .protocol import (
    PRECISIONS,
    REFERENCE,
    Job,
    TimingError,
    measure,
    prepared,
    start_worker,
    worker_command,
)
from .timing import PAUSE_SECONDS, Plan, SamplingPolicy, turn_order
from .workers import Worker, WorkerError
from .workloads import ModelWorkload

__all__ = ["BASELINES", "FLOAT32", "IMPLS", "SELF_CHOSEN", "STATUSES", "TOLERANCE", "TOLERANCES",
           "BenchConfig", "Row", "default_work_dir", "judge", "run_bench"]

#: The implementations ``tvm-tpp bench`` compares, in table order.
IMPLS = tuple(i for i in _impls.IMPLS
              if _impls.supports(i, ModelWorkload("m.onnx", "i.npz", "o.npz", "m")))
#: The row a low-precision run adds: tpp on the float32 model (not chosen with ``impls``).
FLOAT32 = "tpp-float32"
#: Implementations every other row's speedup is given against, when they were benchmarked.
BASELINES = (FLOAT32, "tvm-default", "metaschedule", *_impls.TIME_MATCHED, "onnxruntime",
             "openvino", "openvino-f32")
#: Rows whose precision is the library's own choice (OpenVINO's default is bf16 on CPUs with
#: AVX512-BF16 or AMX): their notes begin with ``"<precision>:"``, and a row that ran in a
#: lower precision than the run's gets that precision's tolerance.
SELF_CHOSEN = ("openvino", "openvino-f32")
#: ``ok``; ``WRONG`` (over tolerance); ``error`` (crash, failure, time-out); ``skipped``
#: (not available here); ``unchecked`` (ONNX Runtime could not produce a reference).
STATUSES = ("ok", "WRONG", "error", "skipped", "unchecked")
#: The default tolerance by precision (:data:`tvm_tpp.reference.TOLERANCES`), and float32's.
TOLERANCES = _TOLERANCES
TOLERANCE = TOLERANCES["float32"]

def default_work_dir() -> Path:
    """Where models, logs and tuning databases go unless ``--work-dir`` says otherwise."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "tvm-tpp" / "bench"


@dataclass(frozen=True)
class BenchConfig:
    """What to benchmark and how.

    Parameters
    ----------
    models
        Bundled model names (:func:`tvm_tpp.models.names`) or ONNX file paths.
    batches
        Batch sizes of bundled models; for files, a symbolic first dimension is set to each
        (a file with a static batch runs once, at its own batch).
    threads
        Threads of every implementation; default: the cores this process may use.
    repeat
        Timed samples per implementation (fewer for runs over ``slow_seconds``).
    impls
        Implementations, a subset of :data:`IMPLS` (default: all but :data:`FLOAT32`, the
        optional OpenVINO rows, :data:`SELF_CHOSEN`, and the time-matched MetaSchedule rows).
    ms_trials
        MetaSchedule's total trial budget, split evenly over the model's tasks (the
        ``metaschedule`` row; ``metaschedule-1x`` and ``metaschedule-10x`` search for as long
        as ``tpp-tuned``'s tuning took, and ten times that: they need it before them).
    work_dir
        Models, inputs, outputs, worker logs and tuning databases.
    seed
        Seed of the weights of bundled models, of the inputs and of MetaSchedule.
    precision
        One of :data:`TOLERANCES`' keys; below float32 the run adds the :data:`FLOAT32` row.
    reduce_range
        With ``precision="int8"``, a float model is quantized with 7-bit weights
        (``reduce_range``: ONNX Runtime's advice for CPUs without VNNI); every row runs that
        file.
    shapes
        Input shapes by name for ONNX files whose inputs have symbolic dimensions besides the
        batch (a detector's height and width); these inputs then run at that shape only.
    tolerance
        Largest normwise relative error against ONNX Runtime that counts as correct (for the
        :data:`FLOAT32` row always :data:`TOLERANCE`); default: :data:`TOLERANCES`'.
    timeout
        Seconds a worker may take to build (and tune) before it is killed.
    sample_seconds
        Target length of one timed sample: fast models run back to back until it is reached.
    slow_seconds, slow_budget
        Runs longer than ``slow_seconds`` get no warm-up and only about
        ``slow_budget / run`` samples (at least 3, at most ``repeat``).
    pause
        Seconds of quiet before each sample (:data:`~tvm_tpp.bench.timing.PAUSE_SECONDS`).
    worker_command
        The worker's command line; the job's JSON is appended.

    Examples
    --------
    >>> BenchConfig(models=("mlp",), impls=("tpp", "onnxruntime")).batches
    (1,)
    >>> cfg = BenchConfig(models=("mlp",), impls=("onnxruntime", "tpp"), precision="int8")
    >>> cfg.compared, cfg.tolerance
    (('onnxruntime', 'tpp', 'tpp-float32'), 0.05)
    """

    models: tuple[str, ...]
    batches: tuple[int, ...] = (1,)
    threads: int = field(default_factory=_isa.num_cores)
    repeat: int = 10
    impls: tuple[str, ...] = tuple(i for i in IMPLS if i != FLOAT32 and i not in SELF_CHOSEN
                                   and i not in _impls.TIME_MATCHED)
    ms_trials: int = 64
    work_dir: Path = field(default_factory=default_work_dir)
    seed: int = 0
    precision: str = "float32"
    reduce_range: bool = False
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    tolerance: float | None = None
    timeout: float = 3600.0
    sample_seconds: float = 0.05
    slow_seconds: float = 1.0
    slow_budget: float = 30.0
    pause: float = PAUSE_SECONDS
    worker_command: tuple[str, ...] = field(default_factory=worker_command)

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))
        object.__setattr__(self, "batches", tuple(self.batches))
        object.__setattr__(self, "impls", tuple(self.impls))
        object.__setattr__(self, "work_dir", Path(self.work_dir))
        object.__setattr__(self, "worker_command", tuple(self.worker_command))
        object.__setattr__(self, "shapes", {k: tuple(v) for k, v in self.shapes.items()})
        if not self.models:
            raise ValueError("give at least one model (bundled name or ONNX file)")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, "
                             f"got {self.precision!r}")
        if self.reduce_range and self.precision != "int8":
            raise ValueError("reduce_range quantizes a model's weights: it needs precision int8")
        if self.tolerance is None:
            object.__setattr__(self, "tolerance", TOLERANCES[self.precision])
        if FLOAT32 in self.impls:
            raise ValueError(f"{FLOAT32} is not chosen: a run with a precision below float32 "
                             "adds it")
        unknown = [i for i in self.impls if i not in IMPLS]
        if unknown or not self.impls or len(set(self.impls)) != len(self.impls):
            raise ValueError(f"implementations must be distinct names from {', '.join(IMPLS)}; "
                             f"got {', '.join(self.impls) or 'none'}")
        for n, impl in enumerate(self.impls):
            if impl in _impls.TIME_MATCHED and "tpp-tuned" not in self.impls[:n]:
                raise ValueError(f"{impl} searches for as long as tpp-tuned tuned: put "
                                 "tpp-tuned before it in the implementations")
        for name in ("threads", "repeat", "ms_trials"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if not self.batches or any(not isinstance(b, int) or b < 1 for b in self.batches):
            raise ValueError(f"batches must be positive ints, got {self.batches}")
        for name in ("tolerance", "timeout", "sample_seconds", "slow_seconds", "slow_budget"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.pause < 0:
            raise ValueError(f"pause must be >= 0, got {self.pause}")

    @property
    def sampling(self) -> SamplingPolicy:
        """Samples of ``sample_seconds`` each; slow runs get fewer, without warm-up.

        Examples
        --------
        >>> BenchConfig(models=("mlp",), repeat=10).sampling.plan(0.001)
        Plan(number=50, samples=10, warmup=True)
        """
        return SamplingPolicy(samples=self.repeat, sample_seconds=self.sample_seconds,
                              slow_seconds=self.slow_seconds, budget_seconds=self.slow_budget)

    @property
    def compared(self) -> tuple[str, ...]:
        """The implementations of the run in table order: ``impls`` as given, below float32
        with :data:`FLOAT32` after the TPP rows (next to what it is the float32 of)."""
        if self.precision == "float32":
            return self.impls
        after = max((n + 1 for n, i in enumerate(self.impls) if i.startswith("tpp")), default=0)
        return (*self.impls[:after], FLOAT32, *self.impls[after:])

    def command_line(self) -> str:
        """The ``tvm-tpp bench`` command that reproduces this configuration."""
        words = ["tvm-tpp", "bench", *self.models,
                 "--batch", ",".join(map(str, self.batches)), "--threads", str(self.threads),
                 "--repeat", str(self.repeat), "--impls", ",".join(self.impls),
                 "--ms-trials", str(self.ms_trials), "--work-dir", str(self.work_dir),
                 "--seed", str(self.seed), "--timeout", f"{self.timeout:g}",
                 "--precision", self.precision] + (["--reduce-range"] if self.reduce_range else [])
        return shlex.join(words)




@dataclass(frozen=True)
class Row:
    """One implementation on one model and batch; times in ms, build costs in seconds.

    ``speedup`` maps each baseline of :data:`BASELINES` that ran correctly on the same model
    and batch to ``baseline median / this median`` (filled in by :func:`judge`).
    """

    model: str
    batch: int
    threads: int
    impl: str
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    compile_seconds: float | None = None
    tune_seconds: float | None = None
    max_rel_err: float | None = None
    max_abs_err: float | None = None
    status: str = "ok"
    error: str | None = None
    samples: int = 0
    runs_per_sample: int = 0
    target: str | None = None
    notes: str | None = None
    speedup: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(f"unknown implementation {self.impl!r}")
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")



@dataclass(frozen=True)
class _Case:
    """One model at one batch size, with its files."""

    label: str
    batch: int
    model_path: Path
    input_shapes: dict[str, list[int]] | None
    run_dir: Path
    #: Inputs of ``input_shapes`` whose symbolic batch this case sets.
    symbolic_batch: tuple[str, ...] = ()
    #: The float32 model of the FLOAT32 row (None: only a quantized file was given).
    float_path: Path | None = None
    precision: str = "float32"

    @property
    def key(self) -> str:
        # An int8 model is another model: MetaSchedule's databases must not be shared.
        return f"{self.label}_{self.batch}" + ("_int8" if self.precision == "int8" else "")

    @property
    def title(self) -> str:
        return f"{self.label} b{self.batch}"


def _is_file_model(model: str) -> bool:
    return os.path.exists(model) or model.endswith(".onnx")


def _cases(cfg: BenchConfig) -> list[_Case]:
    """Resolve every model and batch, write models and inputs; fails before any worker runs."""
    for model in cfg.models:
        if not _is_file_model(model) and model not in models.names():
            raise ModelError(f"{model!r} is neither an ONNX file nor a bundled model; bundled: "
                             + ", ".join(models.names()))
    if cfg.shapes and not any(_is_file_model(m) for m in cfg.models):
        raise ModelError("input shapes apply to ONNX files; a bundled model takes a batch size")
    cases: dict[tuple[str, int], _Case] = {}
    for model in cfg.models:
        for batch in cfg.batches:
            shapes = None
            if _is_file_model(model):
                path = Path(model).resolve()
                proto = load_onnx(path)
                shapes = _batched_shapes(proto, batch, cfg.shapes)
                label = path.stem
            else:
                proto = models.load(model, batch=batch, seed=cfg.seed)
                path, label = None, model
            specs = input_specs(proto, shapes)
            actual = specs[0].shape[0] if specs and specs[0].shape else batch
            if (label, actual) in cases:
                continue  # a file with a static batch: once is enough
            run_dir = cfg.work_dir / "runs" / f"{label}_{actual}"
            (run_dir / "logs").mkdir(parents=True, exist_ok=True)
            if path is None:
                path = run_dir / "model.onnx"
                import onnx

                onnx.save(proto, str(path))
            np.savez(run_dir / "inputs.npz", **random_inputs(specs, seed=cfg.seed))
            model_path, float_path = path, path
            if cfg.precision == "int8":
                model_path, float_path = _int8_model(proto, path, run_dir, cfg.reduce_range)
            symbolic = tuple(n for n in shapes or {} if n not in cfg.shapes)
            cases[(label, actual)] = _Case(label, actual, model_path, shapes, run_dir,
                                           symbolic, float_path, cfg.precision)
    return list(cases.values())


def _int8_model(proto, path: Path, run_dir: Path, reduce_range: bool = False
                ) -> tuple[Path, Path | None]:
    """(the int8 model, the float32 one): ``path`` itself when it is quantized already (no
    float model then), else its QDQ quantization (7-bit weights with ``reduce_range``),
    cached in ``run_dir`` under a hash of the float model and the recipe (quantizing BERT
    takes a while; another seed or file is another model)."""
    if is_quantized(proto):
        return path, None
    recipe = RECIPE_REDUCED if reduce_range else RECIPE
    digest = hashlib.sha256(proto.SerializeToString() + recipe.encode()).hexdigest()[:16]
    quantized = run_dir / f"model.int8.{digest}.onnx"
    if not quantized.exists():
        # Written under another name first: an interrupted run leaves no half file behind.
        partial = run_dir / f"{quantized.name}.partial"
        quantize_static_qdq(proto, partial, reduce_range=reduce_range)
        partial.replace(quantized)
    return quantized, path


def _batched_shapes(proto, batch: int, given: Mapping[str, tuple[int, ...]]
                    ) -> dict[str, list[int]] | None:
    """Input shapes: those ``given``, and others with a symbolic leading dimension set to
    ``batch`` (their names: the shapes' keys not in ``given``)."""
    initializers = {i.name for i in proto.graph.initializer}
    shapes = {name: list(shape) for name, shape in given.items()}
    for value in proto.graph.input:
        dims = value.type.tensor_type.shape.dim
        if (value.name in initializers or value.name in given or not dims
                or dims[0].dim_value > 0):
            continue
        rest = [d.dim_value if d.dim_value > 0 else -1 for d in dims[1:]]
        if -1 in rest:
            return None  # more than the batch is symbolic: input_specs names the input
        shapes[value.name] = [batch, *rest]
    return shapes or None




@dataclass
class _Timed:
    """A live worker being timed and what it reported when prepared."""

    impl: str
    worker: Worker
    answer: dict[str, Any]
    plan: Plan
    rel_err: float | None
    abs_err: float | None
    problem: str | None
    ref_error: str | None = None
    samples: list[float] = field(default_factory=list)
    failure: str | None = None


def _check(outputs_path: Path, reference: list[np.ndarray] | None
           ) -> tuple[float | None, float | None, str | None]:
    """(normwise relative error, absolute error, problem) of a worker's outputs."""
    if reference is None:
        return None, None, None
    try:
        got = _outputs(outputs_path)
        abs_err, rel_err = max_errors(got, reference)
    except (OSError, KeyError, ValueError) as err:
        return None, None, f"outputs not comparable: {err}"
    if not (math.isfinite(rel_err) and math.isfinite(abs_err)):
        return None, None, "non-finite outputs"
    return rel_err, abs_err, None


def _outputs(path: Path) -> list[np.ndarray]:
    with np.load(path) as stored:
        return [stored[f"out{i}"] for i in range(len(stored.files))]


def _workload(case: _Case, impl: str, float_model: bool = False) -> ModelWorkload:
    """``impl``'s workload: the case's model, or with ``float_model`` its float32 one."""
    model, name = (case.float_path, f"{impl}-float32") if float_model else (case.model_path, impl)
    return ModelWorkload(str(model), str(case.run_dir / "inputs.npz"),
                         str(case.run_dir / f"{name}.npz"), case.key, case.input_shapes,
                         case.symbolic_batch)


def _start(cfg: BenchConfig, case: _Case, impl: str, float_model: bool = False,
           ms_budget: float | None = None) -> Worker:
    float_model = float_model or impl == FLOAT32
    job = Job(impl, cfg.threads, str(cfg.work_dir), (_workload(case, impl, float_model),),
              seed=cfg.seed, ms_trials=cfg.ms_trials, ms_budget=ms_budget,
              precision="float32" if float_model else cfg.precision)
    log = f"{impl}{'-float32' if float_model and impl != FLOAT32 else ''}.log"
    return start_worker(cfg.worker_command, job, case.run_dir / "logs" / log)


def _setup(cfg: BenchConfig, case: _Case, worker: Worker, progress: Progress, impl: str
           ) -> dict[str, Any]:
    """The worker's ``prepared`` message (killing it if it fails to send one)."""

    def on_step(index: int, step: str) -> None:
        progress.say(f"{case.title}: {impl}: {step}")

    try:
        (answer,) = prepared(worker, cfg.timeout, on_step)
    except WorkerError:
        worker.close()
        raise
    except BaseException:  # e.g. Ctrl-C while it builds: leave no orphan behind
        worker.kill()
        worker.close()
        raise
    return answer


def _reference(cfg: BenchConfig, case: _Case, progress: Progress, float_model: bool = False
               ) -> tuple[list[np.ndarray] | None, str | None]:
    """ONNX Runtime's outputs (on the float32 model with ``float_model``), computed in a
    worker of their own."""
    worker = _start(cfg, case, REFERENCE, float_model)
    try:
        answer = _setup(cfg, case, worker, progress, REFERENCE)
    except WorkerError as err:
        return None, str(err)
    worker.close()
    if not answer.get("ok"):
        return None, answer.get("error", "failed")
    return _outputs(Path(_workload(case, REFERENCE, float_model).outputs)), None


def _bench_case(cfg: BenchConfig, case: _Case, progress: Progress) -> list[Row]:
    base = {"model": case.label, "batch": case.batch, "threads": cfg.threads}
    progress.say(f"{case.title}: ONNX Runtime reference")
    references = {False: _reference(cfg, case, progress)}
    if FLOAT32 in cfg.compared and case.float_path != case.model_path:
        references[True] = ((None, "no float32 model: the file given is quantized")
                            if case.float_path is None else _reference(cfg, case, progress, True))
    progress.say(f"{case.title}: reference done", advance=1)
    rows: dict[str, Row] = {}
    live: list[_Timed] = []
    tpp_search: float | None = None  # tpp-tuned's, for the time-matched MetaSchedule rows
    try:
        for impl in cfg.compared:
            reference, ref_error = references.get(impl == FLOAT32, references[False])
            if impl == FLOAT32 and case.float_path is None:
                rows[impl] = Row(**base, impl=impl, status="skipped", error=ref_error)
                continue
            if impl in _impls.TIME_MATCHED and tpp_search is None:
                rows[impl] = Row(**base, impl=impl, status="skipped",
                                 error="no tuning time of tpp-tuned to match (its row failed)")
                continue
            progress.say(f"{case.title}: building {impl}")
            worker = _start(cfg, case, impl, ms_budget=tpp_search if impl in _impls.TIME_MATCHED
                            else None)
            try:
                answer = _setup(cfg, case, worker, progress, impl)
            except WorkerError as err:
                rows[impl] = Row(**base, impl=impl, status="error", error=str(err))
                continue
            finally:
                progress.say(f"{case.title}: built {impl}", advance=1)
            if not answer.get("ok"):
                worker.close()
                skipped = "skipped" in answer
                rows[impl] = Row(**base, impl=impl, status="skipped" if skipped else "error",
                                 error=answer.get("skipped") or answer.get("error", "failed"))
                continue
            run_seconds = answer.get("run_seconds")
            if not isinstance(run_seconds, (int, float)) or not run_seconds >= 0:
                worker.kill()
                worker.close()
                rows[impl] = Row(**base, impl=impl, status="error",
                                 error=f"worker reported no run time: {answer}")
                continue
            if impl == "tpp-tuned" and isinstance(answer.get("search_seconds"), (int, float)):
                tpp_search = float(answer["search_seconds"])
            outputs = Path(_workload(case, impl, impl == FLOAT32).outputs)
            rel, abs_, problem = _check(outputs, reference)
            live.append(_Timed(impl, worker, answer, cfg.sampling.plan(float(run_seconds)),
                               rel, abs_, problem, ref_error))
        _time_round_robin(cfg, case, live, progress)
    except BaseException:  # Ctrl-C or a bug: do not wait for busy workers to finish a sample
        for timed in live:
            timed.worker.kill()
        raise
    finally:
        for timed in live:
            timed.worker.close()
    for timed in live:
        rows[timed.impl] = _timed_row(base, timed)
    return [rows[impl] for impl in cfg.compared]


def _time_round_robin(cfg: BenchConfig, case: _Case, live: list[_Timed],
                      progress: Progress) -> None:
    """One sample per live worker per round, in :func:`turn_order`, until each has its own."""
    task = progress.add(f"{case.title}: timing", sum(t.plan.samples for t in live))
    for round_ in range(max((t.plan.samples for t in live), default=0)):
        for timed in turn_order(live, round_):
            if timed.failure is not None or round_ >= timed.plan.samples:
                continue
            time.sleep(cfg.pause)
            number, _, warmup = timed.plan
            expected = number * float(timed.answer["run_seconds"]) * (2 if warmup else 1)
            try:
                (seconds,) = measure(timed.worker, 0, Plan(number, 1, warmup),
                                     timeout=max(120.0, 10 * expected))
            except TimingError as err:
                timed.failure = str(err)
                timed.worker.kill()
                continue
            except WorkerError as err:
                timed.failure = str(err)
                continue
            timed.samples.append(seconds)
            progress.tick(task)


def _timed_row(base: Mapping[str, Any], timed: _Timed) -> Row:
    answer = timed.answer
    common = dict(base, impl=timed.impl, compile_seconds=answer.get("compile_seconds"),
                  tune_seconds=answer.get("tune_seconds"), max_rel_err=timed.rel_err,
                  max_abs_err=timed.abs_err, runs_per_sample=timed.plan.number,
                  target=answer.get("target") or None, notes=answer.get("notes") or None)
    if timed.failure is not None:
        return Row(**common, status="error", error=f"during timing: {timed.failure}",
                   samples=len(timed.samples))
    ms = np.asarray(timed.samples) * 1e3
    stats = {"median_ms": float(np.median(ms)), "p10_ms": float(np.percentile(ms, 10)),
             "p90_ms": float(np.percentile(ms, 90)), "samples": len(ms)}
    if timed.problem is not None:
        return Row(**common, **stats, status="WRONG", error=timed.problem)
    if timed.ref_error is not None:
        return Row(**common, **stats, status="unchecked",
                   error=f"no reference: {timed.ref_error}")
    return Row(**common, **stats)


def _limit(row: Row, tolerance: float) -> float:
    """``row``'s tolerance: :data:`TOLERANCE` for the :data:`FLOAT32` row; for a
    :data:`SELF_CHOSEN` row whose notes say it ran in a lower precision, the larger of
    ``tolerance`` and that precision's; else ``tolerance``.

    Examples
    --------
    >>> _limit(Row("m", 1, 2, "openvino", notes="bf16: OpenVINO's defaults"), 1e-4)
    0.02
    >>> _limit(Row("m", 1, 2, "openvino-f32", notes="float32: f32 hint"), 1e-4)
    0.0001
    """
    if row.impl == FLOAT32:
        return TOLERANCE
    ran = (row.notes or "").partition(":")[0]
    if row.impl in SELF_CHOSEN and ran in TOLERANCES:
        return max(tolerance, TOLERANCES[ran])
    return tolerance


def judge(rows: Sequence[Row], tolerance: float = TOLERANCE) -> list[Row]:
    """Flag rows over ``tolerance`` as WRONG, then rank the correct ones against the baselines.

    Only ``ok`` rows get speedups, and only against baselines that are ``ok`` themselves.
    The :data:`FLOAT32` row is a float32 build whatever the run's precision: its tolerance is
    :data:`TOLERANCE`; an OpenVINO row that chose bf16 itself gets bf16's (:func:`_limit`).

    Examples
    --------
    >>> rows = [Row("m", 1, 2, "tpp", median_ms=1.0, max_rel_err=1e-6),
    ...         Row("m", 1, 2, "onnxruntime", median_ms=2.0, max_rel_err=0.0)]
    >>> judge(rows)[0].speedup
    {'onnxruntime': 2.0}
    """
    flagged = []
    for row in rows:
        if row.status == "ok" and row.max_rel_err is None:
            row = replace(row, status="unchecked", error=row.error or "no error measured")
        elif row.status == "ok" and not row.max_rel_err <= (limit := _limit(row, tolerance)):
            row = replace(row, status="WRONG",
                          error=f"max rel err {row.max_rel_err:.2e} > tolerance {limit:g}")
        flagged.append(row)
    ranked = []
    for row in flagged:
        speedup = {}
        if row.status == "ok" and row.median_ms:
            for other in flagged:
                if (other.impl in BASELINES and other.status == "ok" and other.median_ms
                        and (other.model, other.batch) == (row.model, row.batch)):
                    speedup[other.impl] = other.median_ms / row.median_ms
        ordered = {b: speedup[b] for b in BASELINES if b in speedup}
        ranked.append(replace(row, speedup=ordered))
    return ranked


def run_bench(cfg: BenchConfig, progress: bool = True) -> list[Row]:
    """Benchmark every model, batch and implementation of ``cfg``; rows judged and ranked."""
    cases = _cases(cfg)
    rows: list[Row] = []
    with Progress(progress, total=len(cases) * (1 + len(cfg.compared))) as bar:
        for case in cases:
            rows += _bench_case(cfg, case, bar)
        bar.say("done")
    return judge(rows, cfg.tolerance)

