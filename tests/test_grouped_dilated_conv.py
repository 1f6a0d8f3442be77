"""Grouped and dilated convolutions on the TPP conv kernels (issue 15, item 1).

A grouped conv runs the conv template with its K blocks inside one group each (a block reduces
its own group's channels); a dilation spreads the filter taps in the padded input; a dilated
depthwise conv runs the depthwise template.  Checked against numpy (float32, bf16 and the
exact u8 x s8 kernels, odd sizes, strides, asymmetric padding), through the graph passes
against ONNX Runtime (float32, bf16, QDQ int8), and in the AMX code of a cross-compile.
"""

import itertools
from dataclasses import replace

import numpy as np
import pytest
from conftest import needs_isa
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType
from test_conv_lowp import BIAS_RELU, DEQUANT, REQUANT, ZX, _check, _ops
from test_conv_lowp import _machine as _lowp_machine
from test_conv_schedule import BIAS_RES_RELU, _default
from test_conv_schedule import _run as _run_float32
from test_depthwise import _run as _run_depthwise
from test_qdq_conv import (
    _assert_matches_qdq,
    _Conv,
    _int8_report,
    _output_step,
    _qdq_reference,
    _quantized,
)

import tvm_tpp
from microkernels.epilogue import Epilogue
from schedules.conv import ConvConfig, ConvProblem, candidates, default_config
from schedules.conv import reference as conv_reference
from schedules.depthwise import DepthwiseProblem
from schedules.ops import problem_text
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime

FLOAT32 = {
    "g3-d2": ConvProblem(1, 12, 9, 9, 6, 3, 3, padding=2, dilation=2, groups=3),
    "g2-s2": ConvProblem(1, 16, 11, 11, 32, 3, 3, stride=2, padding=1, groups=2,
                         epilogue=BIAS_RELU),
    "g3-1x1": ConvProblem(2, 24, 7, 5, 48, 1, 1, groups=3, epilogue=BIAS_RES_RELU),
    "d4-odd": ConvProblem(2, 7, 13, 11, 9, 3, 3, padding=(4, 3, 4, 5), dilation=4),
    "d2x3-s2": ConvProblem(1, 64, 14, 13, 64, 3, 3, stride=2, padding=(2, 3, 1, 2),
                           dilation=(2, 3), epilogue=BIAS_RELU),
    "d2-stem": ConvProblem(1, 3, 15, 15, 16, 3, 3, padding=2, dilation=2),  # taps apart
    "g5-d3-5x3": ConvProblem(1, 40, 13, 12, 25, 5, 3, padding=(6, 3, 6, 3), dilation=3,
                             groups=5),
    # 136 channels a group: one-vector K blocks on AVX2 (vector_block), 17 of them a group.
    "g4-136": ConvProblem(1, 544, 5, 3, 544, 1, 1, groups=4, epilogue=BIAS_RELU),
}


@pytest.mark.parametrize("name", sorted(FLOAT32))
def test_float32_matches_numpy(name):
    problem = FLOAT32[name]
    _run_float32(problem, _default(problem))


@pytest.mark.parametrize("spec", ["ACbfgde", "ACDbfge", "ADEcbfg", "aCdebfg"])
def test_every_loop_order_of_a_grouped_dilated_conv(spec):
    problem = ConvProblem(1, 32, 10, 10, 32, 3, 3, padding=2, dilation=2, groups=4)
    _run_float32(problem, ConvConfig(bq=5, bc=8, bk=8, spec=spec))


def test_candidates_of_a_grouped_conv_stay_in_their_groups():
    problem = ConvProblem(1, 48, 14, 14, 96, 3, 3, padding=1, groups=3)
    found = candidates(problem, _lowp_machine("avx2"))
    assert found and all(problem.group_k % c.bk == 0 and problem.group_c % c.bc == 0
                         for c in found)
    for config in found[:3]:
        _run_float32(problem, config)


LOWP = {
    "u8-g2-d2": ConvProblem(1, 16, 9, 9, 8, 3, 3, padding=2, dilation=2, groups=2,
                            dtype="uint8", epilogue=REQUANT),
    "u8-g3-s2": ConvProblem(1, 24, 11, 10, 36, 3, 3, stride=2, padding=(1, 0, 1, 2), groups=3,
                            dtype="uint8", epilogue=DEQUANT),
    "u8-d3-c5": ConvProblem(1, 5, 12, 12, 24, 3, 3, padding=3, dilation=3, dtype="uint8"),
    "bf16-g2-d2": ConvProblem(1, 16, 9, 9, 8, 3, 3, padding=2, dilation=2, groups=2,
                              dtype="bfloat16", epilogue=BIAS_RELU),
    "bf16-d2x1": ConvProblem(2, 10, 8, 9, 16, 3, 3, padding=(2, 1, 2, 1), dilation=(2, 1),
                             dtype="bfloat16"),
}


