"""Dense layers to TPP kernels: ``act(x @ W + b [+ r])`` with constant W becomes one call_tir.

Matches ``relax.matmul`` whose right operand is a constant (ONNX MatMul and Gemm, after
:func:`relay_passes.prepare.prepare` folded transposes of constants) together with the
epilogue that follows it: a constant bias over the output columns, a residual add of another
tensor of the output's shape, and ReLU / GELU / sigmoid.  The weights are packed at compile
time into the BRGEMM's blocked layout, the activations of rank > 2 are viewed as ``[M, K]``,
and the whole chain becomes one scheduled PrimFunc (:mod:`schedules.gemm`).

A symbolic first dimension (the batch) is a run-time loop extent of the kernel around static
blocks: a ``[n, S, K]`` input multiplies ``n`` samples of ``S`` rows; a ``[n, K]`` one blocks
of :data:`ROW_BLOCK` rows, its last block padded with zeros and the padding cropped from the
output.  What does not fit (non-float32, other symbolic sizes) is left to TVM's own lowering
and listed in the report with the reason; matmuls of two activations (attention's ``Q @ K^T``) are
:mod:`relay_passes.batch_matmul`'s.

Precision (:data:`PRECISIONS`): ``"float32"`` computes in float32; ``"bf16"`` multiplies in
bfloat16 accumulating in float32 (``vdpbf16ps`` on AVX-512 BF16, AMX ``tdpbf16ps`` for
tile-shaped blocks): the weights are rounded to bf16 (to nearest even) and packed in VNNI-2
groups at compile time, the activations are converted to bf16 right before the kernel, and
the epilogue (bias, residual, activation) and the output stay float32, so the rest of the
network does not change.  Convolutions (:mod:`relay_passes.conv`) and attention's batch
GEMMs (:mod:`relay_passes.batch_matmul`) take the same precision.

Examples
--------
>>> import numpy as np
>>> target = Target({"kind": "llvm", "keys": ["tpp", "cpu"], "model": "avx2"})
>>> x = relax.Var("x", relax.TensorType((5, 24), "float32"))
>>> bb = relax.BlockBuilder()
>>> with bb.function("main", [x]):
...     y = bb.emit(relax.op.matmul(x, relax.const(np.ones((24, 40), "float32"))))
...     _ = bb.emit_func_output(bb.emit(relax.op.nn.relu(y)))
>>> report = []
>>> mod = rewrite_dense(bb.get(), target, report)
>>> [(r.op, r.shape, r.kernel) for r in report]
[('matmul+relu', (5, 40, 24), 'tpp_dense_5x40x24_relu [...]')]
>>> report = []
>>> _ = rewrite_dense(bb.get(), target, report, precision="bf16")
>>> [(r.kernel.split()[0], r.dtypes, r.layout) for r in report]
[('tpp_dense_5x40x24_relu_bf16', 'bfloat16*bfloat16->float32', 'vnni2')]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern, is_const, is_op, wildcard
from tvm.target import Target

from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.machine import machine_of
from schedules.gemm import GemmConfig, GemmProblem, pack_weight, schedule
from schedules.tuner import TaskCollector, Tuner

from .layouts import selects_data
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
    same_dims,
    with_config,
)

if TYPE_CHECKING:  # annotations only
    from tvm import s_tir

    from .scaffold import EpiloguePattern, KernelAdder

__all__ = ["rewrite_dense", "PRECISIONS", "ROW_BLOCK", "DenseRows", "scheduled"]

#: ``precision`` of the dense layers -> the GEMM problem's dtype (X's, W's follows).
PRECISIONS: dict[str, str] = {"float32": "float32", "bf16": "bfloat16"}
#: Rows per run-time block of a ``[n, K]`` input with a symbolic ``n``: a register tile's
#: worth, so that batch 1 computes at most this many padded rows, and the weight panels
#: stay in cache across blocks anyway.
ROW_BLOCK = 8


@dataclass(frozen=True)
class DenseRows:
    """How a dense layer's ``[..., K]`` activation becomes its kernel's ``[rows, K]`` A: with a
    static shape, all rows at once (``m`` of them); with a symbolic batch, ``units`` run-time
    blocks of ``m`` rows: samples of a rank > 2 input, else :data:`ROW_BLOCK` rows of a
    matrix padded to whole blocks (the padding cropped from the result).

    Examples
    --------
    >>> from tvm import tirx
    >>> n = tirx.Var("n", "int64")
    >>> DenseRows.of([n, 5, 24]).m, DenseRows.of([n, 24]).padded, DenseRows.of([4, 24]).m
    (5, True, 4)
    """

    shape: tuple  # the activation's Relax shape
    m: int
    batch: tvm.ir.PrimExpr | None = None
    padded: bool = False

    @classmethod
    def of(cls, shape) -> DenseRows | None:
        """The rows of an activation of ``shape`` (None: symbolic beyond its batch, or not
        a matrix)."""
        batched = batched_shape(shape)
        if batched is None or len(batched[0]) < 2:
            return None
        sizes, batch = batched
        padded = batch is not None and len(sizes) == 2
        m = ROW_BLOCK if padded else int(np.prod(sizes[:-1]))
        return cls(tuple(shape), m, batch, padded)

    @property
    def units(self) -> tvm.ir.PrimExpr | None:
        """The kernel's run-time count of ``m``-row blocks (None: static)."""
        if self.batch is None:
            return None
        return tvm.tirx.floordiv(self.batch + self.m - 1, self.m) if self.padded else self.batch

    @property
    def rows(self) -> tvm.ir.PrimExpr | int:
        """Rows of the kernel's A and C."""
        return self.m if self.units is None else self.units * self.m

    @property
    def sample_rows(self) -> int:
        """Rows of one sample (what the report's FLOPs count for a symbolic batch)."""
        return 1 if self.padded else self.m

    def matrix(self, expr: relax.Expr, cols: int, dtype: str) -> relax.Expr:
        """``expr`` (of the activation's leading shape, ``cols`` columns of ``dtype``) as a
        ``[rows, cols]`` kernel operand: reshaped, or padded with zero rows to whole blocks."""
        if not self.padded:
            # A new expression's type is not inferred yet: it has the activation's shape.
            typed = isinstance(expr.ty, relax.TensorType) and expr.ty.shape is not None
            shape = list(expr.ty.shape) if typed else (*self.shape[:-1], cols)
            same = same_dims(shape, (self.rows, cols))
            return expr if same else relax.op.reshape(expr, (self.rows, cols))
        zeros = relax.op.zeros(relax.ShapeExpr([self.rows - self.batch, cols]), dtype)
        return relax.op.concat([expr, zeros], axis=0)

    def result(self, out: relax.Expr, cols: int) -> relax.Expr:
        """The kernel's ``[rows, cols]`` result in the activation's leading shape."""
        if self.padded:
            # In bounds by construction; unassumed, the shape would carry clamps that TVM's
            # FuseOps cannot type once the crop is fused with what reads it.
            return relax.op.strided_slice(out, axes=[0], begin=[0], end=[self.batch],
                                          assume_inbound=True)
        shape = (*self.shape[:-1], cols)
        return out if len(shape) == 2 else relax.op.reshape(out, shape)

    def name(self) -> str:
        """The kernel name's rows: ``n<m>`` for run-time blocks of m rows."""
        return str(self.m) if self.batch is None else f"n{self.m}"


