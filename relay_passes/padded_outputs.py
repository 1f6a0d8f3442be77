"""Kernels that write their output straight into the padded buffer the next conv reads.

Every TPP conv reads a zero-padded channels-last input, so a conv whose input is another TPP
conv's output reads ``pad(reshape(y))``: the producer writes ``y``, then a copy kernel reads
it back and writes it again with a border around it (16 such copies in ResNet-50, 1 % of
its profiled time on a Zen 1; VGG-19 and DenseNet-121 pad before every 3x3 conv).  OpenVINO
and oneDNN read the border in the consumer instead; here the producer writes its tile into
the interior of the padded buffer (:func:`padded_output`) and fills the border itself.

:func:`write_padded_outputs` rewrites ``p = pad(reshape(call_tir(f, args)))`` when

* ``f``'s output is ``[N*H*W, C]``, reshaped to NHWC ``[N, H, W, C]``, and ``f`` writes it
  only element by element (no kernel matches the output as a tile: a conv with an epilogue,
  which every conv before a pad here has, writes it from its epilogue's point stores);
* the pad is a constant pad of the H and W axes only;
* nothing but the pad reads the reshape, and nothing but the reshape reads ``f``'s output
  -- or kernels that read it element by element too (MobileNet-V2's first block: the stem
  conv's output padded for the depthwise conv and read unpadded as the project conv's
  residual), which then read the interior of the padded buffer (:func:`reading_padded`).

``p`` becomes ``reshape(call_tir(f', args))``: ``f'`` writes the ``[N*Hp*Wp, C]`` buffer whose
NHWC view is ``p``.  Functions with symbolic shapes (a run-time batch) are left as they are.

Examples
--------
>>> from tvm.script import tirx as T
>>> @T.prim_func(s_tir=True)
... def relu(x: T.Buffer((6, 8), "float32"), y: T.Buffer((6, 8), "float32")):
...     for i, j in T.grid(6, 8):
...         with T.sblock("epilogue"):
...             vi, vj = T.axis.remap("SS", [i, j])
...             y[vi, vj] = T.max(x[vi, vj], T.float32(0))
>>> padded = padded_output(relu, (1, 2, 3), (1, 1, 1, 1), 0.0)
>>> [tuple(int(d) for d in p.ty.shape) for p in padded.params]
[(6, 8), (20, 8)]
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.script import tirx as T

from microkernels.script_source import pin_source
from schedules.kernel_buffers import bits_of, redirect

from .scaffold import (
    add_kernel,
    is_call_to,
    only_reader,
    readers,
    rewrite_static_functions,
    static_shape,
    visit_binding_replaced,
)

# The TVMScript builders below parse the text this module was imported from.
pin_source(__name__)

__all__ = ["padded_output", "reading_padded", "write_padded_outputs"]

#: (top, bottom, left, right) rows and columns of a pad around the H and W axes of NHWC.
Padding = tuple[int, int, int, int]
#: A border of this many bytes or more is filled by all threads, a row of the image each: on a
#: Zen 1, with every border so filled, MobileNet-V2 at batch 8 (320-600 KiB of border a conv)
#: ran 1.04x, at batch 1 (40-75 KiB) 0.88x: there the fork and join cost more than they share.
#: With this bound: MobileNet-V2 1.02x at batch 8, 1.00x at 1; EfficientNet 1.02x, ResNet-50
#: 1.01x at batch 8.
_PARALLEL_FILL_BYTES = 256 << 10


def padded_output(func: tirx.PrimFunc, images: tuple[int, int, int], padding: Padding,
                  pad_value: float | int) -> tirx.PrimFunc | None:
    """``func`` writing its ``[N*H*W, C]`` output (``images`` = ``(N, H, W)``) into the
    ``[N*Hp*Wp, C]`` buffer of the NHWC image padded by ``padding`` with ``pad_value``, or
    None when ``func`` does not write its output element by element (module doc)."""
    *inputs, out = func.params
    n, h, w = images
    top, bottom, left, right = padding
    pixels, channels = (int(d) for d in out.ty.shape)
    if pixels != n * h * w:
        raise ValueError(f"output of {pixels} rows is not {n}x{h}x{w} pixels")
    hp, wp = h + top + bottom, w + left + right
    dtype = str(out.ty.dtype)
    fill = _border_fill(n, hp, wp, channels, (top, top + h, left, left + w), dtype, pad_value)
    into = fill.params[0]
    body = redirect(func, out, into, _interior_row(images, padding), [fill.body])
    return None if body is None else tirx.PrimFunc([*inputs, into], body, func.ret_type,
                                                   func.attrs)


def reading_padded(func: tirx.PrimFunc, index: int, images: tuple[int, int, int],
                   padding: Padding) -> tirx.PrimFunc | None:
    """``func`` reading its ``[N*H*W, C]`` parameter ``index`` (``images`` = ``(N, H, W)``)
    from the interior of the ``[N*Hp*Wp, C]`` buffer of the image padded by ``padding``, or
    None when ``func`` does not read it element by element.

    >>> from tvm.script import tirx as T
    >>> @T.prim_func(s_tir=True)
    ... def add(x: T.Buffer((6, 8), "float32"), r: T.Buffer((6, 8), "float32"),
    ...         y: T.Buffer((6, 8), "float32")):
    ...     for i, j in T.grid(6, 8):
    ...         with T.sblock("add"):
    ...             vi, vj = T.axis.remap("SS", [i, j])
    ...             y[vi, vj] = x[vi, vj] + r[vi, vj]
    >>> [tuple(int(d) for d in p.ty.shape) for p in reading_padded(add, 1, (1, 2, 3),
    ...                                                            (1, 1, 1, 1)).params]
    [(6, 8), (20, 8), (6, 8)]
    """
    param = func.params[index]
    n, h, w = images
    top, bottom, left, right = padding
    channels = int(param.ty.shape[-1])
    padded = tirx.decl_buffer((n * (h + top + bottom) * (w + left + right), channels),
                              param.ty.dtype, param.name)
    body = redirect(func, param, padded, _interior_row(images, padding))
    if body is None:
        return None
    return tirx.PrimFunc([padded if p.same_as(param) else p for p in func.params], body,
                         func.ret_type, func.attrs)


def _interior_row(images: tuple[int, int, int], padding: Padding
                  ) -> Callable[[tirx.PrimExpr], tirx.PrimExpr]:
    """Row ``i`` of the unpadded ``[N*H*W, C]`` image as a row of the padded one's."""
    n, h, w = images
    top, bottom, left, right = padding
    hp, wp = h + top + bottom, w + left + right

    def row(i: tirx.PrimExpr) -> tirx.PrimExpr:
        image, pixel = i // (h * w), i % (h * w)
        return (image * hp + pixel // w + top) * wp + pixel % w + left

    return row


def _border_fill(n: int, hp: int, wp: int, channels: int, interior: tuple[int, int, int, int],
                 dtype: str, pad_value: float | int) -> tirx.PrimFunc:
    """A PrimFunc writing ``pad_value`` into the border of its ``[n*hp*wp, channels]``
    parameter: the rows outside ``interior`` (first row, end row, first column, end column)
    whole, the rest left and right of the interior's columns.  It stores the value's bits
    through an unsigned view of the buffer: TVM legalizes no bfloat16 constant store."""
    r0, r1, c0, c1 = interior
    lanes = next(v for v in (8, 4, 2, 1) if channels % v == 0)
    value = bits_of(pad_value, dtype)
    word = np.dtype(str(value.ty))

    border_bytes = n * (hp * wp - (r1 - r0) * (c1 - c0)) * channels * word.itemsize
    rows = T.parallel if border_bytes >= _PARALLEL_FILL_BYTES else T.serial

    @T.prim_func(s_tir=True)
    def fill(buf: T.handle):
        padded = T.match_buffer(buf, (n * hp * wp, channels), dtype)
        padded_bits = T.decl_buffer((n * hp * wp, channels), word, data=padded.data)
        for row in rows(n * hp):
            image, y = row // hp, row % hp
            base = (image * hp + y) * wp
            if y < r0 or y >= r1:
                for x, v in T.grid(wp, channels // lanes):
                    for j in T.vectorized(lanes):
                        padded_bits[base + x, v * lanes + j] = value
            else:
                if c0 > 0:
                    for x, v in T.grid(c0, channels // lanes):
                        for j in T.vectorized(lanes):
                            padded_bits[base + x, v * lanes + j] = value
                if wp > c1:
                    for x, v in T.grid(wp - c1, channels // lanes):
                        for j in T.vectorized(lanes):
                            padded_bits[base + c1 + x, v * lanes + j] = value

    return fill


def write_padded_outputs(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every pad of a kernel's output written by the kernel (module doc)."""
    rewriter = _PaddedOutputs(mod)
    return relax.transform.DeadCodeElimination()(
        rewrite_static_functions(mod, rewriter, rewriter.replace))


def _pad_widths(pad: relax.Call) -> Padding | None:
    """(top, bottom, left, right) of a constant pad of NHWC's H and W axes only, or None."""
    if str(pad.attrs.pad_mode) != "constant":
        return None
    widths = [int(v) for v in pad.attrs.pad_width]
    if len(widths) != 8 or any(widths[i] for i in (0, 1, 6, 7)) or min(widths) < 0:
        return None
    return widths[2], widths[3], widths[4], widths[5]


@relax.expr_functor.mutator
class _PaddedOutputs(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.mod = mod
        self.replace: dict[relax.Var, relax.Expr] = {}  # pad var -> its kernel's padded call

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        bound = relax.analysis.get_var2val(func)
        read_by = readers(func)
        rewritten: set[relax.Var] = set()  # kernel calls a rewrite changes: one rewrite each
        for var, value in bound.items():
            if is_call_to(value, "relax.nn.pad"):
                found = self._padded_call(var, value, bound, read_by)
                if found is not None and not rewritten & found.keys():
                    self.replace |= found
                    rewritten |= found.keys()
        return super().visit_function_(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        visit_binding_replaced(self, binding, self.replace)

    def _padded_call(self, pad_var: relax.Var, pad: relax.Call, bound, read_by
                     ) -> dict[relax.Var, relax.Expr] | None:
        """The bindings to replace for ``pad_var = pad``'s kernel writing it: the pad's, and
        those of the kernels reading the unpadded output too (None: no such rewrite)."""
        padding = _pad_widths(pad)
        view = bound.get(pad.args[0]) if isinstance(pad.args[0], relax.Var) else None
        if padding is None or not is_call_to(view, "relax.reshape"):
            return None
        produced = view.args[0]
        call = bound.get(produced) if isinstance(produced, relax.Var) else None
        reads = read_by(call) if call is not None else None
        if (not is_call_to(call, "relax.call_tir") or len(call.args) > 2 or reads is None
                or sum(r.same_as(view) for r in reads) != 1
                or not only_reader(read_by(view), pad)):
            return None
        kernel, args = call.args[0], list(call.args[1].fields)
        func = self.mod[kernel]
        nhwc = static_shape(view.ty.shape.values)
        if not isinstance(func, tirx.PrimFunc) or len(func.params) != len(args) + 1 \
                or nhwc is None or len(nhwc) != 4:
            return None
        n, h, w, c = nhwc
        if static_shape(func.params[-1].ty.shape) != (n * h * w, c):
            return None
        pad_value = float(pad.attrs.pad_value)
        padded = padded_output(func, (n, h, w), padding, pad_value)
        if padded is None:
            return None
        top, bottom, left, right = padding
        hp, wp = h + top + bottom, w + left + right
        others = [r for r in reads if not r.same_as(view)]
        flat = relax.op.reshape(pad_var, (n * hp * wp, c))  # for the other readers
        replaced = {}
        for reader in others:
            var = next((v for v, value in bound.items() if value.same_as(reader)), None)
            found = self._reading_padded(reader, produced, flat, (n, h, w), padding)
            if found is None or var is None:
                return None
            replaced[var] = found
        gv = add_kernel(self.builder_, padded, f"{kernel.name_hint}_padded")
        out = relax.call_tir(gv, args, relax.TensorType((n * hp * wp, c), view.ty.dtype))
        # The producer's binding kept as it is (dead once its readers read the padded
        # buffer), listed so that no other rewrite changes it.
        return {produced: call, pad_var: relax.op.reshape(out, (n, hp, wp, c)), **replaced}

    def _reading_padded(self, reader: relax.Expr, produced: relax.Var, flat: relax.Expr,
                        images: tuple[int, int, int], padding: Padding) -> relax.Expr | None:
        """``reader``, a kernel call taking ``produced`` (an unpadded output), reading
        ``flat`` (the padded buffer) in its place, or None where it cannot."""
        if not is_call_to(reader, "relax.call_tir") or len(reader.args) > 2:
            return None
        kernel, args = reader.args[0], list(reader.args[1].fields)
        func = self.mod[kernel]
        if not isinstance(func, tirx.PrimFunc) or len(func.params) != len(args) + 1:
            return None
        for i, arg in enumerate(args):
            if arg.same_as(produced):
                func = reading_padded(func, i, images, padding)
                if func is None:
                    return None
                args[i] = flat
        gv = add_kernel(self.builder_, func, f"{kernel.name_hint}_from_padded")
        return relax.call_tir(gv, args, reader.ty)
