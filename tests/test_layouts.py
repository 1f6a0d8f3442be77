"""Layout cancellation between TPP convs: NHWC <-> NCHW permutes cancel, through pooling, spatial
means and the residual operand of the next conv.

Each case is a Before/Expected pair of TVMScript modules, checked structurally and numerically
(Before and the simplified module built with TVM and run on the same random data, odd sizes).
"""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.layouts import simplify_layouts

LLVM = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})


# An NHWC tensor (a TPP conv's output) seen as NCHW, pooled, and turned back to NHWC for the
# next conv: the pooling runs on the NHWC tensor and both permutes go.
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


# A global average pool (ONNX GlobalAveragePool: mean over H and W) of the NCHW view.
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


# Conv 1's kernel output y1 ([N*H*W, K]) is the residual operand of conv 2's kernel (here an
# add standing for it): viewed as NCHW by conv 1, brought back to NHWC rows by conv 2.  All
# four conversions cancel and conv 2 reads y1 as it is.
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


# Permutes that do not cancel compose into one; reshapes of reshapes become one reshape.
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


CASES = {
    "max_pool": (MaxPoolBefore, MaxPoolExpected),
    "avg_pool": (AvgPoolBefore, AvgPoolExpected),
    "mean_keepdims": (MeanBefore, MeanExpected),
    "mean": (FlatMeanBefore, FlatMeanExpected),
    "residual": (ResidualBefore, ResidualExpected),
    "compose": (ComposeBefore, ComposeExpected),
}


def _simplified(mod: tvm.IRModule) -> tvm.IRModule:
    return relax.transform.DeadCodeElimination()(simplify_layouts(mod))


@pytest.mark.parametrize("case", CASES)
def test_conversions_cancel(case):
    before, expected = CASES[case]
    tvm.ir.assert_structural_equal(_simplified(before), expected)


def test_the_callers_module_is_unchanged():
    copy = MaxPoolBefore.clone()
    simplify_layouts(MaxPoolBefore)
    tvm.ir.assert_structural_equal(MaxPoolBefore, copy)


def _run(mod: tvm.IRModule, inputs: list[np.ndarray]) -> np.ndarray:
    executable = tvm.compile(mod, target=LLVM, relax_pipeline=relax.get_default_pipeline(LLVM))
    vm = relax.VirtualMachine(executable, tvm.cpu())
    return vm["main"](*map(tvm.runtime.tensor, inputs)).numpy()


@pytest.mark.parametrize("case", CASES)
def test_results_are_unchanged(case):
    before = CASES[case][0]
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal([int(d) for d in p.ty.shape]).astype("float32")
              for p in before["main"].params]
    np.testing.assert_array_equal(_run(_simplified(before), inputs), _run(before, inputs))


# Channel concat of two NHWC tensors' NCHW views (DenseNet, Inception): concatenated along
# the NHWC channels, one permute after.
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


# Squeeze-excite's channel scaling: an [N, C, 1, 1] vector times the NCHW view.
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


LAYOUT_CASES = {"concat": (ConcatBefore, ConcatExpected), "scale": (ScaleBefore, ScaleExpected)}


@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_concat_and_vector_operands_move_to_nhwc(case):
    before, expected = LAYOUT_CASES[case]
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
