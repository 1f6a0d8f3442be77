"""AMX BRGEMM kernels (microkernels.amx): tile plan, numerics, and the generated instructions.

On a host with AMX the real kernels run natively and are compared with numpy.  Everywhere
(qemu cannot execute AMX either) the AMX path is also proven in two parts:

(a) numerics: the very same tile program (tile configuration bytes, tile numbers, pointers,
    strides, K loop) is built with ``impl_func(shape, emulate=True)``, which calls a C emulator
    of the AMX instructions (tests/amx/amx_emu.c, SDM semantics and fault checks) instead of
    the instructions, runs on the host inside a tiled schedule and is compared with numpy; the
    brgemm desc/workload on the same schedule with the generic impl is checked too;
(b) instructions: the real kernel compiled for sapphirerapids has ldtilecfg, tileloadd,
    tdpbusd/tdpbssd/tdpbf16ps, tilestored and tilerelease, configures the tiles once per
    kernel call outside the K loop, and keeps C in tiles across the whole batch-reduce.
"""

import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import s_tir

from microkernels import amx, isa
from microkernels.brgemm import BrgemmShape, desc_func, dispatch, find_impl, reference

SPR = {"kind": "llvm", "mtriple": "x86_64-pc-linux-gnu", "mcpu": "sapphirerapids"}
HOST = {"kind": "llvm", "mcpu": "haswell"}  # the emulated program needs no vector ISA
EMULATOR_SOURCE = Path(__file__).parent / "amx" / "amx_emu.c"
DP = {"uint8": "tdpbusd", "int8": "tdpbssd", "bfloat16": "tdpbf16ps"}


def _shape(m, n, k, batch, dtype):
    acc, layout = ("float32", "vnni2") if dtype == "bfloat16" else ("int32", "vnni4")
    return BrgemmShape(m, n, k, batch, dtype, acc, layout, "amx")


# --------------------------------------------------------------------------------- tile plan


def test_plan_full_tiles_and_config_bytes():
    p = amx.plan(_shape(32, 32, 64, 4, "uint8"))
    assert (p.rows, p.cols, p.kt, p.steps, p.op) == ((16, 16), (16, 16), 64, 4, "tdpbusd")
    assert [p.c_tile(1, 0), p.a_tile(1), p.b_tile(0)] == [2, 5, 6]
    cfg = p.config()
    assert len(cfg) == 64 and cfg[0] == 1 and cfg[1:16] == bytes(15)
    colsb = [int.from_bytes(cfg[16 + 2 * t: 18 + 2 * t], "little") for t in range(8)]
    assert colsb == [64] * 8 and list(cfg[48:56]) == [16] * 8 and cfg[56:] == bytes(8)


def test_plan_partial_tiles():
    # 20 rows -> 16 + 4, 9 columns, K = 3*12 = 36 -> kt = 36 (a multiple of 4 dividing 36).
    p = amx.plan(_shape(20, 9, 12, 3, "int8"))
    assert (p.rows, p.cols, p.kt, p.steps, p.op) == ((16, 4), (9,), 36, 1, "tdpbssd")
    assert p.tiles() == [(16, 36), (4, 36), (16, 36), (4, 36), (9, 36), (0, 0), (0, 0), (0, 0)]
    # bf16: a tile row holds 32 elements; K = 5*6 = 30 -> kt = 30, B rows = 15.
    p = amx.plan(_shape(48, 5, 6, 5, "bfloat16"))
    assert (p.rows, p.cols, p.kt, p.steps, p.op) == ((16, 16, 16), (5,), 30, 1, "tdpbf16ps")
    assert p.tiles()[p.b_tile(0)] == (15, 20)


def test_plan_tail_step_where_it_saves_steps():
    # ShuffleNet's 68-channel groups in bf16: 2 whole rows of 32 and a tail of 4, not 17 x 4.
    p = amx.plan(_shape(14, 34, 68, 1, "bfloat16"))
    assert (p.rows, p.cols, p.kt, p.steps, p.tail) == ((14,), (16, 16, 2), 32, 2, 4)
    assert p.tiles()[p.a_tile(0)] == (14, 64) and p.tiles()[p.b_tile(2)] == (16, 8)
    # int8 K = 160: 64 + 64 + 32 (3 steps) rather than 5 x 32.
    p = amx.plan(_shape(16, 16, 160, 1, "uint8"))
    assert (p.steps, p.tail) == (2, 32)
    # As many steps either way: the divisor stays (K = 96 int8: 2 x 48).
    p = amx.plan(_shape(16, 16, 96, 1, "uint8"))
    assert (p.kt, p.steps, p.tail) == (48, 2, 0)
    with pytest.raises(ValueError, match="K tail"):
        amx.TilePlan((16,), (16,), 32, 2, 2, 2, "tdpbf16ps", tail=3)


