"""Epilogue TPPs: validation, numpy semantics, and TE stages fused after a GEMM vs numpy."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from microkernels import epilogue as ep
from microkernels.epilogue import Epilogue, EpilogueOp, Operand, apply_te, reference

TARGET = {"kind": "llvm", "mcpu": "haswell"}
SHAPES = [(7, 19, 13), (33, 48, 64)]  # (M, N, K): odd sizes, and tiles that leave remainders
FLOAT_TOL = {"rtol": 1e-5, "atol": 1e-6}
GELU_ERF_TOL = {"rtol": 1e-5, "atol": 2e-6}  # float32 1 + erf(x) cancels for x << 0
# Kinds whose float32 results TVM and the reference compute bit-identically.
EXACT_KINDS = {"bias", "residual", "relu", "clamp", "convert", "requantize"}


def _target():
    import tvm

    return tvm.target.Target(TARGET)


def _bits(*words: int) -> np.ndarray:
    return np.array(words, dtype=np.uint32).view(np.float32)


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kind": "clamp", "lo": 1.0, "hi": 0.0}, "lo <= hi"),
        ({"kind": "clamp", "lo": 0.0}, "number for 'hi'"),
        ({"kind": "clamp", "lo": float("nan"), "hi": 1.0}, "number for 'lo'"),
        ({"kind": "gelu", "variant": "sigmoid"}, "unknown gelu variant"),
        ({"kind": "gelu"}, "unknown gelu variant"),
        ({"kind": "convert", "dtype": "float16"}, "bfloat16"),
        ({"kind": "convert"}, "bfloat16"),
        ({"kind": "requantize", "value": 0.1, "dtype": "int16"}, "'uint8' or 'int8'"),
        ({"kind": "requantize", "value": 0.1, "dtype": "uint8", "zero_point": 256}, "[0, 255]"),
        ({"kind": "requantize", "value": 0.1, "dtype": "int8", "zero_point": 128}, "[-128, 127]"),
        ({"kind": "requantize", "value": 0.1, "dtype": "int8", "zero_point": 1.5}, "zero_point"),
        ({"kind": "requantize", "value": 0.0, "dtype": "uint8"}, "positive"),
        ({"kind": "requantize", "dtype": "uint8"}, "constant `value` or a vector"),
        ({"kind": "scale", "value": 2.0, "broadcast": "row"}, "not both"),
        ({"kind": "scale"}, "constant `value` or a vector"),
        ({"kind": "scale", "value": float("inf")}, "finite"),
        ({"kind": "scale", "value": "2"}, "finite number"),
        ({"kind": "bias", "broadcast": "full"}, "'row' or 'col'"),
        ({"kind": "relu", "lo": 0.0}, "takes no 'lo'"),
        ({"kind": "sigmoid", "variant": "tanh"}, "takes no 'variant'"),
        ({"kind": "softmax"}, "unknown epilogue op"),
        ({"kind": "bias", "name": "my bias"}, "identifier"),
        ({"kind": "residual", "dtype": "float16"}, "chain's dtype or 'bfloat16'"),
    ],
)
def test_invalid_op_raises(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EpilogueOp(**kwargs)


@pytest.mark.parametrize(
    "ops, acc, message",
    [
        ([EpilogueOp("convert", dtype="bfloat16"), EpilogueOp("relu")], "float32", "last op"),
        ([EpilogueOp("bias"), EpilogueOp("bias")], "float32", "unique"),
        ([EpilogueOp("relu")], "float64", "accumulator dtype"),
        ([EpilogueOp("gelu", variant="erf")], "int32", "takes float32"),
        ([EpilogueOp("scale", value=2.0)], "int32", "use requantize"),
        ([EpilogueOp("convert", dtype="bfloat16")], "int32", "takes float32"),
        # A quantized value goes on only through dequantize.
        ([EpilogueOp("requantize", value=0.5, dtype="int8"), EpilogueOp("relu")], "int32",
         "takes float32 or int32, got int8"),
        ([EpilogueOp("dequantize", value=0.5)], "int32", "takes int8 or uint8"),
        ([EpilogueOp("clamp", lo=0.5, hi=6.0)], "int32", "integral bounds"),
        ([EpilogueOp("clamp", lo=0, hi=2**31)], "int32", "within int32"),
        ([EpilogueOp("residual", dtype="bfloat16")], "int32", "bfloat16 residual adds to float32"),
    ],
)
def test_invalid_chain_raises(ops, acc, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Epilogue(ops).out_dtype(acc)


def test_epilogue_needs_ops():
    with pytest.raises(TypeError):
        Epilogue(EpilogueOp("relu"))
    with pytest.raises(TypeError):
        Epilogue(("relu",))


def test_inputs_and_dtypes():
    epi = Epilogue(
        [
            EpilogueOp("bias", broadcast="col", name="b"),
            EpilogueOp("residual"),
            EpilogueOp("scale", broadcast="row"),
            EpilogueOp("relu"),
            EpilogueOp("convert", dtype="bfloat16"),
        ]
    )
    assert epi.inputs() == (
        Operand("b", "col", "float32"),
        Operand("residual", "full", "float32"),
        Operand("scale", "row", "float32"),
    )
    assert [o.shape(7, 19) for o in epi.inputs()] == [(7,), (7, 19), (19,)]
    assert epi.out_dtype("float32") == "bfloat16"
    assert epi.name == "bias_col_residual_scale_relu_convert_bf16"

    quant = Epilogue(
        [
            EpilogueOp("bias"),
            EpilogueOp("relu"),
            EpilogueOp("requantize", broadcast="row", dtype="int8", zero_point=-3),
        ]
    )
    assert quant.inputs("int32") == (
        Operand("bias", "row", "int32"),  # an int32 chain adds an int32 bias
        Operand("requantize_scale", "row", "float32"),
    )
    assert quant.out_dtype("int32") == "int8"
    assert Epilogue().out_dtype("int32") == "int32" and Epilogue().name == ""
    assert hash(quant) == hash(Epilogue(tuple(quant.ops)))  # usable as a cache key


def test_reference_known_values():
    x = np.array([[-1.0, 0.0, 1.0, 3.0]], np.float32)

    def ref(op):
        return reference(Epilogue([op]), x)[0]

    gelu_erf = [v / 2 * (1 + math.erf(v / math.sqrt(2))) for v in x[0]]
    np.testing.assert_allclose(ref(EpilogueOp("gelu", variant="erf")), gelu_erf, rtol=1e-7)
    # Published values of the tanh approximation at 1 and 3.
    np.testing.assert_allclose(ref(EpilogueOp("gelu", variant="tanh"))[2:], [0.841192, 2.996363],
                               rtol=1e-6)
    np.testing.assert_allclose(ref(EpilogueOp("sigmoid"))[1:3], [0.5, 0.7310586], rtol=1e-7)
    np.testing.assert_array_equal(ref(EpilogueOp("clamp", lo=-0.5, hi=2.0)), [-0.5, 0, 1, 2])
    acc = np.array([[1, 3, 5, -1, -3, 7, 10**6, -(10**6)]], np.int32)
    rq = Epilogue([EpilogueOp("requantize", value=0.5, zero_point=10, dtype="uint8")])
    # 0.5, 1.5, 2.5, -0.5, -1.5 round half to even; then + 10 and saturate.
    np.testing.assert_array_equal(reference(rq, acc)[0], [10, 12, 12, 10, 8, 14, 255, 0])
    cvt = Epilogue([EpilogueOp("convert", dtype="bfloat16")])
    words = reference(cvt, _bits(0x3F808000, 0x3F818000, 0x3F808001, 0x7F800001)[None, :])[0]
    assert [hex(w) for w in words] == ["0x3f80", "0x3f82", "0x3f81", "0x7fc0"]


# ------------------------------------------------------------------------------ apply_te


def _placeholders(epi, m, n, acc):
    from tvm import te

    return {o.name: te.placeholder(o.shape(m, n), o.dtype, name=o.name) for o in epi.inputs(acc)}


def test_apply_te_checks_operands():
    from tvm import te

    epi = Epilogue([EpilogueOp("bias"), EpilogueOp("relu")])
    C = te.placeholder((7, 19), "float32", name="C")
    with pytest.raises(ValueError, match="needs extra tensors"):
        apply_te(epi, C, {})
    with pytest.raises(ValueError, match="needs extra tensors"):
        apply_te(epi, C, {"bias": te.placeholder((19,)), "typo": te.placeholder((19,))})
    with pytest.raises(ValueError, match="shape"):
        apply_te(epi, C, {"bias": te.placeholder((7,), "float32")})
    with pytest.raises(ValueError, match="must be float32"):
        apply_te(epi, C, {"bias": te.placeholder((19,), "float16")})
    with pytest.raises(ValueError, match="accumulator dtype"):
        apply_te(epi, te.placeholder((7, 19), "float16"), {"bias": te.placeholder((19,))})
    with pytest.raises(ValueError, match="2-D"):
        apply_te(epi, te.placeholder((7,), "float32"), {"bias": te.placeholder((19,))})
    with pytest.raises(TypeError):
        apply_te([EpilogueOp("relu")], C, {})
    assert apply_te(Epilogue(), C) is C


def _run_elementwise(epi, c, extra=None, isa="generic"):
    """Compile ``epilogue(C)`` on its own for the AVX2 target and run it on ``c``."""
    import tvm
    from tvm import te

    m, n = c.shape
    C = te.placeholder((m, n), str(c.dtype), name="C")
    ops = _placeholders(epi, m, n, str(c.dtype))
    Y = apply_te(epi, C, ops, isa=isa)
    ex = tvm.compile(te.create_prim_func([C, *ops.values(), Y]), target=_target())
    out = tvm.runtime.empty((m, n), epi.out_dtype(str(c.dtype)))
    ex(tvm.runtime.tensor(c), *[tvm.runtime.tensor((extra or {})[k]) for k in ops], out)
    return out.numpy()


def test_convert_bits_exact_on_special_values():
    import ml_dtypes

    rng = np.random.default_rng(0)
    specials = _bits(
        0x3F808000,  # tie, even below: stays 0x3f80
        0x3F818000,  # tie, odd below: rounds up to 0x3f82
        0xBF808001,  # just above a tie: rounds up
        0x7F7F8000,  # tie at the top: rounds to +inf
        0x7F7FFFFF,  # FLT_MAX -> +inf
        0x00000001,  # smallest denormal -> +0
        0x00400000,  # denormal kept
        0x80000000,  # -0.0
        0x7F800000,  # +inf
        0xFF800000,  # -inf
        0x7FC00000,  # quiet NaN
        0x7F800001,  # signalling NaN: quieted, not turned into inf
        0xFF800001,  # negative signalling NaN keeps its sign
        0x7FFFFFFF,  # NaN with full payload: not rounded into -0.0
    )
    c = np.concatenate([specials, rng.standard_normal(7 * 19 - specials.size).astype(np.float32)])
    c = c.reshape(7, 19)
    epi = Epilogue([EpilogueOp("convert", dtype="bfloat16")])
    got = _run_elementwise(epi, c).view(np.uint16)
    want = reference(epi, c)
    np.testing.assert_array_equal(got, want)
    assert [hex(w) for w in want.ravel()[11:14]] == ["0x7fc0", "0xffc0", "0x7fff"]
    finite = ~np.isnan(c)  # ml_dtypes canonicalises NaN payloads; everything else must agree
    numpy_bits = c[finite].astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(want[finite], numpy_bits)


@pytest.mark.parametrize("dtype, zero_point", [("uint8", 3), ("int8", -5)])
def test_requantize_ties_and_saturation_exact(dtype, zero_point):
    rng = np.random.default_rng(1)
    acc = rng.integers(-600, 600, size=(7, 19)).astype(np.int32)
    acc[0, :6] = [np.iinfo(np.int32).max, np.iinfo(np.int32).min, 2**24 + 1, 1, 3, -3]
    epi = Epilogue([EpilogueOp("requantize", value=0.5, zero_point=zero_point, dtype=dtype)])
    got = _run_elementwise(epi, acc)
    assert got.dtype == np.dtype(dtype)
    want = reference(epi, acc)
    np.testing.assert_array_equal(got, want)
    lo, hi = np.iinfo(dtype).min, np.iinfo(dtype).max
    assert list(want[0, :3]) == [hi, lo, hi]
    assert list(want[0, 3:6]) == [zero_point, zero_point + 2, zero_point - 2]  # 0.5->0, ±1.5->±2


@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_quantized_residual_chain(dtype):
    # A QDQ conv's output requantized, dequantized, added to a quantized residual, relu'd and
    # quantized again: one chain.  The integer steps are exact; the float sum may become an
    # FMA in TVM, so a value at a rounding tie may land one step apart.
    rng = np.random.default_rng(2)
    lo, hi = np.iinfo(dtype).min, np.iinfo(dtype).max
    acc = rng.integers(-3000, 3000, size=(31, 67)).astype(np.int32)
    residual = rng.integers(lo, hi + 1, size=(31, 67)).astype(dtype)
    s1, s2, s3 = 0.0513, 0.0291, 0.0617
    epi = Epilogue([EpilogueOp("requantize", value=0.0103, zero_point=lo + 100, dtype=dtype),
                    EpilogueOp("dequantize", value=s1, zero_point=lo + 100),
                    EpilogueOp("residual_dq", value=s2, zero_point=lo + 7, dtype=dtype),
                    EpilogueOp("relu"),
                    EpilogueOp("requantize", value=1 / s3, zero_point=lo, dtype=dtype)])
    short = {"uint8": "u8", "int8": "s8"}[dtype]
    assert epi.name == f"requantize_{short}_dequantize_residual_{short}_relu_requantize_{short}"
    got = _run_elementwise(epi, acc, {"residual": residual}).astype(np.int64)
    want = reference(epi, acc, {"residual": residual}).astype(np.int64)
    assert np.abs(got - want).max() <= 1 and np.mean(got != want) <= 0.01
    q1 = np.clip(np.rint(acc * np.float32(0.0103)) + lo + 100, lo, hi)
    real = np.maximum((q1 - lo - 100) * s1 + (residual.astype(np.float64) - lo - 7) * s2, 0)
    assert np.abs(want - np.clip(np.rint(real / s3) + lo, lo, hi)).max() <= 1
    assert len(np.unique(want)) > 10  # not saturated


def test_transcendentals_on_special_values():
    # exp and erf are polynomials here (tirx.exp/erf call scalar libm): check their clamping,
    # saturation and NaN handling at the edges, not just on the bulk of the data.
    c = np.float32([[np.nan, np.inf, 0.0, -0.0, 1e-30, 30.0, -30.0, 100.0, -100.0, 1e30, -1e30]])
    for op in (EpilogueOp("sigmoid"), EpilogueOp("silu"), EpilogueOp("gelu", variant="tanh"),
               EpilogueOp("gelu", variant="erf")):
        epi = Epilogue([op])
        np.testing.assert_allclose(_run_elementwise(epi, c), reference(epi, c), **FLOAT_TOL)


def test_every_op_vectorizes():
    """TVM keeps each op's loop vectorized (tirx.isnan / nearbyint / exp would scalarize it)."""
    import tvm
    from tvm import s_tir, te
    from tvm.ir.instrument import pass_instrument

    after_vectorize = {}

    @pass_instrument
    class Grab:
        def run_after_pass(self, mod, info):
            if info.name == "tirx.VectorizeLoop":
                after_vectorize["script"] = mod.script()

    for op, acc in SINGLE_OPS.values():
        epi = Epilogue([op])
        C = te.placeholder((4, 16), acc, name="C")
        ops = _placeholders(epi, 4, 16, acc)
        sch = s_tir.Schedule(te.create_prim_func([C, *ops.values(), apply_te(epi, C, ops)]))
        _, j = sch.get_loops(sch.get_sblock("epilogue"))
        sch.vectorize(sch.split(j, [None, 8])[1])
        with tvm.transform.PassContext(instruments=[Grab()]):
            tvm.compile(sch.mod, target=_target())
        script = after_vectorize["script"]
        assert "T.Ramp(" in script and "j_1_s" not in script, f"{epi.name} was scalarized"


