"""Low-precision batch GEMMs of two activations: bfloat16 (X and B rounded to bf16 while the
kernel packs them, VNNI-2, float32 accumulation) and uint8 x uint8 (B shifted to int8 while
packed, VNNI-4, int32 accumulation, the zero points folded in the kernel).

The kernels run here against numpy on odd sizes, plain, transposed and heads-interleaved
layouts: natively for the ISAs this host has (the others skip, naming the missing CPU flags),
and AVX2's exact emulations everywhere.  A ``sapphirerapids`` cross-compile is checked by its
instructions.  The graph pass: ``precision="bf16"`` on attention, and ONNX Runtime's QDQ
attention (both operands dequantized uint8) on the int8 kernel, BERT included, against ONNX
Runtime.
"""

import re

import ml_dtypes
import numpy as np
import onnx
import pytest
import tvm
from conftest import emulated_dispatch, needs_isa
from tvm import relax

import tvm_tpp
from microkernels import isa
from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.machine import Machine
from relay_passes.batch_matmul import rewrite_batch_matmul
from schedules.batch_gemm import (
    BatchGemmConfig,
    BatchGemmProblem,
    candidates,
    default_config,
    reference,
    schedule,
)
from tvm_tpp import models
from tvm_tpp.quantized import quantize_static_qdq
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime
from tvm_tpp.tpp_target import target as tpp_target

HOST = isa.host_flags()
SCALE = Epilogue((EpilogueOp("scale", value=0.125),))
SCALE_BIAS = Epilogue((EpilogueOp("scale", value=0.3), EpilogueOp("bias")))
REQUANT = Epilogue((EpilogueOp("requantize", value=1 / 512, zero_point=3, dtype="uint8"),))
DEQUANT_REQUANT = Epilogue((EpilogueOp("scale", value=1 / 64), EpilogueOp("bias"),
                            EpilogueOp("requantize", value=0.5, zero_point=100,
                                       dtype="uint8")))


def _target(isa_name: str) -> tvm.target.Target:
    return tpp_target(f"tpp -isa={isa_name}")


def _machine(isa_name: str) -> Machine:
    return Machine(isa.from_name(isa_name), isa.DEFAULT_CACHES, 2)


def _operands(problem: BatchGemmProblem, seed: int = 0):
    rng = np.random.default_rng(seed)
    if problem.dtype == "uint8":
        x, b = (rng.integers(0, 255, s, endpoint=True).astype("uint8")
                for s in (problem.x_shape, problem.b_shape))
    else:
        stored = ml_dtypes.bfloat16 if problem.bf16_inputs else np.float32
        x, b = (rng.standard_normal(s).astype(stored)
                for s in (problem.x_shape, problem.b_shape))
    extra = {op.name: rng.standard_normal(op.shape(*problem.y_shape)).astype(op.dtype)
             for op in problem.epilogue.inputs(problem.epilogue_dtype)}
    return x, b, extra


def _run(problem: BatchGemmProblem, isa_name: str, config: BatchGemmConfig | None = None,
         func=None):
    """Build (unless ``func``) and run ``problem`` and compare with :func:`reference`: integer
    results exactly (a requantized one after a float epilogue within one unit), float32 ones
    within float32 accumulation of the bf16-rounded operands."""
    config = config or default_config(problem, _machine(isa_name))
    x, b, extra = _operands(problem)
    func = func or tvm.compile(schedule(problem, config, isa_name).mod,
                               target=_target(isa_name))
    y = tvm.runtime.empty(problem.y_shape, problem.out_dtype)
    func(tvm.runtime.tensor(x), tvm.runtime.tensor(b),
         *[tvm.runtime.tensor(v) for v in extra.values()], y)
    got, want = y.numpy(), reference(problem, x, b, extra)
    assert got.dtype == want.dtype
    if problem.out_dtype == "int32" or problem.epilogue_dtype == "int32":
        np.testing.assert_array_equal(got, want)
    elif problem.out_dtype != "float32":
        assert np.abs(got.astype(np.int32) - want).max() <= 1
        assert len(np.unique(got)) > 2  # not saturated
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.abs(got.astype(np.float64)).max() > 0
    return got


