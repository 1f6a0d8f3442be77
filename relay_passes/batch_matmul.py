"""Batch matmuls of two activations (attention) to TPP kernels: ``epi(X @ Y)`` as one call_tir.

Matches ``relax.matmul(x, y)`` whose right operand is not a constant (the dense pass,
:mod:`relay_passes.dense`, has taken the constant ones): float32, static shapes, both of rank
>= 2 with the same leading (batch) dimensions, which flatten into one batch.  Around it:

* the ``permute_dims`` producing the operands, when they only move the heads: ``y`` given as
  ``permute_dims(z)`` swapping its last two axes (``Q @ K^T``) is read transposed, and an
  operand permuted from heads-interleaved ``[..., S, H, D]`` to ``[..., H, S, D]`` (after a
  projection, ``K^T`` also as ``[..., H, D, S]``) is read in place; chains of permutes are
  composed first.  A ``permute_dims`` of the result back to ``[..., S, H, D]`` is absorbed the
  same way.  No transposed copy of Q, K, V or the context is left to TVM;
* the epilogue: division or multiplication by a constant scalar (the ``1/sqrt(d)`` scaling),
  then an add of a constant scalar, of an ``[N]`` vector or of a tensor of the output's shape;
* a left operand ``softmax(scores)`` over its last axis (``P @ V``, float32 and bf16): the
  kernel reads the scores and normalizes each row as it converts it
  (:attr:`~schedules.batch_gemm.BatchGemmProblem.softmax`), also through ``where(mask,
  scores, fill)`` with a constant mask the same for every head and batch element (GPT-2's
  causal mask; either branch the fill).  The score tensor is then written once and read once,
  where TVM's softmax (and the ``where``) read and wrote it again: GPT-2 bf16 1.034x, BERT
  1.027x at batch 8 on a Zen 5, bit-identical.

The kernel (:mod:`schedules.batch_gemm`) packs the right operand itself, per batch element and
N panel.  What does not fit stays with TVM and is reported with the reason.

Whole attentions first.  A first round takes only ``P @ V`` chains whose softmax reads scores
that are themselves such a chain (``Q @ K^T``, its scaling and addend) and that nothing else
reads (neither the scores, the ``where`` nor the probabilities): both become one kernel,
:mod:`schedules.attention`, which makes each block of score rows where its softmax and
``P @ V`` read them, so the score tensor never exists (``attention+scale`` in the report,
``masked_`` with a causal mask; batch, queries, keys and the two head widths as its shape).
Only then the second round routes every matmul left, each on its own kernel: rewriting the
scores first would make (and tune) a kernel the attention leaves dead.

Precision.  With ``precision="bf16"`` (:data:`relay_passes.dense.PRECISIONS`) the float32
matmuls multiply in bfloat16 accumulating in float32: the kernel rounds X and B to bf16 while
it packs them (on AMX tiles where the host has them); inputs and epilogue stay float32, and
so does the output unless only bf16 kernels read it (P @ V's context, read by the output
projection): then the epilogue ends in a conversion to bf16, as bf16 dense layers hand over.

Matmuls of two dequantized uint8 tensors (ONNX Runtime's QDQ attention,
``matmul(dequantize(a_q, sa, za), dequantize(b_q, sb, zb))``, the permutes on the integers)
multiply the integers in any precision: uint8 by B shifted to int8 (``vpdpbusd``), the zero
points folded in the kernel, then the epilogue ``scale`` ``sa sb c`` (``c`` the chain's
constant) and the add in float32, and a following ``quantize`` as the epilogue's
``requantize`` (without an add, one requantize of the int32).

Examples
--------
>>> report = []
>>> mod = rewrite_batch_matmul(mod, target, report)             # doctest: +SKIP
>>> [(r.op, r.shape, r.kernel or r.reason) for r in report]     # doctest: +SKIP
[('batch_matmul+scale', (12, 128, 128, 64), 'tpp_batch_matmul_12x128x128x64_txb12_scale'), ...]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard
from tvm.target import Target

from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.machine import machine_of
from schedules.attention import AttentionProblem
from schedules.attention import schedule as attention_schedule
from schedules.attention import stored as attention_shapes
from schedules.batch_gemm import BatchGemmProblem, schedule, stored_shapes
from schedules.tuner import Tuner, config_for

from .dense import PRECISIONS
from .layouts import moves_data, simplify_layouts, widened
from .scaffold import (
    KernelAdder,
    Offload,
    batched_shape,
    call_kernel,
    dispatched_brgemm,
    is_call_to,
    kernel_batch,
    offload_name,
    offload_patterns,
    readers,
    reads_through_bf16_cast,
    rewrite_patterns,
    same_dims,
    static_shape,
)

__all__ = ["rewrite_batch_matmul"]


@dataclass(frozen=True)
class _Dequantized:
    """``dequantize(q, scale, zero_point)``: an int8 operand of a QDQ matmul."""

    q: DFPattern
    scale: DFPattern
    zero_point: DFPattern


@dataclass(frozen=True)
class _Chain:
    """``matmul(x, y)``, then optionally scaled, added to, quantized and permuted: the pattern
    ``root`` and the parts to read a match by.  A QDQ chain's operands are dequantized."""

    root: DFPattern
    matmul: DFPattern
    scale: DFPattern | None  # the constant
    scale_op: str | None  # "divide" / "multiply"
    addend: DFPattern | None
    out_permute: DFPattern | None
    operands: tuple[_Dequantized, _Dequantized] | None = None  # QDQ: x and y dequantized
    quantize: tuple[DFPattern, DFPattern] | None = None  # QDQ: the output's scale, zero point


