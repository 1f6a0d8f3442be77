"""AMX BRGEMM kernels (Sapphire Rapids tiles): int8 ``tdpbusd``/``tdpbssd``, bf16 ``tdpbf16ps``.

AMX has 8 tile registers of up to 16 rows x 64 bytes.  One kernel call keeps the whole C block
in tiles across the entire batch-reduce (output-stationary, [TPP] Fig. 2):

* C is split into row tiles of 16 rows (last one ``m % 16``) and column tiles of 16 int32/fp32
  columns (last one ``n % 16``): ``rm x cn`` C tiles, plus ``rm`` A tiles and ``cn`` B tiles,
  which must fit the 8 registers: ``rm*cn + rm + cn <= 8``.  So ``m <= 32, n <= 32`` (2x2 C tiles,
  the paper's 32x32 bf16 kernel), or ``m <= 48, n <= 16``, or ``m <= 16, n <= 48``;
  anything larger raises ``ValueError`` (block the problem in the schedule instead).
* K (``batch * k``: the batch blocks are contiguous along K in the vnni layouts) is walked in
  steps of ``kt`` elements, the largest multiple of the VNNI factor that divides K and fits a
  64-byte tile row (64 for int8, 32 for bf16); AMX runs at full rate when ``kt`` is 64/32.
  Where whole tile rows and one shorter last step take fewer steps (ShuffleNet's 68-channel
  groups in bf16: 32 + 32 + 4, not 17 steps of 4), the last step's ``tail`` elements are
  copied into zeroed tile-sized scratch operands, so every step keeps the one tile
  configuration (a second ``ldtilecfg`` costs more than the steps saved) and never reads
  past the operands.
* Per call: ``ldtilecfg`` once, ``tileloadd`` of the C tiles (``tilezero`` for a ``beta=0``
  kernel, which overwrites C: no zeroing pass before it, no C read; a ``first_call_zeroes``
  kernel branches between the two on :func:`~microkernels.brgemm.first_call`), then per K step the A
  and B tile loads and ``rm*cn`` tile multiplies, then ``tilestored`` of C and
  ``tilerelease``.  A scheduled kernel whose calls all share one configuration loads it once
  per thread instead (:mod:`schedules.tile_config` drops the calls' own).

Operands are those of the ``vnni4`` (u8/s8 A, s8 B, int32 C) and ``vnni2`` (bf16 A and B, fp32 C)
layouts of :mod:`microkernels.brgemm`; B's ``[n, alpha]`` rows must be dense (they are, in any
VNNI-packed tensor).  The LLVM intrinsics are used in their tile-number form
(``llvm.x86.tileloadd64(i8 tile, ptr, i64 stride)``): the ``.internal`` x86_amx-value form
cannot be chained from TIR.  bf16 operands are read through ``uint16`` views of their
buffers (as the x86 kernels do): TVM stores a bf16 buffer a function allocates (a packed or
K-padded copy of A) as float32, and only a 16-bit view addresses its elements right.  The A
and B tile pointers are the views' ``access_ptr`` (``T.address_of`` an element of a view
fails in TVM's FlattenBuffer once the viewed buffer is compacted to one task's region, as
the batch GEMM's packed panels are); ``access_ptr`` on a bfloat16 buffer itself trips
TVM's bf16 legalization.

Running AMX code on Linux needs per-process permission (without it the first tile instruction
kills the process with SIGILL): every process that may execute AMX code calls
:func:`tiles_usable` before its first kernel runs, and dispatches no AMX kernel when it says
False (:mod:`microkernels.machine` asks it for the host's ISA).

Examples
--------
>>> from microkernels.brgemm import BrgemmShape
>>> p = plan(BrgemmShape(32, 32, 64, 4, "uint8", "int32", "vnni4", "amx"))
>>> (p.rows, p.cols, p.kt, p.steps)
((16, 16), (16, 16), 64, 4)
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import isa as _isa
from .brgemm import BrgemmShape, first_call, register_impl
from .script_source import pin_source

if TYPE_CHECKING:
    from tvm.tirx import PrimExpr, PrimFunc

# The TVMScript builders below parse the text this module was imported from.
pin_source(__name__)

__all__ = ["TilePlan", "plan", "impl_func", "request_permission", "tiles_usable",
           "EMULATOR_SYMBOLS", "OPS_PER_CYCLE"]

TILE_ROWS = 16
TILE_BYTES = 64
NUM_TILES = 8

#: dtype of A -> (bytes per element, tile multiply instruction).
_OPS: dict[str, tuple[int, str]] = {
    "uint8": (1, "tdpbusd"),
    "int8": (1, "tdpbssd"),
    "bfloat16": (2, "tdpbf16ps"),
}

#: One core's AMX peak in ops per cycle (a multiply-add is 2 ops) by dtype of A, Sapphire
#: Rapids' figures; ``bench-kernel --isa amx`` reports the fraction of it a kernel reaches.
OPS_PER_CYCLE: dict[str, int] = {"uint8": 2048, "int8": 2048, "bfloat16": 1024}

#: Functions an AMX emulator must export for :func:`impl_func` with ``emulate=True``.
EMULATOR_SYMBOLS = tuple(
    f"tpp_amx_emu_{op}"
    for op in ("ldtilecfg", "tileloadd64", "tilestored64", "tilerelease", "tilezero")
    + tuple(op for _, op in _OPS.values())
)


def _split(extent: int) -> tuple[int, ...]:
    full, rest = divmod(extent, TILE_ROWS)
    return (TILE_ROWS,) * full + ((rest,) if rest else ())


@dataclass(frozen=True)
class TilePlan:
    """How one BRGEMM call maps onto the AMX tile registers.

    Parameters
    ----------
    rows
        Rows of each C row tile (A tile ``i`` holds the same rows); tile ``i`` starts at ``16*i``.
    cols
        C columns of each column tile; tile ``j`` starts at column ``16*j``.
    kt
        K elements consumed per tile multiply (a multiple of ``alpha``).
    steps
        Number of K steps (``batch * k / kt``).
    elem_bytes, alpha
        Bytes per A/B element and the VNNI factor (4 for int8, 2 for bf16).
    op
        Tile multiply instruction (``tdpbusd``, ``tdpbssd`` or ``tdpbf16ps``).
    tail
        K elements of one last step after the ``steps`` full ones, read through zero-padded
        copies of the operands (0: none).
    """

    rows: tuple[int, ...]
    cols: tuple[int, ...]
    kt: int
    steps: int
    elem_bytes: int
    alpha: int
    op: str
    tail: int = 0

    def __post_init__(self) -> None:
        sizes = self.rows + self.cols
        if not self.rows or not self.cols or any(not 0 < r <= TILE_ROWS for r in sizes):
            raise ValueError(f"tile rows/cols must be 1..{TILE_ROWS}: {self.rows}, {self.cols}")
        if len(self.rows) * len(self.cols) + len(self.rows) + len(self.cols) > NUM_TILES:
            raise ValueError(f"{len(self.rows)}x{len(self.cols)} C tiles need more than 8 tiles")
        if self.kt % self.alpha or self.kt * self.elem_bytes > TILE_BYTES or self.steps < 1:
            raise ValueError(f"invalid K step {self.kt} for alpha={self.alpha}")
        if self.tail % self.alpha or not 0 <= self.tail < self.kt:
            raise ValueError(f"invalid K tail {self.tail} for kt={self.kt}, alpha={self.alpha}")

    @property
    def num_c(self) -> int:
        return len(self.rows) * len(self.cols)

    def c_tile(self, i: int, j: int) -> int:
        return i * len(self.cols) + j

    def a_tile(self, i: int) -> int:
        return self.num_c + i

    def b_tile(self, j: int) -> int:
        return self.num_c + len(self.rows) + j

    def tiles(self) -> list[tuple[int, int]]:
        """(rows, bytes per row) of tiles 0..7 in the plan's numbering; (0, 0) = unused."""
        shapes = [(0, 0)] * NUM_TILES
        for i, r in enumerate(self.rows):
            shapes[self.a_tile(i)] = (r, self.kt * self.elem_bytes)
            for j, c in enumerate(self.cols):
                shapes[self.c_tile(i, j)] = (r, 4 * c)
        for j, c in enumerate(self.cols):
            shapes[self.b_tile(j)] = (self.kt // self.alpha, 4 * c)
        return shapes

    def config(self) -> bytes:
        """The 64-byte ``ldtilecfg`` operand: palette 1, per-tile bytes per row and rows."""
        cfg = bytearray(64)
        cfg[0] = 1
        for t, (rows, colsb) in enumerate(self.tiles()):
            cfg[16 + 2 * t : 18 + 2 * t] = colsb.to_bytes(2, "little")
            cfg[48 + t] = rows
        return bytes(cfg)


def plan(shape: BrgemmShape) -> TilePlan:
    """The tile plan for ``shape``; ``ValueError`` when AMX cannot hold it in one call.

    Raises
    ------
    ValueError
        Wrong dtype/layout pairing, or C larger than the tile registers allow (see module doc).
    """
    if shape.dtype_a not in _OPS:
        raise ValueError(f"AMX has no {shape.dtype_a} tile multiply; supported: {', '.join(_OPS)}")
    elem_bytes, op = _OPS[shape.dtype_a]
    want = "vnni2" if shape.dtype_a == "bfloat16" else "vnni4"
    if shape.layout != want:
        raise ValueError(
            f"AMX {shape.dtype_a} kernels need the {want!r} layout, got {shape.layout!r}"
        )
    rows, cols = _split(shape.m), _split(shape.n)
    if len(rows) * len(cols) + len(rows) + len(cols) > NUM_TILES:
        raise ValueError(
            f"AMX BRGEMM {shape.m}x{shape.n} needs {len(rows)}x{len(cols)} C tiles plus "
            f"{len(rows)} A and {len(cols)} B tiles, more than the 8 tile registers; use "
            "m, n <= 32, or m <= 48 with n <= 16, or m <= 16 with n <= 48"
        )
    total_k, alpha, row = shape.batch * shape.k, shape.alpha, TILE_BYTES // elem_bytes
    kt = max(d for d in range(alpha, row + 1, alpha) if total_k % d == 0)
    if -(-total_k // row) < total_k // kt:  # whole rows and a tail step: fewer steps
        return TilePlan(rows, cols, row, total_k // row, elem_bytes, alpha, op, total_k % row)
    return TilePlan(rows, cols, kt, total_k // kt, elem_bytes, alpha, op)


def impl_func(shape: BrgemmShape, emulate: bool = False) -> PrimFunc:
    """The AMX implementation of ``shape`` (same buffers as ``brgemm.desc_func(shape)``).

    Parameters
    ----------
    emulate
        Call ``tpp_amx_emu_<instruction>`` C functions (:data:`EMULATOR_SYMBOLS`, int32 result,
        tile numbers as int32) instead of the AMX instructions, with everything else identical.
        This lets a host without AMX execute the very same tile program against an emulator,
        which is how the tests check this kernel's numerics.
    """
    import tvm.s_tir
    import tvm.tirx as tir
    from tvm.script import tirx as T

    p = plan(shape)
    m, n, k_total = shape.m, shape.n, shape.batch * shape.k
    ta, tb, tc = shape.dtype_a, shape.dtype_b, shape.dtype_acc
    alpha, kt, eb, steps = p.alpha, p.kt, p.elem_bytes, p.steps
    nr, nc, num_c = len(p.rows), len(p.cols), p.num_c
    cfg = p.config()
    words = tuple(int.from_bytes(cfg[8 * w : 8 * w + 8], "little") for w in range(8))

    def amx(op: str, *args: PrimExpr, tiles: int = 0) -> PrimExpr:
        """One AMX instruction; the first ``tiles`` arguments are tile numbers."""
        if emulate:
            conv = [tir.Cast("int32", a) for a in args[:tiles]] + list(args[tiles:])
            return tir.call_extern("int32", f"tpp_amx_emu_{op}", *conv)
        conv = [tir.Cast("int8", a) for a in args[:tiles]] + list(args[tiles:])
        return tir.call_llvm_intrin("void", f"llvm.x86.{op}", *conv)

    bf16 = ta == "bfloat16"
    zeroing = shape.beta == 0
    first = first_call() if shape.first_call_zeroes else None

    @T.macro
    def load_c(C, sc, zero):
        for i in T.unroll(nr):
            for j in T.unroll(nc):
                if zero:
                    T.evaluate(amx("tilezero", i * nc + j, tiles=1))
                else:
                    T.evaluate(amx("tileloadd64", i * nc + j, T.address_of(C[i * 16, j * 16]),
                                   T.Cast("int64", sc * 4), tiles=1))

    tail, at, bt = p.tail > 0, ("uint16" if bf16 else ta), ("uint16" if bf16 else tb)

    @T.macro
    def tail_step(A, B):
        # Tile-sized copies of the last K elements, zero beyond them: the tail's products
        # read no operand past K, and zeros on both sides add nothing (not even NaN).
        a_pad = T.alloc_buffer((TILE_ROWS, kt), at, scope="local")
        b_pad = T.alloc_buffer((kt // alpha, TILE_ROWS * alpha), bt, scope="local")
        for r, e in T.grid(TILE_ROWS, kt):
            a_pad[r, e] = T.Cast(at, 0)
        for r, e in T.grid(kt // alpha, TILE_ROWS * alpha):
            b_pad[r, e] = T.Cast(bt, 0)
        for i in T.unroll(nr):
            for r, e in T.grid(TILE_ROWS, p.tail):
                if i * 16 + r < m:
                    a_pad[r, e] = A[i * 16 + r, steps * kt + e]
            T.evaluate(amx("tileloadd64", num_c + i, T.address_of(a_pad[0, 0]),
                           T.int64(TILE_BYTES), tiles=1))
        for j in T.unroll(nc):
            for r, col, e in T.grid(p.tail // alpha, TILE_ROWS, alpha):
                if j * 16 + col < n:
                    b_pad[r, col * alpha + e] = B[steps * (kt // alpha) + r, j * 16 + col, e]
            T.evaluate(amx("tileloadd64", num_c + nr + j, T.address_of(b_pad[0, 0]),
                           T.int64(TILE_BYTES), tiles=1))
        for i in T.unroll(nr):
            for j in T.unroll(nc):
                T.evaluate(amx(p.op, i * nc + j, num_c + i, num_c + nr + j, tiles=3))

    @T.macro
    def program(A, B, C, sa, sb, sc):
        config = T.alloc_buffer((8,), "int64", scope="local")
        config[0] = T.int64(words[0])
        config[1] = T.int64(words[1])
        config[2] = T.int64(words[2])
        config[3] = T.int64(words[3])
        config[4] = T.int64(words[4])
        config[5] = T.int64(words[5])
        config[6] = T.int64(words[6])
        config[7] = T.int64(words[7])
        T.evaluate(amx("ldtilecfg", config.access_ptr("r")))
        if first is not None:
            if first:
                load_c(C, sc, True)
            else:
                load_c(C, sc, False)
        else:
            load_c(C, sc, zeroing)
        for s in T.serial(steps):
            for i in T.unroll(nr):
                T.evaluate(amx("tileloadd64", num_c + i,
                               A.access_ptr("r", offset=i * 16 * sa + s * kt),
                               T.Cast("int64", sa * eb), tiles=1))
            for j in T.unroll(nc):
                T.evaluate(amx("tileloadd64", num_c + nr + j,
                               B.access_ptr("r", offset=s * (kt // alpha) * sb + j * 16 * alpha),
                               T.Cast("int64", sb * eb), tiles=1))
            for i in T.unroll(nr):
                for j in T.unroll(nc):
                    T.evaluate(amx(p.op, i * nc + j, num_c + i, num_c + nr + j, tiles=3))
        if tail:
            tail_step(A, B)
        for i in T.unroll(nr):
            for j in T.unroll(nc):
                T.evaluate(amx("tilestored64", i * nc + j, T.address_of(C[i * 16, j * 16]),
                               T.Cast("int64", sc * 4), tiles=1))
        T.evaluate(amx("tilerelease"))

    # Checked below: the first-call flag is free until the schedule binds it.
    @T.prim_func(s_tir=True, check_well_formed=False)
    def impl(a: T.handle, b: T.handle, c: T.handle):
        sa0 = T.int32()
        sb0 = T.int32()
        sc = T.int32()
        A = T.match_buffer(a, (m, k_total), ta, offset_factor=1, strides=[sa0, 1])
        # A tile row of B is one [n, alpha] slab: alpha must be its element stride.
        B = T.match_buffer(b, (k_total // alpha, n, alpha), tb, offset_factor=1,
                           strides=[sb0, alpha, 1])
        C = T.match_buffer(c, (m, n), tc, offset_factor=1, strides=[sc, 1])
        with T.sblock("root"):
            T.reads(C[0:m, 0:n], A[0:m, 0:k_total], B[0:k_total // alpha, 0:n, 0:alpha])
            T.writes(C[0:m, 0:n])
            if bf16:  # the tiles read raw bf16 bits: through uint16 views (see module doc)
                A16 = T.decl_buffer((m, k_total), "uint16", data=A.data, strides=[sa0, 1],
                                    elem_offset=A.elem_offset)
                B16 = T.decl_buffer((k_total // alpha, n, alpha), "uint16", data=B.data,
                                    strides=[sb0, alpha, 1], elem_offset=B.elem_offset)
                program(A16, B16, C, sa0, sb0, sc)
            else:
                program(A, B, C, sa0, sb0, sc)

    if first is None:
        tvm.s_tir.analysis.verify_well_formed(impl)
    return impl


@register_impl("amx", "uint8", "vnni4", zeroing=True)
def _u8(shape: BrgemmShape) -> PrimFunc:
    return impl_func(shape)


@register_impl("amx", "int8", "vnni4", zeroing=True)
def _s8(shape: BrgemmShape) -> PrimFunc:
    return impl_func(shape)


@register_impl("amx", "bfloat16", "vnni2", zeroing=True)
def _bf16(shape: BrgemmShape) -> PrimFunc:
    return impl_func(shape)


def request_permission() -> bool:
    """Ask Linux for this process's AMX tile state; True when AMX code may now run.

    Linux refuses AMX instructions (SIGILL) until the process calls
    ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``.  Returns False on other systems
    and on CPUs without AMX, where the call is a harmless no-op.
    """
    import platform

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0


@functools.cache
def tiles_usable() -> bool:
    """Whether this process may run AMX code: the CPU has tiles and Linux granted their state.

    Asks for the permission (:func:`request_permission`) once per process, on the first call;
    the answer is cached, so calling it before every run is free.  False on CPUs without
    ``amx_tile``, where nothing is asked.  Tests that fake the flags or the answer clear the
    cache with ``tiles_usable.cache_clear()``.

    Examples
    --------
    >>> tiles_usable() is (tiles_usable() and "amx_tile" in _isa.host_flags())
    True
    """
    return "amx_tile" in _isa.host_flags() and request_permission()
