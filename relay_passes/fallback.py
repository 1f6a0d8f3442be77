"""Schedules for what TVM lowers itself: the operators no TPP pattern took.

TVM 0.27 schedules nothing on CPU by default (the legalized loops run serial and scalar), so
the ``tpp`` pipeline applies DLight's CPU rules (GEMV; softmax/layer-norm style reductions)
and, for everything else, :class:`ParallelLoops`: the leading spatial loops of each block are
fused and run in parallel, and an injective block's innermost loop is vectorized when the
vector length divides it.  Functions already scheduled (the TPP kernels) are left alone.
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.target import Target

__all__ = ["ParallelLoops", "fallback_schedules"]


class ParallelLoops(dl.ScheduleRule):
    """Parallel leading spatial loops, vectorized injective inner loops."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        lanes = max(1, tvm.target.codegen.llvm_get_vector_width(target) // 32)
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
                if isinstance(extent, tirx.IntImm) and extent.value % lanes == 0 and lanes > 1:
                    sch.vectorize(sch.split(inner, [None, lanes])[1])
                outer = loops[: spatial - 1]
            if outer:
                sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
        return sch


def fallback_schedules() -> tvm.transform.Pass:
    """DLight CPU rules, then :class:`ParallelLoops` for the rest."""
    return dl.ApplyDefaultSchedule(dl.cpu.GEMV(), dl.cpu.Reduction(), ParallelLoops())
