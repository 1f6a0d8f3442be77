"""Dense layers to TPP kernels: ``act(x @ W + b [+ r])`` with constant W becomes one call_tir.

Matches ``relax.matmul`` whose right operand is a constant (ONNX MatMul and Gemm, after
:func:`relay_passes.pipeline.prepare` folded transposes of constants) together with the
epilogue that follows it: a constant bias over the output columns, a residual add of another
tensor of the output's shape, and ReLU / GELU / sigmoid.  The weights are packed at compile
time into the BRGEMM's blocked layout, the activations of rank > 2 are viewed as ``[M, K]``,
and the whole chain becomes one scheduled PrimFunc (:mod:`schedules.gemm`).

What does not fit (non-float32, symbolic shapes) is left to TVM's own lowering and listed in
the report with the reason; matmuls of two activations (attention's ``Q @ K^T``) are
:mod:`relay_passes.batch_matmul`'s.

Examples
--------
>>> report = []
>>> mod = rewrite_dense(mod, target, report)                  # doctest: +SKIP
>>> [(r.op, r.shape, r.kernel or r.reason) for r in report]   # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard
from tvm.target import Target

from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.machine import machine_of
from schedules.gemm import GemmProblem, pack_weight, schedule
from schedules.tuner import Tuner, config_for

__all__ = ["Offload", "rewrite_dense", "rewrite_patterns", "report_leftovers", "static_shape",
           "add_patterns"]

_GELU_SPELLED_OUT = "gelu_erf"
# Activations absorbed into the epilogue: relax op -> epilogue op.
_ACTIVATIONS = {
    "relax.nn.relu": EpilogueOp("relu"),
    "relax.nn.gelu": EpilogueOp("gelu", variant="erf"),
    "relax.nn.gelu_tanh": EpilogueOp("gelu", variant="tanh"),
    "relax.sigmoid": EpilogueOp("sigmoid"),
    # ONNX exporters spell GELU out as x * (1 + erf(x / sqrt 2)) * 0.5.
    _GELU_SPELLED_OUT: EpilogueOp("gelu", variant="erf"),
}
_GELU_CONSTANTS = (math.sqrt(2.0), 1.0, 0.5)


@dataclass(frozen=True)
class Offload:
    """One GEMM-like operator: the kernel it became, or why it stayed with TVM.

    ``shape`` is ``(m, n, k)`` for offloaded dense layers, the output shape otherwise.
    """

    op: str
    shape: tuple[int, ...]
    kernel: str | None = None
    reason: str | None = None


def static_shape(shape) -> tuple[int, ...] | None:
    """A Relax shape as ints, or None when any dimension is symbolic."""
    try:
        return tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class _Pattern:
    root: object
    matmul: object
    x: object
    w: object
    w_transposed: object
    bias: object | None
    residual: object | None
    activation: str | None
    constants: tuple = ()  # constant patterns whose values must be _GELU_CONSTANTS


def _gelu_spelled_out(node):
    div, one, half = is_const(), is_const(), is_const()
    erf = is_op("relax.erf")(is_op("relax.divide")(node, div))
    gelu = is_op("relax.multiply")(is_op("relax.multiply")(node, is_op("relax.add")(erf, one)),
                                   half)
    return gelu, (div, one, half)


def add_patterns(node, with_bias: bool, with_residual: bool) -> tuple:
    """``node``, then optionally ``+ constant bias``, then optionally ``+ residual`` tensor
    (either operand order): returns the pattern and the bias and residual sub-patterns."""
    bias = residual = None
    if with_bias:
        bias = is_const()
        node = is_op("relax.add")(node, bias) | is_op("relax.add")(bias, node)
    if with_residual:
        residual = wildcard()
        node = is_op("relax.add")(node, residual) | is_op("relax.add")(residual, node)
    return node, bias, residual


def _patterns() -> list[_Pattern]:
    """Every chain, longest first so the whole epilogue is taken before its prefixes."""
    out = []
    for activation in (*_ACTIVATIONS, None):
        for with_residual in (True, False):
            for with_bias in (True, False):
                x, w = wildcard(), is_const()
                wt = is_op("relax.permute_dims")(w)
                mm = is_op("relax.matmul")(x, w) | is_op("relax.matmul")(x, wt)
                node, bias, residual = add_patterns(mm, with_bias, with_residual)
                constants = ()
                if activation == _GELU_SPELLED_OUT:
                    node, constants = _gelu_spelled_out(node)
                elif activation:
                    node = is_op(activation)(node)
                out.append(_Pattern(node, mm, x, w, wt, bias, residual, activation, constants))
    return out


def rewrite_dense(
    mod: tvm.IRModule, target: Target, report: list[Offload], tuner: Tuner | None = None
) -> tvm.IRModule:
    """Replace every float32 dense chain with a constant weight by a TPP kernel call.

    With a ``tuner`` each GEMM gets its tuned configuration (tuned now if its database does
    not know it yet); without one, the default heuristic's.
    """
    def make_rewriter(builder, pattern, _func):
        return lambda orig, matches: _rewrite(orig, matches, pattern, builder, target, tuner,
                                              report)

    new_mod = rewrite_patterns(mod, _patterns(), make_rewriter)
    new_mod = relax.transform.DeadCodeElimination()(new_mod)
    report_leftovers(new_mod, report)
    return new_mod


def rewrite_patterns(
    mod: tvm.IRModule,
    patterns: Iterable[Any],
    make_rewriter: Callable[[relax.BlockBuilder, Any, relax.Function], Callable],
) -> tvm.IRModule:
    """``mod`` with every Relax function rewritten by each pattern in turn (``rewrite_call``).

    ``make_rewriter(builder, pattern, func)`` gives the callback for one pattern in one
    function (as rewritten by the patterns before it); the kernels it emits through
    ``builder`` land in the returned module.  Dead bindings are left for the caller's
    DeadCodeElimination.
    """
    builder = relax.BlockBuilder(mod)
    functions = {gv: f for gv, f in mod.functions.items() if isinstance(f, relax.Function)}
    for pattern in patterns:
        functions = {gv: rewrite_call(pattern.root, make_rewriter(builder, pattern, f), f)
                     for gv, f in functions.items()}
    new_mod = builder.get()
    for gv, f in functions.items():
        new_mod[gv] = f
    return new_mod


def _unsupported(x, weight: np.ndarray) -> str | None:
    """Why ``x @ weight`` cannot become a TPP kernel (None if it can)."""
    shape = static_shape(x.ty.shape) if isinstance(x.ty, relax.TensorType) else None
    if shape is None or len(shape) < 2:
        return "activation shape is symbolic or not a matrix"
    if x.ty.dtype != "float32" or weight.dtype != np.float32:
        return f"dtype {x.ty.dtype} x {weight.dtype}: only float32 dense is routed to TPP"
    if weight.ndim != 2 or weight.shape[0] != shape[-1]:
        return f"weight of shape {weight.shape} is not a [K, N] matrix for this input"
    return None


def _rewrite(orig, matches, pattern: _Pattern, builder, target, tuner, report):
    # Returning ``orig`` leaves the chain to a shorter pattern or to TVM; what stays is
    # reported once, by report_leftovers().
    x = matches[pattern.x]
    weight = matches[pattern.w].value.numpy()
    if pattern.w_transposed in matches:
        weight = weight.T
    if _unsupported(x, weight) is not None:
        return orig
    for const, want in zip(pattern.constants, _GELU_CONSTANTS, strict=False):
        value = matches[const].value.numpy()
        if value.size != 1 or abs(float(value.reshape(-1)[0]) - want) > 1e-6 * want:
            return orig
    x_shape = static_shape(x.ty.shape)
    k, n = weight.shape
    out_shape = (*x_shape[:-1], n)
    bias = matches[pattern.bias].value.numpy() if pattern.bias is not None else None
    if bias is not None and (bias.size != n or bias.shape[-1] != n):
        return orig
    residual = matches[pattern.residual] if pattern.residual is not None else None
    if residual is not None and (
        isinstance(residual, tvm.ir.expr.Constant)
        or static_shape(residual.ty.shape) != out_shape
        or residual.ty.dtype != "float32"
    ):
        return orig

    m = int(np.prod(x_shape[:-1]))
    ops = [EpilogueOp(kind) for kind, part in (("bias", bias), ("residual", residual))
           if part is not None]
    if pattern.activation:
        ops.append(_ACTIVATIONS[pattern.activation])
    problem = GemmProblem(m, n, k, epilogue=Epilogue(tuple(ops)))
    isa = machine_of(target).isa
    config = config_for(problem, target, tuner)
    func = schedule(problem, config, isa).mod["main"]
    # kOpaque keeps FuseOps from fusing neighbours into the kernel; is_scheduled keeps the
    # fallback schedules off it.
    func = func.without_attr("global_symbol").with_attrs(
        {"op_pattern": 8, "tirx.is_scheduled": True})
    name = f"tpp_dense_{m}x{n}x{k}" + (f"_{problem.epilogue.name}" if ops else "")
    gv = builder.add_func(func, name)

    args = [_as_matrix(x, m, k), relax.const(pack_weight(weight.astype(np.float32), config.bn))]
    if bias is not None:
        args.append(relax.const(bias.reshape(n).astype(np.float32)))
    if residual is not None:
        args.append(_as_matrix(residual, m, n))
    out = relax.call_tir(gv, args, relax.TensorType((m, n), "float32"))
    op = "+".join(["matmul", *(o.tag for o in ops)])  # e.g. matmul+bias+gelu_erf
    packed = "" if config.pack_a is None else f" pack_a={config.pack_a}"
    report.append(Offload(op, (m, n, k), kernel=f"{name} [{config.spec}{packed}]"))
    return out if len(out_shape) == 2 else relax.op.reshape(out, out_shape)


def report_leftovers(mod: tvm.IRModule, report: list[Offload]) -> None:
    """Add the matmuls still in ``mod`` (left to TVM) to ``report``, with why."""

    def visit(expr) -> None:
        if not (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op)
                and expr.op.name == "relax.matmul"):
            return
        name = expr.op.name
        x, w = expr.args
        if not isinstance(w, tvm.ir.expr.Constant):
            return  # activations on both sides: relay_passes.batch_matmul reports these
        reason = _unsupported(x, w.value.numpy()) or "pattern not matched"
        shape = static_shape(expr.ty.shape) or ()
        report.append(Offload(name.split(".")[-1], shape, reason=reason))

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)


def _as_matrix(expr, rows: int, cols: int):
    shape = static_shape(expr.ty.shape)
    return expr if shape == (rows, cols) else relax.op.reshape(expr, (rows, cols))

