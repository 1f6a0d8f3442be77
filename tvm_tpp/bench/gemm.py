"""``tvm-tpp bench-gemm``: GEMM throughput of the TPP schedules against baselines.

``Y[M, N] = X[M, K] @ W[K, N]`` in float32 (``--dtype``, the default), for each shape and
thread count, by:

- ``tpp`` — the loop_spec template with the default heuristic configuration
  (:func:`schedules.blocking.default_config`);
- ``tpp-tuned`` — the configuration :func:`schedules.tuner.tune` picks, with its database at
  ``work_dir/tuning.db`` (the one ``tvm-tpp tune`` writes; a known GEMM is not tuned again);
- ``numpy`` — ``np.matmul`` (the BLAS numpy links, OpenBLAS for the wheels);
- ``tvm-default`` — the plain TE matmul built by TVM without a schedule (naive loops; shapes
  whose single run would exceed ``--tvm-default-limit`` seconds (default 5), predicted from a
  run on a few rows, are skipped and say so);
- ``metaschedule`` — TVM's default MetaSchedule space on the plain matmul, ``--ms-trials``
  trials, one database per shape and thread count in the work directory (reused when warm).

``--dtype int8`` (uint8 X x int8 W -> int32 Y, no epilogue) and ``--dtype bfloat16`` (bf16 X
and W -> float32 Y) time the low-precision GEMMs of the same shapes (:class:`~tvm_tpp.bench.
workloads.GemmWorkload`): ``tpp`` and ``tpp-tuned`` in that dtype (on AMX, where this process
may run it, with the tile-shaped default blocks; where the ISA has no instruction for the
dtype the kernel is an emulation and the notes say so), ``tpp-float32`` (``tpp`` on the
float32 GEMM; a row's ``ratio_to_fp32`` is its GOPS over that row's GFLOPS on the shape),
``numpy`` (float32, as above) and ``torch``: PyTorch's CPU matmul in the same units (bf16
``torch.matmul``, int8 ``torch._int_mm``), a skipped row where ``torch`` does not import (it
is optional). int8 rows must equal the int64 product exactly, bf16 rows the float64 product of
the rounded operands within bf16 rounding; a row that fails its check is an error row. GOPS
count ``2 M N K`` operations as GFLOPS do; ``fraction_of_dtype_peak`` divides by ``threads x``
the ISA's peak in the dtype (:func:`dtype_peak`: AMX tiles, VNNI, AVX512-BF16), next to
``fraction_of_peak`` of the fp32 FMA peak.

Tuning seconds follow the one rule of :mod:`tvm_tpp.bench.impls`: the search this run did
(0 for a warm database).  Each implementation runs in a persistent worker process of its own
(:mod:`tvm_tpp.bench.protocol`) with its thread pools sized before anything loads: TVM's and
OpenBLAS's thread pools disturb each other in one process.  Per thread count:

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
fastest of short samples (:attr:`BenchConfig.sampling`: each at least 1 ms, as many as fit
in about 0.4 s, at least ``--repeat`` unless that exceeds 10 s, at most 200), since
interference only slows a run down.  Pre-packing the weights for ``tpp``
(``Wp[N/bn, K, bn]``) is outside the timing, as for a model's constant weights.  A worker
that dies or times out gives error rows for the shapes it did not finish.
``fraction_of_peak`` divides by ``threads x`` the peak.  The 1-minute load average before and
after the run is reported: a loaded machine distorts 2-thread numbers most.

Examples
--------
$ tvm-tpp bench-gemm --threads 1,2 --against numpy,tvm-default --json gemm.json
$ tvm-tpp bench-gemm --shapes 512x512x512 --against metaschedule --ms-trials 64 --explain
$ tvm-tpp bench-gemm --dtype bfloat16 --shapes 128x768x768 --threads 1 --against numpy,torch
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from microkernels import amx as _amx

from ..errors import UsageError
from . import impls as _impls
from .progress import Progress
from .protocol import (
    PEAK,
    Job,
    TimingError,
    measure,
    prepared,
    start_worker,
    worker_command,
)
from .timing import PAUSE_SECONDS, SamplingPolicy, turn_order
from .workers import Worker, WorkerError
from .workloads import GEMM_DTYPES, GemmWorkload

__all__ = ["IMPLS", "BASELINES", "DTYPES", "FLOAT32", "DEFAULT_SHAPES", "ROW_KEYS",
           "TVM_DEFAULT_LIMIT", "parse_shapes", "add_arguments", "run", "BenchConfig",
           "BenchResult", "run_bench", "summary", "dtype_peak", "print_lowp_report"]

#: ``--dtype``: float32, int8 (u8 x s8 -> s32) or bfloat16 (bf16 x bf16 -> f32).
DTYPES = GEMM_DTYPES
#: The row a low-precision run adds: tpp on the float32 GEMM, every row's 1x.
FLOAT32 = "tpp-float32"
#: PyTorch's matmul in a low-precision GEMM's own units (optional: skipped without torch).
TORCH = "torch"
#: Implementations in table order; ``tpp`` and ``tpp-tuned`` always run.
IMPLS = tuple(i for i in _impls.IMPLS if _impls.supports(i, GemmWorkload(1, 1, 1)))
#: Baselines ``--against`` may add (torch below float32 only; tvm-default and metaschedule in
#: float32 only).
BASELINES = ("numpy", TORCH, "tvm-default", "metaschedule")
#: Baselines of a float32 run only, and of a low-precision run only.
_FLOAT32_ONLY = ("tvm-default", "metaschedule")
_LOWP_ONLY = (FLOAT32, TORCH)
#: Square GEMMs, BERT-base (seq 128) projections and FFN, DLRM MLP layers: (M, N, K).
DEFAULT_SHAPES = ((512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (128, 768, 768),
                  (128, 3072, 768), (128, 768, 3072), (512, 1024, 1024), (32, 512, 256))
#: Seconds a single naive ``tvm-default`` run may take before the shape is skipped.
TVM_DEFAULT_LIMIT = 5.0
#: Keys of every JSON row (``explain`` is added with ``--explain``).  ``dtype`` is the GEMM the
#: row ran (float32 for ``tpp-float32`` and ``numpy``); ``gflops`` counts operations (GOPS
#: for int8); ``ratio_to_fp32`` and ``fraction_of_dtype_peak`` are None in a float32 run.
ROW_KEYS = ("m", "n", "k", "threads", "impl", "dtype", "gflops", "fraction_of_peak",
            "ratio_to_fp32", "fraction_of_dtype_peak", "tune_seconds", "max_abs_err", "note",
            "gflops_rounds")


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
class BenchConfig:
    """Options of one ``bench-gemm`` run (see :func:`add_arguments`).

    ``pause`` is the quiet before each timing request (idle TVM and OpenBLAS threads spin
    after a run), ``timeout`` the longest a worker may stay silent while it prepares, and
    ``worker_command`` the worker's command line (the job's JSON is appended).

    Examples
    --------
    >>> BenchConfig(shapes=((64, 64, 64),), threads=(1,)).planned_rounds("tvm-default")
    1
    >>> BenchConfig(shapes=((8, 8, 8),), impls=("tpp", "torch"), dtype="int8").impls
    ('tpp', 'tpp-float32', 'torch')
    >>> BenchConfig(dtype="bfloat16").impls
    ('tpp', 'tpp-tuned', 'tpp-float32', 'numpy', 'torch')
    """

    shapes: tuple[tuple[int, int, int], ...] = DEFAULT_SHAPES
    threads: tuple[int, ...] = (1, 2)
    impls: tuple[str, ...] | None = None  # default: tpp, tpp-tuned, numpy, tvm-default; below
    # float32 tpp, tpp-tuned, tpp-float32, numpy, torch
    work_dir: Path = Path("tvm_tpp_work")
    repeat: int = 10
    top_k: int = 8
    ms_trials: int = 64
    explain: bool = False
    seed: int = 0
    tvm_default_limit: float = TVM_DEFAULT_LIMIT
    tune_budget: float | None = None
    rounds: int = 5
    pause: float = PAUSE_SECONDS
    timeout: float = 3600.0
    worker_command: tuple[str, ...] = field(default_factory=worker_command)
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype takes {', '.join(DTYPES)}, got {self.dtype!r}")
        lowp = self.dtype != "float32"
        if self.impls is None:
            object.__setattr__(self, "impls", ("tpp", "tpp-tuned", "numpy") + (
                (TORCH,) if lowp else ("tvm-default",)))
        wrong = [i for i in self.impls if i in (_FLOAT32_ONLY if lowp else _LOWP_ONLY)]
        if wrong:
            only = "float32 GEMMs" if lowp else "GEMMs in int8 or bfloat16"
            raise ValueError(f"{', '.join(wrong)} {'run' if len(wrong) > 1 else 'runs'} "
                             f"{only} only, not {self.dtype} (--dtype)")
        if lowp and FLOAT32 not in self.impls:  # every row's 1x
            object.__setattr__(self, "impls", tuple(i for i in IMPLS
                                                    if i in self.impls or i == FLOAT32))
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
        self.job("tpp", min(self.threads))  # validates the worker's settings
        _ = self.sampling  # validates repeat

    @property
    def sampling(self) -> SamplingPolicy:
        """The fastest of samples of at least 1 ms: as many as fit in 0.4 s, at least
        ``repeat`` unless they exceed 10 s, at most 200; always after a warm-up."""
        return SamplingPolicy(samples=self.repeat, sample_seconds=1e-3, fill_seconds=0.4,
                              max_samples=200, slow_seconds=math.inf, budget_seconds=10.0,
                              min_samples=1)

    def workload_dtype(self, impl: str) -> str:
        """The dtype of the GEMMs row ``impl`` runs: float32 for tpp-float32 and numpy."""
        return "float32" if impl in (FLOAT32, "numpy") else self.dtype

    def job(self, impl: str, threads: int) -> Job:
        """The :class:`~tvm_tpp.bench.protocol.Job` of row ``impl``'s worker at ``threads``."""
        dtype = self.workload_dtype(impl)
        return Job(impl, threads, str(self.work_dir),
                   tuple(GemmWorkload(*shape, dtype) for shape in self.shapes), seed=self.seed,
                   ms_trials=self.ms_trials, top_k=self.top_k, tune_budget=self.tune_budget,
                   explain=self.explain, tvm_default_limit=self.tvm_default_limit)

    def planned_rounds(self, impl: str) -> int:
        """Rounds ``impl`` is timed in: ``tvm-default``, a hundred times slower, only one."""
        return 1 if impl == "tvm-default" else self.rounds


