"""7-bit int8 weights (ONNX Runtime's ``reduce_range``) on the ``vpmaddubsw`` kernels.

Without VNNI the exact u8 x s8 kernel widens both operands to 16 bits; weights in [-64, 64]
cannot saturate ``vpmaddubsw``'s int16 pair sums, so the graph pass marks such layers
(``narrow_weights``) and the schedules dispatch the ``vnni4_w7`` kernel, about twice as fast.
Checked: the choice per ISA and per weight range, the tuning key, and the layers' results
against ONNX Runtime running the same file unfused (ONNX's roundings), extremes included.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import runs_here
from onnx import numpy_helper
from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
from test_qdq_conv import _Conv, _Inputs, _output_step
from tvm import relax

import tvm_tpp
from relay_passes.qdq import rewrite_qdq
from relay_passes.scaffold import Offload
from schedules.conv import ConvProblem
from schedules.database import TuningKey
from schedules.gemm import GemmProblem
from schedules.operands import narrow
from schedules.tuner import TaskCollector
from tvm_tpp import models
from tvm_tpp.compiler import import_model
from tvm_tpp.quantized import quantize_static_qdq
from tvm_tpp.reference import run_onnxruntime
from tvm_tpp.tpp_target import target as tpp_target

#: An ISA without VNNI whose code every x86 host of the project runs.
AVX2 = "tpp -isa=avx2"
needs_avx2 = pytest.mark.skipif(not runs_here("avx2"), reason="host cannot run avx2 code")


def _quantized_conv(layer: _Conv, tmp_path, reduce_range: bool) -> onnx.ModelProto:
    src, dst = tmp_path / "float.onnx", tmp_path / f"qdq{int(reduce_range)}.onnx"
    onnx.save(layer.model(), str(src))
    quantize_static(str(src), str(dst), _Inputs(layer), quant_format=QuantFormat.QDQ,
                    per_channel=layer.per_channel, reduce_range=reduce_range,
                    activation_type=layer.activations, weight_type=QuantType.QInt8)
    return onnx.load(str(dst))


def _report(model: onnx.ModelProto, target: str = AVX2) -> list[Offload]:
    mod, _ = import_model(model)
    report: list[Offload] = []
    rewrite_qdq(mod, tpp_target(target), report)
    return report


def _weights_of(model: onnx.ModelProto) -> list[np.ndarray]:
    return [numpy_helper.to_array(t) for t in model.graph.initializer
            if t.data_type == onnx.TensorProto.INT8 and len(t.dims) > 1]


def test_brgemm_layout_by_isa_and_range():
    wide = GemmProblem(8, 16, 32, "uint8")
    thin = GemmProblem(8, 16, 32, "uint8", narrow_weights=True)
    assert [thin.brgemm_layout(i) for i in ("avx2", "avx512", "avx_vnni", "avx512_vnni",
                                            "amx")] == ["vnni4_w7", "vnni4_w7", "vnni4",
                                                        "vnni4", "vnni4"]
    assert wide.brgemm_layout("avx2") == "vnni4"
    assert thin.on("neon_i8mm").brgemm_layout("neon_i8mm") == "mmla"  # no saturation there
    conv = ConvProblem(1, 8, 6, 6, 16, 3, 3, dtype="uint8", narrow_weights=True)
    assert conv.brgemm_layout("avx2") == "vnni4_w7" and conv.layout == "vnni4"


def test_narrow_weights_validated():
    with pytest.raises(ValueError, match="describes int8 weights"):
        GemmProblem(8, 16, 32, "float32", narrow_weights=True)
    with pytest.raises(ValueError, match="describes int8 weights"):
        ConvProblem(1, 8, 6, 6, 16, 3, 3, narrow_weights=True)
    with pytest.raises(TypeError, match="must be a bool"):
        GemmProblem(8, 16, 32, "uint8", narrow_weights=1)
    assert narrow(np.array([[-64, 64]], "int8")) and not narrow(np.array([65], "int8"))
    assert not narrow(np.array([-65], "int8"))


def test_narrow_problems_tune_apart():
    target = tpp_target(AVX2)
    keys = {TuningKey.of(GemmProblem(8, 16, 32, "uint8", narrow_weights=flag), target).text()
            for flag in (False, True)}
    assert len(keys) == 2 and any("|uint8_w7|" in key for key in keys)


@needs_avx2
@pytest.mark.parametrize("layer", [
    _Conv(5, 24, (9, 11), 3, pad=1, relu=True),
    pytest.param(_Conv(16, 40, (10, 9), 3, stride=2, pad=1, per_channel=False),
                 marks=pytest.mark.slow),  # a build each: the default suite's budget
    _Conv(3, 16, (17, 15), 7, stride=2, pad=3, relu=True),
    _Conv(12, 32, (7, 7), 3, pad=1, activations=QuantType.QInt8),
    pytest.param(_Conv(8, 16, (6, 6), 3, pad=1, sign=-1), marks=pytest.mark.slow),
], ids=["3x3_relu", "3x3_s2_per_tensor", "stem_7x7", "int8_activations", "zero_point_255"])
def test_reduced_range_conv_on_w7_kernel_matches_onnxruntime(layer, tmp_path):
    model = _quantized_conv(layer, tmp_path, reduce_range=True)
    assert all(narrow(w) for w in _weights_of(model))
    assert [(r.dtypes, r.layout) for r in _report(model)] == [("uint8*int8->int32",
                                                               "vnni4_w7")]
    compiled = tvm_tpp.compile(model, target=AVX2)
    step = _output_step(model)
    for seed in range(2):
        x = layer.inputs(seed)
        got, want = compiled.run(x=x)[0], run_onnxruntime(model, {"x": x}, optimize=False)[0]
        assert np.std(want) > 0
        assert np.max(np.abs(got - want)) <= step * (1 + 1e-5)
        assert np.mean(got != want) <= 0.01


def test_full_range_conv_keeps_the_exact_kernel(tmp_path):
    model = _quantized_conv(_Conv(5, 24, (9, 11), 3, pad=1, relu=True), tmp_path,
                            reduce_range=False)
    assert not all(narrow(w) for w in _weights_of(model))
    assert [r.layout for r in _report(model)] == ["vnni4"]


def test_vnni_targets_keep_their_dot_product(tmp_path):
    model = _quantized_conv(_Conv(8, 16, (6, 6), 3, pad=1), tmp_path, reduce_range=True)
    assert [(r.isa, r.layout) for r in _report(model, "tpp -isa=avx512_vnni")] == [
        ("avx512_vnni", "vnni4")]


@needs_avx2
def test_reduced_range_mlp_matches_onnxruntime(tmp_path):
    path = quantize_static_qdq(models.load("mlp"), tmp_path / "mlp.w7.onnx", samples=2,
                               reduce_range=True)
    model = onnx.load(str(path))
    report = _report(model)
    assert report and all(r.layout == "vnni4_w7" for r in report), report
    name = model.graph.input[0].name
    x = np.random.default_rng(3).standard_normal((1, 512)).astype("float32")
    got = tvm_tpp.compile(model, target=AVX2).run(**{name: x})[0]
    want = run_onnxruntime(model, {name: x}, optimize=False)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))


@needs_avx2
def test_extreme_pairs_do_not_saturate():
    """u8 255 against weight pairs of +-64: the pair sums reach +-32640, int16's edge."""
    k, n = 36, 20
    w = np.random.default_rng(1).choice(np.array([-64, 64], "int8"), (k, n))
    x = relax.Var("x", relax.TensorType((5, k), "uint8"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        xf = bb.emit(relax.op.dequantize(x, relax.const(1.0), relax.const(0, "uint8")))
        wf = bb.emit(relax.op.dequantize(relax.const(w), relax.const(1.0),
                                         relax.const(0, "int8")))
        bb.emit_func_output(bb.emit(relax.op.matmul(xf, wf)))
    report: list[Offload] = []
    mod = rewrite_qdq(bb.get(), tpp_target(AVX2), report)
    assert [r.layout for r in report] == ["vnni4_w7"]
    xq = np.full((5, k), 255, "uint8")
    xq[1] = np.random.default_rng(0).integers(0, 256, k)
    (got,) = tvm_tpp.compile(mod, target=AVX2).run(x=xq)
    np.testing.assert_array_equal(got, xq.astype(np.int64) @ w.astype(np.int64))


def test_tasks_of_a_reduced_range_model_are_w7(tmp_path):
    model = _quantized_conv(_Conv(8, 16, (6, 6), 3, pad=1), tmp_path, reduce_range=True)
    mod, _ = import_model(model)
    tasks = TaskCollector()
    rewrite_qdq(mod, tpp_target(AVX2), [], tasks)
    assert [key.dtype for key in tasks.tasks] == ["uint8_w7"]
