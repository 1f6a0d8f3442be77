"""Depthwise convolution: the template vs numpy (float32, bf16, u8 x s8), the float32 graph
pass vs ONNX Runtime, QDQ depthwise convs on the int8 kernel, and mobilenet_v2."""

import numpy as np
import pytest
import tvm
from conftest import isa_target, pixel_rows, runs_here
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType
from test_qdq_conv import _assert_matches_qdq, _Conv, _int8_report, _quantized
from tvm import relax

import tvm_tpp
from microkernels import isa
from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.epilogue import reference as epilogue_reference
from microkernels.machine import Machine
from relay_passes.conv import rewrite_conv
from relay_passes.prepare import prepare
from relay_passes.scaffold import is_call_to
from schedules.depthwise import (
    DepthwiseConfig,
    DepthwiseProblem,
    candidates,
    default_config,
    pack_input,
    pack_weight,
    reference,
    schedule,
)
from tvm_tpp import models
from tvm_tpp.compiler import import_model
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime
from tvm_tpp.tpp_target import target as tpp_target

BIAS_RELU = Epilogue((EpilogueOp("bias"), EpilogueOp("relu")))
BIAS_RELU6 = Epilogue((EpilogueOp("bias"), EpilogueOp("clamp", lo=0.0, hi=6.0)))
REQUANT = Epilogue((EpilogueOp("bias"), EpilogueOp("relu"),
                    EpilogueOp("requantize", broadcast="row", zero_point=3, dtype="uint8")))
DEQUANT = Epilogue((EpilogueOp("scale", broadcast="row"), EpilogueOp("bias"),
                    EpilogueOp("clamp", lo=0.0, hi=6.0)))


def _machine(isa_name="avx512"):
    return Machine(isa.from_name(isa_name), isa.DEFAULT_CACHES, threads=2)


def _operands(problem, rng):
    out = {}
    for op in problem.epilogue.inputs(problem.epilogue_dtype):
        shape = op.shape(problem.rows, problem.c)
        if op.dtype == "int32":
            out[op.name] = rng.integers(-500, 500, shape).astype("int32")
        elif "scale" in op.name:
            out[op.name] = rng.uniform(0.001, 0.01, shape).astype("float32")
        else:
            out[op.name] = rng.standard_normal(shape).astype("float32")
    return out


def _run(problem, config=None, isa_name="avx2", pad_value=0, seed=0):
    rng = np.random.default_rng(seed)
    shape_x = (problem.n, problem.c, problem.h, problem.w)
    shape_w = (problem.c, 1, problem.r, problem.s)
    if problem.dtype == "uint8":
        x = rng.integers(0, 256, shape_x).astype("uint8")
        w = rng.integers(-128, 128, shape_w).astype("int8")
    else:
        x = rng.standard_normal(shape_x).astype("float32")
        w = rng.standard_normal(shape_w).astype("float32")
        if problem.dtype == "bfloat16":  # the reference multiplies the rounded values
            import ml_dtypes
            x = x.astype(ml_dtypes.bfloat16).astype("float32")
            w = w.astype(ml_dtypes.bfloat16).astype("float32")
    extra = _operands(problem, rng)
    config = config or default_config(problem, _machine(isa_name))
    packed_x = pack_input(x, problem, pad_value)
    assert packed_x.shape == problem.input_shape
    func = tvm.compile(schedule(problem, config, isa_name).mod, target=isa_target(isa_name))
    y = tvm.runtime.empty((problem.rows, problem.c), problem.out_dtype)
    func(tvm.runtime.tensor(packed_x), tvm.runtime.tensor(pack_weight(w, problem)),
         *[tvm.runtime.tensor(v) for v in extra.values()], y)
    acc = pixel_rows(reference(problem, x, w, pad_value))
    if problem.dtype == "uint8":
        acc = acc.astype(problem.epilogue_dtype)  # the dequantizing chains start in float32
        want = epilogue_reference(problem.epilogue, acc, extra) if problem.epilogue.ops else acc
        if problem.out_dtype == "float32":
            np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)
        else:  # exact
            np.testing.assert_array_equal(y.numpy(), want)
    else:
        want = acc.astype("float32")
        if problem.epilogue.ops:
            want = epilogue_reference(problem.epilogue, want, extra)
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)
    assert np.abs(y.numpy().astype("float64")).max() > 0


SHAPES = [(1, 5, 7, 7, 1), (1, 24, 9, 9, 2), (2, 40, 7, 9, 1), (1, 40, 9, 7, 2),
          (1, 24, 7, 9, 2)]


