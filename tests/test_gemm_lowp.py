"""Low-precision GEMMs of the GEMM template: bfloat16 (VNNI-2) and uint8 x int8 (VNNI-4).

Each GEMM is scheduled, built and run on this host against numpy on random data with odd
sizes (37 x 48 x 68, a GEMV, N not a multiple of a vector, K not a multiple of the VNNI
group): uint8 exactly, in int32 and through dequantizing and requantizing epilogues; bfloat16
within the accuracy of its inputs.
ISAs this host cannot run are checked by the instructions in their assembly: AMX tiles for
tile-shaped blocks (and the AVX-512 fallback for others), ``vpdpbusd`` for AVX512-VNNI; AVX2's
exact emulation of u8 x s8 runs here.  The AMX GEMMs also run here, their tile program calling
the C emulator of tests/amx (as in test_brgemm_amx.py) instead of the tile instructions.
"""

import re
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
import tvm
from conftest import emulated_dispatch, isa_target, needs_isa, runs_here

import tvm_tpp
from microkernels import amx, isa
from microkernels.brgemm import BrgemmShape, find_impl
from microkernels.epilogue import Epilogue, EpilogueOp, reference
from microkernels.machine import Machine
from microkernels.pack import Packing
from schedules import gemm, search
from schedules.database import Database, TuningKey
from schedules.gemm import (
    GemmConfig,
    GemmProblem,
    candidates,
    default_config,
    pack_weight,
    schedule,
)
from schedules.ops import OPS
from schedules.space import Candidate

#: Each ISA's CPU to build for; the AMX emulator tests swap in this host's.
MCPU = {name: chosen.mcpu for name, chosen in isa.KNOWN.items()}
DEQUANT = Epilogue((EpilogueOp("scale", broadcast="row"), EpilogueOp("bias")))
REQUANT = Epilogue((EpilogueOp("bias"), EpilogueOp("relu"),
                    EpilogueOp("requantize", value=1 / 4096, zero_point=3, dtype="uint8")))


def _machine(isa_name: str) -> Machine:
    return Machine(isa.from_name(isa_name), isa.DEFAULT_CACHES, 2, fp32_flops_per_cycle=32.0)


def _build(problem: GemmProblem, config: GemmConfig, isa_name: str):
    return tvm.compile(schedule(problem, config, isa_name).mod,
                       target=isa_target(isa_name, MCPU[isa_name]))


def _operands(problem: GemmProblem, rng: np.random.Generator):
    """X, W (float32 for bfloat16: rounded to bf16 for the kernel) and the epilogue's
    operands."""
    m, n, k = problem.m, problem.n, problem.k
    if problem.dtype == "uint8":
        x = rng.integers(0, 255, (m, k), endpoint=True).astype("uint8")
        w = rng.integers(-128, 127, (k, n), endpoint=True).astype("int8")
    else:
        x = rng.standard_normal((m, k)).astype("float32")
        w = rng.standard_normal((k, n)).astype("float32")
    extra = {}
    for op in problem.epilogue.inputs(problem.epilogue_dtype):
        shape = op.shape(m, n)
        if op.dtype == "int32":  # an integer bias, of the accumulator's magnitude
            extra[op.name] = rng.integers(-50000, 50000, shape).astype("int32")
        elif op.name == "scale":  # per-channel dequantization factors
            extra[op.name] = rng.uniform(0.5e-4, 2e-4, shape).astype("float32")
        else:
            extra[op.name] = rng.standard_normal(shape).astype("float32")
    return x, w, extra


