"""Layout cancellation: the NHWC <-> NCHW conversions between TPP convolutions disappear.

A rewritten conv (:mod:`relay_passes.conv`) reads ``permute_dims(x, NHWC)`` and is read through
``permute_dims(reshape(y), NCHW)``.  :func:`simplify_layouts` cancels these conversions between
consecutive TPP convs, residual adds included, and moves pooling and spatial means of an
NCHW view to the NHWC tensor, so a chain of convs passes NHWC tensors along and converts only
at its borders (graph inputs, flattening, ...).

Examples
--------
>>> x = relax.Var("x", relax.TensorType((1, 5, 7, 3), "float32"))
>>> bb = relax.BlockBuilder()
>>> with bb.function("main", [x]):
...     nchw = bb.emit(relax.op.permute_dims(x, TO_NCHW))
...     pooled = bb.emit(relax.op.nn.max_pool2d(nchw, (2, 2)))
...     _ = bb.emit_func_output(bb.emit(relax.op.permute_dims(pooled, TO_NHWC)))
>>> mod = relax.transform.DeadCodeElimination()(simplify_layouts(bb.get()))
>>> ops = []
>>> relax.analysis.post_order_visit(mod["main"], lambda e: ops.append(e.op.name)
...                                 if isinstance(e, relax.Call) else None)
>>> ops
['relax.nn.max_pool2d']
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax

from .scaffold import is_call_to, map_functions, static_shape

__all__ = ["TO_NCHW", "TO_NHWC", "moves_data", "selects_data", "simplify_layouts", "widened"]

#: ``permute_dims`` axes from NCHW to NHWC, and back.
TO_NHWC = (0, 2, 3, 1)
TO_NCHW = (0, 3, 1, 2)

#: Elementwise ops a permute moves through -> how many leading arguments are tensors of
#: the output's shape (the rest: scalars, quantization parameters, attributes' values).
_ELEMENTWISE = {"relax.add": 2, "relax.subtract": 2, "relax.multiply": 2, "relax.divide": 2,
                "relax.maximum": 2, "relax.minimum": 2, "relax.nn.relu": 1, "relax.clip": 1,
                "relax.astype": 1, "relax.sigmoid": 1, "relax.quantize": 1,
                "relax.dequantize": 1}
#: An NCHW axis's index in NHWC (a per-channel quantization's axis moves with the permute).
_NCHW_TO_NHWC_AXIS = (0, 3, 1, 2)

_POOLS = {"relax.nn.max_pool2d": relax.op.nn.max_pool2d,
          "relax.nn.avg_pool2d": relax.op.nn.avg_pool2d}


def _axes(call: relax.Call) -> tuple[int, ...] | None:
    axes = call.attrs.axes
    return None if axes is None else tuple(int(a) for a in axes)


@relax.expr_functor.mutator
class _Layouts(relax.PyExprMutator):
    """Local rewrites that let the NHWC <-> NCHW conversions around TPP convs cancel.

    * ``permute_dims(permute_dims(a, p), q)`` -> ``a`` (or one permute_dims);
    * ``reshape(reshape(a, s), t)`` -> ``reshape(a, t)``, and ``a`` if ``t`` is a's shape
      (FuseOps would otherwise fuse the pair into a copy kernel);
    * pooling, resizing (FPN and segmentation heads' upsampling) and spatial ``mean`` of
      ``permute_dims(a, NCHW)`` run on ``a`` in NHWC, with the permute after them, where
      the next conv's permute cancels it;
    * so do elementwise ops whose tensor operands are all such permutes, scalars, constants
      (transposed at compile time) or per-image vectors ``[N, C, 1, 1]`` (reshaped): a
      quantized residual block's dequantize / add / relu / quantize between int8 convs,
      DenseNet's BatchNorm + ReLU before a conv, squeeze-excite's channel scaling,
      HardSwish's ``x * clip(x + 3, 0, 6) / 6``;
    * and a channel ``concat`` of such permutes (DenseNet, Inception): the NHWC tensors are
      concatenated along their last axis; ShuffleNet's channel shuffle of one shuffles the
      NHWC channels;
    * ``astype(astype(x, float32), bfloat16)`` of a bf16 ``x`` is ``x`` (a bf16 producer's
      output handed to a bf16 consumer), also with reshapes and permutes between the casts,
      and through a concat: each part's widening cancels, the other parts cast on their own;
      a concat of widened bf16 parts widens once, after it (Inception's branches, joined
      for the bf16 max pool after them).
    """

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op) or not call.args:
            return call
        name = call.op.name
        inner = self._bound(call.args[0])
        if name == "relax.astype":
            cancelled = _undo_widening(inner, str(call.attrs.dtype), self._bound)
            if cancelled is not None:
                return cancelled
        if name == "relax.permute_dims" and is_call_to(inner, "relax.permute_dims"):
            outer_axes, inner_axes = _axes(call), _axes(inner)
            if outer_axes is None or inner_axes is None:
                return call
            composed = tuple(inner_axes[a] for a in outer_axes)
            if composed == tuple(range(len(composed))):
                return inner.args[0]
            return relax.op.permute_dims(inner.args[0], composed)
        if name == "relax.reshape":
            shuffled = self._channel_shuffle(call)
            if shuffled is not None:
                return shuffled
            source = inner.args[0] if is_call_to(inner, "relax.reshape") else call.args[0]
            target = static_shape(call.ty.shape)
            if target is not None and static_shape(source.ty.shape) == target:
                return source
            return call if source is call.args[0] else relax.op.reshape(source, call.args[1])
        if name == "relax.concat":
            return self._concat(call)
        if name in _ELEMENTWISE:
            return self._elementwise(call)
        if not (is_call_to(inner, "relax.permute_dims") and _axes(inner) == TO_NCHW):
            return call
        nhwc = inner.args[0]
        attrs = call.attrs
        if name in _POOLS and str(attrs.layout) == "NCHW" and str(attrs.out_layout) == "NCHW":
            pooled = _POOLS[name](nhwc, attrs.pool_size, attrs.strides, attrs.padding,
                                  attrs.dilation, bool(attrs.ceil_mode),
                                  bool(attrs.count_include_pad), layout="NHWC")
            return relax.op.permute_dims(pooled, TO_NCHW)
        if name == "relax.image.resize2d" and str(attrs.layout) == "NCHW":
            out_dtype = str(attrs.out_dtype) if attrs.out_dtype is not None else ""
            resized = relax.op.image.resize2d(
                nhwc, call.args[1], tuple(float(v) for v in attrs.roi), layout="NHWC",
                method=str(attrs.method),
                coordinate_transformation_mode=str(attrs.coordinate_transformation_mode),
                rounding_method=str(attrs.rounding_method),
                cubic_alpha=float(attrs.cubic_alpha), cubic_exclude=int(attrs.cubic_exclude),
                extrapolation_value=float(attrs.extrapolation_value),
                out_dtype=None if out_dtype in ("", "void") else out_dtype)
            return relax.op.permute_dims(resized, TO_NCHW)
        if name == "relax.mean" and attrs.axis is not None \
                and sorted(int(a) for a in attrs.axis) == [2, 3]:
            if not attrs.keepdims:
                return relax.op.mean(nhwc, [1, 2], keepdims=False)
            return relax.op.permute_dims(relax.op.mean(nhwc, [1, 2], keepdims=True), TO_NCHW)
        return call

    def _nhwc(self, expr: relax.Expr) -> relax.Expr | None:
        """``expr``, an NCHW tensor of the output's NHWC view, as that NHWC tensor (None: not
        a permuted NCHW view)."""
        bound = self._bound(expr)
        if is_call_to(bound, "relax.permute_dims") and _axes(bound) == TO_NCHW:
            return bound.args[0]
        return None

    def _channel_shuffle(self, call: relax.Call) -> relax.Expr | None:
        """ShuffleNet's ``reshape(permute_dims(reshape(x, [N, g, C/g, H, W]), [0, 2, 1, 3, 4]),
        [N, C, H, W])`` of ``x = permute_dims(a, NCHW)`` as the same shuffle of the NHWC ``a``:
        ``permute_dims(reshape(permute_dims(reshape(a, [N, H, W, g, C/g]), [0, 1, 2, 4, 3]),
        [N, H, W, C]), NCHW)`` (None: not that pattern)."""
        swap = self._bound(call.args[0])
        if not (is_call_to(swap, "relax.permute_dims") and _axes(swap) == (0, 2, 1, 3, 4)):
            return None
        split = self._bound(swap.args[0])
        if not is_call_to(split, "relax.reshape"):
            return None
        nhwc = self._nhwc(split.args[0])
        parts, out = static_shape(split.ty.shape), static_shape(call.ty.shape)
        if nhwc is None or parts is None or out is None or len(parts) != 5:
            return None
        n, groups, per_group, h, w = parts
        channels = groups * per_group
        if out != (n, channels, h, w) or static_shape(nhwc.ty.shape) != (n, h, w, channels):
            return None
        grouped = relax.op.reshape(nhwc, (n, h, w, groups, per_group))
        shuffled = relax.op.permute_dims(grouped, [0, 1, 2, 4, 3])
        return relax.op.permute_dims(relax.op.reshape(shuffled, (n, h, w, channels)), TO_NCHW)

    def _concat(self, call: relax.Call) -> relax.Expr:
        """``concat([permute_dims(a, NCHW), ...], axis=1)`` -> ``permute_dims(concat([a, ...],
        axis=3), NCHW)`` when every part is such a permute."""
        parts = self._bound(call.args[0])
        if not isinstance(parts, relax.Tuple):
            return call
        nhwc = [self._nhwc(part) for part in parts.fields]
        if int(call.attrs.axis) % 4 != 1 or call.ty.ndim != 4 \
                or any(part is None for part in nhwc):
            joined = self._join(list(parts.fields), int(call.attrs.axis))
            return call if joined is None else joined
        joined = self._join(nhwc, 3)
        return relax.op.permute_dims(relax.op.concat(nhwc, axis=3) if joined is None
                                     else joined, TO_NCHW)

    def _join(self, parts: list[relax.Expr], axis: int) -> relax.Expr | None:
        """``concat([astype(a, float32), ...])`` of bf16 parts all widened ->
        ``astype(concat([a, ...]), float32)`` (None: some part is no such widening): bf16
        convs' branches joined in bf16, for the bf16 max pool or conv after the concat."""
        bound = [self._bound(part) for part in parts]
        narrow = [widened(part) for part in bound]
        if any(source is None for source in narrow):
            return None
        casts = {(str(source.ty.dtype), str(part.ty.dtype))
                 for source, part in zip(narrow, bound, strict=True)}
        if len(casts) != 1:  # parts of one dtype, widened to one
            return None
        return relax.op.astype(relax.op.concat(narrow, axis=axis), casts.pop()[1])

    def _elementwise(self, call: relax.Call) -> relax.Expr:
        """``op(permute_dims(a, NCHW), ...)`` -> ``permute_dims(op(a, ...), NCHW)`` when every
        other tensor operand is a scalar, NCHW-permuted too, a constant (transposed here) or
        an ``[N, C, 1, 1]`` vector (reshaped)."""
        tensors = _ELEMENTWISE[call.op.name]
        args = list(call.args)
        permuted = False
        for i in range(tensors):
            nhwc = self._nhwc(args[i])
            if nhwc is not None:
                args[i], permuted = nhwc, True
            elif not (isinstance(args[i].ty, relax.TensorType) and args[i].ty.ndim == 0):
                args[i] = _broadcast_operand_nhwc(args[i])
                if args[i] is None:
                    return call
        if not permuted or call.ty.ndim != 4:
            return call
        attrs = call.attrs
        if call.op.name in ("relax.quantize", "relax.dequantize"):
            make = getattr(relax.op, call.op.name.split(".")[1])
            axis = _NCHW_TO_NHWC_AXIS[int(attrs.axis) % 4]
            out = make(*args, axis=axis, out_dtype=str(attrs.out_dtype))
        elif call.op.name == "relax.astype":
            out = _undo_widening(self._bound(args[0]), str(attrs.dtype), self._bound)
            out = relax.Call(call.op, args, attrs) if out is None else out
        else:
            out = relax.Call(call.op, args, attrs)
        return relax.op.permute_dims(out, TO_NCHW)

    def _bound(self, expr: relax.Expr) -> relax.Expr:
        # Through var-to-var aliases (left by cancelled permutes) to the defining call.
        while isinstance(expr, relax.Var):
            value = self.lookup_binding(expr)
            if value is None:
                return expr
            expr = value
        return expr