#: The richest ISA of each family this host may run, and the emulations that run anywhere.
BF16_ISAS = [pytest.param("amx", marks=needs_isa("amx")),                  # tdpbf16ps
             pytest.param("avx512_bf16", marks=needs_isa("avx512_bf16")),  # vdpbf16ps
             pytest.param("avx512", marks=needs_isa("avx512")), "avx2"]      # shifts + FMA
U8_ISAS = [pytest.param("avx512_vnni", marks=needs_isa("avx512_vnni")),     # vpdpbusd
           pytest.param("avx512", marks=needs_isa("avx512")), "avx2"]       # exact vpmaddwd

#: (batch, m, n, k, transposed, heads, x, b, y interleaved): odd sizes, K not a multiple of
#: the VNNI groups (padded), and BERT's two interleaved forms.
LAYOUTS = [
    (3, 5, 7, 9, True, 1, False, False, False),
    (3, 5, 7, 9, False, 1, False, False, False),
    (6, 7, 24, 12, True, 3, True, True, False),   # Q @ K^T straight from the projections
    (6, 7, 12, 10, False, 3, False, True, True),  # P @ V, context written interleaved
    (6, 5, 8, 7, False, 3, True, False, True),
    (2, 1, 16, 11, True, 1, False, False, False),  # single-row GEMMs
]


def _layout_id(layout) -> str:
    """``3x5x7x9t``: sizes and the layout letters (t: B^T; x/b/y: interleaved)."""
    flags = (layout[4], *layout[6:])
    return "x".join(map(str, layout[:4])) + "".join(
        t for t, on in zip("txby", flags, strict=True) if on)


def _problem(layout, **kwargs) -> BatchGemmProblem:
    batch, m, n, k, transposed, heads, x, b, y = layout
    return BatchGemmProblem(batch, m, n, k, transposed, heads=heads, x_interleaved=x,
                            b_interleaved=b, y_interleaved=y, **kwargs)


# ----------------------------------------------------------------------------------- bf16


@pytest.mark.parametrize("isa_name", BF16_ISAS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: _layout_id(lay))
def test_bf16(layout, isa_name):
    problem = _problem(layout, epilogue=SCALE_BIAS, dtype="bfloat16")
    assert (problem.acc_dtype, problem.b_layout, problem.padded_k % 2) == ("float32", "vnni2", 0)
    _run(problem, isa_name)


@pytest.mark.parametrize("isa_name", BF16_ISAS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: _layout_id(lay))
def test_bf16_inputs(layout, isa_name):
    # X and B stored in bf16 (handed over by bf16 producers): packed without rounding, X
    # read in place where K is whole pairs (the 12- and 10-wide layouts), padded elsewhere.
    problem = _problem(layout, epilogue=SCALE_BIAS, dtype="bfloat16", bf16_inputs=True)
    assert problem.io_dtype == problem.x_dtype == "bfloat16" and "i" in problem.layout
    _run(problem, isa_name)


def test_bf16_inputs_need_bf16_problems():
    with pytest.raises(ValueError, match="bfloat16 problems only"):
        BatchGemmProblem(2, 4, 4, 4, bf16_inputs=True)


@pytest.mark.parametrize("isa_name", BF16_ISAS)
@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[3], (2, 8, 64, 16, False, 1, False,
                                                                 False, False)],
                         ids=lambda lay: _layout_id(lay))
def test_bf16_output(layout, isa_name):
    """An epilogue ending in ``convert`` writes bfloat16 (P @ V handing its context to a bf16
    dense layer): bit for bit the float32 output of the same kernel rounded to nearest even,
    also where a tile is wider than the conversion instruction (64 columns: four of it)."""
    wide = _problem(layout, epilogue=SCALE_BIAS, dtype="bfloat16")
    narrow = _problem(layout, epilogue=Epilogue((*SCALE_BIAS.ops, EpilogueOp(
        "convert", dtype="bfloat16"))), dtype="bfloat16")
    assert narrow.out_dtype == "bfloat16"
    config = default_config(wide, _machine(isa_name))
    outputs = []
    for problem in (wide, narrow):
        x, b, extra = _operands(problem)
        func = tvm.compile(schedule(problem, config, isa_name).mod, target=_target(isa_name))
        y = tvm.runtime.empty(problem.y_shape, problem.out_dtype)
        func(tvm.runtime.tensor(x), tvm.runtime.tensor(b),
             *[tvm.runtime.tensor(v) for v in extra.values()], y)
        outputs.append(y.numpy())
    rounded = outputs[0].astype(ml_dtypes.bfloat16)
    assert outputs[1].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(outputs[1].view(np.uint16), rounded.view(np.uint16))
    assert len(np.unique(outputs[1].view(np.uint16))) > outputs[1].size // 2


