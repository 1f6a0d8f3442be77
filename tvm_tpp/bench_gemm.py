"""``tvm-tpp bench-gemm``: fp32 GEMM throughput of the TPP schedules against baselines.

``Y[M, N] = X[M, K] @ W[K, N]`` in float32, for each shape and thread count, by:

- ``tpp`` — the loop_spec template with the default heuristic configuration
  (:func:`schedules.blocking.default_config`);
- ``tpp-tuned`` — the configuration :func:`schedules.tuner.tune` picks, with its JSON
  database in the work directory (a warm database is reused; its recorded tuning time is shown);
- ``numpy`` — ``np.matmul`` (the BLAS numpy links, OpenBLAS for the wheels);
- ``tvm-default`` — the plain TE matmul built by TVM without a schedule (naive loops; shapes
  whose single run would exceed ``--tvm-default-limit`` seconds (default 5), predicted from a
  run on a few rows, are skipped and say so);
- ``metaschedule`` — TVM's default MetaSchedule space on the plain matmul, ``--ms-trials``
  trials, one database per shape and thread count in the work directory (reused when warm).

Each implementation runs in a persistent worker process of its own (``python -m
tvm_tpp.bench_gemm JOB``, protocol in :func:`run_bench`), with ``TVM_NUM_THREADS``,
``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` set to the thread count
before anything loads: TVM's and OpenBLAS's thread pools disturb each other in one process.
Per thread count:

1. preparation, one worker after another (never overlapping another's work): the worker
   builds every shape (``tpp-tuned`` and ``metaschedule`` tune first), checks it against
   numpy in float64 (``max_abs_err``) and keeps it, operands included, in memory;
2. the single-core fp32 FMA peak is measured by :mod:`microkernels.peak` in a one-shot
   worker (the fastest over the thread counts is kept);
3. timing, shape by shape: ``--rounds`` rounds (default 5) in which every worker that
   prepared the shape is asked, in turn, for one measurement, after a 0.3 s pause (idle TVM
   and OpenBLAS threads spin after a run); who goes first rotates each round and the order
   reverses every other round.  ``tvm-default``, a hundred times slower than the rest, is
   timed in the first round only.

Alternating sample batch by sample batch means a minute of load from elsewhere hits every
implementation alike instead of deciding the comparison: a row's GFLOPS is its best round
(each round's figure is in ``gflops_rounds``; an error row has none).  A measurement is the
fastest of short samples (each at least 1 ms, as many as fit in about 0.4 s, at least
``--repeat`` unless that exceeds 10 s, at most 200; TVM's ``time_evaluator``, a Python loop
for numpy), since interference only slows a run down.  Pre-packing the weights for ``tpp``
(``Wp[N/bn, K, bn]``) is outside the timing, as for a model's constant weights.  A worker
that dies or times out gives error rows for the shapes it did not finish.
``fraction_of_peak`` divides by ``threads x`` the peak.  The 1-minute load average before and
after the run is reported: a loaded machine distorts 2-thread numbers most.

Examples
--------
$ tvm-tpp bench-gemm --threads 1,2 --against numpy,tvm-default --json gemm.json
$ tvm-tpp bench-gemm --shapes 512x512x512 --against metaschedule --ms-trials 64 --explain
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from .workers import Worker, WorkerError, turn_order

__all__ = [
    "IMPLS",
    "BASELINES",
    "DEFAULT_SHAPES",
    "TVM_DEFAULT_LIMIT",
    "Job",
    "parse_shapes",
    "add_arguments",
    "run",
    "BenchConfig",
    "BenchResult",
    "run_bench",
    "print_report",
    "summary",
    "plot",
]

#: Implementations in table order; ``tpp`` and ``tpp-tuned`` always run.
IMPLS = ("tpp", "tpp-tuned", "numpy", "tvm-default", "metaschedule")
#: Baselines ``--against`` may add.
BASELINES = ("numpy", "tvm-default", "metaschedule")
#: Square GEMMs, BERT-base (seq 128) projections and FFN, DLRM MLP layers: (M, N, K).
DEFAULT_SHAPES = ((512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (128, 768, 768),
                  (128, 3072, 768), (128, 768, 3072), (512, 1024, 1024), (32, 512, 256))
#: Seconds a single naive ``tvm-default`` run may take before the shape is skipped.
TVM_DEFAULT_LIMIT = 5.0
#: Job that measures the FMA peak instead of a GEMM.
PEAK = "peak"
#: Keys of every JSON row (``explain`` is added with ``--explain``).
ROW_KEYS = ("m", "n", "k", "threads", "impl", "gflops", "fraction_of_peak", "tune_seconds",
            "max_abs_err", "note", "gflops_rounds")
_MIN_SAMPLE_SECONDS = 1e-3
#: Seconds of timed samples per measurement, i.e. per round (at least ``repeat`` samples).
_SAMPLE_BUDGET = 0.4
_MAX_SAMPLES = 200
#: Most seconds spent on the samples of a slow run (one sample at least).
_SLOW_BUDGET = 10.0


def parse_shapes(text: str) -> tuple[tuple[int, int, int], ...]:
    """``"512x512x512,128x768x768"`` -> ``((512, 512, 512), (128, 768, 768))`` (M x N x K).

    Examples
    --------
    >>> parse_shapes("64x64x64, 48x80x32")
    ((64, 64, 64), (48, 80, 32))
    """
    shapes = []
    for part in (p.strip() for p in text.split(",")):
        dims = part.lower().split("x")
        try:
            m, n, k = (int(d) for d in dims)
        except ValueError:
            raise ValueError(f"a GEMM shape is MxNxK with positive ints, got {part!r}") from None
        if min(m, n, k) < 1:
            raise ValueError(f"a GEMM shape is MxNxK with positive ints, got {part!r}")
        shapes.append((m, n, k))
    return tuple(dict.fromkeys(shapes))  # each shape once, in the given order


def _int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{what} takes positive ints like 1,2, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{what} takes positive ints like 1,2, got {text!r}")
    return values


@dataclass(frozen=True)
class Job:
    """What one worker process measures: one implementation at one thread count.

    Examples
    --------
    >>> Job("tpp", 2, [[64, 64, 64]], "wd").threads
    2
    """

    impl: str
    threads: int
    shapes: list[list[int]]
    work_dir: str
    repeat: int = 10
    top_k: int = 8
    ms_trials: int = 64
    explain: bool = False
    seed: int = 0
    tvm_default_limit: float = TVM_DEFAULT_LIMIT
    tune_budget: float | None = None

    def __post_init__(self) -> None:
        if self.tune_budget is not None and not self.tune_budget > 0:
            raise ValueError(f"tune_budget must be > 0 seconds, got {self.tune_budget}")
        if self.impl not in (*IMPLS, PEAK):
            raise ValueError(f"unknown implementation {self.impl!r}; known: {', '.join(IMPLS)}")
        for name in ("threads", "repeat", "top_k", "ms_trials"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.tvm_default_limit > 0:
            raise ValueError(f"tvm_default_limit must be > 0, got {self.tvm_default_limit}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Job:
        return cls(**json.loads(text))


# ------------------------------------------------------------------------------------------
# Worker side: runs in a fresh process whose thread-count variables the harness has set.


@dataclass
class _Prepared:
    """One implementation built for one shape: ``run`` once, ``timer(number, repeat)``."""

    run: Callable[[], Any]
    timer: Callable[[int, int], list[float]]
    tune_seconds: float | None = None
    note: str = ""
    explain: dict | None = None


class _Skipped(Exception):
    """This shape is not measured for this implementation (the row says why)."""


def _operands(m: int, n: int, k: int, seed: int):
    import numpy as np

    rng = np.random.default_rng([seed, m, n, k])
    return (rng.standard_normal((m, k)).astype("float32"),
            rng.standard_normal((k, n)).astype("float32"))


def _tvm_timer(executable, args) -> Callable[[int, int], list[float]]:
    import tvm

    def timer(number: int, repeat: int) -> list[float]:
        evaluator = executable.mod.time_evaluator(executable.mod.entry_name, tvm.cpu(),
                                                  number=number, repeat=repeat)
        return list(evaluator(*args).results)

    return timer


def _tvm_prepared(executable, args, **details: Any) -> _Prepared:
    def run():
        executable(*args)
        return args[-1].numpy()

    return _Prepared(run, _tvm_timer(executable, args), **details)


def _plain_matmul(m: int, n: int, k: int):
    """TVM's plain ``X @ W`` PrimFunc (no schedule): tvm-default's and MetaSchedule's input."""
    from tvm import te

    x = te.placeholder((m, k), "float32", name="X")
    w = te.placeholder((k, n), "float32", name="W")
    r = te.reduce_axis((0, k), name="k")
    y = te.compute((m, n), lambda i, j: te.sum(x[i, r] * w[r, j], axis=r), name="Y")
    return te.create_prim_func([x, w, y])


