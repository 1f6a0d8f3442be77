"""Epilogue TPPs: elementwise primitives applied to a GEMM's C tile right after its last K step.

An :class:`Epilogue` is a chain of :class:`EpilogueOp` (bias add, ReLU, GELU, sigmoid, residual
add, scale, clamp, fp32 -> bf16 conversion, int32 -> u8/s8 requantization).  :func:`apply_te`
composes the whole chain into ONE ``te.compute`` stage named ``"epilogue"``, so a schedule can
``reverse_compute_at`` a single block under the GEMM's output tile and run it while C is hot
(PARLOOPER's ``if (last K step) relu_tpp(C)``).  :func:`reference` gives the numpy semantics.

Data types along the chain start at the accumulator's (``"float32"`` or ``"int32"``):

==============  =====================  ==============================================
kind            input dtypes           result
==============  =====================  ==============================================
bias            float32, int32         ``x + b``; b is ``[N]`` (``broadcast="row"``,
                                       one value per output column) or ``[M]`` ("col")
residual        float32, int32         ``x + r``; r is a full ``[M, N]`` tensor, of the
                                       chain's dtype or (``dtype="bfloat16"``, to a
                                       float32 chain) bf16, widened exactly
relu            float32, int32         ``max(x, 0)``
clamp           float32, int32         ``min(max(x, lo), hi)``
gelu            float32                ``"erf"``: ``x/2 (1 + erf(x/sqrt 2))``; ``"tanh"``:
                                       ``x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``
sigmoid         float32                ``1 / (1 + exp(-x))``
silu            float32                ``x / (1 + exp(-x))`` (``x * sigmoid(x)``, swish)
scale           float32                ``x * s``; s a constant (``value``) or a vector
convert         float32 (last op)      bfloat16, round to nearest even
requantize      int32, float32         uint8/int8: ``sat(rint(float32(x) * s) + zp)``
dequantize      uint8, int8            float32: ``(float32(x) - zp) * s``
residual_dq     float32                ``x + (float32(r) - zp) * s``; r a full ``[M, N]``
                                       uint8/int8 tensor (a quantized residual)
==============  =====================  ==============================================

A quantized value may go on (``requantize`` then ``dequantize``): the QDQ form of a layer whose
quantized output is added to a quantized residual and quantized again is one chain.

bfloat16 results live in TVM ``"bfloat16"`` buffers (``tvm.runtime.empty(shape, "bfloat16")``,
whose ``.numpy()`` is an ``ml_dtypes.bfloat16`` array); :func:`reference` returns their uint16
bit patterns, like :func:`microkernels.brgemm.reference`.  The conversion is computed on the bits
(TVM's own ``astype("bfloat16")`` turns NaNs into infinities or -0.0): round to nearest even,
and a NaN keeps its sign and top payload bits with the quiet bit set, as ``vcvtneps2bf16`` does.
On ISAs with AVX512-BF16 the conversion is that instruction (:func:`vector_lanes`: the schedule
vectorizes it 16 lanes at a time), which also flushes denormal inputs to zero.

exp and erf are written out as polynomials (Cephes expf; Eigen's rational erf) because
``tirx.exp``/``tirx.erf`` become scalar libm calls that keep the loop from vectorizing (measured
on AVX2: GELU-erf 25-45 ns/element with ``erff``, 1.7 vectorized).  The tanh GELU is computed as
``x / (1 + exp(-2z))``, the same function with one exp and no cancellation in ``1 + tanh``.
:func:`reference` states the resulting tolerances.

Examples
--------
>>> epi = Epilogue((EpilogueOp("bias"), EpilogueOp("gelu", variant="tanh")))
>>> epi.name
'bias_gelu_tanh'
>>> [(o.name, o.shape(7, 19), o.dtype) for o in epi.inputs("float32")]
[('bias', (19,), 'float32')]
>>> q = EpilogueOp("requantize", value=0.02, zero_point=128, dtype="uint8")
>>> Epilogue((q,)).out_dtype("int32")
'uint8'
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from . import isa as _isa
from .fast_math import _f32, _isnan
from .fast_math import erf as _erf
from .fast_math import logistic_exp as _exp

if TYPE_CHECKING:
    import numpy as np
    from tvm import te, tirx
    from tvm.tirx import PrimExpr

__all__ = [
    "KINDS",
    "Operand",
    "EpilogueOp",
    "Epilogue",
    "apply_te",
    "expression_isa",
    "to_bf16",
    "bf16_bits",
    "from_bf16",
    "vector_lanes",
    "reference",
    "register_expr",
    "DTYPE_TAGS",
]

ACC_DTYPES = ("float32", "int32")
_FLOAT, _ANY = frozenset({"float32"}), frozenset({"float32", "int32"})

#: kind -> (accepted input dtypes, fields the kind may set besides ``kind``).
KINDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "bias": (_ANY, frozenset({"broadcast", "name"})),
    "residual": (_ANY, frozenset({"name", "dtype"})),
    "relu": (_ANY, frozenset()),
    "clamp": (_ANY, frozenset({"lo", "hi"})),
    "gelu": (_FLOAT, frozenset({"variant"})),
    "sigmoid": (_FLOAT, frozenset()),
    "silu": (_FLOAT, frozenset()),
    "scale": (_FLOAT, frozenset({"value", "broadcast", "name"})),
    "convert": (_FLOAT, frozenset({"dtype"})),
    "requantize": (_ANY, frozenset({"value", "broadcast", "name", "zero_point", "dtype"})),
    "dequantize": (frozenset({"uint8", "int8"}), frozenset({"value", "zero_point"})),
    "residual_dq": (_FLOAT, frozenset({"name", "value", "zero_point", "dtype"})),
}
#: Ops only the last of a chain may be; their result dtype is their ``dtype``.
_TERMINAL = ("convert",)
_CONVERTING = ("convert", "requantize")
_GELU_VARIANTS = ("erf", "tanh")
_QUANT_RANGE = {"uint8": (0, 255), "int8": (-128, 127)}
#: Short names of the low-precision types, as kernel names, op tags and tuning keys spell them.
DTYPE_TAGS = {"uint8": "u8", "int8": "s8", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Operand:
    """An extra input tensor of an epilogue.

    ``broadcast`` says how it covers the ``[M, N]`` tile: ``"row"`` is one row of ``N`` values
    (one per output column), ``"col"`` one column of ``M`` values (one per row), ``"full"`` the
    whole ``[M, N]`` tensor.
    """

    name: str
    broadcast: str
    dtype: str

    def shape(self, m: Any, n: Any) -> tuple[Any, ...]:
        """Shape of the tensor for an ``m x n`` C (ints or TIR expressions)."""
        return {"row": (n,), "col": (m,), "full": (m, n)}[self.broadcast]

    def index(self, i: Any, j: Any) -> tuple[Any, ...]:
        """Indices of the element that meets C[i, j]."""
        return {"row": (j,), "col": (i,), "full": (i, j)}[self.broadcast]


@dataclass(frozen=True)
class EpilogueOp:
    """One elementwise TPP of an epilogue; the module docstring lists the kinds.

    Parameters
    ----------
    kind
        One of :data:`KINDS`.
    variant
        gelu only: ``"erf"`` (exact GELU) or ``"tanh"`` (its tanh approximation).
    broadcast
        bias: ``"row"`` (default, ``[N]``) or ``"col"`` (``[M]``).  scale/requantize without
        ``value``: the per-column (``"row"``, ``[N]``) or per-row (``"col"``, ``[M]``) factors.
    name
        Name of the operand tensor (defaults: ``bias``, ``residual``, ``scale``,
        ``requantize_scale``); the keys of ``extra`` in :func:`apply_te` and :func:`reference`.
    value
        scale/requantize: the per-tensor factor (applied as float32); dequantize and
        residual_dq: the scale of the quantized value.
    lo, hi
        clamp bounds, ``lo <= hi`` (integral when the chain is int32).
    zero_point
        requantize: added after rounding, within the range of ``dtype``; dequantize and
        residual_dq: subtracted before scaling.
    dtype
        convert: ``"bfloat16"``; requantize and residual_dq (the residual's): ``"uint8"`` or
        ``"int8"``; residual: ``"bfloat16"`` for a bf16 residual (default: the chain's dtype).

    Examples
    --------
    >>> EpilogueOp("clamp", lo=0.0, hi=6.0).tag
    'clamp'
    >>> EpilogueOp("gelu", variant="sigmoid")
    Traceback (most recent call last):
    ...
    ValueError: unknown gelu variant 'sigmoid'; known: erf, tanh
    """

    kind: str
    variant: str = ""
    broadcast: str = ""
    name: str = ""
    value: float | None = None
    lo: float | None = None
    hi: float | None = None
    zero_point: int = 0
    dtype: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown epilogue op {self.kind!r}; known: {', '.join(KINDS)}")
        allowed = KINDS[self.kind][1]
        for f in fields(self):
            if f.name != "kind" and f.name not in allowed and getattr(self, f.name) != f.default:
                raise ValueError(f"epilogue op {self.kind!r} takes no {f.name!r}")
        getattr(self, f"_check_{self.kind}", lambda: None)()
        if self.name and not self.name.isidentifier():
            raise ValueError(f"operand name {self.name!r} is not an identifier")

    def _check_bias(self) -> None:
        if self.broadcast not in ("", "row", "col"):
            raise ValueError(f"bias broadcast must be 'row' or 'col', got {self.broadcast!r}")

    def _check_gelu(self) -> None:
        if self.variant not in _GELU_VARIANTS:
            raise ValueError(
                f"unknown gelu variant {self.variant!r}; known: {', '.join(_GELU_VARIANTS)}"
            )

    def _check_clamp(self) -> None:
        for bound in ("lo", "hi"):
            v = getattr(self, bound)
            if not _is_real(v) or math.isnan(v):
                raise ValueError(f"clamp needs a number for {bound!r}, got {v!r}")
        if self.lo > self.hi:
            raise ValueError(f"clamp needs lo <= hi, got lo={self.lo}, hi={self.hi}")

    def _check_scale(self) -> None:
        if self.value is None:
            if self.broadcast not in ("row", "col"):
                raise ValueError(
                    f"{self.kind} needs a constant `value` or a vector `broadcast` of 'row' "
                    f"(per column) or 'col' (per row), got broadcast={self.broadcast!r}"
                )
        elif self.broadcast or self.name:
            raise ValueError(f"{self.kind} takes either `value` or a vector operand, not both")
        elif not _is_real(self.value) or not math.isfinite(self.value):
            raise ValueError(f"{self.kind} value must be a finite number, got {self.value!r}")

    def _check_dequantize(self) -> None:
        if not _is_real(self.value) or not math.isfinite(self.value) or not self.value > 0:
            raise ValueError(f"{self.kind} needs a positive finite `value` (the scale), "
                             f"got {self.value!r}")
        if not isinstance(self.zero_point, int) or isinstance(self.zero_point, bool):
            raise ValueError(f"{self.kind} zero_point must be an int, got {self.zero_point!r}")

    def _check_residual_dq(self) -> None:
        self._check_dequantize()
        if self.dtype not in _QUANT_RANGE:
            raise ValueError(f"residual_dq dtype must be 'uint8' or 'int8', got {self.dtype!r}")

    def _check_residual(self) -> None:
        if self.dtype not in ("", "bfloat16"):
            raise ValueError(f"a residual is of the chain's dtype or 'bfloat16', got "
                             f"{self.dtype!r}")

    def _check_convert(self) -> None:
        if self.dtype != "bfloat16":
            raise ValueError(f"convert supports dtype 'bfloat16' only, got {self.dtype!r}")

    def _check_requantize(self) -> None:
        self._check_scale()
        if self.value is not None and not self.value > 0:
            raise ValueError(f"requantize scale must be positive, got {self.value}")
        if self.dtype not in _QUANT_RANGE:
            raise ValueError(f"requantize dtype must be 'uint8' or 'int8', got {self.dtype!r}")
        lo, hi = _QUANT_RANGE[self.dtype]
        if not isinstance(self.zero_point, int) or isinstance(self.zero_point, bool) or not (
            lo <= self.zero_point <= hi
        ):
            raise ValueError(
                f"requantize zero_point must be an int in [{lo}, {hi}], got {self.zero_point!r}"
            )

    def operand(self, dtype: str) -> Operand | None:
        """The extra tensor this op reads when the value reaching it has ``dtype``, if any."""
        if self.kind == "bias":
            return Operand(self.name or "bias", self.broadcast or "row", dtype)
        if self.kind == "residual":
            return Operand(self.name or "residual", "full", self.dtype or dtype)
        if self.kind == "residual_dq":
            return Operand(self.name or "residual", "full", self.dtype)
        if self.kind in ("scale", "requantize") and self.value is None:
            default = "scale" if self.kind == "scale" else "requantize_scale"
            return Operand(self.name or default, self.broadcast, "float32")
        return None

    def result_dtype(self, dtype: str) -> str:
        """dtype of this op's result for an input of ``dtype`` (ValueError if not accepted)."""
        accepted = KINDS[self.kind][0]
        if dtype not in accepted:
            hint = " (use requantize for int32)" if self.kind == "scale" else ""
            raise ValueError(
                f"epilogue op {self.tag!r} takes {' or '.join(sorted(accepted))}, got {dtype}{hint}"
            )
        if self.kind == "clamp" and dtype == "int32" and not all(
            float(v).is_integer() and -(2**31) <= v < 2**31 for v in (self.lo, self.hi)
        ):
            raise ValueError(
                f"clamp of int32 needs integral bounds within int32, got {self.lo}, {self.hi}"
            )
        if self.kind == "residual" and self.dtype and dtype != "float32":
            raise ValueError(f"a {self.dtype} residual adds to float32, got {dtype}")
        if self.kind == "dequantize":
            return "float32"
        return self.dtype if self.kind in _CONVERTING else dtype

    @property
    def tag(self) -> str:
        """Short name for kernel names, e.g. ``gelu_tanh``, ``requantize_u8``."""
        if self.kind == "gelu":
            return f"gelu_{self.variant}"
        if self.kind in _CONVERTING:
            return f"{self.kind}_{DTYPE_TAGS[self.dtype]}"
        if self.kind in ("residual_dq", "residual") and self.dtype:
            return f"residual_{DTYPE_TAGS[self.dtype]}"
        if self.kind == "bias" and self.broadcast == "col":
            return "bias_col"
        return self.kind


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class Epilogue:
    """A chain of :class:`EpilogueOp` applied in order to each element of C.

    ``convert`` and ``requantize`` may only come last; operand names must be unique.
    An empty chain is the identity.
    """

    ops: tuple[EpilogueOp, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.ops, Iterable) or isinstance(self.ops, (str, EpilogueOp)):
            raise TypeError(f"Epilogue.ops must be a sequence of EpilogueOp, got {self.ops!r}")
        object.__setattr__(self, "ops", tuple(self.ops))  # accept lists; stay hashable
        for op in self.ops:
            if not isinstance(op, EpilogueOp):
                raise TypeError(f"Epilogue.ops must hold EpilogueOp, got {op!r}")
        for op in self.ops[:-1]:
            if op.kind in _TERMINAL:
                raise ValueError(f"{op.kind} must be the last op of an epilogue")
        names = [o.name for o in (op.operand("float32") for op in self.ops) if o is not None]
        if len(set(names)) != len(names):
            raise ValueError(f"epilogue operand names must be unique, got {names}")

    @property
    def name(self) -> str:
        """Tags of the ops joined by ``_`` (``""`` when empty): readable, for kernel names.

        Not unique (constants are left out); the hashable ``Epilogue`` itself is the cache key.
        """
        return "_".join(op.tag for op in self.ops)

    def _dtypes(self, acc_dtype: str) -> list[str]:
        """dtype reaching each op, then the result's."""
        if acc_dtype not in ACC_DTYPES:
            raise ValueError(
                f"epilogue accumulator dtype must be one of {', '.join(ACC_DTYPES)}, "
                f"got {acc_dtype!r}"
            )
        chain = [acc_dtype]
        for op in self.ops:
            chain.append(op.result_dtype(chain[-1]))
        return chain

    def out_dtype(self, acc_dtype: str) -> str:
        """dtype of the result for accumulators of ``acc_dtype``; ValueError if ill-typed."""
        return self._dtypes(acc_dtype)[-1]

    def start_dtype(self, acc_dtype: str) -> str:
        """The dtype the chain starts from for an ``acc_dtype`` accumulator: that dtype, or
        float32 when the accumulator is int32 and the chain has an op that takes floats only
        (``scale``: it dequantizes); the whole chain then works on float32.

        Examples
        --------
        >>> Epilogue((EpilogueOp("scale", value=0.5),)).start_dtype("int32")
        'float32'
        >>> Epilogue((EpilogueOp("bias"),)).start_dtype("int32")
        'int32'
        """
        try:
            self.out_dtype(acc_dtype)
            return acc_dtype
        except ValueError:
            if acc_dtype == "float32":
                raise
            try:
                self.out_dtype("float32")
            except ValueError:
                raise ValueError(f"epilogue {self.name!r} takes neither the int32 "
                                 f"accumulator nor its float32 value") from None
            return "float32"

    def inputs(self, acc_dtype: str = "float32") -> tuple[Operand, ...]:
        """Extra tensors the chain reads, in op order (``Operand.shape(m, n)`` gives shapes)."""
        dtypes = self._dtypes(acc_dtype)
        found = (op.operand(dt) for op, dt in zip(self.ops, dtypes[:-1], strict=True))
        return tuple(o for o in found if o is not None)


# --------------------------------------------------------------------------------------------
# TE expressions.  builder(op, x, arg) -> the op applied to element x; arg is the operand's
# element at the same (i, j) or None.  Keyed by (kind, isa): apply_te takes the richest entry
# along the ISA's lineage, so an ISA-specific version registers beside the generic one.

ExprBuilder = Callable[[EpilogueOp, "PrimExpr", "PrimExpr | None"], "PrimExpr"]
_EXPRS: dict[tuple[str, str], ExprBuilder] = {}


def register_expr(kind: str, isa: str = "generic"):
    """Decorator registering ``builder(op, x, arg) -> PrimExpr`` for ``kind`` on ``isa``."""
    if kind not in KINDS:
        raise ValueError(f"unknown epilogue op {kind!r}; known: {', '.join(KINDS)}")
    if isa != "generic":
        _isa.from_name(isa)

    def wrap(builder: ExprBuilder) -> ExprBuilder:
        _EXPRS[(kind, isa)] = builder
        return builder

    return wrap


def _builder(kind: str, isa: str) -> ExprBuilder:
    lineage = () if isa == "generic" else _isa.from_name(isa).lineage()
    for name in lineage + ("generic",):
        if (kind, name) in _EXPRS:
            return _EXPRS[(kind, name)]
    raise AssertionError(f"no generic expression for {kind}")  # every kind registers one below


def _like(x: PrimExpr, v: float) -> PrimExpr:
    from tvm import tirx

    dtype = str(x.ty)
    return tirx.const(int(v) if dtype == "int32" else float(v), dtype)


@register_expr("bias")
@register_expr("residual")
def _add(op: EpilogueOp, x: PrimExpr, arg: PrimExpr | None) -> PrimExpr:
    return x + (from_bf16(arg) if op.dtype == "bfloat16" else arg)


def from_bf16(x: PrimExpr) -> PrimExpr:
    """A bfloat16 value as float32, widened on the bits (a bf16 is a float32's upper half;
    TVM's own cast goes through its bf16 legalization)."""
    from tvm import tirx

    bits = tirx.reinterpret("uint16", x).astype("uint32") << tirx.const(16, "uint32")
    return tirx.reinterpret("float32", bits)


def to_bf16(x: PrimExpr, isa: str = "generic") -> PrimExpr:
    """A float32 value rounded to bfloat16 (to nearest even, NaNs kept) as the ``convert``
    epilogue op computes it on ``isa`` (one ``vcvtneps2bf16`` where the ISA has it and the
    loop is vectorized by its 16 lanes: :func:`expression_isa`)."""
    return _builder("convert", isa)(EpilogueOp("convert", dtype="bfloat16"), x, None)


@register_expr("relu")
def _relu(op: EpilogueOp, x: PrimExpr, arg: PrimExpr | None) -> PrimExpr:
    from tvm import tirx

    return tirx.max(x, _like(x, 0))


@register_expr("clamp")
def _clamp(op: EpilogueOp, x: PrimExpr, arg: PrimExpr | None) -> PrimExpr:
    from tvm import tirx

    return tirx.min(tirx.max(x, _like(x, op.lo)), _like(x, op.hi))


_SQRT_2_PI = math.sqrt(2.0 / math.pi)


@register_expr("gelu")
def _gelu(op: EpilogueOp, x: PrimExpr, arg: PrimExpr | None) -> PrimExpr:
    if op.variant == "erf":
        return _f32(0.5) * x * (_f32(1.0) + _erf(x * _f32(math.sqrt(0.5))))
    # (1 + tanh(z)) / 2 == 1 / (1 + exp(-2z)): one exp and no cancellation in 1 + tanh(z).
    z2 = x * (_f32(-2.0 * _SQRT_2_PI) + _f32(-2.0 * _SQRT_2_PI * 0.044715) * x * x)
    return x / (_f32(1.0) + _exp(z2))


@register_expr("sigmoid")
def _sigmoid(op: EpilogueOp, x: PrimExpr, arg: PrimExpr | None) -> PrimExpr:
    from tvm import tirx

    # The saturating exp makes NaN finite; SiLU and GELU divide their x, which keeps it.
    return tirx.Select(_isnan(x), x, _f32(1.0) / (_f32(1.0) + _exp(-x)))


@register_expr("silu")
def _silu(op: EpilogueOp, x: PrimExpr, arg: PrimExpr | None) -> PrimExpr:
    return x / (_f32(1.0) + _exp(-x))


@register_expr("scale")
def _scale(op: EpilogueOp, x: PrimExpr, arg: PrimExpr | None) -> PrimExpr:
    return x * (_f32(op.value) if arg is None else arg)


@register_expr("convert")
def _to_bf16(op: EpilogueOp, x: PrimExpr, arg: PrimExpr | None) -> PrimExpr:
    # On the bits: TVM's own float32 -> bfloat16 cast rounds NaNs into Inf or -0.0.
    from tvm import tirx

    return tirx.reinterpret("bfloat16", bf16_bits(x))


#: AVX512-BF16's float32 -> bf16 conversion of 16 lanes, as an LLVM intrinsic.
_CVTNEPS2BF16 = "llvm.x86.avx512bf16.cvtneps2bf16.512"


@register_expr("convert", isa="avx512_bf16")
def _to_bf16_instruction(op: EpilogueOp, x: PrimExpr, arg: PrimExpr | None) -> PrimExpr:
    # One instruction for the ~8 integer ops of the bits' rounding (bf16 ResNet-50 1.05x).
    from tvm import tirx

    return tirx.reinterpret("bfloat16", bf16_bits(x, "avx512_bf16"))


def bf16_bits(x: PrimExpr, isa: str = "generic") -> PrimExpr:
    """A float32 value rounded to bfloat16 (to nearest even, NaNs kept and quieted), as its
    bits: ``uint16`` of ``x``'s lanes.  Where ``isa`` has AVX512-BF16, one
    ``vcvtneps2bf16``: ``x`` must then be 16 lanes, or a scalar its loop vectorizes by 16
    (:func:`vector_lanes`).  Kernels that move bits round with it.

    Examples
    --------
    >>> from tvm import tirx
    >>> [str(bf16_bits(tirx.Var("x", "float32x16"), isa).ty) for isa in ("avx2", "amx")]
    ['uint16x16', 'uint16x16']
    """
    from tvm import tirx

    lanes = str(x.ty).removeprefix("float32") if hasattr(x, "ty") else ""  # TE's are scalars
    if isa != "generic" and "avx512_bf16" in _isa.from_name(isa).lineage():
        # LLVM's result is bfloat: a reinterpret to another type bitcasts it to integers.
        return tirx.reinterpret(f"uint16{lanes}",
                                tirx.call_llvm_pure_intrin(f"int16{lanes}", _CVTNEPS2BF16, x))

    def u32(v: int) -> PrimExpr:
        return tirx.const(v, "uint32")

    bits = tirx.reinterpret(f"uint32{lanes}", x)
    rne = (bits + u32(0x7FFF) + ((bits >> u32(16)) & u32(1))) >> u32(16)
    quiet_nan = (bits >> u32(16)) | u32(0x40)
    nan = (bits & u32(0x7FFFFFFF)) > u32(0x7F800000)
    return tirx.Select(nan, quiet_nan, rne).astype(f"uint16{lanes}")


#: Lanes of the ISA-specific expressions' instructions (``vcvtneps2bf16``'s 16 floats).
_ISA_LANES = 16


def expression_isa(isa: str, columns: int) -> str:
    """The ISA whose expressions an epilogue over blocks of ``columns`` output columns uses:
    ``isa``'s where whole vectors of their instructions' lanes tile the block, else the
    generic ones (which vectorize to any width).

    >>> expression_isa("amx", 48), expression_isa("amx", 34)
    ('amx', 'generic')
    """
    return isa if columns % _ISA_LANES == 0 else "generic"


def vector_lanes(stmt: tirx.Stmt) -> int | None:
    """The lanes the code under ``stmt`` must be vectorized by, if any: 16 where it converts
    to bf16 with ``vcvtneps2bf16`` (an intrinsic of exactly 16 lanes), else None.

    >>> from tvm import tirx
    >>> x = tirx.Var("x", "float32")
    >>> stores = [tirx.Evaluate(b(EpilogueOp("convert", dtype="bfloat16"), x, None))
    ...           for b in (_to_bf16, _to_bf16_instruction)]
    >>> [vector_lanes(s) for s in stores]
    [None, 16]
    """
    import tvm
    import tvm_ffi
    from tvm import tirx

    marker = tirx.call_llvm_pure_intrin("uint16", _CVTNEPS2BF16, tirx.const(0.0, "float32"))
    found: list[bool] = []
    tvm_ffi.structural_walk(stmt, (tvm.ir.expr.Call, lambda c: found.append(
        c.op.same_as(marker.op) and int(c.args[0]) == int(marker.args[0]))))
    return _ISA_LANES if any(found) else None


@register_expr("dequantize")
def _dequantize(op: EpilogueOp, x: PrimExpr, arg: PrimExpr | None) -> PrimExpr:
    return (x.astype("float32") - _f32(op.zero_point)) * _f32(op.value)


@register_expr("residual_dq")
def _residual_dq(op: EpilogueOp, x: PrimExpr, arg: PrimExpr | None) -> PrimExpr:
    return x + (arg.astype("float32") - _f32(op.zero_point)) * _f32(op.value)


@register_expr("requantize")
def _requantize(op: EpilogueOp, x: PrimExpr, arg: PrimExpr | None, floor: int | None = None
                ) -> PrimExpr:
    # Saturated in float32, then converted rounding half to even (llvm.lrint: one
    # vcvtps2dq, or frintx + fcvtzs on AArch64): exact, since rounding and saturating to
    # integer bounds commute; the saturation keeps the conversion in range.
    from tvm import tirx

    q = tirx.call_llvm_pure_intrin("int32", "llvm.lrint", _saturated(op, x, arg, floor))
    if op.zero_point:
        q = q + tirx.const(op.zero_point, "int32")
    return q.astype(op.dtype)


def _saturated(op: EpilogueOp, x: PrimExpr, arg: PrimExpr | None, floor: int | None = None
               ) -> PrimExpr:
    """``requantize``'s ``x s`` in float32, saturated to the bounds of its dtype less its zero
    point (unrounded); ``floor`` raises the lower bound."""
    from tvm import tirx

    qmin, qmax = _QUANT_RANGE[op.dtype]
    qmin = qmin if floor is None else max(qmin, floor)
    scale = _f32(op.value) if arg is None else arg
    y = x.astype("float32") * scale
    return tirx.min(tirx.max(y, _f32(qmin - op.zero_point)), _f32(qmax - op.zero_point))


#: A fused window's expression: ``(x, args)`` with ``args`` the operand of each op it covers
#: (None for an op without one).
FusedBuilder = Callable[["PrimExpr", tuple], "PrimExpr"]

#: A QDQ residual block's conv epilogue from its requantization on: the output quantized,
#: dequantized, added to a dequantized residual, relu'd and quantized again.
_RESIDUAL_BLOCK = ("requantize", "dequantize", "residual_dq", "relu", "requantize")


def _fused(ops: tuple[EpilogueOp, ...], k: int, isa: str) -> tuple[FusedBuilder, int] | None:
    """An expression for ``ops[k]`` and the ops after it together, shorter than the ops in
    turn, and how many ops it covers; None where there is none (or ``isa`` has expressions
    of its own for any of them).

    * ``requantize`` then ``dequantize`` (a QDQ pair: the quantized output goes on in
      float32): the integer is never materialized.  ``(sat(rint(x s) + zp) - zp') s'`` is
      ``(rint(sat'(x s)) + zp - zp') s'`` with the bounds shifted by ``zp``: no conversion
      to int and back, no adding and subtracting the zero point (a zero may come out as
      -0.0).  Exactly equal.
    * ``relu`` then ``requantize`` by a constant scale (positive, as validated): ``rint``
      and the multiplication are monotonic, so ``max(x, 0)`` becomes a lower bound of the
      saturation, ``zp``.  Exactly equal.
    * A residual block (:data:`_RESIDUAL_BLOCK`, the last scale constant): the pair's
      integer ``q`` and the residual ``r`` enter the last quantization as
      ``q a + (r b + c)`` with ``a = s' s3``, ``b = s_r s3`` and the zero points in ``c``: two
      FMAs in place of four or five float instructions (zero points, three scales, the sum),
      the epilogue's cost on a short-K int8 conv (ResNet-50's residual 1x1 convs 1.09x
      alone, BENCHMARKS.md).  Not bit for bit: the sum is rounded once where the ops apart
      round it three times, so a value a few units in the last place from a rounding tie
      may land one step apart (ONNX Runtime's QLinearAdd also folds the scales).
    """
    if any(_builder(o.kind, isa) is not _EXPRS[(o.kind, "generic")] for o in ops[k:k + 2]):
        return None
    window = ops[k:k + len(_RESIDUAL_BLOCK)]
    if tuple(o.kind for o in window) == _RESIDUAL_BLOCK and window[-1].value is not None and all(
            _builder(o.kind, isa) is _EXPRS[(o.kind, "generic")] for o in window):
        return _residual_block(*window), len(window)
    op, after = ops[k], ops[k + 1] if k + 1 < len(ops) else None
    if after is None:
        return None
    if op.kind == "requantize" and after.kind == "dequantize":
        def pair(x: PrimExpr, args: tuple) -> PrimExpr:
            return _qdq_integer(op, after, x, args[0]) * _f32(after.value)

        return pair, 2
    if op.kind == "relu" and after.kind == "requantize" and after.value is not None:
        def floored(x: PrimExpr, args: tuple) -> PrimExpr:
            return _requantize(after, x, None, floor=after.zero_point)

        return floored, 2
    return None


def _qdq_integer(rq: EpilogueOp, dq: EpilogueOp, x: PrimExpr, scale: PrimExpr | None
                 ) -> PrimExpr:
    """The integer a QDQ pair carries, less the dequantization's zero point, in float32."""
    # tirx.round lowers to llvm.nearbyint (half to even); tirx.nearbyint would stop TVM
    # vectorizing the loop.
    from tvm import tirx

    q = tirx.round(_saturated(rq, x, scale))
    return q + _f32(rq.zero_point - dq.zero_point) if rq.zero_point != dq.zero_point else q


def _residual_block(rq: EpilogueOp, dq: EpilogueOp, residual: EpilogueOp, _relu: EpilogueOp,
                    out: EpilogueOp) -> FusedBuilder:
    """:data:`_RESIDUAL_BLOCK` as ``sat(rint(q a + (r b + c)))``, relu as the lower bound."""
    from tvm import tirx

    a = dq.value * out.value
    b = residual.value * out.value
    c = (rq.zero_point - dq.zero_point) * a - residual.zero_point * b
    unit = replace(out, value=1.0)  # the scale is in a, b and c

    def block(x: PrimExpr, args: tuple) -> PrimExpr:
        q = tirx.round(_saturated(rq, x, args[0]))
        y = q * _f32(a) + (args[2].astype("float32") * _f32(b) + _f32(c))
        return _requantize(unit, y, None, floor=out.zero_point)

    return block


def _extent(e: Any) -> Any:
    try:
        return int(e)
    except TypeError:  # symbolic
        return e


def apply_te(
    epilogue: Epilogue,
    C: te.Tensor,
    extra: dict[str, te.Tensor] | None = None,
    *,
    isa: str = "generic",
    name: str = "epilogue",
) -> te.Tensor:
    """One ``te.compute`` stage ``name`` applying the whole chain to the ``[M, N]`` tensor C.

    Parameters
    ----------
    epilogue
        The chain; empty returns ``C`` itself (no stage).
    C
        The GEMM output, dtype ``"float32"`` or ``"int32"``.
    extra
        Operand tensors by name, exactly those of ``epilogue.inputs(C.dtype)``, with those shapes
        and dtypes.
    isa
        Use expressions registered for this ISA (or its lineage) where there are any.

    Examples
    --------
    >>> from tvm import te  # doctest: +SKIP
    >>> C = te.placeholder((7, 19), "float32", name="C")  # doctest: +SKIP
    >>> b = te.placeholder((19,), "float32", name="bias")  # doctest: +SKIP
    >>> epi = Epilogue([EpilogueOp("bias"), EpilogueOp("relu")])
    >>> Y = apply_te(epi, C, {"bias": b})  # doctest: +SKIP
    """
    from tvm import te, tirx

    if not isinstance(epilogue, Epilogue):
        raise TypeError(f"apply_te needs an Epilogue, got {type(epilogue).__name__}")
    if not isinstance(C, te.Tensor) or len(C.shape) != 2:
        raise ValueError(f"apply_te needs a 2-D te.Tensor C, got {C!r}")
    extra = dict(extra or {})
    acc_dtype = str(C.dtype)
    dtypes = epilogue._dtypes(acc_dtype)
    m, n = (_extent(e) for e in C.shape)
    operands = [op.operand(dt) for op, dt in zip(epilogue.ops, dtypes[:-1], strict=True)]
    wanted = {o.name for o in operands if o is not None}
    if set(extra) != wanted:
        raise ValueError(
            f"epilogue {epilogue.name!r} needs extra tensors {sorted(wanted)}, got {sorted(extra)}"
        )
    for o in (o for o in operands if o is not None):
        t = extra[o.name]
        shape = tuple(_extent(e) for e in t.shape)
        expected = o.shape(m, n)
        static = all(isinstance(e, int) for e in shape + expected)
        if len(shape) != len(expected) or (static and shape != expected):
            raise ValueError(f"extra tensor {o.name!r} must have shape {expected}, got {shape}")
        if str(t.dtype) != o.dtype:
            raise ValueError(f"extra tensor {o.name!r} must be {o.dtype}, got {t.dtype}")
    if not epilogue.ops:
        return C
    # (expression of x and the operands, the operands) per step: one op, or a fused window.
    steps, k = [], 0
    while k < len(epilogue.ops):
        fused = _fused(epilogue.ops, k, isa)
        if fused is None:
            single, op = _builder(epilogue.ops[k].kind, isa), epilogue.ops[k]
            fused = (lambda x, args, single=single, op=op: single(op, x, args[0])), 1
        steps.append((fused[0], operands[k:k + fused[1]]))
        k += fused[1]

    def chain(x: PrimExpr, i: Any, j: Any, step: int) -> PrimExpr:
        builder, window = steps[step]
        y = builder(x, tuple(None if o is None else extra[o.name](*o.index(i, j))
                             for o in window))
        if step + 1 == len(steps):
            return y
        # Bind each intermediate once: builders use x several times (GELU four).
        v = tirx.Var(f"x{step}", str(y.ty))
        return tirx.Let(v, y, chain(v, i, j, step + 1))

    return te.compute(C.shape, lambda i, j: chain(C(i, j), i, j, 0), name=name)


# --------------------------------------------------------------------------------------------
# numpy semantics.  Each op's result is rounded to its dtype, as TVM stores it; a float op is
# evaluated in float64 inside (TVM differs there by rounding: LLVM contracts mul+add into FMA and
# exp/erf come from libm).  int32 arrays wrap around like TVM's int32; requantize runs in
# float32 exactly like the TE expression.


def _np_bf16_bits(x: np.ndarray) -> np.ndarray:
    import numpy as np

    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rne = (bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16
    out = np.where(np.isnan(x), (bits >> 16) | np.uint32(0x40), rne)
    return out.astype(np.uint16)


def _np_operand(value: np.ndarray, dtype: str) -> np.ndarray:
    """An operand in ``dtype``; a bf16 one (``ml_dtypes.bfloat16`` values, or their uint16
    bits as :func:`reference` returns them) widened to float32."""
    import numpy as np

    value = np.asarray(value)
    if dtype != "bfloat16":
        return value.astype(dtype)
    if value.dtype != np.uint16:
        import ml_dtypes

        value = value.astype(ml_dtypes.bfloat16).view(np.uint16)
    return (value.astype(np.uint32) << 16).view(np.float32)


def _np_float(op: EpilogueOp, x: np.ndarray, arg: np.ndarray | None) -> np.ndarray:
    """A float32-only op in float64."""
    import numpy as np

    if op.kind == "gelu" and op.variant == "erf":
        erf = np.vectorize(math.erf, otypes=[np.float64])
        return 0.5 * x * (1.0 + erf(x * math.sqrt(0.5)))
    if op.kind == "gelu":
        return 0.5 * x * (1.0 + np.tanh(_SQRT_2_PI * (x + 0.044715 * x**3)))
    if op.kind in ("sigmoid", "silu"):
        with np.errstate(over="ignore"):
            sigmoid = 1.0 / (1.0 + np.exp(-x))
        return sigmoid if op.kind == "sigmoid" else x * sigmoid
    return x * (float(np.float32(op.value)) if arg is None else arg)  # scale


def _np_apply(op: EpilogueOp, x: np.ndarray, arg: np.ndarray | None) -> np.ndarray:
    import numpy as np

    if op.kind in ("bias", "residual"):
        if x.dtype == np.float32:
            return (x.astype(np.float64) + arg).astype(np.float32)
        return x + arg
    if op.kind == "relu":
        return np.maximum(x, x.dtype.type(0))
    if op.kind == "clamp":
        return np.minimum(np.maximum(x, x.dtype.type(op.lo)), x.dtype.type(op.hi))
    if op.kind == "convert":
        return _np_bf16_bits(x)
    if op.kind in ("dequantize", "residual_dq"):
        q = x if op.kind == "dequantize" else arg
        real = (q.astype(np.float32) - np.float32(op.zero_point)) * np.float32(op.value)
        return real if op.kind == "dequantize" else (x + real).astype(np.float32)
    if op.kind == "requantize":
        qmin, qmax = _QUANT_RANGE[op.dtype]
        scale = np.float32(op.value) if arg is None else arg
        q = np.rint(x.astype(np.float32) * scale) + np.float32(op.zero_point)
        return np.clip(q, qmin, qmax).astype(op.dtype)
    return _np_float(op, x.astype(np.float64), arg).astype(np.float32)


def reference(
    epilogue: Epilogue, c: np.ndarray, extra: dict[str, np.ndarray] | None = None
) -> np.ndarray:
    """numpy result of ``epilogue`` on the ``[M, N]`` accumulator ``c`` (float32 or int32).

    Returns ``epilogue.out_dtype(c.dtype)`` values, bfloat16 as uint16 bit patterns.  Integer
    ops, requantize and bf16 conversion are bit-exact with :func:`apply_te`, and so are float32
    bias/residual adds, relu and clamp.  Other float32 ops agree to ``rtol=1e-5`` plus
    ``atol=1e-6`` for ``|x| <= 10``, ``atol=2e-6`` with ``gelu(erf)`` (measured: 9.3e-7 near
    x = -5.6): the absolute part because ``x * s + b`` may become an FMA and ``1 + erf(x)``
    cancels for ``x << 0``.

    Examples
    --------
    >>> import numpy as np
    >>> epi = Epilogue((EpilogueOp("bias"), EpilogueOp("relu")))
    >>> reference(epi, np.array([[1.0, -2.0]], np.float32), {"bias": np.array([0.5, 1.0])})
    array([[1.5, 0. ]], dtype=float32)
    """
    import numpy as np

    c = np.asarray(c)
    dtypes = epilogue._dtypes(str(c.dtype))
    if c.ndim != 2:
        raise ValueError(f"reference needs a 2-D accumulator, got shape {c.shape}")
    m, n = c.shape
    extra = dict(extra or {})
    x = c
    for op, dtype in zip(epilogue.ops, dtypes[:-1], strict=True):
        operand = op.operand(dtype)
        arg = None
        if operand is not None:
            if operand.name not in extra:
                raise ValueError(f"reference needs extra tensor {operand.name!r}")
            arg = _np_operand(extra[operand.name], operand.dtype)
            if arg.shape != operand.shape(m, n):
                raise ValueError(
                    f"extra tensor {operand.name!r} must have shape {operand.shape(m, n)}, "
                    f"got {arg.shape}"
                )
            arg = {"row": arg[None, :], "col": arg[:, None], "full": arg}[operand.broadcast]
        x = _np_apply(op, x, arg)
    return x
