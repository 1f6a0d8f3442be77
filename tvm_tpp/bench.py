"""``tvm-tpp bench``: TPP against TVM's own build, MetaSchedule and ONNX Runtime, fairly.

The rules that keep the comparison fair:

- every implementation builds and runs in its own worker process
  (:mod:`tvm_tpp.bench_worker`), because thread pools sharing a process disturb each other;
- all use the same number of threads and the same seeded inputs;
- after a warm-up, timed samples alternate round-robin between the live workers (one sample
  per worker per round, starting with a different worker each round), so drift of the
  machine hits all alike; the median, p10 and p90 of the samples are reported;
- every output is checked against ONNX Runtime; a row whose normwise relative error exceeds
  the tolerance is ``WRONG`` and is not ranked;
- compile and tuning seconds are reported apart from latency.

A worker that crashes, fails or times out becomes a row with the reason; the bench goes on.
This module itself never imports TVM or ONNX Runtime.

Examples
--------
>>> cfg = BenchConfig(models=("mlp",), impls=("tpp", "onnxruntime"), repeat=5)  # doctest: +SKIP
>>> rows = run_bench(cfg)                                                        # doctest: +SKIP
>>> print_report(rows, cfg)                                                      # doctest: +SKIP
>>> write_json("bench.json", rows, cfg); plot(rows, "bench.png")                 # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import IO, Any

import numpy as np

from microkernels import isa as _isa

from . import models
from .bench_worker import IMPLS, REFERENCE, Job
from .onnx_import import input_specs, load_onnx
from .reference import max_errors, random_inputs
from .workers import Worker, WorkerError, turn_order

__all__ = [
    "BASELINES",
    "IMPLS",
    "STATUSES",
    "TOLERANCE",
    "BenchConfig",
    "Row",
    "default_work_dir",
    "format_table",
    "host_info",
    "judge",
    "plan_timing",
    "plot",
    "print_report",
    "run_bench",
    "to_json",
    "write_json",
]

#: Implementations every other row's speedup is given against, when they were benchmarked.
BASELINES = ("tvm-default", "metaschedule", "onnxruntime")
#: ``ok``; ``WRONG`` (over tolerance); ``error`` (crash, failure, time-out); ``skipped``
#: (not available here); ``unchecked`` (ONNX Runtime could not produce a reference).
STATUSES = ("ok", "WRONG", "error", "skipped", "unchecked")
#: Largest normwise relative error against ONNX Runtime that still counts as correct.
TOLERANCE = 1e-4
# Flags that tell which SIMD units a CPU has (x86 and Arm spellings); "smep" is not Arm SME.
_SIMD_PREFIXES = ("avx", "fma", "amx", "f16c", "asimd", "sve", "sme", "bf16", "i8mm", "fphp")
_NOT_SIMD = frozenset({"smep"})
# Implementations whose worker notes (offload counts, tuning budget, database) are footnoted.
_NOTED = ("tpp", "tpp-tuned", "metaschedule")
# At most this many back-to-back runs in one timed sample.
_MAX_NUMBER = 10_000


def default_work_dir() -> Path:
    """Where models, logs and tuning databases go unless ``--work-dir`` says otherwise."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "tvm-tpp" / "bench"


