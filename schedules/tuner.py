"""A seconds-long tuner over the outer-loop spaces of the GEMM, conv and batch-GEMM templates.

The microkernel is fixed; only block sizes, loop order, blocking and parallel loops vary.
For each operator the tuner

1. lists candidates, the untuned default first:

   * a dense GEMM takes a few blockings around :func:`schedules.blocking.default_config`
     (the whole K in one BRGEMM call; one K block per call, so the K loop is tunable too;
     one K block per call with A packed under the outermost K loop, as BLAS does for long
     K), PARLOOPER's candidates for each (:func:`schedules.space.generate`), ranked
     within each blocking by the cache-trace model (:func:`schedules.cost_model.predict`,
     which sees loop orders and the copies of packing, not the kernel's efficiency at each
     block size: measurement decides between the blockings);
   * a convolution or a batch GEMM takes the short list of its template
     (:func:`schedules.conv.candidates`, :func:`schedules.batch_gemm.candidates`), which
     no model ranks: measurement decides;

2. builds the default and the next ``top_k``, a few per LLVM module, and times them
   interleaved (each batch next to the best so far, which a newcomer must beat by
   :data:`MARGIN`), within an optional time budget, and
3. keeps the winner in a JSON database keyed by (op, shape, dtype, epilogue, target), so the
   same operator costs nothing the second time.

Each kind of operator is one :class:`Op` (its key, candidates, schedule and config JSON);
:func:`tune` is the same loop for all of them.

Examples
--------
>>> from schedules.gemm import GemmProblem
>>> db = Database("tuning.json")                                    # doctest: +SKIP
>>> result = tune(GemmProblem(128, 768, 768), target, database=db)  # doctest: +SKIP
>>> result.best.spec, result.cached                                  # doctest: +SKIP
('cBCa', False)
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from microkernels import isa as _isa
from microkernels.machine import machine_of
from microkernels.peak import flops_per_cycle

from . import batch_gemm, conv
from .batch_gemm import BatchGemmConfig, BatchGemmProblem
from .blocking import GEMV_ROWS, default_config, long_k_config, whole_k_config
from .conv import ConvConfig, ConvProblem
from .cost_model import predict
from .gemm import GemmConfig, GemmProblem
from .gemm import schedule as gemm_schedule
from .space import Candidate, generate

if TYPE_CHECKING:
    from tvm import s_tir
    from tvm.target import Target
    from tvm.tirx import PrimFunc

__all__ = ["Op", "OPS", "TuningKey", "Database", "Measurement", "TuneResult", "Tuner",
           "TaskCollector", "tune", "config_for", "problem_text", "config_text", "measure",
           "build", "ranked_configs", "time_interleaved", "BATCH", "MARGIN", "FINAL_WINDOW",
           "MODEL_RESOLUTION"]

Problem = GemmProblem | ConvProblem | BatchGemmProblem
Config = GemmConfig | ConvConfig | BatchGemmConfig


class Choice(NamedTuple):
    """A candidate to measure, with the cost model's verdict (all None when unranked).

    ``rank`` counts the candidates of its blocking predicted strictly faster, ``model_class``
    those predicted faster by more than :data:`MODEL_RESOLUTION` (0-based both).
    """

    rank: int | None
    model_class: int | None
    cycles: float | None
    config: Config


@dataclass(frozen=True)
class Op:
    """What the tuner needs to know of one kind of operator.

    Parameters
    ----------
    name
        The key's op (``"dense"``, ``"conv2d"``, ``"batch_gemm"``).
    problem, config
        Its problem and configuration classes.
    key
        ``problem -> (shape, layout, dtype)`` for the :class:`TuningKey`.
    default
        ``(problem, isa, caches, threads) -> config``: the untuned heuristic.
    choices
        ``(problem, isa, caches, threads, max_candidates) -> (choices, generated)``: the
        candidates in measuring order, the default first, and how many were considered.
    schedule
        ``(problem, config, isa) -> Schedule``.
    to_json, from_json
        A config to and from its database record.
    text
        A config as one short line.

    Examples
    --------
    >>> OPS["conv2d"].text(ConvConfig(bq=28, bc=64, bk=64))
    'ACDebfg bq=28 bc=64 bk=64 c_step=1'
    """

    name: str
    problem: type
    config: type
    key: Callable[[Any], tuple[tuple[int, ...], str, str]]
    default: Callable[[Any, _isa.Isa, _isa.Caches, int], Any]
    choices: Callable[[Any, _isa.Isa, _isa.Caches, int, int], tuple[list[Choice], int]]
    schedule: Callable[[Any, Any, str], s_tir.Schedule]
    to_json: Callable[[Any], dict]
    from_json: Callable[[dict], Any]
    text: Callable[[Any], str]


def _dense_default(problem: GemmProblem, isa: _isa.Isa, caches: _isa.Caches, threads: int
                   ) -> GemmConfig:
    return default_config(problem.m, problem.n, problem.k, isa, caches, threads)


def _blockings(problem: GemmProblem, isa: _isa.Isa, caches: _isa.Caches, threads: int
               ) -> list[GemmConfig]:
    """The default first, then the other blockings whose loop orders are generated: when
    K spans several blocks, the whole K per call, one K block per call, and (beyond a GEMV's
    rows) one K block per call with A packed under the outermost K loop
    (:func:`~schedules.blocking.long_k_config`)."""
    base = _dense_default(problem, isa, caches, threads)
    out = [base]
    k_blocks = problem.k // base.bk
    if k_blocks > 1:
        whole = whole_k_config(problem.m, problem.n, problem.k, isa, caches, threads)
        split = GemmConfig(whole.bm, whole.bn, whole.bk, Candidate("BCa"))
        packed = (long_k_config(problem.m, base.bn, base.bk, threads)
                  if problem.m > GEMV_ROWS else None)
        out += [c for c in (whole, split, packed) if c is not None and c != base]
    return out


def ranked_configs(problem: GemmProblem, blocking: GemmConfig, isa: _isa.Isa,
                   caches: _isa.Caches, threads: int, max_candidates: int = 400
                   ) -> list[tuple[float, GemmConfig]]:
    """PARLOOPER's loop orders (:func:`~schedules.space.generate`) with ``blocking``'s block
    sizes and packing, as ``(predicted cycles, config)``, best predicted first.

    A packed config is kept only if an N loop runs under its packing, i.e. the packed A is
    reused; ``blocking`` itself is always ranked.

    Examples
    --------
    >>> base = GemmConfig.of("acb", 256, 64, 512, pack_a=1)
    >>> ranked_configs(GemmProblem(1024, 1024, 1024), base, avx512, caches, 1)[0][1].spec
    ...                                                             # doctest: +SKIP
    'bac'
    """
    peak = flops_per_cycle(isa.name)
    blocked = blocking.blocked(problem)  # the same block sizes for every loop order
    candidates = generate(*blocked.trips, steps=(blocking.k_step, 1, 1),
                          require_parallel=threads > 1, max_candidates=max_candidates)
    configs = [cfg for cfg in map(blocking.with_candidate, candidates)
               if cfg.pack_a is None or cfg.reuses_packed_a()]
    if blocking not in configs:  # the sampled space left it out: rank it all the same
        configs.append(blocking)
    return sorted(((predict(cfg.candidate, blocked, caches, threads,
                            peak_flops_per_cycle=peak, pack_a=cfg.pack_a), cfg)
                   for cfg in configs), key=lambda pair: pair[0])


def _dense_choices(problem: GemmProblem, isa: _isa.Isa, caches: _isa.Caches, threads: int,
                   max_candidates: int) -> tuple[list[Choice], int]:
    """The default, then the model's best loop orders of every blocking in turn, each with
    its model rank (the default's too).

    The model ranks the loop orders (and where A is packed) of one blocking
    (:func:`ranked_configs`); it does not see how block sizes change the kernel's own
    efficiency, so it cannot rank blockings against each other: each gets its share of the
    measurements.  A candidate's rank counts the candidates of its blocking predicted
    strictly faster (equal predictions share a rank), its class those predicted faster by
    more than the model's resolution (PARLOOPER's "modeled classes", [PL] Fig. 6).
    """
    blockings = _blockings(problem, isa, caches, threads)
    families = [ranked_configs(problem, b, isa, caches, threads, max_candidates)
                for b in blockings]
    default = blockings[0]
    # Ranks count the candidates predicted faster: bisect the sorted predictions.
    sorted_cycles = [[cycles for cycles, _ in family] for family in families]

    def choice(cycles: float, config: GemmConfig, cycles_of: list[float]) -> Choice:
        return Choice(bisect.bisect_left(cycles_of, cycles),
                      bisect.bisect_left(cycles_of, cycles * (1 - MODEL_RESOLUTION)),
                      cycles, config)

    cycles = next(c for c, cfg in families[0] if cfg == default)
    choices = [choice(cycles, default, sorted_cycles[0])]
    for n in range(max(map(len, families))):
        choices += [choice(*family[n], cycles_of)
                    for family, cycles_of in zip(families, sorted_cycles, strict=True)
                    if n < len(family) and family[n][1] != default]
    return choices, sum(map(len, families))


def _unranked(configs: list[Config]) -> tuple[list[Choice], int]:
    return [Choice(None, None, None, config) for config in configs], len(configs)


def _dense_to_json(config: GemmConfig) -> dict:
    c = config.candidate
    return {"bm": config.bm, "bn": config.bn, "bk": config.bk, "spec": c.spec,
            "block_steps": {k: list(v) for k, v in c.block_steps.items()},
            "steps": dict(c.steps), "pack_a": config.pack_a}


def _dense_from_json(data: dict) -> GemmConfig:
    candidate = Candidate(data["spec"], {k: tuple(v) for k, v in data["block_steps"].items()},
                          data["steps"])
    return GemmConfig(data["bm"], data["bn"], data["bk"], candidate, data.get("pack_a"))


def _fields_to_json(config: ConvConfig | BatchGemmConfig) -> dict:
    """A flat config's fields (block steps as a plain dict): ``type(config)(**json)`` again."""
    values = {f.name: getattr(config, f.name) for f in fields(config)}
    return {name: dict(v) if isinstance(v, Mapping) else v for name, v in values.items()}


