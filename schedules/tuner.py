"""A seconds-long tuner over PARLOOPER's outer-loop space, with a persistent database.

The microkernel is fixed; only block sizes, loop order, blocking and parallel loops vary.
For each GEMM the tuner

1. takes a few block-size choices around :func:`schedules.blocking.default_config`
   (the whole K in one BRGEMM call, or one K block per call so the K loop is tunable too),
2. generates PARLOOPER's candidates for each (:func:`schedules.space.generate`),
3. ranks them all with the cache-trace model (:func:`schedules.cost_model.rank`),
4. builds the untuned default and the model's ``top_k``, a few per LLVM module, and times
   them interleaved (each batch next to the best so far, which a newcomer must beat by
   :data:`MARGIN`), within an optional time budget, and
5. keeps the winner in a JSON database keyed by (op, shape, dtype, epilogue, target), so the
   same GEMM costs nothing the second time.

Examples
--------
>>> from schedules.gemm import GemmProblem
>>> db = Database("tuning.json")                                         # doctest: +SKIP
>>> result = tune_gemm(GemmProblem(128, 768, 768), target, database=db)  # doctest: +SKIP
>>> result.best.spec, result.cached                                       # doctest: +SKIP
('cBCa', False)
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from microkernels import isa as _isa

from .blocking import default_config
from .cost_model import rank
from .gemm import GemmConfig, GemmProblem, pack_weight, schedule
from .space import Candidate, generate

if TYPE_CHECKING:
    from tvm.target import Target

__all__ = ["TuningKey", "Database", "Measurement", "TuneResult", "Tuner", "tune_gemm", "measure",
           "build", "time_interleaved", "BATCH", "MARGIN"]


@dataclass(frozen=True)
class TuningKey:
    """What a tuning result is valid for."""

    op: str
    m: int
    n: int
    k: int
    dtype: str
    epilogue: str
    target: str

    @classmethod
    def of(cls, problem: GemmProblem, target: Target) -> TuningKey:
        attrs = target.attrs
        where = f"{attrs.get('model', '')}/{attrs.get('mcpu', '')}/{attrs.get('num-cores', 1)}t"
        return cls("dense", problem.m, problem.n, problem.k, problem.dtype,
                   problem.epilogue.name, where)

    def text(self) -> str:
        return f"{self.op}|{self.m}x{self.n}x{self.k}|{self.dtype}|{self.epilogue}|{self.target}"


def _config_to_json(config: GemmConfig) -> dict:
    c = config.candidate
    return {"bm": config.bm, "bn": config.bn, "bk": config.bk, "spec": c.spec,
            "block_steps": {k: list(v) for k, v in c.block_steps.items()},
            "steps": dict(c.steps)}


def _config_from_json(data: dict) -> GemmConfig:
    candidate = Candidate(data["spec"], {k: tuple(v) for k, v in data["block_steps"].items()},
                          data["steps"])
    return GemmConfig(data["bm"], data["bn"], data["bk"], candidate)


class Database:
    """Tuning results in one JSON file, rewritten atomically on every update.

    Parameters
    ----------
    path
        The file; created on the first :meth:`put`.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._records: dict[str, dict] = {}
        if self.path.is_file():
            try:
                self._records = json.loads(self.path.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"tuning database {self.path} is corrupt: {err}") from None

    def __len__(self) -> int:
        return len(self._records)

    def get(self, key: TuningKey) -> GemmConfig | None:
        record = self._records.get(key.text())
        return _config_from_json(record["config"]) if record else None

    def record(self, key: TuningKey) -> dict | None:
        """The stored record (config, measured GFLOPS, tuning seconds, measurements)."""
        return self._records.get(key.text())

    def put(self, key: TuningKey, config: GemmConfig, **details: object) -> None:
        self._records[key.text()] = {"config": _config_to_json(config), **details}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self._records, indent=1, sort_keys=True))
        tmp.replace(self.path)


@dataclass(frozen=True)
class Measurement:
    """One candidate: the model's rank and prediction, and what it measured."""

    config: GemmConfig
    model_rank: int | None
    predicted_cycles: float | None
    seconds: float | None = None
    error: str | None = None

    def gflops(self, problem: GemmProblem) -> float | None:
        return problem.flops / self.seconds / 1e9 if self.seconds else None

    def to_json(self) -> dict:
        return {"config": _config_to_json(self.config), "model_rank": self.model_rank,
                "predicted_cycles": self.predicted_cycles, "seconds": self.seconds,
                "error": self.error}


@dataclass(frozen=True)
class TuneResult:
    best: GemmConfig
    cached: bool
    tune_seconds: float
    measurements: tuple[Measurement, ...] = field(default=())
    candidates: int = 0


