"""int8 dense and conv layers in QDQ form to the int8 TPP kernels (u8 x s8 -> s32, VNNI-4).

Quantized ONNX models import in QDQ form (:mod:`tvm_tpp.quantized` normalizes the others to
it), which TVM's ONNX frontend turns into ``relax.quantize`` / ``relax.dequantize`` around float
operators.  This pass matches the layers of that form,

``quantize(relu(op(dequantize(x_q, sx, zx), dequantize(W_q, sw, 0)) + b), sy, zy)``

(``quantize``, ``relu`` and ``+ b`` each optional), where ``op`` is

* ``matmul`` with ``W_q`` a constant int8 ``[K, N]`` (or ``[N, K]`` under ``permute_dims``:
  ONNX Gemm with ``transB``): one GEMM of :mod:`schedules.gemm`;
* ``conv2d`` with ``W_q`` a constant int8 OIHW filter (any conv the float32 path takes, the
  bias reshaped to ``[1, K, 1, 1]``): one conv kernel of :mod:`schedules.conv`, whose input
  borders are padded with ``zx`` (real zeros),

``sw`` per tensor or per output channel, ``b`` a constant float bias (ONNX Runtime's int32 one
under ``dequantize`` included), and makes the whole chain one kernel on the quantized integers.
The zero point of x is folded in at compile time (``sum_k (x_q - zx) W_q = acc - zx colsum``,
``colsum[n]`` the sum of output channel n's weights):

* float output: epilogue ``scale`` (``sx sw[n]``), then ``bias`` ``b[n] - sx sw[n] zx colsum[n]``,
  then ``relu``; the template converts the int32 accumulator to float32 for it;
* uint8/int8 output: int32 ``bias`` ``round(b[n] / (sx sw[n])) - zx colsum[n]``, ``relu``, then
  ``requantize`` by ``sx sw[n] / sy`` to zero point ``zy``, all on the exact int32.

int8 activations become the kernel's uint8 by ``x_q + 128`` (and ``zx + 128``).

The pass must run on the module as imported, BEFORE :func:`relay_passes.prepare.prepare`:
its FoldConstant folds ``dequantize(W_q)`` into a float32 constant and the int8 weights and
their scales are gone.  What it leaves (a non-zero weight zero point, a per-K weight scale,
symbolic shapes, a grouped conv) keeps its dequantize, folds there, and goes the float32 way;
the report says why.

Examples
--------
>>> import numpy as np
>>> target = Target({"kind": "llvm", "keys": ["tpp", "cpu"], "model": "avx512_vnni"})
>>> x = relax.Var("x", relax.TensorType((5, 37), "uint8"))
>>> w = np.ones((37, 29), "int8")
>>> bb = relax.BlockBuilder()
>>> with bb.function("main", [x]):
...     xf = bb.emit(relax.op.dequantize(x, relax.const(0.1), relax.const(3, "uint8")))
...     wf = bb.emit(relax.op.dequantize(relax.const(w), relax.const(0.5),
...                                      relax.const(0, "int8")))
...     _ = bb.emit_func_output(bb.emit(relax.op.nn.relu(bb.emit(relax.op.matmul(xf, wf)))))
>>> report = []
>>> mod = rewrite_qdq(bb.get(), target, report)
>>> [(r.op, r.shape, r.dtypes, r.layout) for r in report]
[('matmul_qdq+relu', (5, 29, 37), 'uint8*int8->int32', 'vnni4')]
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard
from tvm.target import Target

from microkernels.brgemm import BrgemmShape
from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.machine import machine_of
from schedules.gemm import GemmProblem, pack_weight
from schedules.operands import narrow
from schedules.tuner import TaskCollector, Tuner

from .conv import (
    conv_batch,
    conv_problem,
    emit_conv,
    offload,
    to_matrix,
    unsupported_geometry,
    winograd_tile,
)
from .dense import ONE_COLUMN, DenseRows, scheduled
from .scaffold import (
    Offload,
    batched_shape,
    call_flops,
    call_kernel,
    dispatched_brgemm,
    is_call_to,
    rewrite_patterns,
    same_dims,
    static_shape,
)

if TYPE_CHECKING:  # annotations only
    from .scaffold import KernelAdder

__all__ = ["rewrite_qdq"]

#: What the int8 kernel takes for X: uint8; int8 activations are shifted into it by this.
_S8_SHIFT = 128


@dataclass(frozen=True)
class _Chain:
    """One QDQ layer pattern: the root to match and the sub-patterns to read a match by."""

    anchor: str  # "matmul" or "conv2d"
    root: DFPattern
    layer: DFPattern  # the matmul / conv2d call
    x_dequantized: DFPattern
    xq: DFPattern
    sx: DFPattern
    zx: DFPattern
    wq: DFPattern
    sw: DFPattern
    zw: DFPattern
    w_dequantized: DFPattern  # the dequantize of W_q, to read its axis
    w_transposed: DFPattern | None  # matmul: W given as permute_dims(W^T)
    bias: DFPattern | None  # the bias's value: a constant, or dequantize of constants
    relu: bool
    sy: DFPattern | None  # with zy: the output's quantize, if the chain ends with one
    zy: DFPattern | None
    residual: _Residual | None = None
    rescale: DFPattern | None = None  # a multiply of the layer's result (dynamic quantization)

    def name(self, out_dtype: str) -> str:
        """The report's name, e.g. ``matmul_qdq+bias+relu+quantize_u8``."""
        parts = [f"{self.anchor}_qdq", *(["bias"] if self.bias is not None else []),
                 *(["relu"] if self.relu else [])]
        if self.residual is not None:
            parts += ["quantize", "residual", *(["relu"] if self.residual.relu else [])]
        if self.sy is not None:
            parts.append("quantize_" + {"uint8": "u8", "int8": "s8"}[out_dtype])
        return "+".join(parts)


