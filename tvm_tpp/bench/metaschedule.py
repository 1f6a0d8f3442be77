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

    :meth:`callback` gives the ``MeasureCallback`` that enforces it: after each measured batch
    it counts the trials and, once ``seconds`` have passed since :meth:`start`, raises
    :class:`DeadlineReached` out of the search (MetaSchedule itself only knows trial counts,
    and terminating its tasks from a callback trips its scheduler's checks).  The search
    thus ends at the first batch measured after the deadline: it can run over by one batch,
    and never ends before one.  Every batch measured is in the database already (the default
    callbacks, which come first, put it there).

    Examples
    --------
    >>> d = Deadline(60.0).start()
    >>> d.after_batch(1, ["build failed", None])
    >>> d.trials, sorted(d.measured_tasks), d.hit
    (2, [1], False)
    >>> try:
    ...     Deadline(0.0).start().after_batch(0, [None])
    ... except DeadlineReached as err:
    ...     print(err)
    MetaSchedule's 0.0 s budget is spent
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

    def after_batch(self, task_id: int, run_errors: list[str | None]) -> None:
        """Count a measured batch (``run_errors``: each trial's error, None if it ran), and
        end the search when the time is up."""
        self.trials += len(run_errors)
        if any(error is None for error in run_errors):
            self.measured_tasks.add(task_id)
        if time.perf_counter() >= self._end:
            self.hit = True
            raise DeadlineReached(f"MetaSchedule's {self.seconds:.1f} s budget is spent")

    def callback(self) -> Any:
        """The ``MeasureCallback`` calling :meth:`after_batch` (add it after the defaults,
        which put each batch in the database first)."""
        from tvm.ir.utils import derived_object
        from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback

        deadline = self

        @derived_object
        class _DeadlineCallback(PyMeasureCallback):
            def apply(self, task_scheduler, task_id, measure_candidates, builder_results,
                      runner_results) -> None:
                deadline.after_batch(task_id, [r.error_msg for r in runner_results])

        return _DeadlineCallback()
