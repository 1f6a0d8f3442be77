"""x86 BRGEMM kernels (microkernels.x86): numerics on this host, instructions for every ISA.

Each kernel is tensorized into its own semantics (``desc_func(shape, as_workload=True)``)
and compared with ``brgemm.reference`` on random data with C preloaded (beta = 1); a GEMM
schedule whose ``decompose_reduction`` zeroes C before the kernel covers beta = 0.  AVX2 code
(mcpu haswell) always runs; AVX-512 / VNNI / BF16 code runs only where the host has the
flags, and is otherwise proven by the instructions in its assembly.
"""

import dataclasses
import functools
import re

import ml_dtypes
import numpy as np
import pytest
import tvm
from conftest import isa_target, needs_isa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tvm import s_tir, te

from microkernels import isa as _isa
from microkernels import x86
from microkernels.brgemm import (
    B_RANGES,
    BrgemmShape,
    desc_func,
    dispatch,
    edge_rows,
    find_impl,
    implementations,
    reference,
)

HOST = _isa.host_flags()
MCPU = {name: chosen.mcpu for name, chosen in _isa.KNOWN.items()}  # each ISA's own CPU
LAYOUT = {"float32": ("float32", "flat"), "uint8": ("int32", "vnni4"),
          "int8": ("int32", "vnni4"), "bfloat16": ("float32", "vnni2")}


def _shape(m, n, k, batch, isa, dtype="float32", layout=None):
    acc, default_layout = LAYOUT[dtype]
    return BrgemmShape(m, n, k, batch, dtype, acc, layout or default_layout, isa)


def _intrin(shape, impl):
    """Name of the TensorIntrin of ``shape``: the dispatched one, or one built from ``impl``."""
    if impl is None:
        return dispatch(shape)
    name = f"{shape.name}_{impl.__name__}"
    if s_tir.TensorIntrin.get(name, allow_missing=True) is None:
        s_tir.TensorIntrin.register(name, desc_func(shape), impl(shape))
    return name


def _build(shape, mcpu=None, impl=None):
    """The kernel tensorized into its own semantics, compiled for ``mcpu`` (default: the
    ISA's own CPU)."""
    return _compile(shape, mcpu or MCPU[shape.isa], impl)


@functools.cache
def _compile(shape, mcpu, impl):
    """Cached: a compile costs ~0.5 s, and execution and assembly tests share kernels."""
    sch = s_tir.Schedule(desc_func(shape, as_workload=True))
    sch.tensorize(sch.get_loops(sch.get_sblock("brgemm"))[0], _intrin(shape, impl))
    return tvm.compile(sch.mod, target=isa_target(shape.isa, mcpu))


def _operands(shape, rng, a_range=None, b_range=None):
    """Random (A, B, C) in the kernel's dtypes, and A, B as ``reference`` takes them."""
    if shape.dtype_a in ("float32", "bfloat16"):
        dtype = ml_dtypes.bfloat16 if shape.dtype_a == "bfloat16" else np.float32
        a = rng.standard_normal(shape.a_shape()).astype(dtype)
        b = rng.standard_normal(shape.b_shape()).astype(dtype)
        c = rng.standard_normal((shape.m, shape.n)).astype("float32")
        if shape.dtype_a == "bfloat16":
            return a, b, c, a.view(np.uint16), b.view(np.uint16)
        return a, b, c, a, b
    lo, hi = a_range or ((0, 255) if shape.dtype_a == "uint8" else (-128, 127))
    blo, bhi = b_range or B_RANGES.get(shape.layout, (-128, 127))
    a = rng.integers(lo, hi, shape.a_shape(), endpoint=True).astype(shape.dtype_a)
    b = rng.integers(blo, bhi, shape.b_shape(), endpoint=True).astype("int8")
    c = rng.integers(-1000, 1000, (shape.m, shape.n)).astype("int32")
    return a, b, c, a, b


def _assert_close(shape, got, expected):
    if shape.dtype_acc == "int32":
        np.testing.assert_array_equal(got, expected)
    else:
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * shape.k * shape.batch)


