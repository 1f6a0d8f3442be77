"""Adjacent epilogue ops computed as one shorter expression (``microkernels.epilogue._fused``):
a QDQ pair (``requantize`` then ``dequantize``) without the integer in between, ``relu``
before a constant-scale ``requantize`` as the saturation's lower bound, and a quantized
residual block's whole tail as two FMAs.  The first two must give the very bits of the ops
one after another (fusion switched off), on values at rounding ties, saturating both ways and
at int32's extremes (the QDQ pair's float zero may come out as -0.0, equal to 0.0); the
residual block within one step, rarely; each computes fewer operations."""

from __future__ import annotations

import numpy as np
import pytest

from microkernels import epilogue as ep
from microkernels.epilogue import Epilogue, EpilogueOp, apply_te, reference

M, N = 13, 37  # odd: a vector tail on every row


def _accumulators(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    acc = rng.integers(-4000, 4000, size=(M, N)).astype(np.int32)
    acc[0, :8] = [np.iinfo(np.int32).max, np.iinfo(np.int32).min, 2**24 + 1, -(2**24) - 1,
                  1, 3, -3, 0]
    return acc


def _build(epi: Epilogue, dtype: str, m: int = M):
    import tvm
    from tvm import te

    c = te.placeholder((m, N), dtype, name="C")
    extra = {o.name: te.placeholder(o.shape(m, N), o.dtype, name=o.name)
             for o in epi.inputs(dtype)}
    func = te.create_prim_func([c, *extra.values(), apply_te(epi, c, extra)])
    return func, tvm.compile(func, target={"kind": "llvm"})


def _run(epi: Epilogue, c: np.ndarray, extra: dict[str, np.ndarray]) -> tuple[np.ndarray, int]:
    """The chain's result on ``c`` and how many arithmetic nodes its expression has."""
    import tvm
    import tvm_ffi
    from tvm import tirx

    func, ex = _build(epi, str(c.dtype), c.shape[0])
    nodes = []
    tvm_ffi.structural_walk(func.body, ((tirx.Add, tirx.Sub, tirx.Mul, tirx.Max, tirx.Min,
                                         tirx.Cast, tvm.ir.expr.Call), nodes.append))
    out = tvm.runtime.empty(c.shape, epi.out_dtype(str(c.dtype)))
    ex(tvm.runtime.tensor(c), *[tvm.runtime.tensor(extra[k]) for k in sorted(extra)], out)
    return out.numpy(), len(nodes)


def _fused_and_apart(monkeypatch, epi, c, extra=None):
    extra = dict(sorted((extra or {}).items()))
    fused, fused_nodes = _run(epi, c, extra)
    monkeypatch.setattr(ep, "_fused", lambda ops, k, isa: None)
    apart, apart_nodes = _run(epi, c, extra)
    return fused, apart, fused_nodes, apart_nodes


@pytest.mark.parametrize("dtype, zp, zp_after", [("uint8", 3, 3), ("uint8", 0, 0),
                                                  ("int8", -5, -5), ("uint8", 128, 120)])
def test_qdq_pair_keeps_the_integer_in_float(monkeypatch, dtype, zp, zp_after):
    epi = Epilogue((EpilogueOp("requantize", broadcast="row", dtype=dtype, zero_point=zp),
                    EpilogueOp("dequantize", value=0.0371, zero_point=zp_after)))
    scale = np.full(N, 0.5, np.float32)  # x.5 ties: half to even
    scale[N // 2:] = np.float32(0.0123)
    fused, apart, fused_nodes, apart_nodes = _fused_and_apart(
        monkeypatch, epi, _accumulators(0), {"requantize_scale": scale})
    np.testing.assert_array_equal(fused, apart)  # equal values; a zero may be -0.0 here
    np.testing.assert_array_equal(fused, reference(epi, _accumulators(0),
                                                   {"requantize_scale": scale}))
    lo, hi = np.iinfo(dtype).min, np.iinfo(dtype).max
    assert fused[0, 0] == np.float32((hi - zp_after) * np.float32(0.0371))  # saturated
    assert fused[0, 1] == np.float32((lo - zp_after) * np.float32(0.0371))
    assert fused_nodes < apart_nodes


@pytest.mark.parametrize("dtype, zp", [("uint8", 0), ("uint8", 17), ("int8", -128),
                                       ("int8", 9)])
@pytest.mark.parametrize("acc_dtype", ["int32", "float32"])
def test_relu_becomes_the_saturations_lower_bound(monkeypatch, dtype, zp, acc_dtype):
    epi = Epilogue((EpilogueOp("relu"),
                    EpilogueOp("requantize", value=0.25, zero_point=zp, dtype=dtype)))
    c = _accumulators(1)
    if acc_dtype == "float32":
        c = c.astype(np.float32) / 7
        c[1, :4] = [-0.0, np.float32(2.0), np.float32(-2.0), np.float32(1e30)]
    fused, apart, fused_nodes, apart_nodes = _fused_and_apart(monkeypatch, epi, c)
    np.testing.assert_array_equal(fused, apart)
    np.testing.assert_array_equal(fused, reference(epi, c))
    assert fused.min() == max(zp, np.iinfo(dtype).min) and fused.max() == np.iinfo(dtype).max
    assert fused_nodes < apart_nodes


def test_relu_before_a_vector_scale_is_kept():
    """A per-channel scale is only known at run time: no fusion (its sign is not checked)."""
    epi = Epilogue((EpilogueOp("relu"),
                    EpilogueOp("requantize", broadcast="row", dtype="uint8", zero_point=4)))
    assert ep._fused(epi.ops, 0, "generic") is None


@pytest.mark.parametrize("dtype, dq_zp", [("uint8", 100), ("int8", -28), ("uint8", 97)])
def test_quantized_residual_block_fuses_within_a_step(monkeypatch, dtype, dq_zp):
    """A QDQ ResNet block's conv epilogue: the pair's integer and the residual scaled once,
    by two FMAs.  The sum is rounded once instead of three times, so a value next to a
    rounding tie may move one step: at most one, rarely, and never past the saturations."""
    lo, hi = np.iinfo(dtype).min, np.iinfo(dtype).max
    rng = np.random.default_rng(3)
    m = 64
    residual = rng.integers(lo, hi + 1, size=(m, N)).astype(dtype)
    epi = Epilogue((EpilogueOp("bias", dtype=""),
                    EpilogueOp("requantize", broadcast="row", zero_point=lo + 100, dtype=dtype),
                    EpilogueOp("dequantize", value=0.0513, zero_point=dq_zp),
                    EpilogueOp("residual_dq", value=0.0291, zero_point=lo + 7, dtype=dtype),
                    EpilogueOp("relu"),
                    EpilogueOp("requantize", value=1 / 0.0317, zero_point=lo, dtype=dtype)))
    acc = rng.integers(-4000, 4000, size=(m, N)).astype(np.int32)
    acc[0, :2] = [np.iinfo(np.int32).max, np.iinfo(np.int32).min]
    extra = {"bias": rng.integers(-500, 500, N).astype(np.int32),
             "requantize_scale": rng.uniform(0.005, 0.02, N).astype(np.float32),
             "residual": residual}
    fused, apart, fused_nodes, apart_nodes = _fused_and_apart(monkeypatch, epi, acc, extra)
    diff = np.abs(fused.astype(np.int64) - apart.astype(np.int64))
    assert diff.max() <= 1 and np.mean(diff > 0) <= 1e-3
    want = reference(epi, acc, extra).astype(np.int64)
    assert np.abs(fused - want).max() <= 1
    assert fused.min() == lo and fused.max() == hi  # relu's floor, the saturation
    assert len(np.unique(fused)) > 10  # not saturated
    assert fused_nodes < apart_nodes - 2


def test_residual_block_is_not_fused_with_a_vector_last_scale():
    epi = Epilogue((EpilogueOp("requantize", broadcast="row", dtype="uint8"),
                    EpilogueOp("dequantize", value=0.05, zero_point=3),
                    EpilogueOp("residual_dq", value=0.03, zero_point=9, dtype="uint8"),
                    EpilogueOp("relu"),
                    EpilogueOp("requantize", broadcast="row", name="out_scale",
                               dtype="uint8")))
    _, count = ep._fused(epi.ops, 0, "generic")
    assert count == 2  # the QDQ pair only
