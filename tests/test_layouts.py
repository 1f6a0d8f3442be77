"""Layout cancellation between TPP convs: NHWC <-> NCHW permutes cancel, through pooling,
resizing, spatial means, elementwise chains (HardSwish) and the residual operand of the next
conv.

Each case is a Before/Expected pair of TVMScript modules, checked structurally and numerically
(Before and the simplified module built with TVM and run on the same random data, odd sizes).
The pairs are parsed when a test first asks for them: TVMScript parsed during an import costs
about 0.3 s a module (``inspect.stack`` over the import's frames), in every pytest worker.
"""

import functools

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tvm_tpp
from relay_passes.layouts import simplify_layouts
from tvm_tpp.compiler import lower
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime

LLVM = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})


# An NHWC tensor (a TPP conv's output) seen as NCHW, pooled, and turned back to NHWC for the
# next conv: the pooling runs on the NHWC tensor and both permutes go.
@functools.cache
def _max_pool() -> tuple[tvm.IRModule, tvm.IRModule]:
    @I.ir_module
    class MaxPoolBefore:
        @R.function
        def main(x: R.Tensor((1, 5, 7, 3), "float32")) -> R.Tensor((1, 3, 4, 3), "float32"):
            with R.dataflow():
                nchw = R.permute_dims(x, axes=[0, 3, 1, 2])
                pooled = R.nn.max_pool2d(nchw, pool_size=[3, 3], strides=[2, 2],
                                         padding=[1, 1, 1, 1])
                gv = R.permute_dims(pooled, axes=[0, 2, 3, 1])
                R.output(gv)
            return gv

    @I.ir_module
    class MaxPoolExpected:
        @R.function
        def main(x: R.Tensor((1, 5, 7, 3), "float32")) -> R.Tensor((1, 3, 4, 3), "float32"):
            with R.dataflow():
                pooled = R.nn.max_pool2d(x, pool_size=[3, 3], strides=[2, 2], padding=[1, 1, 1, 1],
                                         layout="NHWC", out_layout="NHWC")
                gv = pooled
                R.output(gv)
            return gv
    return MaxPoolBefore, MaxPoolExpected


@functools.cache
def _avg_pool() -> tuple[tvm.IRModule, tvm.IRModule]:
    @I.ir_module
    class AvgPoolBefore:
        @R.function
        def main(x: R.Tensor((1, 5, 7, 3), "float32")) -> R.Tensor((1, 3, 3, 3), "float32"):
            with R.dataflow():
                nchw = R.permute_dims(x, axes=[0, 3, 1, 2])
                pooled = R.nn.avg_pool2d(nchw, pool_size=[2, 3], strides=[2, 3], ceil_mode=True,
                                         count_include_pad=False)
                gv = R.permute_dims(pooled, axes=[0, 2, 3, 1])
                R.output(gv)
            return gv

    @I.ir_module
    class AvgPoolExpected:
        @R.function
        def main(x: R.Tensor((1, 5, 7, 3), "float32")) -> R.Tensor((1, 3, 3, 3), "float32"):
            with R.dataflow():
                pooled = R.nn.avg_pool2d(x, pool_size=[2, 3], strides=[2, 3], ceil_mode=True,
                                         count_include_pad=False, layout="NHWC", out_layout="NHWC")
                gv = pooled
                R.output(gv)
            return gv
    return AvgPoolBefore, AvgPoolExpected


# A global average pool (ONNX GlobalAveragePool: mean over H and W) of the NCHW view.
@functools.cache
def _mean() -> tuple[tvm.IRModule, tvm.IRModule]:
    @I.ir_module
    class MeanBefore:
        @R.function
        def main(x: R.Tensor((2, 5, 7, 3), "float32")) -> R.Tensor((2, 3, 1, 1), "float32"):
            with R.dataflow():
                nchw = R.permute_dims(x, axes=[0, 3, 1, 2])
                gv = R.mean(nchw, axis=[2, 3], keepdims=True)
                R.output(gv)
            return gv

    @I.ir_module
    class MeanExpected:
        @R.function
        def main(x: R.Tensor((2, 5, 7, 3), "float32")) -> R.Tensor((2, 3, 1, 1), "float32"):
            with R.dataflow():
                mean = R.mean(x, axis=[1, 2], keepdims=True)
                gv = R.permute_dims(mean, axes=[0, 3, 1, 2])
                R.output(gv)
            return gv
    return MeanBefore, MeanExpected