def _chains() -> list[_Chain]:
    """Every chain, longest first so the whole epilogue is taken before its prefixes; the QDQ
    chains (int8 operands) before the float32 ones, which would take them in float32."""
    out = []
    for qdq in (True, False):
        for out_permute in (True, False):
            for quantized in ((True, False) if qdq else (False,)):
                for with_add in (True, False):
                    for scale_op in ("divide", "multiply", None):
                        out.append(_chain(qdq, out_permute, quantized, with_add, scale_op))
    return out


@functools.cache
def _scores_chains() -> tuple[_Chain, ...]:
    """The float32 chains attention's scores may be: no permute of the result (the softmax
    reads it as it is), not quantized."""
    return tuple(c for c in _chains() if c.operands is None and c.out_permute is None)


def _chain(qdq: bool, out_permute: bool, quantized: bool, with_add: bool,
           scale_op: str | None) -> _Chain:
    operands = None
    if qdq:
        operands = tuple(_Dequantized(wildcard(), is_const(), is_const()) for _ in range(2))
        mm = is_op("relax.matmul")(*(is_op("relax.dequantize")(d.q, d.scale, d.zero_point)
                                     for d in operands))
    else:
        mm = is_op("relax.matmul")(wildcard(), wildcard())
    node, scale, addend, permute, quantize = mm, None, None, None, None
    if scale_op == "divide":
        scale = is_const()
        node = is_op("relax.divide")(node, scale)
    elif scale_op == "multiply":
        scale = is_const()
        node = is_op("relax.multiply")(node, scale) | is_op("relax.multiply")(scale, node)
    if with_add:
        addend = wildcard()
        node = is_op("relax.add")(node, addend) | is_op("relax.add")(addend, node)
    if quantized:
        quantize = (is_const(), is_const())
        node = is_op("relax.quantize")(node, *quantize)
    if out_permute:
        node = permute = is_op("relax.permute_dims")(node)
    return _Chain(node, mm, scale, scale_op, addend, permute, operands, quantize)


