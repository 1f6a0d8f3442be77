"""The benchmarks' one timer and one sampling policy.

A :data:`Timer` times ``number`` back-to-back runs, ``repeat`` times, optionally after one
untimed warm-up run, and gives seconds per run of each sample.  Every implementation of
every benchmark is timed through one: :func:`loop_timer` around a Python call, or
:func:`tvm_timer` around a TVM function (TVM's own ``time_evaluator`` when there is a
warm-up).  A :class:`SamplingPolicy` sizes the samples of one measurement from the seconds of
one run (:func:`probe_seconds`); the benchmarks differ only in its parameters.  Who is timed
when is :func:`turn_order`: measurements alternate between implementations so that drift of
the machine hits all alike.

Examples
--------
>>> timer = loop_timer(lambda: sum(range(100)))
>>> len(timer(10, 3, True))
3
>>> SamplingPolicy(samples=10).plan(0.001)
Plan(number=50, samples=10, warmup=True)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

__all__ = ["PAUSE_SECONDS", "PROBE_SECONDS", "Plan", "SamplingPolicy", "Timer", "loop_timer",
           "probe_seconds", "turn_order", "tvm_timer"]

#: ``timer(number, repeat, warmup)`` -> seconds per run of each of ``repeat`` samples.
Timer = Callable[[int, int, bool], list[float]]
#: Runs shorter than this are timed again over about this long before samples are sized.
PROBE_SECONDS = 0.05
#: Quiet before each measurement, so spinning threads of the previous worker park (50 ms was
#: not enough here: whichever implementation followed a TVM worker measured up to 2x slower).
PAUSE_SECONDS = 0.3
# At most this many back-to-back runs in one sample.
_MAX_NUMBER = 10_000
# A first run at least this long is its own probe.
_PROBED_BELOW = 1.0
_T = TypeVar("_T")


def loop_timer(call: Callable[[], object]) -> Timer:
    """A :data:`Timer` of ``call`` in a Python loop (the warm-up is one untimed call)."""

    def timer(number: int, repeat: int, warmup: bool) -> list[float]:
        if warmup:
            call()
        samples = []
        for _ in range(repeat):
            start = time.perf_counter()
            for _ in range(number):
                call()
            samples.append((time.perf_counter() - start) / number)
        return samples

    return timer


def tvm_timer(module: Any, name: str, args: Sequence[Any]) -> Timer:
    """A :data:`Timer` of ``module[name](*args)``: TVM's ``time_evaluator`` with a warm-up
    (it always makes one untimed call first), a Python loop without one.

    ``module`` is a ``tvm.runtime.Module`` or a ``relax.VirtualMachine``.
    """
    import tvm

    loop = loop_timer(lambda: module[name](*args))
    evaluators: dict[tuple[int, int], Callable] = {}

    def timer(number: int, repeat: int, warmup: bool) -> list[float]:
        if not warmup:
            return loop(number, repeat, False)
        if (number, repeat) not in evaluators:
            evaluators[number, repeat] = module.time_evaluator(name, tvm.cpu(), number=number,
                                                               repeat=repeat)
        return list(evaluators[number, repeat](*args).results)

    return timer


def probe_seconds(timer: Timer, first: float) -> float:
    """Seconds of one run, from which samples are sized (:meth:`SamplingPolicy.plan`).

    A first run over a second is its own probe.  Faster ones are timed again after a warm-up,
    and those under :data:`PROBE_SECONDS` over about that long: one run may include waking
    the thread pool, up to 10x a 60-us model's run, and a probe that long would shrink the
    samples to a tenth of the others'.

    Examples
    --------
    >>> cold_then_steady = lambda number, repeat, warmup: [6e-4 if number == 1 else 6e-5]
    >>> probe_seconds(cold_then_steady, first=1e-3), probe_seconds(cold_then_steady, first=2.0)
    (6e-05, 2.0)
    """
    if first > _PROBED_BELOW:
        return first
    (once,) = timer(1, 1, True)
    if once >= PROBE_SECONDS:
        return once
    return timer(math.ceil(PROBE_SECONDS / max(once, 1e-9)), 1, True)[0]


class Plan(NamedTuple):
    """One measurement: ``samples`` samples of ``number`` back-to-back runs each."""

    number: int
    samples: int
    warmup: bool


@dataclass(frozen=True)
class SamplingPolicy:
    """How many runs make a sample and how many samples make a measurement.

    Parameters
    ----------
    samples
        Samples per measurement (more when ``fill_seconds`` allows, fewer for slow runs).
    sample_seconds
        A sample runs back to back until it is about this long.
    fill_seconds, max_samples
        More samples while they fit in ``fill_seconds``, at most ``max_samples``.
    slow_seconds
        Runs longer than this are sampled one at a time without a warm-up.
    budget_seconds, min_samples
        The samples of one measurement take at most about ``budget_seconds``, but there are
        at least ``min_samples`` (and never more than otherwise planned).

    Examples
    --------
    >>> networks = SamplingPolicy(samples=10)
    >>> networks.plan(0.5), networks.plan(6.0), networks.plan(100.0)
    (Plan(number=1, samples=10, warmup=True), Plan(number=1, samples=5, warmup=False), \
Plan(number=1, samples=3, warmup=False))
    >>> gemm = SamplingPolicy(samples=10, sample_seconds=1e-3, fill_seconds=0.4,
    ...                       slow_seconds=math.inf, budget_seconds=10.0, min_samples=1)
    >>> gemm.plan(1e-5), gemm.plan(4.0)
    (Plan(number=100, samples=200, warmup=True), Plan(number=1, samples=2, warmup=True))
    """

    samples: int = 10
    sample_seconds: float = 0.05
    fill_seconds: float = 0.0
    max_samples: int = 200
    slow_seconds: float = 1.0
    budget_seconds: float = 30.0
    min_samples: int = 3

    def __post_init__(self) -> None:
        for name in ("samples", "max_samples", "min_samples"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        for name in ("sample_seconds", "slow_seconds", "budget_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.fill_seconds < 0:
            raise ValueError(f"fill_seconds must be >= 0, got {self.fill_seconds}")

    def plan(self, run_seconds: float) -> Plan:
        """The measurement of a run of ``run_seconds`` (see the class docstring)."""
        run = max(run_seconds, 1e-9)
        slow = run > self.slow_seconds
        number = 1 if slow else max(1, min(_MAX_NUMBER, math.ceil(self.sample_seconds / run)))
        sample = number * run
        count = max(self.samples, min(self.max_samples, int(self.fill_seconds / sample)))
        count = max(min(count, self.min_samples), min(count, int(self.budget_seconds / sample)))
        return Plan(number, count, not slow)


def turn_order(items: Sequence[_T], round_: int) -> list[_T]:
    """The order in which ``items`` are timed in round ``round_`` of an alternating benchmark.

    Who goes first rotates each round, and every other round runs in reverse: a rotation
    alone keeps each implementation behind the same neighbour, whose threads may still be
    spinning.

    Examples
    --------
    >>> [turn_order("abc", r) for r in range(3)]
    [['a', 'b', 'c'], ['a', 'c', 'b'], ['c', 'a', 'b']]
    """
    if not items:
        return []
    shift = round_ % len(items)
    order = [*items[shift:], *items[:shift]]
    return order if round_ % 2 == 0 else order[::-1]
