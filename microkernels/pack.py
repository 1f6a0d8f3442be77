"""Operand packing: numpy packers, TE packers and the matching TIR index maps (with inverses).

Every packing here splits the two axes of a row-major 2-D operand ``X[R, C]`` into blocks
(``R -> (R/br, br)``, ``C -> (C/bc, bc)``; a block of 1 leaves the axis whole) and reorders the
pieces.  A :class:`Packing` says how, and gives the same transform three ways: numpy
(:meth:`Packing.pack` / :meth:`Packing.unpack`, for pre-packing weights and tests), TE
(:meth:`Packing.te_pack` / :meth:`Packing.te_unpack`: a packing stage TVM can constant-fold
on weights or fuse) and index maps (:meth:`Packing.index_maps`, for ``sch.transform_layout``).
Sizes that are not block multiples are padded with zeros; unpacking drops the padding.

======================  ==========================  ======================================
constructor             packed shape                used for
======================  ==========================  ======================================
``blocked_b(bn)``       ``[N/bn][K][bn]``           B panels: one flat ``[K, bn]`` region
                                                    per N block (the GEMM schedule's B)
``blocked_a(bm, bk)``   ``[M/bm][K/bk][bm][bk]``    A in PARLOOPER's blocked layout
``vnni_b(a)``           ``[K/a][N][a]``             BRGEMM ``vnni2`` / ``vnni4`` B
``vnni_blocked_b(a,     ``[N/bn][K/a][bn][a]``      VNNI B per N block
bn)``
======================  ==========================  ======================================

Examples
--------
>>> b = np.arange(12, dtype="int8").reshape(3, 4)           # B[K=3, N=4]
>>> vnni4 = Packing.vnni_b(4)
>>> vnni4.pack(b).shape                                      # K zero-padded to 4
(1, 4, 4)
>>> np.array_equal(vnni4.unpack(vnni4.pack(b), 3, 4), b)
True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .brgemm import B_RANGES, LAYOUTS

if TYPE_CHECKING:
    from tvm import te

__all__ = ["Packing", "padded", "MMLA_K_BLOCK", "mmla_k_block", "pack_mmla", "unpack_mmla",
           "mmla_index_maps"]

#: The four pieces of a split 2-D index: row block, row in block, column block, column in block.
_PIECES = ("R", "r", "C", "c")


def padded(size: int, block: int) -> int:
    """``size`` rounded up to a multiple of ``block``.

    >>> padded(37, 16)
    48
    """
    _positive(size, "size")
    _positive(block, "block")
    return -(-size // block) * block


def _positive(value: Any, name: str) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class Packing:
    """Blocked reordering of a 2-D operand ``X[R, C]``.

    Parameters
    ----------
    row_block, col_block
        Block sizes ``br`` and ``bc`` along rows and columns (1: the axis is not split).
    order
        The packed axes, outermost first, as pieces of the split index: ``"R"`` (row block),
        ``"r"`` (row within its block), ``"C"``, ``"c"``.  ``"R"`` and ``"C"`` always appear,
        ``"r"``/``"c"`` iff their block is larger than 1.
    name
        Label used in messages.
    value_range
        Inclusive bounds every value must lie in (a layout's contract on its values, e.g. the
        7-bit weights of ``vnni4_w7``); :meth:`pack` refuses others.

    Examples
    --------
    >>> Packing.blocked_b(16).packed_shape(64, 40)    # B[K=64, N=40] -> [N/16][K][16]
    (3, 64, 16)
    >>> fwd, inv = Packing.blocked_b(16).index_maps()
    >>> fwd(5, 37), inv(*fwd(5, 37))
    ((2, 5, 5), (5, 37))
    """

    row_block: int
    col_block: int
    order: tuple[str, ...]
    name: str = "packing"
    value_range: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        _positive(self.row_block, "row_block")
        _positive(self.col_block, "col_block")
        if self.value_range is not None and self.value_range[0] > self.value_range[1]:
            raise ValueError(f"{self.name}: empty value range {self.value_range}")
        wanted = {"R", "C"} | ({"r"} if self.row_block > 1 else set()) | (
            {"c"} if self.col_block > 1 else set())
        if sorted(self.order) != sorted(wanted):
            raise ValueError(f"{self.name}: order {self.order} must list each of "
                             f"{sorted(wanted)} exactly once")

    @classmethod
    def _of(cls, row_block: int, col_block: int, order: str, name: str) -> Packing:
        """Drop the inner pieces of unsplit axes from ``order`` (e.g. bn = 1)."""
        _positive(row_block, "row block")
        _positive(col_block, "column block")
        unsplit = ("r" if row_block == 1 else "") + ("c" if col_block == 1 else "")
        return cls(row_block, col_block, tuple(p for p in order if p not in unsplit), name)

    @classmethod
    def blocked_b(cls, bn: int) -> Packing:
        """``B[K, N] -> Bp[N/bn][K][bn]``: the ``[K, bn]`` panel of each N block contiguous."""
        return cls._of(1, bn, "CRc", f"blocked_b({bn})")

    @classmethod
    def blocked_a(cls, bm: int, bk: int) -> Packing:
        """``A[M, K] -> Ap[M/bm][K/bk][bm][bk]``."""
        return cls._of(bm, bk, "RCrc", f"blocked_a({bm}, {bk})")

    @classmethod
    def vnni_b(cls, alpha: int) -> Packing:
        """``B[K, N] -> Bp[K/alpha][N][alpha]``: ``alpha`` consecutive K values per column."""
        return cls._of(alpha, 1, "RCr", f"vnni_b({alpha})")

    @classmethod
    def for_layout(cls, layout: str) -> Packing:
        """The packing of a BRGEMM B operand in ``layout`` (``vnni2``, ``vnni4``,
        ``vnni4_w7``), with the layout's value range.

        >>> w7 = Packing.for_layout("vnni4_w7")
        >>> w7.pack(np.full((4, 2), 65, "int8"))
        Traceback (most recent call last):
        ...
        ValueError: vnni_b(4): values must lie in [-64, 64], got [65, 65]
        """
        if layout not in LAYOUTS or LAYOUTS[layout][0] == 1:
            raise ValueError(f"{layout!r} is not a VNNI layout of B")
        return replace(cls.vnni_b(LAYOUTS[layout][0]), value_range=B_RANGES.get(layout))

    @classmethod
    def vnni_blocked_b(cls, alpha: int, bn: int) -> Packing:
        """``B[K, N] -> Bp[N/bn][K/alpha][bn][alpha]``: a VNNI panel per N block."""
        return cls._of(alpha, bn, "CRcr", f"vnni_blocked_b({alpha}, {bn})")

    # -- shapes ---------------------------------------------------------------------------------

    def padded_shape(self, rows: int, cols: int) -> tuple[int, int]:
        """``(rows, cols)`` rounded up to whole blocks: what the packed array covers."""
        return padded(rows, self.row_block), padded(cols, self.col_block)

    def _extents(self, rows: int, cols: int) -> dict[str, int]:
        pr, pc = self.padded_shape(rows, cols)
        return {"R": pr // self.row_block, "r": self.row_block,
                "C": pc // self.col_block, "c": self.col_block}

    def packed_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        """Shape of the packed array of an ``X[rows, cols]``."""
        extents = self._extents(rows, cols)
        return tuple(extents[p] for p in self.order)

    # -- numpy ----------------------------------------------------------------------------------

    def _axes(self) -> tuple[str, ...]:
        """``order`` plus the unit-extent pieces it leaves out (their position is immaterial)."""
        return self.order + tuple(p for p in _PIECES if p not in self.order)

    def pack(self, x: np.ndarray) -> np.ndarray:
        """numpy ``X[R, C]`` -> a new contiguous packed array, zero in the padding."""
        x = np.asarray(x)
        if x.ndim != 2 or 0 in x.shape:
            raise ValueError(f"{self.name}: expected a non-empty 2-D array, got shape {x.shape}")
        if self.value_range is not None:
            lo, hi = self.value_range
            if x.min() < lo or x.max() > hi:
                raise ValueError(f"{self.name}: values must lie in [{lo}, {hi}], "
                                 f"got [{x.min()}, {x.max()}]")
        rows, cols = x.shape
        pr, pc = self.padded_shape(rows, cols)
        full = np.zeros((pr, pc), dtype=x.dtype)
        full[:rows, :cols] = x
        split = full.reshape(pr // self.row_block, self.row_block, pc // self.col_block,
                             self.col_block)
        perm = tuple(_PIECES.index(p) for p in self._axes())
        return np.ascontiguousarray(split.transpose(perm)).reshape(self.packed_shape(rows, cols))

    def unpack(self, xp: np.ndarray, rows: int, cols: int) -> np.ndarray:
        """Inverse of :meth:`pack`: the ``X[rows, cols]`` held in ``xp``, padding dropped."""
        xp = np.asarray(xp)
        expected = self.packed_shape(rows, cols)
        if xp.shape != expected:
            raise ValueError(f"{self.name}: a packed [{rows}, {cols}] operand has shape "
                             f"{expected}, got {xp.shape}")
        extents = self._extents(rows, cols)
        axes = self._axes()
        split = xp.reshape(tuple(extents[p] for p in axes))
        full = split.transpose(tuple(axes.index(p) for p in _PIECES))
        pr, pc = self.padded_shape(rows, cols)
        return np.ascontiguousarray(full.reshape(pr, pc)[:rows, :cols])

    # -- TIR / TE -------------------------------------------------------------------------------

    def index_maps(self) -> tuple[Callable[..., tuple], Callable[..., tuple]]:
        """``(forward, inverse)``: ``X[i, j]`` is ``Xp[forward(i, j)]``; ``inverse`` undoes it.

        Both work on ints and on TIR expressions, so ``forward`` can be handed to
        ``sch.transform_layout(block, buffer, forward, pad_value=0)``.
        """
        br, bc = self.row_block, self.col_block

        def forward(i, j):
            pieces = {"R": i // br if br > 1 else i, "r": i % br,
                      "C": j // bc if bc > 1 else j, "c": j % bc}
            return tuple(pieces[p] for p in self.order)

        def inverse(*packed):
            if len(packed) != len(self.order):
                raise ValueError(f"{self.name}: expected {len(self.order)} packed indices, "
                                 f"got {len(packed)}")
            pieces = dict(zip(self.order, packed, strict=True))
            return (pieces["R"] * br + pieces.get("r", 0), pieces["C"] * bc + pieces.get("c", 0))

        return forward, inverse

    def te_pack(self, x: te.Tensor, name: str | None = None) -> te.Tensor:
        """TE stage computing the packed form of the 2-D tensor ``x`` (zero in the padding)."""
        from tvm import te, tirx

        if len(x.shape) != 2:
            raise ValueError(f"{self.name}: expected a 2-D tensor, got shape {x.shape}")
        rows, cols = (int(d) for d in x.shape)
        _, inverse = self.index_maps()
        pr, pc = self.padded_shape(rows, cols)

        def element(*idx):
            i, j = inverse(*idx)
            if (pr, pc) == (rows, cols):
                return x[i, j]
            inside = tirx.all(i < rows, j < cols)
            return tirx.if_then_else(inside, x[i, j], tirx.const(0, x.dtype))

        return te.compute(self.packed_shape(rows, cols), element,
                          name=name or f"{x.op.name}_packed")

    def te_unpack(self, xp: te.Tensor, rows: int, cols: int, name: str | None = None
                  ) -> te.Tensor:
        """TE stage reading ``X[rows, cols]`` back out of its packed form ``xp``."""
        from tvm import te

        expected = self.packed_shape(rows, cols)
        if tuple(int(d) for d in xp.shape) != expected:
            raise ValueError(f"{self.name}: a packed [{rows}, {cols}] operand has shape "
                             f"{expected}, got {tuple(xp.shape)}")
        forward, _ = self.index_maps()
        return te.compute((rows, cols), lambda i, j: xp[forward(i, j)],
                          name=name or f"{xp.op.name}_unpacked")


# -------------------------------------------------------------------------------------------------
# MMLA block layout (aarch64 smmla / usmmla / bfmmla; used by microkernels.arm's "mmla" layout).
#
# An operand X[rows, K] (A as is; B[K, n] through its transpose, B^T[n, K]) is stored as
# Xp[rows/2][K/kb][2][kb] with Xp[r2, kq, r, kk] = X[2*r2 + r, kq*kb + kk]: each 2 x kb block
# (16 bytes) is one MMLA source register, and the K blocks of a row pair follow each other.
# kb = 8 for int8/uint8, 4 for bfloat16.  The numpy packers zero-pad rows to even and K to kb.
# -------------------------------------------------------------------------------------------------

#: dtype -> K elements of one MMLA block row.
MMLA_K_BLOCK: dict[str, int] = {"int8": 8, "uint8": 8, "bfloat16": 4}


def mmla_k_block(dtype: str) -> int:
    """K elements per MMLA block row for ``dtype`` (8 for int8/uint8, 4 for bfloat16).

    >>> mmla_k_block("bfloat16")
    4
    """
    if dtype not in MMLA_K_BLOCK:
        raise ValueError(f"no MMLA instruction for {dtype!r}; supported: {', '.join(MMLA_K_BLOCK)}")
    return MMLA_K_BLOCK[dtype]


def _check_operand(operand: str) -> None:
    if operand not in ("a", "b"):
        raise ValueError(f"operand must be 'a' ([M, K]) or 'b' ([K, N]), got {operand!r}")


def pack_mmla(x: np.ndarray, kb: int, operand: str = "a") -> np.ndarray:
    """Pack a 2-D operand into MMLA blocks ``[ceil(R/2)][ceil(K/kb)][2][kb]``, zero-padded.

    Parameters
    ----------
    x
        ``A[M, K]`` for ``operand="a"``, ``B[K, N]`` for ``operand="b"`` (rows R = M or N).
    kb
        K elements per block row (:func:`mmla_k_block`).

    Examples
    --------
    >>> pack_mmla(np.arange(6).reshape(3, 2), 4, "b").shape   # B[K=3, N=2]
    (1, 1, 2, 4)
    """
    _check_operand(operand)
    if x.ndim != 2 or kb <= 0:
        raise ValueError(f"pack_mmla needs a 2-D array and kb > 0, got shape {x.shape}, kb={kb}")
    rows_k = x if operand == "a" else x.T
    rows, k = rows_k.shape
    padded = np.zeros((-(-rows // 2) * 2, -(-k // kb) * kb), dtype=x.dtype)
    padded[:rows, :k] = rows_k
    r2, kq = padded.shape[0] // 2, padded.shape[1] // kb
    return np.ascontiguousarray(padded.reshape(r2, 2, kq, kb).transpose(0, 2, 1, 3))


def unpack_mmla(xp: np.ndarray, shape: tuple[int, int], operand: str = "a") -> np.ndarray:
    """Inverse of :func:`pack_mmla`: the ``shape`` operand (``[M, K]`` or ``[K, N]``), unpadded."""
    _check_operand(operand)
    if xp.ndim != 4 or xp.shape[2] != 2:
        raise ValueError(f"expected MMLA blocks [R/2][K/kb][2][kb], got shape {xp.shape}")
    r2, kq, _, kb = xp.shape
    rows_k = xp.transpose(0, 2, 1, 3).reshape(2 * r2, kq * kb)
    rows, k = shape if operand == "a" else shape[::-1]
    if rows > 2 * r2 or k > kq * kb:
        raise ValueError(f"shape {shape} does not fit packed blocks {xp.shape}")
    out = rows_k[:rows, :k]
    return np.ascontiguousarray(out if operand == "a" else out.T)


def mmla_index_maps(kb: int, operand: str = "a") -> tuple[Callable, Callable]:
    """(forward, inverse) index maps of the MMLA packing, for ``sch.transform_layout``.

    ``operand="a"`` maps ``A[i, k]`` to ``Ap[i // 2, k // kb, i % 2, k % kb]``; ``"b"`` maps
    ``B[k, j]`` to ``Bp[j // 2, k // kb, j % 2, k % kb]``.  The inverse maps packed indices back.
    Extents must be multiples of 2 (rows) and ``kb`` (K) for the maps to be bijective.

    >>> fwd, inv = mmla_index_maps(8, "b")
    >>> fwd(13, 5), inv(*fwd(13, 5))
    ((2, 1, 1, 5), (13, 5))
    """
    _check_operand(operand)
    if operand == "a":
        return (lambda i, k: (i // 2, k // kb, i % 2, k % kb),
                lambda r2, kq, r, kk: (r2 * 2 + r, kq * kb + kk))
    return (lambda k, j: (j // 2, k // kb, j % 2, k % kb),
            lambda r2, kq, r, kk: (kq * kb + kk, r2 * 2 + r))