def test_isa_override_is_found_along_lineage(monkeypatch):
    monkeypatch.setattr(ep, "_EXPRS", dict(ep._EXPRS))

    @ep.register_expr("relu", isa="avx512")
    def _marked_relu(op, x, arg):  # distinguishable from the generic relu
        from tvm import tirx

        return tirx.max(x, tirx.const(0, "float32")) + tirx.const(1, "float32")

    c = np.random.default_rng(2).standard_normal((3, 5)).astype(np.float32)
    epi = Epilogue([EpilogueOp("relu")])
    # avx512_vnni descends from avx512, so it takes the override; avx2 keeps the generic one.
    np.testing.assert_array_equal(_run_elementwise(epi, c, isa="avx512_vnni"), np.maximum(c, 0) + 1)
    np.testing.assert_array_equal(_run_elementwise(epi, c, isa="avx2"), np.maximum(c, 0))
    with pytest.raises(ValueError, match="unknown ISA"):
        ep.register_expr("relu", isa="sse2")


# ------------------------------------------------------------------------------ GEMM + epilogue


def _gemm_te(m, n, k, acc):
    from tvm import te

    ta, tb = ("float32", "float32") if acc == "float32" else ("uint8", "int8")
    A = te.placeholder((m, k), ta, name="A")
    B = te.placeholder((k, n), tb, name="B")
    r = te.reduce_axis((0, k), name="k")
    C = te.compute(
        (m, n), lambda i, j: te.sum(A[i, r].astype(acc) * B[r, j].astype(acc), axis=r), name="C"
    )
    return A, B, C