def _run(shape, impl=None, seed=0, **ranges):
    a, b, c, ra, rb = _operands(shape, np.random.default_rng(seed), **ranges)
    out = tvm.runtime.tensor(c)
    _build(shape, impl=impl)(tvm.runtime.tensor(a), tvm.runtime.tensor(b), out)
    return out.numpy(), reference(shape, ra, rb, c)


def _check(shape, impl=None, **ranges):
    got, expected = _run(shape, impl, **ranges)
    _assert_close(shape, got, expected)


# Odd sizes on purpose: row tails (7 = 4 + 3), column tails narrower than a vector (37, 9, 3),
# several register tiles (24 x 64), batch > 1 everywhere, one batch-1 kernel.
FP32_SHAPES = [(7, 37, 5, 3), (6, 16, 8, 2), (13, 9, 3, 2), (24, 64, 16, 2), (2, 3, 7, 1),
               (1, 20, 4, 2)]
VNNI_SHAPES = [(7, 37, 8, 3), (13, 9, 4, 2), (24, 64, 16, 2)]


# ----------------------------------------------------------------------------- AVX2: always


@pytest.mark.parametrize("m,n,k,batch", FP32_SHAPES)
def test_fp32_flat_avx2(m, n, k, batch):
    _check(_shape(m, n, k, batch, "avx2"))


@pytest.mark.parametrize("m,n,k,batch", [(6, 1, 4, 2), (6, 16, 1, 1)])
def test_fp32_unit_n_or_k_avx2(m, n, k, batch):
    _check(_shape(m, n, k, batch, "avx2"))


@pytest.mark.parametrize("m,n,k,batch", FP32_SHAPES[:2])
def test_fp32_blocked_avx2(m, n, k, batch):
    _check(_shape(m, n, k, batch, "avx2", layout="blocked"))


@pytest.mark.parametrize("dtype,m,n,k,batch", [("uint8", *s) for s in VNNI_SHAPES]
                         + [("int8", *VNNI_SHAPES[0])])
def test_int8_vnni4_avx2(dtype, m, n, k, batch):
    _check(_shape(m, n, k, batch, "avx2", dtype))


def test_int8_avx2_exact_where_vpmaddubsw_saturates():
    """All A = 255 and B = -128: every vpmaddubsw pair sum would clip at -32768."""
    shape = _shape(6, 16, 8, 2, "avx2", "uint8")
    got, expected = _run(shape, a_range=(255, 255), b_range=(-128, -128))
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("m,n,k,batch", VNNI_SHAPES)
def test_int8_w7_avx2(m, n, k, batch):
    """The dispatched vnni4_w7 kernel is exact on 7-bit weights, extremes included."""
    shape = _shape(m, n, k, batch, "avx2", "uint8", "vnni4_w7")
    assert find_impl(shape)[0] == "avx2"
    _check(shape)
    for a, b in (((255, 255), (-64, -64)), ((255, 255), (64, 64))):
        got, expected = _run(shape, a_range=a, b_range=b)
        np.testing.assert_array_equal(got, expected)


def test_vpmaddubsw_saturates_on_full_range_weights():
    """Why the layout bounds B: on 8-bit weights the same kernel clips its pair sums."""
    shape = _shape(6, 16, 8, 2, "avx2", "uint8")
    got, expected = _run(shape, x86.int8_w7_impl, a_range=(255, 255), b_range=(-128, -128))
    assert not np.array_equal(got, expected)


def test_w7_layout_rejects_8bit_weights():
    from microkernels.pack import Packing

    shape = _shape(6, 16, 8, 1, "avx2", "uint8", "vnni4_w7")
    b = np.full(shape.b_shape(), -65, "int8")
    with pytest.raises(ValueError, match=r"\[-64, 64\]"):
        reference(shape, np.zeros(shape.a_shape(), "uint8"), b, np.zeros((6, 16), "int32"))
    with pytest.raises(ValueError, match="values must lie in"):
        Packing.for_layout("vnni4_w7").pack(np.full((8, 16), 65, "int8"))
    with pytest.raises(ValueError, match="not a VNNI layout"):
        Packing.for_layout("flat")