def _accumulator(problem: GemmProblem, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The exact ``X @ W`` of the kernel's operands, as the accumulator's dtype."""
    if problem.dtype == "uint8":
        return (x.astype(np.int64) @ w.astype(np.int64)).astype(np.int32)
    x16, w16 = (v.astype(ml_dtypes.bfloat16).astype(np.float64) for v in (x, w))
    return (x16 @ w16).astype(np.float32)


def _run(problem: GemmProblem, config: GemmConfig, isa_name: str, seed: int = 0):
    """(Y, X, W, extra) of one run of the built GEMM on random operands."""
    x, w, extra = _operands(problem, np.random.default_rng(seed))
    func = _build(problem, config, isa_name)
    y = tvm.runtime.empty((problem.m, problem.n), problem.out_dtype)
    x_in = x.astype(ml_dtypes.bfloat16) if problem.dtype == "bfloat16" else x
    func(tvm.runtime.tensor(x_in), tvm.runtime.tensor(pack_weight(w, config.bn, problem)),
         *[tvm.runtime.tensor(v) for v in extra.values()], y)
    return y.numpy(), x, w, extra


def _check(problem: GemmProblem, config: GemmConfig, isa_name: str):
    """The GEMM against numpy: exact for integer results, bf16 results within one ulp,
    float32 results within float32 accumulation's rounding.  Returns (Y, X, W)."""
    y, x, w, extra = _run(problem, config, isa_name)
    acc = _accumulator(problem, x, w)
    if problem.epilogue_dtype != problem.acc_dtype:
        acc = acc.astype(problem.epilogue_dtype)
    want = reference(problem.epilogue, acc, extra) if problem.epilogue.ops else acc
    if problem.out_dtype == "bfloat16":
        y = y.view(np.uint16)
        assert np.abs(y.astype(np.int32) - want).max() <= 1  # one ulp of accumulation
    elif problem.dtype == "uint8" and problem.epilogue_dtype == "int32":
        np.testing.assert_array_equal(y, want)
    else:
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.abs(y.astype(np.float64)).max() > 0
    return y, x, w


# ----------------------------------------------------------------------- u8 x s8 -> int32


#: The richest ISA with vpdpbusd this host runs (avx512_bf16 runs the avx512_vnni kernel).
VNNI = "avx512_bf16" if runs_here("avx512_bf16") else "avx512_vnni"
U8_SHAPES = [(37, 48, 68), (1, 48, 68), (13, 40, 36), (6, 20, 8), (37, 48, 66), (1, 24, 5)]


@pytest.mark.parametrize("isa_name", [
    pytest.param(VNNI, marks=needs_isa(VNNI)),                   # vpdpbusd
    pytest.param("avx512", marks=needs_isa("avx512")),            # exact vpmaddwd emulation
    "avx2",
])
@pytest.mark.parametrize("m, n, k", U8_SHAPES)
def test_u8_exact(isa_name, m, n, k):
    problem = GemmProblem(m, n, k, "uint8")
    _check(problem, default_config(problem, _machine(isa_name)), isa_name)


@pytest.mark.parametrize("epilogue", [DEQUANT, REQUANT], ids=["dequantize", "requantize"])
@pytest.mark.parametrize("m", [37, 1])
def test_u8_epilogues(epilogue, m):
    problem = GemmProblem(m, 48, 68, "uint8", epilogue)
    host = "avx512_bf16" if runs_here("avx512_bf16") else "avx2"
    _check(problem, default_config(problem, _machine(host)), host)


@pytest.mark.parametrize("spec, block_steps, k_step, pack_a", [
    ("aBC", {}, 2, None),
    ("bcaBCb", {"b": (4, 2), "c": (2,)}, 1, None),
    ("BCa", {}, 4, None),
    ("acb", {}, 1, 1),             # A packed under the K loop
    ("bC{R:2}aB{C:1}cb", {"b": (4, 2), "c": (2,)}, 1, None),
])
@pytest.mark.parametrize("k", [96, 94])  # 94: K padded to 96, X's copy made where A is packed
def test_u8_loop_specs(spec, block_steps, k_step, pack_a, k):
    problem = GemmProblem(48, 64, k, "uint8", DEQUANT)
    config = GemmConfig.of(spec, 6, 16, 24, k_step=k_step, block_steps=block_steps,
                           pack_a=pack_a)
    _check(problem, config, "avx512_bf16" if runs_here("avx512_bf16") else "avx2")


# -------------------------------------------------------------------- bf16 -> float32


@pytest.mark.parametrize("isa_name", [
    pytest.param("avx512_bf16", marks=needs_isa("avx512_bf16")),  # vdpbf16ps
    "avx2",                                                    # exact emulation
])
@pytest.mark.parametrize("m, n, k", [(37, 48, 68), (1, 48, 68), (13, 40, 36), (37, 48, 67)])
def test_bf16(isa_name, m, n, k):
    problem = GemmProblem(m, n, k, "bfloat16")
    y, x, w = _check(problem, default_config(problem, _machine(isa_name)), isa_name)
    exact = x.astype(np.float64) @ w  # the float32 GEMM that bf16 approximates
    assert np.linalg.norm(y - exact) <= 1e-2 * np.linalg.norm(exact)


@pytest.mark.parametrize("epilogue", [
    Epilogue((EpilogueOp("bias"), EpilogueOp("gelu", variant="tanh"))),
    Epilogue((EpilogueOp("bias"), EpilogueOp("convert", dtype="bfloat16"))),
], ids=["bias_gelu", "bias_to_bf16"])
def test_bf16_epilogues(epilogue):
    problem = GemmProblem(37, 48, 68, "bfloat16", epilogue)
    host = "avx512_bf16" if runs_here("avx512_bf16") else "avx2"
    _check(problem, GemmConfig.of("BCa", 37, 16, 34, k_step=2), host)


# ------------------------------------------------------------- problems, configs, packing


def test_problem_types():
    assert GemmProblem(8, 16, 12).layout == "flat"
    bf16 = GemmProblem(8, 16, 12, "bfloat16")
    assert (bf16.acc_dtype, bf16.weight_dtype, bf16.layout, bf16.alpha) == (
        "float32", "bfloat16", "vnni2", 2)
    assert GemmProblem(8, 16, 12, "uint8", REQUANT).epilogue_dtype == "int32"
    assert GemmProblem(8, 16, 12, "uint8", REQUANT).out_dtype == "uint8"
    gelu = Epilogue((EpilogueOp("gelu", variant="erf"),))
    assert GemmProblem(8, 16, 12, "uint8", gelu).epilogue_dtype == "float32"
    assert GemmProblem(8, 16, 12, "uint8").out_dtype == "int32"


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": "int8"}, "handles float32, bfloat16, uint8"),
    ({"dtype": "bfloat16", "epilogue": Epilogue((EpilogueOp("dequantize", value=0.5),))},
     "takes int8 or uint8"),
    ({"dtype": "uint8", "epilogue": Epilogue((EpilogueOp("dequantize", value=0.5),))},
     "takes neither the int32 accumulator nor its float32 value"),
])
def test_problem_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GemmProblem(**{"m": 4, "n": 16, "k": 8, **kwargs})


