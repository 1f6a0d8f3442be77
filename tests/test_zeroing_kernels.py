"""BRGEMM kernels that overwrite C: ``beta=0`` (C never read) where one call is the whole
reduction of its C block, ``first_call_zeroes`` (C overwritten on the first call of the
reduction, added to on the others) where it takes several; the schedules that use them drop
the zeroing pass.

The kernels run on garbage C (NaN, or a huge integer) and must equal ``A @ B`` (on a later
call of ``first_call_zeroes``, ``C + A @ B``); the schedules must drop their init block
exactly where a zeroing kernel starts every C block's reduction, pick the variant that
fits, and compute the same values as numpy on outputs full of garbage.
"""

import dataclasses
import functools

import numpy as np
import pytest
import tvm
from conftest import isa_target, needs_isa, pixel_rows, runs_here
from test_brgemm_x86 import LAYOUT, _operands
from tvm import s_tir, tirx
from tvm.script import tirx as T

from microkernels import amx, brgemm
from microkernels.brgemm import BrgemmShape, desc_func, dispatch, find_impl, reference, zeroing
from microkernels.epilogue import Epilogue, EpilogueOp
from relay_passes.scaffold import dispatched_brgemm
from schedules import nest
from schedules.conv import ConvConfig, ConvProblem, pack_input
from schedules.conv import pack_weight as conv_pack_weight
from schedules.conv import reference as conv_reference
from schedules.conv import schedule as conv_schedule
from schedules.gemm import GemmConfig, GemmProblem, pack_weight
from schedules.gemm import schedule as gemm_schedule
from schedules.space import Candidate

AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
BIAS_RELU = Epilogue((EpilogueOp("bias"), EpilogueOp("relu")))


def _zeroed(m, n, k, batch, isa, dtype="float32", layout=None, first_call_only=False):
    acc, default_layout = LAYOUT[dtype]
    shape = BrgemmShape(m, n, k, batch, dtype, acc, layout or default_layout, isa)
    zeroed = zeroing(shape, first_call_only)
    assert zeroed == dataclasses.replace(shape, **({"first_call_zeroes": True}
                                                   if first_call_only else {"beta": 0}))
    return zeroed


def _run_on_garbage(shape, intrin=None, target=None):
    """The kernel tensorized into its semantics, run on C full of garbage: A @ B expected.
    A ``first_call_zeroes`` kernel runs as a first call, and as a later one on C."""
    firsts = [True, False] if shape.first_call_zeroes else [None]
    for first in firsts:
        sch = s_tir.Schedule(desc_func(shape, as_workload=True))
        call = sch.blockize(sch.get_loops(sch.get_sblock("brgemm"))[0])
        sch.tensorize(call, intrin or dispatch(shape))
        if first is not None:
            nest.bind_first_call(sch, call, lambda block, first=first: tirx.const(first))
        kernel = tvm.compile(sch.mod, target=target or isa_target(shape.isa))
        a, b, c, ra, rb = _operands(shape, np.random.default_rng(3))
        garbage = np.full_like(c, np.nan if c.dtype.kind == "f" else np.iinfo(c.dtype).max)
        out = tvm.runtime.tensor(c if first is False else garbage)
        kernel(tvm.runtime.tensor(a), tvm.runtime.tensor(b), out)
        expected = reference(shape, ra, rb, c if first is False else np.zeros_like(c))
        if c.dtype.kind == "f":
            np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-4 * shape.k)
        else:
            np.testing.assert_array_equal(out.numpy(), expected)


# Odd sizes: row tails (7 = 4 + 3), columns narrower than a vector (37), batch > 1.
@pytest.mark.parametrize("dtype,layout", [("float32", "flat"), ("float32", "blocked"),
                                          ("uint8", "vnni4"), ("int8", "vnni4"),
                                          ("uint8", "vnni4_w7"), ("bfloat16", "vnni2")])
@pytest.mark.parametrize("first_call_only", [False, True], ids=["beta0", "first-call"])
def test_avx2_kernels_overwrite_c(dtype, layout, first_call_only):
    _run_on_garbage(_zeroed(7, 37, 8, 3, "avx2", dtype, layout, first_call_only))


@needs_isa("avx512_vnni")
@pytest.mark.parametrize("isa,dtype", [("avx512", "float32"), ("avx512_vnni", "uint8")])
@pytest.mark.parametrize("first_call_only", [False, True], ids=["beta0", "first-call"])
def test_avx512_kernels_overwrite_c(isa, dtype, first_call_only):
    _run_on_garbage(_zeroed(7, 37, 8, 3, isa, dtype, first_call_only=first_call_only))