@dataclass(frozen=True)
class _Residual:
    """``quantize([relu](dequantize(layer_q, s1, z1) + dequantize(r_q, sr, zr)), sy, zy)``
    after a layer whose output is quantized (``layer_q``, by the chain's inner quantize): a
    quantized residual block's add, fused into the layer's kernel."""

    inner: DFPattern  # the layer's own quantize
    reshaped: DFPattern  # a reshape of its output (Gemm's back to [.., N])
    mine: DFPattern  # the dequantize of the layer's output, the add's operand
    s1: DFPattern  # the scale and zero point of that dequantize
    z1: DFPattern
    rq: DFPattern  # the residual's integers, scale and zero point
    sr: DFPattern
    zr: DFPattern
    relu: bool


def _chains() -> list[_Chain]:
    """Every chain, longest first (the whole epilogue is taken before its prefixes): the
    residual blocks, then the layers alone."""
    flags = [(relu, with_bias) for relu in (True, False) for with_bias in (True, False)]
    # Each operand order is a chain of its own: where both operands come from layers, the one
    # that cannot join (another reader) must not hide the other.
    out = [_with_residual(_chain(anchor, True, relu, with_bias), relu_after, mine_first)
           for anchor in ("matmul", "conv2d") for relu_after in (True, False)
           for relu, with_bias in flags for mine_first in (True, False)]
    for anchor in ("matmul", "conv2d"):
        # ONNX Runtime's dynamic quantization: MatMulInteger / ConvInteger, then scaled.
        out += [_chain(anchor, False, relu, with_bias, rescaled=True)
                for relu, with_bias in flags]
        for quantized in (True, False):
            out += [_chain(anchor, quantized, relu, with_bias) for relu, with_bias in flags]
    return out


def _with_residual(layer: _Chain, relu: bool, mine_first: bool) -> _Chain:
    """``layer`` (whose output is quantized) followed by a quantized residual add, the
    layer's operand first or second."""
    s1, z1, sr, zr, sy, zy = (is_const() for _ in range(6))
    rq = wildcard()
    # A Gemm's output may be reshaped back to [batch, seq, N] first (ORT's pre-processing).
    reshaped = is_op("relax.reshape")(layer.root, wildcard())
    mine = is_op("relax.dequantize")(layer.root | reshaped, s1, z1)
    other = is_op("relax.dequantize")(rq, sr, zr)
    node = is_op("relax.add")(*((mine, other) if mine_first else (other, mine)))
    if relu:
        node = is_op("relax.nn.relu")(node)
    root = is_op("relax.quantize")(node, sy, zy)
    return replace(layer, root=root, sy=sy, zy=zy,
                   residual=_Residual(layer.root, reshaped, mine, s1, z1, rq, sr, zr, relu))


def _chain(anchor: str, quantized: bool, relu: bool, with_bias: bool,
           rescaled: bool = False) -> _Chain:
    # sx and zx may be computed at run time (dynamic quantization): the rewrite checks that
    # they are scalars.
    xq, sx, zx, wq, sw, zw = (wildcard(), wildcard(), wildcard(), is_const(), is_const(),
                              is_const())
    x = is_op("relax.dequantize")(xq, sx, zx)
    w = is_op("relax.dequantize")(wq, sw, zw)
    wt = None
    if anchor == "matmul":
        wt = is_op("relax.permute_dims")(w)
        layer = is_op("relax.matmul")(x, w) | is_op("relax.matmul")(x, wt)
    else:
        layer = is_op("relax.nn.conv2d")(x, w)
    node, bias, rescale = layer, None, None
    if rescaled:
        # Dynamic quantization: the integer product times the run-time scale sx * sw.
        rescale = wildcard()
        node = is_op("relax.multiply")(node, rescale) | is_op("relax.multiply")(rescale, node)
    if with_bias:
        # ONNX Runtime's QDQ Gemm and Conv keep their bias as int32 + dequantize; a conv's
        # is reshaped to [1, K, 1, 1] for the add.
        bias = is_const() | is_op("relax.dequantize")(is_const(), is_const(), is_const())
        term = bias | is_op("relax.reshape")(bias, wildcard()) if anchor == "conv2d" else bias
        node = is_op("relax.add")(node, term) | is_op("relax.add")(term, node)
    if relu:
        node = is_op("relax.nn.relu")(node)
    sy = zy = None
    if quantized:
        sy, zy = is_const(), is_const()
        node = is_op("relax.quantize")(node, sy, zy)
    return _Chain(anchor, node, layer, x, xq, sx, zx, wq, sw, zw, w, wt, bias, relu, sy, zy,
                  rescale=rescale)