def _blockings(problem: GemmProblem, isa: _isa.Isa, caches, threads: int) -> list[GemmConfig]:
    base = default_config(problem.m, problem.n, problem.k, isa, caches, threads)
    k_blocks = problem.k // base.bk
    out = [base]
    if k_blocks > 1:
        out.append(GemmConfig(base.bm, base.bn, base.bk, Candidate("BCa")))
    return out


#: Candidates compiled per module: one LLVM invocation for several, and a budgeted tuner
#: checks its clock between modules.
BATCH = 5
#: A candidate replaces the incumbent only if it is this much faster: timings of equal
#: programs differ by about this much on a shared machine.
MARGIN = 0.02
#: Seconds of samples per candidate per round (at least one run each).
_ROUND_SECONDS = 0.05
_ROUNDS = 3


def _operands(problem: GemmProblem, bns: set[int]) -> tuple[list, dict[int, object]]:
    """Shared arguments (X first, then epilogue operands and Y) and the packed W per ``bn``."""
    import numpy as np
    import tvm

    rng = np.random.default_rng(0)
    x = rng.standard_normal((problem.m, problem.k)).astype("float32")
    w = rng.standard_normal((problem.k, problem.n)).astype("float32")
    rest = [tvm.runtime.tensor(rng.standard_normal(op.shape(problem.m, problem.n))
                               .astype("float32"))
            for op in problem.epilogue.inputs("float32")]
    rest.append(tvm.runtime.empty((problem.m, problem.n), "float32"))
    return [tvm.runtime.tensor(x), *rest], {bn: tvm.runtime.tensor(pack_weight(w, bn))
                                            for bn in bns}


def build(problem: GemmProblem, configs: list[GemmConfig], target: Target, isa: str
          ) -> list[Callable[..., object] | str]:
    """Schedule ``configs`` and compile them as one module: per config its function, or the
    error that kept it from being built."""
    import tvm

    out: list[Callable[..., object] | str] = []
    funcs = {}
    for i, config in enumerate(configs):
        try:
            funcs[i] = schedule(problem, config, isa).mod["main"].with_attr(
                "global_symbol", f"candidate{i}")
            out.append("")
        except Exception as err:  # a candidate that cannot be scheduled is recorded, skipped
            out.append(f"{type(err).__name__}: {err}"[:200])
    if not funcs:
        return out
    try:
        ex = tvm.compile(tvm.IRModule({f"candidate{i}": f for i, f in funcs.items()}),
                         target=target)
        for i in funcs:
            out[i] = ex.mod[f"candidate{i}"]
    except Exception:  # one bad function fails the module: find which, one by one
        for i, func in funcs.items():
            try:
                out[i] = tvm.compile(tvm.IRModule({f"candidate{i}": func}),
                                     target=target).mod[f"candidate{i}"]
            except Exception as err:
                out[i] = f"{type(err).__name__}: {err}"[:200]
    return out


def time_interleaved(runs: list[Callable[[], None]], rounds: int = _ROUNDS,
                     round_seconds: float = _ROUND_SECONDS) -> list[float]:
    """Seconds of one call of each function: the fastest of samples taken in ``rounds``
    interleaved rounds, so drift of the machine's load hits every candidate alike and the
    minimum is a run that went undisturbed."""
    import time as _time

    best = [float("inf")] * len(runs)
    for i, run in enumerate(runs):  # warm-up, and a first estimate
        start = _time.perf_counter()
        run()
        best[i] = _time.perf_counter() - start
    for _ in range(rounds):
        for i, run in enumerate(runs):
            for _ in range(max(1, min(20, int(round_seconds / best[i])))):
                start = _time.perf_counter()
                run()
                best[i] = min(best[i], _time.perf_counter() - start)
    return best


def measure(problem: GemmProblem, configs: list[GemmConfig], target: Target, isa: str
            ) -> list[float | str]:
    """Build ``configs`` together and time them interleaved: seconds of one run, or the
    error of a candidate that could not be built."""
    built = build(problem, configs, target, isa)
    timed = [i for i, b in enumerate(built) if not isinstance(b, str)]
    if not timed:
        return list(built)  # type: ignore[arg-type]
    inputs, weights = _operands(problem, {configs[i].bn for i in timed})

    def runner(i: int) -> Callable[[], None]:
        args = [inputs[0], weights[configs[i].bn], *inputs[1:]]
        return lambda: built[i](*args)  # type: ignore[operator]

    seconds = time_interleaved([runner(i) for i in timed])
    out: list[float | str] = list(built)  # type: ignore[arg-type]
    for i, t in zip(timed, seconds, strict=True):
        out[i] = t
    return out


