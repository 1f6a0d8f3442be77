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

import tvm
from tvm import relax

from .scaffold import is_call_to, static_shape

__all__ = ["TO_NCHW", "TO_NHWC", "simplify_layouts"]

#: ``permute_dims`` axes from NCHW to NHWC, and back.
TO_NHWC = (0, 2, 3, 1)
TO_NCHW = (0, 3, 1, 2)

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
    * pooling and spatial ``mean`` of ``permute_dims(a, NCHW)`` run on ``a`` in NHWC, with
      the permute after them, where the next conv's permute cancels it.
    """

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op) or not call.args:
            return call
        name = call.op.name
        inner = self._bound(call.args[0])
        if name == "relax.permute_dims" and is_call_to(inner, "relax.permute_dims"):
            outer_axes, inner_axes = _axes(call), _axes(inner)
            if outer_axes is None or inner_axes is None:
                return call
            composed = tuple(inner_axes[a] for a in outer_axes)
            if composed == tuple(range(len(composed))):
                return inner.args[0]
            return relax.op.permute_dims(inner.args[0], composed)
        if name == "relax.reshape":
            source = inner.args[0] if is_call_to(inner, "relax.reshape") else call.args[0]
            target = static_shape(call.ty.shape)
            if target is not None and static_shape(source.ty.shape) == target:
                return source
            return call if source is call.args[0] else relax.op.reshape(source, call.args[1])
        if not (is_call_to(inner, "relax.permute_dims") and _axes(inner) == TO_NCHW):
            return call
        nhwc = inner.args[0]
        attrs = call.attrs
        if name in _POOLS and str(attrs.layout) == "NCHW" and str(attrs.out_layout) == "NCHW":
            pooled = _POOLS[name](nhwc, attrs.pool_size, attrs.strides, attrs.padding,
                                  attrs.dilation, bool(attrs.ceil_mode),
                                  bool(attrs.count_include_pad), layout="NHWC")
            return relax.op.permute_dims(pooled, TO_NCHW)
        if name == "relax.mean" and attrs.axis is not None \
                and sorted(int(a) for a in attrs.axis) == [2, 3]:
            if not attrs.keepdims:
                return relax.op.mean(nhwc, [1, 2], keepdims=False)
            return relax.op.permute_dims(relax.op.mean(nhwc, [1, 2], keepdims=True), TO_NCHW)
        return call

    def _bound(self, expr: relax.Expr) -> relax.Expr:
        # Through var-to-var aliases (left by cancelled permutes) to the defining call.
        while isinstance(expr, relax.Var):
            value = self.lookup_binding(expr)
            if value is None:
                return expr
            expr = value
        return expr


def simplify_layouts(mod: tvm.IRModule) -> tvm.IRModule:
    """Cancel the layout conversions between TPP convs (see :class:`_Layouts`).

    Dead intermediate permutes are left for DeadCodeElimination; the caller's module stays as
    it was.
    """
    mod = mod.clone()
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gv] = _Layouts(mod).visit_expr(func)
    return mod
