"""The tuning search: which candidates to measure, in which batches, and which one to keep.

For one operator, :func:`tune`

1. takes the candidates of its :class:`~schedules.ops.Op`, the untuned default first (a
   dense GEMM's ranked by the cache-trace model within each blocking, a convolution's or a
   batch GEMM's in their template's order);
2. builds the default and the next ``top_k``, :data:`BATCH` per LLVM module, and times them
   interleaved (each batch next to the best so far, which a newcomer must beat by
   :data:`MARGIN`), within an optional time budget;
3. times the default and the fastest candidates again in a final round, in two halves whose
   disagreement measures the timer's noise; the first in measuring order within that noise
   (at least :data:`MARGIN`) of the fastest wins, and
4. keeps the winner in a :class:`~schedules.database.Database`, if given one.

Examples
--------
>>> from schedules.gemm import GemmProblem
>>> db = Database("work/tuning.db")                                  # doctest: +SKIP
>>> result = tune(GemmProblem(128, 768, 768), target, database=db)  # doctest: +SKIP
>>> result.best.spec, result.cached                                  # doctest: +SKIP
('cBCa', False)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from microkernels.machine import machine_of

from .database import Database, TuningKey
from .measure import Measurer, measure
from .ops import Choice, Config, Problem, op_of

if TYPE_CHECKING:
    from tvm.target import Target

__all__ = ["Measurement", "TuneResult", "tune", "BATCH", "MARGIN", "MAX_CANDIDATES"]

#: The most candidates a tuning run (and ``bench-conv``/``bench-dense --candidates``) lists.
MAX_CANDIDATES = 400
#: Candidates compiled per module: one LLVM invocation for several, and a budgeted tuner
#: checks its clock between modules.
BATCH = 5
#: A candidate replaces the incumbent only if it is this much faster: timings of equal
#: programs differ by about this much on a quiet machine (the final round widens it to the
#: noise it measures).
MARGIN = 0.02
#: The final round: the default and the fastest candidates, this many in all (the default's
#: ``top_k`` of 8 and the default), timed again side by side in two halves of
#: :data:`_FINAL_ROUNDS` rounds of :data:`_FINAL_SECONDS` each per contender.
_FINAL_CONTENDERS = 9
_FINAL_ROUNDS = 3
_FINAL_SECONDS = 0.04


@dataclass(frozen=True)
class Measurement:
    """One candidate: the model's rank and class within its blocking and its prediction
    (None when unranked; see :class:`~schedules.ops.Choice`), what it measured."""

    config: Config
    model_rank: int | None
    predicted_cycles: float | None
    seconds: float | None = None
    error: str | None = None
    model_class: int | None = None

    def __post_init__(self) -> None:
        if self.seconds is not None and self.error is not None:
            raise ValueError("a measurement has seconds or an error, not both")

    def gflops(self, problem: Problem) -> float | None:
        return problem.flops / self.seconds / 1e9 if self.seconds else None

    def to_json(self) -> dict:
        return {"config": op_of(self.config).to_json(self.config),
                "model_rank": self.model_rank, "model_class": self.model_class,
                "predicted_cycles": self.predicted_cycles, "seconds": self.seconds,
                "error": self.error}


@dataclass(frozen=True)
class TuneResult:
    """The kept config; when tuned now, what was measured (the default first), how many
    candidates were considered, and the final round's tie margin (see :func:`tune`)."""

    best: Config
    cached: bool
    tune_seconds: float
    measurements: tuple[Measurement, ...] = field(default=())
    candidates: int = 0
    tie_margin: float | None = None