def rewrite_batch_matmul(mod: tvm.IRModule, target: Target, report: list[Offload],
                         tuner: Tuner | None = None, precision: str = "float32") -> tvm.IRModule:
    """Replace every matmul of two activations (and its epilogue) by a TPP kernel call.

    Appends one :class:`~relay_passes.scaffold.Offload` per such matmul to ``report``: the kernel
    (``shape`` is ``(batch, m, n, k)``) or why it stayed with TVM (``shape`` is its output's).
    With a ``tuner`` each kernel gets its tuned configuration (tuned now if its database does
    not know it yet); without one, the default heuristic's.  ``precision`` (a key of
    :data:`relay_passes.dense.PRECISIONS`) is what float32 matmuls multiply in; matmuls of
    two dequantized uint8 tensors (QDQ) multiply the integers whatever it is.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    dtype = PRECISIONS[precision]

    def rewriter(attention: bool):
        def make_rewriter(add_kernel, pattern, func):
            bindings, read_by = _bindings(func), readers(func)
            return lambda orig, matches: _rewrite(orig, matches, pattern, bindings, read_by,
                                                  add_kernel, target, tuner, report, dtype,
                                                  attention)
        return make_rewriter

    # Whole attentions first, so that no kernel is made (or tuned) for scores they take in.
    mod = relax.transform.DeadCodeElimination()(
        rewrite_patterns(mod, _chains(), rewriter(attention=True)))
    return offload_patterns(mod, _chains(), rewriter(attention=False), report, "relax.matmul",
                            _why_left, then=simplify_layouts)


def _bindings(func: relax.Function) -> dict[relax.Var, relax.Expr]:
    """var -> bound value, for following an operand back through its permutes."""
    found = {}

    def visit(expr) -> None:
        if isinstance(expr, relax.SeqExpr):
            for block in expr.blocks:
                for binding in block.bindings:
                    if isinstance(binding, relax.VarBinding):
                        found[binding.var] = binding.value

    relax.analysis.post_order_visit(func, visit)
    return found


def _axes(call: relax.Call, rank: int) -> list[int]:
    axes = call.attrs.axes
    return list(range(rank))[::-1] if axes is None else [int(a) for a in axes]


def _layout(axes: list[int], transposable: bool) -> tuple[bool, bool] | None:
    """(interleaved, transposed) of an operand read through the permutation ``axes``."""
    r = len(axes)
    forms = {(False, False): [*range(r - 2), r - 2, r - 1],
             (False, True): [*range(r - 2), r - 1, r - 2]}
    if r >= 3:  # [..., S, H, D] -> [..., H, S, D] (or [..., H, D, S])
        forms[(True, False)] = [*range(r - 3), r - 2, r - 3, r - 1]
        forms[(True, True)] = [*range(r - 3), r - 2, r - 1, r - 3]
    for form, want in forms.items():
        if want == axes and (transposable or not form[1]):
            return form
    return None


def _operand(expr, bindings: dict, transposable: bool):
    """(source, interleaved, transposed): the deepest tensor ``expr`` is a head-moving (or, if
    ``transposable``, transposing) permutation of, through chains of ``permute_dims``."""
    rank = len(expr.ty.shape)
    best, axes, node = (expr, False, False), list(range(rank)), expr
    while True:
        value = bindings.get(node, node)
        if not is_call_to(value, "relax.permute_dims"):
            return best
        # y = permute(z, P), z = permute(w, Q)  =>  y = permute(w, [Q[p] for p in P]).
        axes = [_axes(value, rank)[a] for a in axes]
        node = value.args[0]
        form = _layout(axes, transposable)
        if form is not None:
            best = (node, *form)


def _f32_batched(expr) -> tuple[tuple[int, ...], tvm.ir.PrimExpr | None] | None:
    """A float32 tensor's :func:`~relay_passes.scaffold.batched_shape`, else None."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.dtype != "float32":
        return None
    return batched_shape(ty.shape)