def _worker_command() -> tuple[str, ...]:
    return (sys.executable, "-m", "tvm_tpp.bench_worker")


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
        Implementations, a subset of :data:`IMPLS`.
    ms_trials
        MetaSchedule's total trial budget, split evenly over the model's tasks.
    work_dir
        Models, inputs, outputs, worker logs and tuning databases.
    seed
        Seed of the weights of bundled models, of the inputs and of MetaSchedule.
    tolerance
        Largest normwise relative error against ONNX Runtime that counts as correct.
    timeout
        Seconds a worker may take to build (and tune) before it is killed.
    sample_seconds
        Target length of one timed sample: fast models run back to back until it is reached.
    slow_seconds, slow_budget
        Runs longer than ``slow_seconds`` get no warm-up and only about
        ``slow_budget / run`` samples (at least 3, at most ``repeat``).
    pause
        Seconds of quiet before each sample, so spinning threads of the previous worker park
        (50 ms was not enough here: whichever implementation followed a TVM worker measured
        up to 2x slower, and identical programs differed by that much).
    worker_command
        The worker's command line; the job's JSON is appended.

    Examples
    --------
    >>> BenchConfig(models=("mlp",), impls=("tpp", "onnxruntime")).batches
    (1,)
    """

    models: tuple[str, ...]
    batches: tuple[int, ...] = (1,)
    threads: int = field(default_factory=_isa.num_cores)
    repeat: int = 10
    impls: tuple[str, ...] = IMPLS
    ms_trials: int = 64
    work_dir: Path = field(default_factory=default_work_dir)
    seed: int = 0
    tolerance: float = TOLERANCE
    timeout: float = 3600.0
    sample_seconds: float = 0.05
    slow_seconds: float = 1.0
    slow_budget: float = 30.0
    pause: float = 0.3
    worker_command: tuple[str, ...] = field(default_factory=_worker_command)

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))
        object.__setattr__(self, "batches", tuple(self.batches))
        object.__setattr__(self, "impls", tuple(self.impls))
        object.__setattr__(self, "work_dir", Path(self.work_dir))
        object.__setattr__(self, "worker_command", tuple(self.worker_command))
        if not self.models:
            raise ValueError("give at least one model (bundled name or ONNX file)")
        unknown = [i for i in self.impls if i not in IMPLS]
        if unknown or not self.impls or len(set(self.impls)) != len(self.impls):
            raise ValueError(f"implementations must be distinct names from {', '.join(IMPLS)}; "
                             f"got {', '.join(self.impls) or 'none'}")
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

    def command_line(self) -> str:
        """The ``tvm-tpp bench`` command that reproduces this configuration."""
        words = ["tvm-tpp", "bench", *self.models,
                 "--batch", ",".join(map(str, self.batches)), "--threads", str(self.threads),
                 "--repeat", str(self.repeat), "--impls", ",".join(self.impls),
                 "--ms-trials", str(self.ms_trials), "--work-dir", str(self.work_dir),
                 "--seed", str(self.seed), "--timeout", f"{self.timeout:g}"]
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


def plan_timing(run_seconds: float, cfg: BenchConfig) -> tuple[int, int, bool]:
    """(runs per sample, samples, warm-up before each sample) for a run of ``run_seconds``.

    Examples
    --------
    >>> cfg = BenchConfig(models=("mlp",), repeat=10)
    >>> plan_timing(0.001, cfg), plan_timing(12.0, cfg)
    ((50, 10, True), (1, 3, False))
    """
    if run_seconds > cfg.slow_seconds:
        fitting = int(cfg.slow_budget / run_seconds)
        return 1, max(min(cfg.repeat, 3), min(cfg.repeat, fitting)), False
    number = math.ceil(cfg.sample_seconds / max(run_seconds, 1e-9))
    return max(1, min(_MAX_NUMBER, number)), cfg.repeat, True


@dataclass(frozen=True)
class _Case:
    """One model at one batch size, with its files."""

    label: str
    batch: int
    model_path: Path
    input_shapes: dict[str, list[int]] | None
    run_dir: Path

    @property
    def key(self) -> str:
        return f"{self.label}_{self.batch}"

    @property
    def title(self) -> str:
        return f"{self.label} b{self.batch}"


def _is_file_model(model: str) -> bool:
    return os.path.exists(model) or model.endswith(".onnx")


def _cases(cfg: BenchConfig) -> list[_Case]:
    """Resolve every model and batch, write models and inputs; fails before any worker runs."""
    for model in cfg.models:
        if not _is_file_model(model) and model not in models.names():
            raise ValueError(f"{model!r} is neither an ONNX file nor a bundled model; bundled: "
                             + ", ".join(models.names()))
    cases: dict[tuple[str, int], _Case] = {}
    for model in cfg.models:
        for batch in cfg.batches:
            shapes = None
            if _is_file_model(model):
                path = Path(model).resolve()
                proto = load_onnx(path)
                shapes = _batched_shapes(proto, batch)
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
            cases[(label, actual)] = _Case(label, actual, path, shapes, run_dir)
    return list(cases.values())


def _batched_shapes(proto, batch: int) -> dict[str, list[int]] | None:
    """Input shapes with a symbolic leading dimension set to ``batch``."""
    initializers = {i.name for i in proto.graph.initializer}
    shapes = {}
    for value in proto.graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name in initializers or not dims or dims[0].dim_value > 0:
            continue
        rest = [d.dim_value if d.dim_value > 0 else -1 for d in dims[1:]]
        if -1 in rest:
            return None  # more than the batch is symbolic: input_specs names the input
        shapes[value.name] = [batch, *rest]
    return shapes or None


def _start_worker(cfg: BenchConfig, job: Job, log_path: Path) -> Worker:
    """Start ``job``'s worker with the thread-count variables set."""
    threads = str(job.threads)
    # TVM sizes its pool from TVM_NUM_THREADS when its runtime starts; OpenMP kernels
    # follow OMP_NUM_THREADS; numpy's BLAS is not timed and must not spin beside them.
    env = {"TVM_NUM_THREADS": threads, "OMP_NUM_THREADS": threads,
           "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return Worker([*cfg.worker_command, job.to_json()], log_path, env)


@dataclass
class _Timed:
    """A live worker being timed and what it reported at setup."""

    impl: str
    worker: Worker
    answer: dict[str, Any]
    number: int
    repeats: int
    warmup: bool
    rel_err: float | None
    abs_err: float | None
    problem: str | None
    samples: list[float] = field(default_factory=list)
    failure: str | None = None


class _Progress:
    """A rich progress display on stderr (silent when disabled or rich is missing)."""

    def __init__(self, enabled: bool, steps: int) -> None:
        self._bar = None
        if not enabled:
            return
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )
        except ImportError:
            return
        # One refresh a second: the display thread must not compete with the timed workers.
        self._bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                             MofNCompleteColumn(), TimeElapsedColumn(),
                             console=Console(stderr=True), refresh_per_second=1)
        self._steps = self._bar.add_task("starting", total=steps)

    @contextmanager
    def shown(self) -> Iterator[_Progress]:
        if self._bar is None:
            yield self
            return
        with self._bar:
            yield self

    def step(self, text: str, advance: int = 0) -> None:
        if self._bar is not None:
            self._bar.update(self._steps, description=text, advance=advance)

    def timing(self, text: str, total: int) -> Any:
        return None if self._bar is None else self._bar.add_task(text, total=total)

    def tick(self, task: Any) -> None:
        if self._bar is not None and task is not None:
            self._bar.advance(task)