def dtype_peak(dtype: str, isa: Any, peak: dict[str, Any]) -> tuple[float, str] | None:
    """One core's peak in ``dtype`` on ``isa`` (a :class:`microkernels.isa.Isa`), in GOPS, and
    how it follows from the measured fp32 FMA ``peak`` (the peak worker's message); None where
    the ISA has no instruction for the dtype (its kernel emulates it).

    The rates of the kernels ``bench-kernel`` times: AMX tiles do
    :data:`microkernels.amx.OPS_PER_CYCLE` per cycle at the measured clock; a VNNI
    ``vpdpbusd`` does 4 u8 x s8 multiply-adds per 32-bit lane where an FMA does one, and an
    AVX512-BF16 ``vdpbf16ps`` 2 bf16 ones, at the FMA's rate: 4x and 2x the fp32 peak.

    Examples
    --------
    >>> from microkernels.isa import from_name
    >>> peak = {"isa": "avx512", "gflops_per_core": 100.0, "clock_ghz": 3.0}
    >>> dtype_peak("int8", from_name("avx512_bf16"), peak)[0]
    400.0
    >>> dtype_peak("bfloat16", from_name("amx"), peak)
    (3072.0, 'AMX 1024 bfloat16 ops per cycle x 3.00 GHz')
    >>> dtype_peak("bfloat16", from_name("avx512_vnni"), peak) is None
    True
    """
    fp32 = float(peak["gflops_per_core"])
    if dtype == "float32":
        return fp32, "fp32 FMA peak"
    dtype_a = "uint8" if dtype == "int8" else dtype
    if isa.has("amx_tile"):
        ops = _amx.OPS_PER_CYCLE[dtype_a]
        clock = float(peak["clock_ghz"])
        return ops * clock, f"AMX {ops} {dtype} ops per cycle x {clock:.2f} GHz"
    feature = _impls.native_feature(isa, dtype)
    if feature is None:
        return None
    factor = 4 if dtype == "int8" else 2
    return factor * fp32, f"{feature}: {factor} x the fp32 FMA peak"