def rewrite_qdq(
    mod: tvm.IRModule, target: Target, report: list[Offload],
    tuner: Tuner | TaskCollector | None = None,
) -> tvm.IRModule:
    """Replace every int8 QDQ dense chain with a constant weight by an int8 TPP kernel call.

    Run it on the imported module, before :func:`relay_passes.prepare.prepare` (whose constant
    folding loses the int8 weights).  ``report`` receives one record per QDQ matmul: its
    kernel, or why it stays dequantized (then the float32 dense pass sees it after folding).
    With a ``tuner`` each GEMM gets its tuned configuration, or is recorded as a task.
    """

    def make_rewriter(add_kernel, chain, func):
        single_use = _single_use(func)
        return lambda orig, matches: _rewrite(orig, matches, chain, add_kernel, target, tuner,
                                              report, single_use)

    new_mod = relax.transform.DeadCodeElimination()(
        rewrite_patterns(mod, _chains(), make_rewriter))
    _report_leftovers(new_mod, report)
    return new_mod


@dataclass(frozen=True)
class _Weights:
    """A layer's quantized weight: the int8 values as the op holds them, the axis of its
    output channels, and their scales (per tensor: repeated)."""

    values: np.ndarray  # int8, [K, N] / [N, K] (matmul) or OIHW (conv2d)
    n_axis: int
    scale: np.ndarray  # float64 [N]

    @property
    def colsum(self) -> np.ndarray:
        """Per output channel, the sum of its weights: the zero point's fold."""
        other = tuple(a for a in range(self.values.ndim) if a != self.n_axis)
        return self.values.astype(np.int64).sum(axis=other)

    @functools.cached_property
    def dequantized(self) -> np.ndarray:
        """The float32 weights ``dequantize`` computes: ``float32(W_q) * float32(sw)``
        (computed once: the kernel and the report both ask)."""
        shape = [-1 if a == self.n_axis else 1 for a in range(self.values.ndim)]
        return self.values.astype(np.float32) * self.scale.astype(np.float32).reshape(shape)

    def kernel_operands(self, in_float: bool) -> tuple[str, np.ndarray, bool]:
        """What the layer's kernel multiplies: the dtype of its X, its weights and whether
        they lie in 7 bits -- the int8 kernel's (uint8, the int8 values) or, ``in_float``,
        the float32 kernel's (float32, :attr:`dequantized`)."""
        if in_float:
            return "float32", self.dequantized, False
        return "uint8", self.values, self.narrow

    @functools.cached_property
    def narrow(self) -> bool:
        """Whether the values lie in 7 bits (:func:`schedules.operands.narrow`; scanned once:
        the kernel and the report both ask)."""
        return narrow(self.values)


def _weights(wq: np.ndarray, sw: np.ndarray, zw: np.ndarray, axis: int, n_axis: int,
             rank: int) -> _Weights | str:
    """The weight of ``dequantize(wq, sw, zw, axis)`` whose output channels lie along
    ``n_axis`` of a rank-``rank`` tensor, or why the int8 kernels cannot take it.

    Examples
    --------
    >>> w = np.zeros((3, 2), "int8")
    >>> _weights(w, np.array([0.5, 0.25], "float32"), np.zeros(2, "int8"), 1, 1, 2).scale
    array([0.5 , 0.25])
    >>> _weights(w, np.float32(0.5), np.int8(1), 1, 1, 2)
    'weight zero point is not 0 (only symmetric int8 weights)'
    """
    if wq.dtype != np.int8 or wq.ndim != rank:
        return f"weight is {wq.dtype} of rank {wq.ndim}, not an int8 tensor of rank {rank}"
    if np.any(zw != 0):
        return "weight zero point is not 0 (only symmetric int8 weights)"
    n = wq.shape[n_axis]
    if n == 1 and rank == 2:
        return ONE_COLUMN
    if sw.size != 1 and (sw.size != n or axis % rank != n_axis):
        return "weight scale is not per tensor or per output channel"
    if not np.all(np.isfinite(sw) & (sw > 0)):
        return "weight scale is not positive"  # the folding divides by it
    return _Weights(wq, n_axis, np.broadcast_to(sw.astype(np.float64).reshape(-1), (n,)).copy())