def _check(outputs_path: Path, reference: list[np.ndarray] | None
           ) -> tuple[float | None, float | None, str | None]:
    """(normwise relative error, absolute error, problem) of a worker's outputs."""
    if reference is None:
        return None, None, None
    try:
        with np.load(outputs_path) as stored:
            got = [stored[f"out{i}"] for i in range(len(stored.files))]
        abs_err, rel_err = max_errors(got, reference)
    except (OSError, KeyError, ValueError) as err:
        return None, None, f"outputs not comparable: {err}"
    if not (math.isfinite(rel_err) and math.isfinite(abs_err)):
        return None, None, "non-finite outputs"
    return rel_err, abs_err, None


def _job(cfg: BenchConfig, case: _Case, impl: str) -> Job:
    databases = {"metaschedule": "ms", "tpp-tuned": "tpp"}
    work_dir = cfg.work_dir / databases.get(impl, "runs") / case.key
    return Job(impl=impl, model=str(case.model_path), inputs=str(case.run_dir / "inputs.npz"),
               outputs=str(case.run_dir / f"{impl}.npz"), threads=cfg.threads,
               work_dir=str(work_dir), input_shapes=case.input_shapes,
               ms_trials=cfg.ms_trials, seed=cfg.seed)


def _reference(cfg: BenchConfig, case: _Case) -> tuple[list[np.ndarray] | None, str | None]:
    """ONNX Runtime's outputs, computed in a worker of their own."""
    job = _job(cfg, case, REFERENCE)
    worker = _start_worker(cfg, job, case.run_dir / "logs" / f"{REFERENCE}.log")
    try:
        answer = worker.receive(cfg.timeout)
    except WorkerError as err:
        return None, str(err)
    finally:
        worker.close()
    if not answer.get("ok"):
        return None, answer.get("error", "failed")
    with np.load(job.outputs) as stored:
        return [stored[f"out{i}"] for i in range(len(stored.files))], None