@pytest.mark.parametrize("dtype", ["uint8", "int8", "bfloat16"])
@pytest.mark.parametrize("first_call_only", [False, True], ids=["beta0", "first-call"])
def test_amx_kernels_zero_their_tiles(amx_emulator, dtype, first_call_only):
    """AMX's zeroing kernels start from ``tilezero`` instead of loading C (on the first call
    only, for ``first_call_zeroes``): under the emulator on any host (partial row and
    column tiles, batch 3), natively where the CPU has AMX."""
    shape = _zeroed(20, 9, 12, 3, "amx", dtype, first_call_only=first_call_only)
    name = f"{shape.name}_emulated"
    if s_tir.TensorIntrin.get(name, allow_missing=True) is None:
        s_tir.TensorIntrin.register(name, desc_func(shape), amx.impl_func(shape, emulate=True))
    amx_emulator.tpp_amx_emu_reset()
    _run_on_garbage(shape, name, target=AVX2)
    assert amx_emulator.tpp_amx_emu_faults() == 0
    if runs_here("amx"):
        _run_on_garbage(shape)


@pytest.mark.parametrize("zeroes", [{"beta": 0}, {"first_call_zeroes": True}])
def test_generic_kernel_zeroes_first(zeroes):
    shape = BrgemmShape(5, 9, 3, 2, isa="avx2", **zeroes)
    name = f"{shape.name}_generic"
    if s_tir.TensorIntrin.get(name, allow_missing=True) is None:
        s_tir.TensorIntrin.register(name, desc_func(shape), brgemm._generic_impl(shape))
    _run_on_garbage(shape, name)


def test_zeroing_keeps_the_implementation():
    """A beta=0 kernel is offered only by the implementation that runs the beta=1 shape:
    the MMLA layout has none, and never falls back to another."""
    avx2 = BrgemmShape(28, 64, 64, isa="avx2")
    assert zeroing(avx2).name == avx2.name + "_beta0"
    assert find_impl(zeroing(avx2))[0] == find_impl(avx2)[0] == "avx2"
    tiles = BrgemmShape(32, 32, 64, 1, "bfloat16", "float32", "vnni2", "amx")
    assert find_impl(tiles)[0] == find_impl(zeroing(tiles))[0] == "amx"
    mmla = BrgemmShape(4, 8, 8, 1, "int8", "int32", "mmla", "neon_i8mm")
    assert zeroing(mmla) is None and zeroing(mmla, first_call_only=True) is None
    with pytest.raises(ValueError, match="zeroing variant"):
        find_impl(dataclasses.replace(mmla, beta=0))
    with pytest.raises(ValueError, match="zeroing variant"):
        find_impl(dataclasses.replace(mmla, first_call_zeroes=True))
    with pytest.raises(ValueError, match="beta must be 0 or 1"):
        BrgemmShape(6, 16, 8, beta=2)
    with pytest.raises(ValueError, match="first_call_zeroes needs beta=1"):
        BrgemmShape(6, 16, 8, beta=0, first_call_zeroes=True)


# -------------------------------------------------------------------------------- schedules


# TVMScript parsed when a test asks: parsed at import, each function costs ~0.3 s per worker.
@functools.cache
def _matmul_ir():
    @T.prim_func(s_tir=True)
    def _matmul(a: T.Buffer((8, 4), "float32"), b: T.Buffer((4, 16), "float32"),
                c: T.Buffer((8, 16), "float32")):
        for i, j, k in T.grid(8, 16, 4):
            with T.sblock("C"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    c[vi, vj] = T.float32(0)
                c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]
    return _matmul


