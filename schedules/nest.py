"""From a parsed loop_spec to TVM loops: split, hoist grids, place the epilogue, parallelize.

Shared by the GEMM and convolution templates: each maps its logical loops (letters) to the TIR
loops over its blocks, and these functions do the rest the same way for both.  See
:mod:`schedules.gemm` for how each loop_spec construct maps onto TVM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from microkernels.epilogue import vector_lanes

from .loop_spec import LoopSpec, LoopSpecError

if TYPE_CHECKING:
    from tvm import s_tir, tirx
    from tvm.s_tir import LoopRV, SBlockRV

    from microkernels.brgemm import BrgemmShape

__all__ = ["check_exact", "check_run_time_loop", "nest_loops", "finish_nest", "guard",
           "drop_zeroing", "zeroing_kernel", "bind_first_call", "bind_first_calls",
           "bind_call_vars", "block_realize", "loop_bound_to"]

#: Lanes of 32-bit values in one AVX-512 register: the chunks of :func:`_vectorize`.
_SPLIT_LANES = 16


def check_exact(spec: LoopSpec) -> None:
    """LoopSpecError unless every occurrence and thread grid tiles its range exactly."""
    # TVM tensorizes only exact tiles: a ragged last block would need predicated kernels.
    for o in spec.occurrences:
        if o.span % o.step:
            raise LoopSpecError(f"step {o.step} of {o.var} does not divide its range {o.span}",
                                spec.text, o.position)
        if o.grid is not None and o.trips % o.grid[1]:
            raise LoopSpecError(f"{o.grid[1]} {o.grid[0]}-teams do not divide the "
                                f"{o.trips} iterations of {o.var}", spec.text, o.position)


def check_run_time_loop(spec: LoopSpec, letter: str) -> None:
    """LoopSpecError unless loop ``letter`` can take a run-time extent (a symbolic batch): it
    appears once and is not split among threads, so the nest never splits it by a constant
    that might not divide the extent (TVM would predicate the tensorized body).

    Examples
    --------
    >>> from schedules.loop_spec import parse
    >>> check_run_time_loop(parse("BCa", 3), "b")
    >>> check_run_time_loop(parse("bCab", 3), "b")
    Traceback (most recent call last):
    ...
    schedules.loop_spec.LoopSpecError: ...
    """
    occurrences = spec.occurrences_of(letter)
    if len(occurrences) > 1 or any(o.grid is not None for o in occurrences):
        raise LoopSpecError(f"loop {letter} takes the run-time batch: it may appear only once "
                            "and outside thread grids", spec.text, occurrences[-1].position)


def nest_loops(sch: s_tir.Schedule, spec: LoopSpec, logical: Mapping[str, LoopRV]
               ) -> tuple[list[LoopRV], list[LoopRV]]:
    """Split each logical loop into its spec occurrences, in nest order.

    ``logical`` maps each letter to the TIR loop over its blocks.  Returns the occurrence
    loops in nest order and, in grid mode, the thread-grid chunk loops split off each gridded
    occurrence (``L, R, C`` order), to be hoisted above them.  Nothing is reordered yet.
    """
    loops = {}
    for letter, blocks in logical.items():
        occurrences = spec.occurrences_of(letter)
        parts = sch.split(blocks, [None] + [o.trips for o in occurrences[1:]])
        loops.update({(o.letter, o.level): part
                      for o, part in zip(occurrences, parts, strict=True)})
    order = [loops[(o.letter, o.level)] for o in spec.occurrences]
    grid_loops = []
    if spec.mode == "grid":
        for index in spec.parallel_groups()[0]:
            chunk, order[index] = sch.split(order[index], [spec.occurrences[index].grid[1], None])
            grid_loops.append(chunk)
    return order, grid_loops


def finish_nest(sch: s_tir.Schedule, spec: LoopSpec, order: list[LoopRV],
                grid_loops: list[LoopRV], block: SBlockRV, reductions: frozenset[str],
                epilogue: SBlockRV | None = None) -> SBlockRV:
    """Place the epilogue, parallelize, and zero the accumulator; returns the init block.

    The epilogue block goes under the deepest spatial loop above the first reduction loop:
    each output tile is finished there (a separate parallel pass when a reduction loop is
    outermost).  Collapse groups and thread grids become one fused parallel loop, and the
    accumulator is zeroed right above the first reduction loop (``decompose_reduction``).
    """
    first = next(i for i, o in enumerate(spec.occurrences) if o.letter in reductions)
    anchor = order[first - 1] if first else (grid_loops[-1] if grid_loops else None)
    if epilogue is not None:
        if anchor is not None:
            sch.reverse_compute_at(epilogue, anchor)
        _vectorize(sch, epilogue, parallel=anchor is None)
    if grid_loops:
        sch.parallel(sch.fuse(*grid_loops) if len(grid_loops) > 1 else grid_loops[0])
    elif spec.parallel_groups():
        members = [order[index] for index in spec.parallel_groups()[0]]
        sch.parallel(sch.fuse(*members) if len(members) > 1 else members[0])
    init = sch.decompose_reduction(block, order[first])
    # With a reduction loop outermost, zeroing is a pass of its own over the whole output,
    # parallel as the epilogue's (serial, LLVM unrolls its constant nest into thousands of
    # stores: 4 s to compile "abc" at 128x768x768).
    _vectorize(sch, init, parallel=anchor is None)
    return init


def _vectorize(sch: s_tir.Schedule, block: SBlockRV, parallel: bool) -> None:
    """Vectorize ``block``'s innermost loop; if ``parallel``, fuse the others into one
    parallel loop (a pass of its own over the output).

    An extent that is a multiple of 16 but no power of two (48 output channels) is vectorized
    16 lanes at a time: LLVM builds a 48-lane vector's loop-invariant operands (the bias,
    the scales) from scalars on every row, and the AMX 16 -> 96 channel conv of MobileNet-V2
    ran its int8 epilogue 4x slower for it.  A block whose code needs a number of lanes
    (:func:`microkernels.epilogue.vector_lanes`) is vectorized by exactly that many."""
    *outer, inner = sch.get_loops(block)
    if parallel and outer:
        sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
    extent = getattr(sch.get(inner).extent, "value", None)  # None: a run-time extent
    lanes = vector_lanes(sch.get(block).body)
    if lanes is not None:  # an instruction of that many lanes (a bf16 conversion)
        if extent is None or extent % lanes:
            raise ValueError(f"block {sch.get(block).name_hint!r} runs {lanes}-lane "
                             f"instructions: its innermost extent {extent} must be a multiple")
    elif extent and extent > _SPLIT_LANES and extent % _SPLIT_LANES == 0 and \
            extent & (extent - 1):
        lanes = _SPLIT_LANES
    if lanes is not None and extent > lanes:
        inner = sch.split(inner, [None, lanes])[1]
    sch.vectorize(inner)


def guard(sch: s_tir.Schedule, block: SBlockRV,
          condition: Callable[[s_tir.SBlockRealize], tirx.PrimExpr]) -> None:
    """Run ``block`` only where ``condition(realize)`` holds (ANDed onto its predicate);
    the block must sit directly in its innermost loop (alone, or among its statements)."""
    from tvm import s_tir, tirx

    loop = sch.get_loops(block)[-1]
    old = sch.get(loop)
    stmts, at = _in_loop(sch, block)
    realize = stmts[at]
    stmts[at] = s_tir.SBlockRealize(list(realize.iter_values),
                                    tirx.all(realize.predicate, condition(realize)),
                                    realize.block)
    body = tirx.SeqStmt(stmts) if len(stmts) > 1 else stmts[0]
    sch.state.replace(sch.get_sref(loop),
                      tirx.For(old.loop_var, old.min, old.extent, old.kind, body,
                               old.thread_binding, old.annotations),
                      {realize.block: realize.block})


def block_realize(sch: s_tir.Schedule, block: SBlockRV) -> s_tir.SBlockRealize:
    """The realize of ``block`` (its iterators' bindings to the loops); the block must sit
    directly in its innermost loop."""
    stmts, at = _in_loop(sch, block)
    return stmts[at]


def loop_bound_to(sch: s_tir.Schedule, block: SBlockRV, iter_type: int) -> LoopRV:
    """The loop whose variable is bound to ``block``'s first iterator of ``iter_type``
    (``tirx.IterVar.DataPar``, ``CommReduce``); ``block`` sits directly in its innermost
    loop."""
    value = next(v for iv, v in zip(sch.get(block).iter_vars, block_realize(sch, block)
                                    .iter_values, strict=True) if iv.iter_type == iter_type)
    return next(loop for loop in sch.get_loops(block) if sch.get(loop).loop_var.same_as(value))


def _in_loop(sch: s_tir.Schedule, block: SBlockRV) -> tuple[list[tirx.Stmt], int]:
    """The statements of ``block``'s innermost loop and the index of its realize among them."""
    from tvm import s_tir, tirx

    body = sch.get(sch.get_loops(block)[-1]).body
    stmts = list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]
    at = next((i for i, stmt in enumerate(stmts) if isinstance(stmt, s_tir.SBlockRealize)
               and stmt.block.same_as(sch.get(block))), None)
    if at is None:
        raise RuntimeError(f"block {sch.get(block).name_hint} is not directly in its "
                           "innermost loop")
    return stmts, at