def _row(impl: str, threads: int, m: int, n: int, k: int, **values: Any) -> dict[str, Any]:
    """A row of :data:`ROW_KEYS`, all None but the given values."""
    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    row.update(m=m, n=n, k=k, threads=threads, impl=impl, **values)
    return row


def _prepared_row(row: dict[str, Any], message: dict[str, Any]) -> dict[str, Any]:
    """``row`` with what the worker's ``prepared`` message says (no GFLOPS yet)."""
    if "skipped" in message:
        return {**row, "note": f"skipped: {message['skipped']}"}
    if not message.get("ok"):
        return {**row, "note": f"error: {message.get('error', 'failed')}"}
    values = {"tune_seconds": message.get("tune_seconds"),
              "max_abs_err": message.get("max_abs_err"), "note": message.get("notes") or None}
    if "explain" in message:
        values["explain"] = message["explain"]
    return {**row, **values}


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
    (``impl/tN``: that worker's preparation; ``timing/tN``: the alternating timing); for a
    low-precision run its dtype and ``dtype_peak`` (``{"dtype", "isa", "gops_per_core",
    "how"}``; ``gops_per_core`` None where the ISA emulates the dtype)."""

    rows: list[dict]
    peak: dict | None
    wall_seconds: dict[str, float] = field(default_factory=dict)
    peak_error: str | None = None
    load_average: tuple[float, float] | None = None
    dtype: str = "float32"
    dtype_peak: dict | None = None


def _prepare(config: BenchConfig, impl: _Impl, threads: int, bar: Progress) -> None:
    """Start ``impl``'s worker and wait until it has prepared every shape (or failed)."""
    impl.worker = start_worker(config.worker_command, config.job(impl.name, threads), impl.log)
    bar.say(f"t{threads}: preparing {impl.name}")

    def on_step(index: int, step: str) -> None:
        m, n, k = config.shapes[index]
        bar.say(f"t{threads}: preparing {impl.name} {m}x{n}x{k}: {step}")

    try:
        for message in prepared(impl.worker, config.timeout, on_step):
            index = int(message["prepared"])
            impl.rows[index] = _prepared_row(impl.rows[index], message)
            seconds = message.get("run_seconds") if message.get("ok") else None
            impl.run_seconds[index] = float(seconds) if seconds is not None else None
            impl.prepared = index + 1
            bar.advance()
    except WorkerError as err:
        bar.advance(len(impl.rows) - impl.prepared)
        impl.fail(impl.prepared, f"error: during preparation: {err}; log {impl.log}")
        return
    if all(seconds is None for seconds in impl.run_seconds):  # nothing to time: free it now
        impl.worker.close()
        impl.worker = None


def _peak(config: BenchConfig, log: Path) -> dict[str, Any]:
    """One message of the one-shot FMA-peak worker (``{"crashed": reason}`` if it failed)."""
    worker = start_worker(config.worker_command, Job(PEAK, 1, str(config.work_dir)), log)
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
                bar: Progress) -> None:
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
                # One measurement takes at most about the sampling budget or one run.
                samples = measure(impl.worker, index, config.sampling.plan(run_seconds),
                                  timeout=120.0 + 10 * run_seconds)
            except TimingError as err:
                impl.drop(index, f"error: {when}: {err}; log {impl.log}")
                continue
            except WorkerError as err:
                impl.fail(index, f"error: {when}: {err}; log {impl.log}")
                continue
            impl.figures[index].append(2 * m * n * k / min(samples) / 1e9)