@functools.cache
def _matmul_without_zeroing_ir():
    @T.prim_func(s_tir=True)
    def _matmul_without_zeroing(a: T.Buffer((8, 4), "float32"), b: T.Buffer((4, 16), "float32"),
                                c: T.Buffer((8, 16), "float32")):
        for i, j in T.grid(8, 16):
            with T.sblock("C_init"):
                T.where(T.bool(False))
                vi, vj = T.axis.remap("SS", [i, j])
                c[vi, vj] = T.float32(0)
            for k in range(4):
                with T.sblock("C_update"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    c[vi, vj] = c[vi, vj] + a[vi, vk] * b[vk, vj]
    return _matmul_without_zeroing


def test_drop_zeroing_structure():
    sch = s_tir.Schedule(_matmul_ir())
    block = sch.get_sblock("C")
    init = sch.decompose_reduction(block, sch.get_loops(block)[2])
    assert nest.drop_zeroing(sch, init)
    tvm.ir.assert_structural_equal(
        sch.mod["main"], _matmul_without_zeroing_ir().with_attr("global_symbol", "_matmul"))


def test_drop_zeroing_keeps_other_starting_values():
    @T.prim_func(s_tir=True)
    def starts_at_one(a: T.Buffer((8, 4), "float32"), c: T.Buffer((8,), "float32")):
        for i, k in T.grid(8, 4):
            with T.sblock("C"):
                vi, vk = T.axis.remap("SR", [i, k])
                with T.init():
                    c[vi] = T.float32(1)
                c[vi] = c[vi] + a[vi, vk]

    sch = s_tir.Schedule(starts_at_one)
    block = sch.get_sblock("C")
    init = sch.decompose_reduction(block, sch.get_loops(block)[1])
    before = sch.mod["main"]
    assert not nest.drop_zeroing(sch, init)
    tvm.ir.assert_structural_equal(sch.mod["main"], before)


def _dropped(sch, init_name):
    """Whether the schedule's init block never runs."""
    return "T.where(T.bool(False))" in sch.mod.script() and init_name in sch.mod.script()


def _variant(sch):
    """Which kernel the schedule calls: "beta0", "first" (first_call_zeroes) or "beta1"."""
    shape = dispatched_brgemm(sch)
    return "beta0" if shape.beta == 0 else "first" if shape.first_call_zeroes else "beta1"


@pytest.mark.parametrize("problem,config,variant", [
    # 1x1, every channel in one block: one call per tile (odd sizes, two images).
    (ConvProblem(2, 12, 5, 7, 24, 1, 1), ConvConfig(bq=7, bc=12, bk=8), "beta0"),
    (ConvProblem(1, 20, 3, 9, 16, 1, 1, epilogue=BIAS_RELU),
     ConvConfig(bq=9, bc=20, bk=16, spec="ACbfgde"), "beta0"),
    # Two channel blocks, or three filter taps per row: several calls add up, the first
    # zeroes; at the top and bottom rows the first real filter row's call is the first.
    (ConvProblem(1, 24, 5, 7, 16, 1, 1), ConvConfig(bq=7, bc=12, bk=8), "first"),
    (ConvProblem(1, 8, 6, 6, 16, 3, 3, padding=1, epilogue=BIAS_RELU),
     ConvConfig(bq=6, bc=8, bk=16), "first"),
    (ConvProblem(1, 16, 7, 5, 8, 3, 3, padding=(2, 1, 2, 1), dilation=(2, 1)),
     ConvConfig(bq=5, bc=8, bk=8, c_step=1), "first"),
    (ConvProblem(1, 8, 6, 5, 16, 3, 3, padding=2, dilation=2, zero_border=False),
     ConvConfig(bq=5, bc=8, bk=16), "first"),
    # Output rows whose every filter row is in the border: no call starts them, C is zeroed.
    (ConvProblem(1, 8, 2, 4, 8, 3, 3, padding=(3, 1, 3, 1)),
     ConvConfig(bq=4, bc=8, bk=8), "beta1"),
], ids=["1x1", "1x1-epilogue", "1x1-two-blocks", "3x3", "3x3-dilated-rows", "zero-point",
        "rows-of-border"])
def test_conv_zeroes_where_its_first_call_runs(problem, config, variant):
    sch = conv_schedule(problem, config, "avx2")
    assert _variant(sch) == variant
    assert _dropped(sch, "conv_init") == (variant != "beta1")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((problem.n, problem.c, problem.h, problem.w)).astype("float32")
    w = rng.standard_normal((problem.k, problem.c, problem.r, problem.s)).astype("float32")
    bias = rng.standard_normal(problem.k).astype("float32")
    y = tvm.runtime.tensor(np.full((problem.rows, problem.k), np.nan, "float32"))
    pad = {} if problem.zero_border else {"pad_value": 3.0}
    args = [pack_input(x, problem, **pad), conv_pack_weight(w, config.bk, problem)]
    args += [bias] if problem.epilogue.ops else []
    tvm.compile(sch.mod, target=AVX2)(*map(tvm.runtime.tensor, args), y)
    want = pixel_rows(conv_reference(problem, x, w, **pad))
    if problem.epilogue.ops:
        want = np.maximum(want + bias, 0)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec,block_steps,k_step,variant", [
    ("BCa", {}, 6, "beta0"), ("BCa", {}, 1, "first"), ("aBC", {}, 2, "first"),
    # K split twice: only the call at the first block of both is the first.
    ("aBCa", {"a": (2,)}, 1, "first"),
])
def test_gemm_zeroes_on_the_first_k_block(spec, block_steps, k_step, variant):
    problem = GemmProblem(13, 24, 96)
    config = GemmConfig(bm=13, bn=8, bk=16, candidate=Candidate(spec, block_steps,
                                                                {"a": k_step}))
    sch = gemm_schedule(problem, config, "avx2")
    assert _variant(sch) == variant and _dropped(sch, "C_init")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((13, 96)).astype("float32")
    w = rng.standard_normal((96, 24)).astype("float32")
    y = tvm.runtime.tensor(np.full((13, 24), np.nan, "float32"))
    tvm.compile(sch.mod, target=AVX2)(tvm.runtime.tensor(x),
                                      tvm.runtime.tensor(pack_weight(w, config.bn)), y)
    np.testing.assert_allclose(y.numpy(), x @ w, rtol=1e-4, atol=1e-4)
