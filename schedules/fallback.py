"""Schedules for what TVM lowers itself: the operators no TPP pattern took.

TVM 0.27 schedules nothing on CPU by default (the legalized loops run serial and scalar), so
the ``tpp`` pipeline applies DLight's CPU GEMV rule, :class:`RowReduction` for softmax /
layer-norm style functions (vectorized partial reductions; DLight's ``Reduction`` for the
rows no vector divides) and, for everything else, :class:`ParallelLoops`: the leading spatial
loops of each block are fused and run in parallel, and an injective block's innermost loop is
vectorized by the widest of a full, half or quarter-width (4 lanes) vector that divides it.
Before any of them, a fused function's elementwise chain is inlined into one block
(:func:`inline_elementwise`): a quantized GELU is ~20 operators, each otherwise its own loop
over its own intermediate tensor.  Functions already scheduled (the TPP kernels) are left
alone.  The exp/erf/tanh/sigmoid calls these functions make become vectorizable polynomials
afterwards (:func:`microkernels.fast_math.fast_math`, in the pipeline).

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

import logging

import tvm
from tvm import s_tir, tirx
from tvm.ir import expr as ir_expr
from tvm.s_tir import dlight as dl
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.target import Target

from microkernels.machine import is_tpp, machine_of

from .nest import loop_bound_to

_log = logging.getLogger("tvm_tpp.fallback")

__all__ = [
    "ChannelsLastReduction", "Guarded", "Inlined", "ParallelLoops", "RowReduction",
    "fallback_schedules",
    "inline_elementwise",
]


#: Calls cheap enough to recompute in each consumer when their block is inlined into several.
_CHEAP_CALLS = frozenset({
    "tirx.round", "tirx.nearbyint", "tirx.floor", "tirx.ceil", "tirx.trunc", "tirx.fabs",
    "tirx.reinterpret", "tirx.if_then_else", "tirx.likely",
})


def _costly(stmt: tirx.Stmt) -> bool:
    """Whether ``stmt`` calls anything but :data:`_CHEAP_CALLS` (exp, erf, rsqrt, ...)."""
    import tvm_ffi

    found = []
    tvm_ffi.structural_walk(stmt, (ir_expr.Call, lambda c: found.append(
        getattr(c.op, "name", None) not in _CHEAP_CALLS)))
    return any(found)


def _reads(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> int:
    """How many loads of ``block``'s result its consumers make (each one recomputes it once
    the block is inlined)."""
    import tvm_ffi

    buffer = sch.get(block).writes[0].source
    loads = []
    for consumer in sch.get_consumers(block):
        tvm_ffi.structural_walk(sch.get(consumer).body, (
            ir_expr.TensorLoad, lambda load: loads.append(load.source.same_as(buffer))))
    return sum(loads)


def inline_elementwise(sch: s_tir.Schedule) -> bool:
    """``compute_inline`` the function's injective intermediate blocks into their consumers.

    A block goes if its result is read once, or if its computation is cheap (no
    transcendental call) so that recomputing it at each read costs less than a round trip
    through memory.  Without this, a fused chain of N elementwise operators (the quantized GELU's
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
        if _costly(sch.get(block).body) and _reads(sch, block) > 1:
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


def _interleave(block: s_tir.SBlock, var: tirx.Var) -> int | None:
    """``G`` where ``block`` reads at ``floormod(var, G)`` and ``floordiv(var, G)`` (a
    channel shuffle's ``c % G * C/G + c // G``), for a few groups: consecutive ``var`` read
    ``G`` separate streams."""
    import tvm_ffi

    found = {tirx.FloorMod: set(), tirx.FloorDiv: set()}

    def visit(op: tirx.PrimExpr) -> None:
        if op.a.same_as(var) and isinstance(op.b, tirx.IntImm) and 1 < op.b.value <= 16:
            found[type(op)].add(op.b.value)

    tvm_ffi.structural_walk(block.body, [(tirx.FloorMod, visit), (tirx.FloorDiv, visit)])
    return min(found[tirx.FloorMod] & found[tirx.FloorDiv], default=None)


class ParallelLoops(dl.ScheduleRule):
    """Inlined elementwise chains, parallel leading spatial loops, vectorized injective inner
    loops (a 1-D injective block: split into a parallel outer and a vector inner loop).

    An inner loop that interleaves ``G`` input streams (a channel shuffle) is split by ``G``
    and the ``G`` copies unrolled instead: LLVM's loop vectorizer turns the interleaved
    stores into contiguous loads and vector shuffles (4-10x a vector of per-lane gathers)."""

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
                extent = sch.get(inner).extent
                width = _width(extent, lanes)
                block = sch.get(info.block_rv)
                streams = _interleave(block, block.iter_vars[spatial - 1].var)
                if streams is not None and isinstance(extent, tirx.IntImm) \
                        and extent.value % streams == 0 and spatial >= 2:
                    sch.unroll(sch.split(inner, [None, streams])[1])
                    outer = loops[: spatial - 1]
                elif width is not None:
                    split = sch.split(inner, [None, width])
                    sch.vectorize(split[1])
                    outer = loops[: spatial - 1] if spatial >= 2 else [split[0]]
                elif spatial >= 2:
                    outer = loops[: spatial - 1]
            if outer:
                sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
        return sch


class RowReduction(dl.ScheduleRule):
    """Softmax / layer-norm style functions (row reductions and elementwise blocks sharing
    leading spatial axes), with vectorized reductions.

    Like DLight's CPU ``Reduction`` (each row's blocks under one parallel loop), but each
    reduction whose (single, innermost) axis a vector divides first becomes ``lanes`` partial
    reductions (``rfactor``): a vector accumulator over the row, then ``lanes`` scalar steps.
    A sum or max over a row otherwise runs as one scalar dependence chain (LLVM may not
    reorder float additions).  The elementwise chains are inlined first
    (:func:`inline_elementwise`) and the elementwise blocks' inner loops vectorized.
    Functions of another shape, or whose reductions no vector divides, are left to the
    next rule.
    """

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc):
            return None
        sch = s_tir.Schedule(func)
        inline_elementwise(sch)
        infos = normalize_prim_func(sch)
        if (infos is None or len(infos) < 2 or not infos[-1].is_injective()
                or all(info.is_injective() for info in infos)):
            return None
        kinds = [info.dom_kind() for info in infos]
        lead = min(len(k) - len(k.lstrip("S")) for k in kinds)
        # One reduction axis at most, innermost.
        if lead == 0 or any("R" in k[:-1] or k.count("R") > 1 for k in kinds):
            return None
        lanes = machine_of(target).isa.lanes("float32") if is_tpp(target) else 8
        factored = []
        for info in infos:
            if info.is_injective():
                continue
            loops = sch.get_loops(info.block_rv)
            extent = sch.get(loops[-1]).extent
            if not isinstance(extent, tirx.IntImm) or extent.value % lanes or extent.value <= lanes:
                return None
            inner = sch.split(loops[-1], [None, lanes])[1]
            ndim = len(sch.get(info.block_rv).writes[0].source.shape)
            factored.append(sch.rfactor(inner, factor_axis=ndim))
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        rows = sch.get_loops(blocks[-1])[:lead]
        rows = sch.fuse(*rows) if lead > 1 else rows[0]
        sch.parallel(rows)
        for block in reversed(blocks[:-1]):
            sch.compute_at(block, rows, preserve_unit_loops=True)
        names = {sch.get(block).name_hint for block in factored}
        for block in blocks:
            stmt = sch.get(block)
            if stmt.name_hint in names:
                across = loop_bound_to(sch, block, tirx.IterVar.DataPar)
                along = loop_bound_to(sch, block, tirx.IterVar.CommReduce)
                sch.reorder(along, across)
                sch.vectorize(across)
            elif all(iv.iter_type == tirx.IterVar.DataPar for iv in stmt.iter_vars):
                inner = sch.get_loops(block)[-1]
                width = _width(sch.get(inner).extent, lanes)
                if width is not None and not inner.same_as(rows):
                    sch.vectorize(sch.split(inner, [None, width])[1])
        return sch


