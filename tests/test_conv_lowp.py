"""Low-precision convolutions of the conv template: uint8 x int8 -> int32 (VNNI-4), bfloat16
(VNNI-2).

Each conv is scheduled, built and run on this host against numpy on random data with odd
channel counts (C = 3, 5, 7, 21: padded to whole VNNI groups; K = 24, 40: not a multiple of
a vector), stride 2, padding, 1x1, 3x3 and a 7x7 stem folding its taps: uint8
exactly (an int64 reference of the input padded with its zero point) in int32 and through
requantizing and dequantizing epilogues; bfloat16 against a float64 conv of the
bf16-rounded operands.  Native runs need the host's avx512_vnni / avx512_bf16 (skipped,
naming the missing flags, elsewhere); AVX2's exact emulations run everywhere.  ISAs this host
cannot run are checked by their assembly (AMX tiles, vpdpbusd), and the AMX tile program also
runs here under the C emulator of tests/amx.
"""

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
import tvm
from conftest import emulated_dispatch, isa_target, needs_isa, pixel_rows, runs_here

import tvm_tpp
from microkernels import amx, isa
from microkernels.brgemm import BrgemmShape, find_impl
from microkernels.epilogue import Epilogue, EpilogueOp, reference
from microkernels.machine import Machine
from microkernels.pack import Packing
from relay_passes.scaffold import dispatched_brgemm
from schedules import conv, search
from schedules.conv import (
    ConvConfig,
    ConvProblem,
    candidates,
    default_config,
    pack_input,
    pack_weight,
    schedule,
)
from schedules.database import Database, TuningKey
from schedules.ops import OPS

#: Each ISA's CPU to build for; the AMX emulator tests swap in this host's.
MCPU = {name: chosen.mcpu for name, chosen in isa.KNOWN.items()}
ZX = 7  # the activations' zero point: what padded pixels hold
REQUANT = Epilogue((EpilogueOp("bias"), EpilogueOp("relu"),
                    EpilogueOp("requantize", value=1 / 4096, zero_point=3, dtype="uint8")))
DEQUANT = Epilogue((EpilogueOp("scale", broadcast="row"), EpilogueOp("bias"),
                    EpilogueOp("residual"), EpilogueOp("relu")))
BIAS_RELU = Epilogue((EpilogueOp("bias"), EpilogueOp("relu")))
BIAS_RES_RELU = Epilogue((EpilogueOp("bias"), EpilogueOp("residual"), EpilogueOp("relu")))


#: The richest ISA with vpdpbusd this host runs (avx512_bf16 runs the avx512_vnni kernel).
VNNI = "avx512_bf16" if runs_here("avx512_bf16") else "avx512_vnni"


def _machine(isa_name: str) -> Machine:
    return Machine(isa.from_name(isa_name), isa.DEFAULT_CACHES, 2, fp32_flops_per_cycle=32.0)


def _operands(problem: ConvProblem, rng: np.random.Generator):
    """NCHW X, OIHW W (float32 for bfloat16: rounded to bf16 by the packing) and the
    epilogue's operands."""
    n, c, h, w, k, r, s = (getattr(problem, d) for d in "nchwkrs")
    cg = c // problem.groups  # the filter's input channels
    if problem.dtype == "uint8":
        x = rng.integers(0, 255, (n, c, h, w), endpoint=True).astype("uint8")
        wt = rng.integers(-128, 127, (k, cg, r, s), endpoint=True).astype("int8")
    else:
        x = rng.standard_normal((n, c, h, w)).astype("float32")
        wt = rng.standard_normal((k, cg, r, s)).astype("float32")
    extra = {}
    for op in problem.epilogue.inputs(problem.epilogue_dtype):
        shape = op.shape(problem.rows, k)
        if op.dtype == "int32":  # an integer bias, of the accumulator's magnitude
            extra[op.name] = rng.integers(-50000, 50000, shape).astype("int32")
        elif op.name == "scale":  # per-channel dequantization factors
            extra[op.name] = rng.uniform(0.5e-4, 2e-4, shape).astype("float32")
        else:
            extra[op.name] = rng.standard_normal(shape).astype("float32")
    return x, wt, extra