@pytest.mark.parametrize("m,n,k,batch", VNNI_SHAPES[:2])
def test_bf16_vnni2_avx2(m, n, k, batch):
    _check(_shape(m, n, k, batch, "avx2", "bfloat16"))


def _gemm_beta0(shape, blocks=(2, 3)):
    """``C = A @ B`` (no preloaded C) over a grid of kernel blocks: the schedule splits M and
    N into the kernel's m x n, zeroes each C block with ``decompose_reduction`` right before
    the kernel (PARLOOPER's zero TPP) and tensorizes the update."""
    bm, bn = blocks
    big_m, big_n, big_k = bm * shape.m, bn * shape.n, shape.k * shape.batch
    tc, alpha = shape.dtype_acc, shape.alpha
    a = te.placeholder((big_m, big_k), shape.dtype_a, name="A")
    b_shape = (big_k // alpha, big_n, alpha) if alpha > 1 else (big_k, big_n)
    b = te.placeholder(b_shape, shape.dtype_b, name="B")
    r = te.reduce_axis((0, big_k), name="kk")

    def b_at(kk, j):
        return b[kk // alpha, j, kk % alpha] if alpha > 1 else b[kk, j]

    c = te.compute((big_m, big_n), lambda i, j: te.sum(
        a[i, r].astype(tc) * b_at(r, j).astype(tc), axis=r), name="brgemm")
    sch = s_tir.Schedule(te.create_prim_func([a, b, c]))
    block = sch.get_sblock("brgemm")
    i, j, kk = sch.get_loops(block)
    io, ii = sch.split(i, [None, shape.m])
    jo, ji = sch.split(j, [None, shape.n])
    sch.reorder(io, jo, ii, ji, kk)
    sch.decompose_reduction(block, ii)
    sch.tensorize(ii, dispatch(shape))
    ex = tvm.compile(sch.mod, target=isa_target(shape.isa))
    big = BrgemmShape(big_m, big_n, big_k, 1, shape.dtype_a, tc, shape.layout, shape.isa)
    aa, bb, _, ra, rb = _operands(big, np.random.default_rng(1))
    out = tvm.runtime.tensor(np.full((big_m, big_n), 7, tc))  # garbage the init must clear
    ex(tvm.runtime.tensor(aa), tvm.runtime.tensor(bb), out)
    _assert_close(big, out.numpy(), reference(big, ra, rb, np.zeros((big_m, big_n), tc)))


@pytest.mark.parametrize("dtype", ["float32", "uint8", "bfloat16"])
def test_beta0_via_decompose_reduction_avx2(dtype):
    _gemm_beta0(_shape(5, 13, 8, 2, "avx2", dtype))


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(2, 17), n=st.integers(2, 40), k=st.integers(1, 9),
       batch=st.integers(2, 4))
def test_fp32_avx2_random_shapes(m, n, k, batch):
    _check(_shape(m, n, k, batch, "avx2"))


# ------------------------------------------------------------------ AVX-512 family: on host


@needs_isa("avx512")
@pytest.mark.parametrize("dtype,layout", [("float32", "flat"), ("float32", "blocked"),
                                          ("uint8", None), ("int8", None), ("bfloat16", None)])
def test_avx512_kernels(dtype, layout):
    _check(_shape(7, 37, 8, 3, "avx512", dtype, layout))


@needs_isa("avx512_vnni")
@pytest.mark.parametrize("m,n,k,batch", [(7, 37, 8, 3), (6, 64, 16, 2)])
def test_int8_vpdpbusd_avx512_vnni(m, n, k, batch):
    shape = _shape(m, n, k, batch, "avx512_vnni", "uint8")
    assert find_impl(shape)[0] == "avx512_vnni"
    _check(shape)


@needs_isa("avx512_vnni")
def test_beta0_vpdpbusd_avx512_vnni():
    _gemm_beta0(_shape(6, 20, 8, 2, "avx512_vnni", "uint8"))


@needs_isa("avx_vnni")
def test_int8_vpdpbusd_avx_vnni():
    _check(_shape(7, 37, 8, 3, "avx_vnni", "uint8"))


@needs_isa("avx512_bf16")
@pytest.mark.parametrize("m,n,k,batch", [(7, 37, 8, 3), (5, 21, 6, 2), (3, 3, 4, 2),
                                         (4, 24, 6, 2), (3, 29, 4, 1), (3, 23, 4, 2), (2, 7, 6, 1)])
def test_bf16_vdpbf16ps(m, n, k, batch):
    _check(_shape(m, n, k, batch, "avx512_bf16", "bfloat16"))


@needs_isa("avx512_vnni")
@pytest.mark.parametrize("m,n,k,batch", [(5, 21, 8, 2), (3, 3, 4, 2), (4, 24, 8, 1), (3, 7, 4, 1),
                                         (3, 30, 4, 2)])
def test_int8_vpdpbusd_column_tails(m, n, k, batch):
    _check(_shape(m, n, k, batch, "avx512_vnni", "uint8"))


# A's batch blocks at a stride of their own (a conv's filter rows): every x86 family, odd
# sizes; a kernel reading A as [m, batch*k] gives other sums.
BATCHED_A = [("avx2", "float32"), ("avx2", "uint8"), ("avx2", "int8"), ("avx2", "bfloat16"),
             ("avx512_vnni", "uint8"), ("avx512_bf16", "bfloat16")]


@pytest.mark.parametrize("isa,dtype", BATCHED_A)
@pytest.mark.parametrize("m,n,k,batch", [(7, 37, 8, 3), (5, 21, 12, 2)])
def test_batched_a_kernels(isa, dtype, m, n, k, batch):
    if not _isa.from_name(isa).requires <= HOST:
        pytest.skip(f"this host lacks {isa} (its code is checked in the assembly tests)")
    shape = dataclasses.replace(_shape(m, n, k, batch, isa, dtype), batched_a=True)
    assert shape.a_shape() == (batch, m, k) and find_impl(shape)[0] == isa
    _check(shape)


def test_batched_a_validation_and_impls():
    with pytest.raises(ValueError, match="batched_a needs batch > 1"):
        BrgemmShape(4, 16, 8, 1, batched_a=True)
    with pytest.raises(ValueError, match="flat or VNNI layout"):
        BrgemmShape(4, 16, 8, 2, layout="blocked", batched_a=True)
    # AMX's tile kernel reads A as [m, batch*k]: such shapes take the AVX-512 VNNI kernel.
    amx = BrgemmShape(16, 16, 64, 2, "uint8", "int32", "vnni4", "amx", batched_a=True)
    assert find_impl(amx)[0] == "avx512_vnni"
    assert find_impl(BrgemmShape(4, 16, 8, 2, isa="neon", batched_a=True))[0] == "generic"


def _run_edges(shape, left, right):
    """The kernel with its edge flags bound to ``left``, ``right``, and the sums with A's
    left-out values zeroed instead."""
    from schedules.nest import bind_call_vars

    sch = s_tir.Schedule(desc_func(shape, as_workload=True))
    call = sch.blockize(sch.get_loops(sch.get_sblock("brgemm"))[0])
    sch.tensorize(call, dispatch(shape))
    first, last = edge_rows()
    bind_call_vars(sch, call, {first.name: tvm.tirx.const(left, "bool"),
                               last.name: tvm.tirx.const(right, "bool")})
    kernel = tvm.compile(sch.mod, target=isa_target(shape.isa, MCPU[shape.isa]))
    a, b, c, ra, rb = _operands(shape, np.random.default_rng(5))
    out = tvm.runtime.tensor(c)
    kernel(tvm.runtime.tensor(a), tvm.runtime.tensor(b), out)
    whole = reference(shape, ra, rb, c)
    ra = ra.copy()
    if left:
        ra[:, 0, :shape.edge_k] = 0
    if right:
        ra[:, -1, shape.k - shape.edge_k:] = 0
    return out.numpy(), reference(shape, ra, rb, c), whole


@pytest.mark.parametrize("isa,dtype", BATCHED_A)
@pytest.mark.parametrize("m,n,k,batch,edge_k", [(7, 37, 12, 3, 4), (13, 64, 16, 2, 8),
                                                (1, 16, 8, 3, 4)])
def test_edge_rows_leave_out_their_edge_of_k(isa, dtype, m, n, k, batch, edge_k):
    """Where its flag holds, A's first row skips the first edge_k values of each block's K
    and its last row the last ones (a conv's border columns): odd sizes, column tails,
    several register tiles, a one-row A that is both edges."""
    if not _isa.from_name(isa).requires <= HOST:
        pytest.skip(f"this host lacks {isa} (its code is checked in the assembly tests)")
    shape = dataclasses.replace(_shape(m, n, k, batch, isa, dtype), batched_a=True,
                                edge_k=edge_k)
    for left in (False, True):
        for right in (False, True):
            got, expected, whole = _run_edges(shape, left, right)
            _assert_close(shape, got, expected)
            if left or right:  # the left-out products are not zero here
                assert not np.allclose(got, whole)


def test_edge_k_validation():
    with pytest.raises(ValueError, match="edge_k is 0, or at most half"):
        BrgemmShape(4, 16, 8, 2, edge_k=4)  # not batched_a
    with pytest.raises(ValueError, match="edge_k is 0, or at most half"):
        BrgemmShape(4, 16, 8, 2, batched_a=True, edge_k=5)
    with pytest.raises(ValueError, match="in whole vnni4 groups"):
        BrgemmShape(4, 16, 8, 2, "uint8", "int32", "vnni4", batched_a=True, edge_k=2)
    shape = BrgemmShape(4, 16, 8, 2, batched_a=True, edge_k=4)
    assert shape.name.endswith("_batcheda_edges4")


@pytest.mark.parametrize("mcpu", ["cascadelake", "znver4"])
def test_asm_batched_a_vpdpbusd(mcpu):
    shape = BrgemmShape(6, 64, 16, 3, "uint8", "int32", "vnni4", "avx512_vnni", batched_a=True)
    assert _count(r"^\s*vpdpbusd\s+.*%zmm", _asm(shape, mcpu)) >= 6


# ------------------------------------------------------------- instructions, for every ISA


def _asm(shape, mcpu=None, impl=None):
    return _build(shape, mcpu, impl).mod.inspect_source("asm")


def _count(pattern, asm):
    return len(re.findall(pattern, asm, re.MULTILINE))


def test_asm_fp32_avx2_is_ymm_fma_only():
    asm = _asm(_shape(6, 16, 8, 2, "avx2"))
    assert _count(r"vfmadd\d+ps\s+%ymm", asm) >= 12 and "zmm" not in asm


@pytest.mark.parametrize("mcpu", ["skylake-avx512", "cascadelake", "znver4"])
def test_asm_fp32_avx512_zmm(mcpu):
    assert _count(r"vfmadd\d+ps\s+%zmm", _asm(_shape(6, 64, 8, 2, "avx512"), mcpu)) >= 24


@pytest.mark.parametrize("isa,mcpu,pattern", [
    ("avx512_vnni", "cascadelake", r"^\s*vpdpbusd\s+.*%zmm"),
    ("avx512_vnni", "sapphirerapids", r"^\s*vpdpbusd\s+.*%zmm"),
    ("avx_vnni", "alderlake", r"^\s*\{vex\}\s*vpdpbusd\s+.*%ymm"),
])
def test_asm_vpdpbusd(isa, mcpu, pattern):
    asm = _asm(_shape(6, 64, 16, 2, isa, "uint8"), mcpu)
    assert _count(pattern, asm) >= 6 and "vpmaddwd" not in asm


@pytest.mark.parametrize("isa,dtype,mcpu,n,instruction,tail", [
    ("avx512_bf16", "bfloat16", "znver4", 21, "vdpbf16ps", "ymm"),
    ("avx512_bf16", "bfloat16", "znver4", 29, "vdpbf16ps", "zmm"),
    ("avx512_vnni", "uint8", "cascadelake", 21, "vpdpbusd", "ymm"),
    ("avx_vnni", "uint8", "alderlake", 13, "vpdpbusd", "ymm"),
])
def test_asm_dot_kernels_tail_columns_in_one_vector(isa, dtype, mcpu, n, instruction, tail):
    """The columns past the last whole vector take the dot instruction too (zero-padded), not
    scalar widening arithmetic: 6 rows x (1 whole vector + the tail) per K step; up to 8
    tail columns of a 512-bit ISA in a ymm register (half a zmm one's cost on Zen 4)."""
    asm = _asm(_shape(6, n, 8, 1, isa, dtype), mcpu)
    whole = "ymm" if isa == "avx_vnni" else "zmm"

    def dots(register: str) -> int:
        return _count(rf"^\s*(\{{vex\}}\s*)?{instruction}\s+.*%{register}", asm)

    assert dots(tail) >= (12 if tail == whole else 6)
    assert dots(whole) >= (12 if tail == whole else 6)
    # The scalar tail's byte/half loads and multiplies, one per row and column at least (24
    # and more before); an index computation may keep one.
    assert _count(r"^\s*(movz[bw]l|imull|vpmulld|v(fmadd\d+|mul)ss)\s", asm) < 6


def test_asm_int8_avx2_exact_uses_vpmaddwd_not_vpmaddubsw():
    asm = _asm(_shape(6, 16, 8, 2, "avx2", "uint8"))
    assert _count(r"vpmaddwd\s+.*%ymm", asm) >= 4 and "vpmaddubsw" not in asm


def test_asm_int8_w7_avx2():
    asm = _asm(_shape(6, 16, 8, 2, "avx2", "uint8", "vnni4_w7"))
    assert _count(r"vpmaddubsw\s+.*%ymm", asm) >= 4 and _count(r"vpmaddwd\s+", asm) >= 4


@pytest.mark.parametrize("mcpu", ["znver4", "sapphirerapids"])
def test_asm_vdpbf16ps(mcpu):
    assert _count(r"^\s*vdpbf16ps\s+.*%zmm", _asm(_shape(6, 32, 8, 2, "avx512_bf16",
                                                         "bfloat16"), mcpu)) >= 6


def test_asm_bf16_avx2_emulation():
    asm = _asm(_shape(6, 16, 8, 2, "avx2", "bfloat16"))
    assert _count(r"vfmadd\d+ps\s+%ymm", asm) >= 4 and "vpslld" in asm
    assert "dpbf16" not in asm and "zmm" not in asm


@pytest.mark.parametrize("isa,n,reg,accumulators", [("avx2", 16, "ymm", 12),
                                                    ("avx512", 64, "zmm", 24)])
def test_accumulators_stay_in_registers(isa, n, reg, accumulators):
    """The k loop of a 6-row fp32 tile: every accumulator is a register that FMAs update in
    place, with no vector stores and no stack traffic (C is loaded and stored once per tile)."""
    asm = _asm(_shape(6, n, 64, 2, isa))
    loops = re.findall(r"^(\.LBB\d+_\d+):\n(.*?)^\s*j\w+\s+\1$", asm, re.MULTILINE | re.DOTALL)
    body = max((b for _, b in loops), key=lambda b: _count(r"vfmadd", b))
    fmas = re.findall(rf"vfmadd231ps\s+%{reg}\d+, %{reg}\d+, (%{reg}\d+)", body)
    assert len(set(fmas)) == accumulators and len(fmas) >= accumulators
    assert not re.search(rf"vmovups\s+%{reg}\d+, ", body)
    assert "(%rsp)" not in body and "(%rbp)" not in body


def test_large_accumulator_tile_needs_no_heap_workspace():
    """AVX-512's 6x64 fp32 tile (1.5 KiB) is split by rows: no per-call workspace allocation."""
    shape = _shape(24, 128, 32, 4, "avx512")
    sch = s_tir.Schedule(desc_func(shape, as_workload=True))
    sch.tensorize(sch.get_loops(sch.get_sblock("brgemm"))[0], dispatch(shape))
    ex = tvm.compile(sch.mod, target=tvm.target.Target({"kind": "llvm", "mcpu": "cascadelake"}))
    assert "TVMBackendAllocWorkspace" not in ex.mod.inspect_source("ll")


# ---------------------------------------------------------------- tiles, registry, dispatch


@pytest.mark.parametrize("m,rows", [(7, 6), (12, 6), (64, 6), (1, 6), (13, 14), (5, 1)])
def test_row_tiles_cover_rows_evenly(m, rows):
    tiles = x86.row_tiles(m, rows)
    covered = [start + t * size + i for start, count, size in tiles
               for t in range(count) for i in range(size)]
    assert covered == list(range(m))
    sizes = {size for _, _, size in tiles}
    assert max(sizes) <= rows and max(sizes) - min(sizes) <= 1


def test_register_tiles():
    assert x86.register_tile(_shape(24, 64, 8, 1, "avx2"), x86.FP32) == x86.RegisterTile(6, 2, 8)
    assert x86.register_tile(_shape(24, 64, 8, 1, "avx512"), x86.FP32) == x86.RegisterTile(
        6, 4, 16)
    assert x86.register_tile(_shape(3, 5, 8, 1, "avx2"), x86.FP32) == x86.RegisterTile(3, 1, 8)
    for isa_name in ("avx2", "avx512"):
        regs = _isa.from_name(isa_name).vector_registers
        for family in (x86.FP32, x86.INT8_EXACT, x86.INT8_DOT, x86.BF16_EMULATED):
            t = x86.register_tile(_shape(64, 64, 8, 1, isa_name), family)
            used = t.rows * t.vectors + t.vectors * family.b_registers + family.a_registers
            assert used <= regs, (isa_name, family, t)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="positive"):
        x86.row_tiles(0, 6)
    with pytest.raises(ValueError, match="positive"):
        x86.RegisterTile(0, 1, 8)
    with pytest.raises(ValueError, match="uint8 A in a vnni4"):
        x86.int8_w7_impl(_shape(6, 16, 8, 1, "avx2"))
    with pytest.raises(ValueError):
        BrgemmShape(0, 16, 8)
    with pytest.raises(ValueError, match="divisible"):
        _shape(6, 16, 6, 1, "avx2", "uint8")
    with pytest.raises(ValueError, match="unknown ISA"):
        BrgemmShape(6, 16, 8, isa="avx9")


