"""Batch GEMM of two activations (attention's ``Q @ K^T`` and ``P @ V``) around BRGEMM.

``Y[b] = epilogue(X[b] @ B[b])`` for ``b < batch``, where B is a tensor computed at run time,
so it cannot be packed ahead like a dense layer's weights.  The PrimFunc packs it itself,
one ``K x bn`` panel at a time into the flat BRGEMM's contiguous B operand
(``Bp[batch, N/bn, K, bn]``): O(K*N) copies per batch element against O(M*N*K) flops.

Loops (outermost first)::

    parallel for (b, jo)                 # batch element x N panel [x M block, see below]
        pack Bp[b, jo] <- B[b][:, jo*bn : (jo+1)*bn]   (vectorized along bn)
        for io:                          # M blocks of bm rows
            C tile = 0
            BRGEMM(bm x bn x K): C tile += X[b][io] @ Bp[b, jo]
            epilogue on the tile while it is hot

Each parallel task owns its B panel, so packing is never repeated; only when there are too
few (batch, panel) tasks for the threads do the M blocks join the parallel loop and each task
packs its panel itself (``BatchGemmConfig.parallel_rows``, cost ``1/bm`` of the compute).

Operand layouts.  Attention keeps heads interleaved along the channels (``[..., S, H, D]``,
what a ``[..., S, H*D]`` projection reshapes to) and permutes them to ``[..., H, S, D]`` for
the matmuls.  Instead of materializing those permutes, each operand may be read (written, for
Y) *interleaved*: with ``heads = H`` the batch index is ``b = o * H + h`` and

=====  ===========================  =================================================
        plain                        interleaved
=====  ===========================  =================================================
X      ``[batch * M, K]``           ``[batch / H * M, H * K]``: X[b][i, r] at
                                    ``[o * M + i, h * K + r]``
B      ``[batch, K, N]``            ``[batch / H, K, H * N]``
B^T    ``[batch, N, K]``            ``[batch / H, N, H * K]``  (``b_transposed``)
Y      ``[batch * M, N]``           ``[batch / H * M, H * N]``
=====  ===========================  =================================================

The epilogue sees Y in its stored two-dimensional form: operand shapes follow
``Operand.shape(*problem.y_shape)``.

Operand types (:data:`OPERANDS`, the GEMM template's kernel families).  ``"float32"``
multiplies float32 X and B.  ``"bfloat16"`` takes float32 X and B too and rounds them to bf16
(to nearest even) while it packs them: B into the VNNI-2 panel ``Bp[batch, N/bn, K'/2, bn,
2]``, the rows of X an M block reads into a bf16 copy ``Xc`` under that block (per task: a
task's rows are converted once per N panel, ``1/bn`` of the compute); float32 accumulation
and epilogue, and Y float32 or, after a final ``convert``, bfloat16.  With ``bf16_inputs``
X and B are stored in bf16 by their producers: packed without rounding, X's rows read in
place where K is whole pairs.  ``"uint8"`` multiplies
uint8 X by uint8 B shifted to int8 while packed (``b - 128``, VNNI-4, ``vpdpbusd``),
accumulating in int32; X is read in place (a zero-padded copy when K is not a multiple of
4).  With the operands' zero points ``(za, zb)``::

    sum_k (a - za)(b - zb) = sum_k a (b - 128) + (128 - zb) rowsum_a[i] - za colsum_b[j] + K za zb

the accumulator starts from the last three terms instead of 0 (stage ``zero_fold``): the
row sums of X under each M block, the column sums of B per task (the panel's), both int32
and computed in the PrimFunc; a term whose factor is 0 is left out.  The epilogue then starts
from the exact int32 (or its float32 value, for a chain starting with ``scale``) and may end
in ``requantize`` (uint8/int8 Y).  K is padded to whole VNNI groups (:attr:`padded_k`) with
zeros in the packed B.  On ``amx`` tile-shaped uint8 and bf16 blocks (the defaults choose
them) run AMX tiles, others the AVX-512 kernel (:func:`microkernels.brgemm.find_impl`'s
fallback); the bf16 kernels read the bf16 buffers the function allocates (``Xc``, ``Bp``,
which TVM stores as float32) through uint16 views.

Softmax over X (:attr:`BatchGemmProblem.softmax`).  Attention's ``P @ V`` reads ``P =
softmax(scores)`` over the rows of X.  Instead of a pass of its own over the score tensor
(written and read back, several MiB at batch 8), the rows an M block reads are normalized
where ``Xc`` is made, under the loop that makes it (a task per batch element by default, so
once per row): the row maxima (stage ``row_max``), ``exp(x - max)`` (``row_exp``), their
sums (``row_sum``), then ``Xc = row_exp / row_sum``, rounded for bf16, all in cache; the
reductions run as vector partial results.  A 0/1 mask (``mask_fill``: GPT-2's causal
``where(mask, scores, -FLT_MAX)``) is applied as the rows are read.

Examples
--------
>>> p = BatchGemmProblem(batch=12, m=128, n=128, k=64, b_transposed=True)
>>> p.x_shape, p.b_shape, p.y_shape
((1536, 64), (12, 128, 64), (1536, 128))
>>> q = BatchGemmProblem(12, 128, 128, 64, True, heads=12, x_interleaved=True,
...                      b_interleaved=True)
>>> q.x_shape, q.b_shape
((128, 768), (1, 128, 768))
>>> from microkernels.isa import DEFAULT_CACHES, from_name
>>> machine = Machine(from_name("avx2"), DEFAULT_CACHES, threads=2)
>>> sch = schedule(p, default_config(p, machine), "avx2")   # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from microkernels import amx as _amx
from microkernels import isa as _isa
from microkernels.brgemm import LAYOUTS, BrgemmShape, dispatch
from microkernels.epilogue import DTYPE_TAGS, Epilogue, expression_isa, to_bf16, vector_lanes
from microkernels.machine import Machine

from .blocking import divisors, near_divisors
from .nest import loop_bound_to, zeroing_kernel
from .operands import OPERANDS, TypedProblem

if TYPE_CHECKING:
    import numpy as np
    from tvm import s_tir, te, tirx
    from tvm.s_tir import LoopRV, SBlockRV
    from tvm.tirx import PrimFunc

__all__ = ["OPERANDS", "BatchGemmProblem", "BatchGemmConfig", "default_config", "candidates",
           "workload", "product_stages", "schedule", "schedule_product", "checked",
           "whole_or_block", "reference", "stored_shapes"]


#: uint8 B is shifted into the kernel's int8 B by this.
_B_SHIFT = 128


def _positive(value: object, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{what} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class BatchGemmProblem(TypedProblem):
    """``Y[b] = epilogue(X[b] @ B[b])`` for ``batch`` pairs of activations.

    Parameters
    ----------
    batch, m, n, k
        Number of GEMMs and their sizes (``X[b]`` is ``m x k``, ``B[b]`` is ``k x n``).
    b_transposed
        B is stored as ``[N, K]`` per batch element (``X @ B^T``, as in ``Q @ K^T``).
    epilogue
        Elementwise chain applied to each finished output tile of the stored Y.
    heads
        Batch elements interleaved along the columns of the interleaved operands; divides
        ``batch``.  1 when no operand is interleaved.
    x_interleaved, b_interleaved, y_interleaved
        Which operands are stored interleaved (module docstring).
    dtype
        What the kernel multiplies in (:data:`OPERANDS`): ``"float32"``, ``"bfloat16"``
        (float32 X and B rounded while packed) or ``"uint8"`` (uint8 X and B).
    zero_points
        uint8: the zero points ``(za, zb)`` of X and B, folded in (module docstring).
    softmax
        X holds scores and the product reads ``softmax(X[b])`` over K (attention's ``P @ V``
        with ``P = softmax(scores)``): the rows an M block reads are normalized in float32
        into ``Xc`` (module docstring).  float32 and bfloat16 only.
    mask_fill
        With ``softmax``: the function takes a uint8 ``mask[m, k]``, the same for every
        batch element, and an element of X whose mask is 0 reads as this value (a causal
        mask's ``where(mask, scores, -FLT_MAX)`` before the softmax).
    bf16_inputs
        bfloat16 problems: B, and X unless it holds a softmax's (float32) scores, are stored
        in bfloat16 already (their producers hand over in bf16), not rounded from float32;
        X is then read in place where K is whole VNNI pairs.

    Examples
    --------
    >>> p = BatchGemmProblem(3, 5, 7, 9, True, dtype="uint8", zero_points=(3, 200))
    >>> (p.acc_dtype, p.b_layout, p.padded_k, p.out_dtype, p.layout)
    ('int32', 'vnni4', 12, 'int32', 'tu8z3.200')
    """

    batch: int
    m: int
    n: int
    k: int
    b_transposed: bool = False
    epilogue: Epilogue = field(default_factory=Epilogue)
    heads: int = 1
    x_interleaved: bool = False
    b_interleaved: bool = False
    y_interleaved: bool = False
    dtype: str = "float32"
    zero_points: tuple[int, int] = (0, 0)
    softmax: bool = False
    mask_fill: float | None = None
    bf16_inputs: bool = False

    def __post_init__(self) -> None:
        for name in ("batch", "m", "n", "k", "heads"):
            _positive(getattr(self, name), f"BatchGemmProblem.{name}")
        flags = ("b_transposed", "x_interleaved", "b_interleaved", "y_interleaved", "softmax",
                 "bf16_inputs")
        for name in flags:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"BatchGemmProblem.{name} must be a bool")
        if not isinstance(self.epilogue, Epilogue):
            raise TypeError(f"epilogue must be an Epilogue, got {type(self.epilogue).__name__}")
        if self.batch % self.heads:
            raise ValueError(f"heads={self.heads} does not divide batch={self.batch}")
        interleaved = self.x_interleaved or self.b_interleaved or self.y_interleaved
        if interleaved != (self.heads > 1):
            raise ValueError(f"heads={self.heads}: heads > 1 exactly when some operand is "
                             "interleaved")
        if self.dtype not in OPERANDS:
            raise ValueError(f"the batch GEMM template handles {', '.join(OPERANDS)}, "
                             f"got {self.dtype!r}")
        zero_points = tuple(self.zero_points)
        if len(zero_points) != 2 or not all(
                isinstance(z, int) and not isinstance(z, bool) and 0 <= z <= 255
                for z in zero_points):
            raise ValueError(f"zero_points must be two ints in [0, 255], got {self.zero_points!r}")
        object.__setattr__(self, "zero_points", zero_points)
        if self.dtype != "uint8" and zero_points != (0, 0):
            raise ValueError("zero points are for uint8 operands only")
        if self.bf16_inputs and self.dtype != "bfloat16":
            raise ValueError("bf16_inputs are for bfloat16 problems only")
        if self.softmax and self.dtype == "uint8":
            raise ValueError("a softmax over X needs float32 scores: not for uint8 operands")
        if self.mask_fill is not None:
            if not self.softmax:
                raise ValueError("mask_fill masks the scores of a softmax: needs softmax=True")
            if isinstance(self.mask_fill, bool) or not isinstance(self.mask_fill, (int, float)) \
                    or math.isnan(self.mask_fill):
                raise ValueError(f"mask_fill must be a number, got {self.mask_fill!r}")
            object.__setattr__(self, "mask_fill", float(self.mask_fill))
        out = self.epilogue.out_dtype(self.epilogue_dtype)  # raises for ill-typed chains
        if self.dtype != "uint8" and out not in ("float32", "bfloat16"):
            raise ValueError(f"a {self.dtype} batch GEMM writes float32, or bfloat16 through "
                             f"a final convert: the epilogue must end in one, not {out}")

    def _h(self, interleaved: bool) -> int:
        return self.heads if interleaved else 1

    @property
    def x_shape(self) -> tuple[int, int]:
        """Stored shape of X."""
        h = self._h(self.x_interleaved)
        return (self.batch // h * self.m, h * self.k)

    @property
    def b_shape(self) -> tuple[int, int, int]:
        """Stored shape of B (``[N, K]`` panels when ``b_transposed``)."""
        h = self._h(self.b_interleaved)
        rows, cols = (self.n, self.k) if self.b_transposed else (self.k, self.n)
        return (self.batch // h, rows, h * cols)

    @property
    def y_shape(self) -> tuple[int, int]:
        """Stored shape of Y (and of C, which the epilogue reads)."""
        h = self._h(self.y_interleaved)
        return (self.batch // h * self.m, h * self.n)

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k


    @property
    def b_layout(self) -> str:
        """The BRGEMM layout of the packed B: ``flat``, ``vnni2`` or ``vnni4``."""
        return OPERANDS[self.dtype][1]

    @property
    def io_dtype(self) -> str:
        """The dtype of the stored B (and X, :attr:`x_dtype`): float32 (bfloat16 problems
        convert it while they pack), bfloat16 with :attr:`bf16_inputs`, or uint8."""
        return ("uint8" if self.dtype == "uint8" else "bfloat16" if self.bf16_inputs
                else "float32")

    @property
    def x_dtype(self) -> str:
        """The dtype of the stored X: float32 scores for a softmax over X, else
        :attr:`io_dtype`."""
        return "float32" if self.softmax else self.io_dtype

    @property
    def alpha(self) -> int:
        """K elements per VNNI group of the packed B (1: not grouped)."""
        return LAYOUTS[self.b_layout][0]

    @property
    def padded_k(self) -> int:
        """K rounded up to whole VNNI groups: the K the blocks tile."""
        return -(-self.k // self.alpha) * self.alpha



    @property
    def layout(self) -> str:
        """Layout letters (t: B^T; x/b/y: interleaved) and the heads, "" for plain operands.

        Examples
        --------
        >>> BatchGemmProblem(12, 8, 8, 8, True, heads=12, x_interleaved=True).layout
        'tx12'
        """
        tags = "".join(t for t, on in (("t", self.b_transposed), ("x", self.x_interleaved),
                                       ("b", self.b_interleaved), ("y", self.y_interleaved),
                                       ("s", self.softmax), ("m", self.mask_fill is not None),
                                       ("i", self.bf16_inputs))
                       if on)
        tags += str(self.heads) if self.heads > 1 else ""
        if self.dtype != "float32":  # tuning keys tell the precisions apart by the layout
            tags += DTYPE_TAGS[self.dtype]
            za, zb = self.zero_points
            tags += f"z{za}.{zb}" if self.zero_points != (0, 0) else ""
        return tags

    @property
    def name(self) -> str:
        """A short unique name: sizes, :attr:`layout`, epilogue."""
        name = f"{self.batch}x{self.m}x{self.n}x{self.k}"
        if self.layout:
            name += f"_{self.layout}"
        return name + (f"_{self.epilogue.name}" if self.epilogue.ops else "")


@dataclass(frozen=True)
class BatchGemmConfig:
    """Block sizes of a batch GEMM; one BRGEMM call reduces the whole K.

    Parameters
    ----------
    bm, bn
        Rows and columns of an output tile; each divides its dimension.
    bk
        K block of the BRGEMM (its batch-reduce count is ``K / bk``).
    parallel_rows
        Also run the M blocks in parallel (each task then packs its own B panel).
    rows_outer
        Each task one batch element, its M blocks outside its N panels: B is packed once for
        all its panels and each M block's rows (converted to bf16, or padded) once for all of
        them, where a task per N panel converts every row once per panel.
    """

    bm: int
    bn: int
    bk: int
    parallel_rows: bool = False
    rows_outer: bool = False

    def __post_init__(self) -> None:
        for name in ("bm", "bn", "bk"):
            _positive(getattr(self, name), f"BatchGemmConfig.{name}")
        if self.parallel_rows and self.rows_outer:
            raise ValueError("BatchGemmConfig: parallel_rows runs each M block as a task of "
                             "its own, rows_outer a whole batch element: choose one")

    def check(self, problem: BatchGemmProblem) -> None:
        """ValueError unless the blocks tile ``problem`` exactly."""
        for block, dim, name in ((self.bm, problem.m, "bm"), (self.bn, problem.n, "bn"),
                                 (self.bk, problem.padded_k, "bk")):
            if dim % block:
                raise ValueError(f"{name}={block} does not divide {dim}")
        if self.bk % problem.alpha:
            raise ValueError(f"bk={self.bk} is not a multiple of {problem.alpha}, the VNNI "
                             f"group of {problem.dtype} batch GEMMs")


def whole_or_block(dim: int, limit: int, multiple: int = 1, step: int = 1) -> int:
    """The largest divisor of ``dim`` within ``limit`` (preferring multiples of ``multiple``,
    only multiples of ``step``); the whole ``dim`` instead of a sliver when ``dim`` has no
    fair divisor (a prime sequence length such as 197) and is not too large for one block."""
    fitting = [d for d in divisors(dim) if d <= limit and d % step == 0] or [dim]
    best = max([d for d in fitting if d % multiple == 0] or fitting)
    return dim if 4 * best < min(dim, limit) and dim <= 4 * limit else best


def default_config(problem: BatchGemmProblem, machine: Machine) -> BatchGemmConfig:
    """Blocks following :func:`schedules.blocking.default_config`'s rules (tiles of at most
    64 x 64, one register tile of columns (x86) or two vectors wide where possible, K whole
    in blocks of at most 512; on AMX uint8 and bf16 blocks are tile-shaped, as
    :func:`schedules.gemm.whole_k_config` chooses them); low-precision problems and those
    with a softmax over X with two batch elements per thread or more run a task per batch
    element (``rows_outer``), the
    others parallel M blocks when the (batch, panel) tasks number fewer than two per thread.

    Examples
    --------
    >>> from microkernels.isa import DEFAULT_CACHES, from_name
    >>> spr = Machine(from_name("amx"), DEFAULT_CACHES, threads=2)
    >>> c = default_config(BatchGemmProblem(12, 128, 128, 64, True, dtype="uint8"), spr)
    >>> (c.bm, c.bn, c.bk, c.rows_outer)
    (32, 32, 64, True)
    """
    lanes = machine.isa.lanes("float32")
    n = problem.n
    if problem.dtype != "float32" and machine.isa.has("amx_tile"):
        # AMX: tile-shaped blocks and K blocks of whole tile rows, as the GEMM template's.
        from .gemm import _k_block, _tile_blocks

        bm, bn = _tile_blocks(problem.m, n)
        bk = _k_block(problem.padded_k, problem.alpha, _amx.TILE_BYTES)
    else:
        # One register tile of columns where it divides N, as the GEMM template's blocks: on a
        # Zen 3, BERT's Q @ K^T (12 x 128 x 128 x 64, B^T packed per panel) ran 1.18x faster
        # at 16 columns than at 64; its P @ V the same.
        from .gemm import _tile_width

        width = _tile_width(machine.isa)
        bn = (width if width and n % width == 0
              else whole_or_block(n, max(64, 2 * lanes), 2 * lanes) if n % lanes == 0
              else whole_or_block(n, 64, lanes))
        bm = whole_or_block(problem.m, 64)
        bk = whole_or_block(problem.padded_k, 512, step=problem.alpha)
    if (problem.dtype != "float32" or problem.softmax) and problem.batch >= 2 * machine.threads:
        # A task per batch element: its rows converted (normalized, for a softmax) once, not
        # once per N panel.  BERT's attention on Sapphire Rapids, bf16 and uint8 tiles:
        # 1.25-1.48x (float32 without a softmax 1.00x).
        return BatchGemmConfig(bm, bn, bk, rows_outer=True)
    tasks = problem.batch * (n // bn)
    return BatchGemmConfig(bm, bn, bk,
                           parallel_rows=tasks < 2 * machine.threads and problem.m > bm)


def candidates(problem: BatchGemmProblem, machine: Machine) -> list[BatchGemmConfig]:
    """A short list of configurations worth measuring, :func:`default_config`'s first.

    Measurement only: no cost model ranks these; the tuner times them all, so the list stays
    short.  After the default come its blocks with the other task layout (a task per batch
    element, ``rows_outer``, or a task per N panel) and with the M blocks' parallelism
    flipped, then, each with both parallelisms, the two nearest other ``bm`` (divisors of M
    from 8 to 128 rows), the nearest other ``bn`` (a vector multiple up to 64 where N has
    one, two vectors wide or more) and the nearest other ``bk`` (a divisor of K up to 512, a
    vector or more).  Parallel M blocks are only tried when M has more than one
    block.  That makes eleven configurations at most.

    Examples
    --------
    >>> from microkernels.isa import DEFAULT_CACHES, from_name
    >>> machine = Machine(from_name("avx2"), DEFAULT_CACHES, threads=2)
    >>> p = BatchGemmProblem(batch=12, m=128, n=128, k=64, b_transposed=True)
    >>> found = candidates(p, machine)
    >>> found[0] == default_config(p, machine)
    True
    >>> [(c.bm, c.bn, c.bk, c.parallel_rows, c.rows_outer) for c in found[:3]]
    [(64, 16, 64, False, False), (64, 16, 64, False, True), (64, 16, 64, True, False)]
    >>> sorted({c.bn for c in found})  # one register tile, and two
    [16, 32]
    """
    base = default_config(problem, machine)
    lanes = machine.isa.lanes("float32")
    p = problem
    blocks = [replace(base, bm=bm) for bm in near_divisors(p.m, base.bm, 2, lo=min(8, p.m),
                                                           hi=128)]
    blocks += [replace(base, bn=bn) for bn in near_divisors(
        p.n, base.bn, 1, lo=min(2 * lanes if p.n % lanes == 0 else lanes, p.n), hi=64,
        multiple=lanes if p.n % lanes == 0 else 1)]
    kp, alpha = p.padded_k, p.alpha
    blocks += [replace(base, bk=bk) for bk in near_divisors(kp, base.bk, 1, lo=min(lanes, kp),
                                                           hi=512, multiple=alpha)
               if bk % alpha == 0]
    found = []
    for config in (base, *blocks):
        for parallel_rows in (config.parallel_rows, not config.parallel_rows):
            flipped = replace(config, parallel_rows=parallel_rows and p.m > config.bm,
                              rows_outer=config.rows_outer and not parallel_rows)
            if flipped not in found:
                found.append(flipped)
    other = replace(base, parallel_rows=False, rows_outer=not base.rows_outer)
    if other not in found:
        found.insert(1, other)
    return found


def stored_shapes(problem: BatchGemmProblem, batch: tirx.PrimExpr | None = None
                  ) -> tuple[tuple, tuple, tuple]:
    """The stored shapes of X, B and Y for ``batch`` copies of ``problem`` (a run-time batch:
    each first dimension, proportional to ``problem.batch``, times ``batch``).

    Examples
    --------
    >>> stored_shapes(BatchGemmProblem(4, 8, 16, 32))
    ((32, 32), (4, 32, 16), (32, 16))
    """
    shapes = (problem.x_shape, problem.b_shape, problem.y_shape)
    if batch is None:
        return shapes
    return tuple((batch * shape[0], *shape[1:]) for shape in shapes)


def workload(problem: BatchGemmProblem, bn: int, batch: tirx.Var | None = None,
             isa: str = "generic") -> PrimFunc:
    """The unscheduled PrimFunc ``(X, B, *epilogue operands, Y)`` with the packing stage ``Bp``,
    the GEMM ``C`` over the stored Y's ``[rows, cols]`` and the stage ``epilogue`` (if any);
    with a run-time ``batch`` (a symbolic batch: the parameter before the output) it
    computes ``batch * problem.batch`` GEMMs.

    bfloat16 problems add ``Xc``, X's rows converted to bf16 (K padded to even); uint8 ones
    ``Xc`` only for a K padded to whole VNNI-4 groups, and, for non-zero zero points, the sums
    ``colsum`` (of B's columns) and ``rowsum`` (of X's rows) that the epilogue folds in.  A
    softmax over X adds ``row_max``, ``row_exp`` and ``row_sum`` before ``Xc`` (of X's rows
    normalized) and, with ``mask_fill``, the parameter ``mask`` after B.  ``Xc``'s rounding
    to bf16 is ``isa``'s (:func:`microkernels.epilogue.to_bf16`)."""
    from tvm import te

    p = problem
    x_shape, b_shape, _ = stored_shapes(p, batch)
    x = te.placeholder(x_shape, p.x_dtype, name="X")
    b_in = te.placeholder(b_shape, p.io_dtype, name="B")
    mask = None if p.mask_fill is None else te.placeholder((p.m, p.k), "uint8", name="mask")
    y, extra = product_stages(p, bn, x, b_in, mask, batch, isa)
    scalars = [] if batch is None else [batch]
    masks = [] if mask is None else [mask]
    return te.create_prim_func([x, b_in, *masks, *extra, *scalars, y])


