"""Graph preparation: the ONNX Sum repaired into adds, constant transposes folded by
``prepare()``, BatchNorm gone from a conv-BN-ReLU-Sum block (``tests/test_scale_shift.py``
checks the folding itself).

Each rewrite is checked structurally (Before/Expected modules) and numerically (ONNX models of
odd sizes built through the pipeline for a plain llvm target, which prepares and then lowers
with TVM, against ONNX Runtime).
"""

import functools

import numpy as np
import onnx
import pytest
import tvm
from conftest import bn_stats, relax_main
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import tvm_tpp
from relay_passes.prepare import prepare, sum_to_add
from tvm_tpp.compiler import import_model
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime

LLVM = {"kind": "llvm", "mcpu": "haswell"}


# TVMScript parsed when a test asks: parsed at import, each function costs ~0.3 s per worker.
@functools.cache
def _SumOfThree_ir():
    @I.ir_module
    class SumOfThree:
        @R.function
        def main(a: R.Tensor((2, 3, 5), "float32"), b: R.Tensor((2, 3, 5), "float32"),
                 c: R.Tensor((2, 3, 5), "float32")) -> R.Tensor((2, 3, 5), "float32"):
            with R.dataflow():
                ba = R.broadcast_to(a, R.shape([2, 3, 5]))
                bb = R.broadcast_to(b, R.shape([2, 3, 5]))
                bc = R.broadcast_to(c, R.shape([2, 3, 5]))
                stacked = R.stack((ba, bb, bc), axis=0)
                gv = R.sum(stacked, axis=[0], keepdims=False)
                R.output(gv)
            return gv
    return SumOfThree


@functools.cache
def _ChainedAdds_ir():
    @I.ir_module
    class ChainedAdds:
        @R.function
        def main(a: R.Tensor((2, 3, 5), "float32"), b: R.Tensor((2, 3, 5), "float32"),
                 c: R.Tensor((2, 3, 5), "float32")) -> R.Tensor((2, 3, 5), "float32"):
            with R.dataflow():
                ab = R.add(a, b)
                gv = R.add(ab, c)
                R.output(gv)
            return gv
    return ChainedAdds


@functools.cache
def _SumWithBroadcast_ir():
    @I.ir_module
    class SumWithBroadcast:
        """``b`` is really broadcast: the sum is not an add of the terms as they are."""

        @R.function
        def main(a: R.Tensor((2, 3, 5), "float32"),
                 b: R.Tensor((1, 3, 5), "float32")) -> R.Tensor((2, 3, 5), "float32"):
            with R.dataflow():
                ba = R.broadcast_to(a, R.shape([2, 3, 5]))
                bb = R.broadcast_to(b, R.shape([2, 3, 5]))
                stacked = R.stack((ba, bb), axis=0)
                gv = R.sum(stacked, axis=[0], keepdims=False)
                R.output(gv)
            return gv
    return SumWithBroadcast


def test_onnx_sum_becomes_chained_adds():
    tvm.ir.assert_structural_equal(sum_to_add(_SumOfThree_ir()), _ChainedAdds_ir())


def test_sum_with_a_real_broadcast_stays():
    tvm.ir.assert_structural_equal(sum_to_add(_SumWithBroadcast_ir()), _SumWithBroadcast_ir())


def test_prepare_folds_the_transpose_of_a_constant_weight():
    """ONNX Gemm(transB=1) imports as ``x @ permute_dims(W)``: the dense pattern wants W."""
    w = np.random.default_rng(2).standard_normal((9, 13)).astype("float32")
    x = relax.Var("x", relax.TensorType((5, 13), "float32"))
    before = relax_main([x], lambda bb, x: relax.op.matmul(
        x, bb.emit(relax.op.permute_dims(relax.const(w)))))
    expected = relax_main([relax.Var("x", relax.TensorType((5, 13), "float32"))],
                     lambda bb, x: relax.op.matmul(x, relax.const(np.ascontiguousarray(w.T))))
    tvm.ir.assert_structural_equal(prepare()(before), expected)


def _conv_bn_sum_model(conv_bias: bool = False) -> onnx.ModelProto:
    """Conv (with its own bias) + BN (odd sizes), its ReLU, and an ONNX Sum with the input: a
    residual block."""
    rng = np.random.default_rng(3)
    c = 5
    weights = {"w": rng.standard_normal((c, c, 3, 3)).astype("float32") / 6}
    weights.update(zip(["g", "b", "m", "v"], bn_stats(rng, c), strict=True))
    if conv_bias:
        weights["cb"] = rng.standard_normal(c).astype("float32")
    nodes = [helper.make_node("Conv", ["x", "w", "cb"] if conv_bias else ["x", "w"], ["y"],
                              kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("BatchNormalization", ["y", "g", "b", "m", "v"], ["n"]),
             helper.make_node("Relu", ["n"], ["r"]),
             helper.make_node("Sum", ["r", "x"], ["out"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 7, 9])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, c, 7, 9])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("conv_bias", [False, True])
def test_prepared_graph_matches_onnxruntime(conv_bias):
    model = _conv_bn_sum_model(conv_bias)
    compiled = tvm_tpp.compile(model, target=LLVM)
    inputs = random_inputs(compiled.inputs, seed=4)
    _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
    assert rel <= 1e-5


@pytest.mark.parametrize("conv_bias", [False, True])
def test_prepare_then_sum_repair_leave_one_conv_and_adds(conv_bias):
    mod, _ = import_model(_conv_bn_sum_model(conv_bias))
    mod = sum_to_add(prepare()(mod))
    ops = []
    relax.analysis.post_order_visit(mod["main"], lambda e: ops.append(e.op.name) if isinstance(
        e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    assert sorted(ops) == ["relax.add", "relax.add", "relax.nn.conv2d", "relax.nn.relu"]