@functools.cache
def _flat_mean() -> tuple[tvm.IRModule, tvm.IRModule]:
    @I.ir_module
    class FlatMeanBefore:
        @R.function
        def main(x: R.Tensor((2, 5, 7, 3), "float32")) -> R.Tensor((2, 3), "float32"):
            with R.dataflow():
                nchw = R.permute_dims(x, axes=[0, 3, 1, 2])
                gv = R.mean(nchw, axis=[3, 2], keepdims=False)
                R.output(gv)
            return gv

    @I.ir_module
    class FlatMeanExpected:
        @R.function
        def main(x: R.Tensor((2, 5, 7, 3), "float32")) -> R.Tensor((2, 3), "float32"):
            with R.dataflow():
                gv = R.mean(x, axis=[1, 2], keepdims=False)
                R.output(gv)
            return gv
    return FlatMeanBefore, FlatMeanExpected


# Conv 1's kernel output y1 ([N*H*W, K]) is the residual operand of conv 2's kernel (here an
# add standing for it): viewed as NCHW by conv 1, brought back to NHWC rows by conv 2.  All
# four conversions cancel and conv 2 reads y1 as it is.
@functools.cache
def _residual() -> tuple[tvm.IRModule, tvm.IRModule]:
    @I.ir_module
    class ResidualBefore:
        @R.function
        def main(y1: R.Tensor((35, 8), "float32"),
                 y2: R.Tensor((35, 8), "float32")) -> R.Tensor((35, 8), "float32"):
            with R.dataflow():
                nhwc = R.reshape(y1, R.shape([1, 5, 7, 8]))
                nchw = R.permute_dims(nhwc, axes=[0, 3, 1, 2])
                back = R.permute_dims(nchw, axes=[0, 2, 3, 1])
                rows = R.reshape(back, R.shape([35, 8]))
                gv = R.add(y2, rows)
                R.output(gv)
            return gv

    @I.ir_module
    class ResidualExpected:
        @R.function
        def main(y1: R.Tensor((35, 8), "float32"),
                 y2: R.Tensor((35, 8), "float32")) -> R.Tensor((35, 8), "float32"):
            with R.dataflow():
                rows = y1
                gv = R.add(y2, rows)
                R.output(gv)
            return gv
    return ResidualBefore, ResidualExpected


# Permutes that do not cancel compose into one; reshapes of reshapes become one reshape.
@functools.cache
def _compose() -> tuple[tvm.IRModule, tvm.IRModule]:
    @I.ir_module
    class ComposeBefore:
        @R.function
        def main(x: R.Tensor((2, 3, 5, 7), "float32")) -> R.Tensor((5, 42), "float32"):
            with R.dataflow():
                a = R.permute_dims(x, axes=[0, 2, 3, 1])
                b = R.permute_dims(a, axes=[1, 0, 2, 3])
                c = R.reshape(b, R.shape([10, 21]))
                gv = R.reshape(c, R.shape([5, 42]))
                R.output(gv)
            return gv

    @I.ir_module
    class ComposeExpected:
        @R.function
        def main(x: R.Tensor((2, 3, 5, 7), "float32")) -> R.Tensor((5, 42), "float32"):
            with R.dataflow():
                b = R.permute_dims(x, axes=[2, 0, 3, 1])
                gv = R.reshape(b, R.shape([5, 42]))
                R.output(gv)
            return gv
    return ComposeBefore, ComposeExpected


CASES = {
    "max_pool": _max_pool,
    "avg_pool": _avg_pool,
    "mean_keepdims": _mean,
    "mean": _flat_mean,
    "residual": _residual,
    "compose": _compose,
}


def _simplified(mod: tvm.IRModule) -> tvm.IRModule:
    return relax.transform.DeadCodeElimination()(simplify_layouts(mod))


@pytest.mark.parametrize("case", CASES)
def test_conversions_cancel(case):
    before, expected = CASES[case]()
    tvm.ir.assert_structural_equal(_simplified(before), expected)


