"""The epilogue of a single-call BRGEMM applied to its accumulators before they are stored.

A template's kernel stores its C tile, and the ``epilogue`` block (bias, residual, activation,
requantization: :mod:`microkernels.epilogue`) reads the tile back in a pass of its own.  Where
one BRGEMM call is the whole reduction of its tile (a ``beta=0`` kernel: a 1x1 convolution
over all its channels, a GEMM over the whole K), nothing but the epilogue reads that tile, so
each accumulator vector can go through the epilogue in registers and be stored once, into the
output, as LIBXSMM's fused BRGEMM and oneDNN's post-ops do: no second pass over the tile and
its round trip through L1, and the output's stores (cache misses where the output is cold)
interleaved with the next register tile's FMAs instead of bunched in a loop of their own.
The call first prefetches its tile's lines of the output (for writing) and of a residual:
without that, each register tile's stores waited for those lines in turn, where the separate
pass had them all in flight.  ResNet-50's in-place residual 1x1 convs on a Zen 3, operands
cold, 2 threads: 1.06-1.34x faster (0.75-0.97x without the prefetches); the whole network
1.115x (BENCHMARKS.md).

:func:`epilogue_in_registers` rewrites a scheduled PrimFunc so where all of this holds:

* one block is named ``epilogue`` and is a single store; it reads the accumulator only at
  its own element (its iterators, in order), and its other operands are parameters;
* one block (the BRGEMM call) matches a 2-D ``C`` into the accumulator, runs unguarded,
  never reads ``C`` and writes it only as ``C[r, c:c+L] = acc[b:b+L]`` from local registers
  (a ``beta=0`` kernel, so one call writes each element once);
* nothing else writes the accumulator but blocks that never run (a dropped zeroing).

Each such store becomes the epilogue's store of that vector (its loop vectorized), and the
epilogue's own loop nest goes.  Anything else is returned unchanged: kernels that load their
C tile (a reduction over several calls), AMX tile stores, guarded calls.  The rewrite runs
after the graph passes that read kernels as blocks (:mod:`relay_passes.inplace` looks for
the epilogue's element-wise store) and in the tuner's measurements.

Examples
--------
>>> from schedules.conv import ConvProblem, ConvConfig, schedule
>>> from microkernels.epilogue import Epilogue, EpilogueOp
>>> p = ConvProblem(1, 16, 4, 4, 16, 1, 1, epilogue=Epilogue((EpilogueOp("relu"),)))
>>> func = schedule(p, ConvConfig(bq=4, bc=16, bk=16, spec="ADEcbfg")).mod["main"]
>>> fused = epilogue_in_registers(func)
>>> fused is not func, '"epilogue"' in fused.script(), '"epilogue"' in func.script()
(True, False, True)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tvm
    from tvm import s_tir, tirx

__all__ = ["epilogue_in_registers", "register_epilogues"]


def epilogue_in_registers(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with its epilogue computed at the BRGEMM call's stores (module doc), or
    ``func`` itself where the conditions do not hold."""
    import tvm_ffi
    from tvm import s_tir, tirx
    from tvm.ir.expr import TensorLoad

    realizes: list[s_tir.SBlockRealize] = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlockRealize, realizes.append))
    epilogues = [r for r in realizes if r.block.name_hint == "epilogue"]
    if len(epilogues) != 1 or not isinstance(epilogues[0].block.body, tirx.BufferStore):
        return func
    epilogue = epilogues[0].block
    store = epilogue.body
    iters = [iv.var for iv in epilogue.iter_vars]
    params = list(func.params)
    loads: list[TensorLoad] = []
    tvm_ffi.structural_walk(store.value, (TensorLoad, loads.append))
    internal = [ld for ld in loads if not any(ld.source.same_as(p) for p in params)]
    if not internal or len(iters) != 2 or any(not ld.source.same_as(internal[0].source)
                                              or len(ld.indices) != 2
                                              or not all(i.same_as(v) for i, v in
                                                         zip(ld.indices, iters, strict=True))
                                              for ld in internal):
        return func
    acc = internal[0].source
    calls = [r for r in realizes
             if any(m.source.source.same_as(acc) for m in r.block.match_buffers)]
    if len(calls) != 1 or not _always(calls[0].predicate):
        return func
    call = calls[0]
    (match,) = [m for m in call.block.match_buffers if m.source.source.same_as(acc)]
    others = [r for r in realizes
              if r is not call and any(w.source.same_as(acc) for w in r.block.writes)]
    if len(match.source.region) != 2 or any(not _never(r.predicate) for r in others):
        return func
    body = _fused_stores(call.block.body, match, store, iters, acc)
    if body is None:
        return func
    body = tirx.SeqStmt([_prefetches(match, store, iters, params), body])
    block = call.block
    reads = [r for r in block.reads if not r.source.same_as(acc)]
    for p in params:
        if any(ld.source.same_as(p) for ld in loads) and not any(r.source.same_as(p)
                                                                 for r in reads):
            reads.append(_whole(p))
    fused = s_tir.SBlock(block.iter_vars, reads, [_whole(store.buffer)], block.name_hint, body,
                         block.init, block.alloc_buffers,
                         [m for m in block.match_buffers if not m.same_as(match)],
                         block.annotations)
    new_call = s_tir.SBlockRealize(call.iter_values, call.predicate, fused)
    out = tvm_ffi.structural_map(func.body, [
        (s_tir.SBlockRealize, lambda r: new_call if r.block.same_as(block) else r),
        (tirx.SeqStmt, lambda s: _without(s, epilogue)),
    ])
    left: list[s_tir.SBlock] = []
    tvm_ffi.structural_walk(out, (s_tir.SBlock, lambda b: left.append(b)
                                  if b.same_as(epilogue) else None))
    # An epilogue left running would read the output it has already written (in place).
    return func if left else func.with_body(out)