def _steps_text(block_steps: Mapping[str, tuple[int, ...]]) -> str:
    return f" {dict(block_steps)}" if block_steps else ""


def _conv_key(p: ConvProblem) -> tuple[tuple[int, ...], str, str]:
    (sh, sw), pads = p.stride, "x".join(map(str, p.padding))
    return (p.n, p.c, p.h, p.w, p.k, p.r, p.s), f"s{sh}x{sw}p{pads}", p.dtype


#: The operators the tuner handles, by the key's op name.
OPS: dict[str, Op] = {op.name: op for op in (
    Op("dense", GemmProblem, GemmConfig,
       key=lambda p: ((p.m, p.n, p.k), "", p.dtype),
       default=_dense_default,
       choices=_dense_choices,
       schedule=gemm_schedule,
       to_json=_dense_to_json,
       from_json=_dense_from_json,
       text=lambda c: (f"{c.spec} bm={c.bm} bn={c.bn} bk={c.bk} k_step={c.k_step}"
                       + _steps_text(c.candidate.block_steps)
                       + ("" if c.pack_a is None else f" pack_a={c.pack_a}"))),
    Op("conv2d", ConvProblem, ConvConfig,
       key=_conv_key,
       default=conv.default_config,
       choices=lambda p, isa, caches, threads, _: _unranked(
           conv.candidates(p, isa, caches, threads)),
       schedule=conv.schedule,
       to_json=_fields_to_json,
       from_json=lambda data: ConvConfig(**data),
       text=lambda c: (f"{c.spec} bq={c.bq} bc={c.bc} bk={c.bk} c_step={c.c_step}"
                       + _steps_text(c.block_steps))),
    Op("batch_gemm", BatchGemmProblem, BatchGemmConfig,
       key=lambda p: ((p.batch, p.m, p.n, p.k), p.layout, "float32"),
       default=lambda p, isa, _caches, threads: batch_gemm.default_config(p, isa, threads),
       choices=lambda p, isa, _caches, threads, _: _unranked(
           batch_gemm.candidates(p, isa, threads)),
       schedule=batch_gemm.schedule,
       to_json=_fields_to_json,
       from_json=lambda data: BatchGemmConfig(**data),
       text=lambda c: (f"bm={c.bm} bn={c.bn} bk={c.bk}"
                       + (" parallel rows" if c.parallel_rows else ""))),
)}