def test_the_callers_module_is_unchanged():
    before = _max_pool()[0]
    copy = before.clone()
    simplify_layouts(before)
    tvm.ir.assert_structural_equal(before, copy)


def _run(mod: tvm.IRModule, inputs: list[np.ndarray]) -> np.ndarray:
    executable = tvm.compile(mod, target=LLVM, relax_pipeline=relax.get_default_pipeline(LLVM))
    vm = relax.VirtualMachine(executable, tvm.cpu())
    return vm["main"](*map(tvm.runtime.tensor, inputs)).numpy()


@pytest.mark.parametrize("case", CASES)
def test_results_are_unchanged(case):
    before = CASES[case]()[0]
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal([int(d) for d in p.ty.shape]).astype("float32")
              for p in before["main"].params]
    np.testing.assert_array_equal(_run(_simplified(before), inputs), _run(before, inputs))


# Channel concat of two NHWC tensors' NCHW views (DenseNet, Inception): concatenated along
# the NHWC channels, one permute after.
@functools.cache
def _concat() -> tuple[tvm.IRModule, tvm.IRModule]:
    @I.ir_module
    class ConcatBefore:
        @R.function
        def main(a: R.Tensor((1, 5, 7, 3), "float32"),
                 b: R.Tensor((1, 5, 7, 4), "float32")) -> R.Tensor((1, 5, 7, 7), "float32"):
            with R.dataflow():
                a_nchw = R.permute_dims(a, axes=[0, 3, 1, 2])
                b_nchw = R.permute_dims(b, axes=[0, 3, 1, 2])
                both = R.concat((a_nchw, b_nchw), axis=1)
                gv = R.permute_dims(both, axes=[0, 2, 3, 1])
                R.output(gv)
            return gv

    @I.ir_module
    class ConcatExpected:
        @R.function
        def main(a: R.Tensor((1, 5, 7, 3), "float32"),
                 b: R.Tensor((1, 5, 7, 4), "float32")) -> R.Tensor((1, 5, 7, 7), "float32"):
            with R.dataflow():
                both = R.concat((a, b), axis=3)
                gv = both
                R.output(gv)
            return gv
    return ConcatBefore, ConcatExpected


# Squeeze-excite's channel scaling: an [N, C, 1, 1] vector times the NCHW view.
@functools.cache
def _scale() -> tuple[tvm.IRModule, tvm.IRModule]:
    @I.ir_module
    class ScaleBefore:
        @R.function
        def main(x: R.Tensor((2, 5, 7, 3), "float32"),
                 s: R.Tensor((2, 3, 1, 1), "float32")) -> R.Tensor((2, 5, 7, 3), "float32"):
            with R.dataflow():
                nchw = R.permute_dims(x, axes=[0, 3, 1, 2])
                scaled = R.multiply(nchw, s)
                gv = R.permute_dims(scaled, axes=[0, 2, 3, 1])
                R.output(gv)
            return gv

    @I.ir_module
    class ScaleExpected:
        @R.function
        def main(x: R.Tensor((2, 5, 7, 3), "float32"),
                 s: R.Tensor((2, 3, 1, 1), "float32")) -> R.Tensor((2, 5, 7, 3), "float32"):
            with R.dataflow():
                vector = R.reshape(s, R.shape([2, 1, 1, 3]))
                scaled = R.multiply(x, vector)
                gv = scaled
                R.output(gv)
            return gv
    return ScaleBefore, ScaleExpected


