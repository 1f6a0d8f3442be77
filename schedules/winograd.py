"""Winograd convolution: a float32 or bf16 3x3 conv as transforms around a batch of BRGEMMs.

``Y = epilogue(conv2d(X, W))`` for a float32 3x3 conv of stride 1 padded by one pixel, by
Lavin and Gray's minimal filtering ``F(m x m, 3 x 3)``: each ``m x m`` tile of output pixels
is ``A^T [(G g G^T) . (B^T d B)] A`` for its ``a x a`` input tile ``d`` (``a = m + 2``), so the
``9 m^2`` products per channel pair of a direct conv become ``a^2``: 2.25x fewer for ``m = 4``.
Three stages, each a parallel loop of the one PrimFunc:

1. input transform: ``V[xi][t, c] = (B^T d_t B)[xi]`` for every tile ``t`` of every image and
   each of the ``a^2`` transform points ``xi`` (the constant ``B`` folded into adds: the
   point loops are unrolled);
2. ``a^2`` GEMMs ``M[xi] = V[xi] @ U[xi]`` over the channels, each output tile one call of
   the flat float32 BRGEMM (``bt`` tiles x ``bk`` output channels x all of C), where
   ``U[xi] = (G g G^T)[xi]`` is the filter transformed and packed once, when the model is
   built (:func:`pack_weight`, ``U[a^2][K/bk][C][bk]``);
3. output transform and the epilogue: ``Y = epilogue(A^T M A)``, written as the direct
   conv writes it, ``[N*P*Q, K]`` (:mod:`schedules.conv`).

The PrimFunc takes the direct conv's operands (the padded NHWC input, the packed weight, the
epilogue's) but for the weight's layout, so a graph pass swaps one kernel for the other.
The transform matrices are Cook-Toom's over TVM's interpolation points (Barabasz et al.,
whose points keep the error of ``F(4, 3)`` near 3e-7 relative); this is float32 arithmetic
throughout, with a rounding error a few times a direct conv's, never a lower precision.
A bf16 conv (``precision="bf16"``) transforms in float32 too and rounds V and U to bf16
for the GEMMs (the bf16 VNNI-2 BRGEMM, float32 accumulation): half the GEMM stage's time
and operand bytes, with bf16's rounding where the direct bf16 conv has it.

Where a tile does not divide the output, the last tiles of a row or column reach past its
edge: they read zeros past the padded input and their pixels past the edge are never
written (:func:`tile_size` picks the tile with the fewest products per output, counting
those: 4 for ResNet's 14x14 and 7x7 maps).

Examples
--------
>>> from schedules.conv import ConvProblem
>>> p = WinogradProblem(ConvProblem(1, 64, 8, 8, 32, 3, 3, padding=1), tile=4)
>>> (p.points, p.tiles, weight_shape(p, 16))
(36, 4, (36, 2, 64, 16))
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from microkernels import isa as _isa
from microkernels.brgemm import BrgemmShape, dispatch
from microkernels.epilogue import Epilogue, expression_isa, from_bf16, to_bf16
from microkernels.machine import Machine
from microkernels.pack import Packing

from .blocking import divisors
from .conv import ConvProblem
from .nest import zeroing_kernel
from .operands import OPERANDS

if TYPE_CHECKING:
    from tvm import s_tir, te, tirx
    from tvm.tirx import PrimFunc

__all__ = ["WinogradProblem", "WinogradConfig", "TILES", "BF16_TILES", "tile_size", "winograd_pays",
           "MIN_CHANNELS", "MIN_TILES", "DIRECT_KEY", "transform_matrices",
           "pack_weight", "weight_shape", "workload", "schedule", "default_config",
           "candidates"]

#: Output tile sizes: F(4x4, 3x3) (36 products for 16 outputs) and F(2x2, 3x3) (16 for 4).
TILES = (4, 2)
#: The tiles a bf16 conv takes: F(4)'s transforms amplify the rounding of V and U to bf16 to
#: ~10x the direct bf16 conv's error (2.5e-2 of the output's largest value on random data),
#: F(2)'s to ~2x (4e-3); VGG-19's convs in bf16 F(2) alone ran 1.0-2.0x the direct bf16
#: conv on a Zen 5 (BENCHMARKS.md).
BF16_TILES = (2,)


def _eligible(problem: ConvProblem) -> bool:
    # bf16: whole VNNI-2 pairs of channels, so that V needs no padded channels.
    return ((problem.dtype == "float32" or problem.dtype == "bfloat16" and problem.c % 2 == 0)
            and (problem.r, problem.s) == (3, 3)
            and problem.stride == (1, 1) and problem.dilation == (1, 1)
            and problem.padding == (1, 1, 1, 1) and problem.groups == 1
            and not problem.prologue.ops)


def _grid(problem: ConvProblem, tile: int) -> tuple[int, int]:
    """Tiles down and across one image's output (the last ones may reach past its edges)."""
    return -(-problem.p // tile), -(-problem.q // tile)


def _products(problem: ConvProblem, tile: int) -> float:
    """Products per output pixel and channel pair: ``(m + 2)^2 / m^2``, times the share of
    the tiles' pixels past the output's edges."""
    th, tw = _grid(problem, tile)
    return (tile + 2) ** 2 / tile ** 2 * th * tw * tile * tile / (problem.p * problem.q)


def tile_size(problem: ConvProblem, min_tiles: int = 1) -> int | None:
    """The output tile of the Winograd form of ``problem``, or None where it has none: a
    float32 (or bf16) 3x3 conv of stride 1 padded by one pixel, ungrouped, undilated,
    without a prologue.  Of :data:`TILES` (:data:`BF16_TILES`) giving at least ``min_tiles``
    tiles over all the images, the one with the fewest products per output, counting the
    tiles' pixels past the edges (a 14x14 map takes 4: 2.94 products to 2's 4; a 6x6 map 2,
    exactly).

    >>> [tile_size(ConvProblem(1, 64, h, h, 64, 3, 3, padding=1)) for h in (56, 14, 7, 6)]
    [4, 4, 4, 2]
    >>> tile_size(ConvProblem(1, 64, 56, 56, 64, 3, 3, padding=1, dtype="bfloat16"))
    2
    >>> tile_size(ConvProblem(1, 64, 56, 56, 64, 3, 3, stride=2, padding=1)) is None
    True
    """
    if not _eligible(problem):
        return None
    tiles = BF16_TILES if problem.dtype == "bfloat16" else TILES
    usable = [m for m in sorted(tiles) if problem.n * math.prod(_grid(problem, m)) >= min_tiles]
    return min(usable, key=lambda m: _products(problem, m)) if usable else None


#: A target key that keeps every conv direct (``tpp -conv=direct``): bit for bit the direct
#: kernels' results, where Winograd's rounding (a few times the direct conv's) matters.
DIRECT_KEY = "tpp-direct-conv"
#: Input channels from which Winograd pays: on a Sapphire Rapids, 2 threads, each conv alone
#: against the direct one (interleaved), 64 channels 2.3-2.4x (224x224 at batch 1, 56x56 at
#: batch 8), 256 and 512 channels 1.9-3.4x.
MIN_CHANNELS = 64
#: Tiles (each GEMM's rows) from which a tile size pays: the transformed filter is
#: ``(m + 2)^2 / 9`` times the filter (4x for F(4)) and streams through every GEMM, so few
#: rows leave the GEMMs waiting on it (ResNet-50 at batch 1, both in one process: its 14x14
#: convs in F(4), 16 tiles, and 7x7 ones, 4, made it 0.97x; at batch 8, 128 and 32, 1.05x).
MIN_TILES = 32


def winograd_pays(problem: ConvProblem, machine: Machine) -> int | None:
    """:func:`tile_size` with at least :data:`MIN_TILES` tiles, where ``problem`` has at
    least :data:`MIN_CHANNELS` input channels; else None (the direct conv).

    >>> from microkernels import isa
    >>> machine = Machine(isa.from_name("avx512"), isa.DEFAULT_CACHES, threads=2)
    >>> [winograd_pays(ConvProblem(1, c, 56, 56, 64, 3, 3, padding=1), machine)
    ...  for c in (32, 64)]
    [None, 4]
    >>> [winograd_pays(ConvProblem(n, 256, h, h, 256, 3, 3, padding=1), machine)
    ...  for n, h in ((1, 14), (8, 14), (1, 7), (8, 7))]
    [2, 4, None, 4]
    """
    if problem.c < MIN_CHANNELS or problem.dtype == "bfloat16" and machine.isa.has("amx_tile"):
        return None  # AMX runs the direct bf16 conv on tiles; Winograd there is unmeasured
    return tile_size(problem, MIN_TILES)


@dataclass(frozen=True)
class WinogradProblem:
    """A conv computed as ``F(tile x tile, 3 x 3)`` (module doc).

    Parameters
    ----------
    conv
        The convolution (operands, epilogue); :func:`tile_size` must allow it.
    tile
        Output pixels per tile side (one of :data:`TILES`); the last tiles of a row or
        column may reach past the output's edge.
    """

    conv: ConvProblem
    tile: int

    def __post_init__(self) -> None:
        if not isinstance(self.conv, ConvProblem):
            raise TypeError(f"conv must be a ConvProblem, got {type(self.conv).__name__}")
        if not _eligible(self.conv):
            raise ValueError("Winograd takes float32 (or bfloat16, with an even number of "
                             "channels) 3x3 convs of stride 1 padded by 1, ungrouped and "
                             "without a prologue")
        if self.tile not in TILES:
            raise ValueError(f"tile={self.tile} must be one of {TILES}")

    @property
    def epilogue(self) -> Epilogue:
        return self.conv.epilogue

    @property
    def dtype(self) -> str:
        return self.conv.dtype

    @property
    def alpha(self) -> int:
        """Input tile side ``m + 2``."""
        return self.tile + 2

    @property
    def points(self) -> int:
        """Transform points ``alpha^2``: the number of GEMMs."""
        return self.alpha ** 2

    @property
    def tile_grid(self) -> tuple[int, int]:
        """Tiles down and across one image's output."""
        return _grid(self.conv, self.tile)

    @property
    def tiles(self) -> int:
        """Output tiles of all the images: each GEMM's rows."""
        return self.conv.n * math.prod(self.tile_grid)

    @property
    def flops(self) -> int:
        """The direct conv's multiply-adds, times 2 (what GFLOPS figures compare)."""
        return self.conv.flops


@dataclass(frozen=True)
class WinogradConfig:
    """Blocks of the GEMM stage: ``bt`` tiles by ``bk`` output channels per BRGEMM call
    (over all the input channels); each divides its dimension."""

    bt: int
    bk: int

    def __post_init__(self) -> None:
        for name in ("bt", "bk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"WinogradConfig.{name} must be a positive int, got {value!r}")

    def check(self, problem: WinogradProblem) -> None:
        """ValueError unless the blocks tile ``problem`` exactly."""
        for block, dim, name, what in ((self.bt, problem.tiles, "bt", "the tiles"),
                                       (self.bk, problem.conv.k, "bk", "K")):
            if dim % block:
                raise ValueError(f"{name}={block} does not divide {what} ({dim})")


@functools.lru_cache(maxsize=len(TILES))
def transform_matrices(tile: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(A, B, G)`` of ``F(tile, 3)``, float64: ``A`` is ``alpha x tile``, ``B`` ``alpha x
    alpha``, ``G`` ``alpha x 3``; a 1-D output tile is ``A^T [(G g) . (B^T d)]``.

    >>> a, b, g = transform_matrices(2)
    >>> d, w = np.arange(4.0), np.array([1.0, 2.0, 3.0])
    >>> (a.T @ ((g @ w) * (b.T @ d))).tolist()   # == [d[0:3] @ w, d[1:4] @ w]
    [8.0, 14.0]
    """
    from tvm.topi.nn.winograd_util import _cook_toom_convolution, _interpolation_points

    a, b, g = _cook_toom_convolution(_interpolation_points(tile + 1), tile, 3)
    return tuple(np.asarray(x, dtype=np.float64) for x in (a, b, g))


def weight_shape(problem: WinogradProblem, bk: int) -> tuple[int, ...]:
    """``U[alpha^2][K/bk][C][bk]``: per transform point, a contiguous ``[C, bk]`` panel per
    K block (the flat BRGEMM's B); bfloat16: ``U[alpha^2][K/bk][C/2][bk][2]``, the panel in
    VNNI-2 pairs of channels."""
    c, k = problem.conv.c, problem.conv.k
    if k % bk:
        raise ValueError(f"bk={bk} does not divide K={k}")
    if problem.dtype == "bfloat16":
        return (problem.points, k // bk, c // 2, bk, 2)
    return (problem.points, k // bk, c, bk)


def pack_weight(w: np.ndarray, problem: WinogradProblem, bk: int) -> np.ndarray:
    """OIHW float32 ``w`` -> ``U`` (:func:`weight_shape`): ``G g G^T`` of each filter,
    computed in float64 (then rounded to bfloat16, to nearest even, for a bf16 problem).

    >>> p = WinogradProblem(ConvProblem(1, 2, 4, 4, 4, 3, 3, padding=1), tile=2)
    >>> pack_weight(np.ones((4, 2, 3, 3), "float32"), p, 4).shape
    (16, 1, 2, 4)
    """
    k, c = problem.conv.k, problem.conv.c
    if tuple(w.shape) != (k, c, 3, 3):
        raise ValueError(f"W must be OIHW {[k, c, 3, 3]}, got {list(w.shape)}")
    shape = weight_shape(problem, bk)
    _, _, g = transform_matrices(problem.tile)
    u = np.einsum("xr,kcrs,ys->xyck", g, np.asarray(w, np.float64), g).astype(np.float32)
    if problem.dtype == "bfloat16":
        import ml_dtypes

        u, packing = u.astype(ml_dtypes.bfloat16), Packing.vnni_blocked_b(2, bk)
    else:
        packing = Packing.blocked_b(bk)
    # Each point's [C, K] matrix is the BRGEMM's B, packed as the direct conv packs its own.
    return np.stack([packing.pack(b) for b in u.reshape(problem.points, c, k)]).reshape(shape)


def _linear(coefficients: np.ndarray, terms: list[tirx.PrimExpr]) -> tirx.PrimExpr:
    """``sum(c * t)`` with the zero coefficients left out and +-1 as adds."""
    from tvm import tirx

    total = None
    for c, term in zip(coefficients.tolist(), terms, strict=True):
        if c == 0:
            continue
        value = term if c == 1 else -term if c == -1 else term * tirx.const(c, "float32")
        total = value if total is None else total + value
    return total if total is not None else tirx.const(0.0, "float32")


def _load_within(x: te.Tensor, index: tuple, bounds: tuple[int, int], reach: tuple[int, int]
                 ) -> tirx.PrimExpr:
    """``x[index]`` in float32, or 0 where a tile past the output's edge reads past the
    padded input's rows and columns (``index[1:3]`` within ``bounds``): guarded in a
    dimension only where the last tile's input, ``reach`` ahead of its first row or column,
    ends beyond it."""
    from tvm import te, tirx

    _, row, col, _ = index
    value = x[index] if x.dtype == "float32" else from_bf16(x[index])
    beyond = [i < b for i, r, b in zip((row, col), reach, bounds, strict=True) if r >= b]
    if not beyond:
        return value
    return te.if_then_else(tirx.all(*beyond), value, tirx.const(0.0, "float32"))


def _select(index: tirx.PrimExpr, values: list[tirx.PrimExpr], first: int = 0
            ) -> tirx.PrimExpr:
    """``values[index - first]`` for a loop variable ``index``: a balanced tree of selects
    (shallow, for TVM's simplifier) that an unrolled loop folds to the one value, so each
    point is its own sparse sum (the transforms' zeros and ones never multiply)."""
    from tvm import tirx

    if len(values) == 1:
        return values[0]
    half = len(values) // 2
    return tirx.Select(index < first + half, _select(index, values[:half], first),
                       _select(index, values[half:], first + half))


def workload(problem: WinogradProblem, bk: int, isa: str = "generic") -> PrimFunc:
    """The unscheduled PrimFunc ``(X, U, *epilogue operands, Y)``: X the direct conv's
    padded NHWC input, Y its ``[N*P*Q, K]`` output (module doc); stages ``V_rows`` and ``V``
    (the input transform's two passes; V rounded to bfloat16 for a bf16 problem), ``M``
    (the GEMMs, float32 accumulation), ``view`` and ``epilogue`` (the output transform, the
    conv's epilogue).  ``isa`` picks the expressions of the epilogue (over ``bk`` columns)
    and of V's rounding (over vectors of :func:`_lanes` channels): :func:`expression_isa`."""
    from tvm import te

    from microkernels.epilogue import apply_te

    conv, m, alpha = problem.conv, problem.tile, problem.alpha
    a, b, _ = transform_matrices(m)
    th, tw = problem.tile_grid
    rows, k = conv.n * conv.p * conv.q, conv.k
    _, hp, wq, _ = conv.input_shape
    x = te.placeholder(conv.input_shape, conv.dtype, name="X")
    u = te.placeholder(weight_shape(problem, bk), conv.dtype, name="U")
    bf16 = conv.dtype == "bfloat16"
    v_isa = expression_isa(isa, _lanes(conv.c))

    def input_rows(i, col, t, c):  # (d B)[i, col] of tile t
        n, ty, tx = t // (th * tw), t // tw % th, t % tw
        d_i = [_load_within(x, (n, ty * m + i, tx * m + j, c), (hp, wq),
                            ((th - 1) * m + alpha - 1, (tw - 1) * m + alpha - 1))
               for j in range(alpha)]
        return _select(col, [_linear(b[:, j], d_i) for j in range(alpha)])

    rows_of_v = te.compute((alpha, alpha, problem.tiles, conv.c), input_rows, name="V_rows")

    def transformed(xi, t, c):  # (B^T d B)[xi // alpha, xi % alpha]
        value = _select(xi, [_linear(b[:, row], [rows_of_v[i, col, t, c] for i in range(alpha)])
                             for row in range(alpha) for col in range(alpha)])
        return to_bf16(value, v_isa) if bf16 else value

    v = te.compute((problem.points, problem.tiles, conv.c), transformed, name="V")
    rc = te.reduce_axis((0, conv.c), name="c")

    def product(xi, t, o):
        if not bf16:
            return v[xi, t, rc] * u[xi, o // bk, rc, o % bk]
        weight = u[xi, o // bk, rc // 2, o % bk, rc % 2]
        return v[xi, t, rc].astype("float32") * weight.astype("float32")

    gemm = te.compute((problem.points, problem.tiles, k),
                      lambda xi, t, o: te.sum(product(xi, t, o), axis=rc), name="M")

    def output_transform(row, o):  # (A^T M A)[row's pixel within its tile]
        n, p, q = row // (conv.p * conv.q), row // conv.q % conv.p, row % conv.q
        t = (n * th + p // m) * tw + q // m
        # (M A)'s columns once per pixel: LLVM merges those the tile's pixels share.
        cols = [[_linear(a[:, col], [gemm[x * alpha + j, t, o] for j in range(alpha)])
                 for col in range(m)] for x in range(alpha)]
        return _select(p % m * m + q % m,
                       [_linear(a[:, i], [cols[x][j] for x in range(alpha)])
                        for i in range(m) for j in range(m)])

    view = te.compute((rows, k), output_transform, name="view")
    extra = {op.name: te.placeholder(op.shape(rows, k), op.dtype, name=op.name)
             for op in conv.epilogue.inputs(conv.epilogue_dtype)}
    y = (apply_te(conv.epilogue, view, extra, isa=expression_isa(isa, bk)) if conv.epilogue.ops
         else te.compute((rows, k), lambda i, o: view[i, o], name="epilogue"))
    return te.create_prim_func([x, u, *extra.values(), y])


def schedule(problem: WinogradProblem, config: WinogradConfig, isa: str | _isa.Isa = "avx2"
             ) -> s_tir.Schedule:
    """The scheduled Winograd conv: the input transform parallel over tiles, 16 channels a
    vector, its ``alpha^2`` points unrolled; the GEMMs parallel over (point, tile block), a
    ``beta=0`` flat BRGEMM call per output tile; the output transform and epilogue
    parallel over tile rows, the pixels of a tile unrolled.

    Raises
    ------
    ValueError
        Blocks that do not tile the problem.
    """
    from tvm import s_tir

    isa_name = isa.name if isinstance(isa, _isa.Isa) else _isa.from_name(isa).name
    config.check(problem)
    conv, m = problem.conv, problem.tile
    sch = s_tir.Schedule(workload(problem, config.bk, isa_name))

    v = sch.get_sblock("V")
    xi, t, c = sch.get_loops(v)
    tile_rows, tile_cols = sch.split(t, [None, problem.tile_grid[1]])  # no divisions
    c_out, c_in = sch.split(c, [None, _lanes(conv.c)])
    sch.reorder(tile_rows, tile_cols, c_out, xi, c_in)
    sch.parallel(tile_rows)
    sch.unroll(xi)
    sch.vectorize(c_in)
    # Each pass of the transforms over one tile's vector of channels, in registers: small
    # sums (TVM's CSE took seconds over all 36 points' sums written out in full).
    _per_tile(sch, "V_rows", c_out)

    out = sch.get_sblock("epilogue")
    sch.compute_inline(sch.get_sblock("view"))
    row, o = sch.get_loops(out)
    images, p, q = sch.split(row, [conv.n, conv.p, conv.q])
    # Tiles past the edge: their pixels beyond it are predicated away.
    tile_rows, i = sch.split(p, [None, m])
    tile_cols, j = sch.split(q, [None, m])
    o_out, o_in = sch.split(o, [None, _lanes(conv.k)])
    sch.reorder(images, tile_rows, tile_cols, o_out, i, j, o_in)
    sch.parallel(sch.fuse(images, tile_rows))
    sch.unroll(i)
    sch.unroll(j)
    sch.vectorize(o_in)
    gemm = sch.get_sblock("M")
    xi, t, o, c = sch.get_loops(gemm)
    t_out, t_in = sch.split(t, [None, config.bt])
    o_out, o_in = sch.split(o, [None, config.bk])
    sch.reorder(xi, t_out, o_out, t_in, o_in, c)
    sch.parallel(sch.fuse(xi, t_out))
    init = sch.decompose_reduction(gemm, t_in)
    shape = BrgemmShape(m=config.bt, n=config.bk, k=conv.c, dtype_a=conv.dtype,
                        dtype_acc="float32", layout=OPERANDS[conv.dtype][1], isa=isa_name)
    shape = zeroing_kernel(sch, init, shape, whole=True)
    sch.tensorize(sch.blockize(t_in), dispatch(shape))
    return sch


def _per_tile(sch: s_tir.Schedule, name: str, loop: s_tir.LoopRV) -> None:
    """Compute stage ``name`` under ``loop`` into a local buffer, its loops unrolled but the
    vector of channels (its last)."""
    block = sch.get_sblock(name)
    sch.compute_at(block, loop)
    sch.set_scope(block, 0, "local")
    loops = sch.get_loops(block)
    at = next(i for i, one in enumerate(loops) if sch.get(one).same_as(sch.get(loop)))
    *outer, lanes = loops[at + 1:]
    for one in outer:
        sch.unroll(one)
    sch.vectorize(lanes)


def _lanes(channels: int) -> int:
    """Channels per vector of the transforms: one AVX-512 register's 16 float32 where they
    divide, else the largest divisor below (each point's sums stay in one register)."""
    return max(d for d in divisors(channels) if d <= 16)


def default_config(problem: WinogradProblem, machine: Machine) -> WinogradConfig:
    """``bk`` the register tile's columns (64 floats on AVX-512), ``bt`` the tiles' divisor
    the direct conv takes for a row of that many pixels (up to 28, at least 7 where one is):
    the GEMMs are that conv's single calls over other rows.

    >>> from microkernels import isa
    >>> p = WinogradProblem(ConvProblem(1, 256, 56, 56, 256, 3, 3, padding=1), tile=4)
    >>> default_config(p, Machine(isa.from_name("avx512"), isa.DEFAULT_CACHES, 2))
    WinogradConfig(bt=28, bk=64)
    """
    from .conv import _column_block, _default_bq

    return WinogradConfig(bt=_default_bq(problem.tiles),
                          bk=_column_block(problem.conv.k, machine.isa))


def candidates(problem: WinogradProblem, machine: Machine) -> list[WinogradConfig]:
    """The default, then its neighbours: half and twice ``bt`` and ``bk`` where they
    divide."""
    first = default_config(problem, machine)
    out = [first]
    for bt, bk in ((first.bt // 2, first.bk), (first.bt * 2, first.bk),
                   (first.bt, first.bk // 2), (first.bt, first.bk * 2)):
        config = WinogradConfig(bt=max(bt, 1), bk=max(bk, 1))
        try:
            config.check(problem)
        except ValueError:
            continue
        if config not in out:
            out.append(config)
    return out