def _constant(expr: relax.Expr) -> np.ndarray:
    """The float64 value of a constant, or of ``dequantize`` of constants (a quantized bias).

    Examples
    --------
    >>> q = relax.const(np.array([3, -2], "int32"))
    >>> _constant(relax.op.dequantize(q, relax.const(0.5), relax.const(1, "int32"), axis=0))
    array([ 1. , -1.5])
    """
    if isinstance(expr, tvm.ir.expr.Constant):
        return expr.value.numpy().astype(np.float64)
    q, scale, zero = (a.value.numpy().astype(np.float64) for a in expr.args)
    if scale.size != 1:  # per channel along the op's axis
        axis = int(expr.attrs.axis) % q.ndim
        shape = [-1 if d == axis else 1 for d in range(q.ndim)]
        scale, zero = scale.reshape(shape), zero.reshape(shape) if zero.size != 1 else zero
    return (q - zero) * scale


def _scalar(value: np.ndarray) -> float | None:
    return float(value.reshape(-1)[0]) if value.size == 1 else None


def _single_use(func: relax.Function) -> Callable[[relax.Expr], bool]:
    """Whether a value bound in ``func`` is read exactly once (fusing its only reader into
    its kernel then computes it once)."""
    uses: Counter[relax.Var] = Counter()
    relax.analysis.post_order_visit(
        func.body, lambda e: uses.update([e]) if isinstance(e, relax.Var) else None)
    var_of = {value: var for var, value in relax.analysis.get_var2val(func).items()}
    return lambda expr: expr in var_of and uses[var_of[expr]] == 1


def _rewrite(orig: relax.Expr, matches: Mapping[DFPattern, relax.Expr], chain: _Chain,
             add_kernel: KernelAdder, target: Target, tuner: Tuner | TaskCollector | None,
             report: list[Offload], single_use: Callable[[relax.Expr], bool]) -> relax.Expr:
    # Returning ``orig`` leaves the chain to a shorter pattern or to the float path; what
    # stays is reported once, by _report_leftovers.
    def const(p: DFPattern) -> np.ndarray:
        return matches[p].value.numpy()

    layer = matches[chain.layer]
    transposed = chain.w_transposed is not None and chain.w_transposed in matches
    if transposed and not _is_transpose(matches[chain.w_transposed]):
        return orig
    if chain.anchor == "conv2d" and unsupported_geometry(layer, "uint8") is not None:
        return orig
    weights = _weights(const(chain.wq), const(chain.sw), const(chain.zw),
                       int(matches[chain.w_dequantized].attrs.axis), *_weight_axes(chain,
                                                                                 transposed))
    channel_axis = -1 if chain.anchor == "matmul" else 1
    if isinstance(weights, str) or _activation_problem(
            matches[chain.x_dequantized], _reduced(chain, weights, layer), channel_axis):
        return orig
    n = weights.scale.size
    bias = _constant(matches[chain.bias]) if chain.bias is not None else np.zeros(n)
    if bias.size != n:
        return orig
    output = None
    if chain.sy is not None:
        output = _output(matches[chain.root])
        if output is None:
            return orig  # per-channel output quantization: the float kernel, then TVM's
    residual = None
    if chain.residual is not None:
        residual = _residual(matches, chain.residual, single_use)
        if residual is None:
            return orig  # the layer alone, then TVM's add
    xq = matches[chain.xq]
    x_shape = tuple(xq.ty.shape)
    zx_expr = matches[chain.zx]
    rescale = matches[chain.rescale] if chain.rescale is not None else None
    sx = 1.0
    if isinstance(matches[chain.sx], tvm.ir.expr.Constant):
        sx = float(const(chain.sx).reshape(-1)[0])
    elif rescale is None:  # a run-time scale (checked a scalar by _activation_problem)
        rescale = matches[chain.sx]
    else:
        rescale = relax.op.multiply(rescale, matches[chain.sx])
    in_float = ((machine_of(target).int8_in_float
                 or _winograd_in_float(chain, layer, weights, target))
                and rescale is None and isinstance(zx_expr, tvm.ir.expr.Constant))
    shift = _S8_SHIFT if str(xq.ty.dtype) == "int8" and not in_float else 0
    if shift:
        # The kernel's A is unsigned: x_q + 128 in [0, 255], and the zero point with it.
        xq = relax.op.astype(relax.op.add(relax.op.astype(xq, "int32"),
                                          relax.const(_S8_SHIFT, "int32")), "uint8")
    scale = sx * weights.scale
    if isinstance(rescale, tvm.ir.expr.Constant):
        factor = rescale.value.numpy().astype(np.float64).reshape(-1)
        if factor.size not in (1, n):
            return orig
        scale, rescale = scale * factor, None
    elif rescale is not None and chain.rescale in matches and not _is_scalar(
            matches[chain.rescale], "float32"):
        return orig  # only a run-time scalar (the activation's scale times the weight's)
    if in_float:
        # The QDQ graph's own float arithmetic on float32 kernels: x and W dequantized.
        xq, zx = matches[chain.x_dequantized], 0
        epilogue, values = _float_epilogue(bias.reshape(n), chain.relu,
                                           output if residual is None else residual.layer)
        operands: list[relax.Expr] = [relax.const(v) for v in values]
    elif isinstance(zx_expr, tvm.ir.expr.Constant) and rescale is None:
        zx = int(zx_expr.value.numpy().reshape(-1)[0]) + shift
        folded = _folded_epilogue(scale, zx, weights.colsum, bias.reshape(n), chain.relu,
                                  output if residual is None else residual.layer)
        if folded is None:
            return orig
        epilogue, values = folded
        operands = [relax.const(v) for v in values]
    elif output is None and residual is None:
        epilogue, operands = _run_time_epilogue(scale, rescale, zx_expr, shift, weights.colsum,
                                                bias.reshape(n), chain.relu)
        zx = 0  # a run-time zero point: borders (convs) pad with it only if known
        if chain.anchor == "conv2d" and any(int(p) for p in layer.attrs.padding):
            return orig
    else:
        return orig  # a quantized output of a run-time quantization: TVM's
    if residual is not None:
        epilogue = Epilogue(epilogue.ops + residual.ops(output))
    emit = _emit_dense if chain.anchor == "matmul" else _emit_conv
    out, shape, kernel, brgemm, flops = emit(xq, x_shape, layer, weights, transposed, epilogue,
                                             operands, residual and residual.tensor, int(zx),
                                             add_kernel, target, tuner, in_float)
    name = chain.name(output.dtype if output else "float32")
    dtype, _, narrow_weights = weights.kernel_operands(in_float)
    report.append(Offload.routed(name, shape, kernel, brgemm, flops)
                  if chain.anchor == "matmul"  # shape (m, n, k)
                  else offload(name, conv_problem(layer, dtype, epilogue, narrow_weights),
                               kernel, brgemm, target))
    want = list(orig.ty.shape)  # a residual add may have reshaped the layer's output
    return out if same_dims(want, _emitted_shape(chain, x_shape, weights, layer)) else \
        relax.op.reshape(out, want)


