"""Vectorizable float32 exp/erf/tanh/sigmoid: accuracy vs float64 numpy, the pass replacing
TVM's calls, and a compiled ONNX graph with Erf/Softmax/Sigmoid/Tanh vs ONNX Runtime."""

import math

import numpy as np
import pytest
import tvm
from tvm import s_tir, te, tirx

from microkernels import fast_math

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
LANES = 8
EDGES = np.array([
    0.0, -0.0, 1e-30, -1e-30, 1e-8, -1e-8, 1e-3, -1e-3, 0.5, 0.6249, 0.625, -0.625, 1.0, -1.0,
    3.99, 4.0, 4.01, 9.0, -9.0, 20.0, -20.0, 87.0, 88.0, 88.72, 88.73, 89.0, 100.0, -87.0,
    -87.5, -88.0, -95.0, -100.0, -103.9, -104.0, -110.0, 1e30, -1e30,
    np.finfo(np.float32).max, -np.finfo(np.float32).max, np.inf, -np.inf, np.nan,
], dtype=np.float32)

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _sigmoid(x):
    e = np.exp(-np.abs(x))
    return np.where(x < 0, e / (1 + e), 1 / (1 + e))


REFERENCE = {"exp": np.exp, "erf": _erf, "tanh": np.tanh, "sigmoid": _sigmoid}
# (function, random input range, bound on the relative error where the float64 result is a
# normal float32).
CASES = [
    ("exp", (-110.0, 90.0), 2e-7), ("exp", (-3.0, 3.0), 2e-7),
    ("erf", (-6.0, 6.0), 4e-7), ("erf", (-0.01, 0.01), 3e-7),
    ("tanh", (-12.0, 12.0), 2e-7), ("tanh", (-0.7, 0.7), 2e-7),
    ("sigmoid", (-110.0, 110.0), 3e-7),
]


def _vectorized(builder, n: int):
    x = te.placeholder((n,), "float32", name="x")
    y = te.compute((n,), lambda i: builder(x(i)), name="y")
    sch = s_tir.Schedule(te.create_prim_func([x, y]))
    (loop,) = sch.get_loops(sch.get_sblock("y"))
    sch.vectorize(sch.split(loop, [None, LANES])[1])
    return tvm.compile(sch.mod, target=TARGET)


def _run(name: str, x: np.ndarray) -> np.ndarray:
    f = _vectorized(getattr(fast_math, name), x.size)
    out = tvm.runtime.empty(x.shape, "float32")
    f(tvm.runtime.tensor(x), out)
    return out.numpy()


