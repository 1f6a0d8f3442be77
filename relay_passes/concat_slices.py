"""Concats whose inputs kernels compute: each kernel writes its own channels of the concat.

A channels-last ``c = concat([t_1, ..., t_n], axis=3)`` reads every input back and writes it
again (DeepLab's ASPP head, five branches of 64 channels on a 16x16 map: 4 % of seg_head's
time at batch 8 on a Zen 1; Inception's modules alike).  OpenVINO has each producer write
into the concat's tensor instead; so does :func:`write_concat_slices`, for every input
``t_i = reshape(call_tir(f_i, args))`` whose kernel writes its ``[N*H*W, C_i]`` output, or
``t_i = call_tir(f_i, args)`` writing NHWC, element by element (a conv or dense layer with
an epilogue; a quantized branch's rescaling lookup table) and which only the concat reads:

* the first such kernel, in binding order, writes its channels of a ``[N*H*W, C]`` (or
  NHWC) buffer, its other channels left as they are allocated;
* each later one writes its channels of that buffer in place (``call_tir_inplace``; the
  buffer viewed as the shape it writes), so the writes stay ordered where the kernels were;
* the other inputs are copied into their channels in place, at the concat
  (:func:`relay_passes.concat_chain.copy_kernel`);
* ``c`` becomes the buffer's NHWC view.

The inputs' channels are disjoint, so no write touches another's.  DenseNet's chains
(:mod:`relay_passes.concat_chain`) are rewritten before; concats without a kernel among
their inputs, and functions with symbolic shapes, are left as they are.

Examples
--------
>>> from tvm.script import tirx as T
>>> @T.prim_func(s_tir=True)
... def relu(x: T.Buffer((6, 8), "float32"), y: T.Buffer((6, 8), "float32")):
...     for i, j in T.grid(6, 8):
...         with T.sblock("epilogue"):
...             vi, vj = T.axis.remap("SS", [i, j])
...             y[vi, vj] = T.max(x[vi, vj], T.float32(0))
>>> sliced = sliced_output(relu, channels=24, offset=16)
>>> "y[vi, vj + 16] = T.max(x[vi, vj]" in sliced.script()
True
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax, tirx

from schedules.kernel_buffers import redirect

from .concat_chain import CHANNEL_AXIS, copy_kernel
from .scaffold import (
    add_kernel,
    is_call_to,
    only_reader,
    readers,
    rewrite_static_functions,
    static_shape,
)

__all__ = ["SlicedProducer", "kernel_writing", "sliced_output", "write_concat_slices"]

def sliced_output(func: tirx.PrimFunc, channels: int, offset: int) -> tirx.PrimFunc | None:
    """``func`` writing its ``[..., C]`` output into channels ``[offset, offset + C)`` of a
    ``[..., channels]`` buffer, or None when it does not write its output element by element
    (module doc)."""
    *inputs, out = func.params
    *lead, width = (int(d) for d in out.ty.shape)
    if offset < 0 or offset + width > channels:
        raise ValueError(f"channels [{offset}, {offset + width}) are not inside {channels}")
    if not _by_element(func, out):
        return None
    into = tirx.decl_buffer((*lead, channels), out.ty.dtype, out.name)
    body = redirect(func, out, into, column=offset)
    return None if body is None else tirx.PrimFunc([*inputs, into], body, func.ret_type,
                                                   func.attrs)


def _by_element(func: tirx.PrimFunc, out: tvm.ir.expr.Var) -> bool:
    """Whether every region of ``out`` that ``func`` names spans one element of each axis but
    the last: a kernel matching its output as a tile (a BRGEMM's C, an AMX tile store) may
    assume the tile's row stride, which a wider buffer changes."""
    import tvm_ffi
    from tvm.ir.expr import TensorRegion

    tiles = []

    def visit(r: TensorRegion) -> None:
        if r.source.same_as(out) and any(
                not (isinstance(d.extent, tirx.IntImm) and d.extent.value == 1)
                for d in r.region[:-1]):
            tiles.append(r)

    tvm_ffi.structural_walk(func.body, (TensorRegion, visit))
    return not tiles


def write_concat_slices(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every concat whose inputs kernels compute written by those kernels
    (module doc)."""
    rewriter = _ConcatSlices(mod)
    return relax.transform.DeadCodeElimination()(
        rewrite_static_functions(mod, rewriter, rewriter.plans))


@dataclass(frozen=True)
class SlicedProducer:
    """A concat input its kernel writes: the call's var, the kernel writing the concat's
    buffer (:func:`sliced_output`), its operands and the buffer's shape it writes."""

    var: relax.Var
    name: str
    kernel: tirx.PrimFunc
    args: tuple[relax.Expr, ...]
    shape: tuple[int, ...]

    def emit(self, builder: relax.BlockBuilder, args: list[relax.Expr],
             buffer: relax.Expr | None, dtype: str) -> relax.Var:
        """The kernel's call on ``args`` (visited), writing into ``buffer`` in place (viewed
        as :attr:`shape`), or into a new one if None."""
        kernel = add_kernel(builder, self.kernel, self.name)
        out = relax.TensorType(self.shape, dtype)
        return builder.emit(relax.call_tir(kernel, args, out) if buffer is None else
                            relax.call_tir_inplace(kernel, [*args, _viewed(builder, buffer,
                                                                           self.shape)],
                                                   [len(args)], out))


def _viewed(builder: relax.BlockBuilder, buffer: relax.Var, shape: tuple[int, ...]
            ) -> relax.Var:
    """``buffer`` viewed as ``shape`` (itself where it has that shape)."""
    if static_shape(buffer.ty.shape.values) == shape:
        return buffer
    return builder.emit(relax.op.reshape(buffer, shape))


def kernel_writing(part: relax.Expr, concat: relax.Call, channels: int, offset: int,
                   bound: dict, read_by, mod: tvm.IRModule) -> SlicedProducer | None:
    """``part`` of ``concat`` (channels ``[offset, ...)`` of ``channels``) as an input its
    kernel can write, or None (module doc): the kernel's ``[N*H*W, C]`` output viewed as NHWC
    (a conv's, a dense layer's), or its NHWC output itself (an elementwise kernel's, a lookup
    table's), read by ``concat`` alone."""
    value = bound.get(part) if isinstance(part, relax.Var) else None
    if (sum(p.same_as(part) for p in concat.args[0].fields) != 1
            or not only_reader(read_by(value), concat)):
        return None
    n, h, w, c = static_shape(part.ty.shape.values)
    if is_call_to(value, "relax.reshape") and isinstance(value.args[0], relax.Var):
        var, wrote, call = value.args[0], (n * h * w, c), bound.get(value.args[0])
        if not only_reader(read_by(call), value):
            return None
    else:
        var, wrote, call = part, (n, h, w, c), value
    if not is_call_to(call, "relax.call_tir") or len(call.args) > 2:
        return None
    func = mod[call.args[0]]
    args = tuple(call.args[1].fields)
    if (not isinstance(func, tirx.PrimFunc) or len(func.params) != len(args) + 1
            or static_shape(func.params[-1].ty.shape) != wrote):
        return None
    sliced = sliced_output(func, channels, offset)
    return None if sliced is None else SlicedProducer(
        var, f"{call.args[0].name_hint}_sliced", sliced, args, (*wrote[:-1], channels))


@dataclass
class _Plan:
    """One concat's rewrite: its producers in binding order, its other inputs with their
    channel offsets, its shape; ``buffer`` the latest var holding the concat's channels."""

    producers: list[SlicedProducer]
    copies: list[tuple[relax.Expr, int]]
    nhwc: tuple[int, int, int, int]
    dtype: str
    buffer: relax.Var | None = None

    def buffer_as(self, builder: relax.BlockBuilder, shape: tuple[int, ...]) -> relax.Var:
        """The buffer viewed as ``shape``."""
        self.buffer = _viewed(builder, self.buffer, shape)
        return self.buffer


@relax.expr_functor.mutator
class _ConcatSlices(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.mod = mod
        self.plans: dict[relax.Var, _Plan] = {}  # concat var -> its plan
        self.producing: dict[relax.Var, tuple[_Plan, SlicedProducer]] = {}  # call var -> its part

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        bound = relax.analysis.get_var2val(func)
        read_by = readers(func)
        order = {var: i for i, var in enumerate(bound)}
        for var, value in bound.items():
            plan = self._plan(value, bound, read_by)
            if plan is not None:
                plan.producers.sort(key=lambda p: order[p.var])
                self.plans[var] = plan
                for producer in plan.producers:
                    self.producing[producer.var] = (plan, producer)
        return super().visit_function_(func)

    def _plan(self, concat: relax.Expr, bound, read_by) -> _Plan | None:
        if not is_call_to(concat, "relax.concat") or not isinstance(concat.args[0], relax.Tuple):
            return None
        ty = concat.ty
        nhwc = static_shape(ty.shape.values) if isinstance(ty, relax.TensorType) else None
        if nhwc is None or len(nhwc) != 4 or int(concat.attrs.axis) % 4 != CHANNEL_AXIS:
            return None
        parts = list(concat.args[0].fields)
        if any(not isinstance(p.ty, relax.TensorType) or p.ty.dtype != ty.dtype
               or static_shape(p.ty.shape.values) is None for p in parts):
            return None
        producers, copies, offset = [], [], 0
        for part in parts:
            found = kernel_writing(part, concat, nhwc[CHANNEL_AXIS], offset, bound, read_by,
                                   self.mod)
            if found is None:
                copies.append((part, offset))
            else:
                producers.append(found)
            offset += int(part.ty.shape.values[CHANNEL_AXIS])
        return _Plan(producers, copies, nhwc, str(ty.dtype)) if producers else None

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = binding.value
        if binding.var in self.producing:
            self._write(*self.producing[binding.var])
        elif binding.var in self.plans:
            self._finish(self.plans[binding.var], binding.var)
        elif not (is_call_to(value, "relax.reshape") and value.args[0] in self.producing):
            super().visit_var_binding_(binding)  # (a producer's view: only the concat read it)

    def _write(self, plan: _Plan, producer: SlicedProducer) -> None:
        """The producer's call, writing its channels of the plan's buffer."""
        plan.buffer = producer.emit(self.builder_, [self.visit_expr(a) for a in producer.args],
                                    plan.buffer, plan.dtype)

    def _finish(self, plan: _Plan, var: relax.Var) -> None:
        """The other inputs copied into their channels, and the concat as the buffer's view."""
        full = relax.TensorType(plan.nhwc, plan.dtype)
        buffer = plan.buffer_as(self.builder_, plan.nhwc)
        for part, offset in plan.copies:
            src = self.visit_expr(part)
            kernel = add_kernel(self.builder_, copy_kernel(
                static_shape(src.ty.shape.values), plan.nhwc[CHANNEL_AXIS], offset, plan.dtype,
                in_place=True), "concat_slice_copy")
            buffer = self.builder_.emit(relax.call_tir_inplace(kernel, [buffer, src], [0], full))
        self.builder_.emit_normalized(relax.VarBinding(var, buffer))
