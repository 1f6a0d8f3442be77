"""The one protocol between a benchmark harness and its worker processes.

Each implementation is built and timed in a worker of its own (:class:`~tvm_tpp.bench.
workers.Worker`): ``python -m tvm_tpp.bench JOB``, ``JOB`` a :class:`Job` as JSON, started by
:func:`start_worker` with the thread-count variables set.  The worker talks JSON lines:

- while preparing, per workload: ``{"step": text, "workload": i}`` (progress), then
  ``{"prepared": i, "ok": true, "compile_seconds", "tune_seconds", "run_seconds", "target",
  "notes", ...}`` (plus what the workload's check reports, e.g. ``max_abs_err``, and
  ``explain``), or ``{"prepared": i, "skipped": reason}``, or ``{"prepared": i, "error":
  reason}``; then ``{"ready": true}``;
- then, per request ``{"time": i, "number": n, "repeat": r, "warmup": w}`` (a
  :class:`~tvm_tpp.bench.timing.Plan`), ``{"seconds": [...]}`` (seconds per run of each
  sample) or ``{"error": reason}``; ``{"quit": true}`` or the end of stdin ends it;
- the ``peak`` job only sends ``{"peak": {...}}`` or ``{"peak": null, "reason": ...}``.

Only the protocol goes to the real stdout: file descriptor 1 is pointed at stderr (the log)
before anything else loads, so library prints (MetaSchedule, LLVM) cannot corrupt it.

Examples
--------
>>> from tvm_tpp.bench.workloads import GemmWorkload
>>> job = Job("tpp", 2, "wd", (GemmWorkload(64, 64, 64),))
>>> Job.from_json(job.to_json()) == job
True
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from microkernels.amx import tiles_usable

from . import workloads as _workloads
from .timing import Plan, Timer, probe_seconds
from .workers import Worker, WorkerError
from .workloads import Workload

__all__ = ["PEAK", "PRECISIONS", "REFERENCE", "Job", "main", "measure", "prepared", "reason",
           "send", "start_worker", "worker_command"]

#: What a benchmark runs the TPP kernels in (``int8``: a QDQ-quantized model).
PRECISIONS = ("float32", "bf16", "int8")
#: The job that only computes ONNX Runtime's reference outputs (not timed).
REFERENCE = "reference"
#: The job that measures one core's fp32 FMA peak instead of a workload.
PEAK = "peak"


def worker_command() -> tuple[str, ...]:
    """The worker's command line (a job's JSON is appended)."""
    return (sys.executable, "-m", "tvm_tpp.bench")


@dataclass(frozen=True)
class Job:
    """What one worker builds and times: one implementation at one thread count.

    Parameters
    ----------
    impl
        An implementation of :data:`tvm_tpp.bench.impls.IMPLS`, :data:`REFERENCE` or
        :data:`PEAK`.
    threads
        Threads of the implementation (TVM's pool size comes from the environment).
    work_dir
        Tuning databases: ``tuning.db`` (tpp-tuned) and ``metaschedule/`` (reused by a
        later run with the same settings).
    workloads
        What to build, check and time, in order.
    seed
        Seed of the GEMM operands and of the searches.
    ms_trials
        MetaSchedule's total trial budget per workload.
    ms_budget
        Seconds tpp-tuned searched for the workload: the time-matched MetaSchedule rows
        (:data:`~tvm_tpp.bench.impls.TIME_MATCHED`) search for a multiple of it.
    top_k, tune_budget
        Candidates the TPP tuner measures per operator, and its seconds per operator.
    explain
        Report the tuner's model ranking next to its measurements (GEMMs).
    tvm_default_limit
        Seconds one untuned TVM GEMM may take before it is skipped.
    precision
        One of :data:`PRECISIONS`: ``bf16`` builds the TPP implementations' dense layers on
        bf16 kernels; ``int8`` says the model is quantized (its QDQ dense layers go to the
        int8 kernels by themselves).
    """

    impl: str
    threads: int
    work_dir: str
    workloads: tuple[Workload, ...] = ()
    seed: int = 0
    ms_trials: int = 64
    ms_budget: float | None = None
    top_k: int = 8
    tune_budget: float | None = None
    explain: bool = False
    tvm_default_limit: float = 5.0
    precision: str = "float32"

    def __post_init__(self) -> None:
        from .impls import IMPLS

        object.__setattr__(self, "workloads", tuple(self.workloads))
        if self.impl not in (*IMPLS, REFERENCE, PEAK):
            raise ValueError(f"unknown implementation {self.impl!r}; known: {', '.join(IMPLS)}")
        for name in ("threads", "ms_trials", "top_k"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.ms_budget is not None and not self.ms_budget >= 0:
            raise ValueError(f"ms_budget must be >= 0 seconds, got {self.ms_budget}")
        if self.tune_budget is not None and not self.tune_budget > 0:
            raise ValueError(f"tune_budget must be > 0 seconds, got {self.tune_budget}")
        if not self.tvm_default_limit > 0:
            raise ValueError(f"tvm_default_limit must be > 0, got {self.tvm_default_limit}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, "
                             f"got {self.precision!r}")

    def to_json(self) -> str:
        fields = asdict(self)
        fields["workloads"] = [_workloads.to_json(w) for w in self.workloads]
        return json.dumps(fields)

    @classmethod
    def from_json(cls, text: str) -> Job:
        fields = json.loads(text)
        fields["workloads"] = tuple(_workloads.from_json(w) for w in fields.get("workloads", ()))
        return cls(**fields)


# ------------------------------------------------------------------------------------------
# Worker side.


def send(channel: IO[str], message: dict[str, Any]) -> None:
    """Write ``message`` as one JSON line and flush it."""
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def reason(err: BaseException) -> str:
    """``"Type: last line of the message"``: what a row says about a failure.

    Examples
    --------
    >>> reason(RuntimeError("building\\n  failed here"))
    'RuntimeError: failed here'
    """
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1].strip() if lines else ''}".rstrip(": ")


def _prepare(job: Job, index: int, workload: Workload, say: Callable[[str], None]
             ) -> tuple[dict[str, Any], Timer | None]:
    """Build, run once (checked), probe one run's seconds: the ``prepared`` message."""
    from .impls import Unavailable, build

    try:
        built = build(job, workload, say)
        say("check")
        start = time.perf_counter()
        outputs = built.run()  # also the first warm-up
        first = time.perf_counter() - start
        checked = workload.check(outputs, job.seed)
        run_seconds = first if built.timer is None else probe_seconds(built.timer, first)
    except Unavailable as err:
        return {"prepared": index, "skipped": str(err)}, None
    except Exception as err:
        traceback.print_exc()
        return {"prepared": index, "error": reason(err)}, None
    answer = {"prepared": index, "ok": True, "compile_seconds": built.compile_seconds,
              "tune_seconds": built.tune_seconds, "search_seconds": built.search_seconds,
              "run_seconds": run_seconds,
              "target": built.target, "notes": built.notes, **checked}
    if job.explain and built.explain is not None:
        answer["explain"] = built.explain
    return answer, built.timer


def _peak_message() -> dict[str, Any]:
    try:
        from microkernels.peak import measure_peak

        peak = measure_peak()
    except Exception as err:
        traceback.print_exc()
        return {"peak": None, "reason": reason(err)}
    return {"peak": {"isa": peak.isa, "gflops_per_core": peak.peak_gflops,
                     "clock_ghz": peak.clock_ghz}}


def _samples(ready: dict[int, Timer], request: dict[str, Any]) -> list[float]:
    index = int(request["time"])
    if index not in ready:
        raise ValueError(f"workload {index} was not prepared")
    seconds = ready[index](int(request["number"]), int(request["repeat"]),
                           bool(request["warmup"]))
    if not all(math.isfinite(s) and s > 0 for s in seconds):
        raise ValueError(f"no time measured: {seconds}")
    return seconds


def main(argv: Sequence[str] | None = None) -> int:
    """Serve one job (see the module docstring); 0 unless the job itself is malformed."""
    argv = sys.argv[1:] if argv is None else list(argv)
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else written to stdout goes to the log
    # Before anything is built or timed: where Linux grants the AMX tile state, this process
    # may run AMX kernels; where it refuses, the host target picks no AMX (no SIGILL).
    tiles_usable()
    job = Job.from_json(argv[0])
    if job.impl == PEAK:
        send(channel, _peak_message())
        return 0
    ready: dict[int, Timer] = {}
    for index, workload in enumerate(job.workloads):
        def say(text: str, index: int = index) -> None:
            send(channel, {"step": text, "workload": index})

        say("build")
        answer, kept = _prepare(job, index, workload, say)
        if kept is not None:
            ready[index] = kept
        send(channel, answer)
    send(channel, {"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            break
        try:
            send(channel, {"seconds": _samples(ready, request)})
        except Exception as err:
            traceback.print_exc()
            send(channel, {"error": reason(err)})
    return 0


# ------------------------------------------------------------------------------------------
# Harness side.


def start_worker(command: Sequence[str], job: Job, log: Path) -> Worker:
    """Start ``job``'s worker with every thread pool it may use sized before anything loads.

    TVM sizes its pool from ``TVM_NUM_THREADS`` when its runtime starts and OpenMP kernels
    follow ``OMP_NUM_THREADS``; BLAS gets the job's threads only when it is what is timed
    (numpy), else one, so it does not spin beside the timed pools.  The peak is one core's.
    """
    threads = str(1 if job.impl == PEAK else job.threads)
    blas = threads if job.impl == "numpy" else "1"
    env = {"TVM_NUM_THREADS": threads, "OMP_NUM_THREADS": threads,
           "OPENBLAS_NUM_THREADS": blas, "MKL_NUM_THREADS": blas}
    return Worker([*command, job.to_json()], log, env)


def prepared(worker: Worker, timeout: float, on_step: Callable[[int, str], None]
             ) -> Iterator[dict[str, Any]]:
    """Each ``prepared`` message of ``worker`` until it is ready; steps go to ``on_step``.

    Raises
    ------
    WorkerError
        The worker died, stayed silent ``timeout`` seconds or answered nonsense.
    """
    while True:
        message = worker.receive(timeout)
        if "step" in message:
            on_step(int(message["workload"]), str(message["step"]))
        elif "prepared" in message:
            yield message
        elif message.get("ready"):
            return
        else:
            worker.kill()
            raise WorkerError(f"unexpected message {str(message)[:80]}")


class TimingError(RuntimeError):
    """A measurement failed, but the worker lives on."""


def measure(worker: Worker, index: int, plan: Plan, timeout: float) -> list[float]:
    """Seconds per run of each sample of one measurement of workload ``index``.

    Raises
    ------
    TimingError
        The worker could not time it (the message says why).
    WorkerError
        The worker died, timed out or answered nonsense (it is gone).
    """
    reply = worker.request({"time": index, "number": plan.number, "repeat": plan.samples,
                            "warmup": plan.warmup}, timeout=timeout)
    if "error" in reply:
        raise TimingError(str(reply["error"]))
    seconds = reply.get("seconds")
    if not isinstance(seconds, list) or not seconds:
        worker.kill()
        raise WorkerError(f"unexpected reply {str(reply)[:80]}")
    return [float(s) for s in seconds]
