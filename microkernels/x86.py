"""x86 BRGEMM micro-kernels: register-blocked TIR implementations for AVX2 and AVX-512.

Every kernel walks the shape's ``m x n`` block of C in register tiles of ``rows x vectors``
SIMD registers (the output-stationary structure of the TPP BRGEMM, Algorithm 2): it loads
a tile of C into accumulators, runs the whole batch-reduce over K with the accumulators kept
in registers, and stores the tile once.  Column tiles are walked outermost so a B micro-panel
stays in L1 while the row tiles stream A.  All sizes are compile-time constants of the shape.

Kernel families (registered with :func:`microkernels.brgemm.register_impl`):

===========  ======  ==================  ============================================
dtype of A   layout  ISAs                inner step per register ``(row, vector)``
===========  ======  ==================  ============================================
float32      flat,   avx2, avx512        broadcast A, load B, ``vfmadd231ps``
             blocked
uint8/int8   vnni4   avx2, avx512        exact: ``vpmaddwd`` on 16-bit halves
uint8        vnni4_  avx2, avx512        ``vpmaddubsw`` + ``vpmaddwd(1)``: 7-bit weights
             w7                          keep the int16 pair sums from saturating
uint8        vnni4,  avx_vnni,           ``vpdpbusd`` (VEX 256-bit / EVEX 512-bit)
             vnni4_w7 avx512_vnni
bfloat16     vnni2   avx2, avx512        exact emulation: bf16 -> fp32 by shifting, FMA
bfloat16     vnni2   avx512_bf16         ``vdpbf16ps``
===========  ======  ==================  ============================================

Tails: rows are split into near-equal register tiles (``m = 7`` on AVX2 runs tiles of 4 and
3 rows, not 6 and 1); columns that do not fill a SIMD register run in a narrower vector
(``n % lanes`` lanes, never touching memory past the block).  Dot-product instructions have
no narrow form, so their tail columns run the whole-register instruction on zero-padded
copies of their accumulators and B values and keep the first lanes (``vdpbf16ps`` and
``vpdpbusd``; the emulated and ``vpmadd*`` families widen them scalar by scalar).

A ``batched_a`` shape with ``edge_k`` (a conv's border columns) walks its first and last
register tiles apart from the loops over the others, and splits each block's K loop in three
there: where the flags hold, A's first row skips the first ``edge_k`` values, its last row
the last ones.

Without VNNI, full-range int8 (``vnni4``) cannot use ``vpmaddubsw``: that instruction
saturates its 16-bit pair sums (``255 * -128 * 2 < -32768``), which silently corrupts results.
The exact ``vpmaddwd`` sequence runs at about the fp32 rate (0.9x on Cascade Lake AVX2).
Weights quantized to 7 bits (layout ``vnni4_w7``, values in [-64, 64], as ONNX Runtime's
``reduce_range`` and oneDNN quantize them for CPUs without VNNI) make ``vpmaddubsw`` exact, and
it runs at about 1.6x fp32 (Cascade Lake), 2x (Zen 3).

Examples
--------
>>> from microkernels.brgemm import BrgemmShape, find_impl
>>> find_impl(BrgemmShape(m=6, n=16, k=64, batch=4, isa="avx2"))[0]
'avx2'
>>> register_tile(BrgemmShape(m=24, n=64, k=64, isa="avx512"), FP32)
RegisterTile(rows=6, vectors=4, lanes=16)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import isa as _isa
from .brgemm import BrgemmShape, edge_rows, first_call, register_impl, skipped_blocks

if TYPE_CHECKING:
    from tvm.tirx import PrimFunc

__all__ = [
    "Family",
    "RegisterTile",
    "FP32",
    "INT8_DOT",
    "INT8_EXACT",
    "INT8_SATURATING",
    "BF16_DOT",
    "BF16_EMULATED",
    "MAX_ROWS",
    "FMA_CHAINS",
    "keeps_fmas_busy",
    "Step",
    "register_tile",
    "row_tiles",
    "tile_columns",
    "brgemm_func",
    "fp32_impl",
    "int8_exact_impl",
    "int8_dot_impl",
    "int8_w7_impl",
    "bf16_emulated_impl",
    "bf16_dot_impl",
]

#: Most rows in one register tile: beyond this A broadcasts dominate the load ports.
MAX_ROWS = 14
#: Accumulators one register tile needs to keep the FMA units busy: 4 cycles of latency on
#: each of 2 units (Haswell to Sapphire Rapids, Zen 1 to 4).  Fewer leave them idle: a 3x2
#: tile (the tail of ``m = 7`` on AVX2) runs at 3/4 of the peak.
FMA_CHAINS = 8


@dataclass(frozen=True)
class Family:
    """Register cost of one kernel family's inner step.

    Parameters
    ----------
    name
        Short name used in messages.
    b_registers
        SIMD registers each B vector needs besides the accumulator (shared by all rows).
    a_registers
        SIMD registers the broadcast A value(s) of one row need (with temporaries).
    unroll
        K steps per K-loop iteration.  Short steps (one FMA per register) gain from it; long
        ones already fill the pipeline, and LLVM interleaving unrolled steps spills registers.
    """

    name: str
    b_registers: int
    a_registers: int
    unroll: int = 1

    def __post_init__(self) -> None:
        if self.b_registers < 0 or self.a_registers < 1 or self.unroll < 1:
            raise ValueError(f"implausible register costs for kernel family {self.name!r}")


FP32 = Family("fp32 fma", b_registers=1, a_registers=1, unroll=4)
INT8_DOT = Family("int8 vpdpbusd", b_registers=1, a_registers=1, unroll=4)
INT8_EXACT = Family("int8 vpmaddwd", b_registers=2, a_registers=3, unroll=2)
INT8_SATURATING = Family("int8 vpmaddubsw", b_registers=1, a_registers=3, unroll=2)
BF16_DOT = Family("bf16 vdpbf16ps", b_registers=1, a_registers=1, unroll=4)
BF16_EMULATED = Family("bf16 fma", b_registers=2, a_registers=3, unroll=2)


@dataclass(frozen=True)
class RegisterTile:
    """``rows x vectors`` accumulator registers of ``lanes`` 32-bit lanes each."""

    rows: int
    vectors: int
    lanes: int

    def __post_init__(self) -> None:
        if min(self.rows, self.vectors, self.lanes) < 1:
            raise ValueError(f"register tile dimensions must be positive: {self}")


def tile_columns(target: _isa.Isa) -> int:
    """Columns (32-bit accumulators) of the widest register tile on ``target``: 2 vectors
    with 16 registers, 4 with 32 — 16 on AVX2, 64 on AVX-512.  A BRGEMM whose ``n`` is this
    wide is one column tile: each register tile's results are stored once, right after its
    reduction.

    >>> tile_columns(_isa.from_name("avx2")), tile_columns(_isa.from_name("avx512"))
    (16, 64)
    """
    return (2 if target.vector_registers <= 16 else 4) * target.lanes("float32")


def register_tile(shape: BrgemmShape, family: Family) -> RegisterTile:
    """The register tile a kernel of ``family`` uses for ``shape`` on ``shape.isa``.

    As many vectors along N as the block has, up to :func:`tile_columns`, then as many rows
    as the remaining registers hold: 6x16 for fp32 on AVX2, 6x64 on AVX-512.
    """
    target = _isa.from_name(shape.isa)
    lanes = target.lanes("float32")
    regs = target.vector_registers
    vectors = min(tile_columns(target) // lanes, -(-shape.n // lanes))
    free = regs - vectors * family.b_registers - family.a_registers
    rows = max(1, min(shape.m, MAX_ROWS, free // vectors))
    return RegisterTile(rows, vectors, lanes)


def keeps_fmas_busy(shape: BrgemmShape, family: Family) -> bool:
    """Whether every register tile of ``shape`` holds :data:`FMA_CHAINS` accumulators (or
    the whole block, when it is smaller).

    >>> keeps_fmas_busy(BrgemmShape(m=7, n=16, k=64, isa="avx2"), FP32)  # tiles 4x2, 3x2
    False
    >>> keeps_fmas_busy(BrgemmShape(m=49, n=16, k=64, isa="avx2"), FP32)  # 6x2 and 5x2
    True
    """
    tile = register_tile(shape, family)
    vectors = -(-shape.n // tile.lanes)
    needed = min(FMA_CHAINS, shape.m * vectors)
    return all(size * min(vectors, tile.vectors) >= needed
               for _, _, size in row_tiles(shape.m, tile.rows))


def row_tiles(m: int, rows: int) -> tuple[tuple[int, int, int], ...]:
    """Split ``m`` rows into near-equal tiles of at most ``rows``: ``(start, count, size)``.

    >>> row_tiles(7, 6)
    ((0, 1, 4), (4, 1, 3))
    >>> row_tiles(12, 6)
    ((0, 2, 6),)
    """
    if m < 1 or rows < 1:
        raise ValueError(f"row_tiles needs positive sizes, got m={m}, rows={rows}")
    count = -(-m // rows)
    size, bigger = divmod(m, count)
    parts = ((0, bigger, size + 1), (bigger * (size + 1), count - bigger, size))
    return tuple(p for p in parts if p[1] > 0)


# ----------------------------------------------------------------------------------------------
# The common walk over register tiles, built with TVM's IR builder: plain Python loops unroll
# rows, vectors and K steps at build time (TVMScript macros cost ~1 s of parsing per kernel).
# ----------------------------------------------------------------------------------------------

#: ``step(A, B, acc, row0, rows, col0, acc0, nvec, width, kb, kq)``: emit the update of
#: accumulators ``acc[r, acc0 + v*width ...]`` (``r < rows``, ``v < nvec``) by one K step of
#: rows ``row0 + r`` and columns ``col0 + v*width ...``; ``kq`` indexes the K step (one element,
#: or one VNNI group of ``alpha``) and ``kb`` the batch block (blocked layout only).
Step = Callable[..., None]


def _vec(base: Any, width: int) -> Any:
    from tvm import tirx

    return tirx.Ramp(base, 1, width) if width > 1 else base


def _bcast(value: Any, width: int) -> Any:
    from tvm import tirx

    return tirx.Broadcast(value, width) if width > 1 else value


def _lanes(dtype: str, width: int) -> str:
    return f"{dtype}x{width}" if width > 1 else dtype


class _Rows:
    """The accumulator tile as one buffer per row, indexed ``acc[r, cols]`` like a 2-D buffer.

    TVM keeps an allocation on the stack (where LLVM promotes it to registers) only up to
    1 KiB; a larger tile (AVX-512's 6 x 64 floats) would become a heap workspace per call.
    """

    def __init__(self, rows: list) -> None:
        self.rows = rows

    def __getitem__(self, index: tuple) -> Any:
        return self.rows[index[0]][tuple(index[1:])]


class _Indexed:
    """One batch block of a ``batched_a`` kernel's operand, indexed as the steps index a
    whole one (``[row, k]`` A, ``[k/alpha, n, alpha]`` B): ``at`` maps those indices to the
    buffer's."""

    def __init__(self, buf: Any, at: Callable[[list], list]) -> None:
        self.buf, self.at, self.dtype = buf, at, buf.dtype

    def __getitem__(self, index: tuple) -> Any:
        return self.buf[tuple(self.at(list(index)))]

    def vload(self, index: list, dtype: str) -> Any:
        return self.buf.vload(self.at(list(index)), dtype)


def _store(buf: Any, indices: list, value: Any) -> None:
    from tvm.script.ir_builder import tirx as T

    if isinstance(buf, _Rows):
        buf, indices = buf.rows[indices[0]], indices[1:]
    T.buffer_store(buf, value, indices)


def brgemm_func(shape: BrgemmShape, tile: RegisterTile, step: Step, tail_step: Step,
                uint16_views: bool = False, unroll: int = 4,
                llvm_import: str | None = None) -> PrimFunc:
    """The impl PrimFunc of ``shape``: C walked in ``tile``-sized register tiles.

    Parameters
    ----------
    step, tail_step
        Emit one K step (see :data:`Step`) for full vectors of ``tile.lanes`` columns and for
        the last ``n % lanes`` columns (one narrower vector) respectively.
    uint16_views
        Hand the steps ``uint16`` views of the (bfloat16) A and B: TVM legalizes bfloat16
        vectors to float32, so raw bf16 bits travel as uint16.
    unroll
        K steps per iteration of the K loop (amortizes loop overhead; LLVM leaves it rolled).
    llvm_import
        LLVM IR text linked into the module (helpers the steps call with ``call_pure_extern``).

    Examples
    --------
    >>> s = BrgemmShape(m=7, n=20, k=8, batch=2)
    >>> f = brgemm_func(s, register_tile(s, FP32), *_fp32_steps(s))  # doctest: +SKIP
    """
    from tvm import tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    if unroll < 1:
        raise ValueError(f"unroll must be positive, got {unroll}")
    m, n, k, batch, alpha = shape.m, shape.n, shape.k, shape.batch, shape.alpha
    tc = shape.dtype_acc
    a_shape, b_shape = shape.a_shape(), shape.b_shape()
    blocked = shape.layout == "blocked"
    lanes = tile.lanes
    width = tile.vectors * lanes
    full_cols, rest = divmod(n, width)
    # (first column, number of such column tiles, full vectors per tile, tail lanes)
    col_tiles = [(0, full_cols, tile.vectors, 0)] if full_cols else []
    if rest:
        col_tiles.append((full_cols * width, 1, rest // lanes, rest % lanes))
    kq_extent = k * batch // alpha

    edge = shape.edge_k // alpha  # K steps per block an edge row leaves out

    def one_tile(A, B, C, row0, rows, col0, nvec, tail_w, edges=(None, None)):
        # "global" scope on purpose: TVM puts small global allocations on the stack, where
        # LLVM promotes them to registers; "local" ones become heap workspaces.
        acc = _Rows([IRBuilder.name(f"acc{r}", T.alloc_buffer((nvec * lanes + tail_w,), tc))
                     for r in range(rows)])
        vectors = [(v * lanes, lanes) for v in range(nvec)] + (
            [(nvec * lanes, tail_w)] if tail_w else [])

        def unrolled(emit, a, b, extent, steps_per_iter, start=0):
            if extent >= steps_per_iter:
                with T.serial(extent // steps_per_iter) as ko:
                    IRBuilder.name("ko", ko)
                    for u in range(steps_per_iter):
                        emit(a, b, 0, start + ko * steps_per_iter + u)
            for kq in range(extent - extent % steps_per_iter, extent):
                emit(a, b, 0, start + kq)

        def edged(emits, a, b, steps, steps_per_iter):
            """A block's K steps where the tile's first (last) row leaves out the first
            (last) ``edge`` steps when its flag in ``edges`` holds: ``emits(lo, hi)`` emits
            a step for the tile's rows lo..hi-1."""
            parts = [(0, edge, 0), (edge, steps - 2 * edge, None), (steps - edge, edge, 1)]
            for start, extent, side in parts:
                flag = None if side is None else edges[side]
                if flag is None:
                    unrolled(emits(0, rows), a, b, extent, steps_per_iter, start)
                    continue
                lo, hi = (1, rows) if side == 0 else (0, rows - 1)
                with T.If(flag):
                    with T.Then():
                        if hi > lo:
                            unrolled(emits(lo, hi), a, b, extent, steps_per_iter, start)
                    with T.Else():
                        unrolled(emits(0, rows), a, b, extent, steps_per_iter, start)

        def k_loop(emits, steps_per_iter, edges=(None, None)):
            """The batch-reduce over K, ``emits(0, rows)(A, B, kb, kq)`` per step, unrolled
            by ``steps_per_iter`` (the blocked layout loops over (batch, k) instead; a
            ``batched_a`` kernel over the batch, each block's A and B as whole operands, its
            edge rows leaving out their edge of each block where ``edges`` say)."""
            emit = emits(0, rows)
            if blocked:
                with T.grid(batch, k) as (kb, kq):
                    IRBuilder.name_many(["kb", "kq"], [kb, kq])
                    emit(A, B, kb, kq)
                return
            if shape.batched_a:
                first, last = skipped_blocks() if shape.skips_blocks else (0, 0)
                with T.serial(first, batch - last) as kb:
                    IRBuilder.name("kb", kb)
                    steps = k // alpha
                    a = _Indexed(A, lambda at: [kb, *at])
                    b = _Indexed(B, lambda at: [kb * steps + at[0], *at[1:]])
                    if edges == (None, None):
                        unrolled(emit, a, b, steps, steps_per_iter)
                    else:
                        edged(emits, a, b, steps, steps_per_iter)
                return
            unrolled(emit, A, B, kq_extent, steps_per_iter)

        def start(zero: bool) -> None:
            for r in range(rows):
                for off, w in vectors:
                    _store(acc, [r, _vec(off, w)], _bcast(tirx.const(0, tc), w) if zero
                           else C[row0 + r, _vec(col0 + off, w)])

        if shape.first_call_zeroes:
            with T.If(first_call()):
                with T.Then():
                    start(True)
                with T.Else():
                    start(False)
        else:
            start(shape.beta == 0)
        if nvec:
            k_loop(lambda lo, hi: lambda a, b, kb, kq: step(
                a, b, _Rows(acc.rows[lo:hi]), row0 + lo, hi - lo, col0, 0, nvec, lanes, kb, kq),
                unroll, edges)
        if tail_w:  # rare narrow columns: their own rolled K loop keeps the code small
            k_loop(lambda lo, hi: lambda a, b, kb, kq: tail_step(
                a, b, _Rows(acc.rows[lo:hi]), row0 + lo, hi - lo, col0 + nvec * lanes,
                nvec * lanes, 1, tail_w, kb, kq), 1, edges)
        for r in range(rows):
            for off, w in vectors:
                _store(C, [row0 + r, _vec(col0 + off, w)], acc[r, _vec(off, w)])

    def walk(A, B, C):
        # Column tiles outermost: a B micro-panel stays in L1 while row tiles stream A.
        # An edge_k kernel's first and last register tiles (A's first and last rows) are
        # walked apart from the loops over the others.
        left, right = edge_rows() if edge else (None, None)
        tiles = row_tiles(m, tile.rows)
        for col_start, col_count, nvec, tail_w in col_tiles:
            with T.serial(col_count) as jt:
                IRBuilder.name("jt", jt)
                col0 = col_start + jt * width
                for g, (row_start, row_count, rows) in enumerate(tiles):
                    lo = 1 if edge and g == 0 else 0
                    hi = row_count - 1 if edge and g == len(tiles) - 1 else row_count
                    if lo:
                        one_tile(A, B, C, row_start, rows, col0, nvec, tail_w,
                                 (left, right if hi < lo else None))
                    if hi > lo:
                        with T.serial(lo, hi) as it:
                            IRBuilder.name("it", it)
                            one_tile(A, B, C, row_start + it * rows, rows, col0, nvec, tail_w)
                    if hi < row_count and hi >= lo:
                        one_tile(A, B, C, row_start + hi * rows, rows, col0, nvec, tail_w,
                                 (None, right))

    strides = {name: tirx.Var(name, "int32") for name in ("sa0", "sa1", "sb0", "sb1", "sc")}
    a_strides = [strides["sa0"], strides["sa1"], 1] if len(a_shape) == 3 else [strides["sa0"], 1]
    b_strides = [strides["sb0"], strides["sb1"], 1] if len(b_shape) == 3 else [strides["sb0"], 1]
    with IRBuilder() as builder:
        with T.prim_func(s_tir=True):
            T.func_name(shape.name + "_impl")
            handles = [T.arg(name, T.handle()) for name in ("a", "b", "c")]
            # Buffers exactly as desc_func declares them (symbolic strides, offset_factor=1).
            A = T.match_buffer(handles[0], a_shape, shape.dtype_a, strides=a_strides,
                               offset_factor=1)
            B = T.match_buffer(handles[1], b_shape, shape.dtype_b, strides=b_strides,
                               offset_factor=1)
            C = T.match_buffer(handles[2], (m, n), tc, strides=[strides["sc"], 1],
                               offset_factor=1)
            for name, buf in zip("ABC", (A, B, C), strict=True):
                IRBuilder.name(name, buf)
            with T.sblock("root"):
                T.reads(C[0:m, 0:n], A[tuple(slice(0, s) for s in a_shape)],
                        B[tuple(slice(0, s) for s in b_shape)])
                T.writes(C[0:m, 0:n])
                with contextlib.ExitStack() as scopes:
                    if alpha > 1:
                        # B rows are loaded as whole vectors: the [n][alpha] part must be dense
                        # (it is in any buffer whose last axis is the alpha group).
                        scopes.enter_context(T.Assert(
                            strides["sb1"] == alpha,
                            "BRGEMM: VNNI-packed B needs dense [n][alpha] rows"))
                    if llvm_import is not None:
                        scopes.enter_context(T.attr(0, "pragma_import_llvm", llvm_import))
                    if uint16_views:
                        A = T.decl_buffer(a_shape, "uint16", data=A.data, strides=a_strides,
                                          elem_offset=A.elem_offset)
                        B = T.decl_buffer(b_shape, "uint16", data=B.data, strides=b_strides,
                                          elem_offset=B.elem_offset)
                    walk(A, B, C)
    return builder.get()


# ----------------------------------------------------------------------------------------------
# Inner steps, one factory per kernel family.
# ----------------------------------------------------------------------------------------------


def _fp32_steps(shape: BrgemmShape) -> tuple[Step, Step]:
    """``acc += broadcast(A[row, k]) * B[k, cols]``: one fused multiply-add per vector."""
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    blocked = shape.layout == "blocked"

    def step(A, B, acc, row0, rows, col0, acc0, nvec, w, kb, kq):
        for r in range(rows):
            a = T.Bind(A[kb, row0 + r, kq] if blocked else A[row0 + r, kq])
            for v in range(nvec):
                cols = _vec(col0 + v * w, w)
                b = B[kb, kq, cols] if blocked else B[kq, cols]
                idx = [r, _vec(acc0 + v * w, w)]
                _store(acc, idx, tirx.call_llvm_pure_intrin(
                    _lanes("float32", w), "llvm.fmuladd", _bcast(a, w), b, acc[tuple(idx)]))

    return step, step


def _vnni_tail_step(shape: BrgemmShape) -> Step:
    """Portable VNNI step for the < lanes tail columns: scalar widen, multiply, add."""
    from tvm import tirx

    alpha, tc = shape.alpha, shape.dtype_acc

    def widen(x):
        if shape.dtype_a == "bfloat16":  # the operands are uint16 views of bf16 bits
            return tirx.reinterpret("float32", tirx.Cast("uint32", x) << tirx.const(16, "uint32"))
        return tirx.Cast(tc, x)

    def step(A, B, acc, row0, rows, col0, acc0, nvec, w, kb, kq):
        for r in range(rows):
            for j in range(w):
                total = acc[r, acc0 + j]
                for q in range(alpha):
                    total = total + widen(A[row0 + r, kq * alpha + q]) * widen(B[kq, col0 + j, q])
                _store(acc, [r, acc0 + j], total)

    return step


def _a_group(A: Any, row: Any, kq: Any, alpha: int, w: int, dtype: str) -> Any:
    """The ``alpha`` A values of one VNNI group of ``row``, broadcast as a 32-bit word to ``w``
    lanes and viewed as ``dtype`` lanes (``4*w`` bytes or ``2*w`` halves)."""
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    per_word = {"int8": 4, "int16": 2, "uint16": 2, "uint32": 1}[dtype]
    word = tirx.reinterpret("int32", A.vload([row, kq * alpha], f"{A.dtype}x{alpha}"))
    return T.Bind(tirx.reinterpret(f"{dtype}x{per_word * w}", tirx.Broadcast(word, w)))


def _dot_step(alpha: int, lane_dtype: str, out_dtype: str, dot: Callable[..., Any]) -> Step:
    """A dot-product instruction per register: ``acc = dot(acc, A group, B row)``, the
    ``alpha`` A values of one VNNI group broadcast 32 bits wide as ``lane_dtype`` lanes."""

    def step(A, B, acc, row0, rows, col0, acc0, nvec, w, kb, kq):
        for r in range(rows):
            a = _a_group(A, row0 + r, kq, alpha, w, lane_dtype)
            for v in range(nvec):
                idx = [r, _vec(acc0 + v * w, w)]
                _store(acc, idx, dot(f"{out_dtype}x{w}", acc[tuple(idx)], a,
                                     B.vload([kq, col0 + v * w, 0], f"{lane_dtype}x{alpha * w}")))

    return step


#: 32-bit lanes of a zmm register: the dot kernels' tails of 512-bit ISAs take ymm ones.
_ZMM_LANES = 16


def _dot_tail_step(alpha: int, lane_dtype: str, out_dtype: str, dot: Callable[..., Any],
                   lanes: int) -> Step:
    """The dot-product instruction for the last ``w < lanes`` columns: their accumulators and
    B values padded with zeros to a whole register, the result's first ``w`` lanes kept.  B
    is read only within the block (no load past its last column); the scalar widening tail
    it replaces took a conv of 21 output channels (a segmentation head's classifier, 16 bf16
    lanes) to half the float32 kernel's speed.  Of a 512-bit ISA's, up to 8 columns take the
    256-bit instruction (AVX512-VL): Zen 4 runs a zmm one as two ymm halves, so a half
    register costs half (MobileNet-V2's 24-channel bf16 project conv 1.20x), and on Intel's
    cores a ymm instruction takes no more issue slots than a zmm one."""
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    def padded(value: Any, count: int, width: int, dtype: str) -> Any:
        if count == width:  # a tail of 8 columns in a ymm register
            return value
        zero = tirx.const(0, dtype)  # a Broadcast has two lanes at least
        zeros = zero if width - count == 1 else tirx.Broadcast(zero, width - count)
        return tirx.Shuffle([value, zeros], list(range(width)))

    def step(A, B, acc, row0, rows, col0, acc0, nvec, w, kb, kq):
        width = lanes // 2 if lanes == _ZMM_LANES and w <= lanes // 2 else lanes
        b = T.Bind(padded(B.vload([kq, col0, 0], f"{lane_dtype}x{alpha * w}"), alpha * w,
                          alpha * width, lane_dtype))
        for r in range(rows):
            a = _a_group(A, row0 + r, kq, alpha, width, lane_dtype)
            idx = [r, _vec(acc0, w)]
            total = dot(f"{out_dtype}x{width}", padded(acc[tuple(idx)], w, width, out_dtype),
                        a, b)
            _store(acc, idx, tirx.Shuffle([total], list(range(w))))

    return step


def _int8_dot_steps(shape: BrgemmShape) -> tuple[Step, Step]:
    """``vpdpbusd``: 4 u8 x s8 products summed into each int32 lane, A broadcast 32 bits wide."""
    from tvm import tirx

    # LLVM >= 21 types the byte operands as vXi8 (not vXi32 as TVM's own VNNI intrinsic has it).
    def dot(dtype, *args):
        bits = 32 * int(dtype.split("x")[1])  # a tail's register may be half the ISA's
        return tirx.call_llvm_pure_intrin(dtype, f"llvm.x86.avx512.vpdpbusd.{bits}", *args)

    lanes = _isa.from_name(shape.isa).vector_bits // 32
    return _dot_step(4, "int8", "int32", dot), _dot_tail_step(4, "int8", "int32", dot, lanes)


def _pmaddwd(bits: int) -> str:
    return "llvm.x86.avx2.pmadd.wd" if bits == 256 else "llvm.x86.avx512.pmaddw.d.512"


def _int8_exact_steps(shape: BrgemmShape) -> tuple[Step, Step]:
    """Exact int8 dot products without VNNI: ``vpmaddwd`` on sign/zero-extended 16-bit halves.

    A 16-bit lane of a VNNI-4 B row holds the bytes (k0, k1) or (k2, k3) of one column; the
    low bytes (k0, k2) and high bytes (k1, k3) are extended in place by shifts, A's quad
    likewise, and two ``vpmaddwd`` give ``a0*b0 + a2*b2`` and ``a1*b1 + a3*b3`` per column.
    Every product and pair sum fits int32, so no input can saturate.
    """
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    pmaddwd = _pmaddwd(_isa.from_name(shape.isa).vector_bits)
    a_unsigned = shape.dtype_a == "uint8"
    eight = tirx.const(8, "int16")

    def low_byte(x, w, unsigned):
        if unsigned:
            return x & tirx.Broadcast(tirx.const(0xFF, "int16"), 2 * w)
        return (x << eight) >> eight  # arithmetic shift: sign-extends

    def high_byte(x, w, unsigned):
        if unsigned:
            return tirx.reinterpret(f"int16x{2 * w}", tirx.reinterpret(
                f"uint16x{2 * w}", x) >> tirx.const(8, "uint16"))
        return x >> eight

    def step(A, B, acc, row0, rows, col0, acc0, nvec, w, kb, kq):
        # B halves of all vectors live across the rows; A halves one row at a time.
        b_halves = []
        for v in range(nvec):
            b16 = tirx.reinterpret(f"int16x{2 * w}",
                                   B.vload([kq, col0 + v * w, 0], f"int8x{4 * w}"))
            b_halves.append((T.Bind(low_byte(b16, w, False)), T.Bind(high_byte(b16, w, False))))
        for r in range(rows):
            a16 = _a_group(A, row0 + r, kq, 4, w, "int16")
            a_lo, a_hi = T.Bind(low_byte(a16, w, a_unsigned)), T.Bind(high_byte(a16, w, a_unsigned))
            for v, (b_lo, b_hi) in enumerate(b_halves):
                idx = [r, _vec(acc0 + v * w, w)]
                _store(acc, idx, acc[tuple(idx)]
                       + tirx.call_llvm_pure_intrin(f"int32x{w}", pmaddwd, a_lo, b_lo)
                       + tirx.call_llvm_pure_intrin(f"int32x{w}", pmaddwd, a_hi, b_hi))

    return step, _vnni_tail_step(shape)


def _int8_saturating_steps(shape: BrgemmShape) -> tuple[Step, Step]:
    """``vpmaddubsw`` + ``vpmaddwd(1)``: twice the exact kernel's rate, but the u8 x s8 pair
    sums saturate at int16: exact only while ``|a0*b0 + a1*b1| <= 32767`` (e.g. B in
    [-64, 64], or A < 128)."""
    from tvm import tirx

    bits = _isa.from_name(shape.isa).vector_bits
    pmaddubsw = "llvm.x86.avx2.pmadd.ub.sw" if bits == 256 else "llvm.x86.avx512.pmaddubs.w.512"
    pmaddwd = _pmaddwd(bits)

    def step(A, B, acc, row0, rows, col0, acc0, nvec, w, kb, kq):
        ones = tirx.Broadcast(tirx.const(1, "int16"), 2 * w)
        for r in range(rows):
            a4 = _a_group(A, row0 + r, kq, 4, w, "int8")
            for v in range(nvec):
                idx = [r, _vec(acc0 + v * w, w)]
                pairs = tirx.call_llvm_pure_intrin(
                    f"int16x{2 * w}", pmaddubsw, a4,
                    B.vload([kq, col0 + v * w, 0], f"int8x{4 * w}"))
                _store(acc, idx, acc[tuple(idx)] + tirx.call_llvm_pure_intrin(
                    f"int32x{w}", pmaddwd, pairs, ones))

    return step, _vnni_tail_step(shape)


def _bf16_emulated_steps(shape: BrgemmShape) -> tuple[Step, Step]:
    """Exact bf16 -> fp32 widening (a bf16 is the top half of an fp32) and two FMAs per pair."""
    from tvm import tirx
    from tvm.script.ir_builder import tirx as T

    def even(x, w):  # element 0 of each (k, k+1) pair: the low half of the 32-bit word
        return tirx.reinterpret(f"float32x{w}", x << tirx.Broadcast(tirx.const(16, "uint32"), w))

    def odd(x, w):
        mask = tirx.Broadcast(tirx.const(0xFFFF0000, "uint32"), w)
        return tirx.reinterpret(f"float32x{w}", x & mask)

    def step(A, B, acc, row0, rows, col0, acc0, nvec, w, kb, kq):
        # B halves of all vectors live across the rows; A halves one row at a time.
        b_halves = []
        for v in range(nvec):
            b = tirx.reinterpret(f"uint32x{w}", B.vload([kq, col0 + v * w, 0], f"uint16x{2 * w}"))
            b_halves.append((T.Bind(even(b, w)), T.Bind(odd(b, w))))
        for r in range(rows):
            a = _a_group(A, row0 + r, kq, 2, w, "uint32")
            a0, a1 = T.Bind(even(a, w)), T.Bind(odd(a, w))
            for v, (b0, b1) in enumerate(b_halves):
                idx = [r, _vec(acc0 + v * w, w)]
                first = tirx.call_llvm_pure_intrin(f"float32x{w}", "llvm.fmuladd", a0, b0,
                                                   acc[tuple(idx)])
                _store(acc, idx, tirx.call_llvm_pure_intrin(f"float32x{w}", "llvm.fmuladd",
                                                            a1, b1, first))

    return step, _vnni_tail_step(shape)


def _dpbf16ps_ll(lanes: int) -> str:
    """``tpp_dpbf16ps_{bits}``: ``vdpbf16ps`` of ``lanes`` float32 lanes on i16 operands."""
    bits, halves = 32 * lanes, 2 * lanes
    return "\n".join([
        f"define linkonce_odr <{lanes} x float> @tpp_dpbf16ps_{bits}(",
        f"    <{lanes} x float> %c, <{halves} x i16> %a, <{halves} x i16> %b) #0 {{",
        f"  %a1 = bitcast <{halves} x i16> %a to <{halves} x bfloat>",
        f"  %b1 = bitcast <{halves} x i16> %b to <{halves} x bfloat>",
        f"  %r = call <{lanes} x float> @llvm.x86.avx512bf16.dpbf16ps.{bits}(",
        f"      <{lanes} x float> %c, <{halves} x bfloat> %a1, <{halves} x bfloat> %b1)",
        f"  ret <{lanes} x float> %r",
        "}",
        f"declare <{lanes} x float> @llvm.x86.avx512bf16.dpbf16ps.{bits}(",
        f"    <{lanes} x float>, <{halves} x bfloat>, <{halves} x bfloat>)"])


#: ``vdpbf16ps`` takes <32 x bfloat> operands, which TVM cannot produce (its bf16
#: legalization widens bf16 vectors to fp32), so a tiny LLVM function bitcasts uint16 lanes.
_DPBF16PS_LL = "\n".join([
    _dpbf16ps_ll(16), _dpbf16ps_ll(8),  # the whole registers and tails of up to 8 columns
    'attributes #0 = { alwaysinline nounwind "target-features"="+avx512f,+avx512vl,'
    '+avx512bf16" }',
])


def _bf16_dot_steps(shape: BrgemmShape) -> tuple[Step, Step]:
    """``vdpbf16ps``: a bf16 pair product summed into each fp32 lane, A broadcast 32 bits wide.

    Needs ``llvm_import=_DPBF16PS_LL`` and 512-bit vectors.
    """
    from tvm import tirx

    def dot(dtype, *args):
        return tirx.call_pure_extern(dtype, f"tpp_dpbf16ps_{32 * int(dtype.split('x')[1])}",
                                     *args)

    return (_dot_step(2, "uint16", "float32", dot),
            _dot_tail_step(2, "uint16", "float32", dot, 16))


def _impl(shape: BrgemmShape, family: Family, steps: Callable[[BrgemmShape], tuple[Step, Step]],
          llvm_import: str | None = None) -> PrimFunc:
    return brgemm_func(shape, register_tile(shape, family), *steps(shape),
                       uint16_views=shape.dtype_a == "bfloat16", unroll=family.unroll,
                       llvm_import=llvm_import)


@register_impl(("avx2", "avx512"), "float32", "flat", zeroing=True, batched_a=True)
@register_impl(("avx2", "avx512"), "float32", "blocked", zeroing=True)
def fp32_impl(shape: BrgemmShape) -> PrimFunc:
    """fp32 FMA kernel (``vfmadd231ps`` on ymm or zmm registers)."""
    return _impl(shape, FP32, _fp32_steps)


@register_impl(("avx2", "avx512"), "uint8", "vnni4", zeroing=True, batched_a=True)
@register_impl(("avx2", "avx512"), "int8", "vnni4", zeroing=True, batched_a=True)
def int8_exact_impl(shape: BrgemmShape) -> PrimFunc:
    """Exact u8/s8 x s8 kernel without VNNI instructions (``vpmaddwd``)."""
    return _impl(shape, INT8_EXACT, _int8_exact_steps)


@register_impl(("avx_vnni", "avx512_vnni"), "uint8", "vnni4", zeroing=True, batched_a=True)
@register_impl(("avx_vnni", "avx512_vnni"), "uint8", "vnni4_w7", zeroing=True, batched_a=True)
def int8_dot_impl(shape: BrgemmShape) -> PrimFunc:
    """u8 x s8 VNNI kernel (``vpdpbusd``, VEX ymm on avx_vnni, EVEX zmm on avx512_vnni)."""
    return _impl(shape, INT8_DOT, _int8_dot_steps)


@register_impl(("avx2", "avx512"), "uint8", "vnni4_w7", zeroing=True, batched_a=True)
def int8_w7_impl(shape: BrgemmShape) -> PrimFunc:
    """u8 x s7 kernel with ``vpmaddubsw``: exact because B's layout bounds it to [-64, 64]
    (``vnni4_w7``); on full-range weights its int16 pair sums would saturate."""
    if shape.dtype_a != "uint8" or shape.layout not in ("vnni4", "vnni4_w7"):
        raise ValueError(f"the vpmaddubsw kernel takes uint8 A in a vnni4 layout, not {shape}")
    return _impl(shape, INT8_SATURATING, _int8_saturating_steps)


@register_impl(("avx2", "avx512"), "bfloat16", "vnni2", zeroing=True, batched_a=True)
def bf16_emulated_impl(shape: BrgemmShape) -> PrimFunc:
    """bf16 kernel for any AVX2 host: exact widening to fp32 and FMA."""
    return _impl(shape, BF16_EMULATED, _bf16_emulated_steps)


@register_impl("avx512_bf16", "bfloat16", "vnni2", zeroing=True, batched_a=True)
def bf16_dot_impl(shape: BrgemmShape) -> PrimFunc:
    """bf16 kernel with ``vdpbf16ps`` (AVX512-BF16: Cooper Lake, Zen 4, Sapphire Rapids)."""
    return _impl(shape, BF16_DOT, _bf16_dot_steps, llvm_import=_DPBF16PS_LL)
