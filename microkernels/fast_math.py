"""float32 exp, erf, tanh and sigmoid as TIR arithmetic that vectorizes, and a pass using them.

``tirx.exp``/``tirx.erf`` become scalar libm calls (``expf``, ``erff``) that keep LLVM from
vectorizing the loop around them, and TVM lowers ``tirx.tanh``/``tirx.sigmoid`` through
``exp``.  The builders here spell the functions out as polynomials (Cephes ``expf`` and
``tanhf``, Eigen's rational ``erf``) over plain float/int arithmetic, ``floor`` and bit
reinterpretation, all of which vectorize.  The TPP epilogues (:mod:`microkernels.epilogue`)
and the TVM-lowered rest of a ``tpp`` model (:func:`fast_math`, run on every PrimFunc before
code generation) share them.

Accuracy (measured against float64, :mod:`tests.test_fast_math`):

=========  ==============================================================================
exp        relative 1.2e-7 over the normal range; overflows to ``inf`` above 88.72 and
           underflows through the subnormals to 0 below -103.97, as ``expf`` does
erf        absolute 4e-7 (relative near 0: 2e-7); exactly +-1 for ``|x| >= 4``
tanh       relative 2e-7 (a polynomial for ``|x| < 0.625``, no cancellation near 0)
sigmoid    relative 2e-7 (``1 / (1 + exp(-x))``, into the subnormals); 0 and 1 at +-inf
=========  ==============================================================================

NaN comes out as NaN; infinities give the limits (``exp(-inf) = 0``, ``erf(inf) = 1``, ...).

Examples
--------
>>> from tvm import te, tirx
>>> x = te.placeholder((64,), "float32", name="x")
>>> f = te.create_prim_func([x, te.compute((64,), lambda i: tirx.exp(x[i]), name="y")])
>>> "T.exp" in fast_math_func(f).script()
False
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tvm
    from tvm.tirx import PrimExpr, PrimFunc

__all__ = ["REPLACED", "erf", "exp", "fast_math", "fast_math_func", "logistic_exp",
           "softmax_exp", "sigmoid",
           "tanh"]

# Cephes expf: exp(x) = 2**n * exp(r), n = round(x / ln 2), ln 2 split in two for an exact r.
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
             1.6666665459e-1, 5.0000001201e-1)
# Adding 1.5 * 2**23 rounds a float below 2**22 to an integer n: the sum's bits are 0x4B400000 + n.
_ROUNDING, _ROUNDING_BITS = 12582912.0, 0x4B400000
# Past these expf overflows to inf / rounds to 0 (exp(-103.98) is half the smallest subnormal).
_EXP_HI, _EXP_LO = 88.8, -104.0
# Eigen's erf(x) = x P(x^2) / Q(x^2) on [-4, 4] (erf(4) rounds to 1.0f).
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
          -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
          -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
          -7.37332916720468e-03, -1.42647390514189e-02)
# Cephes tanhf: tanh(x) = x + x^3 P(x^2) for |x| < 0.625.
_TANH_SMALL = 0.625
_TANH_POLY = (-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1,
              -3.33332819422e-1)


def _f32(v: float) -> PrimExpr:
    from tvm import tirx

    return tirx.const(v, "float32")


def _isnan(x: PrimExpr) -> PrimExpr:
    """NaN test on the bits: ``tirx.isnan`` stops TVM vectorizing the loop, and TVM's
    simplifier folds ``x != x`` to false."""
    from tvm import tirx

    magnitude = tirx.reinterpret("int32", x) & tirx.const(0x7FFFFFFF, "int32")
    return magnitude > tirx.const(0x7F800000, "int32")


def _let(value: PrimExpr, body: Callable[[PrimExpr], PrimExpr]) -> PrimExpr:
    """``body(v)`` with ``v`` bound once to ``value`` (the expression is a tree, not a DAG)."""
    from tvm import tirx

    v = tirx.Var("t", str(value.ty))
    return tirx.Let(v, value, body(v))


def _horner(x: PrimExpr, coefficients: tuple[float, ...]) -> PrimExpr:
    acc = _f32(coefficients[0])
    for c in coefficients[1:]:
        acc = acc * x + _f32(c)
    return acc


def _pow2(n: PrimExpr) -> PrimExpr:
    """``2**n`` as a float32 built from its bits, for an int32 ``n`` in [-126, 127]."""
    from tvm import tirx

    return tirx.reinterpret("float32", (n + tirx.const(127, "int32")) << 23)


def exp(x: PrimExpr) -> PrimExpr:
    """float32 ``exp(x)`` in plain arithmetic, so it vectorizes (``tirx.exp`` calls ``expf``).

    Relative error below 2e-7 over the normal range (measured 1.2e-7).  Beyond it, as
    ``expf``: ``inf`` above 88.72, subnormals, then 0 below -103.97; NaN stays NaN.

    Examples
    --------
    >>> from tvm import tirx
    >>> str(exp(tirx.const(1.0, "float32")).ty)
    'float32'
    """
    from tvm import tirx

    def from_clamped(xc: PrimExpr) -> PrimExpr:
        def from_n(n: PrimExpr) -> PrimExpr:
            def from_r(r: PrimExpr) -> PrimExpr:
                y = _horner(r, _EXP_POLY) * r * r + r + _f32(1.0)
                # n reaches 128 and -150: scale in two normal steps; the second rounds once
                # into the subnormals or overflows to inf.
                return _let(n.astype("int32"), lambda k: _let(
                    k >> tirx.const(1, "int32"),
                    lambda k1: y * _pow2(k1) * _pow2(k - k1)))

            return _let(xc - n * _f32(_LN2_HI) - n * _f32(_LN2_LO), from_r)

        return _let(tirx.floor(xc * _f32(1.0 / math.log(2.0)) + _f32(0.5)), from_n)

    def of(v: PrimExpr) -> PrimExpr:
        clamped = _let(tirx.min(tirx.max(v, _f32(_EXP_LO)), _f32(_EXP_HI)), from_clamped)
        return tirx.Select(_isnan(v), v, clamped)

    return _let(x, of)


def logistic_exp(x: PrimExpr) -> PrimExpr:
    """float32 ``exp(x)`` for the logistic forms ``1 / (1 + exp(x))`` of the TPP epilogues
    (sigmoid, SiLU, the tanh GELU): ``x`` clamped to [-87, 88] (results between exp(-87) and
    exp(88)); NaN comes out finite, left to the caller (SiLU and GELU divide their ``x``,
    which carries it).

    Cheaper than :func:`exp` by its exactness at large ``|x|``: ``n = round(x / ln 2)`` by
    adding ``1.5 * 2**23`` (the sum's low bits are ``n``, its exponent field built from them
    by an integer add and a shift), ``r = x - n ln 2`` with ``ln 2`` in one float (off by
    ``|n|`` times its rounding, 1.9e-9), Cephes' polynomial but its r**7 term in one Horner
    chain: relative error below 5e-7 (measured 4.5e-7, near the ends, where
    ``e / (1 + e)**2`` takes all but 1e-37 of it out of the logistic's result).  On a Zen 1,
    one core, SiLU 1.19-1.20x as fast as with :func:`exp`'s reduction and scaling.

    Examples
    --------
    >>> from tvm import tirx
    >>> str(logistic_exp(tirx.const(1.0, "float32")).ty)
    'float32'
    """
    from tvm import tirx

    def from_clamped(xc: PrimExpr) -> PrimExpr:
        def from_t(t: PrimExpr) -> PrimExpr:
            def from_r(r: PrimExpr) -> PrimExpr:
                # t's bits are 0x4B400000 + n: less 0x4B400000 - 127, shifted: 2**n's.
                scale = (tirx.reinterpret("int32", t)
                         - tirx.const(_ROUNDING_BITS - 127, "int32")) << 23
                return _horner(r, (*_EXP_POLY[1:], 1.0, 1.0)) * tirx.reinterpret("float32", scale)

            return _let(xc - (t - _f32(_ROUNDING)) * _f32(math.log(2.0)), from_r)

        return _let(xc * _f32(1.0 / math.log(2.0)) + _f32(_ROUNDING), from_t)

    return _let(tirx.min(tirx.max(x, _f32(-87.0)), _f32(88.0)), from_clamped)


def softmax_exp(x: PrimExpr) -> PrimExpr:
    """float32 ``exp(x)`` of a softmax's ``x - max``: :func:`logistic_exp`'s arithmetic
    (relative error below 5e-7), NaN kept (a row with a NaN normalizes to NaN, as TOPI's
    softmax does).  Arguments below -87 give exp(-87) (1.6e-38, nothing beside the row's
    largest term, 1), not the subnormals :func:`exp` goes through: BERT's bf16 attention at
    batch 8 1.05x as fast alone on a Zen 4 (its softmax-reading ``P @ V`` kernel 1.10x).

    Examples
    --------
    >>> from tvm import tirx
    >>> str(softmax_exp(tirx.const(-1.0, "float32")).ty)
    'float32'
    """
    from tvm import tirx

    return _let(x, lambda v: tirx.Select(_isnan(v), v, logistic_exp(v)))


def erf(x: PrimExpr) -> PrimExpr:
    """float32 ``erf(x)`` as a rational function (vectorizes; ``tirx.erf`` calls ``erff``).

    Absolute error below 4e-7 (libm's: 6e-8), relative error near 0 below 3e-7; exactly
    +-1 for ``|x| >= 4``; NaN stays NaN.

    Examples
    --------
    >>> from tvm import tirx
    >>> str(erf(tirx.Var("x", "float32")).ty)
    'float32'
    """
    from tvm import tirx

    def from_clamped(xc: PrimExpr) -> PrimExpr:
        return _let(xc * xc, lambda x2: xc * _horner(x2, _ERF_P) / _horner(x2, _ERF_Q))

    # The rational function overshoots |erf| = 1 by up to 4e-7 near |x| = 4: clip it.
    def of(v: PrimExpr) -> PrimExpr:
        y = _let(tirx.min(tirx.max(v, _f32(-4.0)), _f32(4.0)), from_clamped)
        return tirx.Select(_isnan(v), v, tirx.min(tirx.max(y, _f32(-1.0)), _f32(1.0)))

    return _let(x, of)


def tanh(x: PrimExpr) -> PrimExpr:
    """float32 ``tanh(x)``: Cephes ``tanhf``, an odd polynomial below 0.625 (no cancellation
    near 0), ``1 - 2 / (exp(2|x|) + 1)`` above; relative error below 3e-7, +-1 at +-inf.

    Examples
    --------
    >>> from tvm import tirx
    >>> str(tanh(tirx.Var("x", "float32")).ty)
    'float32'
    """
    from tvm import tirx

    def of(v: PrimExpr) -> PrimExpr:
        def from_abs(a: PrimExpr) -> PrimExpr:
            small = _let(v * v, lambda z: _horner(z, _TANH_POLY) * z * v + v)
            return tirx.Select(a < _f32(_TANH_SMALL), small, _let(
                _f32(1.0) - _f32(2.0) / (exp(a * _f32(2.0)) + _f32(1.0)),
                lambda large: tirx.Select(v < _f32(0.0), -large, large)))

        return _let(tirx.abs(v), from_abs)

    return _let(x, of)


def sigmoid(x: PrimExpr) -> PrimExpr:
    """float32 ``1 / (1 + exp(-x))`` with :func:`exp` of ``-|x|`` (``e / (1 + e)`` for
    ``x < 0``, so it stays relatively accurate into the subnormals); relative error below 3e-7.

    Examples
    --------
    >>> from tvm import tirx
    >>> str(sigmoid(tirx.Var("x", "float32")).ty)
    'float32'
    """
    from tvm import tirx

    def of(v: PrimExpr) -> PrimExpr:
        return _let(exp(-tirx.abs(v)), lambda e: _let(
            _f32(1.0) / (_f32(1.0) + e), lambda r: tirx.Select(v < _f32(0.0), e * r, r)))

    return _let(x, of)


#: TIR op name -> builder, for the float32 calls :func:`fast_math_func` replaces.
REPLACED: dict[str, Callable[[PrimExpr], PrimExpr]] = {
    "tirx.exp": exp, "tirx.erf": erf, "tirx.tanh": tanh, "tirx.sigmoid": sigmoid,
}


def fast_math_func(func: PrimFunc) -> PrimFunc:
    """``func`` with every float32 ``exp``/``erf``/``tanh``/``sigmoid`` call replaced by the
    builders above (other dtypes and functions unchanged).

    Examples
    --------
    >>> from tvm import te, tirx
    >>> x = te.placeholder((8,), "float32", name="x")
    >>> y = te.compute((8,), lambda i: tirx.erf(x[i]) + tirx.tanh(x[i]), name="y")
    >>> "T.erf" in fast_math_func(te.create_prim_func([x, y])).script()
    False
    """
    import tvm_ffi
    from tvm.ir.expr import Call

    def replace(call):
        builder = REPLACED.get(getattr(call.op, "name", None))
        if builder is None or str(call.ty) != "float32":
            return call
        return builder(call.args[0])

    return tvm_ffi.structural_map(func, (Call, replace))


def fast_math() -> tvm.transform.Pass:
    """The module pass of :func:`fast_math_func` over every PrimFunc."""
    from tvm import tirx

    return tirx.transform.prim_func_pass(
        lambda func, _mod, _ctx: fast_math_func(func), opt_level=0, name="TppFastMath")