def _inputs(lo: float, hi: float) -> np.ndarray:
    x = np.random.default_rng(0).uniform(lo, hi, 1 << 16).astype(np.float32)
    x = np.concatenate([x, EDGES])
    return np.resize(x, -(-x.size // LANES) * LANES)


@pytest.mark.parametrize(("name", "span", "rtol"), CASES)
def test_accuracy_against_float64(name, span, rtol):
    x = _inputs(*span)
    y = _run(name, x)
    with np.errstate(all="ignore"):
        ref = REFERENCE[name](x.astype(np.float64))
    tiny, big = np.finfo(np.float32).tiny, np.finfo(np.float32).max
    normal = np.isfinite(ref) & (np.abs(ref) >= tiny) & (np.abs(ref) <= big)
    rel = np.abs(y[normal] - ref[normal]) / np.abs(ref[normal])
    assert rel.max() <= rtol, (rel.max(), x[normal][rel.argmax()])
    if name == "erf":  # the absolute error is what GELU's 1 + erf(x) sees
        assert np.abs(y - ref)[np.isfinite(ref)].max() <= 4e-7
    # Beyond the normal range: what float32 rounding of the exact value gives (inf, 0,
    # subnormals to within a couple of their ulps), NaN for NaN.
    with np.errstate(over="ignore"):
        rounded = ref.astype(np.float32)
    rest = ~normal & ~np.isnan(x)
    np.testing.assert_allclose(y[rest], rounded[rest], rtol=1e-6, atol=3e-45)
    assert np.isnan(y[np.isnan(x)]).all()


def test_logistic_exp_accuracy_and_saturation():
    """The epilogues' exp: within 5e-7 of exp over [-87, 88], exp(-87) and exp(88) beyond."""
    inside = np.random.default_rng(1).uniform(-87.0, 88.0, 1 << 16).astype(np.float32)
    edges = np.float32([-87.0, 88.0, 0.0, -0.0, 1e-30, 0.3466, -0.3466, 44.36, -44.36])
    outside = np.float32([-87.5, -100.0, -1e30, 88.5, 100.0, 1e30, np.inf, -np.inf])
    x = np.resize(np.concatenate([inside, edges, outside]), -(-(inside.size + 17) // LANES)
                  * LANES)
    y = _run("logistic_exp", x).astype(np.float64)
    ref = np.exp(np.clip(x.astype(np.float64), -87.0, 88.0))
    rel = np.abs(y - ref) / ref
    assert rel.max() <= 5e-7, (rel.max(), x[rel.argmax()])


def test_softmax_exp_accuracy_floor_and_nan():
    """A softmax's exp of ``x - max`` (<= 0): within 5e-7 of exp down to -87, exp(-87)
    below (nothing beside the row's 1), NaN kept."""
    inside = np.random.default_rng(2).uniform(-87.0, 0.0, 1 << 16).astype(np.float32)
    below = np.float32([-87.5, -100.0, -1e30, -np.finfo(np.float32).max, -np.inf])
    x = np.resize(np.concatenate([inside, np.float32([0.0, -0.0]), below, np.float32([np.nan])]),
                  -(-(inside.size + 8) // LANES) * LANES)
    y = _run("softmax_exp", x).astype(np.float64)
    finite = ~np.isnan(x)
    ref = np.exp(np.maximum(x[finite].astype(np.float64), -87.0))
    rel = np.abs(y[finite] - ref) / ref
    assert rel.max() <= 5e-7, (rel.max(), x[finite][rel.argmax()])
    assert np.isnan(y[~finite]).all() and (~finite).any()


def test_limits():
    x = np.resize(np.array([np.inf, -np.inf, np.nan, -0.0], np.float32), LANES)
    with np.errstate(invalid="ignore"):
        expected = {"exp": [np.inf, 0.0], "erf": [1.0, -1.0], "tanh": [1.0, -1.0],
                    "sigmoid": [1.0, 0.0]}
    for name, (at_inf, at_minus_inf) in expected.items():
        y = _run(name, x)
        assert y[0] == at_inf and y[1] == at_minus_inf and np.isnan(y[2]), (name, y)


def _with_calls(dtype: str = "float32") -> tirx.PrimFunc:
    x = te.placeholder((4, 16), dtype, name="x")
    y = te.compute((4, 16), lambda i, j: tirx.exp(x[i, j]) + tirx.erf(x[i, j])
                   + tirx.tanh(x[i, j]) + tirx.sigmoid(x[i, j]), name="y")
    return te.create_prim_func([x, y])


def test_pass_replaces_float32_calls_and_keeps_others():
    ops = []
    call_type = type(tirx.exp(tirx.Var("v", "float32")))

    def names(func):
        ops.clear()
        import tvm_ffi

        tvm_ffi.structural_walk(func.body, (call_type, lambda c: ops.append(c.op.name)))
        return set(ops)

    replaced = set(fast_math.REPLACED)
    assert replaced <= names(_with_calls())
    mod = fast_math.fast_math()(tvm.IRModule({"main": _with_calls()}))
    assert not replaced & names(mod["main"])
    # float64 calls stay (the polynomials are float32)
    assert replaced <= names(fast_math.fast_math_func(_with_calls("float64")))


def test_pass_result_is_correct():
    mod = fast_math.fast_math()(tvm.IRModule({"main": _with_calls()}))
    f = tvm.compile(mod, target=TARGET)
    x = np.random.default_rng(1).uniform(-6, 6, (4, 16)).astype(np.float32)
    out = tvm.runtime.empty((4, 16), "float32")
    f(tvm.runtime.tensor(x), out)
    x64 = x.astype(np.float64)
    ref = np.exp(x64) + _erf(x64) + np.tanh(x64) + _sigmoid(x64)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-6, atol=1e-6)


def _activations_model():
    """x[2, 8, 64] -> softmax(x) + sigmoid(x) * tanh(x) + gelu_erf(x), as ONNX."""
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    shape = [2, 8, 64]
    c = {name: helper.make_tensor(name, TensorProto.FLOAT, [], [value])
         for name, value in (("half", 0.5), ("one", 1.0), ("rsqrt2", math.sqrt(0.5)))}
    nodes = [
        helper.make_node("Softmax", ["x"], ["sm"], axis=-1),
        helper.make_node("Sigmoid", ["x"], ["sg"]),
        helper.make_node("Tanh", ["x"], ["th"]),
        helper.make_node("Mul", ["sg", "th"], ["st"]),
        helper.make_node("Mul", ["x", "rsqrt2"], ["xs"]),
        helper.make_node("Erf", ["xs"], ["er"]),
        helper.make_node("Add", ["er", "one"], ["e1"]),
        helper.make_node("Mul", ["x", "half"], ["xh"]),
        helper.make_node("Mul", ["xh", "e1"], ["ge"]),
        helper.make_node("Add", ["sm", "st"], ["a"]),
        helper.make_node("Add", ["a", "ge"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "activations", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], list(c.values()))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_compiled_activations_match_onnxruntime():
    ort = pytest.importorskip("onnxruntime")
    import tvm_tpp

    model = _activations_model()
    x = (np.random.default_rng(2).standard_normal((2, 8, 64)) * 4).astype(np.float32)
    x[0, 0, :4] = [30.0, -30.0, 90.0, -90.0]
    cm = tvm_tpp.compile(model, "tpp")
    (got,) = cm.run(x=x)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = sess.run(None, {"x": x})
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)
    # No scalar libm call is left in the TVM-lowered functions.
    ll = cm.source("llvm")
    for name in ("@expf", "@erff", "@tanhf", "@llvm.exp.", "@exp("):
        assert name not in ll, name