def _unsupported(call: relax.Call) -> str | None:
    """Why the matmul ``call`` cannot become a batch TPP kernel (None if it can)."""
    x, y = call.args
    if isinstance(y, tvm.ir.expr.Constant):
        return "constant right operand: a dense layer the dense pass did not take"
    shapes = [_f32_batched(e) for e in (x, y, call)]
    if any(s is None for s in shapes):
        return "operands and result must be float32, static beyond a symbolic batch"
    batches = [b for _, b in shapes]
    if (None in batches and batches != [None] * 3) or (
            None not in batches and not same_dims(batches, batches[:1] * 3)):
        return "operands and result must share their symbolic batch"
    xs, ys, _ = (sizes for sizes, _ in shapes)
    if len(xs) < 2 or len(xs) != len(ys):
        return f"operand ranks {len(xs)} and {len(ys)}: need equal ranks >= 2"
    if xs[:-2] != ys[:-2]:
        return f"batch dimensions {xs[:-2]} and {ys[:-2]} differ (broadcasting unsupported)"
    if xs[-1] != ys[-2]:
        return f"inner dimensions {xs[-1]} and {ys[-2]} differ"
    return None


def _scalar(const, infinite: bool = False) -> float | None:
    """A float constant's one value: finite (or, with ``infinite``, any but NaN), else None."""
    value = const.value.numpy()
    if value.size != 1 or value.dtype.kind != "f":
        return None
    v = float(value.reshape(()))
    return v if math.isfinite(v) or (infinite and not math.isnan(v)) else None


@dataclass(frozen=True)
class _Product:
    """A matched chain as a batch GEMM: its problem, the tensors its kernel reads (X's and
    B's sources, read in their stored shapes, the mask, the epilogue's operands) and how the
    report names it."""

    problem: BatchGemmProblem
    x: relax.Expr
    b: relax.Expr
    masks: tuple[relax.Expr, ...]
    extra: tuple[relax.Expr, ...]
    run_batch: tvm.ir.PrimExpr | None
    anchor: str
    matched: tuple[EpilogueOp, ...]  # the chain's ops (a bf16 handoff's conversion is none)
    softmax: _Softmax | None