def _host_llvm(threads: int):
    import tvm

    return tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu(),
                              "num-cores": threads})


def _tpp_args(x, w, bn: int):
    import tvm

    from schedules.gemm import pack_weight

    return [tvm.runtime.tensor(x), tvm.runtime.tensor(pack_weight(w, bn)),
            tvm.runtime.empty((x.shape[0], w.shape[1]), "float32")]


def _tpp_build(m: int, n: int, k: int, config, target, x, w, **details: Any) -> _Prepared:
    import tvm

    from microkernels.brgemm import BrgemmShape, find_impl
    from microkernels.machine import machine_of
    from schedules.gemm import GemmProblem, schedule

    isa = machine_of(target).isa
    executable = tvm.compile(schedule(GemmProblem(m, n, k), config, isa).mod, target=target)
    kernel, _ = find_impl(BrgemmShape(m=config.bm, n=config.bn, k=config.bk,
                                      batch=config.k_step, isa=isa.name))
    steps = dict(config.candidate.block_steps)
    note = (f"{kernel} kernel, bm x bn x bk x k_step {config.bm}x{config.bn}x{config.bk}"
            f"x{config.k_step} {config.spec}{' ' + str(steps) if steps else ''}"
            f"{'' if config.pack_a is None else f' A packed at depth {config.pack_a}'}")
    details["note"] = "; ".join(filter(None, (details.get("note"), note)))
    return _tvm_prepared(executable, _tpp_args(x, w, config.bn), **details)


def _prepare_tpp(job: Job, m: int, n: int, k: int, x, w, send) -> _Prepared:
    from microkernels.machine import machine_of
    from schedules.blocking import default_config

    from .tpp_target import target

    machine = machine_of(target("tpp", num_cores=job.threads))
    config = default_config(m, n, k, machine.isa, machine.caches, machine.threads)
    return _tpp_build(m, n, k, config, target("tpp", num_cores=job.threads), x, w)