@pytest.mark.parametrize(
    "shape, match",
    [
        (_shape(64, 32, 64, 1, "uint8"), "more than the 8 tile registers"),
        (_shape(16, 64, 64, 1, "uint8"), "more than the 8 tile registers"),
        (BrgemmShape(16, 16, 64, 1, "uint8", "int32", "flat", "amx"), "vnni4"),
        (BrgemmShape(16, 16, 64, 1, "float32", "float32", "flat", "amx"), "no float32"),
    ],
)
def test_plan_rejects_what_amx_cannot_hold(shape, match):
    with pytest.raises(ValueError, match=match):
        amx.plan(shape)


def test_oversized_block_refused_then_dispatched_to_avx512():
    with pytest.raises(ValueError, match="tile registers"):
        amx.impl_func(_shape(64, 64, 64, 1, "bfloat16"))
    assert find_impl(_shape(64, 64, 64, 1, "bfloat16"))[0] == "avx512_bf16"


def test_registered_for_amx_only():
    for dtype in DP:
        assert find_impl(_shape(16, 16, 64, 1, dtype))[0] == "amx"
    assert find_impl(BrgemmShape(16, 16, 64, 1, "uint8", "int32", "vnni4", "avx2"))[0] != "amx"


# --------------------------------------------------------------------- (a) numerics, emulated


def _tiled(kernel: BrgemmShape, intrin: str, rows: int, cols: int):
    """The ``rows x cols`` block grid of ``kernel`` calls: the workload and its schedule."""
    big = BrgemmShape(kernel.m * rows, kernel.n * cols, kernel.k, kernel.batch, kernel.dtype_a,
                      kernel.dtype_acc, kernel.layout, "avx2")
    sch = s_tir.Schedule(desc_func(big, as_workload=True))
    i, j, k = sch.get_loops(sch.get_sblock("brgemm"))
    i0, i1 = sch.split(i, [None, kernel.m])
    j0, j1 = sch.split(j, [None, kernel.n])
    sch.reorder(i0, j0, i1, j1, k)
    sch.tensorize(i1, intrin)
    return big, sch.mod


def _operands(shape: BrgemmShape, rng):
    if shape.dtype_a == "bfloat16":
        a = rng.standard_normal(shape.a_shape()).astype(ml_dtypes.bfloat16)
        b = rng.standard_normal(shape.b_shape()).astype(ml_dtypes.bfloat16)
        c = rng.standard_normal((shape.m, shape.n)).astype(np.float32)
        return a, b, c, reference(shape, a.view(np.uint16), b.view(np.uint16), c)
    low = 0 if shape.dtype_a == "uint8" else -128
    a = rng.integers(low, low + 256, shape.a_shape()).astype(shape.dtype_a)
    b = rng.integers(-128, 128, shape.b_shape()).astype(np.int8)
    c = rng.integers(-1000, 1000, (shape.m, shape.n)).astype(np.int32)
    return a, b, c, reference(shape, a, b, c)


def _run_host(mod, operands, target=HOST):
    a, b, c = (tvm.runtime.tensor(x) for x in operands)
    tvm.compile(mod, target=tvm.target.Target(target))(a, b, c)
    return c.numpy()


def _check(shape, got, want):
    if shape.dtype_a == "bfloat16":  # fp32 accumulation vs float64 numpy
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * shape.batch * shape.k)
    else:
        np.testing.assert_array_equal(got, want)


KERNELS = [
    _shape(32, 32, 64, 4, "uint8"),  # 2x2 full tiles, 4 K steps
    _shape(20, 9, 12, 3, "int8"),  # partial row and column tiles, kt = 36
    _shape(16, 48, 16, 8, "uint8"),  # 1x3 C tiles, K steps span batch blocks
    _shape(32, 32, 32, 3, "bfloat16"),  # the paper's 32x32x32 bf16 kernel
    _shape(48, 5, 6, 5, "bfloat16"),  # 3x1 C tiles, odd n, kt = 30
    _shape(14, 34, 68, 1, "bfloat16"),  # a K tail of 4 after 2 x 32, a 2-column tile
    _shape(20, 16, 40, 4, "uint8"),  # K = 160: a tail of 32 spanning batch blocks
]


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda s: s.name)
def test_emulated_tile_program_matches_numpy(amx_emulator, kernel):
    name = kernel.name + "_emulated"
    if s_tir.TensorIntrin.get(name, allow_missing=True) is None:
        s_tir.TensorIntrin.register(name, desc_func(kernel), amx.impl_func(kernel, emulate=True))
    big, mod = _tiled(kernel, name, rows=2, cols=3)
    operands = _operands(big, np.random.default_rng(7))
    amx_emulator.tpp_amx_emu_reset()
    got = _run_host(mod, operands[:3])
    assert amx_emulator.tpp_amx_emu_faults() == 0
    assert amx_emulator.tpp_amx_emu_configs() == 6 == amx_emulator.tpp_amx_emu_releases()
    assert amx_emulator.tpp_amx_emu_configured() == 0
    _check(big, got, operands[3])


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda s: s.name)
def test_native_tile_program_matches_numpy(kernel):
    """The real tile instructions, where the CPU has them."""
    if "amx_tile" not in isa.host_flags():
        pytest.skip("host lacks AMX (no amx_tile flag): the tile program is checked under the "
                    "emulator and in sapphirerapids assembly instead")
    assert amx.tiles_usable(), "AMX host, but Linux refused the tile state (arch_prctl)"
    big, mod = _tiled(kernel, dispatch(kernel), rows=2, cols=3)
    operands = _operands(big, np.random.default_rng(9))
    _check(big, _run_host(mod, operands[:3], target=SPR), operands[3])


