"""aarch64 BRGEMM kernels (microkernels.arm): NEON fp32 ``fmla`` and MMLA smmla/usmmla/bfmmla.

Every kernel is compiled for aarch64 (+neon +i8mm +bf16) and its assembly checked for the
instruction; then the same object is linked with tests/aarch64/driver.c and run under
``qemu-aarch64 -cpu max`` on random data, compared with numpy (tests/qemu_aarch64.py).  The
qemu tests skip when qemu-user or gcc-aarch64-linux-gnu is missing.  The MMLA desc itself is
also executed on the host through the generic fallback, and the MMLA packing is checked here.
"""

import functools
import re

import ml_dtypes
import numpy as np
import pytest
import tvm
from qemu_aarch64 import TARGET, QemuRunner, missing
from tvm import s_tir
from tvm.script import tirx as T

from microkernels import arm
from microkernels.brgemm import BrgemmShape, desc_func, dispatch, find_impl, implementations
from microkernels.brgemm import reference as flat_reference
from microkernels.pack import mmla_index_maps, mmla_k_block, pack_mmla, unpack_mmla

ACC = {"float32": "float32", "bfloat16": "float32", "int8": "int32", "uint8": "int32"}


def neon(m, n, k, batch, layout="flat"):
    return BrgemmShape(m, n, k, batch, "float32", "float32", layout, "neon")


def mmla(m, n, k, batch, dtype):
    return BrgemmShape(m, n, k, batch, dtype, ACC[dtype], "mmla", "neon_i8mm")


# (kernel, row blocks, column blocks): the workload is a rows x cols grid of kernel calls.
CASES = {
    "neon_8x12": (neon(8, 12, 16, 3), 1, 1),
    "neon_blocked_odd": (neon(5, 10, 7, 3, "blocked"), 1, 1),  # 2 vectors + 2 scalar columns
    "neon_tiled_tail": (neon(3, 7, 5, 2), 3, 2),  # 9x14 from 3x7 kernels
    "neon_blocked_4x16_tiled": (neon(4, 16, 9, 2, "blocked"), 2, 2),
    "smmla_8x8": (mmla(8, 8, 16, 2, "int8"), 1, 1),
    "smmla_tiled": (mmla(8, 8, 16, 2, "int8"), 2, 3),
    "usmmla_6x4": (mmla(6, 4, 8, 3, "uint8"), 1, 2),
    "bfmmla_8x8": (mmla(8, 8, 8, 2, "bfloat16"), 1, 1),
    "bfmmla_tiled": (mmla(4, 6, 16, 1, "bfloat16"), 2, 2),
}
INSTRUCTION = {"float32": "fmla", "int8": "smmla", "uint8": "usmmla", "bfloat16": "bfmmla"}


def _tiled(kernel: BrgemmShape, rows: int, cols: int, intrin: str | None = None):
    big = BrgemmShape(kernel.m * rows, kernel.n * cols, kernel.k, kernel.batch, kernel.dtype_a,
                      kernel.dtype_acc, kernel.layout, kernel.isa)
    sch = s_tir.Schedule(desc_func(big, as_workload=True))
    i, j, k = sch.get_loops(sch.get_sblock("brgemm"))
    i0, i1 = sch.split(i, [None, kernel.m])
    j0, j1 = sch.split(j, [None, kernel.n])
    sch.reorder(i0, j0, i1, j1, k)
    sch.tensorize(i1, intrin or dispatch(kernel))
    return big, sch.mod


# TVMScript parsed when a test asks: parsed at import, each function costs ~0.3 s per worker.
@functools.cache
def _build(case: str):
    kernel, rows, cols = CASES[case]
    big, mod = _tiled(kernel, rows, cols)
    return big, tvm.compile(mod, target=tvm.target.Target(TARGET))


def _operands(shape: BrgemmShape, seed: int):
    rng = np.random.default_rng(seed)
    if shape.layout == "mmla":
        a_shape, b_shape, _ = arm.mmla_shapes(shape)
    else:
        a_shape, b_shape = shape.a_shape(), shape.b_shape()

    def draw(dtype, shape_):
        if dtype == "int8":
            return rng.integers(-128, 128, shape_).astype(np.int8)
        if dtype == "uint8":
            return rng.integers(0, 256, shape_).astype(np.uint8)
        if dtype == "int32":
            return rng.integers(-1000, 1000, shape_).astype(np.int32)
        return rng.standard_normal(shape_).astype(
            ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)

    return (draw(shape.dtype_a, a_shape), draw(shape.dtype_b, b_shape),
            draw(shape.dtype_acc, (shape.m, shape.n)))