def _explain(measured: Sequence[dict], flops: int) -> dict:
    """The tuner's model ranking next to what it measured: 1-based ranks and classes within
    each blocking (:class:`schedules.tuner.Choice`), the default (measured first) flagged."""
    from schedules.tuner import MARGIN, OPS, config_text

    def one_based(value: int | None) -> int | None:
        return None if value is None else value + 1

    rows = []
    for i, item in enumerate(measured):
        seconds = item.get("seconds")
        rows.append({
            "model_rank": one_based(item.get("model_rank")),
            "model_class": one_based(item.get("model_class")),
            "default": i == 0,
            "predicted_cycles": item.get("predicted_cycles"),
            "gflops": flops / seconds / 1e9 if seconds else None,
            "config": config_text(OPS["dense"].from_json(item["config"])),
            "error": item.get("error"),
        })
    timed = [r for r in rows if r["gflops"]]
    best = max(timed, key=lambda r: r["gflops"]) if timed else None
    rank = best["model_rank"] if best else None
    model_class = best["model_class"] if best else None
    top5 = [r["gflops"] for r in timed if r["model_rank"] is not None and r["model_rank"] <= 5]
    # Candidates within the tuner's MARGIN of each other are equal as far as timing can tell.
    return {"measured": rows, "best_model_rank": rank, "best_model_class": model_class,
            "best_in_model_top5": rank is not None and rank <= 5,
            "best_in_model_top5_classes": model_class is not None and model_class <= 5,
            "top5_within_margin": bool(best and top5
                                       and max(top5) >= best["gflops"] * (1 - MARGIN))}


def _prepare_tpp_tuned(job: Job, m: int, n: int, k: int, x, w, send) -> _Prepared:
    from schedules.gemm import GemmProblem
    from schedules.tuner import Database, TuningKey, tune

    from .tpp_target import target

    tgt = target("tpp", num_cores=job.threads)
    problem = GemmProblem(m, n, k)
    database = Database(Path(job.work_dir) / "tpp_tuned.json")

    def progress(done: int, total: int) -> None:
        send({"step": f"tuning {done}/{total}", "shape": [m, n, k]})

    result = tune(problem, tgt, database=database, top_k=job.top_k,
                       budget_seconds=job.tune_budget, progress=progress)
    record = database.record(TuningKey.of(problem, tgt)) or {}
    if result.cached:
        tune_seconds = record.get("tune_seconds")
        note = "database hit (tuning seconds as recorded)"
    else:
        measured = len(result.measurements) - 1
        tune_seconds, note = result.tune_seconds, f"tuned: default + model top-{measured}"
        if job.tune_budget is not None:
            note += f" (budget {job.tune_budget:g} s)"
    explain = _explain(record.get("measured", []), problem.flops) if job.explain else None
    return _tpp_build(m, n, k, result.best, tgt, x, w, tune_seconds=tune_seconds, note=note,
                      explain=explain)


def _prepare_numpy(job: Job, m: int, n: int, k: int, x, w, send) -> _Prepared:
    import numpy as np

    out = np.empty((m, n), "float32")

    def run():
        np.matmul(x, w, out=out)
        return out

    def timer(number: int, repeat: int) -> list[float]:
        samples = []
        for _ in range(repeat):
            start = time.perf_counter()
            for _ in range(number):
                np.matmul(x, w, out=out)
            samples.append((time.perf_counter() - start) / number)
        return samples

    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    return _Prepared(run, timer, note=f"numpy {np.__version__} with {blas.get('name')} "
                                      f"{blas.get('version', '')}".strip())


