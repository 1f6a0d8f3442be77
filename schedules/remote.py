"""Timing candidates on other machines, through TVM's RPC tracker.

A fleet registers TVM's own RPC servers with a tracker under a device key, one key per kind of
CPU (``python -m tvm.exec.rpc_tracker --port 9190``; ``python -m tvm.exec.rpc_server
--tracker HOST:9190 --key KEY``).  The tuner's search (:func:`~schedules.search.tune`) stays
here; only its measurements go out:

* :class:`Tracker` names the tracker and the key;
* :class:`RemotePool` holds one session per server under the key, each served by a worker
  thread from a shared queue of batches.  A batch whose server dies or stops answering
  (``timeout``) goes back to the queue for another server, at most ``tries`` times, then
  its candidates are reported failed; when no server is left the run stops with a
  :class:`RemoteError`.
* :class:`RemoteMeasurer` is the :class:`~schedules.measure.Measurer` the search calls: it
  compiles candidates here for the remote target (cross-linked when its architecture is not
  this host's, :func:`~schedules.measure.export`) and has the pool time them there.

The servers' CPU is learned from the servers themselves (:class:`RemoteCpu`, through the
LLVM host queries every full TVM build registers); a server that lacks the ISA the
candidates are built for is never sent one.  Servers run by a TVM runtime without LLVM
cannot say: then the ISA must be given.

Examples
--------
>>> Tracker.parse("10.0.0.5:9190", "zen4")
Tracker(host='10.0.0.5', port=9190, key='zen4')
>>> pool = RemotePool(Tracker.parse("127.0.0.1:9190", "zen4"))      # doctest: +SKIP
>>> tune(problem, target, measurer=RemoteMeasurer(pool, "work"))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from microkernels import isa as _isa

from .measure import FLUSH, Artifact, export, linker, samples
from .ops import Config, Problem

if TYPE_CHECKING:
    from tvm.target import Target

__all__ = ["Tracker", "RemoteError", "RemoteCpu", "RemotePool", "RemoteMeasurer", "Session",
           "cpu_of_features"]

log = logging.getLogger(__name__)

#: LLVM's names of the host CPU's features (what ``GetHostCPUFeatures`` answers) for the
#: ``/proc/cpuinfo`` flags the ISA table (:data:`microkernels.isa.KNOWN`) requires.
_LLVM_FLAGS = {"avx2": "avx2", "fma": "fma", "avx512f": "avx512f", "avx512bw": "avx512bw",
               "avx512vl": "avx512vl", "avx512dq": "avx512dq", "avx512vnni": "avx512_vnni",
               "avx512bf16": "avx512_bf16", "avxvnni": "avx_vnni", "amx-tile": "amx_tile",
               "amx-int8": "amx_int8", "amx-bf16": "amx_bf16", "neon": "asimd",
               "i8mm": "i8mm", "bf16": "bf16"}
#: Bytes of argument tensors a session keeps between batches (beyond the current batch's).
_KEPT_BYTES = 256 << 20


class RemoteError(RuntimeError):
    """The tracker or its servers cannot do what was asked: unreachable, no server under the
    key, no server left, an ISA the servers lack.  One line, naming what to do."""


@dataclass(frozen=True)
class Tracker:
    """A TVM RPC tracker and the device key of the servers to use.

    Examples
    --------
    >>> Tracker.parse("localhost:9190", "arm").port
    9190
    >>> Tracker.parse("localhost", "arm")
    Traceback (most recent call last):
    ...
    ValueError: the tracker is HOST:PORT, got 'localhost'
    """

    host: str
    port: int
    key: str

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("the tracker's host is empty")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or \
                not 0 < self.port < 65536:
            raise ValueError(f"the tracker's port must be in 1..65535, got {self.port!r}")
        if not self.key or any(c in self.key for c in ": \t\n"):
            raise ValueError(f"the device key must be a non-empty word without ':', "
                             f"got {self.key!r}")

    @classmethod
    def parse(cls, address: str, key: str) -> Tracker:
        """The tracker at ``address`` (``HOST:PORT``) with device key ``key``."""
        host, colon, port = address.rpartition(":")
        if not colon or not port.isdigit():
            raise ValueError(f"the tracker is HOST:PORT, got {address!r}")
        return cls(host, int(port), key)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def summary(self, timeout: float = 5.0) -> dict:
        """The tracker's summary (its servers and queues); RemoteError in one line when it
        cannot be reached or is no tracker (TVM's own client would retry for a minute)."""
        try:
            socket.create_connection((self.host, self.port), timeout=timeout).close()
            from tvm import rpc

            return rpc.connect_tracker(self.host, self.port).summary()
        except (OSError, RuntimeError) as err:
            why = err.strerror if isinstance(err, OSError) and err.strerror else err
            raise RemoteError(f"cannot reach the RPC tracker at {self.address}: {why} (start "
                              f"one with `python -m tvm.exec.rpc_tracker --port {self.port}`)"
                              ) from None

    def servers(self, summary: dict) -> int:
        """How many servers the ``summary`` lists under this key."""
        return sum(s.get("key") == f"server:{self.key}" for s in summary.get("server_info", ()))


@dataclass(frozen=True)
class RemoteCpu:
    """What a server says of its CPU: architecture, LLVM's name for it, the flags (in
    ``/proc/cpuinfo``'s spelling) the ISA table asks about, None when LLVM could not read
    them there (e.g. under qemu-user, whose /proc/cpuinfo is the host's), and TVM's thread
    count there.

    Examples
    --------
    >>> cpu = RemoteCpu("x86_64", "znver1", frozenset({"avx2", "fma"}), 2)
    >>> cpu.isa().name, cpu.runs(_isa.from_name("avx512"))
    ('avx2', False)
    >>> RemoteCpu("aarch64", "generic", None, 1).runs(_isa.from_name("neon_i8mm"))
    True
    """

    arch: str
    mcpu: str
    flags: frozenset[str] | None
    threads: int

    def __post_init__(self) -> None:
        if self.arch not in ("x86_64", "aarch64"):
            raise ValueError(f"tvm-tpp has no kernels for {self.arch!r} CPUs")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")

    def runs(self, isa: _isa.Isa) -> bool:
        """Whether this CPU executes ``isa``'s code in a TVM RPC server (taken on trust when
        its flags are unknown): AMX never (the server does not ask Linux for the tile state,
        so the first tile instruction kills it)."""
        return isa.arch == self.arch and not isa.has("amx_tile") and \
            (self.flags is None or isa.runs_on(self.flags))

    def isa(self) -> _isa.Isa:
        """The richest known ISA this CPU :meth:`runs`; RemoteError when its flags are
        unknown (the ISA must then be given)."""
        if self.flags is None:
            raise RemoteError(f"the {self.arch} server ({self.mcpu}) cannot say which CPU "
                              "features it has: give the ISA (--isa NAME)")
        fit = [i for i in _isa.KNOWN.values() if self.runs(i)]
        if not fit:
            raise RemoteError(f"the {self.arch} CPU {self.mcpu!r} runs none of the ISAs "
                              f"tvm-tpp has kernels for; its flags: "
                              f"{' '.join(sorted(self.flags)) or 'none known'}")
        return fit[-1]


def cpu_of_features(triple: str, mcpu: str, features: dict[str, bool], threads: int
                    ) -> RemoteCpu:
    """A :class:`RemoteCpu` from LLVM's answers: the process triple, the host CPU's name and
    its feature map (empty where LLVM cannot read them: flags unknown).

    Examples
    --------
    >>> cpu_of_features("aarch64-unknown-linux-gnu", "neoverse-n1",
    ...                 {"neon": True, "i8mm": False}, 4).isa().name
    'neon'
    """
    flags = frozenset(_LLVM_FLAGS[f] for f, on in features.items() if on and f in _LLVM_FLAGS)
    known = any(features.values())  # every CPU tvm-tpp has kernels for has some feature
    return RemoteCpu(triple.split("-")[0], mcpu, flags if known else None, threads)


def _json_graph_map(text: str) -> dict[str, bool]:
    """The ``{feature: bool}`` map TVM's ``ffi.ToJSONGraphString`` wrote (a remote map is a
    handle: it comes back as this text)."""
    graph = json.loads(text)
    nodes = graph["nodes"]

    def value(i: int) -> Any:
        node = nodes[i]
        if node["type"] == "ir.IntImm":
            return value(node["data"]["value"])
        return node.get("data")

    items = nodes[graph["root_index"]]["data"]
    return {str(value(k)): bool(value(v)) for k, v in zip(items[::2], items[1::2], strict=True)}


def _query_cpu(session: Any) -> RemoteCpu | None:
    """The server's CPU, or None when its TVM has no LLVM to ask (a runtime-only build)."""
    try:
        triple = str(session.get_function("tvm.codegen.llvm.GetProcessTriple")())
        mcpu = str(session.get_function("tvm.codegen.llvm.GetHostCPUName")())
        handle = session.get_function("tvm.codegen.llvm.GetHostCPUFeatures")()
        text = session.get_function("ffi.ToJSONGraphString")(handle, None)
        threads = int(session.get_function("runtime.NumThreads")())
        return cpu_of_features(triple, mcpu, _json_graph_map(str(text)), max(1, threads))
    except (RuntimeError, AttributeError, KeyError, ValueError, TypeError):
        return None


@dataclass
class _Work:
    """Something to run on one server's :class:`Session` (``work(session)``), and what came
    of it."""

    work: Callable[[Session], Any]
    expected: float
    what: str
    tries: int = 0
    result: Any = None
    failure: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def finish(self, result: Any = None, failure: str | None = None) -> None:
        self.result, self.failure = result, failure
        self.done.set()


class Session:
    """One server's RPC session, as :meth:`RemotePool.run` hands it to work: the libraries it
    has loaded and the argument tensors it holds."""

    def __init__(self, session: Any, label: str) -> None:
        self.session, self.label = session, label
        self.device = session.cpu()
        self.modules: dict[Path, Any] = {}
        self.arrays: dict[tuple[tuple[int, ...], str, bool], Any] = {}

    def _module(self, library: Path) -> Any:
        if library not in self.modules:
            self.session.upload(str(library), target=library.name)
            self.modules[library] = self.session.load_module(library.name)
        return self.modules[library]

    def _arguments(self, artifacts: list[Artifact]) -> list[list[Any]]:
        """Per candidate its arguments: seeded random inputs and an output, shared by every
        parameter of the same shape and dtype (as :func:`~schedules.measure.measure`)."""
        import numpy as np
        import tvm

        wanted = {(shape, dtype, i == len(a.params) - 1)
                  for a in artifacts for i, (shape, dtype) in enumerate(a.params)}
        if sum(int(np.prod(k[0])) * np.dtype(k[1]).itemsize for k in self.arrays) > _KEPT_BYTES:
            self.arrays = {k: v for k, v in self.arrays.items() if k in wanted}
        rng = np.random.default_rng(0)
        out = []
        for a in artifacts:
            args = []
            for i, (shape, dtype) in enumerate(a.params):
                key = (shape, dtype, i == len(a.params) - 1)
                if key not in self.arrays:
                    self.arrays[key] = (
                        tvm.runtime.empty(shape, dtype, device=self.device) if key[2]
                        else tvm.runtime.tensor(rng.standard_normal(shape).astype(dtype),
                                                device=self.device))
                args.append(self.arrays[key])
            out.append(args)
        return out

    def time(self, artifacts: list[Artifact], rounds: int, round_seconds: float
             ) -> list[float]:
        """Seconds of one run of each candidate, interleaved as
        :func:`~schedules.measure.time_interleaved` times them here (the server's own timer,
        so the network is not in the figures), all operands but the first flushed from the
        caches before each run (:data:`~schedules.measure.FLUSH`)."""
        args = self._arguments(artifacts)
        modules = [self._module(a.library) for a in artifacts]

        def fastest(i: int, runs: int) -> float:
            evaluator = modules[i].time_evaluator(artifacts[i].name, self.device,
                                                  number=1, repeat=runs, f_preproc=FLUSH)
            return min(evaluator(*args[i]).results)

        best = [fastest(i, 1) for i in range(len(modules))]  # warm-up, a first estimate
        for _ in range(rounds):
            for i in range(len(modules)):
                best[i] = min(best[i], fastest(i, samples(round_seconds, best[i])))
        return best

    def time_model(self, library: Path, inputs: list[Any], number: int, repeat: int
                   ) -> list[float]:
        """Seconds per run of a Relax model exported to ``library``, run by a VM there on
        ``inputs`` (numpy arrays): ``repeat`` samples, each the mean of ``number`` runs."""
        import tvm
        from tvm import relax

        vm = relax.VirtualMachine(self._module(library), self.device)
        args = [tvm.runtime.tensor(a, device=self.device) for a in inputs]
        vm["main"](*args)  # warm-up
        return list(vm.time_evaluator("main", self.device, number=number,
                                      repeat=repeat)(*args).results)


class RemotePool:
    """The servers under a tracker's key, timing batches of candidates in parallel.

    Parameters
    ----------
    tracker
        The tracker and key.
    isa
        The ISA the candidates will be built for; default: the richest the first server runs
        (learned from it).  Servers that lack it get nothing to run.
    timeout
        Seconds a server may take for one batch beyond its timing rounds before it is taken
        for hung: its batch goes to another server.
    tries
        Servers a batch is given to before its candidates are reported failed.
    connect_seconds
        Seconds to wait for the tracker, and for a free server when a session is (re)opened.
    exclusive
        The servers share one machine (several on a many-core host, or loopback): they time
        one at a time, since two timing at once measure each other through the shared caches
        and memory; building and uploading still overlap.

    Raises
    ------
    RemoteError
        The tracker cannot be reached, lists no server under the key, or no server became
        free; the servers' ISA cannot be learned and none was given; they lack ``isa``.

    Examples
    --------
    >>> with RemotePool(Tracker.parse("127.0.0.1:9190", "x86")) as pool:  # doctest: +SKIP
    ...     print(pool.isa.name, pool.size, pool.cpu.mcpu)
    avx2 2 znver1
    """

    def __init__(self, tracker: Tracker, isa: str | None = None, *, timeout: float = 120.0,
                 tries: int = 3, connect_seconds: float = 10.0, exclusive: bool = False
                 ) -> None:
        if not timeout > 0 or not connect_seconds > 0:
            raise ValueError("timeout and connect_seconds must be > 0")
        if tries < 1:
            raise ValueError(f"tries must be >= 1, got {tries}")
        self.tracker, self.timeout, self.tries = tracker, timeout, tries
        self.connect_seconds = connect_seconds
        self.size = tracker.servers(tracker.summary(connect_seconds))
        if not self.size:
            raise RemoteError(f"no RPC server is registered under key {tracker.key!r} at the "
                              f"tracker {tracker.address} (start one with `python -m "
                              f"tvm.exec.rpc_server --tracker {tracker.address} "
                              f"--key {tracker.key}`)")
        self._queue: queue.Queue[_Work | None] = queue.Queue()
        self._lock = threading.Lock()
        self._turn = threading.Lock() if exclusive else None  # whose turn it is to time
        self._live = 0
        self._broken: str | None = None
        self._opened = 0
        first = self._open()
        if first is None:
            raise RemoteError(f"no server under key {tracker.key!r} at {tracker.address} "
                              f"became free within {connect_seconds:g} s")
        session, cpu = first
        given = _isa.from_name(isa) if isa is not None else None
        if cpu is None and given is None:
            raise RemoteError(f"the servers under key {tracker.key!r} cannot say which CPU "
                              "they have (their TVM has no LLVM): give the ISA (--isa NAME)")
        if cpu is not None and cpu.flags is None and given is None:
            cpu.isa()  # RemoteError: give the ISA
        #: The first server's CPU (None: not learned, the ISA was given).
        self.cpu = cpu
        self.isa = given if given is not None else cpu.isa()  # type: ignore[union-attr]
        if cpu is not None and not cpu.runs(self.isa):
            raise RemoteError(f"the servers under key {tracker.key!r} ({cpu.arch} "
                              f"{cpu.mcpu}) cannot run {self.isa.name} code"
                              + ("; AMX is never sent to an RPC server" if
                                 self.isa.has("amx_tile") else
                                 f"; they run {cpu.isa().name}" if cpu.flags is not None
                                 else ""))
        self._threads = [threading.Thread(target=self._work, args=(session,), daemon=True,
                                          name="tpp-remote-0")]
        self._threads += [threading.Thread(target=self._work, args=(None,), daemon=True,
                                           name=f"tpp-remote-{i}") for i in range(1, self.size)]
        self._live = len(self._threads)
        for thread in self._threads:
            thread.start()

    def __enter__(self) -> RemotePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (their sessions end with them); a worker still busy with a batch
        after a few seconds (a run interrupted) is left to finish it."""
        self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout=5.0)

    # -- sessions --------------------------------------------------------------------------

    def _bounded(self, call: Callable[[], Any], seconds: float) -> Any:
        """``call()`` on a thread of its own, given up on after ``seconds`` (an RPC call to a
        stopped machine never returns; the thread is left to it)."""
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["value"] = call()
            except Exception as err:  # noqa: BLE001 - any failure of the server
                result["error"] = err

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(seconds)
        if thread.is_alive():
            raise TimeoutError(f"no answer within {seconds:g} s")
        if "error" in result:
            raise result["error"]
        return result.get("value")

    def _open(self) -> tuple[Session, RemoteCpu | None] | None:
        """A session on a free server under the key and its CPU, or None when none became
        free within ``connect_seconds``."""
        from tvm import rpc

        deadline = time.monotonic() + self.connect_seconds
        while True:
            try:
                summary = self.tracker.summary(self.connect_seconds)
                free = summary["queue_info"].get(self.tracker.key, {}).get("free", 0)
            except (RemoteError, KeyError, AttributeError):
                free = 0
            if free:
                try:
                    raw = self._bounded(lambda: rpc.connect_tracker(
                        self.tracker.host, self.tracker.port).request(
                            self.tracker.key, session_timeout=0, max_retry=1),
                        self.connect_seconds)
                    with self._lock:
                        label, self._opened = f"#{self._opened}", self._opened + 1
                    session = Session(raw, label)
                    return session, self._bounded(lambda r=raw: _query_cpu(r), self.timeout)
                except (RuntimeError, OSError, TimeoutError) as err:
                    log.info(f"opening a session under {self.tracker.key!r} failed: {err}")
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)

    def _work(self, session: Session | None) -> None:
        """A worker: run work from the queue on its session; on a failure, hand the work back
        and open a session on another free server (or retire)."""
        last = "none"
        while True:
            if session is None:
                opened = self._open()
                if opened is None:
                    break
                session, cpu = opened
                if cpu is not None and not cpu.runs(self.isa):
                    log.warning(f"a server under key {self.tracker.key!r} ({cpu.arch} "
                                f"{cpu.mcpu}) lacks {self.isa.name}: nothing is sent to it")
                    break
            item = self._queue.get()
            if item is None:
                self._queue.put(None)  # for the other workers
                break
            try:
                result = self._bounded(lambda s=session, w=item: w.work(s),
                                       self.timeout + 2 * item.expected)
            except Exception as err:  # noqa: BLE001 - the server died, hung or failed
                last = f"{type(err).__name__}: " + (str(err).strip().splitlines() or [""])[-1]
                log.warning(f"server session {session.label} under key {self.tracker.key!r} "
                            f"failed ({last}); its {item.what} go to another server")
                session = None
                self._retry(item, last)
                continue
            item.finish(result)
        self._retire(last)

    def _retry(self, item: _Work, why: str) -> None:
        with self._lock:
            item.tries += 1
            if item.tries >= self.tries:
                item.finish(failure=f"failed on {item.tries} servers, last: {why}"[:200])
            elif self._broken is not None:
                item.finish(failure=self._broken)
            else:
                self._queue.put(item)

    def _retire(self, why: str) -> None:
        """A worker leaves; the last one fails what is still queued."""
        with self._lock:
            self._live -= 1
            if self._live or self._broken is not None:
                return
            self._broken = (f"no RPC server left under key {self.tracker.key!r} at "
                            f"{self.tracker.address} (last failure: {why})")
            for item in self._drain():
                item.finish(failure=self._broken)

    def _drain(self) -> Iterator[_Work]:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                yield item

    # -- timing ----------------------------------------------------------------------------

    def run(self, work: Callable[[Session], Any], expected: float = 0.0,
            what: str = "work") -> Any:
        """``work(session)`` on one server's :class:`Session` (on another if that server
        fails or stays silent for ``timeout`` + twice the ``expected`` seconds), at most
        ``tries`` times.

        Raises
        ------
        RemoteError
            The work failed on ``tries`` servers, or no server is left under the key.
        """
        item = _Work(work, expected, what)
        with self._lock:
            if self._broken is not None:
                raise RemoteError(self._broken)
            self._queue.put(item)
        item.done.wait()
        if item.failure is not None:
            raise RemoteError(item.failure)
        return item.result

    def time(self, artifacts: list[Artifact], rounds: int, round_seconds: float
             ) -> list[float | str]:
        """Time ``artifacts`` together on one server (:meth:`Session.time`): per candidate its
        seconds, or why it could not be timed.

        Raises
        ------
        RemoteError
            No server is left under the key.
        """
        expected = (rounds + 1) * len(artifacts) * max(round_seconds, 0.01)

        def time_in_turn(session: Session) -> list[float]:
            # A server that hangs holding the turn holds it only until its timeout.
            turn = self._turn is not None and self._turn.acquire(timeout=self.timeout)
            try:
                return session.time(artifacts, rounds, round_seconds)
            finally:
                if turn:
                    self._turn.release()  # type: ignore[union-attr]

        try:
            return self.run(time_in_turn, expected, f"{len(artifacts)} candidates")
        except RemoteError as err:
            if self._broken is not None:
                raise
            return [f"RemoteError: {err}"] * len(artifacts)


class RemoteMeasurer:
    """The :class:`~schedules.measure.Measurer` of a :class:`RemotePool`: candidates are
    compiled here into libraries in ``directory`` and timed on the pool's servers.

    ``built`` (the search's cache) maps a config to its :class:`Artifact`: the final round
    sends the same libraries again, never rebuilds.

    Raises
    ------
    RuntimeError
        The target's architecture is not this host's and its cross linker is missing.

    Examples
    --------
    >>> measurer = RemoteMeasurer(pool, "work/candidates")             # doctest: +SKIP
    >>> measurer(problem, configs, target, pool.isa.name)                # doctest: +SKIP
    [4.1e-05, 3.9e-05]
    """

    def __init__(self, pool: RemotePool, directory: str | Path) -> None:
        self.pool = pool
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def __call__(self, problem: Problem, configs: list[Config], target: Target, isa: str,
                 rounds: int = 3, round_seconds: float = 0.05,
                 built: dict[Config, object] | None = None) -> list[float | str]:
        if isa != self.pool.isa.name:  # never send code for an ISA the servers lack
            raise RemoteError(f"candidates for {isa} cannot go to the servers under key "
                              f"{self.pool.tracker.key!r}, which run {self.pool.isa.name}")
        built = {} if built is None else built
        new = [c for c in dict.fromkeys(configs) if c not in built]
        if new:
            linker(str(target.attrs.get("mtriple", "")))
            for config, artifact in zip(new, export(problem, new, target, isa, self.directory),
                                        strict=True):
                built[config] = artifact
        ready = [c for c in dict.fromkeys(configs) if isinstance(built[c], Artifact)]
        timed = dict(zip(ready, self.pool.time([built[c] for c in ready], rounds,  # type: ignore[misc]
                                               round_seconds), strict=True)) if ready else {}
        return [timed[c] if c in timed else built[c] for c in configs]  # type: ignore[misc]