def zeroing_kernel(sch: s_tir.Schedule, init: SBlockRV, shape: BrgemmShape,
                   whole: bool = True) -> BrgemmShape:
    """The kernel that starts C's reduction instead of ``init``, with ``init`` dropped:
    where each call is the ``whole`` reduction of its C block, the ``beta=0`` variant of
    ``shape``, else its ``first_call_zeroes`` variant (:func:`bind_first_call` then binds its
    flag); ``shape``, nothing changed, where the implementation has no such variant or
    ``init`` stores something else than zeros (a zero point's fold the sums start from)."""
    from microkernels.brgemm import zeroing

    zeroed = zeroing(shape, first_call_only=not whole)
    return zeroed if zeroed is not None and drop_zeroing(sch, init) else shape


def drop_zeroing(sch: s_tir.Schedule, init: SBlockRV) -> bool:
    """Never run ``init`` if it zeroes the accumulator (a zeroing kernel writes every element
    instead); False, and nothing changed, if it stores anything else."""
    from tvm import tirx

    store = sch.get(init).body
    if not (isinstance(store, tirx.BufferStore) and isinstance(store.value, (tirx.IntImm,
                                                                              tirx.FloatImm))
            and store.value.value == 0):
        return False
    guard(sch, init, lambda realize: tirx.const(False))
    return True


