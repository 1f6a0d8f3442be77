"""A seconds-long tuner over PARLOOPER's outer-loop space, with a persistent database.

The microkernel is fixed; only block sizes, loop order, blocking and parallel loops vary.
For each GEMM the tuner

1. takes a few block-size choices around :func:`schedules.blocking.default_config`
   (the whole K in one BRGEMM call, or one K block per call so the K loop is tunable too),
2. generates PARLOOPER's candidates for each (:func:`schedules.space.generate`),
3. ranks them all with the cache-trace model (:func:`schedules.cost_model.rank`),
4. builds and times the model's ``top_k`` plus the untuned default with TVM's
   ``time_evaluator``, and
5. keeps the fastest in a JSON database keyed by (op, shape, dtype, epilogue, target), so the
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from microkernels import isa as _isa

from .blocking import default_config
from .cost_model import rank
from .gemm import GemmConfig, GemmProblem, pack_weight, schedule
from .space import Candidate, generate

if TYPE_CHECKING:
    from tvm.target import Target

__all__ = ["TuningKey", "Database", "Measurement", "TuneResult", "Tuner", "tune_gemm", "measure"]


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


def measure(problem: GemmProblem, config: GemmConfig, target: Target, isa: str,
            repeat: int = 15, min_repeat_ms: int = 5) -> float:
    """Seconds of one run of the scheduled GEMM built for ``target``: the fastest of many
    short samples, which other load on a shared machine can only slow down."""
    import numpy as np
    import tvm

    func = tvm.compile(schedule(problem, config, isa).mod, target=target)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((problem.m, problem.k)).astype("float32")
    w = rng.standard_normal((problem.k, problem.n)).astype("float32")
    args = [tvm.runtime.tensor(x), tvm.runtime.tensor(pack_weight(w, config.bn))]
    args += [tvm.runtime.tensor(rng.standard_normal(op.shape(problem.m, problem.n))
                                .astype("float32"))
             for op in problem.epilogue.inputs("float32")]
    args.append(tvm.runtime.empty((problem.m, problem.n), "float32"))
    timer = func.mod.time_evaluator(func.mod.entry_name, tvm.cpu(), number=1, repeat=repeat,
                                    min_repeat_ms=min_repeat_ms)
    return float(np.min(timer(*args).results))


def tune_gemm(
    problem: GemmProblem,
    target: Target,
    *,
    database: Database | None = None,
    top_k: int = 8,
    max_candidates: int = 400,
    progress: Callable[[int, int], None] | None = None,
) -> TuneResult:
    """The fastest configuration for ``problem`` on ``target`` (from the database if known).

    Parameters
    ----------
    top_k
        How many of the model's best candidates are built and timed (plus the default).
    max_candidates
        Cap on generated candidates per block-size choice.
    progress
        Called with (done, total) after each measurement.
    """
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
    chosen = [(n, cycles, cfg) for n, (cycles, cfg) in enumerate(ranked[:top_k])]
    default = blockings[0]
    if all(cfg != default for _, _, cfg in chosen):
        chosen.append((None, None, default))

    measurements = []
    for done, (model_rank, cycles, config) in enumerate(chosen, 1):
        try:
            seconds = measure(problem, config, target, isa.name)
            measurements.append(Measurement(config, model_rank, cycles, seconds))
        except Exception as err:  # a candidate TVM cannot build is skipped, and recorded
            measurements.append(Measurement(config, model_rank, cycles, error=str(err)[:200]))
        if progress is not None:
            progress(done, len(chosen))
    timed = [m for m in measurements if m.seconds is not None]
    if not timed:
        raise RuntimeError(f"no candidate could be built for {key.text()}: "
                           f"{measurements[0].error}")
    best = min(timed, key=lambda m: m.seconds)
    seconds = time.perf_counter() - start
    if database is not None:
        database.put(key, best.config, gflops=best.gflops(problem), tune_seconds=seconds,
                     candidates=len(ranked),
                     measured=[m.to_json() for m in measurements])
    return TuneResult(best.config, cached=False, tune_seconds=seconds,
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
    tune_missing
        Tune GEMMs the database does not know; otherwise :meth:`config` returns None for them.
    on_result
        Called with ``(problem, result)`` after each GEMM, e.g. to print progress.
    """

    database: Database
    top_k: int = 8
    tune_missing: bool = True
    on_result: Callable[[GemmProblem, TuneResult], None] | None = None

    def config(self, problem: GemmProblem, target: Target) -> GemmConfig | None:
        if not self.tune_missing and self.database.get(TuningKey.of(problem, target)) is None:
            return None
        result = tune_gemm(problem, target, database=self.database, top_k=self.top_k)
        if self.on_result is not None:
            self.on_result(problem, result)
        return result.best