def run_bench(config: BenchConfig, progress: bool = True) -> BenchResult:
    """Measure every (shape, threads, impl) with persistent workers, alternating.

    Per thread count, one worker per implementation prepares every shape, one worker after
    another; then per shape and round each live worker is asked for one measurement in turn
    (:mod:`tvm_tpp.bench.protocol`).  A worker that dies or times out gives error rows for
    the shapes it did not finish.
    """
    logs = config.work_dir / "logs"
    load_before = os.getloadavg()[0]
    peak: dict | None = None
    peak_error = "the peak worker sent nothing"
    rows: list[dict] = []
    walls: dict[str, float] = {}
    shapes = len(config.shapes)
    units = len(config.threads) * (1 + shapes * (len(config.impls) + sum(
        config.planned_rounds(impl) for impl in config.impls)))
    with Progress(progress, total=units) as bar:
        for threads in config.threads:
            impls: list[_Impl] = []
            try:
                for name in config.impls:
                    suffix = "" if config.dtype == "float32" else f"_{config.dtype}"
                    impl = _Impl(name, logs / f"bench_gemm_{name}{suffix}_t{threads}.log",
                                 [_row(name, threads, *s, dtype=config.workload_dtype(name))
                                  for s in config.shapes])
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
    lowp_peak = None
    if config.dtype != "float32":
        lowp_peak = _lowp_figures(rows, config.dtype, peak)
    order = {impl: n for n, impl in enumerate(IMPLS)}
    shape_order = {s: n for n, s in enumerate(config.shapes)}
    rows.sort(key=lambda r: (shape_order[(r["m"], r["n"], r["k"])], r["threads"],
                             order[r["impl"]]))
    return BenchResult(rows, peak, walls, None if peak else peak_error,
                       (load_before, os.getloadavg()[0]), config.dtype, lowp_peak)