def _op(obj: Problem | Config) -> Op:
    """The :class:`Op` of a problem or a config."""
    for op in OPS.values():
        if isinstance(obj, (op.problem, op.config)):
            return op
    raise TypeError(f"the tuner handles GEMM, conv and batch GEMM problems, not "
                    f"{type(obj).__name__}")


def _shape_text(shape: tuple[int, ...], layout: str) -> str:
    return "x".join(map(str, shape)) + (f"/{layout}" if layout else "")


def problem_text(problem: Problem) -> str:
    """One line naming ``problem`` for people: op, shape/layout and epilogue.

    Examples
    --------
    >>> problem_text(ConvProblem(1, 3, 224, 224, 64, 7, 7, stride=2, padding=3))
    'conv2d 1x3x224x224x64x7x7/s2x2p3x3x3x3 -'
    """
    op = _op(problem)
    shape, layout, _ = op.key(problem)
    return f"{op.name} {_shape_text(shape, layout)} {problem.epilogue.name or '-'}"


def config_text(config: Config) -> str:
    """One line describing ``config`` (loop_spec and blocks)."""
    return _op(config).text(config)


@dataclass(frozen=True)
class TuningKey:
    """What a tuning result is valid for.

    ``shape`` holds the operator's sizes (dense ``m, n, k``; conv ``n, c, h, w, k, r, s``;
    batch GEMM ``batch, m, n, k``) and ``layout`` whatever else sets two problems of those
    sizes apart (conv strides and padding, batch-GEMM operand layouts, "" for dense), so
    dense keys read as they always did.

    Examples
    --------
    >>> TuningKey("dense", (48, 64, 96), "", "float32", "bias", "avx2/haswell/1t").text()
    'dense|48x64x96|float32|bias|avx2/haswell/1t'
    """

    op: str
    shape: tuple[int, ...]
    layout: str
    dtype: str
    epilogue: str
    target: str

    @classmethod
    def of(cls, problem: Problem, target: Target) -> TuningKey:
        op = _op(problem)
        shape, layout, dtype = op.key(problem)
        return cls(op.name, shape, layout, dtype, problem.epilogue.name,
                   machine_of(target).key)

    def text(self) -> str:
        return (f"{self.op}|{_shape_text(self.shape, self.layout)}|{self.dtype}|"
                f"{self.epilogue}|{self.target}")


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

    def get(self, key: TuningKey) -> Config | None:
        record = self._records.get(key.text())
        return OPS[key.op].from_json(record["config"]) if record else None

    def record(self, key: TuningKey) -> dict | None:
        """The stored record (config, measured GFLOPS, tuning seconds, measurements)."""
        return self._records.get(key.text())

    def put(self, key: TuningKey, config: Config, **details: object) -> None:
        self._records[key.text()] = {"config": OPS[key.op].to_json(config), **details}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self._records, indent=1, sort_keys=True))
        tmp.replace(self.path)