@pytest.mark.parametrize("isa,dtype,layout,expected", [
    ("avx2", "float32", "flat", "avx2"),
    ("avx512_vnni", "float32", "blocked", "avx512"),
    ("avx_vnni", "uint8", "vnni4", "avx_vnni"),
    ("avx512_bf16", "uint8", "vnni4", "avx512_vnni"),
    ("avx512_vnni", "int8", "vnni4", "avx512"),       # vpdpbusd is u8 x s8 only
    ("avx512_vnni", "bfloat16", "vnni2", "avx512"),   # no vdpbf16ps: exact emulation
    ("avx512_bf16", "bfloat16", "vnni2", "avx512_bf16"),
    ("avx2", "uint8", "flat", "generic"),
    ("avx512", "uint8", "vnni4_w7", "avx512"),             # vpmaddubsw, zmm
    ("avx512_vnni", "uint8", "vnni4_w7", "avx512_vnni"),   # a subset of vpdpbusd's range
    ("amx", "uint8", "vnni4_w7", "avx512_vnni"),
])
def test_find_impl_walks_the_isa_lineage(isa, dtype, layout, expected):
    acc = LAYOUT[dtype][0]
    assert find_impl(BrgemmShape(6, 16, 8, 1, dtype, acc, layout, isa))[0] == expected