def _lowp_figures(rows: list[dict], dtype: str, peak: dict | None) -> dict:
    """Set each row's ``ratio_to_fp32`` (over tpp-float32 of its shape and threads) and
    ``fraction_of_dtype_peak``; return the run's ``dtype_peak``."""
    from microkernels.machine import host_isa

    isa = host_isa()  # what the tpp workers' targets run: AMX only where tiles are granted
    found = dtype_peak(dtype, isa, peak) if peak is not None else None
    reference = {(r["m"], r["n"], r["k"], r["threads"]): r["gflops"] for r in rows
                 if r["impl"] == FLOAT32}
    for row in rows:
        fp32 = reference.get((row["m"], row["n"], row["k"], row["threads"]))
        if row["gflops"] is not None and fp32:
            row["ratio_to_fp32"] = row["gflops"] / fp32
        if row["gflops"] is not None and found is not None:
            row["fraction_of_dtype_peak"] = row["gflops"] / (found[0] * row["threads"])
    how = (found[1] if found else "the peak is unknown" if peak is None
           else f"{isa.name} has no {dtype} instruction ({'/'.join(_impls.NATIVE_FEATURES[dtype])}"
                "): its kernel emulates it")
    return {"dtype": dtype, "isa": isa.name, "gops_per_core": found[0] if found else None,
            "how": how}


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