def _accumulator(problem: ConvProblem, x: np.ndarray, w: np.ndarray, pad_value) -> np.ndarray:
    """The exact conv of the kernel's operands as the ``[N*P*Q, K]`` accumulator."""
    if problem.dtype == "bfloat16":
        x, w = (v.astype(ml_dtypes.bfloat16).astype(np.float64) for v in (x, w))
    acc = conv.reference(problem, x, w, pad_value)
    if problem.dtype == "uint8":
        assert acc.dtype == np.int64
    return pixel_rows(acc).astype(problem.acc_dtype)


def _run(problem: ConvProblem, config: ConvConfig, isa_name: str, pad_value=0, seed: int = 0):
    """(Y, X, W, extra) of one run of the built conv on random operands; a border of
    non-zero ``pad_value`` is not skipped."""
    problem = replace(problem, zero_border=pad_value == 0)
    x, w, extra = _operands(problem, np.random.default_rng(seed))
    packed_x = pack_input(x, problem, pad_value)
    assert packed_x.shape == problem.input_shape
    assert packed_x.dtype == {"uint8": np.uint8, "bfloat16": ml_dtypes.bfloat16}[problem.dtype]
    packed_w = pack_weight(w, config.bk, problem)
    func = tvm.compile(schedule(problem, config, isa_name).mod,
                       target=isa_target(isa_name, MCPU[isa_name]))
    y = tvm.runtime.empty((problem.rows, problem.k), problem.out_dtype)
    func(tvm.runtime.tensor(packed_x), tvm.runtime.tensor(packed_w),
         *[tvm.runtime.tensor(v) for v in extra.values()], y)
    return y.numpy(), x, w, extra


def _check(problem: ConvProblem, config: ConvConfig, isa_name: str, pad_value=0):
    """The conv against numpy: exact for integer results, float32 results within float32
    accumulation's rounding.  Returns (Y, X, W)."""
    y, x, w, extra = _run(problem, config, isa_name, pad_value)
    acc = _accumulator(problem, x, w, pad_value)
    if problem.epilogue_dtype != problem.acc_dtype:
        acc = acc.astype(problem.epilogue_dtype)
    want = reference(problem.epilogue, acc, extra) if problem.epilogue.ops else acc
    assert y.dtype == np.dtype(problem.out_dtype)
    if problem.out_dtype != "float32":
        np.testing.assert_array_equal(y, want)
    else:
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.abs(y.astype(np.float64)).max() > 0 and len(np.unique(y)) > 2
    return y, x, w


# ----------------------------------------------------------------------- u8 x s8 -> int32


U8_PROBLEMS = {
    "3x3-c5-requant": ConvProblem(1, 5, 9, 9, 24, 3, 3, padding=1, dtype="uint8",
                                  epilogue=REQUANT),
    "3x3-s2-c21-dequant": ConvProblem(2, 21, 9, 11, 40, 3, 3, stride=2, padding=(1, 2, 0, 1),
                                      dtype="uint8", epilogue=DEQUANT),
    "1x1-c7-int32": ConvProblem(1, 7, 7, 7, 24, 1, 1, dtype="uint8"),
    "1x1-s2-c3": ConvProblem(1, 3, 9, 9, 16, 1, 1, stride=2, dtype="uint8", epilogue=REQUANT),
    "7x7-stem-c3": ConvProblem(1, 3, 17, 17, 16, 7, 7, stride=2, padding=3, dtype="uint8",
                               epilogue=REQUANT),
}


@pytest.mark.parametrize("isa_name", [
    pytest.param(VNNI, marks=needs_isa(VNNI)),                    # vpdpbusd
    "avx2",                                                    # exact vpmaddwd emulation
])
@pytest.mark.parametrize("name", list(U8_PROBLEMS))
def test_u8_exact(isa_name, name):
    """Padding holds the zero point (not 0): the reference pads with it too."""
    problem = U8_PROBLEMS[name]
    _check(problem, default_config(problem, _machine(isa_name)), isa_name, pad_value=ZX)


