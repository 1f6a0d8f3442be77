"""A TVM RPC tracker and servers on this machine, started and stopped by the caller: the
loopback fleet of the remote-tuning tests and of ``python -m tvm_tpp.bench.rpc_scaling``.

They are TVM's own commands (``python -m tvm.exec.rpc_tracker``, ``python -m
tvm.exec.rpc_server --tracker ... --key ...``), each in a process group of its own so that
stopping one also stops the session process it forked; a server may be pinned to cores
(``taskset``) and given a TVM thread count; TVM never binds a server's threads to cores
itself (``TVM_BIND_THREADS=0``).  Every wait is bounded.

Examples
--------
>>> with Fleet(Path("logs"), servers=[Server("x86", cores=(0,))]) as fleet:  # doctest: +SKIP
...     print(fleet.address, fleet.servers_under("x86"))
127.0.0.1:40123 1
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Fleet", "Server", "free_port"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now.

    >>> 0 < free_port() < 65536
    True
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Server:
    """One RPC server to start: its device key, the cores it is pinned to (empty: not
    pinned), TVM's thread count in it (None: TVM's default), and the Python that runs it
    with extra environment (default: this one; e.g. an aarch64 Python under qemu-aarch64).
    """

    key: str
    cores: tuple[int, ...] = ()
    threads: int | None = None
    python: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.key or ":" in self.key:
            raise ValueError(f"a device key is a non-empty word without ':', got {self.key!r}")
        if any(c < 0 for c in self.cores) or (self.threads is not None and self.threads < 1):
            raise ValueError("cores must be >= 0 and threads >= 1")


class Fleet:
    """A tracker on a free loopback port and ``servers`` registered with it; logs in
    ``log_dir`` (``tracker.log``, ``server<i>.log``).

    Raises
    ------
    RuntimeError
        The tracker or a server did not come up within ``start_seconds`` (the log's last
        line says why), or ``taskset`` is missing for a pinned server.
    """

    def __init__(self, log_dir: Path, servers: list[Server], start_seconds: float = 60.0
                 ) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.specs = list(servers)
        self.start_seconds = start_seconds
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.tracker: subprocess.Popen | None = None
        self.servers: list[subprocess.Popen | None] = []

    def _start(self, command: list[str], log: Path, env: dict[str, str] | None = None
               ) -> subprocess.Popen:
        with open(log, "w") as out:
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, **(env or {})})

    def __enter__(self) -> Fleet:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        python = sys.executable
        self.tracker = self._start([python, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1",
                                    "--port", str(self.port), "--port-end",
                                    str(self.port + 1)], self.log_dir / "tracker.log")
        self._wait(lambda: self._reachable(), "the tracker", self.log_dir / "tracker.log")
        for i, spec in enumerate(self.specs):
            port = free_port()
            command = [*(spec.python or [python]), "-m", "tvm.exec.rpc_server", "--host",
                       "127.0.0.1", "--port", str(port), "--port-end", str(port + 1),
                       "--tracker", self.address, "--key", spec.key]
            if spec.cores:
                if shutil.which("taskset") is None:
                    raise RuntimeError("pinning a server to cores needs taskset (util-linux)")
                command = ["taskset", "-c", ",".join(map(str, spec.cores)), *command]
            # Unbound, or TVM binds a session's pool to the first cores when it starts (the
            # tuner's runtime.NumThreads): a one-thread pool moves its main thread to core 0,
            # out of the cores taskset gave it, and every server shares core 0.
            env = dict(spec.env) | {"TVM_BIND_THREADS": "0"} | (
                {"TVM_NUM_THREADS": str(spec.threads)} if spec.threads else {})
            self.servers.append(self._start(command, self.log_dir / f"server{i}.log", env))
        for key in {s.key for s in self.specs}:
            count = sum(s.key == key for s in self.specs)
            self._wait(lambda k=key, n=count: self.servers_under(k) >= n,
                       f"{count} servers under {key!r}", self.log_dir / "server0.log")

    def _reachable(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def _wait(self, ready, what: str, log: Path) -> None:
        deadline = time.monotonic() + self.start_seconds
        while not ready():
            if time.monotonic() > deadline:
                tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
                raise RuntimeError(f"{what} did not come up within {self.start_seconds:g} s"
                                   + (f": {tail[0]}" if tail else ""))
            time.sleep(0.2)

    def servers_under(self, key: str) -> int:
        """Servers the tracker lists under ``key`` now (0 when it cannot be asked)."""
        from tvm import rpc

        try:
            summary = rpc.connect_tracker("127.0.0.1", self.port).summary()
        except (OSError, RuntimeError):
            return 0
        return sum(s.get("key") == f"server:{key}" for s in summary.get("server_info", ()))

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to server ``index`` and the session process it forked (SIGKILL: it
        dies; SIGSTOP: it hangs)."""
        proc = self.servers[index]
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, sig)

    def stop(self) -> None:
        """Kill every process this fleet started (each one's group) and reap it."""
        for proc in [*self.servers, self.tracker]:
            if proc is None:
                continue
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