def _signature(func):
    line = next(line for line in func.script().splitlines() if line.startswith("def "))
    return line[line.index("("):]


@pytest.mark.parametrize("isa,dtype,layout", [
    (isa, dtype, layout) for isa, dtype, layout in implementations()
    if isa != "generic" and _isa.from_name(isa).arch == "x86_64" and isa != "amx"])
def test_impl_buffers_match_desc(isa, dtype, layout):
    """Same shapes, dtypes, symbolic strides and offset_factor as the desc, for every impl."""
    shape = BrgemmShape(7, 37, 8, 3, dtype, LAYOUT[dtype][0], layout, isa)
    name, impl = find_impl(shape)
    assert name == isa
    assert _signature(impl) == _signature(desc_func(shape))


def test_dispatch_registers_once():
    shape = _shape(3, 11, 4, 2, "avx2")
    name = dispatch(shape)
    intrin = s_tir.TensorIntrin.get(name)
    assert dispatch(shape) == name == shape.name
    assert s_tir.TensorIntrin.get(name).same_as(intrin)


# ------------------------------------------------------------------- peak and bench-kernel


def test_fma_chain_microbenchmark_is_register_only():
    from microkernels.peak import fma_chain_func

    ex = tvm.compile(fma_chain_func(8, 12, 1000), target=isa_target("avx2"))
    asm = ex.mod.inspect_source("asm")
    loops = re.findall(r"^(\.LBB\d+_\d+):\n(.*?)^\s*j\w+\s+\1$", asm, re.MULTILINE | re.DOTALL)
    body = max((b for _, b in loops), key=lambda b: _count(r"vfmadd", b))
    fmas = re.findall(r"vfmadd\d+ps\s+(\S+), (\S+), (%ymm\d+)", body)
    assert len(fmas) >= 12 and len({acc for *_, acc in fmas}) == 12
    assert all(op.startswith("%ymm") for f in fmas for op in f)


