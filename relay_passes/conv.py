"""Convolutions to TPP kernels: ``act(conv2d(x, W) + b [+ r])``, constant W, as one call_tir.

Matches ``relax.nn.conv2d`` with a constant weight (NCHW data, OIHW weights, float32,
``groups = 1``, dilation 1, any stride and padding) together with the epilogue that follows it:
a constant per-channel bias (``[1, K, 1, 1]``, what BatchNorm folding leaves), a residual add
of another tensor of the output's shape, and ReLU / GELU / sigmoid.  The chain becomes one
scheduled PrimFunc (:mod:`schedules.conv`) whose weights are packed at compile time.

The kernel works channels-last, so each rewritten conv reads
``reshape(pad(permute_dims(x, NHWC)))`` and is read through ``permute_dims(reshape(y), NCHW)``.
Between two rewritten convs these conversions cancel (:func:`simplify_layouts`):
a chain of TPP convs, residual adds included, passes NHWC tensors along and converts only at
its borders (graph inputs, pooling, ...).  ONNX ``Sum`` of two tensors, which the importer
spells ``sum(stack(broadcast_to(a), broadcast_to(b)))``, is first turned back into ``add`` so a
ResNet's residual add is found (:func:`sum_to_add`).  :func:`fold_batchnorm` folds inference
BatchNorm into the conv weights in numpy; it belongs before ``DecomposeOpsForInference``.

Convolutions that do not fit (grouped/depthwise, dilated, non-float32, non-constant weights,
symbolic shapes, other layouts) stay with TVM and are reported with the reason.

Examples
--------
>>> report = []
>>> mod = rewrite_conv(mod, target, report)                    # doctest: +SKIP
>>> [(r.op, r.shape, r.kernel or r.reason) for r in report]    # doctest: +SKIP
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, is_tuple_get_item, rewrite_call, wildcard
from tvm.target import Target

from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.machine import machine_of
from schedules.conv import ConvConfig, ConvProblem, pack_weight, schedule, unfold_weight
from schedules.tuner import Tuner, config_for

from .dense import Offload, add_patterns, rewrite_patterns, static_shape

__all__ = ["rewrite_conv", "fold_batchnorm", "simplify_layouts", "sum_to_add"]

# Activations absorbed into the epilogue: relax op -> epilogue op.
_ACTIVATIONS = {
    "relax.nn.relu": EpilogueOp("relu"),
    "relax.nn.gelu": EpilogueOp("gelu", variant="erf"),
    "relax.nn.gelu_tanh": EpilogueOp("gelu", variant="tanh"),
    "relax.sigmoid": EpilogueOp("sigmoid"),
}
_TO_NHWC = (0, 2, 3, 1)
_TO_NCHW = (0, 3, 1, 2)
#: Convs with fewer input channels than this get their width taps unfolded into channels.
_UNFOLD_BELOW = 16


@dataclass(frozen=True)
class _Pattern:
    root: object
    conv: object
    x: object
    w: object
    bias: object | None
    residual: object | None
    activation: str | None


def _patterns() -> list[_Pattern]:
    """Every chain, longest first so the whole epilogue is taken before its prefixes."""
    out = []
    for activation in (*_ACTIVATIONS, None):
        for with_residual in (True, False):
            for with_bias in (True, False):
                x, w = wildcard(), is_const()
                conv = is_op("relax.nn.conv2d")(x, w)
                node, bias, residual = add_patterns(conv, with_bias, with_residual)
                if activation:
                    node = is_op(activation)(node)
                out.append(_Pattern(node, conv, x, w, bias, residual, activation))
    return out


def rewrite_conv(mod: tvm.IRModule, target: Target, report: list[Offload],
                 tuner: Tuner | None = None) -> tvm.IRModule:
    """Replace every supported conv2d chain with a constant weight by a TPP kernel call.

    Appends one :class:`~relay_passes.dense.Offload` per conv2d to ``report``: the kernel it
    became, or why it stayed with TVM.  With a ``tuner`` each kernel gets its tuned
    configuration (tuned now if its database does not know it yet); without one, the
    default heuristic's.
    """
    mod = sum_to_add(mod)
    def make_rewriter(builder, pattern, _func):
        return lambda orig, matches: _rewrite(orig, matches, pattern, builder, target, tuner,
                                              report)

    new_mod = simplify_layouts(rewrite_patterns(mod, _patterns(), make_rewriter))
    new_mod = relax.transform.DeadCodeElimination()(new_mod)
    _report_leftovers(new_mod, report)
    return new_mod


def _unsupported(call: relax.Call) -> str | None:
    """Why this conv2d cannot become a TPP kernel (None if it can)."""
    attrs = call.attrs
    x, w = call.args
    if not isinstance(w, tvm.ir.expr.Constant):
        return "weight is not a constant"
    if int(attrs.groups) != 1:
        return f"groups={int(attrs.groups)} (grouped/depthwise conv) is not routed to TPP"
    if any(int(d) != 1 for d in attrs.dilation):
        return f"dilation {[int(d) for d in attrs.dilation]} is not routed to TPP"
    layouts = (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout))
    if layouts != ("NCHW", "OIHW", "NCHW"):
        return f"layouts {'/'.join(layouts)}: only NCHW/OIHW/NCHW is routed to TPP"
    shape = static_shape(x.ty.shape) if isinstance(x.ty, relax.TensorType) else None
    if shape is None or len(shape) != 4:
        return "input shape is symbolic or not 4-D"
    out_dtype = str(attrs.out_dtype or "")
    if x.ty.dtype != "float32" or w.ty.dtype != "float32" or out_dtype not in ("", "float32"):
        return f"dtype {x.ty.dtype} x {w.ty.dtype}: only float32 conv2d is routed to TPP"
    return None


def _channel_vector(bias: np.ndarray, k: int) -> np.ndarray | None:
    """``bias`` as ``[K]`` if it is one value per output channel of an NCHW tensor."""
    if bias.ndim < 3 or bias.ndim > 4 or bias.shape[-3] != k or bias.size != k:
        return None
    return bias.reshape(k).astype(np.float32)


def _rewrite(orig, matches, pattern: _Pattern, builder, target, tuner, report):
    # Returning ``orig`` leaves the chain to a shorter pattern or to TVM; what stays is
    # reported once, by _report_leftovers().
    call = matches[pattern.conv]
    if _unsupported(call) is not None:
        return orig
    x = matches[pattern.x]
    weight = matches[pattern.w].value.numpy()
    n, c, h, w = static_shape(x.ty.shape)
    k, _, r, s = weight.shape
    attrs = call.attrs
    problem_args = dict(n=n, c=c, h=h, w=w, k=k, r=r, s=s,
                        stride=tuple(int(v) for v in attrs.strides),
                        padding=tuple(int(v) for v in attrs.padding))
    bias = None
    if pattern.bias is not None:
        bias = _channel_vector(matches[pattern.bias].value.numpy(), k)
        if bias is None:
            return orig
    residual = matches[pattern.residual] if pattern.residual is not None else None
    out_shape = static_shape(call.ty.shape)
    if residual is not None and (
        isinstance(residual, tvm.ir.expr.Constant)
        or not isinstance(residual.ty, relax.TensorType)
        or static_shape(residual.ty.shape) != out_shape
        or residual.ty.dtype != "float32"
    ):
        return orig

    ops = [EpilogueOp(kind) for kind, part in (("bias", bias), ("residual", residual))
           if part is not None]
    if pattern.activation:
        ops.append(_ACTIVATIONS[pattern.activation])
    problem = ConvProblem(**problem_args, epilogue=Epilogue(tuple(ops)))
    # Few input channels (an RGB stem): unfold the S taps into the channels, so that each
    # BRGEMM call reduces S*C values instead of C.
    unfold = problem.c < _UNFOLD_BELOW and problem.s > 1
    kernel_problem = problem.unfold_width() if unfold else problem
    isa = machine_of(target).isa
    config = config_for(kernel_problem, target, tuner)  # the problem the kernel computes
    sh, sw = problem.stride
    name = (f"tpp_conv2d_{n}x{c}x{h}x{w}_{k}x{r}x{s}_s{sh}x{sw}"
            + (f"_{problem.epilogue.name}" if ops else ""))
    gv = builder.add_func(_kernel(kernel_problem, config, isa.name), name)

    packed = _unfold_input(x, problem) if unfold else _pack_input(x, problem)
    args = [packed, relax.const(pack_weight(unfold_weight(weight) if unfold else weight,
                                            config.bk))]
    if bias is not None:
        args.append(relax.const(bias))
    if residual is not None:
        args.append(relax.op.reshape(relax.op.permute_dims(residual, _TO_NHWC),
                                     (problem.rows, k)))
    out = relax.call_tir(gv, args, relax.TensorType((problem.rows, k), "float32"))
    op = "+".join(["conv2d", *(o.tag for o in ops)])
    report.append(Offload(op, out_shape, kernel=f"{name} [{config.spec}]"))
    nhwc = relax.op.reshape(out, (n, problem.p, problem.q, k))
    return relax.op.permute_dims(nhwc, _TO_NCHW)


@functools.lru_cache(maxsize=256)
def _kernel(problem: ConvProblem, config: ConvConfig, isa: str) -> tvm.tirx.PrimFunc:
    """The scheduled PrimFunc, built once per distinct layer (a ResNet repeats its blocks)."""
    func = schedule(problem, config, isa).mod["main"]
    # kOpaque keeps FuseOps from fusing neighbours into the kernel; is_scheduled keeps the
    # fallback schedules off it.
    return func.without_attr("global_symbol").with_attrs(
        {"op_pattern": 8, "tirx.is_scheduled": True})


def _padded_nhwc(x, problem: ConvProblem, extra_right: int = 0):
    top, left, bottom, right = problem.padding
    y = relax.op.permute_dims(x, _TO_NHWC)
    if top or left or bottom or right + extra_right:
        y = relax.op.nn.pad(y, [0, 0, top, bottom, left, right + extra_right, 0, 0])
    return y


def _unfold_input(x, problem: ConvProblem):
    """NCHW ``x`` -> the input of ``problem.unfold_width()`` (see :mod:`schedules.conv`)."""
    padded = _padded_nhwc(x, problem)
    sw, q = problem.stride[1], problem.q
    taps = [relax.op.strided_slice(padded, axes=[2], begin=[s], end=[s + (q - 1) * sw + 1],
                                   strides=[sw]) for s in range(problem.s)]
    return relax.op.concat(taps, axis=3)


def _pack_input(x, problem: ConvProblem):
    """NCHW ``x`` -> the kernel's padded ``[N, Hp, Wq, sw*C]`` (see :mod:`schedules.conv`)."""
    _, left, _, right = problem.padding
    y = _padded_nhwc(x, problem, problem.wq * problem.stride[1] - (problem.w + left + right))
    if problem.stride[1] > 1:
        y = relax.op.reshape(y, problem.input_shape)
    return y