@pytest.mark.parametrize("isa_name", [pytest.param(VNNI, marks=needs_isa(VNNI)), "avx2"])
def test_u8_stem_folds_its_taps(isa_name):
    """The 7x7 stem reduces a filter row a call: 7 taps of 3 channels, each tap's padded to a
    VNNI group (its padded channel holds the zero point and meets a zero weight)."""
    problem = U8_PROBLEMS["7x7-stem-c3"]
    config = default_config(problem, _machine(isa_name))
    folded = problem.taps_folded()
    assert config.fold_taps and (folded.c, folded.padded_c) == (28, 28)
    _check(problem, config, isa_name, pad_value=ZX)


@pytest.mark.parametrize("spec, c_step, block_steps", [
    ("ACDbfge", 2, {}),             # taps outside the column blocks, 2 channel blocks/call
    ("bfgACDe", 1, {}),             # reductions outermost: the epilogue is its own pass
    ("aC{R:2}D{C:2}ebfg", 1, {}),   # thread grid
])
def test_u8_loop_specs(spec, c_step, block_steps):
    problem = ConvProblem(2, 14, 6, 10, 32, 3, 3, padding=1, dtype="uint8", epilogue=DEQUANT)
    assert problem.padded_c == 16
    config = ConvConfig(bq=5, bc=8, bk=16, spec=spec, c_step=c_step, block_steps=block_steps)
    _check(problem, config, VNNI if runs_here(VNNI) else "avx2", pad_value=ZX)


# -------------------------------------------------------------------- bf16 -> float32


BF16_PROBLEMS = {
    "3x3-c5": ConvProblem(1, 5, 9, 9, 24, 3, 3, padding=1, dtype="bfloat16",
                          epilogue=BIAS_RELU),
    "3x3-s2-c21": ConvProblem(2, 21, 9, 11, 40, 3, 3, stride=2, padding=(1, 2, 0, 1),
                              dtype="bfloat16", epilogue=BIAS_RES_RELU),
    "1x1-c7": ConvProblem(1, 7, 7, 7, 24, 1, 1, dtype="bfloat16"),
}


@pytest.mark.parametrize("isa_name", [
    pytest.param("avx512_bf16", marks=needs_isa("avx512_bf16")),  # vdpbf16ps
    "avx2",                                                    # exact emulation
])
@pytest.mark.parametrize("name", list(BF16_PROBLEMS))
def test_bf16(isa_name, name):
    problem = BF16_PROBLEMS[name]
    y, x, w = _check(problem, default_config(problem, _machine(isa_name)), isa_name)
    if not problem.epilogue.ops:  # bf16 approximates the float32 conv
        exact = pixel_rows(conv.reference(problem, x, w))
        assert np.linalg.norm(y - exact) <= 1e-2 * np.linalg.norm(exact)


def test_bf16_stem_folds_its_taps():
    problem = ConvProblem(1, 3, 17, 17, 16, 7, 7, stride=2, padding=3, dtype="bfloat16",
                          epilogue=BIAS_RELU)
    host = "avx512_bf16" if runs_here("avx512_bf16") else "avx2"
    config = default_config(problem, _machine(host))
    assert config.fold_taps and problem.taps_folded().c == 28
    _check(problem, config, host)


# ------------------------------------------------------------- problems, configs, packing