def test_peak_formula_and_validation():
    from microkernels.peak import Peak, measure_peak

    assert Peak("avx2", 8, 2.5).peak_gflops == 2 * 8 * 2 * 2.5
    with pytest.raises(ValueError):
        Peak("avx2", 8, 0.0)
    with pytest.raises(ValueError, match="not x86"):
        measure_peak("neon")
    if not _isa.from_name("amx").runs_on(HOST):
        with pytest.raises(ValueError, match="cannot run amx"):
            measure_peak("amx")
    p = measure_peak("avx2", repeat=3)
    assert p.lanes == 8 and p.fma_units == 2 and p.peak_gflops == pytest.approx(32 * p.clock_ghz)


@pytest.mark.parametrize("avx512_gflops, expected", [(153.4, 64.0), (118.2, 32.0)])
def test_flops_per_cycle_sees_half_width_fma_pipes(monkeypatch, avx512_gflops, expected):
    """Cascade Lake's AVX-512 chains run 1.78x AVX2's, Zen 4's 1.0x: 64 vs 32 flops/cycle."""
    from microkernels import peak

    rates = {"avx2": 86.3 if expected == 64 else 118.2, "avx512": avx512_gflops}
    monkeypatch.setattr(peak, "measure_peak",
                        lambda name: peak.Peak(name, 8, rates[name] / 32))
    monkeypatch.setattr(peak._isa, "host_flags", lambda: _isa.from_name("avx512").requires)
    peak.flops_per_cycle.cache_clear()
    try:
        assert peak.flops_per_cycle("avx512") == expected
        assert peak.flops_per_cycle("avx2") == 32.0  # 256-bit ISAs are never measured
        assert peak.flops_per_cycle("amx") == 64.0  # not runnable here: nominal
        assert peak.flops_per_cycle("neon") == 16.0
    finally:
        peak.flops_per_cycle.cache_clear()