def _product(orig: relax.Expr, matches: Mapping[DFPattern, relax.Expr], pattern: _Chain,
             bindings: dict[relax.Var, relax.Expr],
             read_by: Callable[[relax.Expr], list[relax.Expr] | None], dtype: str
             ) -> _Product | None:
    """The batch GEMM a chain's match computes, or None when the kernel cannot take it."""
    call = matches[pattern.matmul]
    if _unsupported(call) is not None:
        return None
    xs, run_batch = batched_shape(call.args[0].ty.shape)
    lead, (m, k), n = xs[:-2], xs[-2:], int(call.args[1].ty.shape[-1])
    batch = int(np.prod(lead, dtype=np.int64))
    quant = None
    x_arg, y_arg = call.args
    if pattern.operands is not None:
        quant = _quantization(pattern, matches)
        if quant is None:
            return None
        x_arg, y_arg = (matches[d.q] for d in pattern.operands)
        dtype = "uint8"
    softmax = _softmax_of(x_arg, bindings, m, k) if quant is None else None
    if softmax is not None:
        x_arg = softmax.scores
    x_src, x_inter, _ = _operand(x_arg, bindings, transposable=False)
    b_src, b_inter, transposed = _operand(y_arg, bindings, transposable=True)
    # Operands a bf16 producer hands over (a float32 view of its bf16 output) are read as
    # bf16: X too unless it holds a softmax's scores.
    bf16_inputs = dtype == "bfloat16" and all(
        _bf16_view(e, bindings) for e in ([b_src] if softmax else [x_src, b_src]))
    y_inter = pattern.out_permute is not None
    if y_inter and _layout(_axes(orig, len(xs)), False) != (True, False):
        return None  # not the permute back to [..., S, H, D]
    heads = lead[-1] if (x_inter or b_inter or y_inter) and lead[-1] > 1 else 1
    if heads == 1:  # one head: interleaved and plain layouts are the same memory
        x_inter = b_inter = y_inter = False

    factor = 1.0  # the product's scale: the dequantization's, times the chain's constant
    if quant is not None:
        factor = quant.scale
    if pattern.scale is not None:
        value = _scalar(matches[pattern.scale])
        if value is None or (pattern.scale_op == "divide" and value == 0):
            return None
        factor *= 1.0 / value if pattern.scale_op == "divide" else value
    ops, extra = [], []
    requantize = quant is not None and quant.output is not None
    if requantize and pattern.addend is None:
        # The whole chain on the integers: one requantize of the folded accumulator.
        so, zo, out_dtype = quant.output
        ops.append(EpilogueOp("requantize", value=factor / so, zero_point=zo, dtype=out_dtype))
    else:
        if quant is not None or pattern.scale is not None:
            ops.append(EpilogueOp("scale", value=factor))
        if pattern.addend is not None:
            rows = batch * m if run_batch is None else run_batch * (batch * m)
            added = _addend(matches[pattern.addend], list(call.ty.shape), rows, n,
                            heads if y_inter else 1)
            if added is None:
                return None
            ops.append(added[0])
            extra.append(added[1])
        if requantize:
            so, zo, out_dtype = quant.output
            ops.append(EpilogueOp("requantize", value=1.0 / so, zero_point=zo, dtype=out_dtype))
    matched = tuple(ops)
    # A bf16 product read only by bf16 kernels (P @ V's context by the output projection)
    # writes bf16 itself, as bf16 dense layers do: they read it through a float32 view that
    # simplify_layouts cancels against their own cast.
    if dtype == "bfloat16" and _read_as_bf16(orig, read_by):
        ops.append(EpilogueOp("convert", dtype="bfloat16"))

    problem = BatchGemmProblem(batch, m, n, k, transposed, Epilogue(tuple(ops)), heads=heads,
                               x_interleaved=x_inter, b_interleaved=b_inter,
                               y_interleaved=y_inter, dtype=dtype,
                               zero_points=quant.zero_points if quant else (0, 0),
                               softmax=softmax is not None,
                               mask_fill=None if softmax is None else softmax.fill,
                               bf16_inputs=bf16_inputs)
    masks = () if softmax is None or softmax.mask is None else (relax.const(softmax.mask),)
    anchor = ("batch_matmul_qdq" if quant is not None else "batch_matmul" if softmax is None
              else f"{'masked_' if masks else ''}softmax+batch_matmul")
    return _Product(problem, x_src, b_src, masks, tuple(extra), run_batch, anchor, matched,
                    softmax)