def _emitted_shape(chain: _Chain, x_shape: tuple, weights: _Weights, layer: relax.Call
                   ) -> list:
    """The shape of what the chain's emitter returns: the layer's own output shape."""
    if chain.anchor == "conv2d":
        return list(layer.ty.shape)
    return [*x_shape[:-1], weights.scale.size]


def _weight_axes(chain: _Chain, transposed: bool) -> tuple[int, int]:
    """(axis of the output channels, rank) of the chain's weight as the graph holds it."""
    if chain.anchor == "conv2d":
        return 0, 4  # OIHW
    return (0 if transposed else 1), 2


def _reduced(chain: _Chain, weights: _Weights, layer: relax.Call) -> int:
    """The activation's channels the weight reads: matmul's K, conv2d's C (a grouped conv's
    weight holds C / groups of them: a depthwise one's ``[C, 1, R, S]`` one)."""
    if chain.anchor == "matmul":
        return weights.values.shape[1 - weights.n_axis]
    return weights.values.shape[1] * int(layer.attrs.groups)


def _emit_dense(xq: relax.Expr, x_shape: tuple, _layer: relax.Call,
                weights: _Weights, transposed: bool,
                epilogue: Epilogue, operands: list[relax.Expr],
                residual: relax.Expr | None, _zx: int,
                add_kernel: KernelAdder, target: Target, tuner: Tuner | TaskCollector | None,
                in_float: bool = False
                ) -> tuple[relax.Expr, tuple[int, ...], str, BrgemmShape | None, int]:
    """The int8 GEMM of a QDQ matmul (``in_float``: the float32 GEMM of ``xq`` dequantized,
    with the dequantized weights): (its result, the report's shape, kernel, BRGEMM, FLOPs
    (of one sample where the batch is symbolic))."""
    dtype, values, narrow_weights = weights.kernel_operands(in_float)
    w = np.ascontiguousarray(values.T if transposed else values)  # [K, N]
    k, n = w.shape
    rows = DenseRows.of(x_shape)
    # Bound to the ISA: its layout (VNNI-4, or MMLA on neon_i8mm) decides the packing.
    problem = GemmProblem(rows.m, n, k, dtype, epilogue,
                          narrow_weights=narrow_weights).on(machine_of(target).isa)
    sch, config = scheduled(problem, target, tuner, rows)
    name = (f"tpp_qdq_dense_{rows.name()}x{n}x{k}_{problem.epilogue.name}"
            + ("_f32" if in_float else ""))
    gv = add_kernel(sch.mod["main"], name)
    args = [rows.matrix(xq, k, dtype), relax.const(pack_weight(w, config.bn, problem)),
            *operands]
    if residual is not None:  # the epilogue's last operand
        args.append(rows.matrix(residual, n, str(residual.ty.dtype)))
    out = call_kernel(gv, args, (rows.rows, n), problem.out_dtype, rows.units)
    packed = "" if config.pack_a is None else f" pack_a={config.pack_a}"
    return (rows.result(out, n), (rows.m, n, k), f"{name} [{config.spec}{packed}]",
            dispatched_brgemm(sch), 2 * rows.sample_rows * n * k)