def tune_gemm(
    problem: GemmProblem,
    target: Target,
    *,
    database: Database | None = None,
    top_k: int = 8,
    max_candidates: int = 400,
    budget_seconds: float | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> TuneResult:
    """The fastest configuration for ``problem`` on ``target`` (from the database if known).

    The default configuration and the model's best candidates are built :data:`BATCH` at a
    time and timed interleaved with the best so far; a candidate replaces it only when
    :data:`MARGIN` faster, so tuning never keeps a configuration that merely measured lucky
    over the default.

    Parameters
    ----------
    top_k
        How many of the model's best candidates may be built and timed (plus the default).
    max_candidates
        Cap on generated candidates per block-size choice.
    budget_seconds
        Stop starting new batches once this much time is spent or the next batch would
        exceed it (the first batch, with the default, always runs).
    progress
        Called with (done, total) after each batch.
    """
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    key = TuningKey.of(problem, target)
    if database is not None and (known := database.get(key)) is not None:
        return TuneResult(known, cached=True, tune_seconds=0.0)
    start = time.perf_counter()
    isa = _isa.from_name(str(target.attrs["model"]))
    threads = int(target.attrs.get("num-cores", 1))
    caches = _isa.caches()
    ranked: list[tuple[float, GemmConfig]] = []
    blockings = _blockings(problem, isa, caches, threads)
    # Two FMA pipes per core, each a vector of fp32 multiply-adds per cycle.
    peak = 2 * 2 * isa.lanes("float32")
    for blocking in blockings:
        blocked = blocking.blocked(problem)
        candidates = generate(*blocked.trips, steps=(blocking.k_step, 1, 1),
                              require_parallel=threads > 1, max_candidates=max_candidates)
        for cycles, candidate in rank(candidates, blocked, caches, threads,
                                      peak_flops_per_cycle=peak):
            ranked.append((cycles, GemmConfig(blocking.bm, blocking.bn, blocking.bk, candidate)))
    ranked.sort(key=lambda pair: pair[0])
    default = blockings[0]
    chosen: list[tuple[int | None, float | None, GemmConfig]] = [(None, None, default)]
    chosen += [(n, cycles, cfg) for n, (cycles, cfg) in enumerate(ranked)
               if cfg != default][:top_k]

    measurements: list[Measurement] = []
    incumbent: Measurement | None = None
    for first in range(0, len(chosen), BATCH):
        batch = chosen[first:first + BATCH]
        spent = time.perf_counter() - start
        if budget_seconds is not None and first and spent * (first + len(batch)) / first > \
                budget_seconds:
            break
        configs = [cfg for _, _, cfg in batch]
        if incumbent is not None:  # re-timed next to the newcomers
            configs.append(incumbent.config)
        results = measure(problem, configs, target, isa.name)
        if incumbent is not None:
            again = results.pop()
            if isinstance(again, float):
                incumbent = replace(incumbent, seconds=min(incumbent.seconds, again))
        for (model_rank, cycles, config), result in zip(batch, results, strict=True):
            m = (Measurement(config, model_rank, cycles, seconds=result)
                 if isinstance(result, float)
                 else Measurement(config, model_rank, cycles, error=result))
            measurements.append(m)
            if m.seconds is not None and (incumbent is None
                                          or m.seconds < incumbent.seconds * (1 - MARGIN)):
                incumbent = m
        if progress is not None:
            progress(min(first + BATCH, len(chosen)), len(chosen))
    if incumbent is None:
        raise RuntimeError(f"no candidate could be built for {key.text()}: "
                           f"{measurements[0].error}")
    seconds = time.perf_counter() - start
    if database is not None:
        database.put(key, incumbent.config, gflops=incumbent.gflops(problem),
                     tune_seconds=seconds, candidates=len(ranked),
                     measured=[m.to_json() for m in measurements])
    return TuneResult(incumbent.config, cached=False, tune_seconds=seconds,
                      measurements=tuple(measurements), candidates=len(ranked))


@dataclass
class Tuner:
    """What the graph passes call for each GEMM: tune it (or look it up) and remember it.

    Parameters
    ----------
    database
        Where results persist.
    top_k
        Candidates measured per GEMM.
    budget_seconds
        Time budget per GEMM (see :func:`tune_gemm`).
    tune_missing
        Tune GEMMs the database does not know; otherwise :meth:`config` returns None for them.
    on_result
        Called with ``(problem, result)`` after each GEMM, e.g. to print progress.
    """

    database: Database
    top_k: int = 8
    budget_seconds: float | None = None
    tune_missing: bool = True
    on_result: Callable[[GemmProblem, TuneResult], None] | None = None

    def config(self, problem: GemmProblem, target: Target) -> GemmConfig | None:
        if not self.tune_missing and self.database.get(TuningKey.of(problem, target)) is None:
            return None
        result = tune_gemm(problem, target, database=self.database, top_k=self.top_k,
                           budget_seconds=self.budget_seconds)
        if self.on_result is not None:
            self.on_result(problem, result)
        return result.best
