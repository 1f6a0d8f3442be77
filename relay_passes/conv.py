"""Convolutions to TPP kernels: ``act(conv2d(x, W) + b [+ r])``, constant W, as one call_tir.

Matches ``relax.nn.conv2d`` with a constant weight (NCHW data, OIHW weights, float32, any
groups, stride, padding and dilation) together with the epilogue that follows it:
a constant per-channel bias (``[1, K, 1, 1]``, what BatchNorm folding leaves), a residual add
of another tensor of the output's shape, and ReLU / GELU / sigmoid.  The chain becomes one
scheduled PrimFunc (:mod:`schedules.conv`) whose weights are packed at compile time.  A
1x1 conv also takes the ``relu([x * s] [+ b])`` before it (DenseNet's pre-activation,
per-channel constants, read by this conv only, no conv's epilogue) as its prologue, computed
per pixel tile, where that pays (:func:`_prologue_pays`; DenseNet-121 +3 to 4 % on a Zen 1);
a bf16 one reads the float32 tensor and rounds the prologue's result (DenseNet-121 bf16
1.085x at batch 8, 1.025x at batch 1 on a Zen 5, bit-identical: the pre-activations were a
pass of their own over the float32 block buffer, writing a bf16 copy).
Grouped convs run the conv template with its K blocks within one group each (every block
reduces its own group's channels); depthwise convs (``groups = C = K``, weight
``[C, 1, R, S]``) take the same chains to the depthwise template (:mod:`schedules.depthwise`:
padded NHWC in, ``[N*P*Q, C]`` out, the same layout conversions).  A dilation spreads the
taps in the padded input: the kernels' tap offsets take it.

The kernel works channels-last, so each rewritten conv reads
``reshape(pad(permute_dims(x, NHWC)))`` and is read through ``permute_dims(reshape(y), NCHW)``;
:func:`relay_passes.layouts.simplify_layouts` then cancels these conversions between TPP convs,
and :func:`relay_passes.padded_outputs.write_padded_outputs` has a producing conv write the pad.
ONNX ``Sum`` of two tensors is first turned back into ``add`` so that a ResNet's residual add
is found (:func:`relay_passes.prepare.sum_to_add`).

Convolutions that do not fit (non-float32, non-constant weights, symbolic shapes, other
layouts; in low precision, groups of channels that are not whole VNNI groups, which then
multiply in float32) stay with TVM and are reported with the reason.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard
from tvm.target import Target

from microkernels.brgemm import LAYOUTS, BrgemmShape
from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.machine import Machine, machine_of
from schedules import depthwise, winograd
from schedules.conv import (
    IMAGE_CHANNELS,
    ConvConfig,
    ConvProblem,
    default_config,
    fold_rows_pays,
    fold_rows_weight,
    one_row_pays,
    pack_weight,
    schedule,
)
from schedules.depthwise import DepthwiseConfig, DepthwiseProblem
from schedules.operands import OPERANDS
from schedules.stacked_rows import padded_image_kernel, stacked_rows_kernel
from schedules.tuner import TaskCollector, Tuner, config_for
from schedules.winograd import DIRECT_KEY, WinogradConfig, WinogradProblem, winograd_pays

from .bf16_pools import max_pool_in_bf16
from .dense import PRECISIONS
from .layouts import TO_NCHW, TO_NHWC, moves_data, simplify_layouts, widened
from .prepare import sum_to_add
from .scaffold import (
    Offload,
    batched_shape,
    call_kernel,
    dispatched_brgemm,
    epilogue_patterns,
    is_call_to,
    kernel_batch,
    offload_patterns,
    readers,
    reads_through_bf16_cast,
    report_leftovers,
    static_shape,
    with_config,
)

if TYPE_CHECKING:  # annotations only
    from .scaffold import EpiloguePattern, KernelAdder

__all__ = ["rewrite_conv", "conv_problem", "conv_batch", "emit_conv", "to_matrix",
           "unsupported_geometry", "is_bf16_conv_chain", "is_depthwise", "offload",
           "winograd_tile"]

def _conv() -> DFPattern:
    """``conv2d(x, w)``, ``w`` constant (the call's own arguments are read, not sub-patterns)."""
    return is_op("relax.nn.conv2d")(wildcard(), is_const())


def rewrite_conv(mod: tvm.IRModule, target: Target, report: list[Offload],
                 tuner: Tuner | TaskCollector | None = None, precision: str = "float32"
                 ) -> tvm.IRModule:
    """Replace every supported conv2d chain with a constant weight by a TPP kernel call.

    Appends one :class:`~relay_passes.scaffold.Offload` per conv2d to ``report``: the kernel it
    became, or why it stayed with TVM.  With a ``tuner`` each kernel gets its tuned
    configuration (tuned now if its database does not know it yet); without one, the
    default heuristic's.  ``precision`` (a key of :data:`relay_passes.dense.PRECISIONS`) is
    the type the convolutions multiply in (``"bf16"``: the input converted, the weights
    rounded, float32 accumulation and output).  ONNX ``Sum`` is repaired into ``add`` first,
    and the layout conversions between the rewritten convs are cancelled after.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    dtype = PRECISIONS[precision]

    def make_rewriter(add_kernel, pattern, func):
        read_by, bound = readers(func), relax.analysis.get_var2val(func)
        return lambda orig, matches: _rewrite(orig, matches, pattern, add_kernel, target, tuner,
                                              report, dtype, read_by, bound)

    mod = offload_patterns(sum_to_add(mod), epilogue_patterns(_conv), make_rewriter, report,
                           "relax.nn.conv2d", _why_left, then=simplify_layouts)
    report_leftovers(mod, report, "relax.nn.conv2d_transpose", lambda _: TRANSPOSED)
    return mod


#: Why a ConvTranspose stays with TVM (reported with its FLOPs, so that the share of the
#: model's FLOPs on TPP kernels counts it): the grouped or dilated ones, which
#: :func:`relay_passes.conv_transpose.transposed_as_conv` does not rewrite.
TRANSPOSED = "ConvTranspose is not routed to TPP: TVM computes it"


def _unsupported(call: relax.Call) -> str | None:
    """Why this conv2d cannot become a TPP kernel (None if it can)."""
    x, w = call.args
    if not isinstance(w, tvm.ir.expr.Constant):
        return "weight is not a constant"
    why = unsupported_geometry(call)
    if why is not None:
        return why
    out_dtype = str(call.attrs.out_dtype or "")
    if x.ty.dtype != "float32" or w.ty.dtype != "float32" or out_dtype not in ("", "float32"):
        return f"dtype {x.ty.dtype} x {w.ty.dtype}: only float32 conv2d is routed to TPP"
    return None


def unsupported_geometry(call: relax.Call, dtype: str = "float32") -> str | None:
    """Why the templates cannot compute this conv2d's shape multiplying in ``dtype`` (None if
    they can): layouts, symbolic shapes, and a grouped conv's channels per group in low
    precision (whole VNNI groups each)."""
    attrs = call.attrs
    x = call.args[0]
    layouts = (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout))
    if layouts != ("NCHW", "OIHW", "NCHW"):
        return f"layouts {'/'.join(layouts)}: only NCHW/OIHW/NCHW is routed to TPP"
    batched = batched_shape(x.ty.shape) if isinstance(x.ty, relax.TensorType) else None
    if batched is None or len(batched[0]) != 4:
        return "input shape is symbolic beyond its batch, or not 4-D"
    shape = batched[0]
    groups = int(attrs.groups)
    alpha = LAYOUTS[OPERANDS[dtype][1]][0]
    if groups > 1 and not is_depthwise(call) and (shape[1] // groups) % alpha:
        return (f"groups={groups}: {shape[1] // groups} channels per group are not whole "
                f"VNNI groups of {alpha} for {dtype}")
    return None


def is_depthwise(call: relax.Call) -> bool:
    """Whether this conv2d is depthwise: ``groups == C == K``, one ``R x S`` filter per
    channel (weight ``[C, 1, R, S]``), which :mod:`schedules.depthwise` computes."""
    groups = int(call.attrs.groups)
    x, w = call.args
    if groups == 1 or not all(isinstance(a.ty, relax.TensorType) for a in (x, w)):
        return False
    x_shape, w_shape = _sizes(x.ty.shape), static_shape(w.ty.shape)
    return (x_shape is not None and w_shape is not None and len(x_shape) == 4
            and len(w_shape) == 4 and x_shape[1] == groups == w_shape[0] and w_shape[1] == 1)


def _sizes(shape) -> tuple[int, ...] | None:
    """A shape's static sizes, a symbolic batch counted as one image."""
    batched = batched_shape(shape)
    return None if batched is None else batched[0]