def _winograd_in_float(chain: _Chain, layer: relax.Call, weights: _Weights,
                       target: Target) -> bool:
    """Whether a QDQ conv computes in float32 because float32 runs it in Winograd form
    (:func:`~relay_passes.conv.winograd_tile`) where the ISA has no int8 dot product: there
    the exact int8 kernel multiplies at only 1.2x float32's rate (``vpmaddwd``; a Zen 3),
    while Winograd needs a quarter (F(4x4, 3x3)) or 4/9 (F(2x2, 3x3)) of the products.  On
    7-bit weights, whose ``vpmaddubsw`` kernel runs 2x float32, only F(4x4) pays (ResNet-50
    at batch 1, F(2x2) at 14x14: 0.98x).  ``tpp -int8=kernels`` keeps every layer on the
    int8 kernels."""
    machine = machine_of(target)
    if chain.anchor != "conv2d" or machine.int8 != "auto" or machine.isa.int8_dot:
        return False
    tile = winograd_tile(conv_problem(layer, "float32", Epilogue(), False), target,
                         conv_batch(layer))
    return tile is not None and (tile >= 4 or not weights.narrow)


def _emit_conv(xq: relax.Expr, _x_shape: tuple, layer: relax.Call,
               weights: _Weights, _transposed: bool,
               epilogue: Epilogue, operands: list[relax.Expr],
               residual: relax.Expr | None, zx: int,
               add_kernel: KernelAdder, target: Target, tuner: Tuner | TaskCollector | None,
               in_float: bool = False
               ) -> tuple[relax.Expr, tuple[int, ...], str, BrgemmShape | None, int]:
    """The int8 conv kernel of a QDQ conv2d: borders pad with the zero point (real zeros).
    A depthwise conv gets the u8 x s8 -> s32 depthwise kernel (its ``[C, 1, R, S]`` weight's
    ``colsum`` is each channel's filter sum), with the same epilogues.  ``in_float``: the
    float32 conv (or its Winograd form) of ``xq`` dequantized, with the dequantized weights."""
    dtype, values, narrow_weights = weights.kernel_operands(in_float)
    problem = conv_problem(layer, dtype, epilogue, narrow_weights)
    out, kernel, brgemm = emit_conv(xq, problem, values,
                                    [*operands, *([] if residual is None
                                                  else [to_matrix(residual)])],
                                    add_kernel, target, tuner, pad_value=zx,
                                    batch=conv_batch(layer))
    return out, problem.output_shape, kernel, brgemm, problem.flops


def _is_scalar(expr: relax.Expr, dtype: str) -> bool:
    """Whether ``expr`` is one value of ``dtype``: a constant of size 1, or a rank-0 tensor."""
    if isinstance(expr, tvm.ir.expr.Constant):
        return expr.value.numpy().size == 1
    return (isinstance(expr.ty, relax.TensorType) and expr.ty.ndim == 0
            and str(expr.ty.dtype) == dtype)


def _run_time_epilogue(scale: np.ndarray, rescale: relax.Expr | None, zx: relax.Expr,
                       shift: int, colsum: np.ndarray, bias: np.ndarray, relu: bool
                       ) -> tuple[Epilogue, list[relax.Expr]]:
    """The float epilogue of a layer whose activation is quantized at run time (ONNX
    Runtime's dynamic quantization): per-column ``scale`` (times the run-time scalar
    ``rescale``) and ``bias - scale * zx * colsum``, both computed in the graph from the
    run-time scalars, then ``relu``.  ``scale * (acc - zx colsum) + bias`` as
    :func:`_folded_epilogue` folds it, with ``zx`` (+ ``shift``) known only when it runs."""
    scale_vector: relax.Expr = relax.const(scale.astype(np.float32))
    if rescale is not None:
        scale_vector = relax.op.multiply(scale_vector, rescale)
    zero = relax.op.astype(zx, "float32")
    if shift:
        zero = relax.op.add(zero, relax.const(float(shift), "float32"))
    folded = relax.op.multiply(zero, relax.const(colsum.astype(np.float32)))
    float_bias = relax.op.subtract(relax.const(bias.astype(np.float32)),
                                   relax.op.multiply(scale_vector, folded))
    ops = [EpilogueOp("scale", broadcast="row"), EpilogueOp("bias"),
           *([EpilogueOp("relu")] if relu else [])]
    return Epilogue(tuple(ops)), [scale_vector, float_bias]


@dataclass(frozen=True)
class _Output:
    """The quantization of a kernel's output: ``quantize(y, scale, zero_point)`` to dtype."""

    scale: float
    zero_point: int
    dtype: str


def _output(quantize: relax.Call) -> _Output | None:
    """The per-tensor quantization a ``quantize`` call makes (None: per channel, or not to
    uint8/int8)."""
    scale, zero = (_scalar(a.value.numpy()) for a in quantize.args[1:])
    dtype = str(quantize.attrs.out_dtype)
    if scale is None or zero is None or dtype not in ("uint8", "int8"):
        return None
    return _Output(scale, int(zero), dtype)


