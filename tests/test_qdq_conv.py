"""int8 convolutions in QDQ form on the uint8 x int8 conv kernels (relay_passes.qdq), against
ONNX Runtime running the same int8 file.

Single convolutions (odd channel counts, strides, padding, 1x1, an RGB stem, ReLU, per-tensor
and per-channel weights, uint8 and int8 activations, zero points 0 and 255) are built with
onnx.helper and quantized by ``onnxruntime.quantization.quantize_static``; then the networks:
the bundled resnet_small and mobilenet_v2 quantized by :func:`tvm_tpp.quantized
.quantize_static_qdq` (ONNX Runtime's pre-processing folds their BatchNorms into the convs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import pytest
import tvm
from conftest import INT8_KERNELS
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
from tvm import relax

import tvm_tpp
from relay_passes.qdq import rewrite_qdq
from relay_passes.scaffold import Offload, is_call_to
from tvm_tpp import models
from tvm_tpp.compiler import import_model
from tvm_tpp.quantized import quantize_static_qdq
from tvm_tpp.reference import max_errors, run_onnxruntime
from tvm_tpp.tpp_target import target as tpp_target


@dataclass(frozen=True)
class _Conv:
    """One float conv layer ``[relu](conv(x, W) + b)`` to be quantized, and its inputs:
    ``sign`` -1 draws negative inputs only (a uint8 zero point of 255), +1 positive ones (0)."""

    c: int
    k: int
    size: tuple[int, int]
    kernel: int
    stride: int = 1
    pad: int = 0
    relu: bool = False
    per_channel: bool = True
    activations: QuantType = QuantType.QUInt8
    sign: int = 0
    group: int = 1  # C: a depthwise conv (tests/test_depthwise.py)
    dilation: int = 1

    def inputs(self, seed: int) -> np.ndarray:
        x = np.random.default_rng(seed).standard_normal((1, self.c, *self.size))
        return (np.abs(x) * self.sign if self.sign else x).astype("float32")

    def model(self) -> onnx.ModelProto:
        rng = np.random.default_rng(0)
        fan_in = self.c // self.group * self.kernel ** 2
        w = (rng.standard_normal((self.k, self.c // self.group, self.kernel, self.kernel))
             * np.sqrt(2 / fan_in)).astype("float32")
        b = (0.1 * rng.standard_normal(self.k)).astype("float32")
        nodes = [helper.make_node("Conv", ["x", "w", "b"], ["conv" if self.relu else "y"],
                                  kernel_shape=[self.kernel] * 2, strides=[self.stride] * 2,
                                  pads=[self.pad] * 4, group=self.group,
                                  dilations=[self.dilation] * 2)]
        if self.relu:
            nodes.append(helper.make_node("Relu", ["conv"], ["y"]))
        graph = helper.make_graph(
            nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                          [1, self.c, *self.size])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                 ir_version=8)


class _Inputs(CalibrationDataReader):
    def __init__(self, layer: _Conv) -> None:
        self._batches = iter({"x": layer.inputs(100 + s)} for s in range(4))

    def get_next(self):
        return next(self._batches, None)


_CASES = {
    "3x3_c5_k24_relu_per_channel": _Conv(5, 24, (9, 11), 3, pad=1, relu=True),
    "3x3_s2_c16_k40_per_tensor": _Conv(16, 40, (10, 9), 3, stride=2, pad=1, per_channel=False),
    "1x1_s2_c7_k16": _Conv(7, 16, (8, 8), 1, stride=2),
    "stem_7x7_s2_c3": _Conv(3, 16, (17, 15), 7, stride=2, pad=3, relu=True),
    "int8_activations": _Conv(12, 32, (7, 7), 3, pad=1, activations=QuantType.QInt8),
    "uint8_zero_point_255": _Conv(8, 16, (6, 6), 3, pad=1, sign=-1),
    "uint8_zero_point_0": _Conv(8, 16, (6, 6), 3, pad=1, sign=1),
}


def _quantized(layer: _Conv, tmp_path, reduce_range: bool = False) -> onnx.ModelProto:
    src, dst = tmp_path / "float.onnx", tmp_path / "qdq.onnx"
    onnx.save(layer.model(), str(src))
    quantize_static(str(src), str(dst), _Inputs(layer), quant_format=QuantFormat.QDQ,
                    per_channel=layer.per_channel, activation_type=layer.activations,
                    weight_type=QuantType.QInt8, reduce_range=reduce_range)
    return onnx.load(str(dst))


def _qdq_reference(model: onnx.ModelProto, inputs) -> list[np.ndarray]:
    """A QDQ model's outputs as ONNX defines them: ONNX Runtime running it unfused (its fused
    u8 x s8 kernels saturate on CPUs without VNNI: conftest.ORT_INT8_EXACT)."""
    return run_onnxruntime(model, inputs, optimize=False)


def _assert_matches_qdq(model: onnx.ModelProto, layer: _Conv,
                        compiled: tvm_tpp.CompiledModel | None = None) -> None:
    """The compiled int8 layer (``compiled``, by default the build on the int8 kernels) on two
    seeded inputs against :func:`_qdq_reference`: within one output step, equal but for 1 %
    of the values (float32 sums, ``tpp -int8=float``, round where the integer chain is exact:
    a value on a rounding boundary may land one step over, as the kernels' ties do)."""
    compiled = compiled or tvm_tpp.compile(model, target=INT8_KERNELS)
    step = _output_step(model)
    for seed in range(2):
        x = layer.inputs(seed)
        got, want = compiled.run(x=x)[0], _qdq_reference(model, {"x": x})[0]
        assert np.std(want) > 0
        # The integer chain is exact; at most a rounding tie lands on the other side.
        assert np.max(np.abs(got - want)) <= step * (1 + 1e-5)
        assert np.mean(got != want) <= 0.01


def _output_step(model: onnx.ModelProto) -> float:
    """The scale of the graph output's DequantizeLinear."""
    producer = next(n for n in model.graph.node if n.output[0] == model.graph.output[0].name)
    assert producer.op_type == "DequantizeLinear"
    scales = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return float(scales[producer.input[1]])


def _input_zero_point(model: onnx.ModelProto) -> int:
    first_q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear")
    zeros = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return int(zeros[first_q.input[2]])


def _int8_report(model: onnx.ModelProto) -> tuple[tvm.IRModule, list[Offload]]:
    mod, _ = import_model(model)
    report: list[Offload] = []
    return rewrite_qdq(mod, tpp_target(INT8_KERNELS), report), report


@pytest.mark.parametrize("name", sorted(_CASES))
def test_qdq_conv_matches_onnxruntime(name, tmp_path):
    layer = _CASES[name]
    model = _quantized(layer, tmp_path)
    if layer.sign:
        assert _input_zero_point(model) == (255 if layer.sign < 0 else 0)
    _, report = _int8_report(model)
    assert [(r.op.split("+")[0], r.dtypes, r.layout) for r in report] == [
        ("conv2d_qdq", "uint8*int8->int32", "vnni4")], report
    _assert_matches_qdq(model, layer)


def test_rewritten_conv_reads_uint8_padded_with_its_zero_point(tmp_path):
    layer = _CASES["uint8_zero_point_255"]
    mod, _ = _int8_report(_quantized(layer, tmp_path))
    calls, pads, dequantized_constants = [], [], []

    def visit(expr: relax.Expr) -> None:
        if is_call_to(expr, "relax.call_tir"):
            calls.append(expr)
        elif is_call_to(expr, "relax.nn.pad"):
            pads.append(expr)
        elif is_call_to(expr, "relax.dequantize") and isinstance(expr.args[0],
                                                                   tvm.ir.expr.Constant):
            dequantized_constants.append(expr)

    relax.analysis.post_order_visit(mod["main"], visit)
    assert len(calls) == 1 and not dequantized_constants  # W_q and b in the kernel's operands
    x, packed, *_ = calls[0].args[1].fields
    assert str(x.ty.dtype) == "uint8" and str(packed.ty.dtype) == "int8"
    assert [float(p.attrs.pad_value) for p in pads] == [255.0]  # real zeros at the borders


def test_asymmetric_weights_stay_float_with_the_reason(tmp_path):
    layer = _CASES["1x1_s2_c7_k16"]
    src, dst = tmp_path / "float.onnx", tmp_path / "u8w.onnx"
    onnx.save(layer.model(), str(src))
    quantize_static(str(src), str(dst), _Inputs(layer), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QUInt8)
    model = onnx.load(str(dst))
    _, report = _int8_report(model)
    assert len(report) == 1 and report[0].kernel is None
    assert "not an int8 tensor" in report[0].reason and "float32" in report[0].reason
    x = layer.inputs(0)
    got = tvm_tpp.compile(model, target=INT8_KERNELS).run(x=x)[0]
    assert max_errors([got], _qdq_reference(model, {"x": x}))[1] <= 1e-2


def _residual_block() -> onnx.ModelProto:
    """``relu(conv2(relu(conv1(x))) + x)``: a basic residual block, odd channels."""
    rng = np.random.default_rng(3)
    c = 12
    w = [numpy_helper.from_array((rng.standard_normal((c, c, 3, 3)) * 0.15).astype("float32"),
                                 f"w{i}") for i in (1, 2)]
    b = [numpy_helper.from_array((0.1 * rng.standard_normal(c)).astype("float32"), f"b{i}")
         for i in (1, 2)]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1] * 4),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1] * 4),
             helper.make_node("Add", ["c2", "x"], ["sum"]),
             helper.make_node("Relu", ["sum"], ["y"])]
    graph = helper.make_graph(
        nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 9, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [*w, *b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _quantized_residual_block(tmp_path) -> tuple[onnx.ModelProto, _Conv]:
    """:func:`_residual_block` quantized (QDQ, per-channel s8 weights, u8 activations), and
    the layer whose inputs calibrate and feed it."""
    src, dst = tmp_path / "float.onnx", tmp_path / "qdq.onnx"
    onnx.save(_residual_block(), str(src))
    layer = _Conv(12, 12, (9, 7), 3)
    quantize_static(str(src), str(dst), _Inputs(layer), quant_format=QuantFormat.QDQ,
                    per_channel=True, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8)
    return onnx.load(str(dst)), layer


def test_quantized_residual_add_joins_the_conv_kernel(tmp_path):
    model, layer = _quantized_residual_block(tmp_path)
    _, report = _int8_report(model)
    assert sorted(r.op for r in report) == [
        "conv2d_qdq+bias+quantize+residual+quantize_u8", "conv2d_qdq+bias+quantize_u8"]
    assert all(r.dtypes == "uint8*int8->int32" for r in report)
    mod, _ = _int8_report(model)
    adds = []
    relax.analysis.post_order_visit(mod["main"], lambda e: adds.append(e)
                                    if is_call_to(e, "relax.add") else None)
    assert not adds  # the residual add is in the kernel's epilogue
    _assert_matches_qdq(model, layer)


# Both slow (5 s and more): test_symbolic_batch's quantized resnet_small runs the int8 kernels
# in the default suite.
@pytest.mark.parametrize("name", [pytest.param("resnet_small", marks=pytest.mark.slow),
                                  pytest.param("mobilenet_v2", marks=pytest.mark.slow)])
def test_quantized_network_runs_its_convs_on_int8_kernels(name, tmp_path):
    float_model = models.load(name)
    path = quantize_static_qdq(float_model, tmp_path / "int8.onnx", samples=2)
    model = onnx.load(str(path))
    compiled = tvm_tpp.compile(model, target=INT8_KERNELS)
    routed = [r for r in compiled.report if r.op.startswith(("conv2d_qdq", "matmul_qdq"))]
    # Every conv and Gemm, mobilenet_v2's depthwise convs included, on an int8 kernel.
    assert all(r.kernel is not None and r.dtypes == "uint8*int8->int32" for r in routed), [
        r for r in routed if r.kernel is None or r.dtypes != "uint8*int8->int32"]
    convs = [n for n in float_model.graph.node if n.op_type == "Conv"]
    gemms = sum(n.op_type == "Gemm" for n in float_model.graph.node)
    assert len(routed) == len(convs) + gemms
    depthwise = [r for r in routed if "tpp_dwconv2d" in r.kernel]
    assert len(depthwise) == sum(any(a.name == "group" and a.i > 1 for a in n.attribute)
                                 for n in convs)
    x = models.random_inputs(float_model, seed=1)
    got, want = compiled.run(**x)[0], _qdq_reference(model, x)[0]
    # The output is the float logits: the integer chains are exact, a rounding tie may land
    # on the other side of one quantization step.
    assert max_errors([got], [want])[1] <= 1e-2