def register_epilogues() -> tvm.transform.Pass:
    """The module pass of :func:`epilogue_in_registers` over every PrimFunc."""
    from tvm import tirx

    return tirx.transform.prim_func_pass(
        lambda func, _mod, _ctx: epilogue_in_registers(func), opt_level=0,
        name="TppRegisterEpilogues")


def _fused_stores(body: tirx.Stmt, match: s_tir.MatchBufferRegion, store: tirx.BufferStore,
                  iters: list[tirx.Var], acc: tirx.Var) -> tirx.Stmt | None:
    """The kernel body with each ``C[r, c:c+L] = reg[b:b+L]`` replaced by the epilogue's
    store of those elements; None if it uses ``C`` any other way."""
    import tvm
    import tvm_ffi
    from tvm import tirx
    from tvm.ir.expr import TensorLoad

    c_buffer = match.buffer
    row0, col0 = (r.min for r in match.source.region)
    refused = []

    def element(row, col, value) -> tirx.Stmt:
        def fill(expr):
            expr = tvm_ffi.structural_map(expr, (TensorLoad, lambda ld: value
                                                 if ld.source.same_as(acc) else ld))
            return _at(expr, iters, row0 + row, col0 + col)

        return tirx.BufferStore(store.buffer, _fresh_lets(fill(store.value)),
                                [fill(i) for i in store.indices])

    def fuse(s: tirx.BufferStore) -> tirx.Stmt:
        if not s.buffer.same_as(c_buffer):
            return s
        value, (row, col) = s.value, s.indices
        if not (isinstance(value, TensorLoad) and len(value.indices) == 1):
            refused.append(s)
            return s
        (at,) = value.indices
        if not isinstance(col, tirx.Ramp) and not isinstance(at, tirx.Ramp):
            return element(row, col, value)
        if not (isinstance(col, tirx.Ramp) and isinstance(at, tirx.Ramp)
                and _is_one(col.stride) and _is_one(at.stride)):
            refused.append(s)
            return s
        lane = tirx.Var("lane", "int32")
        one = tirx.BufferLoad(value.source, [at.base + lane])
        return tirx.For(lane, 0, col.lanes, tirx.ForKind.VECTORIZED,
                        element(row, col.base + lane, one))

    fused = tvm_ffi.structural_map(body, (tirx.BufferStore, fuse))
    used = []
    tvm_ffi.structural_walk(fused, (tvm.ir.expr.Var,
                                    lambda v: used.append(v) if v.same_as(c_buffer) else None))
    return None if refused or used else fused


