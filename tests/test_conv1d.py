"""1-D convolutions on the conv kernels (a conv2d of height 1: relay_passes.prepare
.conv1d_as_conv2d), and a ConvTranspose that stays with TVM (grouped) reported with its FLOPs
(issue 15, item 1; the others run on TPP kernels: tests/test_conv_transpose.py)."""

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import tvm_tpp
from relay_passes.prepare import conv1d_as_conv2d
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime


def test_conv1d_becomes_a_conv2d_of_height_one_structurally():
    x = relax.Var("x", relax.TensorType((2, 4, 9), "float32"))
    w = np.arange(6 * 2 * 3, dtype="float32").reshape(6, 2, 3)
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        y = bb.emit(relax.op.nn.conv1d(x, relax.const(w), strides=2, padding=(1, 2),
                                       dilation=2, groups=2))
        bb.emit_func_output(y)
    before = bb.get()

    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        conv = relax.op.nn.conv2d(relax.op.reshape(x, (2, 4, 1, 9)), relax.const(w[:, :, None]),
                                  strides=(1, 2), padding=(0, 1, 0, 2), dilation=(1, 2),
                                  groups=2)
        bb.emit_func_output(bb.emit(relax.op.reshape(conv, (2, 6, 4))))
    tvm.ir.assert_structural_equal(conv1d_as_conv2d(before), bb.get())


def _conv1d_model(c=12, k=16, length=29, kernel=5, stride=2, pads=(3, 1), dilation=2,
                  group=2, batch=1):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((k, c // group, kernel)) * 0.3).astype("float32")
    b = (0.1 * rng.standard_normal(k)).astype("float32")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], strides=[stride], pads=list(pads),
                              dilations=[dilation], group=group),
             helper.make_node("Relu", ["c"], ["y"])]
    out = (length + sum(pads) - dilation * (kernel - 1) - 1) // stride + 1
    graph = helper.make_graph(
        nodes, "conv1d", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                        [batch, c, length])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, k, out])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("kwargs", [{}, dict(group=1, dilation=1, stride=1, pads=(2, 2)),
                                    dict(c=3, k=8, group=1, batch=3)],
                         ids=["grouped_dilated_strided", "plain", "few_channels_batch3"])
@pytest.mark.parametrize("precision", ["float32", "bf16-strict"])
def test_onnx_conv1d_runs_on_a_tpp_conv_kernel(kwargs, precision):
    model = _conv1d_model(**kwargs)
    compiled = tvm_tpp.compile(model, target="tpp", precision=precision)
    # The bias joins the kernel; ReLU follows the reshape back to 1-D (TVM fuses the two).
    assert [r.op for r in compiled.report] == ["conv2d+bias"]
    assert compiled.report[0].kernel.startswith("tpp_conv2d_")
    assert compiled.tpp_flops_fraction == 1.0
    inputs = random_inputs(compiled.inputs, seed=1)
    _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
    assert rel <= (1e-5 if precision == "float32" else 1e-2)


def test_grouped_conv_transpose_stays_with_tvm_and_counts_its_flops():
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1] * 4),
             helper.make_node("ConvTranspose", ["c", "wt"], ["y"], strides=[2, 2], group=2)]
    inits = [numpy_helper.from_array(rng.standard_normal((8, 4, 3, 3)).astype("float32"), "w"),
             numpy_helper.from_array(rng.standard_normal((8, 3, 2, 2)).astype("float32"), "wt")]
    graph = helper.make_graph(
        nodes, "up", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 12, 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    compiled = tvm_tpp.compile(model, target="tpp")
    by_op = {r.op: r for r in compiled.report}
    assert by_op["conv2d_transpose"].reason == (
        "ConvTranspose is not routed to TPP: TVM computes it")
    assert by_op["conv2d_transpose"].flops == 2 * (8 * 6 * 5) * (3 * 2 * 2)
    assert by_op["conv2d"].flops == 2 * (8 * 6 * 5) * (4 * 3 * 3)
    assert compiled.tpp_flops_fraction == pytest.approx(36 / (36 + 12))
    inputs = random_inputs(compiled.inputs, seed=0)
    _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
    assert rel <= 1e-5