def _prepare_tvm_default(job: Job, m: int, n: int, k: int, x, w, send) -> _Prepared:
    import tvm

    target = _host_llvm(job.threads)
    # Rows are independent in the naive loops: a run on a few rows predicts the full one.
    rows = max(1, min(m, 4, int(2e7 // (2 * n * k))))
    if rows < m:
        probe = tvm.compile(_plain_matmul(rows, n, k), target=target)
        args = [tvm.runtime.tensor(x[:rows]), tvm.runtime.tensor(w),
                tvm.runtime.empty((rows, n), "float32")]
        probe(*args)  # warm-up
        predicted = min(_tvm_timer(probe, args)(1, 3)) * m / rows
        if predicted > job.tvm_default_limit:
            raise _Skipped(f"skipped: one run would take ~{predicted:.3g} s (> "
                           f"{job.tvm_default_limit:g} s limit; timed on {rows} rows)")
    executable = tvm.compile(_plain_matmul(m, n, k), target=target)
    args = [tvm.runtime.tensor(x), tvm.runtime.tensor(w), tvm.runtime.empty((m, n), "float32")]
    return _tvm_prepared(executable, args, note="no schedule: naive serial loops")


def _prepare_metaschedule(job: Job, m: int, n: int, k: int, x, w, send) -> _Prepared:
    import tvm
    from tvm.s_tir import meta_schedule as ms

    from schedules.ms_space import local_builder

    target = _host_llvm(job.threads)
    func = _plain_matmul(m, n, k)
    db_dir = Path(job.work_dir) / "metaschedule" / f"{m}x{n}x{k}_t{job.threads}"
    meta_path = db_dir / "bench_meta.json"
    meta = {"trials": job.ms_trials, "target": str(target), "seed": job.seed}
    old = json.loads(meta_path.read_text()) if meta_path.is_file() else None
    reused = old is not None and {key: old.get(key) for key in meta} == meta
    startup = 0.0
    if reused:
        database = ms.database.JSONDatabase(work_dir=str(db_dir))
        tune_seconds = float(old["tune_seconds"])
    else:
        # A database of another budget or target would mix results: start afresh.
        for stale in (db_dir.glob("*.json") if db_dir.is_dir() else ()):
            stale.unlink()
        db_dir.mkdir(parents=True, exist_ok=True)
        send({"step": f"MetaSchedule, {job.ms_trials} trials", "shape": [m, n, k]})
        # TuneContext imports tvm.s_tir.tensor_intrin (30-60 s) once per process: pay it
        # outside the timer so every shape's tuning time is comparable.
        start = time.perf_counter()
        import tvm.s_tir.tensor_intrin  # noqa: F401

        startup = time.perf_counter() - start
        start = time.perf_counter()
        database = ms.tune_tir(mod=func, target=target, work_dir=str(db_dir),
                               max_trials_global=job.ms_trials,
                               num_trials_per_iter=min(64, job.ms_trials),
                               builder=local_builder(), cost_model="xgb", seed=job.seed)
        tune_seconds = time.perf_counter() - start
        meta_path.write_text(json.dumps({**meta, "tune_seconds": tune_seconds}))
    sch = ms.tir_integration.compile_tir(database, func, target)
    if sch is None:
        raise RuntimeError(f"MetaSchedule found no valid schedule; logs in {db_dir}/logs")
    executable = tvm.compile(sch.mod, target=target)
    args = [tvm.runtime.tensor(x), tvm.runtime.tensor(w), tvm.runtime.empty((m, n), "float32")]
    note = f"{job.ms_trials} trials, xgb; database {db_dir}"
    if reused:
        note += " (reused; tuning seconds as recorded)"
    elif startup > 1:
        note += f"; +{startup:.0f} s one-off MetaSchedule start-up not counted"
    return _tvm_prepared(executable, args, tune_seconds=tune_seconds, note=note)


_PREPARE: dict[str, Callable[..., _Prepared]] = {
    "tpp": _prepare_tpp,
    "tpp-tuned": _prepare_tpp_tuned,
    "numpy": _prepare_numpy,
    "tvm-default": _prepare_tvm_default,
    "metaschedule": _prepare_metaschedule,
}


def _best_seconds(prepared: _Prepared, first: float, repeat: int) -> float:
    """Seconds per run in the fastest of many short samples (see the module docstring)."""
    first = max(first, 1e-7)
    number = max(1, math.ceil(_MIN_SAMPLE_SECONDS / first))
    samples = max(repeat, min(_MAX_SAMPLES, int(_SAMPLE_BUDGET / (number * first))))
    samples = max(1, min(samples, int(_SLOW_BUDGET / (number * first))))
    return min(prepared.timer(number, samples))


def _row(impl: str, threads: int, m: int, n: int, k: int, **values: Any) -> dict[str, Any]:
    """A row of :data:`ROW_KEYS`, all None but the given values."""
    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    row.update(m=m, n=n, k=k, threads=threads, impl=impl, **values)
    return row


def _prepare_shape(job: Job, m: int, n: int, k: int, send
                   ) -> tuple[dict[str, Any], _Prepared | None, float | None]:
    """Build (and tune) one shape, check it against numpy in float64, time one run.

    Returns the row without GFLOPS, what to time (None if skipped) and one run's seconds.
    """
    import numpy as np

    row = _row(job.impl, job.threads, m, n, k)
    x, w = _operands(m, n, k, job.seed)
    try:
        send({"step": "build", "shape": [m, n, k]})
        prepared = _PREPARE[job.impl](job, m, n, k, x, w, send)
    except _Skipped as skip:
        row["note"] = str(skip)
        return row, None, None
    send({"step": "check", "shape": [m, n, k]})
    start = time.perf_counter()
    out = np.asarray(prepared.run())
    first = time.perf_counter() - start
    reference = x.astype(np.float64) @ w.astype(np.float64)
    row["max_abs_err"] = float(np.max(np.abs(out - reference)))
    if first < 1.0:  # the first run pays one-off costs (pages, thread start-up): probe again
        first = min(prepared.timer(1, 3))
    row["tune_seconds"] = prepared.tune_seconds
    row["note"] = prepared.note or None
    if job.explain and prepared.explain is not None:
        row["explain"] = prepared.explain
    return row, prepared, first


def _send(channel: IO[str], message: dict[str, Any]) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def _reason(err: BaseException) -> str:
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1].strip() if lines else ''}".rstrip(": ")


def worker_main(argv: Sequence[str]) -> int:
    """Serve one :class:`Job` over JSON lines (the protocol is in :func:`run_bench`)."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # library prints (MetaSchedule's logs) go to the log, not the protocol

    def send(message: dict[str, Any]) -> None:
        _send(channel, message)

    job = Job.from_json(argv[0])
    if job.impl == PEAK:
        try:
            from microkernels.peak import measure_peak

            peak = measure_peak()
            send({"peak": {"isa": peak.isa, "gflops_per_core": peak.peak_gflops,
                           "clock_ghz": peak.clock_ghz}})
        except Exception as err:
            traceback.print_exc()
            send({"peak": None, "reason": _reason(err)})
        return 0
    ready: dict[int, tuple[_Prepared, float]] = {}
    for index, (m, n, k) in enumerate(job.shapes):
        first = None
        try:
            row, prepared, first = _prepare_shape(job, m, n, k, send)
            if prepared is not None and first is not None:
                ready[index] = (prepared, first)
        except Exception as err:
            traceback.print_exc()
            row = _row(job.impl, job.threads, m, n, k, note=f"error: {_reason(err)}")
        send({"prepared": index, "row": row,
               "run_seconds": first if index in ready else None})
    send({"ready": True})
    for line in sys.stdin:
        try:
            request = json.loads(line)
            if request.get("quit"):
                break
            index = int(request["time"])
            if index not in ready:
                raise ValueError(f"shape {index} was not prepared")
            prepared, first = ready[index]
            send({"seconds": _best_seconds(prepared, first, job.repeat)})
        except Exception as err:
            traceback.print_exc()
            send({"error": _reason(err)})
    return 0


# ------------------------------------------------------------------------------------------
# Harness side.


def _worker_command() -> tuple[str, ...]:
    return (sys.executable, "-m", "tvm_tpp.bench_gemm")


@dataclass(frozen=True)
class BenchConfig:
    """Options of one ``bench-gemm`` run (see :func:`add_arguments`).

    ``pause`` is the quiet before each timing request (idle TVM and OpenBLAS threads spin
    after a run), ``timeout`` the longest a worker may stay silent while it prepares, and
    ``worker_command`` the worker's command line (the job's JSON is appended).
    """

    shapes: tuple[tuple[int, int, int], ...] = DEFAULT_SHAPES
    threads: tuple[int, ...] = (1, 2)
    impls: tuple[str, ...] = ("tpp", "tpp-tuned", "numpy", "tvm-default")
    work_dir: Path = Path("tvm_tpp_work")
    repeat: int = 10
    top_k: int = 8
    ms_trials: int = 64
    explain: bool = False
    seed: int = 0
    tvm_default_limit: float = TVM_DEFAULT_LIMIT
    tune_budget: float | None = None
    rounds: int = 5
    pause: float = 0.3
    timeout: float = 3600.0
    worker_command: tuple[str, ...] = field(default_factory=_worker_command)

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        unknown = set(self.impls) - set(IMPLS)
        if unknown:
            raise ValueError(f"unknown implementations {sorted(unknown)}; known: "
                             f"{', '.join(IMPLS)}")
        if not self.threads:
            raise ValueError("no thread counts given")
        if self.pause < 0:
            raise ValueError(f"pause must be >= 0, got {self.pause}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")
        Job("tpp", min(self.threads), [], "", self.repeat, self.top_k, self.ms_trials,
            tvm_default_limit=self.tvm_default_limit, tune_budget=self.tune_budget)

    def job(self, impl: str, threads: int) -> Job:
        """The :class:`Job` of ``impl``'s worker at ``threads``."""
        return Job(impl, threads, [list(s) for s in self.shapes], str(self.work_dir),
                   self.repeat, self.top_k, self.ms_trials, self.explain, self.seed,
                   self.tvm_default_limit, self.tune_budget)

    def planned_rounds(self, impl: str) -> int:
        """Rounds ``impl`` is timed in: ``tvm-default``, a hundred times slower, only one."""
        return 1 if impl == "tvm-default" else self.rounds


