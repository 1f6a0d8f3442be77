"""Chains of per-channel affine steps with constants folded into one ``x * s + t``, and into
the weights of the conv before them.

An exported network spells one affine map per channel in many ways: an inference
BatchNorm, Caffe's ``Scale`` layer after it (``Mul`` and ``Add``), a conv's own bias before
it, a ``Sub``/``Div`` normalisation.  DenseNet-121 (Caffe2) writes each pre-activation as
BatchNorm, Mul, Add, Relu: six elementwise passes over the activation, one a division, where
ONNX Runtime and OpenVINO run one scale-shift.  :func:`fold_scale_shift` composes such a chain
in float64 numpy and emits it as at most a multiply and an add; when the chain starts at a
conv2d with constant weights, the multiply goes into the weights (``conv(x, W * s) + t``) and
the add becomes the conv's bias, which the conv rewrite takes into its kernel.

A step is ``x + c``, ``c + x``, ``x - c``, ``c - x``, ``x * c``, ``c * x``, ``x / c`` (``c``
without zeros) or ``batch_norm(x, gamma, beta, mean, var)[0]`` in inference mode, with ``c``
and the statistics float32 constants that broadcast to ``x``'s static shape without enlarging
it.  A step continues the chain of its input when that input is a dataflow variable nothing
else reads.  Chains of one add or multiply stay as they are (there is nothing to fold) unless
the multiply scales a conv.

Examples
--------
>>> x = relax.Var("x", relax.TensorType((1, 2, 3, 3), "float32"))
>>> bb = relax.BlockBuilder()
>>> with bb.function("main", [x]):
...     with bb.dataflow():
...         y = bb.emit(relax.op.subtract(x, relax.const(np.full((1, 2, 1, 1), 1.0, "float32"))))
...         y = bb.emit(relax.op.divide(y, relax.const(np.full((1, 2, 1, 1), 4.0, "float32"))))
...         y = bb.emit(relax.op.multiply(y, relax.const(np.full((1, 2, 1, 1), 2.0, "float32"))))
...         out = bb.emit_output(relax.op.nn.relu(y))
...     _ = bb.emit_func_output(out)
>>> block = fold_scale_shift(bb.get())["main"].body.blocks[0]
>>> [(b.value.op.name, b.value.args[1].value.numpy().ravel().tolist())
...  for b in block.bindings[:2]]  # (x - 1) / 4 * 2 = x * 0.5 - 0.5
[('relax.multiply', [0.5, 0.5]), ('relax.add', [-0.5, -0.5])]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant

from .scaffold import is_call_to, static_shape, visit_binding_replaced

__all__ = ["fold_scale_shift"]

_ARITHMETIC = ("relax.add", "relax.subtract", "relax.multiply", "relax.divide")


@dataclass(frozen=True)
class _Chain:
    """``base * scale + shift`` (float64, each broadcasting to ``base``'s shape), the value of
    the chain's last variable; ``steps``: how many bindings it replaces."""

    base: relax.Expr
    scale: np.ndarray
    shift: np.ndarray
    steps: int
    has_batchnorm: bool

    def then(self, scale: np.ndarray, shift: np.ndarray, batchnorm: bool) -> _Chain:
        return _Chain(self.base, self.scale * scale, self.shift * scale + shift, self.steps + 1,
                      self.has_batchnorm or batchnorm)


def fold_scale_shift(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with each chain of per-channel affine steps (see the module doc) bound as at
    most ``x * s + t``, and ``s`` folded into the weights of a conv2d (NCHW, OIHW, constant
    float32 weights) the chain starts at.  The caller's module stays as it was."""
    mutator = _ScaleShift(mod)
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    return relax.transform.DeadCodeElimination()(mutator.builder_.get())


@relax.expr_functor.mutator
class _ScaleShift(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.replace: dict[relax.Var, relax.Expr] = {}

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.DataflowBlock:
        self.replace = _plan(list(block.bindings))
        return super().visit_dataflow_block_(block)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        visit_binding_replaced(self, binding, self.replace)


def _plan(bindings: list[relax.VarBinding]) -> dict[relax.Var, relax.Expr]:
    """The new values of the block's chain ends (and of the convs whose weights take a
    chain's scale); the rest of each chain is left for dead-code elimination."""
    values = {b.var: b.value for b in bindings}
    uses: dict[relax.Var, int] = {}
    for binding in bindings:
        relax.analysis.post_order_visit(binding.value, lambda e: uses.__setitem__(
            e, uses.get(e, 0) + 1) if isinstance(e, relax.Var) else None)
    chains: dict[relax.Var, _Chain] = {}
    continued: set[relax.Var] = set()
    for binding in bindings:
        step = _step(binding.value, values, uses)
        if step is None:
            continue
        x, scale, shift, batchnorm = step
        if x in chains and isinstance(x, relax.DataflowVar) and uses.get(x) == 1:
            chains[binding.var] = chains[x].then(scale, shift, batchnorm)
            continued.add(x)
        else:
            chains[binding.var] = _Chain(x, scale, shift, 1, batchnorm)
    replace: dict[relax.Var, relax.Expr] = {}
    for var, chain in chains.items():
        if var in continued:
            continue
        base, scale = chain.base, chain.scale
        conv = None if np.all(scale == 1) else _scaled_conv(base, scale, values, uses)
        if conv is not None:
            replace[base] = conv
            scale = np.ones(())
        elif chain.steps == 1 and not chain.has_batchnorm:
            continue
        replace[var] = _affine(base, scale, chain.shift)
    return replace


def _step(value: relax.Expr, values: dict[relax.Var, relax.Expr], uses: dict[relax.Var, int]
          ) -> tuple[relax.Expr, np.ndarray, np.ndarray, bool] | None:
    """``(x, s, t, is_batchnorm)`` when ``value`` is ``x * s + t`` for constants ``s``, ``t``."""
    if isinstance(value, relax.TupleGetItem) and value.index == 0:
        return _batchnorm(value.tuple_value, values, uses)
    if not any(is_call_to(value, op) for op in _ARITHMETIC):
        return None
    op = value.op.name
    a, b = value.args
    constant_first = isinstance(a, Constant)
    x, c = (b, a) if constant_first else (a, b)
    shape = _float32_shape(x)
    if (not isinstance(c, Constant) or shape is None
            or static_shape(value.ty.shape) != shape):
        return None
    c = c.value.numpy().astype(np.float64)
    one, zero = np.ones(()), np.zeros(())
    if op == "relax.add":
        return x, one, c, False
    if op == "relax.multiply":
        return x, c, zero, False
    if op == "relax.subtract":
        return (x, -one, c, False) if constant_first else (x, one, -c, False)
    if constant_first or not np.all(c != 0):
        return None  # c / x is not affine; x / 0 is not x * (1 / 0)
    return x, 1.0 / c, zero, False


def _batchnorm(norm: relax.Expr, values: dict[relax.Var, relax.Expr],
               uses: dict[relax.Var, int]
               ) -> tuple[relax.Expr, np.ndarray, np.ndarray, bool] | None:
    """``batch_norm(x, gamma, beta, mean, var)[0]`` in inference mode as ``x * s + t``."""
    call = values.get(norm)
    if (not is_call_to(call, "relax.nn.batch_norm") or uses.get(norm) != 1
            or call.attrs.training or not all(isinstance(a, Constant) and str(
                a.value.dtype) == "float32" for a in call.args[1:5])):
        return None
    x = call.args[0]
    shape = _float32_shape(x)
    if shape is None:
        return None
    gamma, beta, mean, var = (a.value.numpy().astype(np.float64) for a in call.args[1:5])
    attrs = call.attrs
    axis = int(attrs.axis) % len(shape)
    scale = (gamma if attrs.scale else 1.0) / np.sqrt(var + float(attrs.epsilon))
    shift = (beta if attrs.center else 0.0) - mean * scale
    along = [1] * len(shape)
    along[axis] = shape[axis]
    return x, scale.reshape(along), shift.reshape(along), True


def _float32_shape(x: relax.Expr) -> tuple[int, ...] | None:
    ty = x.ty
    if not isinstance(ty, relax.TensorType) or ty.dtype != "float32" or ty.shape is None:
        return None
    return static_shape(ty.shape)


def _scaled_conv(base: relax.Expr, scale: np.ndarray, values: dict[relax.Var, relax.Expr],
                 uses: dict[relax.Var, int]) -> relax.Expr | None:
    """``conv2d(x, W * s)`` when ``base`` is a conv2d with constant float32 weights that
    only the chain reads and ``scale`` varies along its output channels alone."""
    call = values.get(base)
    if (not is_call_to(call, "relax.nn.conv2d") or uses.get(base) != 1
            or not isinstance(base, relax.DataflowVar)
            or not isinstance(call.args[1], Constant)
            or str(call.args[1].value.dtype) != "float32"):
        return None
    a = call.attrs
    if (str(a.data_layout), str(a.kernel_layout), str(a.out_layout)) != ("NCHW", "OIHW", "NCHW"):
        return None
    weight = call.args[1].value.numpy()
    channels = weight.shape[0]
    # The steps broadcast to the conv's [N, K, P, Q]: at most four dims, K or 1 of them.
    scale4 = scale.reshape((1,) * (4 - scale.ndim) + scale.shape)
    if scale4.shape[0] != 1 or scale4.shape[2:] != (1, 1):
        return None
    per_channel = np.broadcast_to(scale4.reshape(-1), (channels,))
    return relax.op.nn.conv2d(
        call.args[0], relax.const((weight * per_channel[:, None, None, None]).astype(np.float32)),
        a.strides, a.padding, a.dilation, int(a.groups), str(a.data_layout),
        str(a.kernel_layout), str(a.out_layout), a.out_dtype)


def _affine(x: relax.Expr, scale: np.ndarray, shift: np.ndarray) -> relax.Expr:
    """``x * scale + shift`` with the multiply by ones and the add of zeros left out."""
    if not np.all(scale == 1):
        x = relax.op.multiply(x, relax.const(scale.astype(np.float32)))
    if not np.all(shift == 0):
        x = relax.op.add(x, relax.const(shift.astype(np.float32)))
    return x