def _report_leftovers(mod: tvm.IRModule, report: list[Offload]) -> None:
    def visit(expr) -> None:
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) \
                and expr.op.name == "relax.nn.conv2d":
            reason = _unsupported(expr) or "pattern not matched"
            report.append(Offload("conv2d", static_shape(expr.ty.shape) or (), reason=reason))

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)


def _is_op(expr, name: str) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name


def _axes(call: relax.Call) -> tuple[int, ...] | None:
    axes = call.attrs.axes
    return None if axes is None else tuple(int(a) for a in axes)


_POOLS = {"relax.nn.max_pool2d": relax.op.nn.max_pool2d,
          "relax.nn.avg_pool2d": relax.op.nn.avg_pool2d}


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
        if name == "relax.permute_dims" and _is_op(inner, "relax.permute_dims"):
            outer_axes, inner_axes = _axes(call), _axes(inner)
            if outer_axes is None or inner_axes is None:
                return call
            composed = tuple(inner_axes[a] for a in outer_axes)
            if composed == tuple(range(len(composed))):
                return inner.args[0]
            return relax.op.permute_dims(inner.args[0], composed)
        if name == "relax.reshape":
            source = inner.args[0] if _is_op(inner, "relax.reshape") else call.args[0]
            target = static_shape(call.ty.shape)
            if target is not None and static_shape(source.ty.shape) == target:
                return source
            return call if source is call.args[0] else relax.op.reshape(source, call.args[1])
        if not (_is_op(inner, "relax.permute_dims") and _axes(inner) == _TO_NCHW):
            return call
        nhwc = inner.args[0]
        attrs = call.attrs
        if name in _POOLS and str(attrs.layout) == "NCHW" and str(attrs.out_layout) == "NCHW":
            pooled = _POOLS[name](nhwc, attrs.pool_size, attrs.strides, attrs.padding,
                                  attrs.dilation, bool(attrs.ceil_mode),
                                  bool(attrs.count_include_pad), layout="NHWC")
            return relax.op.permute_dims(pooled, _TO_NCHW)
        if name == "relax.mean" and attrs.axis is not None \
                and sorted(int(a) for a in attrs.axis) == [2, 3]:
            if not attrs.keepdims:
                return relax.op.mean(nhwc, [1, 2], keepdims=False)
            return relax.op.permute_dims(relax.op.mean(nhwc, [1, 2], keepdims=True), _TO_NCHW)
        return call

    def _bound(self, expr):
        # Through var-to-var aliases (left by cancelled permutes) to the defining call.
        while isinstance(expr, relax.Var):
            value = self.lookup_binding(expr)
            if value is None:
                return expr
            expr = value
        return expr