def _rewrite(orig: relax.Expr, matches: Mapping[DFPattern, relax.Expr],
             pattern: _Chain, bindings: dict[relax.Var, relax.Expr],
             read_by: Callable[[relax.Expr], list[relax.Expr] | None], add_kernel: KernelAdder,
             target: Target, tuner: Tuner | None, report: list[Offload], dtype: str,
             attention: bool) -> relax.Expr:
    # Returning ``orig`` leaves the chain to a shorter pattern, to the next round or to TVM;
    # what stays is reported once, with _why_left().
    x = matches[pattern.matmul].args[0]
    if attention and not is_call_to(bindings.get(x, x), "relax.nn.softmax"):
        return orig  # the attention round takes only P @ V
    product = _product(orig, matches, pattern, bindings, read_by, dtype)
    if product is None:
        return orig
    isa = machine_of(target).isa
    batch_var = kernel_batch(product.run_batch is not None)
    prefix = "n" if product.run_batch is not None else ""
    if attention:
        fused = _attention(product, bindings, read_by, dtype)
        if fused is None:
            return orig
        scores, problem, biases = fused
        config = config_for(problem, target, tuner)
        name = f"tpp_attention_{prefix}{problem.name}"
        sch = attention_schedule(problem, config, isa, batch_var)
        q_shape, k_shape, v_shape, y_shape = attention_shapes(problem, product.run_batch)
        sp, cp = scores.problem, product.problem
        args = [_read(scores.x, q_shape, sp.x_dtype), _read(scores.b, k_shape, sp.io_dtype),
                _read(product.b, v_shape, cp.io_dtype), *product.masks, *biases,
                *scores.extra, *product.extra]
        anchor = product.anchor.replace("softmax+batch_matmul", "attention")
        op = (offload_name(anchor, (*scores.matched, *product.matched))
              + ("+key_bias" if biases else ""))
        shape = problem.shape
    else:
        problem = product.problem
        config = config_for(problem, target, tuner)
        name = f"tpp_batch_matmul_{prefix}{problem.name}"
        sch = schedule(problem, config, isa, batch_var)
        x_shape, b_shape, y_shape = stored_shapes(problem, product.run_batch)
        args = [_read(product.x, x_shape, problem.x_dtype),
                _read(product.b, b_shape, problem.io_dtype), *product.masks, *product.extra]
        op = offload_name(product.anchor, product.matched)
        shape = (problem.batch, problem.m, problem.n, problem.k)
    gv = add_kernel(sch.mod["main"], name)
    out = call_kernel(gv, args, y_shape, problem.out_dtype, product.run_batch)
    # Named by the matched chain, as dense layers are: the handoff's conversion is no op of it.
    report.append(Offload.routed(op, shape, name, dispatched_brgemm(sch), problem.flops))
    dims = list(orig.ty.shape)
    out = out if same_dims(dims, y_shape) else relax.op.reshape(out, dims)
    return relax.op.astype(out, "float32") if problem.out_dtype == "bfloat16" else out


def _attention(context: _Product, bindings: dict[relax.Var, relax.Expr],
               read_by: Callable[[relax.Expr], list[relax.Expr] | None], dtype: str
               ) -> tuple[_Product, AttentionProblem, tuple[relax.Expr, ...]] | None:
    """``P @ V`` whose ``P = softmax(scores)`` (perhaps masked) reads a product of two
    activations that nothing else reads, as one fused attention: the scores' product, the
    problem and its key bias argument (if any), else None."""
    softmax = context.softmax
    if softmax is None:
        return None
    value = bindings.get(softmax.scores)
    if value is None or any(len(read_by(v) or ()) != 1 for v in (value, *softmax.reads)):
        return None  # the scores (or the probabilities) are read elsewhere too
    for chain in _scores_chains():
        matches = chain.root.extract_matched_expr(value, bindings)
        if matches is None:
            continue
        scores = _product(value, matches, chain, bindings, read_by, dtype)
        key_bias = None
        if scores is None and chain.addend is not None:
            # No epilogue addend: perhaps a sample's key mask, which the kernel adds itself.
            key_bias = _key_bias(matches[chain.addend], value)
            if key_bias is not None:
                scores = _product(value, matches, replace(chain, addend=None), bindings,
                                  read_by, dtype)
        if scores is None:
            return None
        try:
            problem = AttentionProblem(scores.problem, context.problem,
                                       key_bias[0] if key_bias else 0)
        except ValueError:
            return None
        biases = () if key_bias is None else (
            _view(key_bias[1], problem.key_bias_shape(context.run_batch)),)
        return scores, problem, biases
    return None


def _key_bias(addend: relax.Expr, scores: relax.Expr) -> tuple[int, relax.Expr] | None:
    """``(heads, addend)`` when ``addend`` is a float32 ``[B, 1, ..., 1, S]`` tensor added to
    ``[B, H..., M, S]`` scores (BERT's padding mask: a row per sample, the same for its
    heads and queries), else None."""
    shape, dims = list(addend.ty.shape), list(scores.ty.shape)
    if (not isinstance(addend.ty, relax.TensorType) or addend.ty.dtype != "float32"
            or len(shape) != len(dims) or len(dims) < 3
            or not same_dims(shape[:1] + shape[-1:], dims[:1] + dims[-1:])
            or any(not isinstance(d, tvm.tirx.IntImm) or int(d) != 1 for d in shape[1:-1])
            or any(not isinstance(d, tvm.tirx.IntImm) for d in dims[1:])):
        return None
    return int(np.prod([int(d) for d in dims[1:-2]], dtype=np.int64)), addend