def _gemm_data(rng, m, n, k, acc):
    """Operands whose product is exact in the accumulator, so C itself has no rounding error."""
    if acc == "float32":
        a = rng.integers(-2, 3, (m, k)).astype(np.float32)
        b = (rng.integers(-2, 3, (k, n)) / 16).astype(np.float32)
        return a, b, (a.astype(np.float64) @ b).astype(np.float32)
    a = rng.integers(0, 256, (m, k)).astype(np.uint8)
    b = rng.integers(-128, 128, (k, n)).astype(np.int8)
    return a, b, a.astype(np.int32) @ b.astype(np.int32)


def _operand_data(rng, o: Operand, m, n):
    shape = o.shape(m, n)
    if o.dtype == "int32":
        return rng.integers(-20000, 20000, shape).astype(np.int32)
    if o.name == "requantize_scale":
        return rng.uniform(1 / 1600, 1 / 400, shape).astype(np.float32)
    if o.name == "scale":
        return rng.uniform(-2, 2, shape).astype(np.float32)
    if o.dtype == "bfloat16":
        import ml_dtypes

        return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    return rng.standard_normal(shape).astype(np.float32)


def _run_gemm(epi, m, n, k, acc, fused, seed=0):
    """Compile GEMM + epilogue (unscheduled, or tiled with the epilogue under the tile), run it.

    Returns (result, reference).
    """
    import tvm
    from tvm import s_tir, te

    A, B, C = _gemm_te(m, n, k, acc)
    ops = _placeholders(epi, m, n, acc)
    Y = apply_te(epi, C, ops)
    sch = s_tir.Schedule(te.create_prim_func([A, B, *ops.values(), Y]))
    if fused:
        gemm = sch.get_sblock("C")
        i, j, kk = sch.get_loops(gemm)
        io, ii = sch.split(i, [None, 4])
        jo, ji = sch.split(j, [None, 8])
        sch.reorder(io, jo, kk, ii, ji)
        block = sch.get_sblock("epilogue")
        sch.reverse_compute_at(block, jo)
        loops = sch.get_loops(block)
        assert [sch.get(x) for x in loops[:2]] == [sch.get(io), sch.get(jo)]  # under the tile
        sch.set_scope(gemm, 0, "local")  # the C tile becomes a per-tile local buffer
        if n % 8 == 0:
            sch.vectorize(loops[-1])
        sch.decompose_reduction(gemm, kk)
    ex = tvm.compile(sch.mod, target=_target())

    rng = np.random.default_rng(seed)
    a, b, c = _gemm_data(rng, m, n, k, acc)
    extra = {o.name: _operand_data(rng, o, m, n) for o in epi.inputs(acc)}
    out = tvm.runtime.empty((m, n), epi.out_dtype(acc))
    args = [a, b, *(extra[name] for name in ops)]
    ex(*[tvm.runtime.tensor(x) for x in args], out)
    return out.numpy(), reference(epi, c, extra)


