"""Quantized tensors stay quantized through data movement, ReLU and concat (relay_passes.keep_int8).

Each rewrite against its expected IR (``tvm.ir.assert_structural_equal``), the cases it must
leave alone (another scale or zero point, a per-channel quantization), and a QDQ graph of
these operators built with onnx.helper, compiled for the tpp target and compared with ONNX
Runtime on the same file: the rewrites are exact, so the outputs are equal.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import tvm_tpp
from relay_passes.keep_int8 import keep_int8
from tvm_tpp.compiler import import_model
from tvm_tpp.reference import run_onnxruntime

S, Z = relax.const(0.25), relax.const(7, "uint8")


def _func(x_shape, body, x_dtype="uint8") -> tvm.IRModule:
    """``main(x)`` whose dataflow block emits ``body(bb, x)``."""
    x = relax.Var("x", relax.TensorType(x_shape, x_dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(body(bb, x))
        bb.emit_func_output(out)
    return bb.get()


def _qdq(op, s=S, z=Z, s_out=S, z_out=Z):
    return lambda bb, x: relax.op.quantize(bb.emit(op(bb.emit(relax.op.dequantize(x, s, z)))),
                                           s_out, z_out, out_dtype="uint8")


MOVES = {
    "reshape": lambda t: relax.op.reshape(t, (4, 6)),
    "permute_dims": lambda t: relax.op.permute_dims(t, [0, 2, 1]),
    "flatten": lambda t: relax.op.reshape(t, (24,)),
    "strided_slice": lambda t: relax.op.strided_slice(t, axes=[2], begin=[1], end=[4]),
    "expand_dims": lambda t: relax.op.expand_dims(t, 0),
}


@pytest.mark.parametrize("name", sorted(MOVES))
def test_data_movement_runs_on_the_integers(name):
    op = MOVES[name]
    after = keep_int8(_func((2, 3, 4), _qdq(op)))
    expected = _func((2, 3, 4), lambda bb, x: op(x))
    tvm.ir.assert_structural_equal(after, expected)


def test_max_pool_runs_on_the_integers():
    def pool(t):
        return relax.op.nn.max_pool2d(t, pool_size=3, strides=2, padding=1)

    after = keep_int8(_func((1, 2, 7, 7), _qdq(pool)))
    tvm.ir.assert_structural_equal(after, _func((1, 2, 7, 7), lambda bb, x: pool(x)))


def test_relu_is_a_maximum_with_the_zero_point():
    after = keep_int8(_func((3, 5), _qdq(relax.op.nn.relu)))
    expected = _func((3, 5), lambda bb, x: relax.op.maximum(
        x, relax.const(np.array(7, "uint8"))))
    tvm.ir.assert_structural_equal(after, expected)


def test_a_bare_round_trip_goes():
    identity = _func((3, 5), lambda bb, x: relax.op.quantize(
        bb.emit(relax.op.dequantize(x, S, Z)), S, Z, out_dtype="uint8"))
    assert keep_int8(identity)["main"].body.body.same_as(identity["main"].params[0])


@pytest.mark.parametrize("case", ["other scale", "other zero point", "other dtype",
                                  "per channel"])
def test_other_quantizations_are_left_alone(case):
    s_out, z_out, s, out_dtype = S, Z, S, "uint8"
    if case == "other scale":
        s_out = relax.const(0.5)
    elif case == "other zero point":
        z_out = relax.const(8, "uint8")
    elif case == "other dtype":
        out_dtype = "int8"
    else:
        s = s_out = relax.const(np.full(3, 0.25, "float32"))

    def body(bb, x):
        y = bb.emit(relax.op.reshape(bb.emit(relax.op.dequantize(x, s, Z, axis=0)), (3, 4)))
        return relax.op.quantize(y, s_out, z_out if out_dtype == "uint8" else relax.const(
            0, "int8"), axis=0, out_dtype=out_dtype)

    before = _func((3, 4), body)
    tvm.ir.assert_structural_equal(keep_int8(before), before)


def test_concat_requantizes_only_the_inputs_quantized_otherwise():
    other_s, other_z = relax.const(0.5), relax.const(3, "uint8")

    def before(bb, x):
        a = bb.emit(relax.op.dequantize(x, S, Z))
        b = bb.emit(relax.op.dequantize(x, other_s, other_z))
        cat = bb.emit(relax.op.concat([a, b], axis=1))
        return relax.op.quantize(cat, S, Z, out_dtype="uint8")

    def expected(bb, x):
        b = bb.emit(relax.op.dequantize(x, other_s, other_z))
        return relax.op.concat([x, relax.op.quantize(b, S, Z, out_dtype="uint8")], axis=1)

    tvm.ir.assert_structural_equal(keep_int8(_func((2, 3), before)), _func((2, 3), expected))


def _qdq_graph() -> onnx.ModelProto:
    """x -> Q -> DQ -> Transpose -> Q -> DQ -> MaxPool -> Q -> DQ -> Relu -> Q -> DQ ->
    Concat(with a branch quantized otherwise) -> Q -> DQ -> Reshape -> Q -> DQ: the shapes of
    ONNX Runtime's QDQ output, odd sizes."""
    nodes, inits = [], []

    def const(name, value, dtype=None):
        inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def qdq(x, tag, scale, zero):
        s, z = const(f"s_{tag}", scale, "float32"), const(f"z_{tag}", zero, "uint8")
        nodes.append(helper.make_node("QuantizeLinear", [x, s, z], [f"q_{tag}"]))
        nodes.append(helper.make_node("DequantizeLinear", [f"q_{tag}", s, z], [f"dq_{tag}"]))
        return f"dq_{tag}"

    t = qdq("x", "in", 0.03, 128)
    nodes.append(helper.make_node("Transpose", [t], ["t"], perm=[0, 1, 3, 2]))
    p = qdq("t", "t", 0.03, 128)
    nodes.append(helper.make_node("MaxPool", [p], ["p"], kernel_shape=[3, 3], strides=[2, 2],
                                  pads=[1, 1, 1, 1]))
    r = qdq("p", "p", 0.03, 128)
    nodes.append(helper.make_node("Relu", [r], ["r"]))
    a = qdq("r", "r", 0.03, 128)
    b = qdq("p", "branch", 0.05, 100)
    nodes.append(helper.make_node("Concat", [a, b], ["c"], axis=1))
    c = qdq("c", "c", 0.03, 128)
    nodes.append(helper.make_node("Reshape", [c, const("shape", [1, -1], "int64")], ["y0"]))
    y = qdq("y0", "out", 0.03, 128)
    graph = helper.make_graph(
        nodes, "qdq_moves", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                           [1, 3, 9, 11])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, [1, 75])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_qdq_graph_equals_onnxruntime():
    model = _qdq_graph()
    mod, _ = import_model(model)
    quantizes = [b for b in keep_int8(mod)["main"].body.blocks[0].bindings
                 if b.value.op.name == "relax.quantize"]
    assert len(quantizes) == 3  # x's, the other branch's and its requantization to the concat's
    x = np.random.default_rng(0).standard_normal((1, 3, 9, 11)).astype("float32") * 2
    compiled = tvm_tpp.compile(model, "tpp")
    (got,) = compiled.run(x=x)
    (want,) = run_onnxruntime(model, {"x": x}, optimize=False)  # ONNX's roundings
    np.testing.assert_array_equal(got, want)