def conv_batch(call: relax.Call) -> tvm.ir.PrimExpr | None:
    """The run-time batch of a conv2d call whose input's first dimension is symbolic (its
    :func:`conv_problem` is then one image's), else None."""
    return batched_shape(call.args[0].ty.shape)[1]


def _channel_vector(bias: np.ndarray, k: int) -> np.ndarray | None:
    """``bias`` as ``[K]`` if it is one value per output channel of an NCHW tensor."""
    if bias.ndim < 3 or bias.ndim > 4 or bias.shape[-3] != k or bias.size != k:
        return None
    return bias.reshape(k).astype(np.float32)


def _rewrite(orig: relax.Expr, matches: Mapping[DFPattern, relax.Expr],
             pattern: EpiloguePattern[DFPattern], add_kernel: KernelAdder,
             target: Target, tuner: Tuner | None, report: list[Offload], dtype: str,
             read_by: Callable[[relax.Expr], list[relax.Expr] | None],
             bound: Mapping[relax.Var, relax.Expr]) -> relax.Expr:
    # Returning ``orig`` leaves the chain to a shorter pattern or to TVM; what stays is
    # reported once, with _why_left().
    call = matches[pattern.anchor]
    if _unsupported(call) is not None or not pattern.constants_match(matches):
        return orig
    if unsupported_geometry(call, dtype) is not None:
        dtype = "float32"  # a grouped conv whose groups are no whole VNNI groups
    k = int(call.args[1].ty.shape[0])
    operands = []
    if pattern.bias is not None:
        bias = _channel_vector(matches[pattern.bias].value.numpy(), k)
        if bias is None:
            return orig
        operands.append(relax.const(bias))
    epilogue = pattern.epilogue(matches)
    if pattern.residual is not None:
        if not pattern.residual_fits(matches, tuple(call.ty.shape), bound):
            return orig
        residual = matches[pattern.residual]
        shape = residual.ty.shape
        value = bound.get(residual) if isinstance(residual, relax.Var) else residual
        if dtype == "bfloat16" and _read_by_convs_only(value, read_by, bound):
            # A bf16 residual stream: its producer hands it over in bf16 (as it does to bf16
            # convs), so no float32 copy is written and cast for the convs that read it.
            residual = relax.op.astype(residual, dtype)
            epilogue = Epilogue(tuple(replace(op, dtype=dtype) if op.kind == "residual"
                                      else op for op in epilogue.ops))
        operands.append(to_matrix(residual, shape))
    problem = conv_problem(call, dtype, epilogue)
    x = call.args[0]
    found = _preactivation(x, problem, bound, read_by, target)
    if found is not None:  # computed inside the kernel, per pixel tile
        x, problem, prologue_operands = found
        operands = [*prologue_operands, *operands]
    # A bf16 conv, depthwise too, read only by bf16 convs writes bf16 itself (its epilogue
    # converts): they read it through a float32 view that simplify_layouts cancels against
    # their own cast.
    handoff = dtype == "bfloat16" and _read_by_convs_only(orig, read_by, bound)
    if handoff:
        problem = replace(problem, epilogue=Epilogue(
            (*problem.epilogue.ops, EpilogueOp("convert", dtype="bfloat16"))))
    # A prologue rounds its result to bf16 itself (ConvProblem.input_dtype: what it reads).
    x = x if dtype == "float32" or found is not None else relax.op.astype(x, dtype)
    out, kernel, brgemm = emit_conv(x, problem, call.args[1].value.numpy(), operands,
                                    add_kernel, target, tuner, batch=conv_batch(call))
    report.append(offload(pattern.name("conv2d", matches), problem, kernel, brgemm, target))
    return relax.op.astype(out, "float32") if handoff else out