def product_stages(problem: BatchGemmProblem, bn: int, x: te.Tensor, b_in: te.Tensor,
                   mask: te.Tensor | None = None, batch: tirx.Var | None = None,
                   isa: str = "generic", tag: str = "") -> tuple[te.Tensor, list[te.Tensor]]:
    """:func:`workload`'s stages computing Y from the stored X and B (``x`` may be computed
    itself: attention's scores), each stage's name prefixed by ``tag``: Y and the epilogue's
    operand placeholders, in the chain's order."""
    from tvm import te, tirx

    from microkernels.epilogue import apply_te

    p = problem
    if p.n % bn:
        raise ValueError(f"bn={bn} does not divide N={p.n}")
    m, n, k, kp, alpha = p.m, p.n, p.k, p.padded_k, p.alpha
    acc = p.acc_dtype
    hx, hb, hy = (p._h(f) for f in (p.x_interleaved, p.b_interleaved, p.y_interleaved))
    gemms = p.batch if batch is None else batch * p.batch
    _, _, y_shape = stored_shapes(p, batch)

    def b_at(b, r, j):  # B[b][r, j]
        o, h = b // hb, b % hb
        if p.b_transposed:
            return b_in[o, j, h * k + r]
        return b_in[o, r, h * n + j]

    def x_at(b, i, r):  # X[b][i, r]
        return x[b // hx * m + i, (b % hx) * k + r]

    def packed(v):  # a stored value as the kernel's B holds it
        if p.dtype == "bfloat16":
            return to_bf16(v) if b_in.dtype == "float32" else v
        if p.dtype == "uint8":
            return (v.astype("int32") - _B_SHIFT).astype("int8")
        return v

    b_dtype = {"float32": "float32", "bfloat16": "bfloat16", "uint8": "int8"}[p.dtype]
    if alpha == 1:
        bp = te.compute((gemms, n // bn, k, bn),
                        lambda b, jo, r, ji: b_at(b, r, jo * bn + ji), name=f"{tag}Bp")
    else:
        def group(b, jo, kq, ji, t):
            r = kq * alpha + t
            value = packed(b_at(b, tirx.min(r, k - 1), jo * bn + ji))
            return value if kp == k else tirx.if_then_else(r < k, value,
                                                           tirx.const(0, b_dtype))
        bp = te.compute((gemms, n // bn, kp // alpha, bn, alpha), group, name=f"{tag}Bp")

    # A: X in place, or its rows normalized (softmax), converted (bf16) or zero-padded (K
    # not whole VNNI groups).
    a_at = _softmax_rows(x_at, mask, p.mask_fill, gemms, m, k, tag) if p.softmax else x_at
    xc = None
    # X (or its softmax) rounded to bf16 under its M block, unless stored in bf16 already.
    rounds = p.dtype == "bfloat16" and (x.dtype == "float32" or p.softmax)
    if rounds or kp != k or p.softmax:
        a_dtype = "bfloat16" if p.dtype == "bfloat16" else p.io_dtype

        def row(b, i, r):
            value = a_at(b, i, tirx.min(r, k - 1))
            value = to_bf16(value, isa) if rounds else value
            return value if kp == k else tirx.if_then_else(r < k, value,
                                                           tirx.const(0, a_dtype))
        xc = te.compute((gemms, m, kp), row, name=f"{tag}Xc")
    r = te.reduce_axis((0, kp), name="k")

    def coords(row, col):
        """Batch element, row and column of the stored Y element (row, col)."""
        b = row // m * hy + col // n if hy > 1 else row // m
        return b, row % m, col % n

    # uint8: the accumulator starts from the zero points' fold instead of 0.
    init = _zero_point_fold(p, coords, x_at, b_at, gemms, y_shape, tag)

    def gemm(row, col):
        b, i, j = coords(row, col)
        if xc is not None:
            a = xc[b, i, r]
        else:
            a = x[row if hx == hy else b // hx * m + i, (b % hx) * k + r if hx > 1 else r]
        w = (bp[b, j // bn, r, j % bn] if alpha == 1
             else bp[b, j // bn, r // alpha, j % bn, r % alpha])
        if p.dtype == "float32":
            return te.sum(a * w, axis=r)
        return te.sum(a.astype(acc) * w.astype(acc), axis=r,
                      init=None if init is None else init(row, col))

    c = te.compute(y_shape, gemm, name=f"{tag}C")
    start = p.epilogue_dtype
    if start != acc:
        c = te.compute(y_shape, lambda i, j: c[i, j].astype(start), name=f"{tag}dequantize")
    extra = {op.name: te.placeholder(op.shape(*y_shape), op.dtype, name=f"{tag}{op.name}")
             for op in p.epilogue.inputs(start)}
    y = (apply_te(p.epilogue, c, extra, isa=isa, name=f"{tag}epilogue") if p.epilogue.ops
         else c)
    return y, list(extra.values())


def _softmax_rows(x_at, mask: te.Tensor | None, fill: float | None, gemms: tirx.PrimExpr,
                  m: int, k: int, tag: str = ""):
    """``at(b, i, r)``: element ``r`` of ``softmax(X[b][i, :])``, where ``x_at`` reads X and
    an element whose ``mask[i, r]`` is 0 reads as ``fill``, as TOPI's softmax computes it
    (``exp(x - max) / sum``; the stages ``row_max``, ``row_exp``, ``row_sum``).

    A masked element's ``exp(fill - max)`` is the same for the whole row: one value a row
    (stage ``row_fill``), selected, not computed per element (``exp(-FLT_MAX - max)``
    would make every masked lane's exponent underflow through the subnormals: 0.28 ms of
    GPT-2's 96 x 128 x 128 causal softmax on a Zen 5, against none)."""
    from tvm import te, tirx

    from microkernels.fast_math import softmax_exp as exp

    def masked(b, i, r):
        return tirx.Select(mask[i, r] != tirx.const(0, "uint8"), x_at(b, i, r),
                           tirx.const(fill, "float32"))

    scores = x_at if mask is None else masked
    r = te.reduce_axis((0, k), name="km")
    row_max = te.compute((gemms, m), lambda b, i: te.max(scores(b, i, r), axis=r),
                         name=f"{tag}row_max")

    def exp_at(b, i, j):
        return exp(x_at(b, i, j) - row_max[b, i])

    if mask is not None:
        row_fill = te.compute((gemms, m), lambda b, i: exp(
            tirx.const(fill, "float32") - row_max[b, i]), name=f"{tag}row_fill")
        unmasked = exp_at

        def exp_at(b, i, j):
            return tirx.Select(mask[i, j] != tirx.const(0, "uint8"), unmasked(b, i, j),
                               row_fill[b, i])

    row_exp = te.compute((gemms, m, k), exp_at, name=f"{tag}row_exp")
    r = te.reduce_axis((0, k), name="ks")
    row_sum = te.compute((gemms, m), lambda b, i: te.sum(row_exp[b, i, r], axis=r),
                         name=f"{tag}row_sum")
    # One division a row (hoisted out of the column loop), not one per element.
    return lambda b, i, j: row_exp[b, i, j] * (tirx.const(1.0, "float32") / row_sum[b, i])


def _zero_point_fold(p: BatchGemmProblem, coords, x_at, b_at, gemms, y_shape, tag: str = ""):
    """``init(row, col)``: where the int32 accumulator of ``sum_k a (b - 128)`` starts so that
    it ends as ``sum_k (a - za)(b - zb)``: ``(128 - zb) rowsum_a[i] - za colsum_b[j] + K za zb``
    per batch element, the sums as stages of their own (``rowsum``, ``colsum``); None when
    all of it is 0.  ``gemms`` and ``y_shape`` are the function's (a run-time batch's)."""
    from tvm import te, tirx

    if p.dtype != "uint8":
        return None
    za, zb = p.zero_points
    row_coef, col_coef, constant = _B_SHIFT - zb, -za, p.k * za * zb
    if not (row_coef or col_coef):
        return None
    terms = []
    if row_coef:
        r = te.reduce_axis((0, p.k), name="kr")
        rowsum = te.compute((gemms, p.m), lambda b, i: te.sum(
            x_at(b, i, r).astype("int32"), axis=r), name=f"{tag}rowsum")
        terms.append(lambda b, i, j: rowsum[b, i] * tirx.const(row_coef, "int32"))
    if col_coef:
        r = te.reduce_axis((0, p.k), name="kc")
        colsum = te.compute((gemms, p.n), lambda b, j: te.sum(
            b_at(b, r, j).astype("int32"), axis=r), name=f"{tag}colsum")
        terms.append(lambda b, i, j: colsum[b, j] * tirx.const(col_coef, "int32"))

    def fold(b, i, j):
        value = tirx.const(constant, "int32")
        for term in terms:
            value = value + term(b, i, j)
        return value

    # TE takes a reduction's init from a tensor only: the stage ``zero_fold``, of Y's shape.
    zero_fold = te.compute(y_shape, lambda row, col: fold(*coords(row, col)),
                           name=f"{tag}zero_fold")
    return lambda row, col: zero_fold[row, col]


def schedule(problem: BatchGemmProblem, config: BatchGemmConfig,
             isa: str | _isa.Isa = "avx2", batch: tirx.Var | None = None) -> s_tir.Schedule:
    """The scheduled batch GEMM (module docstring) with the ISA's BRGEMM microkernel; with a
    run-time ``batch`` (a symbolic batch: the parameter before the output) the loop over
    GEMMs runs ``batch * problem.batch`` times.

    Raises
    ------
    TypeError
        ``problem`` or ``config`` is not of its class.
    ValueError
        Block sizes do not tile the problem.
    """
    from tvm import s_tir

    isa_name = checked(problem, config, isa, BatchGemmProblem, BatchGemmConfig)
    sch = s_tir.Schedule(workload(problem, config.bn, batch,
                                  expression_isa(isa_name, problem.padded_k)))
    if "zero_fold" in _stages(sch):
        # The accumulator starts from the fold; a new schedule sees the new dependency.
        _init_from(sch, "C", "zero_fold")
        sch = s_tir.Schedule(sch.mod)
    schedule_product(sch, problem, config, isa_name)
    return sch


def checked(problem: object, config: object, isa: str | _isa.Isa, problem_type: type,
            config_type: type) -> str:
    """The name of ``isa``, once ``problem`` and ``config`` are of their template's types
    (TypeError) and the config tiles the problem (ValueError): what a ``schedule`` checks
    first."""
    for value, kind, what in ((problem, problem_type, "problem"), (config, config_type,
                                                                   "config")):
        if not isinstance(value, kind):
            article = "an" if kind.__name__[0] in "AEIOU" else "a"
            raise TypeError(f"{what} must be {article} {kind.__name__}, got "
                            f"{type(value).__name__}")
    config.check(problem)
    return isa.name if isinstance(isa, _isa.Isa) else _isa.from_name(isa).name


def schedule_product(sch: s_tir.Schedule, problem: BatchGemmProblem, config: BatchGemmConfig,
                     isa_name: str) -> tuple[LoopRV, LoopRV]:
    """Schedule the untagged stages of :func:`product_stages` in ``sch`` (:func:`schedule`'s
    work once the workload is built): the parallel task loop and the loop under which an M
    block's rows are made (``rows_at``), for stages computed there too."""
    p, bm, bn = problem, config.bm, config.bn
    hy = p._h(p.y_interleaved)
    stages = _stages(sch)
    if "dequantize" in stages:
        sch.compute_inline(sch.get_sblock("dequantize"))
    lanes = _isa.from_name(isa_name).lanes("float32")
    partials = {name: _partial_sums(sch, name, lanes) for name in ("row_sum", "row_max")
                if name in stages}
    gemm = sch.get_sblock("C")
    row, col, kk = sch.get_loops(gemm)
    o, io, ii = sch.split(row, [None, p.m // bm, bm])
    h, jo, ji = sch.split(col, [hy, p.n // bn, bn])
    ko, ki = sch.split(kk, [1, None])  # a one-trip K loop: where C is zeroed
    # rows_at: where an M block's rows are ready (converted X, row sums); tile_at: where an
    # output tile is (its epilogue).
    if config.rows_outer:
        sch.reorder(o, h, io, jo, ko, ii, ji, ki)
        task = sch.fuse(o, h)
        rows_at, tile_at = io, jo
    else:
        sch.reorder(o, h, jo, io, ko, ii, ji, ki)
        task = sch.fuse(o, h, jo, io) if config.parallel_rows else sch.fuse(o, h, jo)
        rows_at = tile_at = task if config.parallel_rows else io
    # B under the task loop: TVM compacts Bp (and the C of an epilogue) to one task's region,
    # a per-thread buffer that stays in cache for all of the task's M blocks.
    pack = sch.get_sblock("Bp")
    sch.compute_at(pack, task)
    _pack_schedule(sch, pack, p.alpha, p.b_transposed)
    if "Xc" in stages:  # the rows of X one M block reads, normalized, converted or padded
        xc = sch.get_sblock("Xc")
        sch.compute_at(xc, rows_at)
        _vectorize_conversions(sch, xc)
    # The softmax's stages, consumers first, as per-task scratch ("local"): kept out of the
    # storage TVM would otherwise share between them and Xc, which the AMX kernel reads
    # through a uint16 view whose access_ptr refuses a float32 allocation.
    for name in ("row_sum", "row_exp", "row_fill", "row_max"):
        if name not in stages:
            continue
        sch.compute_at(sch.get_sblock(name), rows_at)
        sch.set_scope(sch.get_sblock(name), 0, "local")
        partial = partials.get(name)
        if partial is not None:
            sch.compute_at(partial, rows_at)
            sch.set_scope(partial, 0, "local")
            _rows_then_vector(sch, partial, rows_at)
    if "row_exp" in stages:
        sch.vectorize(sch.get_loops(sch.get_sblock("row_exp"))[-1])
    if "epilogue" in stages:
        epilogue = sch.get_sblock("epilogue")
        sch.reverse_compute_at(epilogue, tile_at)
        _vectorize_conversions(sch, epilogue)  # the context's conversion to bf16, if any
    sch.parallel(task)
    # The zero points' fold (where the accumulator starts from) and its sums.
    if "zero_fold" in stages:
        fold = sch.get_sblock("zero_fold")
        sch.compute_at(fold, tile_at)
        sch.vectorize(sch.get_loops(fold)[-1])
    if "colsum" in stages:
        colsum = sch.get_sblock("colsum")
        sch.compute_at(colsum, task)
        _sum_schedule(sch, colsum, contiguous=p.b_transposed)
    if "rowsum" in stages:
        rowsum = sch.get_sblock("rowsum")
        sch.compute_at(rowsum, rows_at)
        _sum_schedule(sch, rowsum, contiguous=True)
    init = sch.decompose_reduction(gemm, ko)
    sch.vectorize(sch.get_loops(init)[-1])
    if "zero_fold" in stages:  # the update reads no fold: the kernel's reads
        _set_reads(sch, sch.get_sblock("C_update"), keep=("C", "X", "Xc", "Bp"))
    shape = BrgemmShape(m=bm, n=bn, k=config.bk, batch=p.padded_k // config.bk,
                        dtype_a=p.dtype, dtype_acc=p.acc_dtype, layout=p.b_layout,
                        isa=isa_name)
    shape = zeroing_kernel(sch, init, shape)  # one call is the whole K
    # A unit row loop vanishes from the matched block (see the BRGEMM desc): start below it.
    sch.tensorize(ii if bm > 1 else ji, dispatch(shape))
    return task, rows_at


def _vectorize_conversions(sch: s_tir.Schedule, block: SBlockRV) -> None:
    """Vectorize ``block``'s innermost loop, by the lanes of the instruction that converts to
    bf16 where its code has one (LLVM's ``vcvtneps2bf16`` takes exactly 16)."""
    inner = sch.get_loops(block)[-1]
    converts = vector_lanes(sch.get(block))
    sch.vectorize(sch.split(inner, [None, converts])[1] if converts else inner)


def _partial_sums(sch: s_tir.Schedule, name: str, lanes: int) -> SBlockRV | None:
    """Reduce the row of stage ``name`` into a vector of partial results first (``rfactor``),
    so that it vectorizes: the block of those (vectorized once placed), or None when no
    vector of ``lanes``, half or 4 lanes divides the row."""
    block = sch.get_sblock(name)
    loop = sch.get_loops(block)[-1]
    extent = sch.get(loop).extent.value
    width = next((w for w in (lanes, lanes // 2, 4) if extent % w == 0 and extent > w), None)
    if width is None:
        return None
    return sch.rfactor(sch.split(loop, [None, width])[1], factor_axis=2)


def _rows_then_vector(sch: s_tir.Schedule, partial: SBlockRV, at: LoopRV) -> None:
    """Order the loops of a partial reduction placed under ``at``: rows, reduction, the
    vector of partial results, vectorized (each row's accumulator one register)."""
    from tvm import tirx

    lane, red = (loop_bound_to(sch, partial, kind)
                 for kind in (tirx.IterVar.DataPar, tirx.IterVar.CommReduce))
    loops = sch.get_loops(partial)
    start = next(i for i, loop in enumerate(loops) if sch.get(loop).same_as(sch.get(at))) + 1
    ends = [sch.get(lane), sch.get(red)]
    rows = [loop for loop in loops[start:] if not any(sch.get(loop).same_as(e) for e in ends)]
    sch.reorder(*rows, red, lane)
    sch.vectorize(lane)


def _stages(sch: s_tir.Schedule, tag: str = "") -> set[str]:
    """Which of the workload's optional stages (names prefixed by ``tag``) the scheduled
    function has."""
    found = set()
    for name in ("Xc", "rowsum", "colsum", "zero_fold", "dequantize", "epilogue",
                 "row_max", "row_fill", "row_exp", "row_sum"):
        try:
            sch.get_sblock(tag + name)
        except Exception:  # noqa: BLE001 - TVM's schedule error: no such block
            continue
        found.add(name)
    return found


def _init_from(sch: s_tir.Schedule, name: str, source: str) -> None:
    """Make the reduction block ``name`` start from the same element of ``source``'s output
    instead of 0.  (TE's reductions take an ``init``, but ``create_prim_func`` writes 0 in
    its place.)"""
    from tvm import ir, tirx
    from tvm.s_tir.stmt import SBlock

    sref = sch.get_sref(sch.get_sblock(name))
    old = sref.stmt
    written = sch.get(sch.get_sblock(source)).writes[0]
    store = old.init
    init = tirx.BufferStore(store.buffer, tirx.BufferLoad(written.source, store.indices),
                            store.indices)
    region = type(written)(written.source,
                           [ir.Range.from_min_extent(i, 1) for i in store.indices], written.ty)
    new = SBlock(old.iter_vars, [*old.reads, region], old.writes, old.name_hint, old.body,
                 init, old.alloc_buffers, old.match_buffers, old.annotations)
    sch.state.replace(sref, new, {old: new})


def _set_reads(sch: s_tir.Schedule, block: SBlockRV, keep: tuple[str, ...]) -> None:
    """Keep only the reads of ``block`` from the buffers named ``keep``."""
    from tvm.s_tir.stmt import SBlock

    sref = sch.get_sref(block)
    old = sref.stmt
    reads = [r for r in old.reads if r.source.name in keep]
    new = SBlock(old.iter_vars, reads, old.writes, old.name_hint, old.body, old.init,
                 old.alloc_buffers, old.match_buffers, old.annotations)
    sch.state.replace(sref, new, {old: new})


def _vectorize_tail(sch: s_tir.Schedule, block, loops: int) -> None:
    """Vectorize the innermost ``loops`` loops of ``block``, fused."""
    inner = sch.get_loops(block)[-loops:]
    sch.vectorize(sch.fuse(*inner) if loops > 1 else inner[0])


def _sum_schedule(sch: s_tir.Schedule, block, contiguous: bool) -> None:
    """A row (``contiguous``: the summed values are adjacent) or column sum of uint8 values:
    columns vectorize across the columns, the reduction outside them."""
    loops = sch.get_loops(block)
    spatial, red = loops[-2], loops[-1]
    if not contiguous:
        sch.reorder(red, spatial)
        sch.vectorize(spatial)


def reference(problem: BatchGemmProblem, x: np.ndarray, b: np.ndarray,
              extra: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """numpy result (stored Y) for operands in their stored shapes, accumulated in float64.

    bfloat16 problems take float32 X and B and round them to bf16 (to nearest even) as the
    kernel does; uint8 problems compute ``sum_k (x - za)(b - zb)`` exactly in int32, then the
    epilogue (from float32 when it starts with a float op).  A softmax over X normalizes its
    rows first, masked by ``extra["mask"]`` (``[m, k]``) with a ``mask_fill``.

    Examples
    --------
    >>> import numpy as np
    >>> p = BatchGemmProblem(2, 1, 1, 2, b_transposed=True)
    >>> reference(p, np.ones((2, 2), np.float32), np.full((2, 1, 2), 3, np.float32))
    array([[6.],
           [6.]], dtype=float32)
    >>> q = BatchGemmProblem(1, 1, 1, 2, dtype="uint8", zero_points=(1, 128))
    >>> reference(q, np.array([[3, 5]], np.uint8), np.array([[[130], [129]]], np.uint8))
    array([[8]], dtype=int32)
    """
    import numpy as np

    from microkernels.epilogue import reference as epilogue_reference

    p = problem
    hx, hb, hy = (p._h(f) for f in (p.x_interleaved, p.b_interleaved, p.y_interleaved))
    for array, shape, what in ((x, p.x_shape, "X"), (b, p.b_shape, "B")):
        if np.shape(array) != shape:
            raise ValueError(f"{what} must have the stored shape {shape}, got {np.shape(array)}")
    # Stored -> logical [batch, rows, cols]: [o, rows, h, cols] -> [o, h, rows, cols].
    def logical(a, h, rows, cols):
        return a.reshape(-1, rows, h, cols).transpose(0, 2, 1, 3).reshape(p.batch, rows, cols)

    x, b = np.asarray(x), np.asarray(b)
    if p.softmax:
        x = _softmax_reference(p, x, (extra or {}).get("mask"))
    if p.dtype == "bfloat16":
        import ml_dtypes

        x, b = (v.astype(np.float32).astype(ml_dtypes.bfloat16) for v in (x, b))
    wide = np.int64 if p.dtype == "uint8" else np.float64
    za, zb = p.zero_points
    xs = logical(x.astype(wide) - za, hx, p.m, p.k)
    bs = logical(b.astype(wide) - zb, hb, *((p.n, p.k) if p.b_transposed else (p.k, p.n)))
    if p.b_transposed:
        bs = bs.transpose(0, 2, 1)
    ys = (xs @ bs).astype(p.acc_dtype)
    # Logical -> stored Y.
    c = ys.reshape(-1, hy, p.m, p.n).transpose(0, 2, 1, 3).reshape(p.y_shape)
    if p.epilogue_dtype != p.acc_dtype:
        c = c.astype(p.epilogue_dtype)
    return epilogue_reference(p.epilogue, c, extra) if p.epilogue.ops else c


def _softmax_reference(p: BatchGemmProblem, x: np.ndarray, mask: np.ndarray | None
                       ) -> np.ndarray:
    """The stored X with each batch element's rows replaced by their (masked) softmax."""
    import numpy as np

    h = p._h(p.x_interleaved)
    rows = x.astype(np.float64).reshape(-1, p.m, h, p.k)  # [o, i, h, r]
    if p.mask_fill is not None:
        if mask is None or np.shape(mask) != (p.m, p.k):
            raise ValueError(f"a masked softmax needs extra['mask'] of shape {(p.m, p.k)}")
        rows = np.where(np.asarray(mask)[None, :, None, :] != 0, rows, p.mask_fill)
    e = np.exp(rows - rows.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32).reshape(x.shape)


def _pack_schedule(sch: s_tir.Schedule, pack: SBlockRV, alpha: int, transposed: bool) -> None:
    """Vectorize the packing of B.  A flat panel copies rows along ``bn``.  A VNNI group
    interleaves ``alpha`` rows of B (columns of a transposed B): the group loop is unrolled
    inside the column loop and LLVM vectorizes the rows' loads and the interleaving stores
    (TVM's own vectorization of the fused loop gathers lane by lane: measured 189 -> 152 us on
    BERT's ``P @ V`` in bf16 on one core, 117 -> 81 in int8).  Transposed B walks each
    column's contiguous K values in the inner loops (scores in int8: 124 -> 110 us)."""
    if alpha == 1:
        _vectorize_tail(sch, pack, 1)
        return
    kq, ji, t = sch.get_loops(pack)[-3:]
    if transposed:
        sch.reorder(ji, kq, t)
    sch.unroll(t)