def _start(config: BenchConfig, job: Job, log: Path) -> Worker:
    """Start ``job``'s worker with the thread-count variables set before anything loads."""
    # Every pool the timed library may use gets the job's threads (numpy's OpenBLAS is timed
    # here); the FMA-peak probe is single-core.
    threads = str(1 if job.impl == PEAK else job.threads)
    env = dict.fromkeys(("TVM_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                         "MKL_NUM_THREADS"), threads)
    return Worker([*config.worker_command, job.to_json()], log, env)


@dataclass
class _Impl:
    """One implementation's persistent worker at one thread count, and its rows so far."""

    name: str
    log: Path
    rows: list[dict[str, Any]]  # per shape: the preparation's row (no GFLOPS yet)
    run_seconds: list[float | None] = field(init=False)  # per shape; None = not to be timed
    figures: list[list[float]] = field(init=False)  # per shape: GFLOPS of each round
    prepared: int = 0  # shapes the worker has reported on
    worker: Worker | None = None

    def __post_init__(self) -> None:
        self.run_seconds = [None] * len(self.rows)
        self.figures = [[] for _ in self.rows]

    def drop(self, index: int, note: str) -> None:
        """Shape ``index`` failed: an error row, not timed again."""
        self.rows[index]["note"] = note
        self.run_seconds[index] = None

    def fail(self, first: int, note: str) -> None:
        """The worker is gone: error rows from shape ``first`` on, unless skipped or failed
        already."""
        if self.worker is not None:
            self.worker.kill()
            self.worker.close()
            self.worker = None
        for index in range(first, len(self.rows)):
            if index >= self.prepared or self.run_seconds[index] is not None:
                self.drop(index, note)

    def final_rows(self, config: BenchConfig) -> list[dict[str, Any]]:
        """Rows with ``gflops`` the best round and ``gflops_rounds`` one entry per planned
        round (None where not timed); error rows have no GFLOPS."""
        rows = []
        for row, figures in zip(self.rows, self.figures, strict=True):
            padded: list[float | None] = [*figures]
            padded += [None] * (config.planned_rounds(self.name) - len(figures))
            failed = (row["note"] or "").startswith("error")
            rows.append({**row, "gflops": None if failed or not figures else max(figures),
                         "gflops_rounds": padded})
        return rows


@dataclass
class BenchResult:
    """Rows (see :data:`ROW_KEYS`), the measured peak (None if unknown) and wall times
    (``impl/tN``: that worker's preparation; ``timing/tN``: the alternating timing)."""

    rows: list[dict]
    peak: dict | None
    wall_seconds: dict[str, float] = field(default_factory=dict)
    peak_error: str | None = None
    load_average: tuple[float, float] | None = None


class _Bar:
    """The rich progress bar on stderr (refreshed once a second: it shares the CPUs)."""

    def __init__(self, progress: Any, total: int) -> None:
        self.progress = progress
        self.task = progress.add_task("starting", total=total)

    def say(self, text: str) -> None:
        self.progress.update(self.task, description=text)

    def advance(self, units: int = 1) -> None:
        self.progress.advance(self.task, units)


def _prepare(config: BenchConfig, impl: _Impl, threads: int, bar: _Bar) -> None:
    """Start ``impl``'s worker and wait until it has prepared every shape (or failed)."""
    impl.worker = _start(config, config.job(impl.name, threads), impl.log)
    bar.say(f"t{threads}: preparing {impl.name}")
    while True:
        try:
            message = impl.worker.receive(config.timeout)
        except WorkerError as err:
            bar.advance(len(impl.rows) - impl.prepared)
            impl.fail(impl.prepared, f"error: during preparation: {err}; log {impl.log}")
            return
        if "step" in message:
            m, n, k = message["shape"]
            bar.say(f"t{threads}: preparing {impl.name} {m}x{n}x{k}: {message['step']}")
        elif "prepared" in message:
            index = int(message["prepared"])
            impl.rows[index] = message["row"]
            seconds = message.get("run_seconds")
            impl.run_seconds[index] = float(seconds) if seconds is not None else None
            impl.prepared = index + 1
            bar.advance()
        elif message.get("ready"):
            break
    if all(seconds is None for seconds in impl.run_seconds):  # nothing to time: free it now
        impl.worker.close()
        impl.worker = None


def _peak(config: BenchConfig, log: Path) -> dict[str, Any]:
    """One message of the one-shot FMA-peak worker (``{"crashed": reason}`` if it failed)."""
    worker = _start(config, Job(PEAK, 1, [], str(config.work_dir)), log)
    try:
        return worker.receive(config.timeout)
    except WorkerError as err:
        return {"crashed": str(err)}
    except BaseException:
        worker.kill()
        raise
    finally:
        worker.close()


def _time_shape(config: BenchConfig, index: int, impls: list[_Impl], threads: int,
                bar: _Bar) -> None:
    """``config.rounds`` alternating rounds of one timed measurement per live worker."""
    m, n, k = config.shapes[index]
    for round_ in range(config.rounds):
        present = [i for i in impls if round_ < config.planned_rounds(i.name)]
        for impl in turn_order(present, round_):
            bar.advance()
            run_seconds = impl.run_seconds[index]
            if impl.worker is None or run_seconds is None:  # gone, skipped or failed
                continue
            bar.say(f"t{threads}: timing {m}x{n}x{k}, round {round_ + 1}/{config.rounds}: "
                    f"{impl.name}")
            when = f"timing round {round_ + 1}"
            time.sleep(config.pause)
            try:
                # One measurement takes at most about _SLOW_BUDGET or one run.
                reply = impl.worker.request({"time": index},
                                            timeout=120.0 + 10 * run_seconds)
            except WorkerError as err:
                impl.fail(index, f"error: {when}: {err}; log {impl.log}")
                continue
            seconds = reply.get("seconds")
            if isinstance(seconds, (int, float)) and seconds > 0:
                impl.figures[index].append(2 * m * n * k / seconds / 1e9)
            elif "error" in reply:
                impl.drop(index, f"error: {when}: {reply['error']}; log {impl.log}")
            else:
                impl.fail(index, f"error: {when}: unexpected reply {str(reply)[:80]}")


def run_bench(config: BenchConfig, progress: bool = True) -> BenchResult:
    """Measure every (shape, threads, impl) with persistent workers, alternating.

    Per thread count, one worker per implementation (``python -m tvm_tpp.bench_gemm JOB``)
    prepares every shape, one worker after another; then per shape and round each live
    worker is asked for one measurement in turn.  The protocol, JSON lines:

    - worker -> harness while preparing: ``{"step": text, "shape": [m, n, k]}`` (progress),
      ``{"prepared": index, "row": row, "run_seconds": s}`` per shape (``row`` without
      GFLOPS; ``run_seconds`` None when the shape is skipped or failed), then
      ``{"ready": true}``;
    - then harness -> worker ``{"time": index}``, answered ``{"seconds": s}`` (the fastest
      sample's seconds per run) or ``{"error": reason}``; ``{"quit": true}`` ends it;
    - the ``peak`` job sends one ``{"peak": {...}}`` (or ``{"peak": null, "reason": ...}``).

    A worker that dies or times out gives error rows for the shapes it did not finish.
    """
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    logs = config.work_dir / "logs"
    load_before = os.getloadavg()[0]
    peak: dict | None = None
    peak_error = "the peak worker sent nothing"
    rows: list[dict] = []
    walls: dict[str, float] = {}
    shapes = len(config.shapes)
    units = len(config.threads) * (1 + shapes * (len(config.impls) + sum(
        config.planned_rounds(impl) for impl in config.impls)))
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), disable=not progress,
                  refresh_per_second=1) as display:
        bar = _Bar(display, units)
        for threads in config.threads:
            impls: list[_Impl] = []
            try:
                for name in config.impls:
                    impl = _Impl(name, logs / f"bench_gemm_{name}_t{threads}.log",
                                 [_row(name, threads, *s) for s in config.shapes])
                    impls.append(impl)
                    start = time.perf_counter()
                    _prepare(config, impl, threads, bar)
                    walls[f"{name}/t{threads}"] = time.perf_counter() - start
                # Each thread count measures the peak again; the fastest is the peak, as for
                # the kernels.
                bar.say(f"t{threads}: measuring the FMA peak")
                message = _peak(config, logs / f"bench_gemm_peak_t{threads}.log")
                bar.advance()
                found = message.get("peak")
                if found and (peak is None or found["gflops_per_core"] > peak["gflops_per_core"]):
                    peak = found
                elif not found:
                    peak_error = message.get("reason") or message.get("crashed") or peak_error
                start = time.perf_counter()
                for index in range(shapes):
                    _time_shape(config, index, impls, threads, bar)
                walls[f"timing/t{threads}"] = time.perf_counter() - start
            except BaseException:  # Ctrl-C or a bug: do not wait for busy workers
                for impl in impls:
                    if impl.worker is not None:
                        impl.worker.kill()
                raise
            finally:
                for impl in impls:
                    if impl.worker is not None:
                        impl.worker.close()
            for impl in impls:
                rows += impl.final_rows(config)
    if peak is not None:
        for row in rows:
            if row["gflops"] is not None:
                row["fraction_of_peak"] = row["gflops"] / (peak["gflops_per_core"]
                                                           * row["threads"])
    order = {impl: n for n, impl in enumerate(IMPLS)}
    shape_order = {s: n for n, s in enumerate(config.shapes)}
    rows.sort(key=lambda r: (shape_order[(r["m"], r["n"], r["k"])], r["threads"],
                             order[r["impl"]]))
    return BenchResult(rows, peak, walls, None if peak else peak_error,
                       (load_before, os.getloadavg()[0]))