def _read_as_bf16(value: relax.Expr, read_by: Callable[[relax.Expr], list[relax.Expr] | None]
                  ) -> bool:
    """Whether every reader of ``value`` takes it only as bfloat16 (a kernel routed in bf16,
    :func:`~relay_passes.scaffold.reads_through_bf16_cast`), through reshapes and permutes."""
    found = read_by(value)
    return bool(found) and all(reads_through_bf16_cast(r)
                               or (moves_data(r) and _read_as_bf16(r, read_by)) for r in found)


@dataclass(frozen=True)
class _Softmax:
    """The left operand ``softmax(scores)`` over its last axis, the scores perhaps masked
    first: ``where(mask, scores, fill)`` with a constant mask, as ``[m, k]`` uint8.
    ``reads``: the bound values from the softmax down to the scores (the ``where``)."""

    scores: relax.Expr
    reads: tuple[relax.Expr, ...]
    mask: np.ndarray | None = None
    fill: float | None = None


def _softmax_of(expr: relax.Expr, bindings: dict[relax.Var, relax.Expr], m: int, k: int
                ) -> _Softmax | None:
    """``expr`` as a softmax over its last axis (of float32 scores, perhaps masked), else
    None."""
    value = bindings.get(expr, expr)
    if not is_call_to(value, "relax.nn.softmax"):
        return None
    rank = len(value.ty.shape)
    if int(value.attrs.axis) % rank != rank - 1 or value.args[0].ty.dtype != "float32":
        return None
    scores = value.args[0]
    where = bindings.get(scores, scores)
    if not is_call_to(where, "relax.where"):
        return _Softmax(scores, (value,))
    cond, *branches = where.args
    # A fill may be -inf (masked_fill's), not NaN.
    fills = [_scalar(b, infinite=True) if isinstance(b, tvm.ir.expr.Constant) else None
             for b in branches]
    mask = cond.value.numpy() if isinstance(cond, tvm.ir.expr.Constant) else None
    if mask is None or fills.count(None) != 1 or mask.ndim > rank or mask.ndim < 2 \
            or any(d != 1 for d in mask.shape[:-2]) or mask.shape[-2] not in (1, m) \
            or mask.shape[-1] not in (1, k):
        return _Softmax(scores, (value,))  # the where stays with TVM; the softmax folds
    kept = branches[fills.index(None)]
    if not same_dims(list(kept.ty.shape), list(where.ty.shape)):
        return _Softmax(scores, (value,))
    keep = mask.reshape(mask.shape[-2:]).astype(bool)
    if fills[0] is not None:  # where(mask, fill, scores)
        keep = ~keep
    fill = next(f for f in fills if f is not None)
    return _Softmax(kept, (value, where),
                    np.ascontiguousarray(np.broadcast_to(keep, (m, k)), np.uint8), fill)


@dataclass(frozen=True)
class _Quantization:
    """A QDQ matmul's integers: the product's scale ``sx sy``, the operands' zero points, and
    the output's quantization ``(scale, zero point, dtype)`` if the chain quantizes."""

    scale: float
    zero_points: tuple[int, int]
    output: tuple[float, int, str] | None