@pytest.mark.parametrize("kernel", KERNELS[1::3], ids=lambda s: s.name)
def test_desc_on_same_schedule_matches_numpy(kernel):
    """The semantics the AMX impl is matched against, run with the generic (desc) impl."""
    name = kernel.name + "_generic"
    if s_tir.TensorIntrin.get(name, allow_missing=True) is None:
        s_tir.TensorIntrin.register(name, desc_func(kernel), desc_func(kernel))
    big, mod = _tiled(kernel, name, rows=2, cols=3)
    operands = _operands(big, np.random.default_rng(8))
    _check(big, _run_host(mod, operands[:3]), operands[3])


def test_emulator_flags_invalid_tile_programs(amx_emulator):
    """The fault checks are live: a bad palette and mismatched tile shapes are counted."""
    p = amx.plan(_shape(16, 16, 64, 1, "uint8"))
    amx_emulator.tpp_amx_emu_reset()
    amx_emulator.tpp_amx_emu_ldtilecfg(p.config())
    amx_emulator.tpp_amx_emu_tdpbusd(0, 1, 2)
    assert amx_emulator.tpp_amx_emu_faults() == 0
    amx_emulator.tpp_amx_emu_tdpbusd(0, 0, 2)  # destination used as a source
    amx_emulator.tpp_amx_emu_tdpbusd(0, 1, 5)  # tile 5 not configured
    amx_emulator.tpp_amx_emu_ldtilecfg(b"\x02" + p.config()[1:])  # palette 2
    assert amx_emulator.tpp_amx_emu_faults() == 3
    assert amx_emulator.tpp_amx_emu_configured() == 0


# ------------------------------------------------------------------ (b) instructions, asm


def _kernel_asm(shape: BrgemmShape) -> list[str]:
    sch = s_tir.Schedule(desc_func(shape, as_workload=True))
    sch.tensorize(sch.get_loops(sch.get_sblock("brgemm"))[0], dispatch(shape))
    asm = tvm.compile(sch.mod, target=tvm.target.Target(SPR)).mod.inspect_source("asm")
    body = asm[asm.index("main_compute_:"):]
    return body[: body.index(".Lfunc_end")].splitlines()


def _loops(lines: list[str]) -> list[tuple[int, int]]:
    """(first, last) line of every loop: a label and a later jump back to it."""
    labels = {}
    for i, line in enumerate(lines):
        if m := re.match(r"(\.LBB\w+):", line):
            labels[m.group(1)] = i
    loops = []
    for i, line in enumerate(lines):
        m = re.match(r"\s+j\w+\s+(\.LBB\w+)", line)
        if m and labels.get(m.group(1), i) < i:
            loops.append((labels[m.group(1)], i))
    return loops


@pytest.mark.parametrize("dtype", list(DP))
def test_sapphirerapids_asm(dtype):
    k = 32 if dtype == "bfloat16" else 64
    shape = _shape(32, 32, k, 32, dtype)  # 32 K steps: LLVM keeps the K loop
    p = amx.plan(shape)
    lines = _kernel_asm(shape)
    ops = [line.split()[0] for line in lines if line.startswith("\t") and line.split()]
    for op in ("ldtilecfg", "tileloadd", DP[dtype], "tilestored", "tilerelease"):
        assert op in ops, op
    assert ops.count("ldtilecfg") == 1 and ops.count("tilerelease") == 1
    assert ops.count("tilestored") == p.num_c
    order = [ops.index(op) for op in ("ldtilecfg", "tileloadd", DP[dtype], "tilestored")]
    assert order == sorted(order)

    dp_lines = [i for i, line in enumerate(lines) if DP[dtype] in line]
    k_loops = [(a, b) for a, b in _loops(lines) if a < dp_lines[0] <= b]
    assert k_loops, "the K-step loop was expected to stay a loop"
    first_line, last_line = min(k_loops, key=lambda ab: ab[1] - ab[0])
    body = lines[first_line: last_line + 1]
    c_tiles = {f"%tmm{t}" for t in range(p.num_c)}
    assert not [line for line in body if re.search("ldtilecfg|tilestored|tilerelease", line)]
    assert not [line for line in body if "tileloadd" in line and line.split()[-1] in c_tiles]
    assert sum(DP[dtype] in line for line in body) % p.num_c == 0


def test_request_permission_matches_host():
    # Granted exactly where the CPU (and Linux >= 5.16) has AMX; elsewhere the call fails.
    assert amx.request_permission() is ("amx_tile" in isa.host_flags())