def test_bf16_rounds_to_nearest_even():
    """X = 1 + 2^-8 (a tie: rounds down to 1) and 1 + 3 * 2^-8 (up to 1 + 2^-6), as
    ``vcvtneps2bf16`` and ml_dtypes round, not truncated."""
    problem = BatchGemmProblem(1, 2, 16, 2, dtype="bfloat16")
    x = np.array([[1 + 2**-8, 0], [1 + 3 * 2**-8, 0]], np.float32)
    b = np.zeros(problem.b_shape, np.float32)
    b[0, 0, :] = 1
    func = tvm.compile(schedule(problem, default_config(problem, _machine("avx2")), "avx2").mod,
                       target=_target("avx2"))
    y = tvm.runtime.empty(problem.y_shape, "float32")
    func(tvm.runtime.tensor(x), tvm.runtime.tensor(b), y)
    np.testing.assert_array_equal(y.numpy()[:, 0], [1.0, 1 + 2**-6])
    np.testing.assert_array_equal(y.numpy()[:, 0],
                                  x[:, 0].astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("dtype", ["bfloat16", "uint8"])
def test_candidates_are_correct(dtype):
    """Every configuration the tuner may try tiles K in whole VNNI groups and computes the
    batch GEMM; parallel M blocks included."""
    problem = BatchGemmProblem(1, 24, 16, 10, True, SCALE if dtype == "bfloat16" else REQUANT,
                               dtype=dtype, zero_points=(0, 0) if dtype == "bfloat16"
                               else (5, 130))
    found = candidates(problem, _machine("avx2"))
    assert any(c.parallel_rows for c in found)
    for config in found:
        assert config.bk % problem.alpha == 0
        _run(problem, "avx2", config)


# ---------------------------------------------------------------------------------- uint8


@pytest.mark.parametrize("isa_name", U8_ISAS)
@pytest.mark.parametrize("zero_points", [(0, 128), (3, 200), (0, 7), (250, 128)],
                         ids=lambda z: f"z{z[0]}.{z[1]}")
@pytest.mark.parametrize("layout", LAYOUTS[:4], ids=lambda lay: _layout_id(lay))
def test_uint8_zero_points(layout, zero_points, isa_name):
    """``sum_k (x - za)(b - zb)`` exactly in int32: no fold ((0, 128): B's shift is its zero
    point), both sums, the rows' sum only, the columns' only."""
    _run(_problem(layout, dtype="uint8", zero_points=zero_points), isa_name)


@pytest.mark.parametrize("epilogue", [REQUANT, SCALE_BIAS, DEQUANT_REQUANT],
                         ids=lambda e: e.name)
def test_uint8_epilogues(epilogue):
    """A requantize of the exact int32 (the QDQ scores), a float scale and bias (dequantized
    output), and dequantize + bias + requantize."""
    problem = _problem(LAYOUTS[2], dtype="uint8", zero_points=(125, 124), epilogue=epilogue)
    _run(problem, "avx512_vnni" if isa.from_name("avx512_vnni").requires <= HOST else "avx2")


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": "int8"}, "handles float32, bfloat16, uint8"),
    ({"dtype": "uint8", "zero_points": (0, 256)}, "two ints in"),
    ({"zero_points": (1, 0)}, "uint8 operands only"),
    ({"dtype": "bfloat16", "epilogue": REQUANT}, "writes float32, or bfloat16"),
])
def test_problem_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BatchGemmProblem(4, 8, 8, 8, **kwargs)


def test_config_needs_whole_vnni_groups():
    problem = BatchGemmProblem(2, 4, 8, 9, dtype="uint8")
    assert problem.padded_k == 12 and default_config(problem, _machine("avx2")).bk == 12
    with pytest.raises(ValueError, match="bk=6 is not a multiple of 4"):
        schedule(problem, BatchGemmConfig(4, 8, 6))


