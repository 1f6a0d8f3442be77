"""An image's first conv with its filter rows folded into channels
(:meth:`ConvProblem.rows_folded`, :func:`schedules.conv.fold_rows_pays`): one kernel call
reduces the whole filter.

The folded problem against the original in numpy (odd sizes, strides, dilation, asymmetric
padding); which convs fold; and the graph rewrite: an RGB stem reads its rows stacked as
channels, checked against ONNX Runtime in float32 and bf16, with a fixed and a run-time batch.
"""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import tvm_tpp
from microkernels.epilogue import Epilogue, EpilogueOp
from relay_passes.conv import rewrite_conv
from relay_passes.prepare import prepare
from relay_passes.scaffold import is_call_to
from schedules.conv import ConvProblem, fold_rows_pays, fold_rows_weight
from schedules.conv import reference as conv_reference
from tvm_tpp.compiler import import_model
from tvm_tpp.reference import TOLERANCES, max_errors, run_onnxruntime
from tvm_tpp.tpp_target import target as make_target


def _rows_as_channels(x: np.ndarray, problem: ConvProblem) -> np.ndarray:
    """The folded problem's input, by its definition: ``X''[n, r*C + c, p, w] =
    Xpad[n, c, p*sh + r*dh, w]``."""
    top, _, bottom, _ = problem.padding
    padded = np.pad(x, ((0, 0), (0, 0), (top, bottom), (0, 0)))
    (sh, _), (dh, _) = problem.stride, problem.dilation
    return np.concatenate([padded[:, :, r * dh: r * dh + (problem.p - 1) * sh + 1: sh]
                           for r in range(problem.r)], axis=1)


@pytest.mark.parametrize("problem", [
    ConvProblem(2, 3, 19, 17, 8, 7, 7, stride=2, padding=3),
    ConvProblem(1, 1, 9, 11, 5, 3, 3, padding=(1, 0, 2, 1)),
    ConvProblem(1, 4, 13, 10, 6, 3, 2, stride=(3, 1), padding=2, dilation=(2, 3)),
    ConvProblem(1, 3, 8, 8, 4, 5, 1, stride=(1, 2)),
])
def test_folded_rows_compute_the_same_conv(problem):
    folded = problem.rows_folded()
    assert (folded.r, folded.c, folded.output_shape) == (1, problem.r * problem.c,
                                                         problem.output_shape)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((problem.n, problem.c, problem.h, problem.w)).astype("float32")
    w = rng.standard_normal((problem.k, problem.c, problem.r, problem.s)).astype("float32")
    np.testing.assert_allclose(
        conv_reference(folded, _rows_as_channels(x, problem), fold_rows_weight(w)),
        conv_reference(problem, x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("problem,folds", [
    (ConvProblem(1, 3, 224, 224, 64, 7, 7, stride=2, padding=3, dtype="uint8"), True),  # ResNet
    (ConvProblem(1, 3, 224, 224, 64, 3, 3, padding=1, dtype="bfloat16"), True),  # VGG's
    (ConvProblem(1, 1, 28, 28, 8, 5, 5, dtype="uint8"), True),  # grey
    (ConvProblem(1, 3, 224, 224, 64, 7, 7, stride=2, padding=3), False),  # float32
    (ConvProblem(1, 5, 28, 28, 8, 3, 3, dtype="bfloat16"), False),  # more than an image's
    (ConvProblem(1, 3, 28, 28, 8, 1, 3, dtype="uint8"), False),  # one filter row
    (ConvProblem(1, 4, 28, 28, 8, 3, 3, groups=2, dtype="bfloat16"), False),
])
def test_only_an_images_first_conv_folds_in_low_precision(problem, folds):
    assert fold_rows_pays(problem) is folds


def test_a_prologue_or_groups_do_not_fold():
    relu = Epilogue((EpilogueOp("relu"),))
    for problem in (ConvProblem(1, 4, 8, 8, 8, 3, 3, groups=2),
                    ConvProblem(1, 4, 8, 8, 8, 1, 1, prologue=relu)):
        with pytest.raises(ValueError, match="ungrouped conv without a prologue"):
            problem.rows_folded()


def _stem_model(batch: int | str) -> onnx.ModelProto:
    """``relu(conv3x3(relu(conv5x5/2(x) + b0)) + b1)``: an RGB stem of odd sizes, asymmetric
    padding, then a conv of 16 channels (which does not fold)."""
    rng = np.random.default_rng(1)
    weights = {"w0": rng.standard_normal((16, 3, 5, 5)) / 8, "b0": rng.normal(0, 0.1, 16),
               "w1": rng.standard_normal((8, 16, 3, 3)) / 12, "b1": rng.normal(0, 0.1, 8)}
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], strides=[2, 2],
                              pads=[2, 1, 1, 2]),
             helper.make_node("Relu", ["c0"], ["r0"]),
             helper.make_node("Conv", ["r0", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["y"])]
    graph = helper.make_graph(
        nodes, "stem", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 19, 17])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 8, 9, 8])],
        [numpy_helper.from_array(v.astype("float32"), k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


#: The graph's kernels by precision: each one's name and packed input's shape.  The stem
#: keeps its name; in bf16 it reads 9 rows of 1 + 17 + 2 padded columns of its 5 filter rows'
#: 15 channels (padded to 16), two columns a row (stride 2), and writes bf16 for the next conv;
#: in float32 19 + 3 rows of those columns of 3 channels.
KERNELS = {
    "bf16": {"tpp_conv2d_2x3x19x17_16x5x5_s2x2_bias_relu_convert_bf16_bf16": [2, 9, 10, 32],
             "tpp_conv2d_2x16x9x8_8x3x3_s1x1_bias_relu_bf16": [2, 11, 10, 16]},
    "float32": {"tpp_conv2d_2x3x19x17_16x5x5_s2x2_bias_relu": [2, 22, 10, 6],
                "tpp_conv2d_2x16x9x8_8x3x3_s1x1_bias_relu": [2, 11, 10, 16]},
}


@pytest.mark.parametrize("precision,stacked", [("bf16", [[2, 9, 10, 2, 16]]), ("float32", [])])
def test_graph_stacks_the_stems_rows_in_low_precision(precision, stacked):
    mod, _ = import_model(_stem_model(2))
    mod = rewrite_conv(prepare()(mod), make_target("tpp -isa=avx2"), [], precision=precision)
    stacks = []

    def visit(expr: relax.Expr) -> None:
        if is_call_to(expr, "relax.call_tir") and expr.args[0].name_hint == "pad_stack_rows":
            stacks.append(expr)

    relax.analysis.post_order_visit(mod["main"], visit)
    assert [[int(d) for d in s.ty.shape] for s in stacks] == stacked
    assert {gv.name_hint: [int(d) for d in func.params[0].ty.shape]
            for gv, func in mod.functions.items()
            if gv.name_hint.startswith("tpp_conv2d")} == KERNELS[precision]


@pytest.mark.parametrize("precision", ["float32", "bf16"])
@pytest.mark.parametrize("batch", [2, "N"])
def test_folded_stem_matches_onnxruntime(precision, batch):
    model = _stem_model(batch)
    x = np.random.default_rng(2).standard_normal((2, 3, 19, 17)).astype("float32")
    compiled = tvm_tpp.compile(model, target="tpp", precision=precision)
    _, rel = max_errors(compiled.run(x=x), run_onnxruntime(model, {"x": x}))
    assert rel <= (1e-5 if precision == "float32" else TOLERANCES["bf16"])
