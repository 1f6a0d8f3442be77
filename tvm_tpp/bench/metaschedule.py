"""The MetaSchedule baseline's database: searched once per setting, reused while it holds.

Both benchmarks tune MetaSchedule the same way: one database directory per workload and
thread count under ``work_dir/metaschedule``, with a ``bench_meta.json`` that records the
settings it was searched with and how long the search took.  A later run with the same
settings reuses it (no search: tuning seconds 0, the earlier search's seconds in the notes);
other settings would mix results, so the directory starts afresh.

Examples
--------
>>> database_dir("wd", "64x64x64", 2).as_posix()
'wd/metaschedule/64x64x64_t2'
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Deadline", "DeadlineReached", "MetaScheduleDatabase", "database_dir",
           "missing_packages", "search"]

# MetaSchedule's cost model and workers: the [tune] extra.
_NEEDS = ("xgboost", "psutil", "cloudpickle")
_META = "bench_meta.json"


def missing_packages() -> list[str]:
    """The packages MetaSchedule's search needs that are not installed."""
    return [m for m in _NEEDS if importlib.util.find_spec(m) is None]


def database_dir(work_dir: str | os.PathLike, key: str, threads: int) -> Path:
    """Where the database of workload ``key`` at ``threads`` lives."""
    return Path(work_dir) / "metaschedule" / f"{key}_t{threads}"


@dataclass(frozen=True)
class MetaScheduleDatabase:
    """A searched (or reused) database and what its search cost.

    Attributes
    ----------
    database
        The ``JSONDatabase``.
    path
        Its directory.
    tune_seconds
        Seconds searched in this run (0 when reused).
    earlier_seconds
        When reused: the seconds of the search that filled it.
    startup_seconds
        MetaSchedule's one-off tensor-intrinsic import (30-60 s per process), timed apart:
        it is no search, and it would make the first workload's search look slower.
    """

    database: Any
    path: Path
    tune_seconds: float
    earlier_seconds: float | None = None
    startup_seconds: float = 0.0

    def note(self) -> str:
        """``database DIR`` and, when it applies, how its tuning time was counted."""
        if self.earlier_seconds is not None:
            return (f"database {self.path} (reused: searched earlier in "
                    f"{self.earlier_seconds:.1f} s)")
        extra = (f"; +{self.startup_seconds:.0f} s one-off MetaSchedule start-up not counted"
                 if self.startup_seconds > 1 else "")
        return f"database {self.path}{extra}"


def search(path: Path, settings: dict[str, Any], run_search: Callable[[str], Any]
           ) -> MetaScheduleDatabase:
    """The database in ``path`` if it was searched with ``settings``, else a new search.

    Parameters
    ----------
    path
        The database directory (:func:`database_dir`).
    settings
        Everything that makes two searches differ (trials, target, seed, ...), as JSON values.
    run_search
        Searches into the directory it is given and returns the database
        (``tune_tir`` or ``tune_relax``).
    """
    from tvm.s_tir import meta_schedule as ms

    meta_path = path / _META
    old = json.loads(meta_path.read_text()) if meta_path.is_file() else None
    if old is not None and {key: old.get(key) for key in settings} == settings:
        return MetaScheduleDatabase(ms.database.JSONDatabase(work_dir=str(path)), path, 0.0,
                                    float(old["tune_seconds"]))
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    start = time.perf_counter()
    import tvm.s_tir.tensor_intrin  # noqa: F401  (what TuneContext imports first)

    startup = time.perf_counter() - start
    start = time.perf_counter()
    database = run_search(str(path))
    tune_seconds = time.perf_counter() - start
    meta_path.write_text(json.dumps({**settings, "tune_seconds": tune_seconds}))
    return MetaScheduleDatabase(database, path, tune_seconds, None, startup)


class DeadlineReached(RuntimeError):
    """A :class:`Deadline`'s time is up: raised out of the MetaSchedule search to end it."""


@dataclass
class Deadline:
    """A wall-time budget for a MetaSchedule search, and what the search did within it.

    MetaSchedule itself only knows trial counts, and its gradient scheduler sends every task
    a batch before it collects any result, so a budget cannot wait for results to stop it.
    :meth:`builder` wraps the search's builder: once ``seconds`` have passed since
    :meth:`start`, the next batch sent to be built first collects every batch still being
    measured (their records go to the database, as always) and then raises
    :class:`DeadlineReached` out of the search.  It overruns by the wait for those
    measurements; a budget spent before the first batch measures nothing.
    :meth:`callback` counts the trials measured and the tasks with at least one that ran.

    Examples
    --------
    >>> d = Deadline(60.0).start()
    >>> d.measured(1, ["build failed", None])
    >>> d.trials, sorted(d.measured_tasks), d.hit
    (2, [1], False)
    >>> class Task:
    ...     builder_results = None  # a batch being measured has them
    >>> class Scheduler:
    ...     tasks_ = [Task(), Task()]
    ...     joined = []
    ...     def join_running_task(self, i):
    ...         self.joined.append(i)
    >>> scheduler = Scheduler()
    >>> scheduler.tasks_[1].builder_results = ["built"]
    >>> d = Deadline(0.0).start()
    >>> try:
    ...     d.before_build(scheduler)
    ... except DeadlineReached as err:
    ...     print(err)
    MetaSchedule's 0.0 s budget is spent
    >>> scheduler.joined, d.hit
    ([1], True)
    """

    seconds: float
    trials: int = 0
    measured_tasks: set[int] = field(default_factory=set)
    hit: bool = False
    _end: float = float("inf")

    def __post_init__(self) -> None:
        if not self.seconds >= 0:
            raise ValueError(f"a MetaSchedule budget must be >= 0 seconds, got {self.seconds}")

    def start(self) -> Deadline:
        """Start the clock (the search starts right after)."""
        self._end = time.perf_counter() + self.seconds
        return self

    def measured(self, task_id: int, run_errors: list[str | None]) -> None:
        """Count a measured batch (``run_errors``: each trial's error, None if it ran)."""
        self.trials += len(run_errors)
        if any(error is None for error in run_errors):
            self.measured_tasks.add(task_id)

    def before_build(self, scheduler: Any) -> None:
        """Before a batch is built: once the time is up, collect the batches in flight (each
        task with built candidates awaits its measurements) and end the search."""
        if time.perf_counter() < self._end:
            return
        self.hit = True
        for i, task in enumerate(scheduler.tasks_):
            if task.builder_results is not None:
                scheduler.join_running_task(i)
        raise DeadlineReached(f"MetaSchedule's {self.seconds:.1f} s budget is spent")

    def callback(self) -> Any:
        """The ``MeasureCallback`` that counts (add it after the defaults)."""
        from tvm.ir.utils import derived_object
        from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

        deadline = self

        @derived_object
        class _Counter(PyMeasureCallback):
            def apply(self, task_scheduler, task_id, measure_candidates, builder_results,
                      runner_results) -> None:
                deadline.measured(task_id, [r.error_msg for r in runner_results])

        return _Counter()

    def builder(self, inner: Any, scheduler: Any) -> Any:
        """``inner`` (a MetaSchedule ``Builder``) behind :meth:`before_build`, for the search
        that ``scheduler`` (its ``TaskScheduler``) runs."""
        from tvm.ir.utils import derived_object
        from tvm.s_tir.meta_schedule.builder import PyBuilder

        deadline = self

        @derived_object
        class _BudgetedBuilder(PyBuilder):
            def build(self, build_inputs):
                deadline.before_build(scheduler)
                return inner.build(build_inputs)

        return _BudgetedBuilder()