def bind_first_calls(sch: s_tir.Schedule) -> None:
    """:func:`bind_first_call` (the default condition) for every call of ``sch`` whose
    kernel's flag is free: a schedule replayed from its trace (MetaSchedule's design spaces
    and records) has them so, because the binding is no schedule instruction."""
    import tvm_ffi
    from tvm import ir, s_tir

    from microkernels.brgemm import first_call

    flag = first_call().name

    def flagged(stmt: object) -> bool:
        found = []
        tvm_ffi.structural_walk(stmt, (ir.expr.Var, lambda v: found.append(v)
                                       if v.name == flag else None))
        return bool(found)

    def nested(block: s_tir.SBlock) -> list[s_tir.SBlock]:
        inner = []
        tvm_ffi.structural_walk(block.body, (s_tir.SBlock, inner.append))
        return inner

    for gv, func in sch.mod.functions.items():
        blocks = []
        tvm_ffi.structural_walk(func.body, (s_tir.SBlock, blocks.append))
        # The calls: blocks that read the flag and hold no block that does.
        calls = [b.name_hint for b in blocks
                 if flagged(b.body) and not any(flagged(i.body) for i in nested(b))]
        for name in calls:
            bind_first_call(sch, sch.get_sblock(name, gv.name_hint))


def bind_first_call(sch: s_tir.Schedule, call: SBlockRV,
                    first: Callable[[s_tir.SBlock], tirx.PrimExpr] | None = None) -> None:
    """Bind the flag of the ``first_call_zeroes`` kernel tensorized in block ``call``
    (:func:`microkernels.brgemm.first_call`) to ``first(block)``, by default "every
    reduction index of the call at its first value": the call that starts its C block's
    reduction where every call runs."""
    from tvm import tirx

    from microkernels.brgemm import first_call

    block = sch.get(call)
    if first is None:
        condition = tirx.all(*(tirx.EQ(iv.var, iv.dom.min) for iv in block.iter_vars
                               if iv.iter_type == tirx.IterVar.CommReduce))
    else:
        condition = first(block)
    bind_call_vars(sch, call, {first_call().name: condition})


def bind_call_vars(sch: s_tir.Schedule, call: SBlockRV,
                   values: Mapping[str, tirx.PrimExpr]) -> None:
    """Replace the free variables of the kernel tensorized in block ``call`` named as
    ``values``' keys (by name: registering the intrinsic copies its variables) with
    ``values``' expressions (:func:`microkernels.brgemm.first_call`,
    :func:`microkernels.brgemm.skipped_blocks`, :func:`microkernels.brgemm.edge_rows`)."""
    import tvm_ffi
    from tvm import ir, s_tir

    block = sch.get(call)
    body = tvm_ffi.structural_map(block.body, [(ir.expr.Var, lambda v: values.get(v.name, v))])
    bound = s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, body,
                         block.init, block.alloc_buffers, block.match_buffers,
                         block.annotations)
    sch.state.replace(sch.get_sref(call), bound, {block: bound})