def _broadcast_operand_nhwc(operand: relax.Expr) -> relax.Expr | None:
    """An operand broadcast against an NCHW tensor, for the same op on its NHWC tensor: a
    constant of rank <= 4, transposed in numpy; a ``[N, C, 1, 1]`` tensor, reshaped to
    ``[N, 1, 1, C]``; None for anything else."""
    if not isinstance(operand.ty, relax.TensorType):
        return None
    shape = static_shape(operand.ty.shape)
    if shape is None or len(shape) > 4:
        return None
    if isinstance(operand, tvm.ir.expr.Constant):
        value = operand.value.numpy()
        value = value.reshape((1,) * (4 - value.ndim) + value.shape)
        return relax.const(np.ascontiguousarray(value.transpose(TO_NHWC)), str(value.dtype))
    if len(shape) == 4 and shape[2:] == (1, 1):
        return relax.op.reshape(operand, (shape[0], 1, 1, shape[1]))
    return None


def moves_data(expr: relax.Expr) -> bool:
    """Whether ``expr`` only moves its input's values (a reshape or a permute): a cast
    commutes with it, so a widening round trip around it cancels (:func:`_undo_widening`)."""
    return is_call_to(expr, "relax.reshape") or is_call_to(expr, "relax.permute_dims")


def selects_data(expr: relax.Expr) -> bool:
    """Whether ``expr`` moves or splits its input's values (:func:`moves_data`, a ``split``,
    a part of one): a cast commutes with it too."""
    return (moves_data(expr) or is_call_to(expr, "relax.split")
            or isinstance(expr, relax.TupleGetItem))


