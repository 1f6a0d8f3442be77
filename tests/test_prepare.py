"""Graph preparation: BatchNorm folded into the conv before it, the ONNX Sum repaired into
adds, constant transposes folded by ``prepare()``.

Each rewrite is checked structurally (Before/Expected modules) and numerically (ONNX models of
odd sizes built through the pipeline for a plain llvm target, which prepares and then lowers
with TVM, against ONNX Runtime).
"""

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import tvm_tpp
from relay_passes.prepare import fold_batchnorm, prepare, sum_to_add
from tvm_tpp.compiler import import_model
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime

LLVM = {"kind": "llvm", "mcpu": "haswell"}
X_SHAPE, W_SHAPE = (1, 3, 5, 7), (4, 3, 3, 3)


def _bn_stats(rng: np.random.Generator, c: int) -> list[np.ndarray]:
    """gamma, beta, mean, variance."""
    return [rng.uniform(0.8, 1.2, c).astype("float32"), rng.normal(0, 0.1, c).astype("float32"),
            rng.normal(0, 0.1, c).astype("float32"), rng.uniform(0.5, 1.5, c).astype("float32")]


def _main(params: list[relax.Var], body) -> tvm.IRModule:
    """``main(*params)`` whose dataflow block ``body(bb, *params)`` computes the output."""
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *params))
        bb.emit_func_output(out)
    return bb.get()


def _conv_bn(w: relax.Expr, stats: list[np.ndarray], own_bias: np.ndarray | None = None,
             **bn_attrs) -> tvm.IRModule:
    def body(bb, x, *_):
        y = bb.emit(relax.op.nn.conv2d(x, w, padding=1))
        if own_bias is not None:
            y = bb.emit(relax.op.add(y, relax.const(own_bias)))
        norm = bb.emit(relax.op.nn.batch_norm(y, *map(relax.const, stats), axis=1,
                                              epsilon=1e-5, training=False, **bn_attrs))
        return relax.TupleGetItem(norm, 0)

    params = [relax.Var("x", relax.TensorType(X_SHAPE, "float32"))]
    if isinstance(w, relax.Var):
        params.append(w)
    return _main(params, body)


@pytest.mark.parametrize("center, scale", [(True, True), (False, True), (True, False)])
def test_batchnorm_folds_into_conv_weight_and_bias(center, scale):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(W_SHAPE).astype("float32")
    gamma, beta, mean, var = _bn_stats(rng, W_SHAPE[0])
    before = _conv_bn(relax.const(w), [gamma, beta, mean, var], center=center, scale=scale)

    # What fold_batchnorm promises: W * s and b - m * s, s = g / sqrt(v + eps), in float64.
    g = gamma.astype(np.float64) if scale else np.ones(W_SHAPE[0])
    bias = beta.astype(np.float64) if center else np.zeros(W_SHAPE[0])
    s = g / np.sqrt(var.astype(np.float64) + 1e-5)
    folded_w = (w * s[:, None, None, None]).astype("float32")
    folded_b = (bias - mean * s).astype("float32").reshape(1, -1, 1, 1)
    expected = _main([relax.Var("x", relax.TensorType(X_SHAPE, "float32"))], lambda bb, x: (
        relax.op.add(bb.emit(relax.op.nn.conv2d(x, relax.const(folded_w), padding=1)),
                     relax.const(folded_b))))
    tvm.ir.assert_structural_equal(fold_batchnorm(before), expected)


@pytest.mark.parametrize("bias_shape", [(1, 4, 1, 1), (4, 1, 1)])
def test_batchnorm_after_a_conv_with_its_own_bias_folds_both(bias_shape):
    """``Conv(x, W, B)`` then BatchNorm, as Caffe2 and PyTorch exports with ``bias=True``
    write it (ShuffleNet's stem): the conv's bias shifts the mean."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal(W_SHAPE).astype("float32")
    c = rng.standard_normal(bias_shape).astype("float32")
    gamma, beta, mean, var = _bn_stats(rng, W_SHAPE[0])
    before = _conv_bn(relax.const(w), [gamma, beta, mean, var], own_bias=c)

    s = gamma.astype(np.float64) / np.sqrt(var.astype(np.float64) + 1e-5)
    folded_w = (w * s[:, None, None, None]).astype("float32")
    folded_b = (beta + (c.reshape(-1) - mean.astype(np.float64)) * s).astype("float32")
    expected = _main([relax.Var("x", relax.TensorType(X_SHAPE, "float32"))], lambda bb, x: (
        relax.op.add(bb.emit(relax.op.nn.conv2d(x, relax.const(folded_w), padding=1)),
                     relax.const(folded_b.reshape(1, -1, 1, 1)))))
    tvm.ir.assert_structural_equal(fold_batchnorm(before), expected)


def test_batchnorm_after_a_conv_plus_a_full_tensor_stays():
    """An added constant that varies over the image is no per-channel bias."""
    rng = np.random.default_rng(3)
    before = _conv_bn(relax.const(rng.standard_normal(W_SHAPE).astype("float32")),
                      _bn_stats(rng, W_SHAPE[0]),
                      own_bias=rng.standard_normal((1, 4, 5, 7)).astype("float32"))
    tvm.ir.assert_structural_equal(fold_batchnorm(before), before)


def test_batchnorm_after_a_conv_with_varying_weights_stays():
    rng = np.random.default_rng(1)
    before = _conv_bn(relax.Var("w", relax.TensorType(W_SHAPE, "float32")),
                      _bn_stats(rng, W_SHAPE[0]))
    tvm.ir.assert_structural_equal(fold_batchnorm(before), before)


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


def test_onnx_sum_becomes_chained_adds():
    tvm.ir.assert_structural_equal(sum_to_add(SumOfThree), ChainedAdds)


def test_sum_with_a_real_broadcast_stays():
    tvm.ir.assert_structural_equal(sum_to_add(SumWithBroadcast), SumWithBroadcast)


def test_prepare_folds_the_transpose_of_a_constant_weight():
    """ONNX Gemm(transB=1) imports as ``x @ permute_dims(W)``: the dense pattern wants W."""
    w = np.random.default_rng(2).standard_normal((9, 13)).astype("float32")
    x = relax.Var("x", relax.TensorType((5, 13), "float32"))
    before = _main([x], lambda bb, x: relax.op.matmul(
        x, bb.emit(relax.op.permute_dims(relax.const(w)))))
    expected = _main([relax.Var("x", relax.TensorType((5, 13), "float32"))],
                     lambda bb, x: relax.op.matmul(x, relax.const(np.ascontiguousarray(w.T))))
    tvm.ir.assert_structural_equal(prepare()(before), expected)


def _conv_bn_sum_model(conv_bias: bool = False) -> onnx.ModelProto:
    """Conv (with its own bias) + BN (odd sizes), its ReLU, and an ONNX Sum with the input: a
    residual block."""
    rng = np.random.default_rng(3)
    c = 5
    weights = {"w": rng.standard_normal((c, c, 3, 3)).astype("float32") / 6}
    weights.update(zip(["g", "b", "m", "v"], _bn_stats(rng, c), strict=True))
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