def _indexed_last_by(region: tirx.BufferRegion, var: tirx.Var) -> bool:
    """Whether ``region``'s innermost index is ``var`` itself (a unit-stride access along it)."""
    last = region.region[-1].min
    return isinstance(last, tirx.Var) and last.same_as(var)


class ChannelsLastReduction(dl.ScheduleRule):
    """Reductions over the outer axes of a channels-last tensor (NHWC pooling, spatial
    means): the reduction loops move outside the channel loop, which is vectorized.

    ``S..S c R..R`` (every access's innermost index ``c``) becomes ``parallel(S..S)``, the
    reductions, then ``c`` in vectors: each output pixel's channels accumulate in vector
    registers, and an injective block reading them (an average's division) runs in the same
    parallel loop on each finished vector.  DLight and :class:`ParallelLoops` would instead
    reduce each output element by scalar steps.  Functions with other blocks than injective
    ones are left alone.
    """

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool):
        if not isinstance(func, tirx.PrimFunc):
            return None
        sch = s_tir.Schedule(func)
        inline_elementwise(sch)
        infos = normalize_prim_func(sch)
        if infos is None:
            return None
        reductions = [info for info in infos if not info.is_injective()]
        if len(reductions) != 1:
            return None
        info = reductions[0]
        kinds = info.dom_kind()
        spatial = len(kinds) - len(kinds.lstrip("S"))
        loops = sch.get_loops(info.block_rv)
        block = sch.get(info.block_rv)
        if (spatial < 1 or kinds[spatial:].strip("R") or len(loops) != len(kinds)
                or len(block.writes) != 1):
            return None
        channel = block.iter_vars[spatial - 1].var
        if not all(_indexed_last_by(r, channel) for r in (*block.reads, *block.writes)):
            return None
        bits = tvm.DataType(block.writes[0].source.dtype).bits
        lanes = (machine_of(target).isa.vector_bits if is_tpp(target) else 256) // bits
        width = _width(sch.get(loops[spatial - 1]).extent, lanes)
        if width is None:
            return None
        channels = sch.split(loops[spatial - 1], [None, width])
        sch.reorder(*loops[:spatial - 1], channels[0], *loops[spatial:], channels[1])
        # A batch of one has no loop of its own (normalize_prim_func drops unit loops).
        outer = sch.fuse(*loops[:spatial - 1], channels[0]) if spatial > 1 else channels[0]
        sch.parallel(outer)
        sch.vectorize(channels[1])
        sch.decompose_reduction(info.block_rv, loops[spatial])
        for consumer in sch.get_consumers(info.block_rv):  # an average's division
            try:
                sch.reverse_compute_at(consumer, outer)
            except s_tir.ScheduleError:
                continue
            inner = sch.get_loops(consumer)[-1]
            if _width(sch.get(inner).extent, lanes) == sch.get(inner).extent:
                sch.vectorize(inner)
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
    """A rule whose failure on some function leaves that function to the next rule, or
    unscheduled (still correct).

    DLight's rules raise on shapes they do not expect (``ScheduleError`` from ``Reduction``
    on an average pool whose result is an output block, ``IndexError`` on the loops of
    NonMaxSuppression's functions, ...); one such function must not fail the whole model.
    What failed is logged (``tvm-tpp -v`` shows it).
    """

    def __init__(self, rule: dl.ScheduleRule) -> None:
        self.rule = rule

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        try:
            return self.rule.apply(func, target, tunable)
        except Exception as err:  # noqa: BLE001 - any rule's failure: the next rule's turn
            _log.info("%s left a function unscheduled: %s: %s", type(self.rule).__name__,
                      type(err).__name__, str(err).strip().splitlines()[-1:] or "")
            return None


def fallback_schedules() -> tvm.transform.Pass:
    """DLight's CPU GEMV rule, :class:`RowReduction` (else DLight's ``Reduction`` after
    :func:`inline_elementwise`), then :class:`ParallelLoops` for the rest."""
    rules = (dl.cpu.GEMV(), RowReduction(), ChannelsLastReduction(), Inlined(dl.cpu.Reduction()),
             ParallelLoops())
    return dl.ApplyDefaultSchedule(*(Guarded(rule) for rule in rules))