def scheduled(problem: GemmProblem, target: Target, tuner: Tuner | TaskCollector | None,
              rows: DenseRows) -> tuple[s_tir.Schedule, GemmConfig]:
    """``problem`` scheduled with its configuration (a tuned one that splits the run-time
    row loop gives way to the default), taking ``rows``' run-time blocks if it has them."""
    batch = kernel_batch(rows.units is not None)
    return with_config(problem, target, tuner,
                       lambda config: schedule(problem, config, machine_of(target).isa, batch),
                       batch is not None)


@dataclass(frozen=True)
class _Matmul:
    """``x @ w`` or ``x @ permute_dims(w)`` (ONNX Gemm with ``transB``), ``w`` constant."""

    matmul: DFPattern
    x: DFPattern
    w: DFPattern
    w_transposed: DFPattern


def _matmul() -> _Matmul:
    x, w = wildcard(), is_const()
    wt = is_op("relax.permute_dims")(w)
    return _Matmul(is_op("relax.matmul")(x, w) | is_op("relax.matmul")(x, wt), x, w, wt)


def rewrite_dense(
    mod: tvm.IRModule, target: Target, report: list[Offload], tuner: Tuner | None = None,
    precision: str = "float32",
) -> tvm.IRModule:
    """Replace every float32 dense chain with a constant weight by a TPP kernel call.

    With a ``tuner`` each GEMM gets its tuned configuration (tuned now if its database does
    not know it yet); without one, the default heuristic's.  ``precision`` (a key of
    :data:`PRECISIONS`) is the type the GEMMs multiply in; inputs and outputs stay float32.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    dtype = PRECISIONS[precision]

    def make_rewriter(add_kernel, pattern, func):
        read_by, bound = readers(func), relax.analysis.get_var2val(func)
        return lambda orig, matches: _rewrite(orig, matches, pattern, add_kernel, target, tuner,
                                              report, dtype, read_by, bound)

    chains = epilogue_patterns(_matmul, spelled_out_gelu=True, root_of=lambda a: a.matmul)
    return offload_patterns(mod, chains, make_rewriter, report, "relax.matmul", _why_left)


def _unsupported(x: relax.Expr, weight: np.ndarray) -> str | None:
    """Why ``x @ weight`` cannot become a TPP kernel (None if it can)."""
    rows = DenseRows.of(x.ty.shape) if isinstance(x.ty, relax.TensorType) else None
    if rows is None:
        return "activation shape is symbolic beyond its batch, or not a matrix"
    shape = batched_shape(x.ty.shape)[0]
    if x.ty.dtype != "float32" or weight.dtype != np.float32:
        return f"dtype {x.ty.dtype} x {weight.dtype}: only float32 dense is routed to TPP"
    if weight.ndim != 2 or weight.shape[0] != shape[-1]:
        return f"weight of shape {weight.shape} is not a [K, N] matrix for this input"
    if weight.shape[1] == 1:
        return ONE_COLUMN
    if weight.shape[0] == 1:
        return ONE_TERM
    return None


#: Why a layer with one output column stays with TVM: it is a matrix-vector product, memory
#: bound, which TVM's GEMV schedule covers (the BRGEMM has no 1-wide register tile).
ONE_COLUMN = "N = 1: a matrix-vector product, left to TVM's GEMV schedule"
#: Why a layer with K = 1 stays with TVM: an outer product, no reduction for a BRGEMM.
ONE_TERM = "K = 1: an outer product (nothing to reduce), left to TVM's elementwise schedule"


def _rewrite(orig: relax.Expr, matches: Mapping[DFPattern, relax.Expr],
             pattern: EpiloguePattern[_Matmul], add_kernel: KernelAdder,
             target: Target, tuner: Tuner | None, report: list[Offload], dtype: str,
             read_by: Callable[[relax.Expr], list[relax.Expr] | None],
             bound: Mapping[relax.Var, relax.Expr]) -> relax.Expr:
    # Returning ``orig`` leaves the chain to a shorter pattern or to TVM; what stays is
    # reported once, with _why_left().
    mm = pattern.anchor
    x = matches[mm.x]
    weight = matches[mm.w].value.numpy()
    if mm.w_transposed in matches:
        weight = weight.T
    if _unsupported(x, weight) is not None or not pattern.constants_match(matches):
        return orig
    k, n = weight.shape
    out_shape = (*list(x.ty.shape)[:-1], n)
    bias = matches[pattern.bias].value.numpy() if pattern.bias is not None else None
    if bias is not None and (bias.size != n or bias.shape[-1] != n):
        return orig
    residual = matches[pattern.residual] if pattern.residual is not None else None
    if not pattern.residual_fits(matches, out_shape, bound):
        return orig

    rows = DenseRows.of(x.ty.shape)
    isa = machine_of(target).isa
    # Bound to the ISA: the operands' layout (VNNI, MMLA) is that of the ISA's kernels.
    epilogue = pattern.epilogue(matches)
    # A bf16 layer read only by bf16 layers writes bf16 itself (its epilogue converts); they
    # read it through a float32 view that simplify_layouts cancels against their own cast.
    found = read_by(orig) if dtype == "bfloat16" else None
    handoff = bool(found) and all(_reads_as_bf16_dense(r, read_by) for r in found)
    if handoff:
        epilogue = Epilogue((*epilogue.ops, EpilogueOp("convert", dtype="bfloat16")))
    problem = GemmProblem(rows.m, n, k, dtype, epilogue).on(isa)
    sch, config = scheduled(problem, target, tuner, rows)
    name = (f"tpp_dense_{rows.name()}x{n}x{k}"
            + (f"_{problem.epilogue.name}" if pattern.ops(matches) else "")
            + ("_bf16" if dtype == "bfloat16" else ""))
    gv = add_kernel(sch.mod["main"], name)

    x_matrix = rows.matrix(x, k, "float32")
    if dtype != "float32":
        # Cancelled against a bf16 producer's float32 view of its bf16 output (see above).
        x_matrix = relax.op.astype(x_matrix, dtype)
    args = [x_matrix, relax.const(pack_weight(weight.astype(np.float32), config.bn, problem))]
    if bias is not None:
        args.append(relax.const(bias.reshape(n).astype(np.float32)))
    if residual is not None:
        args.append(rows.matrix(residual, n, "float32"))
    out = call_kernel(gv, args, (rows.rows, n), problem.out_dtype, rows.units)
    packed = "" if config.pack_a is None else f" pack_a={config.pack_a}"
    # A symbolic batch counts the FLOPs of one sample (the share on kernels is the same).
    report.append(Offload.routed(pattern.name("matmul", matches), (rows.m, n, k),  # +bias+relu
                                 f"{name} [{config.spec}{packed}]", dispatched_brgemm(sch),
                                 problem.flops // rows.m * rows.sample_rows))
    out = rows.result(out, n)
    return relax.op.astype(out, "float32") if handoff else out


def _reads_as_bf16_dense(reader: relax.Expr,
                         read_by: Callable[[relax.Expr], list[relax.Expr] | None]) -> bool:
    """Whether ``reader`` is a dense layer this pass routes in bf16 (reading the value as its
    X), one it has routed already (reading it only through its bf16 cast, or that cast on
    its own), or a matmul of two activations, which the batch matmul pass multiplies in bf16
    reading a bf16 operand as it is (attention's Q, K and V) -- through reshapes, permutes
    and splits."""
    if is_call_to(reader, "relax.matmul"):
        x, w = reader.args
        if not isinstance(w, tvm.ir.expr.Constant):
            return not isinstance(x, tvm.ir.expr.Constant)
        return (isinstance(x, relax.Var) and w.ty.ndim == 2
                and _unsupported(x, w.value.numpy()) is None)
    if selects_data(reader):
        found = read_by(reader)
        return bool(found) and all(_reads_as_bf16_dense(r, read_by) for r in found)
    return reads_through_bf16_cast(reader)


def _why_left(call: relax.Call) -> str | None:
    """Why a matmul with a constant weight is still in the graph (None: not such a matmul)."""
    x, w = call.args
    if not isinstance(w, tvm.ir.expr.Constant):
        return None  # activations on both sides: relay_passes.batch_matmul reports these
    return _unsupported(x, w.value.numpy()) or "pattern not matched"