def simplify_layouts(mod: tvm.IRModule) -> tvm.IRModule:
    """Cancel the layout conversions between TPP convs (see :class:`_Layouts`).

    Dead intermediate permutes are left for DeadCodeElimination.
    """
    mod = mod.clone()  # the caller's module stays as it was
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gv] = _Layouts(mod).visit_expr(func)
    return mod


def fold_batchnorm(mod: tvm.IRModule) -> tvm.IRModule:
    """Fold inference BatchNorm into the constant weights of the conv2d before it, in numpy.

    ``batch_norm(conv2d(x, W), g, b, m, v)[0]`` -> ``conv2d(x, W * s) + (b - m * s)`` with
    ``s = g / sqrt(v + eps)`` per output channel.  Relax's FoldBatchnormToConv2D leaves the
    products for FoldConstant, which compiles a kernel for each one (a minute on ResNet-50);
    numpy does them in milliseconds.
    """
    mod = mod.clone()  # the caller's module stays as it was
    conv = is_op("relax.nn.conv2d")(wildcard(), is_const())
    stats = [is_const() for _ in range(4)]
    norm = is_op("relax.nn.batch_norm")(conv, *stats)
    pattern = is_tuple_get_item(norm, 0)

    def rewriter(orig, matches):
        call, bn = matches[conv], matches[norm]
        attrs = bn.attrs
        if attrs.training or int(attrs.axis) != 1 or str(call.attrs.kernel_layout) != "OIHW" \
                or str(call.attrs.data_layout) != "NCHW" or call.args[1].ty.dtype != "float32":
            return orig
        gamma, beta, mean, var = (matches[p].value.numpy().astype(np.float64) for p in stats)
        if not attrs.scale:
            gamma = np.ones_like(gamma)
        if not attrs.center:
            beta = np.zeros_like(beta)
        weight = call.args[1].value.numpy()
        scale = gamma / np.sqrt(var + float(attrs.epsilon))
        if scale.shape != (weight.shape[0],):
            return orig
        a = call.attrs
        folded = relax.op.nn.conv2d(
            call.args[0], relax.const((weight * scale[:, None, None, None]).astype(np.float32)),
            a.strides, a.padding, a.dilation, int(a.groups), str(a.data_layout),
            str(a.kernel_layout), str(a.out_layout), a.out_dtype)
        bias = (beta - mean * scale).astype(np.float32).reshape(1, -1, 1, 1)
        return relax.op.add(folded, relax.const(bias))

    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gv] = rewrite_call(pattern, rewriter, func)
    return relax.transform.DeadCodeElimination()(mod)


@relax.expr_functor.mutator
class _SumToAdd(relax.PyExprMutator):
    """``sum(stack((broadcast_to(a, S), broadcast_to(b, S), ...), 0), 0)`` -> ``a + b + ...``."""

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not _is_op(call, "relax.sum") or call.attrs.keepdims:
            return call
        if call.attrs.axis is None or [int(a) for a in call.attrs.axis] != [0]:
            return call
        stacked = self._bound(call.args[0])
        if not _is_op(stacked, "relax.stack") or int(stacked.attrs.axis) != 0:
            return call
        fields = self._bound(stacked.args[0])
        if not isinstance(fields, relax.Tuple):
            return call
        terms = []
        for item in fields.fields:
            value = self._bound(item)
            if not _is_op(value, "relax.broadcast_to"):
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

    def _bound(self, expr):
        return self.lookup_binding(expr) if isinstance(expr, relax.Var) else expr


def sum_to_add(mod: tvm.IRModule) -> tvm.IRModule:
    """Turn the ONNX importer's ``Sum`` of same-shaped tensors back into chained ``add``."""
    mod = mod.clone()  # the caller's module stays as it was
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gv] = _SumToAdd(mod).visit_expr(func)
    return relax.transform.DeadCodeElimination()(mod)