def test_problem_types():
    f32 = ConvProblem(1, 3, 8, 8, 16, 3, 3)
    assert (f32.layout, f32.alpha, f32.padded_c, f32.out_dtype) == ("flat", 1, 3, "float32")
    bf16 = ConvProblem(1, 3, 8, 8, 16, 3, 3, dtype="bfloat16")
    assert (bf16.acc_dtype, bf16.weight_dtype, bf16.layout, bf16.padded_c) == (
        "float32", "bfloat16", "vnni2", 4)
    u8 = ConvProblem(1, 3, 8, 8, 16, 3, 3, stride=2, dtype="uint8", epilogue=REQUANT)
    assert (u8.epilogue_dtype, u8.out_dtype, u8.input_shape) == ("int32", "uint8",
                                                                 (1, 8, 4, 8))
    assert replace(u8, epilogue=DEQUANT).epilogue_dtype == "float32"
    assert u8.taps_folded().epilogue == REQUANT
    assert u8.flops == 2 * u8.rows * 16 * 3 * 9  # real channels, not padded ones


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": "int8"}, "handles float32, bfloat16, uint8"),
    ({"dtype": "bfloat16", "epilogue": REQUANT},
     "a bfloat16 conv writes float32 or bfloat16, not uint8"),
    ({"dtype": "float32", "epilogue": Epilogue((EpilogueOp("convert", dtype="bfloat16"),))},
     "a float32 conv writes float32 or uint8 or int8, not bfloat16"),
    ({"dtype": "uint8", "epilogue": Epilogue((EpilogueOp("scale", value=0.5),
                                              EpilogueOp("convert", dtype="bfloat16")))},
     "a uint8 conv writes int32 or float32 or uint8 or int8, not bfloat16"),
])
def test_problem_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ConvProblem(**{"n": 1, "c": 8, "h": 8, "w": 8, "k": 16, "r": 3, "s": 3, **kwargs})


def test_config_needs_whole_vnni_groups():
    problem = ConvProblem(1, 6, 8, 8, 16, 3, 3, padding=1, dtype="uint8")
    with pytest.raises(ValueError, match="bc=6 does not divide padded C=8"):
        schedule(problem, ConvConfig(bq=8, bc=6, bk=16))
    with pytest.raises(ValueError, match="bc=2 is not a multiple of 4"):
        schedule(problem, ConvConfig(bq=8, bc=2, bk=16))


def test_pack_weight_layouts():
    rng = np.random.default_rng(3)
    w8 = rng.integers(-128, 127, (40, 5, 3, 3), endpoint=True).astype("int8")
    problem = ConvProblem(1, 5, 8, 8, 40, 3, 3, dtype="uint8")
    packed = pack_weight(w8, 8, problem)
    assert packed.shape == (5, 3, 3, 2, 8, 4) and packed.dtype == np.int8
    # B[R*S*C', K] in VNNI groups, each tap's channels zero-padded from 5 to 8
    b = np.pad(w8, ((0, 0), (0, 3), (0, 0), (0, 0))).transpose(2, 3, 1, 0).reshape(72, 40)
    np.testing.assert_array_equal(Packing.vnni_blocked_b(4, 8).unpack(
        packed.reshape(5, 18, 8, 4), 72, 40), b)
    assert packed[2, 1, 2, 1, 3, 0] == w8[2 * 8 + 3, 4, 1, 2]  # channel 4 of tap (1, 2)
    assert not packed[:, :, :, 1, :, 1:].any()                 # channels 5..7: zeros
    np.testing.assert_array_equal(pack_weight(w8.astype("int32"), 8, problem), packed)
    w = rng.standard_normal((24, 3, 1, 1)).astype("float32")
    bf16 = pack_weight(w, 24, ConvProblem(1, 3, 4, 4, 24, 1, 1, dtype="bfloat16"))
    assert bf16.shape == (1, 1, 1, 2, 24, 2) and bf16.dtype == ml_dtypes.bfloat16
    assert bf16[0, 0, 0, 1, 7, 0] == w[7, 2, 0, 0].astype(ml_dtypes.bfloat16)
    assert bf16[0, 0, 0, 1, 7, 1] == 0
    f32 = ConvProblem(1, 3, 4, 4, 24, 1, 1)
    np.testing.assert_array_equal(pack_weight(w, 8), pack_weight(w, 8, f32))


@pytest.mark.parametrize("dtype, w, message", [
    ("uint8", np.zeros((16, 8, 3, 3), "float32"), "int8 weights must be integers"),
    ("uint8", np.full((16, 8, 3, 3), -129, "int32"), r"in \[-129, -129\]"),
    ("bfloat16", np.zeros((16, 8, 3, 3), "float64"), "float32 or ml_dtypes.bfloat16"),
    ("bfloat16", np.zeros((16, 4, 3, 3), "float32"), r"W must be OIHW \[16, 8, 3, 3\]"),
])
def test_pack_weight_errors(dtype, w, message):
    with pytest.raises(ValueError, match=message):
        pack_weight(w, 8, ConvProblem(1, 8, 8, 8, 16, 3, 3, dtype=dtype))