# ------------------------------------------------------------ instructions (cross-compiled)


def _ops(problem: BatchGemmProblem, config: BatchGemmConfig, isa_name: str) -> list[str]:
    asm = tvm.compile(schedule(problem, config, isa_name).mod,
                      target=_target(isa_name)).mod.inspect_source("asm")
    return [line.split()[0] for line in asm.splitlines() if line.startswith("\t") and line.split()]


@pytest.mark.parametrize("dtype, tile_op, vector_op", [("uint8", "tdpbusd", "vpdpbusd"),
                                                      ("bfloat16", "tdpbf16ps", "vdpbf16ps")])
def test_sapphirerapids_asm(dtype, tile_op, vector_op):
    """On ``amx`` the default (tile-shaped) blocks multiply in AMX tiles, reading the panel
    the kernel packs per task; wider ones with the AVX-512 dot product.  BERT's scores,
    cross-compiled for Sapphire Rapids."""
    quantized = dtype == "uint8"
    problem = BatchGemmProblem(12, 128, 128, 64, True, REQUANT if quantized else SCALE,
                               heads=12, x_interleaved=True, b_interleaved=True, dtype=dtype,
                               zero_points=(125, 124) if quantized else (0, 0))
    config = default_config(problem, _machine("amx"))
    assert (config.bm, config.bn, config.bk) == (32, 32, 64)
    tiles = _ops(problem, config, "amx")
    assert tile_op in tiles and "ldtilecfg" in tiles and "tilerelease" in tiles
    assert ("tilezero" in tiles) is not quantized  # the zero points' fold starts uint8's C
    wide = _ops(problem, BatchGemmConfig(64, 64, 64), "amx")
    assert vector_op in wide and tile_op not in wide and "ldtilecfg" not in wide
    if quantized:
        vnni = _ops(problem, config, "avx512_vnni")
        assert "vpdpbusd" in vnni and "vpmaddwd" not in vnni


@pytest.mark.parametrize("dtype, k, transposed", [
    ("uint8", 64, True), ("uint8", 66, False),
    # The K tails above and the transposed read cover the program; whole K steps once more:
    pytest.param("bfloat16", 64, True, marks=pytest.mark.slow), ("bfloat16", 70, False)])
def test_amx_batch_gemm_emulated(amx_emulator, monkeypatch, dtype, k, transposed):
    """The tile program runs under the AMX emulator on the panel the kernel packs (and X's
    converted or zero-padded copy), uint8 zero points folded, and matches numpy.  One task
    (the emulator's tile state is global: no two threads may run tiles)."""
    from schedules import batch_gemm

    problem = BatchGemmProblem(1, 32, 16, k, transposed, SCALE, dtype=dtype,
                               zero_points=(7, 140) if dtype == "uint8" else (0, 0))
    config = default_config(problem, _machine("amx"))
    assert (config.bm, config.bn, config.parallel_rows) == (32, 16, False)
    monkeypatch.setattr(batch_gemm, "dispatch", emulated_dispatch)
    # The emulated tile program needs no vector ISA; the code around it this host's.
    host = "avx512_bf16" if isa.from_name("avx512_bf16").requires <= HOST else "avx2"
    amx_emulator.tpp_amx_emu_reset()
    func = tvm.compile(schedule(problem, config, "amx").mod, target=_target(host))
    _run(problem, "amx", config, func=func)
    assert amx_emulator.tpp_amx_emu_faults() == 0
    assert amx_emulator.tpp_amx_emu_configs() == 1 == amx_emulator.tpp_amx_emu_releases()


# ------------------------------------------------------------------------- the graph pass