@pytest.mark.parametrize("name", sorted(LOWP))
def test_low_precision_matches_numpy(name):
    """u8 x s8 exactly (AVX2's exact emulation runs on any x86 host), bf16 within float32
    accumulation's rounding; borders padded with the zero point."""
    problem = LOWP[name]
    pad = ZX if problem.dtype == "uint8" else 0
    _check(problem, default_config(problem, _lowp_machine("avx2")), "avx2", pad_value=pad)


@needs_isa("avx512_vnni")
def test_u8_grouped_dilated_on_vnni():
    problem = LOWP["u8-g2-d2"]
    _check(problem, default_config(problem, _lowp_machine("avx512_vnni")), "avx512_vnni",
           pad_value=ZX)


def test_amx_runs_a_grouped_conv_on_tiles():
    """A grouped int8 conv with tile-shaped blocks inside its groups multiplies in AMX
    tiles (the cross-compile's assembly)."""
    problem = ConvProblem(1, 128, 8, 8, 64, 3, 3, padding=2, dilation=2, groups=2,
                          dtype="uint8", epilogue=DEQUANT)
    config = default_config(problem, _lowp_machine("amx"))
    assert problem.group_k % config.bk == 0
    ops = _ops(problem, config, "amx")
    assert "tdpbusd" in ops and "ldtilecfg" in ops


@pytest.mark.parametrize("problem", [
    DepthwiseProblem(1, 24, 9, 9, 3, 3, padding=2, dilation=2),
    DepthwiseProblem(2, 40, 11, 9, 3, 3, stride=2, padding=(4, 2, 3, 2), dilation=(4, 2)),
    DepthwiseProblem(1, 16, 10, 10, 3, 3, padding=3, dilation=3, dtype="uint8",
                     epilogue=Epilogue()),
], ids=["d2", "d4x2-s2", "u8-d3"])
def test_dilated_depthwise_matches_numpy(problem):
    _run_depthwise(problem, pad_value=ZX if problem.dtype == "uint8" else 0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(groups=3), "groups=3 must divide C=8 and K=16"),
    (dict(groups=2, dtype="uint8", c=12), "whole VNNI groups of 4 channels per group, got 6"),
    (dict(dilation=4), "a 3x3 filter dilated by (4, 4) does not fit the 7x7 input"),
    (dict(dilation=0), "dilations must be >= 1"),
])
def test_problem_errors(kwargs, message):
    base = dict(n=1, c=8, h=7, w=7, k=16, r=3, s=3)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ConvProblem(**{**base, **kwargs})


def test_config_blocks_stay_within_a_group():
    problem = ConvProblem(1, 16, 7, 7, 16, 3, 3, padding=1, groups=2)
    with pytest.raises(ValueError, match="bk=16 does not divide K/groups=8"):
        ConvConfig(bq=7, bc=8, bk=16).check(problem)
    with pytest.raises(ValueError, match="bc=16 does not divide C/groups=8"):
        ConvConfig(bq=7, bc=16, bk=8).check(problem)


def test_tuning_keys_name_dilation_and_groups_only_where_they_are_not_1():
    plain = ConvProblem(1, 16, 7, 7, 16, 3, 3, padding=1)
    assert problem_text(plain) == "conv2d 1x16x7x7x16x3x3/s1x1p1x1x1x1 -"
    assert problem_text(replace(plain, dilation=(2, 2), padding=2, groups=4)) == \
        "conv2d 1x16x7x7x16x3x3/s1x1p2x2x2x2d2x2g4 -"
    assert problem_text(DepthwiseProblem(1, 8, 7, 7, 3, 3, padding=3, dilation=3)) == \
        "depthwise_conv2d 1x8x7x7x3x3/s1x1p3x3x3x3d3x3 -"


# --------------------------------------------------------------------------------------------
# through the graph passes