def test_padded_k():
    """K is padded to whole VNNI groups in the packed weight and in a copy of X the GEMM
    reads; X itself keeps its K (test_u8_exact and test_bf16 run such GEMMs)."""
    problem = GemmProblem(8, 16, 6, "uint8")
    assert problem.padded_k == 8 and GemmProblem(8, 16, 7, "bfloat16").padded_k == 8
    assert GemmProblem(8, 16, 7).padded_k == 7
    func = schedule(problem, default_config(problem, _machine("avx2")), "avx2").mod["main"]
    shapes = [tuple(int(d) for d in p.ty.shape) for p in func.params[:2]]
    assert shapes == [(8, 6), (1, 2, 16, 4)]
    w = np.ones((6, 16), "int8")
    assert pack_weight(w, 16, problem)[0, 1, 0].tolist() == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="bk=6 does not divide 8"):
        GemmConfig.of("BCa", 8, 16, 6).check(problem)


def test_config_needs_whole_vnni_groups():
    problem = GemmProblem(8, 16, 12, "uint8")
    with pytest.raises(ValueError, match="bk=6 is not a multiple of 4"):
        schedule(problem, GemmConfig.of("BCa", 8, 16, 6, k_step=2), "avx2")


@pytest.mark.parametrize("dtype", ["uint8", "bfloat16"])
@pytest.mark.parametrize("isa_name", ["avx2", "avx512_bf16", "amx"])
@pytest.mark.parametrize("shape", [(37, 48, 68), (128, 768, 3072), (2048, 1024, 4096),
                                   (1, 4096, 1024)])
def test_candidates_fit_the_kernels(dtype, isa_name, shape):
    """Every candidate's blocks take whole VNNI groups; on amx they are tile-shaped, so the
    tile kernel runs."""
    problem = GemmProblem(*shape, dtype)
    configs = candidates(problem, _machine(isa_name), max_candidates=20)
    assert configs[0] == default_config(problem, _machine(isa_name))
    for config in configs:
        config.check(problem)
        if isa_name == "amx":
            shape = BrgemmShape(config.bm, config.bn, config.bk, config.k_step, dtype,
                                problem.acc_dtype, problem.layout, "amx")
            amx.plan(shape)  # raises unless tile-shaped


