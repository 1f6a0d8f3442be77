"""The epilogue's float32 -> bf16 conversion as AVX512-BF16's ``vcvtneps2bf16``.

On ISAs with AVX512-BF16 the ``convert`` op is the instruction (one for the bits' eight
integer ops) wherever the schedule can vectorize it 16 lanes at a time: the bits must equal
the portable rounding's (round to nearest even, NaNs quieted), but for denormal inputs, which
the instruction flushes to zero.  The cross-compiled code is checked on any host, the numbers
natively where the CPU has the instruction.
"""

import ml_dtypes
import numpy as np
import pytest
import tvm
from conftest import isa_target, runs_here
from tvm import s_tir, te

from microkernels import isa as isa_module
from microkernels.epilogue import Epilogue, EpilogueOp, apply_te, reference, vector_lanes
from microkernels.machine import Machine
from schedules import depthwise, gemm
from schedules.conv import (
    ConvConfig,
    ConvProblem,
    default_config,
    pack_input,
    pack_weight,
    schedule,
)
from schedules.conv import reference as conv_reference
from schedules.gemm import GemmProblem

CONVERT = Epilogue((EpilogueOp("convert", dtype="bfloat16"),))
BIAS_RELU_CONVERT = Epilogue((EpilogueOp("bias"), EpilogueOp("relu"),
                              EpilogueOp("convert", dtype="bfloat16")))
SPR = "sapphirerapids"


def _special_values(n: int) -> np.ndarray:
    bits = np.array([0x7FC00001, 0xFFA12345, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000,
                     0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x00800000, 0x80800000],
                    np.uint32)  # NaNs with payloads, infinities, zeros, ties, the extremes
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(n) * 10.0 ** rng.integers(-45, 30, n)).astype(np.float32)
    values.view(np.uint32)[:len(bits)] = bits
    return values


def _converted(isa: str, values: np.ndarray) -> np.ndarray:
    c = te.placeholder((1, values.size), "float32", name="C")
    y = apply_te(CONVERT, c, isa=isa)
    sch = s_tir.Schedule(te.create_prim_func([c, y]))
    columns = sch.get_loops(sch.get_sblock("epilogue"))[-1]
    sch.vectorize(sch.split(columns, [None, 16])[1])
    func = tvm.compile(sch.mod, target=isa_target("avx512_bf16", SPR))
    out = tvm.runtime.empty((1, values.size), "bfloat16")
    func(tvm.runtime.tensor(values[None]), out)
    return out.numpy().view(np.uint16)[0]


@pytest.mark.skipif(not runs_here("avx512_bf16"), reason="host lacks AVX512-BF16: the "
                    "instruction is checked in the cross-compiled convs' assembly below")
def test_instruction_rounds_as_the_bits_do():
    values = _special_values(4096)
    want = reference(CONVERT, values[None])[0]
    got = _converted("avx512_bf16", values)
    denormal = (values != 0) & (np.abs(values) < np.finfo(np.float32).tiny)
    assert denormal.sum() > 10
    np.testing.assert_array_equal(got[~denormal], want[~denormal])
    np.testing.assert_array_equal(got[denormal], np.signbit(values[denormal]) * 0x8000)
    np.testing.assert_array_equal(_converted("generic", values), want)  # the portable bits


def test_only_isas_with_the_instruction_use_it():
    x = tvm.tirx.Var("x", "float32")

    def lanes(isa: str) -> int | None:
        c = te.placeholder((1, 16), "float32", name="C")
        return vector_lanes(te.create_prim_func([c, apply_te(CONVERT, c, isa=isa)]).body)

    assert [lanes(isa) for isa in ("amx", "avx512_bf16", "avx512", "avx2", "generic")] == \
        [16, 16, None, None, None]
    assert vector_lanes(tvm.tirx.Evaluate(x)) is None


def _asm(problem: ConvProblem, config: ConvConfig, isa: str) -> str:
    return tvm.compile(schedule(problem, config, isa).mod,
                       target=isa_target(isa, SPR)).mod.inspect_source("asm")


@pytest.mark.parametrize("isa", ["amx", "avx512_bf16"])
def test_conv_epilogue_converts_in_16_lanes(isa):
    """bf16 convs writing bf16 convert with the instruction where their column blocks are
    whole vectors of 16 (the epilogue then runs 16 lanes at a time), with the bits where not."""
    problem = ConvProblem(2, 32, 5, 7, 96, 1, 1, dtype="bfloat16", epilogue=BIAS_RELU_CONVERT)
    blocks = ConvConfig(bq=7, bc=32, bk=48, spec="ADEcbfg")
    sch = schedule(problem, blocks, isa)
    loops = [sch.get(loop) for loop in sch.get_loops(sch.get_sblock("epilogue"))]
    assert int(loops[-1].extent) == 16 and loops[-1].kind == tvm.tirx.ForKind.VECTORIZED
    assert "vcvtneps2bf16" in _asm(problem, blocks, isa)
    odd = ConvConfig(bq=7, bc=32, bk=24, spec="ADEcbfg")
    assert "vcvtneps2bf16" not in _asm(problem, odd, isa)


