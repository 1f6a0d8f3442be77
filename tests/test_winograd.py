"""Winograd convs (:mod:`schedules.winograd`): float32 3x3 convs as F(m x m, 3x3) transforms
around flat BRGEMMs.

The kernel against numpy on odd sizes (channels that take no whole vector, both tiles, tiles
past the output's edges, two images, each epilogue kind) and every candidate config; the
filter transform; which convs take it; and the graph rewrite: a 64-channel conv becomes the
Winograd kernel (a 32-channel one stays direct), checked against ONNX Runtime.
"""

from dataclasses import replace

import numpy as np
import onnx
import pytest
import tvm
from conftest import isa_target, pixel_rows, runs_here
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import tvm_tpp
from microkernels import isa
from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.epilogue import reference as epilogue_reference
from microkernels.machine import Machine
from relay_passes.conv import rewrite_conv
from relay_passes.prepare import prepare
from schedules.conv import ConvProblem, pack_input
from schedules.conv import reference as conv_reference
from schedules.ops import OPS, op_of
from schedules.winograd import (
    WinogradConfig,
    WinogradProblem,
    candidates,
    default_config,
    pack_weight,
    schedule,
    tile_size,
    transform_matrices,
    winograd_pays,
)
from tvm_tpp.compiler import import_model
from tvm_tpp.reference import max_errors, run_onnxruntime
from tvm_tpp.tpp_target import target as make_target

AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
MACHINE = Machine(isa.from_name("avx2"), isa.DEFAULT_CACHES, threads=2)
BIAS_RELU = Epilogue((EpilogueOp("bias"), EpilogueOp("relu")))
BIAS_RESIDUAL_RELU = Epilogue((EpilogueOp("bias"), EpilogueOp("residual"), EpilogueOp("relu")))