def test_amx_default_uses_whole_tile_rows():
    cfg = default_config(GemmProblem(128, 768, 768, "uint8"), _machine("amx"))
    assert (cfg.bm, cfg.bn, cfg.bk % 64) == (32, 32, 0)
    cfg = default_config(GemmProblem(128, 768, 768, "bfloat16"), _machine("amx"))
    assert (cfg.bm, cfg.bn, cfg.bk % 32) == (32, 32, 0)
    cfg = default_config(GemmProblem(37, 48, 68, "uint8"), _machine("amx"))
    assert (cfg.bm, cfg.bn) == (37, 16)  # 16 + 16 + 5 rows by one column tile
    # A K too long for L2 packs A, in int8 and in bf16 (the tiles read the copy too).
    long_k = (256, 1024, 32768)
    assert default_config(GemmProblem(*long_k, "uint8"), _machine("amx")).pack_a == 1
    assert default_config(GemmProblem(*long_k, "bfloat16"), _machine("amx")).pack_a == 1


def test_pack_weight_layouts():
    rng = np.random.default_rng(3)
    w8 = rng.integers(-128, 127, (68, 48), endpoint=True).astype("int8")
    problem = GemmProblem(5, 48, 68, "uint8")
    packed = pack_weight(w8, 16, problem)
    assert packed.shape == (3, 17, 16, 4) and packed.dtype == np.int8
    unpacked = Packing.vnni_blocked_b(4, 16).unpack(packed.reshape(3, 17, 16, 4), 68, 48)
    np.testing.assert_array_equal(unpacked, w8)
    np.testing.assert_array_equal(pack_weight(w8.astype("int32"), 16, problem), packed)
    w = rng.standard_normal((68, 48)).astype("float32")
    bf16 = pack_weight(w, 48, GemmProblem(5, 48, 68, "bfloat16"))
    assert bf16.shape == (1, 34, 48, 2) and bf16.dtype == ml_dtypes.bfloat16
    assert bf16[0, 3, 7, 1] == w[7, 7].astype(ml_dtypes.bfloat16)  # W[2*3 + 1, 7]
    np.testing.assert_array_equal(pack_weight(w, 16), pack_weight(w, 16, GemmProblem(5, 48, 68)))


@pytest.mark.parametrize("dtype, w, message", [
    ("uint8", np.zeros((8, 16), "float32"), "int8 weights must be integers"),
    ("uint8", np.full((8, 16), 128, "int32"), r"in \[128, 128\]"),
    ("bfloat16", np.zeros((8, 16), "float64"), "float32 or ml_dtypes.bfloat16"),
    ("bfloat16", np.zeros((8, 8), "float32"), r"W must be \[K, N\] = \[8, 16\]"),
])
def test_pack_weight_errors(dtype, w, message):
    with pytest.raises(ValueError, match=message):
        pack_weight(w, 8, GemmProblem(4, 16, 8, dtype))


def test_tune(tmp_path):
    """The tuner times low-precision candidates (arguments in the problem's dtypes) and keys
    their winner by the dtype; the float32 GEMM of the same shape is another key."""
    host = "avx512_bf16" if runs_here("avx512_bf16") else "avx2"
    target = tvm_tpp.target(f"tpp -isa={host} -num-cores=1")
    database = Database(tmp_path / "tuning.db")
    for dtype in ("uint8", "bfloat16"):
        problem = GemmProblem(37, 48, 66, dtype, DEQUANT if dtype == "uint8" else Epilogue())
        result = search.tune(problem, target, database=database, top_k=2)
        assert all(m.seconds is not None for m in result.measurements)
        assert Database(tmp_path / "tuning.db").get(TuningKey.of(problem, target)) == \
            result.best
        _check(problem, result.best, host)
    assert Database(tmp_path / "tuning.db").get(
        TuningKey.of(GemmProblem(37, 48, 66), target)) is None


def test_dense_key_and_default_carry_the_dtype():
    op = OPS["dense"]
    machine = _machine("avx512_bf16")
    assert op.key(GemmProblem(37, 48, 68, "uint8"))[2] == "uint8"
    assert op.default(GemmProblem(37, 48, 68, "uint8"), machine).bk % 4 == 0


# ------------------------------------------------------------ instructions, for every ISA


def _asm(problem: GemmProblem, config: GemmConfig, isa_name: str) -> str:
    return _build(problem, config, isa_name).mod.inspect_source("asm")


def _ops(asm: str) -> list[str]:
    return [line.split()[0] for line in asm.splitlines()
            if line.startswith("\t") and line.split()]


