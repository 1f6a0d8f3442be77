"""Graph preparation: the inference simplifications that expose GEMM/conv patterns with
constant weights, before any TPP rewrite.

* :func:`prepare` is the pass the ``tpp`` pipeline starts with: BatchNorm and the other
  per-channel scale-shift chains folded in numpy, into the conv before them where there is
  one (:func:`~relay_passes.scale_shift.fold_scale_shift`), then TVM's
  ``DecomposeOpsForInference`` and ``FoldConstant`` (transposes of constant weights go);
* :func:`sum_to_add` repairs the ONNX importer's ``Sum``, which hides a residual add;
  :func:`~relay_passes.conv.rewrite_conv` applies it before matching;
* :func:`conv1d_as_conv2d` states a 1-D convolution as a 2-D one of height 1, which the conv
  rewrite then routes (:func:`prepare` applies it), and
  :func:`~relay_passes.conv_transpose.transposed_as_conv` a ConvTranspose as a conv and an
  interleave (:func:`prepare` applies it too);
* :func:`te_extrema_to_ops` turns the importer's ``Clip`` (TE kernels of an elementwise
  maximum and minimum with a scalar) into ``relax.maximum``/``relax.minimum``, which the
  offload passes take as a ``clamp`` epilogue and the layout pass moves to NHWC.

Examples
--------
ONNX ``Sum(a, b)`` as the importer leaves it, and repaired:

>>> a = relax.Var("a", relax.TensorType((2, 3), "float32"))
>>> b = relax.Var("b", relax.TensorType((2, 3), "float32"))
>>> bb = relax.BlockBuilder()
>>> with bb.function("main", [a, b]):
...     terms = [bb.emit(relax.op.broadcast_to(t, (2, 3))) for t in (a, b)]
...     stacked = bb.emit(relax.op.stack(terms, axis=0))
...     _ = bb.emit_func_output(bb.emit(relax.op.sum(stacked, axis=[0])))
>>> ops = []
>>> relax.analysis.post_order_visit(sum_to_add(bb.get())["main"], lambda e: ops.append(
...     e.op.name) if isinstance(e, relax.Call) else None)
>>> ops
['relax.add']
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir.expr import TensorLoad
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

from .conv_transpose import transposed_as_conv
from .pool_first import pool_before_pointwise_conv
from .scaffold import is_call_to, map_functions, static_shape
from .scale_shift import fold_scale_shift

__all__ = ["conv1d_as_conv2d", "prepare", "sum_to_add", "te_extrema_to_ops"]


def prepare() -> tvm.transform.Pass:
    """Inference simplifications that expose GEMM/conv patterns with constant weights.

    BatchNorm and its scale-shift neighbours are folded in numpy first (before
    DecomposeOpsForInference turns BatchNorm into arithmetic; TVM's FoldConstant would compile
    a kernel per fold).
    """
    return tvm.transform.Sequential(
        [
            # Constant biases of 1-D convs are reshapes until folded.
            relax.transform.FoldConstant(),
            tvm.transform.module_pass(lambda mod, _ctx: conv1d_as_conv2d(mod), opt_level=0,
                                      name="TppConv1dAsConv2d"),
            tvm.transform.module_pass(lambda mod, _ctx: transposed_as_conv(mod), opt_level=0,
                                      name="TppTransposedAsConv"),
            tvm.transform.module_pass(lambda mod, _ctx: fold_scale_shift(mod), opt_level=0,
                                      name="TppFoldScaleShift"),
            relax.transform.DecomposeOpsForInference(),
            relax.transform.FoldConstant(),
            # After the folding: Clip's bounds are where(isnan(b), inf, b) until then.
            tvm.transform.module_pass(lambda mod, _ctx: te_extrema_to_ops(mod), opt_level=0,
                                      name="TppExtremaToOps"),
            # DenseNet's transitions: the conv on a quarter of the pixels.
            tvm.transform.module_pass(lambda mod, _ctx: pool_before_pointwise_conv(mod),
                                      opt_level=0, name="TppPoolBeforePointwiseConv"),
        ],
        name="TppPrepare",
    )


def conv1d_as_conv2d(mod: tvm.IRModule) -> tvm.IRModule:
    """``conv1d(x, W) [+ b]`` (NCW data, a constant OIW weight, a constant bias) as
    ``conv2d`` of height 1: ``reshape(conv2d(reshape(x, [N, C, 1, L]), W[:, :, None], ...)
    [+ b[..., None, :]], [N, K, L'])`` with the stride, padding, dilation and groups along
    the width.  The caller's module stays as it was.

    Examples
    --------
    >>> import numpy as np
    >>> x = relax.Var("x", relax.TensorType((1, 4, 9), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     w = relax.const(np.ones((6, 2, 3), "float32"))
    ...     y = bb.emit(relax.op.nn.conv1d(x, w, strides=2, padding=1, dilation=2, groups=2))
    ...     _ = bb.emit_func_output(y)
    >>> convs = []
    >>> relax.analysis.post_order_visit(conv1d_as_conv2d(bb.get())["main"], lambda e: convs.append(
    ...     e) if is_call_to(e, "relax.nn.conv2d") else None)
    >>> [(tuple(c.attrs.strides), tuple(c.attrs.dilation), c.ty.shape) for c in convs]
    [((1, 2), (1, 2), R.shape([1, 6, 1, 4]))]
    """
    conv1d = is_op("relax.nn.conv1d")(wildcard(), is_const())
    bias = is_const()
    pattern = is_op("relax.add")(conv1d, bias) | conv1d

    def rewriter(orig, matches):
        call = matches[conv1d]
        x, w = call.args
        a = call.attrs
        x_shape = static_shape(x.ty.shape) if isinstance(x.ty, relax.TensorType) else None
        if (x_shape is None or len(x_shape) != 3 or (str(a.data_layout), str(a.kernel_layout),
                                                      str(a.out_layout)) != ("NCW", "OIW", "NCW")):
            return orig
        weight = w.value.numpy()
        left, right = (int(p) for p in a.padding)
        conv = relax.op.nn.conv2d(
            relax.op.reshape(x, (x_shape[0], x_shape[1], 1, x_shape[2])),
            relax.const(weight[:, :, None, :]), strides=(1, int(a.strides[0])),
            padding=(0, left, 0, right), dilation=(1, int(a.dilation[0])), groups=int(a.groups),
            out_dtype=a.out_dtype)
        out_shape = static_shape(call.ty.shape)
        if bias in matches:  # ONNX Conv's B, [1, K, 1]: added in 2-D, where the conv
            b = matches[bias].value.numpy()  # rewrite fuses it into the kernel
            if b.ndim > 3 or static_shape(orig.ty.shape) != out_shape:
                return orig
            conv = relax.op.add(conv, relax.const(b.reshape(*b.shape[:-1], 1, b.shape[-1])))
        return relax.op.reshape(conv, out_shape)

    return map_functions(mod, lambda func: rewrite_call(pattern, rewriter, func))


def _extremum(func: tvm.tirx.PrimFunc) -> str | None:
    """``"relax.maximum"`` or ``"relax.minimum"`` if ``func`` is a TE kernel of one
    elementwise ``max(a[i], b[()])`` (or min) of its first parameter and a scalar, else None."""
    if not isinstance(func, tvm.tirx.PrimFunc) or len(func.params) != 3:
        return None
    import tvm_ffi

    a, b, out = func.params  # buffer parameters
    if len(b.shape) or len(a.shape) != len(out.shape):
        return None
    stores: list[tvm.tirx.BufferStore] = []
    tvm_ffi.structural_walk(func.body, (tvm.tirx.BufferStore, stores.append))
    if len(stores) != 1 or not stores[0].buffer.same_as(out):
        return None
    value = stores[0].value
    kind = {tvm.tirx.Max: "relax.maximum", tvm.tirx.Min: "relax.minimum"}.get(type(value))
    loads = (value.a, value.b) if kind else ()
    if not loads or not all(isinstance(x, TensorLoad) for x in loads) or \
            not (loads[0].source.same_as(a) and loads[1].source.same_as(b)):
        return None
    return kind


def te_extrema_to_ops(mod: tvm.IRModule) -> tvm.IRModule:
    """``call_tir`` of a TE elementwise maximum/minimum with a scalar constant (what TVM's
    ONNX importer makes of ``Clip``) as the Relax operator.  The caller's module stays as
    it was; the kernels no longer called go.

    Examples
    --------
    >>> from tvm import topi
    >>> x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     y = bb.emit_te(topi.maximum, x, relax.const(0.0, "float32"))
    ...     _ = bb.emit_func_output(bb.emit_te(topi.minimum, y, relax.const(6.0, "float32")))
    >>> mod = te_extrema_to_ops(bb.get())
    >>> [b.value.op.name for b in mod["main"].body.blocks[0].bindings], sorted(
    ...     gv.name_hint for gv in mod.functions)
    (['relax.maximum', 'relax.minimum'], ['main'])
    """
    kinds = {gv: _extremum(f) for gv, f in mod.functions.items()}

    def rewrite(call: relax.Call) -> relax.Expr:
        if not is_call_to(call, "relax.call_tir") or not isinstance(call.args[1], relax.Tuple):
            return call
        kind = kinds.get(call.args[0])
        x, bound = (list(call.args[1].fields) + [None, None])[:2]
        if kind is None or not isinstance(bound, tvm.ir.expr.Constant) or \
                bound.value.numpy().ndim != 0 or bound.ty.dtype != x.ty.dtype:
            return call
        return relax.op.maximum(x, bound) if kind == "relax.maximum" \
            else relax.op.minimum(x, bound)

    rewritten = map_functions(mod, lambda func: _CallRewriter(rewrite).visit_expr(func))
    return relax.transform.DeadCodeElimination()(rewritten)


@relax.expr_functor.mutator
class _CallRewriter(relax.PyExprMutator):
    """Every call, after its arguments, replaced by ``rewrite(call)``."""

    def __init__(self, rewrite) -> None:
        super().__init__()
        self.rewrite = rewrite

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        return self.rewrite(super().visit_call_(call))


@relax.expr_functor.mutator
class _SumToAdd(relax.PyExprMutator):
    """``sum(stack((broadcast_to(a, S), broadcast_to(b, S), ...), 0), 0)`` -> ``a + b + ...``."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not is_call_to(call, "relax.sum") or call.attrs.keepdims:
            return call
        if call.attrs.axis is None or [int(a) for a in call.attrs.axis] != [0]:
            return call
        stacked = self._bound(call.args[0])
        if not is_call_to(stacked, "relax.stack") or int(stacked.attrs.axis) != 0:
            return call
        fields = self._bound(stacked.args[0])
        if not isinstance(fields, relax.Tuple):
            return call
        terms = []
        for item in fields.fields:
            value = self._bound(item)
            if not is_call_to(value, "relax.broadcast_to"):
                return call
            term = value.args[0]
            shape = static_shape(call.ty.shape)
            if (shape is None or static_shape(term.ty.shape) != shape
                    or term.ty.dtype != call.ty.dtype):
                return call
            terms.append(term)
        total = terms[0]
        for term in terms[1:]:
            total = relax.op.add(total, term)
        return total

    def _bound(self, expr: relax.Expr) -> relax.Expr:
        return self.lookup_binding(expr) if isinstance(expr, relax.Var) else expr


def sum_to_add(mod: tvm.IRModule) -> tvm.IRModule:
    """Turn the ONNX importer's ``Sum`` of same-shaped tensors back into chained ``add``.

    The importer spells ``Sum(a, b)`` ``sum(stack(broadcast_to(a), broadcast_to(b)), 0)``,
    where no residual-add pattern sees it.  The caller's module stays as it was.
    """
    rewritten = map_functions(mod, lambda func: _SumToAdd(mod).visit_expr(func))
    return relax.transform.DeadCodeElimination()(rewritten)
