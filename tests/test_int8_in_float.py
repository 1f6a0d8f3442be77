"""Quantized (QDQ) layers computed in float32 on their dequantized operands: ``tpp -int8=float``,
the default where the int8 kernels are slower than float32 (``Machine.int8_in_float``: a Zen 1).

The float kernels (Winograd's included) with the int8 path's requantizing epilogues, against
the QDQ graph as ONNX Runtime runs it unfused; the activations between layers stay integers.
"""

import numpy as np
import onnx
import pytest
import tvm
from test_qdq_conv import (
    _CASES,
    _assert_matches_qdq,
    _Conv,
    _quantized,
    _quantized_residual_block,
)
from test_qdq_dense import _LAYERS, _check, _inputs, _layer_model
from tvm import relax

import tvm_tpp
from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.machine import machine_of
from relay_passes.qdq import rewrite_qdq
from schedules.gemm import GemmProblem, default_config, pack_weight
from tvm_tpp import models
from tvm_tpp.quantized import quantize_static_qdq
from tvm_tpp.reference import max_errors, run_onnxruntime
from tvm_tpp.tpp_target import target as tpp_target

FLOAT = "tpp -int8=float"
FLOAT32 = "float32*float32->float32"


def _routed(compiled: tvm_tpp.CompiledModel) -> list:
    return [r for r in compiled.report if r.op.startswith(("conv2d_qdq", "matmul_qdq"))]


@pytest.mark.parametrize("name", sorted(_LAYERS))
def test_dense_layer_in_float(name):
    layer = _LAYERS[name]
    model, step = _layer_model(layer)
    compiled = tvm_tpp.compile(model, target=FLOAT)
    (entry,) = _routed(compiled)
    assert entry.dtypes == FLOAT32 and entry.kernel.startswith("tpp_qdq_dense_"), entry
    assert "_f32 [" in entry.kernel and entry.op.startswith("matmul_qdq" + "+bias" * layer.bias)
    rng = np.random.default_rng(7)
    for _ in range(2):
        x = _inputs(layer, rng)[0]
        _check(compiled.run(x=x)[0], run_onnxruntime(model, {"x": x}, optimize=False)[0], step)


@pytest.mark.parametrize("name", sorted(_CASES))
def test_conv_in_float(name, tmp_path):
    layer = _CASES[name]
    model = _quantized(layer, tmp_path)
    compiled = tvm_tpp.compile(model, target=FLOAT)
    (entry,) = _routed(compiled)
    assert entry.kernel is not None and entry.dtypes == FLOAT32, entry
    _assert_matches_qdq(model, layer, compiled)


def test_depthwise_and_grouped_convs_in_float(tmp_path):
    for layer, kernel in ((_Conv(16, 16, (9, 7), 3, pad=1, group=16, relu=True),
                           "tpp_dwconv2d"), (_Conv(16, 24, (8, 8), 3, pad=1, group=2), "")):
        model = _quantized(layer, tmp_path)
        compiled = tvm_tpp.compile(model, target=FLOAT)
        (entry,) = _routed(compiled)
        assert entry.dtypes == FLOAT32 and kernel in entry.kernel, entry
        _assert_matches_qdq(model, layer, compiled)


def test_a_3x3_conv_over_64_channels_takes_winograd(tmp_path):
    """In float32 the Winograd form is open to a quantized conv (the int8 kernels have
    none): the requantizing epilogue follows its output transform."""
    layer = _Conv(64, 72, (14, 14), 3, pad=1, relu=True)
    model = _quantized(layer, tmp_path)
    compiled = tvm_tpp.compile(model, target=FLOAT)
    (entry,) = _routed(compiled)
    # (the quantizer drops the relu: the output's zero point bounds it)
    assert "_winograd" in entry.kernel and "_bias_requantize_u8 " in entry.kernel, entry
    on_kernels = tvm_tpp.compile(model, target="tpp -int8=kernels")
    assert {r.dtypes for r in on_kernels.report if r.kernel} == {"uint8*int8->int32"}
    assert on_kernels.int8_note is None  # the same file on the int8 kernels
    _assert_matches_qdq(model, layer, compiled)


def test_auto_computes_winograd_convs_in_float_without_an_int8_dot_product(tmp_path):
    """``-int8=auto`` on an ISA without an int8 dot product (AVX2): a quantized conv that
    float32 computes in Winograd form is computed so; a 1x1 conv stays on the int8 kernel,
    as the 3x3 conv does where VNNI multiplies int8, or where -int8=kernels asks."""
    conv3, conv1 = _Conv(64, 72, (14, 14), 3, pad=1), _Conv(64, 40, (14, 14), 1)
    models_ = {}
    for name, layer in (("3x3", conv3), ("1x1", conv1)):
        (tmp_path / name).mkdir()
        models_[name] = _quantized(layer, tmp_path / name)
    int8 = "uint8*int8->int32"
    for name, target, dtypes in (("3x3", "tpp -isa=avx2 -mcpu=znver3", FLOAT32),
                                 ("1x1", "tpp -isa=avx2 -mcpu=znver3", int8),
                                 ("3x3", "tpp -isa=avx2 -mcpu=znver3 -int8=kernels", int8),
                                 ("3x3", "tpp -isa=avx512_vnni", int8)):
        compiled = tvm_tpp.compile(models_[name], target=target)
        (entry,) = _routed(compiled)
        assert entry.dtypes == dtypes, (name, target, entry)
        assert ("_winograd" in entry.kernel) == (dtypes == FLOAT32), entry
        if dtypes == FLOAT32:
            assert "3x3 convs in Winograd form" in compiled.int8_note, compiled.int8_note
            _assert_matches_qdq(models_[name], conv3, compiled)
        else:
            assert compiled.int8_note is None


