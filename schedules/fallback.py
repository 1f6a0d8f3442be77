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

__all__ = ["Guarded", "ParallelLoops", "fallback_schedules"]


class ParallelLoops(dl.ScheduleRule):
    """Parallel leading spatial loops, vectorized injective inner loops."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc):
            return None
        sch = s_tir.Schedule(func)
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
            if info.is_injective() and spatial >= 2:
                inner = loops[spatial - 1]
                extent = sch.get(inner).extent
                width = next((w for w in (lanes, lanes // 2, 4) if w > 1 and
                              isinstance(extent, tirx.IntImm) and extent.value % w == 0), None)
                if width is not None:
                    sch.vectorize(sch.split(inner, [None, width])[1])
                outer = loops[: spatial - 1]
            if outer:
                sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
        return sch


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
    rules = (dl.cpu.GEMV(), dl.cpu.Reduction(), ParallelLoops())
    return dl.ApplyDefaultSchedule(*(Guarded(rule) for rule in rules))
