"""From a parsed loop_spec to TVM loops: split, hoist grids, place the epilogue, parallelize.

Shared by the GEMM and convolution templates: each maps its logical loops (letters) to the TIR
loops over its blocks, and these functions do the rest the same way for both.  See
:mod:`schedules.gemm` for how each loop_spec construct maps onto TVM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from .loop_spec import LoopSpec, LoopSpecError

if TYPE_CHECKING:
    from tvm import s_tir, tirx
    from tvm.s_tir import LoopRV, SBlockRV

    from microkernels.brgemm import BrgemmShape

__all__ = ["check_exact", "check_run_time_loop", "nest_loops", "finish_nest", "guard",
           "drop_zeroing", "zeroing_kernel"]


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
    parallel loop (a pass of its own over the output)."""
    *outer, inner = sch.get_loops(block)
    if parallel and outer:
        sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])
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


def zeroing_kernel(sch: s_tir.Schedule, init: SBlockRV, shape: BrgemmShape) -> BrgemmShape:
    """The kernel for a call that is the whole reduction of its C block: the ``beta=0``
    variant of ``shape``, with ``init`` dropped, where the implementation has one and
    ``init`` stores zeros; else ``shape``, nothing changed."""
    from microkernels.brgemm import zeroing

    zeroed = zeroing(shape)
    return zeroed if zeroed is not None and drop_zeroing(sch, init) else shape


def drop_zeroing(sch: s_tir.Schedule, init: SBlockRV) -> bool:
    """Never run ``init`` if it zeroes the accumulator (a ``beta=0`` kernel that makes the
    only call of the reduction writes every element instead); False, and nothing changed,
    if it stores anything else (a zero point's fold the sums start from)."""
    from tvm import tirx

    store = sch.get(init).body
    if not (isinstance(store, tirx.BufferStore) and isinstance(store.value, (tirx.IntImm,
                                                                              tirx.FloatImm))
            and store.value.value == 0):
        return False
    guard(sch, init, lambda realize: tirx.const(False))
    return True