#: Casts whose round trip is exact: (narrow, wide) -- a bf16 producer handing its output to
#: a bf16 consumer through a float32 view of it (:mod:`relay_passes.conv`).
_WIDENINGS = {("bfloat16", "float32")}


def _undo_widening(inner: relax.Expr, dtype: str,
                   bound: Callable[[relax.Expr], relax.Expr]) -> relax.Expr | None:
    """``x`` for ``astype(astype(x, wide), dtype)`` when ``x`` is ``dtype`` and the inner
    cast only widened it (exact both ways), else None; through reshapes and permutes between
    them (ShuffleNet's channel shuffle), the same data movement of ``x``; through a part of a
    split (GPT-2's Q, K and V), that part of ``x``'s split; through a concat with a widened
    part, the concat of the parts in ``dtype`` (``bound`` resolves variables to their
    values)."""
    if moves_data(inner):
        source = _undo_widening(bound(inner.args[0]), dtype, bound)
        if source is None:
            return None
        if is_call_to(inner, "relax.reshape"):
            return relax.op.reshape(source, inner.args[1])
        return relax.op.permute_dims(source, _axes(inner))
    if isinstance(inner, relax.TupleGetItem):  # a part of a split: that part of x's split
        whole = bound(inner.tuple_value)
        if not is_call_to(whole, "relax.split"):
            return None
        source = _undo_widening(bound(whole.args[0]), dtype, bound)
        if source is None:
            return None
        return relax.TupleGetItem(relax.op.split(source, whole.attrs.indices_or_sections,
                                                 int(whole.attrs.axis)), inner.index)
    if is_call_to(inner, "relax.concat"):  # a cast commutes with a concat, part by part
        parts = bound(inner.args[0])
        if not isinstance(parts, relax.Tuple):
            return None
        undone = [_undo_widening(bound(part), dtype, bound) for part in parts.fields]
        if all(part is None for part in undone):
            return None
        return relax.op.concat([relax.op.astype(part, dtype) if source is None else source
                                for part, source in zip(parts.fields, undone, strict=True)],
                               axis=int(inner.attrs.axis))
    source = widened(inner)
    return source if source is not None and str(source.ty.dtype) == dtype else None


def widened(expr: relax.Expr) -> relax.Expr | None:
    """``x`` for ``astype(x, wide)`` that only widens ``x`` (:data:`_WIDENINGS`), else None."""
    if not is_call_to(expr, "relax.astype"):
        return None
    source = expr.args[0]
    if not isinstance(source.ty, relax.TensorType):
        return None
    return source if (str(source.ty.dtype), str(expr.attrs.dtype)) in _WIDENINGS else None


def simplify_layouts(mod: tvm.IRModule) -> tvm.IRModule:
    """Cancel the layout conversions between TPP convs (see :class:`_Layouts`).

    Dead intermediate permutes are left for DeadCodeElimination; the caller's module stays as
    it was.
    """
    return map_functions(mod, lambda func: _Layouts(mod).visit_expr(func))