def _attention_module(dtype_in: str) -> tvm.IRModule:
    """``quantize(dequantize(Q) @ dequantize(K)^T / 8)`` on [1, S, H, D] uint8 projections,
    and the context ``quantize(dequantize(P) @ dequantize(V))`` written back as [1, S, H, D]:
    the QDQ attention ONNX Runtime's quantizer writes (the permutes on the integers)."""
    s, h, d = 5, 3, 7
    q, k, v = (relax.Var(n, relax.TensorType((1, s, h, d), dtype_in)) for n in "qkv")
    p = relax.Var("p", relax.TensorType((1, h, s, s), dtype_in))

    def dq(x, scale, zero):
        return relax.op.dequantize(x, relax.const(scale, "float32"), relax.const(zero, "uint8"))

    bb = relax.BlockBuilder()
    with bb.function("main", [q, k, v, p]):
        with bb.dataflow():
            qt = bb.emit(relax.op.permute_dims(q, [0, 2, 1, 3]))
            kt = bb.emit(relax.op.permute_dims(k, [0, 2, 3, 1]))
            vt = bb.emit(relax.op.permute_dims(v, [0, 2, 1, 3]))
            scores = bb.emit(relax.op.matmul(dq(qt, 0.02, 120), dq(kt, 0.03, 131)))
            scores = bb.emit(relax.op.divide(scores, relax.const(np.float32(8.0))))
            sq = bb.emit(relax.op.quantize(scores, relax.const(0.004, "float32"),
                                           relax.const(128, "uint8"), out_dtype="uint8"))
            ctx = bb.emit(relax.op.matmul(dq(p, 1 / 255, 0), dq(vt, 0.05, 110)))
            cq = bb.emit(relax.op.quantize(ctx, relax.const(0.1, "float32"),
                                           relax.const(7, "uint8"), out_dtype="uint8"))
            out = bb.emit_output(relax.Tuple([sq, bb.emit(relax.op.permute_dims(
                cq, [0, 2, 1, 3]))]))
        bb.emit_func_output(out)
    return bb.get()


def _numpy_attention(q, k, v, p):
    def dq(x, scale, zero):
        return (x.astype(np.float64) - zero) * scale

    def quantize(x, scale, zero):
        return np.clip(np.rint(x / scale) + zero, 0, 255)

    qt, kt, vt = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)
    scores = quantize(dq(qt, 0.02, 120) @ dq(kt, 0.03, 131) / 8, 0.004, 128)
    ctx = quantize(dq(p, 1 / 255, 0) @ dq(vt, 0.05, 110), 0.1, 7)
    return scores, ctx.transpose(0, 2, 1, 3)


def test_qdq_attention_runs_on_the_int8_kernel():
    """Both QDQ matmuls become u8 x s8 kernels reading the projections in place (no permute
    left), the zero points folded, the scales and the quantize in the epilogue; the result is
    numpy's on the dequantized values, within one unit of the quantized outputs."""
    target = tpp_target("tpp")
    report = []
    mod = rewrite_batch_matmul(_attention_module("uint8"), target, report)
    assert [(r.op, r.dtypes, r.layout) for r in report] == [
        ("batch_matmul_qdq+requantize_u8", "uint8*int8->int32", "vnni4")] * 2
    assert {r.shape for r in report} == {(3, 5, 5, 7), (3, 5, 7, 5)}
    ops = set()
    relax.analysis.post_order_visit(mod["main"], lambda e: ops.add(e.op.name) if isinstance(
        e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    assert not ops & {"relax.matmul", "relax.permute_dims", "relax.dequantize",
                      "relax.quantize"}
    rng = np.random.default_rng(0)
    inputs = [rng.integers(0, 255, (1, 5, 3, 7), endpoint=True).astype("uint8")
              for _ in range(3)] + [rng.integers(0, 60, (1, 3, 5, 5)).astype("uint8")]
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(a) for a in inputs])
    for out, want in zip(got, _numpy_attention(*inputs), strict=True):
        assert out.numpy().dtype == np.uint8
        assert np.abs(out.numpy().astype(np.int32) - want).max() <= 1
        assert len(np.unique(out.numpy())) > 10