def test_7bit_weights_take_only_the_larger_winograd_tile_in_float(tmp_path):
    """7-bit weights run the 2x faster ``vpmaddubsw`` kernel: F(2x2) (a 14x14 map at batch 1)
    stays on it, F(4x4) (28x28) is computed in float."""
    for size, dtypes in ((14, "uint8*int8->int32"), (28, FLOAT32)):
        layer = _Conv(64, 72, (size, size), 3, pad=1)
        (tmp_path / str(size)).mkdir()
        model = _quantized(layer, tmp_path / str(size), reduce_range=True)
        compiled = tvm_tpp.compile(model, target="tpp -isa=avx2 -mcpu=znver3")
        (entry,) = _routed(compiled)
        assert entry.dtypes == dtypes, entry
        assert ("_winograd4" in entry.kernel) == (dtypes == FLOAT32), entry
        _assert_matches_qdq(model, layer, compiled)


def test_residual_add_joins_the_float_kernel(tmp_path):
    model, layer = _quantized_residual_block(tmp_path)
    compiled = tvm_tpp.compile(model, target=FLOAT)
    routed = _routed(compiled)
    assert sorted(r.op for r in routed) == [
        "conv2d_qdq+bias+quantize+residual+quantize_u8", "conv2d_qdq+bias+quantize_u8"]
    assert all(r.dtypes == FLOAT32 for r in routed)
    assert any("dequantize_residual_u8" in r.kernel for r in routed)
    _assert_matches_qdq(model, layer, compiled)


def test_quantized_network_in_float(tmp_path):
    float_model = models.load("resnet_small", image=32, widths=(16, 32))
    path = quantize_static_qdq(float_model, tmp_path / "int8.onnx", samples=2)
    compiled = tvm_tpp.compile(str(path), target=FLOAT)
    routed = _routed(compiled)
    assert routed and all(r.kernel is not None and r.dtypes == FLOAT32 for r in routed)
    assert compiled.tpp_flops_fraction == 1.0
    assert "computed in float32" in compiled.int8_note and "-int8=float asks" in \
        compiled.int8_note
    x = models.random_inputs(float_model, seed=1)
    want = run_onnxruntime(onnx.load(str(path)), x, optimize=False)[0]
    got = compiled.run(**x)[0]
    assert max_errors([got], [want])[1] <= 1e-2


def test_rewrite_structurally():
    """``quantize(dequantize(x) @ dequantize(W_q))`` becomes the float32 GEMM of the
    dequantized x, over the packed dequantized weights, requantizing in its epilogue."""
    rng = np.random.default_rng(2)
    wq = rng.integers(-128, 128, (37, 29)).astype("int8")
    sw = (0.01 + 0.02 * rng.random(29)).astype("float32")
    x = relax.Var("x", relax.TensorType((5, 37), "uint8"))
    sx, zx, sy, zy = (relax.const(0.1), relax.const(3, "uint8"), relax.const(0.5),
                      relax.const(7, "uint8"))

    def dequantized_x() -> relax.Call:
        return relax.op.dequantize(x, sx, zx)

    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            w = relax.op.dequantize(relax.const(wq), relax.const(sw), relax.const(0, "int8"),
                                    axis=1)
            y = bb.emit(relax.op.matmul(bb.emit(dequantized_x()), bb.emit(w)))
            out = bb.emit_output(relax.op.quantize(y, sy, zy, out_dtype="uint8"))
        bb.emit_func_output(out)
    target = tpp_target("tpp -isa=avx2 -int8=float")
    report = []
    after = rewrite_qdq(bb.get(), target, report)

    epilogue = Epilogue((EpilogueOp("requantize", value=2.0, zero_point=7, dtype="uint8"),))
    problem = GemmProblem(5, 29, 37, "float32", epilogue).on("avx2")
    config = default_config(problem, machine_of(target))
    name = "tpp_qdq_dense_5x29x37_requantize_u8_f32"
    assert report[0].kernel == f"{name} [{config.spec}]" and report[0].dtypes == FLOAT32
    bb = relax.BlockBuilder()
    gv = bb.add_func(after[name], name)
    with bb.function("main", [x]):
        with bb.dataflow():
            xf = bb.emit(dequantized_x())
            weight = pack_weight(wq.astype("float32") * sw, config.bn, problem)
            out = bb.emit_output(relax.call_tir(gv, [xf, relax.const(weight)],
                                                relax.TensorType((5, 29), "uint8")))
        bb.emit_func_output(out)
    tvm.ir.assert_structural_equal(after, bb.get())


def test_run_time_scales_keep_the_int8_kernels():
    """ONNX Runtime's dynamic quantization (a scale computed when it runs) has no constant
    quantization to dequantize by at build time: it keeps its int8 kernel."""
    x = relax.Var("x", relax.TensorType((4, 24), "uint8"))
    scale = relax.Var("scale", relax.TensorType((), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, scale]):
        w = relax.op.dequantize(relax.const(np.ones((24, 16), "int8")), relax.const(0.5),
                                relax.const(0, "int8"))
        y = relax.op.matmul(relax.op.dequantize(x, scale, relax.const(0, "uint8")), w)
        bb.emit_func_output(bb.emit(y))
    report = []
    rewrite_qdq(bb.get(), tpp_target("tpp -isa=avx2 -int8=float"), report)
    assert [r.dtypes for r in report] == ["uint8*int8->int32"]


def test_int8_option_is_checked():
    assert "tpp-int8-float" in tpp_target(FLOAT).keys
    assert not {"tpp-int8-float", "tpp-int8-kernels"} & set(tpp_target("tpp").keys)
    with pytest.raises(ValueError, match="-int8 must be one of auto, kernels, float, got 'x'"):
        tpp_target("tpp -int8=x")