def _preactivation(x: relax.Expr, problem: ConvProblem | DepthwiseProblem,
                   bound: Mapping[relax.Var, relax.Expr],
                   read_by: Callable[[relax.Expr], list[relax.Expr] | None], target: Target
                   ) -> tuple[relax.Expr, ConvProblem, list[relax.Expr]] | None:
    """``(x0, the problem with its prologue, operands)`` when the conv's input ``x`` is
    ``relu([x0 * s] [+ b])`` with constant per-channel ``s`` and ``b`` (DenseNet's BatchNorm
    and ReLU before each 1x1 conv) that only this conv reads, ``x0`` is no conv's output
    (whose epilogue the chain is), and the conv (a float32 or bf16 1x1 conv of stride 1
    without padding; bf16: its channels whole VNNI pairs) gains by computing it per pixel
    tile (:func:`_prologue_pays`); ``operands`` are the constants, in the prologue's order.
    A bf16 conv rounds the prologue's result; it reads ``x0`` in float32, or where ``x0``
    only widens a bf16 tensor (DenseNet's bf16 block buffer), that tensor, widened in the
    kernel."""
    if not (isinstance(problem, ConvProblem) and problem.dtype in ("float32", "bfloat16")
            and (problem.r, problem.s, problem.stride, problem.groups) == (1, 1, (1, 1), 1)
            and not any(problem.padding) and problem.padded_c == problem.c):
        return None
    relu = bound.get(x) if isinstance(x, relax.Var) else None
    if not is_call_to(relu, "relax.nn.relu") or len(read_by(relu) or ()) != 1:
        return None
    ops, operands, value = [EpilogueOp("relu")], [], relu.args[0]
    for kind, op_name in (("bias", "relax.add"), ("scale", "relax.multiply")):
        step = bound.get(value) if isinstance(value, relax.Var) else None
        if not is_call_to(step, op_name) or len(read_by(step) or ()) != 1:
            continue
        data, constant = step.args
        vector = (_channel_vector(constant.value.numpy(), problem.c)
                  if isinstance(constant, tvm.ir.expr.Constant) else None)
        if vector is not None:
            ops.insert(0, EpilogueOp(kind, broadcast="row", name=f"pre_{kind}"))
            operands.insert(0, relax.const(vector))
            value = data
    if is_call_to(bound.get(value) if isinstance(value, relax.Var) else None,
                  "relax.nn.conv2d"):
        return None  # the chain is the producing conv's epilogue (ResNet's 3x3 -> 1x1)
    # A bf16 conv's prologue widens bf16 itself: it reads what a widening cast reads (a bf16
    # block buffer, relay_passes.bf16_concat_chains).
    source = widened(bound.get(value)) if isinstance(value, relax.Var) else None
    stored = "float32"
    if source is not None and problem.dtype == "bfloat16":
        value, stored = source, "bfloat16"
    fused = replace(problem, prologue=Epilogue(tuple(ops)), prologue_input=stored)
    if not _prologue_pays(fused, machine_of(target)):
        return None
    return value, fused, operands