def _check(epi, got, want):
    if want.dtype == np.uint16:  # bfloat16 bit patterns
        np.testing.assert_array_equal(got.view(np.uint16), want)
    elif want.dtype == np.float32 and not {op.kind for op in epi.ops} <= EXACT_KINDS:
        erf = any(op.variant == "erf" for op in epi.ops)
        np.testing.assert_allclose(got, want, **(GELU_ERF_TOL if erf else FLOAT_TOL))
    else:
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


RQ_U8 = EpilogueOp("requantize", value=1 / 800, zero_point=128, dtype="uint8")
RQ_S8_COL = EpilogueOp("requantize", broadcast="row", zero_point=-7, dtype="int8")

SINGLE_OPS = {
    "bias_row": (EpilogueOp("bias"), "float32"),
    "bias_col": (EpilogueOp("bias", broadcast="col"), "float32"),
    "relu": (EpilogueOp("relu"), "float32"),
    "gelu_tanh": (EpilogueOp("gelu", variant="tanh"), "float32"),
    "gelu_erf": (EpilogueOp("gelu", variant="erf"), "float32"),
    "sigmoid": (EpilogueOp("sigmoid"), "float32"),
    "silu": (EpilogueOp("silu"), "float32"),
    "residual": (EpilogueOp("residual"), "float32"),
    "residual_bf16": (EpilogueOp("residual", dtype="bfloat16"), "float32"),
    "scale_const": (EpilogueOp("scale", value=-0.37), "float32"),
    "scale_per_column": (EpilogueOp("scale", broadcast="row"), "float32"),
    "scale_per_row": (EpilogueOp("scale", broadcast="col"), "float32"),
    "clamp": (EpilogueOp("clamp", lo=-0.25, hi=0.5), "float32"),
    "convert_bf16": (EpilogueOp("convert", dtype="bfloat16"), "float32"),
    "requantize_u8": (RQ_U8, "int32"),
    "requantize_s8_per_column": (RQ_S8_COL, "int32"),
}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", SINGLE_OPS)
def test_single_op_after_gemm(case, shape):
    op, acc = SINGLE_OPS[case]
    epi = Epilogue([op])
    got, want = _run_gemm(epi, *shape, acc, fused=False)
    _check(epi, got, want)