def _prefetches(match: s_tir.MatchBufferRegion, store: tirx.BufferStore,
                iters: list[tirx.Var], params: list[tirx.Var]) -> tirx.Stmt:
    """Prefetches of the tile's lines of the output (for writing) and of every parameter
    the epilogue reads per element (a residual): issued before the call's FMAs, they arrive
    while those run, instead of stalling each register tile's stores."""
    import tvm
    import tvm_ffi
    from tvm import tirx
    from tvm.ir.expr import TensorLoad

    from microkernels.isa import CACHE_LINE

    row0, col0 = (r.min for r in match.source.region)
    rows, cols = (int(r.extent) for r in match.source.region)
    row = tirx.Var("row", "int32")
    loads: list[TensorLoad] = []
    tvm_ffi.structural_walk(store.value, (TensorLoad, loads.append))
    operands = {}  # buffer -> (indices, write)
    for ld in loads:
        if len(ld.indices) == 2 and any(ld.source.same_as(p) for p in params):
            operands.setdefault(ld.source, (ld.indices, False))
    operands[store.buffer] = (store.indices, True)  # in place: the write intent wins

    calls = []
    for buffer, (indices, write) in operands.items():
        step = CACHE_LINE * 8 // tvm.DataType(str(buffer.ty.dtype)).bits
        calls += [tirx.Evaluate(tirx.call_llvm_intrin(
            "void", "llvm.prefetch.p0", tirx.address_of(tirx.BufferLoad(
                buffer, [_at(i, iters, row0 + row, col0 + c) for i in indices])),
            tirx.const(int(write), "int32"), tirx.const(3, "int32"), tirx.const(1, "int32")))
            for c in range(0, cols, step)]
    return tirx.For(row, 0, rows, tirx.ForKind.SERIAL,
                    calls[0] if len(calls) == 1 else tirx.SeqStmt(calls))


def _at(expr: tirx.PrimExpr, iters: list[tirx.Var], row: tirx.PrimExpr, col: tirx.PrimExpr
        ) -> tirx.PrimExpr:
    """``expr`` of the epilogue's iterators at accumulator element ``(row, col)``."""
    import tvm
    import tvm_ffi

    return tvm_ffi.structural_map(expr, (tvm.ir.expr.Var, lambda v: row if v.same_as(iters[0])
                                         else col if v.same_as(iters[1]) else v))


def _fresh_lets(expr: tirx.PrimExpr) -> tirx.PrimExpr:
    """``expr`` with a new variable for each ``Let``: each fused store binds its own (TVM's
    passes refuse one variable bound to two values)."""
    import tvm
    import tvm_ffi
    from tvm import tirx

    def rebind(let: tirx.Let) -> tirx.Let:
        fresh = tirx.Var(let.var.name, let.var.ty)
        body = tvm_ffi.structural_map(let.body, (tvm.ir.expr.Var,
                                                 lambda v: fresh if v.same_as(let.var) else v))
        return tirx.Let(fresh, let.value, body)

    return tvm_ffi.structural_map(expr, (tirx.Let, rebind))


def _without(seq: tirx.SeqStmt, epilogue: s_tir.SBlock) -> tirx.Stmt:
    """``seq`` without the loop nest that runs ``epilogue``."""
    from tvm import s_tir, tirx

    def runs_epilogue(stmt: tirx.Stmt) -> bool:
        while isinstance(stmt, tirx.For):
            stmt = stmt.body
        return isinstance(stmt, s_tir.SBlockRealize) and stmt.block.same_as(epilogue)

    kept = [s for s in seq.seq if not runs_epilogue(s)]
    if len(kept) == len(seq.seq):
        return seq
    return kept[0] if len(kept) == 1 else tirx.SeqStmt(kept)


def _whole(buffer: tirx.Var) -> tirx.BufferRegion:
    import tvm
    from tvm import tirx

    return tirx.BufferRegion(buffer, [tvm.ir.Range.from_min_extent(0, d)
                                      for d in buffer.ty.shape])


def _is_one(e: tirx.PrimExpr) -> bool:
    from tvm import tirx

    return isinstance(e, tirx.IntImm) and e.value == 1


def _always(predicate: tirx.PrimExpr) -> bool:
    return _is_one(predicate)


def _never(predicate: tirx.PrimExpr) -> bool:
    from tvm import tirx

    return isinstance(predicate, tirx.IntImm) and predicate.value == 0