@pytest.mark.parametrize("isa", ["amx", "avx512_bf16"])
def test_conv_with_the_instruction_matches_numpy(isa):
    if not runs_here(isa):
        pytest.skip(f"host lacks {isa}: its conv is checked in cross-compiled assembly above")
    problem = ConvProblem(2, 32, 5, 7, 96, 3, 3, padding=1, dtype="bfloat16",
                          epilogue=BIAS_RELU_CONVERT)
    config = default_config(problem, _machine(isa))
    assert config.bk % 16 == 0
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 32, 5, 7)).astype(np.float32)
    w = rng.standard_normal((96, 32, 3, 3)).astype(np.float32)
    bias = rng.standard_normal(96).astype(np.float32)
    func = tvm.compile(schedule(problem, config, isa).mod, target=isa_target(isa, SPR))
    y = tvm.runtime.empty((problem.rows, problem.k), "bfloat16")
    func(tvm.runtime.tensor(pack_input(x, problem)),
         tvm.runtime.tensor(pack_weight(w, config.bk, problem)), tvm.runtime.tensor(bias), y)
    x16, w16 = (v.astype(ml_dtypes.bfloat16).astype(np.float64) for v in (x, w))
    acc = conv_reference(problem, x16, w16).transpose(0, 2, 3, 1).reshape(problem.rows, -1)
    want = np.maximum(acc + bias, 0).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_allclose(y.numpy().astype(np.float32), want, rtol=2 ** -7, atol=1e-6)
    assert "vcvtneps2bf16" in func.mod.inspect_source("asm")


def _machine(isa: str) -> Machine:
    return Machine(isa_module.from_name(isa), isa_module.DEFAULT_CACHES, 2)


@pytest.mark.parametrize("isa", ["amx", "avx512_bf16"])
def test_dense_epilogue_converts_in_16_lanes(isa):
    """The GEMM template's epilogue too (BERT's FFN dense writes bf16 after its GELU); natively
    against numpy where the CPU runs ``isa``."""
    problem = GemmProblem(37, 96, 64, "bfloat16", BIAS_RELU_CONVERT).on(isa)
    config = gemm.default_config(problem, _machine(isa))
    assert config.bn % 16 == 0
    func = tvm.compile(gemm.schedule(problem, config, isa).mod, target=isa_target(isa, SPR))
    assert "vcvtneps2bf16" in func.mod.inspect_source("asm")
    if not runs_here(isa):
        return
    rng = np.random.default_rng(5)
    x, w = (rng.standard_normal(shape).astype(ml_dtypes.bfloat16) for shape in ((37, 64),
                                                                                  (64, 96)))
    bias = rng.standard_normal(96).astype(np.float32)
    y = tvm.runtime.empty((37, 96), "bfloat16")
    func(tvm.runtime.tensor(x), tvm.runtime.tensor(gemm.pack_weight(w, config.bn, problem)),
         tvm.runtime.tensor(bias), y)
    acc = x.astype(np.float64) @ w.astype(np.float64)
    want = np.maximum(acc + bias, 0).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_allclose(y.numpy().astype(np.float32), want, rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("isa", ["amx", "avx512_bf16"])
@pytest.mark.parametrize("bc, instruction", [(16, True), (32, True), (8, False)])
def test_depthwise_epilogue_converts_in_16_lanes(isa, bc, instruction):
    """MobileNet's depthwise convs writing bf16 for the next conv: the instruction where the
    channel block is whole vectors of 16 (a 32-channel block in two), the bits where not;
    natively against numpy where the CPU runs ``isa``."""
    problem = depthwise.DepthwiseProblem(2, 32, 7, 9, 3, 3, stride=(2, 1), padding=1,
                                         dtype="bfloat16", epilogue=BIAS_RELU_CONVERT)
    config = depthwise.DepthwiseConfig(bq=9, bc=bc)
    func = tvm.compile(depthwise.schedule(problem, config, isa).mod,
                       target=isa_target(isa, SPR))
    assert ("vcvtneps2bf16" in func.mod.inspect_source("asm")) == instruction
    if not runs_here(isa):
        return
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 32, 7, 9)).astype(ml_dtypes.bfloat16).astype(np.float32)
    w = rng.standard_normal((32, 1, 3, 3)).astype(ml_dtypes.bfloat16).astype(np.float32)
    bias = rng.standard_normal(32).astype(np.float32)
    y = tvm.runtime.empty((problem.rows, 32), "bfloat16")
    func(tvm.runtime.tensor(depthwise.pack_input(x, problem)),
         tvm.runtime.tensor(depthwise.pack_weight(w, problem)), tvm.runtime.tensor(bias), y)
    acc = depthwise.reference(problem, x, w).transpose(0, 2, 3, 1).reshape(problem.rows, -1)
    want = np.maximum(acc + bias, 0).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_allclose(y.numpy().astype(np.float32), want, rtol=2 ** -7, atol=1e-6)
