"""Relax conv rewrite: conv2d chains become TPP kernels; the rest is reported with a reason.

Each CNN is built with onnx.helper, prepared (BatchNorm folded into the convs), rewritten with
``rewrite_conv``, built with the tpp pipeline and checked against ONNX Runtime.  The preparation
and the layout cancellation have tests of their own (test_prepare.py, test_layouts.py).
"""

import re

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from relay_passes import tpp_flops_fraction
from relay_passes.conv import rewrite_conv
from relay_passes.pipeline import tpp_pipeline
from relay_passes.prepare import prepare
from tvm_tpp.compiler import CompiledModel, import_model
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime
from tvm_tpp.tpp_target import target as make_target


class _Net:
    """A tiny ONNX graph builder with seeded weights."""

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.weights = [], {}

    def const(self, name, value):
        self.weights[name] = value.astype("float32")
        return name

    def conv(self, x, name, cin, cout, k, stride=1, pad=None, bias=False, **attrs):
        pad = k // 2 if pad is None else pad
        fan_in = cin // attrs.get("group", 1) * k * k
        w = self.const(f"{name}.w", self.rng.standard_normal(
            (cout, cin // attrs.get("group", 1), k, k)) / np.sqrt(fan_in))
        inputs = [x, w] + ([self.const(f"{name}.b", self.rng.normal(0, 0.1, cout))] if bias else [])
        self.nodes.append(helper.make_node("Conv", inputs, [name], kernel_shape=[k, k],
                                           strides=[stride] * 2, pads=[pad] * 4, **attrs))
        return name

    def bn(self, x, name, c):
        stats = [self.rng.uniform(0.8, 1.2, c), self.rng.normal(0, 0.05, c),
                 self.rng.normal(0, 0.05, c), self.rng.uniform(0.5, 1.5, c)]
        names = [self.const(f"{name}.{i}", s) for i, s in enumerate(stats)]
        return self.op("BatchNormalization", [x, *names], name, epsilon=1e-5)

    def op(self, op_type, inputs, name, **attrs):
        self.nodes.append(helper.make_node(op_type, inputs, [name], **attrs))
        return name

    def model(self, x_shape, y, y_shape):
        graph = helper.make_graph(
            self.nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
            [helper.make_tensor_value_info(y, TensorProto.FLOAT, y_shape)],
            [numpy_helper.from_array(v, k) for k, v in self.weights.items()])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                 ir_version=8)


def _rewrite(model, target="tpp"):
    tgt = make_target(target)
    mod, specs = import_model(model)
    mod = prepare()(mod)  # BatchNorm folded into the convs
    report = []
    return rewrite_conv(mod, tgt, report), report, tgt, specs


def _compile_and_check(model):
    mod, report, tgt, specs = _rewrite(model)
    executable = tvm.compile(mod, target=tgt, relax_pipeline=tpp_pipeline(tgt))
    compiled = CompiledModel(executable, tgt, specs)
    inputs = random_inputs(specs, seed=1)
    _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
    assert rel <= 1e-5
    return mod, report


def _ops(mod, name):
    found = []
    relax.analysis.post_order_visit(
        mod["main"], lambda e: found.append(e) if isinstance(e, relax.Call)
        and isinstance(e.op, tvm.ir.Op) and e.op.name == name else None)
    return found


def test_conv_bn_relu_stem_and_pooling():
    """RGB stem (stride 2, taps folded), MaxPool and GlobalAveragePool between TPP convs."""
    net = _Net()
    h = net.op("Relu", [net.bn(net.conv("x", "stem", 3, 16, 3, stride=2), "stem.bn", 16)], "r0")
    h = net.op("MaxPool", [h], "pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4)
    h = net.op("Relu", [net.bn(net.conv(h, "c1", 16, 24, 3), "c1.bn", 24)], "r1")
    h = net.conv(h, "c2", 24, 8, 1, bias=True)  # ONNX Conv bias, no activation
    net.op("GlobalAveragePool", [h], "y")
    mod, report = _compile_and_check(net.model([2, 3, 17, 17], "y", [2, 8, 1, 1]))
    assert sorted(r.op for r in report) == ["conv2d+bias", "conv2d+bias+relu",
                                            "conv2d+bias+relu"]
    assert all(r.kernel.startswith("tpp_conv2d_") for r in report)
    # The convs pass NHWC along: only the pooled output is permuted (the stem's kernel reads
    # the NCHW image itself: tests/test_image_input.py).
    assert len(_ops(mod, "relax.permute_dims")) == 1
    assert _ops(mod, "relax.nn.max_pool2d")[0].attrs.layout == "NHWC"


def test_residual_blocks():
    """Identity shortcut (Add, either operand order) and a strided 1x1 projection (ONNX Sum)."""
    net = _Net(seed=3)
    x = net.op("Relu", [net.conv("x", "c0", 8, 16, 3)], "r0")
    h = net.op("Relu", [net.bn(net.conv(x, "c1", 16, 16, 3), "bn1", 16)], "r1")
    h = net.bn(net.conv(h, "c2", 16, 16, 3), "bn2", 16)
    x = net.op("Relu", [net.op("Add", [x, h], "add")], "r2")  # residual on the left
    h = net.op("Relu", [net.bn(net.conv(x, "c3", 16, 32, 3, stride=2), "bn3", 32)], "r3")
    h = net.bn(net.conv(h, "c4", 32, 32, 3), "bn4", 32)
    shortcut = net.bn(net.conv(x, "proj", 16, 32, 1, stride=2, pad=0), "bnp", 32)
    net.op("Relu", [net.op("Sum", [h, shortcut], "sum")], "y")
    mod, report = _compile_and_check(net.model([1, 8, 11, 11], "y", [1, 32, 6, 6]))
    assert sorted(r.op for r in report) == [
        "conv2d+bias", "conv2d+bias+relu", "conv2d+bias+relu", "conv2d+bias+residual+relu",
        "conv2d+bias+residual+relu", "conv2d+relu"]
    assert not _ops(mod, "relax.sum") and len(_ops(mod, "relax.permute_dims")) == 2


def test_grouped_and_dilated_convs_are_routed_and_a_variable_weight_says_why():
    net = _Net(seed=5)
    h = net.conv("x", "grouped", 8, 8, 3, group=4)  # 2 channels a group
    h = net.conv(h, "dilated", 8, 8, 3, pad=2, dilations=[2, 2])
    net.op("Relu", [net.conv(h, "pw", 8, 16, 1)], "r")
    net.op("Conv", ["r", "w_in"], "y", pads=[1] * 4)  # a weight the graph is given
    model = net.model([1, 8, 9, 9], "y", [1, 4, 9, 9])
    model.graph.input.append(helper.make_tensor_value_info("w_in", TensorProto.FLOAT,
                                                           [4, 16, 3, 3]))
    _, report = _compile_and_check(model)
    assert [r.reason for r in report if r.kernel is None] == ["weight is not a constant"]
    kernels = sorted(r.kernel.split()[0] for r in report if r.kernel)
    assert kernels == ["tpp_conv2d_1x8x9x9_16x1x1_s1x1_relu",
                       "tpp_conv2d_1x8x9x9_8x3x3_s1x1_d2x2", "tpp_conv2d_1x8x9x9_8x3x3_s1x1_g4"]
    # 2 x the multiply-adds: grouped 8*81*2*9, dilated 8*81*8*9, 1x1 16*81*8; left 4*81*16*9
    routed = 2 * (8 * 81 * 2 * 9 + 8 * 81 * 8 * 9 + 16 * 81 * 8)
    assert sorted(r.flops for r in report) == sorted([2 * 8 * 81 * 2 * 9, 2 * 8 * 81 * 8 * 9,
                                                      2 * 16 * 81 * 8, 2 * 4 * 81 * 16 * 9])
    assert tpp_flops_fraction(report) == routed / (routed + 2 * 4 * 81 * 16 * 9)


def test_float64_conv_falls_back():
    w = np.ones((4, 2, 3, 3))
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "W"], ["y"], pads=[1] * 4)], "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [1, 2, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [1, 4, 5, 5])],
        [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    mod, report, _, _ = _rewrite(model)
    assert [r.reason for r in report] == [
        "dtype float64 x float64: only float32 conv2d is routed to TPP"]
    assert len(_ops(mod, "relax.nn.conv2d")) == 1


#: The vector registers each x86 ISA's kernels compute in.
VECTOR_REGISTER = {"avx2": "ymm", "avx512": "zmm"}


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_kernels_for_each_x86_isa_build(isa):
    """The same CNN builds for each x86 ISA: its kernel's FMAs use the ISA's vector
    registers, and where the host runs the ISA the result matches ONNX Runtime."""
    net = _Net(seed=7)
    net.op("Relu", [net.bn(net.conv("x", "c", 4, 32, 3), "bn", 32)], "y")
    model = net.model([1, 4, 6, 6], "y", [1, 32, 6, 6])
    mod, report, tgt, specs = _rewrite(model, f"tpp -isa={isa}")
    assert [r.op for r in report] == ["conv2d+bias+relu"]
    compiled = CompiledModel(tvm.compile(mod, target=tgt, relax_pipeline=tpp_pipeline(tgt)),
                             tgt, specs)
    fma = rf"vfmadd\d+ps\s[^\n]*%{VECTOR_REGISTER[isa]}"
    assert re.search(fma, compiled.source("asm")), f"no {isa} FMA in the assembly"
    if not compiled.runnable:
        pytest.skip(f"this host cannot run {isa}: only the assembly was checked")
    inputs = random_inputs(specs)
    _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
    assert rel <= 1e-5
