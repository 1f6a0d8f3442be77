"""Where a built model's time goes: each VM call timed, grouped by kind.

TVM 0.27's Relax VM has no profiler; :func:`profile_vm` times every call instruction of
``main`` with the VM's instrument hook (a timer before and after each call) over ``repeat``
runs, and :func:`operator_kind` sorts what was called into :data:`KINDS`:

- ``tpp``: a TPP kernel (the graph passes name them ``tpp_...``);
- ``layout``: a layout conversion, a function (fused or not) whose name words are only data
  movement: transpose, reshape, pad, layout_transform, astype, strided_slice, concatenate, ...;
- ``tvm``: everything else TVM lowers itself (its fallback: softmax, layer_norm, a transpose
  fused with an activation, ...);
- ``builtin``: the VM's own builtins (``vm.builtin.alloc_tensor``, shape checks, ...).

Timing each call costs a Python callback per call, so a profiled run is slower than a
timed one (``run_seconds`` against :meth:`~tvm_tpp.compiler.CompiledModel.time`); the shares
are of the time measured inside calls and sum to 1.

Examples
--------
>>> [operator_kind(n) for n in ("tpp_dense_1x1024x512_bias_relu", "fused_transpose_pad1",
...                             "fused_reshape5_transpose7_maximum3", "vm.builtin.alloc_tensor")]
['tpp', 'layout', 'tvm', 'builtin']
"""

from __future__ import annotations

import re
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KINDS", "KIND_NAMES", "LAYOUT_WORDS", "OperatorTime", "Profile", "operator_kind",
           "profile_vm"]

#: The kinds of calls, in the order reports list them.
KINDS = ("tpp", "layout", "tvm", "builtin")
#: What each kind is called in reports.
KIND_NAMES = {"tpp": "TPP kernel", "layout": "layout conversion", "tvm": "TVM fallback",
              "builtin": "VM builtin"}
#: Name words (digits stripped, ``_``-separated) of operators that only move data.
LAYOUT_WORDS = frozenset({
    "transpose", "reshape", "pad", "layout", "transform", "astype", "cast", "strided", "slice",
    "concatenate", "concat", "squeeze", "unsqueeze", "expand", "dims", "flatten", "split",
    "permute", "copy", "broadcast", "to", "tile", "repeat", "stack", "rows",
})


def operator_kind(name: str) -> str:
    """The kind (:data:`KINDS`) of the VM call named ``name``.

    Examples
    --------
    >>> operator_kind("fused_transpose_pad_strided_slice_strided_slice1_concatenate")
    'layout'
    >>> operator_kind("layer_norm"), operator_kind("pad1"), operator_kind("tpp_dwconv2d_1x8")
    ('tvm', 'layout', 'tpp')
    """
    if name.startswith("vm.") or name.startswith("vm_builtin"):
        return "builtin"
    if name.startswith("tpp_"):
        return "tpp"
    words = [re.sub(r"\d+$", "", w) for w in name.split("_")]
    words = [w for w in words if w and w != "fused"]
    if words and all(w in LAYOUT_WORDS for w in words):
        return "layout"
    return "tvm"


@dataclass(frozen=True)
class OperatorTime:
    """One called function: seconds and calls per run, its share of the measured time."""

    name: str
    kind: str
    calls: int
    seconds: float
    share: float


@dataclass(frozen=True)
class Profile:
    """Per-operator times of a model, slowest first, and their totals by kind.

    ``seconds`` and ``shares`` map each of :data:`KINDS` to its seconds per run and share of
    ``measured_seconds`` (the time inside calls; shares sum to 1 when anything was called);
    ``run_seconds`` is one profiled run's wall time (the rest is the VM's interpretation
    and the profiler's own callbacks); ``latency_seconds`` the median of ``repeat`` unprofiled
    runs.
    """

    operators: tuple[OperatorTime, ...]
    seconds: dict[str, float]
    shares: dict[str, float]
    measured_seconds: float
    run_seconds: float
    repeat: int
    latency_seconds: float | None = None
    calls: dict[str, int] = field(default_factory=dict)

    def top(self, count: int) -> tuple[OperatorTime, ...]:
        """The ``count`` slowest operators."""
        return self.operators[:count]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of the profile."""
        return {"operators": [vars(o) for o in self.operators], "seconds": self.seconds,
                "shares": self.shares, "calls": self.calls,
                "measured_seconds": self.measured_seconds, "run_seconds": self.run_seconds,
                "latency_seconds": self.latency_seconds, "repeat": self.repeat}


def profile_vm(vm, args: Sequence[Any], repeat: int = 10, warmup: int = 3,
               function: str = "main") -> Profile:
    """Time every call of ``vm[function](*args)`` over ``repeat`` runs (after ``warmup``
    runs and ``repeat`` unprofiled timed ones) and group them by :func:`operator_kind`.

    ``vm`` gets an instrument for the runs: give it a VM of its own.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    entry = vm[function]
    for _ in range(warmup):
        entry(*args)
    latencies = []
    for _ in range(repeat):  # the unprofiled runs, warm, as tvm-tpp bench times them
        start = time.perf_counter()
        entry(*args)
        latencies.append(time.perf_counter() - start)
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    started: list[float] = []
    clock = time.perf_counter

    def instrument(func, name, before, ret, *call_args) -> int:
        if before:
            started.append(clock())
        else:
            totals[name] += clock() - started.pop()
            counts[name] += 1
        return 0  # VMInstrumentReturnKind.NO_OP

    vm.set_instrument(instrument)
    start = time.perf_counter()
    for _ in range(repeat):
        entry(*args)
    run_seconds = (time.perf_counter() - start) / repeat
    measured = sum(totals.values()) / repeat
    operators = sorted(
        (OperatorTime(name, operator_kind(name), counts[name] // repeat, seconds / repeat,
                      seconds / repeat / measured if measured else 0.0)
         for name, seconds in totals.items()),
        key=lambda o: -o.seconds)
    by_kind = {kind: sum(o.seconds for o in operators if o.kind == kind) for kind in KINDS}
    return Profile(
        operators=tuple(operators), seconds=by_kind,
        shares={k: (s / measured if measured else 0.0) for k, s in by_kind.items()},
        measured_seconds=measured, run_seconds=run_seconds, repeat=repeat,
        latency_seconds=statistics.median(latencies),
        calls={k: sum(o.calls for o in operators if o.kind == k) for k in KINDS})
