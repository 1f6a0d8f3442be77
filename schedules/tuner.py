"""What the graph passes and the compiler call: a tuned configuration for each operator.

The tuner is split by job; this module is the interface the upper layers use and re-exports
the rest for them:

:mod:`schedules.ops`
    The operators (:data:`OPS`): keys, defaults, candidates, schedules, JSON, texts.
:mod:`schedules.database`
    :class:`TuningKey` and the JSON :class:`Database` of results.
:mod:`schedules.measure`
    :func:`build`, :func:`measure` and :func:`time_interleaved`.
:mod:`schedules.search`
    :func:`tune`: which candidates to time, and which to keep.

Here: :class:`Tuner` (the passes' source of tuned configurations), :class:`TaskCollector`
(records the operators a model would tune), :func:`config_for` (a tuned configuration or
the untuned default).

Examples
--------
>>> from schedules.conv import ConvProblem
>>> p = ConvProblem(1, 512, 7, 7, 512, 3, 3, padding=1)
>>> collector = TaskCollector()
>>> config_for(p, target, collector).spec                 # doctest: +SKIP
'ACbfgde'
>>> [problem_text(p) for p in collector.tasks.values()]   # doctest: +SKIP
['conv2d 1x512x7x7x512x3x3/s1x1p1x1x1x1 -']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from microkernels.machine import machine_of

from .database import Database, TuningKey
from .gemm import ranked_configs
from .measure import build, measure, time_interleaved
from .ops import MODEL_RESOLUTION, OPS, Config, Problem, config_text, op_of, problem_text
from .search import BATCH, FINAL_WINDOW, MARGIN, Measurement, TuneResult, tune

if TYPE_CHECKING:
    from tvm.target import Target

__all__ = ["Tuner", "TaskCollector", "config_for", "Database", "TuningKey", "tune",
           "TuneResult", "Measurement", "problem_text", "config_text", "measure", "build",
           "time_interleaved", "ranked_configs", "MODEL_RESOLUTION", "OPS", "BATCH", "MARGIN",
           "FINAL_WINDOW"]


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


def config_for(problem: Problem, target: Target, tuner: Tuner | TaskCollector | None = None
               ) -> Config:
    """The configuration a graph pass schedules ``problem`` with: the ``tuner``'s when it has
    (or tunes) one, else the operator's untuned default for the target's machine.

    Examples
    --------
    >>> from schedules.conv import ConvProblem
    >>> p = ConvProblem(1, 512, 7, 7, 512, 3, 3, padding=1)
    >>> config_for(p, target).spec           # doctest: +SKIP
    'ACbfgde'
    """
    config = tuner.config(problem, target) if tuner is not None else None
    if config is None:
        config = op_of(problem).default(problem, machine_of(target))
    return config