def test_pack_input():
    """Spatial and channel padding take the pad value; the dtype stays."""
    x = np.arange(2 * 3 * 3 * 2).reshape(2, 3, 3, 2).astype("uint8")
    problem = ConvProblem(2, 3, 3, 2, 8, 3, 3, stride=2, padding=1, dtype="uint8")
    packed = pack_input(x, problem, pad_value=ZX)
    assert packed.shape == problem.input_shape == (2, 5, 2, 8) and packed.dtype == np.uint8
    nhwc = packed.reshape(2, 5, 4, 4)  # the width regrouped by the stride, C' = 4
    np.testing.assert_array_equal(nhwc[:, 1:4, 1:3, :3], x.transpose(0, 2, 3, 1))
    assert (nhwc[:, :, :, 3] == ZX).all() and (nhwc[:, 0] == ZX).all()
    assert (nhwc[:, 4] == ZX).all() and (nhwc[:, :, 3] == ZX).all()
    bf16 = pack_input(x.astype("float32") / 3, replace(problem, dtype="bfloat16"))
    # x[0, 0, 0, 1] / 3 sits at padded column 2 (q 1, phase 0), channel 0
    assert bf16.dtype == ml_dtypes.bfloat16
    # rounded to bf16: compared as float32, since numpy >= 2 casts a Python float to the
    # bfloat16 scalar's type before comparing
    assert bf16[0, 1, 1, 0] == np.float32(1 / 3).astype(ml_dtypes.bfloat16)
    assert np.float32(bf16[0, 1, 1, 0]) != np.float32(1 / 3)
    assert (bf16[0, 1, 1, 3] == 0) and bf16[0, 1, 1, 7] == 0
    with pytest.raises(ValueError, match=r"integers in \[0, 255\]"):
        pack_input(x.astype("int32") - 1, problem)
    with pytest.raises(ValueError, match=r"pads with an int in \[0, 255\]"):
        pack_input(x, problem, pad_value=256)


@pytest.mark.parametrize("dtype", ["uint8", "bfloat16"])
@pytest.mark.parametrize("isa_name", ["avx2", "avx512_bf16", "amx"])
@pytest.mark.parametrize("shape", [
    (1, 64, 56, 56, 64, 3, 3, 1, 1),
    (1, 3, 224, 224, 64, 7, 7, 2, 3),
    (1, 21, 112, 112, 40, 1, 1, 1, 0),
    (1, 512, 7, 7, 512, 3, 3, 1, 1),
    (1, 256, 14, 14, 1024, 1, 1, 1, 0),
])
def test_candidates_fit_the_kernels(dtype, isa_name, shape):
    """Every candidate's channel blocks take whole VNNI groups, output channel blocks are
    vectors where K allows; on amx they are tile-shaped, so the tile kernel runs."""
    *dims, stride, padding = shape
    problem = ConvProblem(*dims, stride=stride, padding=padding, dtype=dtype)
    machine = _machine(isa_name)
    configs = candidates(problem, machine)
    assert configs[0] == default_config(problem, machine)
    for config in configs:
        config.check(problem)
        assert config.bc % problem.alpha == 0
        if problem.k % 16 == 0:
            assert config.bk % 16 == 0
        if isa_name == "amx":
            amx.plan(BrgemmShape(config.bq, config.bk, config.bc, config.c_step, dtype,
                                 problem.acc_dtype, problem.layout, "amx"))
    if isa_name == "amx" and problem.padded_c >= 64:
        tile_row = amx.TILE_BYTES // problem.element_bytes
        assert configs[0].bc % tile_row == 0


def test_tuning_key_and_json():
    """The tuning key carries the dtype; a low-precision config survives the JSON trip."""
    op = OPS["conv2d"]
    shape = dict(n=1, c=5, h=9, w=9, k=24, r=3, s=3, padding=1)
    keys = {op.key(ConvProblem(**shape, dtype=dtype)) for dtype in ("float32", "bfloat16",
                                                                   "uint8")}
    assert len(keys) == 3
    problem = ConvProblem(**shape, dtype="uint8", epilogue=REQUANT)
    for config in candidates(problem, _machine("avx512_bf16")):
        assert op.from_json(op.to_json(config)) == config
    assert op.default(problem, _machine("amx")).bc % 4 == 0