def _quantization(pattern: _Chain, matches: Mapping[DFPattern, relax.Expr]
                  ) -> _Quantization | None:
    """The quantization of a QDQ chain's match, or None when the kernel cannot take it:
    operands other than uint8 quantized per tensor, an output other than uint8/int8
    quantized per tensor."""
    scale, zero_points = 1.0, []
    for d in pattern.operands:
        q = matches[d.q]
        if not isinstance(q.ty, relax.TensorType) or q.ty.dtype != "uint8":
            return None
        s, z = (_integral_scalar(matches[c]) if c is d.zero_point else _scalar(matches[c])
                for c in (d.scale, d.zero_point))
        if s is None or z is None or not s > 0 or not 0 <= z <= 255:
            return None
        scale *= s
        zero_points.append(int(z))
    output = None
    if pattern.quantize is not None:
        out_dtype = str(matches[pattern.root].ty.dtype)
        so, zo = _scalar(matches[pattern.quantize[0]]), _integral_scalar(
            matches[pattern.quantize[1]])
        limits = {"uint8": (0, 255), "int8": (-128, 127)}.get(out_dtype)
        if so is None or zo is None or not so > 0 or limits is None or not (
                limits[0] <= zo <= limits[1]):
            return None
        output = (so, int(zo), out_dtype)
    return _Quantization(scale, tuple(zero_points), output)


def _integral_scalar(const) -> int | None:
    value = const.value.numpy()
    if value.size != 1 or value.dtype.kind not in "iu":
        return None
    return int(value.reshape(()))


def _addend(expr, out_shape: list, rows, n: int, heads: int):
    """(EpilogueOp, argument) adding ``expr`` to the ``[rows, heads * n]`` stored result, or
    None: a scalar or ``[N]`` constant (tiled over interleaved heads), an ``[N]`` tensor, or a
    tensor of the output's shape (not when the result is stored interleaved).  ``out_shape``
    and ``rows`` may hold a symbolic batch."""
    if isinstance(expr, tvm.ir.expr.Constant):
        value = expr.value.numpy()
        if value.dtype != np.float32:
            return None
        if value.size == 1:
            value = np.full(n, value.reshape(()), np.float32)
        if value.size == n and value.shape[-1] == n:
            row = np.tile(value.reshape(n), heads)
            return EpilogueOp("bias"), relax.const(np.ascontiguousarray(row))
        if value.shape == static_shape(out_shape) and heads == 1:
            return EpilogueOp("residual"), relax.const(value.reshape(rows, n))
        return None
    if _f32_batched(expr) is None or heads > 1:
        return None
    if same_dims(list(expr.ty.shape), out_shape):
        return EpilogueOp("residual"), _view(expr, (rows, n))
    shape = static_shape(expr.ty.shape)
    if shape is not None and shape[-1:] == (n,) and int(np.prod(shape)) == n:
        return EpilogueOp("bias"), _view(expr, (n,))
    return None


def _view(expr, shape: tuple):
    return expr if same_dims(list(expr.ty.shape), shape) else relax.op.reshape(expr, shape)


def _read(expr, shape: tuple, dtype: str):
    """An operand as its kernel reads it: in ``shape``, and cast to bf16 where the kernel
    takes a producer's bf16 (simplify_layouts cancels the cast against the producer's float32
    view)."""
    view = _view(expr, shape)
    return view if dtype == str(expr.ty.dtype) else relax.op.astype(view, dtype)


def _bf16_view(expr: relax.Expr, bindings: dict[relax.Var, relax.Expr]) -> bool:
    """Whether ``expr`` is a float32 view of a bf16 tensor: ``astype(v, "float32")`` of a
    bf16 ``v`` (a bf16 kernel's output handed over), through reshapes and split parts."""
    value = bindings.get(expr, expr)
    while is_call_to(value, "relax.reshape") or isinstance(value, relax.TupleGetItem):
        inner = value.tuple_value if isinstance(value, relax.TupleGetItem) else value.args[0]
        value = bindings.get(inner, inner)
        if is_call_to(value, "relax.split"):
            value = bindings.get(value.args[0], value.args[0])
    source = widened(value)
    return source is not None and str(source.ty.dtype) == "bfloat16"


def _why_left(call: relax.Call) -> str | None:
    """Why a matmul of two activations is still in the graph (None: a constant weight's)."""
    if isinstance(call.args[1], tvm.ir.expr.Constant):
        return None  # constant weights are the dense pass's to report
    return _unsupported(call) or "pattern not matched"