@pytest.mark.parametrize("dtype, multiply", [("uint8", "tdpbusd"), ("bfloat16", "tdpbf16ps")])
def test_amx_asm(dtype, multiply):
    """Tile-shaped blocks run AMX tiles; larger ones the AVX-512 dot products."""
    problem = GemmProblem(128, 96, 256, dtype, DEQUANT if dtype == "uint8" else Epilogue())
    config = default_config(problem, _machine("amx"))
    shape = BrgemmShape(config.bm, config.bn, config.bk, config.k_step, dtype,
                        problem.acc_dtype, problem.layout, "amx")
    assert find_impl(shape)[0] == "amx"
    ops = _ops(_asm(problem, config, "amx"))
    for op in ("ldtilecfg", "tileloadd", multiply, "tilestored", "tilerelease"):
        assert op in ops, op
    wide = GemmConfig.of("BCa", 64, 96, config.bk, k_step=config.k_step)
    ops = _ops(_asm(problem, wide, "amx"))
    assert multiply not in ops and "ldtilecfg" not in ops
    assert ("vpdpbusd" if dtype == "uint8" else "vdpbf16ps") in ops
    packed = _ops(_asm(problem, replace(config, pack_a=0), "amx"))
    assert multiply in packed  # the tiles read a packed copy of A too (bf16: uint16 views)


def test_avx512_vnni_asm():
    problem = GemmProblem(37, 48, 68, "uint8", DEQUANT)
    ops = _ops(_asm(problem, default_config(problem, _machine("avx512_vnni")), "avx512_vnni"))
    assert ops.count("vpdpbusd") >= 6 and "vpmaddwd" not in ops


def test_avx2_asm_is_exact_emulation():
    """Without VNNI u8 x s8 runs the exact vpmaddwd sequence (test_u8_exact runs it)."""
    problem = GemmProblem(37, 48, 68, "uint8")
    asm = _asm(problem, default_config(problem, _machine("avx2")), "avx2")
    assert "vpmaddwd" in _ops(asm) and not re.search(r"vpdpbusd|vpmaddubsw|zmm", asm)


# --------------------------------------------------------------- AMX tile program, emulated


@pytest.mark.parametrize("dtype, m, n, k, epilogue, pack_a", [
    ("uint8", 37, 48, 66, DEQUANT, None),     # row tails, K padded to 68
    ("uint8", 64, 64, 256, REQUANT, 1),       # whole tiles, 4 K steps per call, A packed
    ("bfloat16", 1, 48, 68, Epilogue(), None),
    # the same blocks with A packed (below) run the same tile program
    pytest.param("bfloat16", 40, 32, 96, Epilogue(), None, marks=pytest.mark.slow),
    # A is a copy the function allocates (odd K padded; packed; both): TVM stores it as fp32,
    # the tiles read its bf16 bits through uint16 views
    ("bfloat16", 1, 48, 67, Epilogue(), None),
    ("bfloat16", 40, 32, 96, Epilogue(), 1),
    ("bfloat16", 40, 32, 95, Epilogue(), 0),
])
def test_amx_gemm_emulated(amx_emulator, monkeypatch, dtype, m, n, k, epilogue, pack_a):
    """The template's AMX GEMM (default blocks) runs its tile program under the emulator with
    the operands, strides and C blocks the schedule gives it, and matches numpy.  The
    emulator's tile registers are one global state, not one per thread: the loops run serial.
    """
    problem = GemmProblem(m, n, k, dtype, epilogue)
    default = default_config(problem, _machine("amx"))
    c = default.candidate
    serial = Candidate(c.spec.lower(), c.block_steps, c.steps)
    config = replace(default.with_candidate(serial), pack_a=pack_a)
    monkeypatch.setattr(gemm, "dispatch", emulated_dispatch)
    # The emulated program needs no vector ISA; the AVX-512 fallback needs this host's.
    monkeypatch.setitem(MCPU, "amx", "znver4" if runs_here("avx512_bf16") else "haswell")
    amx_emulator.tpp_amx_emu_reset()
    _check(problem, config, "amx")
    assert amx_emulator.tpp_amx_emu_faults() == 0
    calls = (m // config.bm) * (n // config.bn) * (problem.padded_k // config.bk // config.k_step)
    assert amx_emulator.tpp_amx_emu_configs() == calls
    assert amx_emulator.tpp_amx_emu_releases() == amx_emulator.tpp_amx_emu_configs()
