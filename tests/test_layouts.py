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