# A segmentation head's or an FPN's upsampling (ONNX Resize) between convs: it resizes the
# NHWC tensor.
@functools.cache
def _resize() -> tuple[tvm.IRModule, tvm.IRModule]:
    @I.ir_module
    class ResizeBefore:
        @R.function
        def main(x: R.Tensor((1, 5, 7, 3), "float32")) -> R.Tensor((1, 10, 13, 3), "float32"):
            with R.dataflow():
                nchw = R.permute_dims(x, axes=[0, 3, 1, 2])
                up = R.image.resize2d(nchw, R.shape([10, 13]), roi=[0.0, 0.0, 0.0, 0.0],
                                      layout="NCHW", method="linear",
                                      coordinate_transformation_mode="half_pixel",
                                      rounding_method="round", cubic_alpha=-0.75, cubic_exclude=0,
                                      extrapolation_value=0.0)
                gv = R.permute_dims(up, axes=[0, 2, 3, 1])
                R.output(gv)
            return gv

    @I.ir_module
    class ResizeExpected:
        @R.function
        def main(x: R.Tensor((1, 5, 7, 3), "float32")) -> R.Tensor((1, 10, 13, 3), "float32"):
            with R.dataflow():
                up = R.image.resize2d(x, R.shape([10, 13]), roi=[0.0, 0.0, 0.0, 0.0],
                                      layout="NHWC", method="linear",
                                      coordinate_transformation_mode="half_pixel",
                                      rounding_method="round", cubic_alpha=-0.75, cubic_exclude=0,
                                      extrapolation_value=0.0)
                gv = up
                R.output(gv)
            return gv
    return ResizeBefore, ResizeExpected


# HardSwish as TVM's importer writes it, x * clip(x + 3, 0, 6) / 6 (MobileNetV3, PP-OCR).
@functools.cache
def _hard_swish() -> tuple[tvm.IRModule, tvm.IRModule]:
    @I.ir_module
    class HardSwishBefore:
        @R.function
        def main(x: R.Tensor((1, 5, 7, 3), "float32")) -> R.Tensor((1, 5, 7, 3), "float32"):
            with R.dataflow():
                nchw = R.permute_dims(x, axes=[0, 3, 1, 2])
                shifted = R.add(nchw, R.const(3.0, "float32"))
                clipped = R.clip(shifted, R.prim_value(T.float64(0.0)),
                                 R.prim_value(T.float64(6.0)))
                ratio = R.divide(clipped, R.const(6.0, "float32"))
                hs = R.multiply(nchw, ratio)
                gv = R.permute_dims(hs, axes=[0, 2, 3, 1])
                R.output(gv)
            return gv

    @I.ir_module
    class HardSwishExpected:
        @R.function
        def main(x: R.Tensor((1, 5, 7, 3), "float32")) -> R.Tensor((1, 5, 7, 3), "float32"):
            with R.dataflow():
                shifted = R.add(x, R.const(3.0, "float32"))
                clipped = R.clip(shifted, R.prim_value(T.float64(0.0)),
                                 R.prim_value(T.float64(6.0)))
                ratio = R.divide(clipped, R.const(6.0, "float32"))
                hs = R.multiply(x, ratio)
                gv = hs
                R.output(gv)
            return gv
    return HardSwishBefore, HardSwishExpected


# ShuffleNet's channel shuffle of 3 groups of 4 channels between convs: the NHWC channels are
# shuffled, no layout conversion left.
@functools.cache
def _shuffle() -> tuple[tvm.IRModule, tvm.IRModule]:
    @I.ir_module
    class ShuffleBefore:
        @R.function
        def main(x: R.Tensor((2, 5, 7, 12), "float32")) -> R.Tensor((2, 5, 7, 12), "float32"):
            with R.dataflow():
                nchw = R.permute_dims(x, axes=[0, 3, 1, 2])
                split = R.reshape(nchw, R.shape([2, 3, 4, 5, 7]))
                swapped = R.permute_dims(split, axes=[0, 2, 1, 3, 4])
                shuffled = R.reshape(swapped, R.shape([2, 12, 5, 7]))
                gv = R.permute_dims(shuffled, axes=[0, 2, 3, 1])
                R.output(gv)
            return gv

    @I.ir_module
    class ShuffleExpected:
        @R.function
        def main(x: R.Tensor((2, 5, 7, 12), "float32")) -> R.Tensor((2, 5, 7, 12), "float32"):
            with R.dataflow():
                grouped = R.reshape(x, R.shape([2, 5, 7, 3, 4]))
                swapped = R.permute_dims(grouped, axes=[0, 1, 2, 4, 3])
                shuffled = R.reshape(swapped, R.shape([2, 5, 7, 12]))
                gv = shuffled
                R.output(gv)
            return gv
    return ShuffleBefore, ShuffleExpected


LAYOUT_CASES = {"concat": _concat, "scale": _scale, "shuffle": _shuffle, "resize": _resize,
                "hard_swish": _hard_swish}