@pytest.mark.parametrize("n,c,h,w,stride", SHAPES)
@pytest.mark.parametrize("epilogue", [Epilogue(), BIAS_RELU, BIAS_RELU6],
                         ids=["none", "bias_relu", "bias_relu6"])
def test_float32_matches_numpy(n, c, h, w, stride, epilogue):
    _run(DepthwiseProblem(n, c, h, w, 3, 3, stride=stride, padding=1, epilogue=epilogue))


@pytest.mark.parametrize("n,c,h,w,stride", SHAPES[:3])
def test_float32_odd_padding(n, c, h, w, stride):
    _run(DepthwiseProblem(n, c, h, w, 3, 5, stride=(stride, 1), padding=(1, 2, 0, 2),
                          epilogue=BIAS_RELU))


def test_float32_avx512_asm():
    """The AVX-512 build multiplies whole zmm vectors of channels (checked on any host)."""
    problem = DepthwiseProblem(1, 32, 7, 7, 3, 3, padding=1, epilogue=BIAS_RELU6)
    config = default_config(problem, _machine("avx512"))
    asm = tvm.compile(schedule(problem, config, "avx512").mod,
                      target=isa_target("avx512")).mod.inspect_source("asm")
    assert any(line.split()[0].startswith("vfmadd") and "zmm" in line
               for line in asm.splitlines() if line.startswith("\t") and line.split())


@pytest.mark.skipif(not runs_here("avx512"), reason="host lacks AVX-512 (asm checked above)")
@pytest.mark.parametrize("n,c,h,w,stride", SHAPES[:3])
def test_float32_on_avx512(n, c, h, w, stride):
    _run(DepthwiseProblem(n, c, h, w, 3, 3, stride=stride, padding=1, epilogue=BIAS_RELU6),
         isa_name="avx512")


