"""Convolutions to TPP kernels: ``act(conv2d(x, W) + b [+ r])``, constant W, as one call_tir.

Matches ``relax.nn.conv2d`` with a constant weight (NCHW data, OIHW weights, float32,
``groups = 1``, dilation 1, any stride and padding) together with the epilogue that follows it:
a constant per-channel bias (``[1, K, 1, 1]``, what BatchNorm folding leaves), a residual add
of another tensor of the output's shape, and ReLU / GELU / sigmoid.  The chain becomes one
scheduled PrimFunc (:mod:`schedules.conv`) whose weights are packed at compile time.

The kernel works channels-last, so each rewritten conv reads
``reshape(pad(permute_dims(x, NHWC)))`` and is read through ``permute_dims(reshape(y), NCHW)``;
:func:`relay_passes.layouts.simplify_layouts` then cancels these conversions between TPP convs.
ONNX ``Sum`` of two tensors is first turned back into ``add`` so that a ResNet's residual add
is found (:func:`relay_passes.prepare.sum_to_add`).

Convolutions that do not fit (grouped/depthwise, dilated, non-float32, non-constant weights,
symbolic shapes, other layouts) stay with TVM and are reported with the reason.

Examples
--------
A 3x3 convolution whose input is a graph input and whose output is the graph's: the layout
conversions stay at these borders.

>>> target = Target({"kind": "llvm", "keys": ["tpp", "cpu"], "model": "avx2"})
>>> x = relax.Var("x", relax.TensorType((1, 16, 7, 7), "float32"))
>>> w = relax.const(np.ones((8, 16, 3, 3), "float32"))
>>> bb = relax.BlockBuilder()
>>> with bb.function("main", [x]):
...     _ = bb.emit_func_output(bb.emit(relax.op.nn.conv2d(x, w, padding=1)))
>>> report = []
>>> mod = rewrite_conv(bb.get(), target, report)
>>> [(r.op, r.shape, r.kernel) for r in report]
[('conv2d', (1, 8, 7, 7), 'tpp_conv2d_1x16x7x7_8x3x3_s1x1 [...]')]
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard
from tvm.target import Target

from microkernels.brgemm import BrgemmShape
from microkernels.machine import machine_of
from schedules.conv import ConvConfig, ConvProblem, pack_weight, schedule, unfold_weight
from schedules.tuner import Tuner, config_for

from .layouts import TO_NCHW, TO_NHWC, simplify_layouts
from .prepare import sum_to_add
from .scaffold import (
    Offload,
    dispatched_brgemm,
    epilogue_patterns,
    offload_patterns,
    static_shape,
)

if TYPE_CHECKING:  # annotations only
    from .scaffold import EpiloguePattern, KernelAdder

__all__ = ["rewrite_conv"]

#: Convs with fewer input channels than this get their width taps unfolded into channels.
_UNFOLD_BELOW = 16


def _conv() -> DFPattern:
    """``conv2d(x, w)``, ``w`` constant (the call's own arguments are read, not sub-patterns)."""
    return is_op("relax.nn.conv2d")(wildcard(), is_const())


def rewrite_conv(mod: tvm.IRModule, target: Target, report: list[Offload],
                 tuner: Tuner | None = None) -> tvm.IRModule:
    """Replace every supported conv2d chain with a constant weight by a TPP kernel call.

    Appends one :class:`~relay_passes.scaffold.Offload` per conv2d to ``report``: the kernel it
    became, or why it stayed with TVM.  With a ``tuner`` each kernel gets its tuned
    configuration (tuned now if its database does not know it yet); without one, the
    default heuristic's.  ONNX ``Sum`` is repaired into ``add`` first, and the layout
    conversions between the rewritten convs are cancelled after.
    """

    def make_rewriter(add_kernel, pattern, _func):
        return lambda orig, matches: _rewrite(orig, matches, pattern, add_kernel, target, tuner,
                                              report)

    return offload_patterns(sum_to_add(mod), epilogue_patterns(_conv), make_rewriter, report,
                            "relax.nn.conv2d", _why_left, then=simplify_layouts)


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


def _rewrite(orig: relax.Expr, matches: Mapping[DFPattern, relax.Expr],
             pattern: EpiloguePattern[DFPattern], add_kernel: KernelAdder,
             target: Target, tuner: Tuner | None, report: list[Offload]) -> relax.Expr:
    # Returning ``orig`` leaves the chain to a shorter pattern or to TVM; what stays is
    # reported once, with _why_left().
    call = matches[pattern.anchor]
    if _unsupported(call) is not None:
        return orig
    x, weight = call.args[0], call.args[1].value.numpy()
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
    if not pattern.residual_fits(matches, out_shape):
        return orig

    problem = ConvProblem(**problem_args, epilogue=pattern.epilogue())
    # Few input channels (an RGB stem): unfold the S taps into the channels, so that each
    # BRGEMM call reduces S*C values instead of C.
    unfold = problem.c < _UNFOLD_BELOW and problem.s > 1
    kernel_problem = problem.unfold_width() if unfold else problem
    isa = machine_of(target).isa
    config = config_for(kernel_problem, target, tuner)  # the problem the kernel computes
    sh, sw = problem.stride
    name = (f"tpp_conv2d_{n}x{c}x{h}x{w}_{k}x{r}x{s}_s{sh}x{sw}"
            + (f"_{problem.epilogue.name}" if pattern.ops() else ""))
    func, brgemm = _kernel(kernel_problem, config, isa.name)
    gv = add_kernel(func, name)

    packed = _unfold_input(x, problem) if unfold else _pack_input(x, problem)
    args = [packed, relax.const(pack_weight(unfold_weight(weight) if unfold else weight,
                                            config.bk))]
    if bias is not None:
        args.append(relax.const(bias))
    if residual is not None:
        args.append(relax.op.reshape(relax.op.permute_dims(residual, TO_NHWC),
                                     (problem.rows, k)))
    out = relax.call_tir(gv, args, relax.TensorType((problem.rows, k), "float32"))
    report.append(Offload.routed(pattern.name("conv2d"), out_shape, f"{name} [{config.spec}]",
                                 brgemm))
    nhwc = relax.op.reshape(out, (n, problem.p, problem.q, k))
    return relax.op.permute_dims(nhwc, TO_NCHW)


@functools.lru_cache(maxsize=256)
def _kernel(problem: ConvProblem, config: ConvConfig, isa: str
            ) -> tuple[tvm.tirx.PrimFunc, BrgemmShape | None]:
    """The scheduled PrimFunc and the BRGEMM it calls, built once per distinct layer (a
    ResNet repeats its blocks)."""
    sch = schedule(problem, config, isa)
    return sch.mod["main"], dispatched_brgemm(sch)


def _padded_nhwc(x, problem: ConvProblem, extra_right: int = 0):
    top, left, bottom, right = problem.padding
    y = relax.op.permute_dims(x, TO_NHWC)
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


def _why_left(call: relax.Call) -> str:
    """Why a conv2d is still in the graph."""
    return _unsupported(call) or "pattern not matched"