def _bench_case(cfg: BenchConfig, case: _Case, progress: _Progress) -> list[Row]:
    base = {"model": case.label, "batch": case.batch, "threads": cfg.threads}
    progress.step(f"{case.title}: ONNX Runtime reference")
    reference, ref_error = _reference(cfg, case)
    progress.step(f"{case.title}: reference done", advance=1)
    rows: dict[str, Row] = {}
    live: list[_Timed] = []
    try:
        for impl in cfg.impls:
            progress.step(f"{case.title}: building {impl}")
            worker = _start_worker(cfg, _job(cfg, case, impl),
                             case.run_dir / "logs" / f"{impl}.log")
            try:
                answer = worker.receive(cfg.timeout)
            except WorkerError as err:
                worker.close()
                rows[impl] = Row(**base, impl=impl, status="error", error=str(err))
                continue
            except BaseException:  # e.g. Ctrl-C while it builds: leave no orphan behind
                worker.kill()
                worker.close()
                raise
            finally:
                progress.step(f"{case.title}: built {impl}", advance=1)
            if "skipped" in answer or not answer.get("ok"):
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
            rel, abs_, problem = _check(Path(_job(cfg, case, impl).outputs), reference)
            number, repeats, warmup = plan_timing(float(run_seconds), cfg)
            live.append(_Timed(impl, worker, answer, number, repeats, warmup, rel, abs_, problem))
        _time_round_robin(cfg, case, live, progress)
    except BaseException:  # Ctrl-C or a bug: do not wait for busy workers to finish a sample
        for timed in live:
            timed.worker.kill()
        raise
    finally:
        for timed in live:
            timed.worker.close()
    for timed in live:
        rows[timed.impl] = _timed_row(base, timed, ref_error)
    return [rows[impl] for impl in cfg.impls]


def _time_round_robin(cfg: BenchConfig, case: _Case, live: list[_Timed],
                      progress: _Progress) -> None:
    task = progress.timing(f"{case.title}: timing", sum(t.repeats for t in live))
    for round_ in range(max((t.repeats for t in live), default=0)):
        for timed in turn_order(live, round_):
            if timed.failure is not None or round_ >= timed.repeats:
                continue
            time.sleep(cfg.pause)
            expected = timed.number * float(timed.answer["run_seconds"]) * (2 if timed.warmup
                                                                            else 1)
            try:
                reply = timed.worker.request({"number": timed.number, "warmup": timed.warmup},
                                             timeout=max(120.0, 10 * expected))
            except WorkerError as err:
                timed.failure = str(err)
                continue
            if not reply.get("ok") or reply.get("seconds") is None:
                timed.failure = reply.get("error") or "no time measured"
                timed.worker.kill()
                continue
            timed.samples.append(float(reply["seconds"]))
            progress.tick(task)


def _timed_row(base: Mapping[str, Any], timed: _Timed, ref_error: str | None) -> Row:
    answer = timed.answer
    common = dict(base, impl=timed.impl, compile_seconds=answer.get("compile_seconds"),
                  tune_seconds=answer.get("tune_seconds"), max_rel_err=timed.rel_err,
                  max_abs_err=timed.abs_err, runs_per_sample=timed.number,
                  target=answer.get("target") or None, notes=answer.get("notes") or None)
    if timed.failure is not None:
        return Row(**common, status="error", error=f"during timing: {timed.failure}",
                   samples=len(timed.samples))
    ms = np.asarray(timed.samples) * 1e3
    stats = {"median_ms": float(np.median(ms)), "p10_ms": float(np.percentile(ms, 10)),
             "p90_ms": float(np.percentile(ms, 90)), "samples": len(ms)}
    if timed.problem is not None:
        return Row(**common, **stats, status="WRONG", error=timed.problem)
    if ref_error is not None:
        return Row(**common, **stats, status="unchecked", error=f"no reference: {ref_error}")
    return Row(**common, **stats)