def tune(
    problem: Problem,
    target: Target,
    *,
    database: Database | None = None,
    top_k: int = 8,
    max_candidates: int = MAX_CANDIDATES,
    budget_seconds: float | None = None,
    progress: Callable[[int, int], None] | None = None,
    measurer: Measurer | None = None,
) -> TuneResult:
    """The fastest configuration for ``problem`` on ``target`` (from the database if known).

    The default configuration and the next candidates (the model's best for a dense GEMM,
    the template's list for a conv or batch GEMM) are built :data:`BATCH` at a time and timed
    interleaved with the best so far; a candidate replaces it only when :data:`MARGIN`
    faster.  A final round times the default and the fastest candidates again, side by side
    and the same rounds each, in two halves; the winner there must beat the default (and
    every earlier candidate) by the margin, or by the halves' disagreement where that is
    larger, so tuning does not keep a configuration that merely measured lucky, and a rerun
    on a noisy machine keeps the same one.

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
    measurer
        What builds and times the candidates: :func:`~schedules.measure.measure` (in this
        process; the default) or a :class:`~schedules.remote.RemoteMeasurer` (on the RPC
        servers of a tracker); the search is the same.

    Examples
    --------
    >>> from schedules.conv import ConvProblem
    >>> p = ConvProblem(1, 16, 14, 14, 32, 3, 3, padding=1)
    >>> tune(p, target, top_k=4).best                       # doctest: +SKIP
    ConvConfig(bq=14, bc=16, bk=32, spec='ACDbfge', c_step=1, block_steps=mappingproxy({}))
    """
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    measurer = measurer or measure
    op = op_of(problem)
    key = TuningKey.of(problem, target)
    machine = machine_of(target)
    # A stored record is used only if it fits the problem (a bad one is dropped and re-tuned)
    # and was tuned against today's default (a stale one is tuned again, its winner among
    # the candidates right after the default).
    default = op.default(problem, machine)
    earlier = None
    if database is not None:
        known = database.get(key, problem, machine.isa.name)
        if known is not None and database.get(key, default=default) is not None:
            return TuneResult(known, cached=True, tune_seconds=0.0)
        earlier = known
    start = time.perf_counter()
    choices, generated = op.choices(problem, machine, max_candidates)
    chosen = choices[:1 + top_k]
    if earlier is not None and all(c.config != earlier for c in chosen):
        chosen.insert(1, Choice(None, None, None, earlier))

    measurements: list[Measurement] = []
    incumbent: Measurement | None = None
    built: dict[Config, object] = {}  # what the measurer built, kept for the final round
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
        results = measurer(problem, configs, target, machine.isa.name, built=built)
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
    incumbent, margin = _final_round(problem, target, machine.isa.name, measurements, built,
                                     round_seconds, measurer)
    seconds = time.perf_counter() - start
    if database is not None:
        database.put(key, incumbent.config, gflops=incumbent.gflops(problem),
                     tune_seconds=seconds, candidates=generated, tie_margin=margin,
                     measured=[m.to_json() for m in measurements])
    return TuneResult(incumbent.config, cached=False, tune_seconds=seconds,
                      measurements=tuple(measurements), candidates=generated,
                      tie_margin=margin)


def _final_round(problem: Problem, target: Target, isa: str, measurements: list[Measurement],
                 built: dict[Config, object], round_seconds: float, measurer: Measurer
                 ) -> tuple[Measurement, float]:
    """The winner of a last, fair round, and the round's tie margin.

    The default (``measurements[0]``) and the fastest timed candidates (at most
    :data:`_FINAL_CONTENDERS` in all) are timed again, interleaved, in two independent halves
    of the same rounds each; each record takes its faster half.  How far the halves disagree
    on the contenders' times relative to the default is the timer's own noise for this
    operator: contenders within the larger of :data:`MARGIN` and twice that disagreement of
    the fastest are a tie, won by the first in measuring order (the default, then the model's
    or the template's order), so a rerun or a run on other servers keeps the same choice.

    Every timed candidate goes on, not only those that came near in the batches: a
    candidate timed once in a batch while the machine was busy can measure far slower than
    it is.  All are built already, so the round costs only timing: ``round_seconds`` per
    contender and round (at least one run), which a budget shrinks to what is left of it.
    """
    timed = sorted((i for i, m in enumerate(measurements) if i and m.seconds is not None),
                   key=lambda i: measurements[i].seconds)  # type: ignore[arg-type, return-value]
    default = [0] if measurements[0].seconds is not None else []  # unless it failed to build
    contenders = default + timed[:_FINAL_CONTENDERS - len(default)]
    margin = MARGIN
    if len(contenders) > 1:
        configs = [measurements[i].config for i in contenders]
        halves = [measurer(problem, configs, target, isa, rounds=_FINAL_ROUNDS,
                           round_seconds=round_seconds, built=built) for _ in range(2)]
        both = [(i, a, b) for i, a, b in zip(contenders, *halves, strict=True)
                if isinstance(a, float) and isinstance(b, float)]
        margin = max(MARGIN, 2 * _disagreement([(a, b) for _, a, b in both]))
        for i, a, b in both:
            measurements[i] = replace(measurements[i], seconds=min(a, b))
    winning = min(measurements[i].seconds for i in contenders)  # type: ignore[type-var]
    return measurements[min(i for i in contenders
                            if measurements[i].seconds <= winning * (1 + margin))], margin  # type: ignore[operator]


def _disagreement(pairs: list[tuple[float, float]]) -> float:
    """The median relative disagreement of two timings of the same programs about their
    times relative to the first program's (a machine that is uniformly slower in one half
    does not count).

    >>> round(_disagreement([(1.0, 2.0), (1.1, 2.2), (1.1, 2.0)]), 6)  # the third: 10 % off
    0.05
    """
    if len(pairs) < 2:  # nothing to compare (contenders that failed in a half are left out)
        return 0.0
    (a0, b0), rest = pairs[0], pairs[1:]
    return statistics.median(abs(a / a0 / (b / b0) - 1) for a, b in rest)
