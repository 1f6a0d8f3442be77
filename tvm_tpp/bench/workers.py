"""Persistent worker processes that talk JSON lines, for the benchmark harnesses.

Every benchmark (:mod:`tvm_tpp.bench`) builds and times each implementation in a process of
its own, with the thread-count variables set before anything loads: TVM's, ONNX Runtime's and
OpenBLAS's thread pools disturb each other when they share one.  A :class:`Worker` is one
such process: requests go to its stdin and replies come from its stdout, one JSON object per
line; its stderr goes to a log file whose last line explains a death; it runs in its own
process group, so killing it also kills the processes it started (MetaSchedule's builders).

Examples
--------
>>> import sys, tempfile
>>> from pathlib import Path
>>> echo = "import sys\\nfor line in sys.stdin: print(line, end='', flush=True)"
>>> log = Path(tempfile.mkdtemp()) / "echo.log"
>>> worker = Worker([sys.executable, "-c", echo], log)
>>> worker.request({"ping": 1}, timeout=60)
{'ping': 1}
>>> worker.close()
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["Worker", "WorkerError", "last_line"]


class WorkerError(RuntimeError):
    """A worker died, timed out or answered nonsense (the message says which)."""


def last_line(path: str | os.PathLike, limit: int = 240) -> str:
    """The last non-blank line of a text file, at most ``limit`` characters ("" if none).

    Parameters
    ----------
    path
        The file, typically a worker's log.
    limit
        Characters kept of that line.

    Returns
    -------
    str
        The line without surrounding white space; empty when the file is missing or blank.

    Examples
    --------
    >>> last_line("/no/such/file")
    ''
    """
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return lines[-1][:limit] if lines else ""


class Worker:
    """One worker process: JSON lines in and out, stderr to a log file, killable as a group.

    Parameters
    ----------
    argv
        The command line of the worker (e.g. ``[sys.executable, "-m", module, job_json]``).
    log_path
        File the worker's stderr is written to (its directory is created).
    env
        Environment variables set for the worker on top of this process's environment
        (e.g. ``TVM_NUM_THREADS``); the directory this package lives in is put first on
        ``PYTHONPATH`` as well, so the worker imports the same code as the harness.

    Attributes
    ----------
    proc : subprocess.Popen
        The worker process.
    log_path : pathlib.Path
        Where its stderr goes.
    """

    def __init__(self, argv: Sequence[str], log_path: str | os.PathLike,
                 env: Mapping[str, str] | None = None) -> None:
        full_env = dict(os.environ)
        full_env.update(env or {})
        package_root = str(Path(__file__).resolve().parents[2])
        full_env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [package_root, full_env.get("PYTHONPATH")]))
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")  # closed in close()
        self.proc = subprocess.Popen(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            env=full_env, text=True, bufsize=1,
            start_new_session=True,  # own process group: its children die with it
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True).start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self._lines.put(line)
        self._lines.put(None)

    def receive(self, timeout: float) -> dict[str, Any]:
        """The worker's next JSON line.

        Parameters
        ----------
        timeout
            Seconds to wait for it; the worker is killed when they pass.

        Returns
        -------
        dict
            The decoded line.

        Raises
        ------
        WorkerError
            The worker timed out (and was killed), died (the message has its exit status
            and its log's last line) or sent a line that is not JSON (and was killed).
        """
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise WorkerError(f"timed out after {timeout:.0f} s") from None
        if line is None:
            raise WorkerError(self._death())
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            self.kill()
            raise WorkerError(f"garbled reply {line[:80]!r}") from None

    def request(self, message: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        """Send ``message`` as one JSON line and return the reply (see :meth:`receive`).

        Raises
        ------
        WorkerError
            As :meth:`receive`, or the worker was already gone.
        """
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except OSError:
            raise WorkerError(self._death()) from None
        return self.receive(timeout)

    def _death(self) -> str:
        code = self.proc.wait()
        if code < 0:
            how = f"killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
        last = last_line(self.log_path)
        return f"worker {how}" + (f": {last}" if last else "")

    def kill(self) -> None:
        """Kill the worker's whole process group at once (no-op when it has ended)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def close(self) -> None:
        """Ask the worker to quit (``{"quit": true}``, then end of stdin); kill it if it
        has not ended 30 s later; close the log."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"quit": true}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self._log.close()
