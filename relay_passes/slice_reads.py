"""Kernels that read a channel range of a wider tensor in place of a copy of it.

DenseNet's dense blocks write every layer's channels into one buffer
(:mod:`relay_passes.concat_chain`); each layer reads the first ``C`` channels of it through
``strided_slice(buf, channels [0, C))``.  Where that reader is a TPP kernel (a 1x1 conv that
computes the BatchNorm and ReLU before it itself: :mod:`relay_passes.conv`), the slice
would be a copy kernel of its own.  :func:`read_slices_in_place` gives the kernel the whole
buffer instead: its parameter is declared with the buffer's channels and every access keeps
its indices (the kernels' BRGEMM operands take their row strides from the buffer they are
matched in), so it reads the same elements where they are.

A ``call_tir`` argument is read in place when it is ``strided_slice`` of the last axis with
step 1 of a static-shape tensor, or a part of a ``split`` of that axis (GPT-2's Q, K and V,
split from one dense's output: the split's copy went, 1.017x at batch 8), or a reshape of
either that keeps the last axis, and the kernel accesses that parameter only by elements and
by regions whose matched buffers take their strides from it.  A slice from channel ``b`` on
is read with the channel index ``b`` further on.  Functions with symbolic shapes are left as
they are.

Examples
--------
>>> from tvm.script import tirx as T
>>> @T.prim_func(s_tir=True)
... def double(x: T.Buffer((2, 4), "float32"), y: T.Buffer((2, 4), "float32")):
...     for i, j in T.grid(2, 4):
...         with T.sblock("double"):
...             vi, vj = T.axis.remap("SS", [i, j])
...             y[vi, vj] = x[vi, vj] * T.float32(2)
>>> [tuple(p.ty.shape) for p in reading_wider(double, 0, 6).params]
[(2, 6), (2, 4)]
"""

from __future__ import annotations

from collections.abc import Mapping

import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx

from schedules.kernel_buffers import redirect

from .scaffold import (
    add_kernel,
    is_call_to,
    rewrite_static_functions,
    static_shape,
    visit_binding_replaced,
)

__all__ = ["read_slices_in_place", "reading_wider"]


def reading_wider(func: tirx.PrimFunc, index: int, channels: int, begin: int = 0
                  ) -> tirx.PrimFunc | None:
    """``func`` with its parameter ``index`` declared with ``channels`` in its last axis (the
    same indices, a wider row; with ``begin``, the last index that much further on), or None
    when it uses the parameter otherwise (module doc)."""
    param = func.params[index]
    shape = static_shape(param.ty.shape)
    if shape is None or begin + shape[-1] > channels or not _strides_from_source(func, param):
        return None
    wide = tirx.decl_buffer((*shape[:-1], channels), param.ty.dtype, param.name,
                            layout=param.ty.layout)
    body = redirect(func, param, wide, column=begin)
    if body is None:
        return None
    params = [wide if p.same_as(param) else p for p in func.params]
    return tirx.PrimFunc(params, body, func.ret_type, func.attrs)


def _strides_from_source(func: tirx.PrimFunc, param: tvm.ir.expr.Var) -> bool:
    """Whether every buffer ``func`` matches in a region of ``param`` declares its strides
    (variables bound to ``param``'s): a dense one would assume the narrower rows."""
    dense = []

    def visit(block: s_tir.SBlock) -> None:
        dense.extend(m for m in block.match_buffers
                     if m.source.source.same_as(param) and not m.buffer.ty.strides)

    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, visit))
    return not dense


def read_slices_in_place(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every kernel argument that is a channel prefix of a wider tensor read
    from that tensor in place (module doc)."""
    rewriter = _SliceReads(mod)
    return relax.transform.DeadCodeElimination()(
        rewrite_static_functions(mod, rewriter, rewriter.replace))


def _channels_of(value: relax.Expr | None, bound: Mapping[relax.Var, relax.Expr]
                 ) -> tuple[relax.Expr, int, int] | None:
    """``(data, begin, channels)`` when ``value`` is the channels (last axis) of ``data``, of
    ``channels`` in all, from ``begin`` on: a ``strided_slice`` of the last axis with step 1,
    a part of a ``split`` of it (GPT-2's Q, K and V of one dense's output), or a reshape of
    either that keeps the last axis (then ``data`` is the whole reshaped alike); else None."""
    if is_call_to(value, "relax.reshape"):
        inner = value.args[0]
        found = _channels_of(bound.get(inner) if isinstance(inner, relax.Var) else None, bound)
        shape, part = static_shape(value.ty.shape), static_shape(inner.ty.shape)
        if found is None or shape is None or part is None or shape[-1] != part[-1]:
            return None
        data, begin, channels = found
        return relax.op.reshape(data, (*shape[:-1], channels)), begin, channels
    if isinstance(value, relax.TupleGetItem):
        split = bound.get(value.tuple_value) if isinstance(value.tuple_value, relax.Var) else None
        return _split_part(split, value.index) if is_call_to(split, "relax.split") else None
    if not is_call_to(value, "relax.strided_slice"):
        return None
    data, axes, begin, _, *steps = value.args
    full = static_shape(data.ty.shape) if isinstance(data.ty, relax.TensorType) else None
    part = static_shape(value.ty.shape)
    if full is None or part is None or full[:-1] != part[:-1]:
        return None
    as_ints = [[int(v.value) for v in t.fields] for t in (axes, begin, *steps)]
    if as_ints[0] != [len(full) - 1] or any(s != [1] for s in as_ints[2:]):
        return None
    return data, as_ints[1][0], full[-1]


def _split_part(split: relax.Call, index: int) -> tuple[relax.Expr, int, int] | None:
    """``(data, begin, channels)`` of part ``index`` of ``split(data)`` along the last
    axis."""
    data = split.args[0]
    full = static_shape(data.ty.shape) if isinstance(data.ty, relax.TensorType) else None
    if full is None or int(split.attrs.axis) % len(full) != len(full) - 1:
        return None
    cuts = split.attrs.indices_or_sections
    if isinstance(cuts, (int, tvm.tirx.IntImm)):  # equal sections
        return data, index * (full[-1] // int(cuts)), full[-1]
    starts = [0, *(int(c) for c in cuts)]
    return data, starts[index], full[-1]


@relax.expr_functor.mutator
class _SliceReads(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.mod = mod
        self.replace: dict[relax.Var, relax.Expr] = {}  # call var -> the call reading in place

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        bound = relax.analysis.get_var2val(func)
        for var, value in bound.items():
            if is_call_to(value, "relax.call_tir") and len(value.args) == 2:
                found = self._in_place(value, bound)
                if found is not None:
                    self.replace[var] = found
        return super().visit_function_(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        visit_binding_replaced(self, binding, self.replace)

    def _in_place(self, call: relax.Call, bound) -> relax.Expr | None:
        kernel, args = call.args[0], list(call.args[1].fields)
        func = self.mod[kernel]
        if not isinstance(func, tirx.PrimFunc) or len(func.params) <= len(args):
            return None
        name = kernel.name_hint
        for i, arg in enumerate(args):
            found = _channels_of(bound.get(arg) if isinstance(arg, relax.Var) else None, bound)
            if found is None:
                continue
            whole, begin, channels = found
            wider = reading_wider(func, i, channels, begin)
            if wider is not None:
                func, args[i] = wider, whole
                name += f"_from{channels}" + (f"at{begin}" if begin else "")
        if name == kernel.name_hint:  # no argument read in place
            return None
        gv = add_kernel(self.builder_, func, name)
        return relax.call_tir(gv, args, call.ty)