@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_concat_and_vector_operands_move_to_nhwc(case):
    before, expected = LAYOUT_CASES[case]()
    tvm.ir.assert_structural_equal(_simplified(before), expected)
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal([int(d) for d in p.ty.shape]).astype("float32")
              for p in before["main"].params]
    np.testing.assert_array_equal(_run(_simplified(before), inputs), _run(before, inputs))


def _batchnorm_relu(nhwc: bool) -> tvm.IRModule:
    """DenseNet's pre-activation between two convs: BatchNorm's multiply and add by constants
    (shapes [1, C, 1, 1] and [C, 1, 1], and a [W] one) and ReLU, on the NCHW view of an NHWC
    tensor, then back to NHWC (``nhwc``: the same on the NHWC tensor, constants transposed)."""
    rng = np.random.default_rng(0)
    scale, shift, ramp = (rng.standard_normal(s).astype("float32") for s in
                          ((1, 3, 1, 1), (3, 1, 1), (7,)))
    x = relax.Var("x", relax.TensorType((1, 5, 7, 3), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            if nhwc:
                h = bb.emit(relax.op.multiply(x, relax.const(scale.transpose(0, 2, 3, 1))))
                h = bb.emit(relax.op.add(h, relax.const(shift[None].transpose(0, 2, 3, 1))))
                h = bb.emit(relax.op.subtract(h, relax.const(ramp.reshape(1, 1, 7, 1))))
                out = bb.emit_output(bb.emit(relax.op.nn.relu(h)))
            else:
                h = bb.emit(relax.op.permute_dims(x, [0, 3, 1, 2]))
                h = bb.emit(relax.op.multiply(h, relax.const(scale)))
                h = bb.emit(relax.op.add(h, relax.const(shift)))
                h = bb.emit(relax.op.subtract(h, relax.const(ramp)))
                h = bb.emit(relax.op.nn.relu(h))
                out = bb.emit_output(relax.op.permute_dims(h, [0, 2, 3, 1]))
        bb.emit_func_output(out)
    return bb.get()


def test_constant_operands_are_transposed_at_compile_time():
    before = _batchnorm_relu(nhwc=False)
    after = _simplified(before)
    tvm.ir.assert_structural_equal(after, _batchnorm_relu(nhwc=True), map_free_vars=True)
    x = np.random.default_rng(2).standard_normal((1, 5, 7, 3)).astype("float32")
    np.testing.assert_allclose(_run(after, [x]), _run(before, [x]), rtol=1e-6)


def _hard_swish_resize_network() -> onnx.ModelProto:
    """PP-OCR's pattern with odd sizes: conv, HardSwish, depthwise conv, a 2x linear Resize,
    a 1x1 conv."""
    rng = np.random.default_rng(7)
    weights = {"w1": rng.standard_normal((8, 3, 3, 3)), "w2": rng.standard_normal((8, 1, 3, 3)),
               "w3": rng.standard_normal((5, 8, 1, 1)) / 3,
               "scales": np.array([1.0, 1.0, 2.0, 2.0])}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("HardSwish", ["c1"], ["h"]),
             helper.make_node("Conv", ["h", "w2"], ["c2"], pads=[1, 1, 1, 1], group=8),
             helper.make_node("Resize", ["c2", "", "scales"], ["up"], mode="linear"),
             helper.make_node("Conv", ["up", "w3"], ["y"])]
    graph = helper.make_graph(
        nodes, "hs_resize", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 9, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5, 18, 14])],
        [numpy_helper.from_array(v.astype("float32"), k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_hard_swish_and_resize_run_between_kernels_in_nhwc():
    """Between TPP kernels HardSwish and Resize run on the NHWC tensors, with no transpose
    in the functions that compute them; the result equals ONNX Runtime's."""
    model = _hard_swish_resize_network()
    lowered = lower(model, "tpp")
    names = [gv.name_hint for gv in lowered.functions]
    between = [n for n in names if "resize2d" in n or "divide" in n]
    assert between and not any("transpose" in n for n in between), names
    compiled = tvm_tpp.compile(model, target="tpp")
    inputs = random_inputs(compiled.inputs, seed=3)
    _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
    assert rel <= 1e-5