def _model(seed=0):
    """A block of a ShuffleNet / a segmentation head: a grouped 1x1 conv, a channel shuffle,
    a dilated 3x3 conv, a dilated depthwise conv, a grouped 3x3 conv (ReLU between)."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def conv(x, out, cin, cout, k, group=1, dilation=1, relu=True):
        w = rng.standard_normal((cout, cin // group, k, k)) / np.sqrt(cin // group * k * k)
        b = 0.1 * rng.standard_normal(cout)
        inits.extend([numpy_helper.from_array(w.astype("float32"), f"{out}.w"),
                      numpy_helper.from_array(b.astype("float32"), f"{out}.b")])
        pad = dilation * (k // 2)
        nodes.append(helper.make_node("Conv", [x, f"{out}.w", f"{out}.b"],
                                      [f"{out}.c" if relu else out], group=group,
                                      pads=[pad] * 4, dilations=[dilation] * 2))
        if relu:
            nodes.append(helper.make_node("Relu", [f"{out}.c"], [out]))
        return out

    h = conv("x", "g1", 24, 48, 1, group=3)
    inits.extend([numpy_helper.from_array(np.array(s, "int64"), n) for n, s in
                  (("s1", [1, 3, 16, 9, 9]), ("s2", [1, 48, 9, 9]))])
    nodes += [helper.make_node("Reshape", [h, "s1"], ["r1"]),
              helper.make_node("Transpose", ["r1"], ["t1"], perm=[0, 2, 1, 3, 4]),
              helper.make_node("Reshape", ["t1", "s2"], ["shuffled"])]
    h = conv("shuffled", "d2", 48, 32, 3, dilation=2)
    h = conv(h, "dw", 32, 32, 3, group=32, dilation=3)
    conv(h, "y", 32, 16, 3, group=4, relu=False)
    graph = helper.make_graph(
        nodes, "grouped_dilated",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 24, 9, 9])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 9, 9])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_float_network_runs_every_conv_on_tpp_kernels():
    model = _model()
    compiled = tvm_tpp.compile(model, target="tpp")
    convs = [r for r in compiled.report if r.op.startswith("conv2d")]
    assert len(convs) == 4 and all(r.kernel for r in convs), compiled.report
    names = sorted(r.kernel.split()[0] for r in convs)
    assert names == ["tpp_conv2d_1x24x9x9_48x1x1_s1x1_g3_bias_relu",
                     "tpp_conv2d_1x32x9x9_16x3x3_s1x1_g4_bias",
                     "tpp_conv2d_1x48x9x9_32x3x3_s1x1_d2x2_bias_relu",
                     "tpp_dwconv2d_1x32x9x9_3x3_s1x1_d3x3_bias_relu"]
    for seed in range(2):
        inputs = random_inputs(compiled.inputs, seed=seed)
        _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
        assert rel <= 1e-5


def _set_group(model, conv: str, groups: int) -> None:
    node = next(n for n in model.graph.node if f"{conv}.w" in n.input)
    next(a for a in node.attribute if a.name == "group").i = groups


def test_bf16_network_multiplies_whole_vnni_groups_in_bf16_and_the_rest_in_float32():
    """``precision="bf16"``: a grouped conv of 8 channels a group runs bf16; one of 3
    channels a group (no whole VNNI-2 pairs) stays on a float32 kernel."""
    model = _model(seed=1)
    _set_group(model, "y", 8)  # 32 channels: 4 a group
    w = next(t for t in model.graph.initializer if t.name == "y.w")
    w.CopyFrom(numpy_helper.from_array(np.ones((16, 4, 3, 3), "float32") * 0.1, "y.w"))
    compiled = tvm_tpp.compile(model, target="tpp", precision="bf16-strict")
    dtypes = {r.kernel.split()[0]: r.dtypes for r in compiled.report if r.kernel}
    # It hands its output to the dilated bf16 conv through the channel shuffle in bf16.
    assert dtypes["tpp_conv2d_1x24x9x9_48x1x1_s1x1_g3_bias_relu_convert_bf16_bf16"] == \
        "bfloat16*bfloat16->float32"
    assert dtypes["tpp_conv2d_1x32x9x9_16x3x3_s1x1_g8_bias_bf16"] == \
        "bfloat16*bfloat16->float32"
    inputs = random_inputs(compiled.inputs, seed=0)
    _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
    assert rel <= 1e-2

    _set_group(model, "g1", 8)  # 24 channels: 3 a group
    w = next(t for t in model.graph.initializer if t.name == "g1.w")
    w.CopyFrom(numpy_helper.from_array(np.full((48, 3, 1, 1), 0.2, "float32"), "g1.w"))
    compiled = tvm_tpp.compile(model, target="tpp", precision="bf16-strict")
    [g1] = [r for r in compiled.report if r.kernel and "48x1x1" in r.kernel]
    assert "_g8_" in g1.kernel and g1.dtypes == "float32*float32->float32"
    _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
    assert rel <= 1e-2


QDQ = {
    "g2_c16_relu": _Conv(16, 24, (9, 7), 3, pad=1, relu=True, group=2),
    "g4_c32_s2_per_tensor": _Conv(32, 16, (8, 9), 3, stride=2, pad=1, group=4,
                                  per_channel=False),
    "d2_c12": _Conv(12, 16, (9, 9), 3, pad=2, dilation=2),
    "g2_d3_int8_activations": _Conv(16, 16, (10, 10), 3, pad=3, group=2, dilation=3,
                                    activations=QuantType.QInt8),
}


@pytest.mark.parametrize("name", sorted(QDQ))
def test_qdq_grouped_and_dilated_convs_on_int8_kernels(name, tmp_path):
    layer = QDQ[name]
    model = _quantized(layer, tmp_path)
    _, report = _int8_report(model)
    assert [(r.op.split("+")[0], r.dtypes, r.layout) for r in report] == [
        ("conv2d_qdq", "uint8*int8->int32", "vnni4")], report
    _assert_matches_qdq(model, layer)


def test_qdq_grouped_conv_of_odd_groups_stays_float_with_the_reason(tmp_path):
    model = _quantized(_Conv(12, 12, (7, 7), 3, pad=1, group=2), tmp_path)  # 6 a group
    _, report = _int8_report(model)
    assert [r.reason for r in report] == [
        "groups=2: 6 channels per group are not whole VNNI groups of 4 for uint8; "
        "left dequantized to float32"]
    x = _Conv(12, 12, (7, 7), 3, pad=1, group=2).inputs(0)
    got = tvm_tpp.compile(model, target="tpp").run(x=x)
    want = _qdq_reference(model, {"x": x})
    assert max_errors(got, want)[0] <= _output_step(model) * (1 + 1e-5)


# --------------------------------------------------------------------------------------------
# taps that read only padding


def test_dropping_dead_taps_keeps_every_result():
    """Over small geometries (dilations past the input, asymmetric padding, strides): the
    problem without the taps that read only zero padding computes the same convolution."""
    rng = np.random.default_rng(0)
    trimmed_some = 0
    for h, w, r, s, dilation, pads, stride in itertools.product(
            (3, 5), (4,), (1, 3), (2, 3), ((1, 1), (3, 4), (6, 2)),
            ((0, 0, 0, 0), (3, 1, 4, 2), (6, 6, 6, 6)), (1, 2)):
        try:
            problem = ConvProblem(1, 2, h, w, 3, r, s, stride=stride, padding=pads,
                                  dilation=dilation)
        except ValueError:  # the dilated filter does not fit
            continue
        trimmed = problem.without_dead_taps()
        if trimmed is problem:
            continue
        trimmed_some += 1
        rows, cols = problem.live_taps()
        x = rng.standard_normal((1, 2, h, w))
        weight = rng.standard_normal((3, 2, r, s))
        assert trimmed.output_shape == problem.output_shape
        np.testing.assert_allclose(conv_reference(trimmed, x, weight[:, :, rows, cols]),
                                   conv_reference(problem, x, weight), rtol=1e-12, atol=1e-12)
    assert trimmed_some >= 10  # the grid has that many geometries with dead taps


def test_a_rate_18_conv_on_a_16x16_map_runs_its_centre_tap_only():
    """DeepLab's rate-18 atrous conv on a 16x16 feature map: every tap but the centre reads
    padding, so the kernel is a 1x1 conv; the result equals ONNX Runtime's."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((32, 16, 3, 3)) * 0.2).astype("float32")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[18] * 4, dilations=[18, 18])], "aspp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, 16, 16])],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    compiled = tvm_tpp.compile(model, target="tpp")
    [record] = compiled.report
    assert record.kernel.startswith("tpp_conv2d_1x16x16x16_32x1x1_s1x1_d18x18")
    assert record.flops == 2 * 32 * 256 * 16 * 9  # the model's FLOPs, as written
    inputs = random_inputs(compiled.inputs, seed=0)
    _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
    assert rel <= 1e-5
