"""What the graph passes and the compiler call: a tuned configuration for each operator.

The tuner is split by job; this module is the interface the upper layers use and re-exports
the rest for them:

:mod:`schedules.ops`
    The operators (:data:`OPS`): keys, defaults, candidates, schedules, JSON, texts.
:mod:`schedules.database`
    :class:`TuningKey` and the SQLite :class:`Database` of results.
:mod:`schedules.measure`
    :func:`build`, :func:`measure` and :func:`time_interleaved`.
:mod:`schedules.search`
    :func:`tune`: which candidates to time, and which to keep.

Here: :class:`TaskCollector` (records the operators a model would tune, to :func:`tune` them
before the build), :class:`Tuner` (the build's lookup of tuned configurations) and
:func:`config_for` (a tuned configuration or the untuned default).

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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from microkernels.machine import machine_of

from .database import Database, TuningKey
from .gemm import ranked_configs
from .measure import build, measure, time_interleaved
from .ops import MODEL_RESOLUTION, OPS, Config, Problem, config_text, op_of, problem_text
from .search import BATCH, MARGIN, Measurement, TuneResult, tune

if TYPE_CHECKING:
    from tvm.target import Target

__all__ = ["Tuner", "TaskCollector", "config_for", "Database", "TuningKey", "tune",
           "TuneResult", "Measurement", "problem_text", "config_text", "measure", "build",
           "time_interleaved", "ranked_configs", "MODEL_RESOLUTION", "OPS", "BATCH", "MARGIN"]


@dataclass(frozen=True)
class Tuner:
    """What the graph passes ask for each operator's configuration: the one a
    :class:`Database` keeps, or None (the pass then uses the operator's default).

    Tuning happens before the lowering, never inside it: a :class:`TaskCollector` lists a
    model's operators, :func:`tune` measures them into the database, and a build lowers with
    a Tuner over that database.

    Parameters
    ----------
    database
        The tuning results.

    Examples
    --------
    >>> tuner = Tuner(Database("work/tuning.db"))                    # doctest: +SKIP
    >>> tuner.config(ConvProblem(1, 16, 14, 14, 32, 3, 3), target)  # doctest: +SKIP
    ConvConfig(bq=12, bc=16, bk=32, spec='ACDebfg', c_step=1, block_steps=mappingproxy({}))
    """

    database: Database

    def __post_init__(self) -> None:
        if not isinstance(self.database, Database):
            raise TypeError(f"a Tuner takes a Database, got {type(self.database).__name__}")

    def config(self, problem: Problem, target: Target) -> Config | None:
        """``problem``'s tuned configuration on ``target``'s machine, or None if untuned (or
        if the stored record does not fit ``problem``: it is dropped, with a warning; or if
        it was tuned against another default: :meth:`Database.stale`)."""
        machine = machine_of(target)
        return self.database.get(TuningKey.of(problem, target), problem, machine.isa.name,
                                 default=op_of(problem).default(problem, machine))


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
