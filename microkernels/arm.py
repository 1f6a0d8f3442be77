"""aarch64 BRGEMM kernels: NEON fp32 (``fmla``) and the MMLA block layout (``smmla``/``bfmmla``).

NEON fp32 (``isa="neon"``, layouts ``flat`` and ``blocked``)
    C stays in registers across the whole batch-reduce: ``m x n/4`` 128-bit accumulators; per
    K step ``n/4`` B vector loads, ``m`` A scalar loads and ``m * n/4`` lane-indexed ``fmla``.
    The ``n % 4`` tail columns use scalar ``fmadd`` (one register per accumulator).  The tile
    must fit the 32 vector registers, ``m*(n//4 + n%4) + ceil(n/4) + 1 <= 32``: the preferred
    tiles are **8x12** (24 accumulators + 3 B + 1 A = 28 registers), 6x16 and 4x16; larger
    tiles raise ``ValueError`` (they would spill).

MMLA layout (``layout="mmla"``; impls on ``isa="neon_i8mm"``)
    ``smmla``/``usmmla Vd.4s, Vn.16b, Vm.16b`` compute ``Cd(2x2) += An(2x8) . Bm(2x8)^T`` (int8,
    int32 accumulators; usmmla takes unsigned A), ``bfmmla Vd.4s, Vn.8h, Vm.8h`` the same with
    2x4 bf16 blocks into fp32.  So both operands are stored as 2-row blocks along K
    (``kb = 8`` for int8/uint8, ``kb = 4`` for bf16; ``K = batch * k``)::

        A  [m/2][K/kb][2][kb]   Ap[i2, kq, i, kk] = A[2*i2 + i, kq*kb + kk]
        B  [n/2][K/kb][2][kb]   Bp[j2, kq, j, kk] = B[kq*kb + kk, 2*j2 + j]   (B^T blocks)
        C  [m, n]               plain row-major, accumulated (int32 / fp32)

    ``C[i, j] += sum_K Ap[i//2, K//kb, i%2, K%kb] * Bp[j//2, K//kb, j%2, K%kb]``.
    m and n must be even, k a multiple of 8 (the layout's alpha; bf16 needs only 4 but shares
    it).  The kernel keeps ``m/2 x n/2`` 2x2 C blocks in registers:
    ``(m/2)*(n/2) + m/2 + n/2 <= 32``, e.g. 8x8 (16 accumulators + 8 operand registers).
    :mod:`microkernels.pack` has the numpy packers and TIR index maps
    (:func:`~microkernels.pack.pack_mmla`, :func:`~microkernels.pack.mmla_index_maps`).

bf16 vectors cannot reach LLVM intrinsics from TIR (TVM's BF16 legalization promotes them to
fp32), so ``bfmmla`` is called through a small LLVM-IR function that loads the two bf16 blocks
itself; the impl carries it as a ``pragma_import_llvm`` attribute, so nothing has to be
annotated after tensorize.  Its pointers are taken on ``uint16`` views of the bf16 buffers:
TVM stores a bf16 buffer a function allocates (the GEMM template's packed A) as float32, and
only a 16-bit view addresses its elements right.

Examples
--------
>>> from microkernels.brgemm import BrgemmShape, dispatch
>>> shape = BrgemmShape(8, 8, 16, 2, "int8", "int32", "mmla", "neon_i8mm")
>>> mmla_shapes(shape)  # packed A, packed B, C
((4, 4, 2, 8), (4, 4, 2, 8), (8, 8))
>>> dispatch(shape)  # doctest: +SKIP
'tpp_brgemm_neon_i8mm_int8_mmla_8x8x16x2'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .brgemm import BrgemmShape, reference, register_impl, register_layout
from .pack import MMLA_K_BLOCK, mmla_k_block, unpack_mmla
from .script_source import pin_source

if TYPE_CHECKING:
    import numpy as np
    from tvm.tirx import PrimFunc

# The TVMScript builders below parse the text this module was imported from.
pin_source(__name__)

__all__ = ["neon_fp32_impl", "mmla_desc", "mmla_impl", "mmla_shapes", "mmla_reference",
           "mmla_registers", "BFMMLA_LLVM_IR", "VECTOR_REGISTERS"]

VECTOR_REGISTERS = 32
LANES = 4  # fp32 lanes of a 128-bit register

#: LLVM IR linked into modules using bfmmla: fp32 2x2 += bf16 2x4 . (2x4)^T, operands by pointer.
#: ``linkonce_odr`` lets several kernels of one module import it.
BFMMLA_LLVM_IR = """
define linkonce_odr <4 x float> @tpp_bfmmla(<4 x float> %c, ptr %a, ptr %b) #0 {
  %va = load <8 x bfloat>, ptr %a, align 2
  %vb = load <8 x bfloat>, ptr %b, align 2
  %r = call <4 x float> @llvm.aarch64.neon.bfmmla(<4 x float> %c,
                                                  <8 x bfloat> %va, <8 x bfloat> %vb)
  ret <4 x float> %r
}
declare <4 x float> @llvm.aarch64.neon.bfmmla(<4 x float>, <8 x bfloat>, <8 x bfloat>)
attributes #0 = { alwaysinline nounwind "target-features"="+neon,+bf16" }
"""

#: dtype of A -> LLVM intrinsic of the int8 MMLA (B is int8).
_INT_MMLA = {"int8": "llvm.aarch64.neon.smmla", "uint8": "llvm.aarch64.neon.usmmla"}


# ---------------------------------------------------------------------------------------------
# NEON fp32
# ---------------------------------------------------------------------------------------------


@register_impl("neon", "float32", "flat")
@register_impl("neon", "float32", "blocked")
def neon_fp32_impl(shape: BrgemmShape) -> PrimFunc:
    """fp32 register-tiled kernel for the flat and blocked layouts (see module doc).

    Raises
    ------
    ValueError
        When the ``m x n`` tile needs more than the 32 vector registers.
    """
    from tvm.script import tirx as T

    if shape.dtype_a != "float32" or shape.layout not in ("flat", "blocked"):
        raise ValueError(f"NEON fp32 kernel cannot do {shape.dtype_a} {shape.layout}")
    m, n, k, batch = shape.m, shape.n, shape.k, shape.batch
    nv, nt = divmod(n, LANES)
    regs = m * (nv + nt) + nv + (1 if nt else 0) + 1
    if regs > VECTOR_REGISTERS:
        raise ValueError(
            f"NEON fp32 {m}x{n} register tile needs {regs} of the {VECTOR_REGISTERS} vector "
            "registers; use e.g. 8x12, 6x16 or 4x16"
        )
    blocked = shape.layout == "blocked"
    a_shape, b_shape = shape.a_shape(), shape.b_shape()
    a_region = tuple(slice(0, s) for s in a_shape)
    b_region = tuple(slice(0, s) for s in b_shape)

    def a_at(A, r, rb, kk):
        return A[rb, r, kk] if blocked else A[r, rb * k + kk]

    def b_row(B, rb, kk):
        return (rb, kk) if blocked else (rb * k + kk,)

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle):
        sa0 = T.int32()
        sa1 = T.int32()
        sb0 = T.int32()
        sb1 = T.int32()
        sc = T.int32()
        A = T.match_buffer(a, a_shape, "float32", offset_factor=1,
                           strides=[sa0, sa1, 1] if blocked else [sa0, 1])
        B = T.match_buffer(b, b_shape, "float32", offset_factor=1,
                           strides=[sb0, sb1, 1] if blocked else [sb0, 1])
        C = T.match_buffer(c, (m, n), "float32", offset_factor=1, strides=[sc, 1])
        with T.sblock("root"):
            T.reads(C[0:m, 0:n], A[a_region], B[b_region])
            T.writes(C[0:m, 0:n])
            acc = T.alloc_buffer((m, nv * LANES + nt), "float32", scope="local")
            for r in T.unroll(m):
                for v in T.unroll(nv):
                    acc[r, T.ramp(v * LANES, 1, LANES)] = C[r, T.ramp(v * LANES, 1, LANES)]
                for t in T.unroll(nt):
                    acc[r, nv * LANES + t] = C[r, nv * LANES + t]
            for rb, kk in T.grid(batch, k):
                for r in T.unroll(m):
                    for v in T.unroll(nv):
                        acc[r, T.ramp(v * LANES, 1, LANES)] = T.call_llvm_pure_intrin(
                            "float32x4", "llvm.fmuladd.v4f32",
                            T.broadcast(a_at(A, r, rb, kk), LANES),
                            B.vload(b_row(B, rb, kk) + (v * LANES,), "float32x4"),
                            acc[r, T.ramp(v * LANES, 1, LANES)])
                    for t in T.unroll(nt):
                        acc[r, nv * LANES + t] = T.call_llvm_pure_intrin(
                            "float32", "llvm.fmuladd.f32", a_at(A, r, rb, kk),
                            B[b_row(B, rb, kk) + (nv * LANES + t,)], acc[r, nv * LANES + t])
            for r in T.unroll(m):
                for v in T.unroll(nv):
                    C[r, T.ramp(v * LANES, 1, LANES)] = acc[r, T.ramp(v * LANES, 1, LANES)]
                for t in T.unroll(nt):
                    C[r, nv * LANES + t] = acc[r, nv * LANES + t]

    return impl


# ---------------------------------------------------------------------------------------------
# MMLA block layout
# ---------------------------------------------------------------------------------------------


def mmla_registers(m: int, n: int) -> int:
    """Vector registers an ``m x n`` MMLA kernel holds (even m, n): ``m/2 x n/2`` 2x2 C
    blocks plus one A and one B register per row and column pair; at most
    :data:`VECTOR_REGISTERS` (32) run as MMLA, larger blocks fall back to the generic loops.

    >>> mmla_registers(8, 8), mmla_registers(8, 10), mmla_registers(16, 16)
    (24, 29, 80)
    """
    return (m // 2) * (n // 2) + m // 2 + n // 2


def mmla_shapes(shape: BrgemmShape) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, int]]:
    """Shapes of packed A, packed B and C of one ``mmla``-layout kernel call.

    >>> mmla_shapes(BrgemmShape(4, 6, 8, 2, "bfloat16", "float32", "mmla", "neon_i8mm"))
    ((2, 4, 2, 4), (3, 4, 2, 4), (4, 6))
    """
    if shape.layout != "mmla":
        raise ValueError(f"not an mmla-layout shape: {shape.layout!r}")
    if shape.m % 2 or shape.n % 2:
        raise ValueError(
            f"the mmla layout needs even m and n (2x2 C blocks), got {shape.m}x{shape.n}"
        )
    kb, kq = mmla_k_block(shape.dtype_a), shape.batch * shape.k // mmla_k_block(shape.dtype_a)
    return (shape.m // 2, kq, 2, kb), (shape.n // 2, kq, 2, kb), (shape.m, shape.n)


def mmla_desc(shape: BrgemmShape, as_workload: bool = False) -> PrimFunc:
    """TIR semantics of an ``mmla``-layout BRGEMM (see module doc for the layout).

    With ``as_workload`` the buffers are dense and the loops sit in block ``"brgemm"`` of a
    function ``main``; otherwise the block pairs' strides are symbolic (any sub-tensor matches).
    """
    from tvm.script import tirx as T

    a_shape, b_shape, _ = mmla_shapes(shape)
    m, n, total_k = shape.m, shape.n, shape.batch * shape.k
    ta, tb, tc = shape.dtype_a, shape.dtype_b, shape.dtype_acc
    kb = a_shape[3]
    dense = as_workload
    a_region = tuple(slice(0, s) for s in a_shape)
    b_region = tuple(slice(0, s) for s in b_shape)

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle):
        if dense:
            T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        sa0 = T.int32()
        sa1 = T.int32()
        sb0 = T.int32()
        sb1 = T.int32()
        sc = T.int32()
        A = T.match_buffer(a, a_shape, ta, offset_factor=1,
                           strides=None if dense else [sa0, sa1, kb, 1])
        B = T.match_buffer(b, b_shape, tb, offset_factor=1,
                           strides=None if dense else [sb0, sb1, kb, 1])
        C = T.match_buffer(c, (m, n), tc, offset_factor=1, strides=None if dense else [sc, 1])
        with T.sblock("root" if not dense else "brgemm_root"):
            T.reads(C[0:m, 0:n], A[a_region], B[b_region])
            T.writes(C[0:m, 0:n])
            # One reduction loop over batch*k, as brgemm's strided layouts: the batch blocks
            # are consecutive K blocks here, so a GEMM's K loop split by batch*k matches.
            for i, j, kk in T.grid(m, n, total_k):
                with T.sblock("brgemm"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, kk])
                    C[vi, vj] = C[vi, vj] + T.Cast(
                        tc, A[vi // 2, vk // kb, vi % 2, vk % kb]
                    ) * T.Cast(tc, B[vj // 2, vk // kb, vj % 2, vk % kb])

    return desc


@register_impl("neon_i8mm", "int8", "mmla")
@register_impl("neon_i8mm", "uint8", "mmla")
@register_impl("neon_i8mm", "bfloat16", "mmla")
def mmla_impl(shape: BrgemmShape) -> PrimFunc:
    """smmla (int8), usmmla (uint8 A) or bfmmla (bf16) kernel for the ``mmla`` layout.

    Raises
    ------
    ValueError
        Odd m/n, or more than 32 registers for the ``m/2 x n/2`` accumulator blocks.
    """
    from tvm.script import tirx as T

    a_shape, b_shape, _ = mmla_shapes(shape)
    m, n = shape.m, shape.n
    ta, tb, tc = shape.dtype_a, shape.dtype_b, shape.dtype_acc
    m2, kq_total, _, kb = a_shape
    n2 = b_shape[0]
    regs = mmla_registers(m, n)
    if regs > VECTOR_REGISTERS:
        raise ValueError(
            f"MMLA {m}x{n} kernel needs {regs} of the {VECTOR_REGISTERS} vector registers; "
            "use e.g. 8x8, 8x10 or 4x16"
        )
    bf16 = ta == "bfloat16"
    lanes = "float32" if bf16 else "int32"
    a_region = tuple(slice(0, s) for s in a_shape)
    b_region = tuple(slice(0, s) for s in b_shape)

    def mmla(acc, A, B, i2, j2, kq):
        if bf16:
            return T.call_extern("float32x4", "tpp_bfmmla", acc,
                                 T.address_of(A[i2, kq, 0, 0]), T.address_of(B[j2, kq, 0, 0]))
        return T.call_llvm_pure_intrin("int32x4", _INT_MMLA[ta], acc,
                                       A.vload([i2, kq, 0, 0], f"{ta}x16"),
                                       B.vload([j2, kq, 0, 0], f"{tb}x16"))

    @T.macro
    def kernel(A, B, C):
        acc = T.alloc_buffer((m2, n2, 4), tc, scope="local")
        for i2 in T.unroll(m2):
            for j2 in T.unroll(n2):
                acc[i2, j2, T.ramp(0, 1, 4)] = T.vectorcombine(
                    C.vload([i2 * 2, j2 * 2], f"{lanes}x2"),
                    C.vload([i2 * 2 + 1, j2 * 2], f"{lanes}x2"), dtype=f"{lanes}x4")
        for kq in T.serial(kq_total):
            for i2 in T.unroll(m2):
                for j2 in T.unroll(n2):
                    acc[i2, j2, T.ramp(0, 1, 4)] = mmla(
                        acc[i2, j2, T.ramp(0, 1, 4)], A, B, i2, j2, kq)
        for i2 in T.unroll(m2):
            for j2 in T.unroll(n2):
                C[i2 * 2, T.ramp(j2 * 2, 1, 2)] = T.vectorlow(
                    acc[i2, j2, T.ramp(0, 1, 4)], dtype=f"{lanes}x2")
                C[i2 * 2 + 1, T.ramp(j2 * 2, 1, 2)] = T.vectorhigh(
                    acc[i2, j2, T.ramp(0, 1, 4)], dtype=f"{lanes}x2")

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle):
        sa0 = T.int32()
        sa1 = T.int32()
        sb0 = T.int32()
        sb1 = T.int32()
        sc = T.int32()
        A = T.match_buffer(a, a_shape, ta, offset_factor=1, strides=[sa0, sa1, kb, 1])
        B = T.match_buffer(b, b_shape, tb, offset_factor=1, strides=[sb0, sb1, kb, 1])
        C = T.match_buffer(c, (m, n), tc, offset_factor=1, strides=[sc, 1])
        with T.sblock("root"):
            T.reads(C[0:m, 0:n], A[a_region], B[b_region])
            T.writes(C[0:m, 0:n])
            if bf16:  # links the bfmmla helper into the module
                # The helper reads raw bf16 bits: through uint16 views (module doc).
                A16 = T.decl_buffer(a_shape, "uint16", data=A.data, strides=[sa0, sa1, kb, 1],
                                    elem_offset=A.elem_offset)
                B16 = T.decl_buffer(b_shape, "uint16", data=B.data, strides=[sb0, sb1, kb, 1],
                                    elem_offset=B.elem_offset)
                with T.attr(T.int32(0), "pragma_import_llvm", BFMMLA_LLVM_IR):
                    kernel(A16, B16, C)
            else:
                kernel(A, B, C)

    return impl


def mmla_reference(shape: BrgemmShape, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """numpy ``c + BRGEMM(a, b)`` for packed ``mmla``-layout operands (bf16 as uint16 bits)."""
    a_shape, b_shape, _ = mmla_shapes(shape)
    if a.shape != a_shape or b.shape != b_shape:
        raise ValueError(f"expected packed A{a_shape} and B{b_shape}, got {a.shape} and {b.shape}")
    total_k = shape.batch * shape.k
    flat = BrgemmShape(shape.m, shape.n, total_k, 1, shape.dtype_a, shape.dtype_acc, "flat",
                       shape.isa)
    return reference(flat, unpack_mmla(a, (shape.m, total_k), "a"),
                     unpack_mmla(b, (total_k, shape.n), "b"), c)


register_layout("mmla", alpha=8, dtypes=frozenset(MMLA_K_BLOCK), shapes=mmla_shapes,
                reference=mmla_reference)(mmla_desc)