def judge(rows: Sequence[Row], tolerance: float = TOLERANCE) -> list[Row]:
    """Flag rows over ``tolerance`` as WRONG, then rank the correct ones against the baselines.

    Only ``ok`` rows get speedups, and only against baselines that are ``ok`` themselves.

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
        elif row.status == "ok" and not row.max_rel_err <= tolerance:
            row = replace(row, status="WRONG",
                          error=f"max rel err {row.max_rel_err:.2e} > tolerance {tolerance:g}")
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
    bar = _Progress(progress, steps=len(cases) * (1 + len(cfg.impls)))
    rows: list[Row] = []
    with bar.shown():
        for case in cases:
            rows += _bench_case(cfg, case, bar)
        bar.step("done")
    return judge(rows, cfg.tolerance)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model name", "Hardware") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def host_info() -> dict[str, Any]:
    """The machine and software versions the numbers belong to."""
    flags = sorted(f for f in _isa.host_flags()
                   if f.startswith(_SIMD_PREFIXES) and f not in _NOT_SIMD)
    return {
        "cpu": _cpu_name(),
        "arch": platform.machine(),
        "simd_flags": flags,
        "cores": _isa.num_cores(),
        "logical_cpus": os.cpu_count(),
        "tvm_version": _version("apache-tvm"),
        "tvm_ffi_version": _version("apache-tvm-ffi"),
        "ort_version": _version("onnxruntime"),
        "onnx_version": _version("onnx"),
        "numpy_version": _version("numpy"),
        "python": platform.python_version(),
        "os": platform.platform(),
    }


def to_json(rows: Sequence[Row], cfg: BenchConfig, wall_seconds: float | None = None
            ) -> dict[str, Any]:
    """The JSON document ``--json`` writes."""
    return {
        "command": cfg.command_line(),
        "host": host_info(),
        "settings": {"threads": cfg.threads, "repeat": cfg.repeat, "impls": list(cfg.impls),
                     "batches": list(cfg.batches), "ms_trials": cfg.ms_trials,
                     "tolerance": cfg.tolerance, "seed": cfg.seed,
                     "work_dir": str(cfg.work_dir)},
        "wall_seconds": wall_seconds,
        "rows": [asdict(row) for row in rows],
    }


def write_json(path: str | os.PathLike, rows: Sequence[Row], cfg: BenchConfig,
               wall_seconds: float | None = None) -> Path:
    path = Path(path)
    path.write_text(json.dumps(to_json(rows, cfg, wall_seconds), indent=1) + "\n")
    return path


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _table(rows: Sequence[Row], cfg: BenchConfig) -> tuple[list[str], list[list[str]],
                                                           list[str]]:
    """Header, cells (one list per row) and footnotes of the report."""
    baselines = [b for b in BASELINES if b in cfg.impls]
    header = ["model", "batch", "impl", "median ms", "p10-p90 ms", "samples",
              *[f"x {b}" for b in baselines], "compile s", "tune s", "rel err", "status"]
    cells, notes = [], []
    for row in rows:
        spread = "-" if row.p10_ms is None else f"{_ms(row.p10_ms)}-{_ms(row.p90_ms)}"
        runs = f"{row.samples}x{row.runs_per_sample}" if row.samples else "-"
        speed = [f"{row.speedup[b]:.2f}x" if b in row.speedup else "-" for b in baselines]
        err = "-" if row.max_rel_err is None else f"{row.max_rel_err:.1e}"
        cells.append([row.model, str(row.batch), row.impl, _ms(row.median_ms), spread, runs,
                      *speed, _seconds(row.compile_seconds), _seconds(row.tune_seconds), err,
                      row.status])
        if row.error:
            notes.append(f"{row.model} b{row.batch} {row.impl} [{row.status}]: {row.error}")
        if row.notes and row.impl in _NOTED:
            notes.append(f"{row.model} b{row.batch} {row.impl}: {row.notes}")
    footnotes = [
        f"{cfg.threads} threads for every implementation (TVM_NUM_THREADS, ONNX Runtime "
        "intra-op threads), each in its own process; samples alternate round-robin.",
        "median/p10-p90 over `samples` timed samples, each the mean of `x` back-to-back runs "
        "after one warm-up run (runs over "
        f"{cfg.slow_seconds:g} s: fewer samples, no warm-up).",
        "x B = median of B / median of this row (> 1: faster than B); rows with normwise "
        f"relative error vs ONNX Runtime over {cfg.tolerance:g} are WRONG and unranked.",
        "compile s = ONNX import + build; tune s = search time, apart from latency.",
        *notes,
    ]
    return header, cells, footnotes


def format_table(rows: Sequence[Row], cfg: BenchConfig) -> str:
    """The report as plain text (aligned columns, then footnotes)."""
    header, cells, footnotes = _table(rows, cfg)
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(header))]
    left = {"model", "impl", "status"}

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if h in left else v.rjust(w)
                         for v, w, h in zip(values, widths, header, strict=True)).rstrip()

    rule = "-" * len(line(header))
    return "\n".join([line(header), rule, *map(line, cells), rule, *footnotes])


def print_report(rows: Sequence[Row], cfg: BenchConfig, wall_seconds: float | None = None,
                 file: IO[str] | None = None) -> None:
    """Print the table with rich when it is installed, else as plain text."""
    file = file or sys.stdout
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_table(rows, cfg), file=file)
        if wall_seconds is not None:
            print(f"wall time {wall_seconds:.0f} s", file=file)
        return
    header, cells, footnotes = _table(rows, cfg)
    title = "tvm-tpp bench" + (f" ({wall_seconds:.0f} s)" if wall_seconds is not None else "")
    table = Table(title=title)
    for name in header:
        table.add_column(name, justify="left" if name in ("model", "impl", "status")
                         else "right")
    styles = {"ok": "green", "WRONG": "bold red", "error": "red", "skipped": "yellow",
              "unchecked": "yellow"}
    previous = None
    for row, values in zip(rows, cells, strict=True):
        if previous is not None and (row.model, row.batch) != previous:
            table.add_section()
        previous = (row.model, row.batch)
        table.add_row(*values[:-1], f"[{styles[row.status]}]{values[-1]}[/]")
    console = Console(file=file)
    if not console.is_terminal:  # a file or pipe: as wide as the table, never truncated
        widths = [max(len(v) for v in column) for column in zip(header, *cells, strict=True)]
        console = Console(file=file, width=sum(widths) + 3 * len(widths) + 1)
    console.print(table)
    for note in footnotes:
        console.print(note, style="dim", highlight=False, markup=False)


def plot(rows: Sequence[Row], path: str | os.PathLike) -> Path:
    """Bar charts of speedups against each baseline, and build cost against latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    path = Path(path)
    ok = [r for r in rows if r.status == "ok" and r.median_ms]
    cases = list(dict.fromkeys((r.model, r.batch) for r in rows))
    baselines = [b for b in BASELINES if any(r.impl == b for r in ok)]
    fig, axes = plt.subplots(1, len(baselines) + 1, figsize=(5.5 * (len(baselines) + 1), 4.5),
                             squeeze=False)
    colours = {impl: f"C{i}" for i, impl in enumerate(IMPLS)}
    labels = [f"{m}\nb{b}" for m, b in cases]
    for ax, baseline in zip(axes[0], baselines, strict=False):
        impls = [i for i in IMPLS if i != baseline and any(r.impl == i for r in ok)]
        width = 0.8 / max(len(impls), 1)
        for j, impl in enumerate(impls):
            found = {(r.model, r.batch): r.speedup.get(baseline) for r in ok if r.impl == impl}
            heights = [found.get(case) or np.nan for case in cases]
            bars = ax.bar(np.arange(len(cases)) + (j - (len(impls) - 1) / 2) * width, heights,
                          width, label=impl, color=colours[impl])
            ax.bar_label(bars, fmt="%.2g", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(np.arange(len(cases)), labels)
        ax.set_ylabel(f"speedup over {baseline} (log)")
        ax.set_title(f"vs {baseline} (higher is better)")
        if impls:
            ax.legend(fontsize="small")
    scatter = axes[0][-1]
    for impl in IMPLS:
        mine = [r for r in ok if r.impl == impl]
        if not mine:
            continue
        cost = [max((r.compile_seconds or 0) + (r.tune_seconds or 0), 1e-2) for r in mine]
        scatter.scatter(cost, [r.median_ms for r in mine], label=impl, color=colours[impl])
        for x, r in zip(cost, mine, strict=True):
            scatter.annotate(f"{r.model} b{r.batch}", (x, r.median_ms), fontsize=7,
                             textcoords="offset points", xytext=(3, 3))
    scatter.set_xscale("log")
    scatter.set_yscale("log")
    scatter.set_xlabel("compile + tune seconds (log)")
    scatter.set_ylabel("median latency ms (log)")
    scatter.set_title("build cost vs latency (lower left is better)")
    if ok:
        scatter.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