def _expected(shape: BrgemmShape, a, b, c):
    bits = [x.view(np.uint16) if x.dtype == ml_dtypes.bfloat16 else x for x in (a, b)]
    ref = arm.mmla_reference if shape.layout == "mmla" else flat_reference
    return ref(shape, *bits, c)


def _check(shape: BrgemmShape, got, want):
    if shape.dtype_acc == "int32":
        np.testing.assert_array_equal(got, want)
    else:  # fp32 accumulation (bfmmla: round-to-odd partial sums) vs float64 numpy
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * shape.batch * shape.k)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    reason = missing()
    if reason:
        pytest.skip(f"cannot run aarch64 code: {reason}")
    return QemuRunner(tmp_path_factory.mktemp("qemu"))


# -------------------------------------------------------------------------- registration


def test_registered_implementations():
    impls = implementations()
    for key in [("neon", "float32", "flat"), ("neon", "float32", "blocked"),
                ("neon_i8mm", "int8", "mmla"), ("neon_i8mm", "uint8", "mmla"),
                ("neon_i8mm", "bfloat16", "mmla")]:
        assert key in impls
    assert find_impl(mmla(8, 8, 8, 1, "int8"))[0] == "neon_i8mm"
    fp32_on_i8mm = BrgemmShape(8, 12, 8, 1, "float32", "float32", "flat", "neon_i8mm")
    assert find_impl(fp32_on_i8mm)[0] == "neon"  # through the ISA lineage
    assert find_impl(BrgemmShape(8, 8, 8, 1, "int8", "int32", "mmla", "neon"))[0] == "generic"


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: arm.neon_fp32_impl(neon(8, 16, 8, 1)), "needs 37 of the 32 vector registers"),
        (lambda: arm.mmla_impl(mmla(16, 16, 8, 1, "int8")), "needs 80 of the 32"),
        (lambda: desc_func(mmla(3, 4, 8, 1, "int8")), "even m and n"),
        (lambda: arm.mmla_shapes(neon(4, 4, 4, 1)), "not an mmla-layout"),
        (lambda: mmla(4, 4, 4, 1, "int8"), "k divisible by 8"),
    ],
)
def test_invalid_shapes_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ------------------------------------------------------------------------------ packing


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
@pytest.mark.parametrize("operand, shape", [("a", (7, 13)), ("b", (13, 5)), ("a", (2, 8))])
def test_mmla_pack_roundtrip_and_index_maps(dtype, operand, shape):
    kb = mmla_k_block(dtype)
    x = np.arange(1, shape[0] * shape[1] + 1, dtype=np.int32).reshape(shape)
    packed = pack_mmla(x, kb, operand)
    rows, k = shape if operand == "a" else shape[::-1]
    assert packed.shape == (-(-rows // 2), -(-k // kb), 2, kb)
    assert packed.sum() == x.sum()  # padding is zeros
    np.testing.assert_array_equal(unpack_mmla(packed, shape, operand), x)
    forward, inverse = mmla_index_maps(kb, operand)
    for idx in np.ndindex(*shape):
        assert packed[forward(*idx)] == x[idx]
        assert inverse(*forward(*idx)) == idx


def test_mmla_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="operand"):
        pack_mmla(np.zeros((2, 8)), 8, "c")
    with pytest.raises(ValueError, match="no MMLA"):
        mmla_k_block("float32")
    with pytest.raises(ValueError, match="does not fit"):
        unpack_mmla(np.zeros((1, 1, 2, 8)), (3, 8))


@pytest.mark.parametrize("dtype", ["int8", "uint8", "bfloat16"])
def test_mmla_desc_on_host_matches_numpy(dtype):
    """The MMLA semantics, run through the generic fallback (an x86 ISA has no MMLA impl)."""
    kernel = BrgemmShape(4, 6, 8, 3, dtype, ACC[dtype], "mmla", "avx2")
    assert find_impl(kernel)[0] == "generic"
    big, mod = _tiled(kernel, 2, 1)
    a, b, c = _operands(big, seed=1)
    out = tvm.runtime.tensor(c)
    ex = tvm.compile(mod, target=tvm.target.Target({"kind": "llvm", "mcpu": "haswell"}))
    ex(tvm.runtime.tensor(a), tvm.runtime.tensor(b), out)
    _check(big, out.numpy(), _expected(big, a, b, c))


# --------------------------------------------------------------- aarch64: asm, then qemu


@pytest.mark.parametrize("case", list(CASES))
def test_aarch64_asm_has_instruction(case):
    kernel = CASES[case][0]
    asm = _build(case)[1].mod.inspect_source("asm")
    op = INSTRUCTION[kernel.dtype_a]
    count = sum(line.split()[:1] == [op] for line in asm.splitlines())
    if op == "fmla":
        # lane-indexed fmla on 4 x fp32 vectors, at least one per accumulator register
        assert count >= kernel.m * (kernel.n // 4)
        assert re.search(r"fmla\tv\d+\.4s, v\d+\.4s, v\d+\.s\[\d\]", asm)
        assert ("fmadd\ts" in asm) == bool(kernel.n % 4)  # scalar tail columns
    else:
        assert count >= (kernel.m // 2) * (kernel.n // 2)


@pytest.mark.parametrize("case", list(CASES))
def test_aarch64_kernel_under_qemu(runner, case):
    big, ex = _build(case)
    a, b, c = _operands(big, seed=len(case))
    got = runner.run(ex.mod, [a, b, c])[2]
    _check(big, got, _expected(big, a, b, c))


def test_mmla_odd_problem_through_padding(runner):
    """A 7x20 by 20x5 int8 product: packing pads to 8x24 / 24x6, the kernel result is cropped."""
    rng = np.random.default_rng(3)
    a = rng.integers(-128, 128, (7, 20)).astype(np.int8)
    b = rng.integers(-128, 128, (20, 5)).astype(np.int8)
    kernel = mmla(8, 6, 8, 3, "int8")
    sch = s_tir.Schedule(desc_func(kernel, as_workload=True))
    sch.tensorize(sch.get_loops(sch.get_sblock("brgemm"))[0], dispatch(kernel))
    ex = tvm.compile(sch.mod, target=tvm.target.Target(TARGET))
    c = np.zeros((8, 6), np.int32)
    got = runner.run(ex.mod, [pack_mmla(a, 8, "a"), pack_mmla(b, 8, "b"), c])[2]
    np.testing.assert_array_equal(got[:7, :5], a.astype(np.int64) @ b)
    np.testing.assert_array_equal(got[7:, :], 0)
    np.testing.assert_array_equal(got[:, 5:], 0)


M, N, K = 16, 16, 48


@functools.cache
def _plain_int8_gemm_ir():
    @T.prim_func(s_tir=True)
    def _plain_int8_gemm(A: T.Buffer((M, K), "int8"), B: T.Buffer((K, N), "int8"),
                         C: T.Buffer((M, N), "int32")):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        for i, j, k in T.grid(M, N, K):
            with T.sblock("gemm"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                C[vi, vj] = C[vi, vj] + T.Cast("int32", A[vi, vk]) * T.Cast("int32", B[vk, vj])
    return _plain_int8_gemm


def test_mmla_index_maps_let_a_plain_gemm_tensorize(runner):
    """transform_layout with pack.mmla_index_maps turns a row-major GEMM into MMLA kernel calls."""
    sch = s_tir.Schedule(_plain_int8_gemm_ir())
    block = sch.get_sblock("gemm")
    sch.transform_layout(block, "A", mmla_index_maps(8, "a")[0])
    sch.transform_layout(block, "B", mmla_index_maps(8, "b")[0])
    i, j, k = sch.get_loops(block)
    i0, i1 = sch.split(i, [None, 8])
    j0, j1 = sch.split(j, [None, 4])
    k0, k1 = sch.split(k, [None, 24])
    sch.reorder(i0, j0, k0, i1, j1, k1)
    sch.tensorize(i1, dispatch(mmla(8, 4, 8, 3, "int8")))  # 2 K blocks of 24 = 3 x 8
    ex = tvm.compile(sch.mod, target=tvm.target.Target(TARGET))
    assert "smmla" in ex.mod.inspect_source("asm")
    rng = np.random.default_rng(4)
    a = rng.integers(-128, 128, (M, K)).astype(np.int8)
    b = rng.integers(-128, 128, (K, N)).astype(np.int8)
    c = rng.integers(-1000, 1000, (M, N)).astype(np.int32)
    got = runner.run(ex.mod, [pack_mmla(a, 8, "a"), pack_mmla(b, 8, "b"), c])[2]
    np.testing.assert_array_equal(got, c + a.astype(np.int64) @ b)


def test_oversized_tiles_fall_back_to_generic():
    """A shape a kernel refuses is dispatched to the next implementation, not an error."""
    assert find_impl(neon(8, 16, 8, 1))[0] == "generic"
    assert find_impl(mmla(16, 16, 8, 1, "int8"))[0] == "generic"
    assert dispatch(neon(8, 16, 8, 1))
