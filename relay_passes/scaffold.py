"""What the three offload passes share: the report record, the epilogue patterns, the rewrite
loop, the leftover report and the marking of a scheduled PrimFunc as a kernel.

A pass (:mod:`~relay_passes.dense`, :mod:`~relay_passes.conv`,
:mod:`~relay_passes.batch_matmul`) lists its patterns longest first (:func:`epilogue_patterns`
builds the chains of an operator with bias, residual and activation) and runs them with
:func:`offload_patterns`: its callback turns one match into a ``call_tir`` of a kernel added with
:func:`add_kernel` (or returns the original chain, leaving it to a shorter pattern or to TVM),
and its reason function says why each of its operators still in the graph stayed with TVM.

Examples
--------
>>> from tvm.relax.dpl import is_const, is_op, wildcard
>>> chains = epilogue_patterns(lambda: is_op("relax.nn.conv2d")(wildcard(), is_const()))
>>> len(chains), chains[0].name("conv2d", {}), chains[-1].name("conv2d", {})
(28, 'conv2d+bias+residual+silu', 'conv2d')
>>> static_shape((2, 3)), Offload("matmul", (4, 8), reason="pattern not matched").kernel
((2, 3), None)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import tvm
from tvm import relax, s_tir
from tvm.relax.dpl import DFPattern, is_const, is_op, rewrite_call, wildcard
from tvm.target import Target

from microkernels.brgemm import DTYPES, BrgemmShape, find_impl
from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.machine import machine_of
from schedules.loop_spec import LoopSpecError
from schedules.ops import Config, Problem, op_of
from schedules.tuner import TaskCollector, Tuner, config_for

__all__ = [
    "ACTIVATIONS",
    "CLAMP",
    "GELU_SPELLED_OUT",
    "GELU_TANH_SPELLED_OUT",
    "SILU",
    "EpiloguePattern",
    "KernelAdder",
    "MakeRewriter",
    "Offload",
    "add_kernel",
    "batched_shape",
    "call_flops",
    "call_kernel",
    "depends_on",
    "dispatched_brgemm",
    "epilogue_patterns",
    "is_call_to",
    "is_tensor_of",
    "kernel_batch",
    "with_config",
    "offload_name",
    "offload_patterns",
    "only_reader",
    "report_leftovers",
    "same_dims",
    "tpp_flops_fraction",
    "rewrite_patterns",
    "static_shape",
]

#: Activations absorbed into a kernel's epilogue: relax op -> epilogue op.
ACTIVATIONS: Mapping[str, EpilogueOp] = {
    "relax.nn.relu": EpilogueOp("relu"),
    "relax.nn.gelu": EpilogueOp("gelu", variant="erf"),
    "relax.nn.gelu_tanh": EpilogueOp("gelu", variant="tanh"),
    "relax.sigmoid": EpilogueOp("sigmoid"),
}
#: ONNX exporters spell GELU out as ``x * (1 + erf(x / sqrt 2)) * 0.5``; this key names that
#: chain where a pass accepts it (its constants are checked against ``_GELU_CONSTANTS``).
GELU_SPELLED_OUT = "gelu_erf"
_GELU_CONSTANTS = (math.sqrt(2.0), 1.0, 0.5)  # the divisor, the one, the half
#: GPT-2's GELU, ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, spelled out (the cube a
#: ``power``; either operand order of every add and multiply): its constants are checked
#: against ``_GELU_TANH_CONSTANTS``.
GELU_TANH_SPELLED_OUT = "gelu_tanh"
_GELU_TANH_CONSTANTS = (3.0, 0.044715, math.sqrt(2 / math.pi), 1.0, 0.5)
_SPELLED_OUT_GELUS = {GELU_SPELLED_OUT: ("erf", _GELU_CONSTANTS),
                      GELU_TANH_SPELLED_OUT: ("tanh", _GELU_TANH_CONSTANTS)}
#: ``x * sigmoid(x)`` (SiLU, swish; EfficientNet's activation): the ``silu`` epilogue op.
SILU = "silu"
#: ``minimum(maximum(x, lo), hi)`` of scalar constants (ONNX Clip, e.g. MobileNet's ReLU6,
#: after :func:`relay_passes.prepare.te_extrema_to_ops`): the ``clamp`` epilogue op.
CLAMP = "clamp"
#: How every BRGEMM intrinsic's name starts (:attr:`microkernels.brgemm.BrgemmShape.name`).
_BRGEMM_PREFIX = "tpp_brgemm_"
# relax OpPatternKind::kOpaque: FuseOps fuses nothing into (or around) such a function.
_OP_PATTERN_OPAQUE = 8

Anchor = TypeVar("Anchor")
Built = TypeVar("Built")


@dataclass(frozen=True)
class Offload:
    """One GEMM-like operator: the kernel it became, or why it stayed with TVM.

    ``shape`` is the problem's (e.g. ``(m, n, k)`` of a dense layer) when offloaded, the
    output shape otherwise.  ``isa``, ``dtypes`` and ``layout`` describe the BRGEMM the
    kernel calls (None for what stayed with TVM, and for a kernel without one): the ISA whose
    implementation :func:`microkernels.brgemm.find_impl` picked for it (``"amx"`` only where
    the AMX tile kernel runs: a block that is not tile-shaped gets the AVX-512 one), its
    operand types as ``A*B->C`` and its layout of B (:data:`microkernels.brgemm.LAYOUTS`).
    Build offloaded records with :meth:`routed`, from the BRGEMM the schedule tensorized with
    (:func:`dispatched_brgemm`).  ``flops`` counts the operator's multiply-adds twice (None:
    a symbolic shape); :func:`tpp_flops_fraction` is the share the kernels compute.

    Examples
    --------
    >>> Offload("matmul+bias", (4, 40, 24), kernel="tpp_dense_4x40x24_bias").reason is None
    True
    """

    op: str
    shape: tuple[int, ...]
    kernel: str | None = None
    reason: str | None = None
    isa: str | None = None
    dtypes: str | None = None
    layout: str | None = None
    flops: int | None = None

    @classmethod
    def routed(cls, op: str, shape: tuple[int, ...], kernel: str, brgemm: BrgemmShape | None,
               flops: int | None = None) -> Offload:
        """The record of an operator that became ``kernel``, which calls ``brgemm`` (None: no
        BRGEMM, e.g. a conv whose blocks are all 1, computed by scalar code).

        Examples
        --------
        >>> o = Offload.routed("matmul", (4, 40, 24), "tpp_dense_4x40x24",
        ...                    BrgemmShape(4, 40, 24, isa="amx"))
        >>> o.isa, o.dtypes, o.layout  # float32: AMX has no fp32 tiles, AVX-512 runs it
        ('avx512', 'float32*float32->float32', 'flat')
        >>> tile = BrgemmShape(32, 32, 64, 8, "uint8", "int32", "vnni4", isa="amx")
        >>> o = Offload.routed("matmul", (64, 64, 512), "tpp_dense_64x64x512", tile)
        >>> o.isa, o.dtypes, o.layout
        ('amx', 'uint8*int8->int32', 'vnni4')
        """
        if brgemm is None:
            return cls(op, shape, kernel, flops=flops)
        return cls(op, shape, kernel, isa=_impl_isa(brgemm),
                   dtypes=f"{brgemm.dtype_a}*{brgemm.dtype_b}->{brgemm.dtype_acc}",
                   layout=brgemm.layout, flops=flops)


def call_flops(call: relax.Call) -> int | None:
    """Twice the multiply-adds of a ``matmul``, ``conv2d`` or ``conv2d_transpose`` call (None:
    a shape symbolic beyond its batch, or another operator): what :attr:`Offload.flops` counts
    for the operators left to TVM.  A symbolic batch counts one sample, as the kernels do.

    Examples
    --------
    >>> x = relax.Var("x", relax.TensorType((1, 8, 9, 9), "float32"))
    >>> w = relax.Var("w", relax.TensorType((16, 2, 3, 3), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x, w]):
    ...     y = bb.emit(relax.op.nn.conv2d(x, w, padding=1, groups=4))
    ...     _ = bb.emit_func_output(y)
    >>> call_flops(bb.get()["main"].body.blocks[0].bindings[0].value)  # 2 * 16*81 * 2*3*3
    46656
    """
    def sizes(ty: Any) -> tuple[int, ...] | None:
        batched = batched_shape(ty.shape) if isinstance(ty, relax.TensorType) else None
        return None if batched is None else batched[0]

    out = sizes(call.ty)
    reduced = sizes(call.args[1].ty) if len(call.args) > 1 else None
    if out is None or reduced is None:
        return None
    if is_call_to(call, "relax.matmul"):
        x = sizes(call.args[0].ty)
        return None if x is None else 2 * math.prod(out) * x[-1]
    if is_call_to(call, "relax.nn.conv2d"):
        return 2 * math.prod(out) * math.prod(reduced[1:])  # OIHW: I is C/groups already
    if is_call_to(call, "relax.nn.conv2d_transpose"):  # each input pixel scatters its taps
        x = sizes(call.args[0].ty)
        return None if x is None else 2 * math.prod(x) * math.prod(reduced[1:])  # IOHW
    return None


def tpp_flops_fraction(report: Sequence[Offload]) -> float | None:
    """The share of the reported operators' FLOPs that TPP kernels compute (None: nothing
    with a known count was reported).

    >>> tpp_flops_fraction([Offload("matmul", (4, 4, 4), "k", flops=128),
    ...                     Offload("conv2d", (1, 4, 2, 2), reason="r", flops=32)])
    0.8
    """
    counted = [o for o in report if o.flops is not None]
    total = sum(o.flops for o in counted)
    return sum(o.flops for o in counted if o.kernel) / total if total else None


@functools.lru_cache(maxsize=1024)
def _impl_isa(brgemm: BrgemmShape) -> str:
    # find_impl builds the impl function (a TVMScript parse); networks repeat their blocks.
    return find_impl(brgemm)[0]


def dispatched_brgemm(sch: s_tir.Schedule) -> BrgemmShape | None:
    """The BRGEMM a scheduled kernel was tensorized with (None: it calls none).

    Read from the schedule's trace, not re-derived from the template's config, so the report
    names what the template really dispatched (it may pick another ISA's kernel for a block,
    e.g. AVX-512 for a copied bf16 A on AMX).  The intrinsic's name is
    :attr:`BrgemmShape.name`, ``tpp_brgemm_<isa>_<dtype of A>_<layout>_<m>x<n>x<k>x<batch>``
    (``_beta0`` after it for a kernel that overwrites C, ``_beta0first`` for one that does
    on its first call, then ``_batcheda`` for one whose A blocks lie apart, ``_skips`` for
    one that leaves some of them out, ``_edges<k>`` for one whose edge rows leave out their
    edge of K).

    Examples
    --------
    >>> from microkernels.brgemm import desc_func, dispatch
    >>> shape = BrgemmShape(8, 16, 4, 2, "uint8", "int32", "vnni4_w7", "avx512_bf16")
    >>> sch = s_tir.Schedule(desc_func(shape, as_workload=True))
    >>> sch.tensorize(sch.get_loops(sch.get_sblock("brgemm"))[0], dispatch(shape))
    >>> dispatched_brgemm(sch) == shape
    True
    """
    names = [str(inst.attrs[0]) for inst in sch.trace.insts if inst.kind.name == "Tensorize"]
    if not names:
        return None
    name = names[-1]
    variant = {"beta0": {"beta": 0}, "beta0first": {"first_call_zeroes": True},
               "batcheda": {"batched_a": True}, "skips": {"skips_blocks": True}}
    head, _, dims = name.removeprefix(_BRGEMM_PREFIX).rpartition("_")
    flags: dict[str, Any] = {}
    while dims in variant or dims.startswith("edges"):  # the suffixes after the dimensions
        flags.update(variant.get(dims) or {"edge_k": int(dims.removeprefix("edges"))})
        head, _, dims = head.rpartition("_")
    for dtype_a, dtype_acc in DTYPES:
        isa, found, layout = head.partition(f"_{dtype_a}_")
        if found:
            m, n, k, batch = (int(d) for d in dims.split("x"))
            shape = BrgemmShape(m, n, k, batch, dtype_a, dtype_acc, layout, isa, **flags)
            if shape.name == name:
                return shape
    raise ValueError(f"{name!r} is not the name of a BRGEMM intrinsic")



def static_shape(shape: Any) -> tuple[int, ...] | None:
    """A Relax shape as ints, or None when any dimension is symbolic.

    Examples
    --------
    >>> from tvm import tirx
    >>> static_shape([4, 8]), static_shape([tirx.Var("n", "int64"), 8])
    ((4, 8), None)
    """
    try:
        return tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        return None


def batched_shape(shape: Any) -> tuple[tuple[int, ...], tvm.ir.PrimExpr | None] | None:
    """A Relax shape as static sizes and its run-time batch: ``(sizes, None)`` when it is
    static, ``((1, *rest), batch)`` when only its first dimension is symbolic (the kernels
    then loop over that many copies of the static rest), None otherwise.

    Examples
    --------
    >>> from tvm import tirx
    >>> n = tirx.Var("n", "int64")
    >>> batched_shape([4, 8]), batched_shape([n, 8]), batched_shape([8, n])
    (((4, 8), None), ((1, 8), n), None)
    """
    if shape is None:
        return None
    dims = list(shape)
    sizes = static_shape(dims)
    if sizes is not None:
        return sizes, None
    rest = static_shape(dims[1:])
    return None if not dims or rest is None else ((1, *rest), dims[0])


def kernel_batch(run_time: bool) -> tvm.tirx.Var | None:
    """A kernel's own run-time batch parameter (None for a static kernel): an int32, like the
    kernels' static extents, which :func:`call_kernel` passes the graph's size to.

    Examples
    --------
    >>> str(kernel_batch(True).ty), kernel_batch(False)
    ('int32', None)
    """
    return tvm.tirx.Var("batch", "int32") if run_time else None


def with_config(problem: Problem, target: Target, tuner: Tuner | TaskCollector | None,
                build: Callable[[Config], Built], run_time_batch: bool) -> tuple[Built, Config]:
    """``build(config)`` with ``problem``'s configuration (:func:`schedules.tuner.config_for`)
    and that configuration; for a kernel with a run-time batch, a tuned nest that would split
    the batch loop (the schedule's LoopSpecError) gives way to the untuned default, which
    never does.

    Examples
    --------
    >>> from schedules.gemm import GemmProblem
    >>> target = Target({"kind": "llvm", "keys": ["tpp", "cpu"], "model": "avx2"})
    >>> _, config = with_config(GemmProblem(8, 40, 24), target, None, lambda c: None, True)
    >>> config.spec
    'CBa'
    """
    config = config_for(problem, target, tuner)
    try:
        return build(config), config
    except LoopSpecError:
        if not run_time_batch:
            raise
        config = op_of(problem).default(problem, machine_of(target))
        return build(config), config


def call_kernel(kernel: tvm.ir.GlobalVar, args: Sequence[relax.Expr], shape: Sequence[Any],
                dtype: str, batch: tvm.ir.PrimExpr | None = None) -> relax.Call:
    """``call_tir`` of a kernel writing a ``shape`` tensor of ``dtype``; a kernel built for a
    run-time batch (its parameter before the output) is passed ``batch``, the graph's
    symbolic size.

    Examples
    --------
    >>> from tvm import tirx
    >>> gv, n = tvm.ir.GlobalVar("k"), tirx.Var("n", "int64")
    >>> call = call_kernel(gv, [], [n * 4, 8], "float32", n)
    >>> call.ty_args[0]
    R.Tensor((n * 4, 8), dtype="float32")
    """
    # The kernels' batch parameter is an int32 like their static extents (index arithmetic
    # of one type); Relax's shapes are int64.
    extra = [] if batch is None else [relax.prim_value(tvm.tirx.Cast("int32", batch))]
    return relax.call_tir(kernel, [*args, *extra], relax.TensorType(list(shape), dtype))


def readers(func: relax.Function) -> Callable[[relax.Expr], list[relax.Expr] | None]:
    """For a value bound in ``func``: the bound values that read it (one entry per read), or
    None when the function returns it or it is not bound (a reader no pass can see).

    Examples
    --------
    >>> x = relax.Var("x", relax.TensorType((2,), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     with bb.dataflow():
    ...         a = bb.emit(relax.op.add(x, x))
    ...         b = bb.emit_output(relax.op.multiply(a, a))
    ...     _ = bb.emit_func_output(b)
    >>> func = bb.get()["main"]
    >>> bound = relax.analysis.get_var2val(func)
    >>> [r.op.name for r in readers(func)(bound[a])], readers(func)(bound[b])
    (['relax.multiply', 'relax.multiply'], None)
    """
    bound = relax.analysis.get_var2val(func)
    reads: dict[relax.Var, list[relax.Expr]] = {var: [] for var in bound}
    for value in bound.values():
        relax.analysis.post_order_visit(
            value, lambda e, v=value: reads[e].append(v) if e in reads else None)
    returned: set[relax.Var] = set()
    relax.analysis.post_order_visit(func.body.body, lambda e: returned.add(e)
                                    if isinstance(e, relax.Var) else None)
    var_of = {value: var for var, value in bound.items()}

    def of(value: relax.Expr) -> list[relax.Expr] | None:
        var = var_of.get(value)
        return None if var is None or var in returned else reads[var]

    return of


def only_reader(reads: list[relax.Expr] | None, value: relax.Expr) -> bool:
    """Whether ``reads`` (a :func:`readers` answer) is ``value`` alone: nothing else, and not
    the function's result, sees what was read.

    >>> x = relax.Var("x", relax.TensorType((2,), "float32"))
    >>> y = relax.op.add(x, x)
    >>> only_reader([y], y), only_reader([y, y], y), only_reader(None, y)
    (True, False, False)
    """
    return reads is not None and len(reads) == 1 and reads[0].same_as(value)


def reads_through_bf16_cast(reader: relax.Expr) -> bool:
    """Whether ``reader`` takes a value only as bfloat16, so a producer may hand it over in
    bf16 already: a cast ``astype(v, "bfloat16")`` (the input of a bf16 kernel routed before
    its producer, bound on its own), or a kernel call a pass emitted that reads every
    variable it reads only cast to bfloat16, ``astype(v, "bfloat16")`` or
    ``astype(reshape(v), "bfloat16")``."""
    if _is_bf16_cast(reader):
        return True
    uses: list[relax.Var] = []
    casts: list[relax.Var] = []

    def visit(e: relax.Expr) -> None:
        if isinstance(e, relax.Var):
            uses.append(e)
        elif _is_bf16_cast(e):
            source = e.args[0]
            if is_call_to(source, "relax.reshape"):
                source = source.args[0]
            if isinstance(source, relax.Var):
                casts.append(source)

    relax.analysis.post_order_visit(reader, visit)
    return (is_call_to(reader, "relax.call_tir") and bool(casts)
            and sorted(map(id, uses)) == sorted(map(id, casts)))


def _is_bf16_cast(e: relax.Expr) -> bool:
    return is_call_to(e, "relax.astype") and str(e.attrs.dtype) == "bfloat16"


def depends_on(expr: relax.Expr, target: relax.Expr,
               bound: Mapping[relax.Var, relax.Expr]) -> bool:
    """Whether computing ``expr`` reads ``target``, through the bindings ``bound``.

    Examples
    --------
    >>> x = relax.Var("x", relax.TensorType((2,), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     a = bb.emit(relax.op.exp(x))
    ...     b = bb.emit(relax.op.add(a, x))
    ...     _ = bb.emit_func_output(b)
    >>> bound = relax.analysis.get_var2val(bb.get()["main"])
    >>> depends_on(b, bound[a], bound), depends_on(x, bound[a], bound)
    (True, False)
    """
    seen: set[relax.Var] = set()
    stack, found = [expr], False

    def visit(e: relax.Expr) -> None:
        nonlocal found
        found = found or e.same_as(target)
        if isinstance(e, relax.Var) and e in bound and e not in seen:
            seen.add(e)
            stack.append(bound[e])

    while stack and not found:
        relax.analysis.post_order_visit(stack.pop(), visit)
    return found


def is_call_to(expr: relax.Expr, name: str) -> bool:
    """Whether ``expr`` calls the Relax operator ``name`` (e.g. ``"relax.matmul"``).

    Examples
    --------
    >>> x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    >>> is_call_to(relax.op.permute_dims(x), "relax.permute_dims"), is_call_to(x, "relax.add")
    (True, False)
    """
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name


def is_tensor_of(expr: relax.Expr, shape: tuple[int, ...]) -> bool:
    """Whether ``expr`` is a float32 tensor of ``shape`` computed by the graph (no constant):
    what a kernel accepts as a residual operand.

    Examples
    --------
    >>> x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    >>> is_tensor_of(x, (2, 3)), is_tensor_of(x, (3, 2))
    (True, False)
    """
    return (not isinstance(expr, tvm.ir.expr.Constant)
            and isinstance(expr.ty, relax.TensorType)
            and expr.ty.shape is not None and same_dims(list(expr.ty.shape), shape)
            and expr.ty.dtype == "float32")


def same_dims(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two shapes are equal dimension by dimension, static sizes or symbolic.

    Examples
    --------
    >>> from tvm import tirx
    >>> n = tirx.Var("n", "int64")
    >>> same_dims([n * 4, 8], [n * 4, 8]), same_dims([n, 8], [4, 8])
    (True, False)
    """
    analyzer = tvm.sym.Analyzer()
    return len(a) == len(b) and all(analyzer.can_prove_equal(x, y)
                                    for x, y in zip(a, b, strict=True))


def _add_patterns(node: DFPattern, with_bias: bool,
                 with_residual: bool) -> tuple[DFPattern, DFPattern | None, DFPattern | None]:
    """``node``, then optionally ``+ constant bias``, then optionally ``+ residual`` tensor
    (either operand order): returns the pattern and the bias and residual sub-patterns.

    Examples
    --------
    >>> _, bias, residual = _add_patterns(wildcard(), with_bias=True, with_residual=False)
    >>> bias is not None, residual
    (True, None)
    """
    bias = residual = None
    if with_bias:
        bias = is_const()
        node = is_op("relax.add")(node, bias) | is_op("relax.add")(bias, node)
    if with_residual:
        residual = wildcard()
        node = is_op("relax.add")(node, residual) | is_op("relax.add")(residual, node)
    return node, bias, residual


@dataclass(frozen=True)
class EpiloguePattern(Generic[Anchor]):
    """An anchor operator (matmul, conv2d) followed by ``+ bias``, ``+ residual`` and an
    activation, each optional: the pattern ``root`` to match and the parts to read a match by.

    ``anchor`` holds the pass's own sub-patterns of the anchor operator (its operands),
    ``result`` the pattern of the anchor's result among them.
    """

    root: DFPattern
    anchor: Anchor
    result: DFPattern
    bias: DFPattern | None
    residual: DFPattern | None
    activation: str | None
    constants: tuple[DFPattern, ...] = ()  # of a spelled-out GELU; a clamp's bounds

    def ops(self, matches: Mapping[DFPattern, relax.Expr]) -> tuple[EpilogueOp, ...]:
        """The epilogue this chain computes, in order (a clamp's bounds from ``matches``)."""
        ops = [EpilogueOp(kind) for kind, part in (("bias", self.bias),
                                                   ("residual", self.residual))
               if part is not None]
        if self.activation in _SPELLED_OUT_GELUS:
            ops.append(EpilogueOp("gelu", variant=_SPELLED_OUT_GELUS[self.activation][0]))
        elif self.activation == CLAMP:
            lo, hi = (_scalar(matches[c]) for c in self.constants)
            ops.append(EpilogueOp("clamp", lo=lo, hi=hi))
        elif self.activation == SILU:
            ops.append(EpilogueOp("silu"))
        elif self.activation:
            ops.append(ACTIVATIONS[self.activation])
        return tuple(ops)

    def epilogue(self, matches: Mapping[DFPattern, relax.Expr]) -> Epilogue:
        """:meth:`ops` as the kernel's :class:`~microkernels.epilogue.Epilogue`."""
        return Epilogue(self.ops(matches))

    def name(self, anchor_op: str, matches: Mapping[DFPattern, relax.Expr]) -> str:
        """The report's name of the chain, e.g. ``matmul+bias+gelu_erf``."""
        return offload_name(anchor_op, self.ops(matches))

    def residual_fits(self, matches: Mapping[DFPattern, relax.Expr], shape: tuple[int, ...],
                      bound: Mapping[relax.Var, relax.Expr]) -> bool:
        """Whether the matched residual, where the chain has one, is a float32 graph tensor
        of the output's ``shape`` (see :func:`is_tensor_of`) that is not computed from the
        anchor's own result (``h + f(h)``, e.g. a GELU's ``h + 0.044715 h^3`` whose constants
        are not GELU's: as a residual, ``h`` would be computed twice); ``bound`` is the
        function's bindings (:func:`relax.analysis.get_var2val`)."""
        if self.residual is None:
            return True
        residual = matches[self.residual]
        return (is_tensor_of(residual, shape)
                and not depends_on(residual, matches[self.result], bound))

    def constants_match(self, matches: Mapping[DFPattern, relax.Expr]) -> bool:
        """Whether the matched constants are what the activation needs: GELU's own for a
        spelled-out GELU, float32 scalars ``lo <= hi`` for a clamp."""
        values = [_scalar(matches[c]) for c in self.constants]
        if self.activation == CLAMP:
            return (None not in values and values[0] <= values[1]
                    and all(str(matches[c].ty.dtype) == "float32" for c in self.constants))
        if self.activation not in _SPELLED_OUT_GELUS:
            return True
        wanted = _SPELLED_OUT_GELUS[self.activation][1]
        return all(value is not None and abs(value - want) <= 1e-6 * want
                   for value, want in zip(values, wanted, strict=True))


def offload_name(anchor_op: str, ops: Iterable[EpilogueOp]) -> str:
    """The report's name of an anchor operator with its epilogue.

    Examples
    --------
    >>> offload_name("batch_matmul", [EpilogueOp("scale", value=0.5)])
    'batch_matmul+scale'
    """
    return "+".join([anchor_op, *(o.tag for o in ops)])


def _scalar(const: relax.Expr) -> float | None:
    """A constant's one value (None: it holds several)."""
    value = const.value.numpy()
    return float(value.reshape(-1)[0]) if value.size == 1 else None


def _silu(node: DFPattern) -> DFPattern:
    # The same sub-pattern twice: both operands must be the one matched expression.
    gate = is_op("relax.sigmoid")(node)
    return is_op("relax.multiply")(node, gate) | is_op("relax.multiply")(gate, node)


def _clamp(node: DFPattern) -> tuple[DFPattern, tuple[DFPattern, ...]]:
    lo, hi = is_const(), is_const()
    return is_op("relax.minimum")(is_op("relax.maximum")(node, lo), hi), (lo, hi)


def _gelu_spelled_out(node: DFPattern) -> tuple[DFPattern, tuple[DFPattern, ...]]:
    div, one, half = is_const(), is_const(), is_const()
    erf = is_op("relax.erf")(is_op("relax.divide")(node, div))
    gelu = is_op("relax.multiply")(is_op("relax.multiply")(node, is_op("relax.add")(erf, one)),
                                   half)
    return gelu, (div, one, half)


def _gelu_tanh_spelled_out(node: DFPattern) -> tuple[DFPattern, tuple[DFPattern, ...]]:
    three, coef, sqrt_2_pi, one, half = (is_const() for _ in range(5))

    def mul(a: DFPattern, b: DFPattern) -> DFPattern:
        return is_op("relax.multiply")(a, b) | is_op("relax.multiply")(b, a)

    def add(a: DFPattern, b: DFPattern) -> DFPattern:
        return is_op("relax.add")(a, b) | is_op("relax.add")(b, a)

    # ``node`` recurs: every use must be the one matched expression.
    cubic = mul(is_op("relax.power")(node, three), coef)
    one_plus = add(is_op("relax.tanh")(mul(add(node, cubic), sqrt_2_pi)), one)
    return mul(mul(node, half), one_plus), (three, coef, sqrt_2_pi, one, half)


def epilogue_patterns(make_anchor: Callable[[], Anchor],
                      spelled_out_gelu: bool = False,
                      root_of: Callable[[Anchor], DFPattern] | None = None,
                      ) -> list[EpiloguePattern[Anchor]]:
    """Every chain of a fresh anchor and an epilogue, longest first so that the whole epilogue
    is taken before its prefixes.

    ``make_anchor()`` builds the anchor's sub-patterns (a new set per chain); ``root_of`` gives
    the pattern of the anchor's result in them (the sub-patterns themselves by default).  With
    ``spelled_out_gelu`` the GELUs ONNX exporters write out in elementwise ops (erf and tanh)
    are activations too (after the relax ones, before none).
    """
    # SiLU before sigmoid: x * sigmoid(x) would otherwise leave its multiply outside.
    activations = (SILU, *ACTIVATIONS, CLAMP,
                   *(_SPELLED_OUT_GELUS if spelled_out_gelu else ()), None)
    out = []
    for activation in activations:
        for with_residual in (True, False):
            for with_bias in (True, False):
                anchor = make_anchor()
                result = anchor if root_of is None else root_of(anchor)
                node, bias, residual = _add_patterns(result, with_bias, with_residual)
                constants: tuple[DFPattern, ...] = ()
                if activation == GELU_SPELLED_OUT:
                    node, constants = _gelu_spelled_out(node)
                elif activation == GELU_TANH_SPELLED_OUT:
                    node, constants = _gelu_tanh_spelled_out(node)
                elif activation == CLAMP:
                    node, constants = _clamp(node)
                elif activation == SILU:
                    node = _silu(node)
                elif activation:
                    node = is_op(activation)(node)
                out.append(EpiloguePattern(node, anchor, result, bias, residual, activation,
                                           constants))
    return out


#: ``add_kernel(func, name)``: add a scheduled PrimFunc to the module being rewritten, as a
#: kernel (see :func:`add_kernel`), and get its GlobalVar for ``call_tir``.
KernelAdder = Callable[[tvm.tirx.PrimFunc, str], tvm.ir.GlobalVar]
#: ``make_rewriter(add_kernel, pattern, func)``: the ``rewrite_call`` callback of one pattern
#: in one Relax function.
MakeRewriter = Callable[[KernelAdder, Any, relax.Function], Callable]


def rewrite_patterns(mod: tvm.IRModule, patterns: Iterable[Any],
                     make_rewriter: MakeRewriter) -> tvm.IRModule:
    """``mod`` with every Relax function rewritten by each pattern in turn (``rewrite_call``).

    Each pattern has a ``root``.  ``make_rewriter(add_kernel, pattern, func)`` gives the
    callback for one pattern in one function (as rewritten by the patterns before it); the
    kernels it adds with ``add_kernel(func, name)`` land in the returned module.  Dead bindings
    are left for the caller's DeadCodeElimination.
    """
    builder = relax.BlockBuilder(mod)
    adder = functools.partial(add_kernel, builder)
    functions = {gv: f for gv, f in mod.functions.items() if isinstance(f, relax.Function)}
    for pattern in patterns:
        functions = {gv: rewrite_call(pattern.root, make_rewriter(adder, pattern, f), f)
                     for gv, f in functions.items()}
    new_mod = builder.get()  # after the rewrites: it holds the kernels they added
    for gv, f in functions.items():
        new_mod[gv] = f
    return new_mod


def offload_patterns(
    mod: tvm.IRModule,
    patterns: Iterable[Any],
    make_rewriter: MakeRewriter,
    report: list[Offload],
    op_name: str,
    reason: Callable[[relax.Call], str | None],
    then: Callable[[tvm.IRModule], tvm.IRModule] | None = None,
) -> tvm.IRModule:
    """One offload pass: :func:`rewrite_patterns`, then ``then`` (a clean-up of what the
    rewrites left), dead bindings removed, and :func:`report_leftovers` of the calls of
    ``op_name`` left with their ``reason``."""
    new_mod = rewrite_patterns(mod, patterns, make_rewriter)
    if then is not None:
        new_mod = then(new_mod)
    new_mod = relax.transform.DeadCodeElimination()(new_mod)
    report_leftovers(new_mod, report, op_name, reason)
    return new_mod


def map_functions(mod: tvm.IRModule,
                  rewrite: Callable[[relax.Function], relax.Expr]) -> tvm.IRModule:
    """A copy of ``mod`` with each Relax function replaced by ``rewrite(function)``; the
    caller's module stays as it was.

    >>> from tvm.script import relax as R
    >>> @R.function
    ... def main(x: R.Tensor((2,), "float32")) -> R.Tensor((2,), "float32"):
    ...     return x
    >>> mod = tvm.IRModule({"main": main})
    >>> out = map_functions(mod, lambda f: f.with_attr("rewritten", True))
    >>> ["rewritten" in m["main"].attrs for m in (out, mod)]
    [True, False]
    """
    mod = mod.clone()
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gv] = rewrite(func)
    return mod


def rewrite_static_functions(mod: tvm.IRModule, mutator: relax.PyExprMutator,
                             pending: dict) -> tvm.IRModule:
    """``mod`` with each Relax function of static shapes visited by ``mutator``, kept where
    the visit left ``pending`` (the mutator's record of its planned rewrites) empty.

    A function re-emitted without changes, or one with symbolic shapes, could lose where a
    shape expression is computed (NonMaxSuppression's "8 * s * s_1 has not been computed"):
    such functions stay as they are.  ``pending`` is cleared after each function.
    """
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function) and not relax.analysis.defined_symbolic_vars(func):
            new_func = mutator.visit_expr(func)
            if pending:
                mutator.builder_.update_func(gv, new_func)
                pending.clear()
    return mutator.builder_.get()


def visit_binding_replaced(mutator: relax.PyExprMutator, binding: relax.VarBinding,
                           replace: Mapping[relax.Var, relax.Expr]) -> None:
    """``mutator``'s visit of ``binding``, with ``replace[binding.var]`` as the value where
    there is one, bound to the same variable (so its readers need no remapping)."""
    if binding.var not in replace:
        relax.PyExprMutator.visit_var_binding_(mutator, binding)
        return
    value = mutator.builder_.normalize(replace[binding.var])
    mutator.builder_.emit_normalized(relax.VarBinding(binding.var, value))


def add_kernel(builder: relax.BlockBuilder, func: tvm.tirx.PrimFunc,
               name: str) -> tvm.ir.GlobalVar:
    """Add the scheduled PrimFunc ``func`` to ``builder``'s module as the kernel ``name``.

    It is marked opaque, so that FuseOps fuses no neighbour into it, and scheduled, so that
    the fallback schedules leave it alone; its ``global_symbol`` goes (the module names it).
    An identical kernel already added is reused.
    """
    kernel = func.without_attr("global_symbol").with_attrs(
        {"op_pattern": _OP_PATTERN_OPAQUE, "tirx.is_scheduled": True})
    return builder.add_func(kernel, name)


def report_leftovers(mod: tvm.IRModule, report: list[Offload], op_name: str,
                     reason: Callable[[relax.Call], str | None]) -> None:
    """Report every call of the operator ``op_name`` still in ``mod``'s Relax functions as
    left to TVM, with ``reason(call)``; a call whose reason is None is another pass's.

    Examples
    --------
    >>> x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    >>> bb = relax.BlockBuilder()
    >>> with bb.function("main", [x]):
    ...     _ = bb.emit_func_output(bb.emit(relax.op.matmul(x, relax.op.permute_dims(x))))
    >>> report = []
    >>> report_leftovers(bb.get(), report, "relax.matmul", lambda call: "not this one")
    >>> [(o.op, o.shape, o.kernel, o.reason) for o in report]
    [('matmul', (2, 2), None, 'not this one')]
    """

    def visit(expr: relax.Expr) -> None:
        if is_call_to(expr, op_name):
            why = reason(expr)
            if why is not None:
                short_name = op_name.rsplit(".", 1)[-1]  # relax.nn.conv2d -> conv2d
                report.append(Offload(short_name, static_shape(expr.ty.shape) or (), reason=why,
                                      flops=call_flops(expr)))

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)