def _prologue_pays(problem: ConvProblem, machine: Machine) -> bool:
    """Whether a conv computing its prologue per pixel tile beats a separate elementwise
    kernel before it: its pixel tiles, run in parallel (the default config's ``n * p *
    q/bq``), keep every thread within 1/8 of an even share, and its filter, read again for
    every tile, fits in half of L2.  On a Zen 1 (512 KiB L2), DenseNet-121's 1x1 convs with
    the prologue against the pair: 1.03-1.17x up to 512 input channels, 0.87x with 768 and
    992 on 14x14 maps (a 384-496 KiB filter), and seven 7x7 rows on two threads slower."""
    tiles = problem.n * problem.p * (problem.q // default_config(problem, machine).bq)
    even = -(-tiles // machine.threads) * machine.threads * 8 <= tiles * 9
    filters = problem.c * problem.k * problem.element_bytes
    return even and filters <= machine.caches.l2 // 2


def _read_by_convs_only(value: relax.Expr | None,
                        read_by: Callable[[relax.Expr], list[relax.Expr] | None],
                        bound: Mapping[relax.Var, relax.Expr], averages: bool = False) -> bool:
    """Whether every reader of ``value`` is a conv this pass routes in bf16: reading it as
    its data, or as the residual its epilogue adds (ResNet's shortcut), or one it has routed
    in bf16 already (reading it only through ``astype(., bfloat16)``, or a cast to bfloat16
    on its own), or a max pool only such convs read (VGG's, ResNet's stem), or a reshape or
    permute of the channels only such convs read (ShuffleNet's channel shuffle), or a
    channel concat only such convs read (a DeepLab head's branches: the concat joins bf16
    parts, :func:`~relay_passes.layouts.simplify_layouts` casting the others); with
    ``averages`` also an average pool, which reads a bf16 max pool's result widened as it
    loads it (ShuffleNet's shortcut, beside the branch's conv)."""
    found = None if value is None else read_by(value)
    return bool(found) and all(averages and is_call_to(r, "relax.nn.avg_pool2d")
                               or _reads_as_bf16_conv(r, value, read_by, bound) for r in found)


def _reads_as_bf16_conv(reader: relax.Expr, value: relax.Expr,
                        read_by: Callable[[relax.Expr], list[relax.Expr] | None],
                        bound: Mapping[relax.Var, relax.Expr]) -> bool:
    if is_call_to(reader, "relax.nn.conv2d"):
        return isinstance(reader.args[0], relax.Var) and _routes_in_bf16(reader)
    if is_call_to(reader, "relax.nn.max_pool2d"):  # a max commutes with the widening cast
        # relay_passes.bf16_pools then pools the bf16 tensor itself.
        return max_pool_in_bf16(reader) and _read_by_convs_only(reader, read_by, bound,
                                                                averages=True)
    if moves_data(reader) or is_call_to(reader, "relax.concat"):
        # simplify_layouts moves it onto the bf16 data (a concat: onto each part)
        return _read_by_convs_only(reader, read_by, bound)
    if is_call_to(reader, "relax.add"):  # a residual add: the other side a conv (+ bias)
        others = [a for a in reader.args if not bound.get(a, a).same_as(value)]
        return len(others) == 1 and is_bf16_conv_chain(others[0], bound)
    return reads_through_bf16_cast(reader)


def _routes_in_bf16(conv: relax.Call) -> bool:
    return _unsupported(conv) is None and unsupported_geometry(conv, "bfloat16") is None


def is_bf16_conv_chain(expr: relax.Expr, bound: Mapping[relax.Var, relax.Expr]) -> bool:
    """Whether ``expr`` is ``conv2d(x, W)`` or ``conv2d(x, W) + b``, b constant, a conv this
    pass routes in bf16: a residual add over it is that conv's epilogue."""
    value = bound.get(expr, expr)
    if is_call_to(value, "relax.add"):
        constants = [isinstance(a, tvm.ir.expr.Constant) for a in value.args]
        if sorted(constants) != [False, True]:
            return False
        conv = value.args[constants.index(False)]
        value = bound.get(conv, conv)
    return is_call_to(value, "relax.nn.conv2d") and _routes_in_bf16(value)


def offload(op: str, problem: ConvProblem | DepthwiseProblem, kernel: str,
            brgemm: BrgemmShape | None, target: Target) -> Offload:
    """The report's record of a conv that became ``kernel``: a depthwise kernel calls no
    BRGEMM, its record names its elementwise operand types (``A*W->accumulator``) and its
    weight layout ``rsc`` itself."""
    if not isinstance(problem, DepthwiseProblem):
        return Offload.routed(op, problem.output_shape, kernel, brgemm, problem.flops)
    return Offload(op, problem.output_shape, kernel, isa=machine_of(target).isa.name,
                   dtypes=f"{problem.dtype}*{problem.weight_dtype}->{problem.acc_dtype}",
                   layout="rsc", flops=problem.flops)


def conv_problem(call: relax.Call, dtype: str, epilogue: Epilogue, narrow_weights: bool = False
                 ) -> ConvProblem | DepthwiseProblem:
    """The :class:`~schedules.conv.ConvProblem` of a (supported) ``conv2d`` call, or the
    :class:`~schedules.depthwise.DepthwiseProblem` of a depthwise one (of one image where the
    batch is symbolic: :func:`conv_batch`); ``narrow_weights``: the conv's int8 weights lie in
    7 bits (the depthwise kernel has no use for it)."""
    n, c, h, w = _sizes(call.args[0].ty.shape)
    k, _, r, s = static_shape(call.args[1].ty.shape)
    attrs = call.attrs
    geometry = {"stride": tuple(int(v) for v in attrs.strides),
                "padding": tuple(int(v) for v in attrs.padding),
                "dilation": tuple(int(v) for v in attrs.dilation)}
    if is_depthwise(call):
        return DepthwiseProblem(n=n, c=c, h=h, w=w, r=r, s=s, dtype=dtype, epilogue=epilogue,
                                **geometry)
    return ConvProblem(n=n, c=c, h=h, w=w, k=k, r=r, s=s, dtype=dtype, epilogue=epilogue,
                       groups=int(attrs.groups), narrow_weights=narrow_weights, **geometry)


def to_matrix(y: relax.Expr, shape: Sequence[tvm.ir.PrimExpr] | None = None) -> relax.Expr:
    """An NCHW tensor as the kernels' ``[N*H*W, C]`` output matrix (a residual operand);
    ``shape``: ``y``'s, where ``y`` is an expression not typed yet."""
    n, c, h, w = y.ty.shape if shape is None else shape
    return relax.op.reshape(relax.op.permute_dims(y, TO_NHWC), (n * h * w, c))


def winograd_tile(problem: ConvProblem, target: Target,
                  batch: tvm.ir.PrimExpr | None = None) -> int | None:
    """The output tile of the Winograd form :func:`emit_conv` computes ``problem`` in on
    ``target`` (:func:`~schedules.winograd.winograd_pays`), or None where it runs direct: a
    run-time batch, or ``tpp -conv=direct``.

    >>> from tvm_tpp.tpp_target import target
    >>> p = ConvProblem(1, 64, 56, 56, 64, 3, 3, padding=1)
    >>> [winograd_tile(p, target(t)) for t in ("tpp -isa=avx2", "tpp -isa=avx2 -conv=direct")]
    [4, None]
    """
    if batch is not None or DIRECT_KEY in target.keys:
        return None
    return winograd_pays(problem, machine_of(target))


def emit_conv(x: relax.Expr, problem: ConvProblem, weight: np.ndarray,
              operands: Sequence[relax.Expr], add_kernel: KernelAdder, target: Target,
              tuner: Tuner | TaskCollector | None, pad_value: float | int = 0,
              batch: tvm.ir.PrimExpr | None = None) -> tuple[relax.Expr, str, BrgemmShape | None]:
    """The TPP kernel of ``problem`` applied to NCHW ``x`` (in ``problem.dtype``): its NCHW
    result, the kernel's name with its loop_spec (for the report), and its BRGEMM.

    ``weight`` is the OIHW filter in values :func:`schedules.conv.pack_weight` takes for the
    dtype; ``operands`` are the prologue's (``[C]`` vectors), then the epilogue's, each in
    its order (``[K]`` vectors, ``[N*P*Q, K]`` matrices: :func:`to_matrix`).  Borders and
    padded channels of the input hold ``pad_value`` (a quantized input's zero point: real
    zeros).  A
    :class:`~schedules.depthwise.DepthwiseProblem` (``weight`` ``[C, 1, R, S]``) becomes the
    depthwise kernel, which calls no BRGEMM (None).  Filter taps that read only padding are
    left out where it is zeros (:meth:`~schedules.conv.ConvGeometry.without_dead_taps`).
    With a run-time ``batch`` (a symbolic size of ``x``'s first dimension) ``problem`` is one
    image's and the kernel loops over ``batch`` of them.
    """
    # A zero point's padding keeps every tap: its fold into the bias covers them all.
    if pad_value != 0 and isinstance(problem, ConvProblem):
        problem = replace(problem, zero_border=False)
    trimmed = problem.without_dead_taps() if pad_value == 0 else problem
    if trimmed is not problem:
        rows, cols = problem.live_taps()
        problem, weight = trimmed, weight[:, :, rows, cols]
    if isinstance(problem, DepthwiseProblem):
        return _emit_depthwise(x, problem, weight, operands, add_kernel, target, tuner,
                               pad_value, batch)
    named = problem  # the kernel is named after the conv, whatever form computes it
    packed = None
    if fold_rows_pays(problem):  # an image's first conv: one call per whole filter
        folded = problem.rows_folded()
        packed = _image_input(x, problem, folded, add_kernel, pad_value, batch, target)
        problem, weight = folded, fold_rows_weight(weight)
    elif problem.c <= IMAGE_CHANNELS and problem.groups == 1:  # an image's first conv too
        packed = _image_input(x, problem, problem, add_kernel, pad_value, batch, target)
    machine = machine_of(target)
    tile = winograd_tile(problem, target, batch) if packed is None else None
    if tile is not None:
        return _emit_winograd(x, WinogradProblem(problem, tile), weight, operands, add_kernel,
                              target, tuner)
    # A pointwise conv on a small map: its pixels as one row, tiles spanning image rows.
    one_row = batch is None and one_row_pays(problem, machine)
    kernel_problem = problem.one_row() if one_row else problem
    isa = machine.isa.name
    (func, brgemm), config = with_config(  # the problem the kernel computes
        kernel_problem, target, tuner,
        lambda c: _kernel(kernel_problem, c, isa, batch is not None), batch is not None)
    name = _conv_name(named, batch)
    gv = add_kernel(func, name)
    if packed is None:
        packed = _pack_input(x, problem, pad_value, batch)
    if one_row:
        packed = relax.op.reshape(packed, kernel_problem.input_shape)
    args = [packed, relax.const(pack_weight(weight, config.bk, kernel_problem)), *operands]
    out = call_kernel(gv, args, (_times(batch, problem.rows), problem.k), problem.out_dtype,
                      batch)
    nhwc = relax.op.reshape(out, (_times(batch, problem.n), problem.p, problem.q, problem.k))
    return relax.op.permute_dims(nhwc, TO_NCHW), f"{name} [{config.spec}]", brgemm


def _emit_winograd(x: relax.Expr, problem: WinogradProblem, weight: np.ndarray,
                   operands: Sequence[relax.Expr], add_kernel: KernelAdder, target: Target,
                   tuner: Tuner | TaskCollector | None
                   ) -> tuple[relax.Expr, str, BrgemmShape | None]:
    """:func:`emit_conv` of a conv computed by Winograd's transforms
    (:mod:`schedules.winograd`): the direct conv's packed input and operands, the filter
    transformed when the model is built."""
    conv = problem.conv
    isa = machine_of(target).isa.name
    (func, brgemm), config = with_config(problem, target, tuner,
                                         lambda c: _winograd_kernel(problem, c, isa), False)
    name = _conv_name(conv, None, f"_winograd{problem.tile}")
    args = [_pack_input(x, conv, 0, None),
            relax.const(winograd.pack_weight(weight, problem, config.bk)), *operands]
    out = call_kernel(add_kernel(func, name), args, (conv.rows, conv.k), conv.out_dtype)
    nhwc = relax.op.reshape(out, (conv.n, conv.p, conv.q, conv.k))
    return (relax.op.permute_dims(nhwc, TO_NCHW),
            f"{name} [winograd bt={config.bt} bk={config.bk}]", brgemm)


@functools.lru_cache(maxsize=256)
def _winograd_kernel(problem: WinogradProblem, config: WinogradConfig, isa: str
                     ) -> tuple[tvm.tirx.PrimFunc, BrgemmShape | None]:
    sch = winograd.schedule(problem, config, isa)
    return sch.mod["main"], dispatched_brgemm(sch)


def _conv_name(problem: ConvProblem, batch: tvm.ir.PrimExpr | None, form: str = "") -> str:
    """The kernel's name: the conv's shape, geometry, ``form`` (how it is computed, where
    not directly), prologue, epilogue and operand type."""
    sh, sw = problem.stride
    return (f"tpp_conv2d_{_images(problem, batch)}x{problem.c}x{problem.h}x{problem.w}_"
            f"{problem.k}x{problem.r}x{problem.s}_s{sh}x{sw}" + _geometry_tag(problem) + form
            + (f"_pre_{problem.prologue_name}" if problem.prologue.ops else "")
            + (f"_{problem.epilogue.name}" if problem.epilogue.ops else "")
            + _DTYPE_TAGS[problem.dtype])


def _times(batch: tvm.ir.PrimExpr | None, size: int) -> tvm.ir.PrimExpr | int:
    """``size`` per image times a run-time batch (``size`` itself without one)."""
    return size if batch is None else batch * size


def _images(problem: ConvProblem | DepthwiseProblem, batch: tvm.ir.PrimExpr | None) -> str:
    """The kernel name's image count: ``n`` for a run-time batch."""
    return str(problem.n) if batch is None else "n"


def _emit_depthwise(x: relax.Expr, problem: DepthwiseProblem, weight: np.ndarray,
                    operands: Sequence[relax.Expr], add_kernel: KernelAdder, target: Target,
                    tuner: Tuner | TaskCollector | None, pad_value: float | int,
                    batch: tvm.ir.PrimExpr | None) -> tuple[relax.Expr, str, None]:
    """:func:`emit_conv` of a depthwise conv: padded NHWC in, ``[N*P*Q, C]`` out."""
    config = config_for(problem, target, tuner)
    sh, sw = problem.stride
    name = (f"tpp_dwconv2d_{_images(problem, batch)}x{problem.c}x{problem.h}x{problem.w}_"
            f"{problem.r}x{problem.s}_s{sh}x{sw}" + _geometry_tag(problem)
            + (f"_{problem.epilogue.name}" if problem.epilogue.ops else "")
            + _DTYPE_TAGS[problem.dtype])
    gv = add_kernel(_depthwise_kernel(problem, config, machine_of(target).isa.name,
                                      batch is not None), name)
    args = [_padded_nhwc(x, problem, pad_value),
            relax.const(depthwise.pack_weight(weight, problem)), *operands]
    out = call_kernel(gv, args, (_times(batch, problem.rows), problem.c), problem.out_dtype,
                      batch)
    nhwc = relax.op.reshape(out, (_times(batch, problem.n), problem.p, problem.q, problem.c))
    kind = f"bq={config.bq} bc={config.bc}" + (" C" if config.parallel_channels else "")
    return relax.op.permute_dims(nhwc, TO_NCHW), f"{name} [{kind}]", None


@functools.lru_cache(maxsize=256)
def _depthwise_kernel(problem: DepthwiseProblem, config: DepthwiseConfig, isa: str,
                      run_time_batch: bool) -> tvm.tirx.PrimFunc:
    return depthwise.schedule(problem, config, isa, kernel_batch(run_time_batch)).mod["main"]


def _geometry_tag(problem: ConvProblem | DepthwiseProblem) -> str:
    """The kernel name's dilation and groups, where they are not 1."""
    dh, dw = problem.dilation
    groups = getattr(problem, "groups", 1)
    return ("" if (dh, dw) == (1, 1) else f"_d{dh}x{dw}") + ("" if groups == 1 else f"_g{groups}")


#: Kernel name suffix of a conv's operand type.
_DTYPE_TAGS = {"float32": "", "bfloat16": "_bf16", "uint8": "_u8s8"}


@functools.lru_cache(maxsize=256)
def _kernel(problem: ConvProblem, config: ConvConfig, isa: str, run_time_batch: bool
            ) -> tuple[tvm.tirx.PrimFunc, BrgemmShape | None]:
    """The scheduled PrimFunc and the BRGEMM it calls, built once per distinct layer (a
    ResNet repeats its blocks); with a ``run_time_batch`` parameter where asked."""
    sch = schedule(problem, config, isa, kernel_batch(run_time_batch))
    return sch.mod["main"], dispatched_brgemm(sch)


def _image_input(x: relax.Expr, problem: ConvProblem, packed: ConvProblem,
                 add_kernel: KernelAdder, pad_value: float | int,
                 batch: tvm.ir.PrimExpr | None, target: Target) -> relax.Expr:
    """The input of ``packed`` (``problem`` itself, or its rows folded) written from the NCHW
    image ``x`` by one kernel (:mod:`schedules.stacked_rows`), which also rounds a float32
    image cast to bf16."""
    # x is a cast (not yet typed) to the problem's dtype, or a typed tensor.
    dtype = str(x.ty.dtype) if isinstance(x.ty, relax.TensorType) else problem.dtype
    source = None
    if dtype == "bfloat16" and is_call_to(x, "relax.astype") and \
            isinstance(x.args[0].ty, relax.TensorType) and str(x.args[0].ty.dtype) == "float32":
        x, source = x.args[0], "float32"  # the kernel rounds the image as it packs it
    folded = packed is not problem
    kernel = (stacked_rows_kernel if folded else padded_image_kernel)(
        problem, dtype, pad_value, batch is not None, source, machine_of(target).isa.name)
    images, rows, columns, channels = _times(batch, problem.n), *packed.input_shape[1:]
    return relax.op.reshape(call_kernel(
        add_kernel(kernel, "pad_stack_rows" if folded else "transpose_pad"), [x],
        (images, rows, columns, packed.stride[1], packed.padded_c), dtype),
        (images, rows, columns, channels))


def _padded_nhwc(x, problem: ConvProblem, pad_value: float | int, extra_right: int = 0):
    top, left, bottom, right = problem.padding
    y = relax.op.permute_dims(x, TO_NHWC)
    if top or left or bottom or right + extra_right:
        y = relax.op.nn.pad(y, [0, 0, top, bottom, left, right + extra_right, 0, 0],
                            pad_value=pad_value)
    return y


def _padded_channels(y, have: int, channels: int, pad_value: float | int):
    """NHWC ``y`` of ``have`` channels padded to ``channels`` (whole VNNI groups)."""
    if have == channels:
        return y
    return relax.op.nn.pad(y, [0, 0, 0, 0, 0, 0, 0, channels - have], pad_value=pad_value)


def _pack_input(x, problem: ConvProblem, pad_value: float | int,
                batch: tvm.ir.PrimExpr | None = None):
    """NCHW ``x`` -> the kernel's padded ``[N, Hp, Wq, sw*C']`` (see :mod:`schedules.conv`)."""
    _, left, _, right = problem.padding
    y = _padded_nhwc(x, problem, pad_value,
                     problem.wq * problem.stride[1] - (problem.w + left + right))
    y = _padded_channels(y, problem.c, problem.padded_c, pad_value)
    if problem.stride[1] > 1:
        y = relax.op.reshape(y, (_times(batch, problem.n), *problem.input_shape[1:]))
    return y


def _why_left(call: relax.Call) -> str:
    """Why a conv2d is still in the graph."""
    return _unsupported(call) or "pattern not matched"