def summary(rows: Sequence[dict]) -> list[dict]:
    """Per (shape, threads): tuned tpp vs numpy and vs MetaSchedule, and tuning-time ratio.

    Ratios are None when a side is missing.  ``ms_tune_time_ratio`` is MetaSchedule's tuning
    seconds over tpp-tuned's.

    Examples
    --------
    >>> summary([{"m": 1, "n": 1, "k": 1, "threads": 1, "impl": "tpp-tuned", "gflops": 2.0,
    ...           "tune_seconds": 1.0}, {"m": 1, "n": 1, "k": 1, "threads": 1,
    ...           "impl": "numpy", "gflops": 1.0, "tune_seconds": None}])[0]["vs_numpy"]
    2.0
    """
    groups: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        groups.setdefault((row["m"], row["n"], row["k"], row["threads"]), {})[row["impl"]] = row

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    out = []
    for (m, n, k, threads), by_impl in groups.items():
        tuned = by_impl.get("tpp-tuned", {})
        numpy_, ms = by_impl.get("numpy", {}), by_impl.get("metaschedule", {})
        out.append({
            "m": m, "n": n, "k": k, "threads": threads,
            "vs_numpy": ratio(tuned.get("gflops"), numpy_.get("gflops")),
            "vs_metaschedule": ratio(tuned.get("gflops"), ms.get("gflops")),
            "ms_tune_time_ratio": ratio(ms.get("tune_seconds"), tuned.get("tune_seconds")),
        })
    return out