@dataclass(frozen=True)
class Measurement:
    """One candidate: the model's rank and class within its blocking and its prediction
    (None when unranked; see :class:`Choice`), what it measured."""

    config: Config
    model_rank: int | None
    predicted_cycles: float | None
    seconds: float | None = None
    error: str | None = None
    model_class: int | None = None

    def gflops(self, problem: Problem) -> float | None:
        return problem.flops / self.seconds / 1e9 if self.seconds else None

    def to_json(self) -> dict:
        return {"config": _op(self.config).to_json(self.config), "model_rank": self.model_rank,
                "model_class": self.model_class, "predicted_cycles": self.predicted_cycles,
                "seconds": self.seconds, "error": self.error}


@dataclass(frozen=True)
class TuneResult:
    """The kept config; when tuned now, what was measured (the default first) and how many
    candidates were considered."""

    best: Config
    cached: bool
    tune_seconds: float
    measurements: tuple[Measurement, ...] = field(default=())
    candidates: int = 0


#: Candidates compiled per module: one LLVM invocation for several, and a budgeted tuner
#: checks its clock between modules.
BATCH = 5
#: A candidate replaces the incumbent only if it is this much faster: timings of equal
#: programs differ by about this much on a shared machine.
MARGIN = 0.02
#: Seconds of samples per candidate per round (at least one run each).
_ROUND_SECONDS = 0.05
_ROUNDS = 3
#: Predictions closer than this are one class: the model works at slice granularity, and its
#: two engines (exact replay, analytic) typically differ by about this much.
MODEL_RESOLUTION = 0.01
#: The final round: the default and the candidates within this fraction of the fastest
#: (at most :data:`_FINAL_CONTENDERS` in all) are timed again side by side, the same rounds
#: each, and that round decides.
FINAL_WINDOW = 0.05
_FINAL_CONTENDERS = 4
_FINAL_ROUNDS = 5
_FINAL_SECONDS = 0.1


