"""Schedules for what TVM lowers itself: the operators no TPP pattern took.

TVM 0.27 schedules nothing on CPU by default (the legalized loops run serial and scalar), so
the ``tpp`` pipeline applies DLight's CPU rules (GEMV; softmax/layer-norm style reductions)
and, for everything else, :class:`ParallelLoops`: the leading spatial loops of each block are
fused and run in parallel, and an injective block's innermost loop is vectorized by the widest
of a full, half or quarter-width (4 lanes) vector that divides it.  Functions already
scheduled (the TPP kernels) are left alone.

Examples
--------
>>> from tvm import te
>>> x = te.placeholder((6, 40), "float32", name="x")
>>> f = te.create_prim_func([x, te.compute((6, 40), lambda i, j: x[i, j] * 2.0, name="y")])
>>> with tvm.target.Target({"kind": "llvm", "mcpu": "haswell"}):
...     mod = fallback_schedules()(tvm.IRModule({"main": f}))
>>> bool(mod["main"].attrs["tirx.is_scheduled"])
True
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.target import Target

from microkernels.machine import is_tpp, machine_of

__all__ = ["Guarded", "Inlined", "ParallelLoops", "fallback_schedules", "inline_elementwise"]


#: Calls cheap enough to recompute in each consumer when their block is inlined into several.
_CHEAP_CALLS = frozenset({
    "tirx.round", "tirx.nearbyint", "tirx.floor", "tirx.ceil", "tirx.trunc", "tirx.fabs",
    "tirx.reinterpret", "tirx.if_then_else", "tirx.likely",
})


def _costly(stmt: tirx.Stmt) -> bool:
    """Whether ``stmt`` calls anything but :data:`_CHEAP_CALLS` (exp, erf, rsqrt, ...)."""
    import tvm_ffi

    call_type = type(tirx.exp(tirx.Var("x", "float32")))
    found = []
    tvm_ffi.structural_walk(stmt, (call_type, lambda c: found.append(
        getattr(c.op, "name", None) not in _CHEAP_CALLS)))
    return any(found)


def inline_elementwise(sch: s_tir.Schedule) -> bool:
    """``compute_inline`` the function's injective intermediate blocks into their consumers.

    A block goes if it has one consumer, or if its computation is cheap (no transcendental
    call) so that recomputing it in each consumer costs less than a round trip through
    memory.  Without this, a fused chain of N elementwise operators (the quantized GELU's
    dequantize, divide, erf, quantize, ... ) makes N passes over N intermediate tensors, each
    its own parallel loop.  Blocks the primitive refuses (e.g. stores through a reshape's
    index arithmetic) stay.  Returns whether any block was inlined.

    Examples
    --------
    >>> from tvm import te
    >>> x = te.placeholder((4, 8), "float32", name="x")
    >>> y = te.compute((4, 8), lambda i, j: x[i, j] + 1.0, name="y")
    >>> z = te.compute((4, 8), lambda i, j: y[i, j] * 2.0, name="z")
    >>> sch = s_tir.Schedule(te.create_prim_func([x, z]))
    >>> inline_elementwise(sch)
    True
    >>> 'sblock("y")' in sch.mod["main"].script()
    False
    """
    infos = normalize_prim_func(sch)
    if infos is None:
        return False
    inlined = False
    for info in infos:
        if not info.is_injective():
            continue
        block = info.block_rv
        if len(sch.get_consumers(block)) > 1 and _costly(sch.get(block).body):
            continue
        try:
            sch.compute_inline(block)
        except s_tir.ScheduleError:
            continue
        inlined = True
    return inlined


def _width(extent: tirx.PrimExpr, lanes: int) -> int | None:
    """The widest of a full, half or quarter-width (4 lanes) vector dividing ``extent``."""
    if not isinstance(extent, tirx.IntImm):
        return None
    return next((w for w in (lanes, lanes // 2, 4) if w > 1 and extent.value % w == 0), None)


class ParallelLoops(dl.ScheduleRule):
    """Inlined elementwise chains, parallel leading spatial loops, vectorized injective inner
    loops (a 1-D injective block: split into a parallel outer and a vector inner loop)."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc):
            return None
        sch = s_tir.Schedule(func)
        inline_elementwise(sch)
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        lanes = machine_of(target).isa.lanes("float32") if is_tpp(target) else 8
        for info in infos:
            kinds = info.dom_kind()
            spatial = len(kinds) - len(kinds.lstrip("S"))
            loops = sch.get_loops(info.block_rv)
            if spatial == 0 or len(loops) != len(kinds):
                continue
            outer = loops[:spatial]
            if info.is_injective():
                inner = loops[spatial - 1]
                width = _width(sch.get(inner).extent, lanes)
                if width is not None:
                    split = sch.split(inner, [None, width])
                    sch.vectorize(split[1])
                    outer = loops[: spatial - 1] if spatial >= 2 else [split[0]]
                elif spatial >= 2:
                    outer = loops[: spatial - 1]
            if outer:
                sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
        return sch


class Inlined(dl.ScheduleRule):
    """``rule`` applied after :func:`inline_elementwise` (e.g. DLight's ``Reduction``, which
    would otherwise run each of softmax's quantize/dequantize epilogue blocks as its own
    loop over an intermediate buffer)."""

    def __init__(self, rule: dl.ScheduleRule) -> None:
        self.rule = rule

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        if not isinstance(func, tirx.PrimFunc):
            return None
        sch = s_tir.Schedule(func)
        if inline_elementwise(sch):
            func = sch.mod["main"]
        return self.rule.apply(func, target, tunable)


class Guarded(dl.ScheduleRule):
    """A rule whose failure on some function leaves that function unscheduled (still correct).

    DLight's rules raise on shapes they do not expect (e.g. ``Reduction`` on an average pool
    whose result is an output block); one such function must not fail the whole model.
    """

    def __init__(self, rule: dl.ScheduleRule) -> None:
        self.rule = rule

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        try:
            return self.rule.apply(func, target, tunable)
        except s_tir.ScheduleError:
            return None


def fallback_schedules() -> tvm.transform.Pass:
    """DLight CPU rules, then :class:`ParallelLoops` for the rest."""
    rules = (dl.cpu.GEMV(), Inlined(dl.cpu.Reduction()), ParallelLoops())
    return dl.ApplyDefaultSchedule(*(Guarded(rule) for rule in rules))
