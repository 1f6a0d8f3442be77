"""ONNX files as exporters write them (issue 15, item 4): shapes computed in the graph
(``Shape -> Gather/Slice/Cast/Mul -> Concat -> Reshape/Resize``, PyTorch's flatten, Paddle's
upsampling) are folded into constants before TVM's importer sees them
(:func:`tvm_tpp.onnx_import.fold_shapes`, ONNX Runtime's basic graph optimizations), and
what the importer still cannot convert is one line naming the operator and its node.
"""

import numpy as np
import onnx
import pytest
from conftest import INT8_KERNELS
from onnx import TensorProto, helper, numpy_helper

import tvm_tpp
from tvm_tpp import cli
from tvm_tpp.errors import ModelError
from tvm_tpp.onnx_import import TensorSpec, fold_shapes
from tvm_tpp.quantized import quantize_static_qdq
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime


def _ints(name: str, values) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, "int64"), name)


def _exported(batch: int = 1) -> onnx.ModelProto:
    """conv -> relu -> Paddle-style 2x nearest upsampling (sizes = Shape cast to float, times
    2, cast back) -> conv -> PyTorch-style flatten (Shape -> Gather -> Unsqueeze -> Concat ->
    Reshape) -> MatMul."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((16, 3, 3, 3)).astype("float32") * 0.3
    w2 = rng.standard_normal((8, 16, 3, 3)).astype("float32") * 0.1
    fc = rng.standard_normal((8 * 10 * 14, 10)).astype("float32") * 0.02
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1] * 4, name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Shape", ["r1"], ["s1"], name="shape1"),
        helper.make_node("Cast", ["s1"], ["s1f"], to=TensorProto.FLOAT, name="cast1"),
        helper.make_node("Slice", ["s1f", "two", "four"], ["hw"], name="slice_hw"),
        helper.make_node("Mul", ["hw", "scale"], ["hw2"], name="times2"),
        helper.make_node("Cast", ["hw2"], ["hwi"], to=TensorProto.INT64, name="cast2"),
        helper.make_node("Slice", ["s1", "zero1", "two"], ["nc"], name="slice_nc"),
        helper.make_node("Concat", ["nc", "hwi"], ["sizes"], axis=0, name="sizes"),
        helper.make_node("Resize", ["r1", "", "", "sizes"], ["up"], mode="nearest",
                         name="upsample"),
        helper.make_node("Conv", ["up", "w2"], ["c2"], pads=[1] * 4, name="conv2"),
        helper.make_node("Shape", ["c2"], ["s2"], name="shape2"),
        helper.make_node("Gather", ["s2", "zero"], ["n"], axis=0, name="batch"),
        helper.make_node("Unsqueeze", ["n", "zero1"], ["n1"], name="unsqueeze"),
        helper.make_node("Concat", ["n1", "minus1"], ["flat_shape"], axis=0, name="flat_shape"),
        helper.make_node("Reshape", ["c2", "flat_shape"], ["flat"], name="flatten"),
        helper.make_node("MatMul", ["flat", "fc"], ["y"], name="fc"),
    ]
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"),
             numpy_helper.from_array(fc, "fc"), _ints("zero", 0), _ints("zero1", [0]),
             _ints("two", [2]), _ints("four", [4]), _ints("minus1", [-1]),
             numpy_helper.from_array(np.array([2.0], "float32"), "scale")]
    graph = helper.make_graph(
        nodes, "exported", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                          [batch, 3, 5, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 10])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_shape_computations_fold_to_constants():
    model = _exported()
    folded = fold_shapes(model, [TensorSpec("x", (1, 3, 5, 7), "float32")])
    ops = [n.op_type for n in folded.graph.node]
    assert "Shape" not in ops and "Gather" not in ops and "Cast" not in ops
    assert ops.count("Conv") == 2 and "Resize" in ops and "Reshape" in ops
    x = random_inputs([TensorSpec("x", (1, 3, 5, 7), "float32")], seed=0)
    np.testing.assert_allclose(run_onnxruntime(folded, x)[0], run_onnxruntime(model, x)[0],
                               rtol=1e-6, atol=1e-6)


def test_a_graph_without_shape_computations_is_left_as_it_is():
    model = tvm_tpp.models.load("mlp")
    assert fold_shapes(model, [TensorSpec("x", (1, 512), "float32")]) is model


@pytest.mark.parametrize("batch", [1, 3])
def test_exported_file_compiles_on_tpp_kernels_and_matches_onnxruntime(batch):
    model = _exported(batch)
    compiled = tvm_tpp.compile(model, target="tpp")
    kernels = [r.op for r in compiled.report if r.kernel]
    assert sorted(kernels) == ["conv2d", "conv2d+relu", "matmul"], compiled.report
    for seed in range(2):
        inputs = random_inputs(compiled.inputs, seed=seed)
        _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
        assert rel <= 1e-5


def test_quantized_exported_file_keeps_its_int8_kernels(tmp_path):
    """Folding leaves a QDQ model's DequantizeLinear of the weights alone (ONNX Runtime folds
    no DequantizeLinear): the convs and the matmul still run u8 x s8."""
    path = quantize_static_qdq(_exported(), tmp_path / "exported.int8.onnx", samples=2)
    compiled = tvm_tpp.compile(path, target=INT8_KERNELS)
    int8 = [r for r in compiled.report if r.dtypes == "uint8*int8->int32"]
    assert len(int8) == 3, compiled.report
    quantized = onnx.load(str(path))
    inputs = random_inputs(compiled.inputs, seed=0)
    _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(quantized, inputs,
                                                                optimize=False))
    assert rel <= 5e-2


def _one_node_model(node: onnx.NodeProto, inputs: list[onnx.ValueInfoProto]) -> onnx.ModelProto:
    graph = helper.make_graph([node], "g", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_an_operator_the_importer_lacks_is_named_with_its_node():
    model = _one_node_model(helper.make_node("DFT", ["x"], ["y"], name="fft"),
                            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 1])])
    with pytest.raises(ModelError) as err:
        tvm_tpp.compile(model, target="tpp")
    assert str(err.value) == "TVM's ONNX importer has no conversion for DFT (node 'fft')"


def test_a_conversion_that_fails_is_one_line_naming_the_node(tmp_path, capsys):
    """A Resize whose sizes are a graph input (nothing to fold): the frontend cannot
    convert it; the CLI says which node in one line and exits 2."""
    model = _one_node_model(
        helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="nearest", name="up"),
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4]),
         helper.make_tensor_value_info("sizes", TensorProto.INT64, [4])])
    onnx.save(model, str(tmp_path / "m.onnx"))
    assert cli.main(["compile", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.so")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "tvm-tpp: error: TVM's ONNX importer cannot convert Resize (node 'up'): "), err
