"""Kernels made to access another buffer in place of one of their parameters.

A scheduled PrimFunc is rewritten so that every access of one parameter goes to another
buffer, the first index mapped where the layout differs: the graph passes let a kernel write
the padded tensor its consumer reads (:mod:`relay_passes.padded_outputs`) or read a channel
prefix of a wider tensor (:mod:`relay_passes.slice_reads`), and the conv template reads its
packed input through an overlapping view (:mod:`schedules.conv`, taps folded into channels).

Examples
--------
A copy whose output goes to rows 2.. of a taller buffer:

>>> from tvm.script import tirx as T
>>> @T.prim_func(s_tir=True)
... def copy(x: T.Buffer((4,), "float32"), y: T.Buffer((4,), "float32")):
...     for i in range(4):
...         with T.sblock("copy"):
...             vi = T.axis.spatial(4, i)
...             y[vi] = x[vi]
>>> taller = tvm.tirx.decl_buffer((6,), "float32", "y")
>>> body = redirect(copy, copy.params[1], taller, row=lambda i: i + 2)
>>> "y[vi + 2] = x[vi]" in tirx.PrimFunc([copy.params[0], taller], body).script()
True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad, TensorRegion

__all__ = ["bits_of", "redirect"]


def redirect(func: tirx.PrimFunc, param: tvm.ir.expr.Var, into: tvm.ir.expr.Var,
             row: Callable[[tirx.PrimExpr], tirx.PrimExpr] | None = None,
             before: Sequence[tirx.Stmt] = (), column: int = 0) -> s_tir.SBlockRealize | None:
    """The body of ``func`` with every access of its buffer parameter ``param`` made to
    ``into`` instead, at the same indices or, with a ``row`` map, the first index ``i`` at
    ``row(i)``, and the last index ``column`` further on (a wider ``into``: the channels of
    a concat); the statements ``before`` come first in the root block.

    None when ``func`` uses ``param`` otherwise than by element and region accesses, or,
    with a ``row`` map, accesses a range of several rows (a tile of rows may cross the
    border of the rows it maps to)."""
    tiles = []

    def index(indices) -> list[tirx.PrimExpr]:
        mapped = list(indices) if row is None else [row(indices[0]), *indices[1:]]
        if column:
            mapped[-1] = mapped[-1] + column
        return mapped

    def shifted(ranges) -> list[tvm.ir.Range]:
        if not column:
            return list(ranges)
        last = ranges[-1]
        return [*ranges[:-1], tvm.ir.Range.from_min_extent(last.min + column, last.extent)]

    def store(s: tirx.BufferStore) -> tirx.BufferStore:
        return tirx.BufferStore(into, s.value, index(s.indices)) if s.buffer.same_as(param) else s

    def load(e: TensorLoad) -> TensorLoad:
        return tirx.BufferLoad(into, index(e.indices)) if e.source.same_as(param) else e

    def region(r: TensorRegion) -> TensorRegion:
        if not r.source.same_as(param):
            return r
        if row is None:
            return tirx.BufferRegion(into, shifted(r.region))
        first = r.region[0]
        if not (isinstance(first.extent, tirx.IntImm) and first.extent.value == 1):
            tiles.append(r)
            return r
        return tirx.BufferRegion(into, shifted([tvm.ir.Range.from_min_extent(row(first.min), 1),
                                                *r.region[1:]]))

    body = tvm_ffi.structural_map(func.body, [(tirx.BufferStore, store), (TensorLoad, load),
                                              (TensorRegion, region)])
    used = []
    tvm_ffi.structural_walk(body, (tvm.ir.expr.Var,
                                   lambda v: used.append(v) if v.same_as(param) else None))
    if tiles or used:
        return None
    if not before:
        return body
    root = body.block
    return s_tir.SBlockRealize(body.iter_values, body.predicate, s_tir.SBlock(
        root.iter_vars, root.reads, root.writes, root.name_hint,
        tirx.SeqStmt([*before, root.body]), root.init, root.alloc_buffers, root.match_buffers,
        root.annotations))


def bits_of(value: float | int, dtype: str) -> tirx.IntImm:
    """``value`` in ``dtype`` as a constant of the unsigned type of its width (``uint16`` for
    bfloat16): kernels that only move data store bits, as TVM legalizes no bfloat16 constant
    or vector.

    >>> [str(bits_of(1.0, "bfloat16")), str(bits_of(7, "uint8"))]
    ['T.uint16(16256)', 'T.uint8(7)']
    """
    import ml_dtypes  # numpy's bfloat16
    import numpy as np

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    bits = np.asarray(value).astype(np_dtype).view(f"uint{np.dtype(np_dtype).itemsize * 8}")
    return tirx.const(int(bits), str(bits.dtype))
