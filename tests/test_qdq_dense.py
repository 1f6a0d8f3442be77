"""int8 dense layers in QDQ form on the int8 TPP GEMM (relay_passes.qdq), against ONNX Runtime.

Single layers built with onnx.helper (MatMul and Gemm, bias, relu, per-tensor and per-channel
weights, uint8 and int8 activations, float and quantized outputs, odd sizes) and the bundled
mlp quantized by onnxruntime.quantization: the pass runs on the imported module (before the
pipeline's preparation folds the weights' dequantize), then the model is built with the tpp
target and run against ONNX Runtime on the same quantized model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import pytest
import tvm
from conftest import INT8_KERNELS, ORT_INT8_EXACT, RandomCalibration
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantFormat, quantize_dynamic, quantize_static
from tvm import relax

import tvm_tpp
from relay_passes.qdq import rewrite_qdq
from relay_passes.scaffold import Offload, is_call_to
from schedules.tuner import TaskCollector
from tvm_tpp import models
from tvm_tpp.compiler import import_model
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime
from tvm_tpp.tpp_target import target as tpp_target

_ONNX = {"uint8": TensorProto.UINT8, "int8": TensorProto.INT8}


@dataclass(frozen=True)
class _Layer:
    """One QDQ dense layer: ``[Q(] [relu(] op(DQ(Q(x)), DQ(W_q)) [+ b] [)]`` (``out``: the
    output's quantized type, None for a float output)."""

    op: str  # "MatMul" (W [K, N]) or "Gemm" (transB: W [N, K])
    x_dtype: str
    zx: int
    per_channel: bool
    bias: bool
    relu: bool
    out: str | None
    m: int = 5
    k: int = 37
    n: int = 29
    zw: int = 0
    lead: tuple[int, ...] = ()  # leading dimensions of x: [*lead, m, k]


def _layer_model(layer: _Layer, seed: int = 0) -> tuple[onnx.ModelProto, float | None]:
    """The ONNX model of ``layer`` and its output's quantization step (None: float output).

    The output scale and zero point are fitted to the layer's real output range on seeded
    inputs (with 0 in it), so that no case saturates."""
    rng = np.random.default_rng(seed)
    m, k, n = layer.m, layer.k, layer.n
    w_shape = (k, n) if layer.op == "MatMul" else (n, k)
    n_axis = 1 if layer.op == "MatMul" else 0
    wq = rng.integers(-128, 128, w_shape).astype(np.int8)
    sw = (rng.uniform(0.002, 0.02, n) if layer.per_channel else np.array(0.01)).astype("float32")
    zw = np.full(sw.shape, layer.zw, np.int8)
    sx = np.float32(0.02)
    b = rng.standard_normal(n).astype("float32")
    inits = {"wq": wq, "sw": sw, "zw": zw, "sx": sx, "zx": np.array(layer.zx, layer.x_dtype),
             **({"b": b} if layer.bias else {})}
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "sw", "zw"], ["wd"], axis=n_axis)]
    if layer.op == "Gemm":
        nodes.append(helper.make_node("Gemm", ["xd", "wd", *(["b"] if layer.bias else [])],
                                      ["acc"], transB=1))
    else:
        nodes.append(helper.make_node("MatMul", ["xd", "wd"], ["mm" if layer.bias else "acc"]))
        if layer.bias:
            nodes.append(helper.make_node("Add", ["mm", "b"], ["acc"]))
    last = "acc"
    if layer.relu:
        nodes.append(helper.make_node("Relu", ["acc"], ["act"]))
        last = "act"
    step = None
    if layer.out is not None:
        real = _real_output(layer, wq, sw, b, rng)
        info = np.iinfo(layer.out)
        lo, hi = min(real.min(), 0.0), max(real.max(), 0.0)
        step = float(np.float32((hi - lo) / (info.max - info.min)))
        inits["sy"] = np.float32(step)
        inits["zy"] = np.array(np.clip(round(info.min - lo / step), info.min, info.max),
                               layer.out)
        nodes += [helper.make_node("QuantizeLinear", [last, "sy", "zy"], ["yq"]),
                  helper.make_node("DequantizeLinear", ["yq", "sy", "zy"], ["y"])]
    else:
        nodes[-1].output[0] = "y"
    graph = helper.make_graph(
        nodes, "qdq_dense", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                        [*layer.lead, m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*layer.lead, m, n])],
        [numpy_helper.from_array(np.asarray(v), name) for name, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return model, step


def _real_output(layer: _Layer, wq: np.ndarray, sw: np.ndarray, b: np.ndarray,
                 rng: np.random.Generator) -> np.ndarray:
    """The layer's float output on a few inputs drawn as :func:`_inputs` draws them."""
    info = np.iinfo(layer.x_dtype)
    x = _inputs(layer, rng, batches=4).reshape(-1, layer.k)
    xd = (np.clip(np.rint(x / 0.02) + layer.zx, info.min, info.max) - layer.zx) * 0.02
    w = (wq * sw.reshape(1, -1) if layer.op == "MatMul" else (wq * sw.reshape(-1, 1)).T)
    y = xd @ w + (b if layer.bias else 0.0)
    return np.maximum(y, 0.0) if layer.relu else y


def _inputs(layer: _Layer, rng: np.random.Generator, batches: int = 1) -> np.ndarray:
    # Centred on the zero point's real value, so that both sides of it are covered.
    centre = -0.02 * (layer.zx - np.iinfo(layer.x_dtype).min - 127.5)
    shape = (batches, *layer.lead, layer.m, layer.k)
    return (centre + 1.5 * rng.standard_normal(shape)).astype("float32")


def _rewrite_and_compile(model: onnx.ModelProto) -> tuple[relax.Expr, list[Offload],
                                                           tvm_tpp.CompiledModel]:
    """The pass on the imported model, then the tpp build (its pipeline prepares the rest)."""
    mod, _ = import_model(model)
    report: list[Offload] = []
    mod = rewrite_qdq(mod, tpp_target(INT8_KERNELS), report)
    return mod, report, tvm_tpp.compile(mod, target=INT8_KERNELS)


def _check(got: np.ndarray, want: np.ndarray, step: float | None) -> None:
    """Within one output quantization step where the output is quantized (and equal but for
    1 % of the values: the kernel's integer chain is exact, only ties may round apart), else
    1e-2 normwise."""
    assert np.std(want) > 0, "degenerate case: constant output"
    if step is None:
        assert max_errors([got], [want])[1] <= 1e-2
    else:
        # One step, plus float32 rounding of the dequantized values themselves.
        rounding = np.finfo(np.float32).eps * np.max(np.abs(want))
        assert np.max(np.abs(got.astype(np.float64) - want)) <= step + rounding
        assert np.mean(got != want) <= 0.01


def _assert_int8_kernels(report: list[Offload], count: int) -> None:
    assert len(report) == count, report
    for entry in report:
        assert entry.kernel is not None and entry.kernel.startswith("tpp_qdq_dense_"), entry
        # vnni4_w7 where the weights happen to lie in 7 bits (test_narrow_weights.py)
        assert entry.dtypes == "uint8*int8->int32" and entry.layout.startswith("vnni4"), entry


_LAYERS = {
    "matmul_u8_zp255_per_channel_bias_relu_u8out":
        _Layer("MatMul", "uint8", 255, per_channel=True, bias=True, relu=True, out="uint8"),
    "gemm_s8_zp-128_per_tensor_bias_s8out":
        _Layer("Gemm", "int8", -128, per_channel=False, bias=True, relu=False, out="int8"),
    "matmul_u8_zp0_per_tensor_float":
        _Layer("MatMul", "uint8", 0, per_channel=False, bias=False, relu=False, out=None),
    "gemm_s8_zp3_per_channel_bias_relu_float":
        _Layer("Gemm", "int8", 3, per_channel=True, bias=True, relu=True, out=None),
    "matmul_rank3_u8_zp128_per_channel_bias_u8out":
        _Layer("MatMul", "uint8", 128, per_channel=True, bias=True, relu=False, out="uint8",
               lead=(2,)),
    "gemm_u8_zp0_per_channel_relu_s8out":
        _Layer("Gemm", "uint8", 0, per_channel=True, bias=False, relu=True, out="int8",
               m=3, k=64, n=48),
}


@pytest.mark.parametrize("name", sorted(_LAYERS))
def test_qdq_layer_matches_onnxruntime(name):
    layer = _LAYERS[name]
    model, step = _layer_model(layer)
    _, report, compiled = _rewrite_and_compile(model)
    _assert_int8_kernels(report, 1)
    assert report[0].shape == (int(np.prod(layer.lead)) * layer.m, layer.n, layer.k)
    assert report[0].op.startswith("matmul_qdq" + "+bias" * layer.bias + "+relu" * layer.relu)
    rng = np.random.default_rng(7)
    for _ in range(2):
        x = _inputs(layer, rng)[0]
        _check(compiled.run(x=x)[0], run_onnxruntime(model, {"x": x}, optimize=False)[0], step)


def test_rewritten_call_reads_uint8_x_and_a_vnni4_int8_weight():
    layer = _LAYERS["gemm_s8_zp-128_per_tensor_bias_s8out"]
    mod, _ = import_model(_layer_model(layer)[0])
    mod = rewrite_qdq(mod, tpp_target(INT8_KERNELS), [])
    calls, dequantized_constants = [], []

    def visit(expr: relax.Expr) -> None:
        if is_call_to(expr, "relax.call_tir"):
            calls.append(expr)
        if is_call_to(expr, "relax.dequantize") and isinstance(expr.args[0], tvm.ir.expr.Constant):
            dequantized_constants.append(expr)

    relax.analysis.post_order_visit(mod["main"], visit)
    assert len(calls) == 1 and not dequantized_constants  # W_q is in the kernel's operand
    x, packed, bias = calls[0].args[1].fields
    assert str(x.ty.dtype) == "uint8"  # int8 activations shifted into the kernel's A
    w = packed.value.numpy()
    # [N/bn, K'/4, bn, 4]: VNNI-4 groups of K zero-padded from 37 to 40
    assert w.dtype == np.int8 and w.ndim == 4 and w.shape[1] * w.shape[3] == 40
    assert w.shape[3] == 4 and w.shape[0] * w.shape[2] == layer.n
    assert bias.value.numpy().dtype == np.int32  # quantized output: the exact int32 chain
    assert str(calls[0].ty.dtype) == "int8"


def test_nonzero_weight_zero_point_is_left_with_a_reason():
    layer = _Layer("MatMul", "uint8", 0, per_channel=False, bias=True, relu=False, out=None,
                   zw=1)
    model, step = _layer_model(layer)
    _, report, compiled = _rewrite_and_compile(model)
    assert [(r.op, r.kernel) for r in report] == [("matmul_qdq", None)]
    assert "weight zero point is not 0" in report[0].reason
    x = _inputs(layer, np.random.default_rng(3))[0]  # the float path still computes it
    _check(compiled.run(x=x)[0], run_onnxruntime(model, {"x": x}, optimize=False)[0], step)


def test_quantized_mlp_runs_every_matmul_on_int8_kernels(tmp_path):
    model = models.load("mlp")
    src, dst = tmp_path / "mlp.onnx", tmp_path / "mlp_qdq.onnx"
    onnx.save(model, str(src))
    # ONNX Runtime's fused integer run is the reference (exact, as the kernels are, where the
    # unfused float run rounds its intermediate layers' values apart): 7-bit weights where it
    # would saturate (conftest).
    quantize_static(str(src), str(dst), RandomCalibration(model), quant_format=QuantFormat.QDQ,
                    per_channel=True, reduce_range=not ORT_INT8_EXACT)
    quantized = onnx.load(str(dst))
    matmuls = sum(n.op_type in ("MatMul", "Gemm") for n in quantized.graph.node)
    _, report, compiled = _rewrite_and_compile(quantized)
    _assert_int8_kernels(report, matmuls)
    producers = {out: n for n in quantized.graph.node for out in n.output}
    last = producers[quantized.graph.output[0].name]
    assert last.op_type == "DequantizeLinear"
    step = float(numpy_helper.to_array(
        next(t for t in quantized.graph.initializer if t.name == last.input[1])))
    for seed in range(2):
        inputs = random_inputs(compiled.inputs, seed=seed)
        _check(compiled.run(**inputs)[0], run_onnxruntime(quantized, inputs)[0], step)


def _relax_layer(x_scale: relax.Expr, params: list[relax.Var]) -> tvm.IRModule:
    """``dequantize(x) @ dequantize(W)`` in Relax, x's scale given (a constant or a param)."""
    x = params[0]
    w = np.ones((24, 32), "int8")
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        xf = bb.emit(relax.op.dequantize(x, x_scale, relax.const(0, "uint8")))
        wf = bb.emit(relax.op.dequantize(relax.const(w), relax.const(0.5), relax.const(0, "int8")))
        bb.emit_func_output(bb.emit(relax.op.matmul(xf, wf)))
    return bb.get()


def test_computed_activation_scale_is_folded_at_run_time():
    # What DynamicQuantizeMatMul becomes: x's scale is computed from x at run time; the
    # kernel's scale and bias vectors then are too.
    x = relax.Var("x", relax.TensorType((4, 24), "uint8"))
    scale = relax.Var("scale", relax.TensorType((), "float32"))
    report: list[Offload] = []
    mod = rewrite_qdq(_relax_layer(scale, [x, scale]), tpp_target(INT8_KERNELS), report)
    assert [(r.op, r.shape, r.dtypes) for r in report] == [
        ("matmul_qdq", (4, 32, 24), "uint8*int8->int32")]
    xq = np.random.default_rng(0).integers(0, 256, (4, 24)).astype("uint8")
    (got,) = tvm_tpp.compile(mod, target=INT8_KERNELS).run(x=xq, scale=np.array(0.25, "float32"))
    np.testing.assert_allclose(got, xq.astype(np.float64) @ np.full((24, 32), 0.5) * 0.25,
                               rtol=1e-6)


@pytest.mark.parametrize("name", ["mlp", pytest.param("bert", marks=pytest.mark.slow)])
def test_dynamically_quantized_network_runs_int8_kernels(name, tmp_path):
    # ONNX Runtime's quantize_dynamic: DynamicQuantizeLinear + MatMulInteger + Cast + Mul.
    src, dst = tmp_path / "float.onnx", tmp_path / "dynamic.onnx"
    onnx.save(models.load(name), str(src))
    # 7-bit weights where ONNX Runtime's MatMulInteger would saturate (conftest).
    quantize_dynamic(str(src), str(dst), reduce_range=not ORT_INT8_EXACT)
    quantized = onnx.load(str(dst))
    matmuls = sum(n.op_type == "MatMulInteger" for n in quantized.graph.node)
    compiled = tvm_tpp.compile(quantized, target=INT8_KERNELS)
    int8 = [r for r in compiled.report if r.dtypes == "uint8*int8->int32"]
    assert len(int8) == matmuls > 0, compiled.report
    inputs = random_inputs(compiled.inputs, seed=1)
    got, want = compiled.run(**inputs), run_onnxruntime(quantized, inputs)
    # Float outputs; each layer quantizes its input by a run-time scale, so an ulp (an FMA)
    # before it may move a value across a rounding boundary: 1e-2 normwise, as for float.
    assert max_errors(got, want)[1] <= 1e-2


def test_tuning_tasks_are_uint8_gemms():
    x = relax.Var("x", relax.TensorType((4, 24), "uint8"))
    tasks = TaskCollector()
    rewrite_qdq(_relax_layer(relax.const(0.1), [x]), tpp_target(INT8_KERNELS), [], tasks)
    # W is all ones: 7-bit weights, a task of their own (another kernel without VNNI)
    assert [(key.op, key.shape, key.dtype) for key in tasks.tasks] == [
        ("dense", (4, 32, 24), "uint8_w7")]


def test_cli_checks_a_quantized_model_against_its_unfused_qdq_graph(tmp_path, capsys):
    from tvm_tpp.cli import main
    from tvm_tpp.quantized import quantize_static_qdq

    path = quantize_static_qdq(models.load("mlp"), tmp_path / "mlp.int8.onnx", samples=2)
    assert main(["run", str(path), "--check", "onnxruntime", "--repeat", "1"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("vs ORT unfused : ") and line.endswith("[OK]"), line