def print_lowp_report(result: BenchResult, explain: bool = False) -> None:
    """The table of a low-precision run: GOPS, ratio to tpp-float32, fractions of the dtype's
    and the fp32 peak; then the peaks, ``--explain``'s rankings, wall times and load."""
    from rich.console import Console
    from rich.table import Table

    from .report import _print_explanation

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    console = Console() if sys.stdout.isatty() else Console(width=180)
    units = {"int8": "uint8 X x int8 W -> int32", "bfloat16": "bf16 X x bf16 W -> float32"}
    table = Table(title=f"{result.dtype} GEMM Y = X @ W, {units[result.dtype]} (GOPS: fastest "
                        "sample; x fp32: over tpp-float32)")
    for name, justify in (("M x N x K", "left"), ("thr", "right"), ("impl", "left"),
                          ("dtype", "left"), ("GOPS", "right"), ("x fp32", "right"),
                          (f"% {result.dtype} peak", "right"), ("% fp32 peak", "right"),
                          ("tune s", "right"), ("max abs err", "right"), ("note", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in result.rows:
        table.add_row(f"{r['m']}x{r['n']}x{r['k']}", str(r["threads"]), r["impl"], r["dtype"],
                      fmt(r["gflops"], ".1f"), fmt(r["ratio_to_fp32"], ".2f"),
                      fmt(r["fraction_of_dtype_peak"] and 100 * r["fraction_of_dtype_peak"],
                          ".1f"),
                      fmt(r["fraction_of_peak"] and 100 * r["fraction_of_peak"], ".1f"),
                      fmt(r["tune_seconds"], ".1f"), fmt(r["max_abs_err"], ".1e"),
                      r["note"] or "")
    console.print(table)
    peak, lowp = result.peak, result.dtype_peak or {}
    if peak is None:
        console.print(f"fp32 peak unknown ({result.peak_error}): fractions of peak are null")
    else:
        console.print(f"fp32 peak: {peak['gflops_per_core']:.1f} GFLOPS per core ({peak['isa']} "
                      f"FMA at {peak['clock_ghz']:.2f} GHz, measured)")
    if lowp.get("gops_per_core") is not None:
        console.print(f"{result.dtype} peak on {lowp['isa']}: {lowp['gops_per_core']:.1f} GOPS "
                      f"per core ({lowp['how']}); % peak = GOPS / (threads x that)")
    elif lowp:
        console.print(f"{result.dtype} peak: none ({lowp['how']})")
    for r in result.rows if explain else ():
        if "explain" in r:
            _print_explanation(console, f"{r['m']}x{r['n']}x{r['k']} t{r['threads']} "
                               f"{r['dtype']}: model ranking vs measurement", r["explain"])
    walls = ", ".join(f"{key} {seconds:.0f} s" for key, seconds in result.wall_seconds.items())
    console.print(f"wall times (impl/tN: preparing that worker; timing/tN: the alternating "
                  f"rounds): {walls}")
    if result.load_average is not None:
        before, after = result.load_average
        console.print(f"1-minute load average: {before:.1f} before, {after:.1f} after "
                      f"({os.cpu_count()} CPUs; other processes distort the timings)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench-gemm`` options."""
    default_shapes = ",".join(f"{m}x{n}x{k}" for m, n, k in DEFAULT_SHAPES)
    parser.add_argument("--dtype", default="float32", metavar="{" + ",".join(DTYPES) + "}",
                        help="float32; int8: uint8 x int8 -> int32; bfloat16: bf16 x bf16 -> "
                             "float32 (adds tpp-float32, every row's 1x)")
    parser.add_argument("--shapes", default=default_shapes,
                        help="comma-separated MxNxK GEMMs (default: square, BERT-base, DLRM)")
    parser.add_argument("--threads", default="1,2", help="thread counts, e.g. 1,2")
    parser.add_argument("--against",
                        help="baselines to include (tpp and tpp-tuned always run): "
                             + ",".join(BASELINES) + "; or 'none' (default: numpy,tvm-default; "
                             "below float32 numpy,torch: torch is optional, tvm-default and "
                             "metaschedule are float32 only)")
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


def _config(args: argparse.Namespace) -> BenchConfig:
    """The :class:`BenchConfig` of ``bench-gemm``'s options (ValueError if they are bad)."""
    dtype = args.dtype.strip().lower()
    if dtype not in DTYPES:
        raise ValueError(f"--dtype takes {', '.join(DTYPES)}, got {args.dtype!r}")
    text = args.against or ("numpy,tvm-default" if dtype == "float32" else f"numpy,{TORCH}")
    against = [] if text.strip() == "none" else [
        a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in against if a not in BASELINES]
    if unknown:
        raise ValueError(f"--against takes {', '.join(BASELINES)} (or none), got {unknown}")
    return BenchConfig(
        shapes=parse_shapes(args.shapes), threads=_int_list(args.threads, "--threads"),
        impls=tuple(i for i in IMPLS if i in ("tpp", "tpp-tuned") or i in against),
        work_dir=Path(args.work_dir), repeat=args.repeat, top_k=args.top_k,
        ms_trials=args.ms_trials, explain=args.explain, seed=args.seed,
        tvm_default_limit=args.tvm_default_limit, tune_budget=args.tune_budget,
        rounds=args.rounds, dtype=dtype,
    )


def run(args: argparse.Namespace) -> int:
    """Run ``bench-gemm``; 0 unless a measurement failed.

    Raises
    ------
    UsageError
        Bad options.
    """
    from .plots import plot_gemm
    from .report import print_gemm_report

    try:
        config = _config(args)
    except ValueError as err:
        raise UsageError(str(err)) from None
    result = run_bench(config, progress=not args.quiet)
    if config.dtype == "float32":
        print_gemm_report(result, config.explain)
    else:
        print_lowp_report(result, config.explain)
    rows = result.rows
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {plot_gemm(rows, args.plot)}")
    failed = any((r["note"] or "").startswith("error") for r in rows)
    return 1 if failed else 0