def test_tune(tmp_path):
    """The tuner times low-precision conv candidates (arguments in the problem's dtypes) and
    keys their winner by the dtype in the database; the float32 and bf16 convs of the same
    shape and epilogue are other keys."""
    host = VNNI if runs_here(VNNI) else "avx2"
    target = tvm_tpp.target(f"tpp -isa={host} -num-cores=1")
    database = Database(tmp_path / "tuning.db")
    problem = ConvProblem(1, 5, 9, 9, 32, 3, 3, padding=1, dtype="uint8", epilogue=DEQUANT)
    result = search.tune(problem, target, database=database, top_k=2)
    assert all(m.seconds is not None for m in result.measurements)
    assert Database(tmp_path / "tuning.db").get(TuningKey.of(problem, target)) == result.best
    for dtype in ("float32", "bfloat16"):
        other = TuningKey.of(replace(problem, dtype=dtype), target)
        assert Database(tmp_path / "tuning.db").get(other) is None
    _check(problem, result.best, host, pad_value=ZX)


# ------------------------------------------------------------ instructions, for every ISA


def _ops(problem: ConvProblem, config: ConvConfig, isa_name: str) -> list[str]:
    func = tvm.compile(schedule(problem, config, isa_name).mod,
                       target=isa_target(isa_name, MCPU[isa_name]))
    asm = func.mod.inspect_source("asm")
    return [line.split()[0] for line in asm.splitlines()
            if line.startswith("\t") and line.split()]


@pytest.mark.parametrize("dtype, multiply, fallback", [("uint8", "tdpbusd", "vpdpbusd"),
                                                       ("bfloat16", "tdpbf16ps", "vdpbf16ps")])
def test_amx_asm(dtype, multiply, fallback):
    """Tile-shaped blocks run AMX tiles (reading X in place, bf16 included); wider ones the
    AVX-512 dot products."""
    problem = ConvProblem(1, 64, 8, 8, 64, 3, 3, padding=1, dtype=dtype,
                          epilogue=DEQUANT if dtype == "uint8" else BIAS_RELU)
    config = default_config(problem, _machine("amx"))
    shape = BrgemmShape(config.bq, config.bk, config.bc, config.c_step, dtype,
                        problem.acc_dtype, problem.layout, "amx")
    assert find_impl(shape)[0] == "amx"
    ops = _ops(problem, config, "amx")
    for op in ("ldtilecfg", "tileloadd", multiply, "tilestored", "tilerelease"):
        assert op in ops, op
    wide = replace(config, bk=64)  # 4 column tiles: more than the tile registers
    ops = _ops(problem, wide, "amx")
    assert multiply not in ops and "ldtilecfg" not in ops and fallback in ops


def test_avx512_vnni_asm():
    """Whole vectors of output channels run vpdpbusd only (the kernel's tail columns, as
    K = 24 leaves, are portable widening code)."""
    problem = replace(U8_PROBLEMS["3x3-c5-requant"], k=32)
    ops = _ops(problem, default_config(problem, _machine("avx512_vnni")), "avx512_vnni")
    assert ops.count("vpdpbusd") >= 9 and "vpmaddwd" not in ops


def test_avx2_asm_is_exact_emulation():
    problem = U8_PROBLEMS["1x1-c7-int32"]
    ops = _ops(problem, default_config(problem, _machine("avx2")), "avx2")
    assert "vpmaddwd" in ops and "vpdpbusd" not in ops and "vpmaddubsw" not in ops


# --------------------------------------------------------------- AMX tile program, emulated