def _fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _yes(flag: bool | None) -> str:
    return "yes" if flag else "no"


def print_report(result: BenchResult, explain: bool = False) -> None:
    """The results table, the per-shape summary, ``--explain`` details and wall times."""
    from rich.console import Console
    from rich.table import Table

    from schedules.tuner import MARGIN, MODEL_RESOLUTION

    rows, peak = result.rows, result.peak
    # Piped output would wrap at 80 columns and fold the notes.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    table = Table(title="fp32 GEMM Y = X @ W (GFLOPS: fastest sample)")
    for name, justify in (("M x N x K", "left"), ("thr", "right"), ("impl", "left"),
                          ("GFLOPS", "right"), ("% peak", "right"), ("tune s", "right"),
                          ("max abs err", "right"), ("note", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        fraction = r["fraction_of_peak"]
        table.add_row(f"{r['m']}x{r['n']}x{r['k']}", str(r["threads"]), r["impl"],
                      _fmt(r["gflops"], ".1f"), _fmt(fraction and 100 * fraction, ".1f"),
                      _fmt(r["tune_seconds"], ".1f"), _fmt(r["max_abs_err"], ".1e"),
                      r["note"] or "")
    console.print(table)
    if peak is None:
        console.print(f"fp32 peak unknown ({result.peak_error}): fraction_of_peak is null")
    else:
        console.print(f"peak: {peak['gflops_per_core']:.1f} GFLOPS per core ({peak['isa']} FMA "
                      f"at {peak['clock_ghz']:.2f} GHz, measured); % peak = GFLOPS / (threads x "
                      "that)")
    lines = Table(title="tuned tpp vs baselines (ratios of GFLOPS; tuning time MS / tpp-tuned)")
    for name in ("M x N x K", "thr", "tpp-tuned / numpy", "tpp-tuned / MetaSchedule",
                 "tuning time MS / tpp-tuned"):
        lines.add_column(name, justify="left" if name == "M x N x K" else "right")
    for s in summary(rows):
        lines.add_row(f"{s['m']}x{s['n']}x{s['k']}", str(s["threads"]),
                      _fmt(s["vs_numpy"], ".2f"), _fmt(s["vs_metaschedule"], ".2f"),
                      _fmt(s["ms_tune_time_ratio"], ".1f"))
    console.print(lines)
    if explain:
        for r in rows:
            if "explain" not in r:
                continue
            ex = r["explain"]
            detail = Table(title=f"{r['m']}x{r['n']}x{r['k']} t{r['threads']}: model ranking vs "
                                 "measurement")
            for name in ("model rank", "class", "predicted Mcycles", "measured GFLOPS",
                         "config"):
                detail.add_column(name, justify="left" if name == "config" else "right")
            for item in sorted(ex["measured"], key=lambda i: i["model_rank"] or 1e9):
                rank = _fmt(item["model_rank"], "d")
                detail.add_row(f"{rank} (default)" if item.get("default") else rank,
                               _fmt(item.get("model_class"), "d"),
                               _fmt(item["predicted_cycles"] and item["predicted_cycles"] / 1e6,
                                    ".2f"),
                               _fmt(item["gflops"], ".1f", item["error"] or "-"), item["config"])
            console.print(detail)
            console.print(
                f"measured best is model rank {_fmt(ex['best_model_rank'], 'd')}, class "
                f"{_fmt(ex.get('best_model_class'), 'd')}; in the model's top 5: "
                f"{_yes(ex['best_in_model_top5'])}; in its top 5 classes: "
                f"{_yes(ex.get('best_in_model_top5_classes'))}; top 5 within "
                f"{100 * MARGIN:g} % of it: {_yes(ex.get('top5_within_margin'))}")
        explained = [r["explain"] for r in rows if "explain" in r]
        counts = {key: sum(bool(ex.get(key)) for ex in explained) for key in
                  ("best_in_model_top5", "best_in_model_top5_classes", "top5_within_margin")}
        console.print(
            f"model vs measurement over {len(explained)} tunings: the fastest measured is in "
            f"the model's top 5 in {counts['best_in_model_top5']}, in its top 5 classes "
            f"(predictions {100 * MODEL_RESOLUTION:g} % apart) in "
            f"{counts['best_in_model_top5_classes']}, and a top-5 candidate is within "
            f"{100 * MARGIN:g} % of it in {counts['top5_within_margin']}")
    walls = ", ".join(f"{key} {seconds:.0f} s" for key, seconds in result.wall_seconds.items())
    console.print(f"wall times (impl/tN: preparing that worker; timing/tN: the alternating "
                  f"rounds): {walls}")
    if result.load_average is not None:
        before, after = result.load_average
        console.print(f"1-minute load average: {before:.1f} before, {after:.1f} after "
                      f"({os.cpu_count()} CPUs; other processes distort the timings)")


def plot(rows: Sequence[dict], path: str | os.PathLike) -> Path:
    """Grouped bars of GFLOPS per shape, one panel per thread count (PNG via matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = sorted({r["threads"] for r in rows})
    shapes = list(dict.fromkeys((r["m"], r["n"], r["k"]) for r in rows))
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    fig, axes = plt.subplots(len(threads), 1, figsize=(max(6, 1.6 * len(shapes)),
                                                       3.2 * len(threads)), squeeze=False)
    width = 0.8 / max(1, len(impls))
    for ax, t in zip(axes[:, 0], threads, strict=True):
        for n, impl in enumerate(impls):
            values = {(r["m"], r["n"], r["k"]): r["gflops"] for r in rows
                      if r["threads"] == t and r["impl"] == impl}
            xs = [i + (n - (len(impls) - 1) / 2) * width for i in range(len(shapes))]
            ax.bar(xs, [values.get(s) or 0.0 for s in shapes], width, label=impl)
            for x, s in zip(xs, shapes, strict=True):
                if s in values and values[s] is None:  # skipped or failed: say so
                    ax.text(x, 0, "n/a", rotation=90, ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels([f"{m}x{n}x{k}" for m, n, k in shapes], rotation=20, fontsize=8)
        ax.set_ylabel("GFLOPS")
        ax.set_title(f"fp32 GEMM, {t} thread{'s' if t > 1 else ''}")
        ax.legend(fontsize=7, ncol=len(impls))
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench-gemm`` options."""
    default_shapes = ",".join(f"{m}x{n}x{k}" for m, n, k in DEFAULT_SHAPES)
    parser.add_argument("--shapes", default=default_shapes,
                        help="comma-separated MxNxK GEMMs (default: square, BERT-base, DLRM)")
    parser.add_argument("--threads", default="1,2", help="thread counts, e.g. 1,2")
    parser.add_argument("--against", default="numpy,tvm-default",
                        help="baselines to include (tpp and tpp-tuned always run): "
                             + ",".join(BASELINES) + "; or 'none'")
    parser.add_argument("--ms-trials", type=int, default=64, help="MetaSchedule's trials")
    parser.add_argument("--top-k", type=int, default=8, help="candidates the tuner measures")
    parser.add_argument("--tune-budget", type=float,
                        help="seconds the tuner may spend per GEMM (default: no limit)")
    parser.add_argument("--tvm-default-limit", type=float, default=TVM_DEFAULT_LIMIT,
                        help="skip tvm-default where one run would take longer (seconds)")
    parser.add_argument("--work-dir", default="tvm_tpp_work",
                        help="tuning databases and worker logs (reused by later runs)")
    parser.add_argument("--repeat", type=int, default=10, help="timed samples per measurement")
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternating rounds per shape; a row keeps its best")
    parser.add_argument("--seed", type=int, default=0, help="seed of the operands and tuning")
    parser.add_argument("--json", help="write the rows as a JSON list")
    parser.add_argument("--plot", help="write grouped GFLOPS bars (PNG)")
    parser.add_argument("--explain", action="store_true",
                        help="show the tuner's model ranking next to its measurements")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run ``bench-gemm``; 0 unless a measurement failed (ValueError on bad options)."""
    against = [] if args.against.strip() == "none" else [
        a.strip() for a in args.against.split(",") if a.strip()]
    unknown = [a for a in against if a not in BASELINES]
    if unknown:
        raise ValueError(f"--against takes {', '.join(BASELINES)} (or none), got {unknown}")
    config = BenchConfig(
        shapes=parse_shapes(args.shapes), threads=_int_list(args.threads, "--threads"),
        impls=tuple(i for i in IMPLS if i in ("tpp", "tpp-tuned") or i in against),
        work_dir=Path(args.work_dir), repeat=args.repeat, top_k=args.top_k,
        ms_trials=args.ms_trials, explain=args.explain, seed=args.seed,
        tvm_default_limit=args.tvm_default_limit, tune_budget=args.tune_budget,
        rounds=args.rounds,
    )
    result = run_bench(config, progress=not args.quiet)
    print_report(result, config.explain)
    rows = result.rows
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {plot(rows, args.plot)}")
    failed = any((r["note"] or "").startswith("error") for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