@pytest.mark.skipif(not runs_here("avx512"), reason="host lacks AVX-512 (asm checked above)")
@pytest.mark.parametrize("c, bc", [(136, 8), (56, 28), (40, 20)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_channels_in_part_vectors_on_avx512(c, bc, dtype):
    """Channels no whole 16-lane vectors tile: blocks of half and quarter vectors (136 in
    8s, ShuffleNet's; 56 in 16 + 8 + 4), against numpy."""
    problem = DepthwiseProblem(1, c, 4, 5, 3, 3, padding=1, dtype=dtype, epilogue=BIAS_RELU6)
    assert default_config(problem, _machine("avx512")).bc == bc
    _run(problem, isa_name="avx512")


@pytest.mark.parametrize("n,c,h,w,stride", SHAPES[:4])
@pytest.mark.parametrize("epilogue", [Epilogue(), BIAS_RELU6], ids=["none", "bias_relu6"])
def test_bfloat16_matches_numpy(n, c, h, w, stride, epilogue):
    _run(DepthwiseProblem(n, c, h, w, 3, 3, stride=stride, padding=1, dtype="bfloat16",
                          epilogue=epilogue))


@pytest.mark.parametrize("n,c,h,w,stride", SHAPES)
@pytest.mark.parametrize("epilogue", [Epilogue(), REQUANT, DEQUANT],
                         ids=["int32", "requantize", "dequantize"])
def test_uint8_matches_exact_reference(n, c, h, w, stride, epilogue):
    _run(DepthwiseProblem(n, c, h, w, 3, 3, stride=stride, padding=1, dtype="uint8",
                          epilogue=epilogue), pad_value=117)


def test_every_candidate_runs():
    p = DepthwiseProblem(1, 24, 9, 9, 3, 3, stride=2, padding=1, epilogue=BIAS_RELU6)
    found = candidates(p, _machine("avx2"))
    assert found[0] == default_config(p, _machine("avx2")) and len(found) >= 3
    for config in found:
        _run(p, config)


def test_problem_and_config_are_checked():
    with pytest.raises(ValueError, match="does not divide"):
        _run(DepthwiseProblem(1, 24, 7, 7, 3, 3, padding=1), DepthwiseConfig(bq=4, bc=8))
    with pytest.raises(ValueError, match="writes"):
        DepthwiseProblem(1, 8, 7, 7, 3, 3, epilogue=Epilogue((EpilogueOp(
            "convert", dtype="bfloat16"),)))  # a float conv writes float32 or requantizes
    with pytest.raises(ValueError, match="handles"):
        DepthwiseProblem(1, 8, 7, 7, 3, 3, dtype="int8")


# --------------------------------------------------------------------------------------------
# the graph passes


def _depthwise_model(c=24, size=(9, 7), stride=1, seed=0):
    """A float ``Clip(Conv(x, W, b, group=C), 0, 6)`` (MobileNetV2's ReLU6)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((c, 1, 3, 3)) * 0.5).astype("float32")
    b = (0.1 * rng.standard_normal(c)).astype("float32")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["conv"], group=c, kernel_shape=[3, 3],
                              pads=[1, 1, 1, 1], strides=[stride, stride]),
             helper.make_node("Clip", ["conv", "lo", "hi"], ["y"])]
    graph = helper.make_graph(
        nodes, "depthwise", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                           [1, c, *size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                       [1, c, *((d - 1) // stride + 1 for d in size)])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b"),
         numpy_helper.from_array(np.array(0, "float32"), "lo"),
         numpy_helper.from_array(np.array(6, "float32"), "hi")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _calls(mod, op_name):
    found = []
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(
                func, lambda e: found.append(e) if is_call_to(e, op_name) else None)
    return found


@pytest.mark.parametrize("stride", [1, 2])
def test_float_pass_routes_depthwise_conv_bias_clip(stride):
    model = _depthwise_model(stride=stride)
    tgt = tpp_target("tpp")
    mod, specs = import_model(model)
    before = prepare()(mod)
    assert [int(c.attrs.groups) for c in _calls(before, "relax.nn.conv2d")] == [24]
    report = []
    after = rewrite_conv(before, tgt, report)
    assert not _calls(after, "relax.nn.conv2d")  # it became a call_tir of the kernel
    assert [(r.op, r.dtypes, r.layout) for r in report] == [  # ReLU6: a clamp epilogue
        ("conv2d+bias+clamp", "float32*float32->float32", "rsc")]
    assert report[0].kernel.startswith("tpp_dwconv2d_1x24x9x7_3x3")
    kernels = [gv.name_hint for gv, f in after.functions.items()
               if isinstance(f, tvm.tirx.PrimFunc)]
    assert any(name.startswith("tpp_dwconv2d") for name in kernels)
    compiled = tvm_tpp.compile(model, target="tpp")
    for seed in range(2):
        inputs = random_inputs(specs, seed=seed)
        _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
        assert rel <= 1e-5


def test_bf16_pass_routes_depthwise_conv():
    model = _depthwise_model(c=40, size=(7, 9), stride=2)
    compiled = tvm_tpp.compile(model, target="tpp", precision="bf16-strict")
    [record] = [r for r in compiled.report if r.op.startswith("conv2d")]
    assert record.dtypes == "bfloat16*bfloat16->float32", record
    inputs = random_inputs(compiled.inputs, seed=0)
    _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
    assert rel <= 1e-2


_QDQ_CASES = {
    "c24_s1_relu_per_channel": _Conv(24, 24, (9, 7), 3, pad=1, relu=True, group=24),
    "c40_s2_per_channel": _Conv(40, 40, (7, 9), 3, stride=2, pad=1, group=40),
    "c5_s2_per_tensor": _Conv(5, 5, (9, 9), 3, stride=2, pad=1, per_channel=False, group=5),
    "c16_int8_activations": _Conv(16, 16, (7, 7), 3, pad=1, group=16,
                                  activations=QuantType.QInt8),
    "c8_zero_point_255": _Conv(8, 8, (7, 7), 3, pad=1, sign=-1, group=8),
}


@pytest.mark.parametrize("name", sorted(_QDQ_CASES))
def test_qdq_depthwise_conv_matches_onnxruntime(name, tmp_path):
    layer = _QDQ_CASES[name]
    model = _quantized(layer, tmp_path)
    _, report = _int8_report(model)
    assert [(r.op.split("+")[0], r.dtypes, r.layout) for r in report] == [
        ("conv2d_qdq", "uint8*int8->int32", "rsc")], report
    assert "tpp_dwconv2d" in report[0].kernel
    _assert_matches_qdq(model, layer)


@pytest.mark.slow  # a network end to end; the layer tests above cover its kernels
def test_float_mobilenet_v2_matches_onnxruntime():
    # Fewer blocks than the bundled default: every kind of layer, a third of the build time.
    model = models.load("mobilenet_v2", image=48, blocks=((1, 16, 1, 1), (6, 24, 2, 2)))
    compiled = tvm_tpp.compile(model, target="tpp")
    convs = [r for r in compiled.report if r.op.startswith("conv2d")]
    assert convs and all(r.kernel is not None for r in convs), [
        r for r in convs if r.kernel is None]
    assert any("tpp_dwconv2d" in r.kernel for r in convs)
    inputs = models.random_inputs(model, seed=1)
    _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
    assert rel <= 1e-4