@pytest.mark.parametrize("dtype, epilogue", [("uint8", REQUANT), ("bfloat16", BIAS_RES_RELU)])
def test_amx_conv_emulated(amx_emulator, monkeypatch, dtype, epilogue):
    """The AMX conv (default blocks: A rows ``sw*C'`` apart, stride 2, each ``S*C'`` long)
    runs its tile program under the emulator and matches numpy.  The emulator's tile
    registers are one global state: the loops run serial."""
    problem = ConvProblem(1, 21, 9, 9, 40, 3, 3, stride=2, padding=1, dtype=dtype,
                          epilogue=epilogue)
    default = default_config(problem, _machine("amx"))
    config = replace(default, spec=default.spec.lower())
    monkeypatch.setattr(conv, "dispatch", emulated_dispatch)
    # The emulated program needs no vector ISA.
    monkeypatch.setitem(MCPU, "amx", "znver4" if runs_here("avx512_bf16") else "haswell")
    amx_emulator.tpp_amx_emu_reset()
    _check(problem, config, "amx", pad_value=ZX if dtype == "uint8" else 0)
    assert amx_emulator.tpp_amx_emu_faults() == 0
    # Filter rows over a zero border are skipped (int8's border is the zero point: kept).
    top = problem.padding[0]
    rows = sum(dtype == "uint8" or top <= i * problem.stride[0] + r < top + problem.h
               for i in range(problem.p) for r in range(problem.r))
    assert config.fold_taps  # a call per filter row: all its taps, all channels
    calls = (problem.q // config.bq) * (problem.k // config.bk) * rows
    assert amx_emulator.tpp_amx_emu_configs() == calls
    assert amx_emulator.tpp_amx_emu_releases() == calls


def test_epilogue_vectorized_a_register_at_a_time():
    """A 48-channel block's epilogue runs as 3 vectors of 16 lanes (LLVM builds a 48-lane
    vector's bias and scales from scalars every row: MobileNet-V2's int8 16 -> 96 conv ran
    4x slower), a 32-channel one stays one loop; both against numpy."""
    problem = ConvProblem(2, 16, 6, 16, 96, 1, 1, dtype="uint8", epilogue=REQUANT)
    for bk, lanes in ((48, [3, 16]), (32, [32])):
        config = ConvConfig(bq=16, bc=16, bk=bk, spec="ADEcbfg")
        sch = schedule(problem, config, "avx2")
        loops = [sch.get(loop) for loop in sch.get_loops(sch.get_sblock("epilogue"))]
        assert [int(loop.extent) for loop in loops[-len(lanes):]] == lanes
        assert loops[-1].kind == tvm.tirx.ForKind.VECTORIZED
        _check(problem, config, "avx2", pad_value=ZX)


#: Grouped convs whose groups' channels are no whole number of 64-byte tile rows: every call
#: ends with a shorter K step read through zeroed copies (``TilePlan.tail``).
K_TAILS = {
    "bf16-34": ConvProblem(2, 136, 5, 7, 136, 1, 1, groups=4, dtype="bfloat16",
                           epilogue=BIAS_RES_RELU),  # 32 + 2 (not 17 steps of 2)
    "u8-160": ConvProblem(1, 320, 3, 5, 64, 1, 1, groups=2, dtype="uint8",
                          epilogue=REQUANT),  # 64 + 64 + 32
}


@pytest.mark.parametrize("name", sorted(K_TAILS))
def test_amx_conv_k_tail(amx_emulator, monkeypatch, name):
    """Calls with a tail step against numpy: emulated everywhere, natively on AMX hosts."""
    problem = K_TAILS[name]
    config = default_config(problem, _machine("amx"))
    kernel = dispatched_brgemm(schedule(problem, config, "amx"))
    assert kernel.isa == "amx" and amx.plan(kernel).tail
    pad = ZX if problem.dtype == "uint8" else 0
    if runs_here("amx"):
        _check(problem, config, "amx", pad_value=pad)
    monkeypatch.setattr(conv, "dispatch", emulated_dispatch)
    monkeypatch.setitem(MCPU, "amx", "znver4" if runs_here("avx512_bf16") else "haswell")
    amx_emulator.tpp_amx_emu_reset()
    _check(problem, replace(config, spec=config.spec.lower()), "amx", pad_value=pad)
    assert amx_emulator.tpp_amx_emu_faults() == 0