def _run(problem: WinogradProblem, config: WinogradConfig, seed: int = 0, isa_name: str = "avx2",
         target: tvm.target.Target = AVX2) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's ``[N*P*Q, K]`` output and numpy's (the exact conv of the float32 data,
    whatever the problem's dtype), on random data."""
    conv = problem.conv
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((conv.n, conv.c, conv.h, conv.w)).astype("float32")
    w = (rng.standard_normal((conv.k, conv.c, 3, 3)) / np.sqrt(9 * conv.c)).astype("float32")
    operands = {"bias": rng.standard_normal(conv.k).astype("float32"),
                "residual": rng.standard_normal((conv.rows, conv.k)).astype("float32")}
    used = [operands[op.name] for op in conv.epilogue.inputs(conv.epilogue_dtype)]
    out = tvm.runtime.tensor(np.full((conv.rows, conv.k), np.nan, "float32"))
    kernel = tvm.compile(schedule(problem, config, isa_name).mod, target=target)
    kernel(*map(tvm.runtime.tensor, (pack_input(x, conv), pack_weight(w, problem, config.bk),
                                     *used)), out)
    direct = pixel_rows(conv_reference(replace(conv, dtype="float32"), x, w)).astype("float32")
    return out.numpy(), epilogue_reference(conv.epilogue, direct, operands)


@pytest.mark.parametrize("n,c,h,w,k,tile,epilogue", [
    (2, 13, 8, 12, 24, 4, Epilogue()),           # channels of no whole vector, two images
    (1, 32, 8, 8, 48, 4, BIAS_RELU),
    (1, 20, 6, 10, 16, 2, BIAS_RESIDUAL_RELU),  # 6 rows: tiles of 2 only
    (2, 16, 4, 4, 32, 2, BIAS_RESIDUAL_RELU),
    (2, 16, 7, 7, 32, 4, BIAS_RESIDUAL_RELU),   # tiles past the edges: ResNet's 7x7 maps
    (1, 24, 6, 9, 16, 4, BIAS_RELU),            # past the bottom by 2, the right by 3
    (1, 8, 5, 3, 16, 2, Epilogue()),
])
def test_kernel_against_numpy(n, c, h, w, k, tile, epilogue):
    problem = WinogradProblem(ConvProblem(n, c, h, w, k, 3, 3, padding=1, epilogue=epilogue),
                              tile)
    got, want = _run(problem, default_config(problem, MACHINE))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


BF16_ISAS = [pytest.param("avx2", id="avx2-emulated"),
             pytest.param("avx512_bf16", id="avx512_bf16", marks=pytest.mark.skipif(
                 not runs_here("avx512_bf16"), reason="host lacks AVX512-BF16: its kernel's "
                 "vdpbf16ps is checked in znver4 assembly instead"))]


@pytest.mark.parametrize("isa_name", BF16_ISAS)
@pytest.mark.parametrize("n,c,h,w,k,tile,epilogue", [
    (2, 14, 8, 12, 24, 2, BIAS_RELU),           # channels of no whole vector, two images
    (1, 64, 7, 7, 48, 2, BIAS_RESIDUAL_RELU),   # tiles past the edges
    (1, 20, 6, 10, 32, 2, Epilogue()),
])
def test_bf16_kernel_against_numpy(n, c, h, w, k, tile, epilogue, isa_name):
    """V and U rounded to bf16: F(2)'s error is about twice the direct bf16 conv's (bf16's
    roundings of the operands), on random data 4e-3 of the output's largest value."""
    conv = ConvProblem(n, c, h, w, k, 3, 3, padding=1, epilogue=epilogue, dtype="bfloat16")
    problem = WinogradProblem(conv, tile)
    target = AVX2 if isa_name == "avx2" else isa_target(isa_name, "znver4")
    machine = Machine(isa.from_name(isa_name), isa.DEFAULT_CACHES, threads=2)
    got, want = _run(problem, default_config(problem, machine), 4, isa_name, target)
    np.testing.assert_allclose(got, want, rtol=0, atol=8e-3 * np.abs(want).max())
    assert np.abs(got - want).max() > 1e-6 * np.abs(want).max()  # bf16, not float32, products


def test_bf16_kernel_multiplies_with_vdpbf16ps():
    conv = ConvProblem(1, 64, 8, 8, 64, 3, 3, padding=1, dtype="bfloat16", epilogue=BIAS_RELU)
    problem = WinogradProblem(conv, 2)
    machine = Machine(isa.from_name("avx512_bf16"), isa.DEFAULT_CACHES, threads=2)
    sch = schedule(problem, default_config(problem, machine), "avx512_bf16")
    asm = tvm.compile(sch.mod, target=isa_target("avx512_bf16", "znver4")).mod \
        .inspect_source("asm")
    assert "vdpbf16ps" in asm and "vcvtneps2bf16" in asm


def test_bf16_filter_transform_in_vnni_pairs():
    problem = WinogradProblem(ConvProblem(1, 4, 8, 8, 4, 3, 3, padding=1, dtype="bfloat16"), 2)
    w = np.random.default_rng(2).standard_normal((4, 4, 3, 3)).astype("float32")
    u = pack_weight(w, problem, 2)
    flat = pack_weight(w, WinogradProblem(replace(problem.conv, dtype="float32"), 2), 2)
    assert u.shape == (16, 2, 2, 2, 2) and str(u.dtype) == "bfloat16"
    # U[xi, o // bk, c // 2, o % bk, c % 2] = the float32 U[xi, o // bk, c, o % bk], rounded
    np.testing.assert_array_equal(u.astype("float32"),
                                  flat.reshape(16, 2, 2, 2, 2).transpose(0, 1, 2, 4, 3)
                                  .astype(u.dtype).astype("float32"))


def test_every_candidate_computes_the_conv():
    problem = WinogradProblem(ConvProblem(1, 24, 8, 8, 64, 3, 3, padding=1, epilogue=BIAS_RELU),
                              2)  # F(2): 16 points, quicker to build than F(4)'s 36
    configs = candidates(problem, MACHINE)
    assert configs[0] == default_config(problem, MACHINE) and len(configs) > 1
    for config in configs:
        got, want = _run(problem, config, seed=1)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("tile", [2, 4])
def test_filter_transform_is_g_w_gt(tile):
    problem = WinogradProblem(ConvProblem(1, 3, 8, 8, 4, 3, 3, padding=1), tile)
    w = np.random.default_rng(2).standard_normal((4, 3, 3, 3)).astype("float32")
    u = pack_weight(w, problem, 2)
    _, _, g = transform_matrices(tile)
    alpha = tile + 2
    assert u.shape == (alpha * alpha, 2, 3, 2) and u.dtype == np.float32
    # U[xi, o // bk, c, o % bk] = (G w[o, c] G^T)[xi // alpha, xi % alpha]
    want = g @ w[3, 1].astype(np.float64) @ g.T
    np.testing.assert_allclose(u[:, 1, 1, 1].reshape(alpha, alpha), want, rtol=1e-6)


@pytest.mark.parametrize("tile", [2, 4])
def test_transforms_compute_a_1d_correlation(tile):
    a, b, g = transform_matrices(tile)
    rng = np.random.default_rng(3)
    d, w = rng.standard_normal(tile + 2), rng.standard_normal(3)
    want = np.correlate(d, w, mode="valid")
    np.testing.assert_allclose(a.T @ ((g @ w) * (b.T @ d)), want, rtol=1e-12, atol=1e-12)


def test_which_convs_take_it():
    conv = ConvProblem(1, 128, 56, 56, 64, 3, 3, padding=1)
    assert tile_size(conv) == 4 and winograd_pays(conv, MACHINE) == 4
    # Fewest products per output, tiles past the edges counted: 14 and 7 take 4, 6 takes 2.
    assert [tile_size(ConvProblem(1, 128, h, h, 64, 3, 3, padding=1))
            for h in (14, 7, 6, 2)] == [4, 4, 2, 2]
    assert winograd_pays(ConvProblem(1, 32, 56, 56, 64, 3, 3, padding=1), MACHINE) is None
    bf16 = ConvProblem(1, 128, 56, 56, 64, 3, 3, padding=1, dtype="bfloat16")
    assert winograd_pays(bf16, Machine(isa.from_name("avx512_bf16"), isa.DEFAULT_CACHES)) == 2
    assert winograd_pays(bf16, Machine(isa.from_name("amx"), isa.DEFAULT_CACHES)) is None
    for other in (ConvProblem(1, 128, 56, 56, 64, 3, 3, stride=2, padding=1),
                  ConvProblem(1, 128, 56, 56, 64, 3, 3, padding=2, dilation=2),
                  ConvProblem(1, 128, 56, 56, 64, 3, 3, padding=1, groups=2),
                  ConvProblem(1, 128, 56, 56, 64, 3, 3),                        # unpadded
                  ConvProblem(1, 128, 56, 56, 64, 1, 1),
                  ConvProblem(1, 127, 56, 56, 64, 3, 3, padding=1, dtype="bfloat16")):
        assert tile_size(other) is None
        with pytest.raises(ValueError, match="Winograd takes"):
            WinogradProblem(other, 2)
    with pytest.raises(ValueError, match="tile=3 must be one of"):
        WinogradProblem(conv, 3)
    with pytest.raises(ValueError, match="bt=5 does not divide"):
        WinogradConfig(bt=5, bk=8).check(WinogradProblem(conv, 4))
    with pytest.raises(ValueError, match="positive int"):
        WinogradConfig(bt=0, bk=8)


def test_tuner_records_round_trip():
    problem = WinogradProblem(ConvProblem(1, 128, 56, 56, 64, 3, 3, padding=1), 4)
    op = op_of(problem)
    assert op is OPS["winograd_conv2d"]
    config = default_config(problem, MACHINE)
    assert op.from_json(op.to_json(config)) == config
    shape, layout, dtype = op.key(problem)
    assert (shape, layout, dtype) == ((1, 128, 56, 56, 64, 3, 3), "s1x1p1x1x1x1t4", "float32")
    assert op.text(config) == f"winograd bt={config.bt} bk={config.bk}"


def _model(c: int) -> onnx.ModelProto:
    """``relu(conv3x3(x) + b) + x``: a padded 3x3 conv with a residual after it."""
    rng = np.random.default_rng(4)
    weights = {"w": rng.standard_normal((c, c, 3, 3)) / np.sqrt(9 * c),
               "b": rng.normal(0, 0.1, c)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c0"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c0"], ["r0"]),
             helper.make_node("Add", ["r0", "x"], ["y"])]
    shape = [2, c, 8, 12]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(v.astype("float32"), k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("c,winograd", [(64, True), (32, False)])
def test_graph_takes_winograd_where_it_pays(c, winograd):
    model = _model(c)
    tgt = make_target("tpp -isa=avx2")
    mod, _ = import_model(model)
    mod = rewrite_conv(prepare()(mod), tgt, [])
    kernels = [gv.name_hint for gv in mod.functions if "conv2d" in gv.name_hint]
    # 48 tiles of 2 (12 of 4: too few rows for the GEMMs, MIN_TILES)
    assert kernels == [f"tpp_conv2d_2x{c}x8x12_{c}x3x3_s1x1"
                       + ("_winograd2" if winograd else "") + "_bias_relu"]
    x = np.random.default_rng(5).standard_normal((2, c, 8, 12)).astype("float32")
    compiled = tvm_tpp.compile(model, target="tpp -isa=avx2")
    assert any("winograd" in (r.kernel or "") for r in compiled.report) == winograd
    _, rel = max_errors(compiled.run(x=x), run_onnxruntime(model, {"x": x}))
    assert rel <= 1e-5


def test_bf16_graph_takes_winograd_in_bf16():
    """``precision="bf16"`` on a CPU with bf16 arithmetic: the 64-channel conv's Winograd
    kernel multiplies in bf16 (checked against ONNX Runtime where the host runs it)."""
    model = _model(64)
    mod = rewrite_conv(prepare()(import_model(model)[0]), make_target("tpp -isa=avx512_bf16"),
                       [], precision="bf16")
    assert [gv.name_hint for gv in mod.functions if "conv2d" in gv.name_hint] == [
        "tpp_conv2d_2x64x8x12_64x3x3_s1x1_winograd2_bias_relu_bf16"]
    if not runs_here("avx512_bf16"):
        pytest.skip("host lacks AVX512-BF16: the rewrite is checked, the numbers are not")
    x = np.random.default_rng(5).standard_normal((2, 64, 8, 12)).astype("float32")
    compiled = tvm_tpp.compile(model, target="tpp -isa=avx512_bf16", precision="bf16")
    assert any("winograd" in (r.kernel or "") and "bfloat16" in (r.dtypes or "")
               for r in compiled.report)
    _, rel = max_errors(compiled.run(x=x), run_onnxruntime(model, {"x": x}))
    assert 1e-5 < rel <= 1e-2


def test_graph_rewrite_structurally():
    """A padded 3x3 conv + ReLU becomes: NHWC, pad by one, the Winograd kernel over the
    transformed filter (a constant: :func:`pack_weight` of the filter), back to NCHW."""
    w = np.random.default_rng(6).standard_normal((64, 64, 3, 3)).astype("float32")
    x = relax.Var("x", relax.TensorType((2, 64, 8, 12), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.relu(bb.emit(relax.op.nn.conv2d(x, relax.const(w),
                                                                    padding=1))))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    after = rewrite_conv(bb.get(), make_target("tpp -isa=avx2"), [])

    problem = WinogradProblem(ConvProblem(2, 64, 8, 12, 64, 3, 3, padding=1,
                                          epilogue=Epilogue((EpilogueOp("relu"),))), 2)
    config = default_config(problem, MACHINE)
    name = "tpp_conv2d_2x64x8x12_64x3x3_s1x1_winograd2_relu"
    kernel = schedule(problem, config, "avx2").mod["main"]
    bb = relax.BlockBuilder()
    gv = bb.add_func(kernel.with_attrs(after[name].attrs), name)
    with bb.function("main", [x]):
        with bb.dataflow():
            nhwc = bb.emit(relax.op.permute_dims(x, [0, 2, 3, 1]))
            padded = bb.emit(relax.op.nn.pad(nhwc, [0, 0, 1, 1, 1, 1, 0, 0], pad_value=0.0))
            y = bb.emit(relax.call_tir(gv, [padded, relax.const(pack_weight(w, problem,
                                                                            config.bk))],
                                       relax.TensorType((192, 64), "float32")))
            y = bb.emit(relax.op.reshape(y, (2, 8, 12, 64)))
            out = bb.emit_output(relax.op.permute_dims(y, [0, 3, 1, 2]))
        bb.emit_func_output(out)
    expected = bb.get()
    expected[gv] = expected[gv].without_attr("global_symbol")  # BlockBuilder's, not the pass's
    tvm.ir.assert_structural_equal(after, expected)


def test_a_target_that_keeps_convs_direct():
    model = _model(64)
    direct = make_target("tpp -isa=avx2 -conv=direct")
    assert "tpp-direct-conv" in direct.keys
    mod = rewrite_conv(prepare()(import_model(model)[0]), direct, [])
    assert [gv.name_hint for gv in mod.functions if "conv2d" in gv.name_hint] == [
        "tpp_conv2d_2x64x8x12_64x3x3_s1x1_bias_relu"]
    assert "tpp-direct-conv" not in make_target("tpp -isa=avx2 -conv=auto").keys
    with pytest.raises(ValueError, match="-conv must be one of auto, direct, got 'fast'"):
        make_target("tpp -isa=avx2 -conv=fast")