@dataclass(frozen=True)
class _ResidualAdd:
    """A matched quantized residual add: the layer's own output quantization, the residual
    tensor and its quantization, and whether a relu follows the add."""

    layer: _Output
    tensor: relax.Expr
    scale: float
    zero_point: int
    relu: bool

    def ops(self, output: _Output) -> tuple[EpilogueOp, ...]:
        """The epilogue after the layer's requantization: dequantize it, add the dequantized
        residual, [relu,] quantize to ``output`` -- the QDQ graph's own roundings."""
        dtype = str(self.tensor.ty.dtype)
        return (EpilogueOp("dequantize", value=self.layer.scale,
                           zero_point=self.layer.zero_point),
                EpilogueOp("residual_dq", value=self.scale, zero_point=self.zero_point,
                           dtype=dtype),
                *([EpilogueOp("relu")] if self.relu else []),
                EpilogueOp("requantize", value=1 / output.scale, zero_point=output.zero_point,
                           dtype=output.dtype))


def _same_matrix(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> bool:
    """Whether two static shapes hold the same ``[rows, channels]`` matrix (a reshape of
    the leading dimensions apart)."""
    return a is not None and b is not None and a[-1] == b[-1] and math.prod(a) == math.prod(b)


def _residual(matches: Mapping[DFPattern, relax.Expr], pattern: _Residual,
              single_use: Callable[[relax.Expr], bool]) -> _ResidualAdd | None:
    """The residual add of a match, if it can join the layer's kernel: the layer's quantized
    output read by the add only, dequantized as it was quantized, the residual a per-tensor
    quantized tensor of the output's shape."""
    inner = matches[pattern.inner]
    layer = _output(inner)
    rq = matches[pattern.rq]
    scale, zero = (_scalar(matches[p].value.numpy()) for p in (pattern.sr, pattern.zr))
    # The layer's output, on its way to the add, must have no other reader: the fused kernel
    # does not write it.
    path = [inner, matches[pattern.mine], *([matches[pattern.reshaped]]
                                            if pattern.reshaped in matches else [])]
    if (layer is None or not all(single_use(e) for e in path) or scale is None or zero is None
            or (_scalar(matches[pattern.s1].value.numpy()), _scalar(
                matches[pattern.z1].value.numpy())) != (layer.scale, layer.zero_point)
            or not isinstance(rq.ty, relax.TensorType)
            or str(rq.ty.dtype) not in ("uint8", "int8")
            or not _same_matrix(static_shape(rq.ty.shape), static_shape(inner.ty.shape))
            or not scale > 0):
        return None
    return _ResidualAdd(layer, rq, scale, int(zero), pattern.relu)


def _folded_epilogue(scale: np.ndarray, zx: int, colsum: np.ndarray, bias: np.ndarray,
                     relu: bool, output: _Output | None
                     ) -> tuple[Epilogue, list[np.ndarray]] | None:
    """The epilogue (and its operands) turning the int32 ``acc = sum_k x_q W_q`` of a layer
    into its QDQ result, the activation's zero point folded in per output column:
    ``sum_k (x_q - zx) W_q = acc - zx colsum[n]``.

    ``scale[n]`` is ``sx sw[n]`` (real = scale * folded acc), ``bias`` the float bias.  A float
    output gets ``scale``, then the float ``bias`` ``b[n] - scale[n] zx colsum[n]``, then
    ``relu``; a quantized one the int32 ``bias`` ``round(b[n] / scale[n]) - zx colsum[n]``,
    ``relu`` and ``requantize`` by ``scale[n] / sy`` to ``zy``, all on the exact int32.  An
    all-zero bias is left out (one load per element less).  None when the int32 bias would
    overflow.

    Examples
    --------
    >>> epi, operands = _folded_epilogue(np.array([0.5, 0.5]), 3, np.array([2, -1]),
    ...                                  np.zeros(2), True, None)
    >>> epi.name, operands
    ('scale_bias_relu', [array([-3. ,  1.5], dtype=float32)])
    """
    per_tensor = bool(np.all(scale == scale[0]))
    operands: list[np.ndarray] = []
    if output is None:
        ops = [EpilogueOp("scale", value=float(scale[0])) if per_tensor
               else EpilogueOp("scale", broadcast="row")]
        if not per_tensor:
            operands.append(scale.astype(np.float32))
        float_bias = (bias - scale * zx * colsum).astype(np.float32)
        if np.any(float_bias):
            ops.append(EpilogueOp("bias"))
            operands.append(float_bias)
        if relu:
            ops.append(EpilogueOp("relu"))
        return Epilogue(tuple(ops)), operands
    requant = scale / output.scale
    int_bias = np.rint(bias / scale) - zx * colsum
    if np.abs(int_bias).max(initial=0) >= 2**31:
        return None
    ops = []
    if np.any(int_bias):
        ops.append(EpilogueOp("bias"))
        operands.append(int_bias.astype(np.int32))
    if relu:  # before requantize: its scale is positive
        ops.append(EpilogueOp("relu"))
    if bool(np.all(requant == requant[0])):
        ops.append(EpilogueOp("requantize", value=float(requant[0]),
                              zero_point=output.zero_point, dtype=output.dtype))
    else:
        ops.append(EpilogueOp("requantize", broadcast="row", zero_point=output.zero_point,
                              dtype=output.dtype))
        operands.append(requant.astype(np.float32))
    return Epilogue(tuple(ops)), operands


def _float_epilogue(bias: np.ndarray, relu: bool, output: _Output | None
                    ) -> tuple[Epilogue, list[np.ndarray]]:
    """The epilogue (and its operands) of a layer computed in float32 on its dequantized
    operands: the float ``bias``, ``relu``, and the requantization to ``output`` (if any), as
    the QDQ graph computes them.  An all-zero bias is left out.

    Examples
    --------
    >>> epi, operands = _float_epilogue(np.array([0.5, 0.0]), True, _Output(0.25, 3, "uint8"))
    >>> epi.name, operands
    ('bias_relu_requantize_u8', [array([0.5, 0. ], dtype=float32)])
    """
    ops, operands = [], []
    if np.any(bias):
        ops.append(EpilogueOp("bias"))
        operands.append(bias.astype(np.float32))
    if relu:
        ops.append(EpilogueOp("relu"))
    if output is not None:
        ops.append(EpilogueOp("requantize", value=1 / output.scale,
                              zero_point=output.zero_point, dtype=output.dtype))
    return Epilogue(tuple(ops)), operands


def _is_transpose(call: relax.Call) -> bool:
    axes = call.attrs.axes
    return axes is None or [int(a) for a in axes] == [1, 0]


def _activation_problem(dequantized: relax.Call, channels: int, axis: int) -> str | None:
    """Why the activation of ``dequantize(x_q, sx, zx)`` cannot be the kernel's A when the
    weight reduces ``channels`` channels along ``axis`` of it (None if it can)."""
    xq, sx, zx = dequantized.args
    if not isinstance(xq.ty, relax.TensorType) or str(xq.ty.dtype) not in ("uint8", "int8"):
        return "activation is not uint8 or int8"
    # A scale and zero point computed at run time (dynamic quantization) are scalars.
    if not (_is_scalar(sx, "float32") and _is_scalar(zx, str(xq.ty.dtype))):
        return "activation is not quantized per tensor (a scalar scale and zero point)"
    batched = batched_shape(xq.ty.shape)
    if batched is None or len(batched[0]) < 2 or batched[0][axis] != channels:
        return "activation shape is symbolic beyond its batch, or does not fit this weight"
    return None


#: Anchor op -> (its name in the report, the axis of the activation's channels).
_ANCHORS = {"relax.matmul": ("matmul", -1), "relax.nn.conv2d": ("conv2d", 1)}


def _report_leftovers(mod: tvm.IRModule, report: list[Offload]) -> None:
    """Report each matmul and conv2d still reading a dequantized constant int8 weight, with
    the reason."""
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            bound = relax.analysis.get_var2val(func)
            relax.analysis.post_order_visit(func, lambda e, b=bound: _report_left(e, b, report))


def _report_left(expr: relax.Expr, bound: Mapping[relax.Var, relax.Expr],
                 report: list[Offload]) -> None:
    def value(e: relax.Expr) -> relax.Expr:
        return bound.get(e, e) if isinstance(e, relax.Var) else e

    anchor = next((a for op, a in _ANCHORS.items() if is_call_to(expr, op)), None)
    if anchor is None:
        return
    name, channel_axis = anchor
    x, w = (value(a) for a in expr.args)
    transposed = name == "matmul" and is_call_to(w, "relax.permute_dims")
    if transposed:
        w = value(w.args[0])
    if not (is_call_to(w, "relax.dequantize")
            and all(isinstance(a, tvm.ir.expr.Constant) for a in w.args)):
        return  # not an int8 weight: the float32 passes' layer
    wq, sw, zw = (a.value.numpy() for a in w.args)
    n_axis, rank = (0, 4) if name == "conv2d" else ((0 if transposed else 1), 2)
    why = _weights(wq, sw, zw, int(w.attrs.axis), n_axis, rank)
    if not isinstance(why, str):
        why = unsupported_geometry(expr, "uint8") if name == "conv2d" else None
    if why is None:
        reduced = (wq.shape[1] * int(expr.attrs.groups) if name == "conv2d"
                   else wq.shape[1 - n_axis])
        why = (_activation_problem(x, reduced, channel_axis)
               if is_call_to(x, "relax.dequantize")
               else "activation is not dequantized from uint8 or int8")
    report.append(Offload(f"{name}_qdq", static_shape(expr.ty.shape) or (),
                          reason=f"{why or 'pattern not matched'}; left dequantized to float32",
                          flops=call_flops(expr)))

