"""Attention as one kernel: ``softmax(epi_s(Q @ K^T)) @ V``, the scores never leaving cache.

Two batch GEMMs (:mod:`schedules.batch_gemm`) chained through a softmax: the scores
``S[b] = epi_s(Q[b] @ K[b]^T)`` (the ``scores`` problem, its epilogue the ``1/sqrt(d)``
scaling and perhaps an addend) and the context ``Y[b] = epi(softmax(S[b]) @ V[b])`` (the
``context`` problem, with its softmax over X).  As two kernels, the first writes the float32
scores of every batch element and the second reads them back: 6 MiB per BERT layer at batch
8, twice.  Here the context's loop nest runs them both::

    parallel for b:                                   # batch element (heads x sequences)
        pack Kp[b] <- K[b]^T;  pack Vp[b] <- V[b]     (VNNI-2 for bf16)
        for io:                                       # bm query rows
            Qc <- Q[b][io] (bf16)
            for js:  S tile (bm x bn_s) = BRGEMM(Qc, Kp[b][js])     # the scores' rows
            row max, exp, sum over S's rows; P <- exp / sum (bf16)
            for jo:  Y tile (bm x bn) = BRGEMM(P, Vp[b][jo]); epilogue

so an M block's scores (``bm x n`` float32: 32 KiB for 64 rows of 128 keys) are written and
read while they are in L1/L2.  The stages are :func:`schedules.batch_gemm.product_stages`'s,
the scores' prefixed ``s_``; a whole row of scores is made before its softmax, so the key
length is bounded by what a block of rows holds in cache, not by an online softmax.  A
sample's padding mask (:attr:`AttentionProblem.key_bias`) is added where the softmax reads
the scores; Q, K and V may be stored in bf16 (``bf16_inputs`` of both problems: packed as
they are, Q's rows read in place).  BERT's attention at batch 8 in bf16 on a Zen 4, alone:
1.20x the two kernels, 1.46x with bf16 Q, K and V (BENCHMARKS.md, forty-third session).

Examples
--------
>>> from schedules.batch_gemm import BatchGemmProblem
>>> from microkernels.epilogue import Epilogue, EpilogueOp
>>> scores = BatchGemmProblem(12, 128, 128, 64, True, Epilogue((EpilogueOp("scale", value=0.125),)),
...                           heads=12, x_interleaved=True, b_interleaved=True)
>>> context = BatchGemmProblem(12, 128, 64, 128, heads=12, b_interleaved=True,
...                            y_interleaved=True, softmax=True)
>>> p = AttentionProblem(scores, context)
>>> p.q_shape, p.k_shape, p.v_shape, p.y_shape
((128, 768), (1, 128, 768), (1, 128, 768), (128, 768))
>>> p.name
'12x128x128x64x64_txb12_scale_bys12'
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from microkernels import isa as _isa
from microkernels.brgemm import BrgemmShape, dispatch
from microkernels.epilogue import Epilogue, expression_isa
from microkernels.machine import Machine

from . import batch_gemm
from .batch_gemm import (
    BatchGemmConfig,
    BatchGemmProblem,
    _pack_schedule,
    _positive,
    _stages,
    _vectorize_conversions,
    checked,
    product_stages,
    schedule_product,
    stored_shapes,
)
from .blocking import near_divisors
from .nest import zeroing_kernel

if TYPE_CHECKING:
    import numpy as np
    from tvm import s_tir, tirx
    from tvm.tirx import PrimFunc

__all__ = ["AttentionProblem", "AttentionConfig", "DTYPES", "default_config", "candidates",
           "stored", "workload", "schedule", "reference"]

#: What the fused kernel multiplies in: the softmax needs float32 scores, so no uint8.
DTYPES = ("float32", "bfloat16")
#: The scores' stages' prefix.
_SCORES = "s_"


@dataclass(frozen=True)
class AttentionProblem:
    """``Y = context(softmax(scores(Q, K)), V)``: two batch GEMMs whose intermediate stays in
    the kernel.

    Parameters
    ----------
    scores
        ``S[b] = epi_s(Q[b] @ K[b]^T)``: X is Q, B is K (usually ``b_transposed``); its
        epilogue ends in float32 and its S is internal (not ``y_interleaved``).
    context
        ``Y[b] = epi(softmax(S[b]) @ V[b])``: ``softmax`` set, X (the scores) internal (not
        ``x_interleaved``), B is V; the same batch, rows, dtype as ``scores``, and K equal
        to the scores' N (the keys).
    key_bias
        0, or how many batch elements share a row of a float32 ``[batch / key_bias, keys]``
        tensor added to the scores before the softmax: a sample's key mask (``[B, 1, 1, S]``
        in the graph, BERT's padding mask), the same for its heads and queries.

    Examples
    --------
    >>> s = BatchGemmProblem(2, 3, 5, 4, True)
    >>> AttentionProblem(s, BatchGemmProblem(2, 3, 6, 5, softmax=True)).flops
    600
    >>> AttentionProblem(s, BatchGemmProblem(2, 3, 6, 4, softmax=True))
    Traceback (most recent call last):
    ...
    ValueError: the context's K (4) must be the scores' N, the keys (5)
    """

    scores: BatchGemmProblem
    context: BatchGemmProblem
    key_bias: int = 0

    def __post_init__(self) -> None:
        s, c = self.scores, self.context
        for part, what in ((s, "scores"), (c, "context")):
            if not isinstance(part, BatchGemmProblem):
                raise TypeError(f"AttentionProblem.{what} must be a BatchGemmProblem, got "
                                f"{type(part).__name__}")
        if s.dtype not in DTYPES or c.dtype != s.dtype:
            raise ValueError(f"attention multiplies in one of {', '.join(DTYPES)}: got scores "
                             f"{s.dtype}, context {c.dtype}")
        if not c.softmax:
            raise ValueError("the context must read softmax(scores): softmax=True")
        if s.softmax:
            raise ValueError("the scores read Q itself: softmax=False")
        if (s.batch, s.m) != (c.batch, c.m):
            raise ValueError(f"scores and context must have the same batch and rows: "
                             f"{(s.batch, s.m)} and {(c.batch, c.m)}")
        if c.k != s.n:
            raise ValueError(f"the context's K ({c.k}) must be the scores' N, the keys ({s.n})")
        if s.n < 2:
            raise ValueError("one key: its softmax is 1, the context V itself; nothing to fuse")
        if s.y_interleaved or c.x_interleaved:
            raise ValueError("the scores stay in the kernel: neither the scores' Y nor the "
                             "context's X is interleaved")
        if s.out_dtype != "float32":
            raise ValueError(f"the softmax reads float32 scores, the scores' epilogue ends in "
                             f"{s.out_dtype}")
        kb = self.key_bias
        if not isinstance(kb, int) or isinstance(kb, bool) or kb < 0 or (kb and s.batch % kb):
            raise ValueError(f"key_bias must be 0 or a divisor of the batch ({s.batch}), "
                             f"got {kb!r}")

    @property
    def dtype(self) -> str:
        return self.context.dtype

    @property
    def epilogue(self) -> Epilogue:
        """The context's epilogue: the output's."""
        return self.context.epilogue

    @property
    def out_dtype(self) -> str:
        return self.context.out_dtype

    @property
    def batch(self) -> int:
        return self.context.batch

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """``(batch, m, n, k, dv)``: batch elements, queries, keys, Q/K width, V width."""
        return (self.batch, self.context.m, self.scores.n, self.scores.k, self.context.n)

    @property
    def layout(self) -> str:
        """The two problems' layouts and the scores' epilogue: what the key tells apart."""
        s = self.scores
        return (s.layout + (f"_{s.epilogue.name}" if s.epilogue.ops else "")
                + (f"_kb{self.key_bias}" if self.key_bias else "") + f"_{self.context.layout}")

    def key_bias_shape(self, batch: tirx.PrimExpr | None = None) -> tuple | None:
        """The stored shape of the key bias (None without one) for ``batch`` copies."""
        if not self.key_bias:
            return None
        rows = self.batch // self.key_bias
        return (rows if batch is None else batch * rows, self.scores.n)

    @property
    def name(self) -> str:
        """A short unique name: sizes, :attr:`layout`, the output's epilogue.

        Examples
        --------
        >>> AttentionProblem(BatchGemmProblem(2, 3, 5, 4, True),
        ...                  BatchGemmProblem(2, 3, 6, 5, softmax=True)).name
        '2x3x5x4x6_t_s'
        """
        name = "x".join(map(str, self.shape)) + f"_{self.layout}"
        return name + (f"_{self.epilogue.name}" if self.epilogue.ops else "")

    @property
    def flops(self) -> int:
        return self.scores.flops + self.context.flops

    @property
    def q_shape(self) -> tuple[int, int]:
        return self.scores.x_shape

    @property
    def k_shape(self) -> tuple[int, int, int]:
        return self.scores.b_shape

    @property
    def v_shape(self) -> tuple[int, int, int]:
        return self.context.b_shape

    @property
    def y_shape(self) -> tuple[int, int]:
        return self.context.y_shape


@dataclass(frozen=True)
class AttentionConfig:
    """Blocks of the fused kernel: ``bm`` query rows a step (both GEMMs), the context's
    ``bn``/``bk`` and the scores' ``bn_s``/``bk_s`` (each divides its dimension; each
    BRGEMM call reduces its whole K)."""

    bm: int
    bn: int
    bk: int
    bn_s: int
    bk_s: int

    def __post_init__(self) -> None:
        for name in ("bm", "bn", "bk", "bn_s", "bk_s"):
            _positive(getattr(self, name), f"AttentionConfig.{name}")

    def parts(self) -> tuple[BatchGemmConfig, BatchGemmConfig]:
        """The scores' and the context's batch GEMM configs (a task per batch element)."""
        return (BatchGemmConfig(self.bm, self.bn_s, self.bk_s, rows_outer=True),
                BatchGemmConfig(self.bm, self.bn, self.bk, rows_outer=True))

    def check(self, problem: AttentionProblem) -> None:
        """ValueError unless the blocks tile ``problem`` exactly, each scores' call at least
        two keys wide."""
        for config, part in zip(self.parts(), (problem.scores, problem.context), strict=True):
            config.check(part)
        if self.bn_s < 2:
            raise ValueError(f"bn_s={self.bn_s}: a block of the scores needs two keys or more")


def default_config(problem: AttentionProblem, machine: Machine) -> AttentionConfig:
    """Each GEMM's :func:`~schedules.batch_gemm.default_config` blocks, the rows the
    context's (the scores' N blocks are the columns the BRGEMM writes at once).

    Examples
    --------
    >>> from microkernels.isa import DEFAULT_CACHES, from_name
    >>> zen4 = Machine(from_name("avx512_bf16"), DEFAULT_CACHES, threads=2)
    >>> s = BatchGemmProblem(96, 128, 128, 64, True, dtype="bfloat16")
    >>> default_config(AttentionProblem(s, BatchGemmProblem(96, 128, 64, 128, softmax=True,
    ...                                                     dtype="bfloat16")), zen4)
    AttentionConfig(bm=64, bn=64, bk=128, bn_s=64, bk_s=64)
    """
    s = batch_gemm.default_config(problem.scores, machine)
    c = batch_gemm.default_config(problem.context, machine)
    # Tile-shaped blocks of a prime length (ViT's 197 tokens on AMX) are single rows and
    # keys: the whole length instead, as off AMX (the AVX-512 kernel takes such a block).
    m, n = problem.context.m, problem.scores.n
    bm = c.bm if c.bm > 1 or m == 1 else batch_gemm.whole_or_block(m, 64)
    bn_s = s.bn if s.bn > 1 else batch_gemm.whole_or_block(n, 64)
    return AttentionConfig(bm, c.bn, c.bk, bn_s, s.bk)


def candidates(problem: AttentionProblem, machine: Machine) -> list[AttentionConfig]:
    """The default, then the two nearest other ``bm`` (8 to 128 rows) and the nearest other
    ``bn`` and ``bn_s`` (vector multiples up to 64 where the dimension has them): seven
    configurations at most, measurement decides.

    Examples
    --------
    >>> from microkernels.isa import DEFAULT_CACHES, from_name
    >>> zen4 = Machine(from_name("avx512_bf16"), DEFAULT_CACHES, threads=2)
    >>> s = BatchGemmProblem(96, 128, 128, 64, True, dtype="bfloat16")
    >>> p = AttentionProblem(s, BatchGemmProblem(96, 128, 64, 128, softmax=True,
    ...                                          dtype="bfloat16"))
    >>> [(c.bm, c.bn, c.bn_s) for c in candidates(p, zen4)]
    [(64, 64, 64), (32, 64, 64), (128, 64, 64), (64, 32, 64), (64, 64, 32)]
    """
    base = default_config(problem, machine)
    lanes = machine.isa.lanes("float32")

    def columns(n: int, block: int) -> list[int]:
        vector = n % lanes == 0
        return near_divisors(n, block, 1, lo=min(2 * lanes if vector else lanes, n), hi=64,
                             multiple=lanes if vector else 1)

    m = problem.context.m
    found = [base]
    found += [replace(base, bm=bm) for bm in near_divisors(m, base.bm, 2, lo=min(8, m), hi=128)]
    found += [replace(base, bn=bn) for bn in columns(problem.context.n, base.bn)]
    found += [replace(base, bn_s=bn) for bn in columns(problem.scores.n, base.bn_s)]
    return list(dict.fromkeys(found))


def stored(problem: AttentionProblem, batch: tirx.PrimExpr | None = None
           ) -> tuple[tuple, tuple, tuple, tuple]:
    """The stored shapes of Q, K, V and Y for ``batch`` copies of ``problem`` (a run-time
    batch: each first dimension times ``batch``).

    Examples
    --------
    >>> stored(AttentionProblem(BatchGemmProblem(2, 3, 5, 4, True),
    ...                         BatchGemmProblem(2, 3, 6, 5, softmax=True)))
    ((6, 4), (2, 5, 4), (2, 5, 6), (6, 6))
    """
    q, k, _ = stored_shapes(problem.scores, batch)
    _, v, y = stored_shapes(problem.context, batch)
    return q, k, v, y


def workload(problem: AttentionProblem, config: AttentionConfig,
             batch: tirx.Var | None = None, isa: str = "generic") -> PrimFunc:
    """The unscheduled PrimFunc ``(Q, K, V, [mask], [key_bias], *scores' operands, *epilogue
    operands, [batch], Y)``: the scores' stages (``s_Bp``, ``s_Xc``, ``s_C``, ``s_epilogue``,
    ``s_key_bias``) feeding the context's (:func:`schedules.batch_gemm.workload`'s names)."""
    from tvm import te

    s, c = problem.scores, problem.context
    q_shape, k_shape, v_shape, _ = stored(problem, batch)
    q = te.placeholder(q_shape, s.io_dtype, name="Q")
    k = te.placeholder(k_shape, s.io_dtype, name="K")
    v = te.placeholder(v_shape, c.io_dtype, name="V")
    mask = None if c.mask_fill is None else te.placeholder((c.m, c.k), "uint8", name="mask")
    scores, scores_extra = product_stages(s, config.bn_s, q, k, None, batch,
                                          expression_isa(isa, s.padded_k), _SCORES)
    masks = [] if mask is None else [mask]
    if problem.key_bias:
        bias = te.placeholder(problem.key_bias_shape(batch), "float32", name="key_bias")
        masks.append(bias)
        unbiased, per_row = scores, c.m * problem.key_bias
        scores = te.compute(unbiased.shape, lambda row, col: unbiased[row, col]
                            + bias[row // per_row, col], name=f"{_SCORES}key_bias")
    y, extra = product_stages(c, config.bn, scores, v, mask, batch,
                              expression_isa(isa, c.padded_k))
    scalars = [] if batch is None else [batch]
    return te.create_prim_func([q, k, v, *masks, *scores_extra, *extra, *scalars, y])


def schedule(problem: AttentionProblem, config: AttentionConfig,
             isa: str | _isa.Isa = "avx2", batch: tirx.Var | None = None) -> s_tir.Schedule:
    """The fused attention (module docstring) with the ISA's BRGEMM microkernels; with a
    run-time ``batch`` the loop over batch elements runs ``batch * problem.batch`` times.

    Raises
    ------
    TypeError
        ``problem`` or ``config`` is not of its class.
    ValueError
        Block sizes do not tile the problem.
    """
    from tvm import s_tir

    isa_name = checked(problem, config, isa, AttentionProblem, AttentionConfig)
    s = problem.scores
    sch = s_tir.Schedule(workload(problem, config, batch, isa_name))
    # The scaling (and the key bias) applied where the softmax reads the scores.
    for stage, present in (("epilogue", s.epilogue.ops), ("key_bias", problem.key_bias)):
        if present:
            sch.compute_inline(sch.get_sblock(f"{_SCORES}{stage}"))
    task, rows_at = schedule_product(sch, problem.context, config.parts()[1], isa_name)
    # The scores of an M block's rows, made where the softmax reads them.
    gemm = sch.get_sblock(f"{_SCORES}C")
    sch.compute_at(gemm, rows_at)
    # compute_at leaves out a unit row loop (one query row a block).
    *rows, col, kk = sch.get_loops(gemm)[-3 if config.bm > 1 else -2:]
    jo, ji = sch.split(col, [None, config.bn_s])
    ko, ki = sch.split(kk, [1, None])
    sch.reorder(jo, ko, *rows, ji, ki)
    if "Xc" in _stages(sch, _SCORES):  # Q's rows rounded to bf16 or padded under the block
        xc = sch.get_sblock(f"{_SCORES}Xc")
        sch.compute_at(xc, rows_at)
        _vectorize_conversions(sch, xc)
    pack = sch.get_sblock(f"{_SCORES}Bp")
    sch.compute_at(pack, task)
    _pack_schedule(sch, pack, s.alpha, s.b_transposed)
    init = sch.decompose_reduction(gemm, ko)
    sch.vectorize(sch.get_loops(init)[-1])
    shape = BrgemmShape(m=config.bm, n=config.bn_s, k=config.bk_s,
                        batch=s.padded_k // config.bk_s, dtype_a=s.dtype,
                        dtype_acc=s.acc_dtype, layout=s.b_layout, isa=isa_name)
    shape = zeroing_kernel(sch, init, shape)
    sch.tensorize(rows[0] if rows else ji, dispatch(shape))
    # Per-task scratch, as the softmax's stages (schedules.batch_gemm): kept out of storage
    # TVM would share with the bf16 buffers the AMX kernel reads through uint16 views.
    sch.set_scope(sch.get_sblock(f"{_SCORES}C_update_o"), 0, "local")
    return sch


def reference(problem: AttentionProblem, q: np.ndarray, k: np.ndarray, v: np.ndarray,
              extra: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """numpy result (stored Y) for operands in their stored shapes: the scores'
    :func:`~schedules.batch_gemm.reference`, the key bias added, then the context's on them
    (``extra`` holds both epilogues' operands, the mask and the key bias)."""
    import numpy as np

    scores = batch_gemm.reference(problem.scores, q, k, extra)
    if problem.key_bias:
        per_row = problem.context.m * problem.key_bias
        scores = scores + np.repeat(extra["key_bias"], per_row, axis=0)[:scores.shape[0]]
    return batch_gemm.reference(problem.context, scores, v, extra)