def test_qdq_matmul_with_float_output():
    """``dequantize(A) @ dequantize(B) * c + bias`` without a quantize: the epilogue scales by
    ``sa sb c`` and adds the bias in float32 (float32 output)."""
    a = relax.Var("a", relax.TensorType((3, 5, 9), "uint8"))
    b = relax.Var("b", relax.TensorType((3, 9, 7), "uint8"))
    bias = np.random.default_rng(1).standard_normal(7).astype("float32")
    bb = relax.BlockBuilder()
    with bb.function("main", [a, b]):
        with bb.dataflow():
            da = relax.op.dequantize(a, relax.const(0.5, "float32"), relax.const(9, "uint8"))
            db = relax.op.dequantize(b, relax.const(0.25, "float32"), relax.const(200, "uint8"))
            y = bb.emit(relax.op.multiply(bb.emit(relax.op.matmul(da, db)),
                                          relax.const(np.float32(0.1))))
            out = bb.emit_output(relax.op.add(y, relax.const(bias)))
        bb.emit_func_output(out)
    report = []
    target = tpp_target("tpp")
    mod = rewrite_batch_matmul(bb.get(), target, report)
    assert [(r.op, r.shape, r.dtypes) for r in report] == [
        ("batch_matmul_qdq+scale+bias", (3, 5, 7, 9), "uint8*int8->int32")]
    rng = np.random.default_rng(0)
    xa = rng.integers(0, 255, (3, 5, 9), endpoint=True).astype("uint8")
    xb = rng.integers(0, 255, (3, 9, 7), endpoint=True).astype("uint8")
    got = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())["main"](
        tvm.runtime.tensor(xa), tvm.runtime.tensor(xb)).numpy()
    want = ((xa - 9.0) * 0.5) @ ((xb - 200.0) * 0.25) * 0.1 + bias
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_qdq_int8_operands_stay_float():
    """int8 (not uint8) operands are left to the float32 kernel, which reads them dequantized."""
    report = []
    rewrite_batch_matmul(_attention_module("int8"), tpp_target("tpp"), report)
    assert [r.dtypes for r in report] == ["float32*float32->float32"] * 2


def test_bf16_precision_of_the_pass():
    report = []
    mod = rewrite_batch_matmul(_attention_module("uint8"), tpp_target("tpp"), report,
                               precision="bf16")
    assert mod is not None and all(r.dtypes == "uint8*int8->int32" for r in report)
    with pytest.raises(ValueError, match="precision must be one of"):
        rewrite_batch_matmul(_attention_module("uint8"), tpp_target("tpp"), [],
                             precision="fp16")


# --------------------------------------------------------------------------------- BERT


@pytest.mark.slow  # a network end to end; smaller tests cover its kernels
def test_bert_in_bf16_vs_onnxruntime():
    """BERT compiled with ``precision="bf16-strict"``: its fused attention multiplies in bf16
    too (in AMX tiles on AMX hosts), within 1e-2 normwise of ONNX Runtime in float32."""
    model = models.load("bert")
    compiled = tvm_tpp.compile(model, target="tpp", precision="bf16-strict", untuned=True)
    inputs = random_inputs(compiled.inputs, seed=1)
    got = compiled.run(**inputs)[0]
    want = run_onnxruntime(model, inputs)[0]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-2
    attention = [(r.op, r.dtypes, r.layout) for r in compiled.report
                 if "attention" in r.op or "batch_matmul" in r.op]
    assert attention == [("attention+scale", "bfloat16*bfloat16->float32", "vnni2")]


@pytest.mark.slow  # 5 s: a whole int8 BERT layer; the batch GEMMs are checked above
def test_bert_int8_vs_onnxruntime(tmp_path):
    """ONNX Runtime's QDQ BERT layer (a small one: 4 heads of 32): the attention matmuls run
    on int8 kernels, and the result is the QDQ graph's as ONNX defines it (ONNX Runtime
    unfused; measured equal on a Zen 1, 2026-11-27; its fused run is 1e-2 from it)."""
    bert = models.load("bert", seq=32, hidden=128, heads=4, ffn=256)
    path = quantize_static_qdq(bert, tmp_path / "bert_int8.onnx")
    compiled = tvm_tpp.compile(str(path), target="tpp", untuned=True)
    inputs = random_inputs(compiled.inputs, seed=1)
    got = compiled.run(**inputs)
    want = run_onnxruntime(onnx.load(path), inputs, optimize=False)
    assert np.linalg.norm(got[0] - want[0]) / np.linalg.norm(want[0]) <= 1e-3
    _, rel = max_errors(got, want)
    assert np.isfinite(rel)
    batch = [(r.op, r.dtypes) for r in compiled.report if r.op.startswith("batch_matmul")]
    assert sorted(batch) == [("batch_matmul_qdq+requantize_u8", "uint8*int8->int32")] * 2
    assert all(re.search(r"u8z\d+\.\d+", r.kernel) for r in compiled.report
               if r.op.startswith("batch_matmul"))
