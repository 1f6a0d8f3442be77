"""Max pools between bf16 convs pool bf16 (schedules.bf16_max_pool, relay_passes.bf16_pools).

The kernel compares bf16 values through order-preserving int16 keys: checked against numpy on
random values with every special one (signed zeros, infinities, subnormals), padding,
strides, windows and channel counts that do and do not fill a vector.  The pass: Before /
Expected on the layout it rewrites, the conv before such a pool writing bf16 (an average pool
beside the next conv reading it widened), a pool that is a graph output left in float32, and
whole networks against ONNX Runtime.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import tvm_tpp
from relay_passes.bf16_pools import max_pools_in_bf16
from relay_passes.pipeline import tpp_rewrites
from relay_passes.scaffold import is_call_to
from schedules.bf16_max_pool import max_pool_bf16_kernel, pooled_size
from tvm_tpp.compiler import import_model
from tvm_tpp.reference import TOLERANCES, max_errors, run_onnxruntime
from tvm_tpp.tpp_target import target as tpp_target

_SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, 1e-40, -1e-40, 3.0e38, -3.0e38, -1.0],
                    dtype=ml_dtypes.bfloat16)


def _reference(x: np.ndarray, window, strides, padding) -> np.ndarray:
    n, h, w, c = x.shape
    wide = np.pad(x.astype(np.float32), ((0, 0), (padding[0], padding[2]),
                                         (padding[1], padding[3]), (0, 0)),
                  constant_values=-np.inf)
    p = pooled_size(h, window[0], strides[0], padding[0], padding[2])
    q = pooled_size(w, window[1], strides[1], padding[1], padding[3])
    out = np.full((n, p, q, c), -np.inf, np.float32)
    for dr in range(window[0]):
        for ds in range(window[1]):
            out = np.maximum(out, wide[:, dr:dr + strides[0] * (p - 1) + 1:strides[0],
                                       ds:ds + strides[1] * (q - 1) + 1:strides[1]])
    return out


@settings(max_examples=12, deadline=None)
@given(h=st.integers(3, 12), w=st.integers(3, 12), c=st.sampled_from([1, 5, 32, 64]),
       window=st.integers(1, 3), stride=st.integers(1, 3), pad=st.integers(0, 1),
       seed=st.integers(0, 2**16))
def test_kernel_matches_numpy(h, w, c, window, stride, pad, seed):
    pad = min(pad, window - 1)  # padding within the window, as ONNX requires
    shape, windows, strides, padding = (2, h, w, c), (window, window), (stride, stride), (pad,) * 4
    x = np.random.default_rng(seed).standard_normal(shape).astype(ml_dtypes.bfloat16)
    x.reshape(-1)[:_SPECIAL.size] = _SPECIAL[:x.size]
    kernel = tvm.compile(max_pool_bf16_kernel(shape, windows, strides, padding), target="llvm")
    want = _reference(x, windows, strides, padding)
    out = tvm.runtime.empty(want.shape, "bfloat16")
    kernel(tvm.runtime.tensor(x), out)
    got = out.numpy().astype(np.float32)
    assert np.array_equal(got, want), np.argwhere(got != want)[:5]


def _pool_of_widened(x_shape, dtype="bfloat16"):
    """``astype(max_pool2d(astype(x, float32)), bfloat16)`` in NHWC: a pool between bf16 convs."""
    x = relax.Var("x", relax.TensorType(x_shape, dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            wide = bb.emit(relax.op.astype(x, "float32"))
            pooled = bb.emit(relax.op.nn.max_pool2d(wide, 3, 2, 1, layout="NHWC"))
            y = bb.emit_output(relax.op.astype(pooled, "bfloat16"))
        bb.emit_func_output(y)
    return bb.get()


def test_pass_pools_the_bf16_tensor():
    before = _pool_of_widened((2, 9, 9, 32))
    after = max_pools_in_bf16(before)
    (kernel,) = [gv for gv, f in after.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    x = relax.Var("x", relax.TensorType((2, 9, 9, 32), "bfloat16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.call_tir(kernel, [x],
                                              relax.TensorType((2, 5, 5, 32), "bfloat16")))
        bb.emit_func_output(y)
    tvm.ir.assert_structural_equal(after["main"], bb.get()["main"], map_free_vars=True)


def test_pass_leaves_a_float32_pool():
    before = _pool_of_widened((2, 9, 9, 32), dtype="float32")
    tvm.ir.assert_structural_equal(max_pools_in_bf16(before)["main"], before["main"])


def _net(beside: str | None = None):
    """conv -> relu -> max pool (3x3, stride 2, padding 1: ResNet's stem) -> conv; with
    ``beside="output"`` the pool also a graph output, with ``beside="average"`` also read by
    an average pool concatenated with the conv (stride 2 then: ShuffleNet's shortcut)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((32, c, 3, 3)) * 0.2)
                                     .astype("float32"), f"w{i}") for i, c in ((1, 3), (2, 32))]
    stride = 2 if beside == "average" else 1
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1] * 4),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("MaxPool", ["r1"], ["p"], kernel_shape=[3, 3], strides=[2, 2],
                              pads=[1] * 4),
             helper.make_node("Conv", ["p", "w2"], ["y" if beside != "average" else "b"],
                              pads=[1] * 4, strides=[stride] * 2)]
    side = 6 // stride
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                             [2, 64 if beside == "average" else 32, side, side])]
    if beside == "output":
        outputs.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, [2, 32, 6, 6]))
    if beside == "average":
        nodes += [helper.make_node("AveragePool", ["p"], ["a"], kernel_shape=[3, 3],
                                   strides=[2, 2], pads=[1] * 4),
                  helper.make_node("Concat", ["a", "b"], ["y"], axis=1)]
    graph = helper.make_graph(
        nodes, "pooled", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 11, 11])],
        outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _calls(model) -> list[tuple[str, str]]:
    """(kernel, output dtype) of each call_tir after the tpp rewrites, in graph order."""
    mod, _ = import_model(model)
    mod = tpp_rewrites(tpp_target("tpp"), precision="bf16")(mod)
    found = []
    relax.analysis.post_order_visit(mod["main"], lambda e: found.append(
        (e.args[0].name_hint, str(e.ty.dtype))) if is_call_to(e, "relax.call_tir") else None)
    return found


@pytest.mark.parametrize("beside", [None, "output", "average"])
def test_conv_before_the_pool_writes_bf16(beside):
    # An average pool beside the next conv reads the bf16 pool's result widened; a graph
    # output must stay float32.
    calls = _calls(_net(beside))
    pools = [dtype for name, dtype in calls if name.startswith("max_pool2d_bf16")]
    first_conv = next(dtype for name, dtype in calls if name.startswith("tpp_conv2d"))
    assert (pools, first_conv) == (([], "float32") if beside == "output"
                                   else (["bfloat16"], "bfloat16")), calls


@pytest.mark.parametrize("beside", [None, "output", "average"])
def test_network_matches_onnxruntime(beside):
    model = _net(beside)
    x = {"x": np.random.default_rng(1).standard_normal((2, 3, 11, 11)).astype("float32")}
    got = tvm_tpp.compile(model, target="tpp", precision="bf16").run(**x)
    _, rel = max_errors(got, run_onnxruntime(model, x))
    assert rel <= TOLERANCES["bf16"], rel