CHAINS = {
    "bias_relu": ([EpilogueOp("bias"), EpilogueOp("relu")], "float32"),
    "bias_gelu_tanh": ([EpilogueOp("bias"), EpilogueOp("gelu", variant="tanh")], "float32"),
    "bias_gelu_erf": ([EpilogueOp("bias"), EpilogueOp("gelu", variant="erf")], "float32"),
    "bias_residual_relu": (
        [EpilogueOp("bias"), EpilogueOp("residual"), EpilogueOp("relu")], "float32"),
    "scale_clamp": ([EpilogueOp("scale", value=2.5), EpilogueOp("clamp", lo=-1.0, hi=1.5)],
                    "float32"),
    "bias_relu_requantize_u8": ([EpilogueOp("bias"), EpilogueOp("relu"), RQ_U8], "int32"),
    "bias_col_requantize_s8": ([EpilogueOp("bias", broadcast="col"), RQ_S8_COL], "int32"),
    "bias_convert_bf16": ([EpilogueOp("bias"), EpilogueOp("convert", dtype="bfloat16")],
                          "float32"),
    "bias_residual_bf16_relu_convert_bf16": (  # a bf16 residual stream (ResNet in bf16)
        [EpilogueOp("bias"), EpilogueOp("residual", dtype="bfloat16"), EpilogueOp("relu"),
         EpilogueOp("convert", dtype="bfloat16")], "float32"),
    "scale_bias_sigmoid": ([EpilogueOp("scale", broadcast="row"), EpilogueOp("bias"),
                            EpilogueOp("sigmoid")], "float32"),
}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", CHAINS)
def test_chain_fused_under_gemm_tile(case, shape):
    ops, acc = CHAINS[case]
    epi = Epilogue(ops)
    got, want = _run_gemm(epi, *shape, acc, fused=True)
    _check(epi, got, want)
    if acc == "int32":  # the data must exercise saturation and the interior
        lo, hi = np.iinfo(want.dtype).min, np.iinfo(want.dtype).max
        assert (want == hi).any() and ((want > lo) & (want < hi)).any()
