"""The benchmarks' progress display: one rich bar on stderr, refreshed once a second.

The display thread shares the CPUs with the timed workers, hence the slow refresh; a disabled
display (``--quiet``) draws nothing.

Examples
--------
>>> with Progress(enabled=False, total=3) as progress:
...     progress.say("building tpp", advance=1)
...     task = progress.add("timing", total=2)
...     progress.tick(task)
"""

from __future__ import annotations

from typing import Any

__all__ = ["Progress"]


class Progress:
    """A main bar of ``total`` steps, plus bars :meth:`add` starts (e.g. per timing phase)."""

    def __init__(self, enabled: bool, total: int) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.progress import Progress as Bars

        self._bars = Bars(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                          MofNCompleteColumn(), TimeElapsedColumn(),
                          console=Console(stderr=True), disable=not enabled,
                          refresh_per_second=1)
        self._main = self._bars.add_task("starting", total=total)

    def __enter__(self) -> Progress:
        self._bars.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._bars.__exit__(*exc)

    def say(self, text: str, advance: int = 0) -> None:
        """Describe the current step; ``advance`` steps are done."""
        self._bars.update(self._main, description=text, advance=advance)

    def advance(self, steps: int = 1) -> None:
        self._bars.advance(self._main, steps)

    def add(self, text: str, total: int) -> Any:
        """A further bar of ``total`` ticks; its id for :meth:`tick`."""
        return self._bars.add_task(text, total=total)

    def tick(self, task: Any) -> None:
        self._bars.advance(task)
