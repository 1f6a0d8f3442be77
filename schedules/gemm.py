"""GEMM schedule template: a loop_spec string decides the outer loops, BRGEMM does the rest.

The workload is ``Y = epilogue(X @ W)`` with ``X[M, K]`` row-major and the weights pre-packed
per N block as ``Wp[N/bn, K, bn]`` (each block's K x bn panel contiguous — the "flat" BRGEMM B
operand).  Three logical loops, declared as in PARLOOPER's GEMM:

* ``a`` — K blocks (``K / bk``), stepping ``k_step`` blocks: one BRGEMM call reduces
  ``k_step`` blocks (its ``batch``);
* ``b`` — M blocks (``M / bm``), step 1;
* ``c`` — N blocks (``N / bn``), step 1.

Below them the ``bm x bn x (k_step * bk)`` body is tensorized with the BRGEMM intrinsic of
the target's ISA (:func:`microkernels.brgemm.dispatch`).  C is zeroed right above the first
``a`` loop (PARLOOPER's ``if (ik == 0) zero_tpp``; TVM's ``decompose_reduction``) unless the
kernel does it: where it has zeroing variants, the call over the first K block starts from
zero instead (``beta=0`` where one call is the whole K, ``first_call_zeroes`` where K takes
several: :func:`schedules.nest.zeroing_kernel`) and the zeroing pass is dropped.  The
epilogue runs on each output tile under the deepest spatial loop that encloses every ``a``
loop, i.e. right after the tile's last K step; when an ``a`` loop is outermost it runs as a
separate parallel pass.

Parallel loops: consecutive capitals are fused into one parallel loop where they stand (TVM's
pool forks and joins around it, like ``omp for collapse(k)`` inside the serial outer loops);
``{R:n}``/``{C:n}``/``{L:n}`` grids split their loop into ``n`` chunks and hoist the chunk loops
outermost, fused into one parallel loop of ``R*C*L`` tasks — each task runs the serial loops
over its own block of iterations, as PARLOOPER's thread grid does.  TVM runs one parallel
region at a time, so other separated parallel loops are rejected.

Packing A (``GemmConfig.pack_a``): ``X`` is the network's activation, row-major with rows K
floats apart, so a call with a short K block reads short pieces of many pages, which neither
the prefetchers nor the TLB like.  ``pack_a=d`` copies the slice of ``X`` the loops below
depth ``d`` read into a dense buffer under the ``d``-th loop (TVM's ``cache_read`` +
``compute_at``), as BLAS packs A; the copy runs in parallel unless a parallel loop already
encloses it.  B needs no packing here: the weights are packed once, ahead of time
(:func:`pack_weight`, with :meth:`microkernels.pack.Packing.blocked_b`).

Default configuration (:func:`default_config`), without tuning: block sizes follow the
microkernel and the caches, the loop order comes from :func:`schedules.space.heuristic`.
Blocks must divide their dimension (the template tiles exactly), so they are chosen among the
dimension's divisors:

* ``bn`` — on x86, one register tile of columns where it divides N
  (:func:`microkernels.x86.tile_columns`: 16 on AVX2, 64 on AVX-512), so each call streams
  its panel of B sequentially, not one column tile of a wider panel at a time; else a
  multiple of two vectors where possible, at most 64 floats so a ``bk x bn`` panel of B
  stays in L1/L2 next to A's rows;
* ``bm`` — at most 64 rows (the kernel walks them in register tiles, remainder included),
  or where ``M``'s divisors up to 64 are all under 16 (ViT's 197 tokens), the smallest one
  from 16 up (:func:`_m_block`);
* ``bk`` and ``k_step`` — the whole K in one BRGEMM call (TPP's Algorithm 6), in blocks of at
  most 512 so one batch element's panel of B stays in L2: C never leaves the registers
  between K steps;
* unless K is so long that the whole-K panel of B (``K x bn``) takes more than half of L2,
  where A's rows streaming past would evict it before the next row tile re-reads it: then
  :func:`long_k_config` splits K across calls and packs A, as BLAS does (128x768x3072 on one
  core: 100 -> 115 GFLOPS measured), on AVX2 and AMX tiles only: the AVX-512 vector
  kernels read the panel from L3 as fast as they need it (:func:`_splits_long_k`).  Up to
  half of L2 the panel stays, provided the loop over N blocks is outside the one over M
  blocks (the heuristic's rule 4): 2048^3, whose panel is exactly half of L2, measured
  faster that way than split and packed, on one core and more so on two (BENCHMARKS.md).

Operand types (:data:`OPERANDS`): ``GemmProblem.dtype`` is X's type and picks the kernel
family.  ``"float32"`` multiplies float32 X and W in float32 (the flat BRGEMM, weights packed
``Wp[N/bn, K, bn]``); ``"bfloat16"`` multiplies bf16 X and W accumulating in float32, and
``"uint8"`` u8 activations by s8 weights accumulating in int32.  The two low-precision kinds
take W packed along K in the VNNI groups their dot-product instructions read (``vdpbf16ps``,
``vpdpbusd``, AMX ``tdpbf16ps``/``tdpbusd``): ``Wp[N/bn, K/a, bn, a]`` with ``a`` = 2 (bf16)
or 4 (int8) (:meth:`~microkernels.pack.Packing.vnni_blocked_b`), and ``bk`` a multiple of
``a``.  A K that is not one is padded with zeros to the next (:attr:`GemmProblem.padded_k`,
which the blocks tile): in the packed weight, and in a zero-padded copy of X that the GEMM
reads instead (made where ``pack_a`` packs A, or before the loops).  The epilogue starts from
the accumulator, except that an int32 one meets a chain that takes floats only (``scale``
first: dequantization) converted to float32, exactly below ``2**24``.  On ``amx`` the kernel
runs in tiles when its blocks are tile-shaped (:func:`microkernels.amx.plan`; the defaults
choose such blocks), otherwise the ISA's AVX-512 kernel runs
(:func:`microkernels.brgemm.find_impl`'s fallback).

The layout is a function of X's dtype and the ISA, chosen in one place
(:func:`operand_layout`): where the ISA has an MMLA kernel for the dtype (``neon_i8mm``:
``usmmla`` for u8 x s8, ``bfmmla`` for bf16) both operands are packed in MMLA 2-row blocks
along K (``"mmla"``, :mod:`microkernels.arm`): W ahead of time as ``Wp[N'/2, K'/kb, 2, kb]``
(:func:`pack_weight` with the problem bound to the ISA, :meth:`GemmProblem.on`), X at run
time into ``X_packed[M'/2, K'/kb, 2, kb]`` (the copy ``pack_a`` places, before the loops if
unasked), ``kb`` = 8 (int8) or 4 (bf16), K padded to a multiple of 8 (the kernels' K step)
and M, N to even: the GEMM computes a ``C[M', N']`` of whole 2x2 blocks and the epilogue
(or a crop) writes ``Y[M, N]``.  The MMLA kernel keeps its whole C block in registers, so
its blocks are register tiles (``(bm/2)(bn/2) + bm/2 + bn/2 <= 32``, e.g. 8x8; larger ones
would run the generic loops) and the defaults choose the largest such even divisors.

Candidates (:func:`candidates`): a few blockings around the default (:func:`blockings`),
PARLOOPER's loop orders for each (:func:`schedules.space.generate`), ranked within each
blocking by the cache-trace model (:func:`ranked_configs`).  The model sees loop orders and
the copies of packing, not the kernel's efficiency at each block size: measurement decides
between the blockings.

Examples
--------
>>> from microkernels.isa import DEFAULT_CACHES, from_name
>>> p = GemmProblem(m=128, n=768, k=768)
>>> cfg = default_config(p, Machine(from_name("avx2"), DEFAULT_CACHES, threads=2))
>>> (cfg.bm, cfg.bn, cfg.bk, cfg.k_step, cfg.spec)
(64, 16, 384, 2, 'CBa')
>>> default_config(GemmProblem(m=1, n=4096, k=4096),
...                Machine(from_name("avx2"), DEFAULT_CACHES, threads=2)).bn
16
>>> sch = schedule(p, cfg, isa="avx2")    # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from microkernels import amx as _amx
from microkernels import arm as _arm
from microkernels import isa as _isa
from microkernels import x86 as _x86
from microkernels.brgemm import LAYOUTS, BrgemmShape, dispatch, implementations
from microkernels.epilogue import Epilogue, expression_isa
from microkernels.machine import Machine
from microkernels.pack import Packing, mmla_k_block, pack_mmla, padded

from .blocking import divisors, pick_divisor
from .cost_model import predict
from .loop_spec import LoopSpec, LoopSpecError, parse
from .nest import (
    bind_first_call,
    check_exact,
    check_run_time_loop,
    finish_nest,
    nest_loops,
    zeroing_kernel,
)
from .operands import OPERANDS, TypedProblem
from .space import BlockedGemm, Candidate, generate, heuristic

if TYPE_CHECKING:
    from tvm import s_tir, tirx
    from tvm.s_tir import LoopRV, SBlockRV
    from tvm.tirx import PrimFunc

__all__ = ["OPERANDS", "MMLA", "operand_layout", "GemmProblem", "GemmConfig", "workload",
           "schedule", "default_config", "candidates", "whole_k_config", "long_k_config",
           "blockings", "ranked_configs", "ranked_blockings", "measuring_order", "pack_weight",
           "GEMV_ROWS"]



#: The layout of both packed operands where the ISA multiplies 2x2 blocks (aarch64 MMLA).
MMLA = "mmla"


def operand_layout(dtype: str, isa: str | _isa.Isa | None = None) -> str:
    """The BRGEMM layout of a GEMM's packed operands, X in ``dtype``, on ``isa``: the one
    place the layout is chosen.

    ``"mmla"`` (A and B in 2-row blocks along K: ``smmla``/``usmmla``/``bfmmla``) where
    ``isa`` or an ISA it extends has an MMLA kernel for ``dtype`` registered; otherwise the
    dtype's layout in :data:`OPERANDS` (``flat``, ``vnni2``, ``vnni4``), also without an ISA.

    Examples
    --------
    >>> [operand_layout("uint8", isa) for isa in (None, "amx", "neon", "neon_i8mm")]
    ['vnni4', 'vnni4', 'vnni4', 'mmla']
    >>> operand_layout("bfloat16", "neon_i8mm"), operand_layout("float32", "neon_i8mm")
    ('mmla', 'flat')
    """
    if dtype not in OPERANDS:
        raise ValueError(f"the GEMM template handles {', '.join(OPERANDS)}, got {dtype!r}")
    default = OPERANDS[dtype][1]
    if isa is None:
        return default
    chosen = isa if isinstance(isa, _isa.Isa) else _isa.from_name(isa)
    registered = set(implementations())
    if any((name, dtype, MMLA) in registered for name in chosen.lineage()):
        return MMLA
    return default


@dataclass(frozen=True)
class GemmProblem(TypedProblem):
    """``Y[m, n] = epilogue(X[m, k] @ W[k, n])``, X in ``dtype``.

    Parameters
    ----------
    m, n, k
        GEMM sizes.
    dtype
        X's type (:data:`OPERANDS`): ``"float32"``, ``"bfloat16"`` (bf16 W, float32
        accumulation) or ``"uint8"`` (s8 W, int32 accumulation).
    epilogue
        Elementwise chain applied to each finished output tile, from :attr:`epilogue_dtype`.
    isa
        The ISA whose kernels the operands are laid out for (:func:`operand_layout`), or
        None: not bound yet, laid out as :data:`OPERANDS` says.  :func:`schedule`,
        :func:`default_config`, :func:`candidates` and :func:`pack_weight` (``isa=``) bind
        an unbound problem to their ISA (:meth:`on`); a bound one keeps its layout, so the
        weight it packs is the one its schedule reads.
    narrow_weights
        W's int8 values lie in [-64, 64] (:func:`schedules.operands.narrow`): on x86 without
        VNNI the kernel multiplies them with ``vpmaddubsw``, exactly
        (:meth:`~schedules.operands.TypedProblem.brgemm_layout`).

    Examples
    --------
    >>> from microkernels.epilogue import EpilogueOp
    >>> dequant = Epilogue((EpilogueOp("scale", broadcast="row"), EpilogueOp("bias")))
    >>> p = GemmProblem(37, 48, 68, "uint8", dequant)
    >>> (p.acc_dtype, p.weight_dtype, p.layout, p.epilogue_dtype, p.out_dtype)
    ('int32', 'int8', 'vnni4', 'float32', 'float32')
    >>> GemmProblem(4, 16, 6, "uint8").padded_k      # whole VNNI-4 groups
    8
    >>> q = p.on("neon_i8mm")                        # usmmla: 2x8 blocks, rows in pairs
    >>> (q.layout, q.padded_m, q.padded_n, q.padded_k)
    ('mmla', 38, 48, 72)
    """

    m: int
    n: int
    k: int
    dtype: str = "float32"
    epilogue: Epilogue = field(default_factory=Epilogue)
    isa: str | None = None
    narrow_weights: bool = False

    def __post_init__(self) -> None:
        for dim in ("m", "n", "k"):
            value = getattr(self, dim)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GemmProblem.{dim} must be a positive int, got {value!r}")
        if self.dtype not in OPERANDS:
            raise ValueError(f"the GEMM template handles {', '.join(OPERANDS)}, "
                             f"got {self.dtype!r}")
        if isinstance(self.isa, _isa.Isa):
            object.__setattr__(self, "isa", self.isa.name)
        elif self.isa is not None:
            _isa.from_name(self.isa)  # ValueError naming the known ISAs
        self._check_narrow_weights()
        self.epilogue.out_dtype(self.epilogue_dtype)  # raises for chains that do not type-check

    def on(self, isa: str | _isa.Isa | None) -> GemmProblem:
        """This problem bound to ``isa`` (its operands laid out for that ISA's kernels);
        a problem already bound, or ``isa`` None, is returned as it is."""
        if self.isa is not None or isa is None:
            return self
        return replace(self, isa=isa.name if isinstance(isa, _isa.Isa) else isa)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


    @property
    def layout(self) -> str:
        """The BRGEMM layout of the packed weight: ``flat``, ``vnni2``, ``vnni4`` or ``mmla``
        (then A is packed so too) (:func:`operand_layout` of the dtype and :attr:`isa`)."""
        return operand_layout(self.dtype, self.isa)

    @property
    def mmla(self) -> bool:
        """Whether both operands are packed in MMLA 2-row blocks (then M, N are even)."""
        return self.layout == MMLA


    @property
    def alpha(self) -> int:
        """K elements per VNNI group of the packed weight (1: not grouped; MMLA: 8, the K
        a kernel call takes a multiple of)."""
        return LAYOUTS[self.layout][0]

    @property
    def padded_k(self) -> int:
        """K rounded up to whole VNNI groups: the K the blocks tile."""
        return padded(self.k, self.alpha)

    @property
    def padded_m(self) -> int:
        """M rounded up to whole row pairs (MMLA), else M: the M the blocks tile."""
        return padded(self.m, 2) if self.mmla else self.m

    @property
    def padded_n(self) -> int:
        """N rounded up to whole column pairs (MMLA), else N: the N the blocks tile."""
        return padded(self.n, 2) if self.mmla else self.n





@dataclass(frozen=True)
class GemmConfig:
    """Block sizes plus a point of the loop_spec space for one GEMM.

    Parameters
    ----------
    bm, bn, bk
        Block sizes: each divides its dimension (K: the problem's ``padded_k``), and ``bk``
        takes whole VNNI groups (a multiple of the problem's ``alpha``).
    candidate
        The loop_spec over ``a`` (K blocks), ``b`` (M blocks), ``c`` (N blocks) with its block
        steps; its step of ``a`` is ``k_step``, the K blocks one BRGEMM call reduces.
    pack_a
        None, or copy the slice of ``X`` that the loops below depth ``pack_a`` of the spec
        read into a contiguous buffer there (0 = all of ``X`` before the loops, 1 = under
        the outermost loop, ...), as BLAS packs A: the microkernel then reads short dense
        rows instead of rows ``K`` floats apart, each on its own page.

    Examples
    --------
    >>> GemmConfig.of("bcaBCb", 32, 64, 128, k_step=2, block_steps={"b": (4, 2)}).k_step
    2
    """

    bm: int
    bn: int
    bk: int
    candidate: Candidate
    pack_a: int | None = None

    def __post_init__(self) -> None:
        for name in ("bm", "bn", "bk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GemmConfig.{name} must be a positive int, got {value!r}")
        if self.pack_a is not None and (not isinstance(self.pack_a, int)
                                        or isinstance(self.pack_a, bool) or self.pack_a < 0):
            raise ValueError(f"GemmConfig.pack_a must be None or a loop depth >= 0, "
                             f"got {self.pack_a!r}")

    @classmethod
    def of(cls, spec: str, bm: int, bn: int, bk: int, k_step: int = 1,
           block_steps: Mapping[str, tuple[int, ...]] | None = None,
           pack_a: int | None = None) -> GemmConfig:
        """Shorthand building the :class:`~schedules.space.Candidate` too."""
        steps = {"a": k_step} if k_step != 1 else {}
        return cls(bm, bn, bk, Candidate(spec, block_steps or {}, steps), pack_a)

    def with_candidate(self, candidate: Candidate) -> GemmConfig:
        """These blocks in another loop order; if A is packed, it is packed under the new
        order's outermost K loop.

        Examples
        --------
        >>> cfg = GemmConfig.of("acb", 256, 64, 512, pack_a=1)
        >>> cfg.with_candidate(Candidate("cBCa", {"c": (2,)})).pack_a
        4
        """
        pack = None
        if self.pack_a is not None:
            letters = [o.loop for o in parse(candidate.spec, 3).occurrences]
            pack = letters.index(0) + 1  # under the first occurrence of ``a``
        return GemmConfig(self.bm, self.bn, self.bk, candidate, pack)

    def reuses_packed_a(self) -> bool:
        """Whether A is packed and an N loop runs under the packing, reusing the copy.

        Examples
        --------
        >>> GemmConfig.of("acb", 256, 64, 512, pack_a=1).reuses_packed_a()
        True
        >>> GemmConfig.of("BCa", 64, 64, 512, pack_a=3).reuses_packed_a()
        False
        """
        if self.pack_a is None:
            return False
        return any(o.loop == 2 for o in parse(self.spec, 3).occurrences[self.pack_a:])

    @property
    def spec(self) -> str:
        return self.candidate.spec

    @property
    def k_step(self) -> int:
        return self.candidate.step("a")

    def check(self, problem: GemmProblem) -> None:
        """ValueError unless the blocks tile ``problem`` exactly."""
        for block, dim, name in ((self.bm, problem.padded_m, "bm"),
                                 (self.bn, problem.padded_n, "bn"),
                                 (self.bk, problem.padded_k, "bk")):
            if dim % block:
                raise ValueError(f"{name}={block} does not divide {dim}")
        if problem.mmla and (self.bm % 2 or self.bn % 2):
            raise ValueError(f"bm={self.bm} and bn={self.bn} must be even: MMLA multiplies "
                             f"2x2 blocks of C")
        k_blocks = problem.padded_k // self.bk
        if k_blocks % self.k_step:
            raise ValueError(f"k_step={self.k_step} does not divide K/bk={k_blocks}")
        if self.bk % problem.alpha:
            raise ValueError(f"bk={self.bk} is not a multiple of {problem.alpha}, the VNNI "
                             f"group of {problem.dtype} GEMMs")

    def parse(self, problem: GemmProblem) -> LoopSpec:
        """The parsed loop_spec over ``problem``'s blocks (ValueError if the blocks do not
        tile it, LoopSpecError if the spec does not fit them)."""
        spec = self.candidate.parse(*self.blocked(problem).trips)
        check_exact(spec)
        return spec

    def blocked(self, problem: GemmProblem) -> BlockedGemm:
        """The problem in block units, as the space and the cost model see it."""
        self.check(problem)
        return BlockedGemm(problem.padded_m, problem.padded_n, problem.padded_k, self.bm,
                           self.bn, self.bk, dtype_bytes=problem.element_bytes)


def pack_weight(w: np.ndarray, bn: int, problem: GemmProblem | None = None, *,
                isa: str | _isa.Isa | None = None) -> np.ndarray:
    """numpy ``W[K, N]`` -> the packed weight of ``problem`` (default: a float32 GEMM) on
    ``isa`` (default: the problem's own :attr:`~GemmProblem.isa`, binding an unbound
    problem as :func:`schedule` does; without either, the layouts of :data:`OPERANDS`).

    float32: ``Wp[N/bn, K, bn]``, each N block's panel contiguous
    (:meth:`~microkernels.pack.Packing.blocked_b`, the flat BRGEMM's B).  bfloat16 and
    uint8 problems: ``Wp[N/bn, K'/a, bn, a]``, each N block's panel in VNNI groups of ``a``
    consecutive K values (:meth:`~microkernels.pack.Packing.vnni_blocked_b`), K zero-padded
    to ``K' = problem.padded_k``.  bfloat16 weights are taken as ``ml_dtypes.bfloat16`` or
    rounded to it from float32 (to nearest even); uint8 problems take integer weights in
    [-128, 127] (quantizing them is the caller's job) and return int8.  MMLA problems
    (:func:`operand_layout`, e.g. ``isa="neon_i8mm"``): ``Wp[N'/2, K'/kb, 2, kb]``, the
    transposed weight in 2 x ``kb`` blocks (:func:`~microkernels.pack.pack_mmla`, ``kb`` = 8
    int8 / 4 bf16), N zero-padded to ``N'`` = :attr:`~GemmProblem.padded_n`; any even ``bn``
    dividing ``N'`` reads it (an N block is a run of whole column pairs).

    Examples
    --------
    >>> w = np.arange(6, dtype="float32").reshape(2, 3)
    >>> pack_weight(w, 1)[2].ravel().tolist()     # column 2 of W, one N block per column
    [2.0, 5.0]
    >>> w8 = np.arange(8, dtype="int8").reshape(4, 2)             # W[K=4, N=2]
    >>> pack_weight(w8, 2, GemmProblem(1, 2, 4, "uint8"))[0, 0].tolist()   # [bn, 4]
    [[0, 2, 4, 6], [1, 3, 5, 7]]
    >>> pack_weight(w8, 2, GemmProblem(1, 2, 4, "uint8"), isa="neon_i8mm").shape
    (1, 1, 2, 8)
    """
    k, n = w.shape
    if problem is not None:
        problem = problem.on(isa)
    if problem is not None and (k, n) != (problem.k, problem.n):
        raise ValueError(f"W must be [K, N] = [{problem.k}, {problem.n}], got {list(w.shape)}")
    if problem is not None and problem.mmla:
        if bn % 2 or problem.padded_n % bn:
            raise ValueError(f"bn={bn} must be even and divide N={problem.padded_n} (MMLA)")
        values = _weight_values(w, problem.weight_dtype)
        full = np.zeros((problem.padded_k, problem.padded_n), values.dtype)
        full[:k, :n] = values
        return pack_mmla(full, mmla_k_block(problem.weight_dtype), "b")
    if n % bn:
        raise ValueError(f"bn={bn} does not divide N={n}")
    if problem is None or problem.layout == "flat":
        # A unit bn leaves its axis out of the packing; the template's operand keeps it.
        return Packing.blocked_b(bn).pack(w).reshape(n // bn, k, bn)
    alpha = problem.alpha
    packed = Packing.vnni_blocked_b(alpha, bn).pack(_weight_values(w, problem.weight_dtype))
    return packed.reshape(n // bn, problem.padded_k // alpha, bn, alpha)


def _weight_values(w: np.ndarray, dtype: str) -> np.ndarray:
    """``w`` as a ``dtype`` array (bfloat16: rounded from float32; int8: integers in range)."""
    import ml_dtypes

    if dtype == "bfloat16":
        if w.dtype not in (np.float32, ml_dtypes.bfloat16):
            raise ValueError(f"bfloat16 weights come as float32 or ml_dtypes.bfloat16, "
                             f"got {w.dtype}")
        return w.astype(ml_dtypes.bfloat16)
    if not np.issubdtype(w.dtype, np.integer) or w.size and (w.min() < -128 or w.max() > 127):
        raise ValueError(f"int8 weights must be integers in [-128, 127], got {w.dtype} "
                         f"values{f' in [{w.min()}, {w.max()}]' if w.size else ''}")
    return w.astype(np.int8)


def workload(problem: GemmProblem, config_or_bn: GemmConfig | int,
             isa: str | _isa.Isa | None = None, batch: tirx.Var | None = None,
             epilogue_isa: str = "generic") -> PrimFunc:
    """The unscheduled PrimFunc ``(X, Wp, *epilogue operands, Y)``; ``Wp`` is packed with
    the config's ``bn`` as :func:`pack_weight` packs it (for ``isa``, binding an unbound
    problem).  With a run-time ``batch`` (a symbolic batch: the parameter before the output),
    M is ``batch * problem.m``: ``problem.m`` rows per unit of the batch.  The epilogue's
    expressions are ``epilogue_isa``'s (:func:`microkernels.epilogue.apply_te`).

    An MMLA problem reads X through a copy in MMLA blocks (``X_packed[M'/2, K'/kb, 2, kb]``,
    zero-padded), multiplies into a ``C[M', N']`` of whole row and column pairs and crops it
    to ``Y[M, N]`` where M or N is odd (the crop is the epilogue's first step, or the
    epilogue)."""
    from tvm import te, tirx

    from microkernels.epilogue import apply_te

    problem = problem.on(isa)
    bn = config_or_bn.bn if isinstance(config_or_bn, GemmConfig) else config_or_bn
    m, n, k, alpha = problem.m, problem.n, problem.padded_k, problem.alpha
    mp, np_ = problem.padded_m, problem.padded_n
    if batch is not None:
        if mp != m:
            raise ValueError("a run-time M cannot be padded to the MMLA row pairs")
        m = mp = batch * problem.m
    acc = problem.acc_dtype
    x = te.placeholder((m, problem.k), problem.dtype, name="X")
    a = x  # the GEMM's A
    if problem.mmla:
        kb = mmla_k_block(problem.dtype)

        def x_block(i2, kq, i, kk):
            row, col = i2 * 2 + i, kq * kb + kk
            if (mp, k) == (m, problem.k):
                return x[row, col]
            return tirx.if_then_else(tirx.all(row < m, col < problem.k), x[row, col],
                                     tirx.const(0, problem.dtype))

        a = te.compute((mp // 2, k // kb, 2, kb), x_block, name=_PACKED_X)
    elif k != problem.k:
        # The kernels read whole VNNI groups: the GEMM reads X through a zero-padded copy.
        a = te.compute((m, k), lambda i, kk: tirx.if_then_else(
            kk < problem.k, x[i, kk], tirx.const(0, problem.dtype)), name=_PADDED_X)
    r = te.reduce_axis((0, k), name="k")
    if problem.mmla:
        packed_shape = (np_ // 2, k // kb, 2, kb)
    elif alpha == 1:
        packed_shape = (n // bn, k, bn)
    else:
        packed_shape = (n // bn, k // alpha, bn, alpha)
    wp = te.placeholder(packed_shape, problem.weight_dtype, name="Wp")

    def weight(j):  # W[r, j] in the packed layout
        if problem.mmla:
            return wp[j // 2, r // kb, j % 2, r % kb]
        if alpha == 1:
            return wp[j // bn, r, j % bn]
        return wp[j // bn, r // alpha, j % bn, r % alpha]

    def x_at(i):  # X[i, r] as the GEMM reads it
        return a[i // 2, r // kb, i % 2, r % kb] if problem.mmla else a[i, r]

    def product(i, j):
        if problem.dtype == acc:  # float32: no casts in the expression
            return x_at(i) * weight(j)
        return x_at(i).astype(acc) * weight(j).astype(acc)

    c = te.compute((mp, np_), lambda i, j: te.sum(product(i, j), axis=r), name="C")
    start = problem.epilogue_dtype
    cropped = (mp, np_) != (m, n)
    if start != acc or cropped:
        # Dequantization's int32 -> float32 and the crop of MMLA's padding, a stage of their
        # own so the GEMM block stays the kernel's semantics; the schedule inlines it into
        # the epilogue (without one, the crop is the epilogue).
        name = "dequantize" if problem.epilogue.ops else _EPILOGUE
        c = te.compute((m, n), lambda i, j: c[i, j].astype(start), name=name)
    extra = {op.name: te.placeholder(op.shape(m, n), op.dtype, name=op.name)
             for op in problem.epilogue.inputs(start)}
    y = (apply_te(problem.epilogue, c, extra, isa=epilogue_isa, name=_EPILOGUE)
         if problem.epilogue.ops else c)
    return te.create_prim_func([x, wp, *extra.values(), *([batch] if batch is not None else []), y])


#: The block copying X with K zero-padded to whole VNNI groups.
_PADDED_X = "X_padded"
#: The block copying X into MMLA blocks (zero-padded to whole row pairs and K blocks).
_PACKED_X = "X_packed"
#: The block finishing each output tile (the epilogue, or the crop of an MMLA GEMM's padding).
_EPILOGUE = "epilogue"


def schedule(problem: GemmProblem, config: GemmConfig, isa: str | _isa.Isa = "avx2",
             batch: tirx.Var | None = None) -> s_tir.Schedule:
    """The scheduled GEMM: loop_spec outer loops around the ISA's BRGEMM microkernel.

    With a run-time ``batch`` (a symbolic batch dimension: the parameter before the output),
    M is ``batch * problem.m``: the loop over M blocks runs ``batch * m / bm`` times and
    everything below it stays static (``problem.m`` is the M the configuration was chosen
    for, e.g. one sample's rows).

    Raises
    ------
    LoopSpecError
        The spec is malformed, misses a loop, blocks do not nest, parallelizes the K loop, or
        needs two parallel regions at once.
    ValueError
        Block sizes do not tile the problem.
    """
    from tvm import s_tir

    isa_name = isa.name if isinstance(isa, _isa.Isa) else _isa.from_name(isa).name
    problem = problem.on(isa_name)
    spec = config.parse(problem)
    if batch is not None:
        check_run_time_loop(spec, "b")
    sch = s_tir.Schedule(workload(problem, config.bn, batch=batch,
                                  epilogue_isa=expression_isa(isa_name, config.bn)))
    cropped = (problem.padded_m, problem.padded_n) != (problem.m, problem.n)
    if problem.epilogue.ops and (problem.epilogue_dtype != problem.acc_dtype or cropped):
        sch.compute_inline(sch.get_sblock("dequantize"))
    gemm = sch.get_sblock("C")
    i, j, kk = sch.get_loops(gemm)
    i_blocks, i_body = sch.split(i, [None, config.bm])
    j_blocks, j_body = sch.split(j, [None, config.bn])
    k_blocks, k_body = sch.split(kk, [None, config.k_step * config.bk])
    single_call = int(sch.get(k_blocks).extent) == 1  # the whole K in each kernel call

    order, grid_loops = nest_loops(sch, spec, {"a": k_blocks, "b": i_blocks, "c": j_blocks})
    sch.reorder(*grid_loops, *order, i_body, j_body, k_body)
    # A padded X, or X in MMLA blocks, is copied anyway: the copy is the packing of A
    # (before the loops if unasked).
    copy_x = (sch.get_sblock(_PACKED_X) if problem.mmla else
              sch.get_sblock(_PADDED_X) if problem.padded_k != problem.k else None)
    pack_depth = 0 if config.pack_a is None and copy_x is not None else config.pack_a
    pack = (_pack_a(sch, spec, gemm, pack_depth, order, copy_x) if pack_depth is not None
            else None)
    epilogue = sch.get_sblock(_EPILOGUE) if problem.epilogue.ops or cropped else None
    init = finish_nest(sch, spec, order, grid_loops, gemm, frozenset("a"), epilogue)
    if pack is not None:
        _parallel_pack(sch, spec, pack, gemm, pack_depth, bool(grid_loops))
    # On amx, blocks that are not tile-shaped get the AVX-512 kernel (find_impl's fallback).
    shape = BrgemmShape(m=config.bm, n=config.bn, k=config.bk, batch=config.k_step,
                        dtype_a=problem.dtype, dtype_acc=problem.acc_dtype,
                        layout=problem.brgemm_layout(isa_name), isa=isa_name)
    shape = zeroing_kernel(sch, init, shape, whole=single_call)
    # Unit loops vanish from the matched block (see the BRGEMM desc): start below them.
    extents = (config.bm, config.bn, config.k_step * config.bk)
    body = next((loop for loop, e in zip((i_body, j_body, k_body), extents, strict=True)
                 if e > 1), k_body)
    call = sch.blockize(body)
    sch.tensorize(call, dispatch(shape))
    if shape.first_call_zeroes:
        bind_first_call(sch, call)
    return sch


def _pack_a(sch: s_tir.Schedule, spec: LoopSpec, gemm: SBlockRV, depth: int,
            order: list[LoopRV], copy: SBlockRV | None = None) -> SBlockRV:
    """Copy the ``X`` slice read below ``depth`` loops into a dense buffer there (with the
    workload's own ``copy`` of X if it has one)."""
    if depth > len(order):
        raise LoopSpecError(f"pack_a={depth} is deeper than the {len(order)} loops of the spec",
                            spec.text, len(spec.text))
    groups = spec.parallel_groups()
    if spec.mode != "grid" and groups and depth - 1 in groups[0][:-1]:
        # The copy would sit between loops that are fused into one parallel loop.
        o = spec.occurrences[depth - 1]
        raise LoopSpecError(f"pack_a={depth} splits the collapsed parallel loops", spec.text,
                            o.position)
    pack = sch.cache_read(gemm, 0, "global") if copy is None else copy
    if depth:
        sch.compute_at(pack, order[depth - 1])
    return pack


def _parallel_pack(sch: s_tir.Schedule, spec: LoopSpec, pack: SBlockRV, gemm: SBlockRV,
                   depth: int, grid: bool) -> None:
    """Vectorize the copy along K; run its rows in parallel unless a parallel loop encloses it."""
    loops = sch.get_loops(pack)
    shared = sch.get_loops(gemm)
    own = [loop for n, loop in enumerate(loops)
           if n >= len(shared) or not sch.get(loop).same_as(sch.get(shared[n]))]
    # The copy's own loops: X_padded's (row, K), X_packed's (row pair, K block, row, K).
    rows, cols = own[0], own[-1]
    sch.vectorize(cols)
    groups = spec.parallel_groups()
    enclosed = depth > 0 and (grid or bool(groups) and depth - 1 >= groups[0][0])
    if not enclosed and len(own) > 1:
        sch.parallel(rows)


#: Up to this many rows (a register tile or so) the kernel reads B's panel about once anyway,
#: so splitting K and packing A would only add traffic.
GEMV_ROWS = 8


def default_config(problem: GemmProblem, machine: Machine) -> GemmConfig:
    """The untuned configuration: blocks from the shape, the ISA's vectors and the caches,
    the whole K per call unless its panel of B outgrows half of L2 (module docstring).

    Examples
    --------
    >>> from microkernels.isa import Caches, from_name
    >>> small_l2 = Machine(from_name("avx2"), Caches(32 << 10, 64 << 10, 1 << 20), threads=2)
    >>> default_config(GemmProblem(40, 64, 1024), small_l2).pack_a
    1
    """
    problem = problem.on(machine.isa)
    whole = whole_k_config(problem, machine)
    if whole.k_step > 1 and problem.m > GEMV_ROWS and _splits_long_k(problem, machine) and \
            problem.padded_k * whole.bn * problem.element_bytes > machine.caches.l2 // 2:
        return long_k_config(problem.padded_m, whole.bn, whole.bk, machine.threads,
                             max_bm=_max_bm(problem, machine, whole.bn), even=problem.mmla)
    return whole


def _splits_long_k(problem: GemmProblem, machine: Machine) -> bool:
    """Whether a K whose whole panel of B outgrows half of L2 is split by default
    (:func:`long_k_config`).  Not for the AVX-512 vector kernels: on a Zen 4 (1 MiB L2, two
    cores) the whole K per call ran 1.03-1.49x faster on all seven shapes measured, float32
    and bf16 (BERT's 128x768x3072 1.06-1.28x, 1024x128x8192 1.49x; BENCHMARKS.md), its
    panel streaming from L3 as fast as the kernel reads it.  AVX2 keeps the split (1.19-1.20x
    on four of five shapes on a Zen 1's 512 KiB L2, measured with 64-column blocks then), as
    do AMX tiles, whose loads read A's rows K apart (unmeasured against the whole K).

    >>> from microkernels.isa import DEFAULT_CACHES, from_name
    >>> [_splits_long_k(GemmProblem(128, 768, 3072), Machine(from_name(name), DEFAULT_CACHES))
    ...  for name in ("avx2", "avx512_bf16")]
    [True, False]
    """
    return _uses_tiles(problem, machine) or machine.isa.vector_bits < 512


def _uses_tiles(problem: GemmProblem, machine: Machine) -> bool:
    return problem.dtype != "float32" and machine.isa.has("amx_tile")


def _tile_rows(bn: int) -> int:
    """The most rows of a C block ``bn`` columns wide whose C, A and B tiles fit the tile
    registers (:func:`microkernels.amx.plan`): 48 for 16 columns, 32 for 32, 16 for 48;
    0 for wider blocks.

    >>> [_tile_rows(bn) for bn in (16, 24, 48, 64)]
    [48, 32, 16, 0]
    """
    cols = -(-bn // _amx.TILE_ROWS)  # column tiles are 16 wide, as row tiles are 16 high
    row_tiles = (_amx.NUM_TILES - cols) // (cols + 1)  # rows*cols + rows + cols tiles
    return max(row_tiles, 0) * _amx.TILE_ROWS


def _max_bm(problem: GemmProblem, machine: Machine, bn: int) -> int:
    if problem.mmla:
        return _mmla_rows(bn)
    return _tile_rows(bn) if _uses_tiles(problem, machine) else 256


def _mmla_rows(bn: int) -> int:
    """The most (even) rows of an MMLA block ``bn`` columns wide whose C blocks and operands
    fit the vector registers (:func:`microkernels.arm.mmla_registers`); at least 2.

    >>> [_mmla_rows(bn) for bn in (2, 8, 16, 30)]
    [30, 10, 4, 2]
    """
    rows = 2
    while _arm.mmla_registers(rows + 2, bn) <= _arm.VECTOR_REGISTERS:
        rows += 2
    return rows


def _mmla_blocks(m: int, n: int) -> tuple[int, int]:
    """The even ``(bm, bn)`` dividing the (even) ``(m, n)`` with the most C per kernel call
    whose accumulators and operands fit the vector registers, then the fewest registers.

    >>> _mmla_blocks(64, 64), _mmla_blocks(6, 6), _mmla_blocks(2, 1000)
    ((8, 8), (6, 6), (2, 20))
    """
    pairs = [(bm, bn) for bn in divisors(n) if bn % 2 == 0
             for bm in divisors(m) if bm % 2 == 0
             and _arm.mmla_registers(bm, bn) <= _arm.VECTOR_REGISTERS]
    return max(pairs, key=lambda p: (p[0] * p[1], -_arm.mmla_registers(*p), p[1]))


def _tile_blocks(m: int, n: int) -> tuple[int, int]:
    """The tile-shaped ``(bm, bn)`` dividing ``(m, n)`` with the most C per call (the most
    tile multiplies per A and B tile loaded), preferring whole 16-wide column tiles.

    >>> _tile_blocks(128, 768), _tile_blocks(37, 48), _tile_blocks(1, 4096)
    ((32, 32), (37, 16), (1, 32))
    """
    pairs = [(bm, bn) for bn in divisors(n) if _tile_rows(bn)
             for bm in divisors(m) if bm <= _tile_rows(bn)]
    return max(pairs, key=lambda p: (p[0] * p[1], p[1] % 16 == 0, p[1]))


def whole_k_config(problem: GemmProblem, machine: Machine, bn: int | None = None
                   ) -> GemmConfig:
    """The whole K in one BRGEMM call, blocks and loop order as the module describes; with
    ``bn`` (x86 float32 and VNNI kernels), column blocks of that width instead."""
    problem = problem.on(machine.isa)
    m, n, k = problem.padded_m, problem.padded_n, problem.padded_k
    lanes = machine.isa.lanes("float32")  # = int32 lanes: the accumulators' vectors
    if problem.mmla:
        # The kernel keeps its whole C block in registers: blocks are its register tile.
        bm, bn = _mmla_blocks(m, n)
        bk = _k_block(k, problem.alpha, problem.alpha)
    elif _uses_tiles(problem, machine):
        # Tile-shaped blocks, and K blocks of whole tile rows where K allows.
        bm, bn = _tile_blocks(m, n)
        bk = _k_block(k, problem.alpha, _amx.TILE_BYTES // problem.element_bytes)
    else:
        # One register tile of columns per call (a GEMV: whole vectors of one where no tile
        # divides N): the call reads its panel of B as one sequential stream, not one column
        # tile of a wider panel at a time (on a Zen 1, 1x4096x25088: 25.8 instead of 18.5
        # GB/s at 64; on a Zen 3 with cold weights, BERT's 128x3072x768 1.08x, its
        # 128x768x3072 1.14x, then in one call, and ResNet's 1x1000x2048 2.1x at 8 columns
        # instead of 50).  Narrower tiles broadcast A for fewer FMAs: 128x1000x2048 ran 2.7x
        # slower at 8 than at 40.
        if bn is None:
            width = _tile_width(machine.isa)
            narrow = [d for d in divisors(n) if d % lanes == 0 and d <= width
                      and (d == width or problem.m <= GEMV_ROWS)]
            bn = max(narrow) if narrow else _wide_column_block(n, lanes)
        bk = _k_block(k, problem.alpha, problem.alpha)
        bm = _m_block(m)
    k_blocks = k // bk
    candidate = heuristic(k_blocks, m // bm, n // bn, machine.caches, machine.threads, bm=bm,
                          bn=bn, bk=bk, dtype_bytes=problem.element_bytes, k_step=k_blocks)
    return GemmConfig(bm, bn, bk, candidate)


def _m_block(m: int) -> int:
    """Rows per call: the largest divisor of ``m`` up to 64; where that is under 16 (an ``m``
    with few divisors), the smallest divisor from 16 up: 197x768x768 on a Zen 3 ran at 48
    GFLOPS in calls of one row, 160 in one call of 197 rows.

    >>> _m_block(1024), _m_block(100), _m_block(197), _m_block(1576), _m_block(5)
    (64, 50, 197, 197, 5)
    """
    bm = pick_divisor(m, 64)
    return bm if bm >= min(m, 16) else min(d for d in divisors(m) if d >= 16)


def _wide_column_block(n: int, lanes: int) -> int:
    """Up to 64 columns (more on AVX-512 if a vector is wider), preferring multiples of two
    vectors, then of one.

    >>> _wide_column_block(768, 8), _wide_column_block(1000, 8), _wide_column_block(30, 8)
    (64, 40, 30)
    """
    fitting = [d for d in divisors(n) if d <= max(64, 2 * lanes)]
    return next(max(aligned) for multiple in (2 * lanes, lanes, 1)
                if (aligned := [d for d in fitting if d % multiple == 0]))


def _tile_width(target: _isa.Isa) -> int:
    """Columns of the x86 kernels' widest register tile (:func:`microkernels.x86.tile_columns`),
    0 elsewhere: blocks of this width make each BRGEMM call one column tile."""
    return _x86.tile_columns(target) if target.arch == "x86_64" else 0


def _k_block(k: int, alpha: int, preferred: int) -> int:
    """The largest divisor of ``k`` up to 512 that is a multiple of ``alpha`` (the kernels
    need whole VNNI groups), preferring multiples of ``preferred``.

    >>> _k_block(68, 4, 4), _k_block(768, 4, 64), _k_block(96, 2, 32)
    (68, 384, 96)
    """
    grouped = [d for d in divisors(k) if d <= 512 and d % alpha == 0]
    return max([d for d in grouped if d % preferred == 0] or grouped)


def long_k_config(m: int, bn: int, bk: int, threads: int, max_bm: int = 256,
                  even: bool = False) -> GemmConfig:
    """BLAS's ``kc`` loop, for a K too long for one BRGEMM call.

    K blocks run outermost, one per call, and each K block's columns of ``X`` are packed
    once (``pack_a=1``) and reused by every N block; under them N and M blocks are
    parallel.  A ``bk x bn`` panel of B stays in L2 while the call walks its ``bm`` rows
    (at most ``max_bm``: AMX tiles take 32; ``even``: whole MMLA row pairs).

    Examples
    --------
    >>> long_k_config(2048, 64, 512, threads=2)
    GemmConfig(bm=256, bn=64, bk=512, candidate=Candidate('aCB', {}), pack_a=1)
    """
    return GemmConfig(pick_divisor(m, max_bm, 2 if even else 1), bn, bk,
                      Candidate("aCB" if threads > 1 else "acb"), pack_a=1)


def blockings(problem: GemmProblem, machine: Machine) -> list[GemmConfig]:
    """The default first, then the other blockings whose loop orders are generated: beyond
    a GEMV's rows, the whole K in column blocks of up to 64 (:func:`_wide_column_block`) if
    the default's differ; when K spans several blocks, the whole K per call, one K
    block per call, and (beyond a GEMV's rows) one K block per call with A packed under the
    outermost K loop (:func:`long_k_config`)."""
    problem = problem.on(machine.isa)
    base = default_config(problem, machine)
    out = [base]
    # Not for a GEMV: its columns stream B from memory in a network, while a measurement
    # keeps B in cache (ResNet's 1x1000x2048 ran 1.4x faster at 40 columns than at 8 warm,
    # 1.5x slower cold).
    if problem.m > GEMV_ROWS and not problem.mmla and not _uses_tiles(problem, machine):
        lanes = machine.isa.lanes("float32")
        wide = whole_k_config(problem, machine, bn=_wide_column_block(problem.n, lanes))
        out += [wide] if wide.bn != base.bn else []
    if problem.padded_k // base.bk > 1:
        whole = whole_k_config(problem, machine)
        split = GemmConfig(whole.bm, whole.bn, whole.bk, Candidate("BCa"))
        packed = (long_k_config(problem.padded_m, base.bn, base.bk, machine.threads,
                                max_bm=_max_bm(problem, machine, base.bn), even=problem.mmla)
                  if problem.m > GEMV_ROWS else None)
        out += [c for c in (whole, split, packed) if c is not None and c != base]
    return out


def ranked_configs(problem: GemmProblem, blocking: GemmConfig, machine: Machine,
                   max_candidates: int = 400) -> list[tuple[float, GemmConfig]]:
    """PARLOOPER's loop orders (:func:`~schedules.space.generate`) with ``blocking``'s block
    sizes and packing, as ``(predicted cycles, config)``, best predicted first.

    A packed config is kept only if an N loop runs under its packing, i.e. the packed A is
    reused; ``blocking`` itself is always ranked.

    Examples
    --------
    >>> from microkernels.isa import DEFAULT_CACHES, from_name
    >>> one_core = Machine(from_name("avx512"), DEFAULT_CACHES, 1, fp32_flops_per_cycle=64.0)
    >>> base = GemmConfig.of("acb", 256, 64, 512, pack_a=1)
    >>> ranked_configs(GemmProblem(1024, 1024, 1024), base, one_core)[0][1].spec
    'bac'
    """
    problem = problem.on(machine.isa)
    blocked = blocking.blocked(problem)  # the same block sizes for every loop order
    generated = generate(*blocked.trips, steps=(blocking.k_step, 1, 1),
                         require_parallel=machine.threads > 1, max_candidates=max_candidates)
    configs = [cfg for cfg in map(blocking.with_candidate, generated)
               if cfg.pack_a is None or cfg.reuses_packed_a()]
    if blocking not in configs:  # the sampled space left it out: rank it all the same
        configs.append(blocking)
    peak = machine.peak_flops_per_cycle
    return sorted(((predict(cfg.candidate, blocked, machine.caches, machine.threads,
                            peak_flops_per_cycle=peak, pack_a=cfg.pack_a), cfg)
                   for cfg in configs), key=lambda pair: pair[0])


def ranked_blockings(problem: GemmProblem, machine: Machine, max_candidates: int = 400
                     ) -> list[list[tuple[float, GemmConfig]]]:
    """:func:`ranked_configs` of each of the :func:`blockings`, the default's first."""
    return [ranked_configs(problem, b, machine, max_candidates)
            for b in blockings(problem, machine)]


def measuring_order(default: GemmConfig, families: list[list[tuple[float, GemmConfig]]]
                    ) -> list[GemmConfig]:
    """The default, then the model's best loop order of every blocking in turn, then the
    second of each, and so on.

    The model ranks the loop orders (and where A is packed) of one blocking; it does not
    see how block sizes change the kernel's own efficiency, so it cannot rank blockings
    against each other: each gets its share of the measurements.

    Examples
    --------
    >>> a, b, c = (GemmConfig.of(spec, 8, 8, 8) for spec in ("BCa", "CBa", "aBC"))
    >>> [x.spec for x in measuring_order(b, [[(1.0, a), (2.0, b)], [(1.5, c)]])]
    ['CBa', 'BCa', 'aBC']
    """
    order = [default]
    for n in range(max(map(len, families))):
        order += [family[n][1] for family in families
                  if n < len(family) and family[n][1] != default]
    return order


def candidates(problem: GemmProblem, machine: Machine, max_candidates: int = 400
               ) -> list[GemmConfig]:
    """Configurations worth measuring in the order to measure them, :func:`default_config`'s
    first (:func:`measuring_order` of :func:`ranked_blockings`).

    Parameters
    ----------
    max_candidates
        Cap on the loop orders generated per blocking.

    Examples
    --------
    >>> from microkernels.isa import DEFAULT_CACHES, from_name
    >>> machine = Machine(from_name("avx2"), DEFAULT_CACHES, 2, fp32_flops_per_cycle=32.0)
    >>> p = GemmProblem(48, 64, 96)
    >>> found = candidates(p, machine, max_candidates=20)
    >>> found[0] == default_config(p, machine), len(found) == len(set(found))
    (True, True)
    """
    problem = problem.on(machine.isa)
    families = ranked_blockings(problem, machine, max_candidates)
    return measuring_order(default_config(problem, machine), families)