def _error(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"[:200]


def _scheduled(problem: Problem, configs: list[Config], isa: str) -> list[PrimFunc | str]:
    """Per config its scheduled PrimFunc, named ``candidate<i>``, or why it has none."""
    schedule = _op(problem).schedule
    out: list[PrimFunc | str] = []
    for i, config in enumerate(configs):
        try:
            out.append(schedule(problem, config, isa).mod["main"].with_attr(
                "global_symbol", f"candidate{i}"))
        except Exception as err:  # a candidate that cannot be scheduled is recorded, skipped
            out.append(_error(err))
    return out


def _compile(scheduled: list[PrimFunc | str], target: Target) -> list[Callable[..., object] | str]:
    """Compile the PrimFuncs of ``scheduled`` as one module; errors pass through."""
    import tvm

    out: list[Callable[..., object] | str] = list(scheduled)  # type: ignore[arg-type]
    funcs = {i: f for i, f in enumerate(scheduled) if not isinstance(f, str)}
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
                out[i] = _error(err)
    return out


def build(problem: Problem, configs: list[Config], target: Target, isa: str
          ) -> list[Callable[..., object] | str]:
    """Schedule ``configs`` and compile them as one module: per config its function, or the
    error that kept it from being built."""
    return _compile(_scheduled(problem, configs, isa), target)


def _arguments(funcs: list[PrimFunc]) -> list[list[object]]:
    """Arguments for each of ``funcs``: random inputs and an output, both shared by every
    function with a parameter of the same shape and dtype (a config's packed weights are
    just another shape).  Values do not matter for timing: no packing, no padding zeros."""
    import numpy as np
    import tvm

    rng = np.random.default_rng(0)
    made: dict[tuple[tuple[int, ...], str, bool], object] = {}
    out = []
    for func in funcs:
        args = []
        for i, param in enumerate(func.params):
            shape, dtype = tuple(int(d) for d in param.ty.shape), str(param.ty.dtype)
            output = i == len(func.params) - 1  # every template's PrimFunc ends with Y
            if (shape, dtype, output) not in made:
                made[(shape, dtype, output)] = (
                    tvm.runtime.empty(shape, dtype) if output
                    else tvm.runtime.tensor(rng.standard_normal(shape).astype(dtype)))
            args.append(made[(shape, dtype, output)])
        out.append(args)
    return out


def time_interleaved(runs: list[Callable[[], None]], rounds: int = _ROUNDS,
                     round_seconds: float = _ROUND_SECONDS) -> list[float]:
    """Seconds of one call of each function: the fastest of samples taken in ``rounds``
    interleaved rounds, so drift of the machine's load hits every candidate alike and the
    minimum is a run that went undisturbed."""
    best = [float("inf")] * len(runs)
    for i, run in enumerate(runs):  # warm-up, and a first estimate
        start = time.perf_counter()
        run()
        best[i] = time.perf_counter() - start
    for _ in range(rounds):
        for i, run in enumerate(runs):
            for _ in range(max(1, min(20, int(round_seconds / best[i])))):
                start = time.perf_counter()
                run()
                best[i] = min(best[i], time.perf_counter() - start)
    return best


def measure(problem: Problem, configs: list[Config], target: Target, isa: str,
            rounds: int = _ROUNDS, round_seconds: float = _ROUND_SECONDS,
            built: dict[Config, Callable[[], object]] | None = None) -> list[float | str]:
    """Build ``configs`` together and time them interleaved (see :func:`time_interleaved`):
    seconds of one run, or the error of a candidate that could not be built.

    ``built`` maps configs to ready runs (built, with arguments): those are not built again,
    and the new ones are added to it."""
    built = {} if built is None else built
    new = [c for c in dict.fromkeys(configs) if c not in built]
    scheduled = _scheduled(problem, new, isa)
    compiled = _compile(scheduled, target)
    errors = {new[i]: f for i, f in enumerate(compiled) if isinstance(f, str)}
    ok = [i for i, f in enumerate(compiled) if not isinstance(f, str)]
    arguments = _arguments([scheduled[i] for i in ok])  # type: ignore[misc]
    for i, args in zip(ok, arguments, strict=True):
        built[new[i]] = functools.partial(compiled[i], *args)  # type: ignore[arg-type]
    timed = [c for c in configs if c in built]
    seconds = dict(zip(timed, time_interleaved([built[c] for c in timed], rounds,
                                               round_seconds), strict=True)) if timed else {}
    return [seconds[c] if c in seconds else errors[c] for c in configs]


def tune(
    problem: Problem,
    target: Target,
    *,
    database: Database | None = None,
    top_k: int = 8,
    max_candidates: int = 400,
    budget_seconds: float | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> TuneResult:
    """The fastest configuration for ``problem`` on ``target`` (from the database if known).

    The default configuration and the next candidates (the model's best for a dense GEMM,
    the template's list for a conv or batch GEMM) are built :data:`BATCH` at a time and timed
    interleaved with the best so far; a candidate replaces it only when :data:`MARGIN`
    faster.  A final round times the default and the candidates within
    :data:`FINAL_WINDOW` of the best again, side by side and the same rounds each; the
    winner there must beat the default by the margin once more, so tuning does not keep a
    configuration that merely measured lucky over the default.

    Parameters
    ----------
    problem
        A :class:`~schedules.gemm.GemmProblem`, :class:`~schedules.conv.ConvProblem` or
        :class:`~schedules.batch_gemm.BatchGemmProblem`.
    top_k
        How many candidates besides the default may be built and timed.
    max_candidates
        Cap on generated candidates per block-size choice of a dense GEMM (the others come
        as a list of a dozen at most).
    budget_seconds
        Stop starting new batches once the next one would exceed this much time at the cost
        per candidate so far; the first batch (the default and one candidate) always runs.
    progress
        Called with (done, total) after each batch.

    Examples
    --------
    >>> p = ConvProblem(1, 16, 14, 14, 32, 3, 3, padding=1)
    >>> tune(p, target, top_k=4).best                       # doctest: +SKIP
    ConvConfig(bq=14, bc=16, bk=32, spec='ACDbfge', c_step=1, block_steps=mappingproxy({}))
    """
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    op = _op(problem)
    key = TuningKey.of(problem, target)
    if database is not None and (known := database.get(key)) is not None:
        return TuneResult(known, cached=True, tune_seconds=0.0)
    start = time.perf_counter()
    machine = machine_of(target)
    isa, caches, threads = machine.isa, machine.caches, machine.threads
    choices, generated = op.choices(problem, isa, caches, threads, max_candidates)
    chosen = choices[:1 + top_k]

    measurements: list[Measurement] = []
    incumbent: Measurement | None = None
    built: dict[Config, Callable[[], object]] = {}  # runs kept for the final round
    # Budgeted, a first batch of two (the default and one candidate) prices a candidate
    # before larger batches are committed to.
    starts = [0] + ([2] if budget_seconds is not None else [])
    starts = [s for s in [*starts, *range(starts[-1] + BATCH, len(chosen), BATCH)]
              if s < len(chosen)]
    for first, end in zip(starts, [*starts[1:], len(chosen)], strict=True):
        batch = chosen[first:end]
        spent = time.perf_counter() - start
        if budget_seconds is not None and first and spent * (first + len(batch)) / first > \
                budget_seconds:
            break
        configs = [c.config for c in batch]
        if incumbent is not None:  # re-timed next to the newcomers
            configs.append(incumbent.config)
        results = measure(problem, configs, target, isa.name, built=built)
        if incumbent is not None:
            again = results.pop()
            if isinstance(again, float):  # its record shows its best time, as the others'
                at = measurements.index(incumbent)
                incumbent = measurements[at] = replace(incumbent,
                                                       seconds=min(incumbent.seconds, again))
        for c, result in zip(batch, results, strict=True):
            m = Measurement(c.config, c.rank, c.cycles, model_class=c.model_class,
                            **({"seconds": result} if isinstance(result, float)
                               else {"error": result}))
            measurements.append(m)
            if m.seconds is not None and (incumbent is None
                                          or m.seconds < incumbent.seconds * (1 - MARGIN)):
                incumbent = m
        if progress is not None:
            progress(end, len(chosen))
    if incumbent is None:
        raise RuntimeError(f"no candidate could be built for {key.text()}: "
                           f"{measurements[0].error}")
    round_seconds = _FINAL_SECONDS
    if budget_seconds is not None:  # what is left of the budget, shared by the contenders
        left = budget_seconds - (time.perf_counter() - start)
        round_seconds = max(0.0, min(round_seconds, left / _FINAL_ROUNDS / _FINAL_CONTENDERS))
    incumbent = _final_round(problem, target, isa.name, measurements, built, round_seconds)
    seconds = time.perf_counter() - start
    if database is not None:
        database.put(key, incumbent.config, gflops=incumbent.gflops(problem),
                     tune_seconds=seconds, candidates=generated,
                     measured=[m.to_json() for m in measurements])
    return TuneResult(incumbent.config, cached=False, tune_seconds=seconds,
                      measurements=tuple(measurements), candidates=generated)


def _final_round(problem: Problem, target: Target, isa: str, measurements: list[Measurement],
                 built: dict[Config, Callable[[], object]], round_seconds: float
                 ) -> Measurement:
    """The winner of a last, fair round: the default (``measurements[0]``) and the fastest
    candidates within :data:`FINAL_WINDOW` of the best are timed again, interleaved, the same
    rounds each, and their records take those times.  A candidate wins only if it beats the
    default by :data:`MARGIN` there.

    Batches time each candidate briefly, while the default and the best so far are re-timed
    with every batch; keeping the fastest of all those samples would favour them, and a
    short batch can flatter a candidate by more than the margin on a shared machine.  All
    contenders are built already, so the round costs only timing: ``round_seconds`` per
    contender and round (at least one run), which a budget shrinks to what is left of it.
    """
    timed = sorted((i for i, m in enumerate(measurements) if m.seconds is not None),
                   key=lambda i: measurements[i].seconds)  # type: ignore[arg-type, return-value]
    fastest = measurements[timed[0]].seconds
    near = [i for i in timed if i and measurements[i].seconds <= fastest * (1 + FINAL_WINDOW)]
    default = [0] if measurements[0].seconds is not None else []  # unless it failed to build
    contenders = default + near[:_FINAL_CONTENDERS - len(default)]
    if len(contenders) > 1:
        again = measure(problem, [measurements[i].config for i in contenders], target, isa,
                        rounds=_FINAL_ROUNDS, round_seconds=round_seconds, built=built)
        for i, seconds in zip(contenders, again, strict=True):
            if isinstance(seconds, float):
                measurements[i] = replace(measurements[i], seconds=seconds)
    best = min(contenders, key=lambda i: measurements[i].seconds)  # type: ignore[arg-type, return-value]
    if best and default and \
            not measurements[best].seconds < measurements[0].seconds * (1 - MARGIN):  # type: ignore[operator]
        best = 0
    return measurements[best]


@dataclass
class Tuner:
    """What the graph passes call for each operator: tune it (or look it up), remember it.

    Parameters
    ----------
    database
        Where results persist.
    top_k
        Candidates measured per operator besides its default.
    budget_seconds
        Time budget per operator (see :func:`tune`).
    tune_missing
        Tune operators the database does not know; otherwise :meth:`config` returns None
        for them.
    on_result
        Called with ``(problem, result)`` after each operator, e.g. to print progress.

    Examples
    --------
    >>> tuner = Tuner(Database("tuning.json"), top_k=4)             # doctest: +SKIP
    >>> tuner.config(ConvProblem(1, 16, 14, 14, 32, 3, 3), target)  # doctest: +SKIP
    ConvConfig(bq=12, bc=16, bk=32, spec='ACDebfg', c_step=1, block_steps=mappingproxy({}))
    """

    database: Database
    top_k: int = 8
    budget_seconds: float | None = None
    tune_missing: bool = True
    on_result: Callable[[Problem, TuneResult], None] | None = None

    def config(self, problem: Problem, target: Target) -> Config | None:
        """``problem``'s tuned configuration (a GEMM, conv or batch GEMM problem), tuned now
        if the database lacks it, or None then if the tuner only looks up."""
        if not self.tune_missing and self.database.get(TuningKey.of(problem, target)) is None:
            return None
        result = tune(problem, target, database=self.database, top_k=self.top_k,
                      budget_seconds=self.budget_seconds)
        if self.on_result is not None:
            self.on_result(problem, result)
        return result.best


@dataclass
class TaskCollector:
    """Stands in for a :class:`Tuner` while a model is lowered only to find its tuning tasks:
    records every problem the passes ask about (once per :class:`TuningKey`) and answers
    None, so they schedule it with its default.

    Examples
    --------
    >>> collector = TaskCollector()
    >>> mod = tpp_pipeline(target, tuner=collector)(mod)      # doctest: +SKIP
    >>> [problem_text(p) for p in collector.tasks.values()]  # doctest: +SKIP
    ['dense 4x40x24 bias+relu']
    """

    tasks: dict[TuningKey, Problem] = field(default_factory=dict)

    def config(self, problem: Problem, target: Target) -> None:
        self.tasks.setdefault(TuningKey.of(problem, target), problem)
        return None


def config_for(problem: Problem, target: Target, tuner: Tuner | None = None) -> Config:
    """The configuration a graph pass schedules ``problem`` with: the ``tuner``'s when it has
    (or tunes) one, else the operator's untuned default.

    Examples
    --------
    >>> p = ConvProblem(1, 512, 7, 7, 512, 3, 3, padding=1)
    >>> config_for(p, target).spec           # doctest: +SKIP
    'ACbfgde'
    """
    config = tuner.config(problem, target) if tuner is not None else None
    if config is None:
        m = machine_of(target)
        config = _op(problem).default(problem, m.isa, m.caches, m.threads)
    return config
