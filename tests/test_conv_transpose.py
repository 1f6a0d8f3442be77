"""ConvTranspose on TPP kernels (issue 15, item 1): the sub-pixel rewrite
(:mod:`relay_passes.conv_transpose`) checked structurally and, through whole builds, against
ONNX Runtime on random data over strides, kernels, paddings and output paddings, odd sizes
included."""

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import tvm_tpp
from relay_passes.conv_transpose import phase_weight, transposed_as_conv
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime


def _conv_transpose_model(c: int, k: int, hw: tuple[int, int], kernel: tuple[int, int],
                          stride: tuple[int, int], pads: tuple[int, int, int, int] = (0,) * 4,
                          output_padding: tuple[int, int] = (0, 0), bias: bool = True,
                          batch: int | str = 1) -> onnx.ModelProto:
    rng = np.random.default_rng(7)
    w = numpy_helper.from_array(rng.standard_normal((c, k, *kernel)).astype("float32"), "W")
    inits, inputs = [w], ["x", "W"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(k).astype("float32"), "B"))
        inputs.append("B")
    out = [(size - 1) * st - pads[i] - pads[i + 2] + kk + op
           for i, (size, st, kk, op) in enumerate(zip(hw, stride, kernel, output_padding,
                                                      strict=True))]
    node = helper.make_node("ConvTranspose", inputs, ["y"], strides=list(stride),
                            pads=list(pads), output_padding=list(output_padding))
    graph = helper.make_graph(
        [node], "conv_transpose",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c, *hw])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, k, *out])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_rewrite_is_a_conv_an_interleave_and_a_crop():
    x = relax.Var("x", relax.TensorType((1, 3, 4, 5), "float32"))
    weight = np.random.default_rng(0).standard_normal((3, 2, 3, 3)).astype("float32")

    def before():
        bb = relax.BlockBuilder()
        with bb.function("main", [x]):
            y = bb.emit(relax.op.nn.conv2d_transpose(x, relax.const(weight), strides=2,
                                                     padding=1, output_padding=1))
            bb.emit_func_output(y)
        return bb.get()

    def expected():
        bb = relax.BlockBuilder()
        with bb.function("main", [x]):
            # k=3, s=2, output_padding 1: two taps per phase, the kernel padded to 4.
            conv = bb.emit(relax.op.nn.conv2d(x, relax.const(phase_weight(weight, (2, 2), (2, 2))),
                                              padding=(1, 1, 1, 1)))
            phases = bb.emit(relax.op.reshape(conv, (1, 2, 2, 2, 5, 6)))
            rows = bb.emit(relax.op.reshape(relax.op.permute_dims(phases, [0, 3, 4, 1, 5, 2]),
                                            (1, 2, 10, 12)))
            bb.emit_func_output(bb.emit(relax.op.strided_slice(rows, axes=[2, 3], begin=[1, 1],
                                                               end=[9, 11])))
        return bb.get()

    tvm.ir.assert_structural_equal(transposed_as_conv(before()), expected())

def test_phase_weight_matches_the_scatter_definition():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 3, 3, 3)).astype("float32")
    x = rng.standard_normal((2, 4, 4)).astype("float32")
    s, k = 2, 3
    full = np.zeros((3, (4 - 1) * s + k, (4 - 1) * s + k), "float32")
    for h in range(4):
        for v in range(4):
            full[:, h * s:h * s + k, v * s:v * s + k] += np.einsum("c,cokl->okl", x[:, h, v], w)
    taps = 2
    pw = phase_weight(w, (s, s), (taps, taps))
    padded = np.pad(x, ((0, 0), (taps - 1, taps - 1), (taps - 1, taps - 1)))
    hq = 4 + taps - 1
    conv = np.zeros((pw.shape[0], hq, hq), "float32")
    for i in range(hq):
        for j in range(hq):
            conv[:, i, j] = np.einsum("ckl,ockl->o", padded[:, i:i + taps, j:j + taps], pw)
    inter = conv.reshape(s, s, 3, hq, hq).transpose(2, 3, 0, 4, 1).reshape(3, hq * s, hq * s)
    np.testing.assert_allclose(inter[:, :full.shape[1], :full.shape[2]], full, atol=1e-5)


@pytest.mark.parametrize("c, k, hw, kernel, stride, pads, output_padding", [
    (8, 16, (5, 7), (2, 2), (2, 2), (0, 0, 0, 0), (0, 0)),    # PP-OCR's upsampling: a 1x1
    (5, 3, (4, 6), (3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),     # "same" x2, odd sizes
    (4, 6, (3, 5), (4, 4), (2, 2), (1, 1, 1, 1), (0, 0)),     # DCGAN's 4x4 stride 2
    (3, 4, (5, 4), (3, 2), (3, 1), (0, 1, 2, 0), (2, 0)),     # asymmetric everything
])
def test_conv_transpose_runs_on_a_tpp_conv_and_matches_onnxruntime(c, k, hw, kernel, stride,
                                                                   pads, output_padding):
    model = _conv_transpose_model(c, k, hw, kernel, stride, pads, output_padding)
    compiled = tvm_tpp.compile(model)
    assert compiled.tpp_flops_fraction == 1.0, compiled.report
    assert [r.op for r in compiled.report] == ["conv2d"]
    inputs = random_inputs(compiled.inputs, seed=3)
    _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
    assert rel <= 1e-5


def test_conv_transpose_with_a_symbolic_batch():
    model = _conv_transpose_model(4, 8, (5, 5), (2, 2), (2, 2), batch="N")
    compiled = tvm_tpp.compile(model)
    for batch in (1, 3):
        inputs = random_inputs(compiled.inputs, seed=batch, batch=batch)
        _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
        assert rel <= 1e-5


def test_grouped_conv_transpose_stays_with_tvm_and_says_so():
    model = _conv_transpose_model(4, 2, (5, 5), (2, 2), (2, 2))
    node = model.graph.node[0]
    node.attribute.append(helper.make_attribute("group", 2))
    w = model.graph.initializer[0]
    w.CopyFrom(numpy_helper.from_array(np.ones((4, 1, 2, 2), "float32"), "W"))
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.ones(2, "float32"), "B"))
    compiled = tvm_tpp.compile(model)
    (left,) = [r for r in compiled.report if not r.kernel]
    assert left.op == "conv2d_transpose" and "ConvTranspose" in left.reason
    inputs = random_inputs(compiled.inputs, seed=0)
    _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
    assert rel <= 1e-5

