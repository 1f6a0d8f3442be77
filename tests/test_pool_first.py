"""Average pools moved before the pointwise conv they follow (relay_passes.pool_first).

The Relax rewrite as Before/Expected, numerically through the VM against numpy for pools of
several geometries (padded, ceil mode, both divisors), the pairs it must leave alone, and a
DenseNet transition layer against ONNX Runtime.
"""

import numpy as np
import pytest
import tvm
from conftest import relax_main, run_main
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from relay_passes.pool_first import pool_before_pointwise_conv
from tvm_tpp import compiler
from tvm_tpp.reference import max_errors, run_onnxruntime

F32 = "float32"
RNG = np.random.default_rng(6)
WEIGHT = RNG.standard_normal((5, 6, 1, 1)).astype(F32)


def _x(shape=(1, 6, 9, 7)) -> relax.Var:
    return relax.Var("x", relax.TensorType(shape, F32))


def _pool(y, **attrs):
    return relax.op.nn.avg_pool2d(y, **{"pool_size": 2, "strides": 2, **attrs})


def test_pool_moved_before_the_conv():
    before = relax_main([_x()], lambda bb, x: _pool(
        bb.emit(relax.op.nn.conv2d(x, relax.const(WEIGHT)))))
    expected = relax_main([_x()], lambda bb, x: relax.op.nn.conv2d(
        bb.emit(_pool(x)), relax.const(WEIGHT)))
    tvm.ir.assert_structural_equal(pool_before_pointwise_conv(before), expected)


@pytest.mark.parametrize("attrs", [
    {},
    {"padding": 1, "count_include_pad": True},
    {"padding": 1, "count_include_pad": False},
    {"pool_size": 3, "strides": 2, "ceil_mode": True},
], ids=["2x2", "padded-with-pads", "padded-without-pads", "3x3-ceil"])
def test_same_result(attrs):
    before = relax_main([_x()], lambda bb, x: _pool(
        bb.emit(relax.op.nn.conv2d(x, relax.const(WEIGHT))), **attrs))
    after = pool_before_pointwise_conv(before)
    ops = [b.value.op.name for b in after["main"].body.blocks[0].bindings[:2]]
    assert ops == ["relax.nn.avg_pool2d", "relax.nn.conv2d"], ops
    x = RNG.standard_normal((1, 6, 9, 7)).astype(F32)
    np.testing.assert_allclose(run_main(after, x), run_main(before, x), rtol=1e-5, atol=1e-5)


def _read_twice(bb, x):
    y = bb.emit(relax.op.nn.conv2d(x, relax.const(WEIGHT)))
    return relax.Tuple([bb.emit(_pool(y)), y])


def _three_by_three(bb, x):
    weight = RNG.standard_normal((5, 6, 3, 3)).astype(F32)
    return _pool(bb.emit(relax.op.nn.conv2d(x, relax.const(weight), padding=1)))


def _strided_conv(bb, x):
    return _pool(bb.emit(relax.op.nn.conv2d(x, relax.const(WEIGHT), strides=2)))


def _pool_keeps_the_size(bb, x):
    return _pool(bb.emit(relax.op.nn.conv2d(x, relax.const(WEIGHT))), pool_size=3, strides=1,
                 padding=1)


@pytest.mark.parametrize("body", [_read_twice, _three_by_three, _strided_conv,
                                  _pool_keeps_the_size],
                         ids=["conv-read-twice", "3x3", "strided", "same-size"])
def test_pairs_kept(body):
    mod = relax_main([_x()], body)
    tvm.ir.assert_structural_equal(pool_before_pointwise_conv(mod), mod)


def test_densenet_transition_matches_onnxruntime():
    """Stem conv, then BatchNorm, ReLU, 1x1 conv and 2x2 average pool at odd sizes."""
    rng = np.random.default_rng(8)
    inits = {"stem": rng.standard_normal((12, 3, 3, 3)).astype(F32) / 3,
             "g": rng.uniform(0.8, 1.2, 12).astype(F32), "b": rng.normal(0, 0.1, 12).astype(F32),
             "m": rng.normal(0, 0.1, 12).astype(F32), "v": rng.uniform(0.5, 1.5, 12).astype(F32),
             "w": rng.standard_normal((6, 12, 1, 1)).astype(F32) / 4}
    nodes = [helper.make_node("Conv", ["x", "stem"], ["s"], pads=[1] * 4),
             helper.make_node("BatchNormalization", ["s", "g", "b", "m", "v"], ["n"]),
             helper.make_node("Relu", ["n"], ["r"]),
             helper.make_node("Conv", ["r", "w"], ["t"]),
             helper.make_node("AveragePool", ["t"], ["out"], kernel_shape=[2, 2],
                              strides=[2, 2])]
    graph = helper.make_graph(
        nodes, "transition", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                            [1, 3, 10, 14])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 6, 5, 7])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    names = [gv.name_hint for gv in compiler.lower(model).functions]
    assert any(n.startswith("tpp_conv2d_1x12x5x7_6x1x1") for n in names), names
    x = rng.standard_normal((1, 3, 10, 14)).astype(F32)
    got = compiler.compile(model, "tpp", untuned=True).run(x=x)
    assert max_errors(got, run_onnxruntime(model, {"x": x}))[1] < 1e-5
