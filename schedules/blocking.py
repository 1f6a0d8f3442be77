"""Default block sizes and loop_spec for a GEMM, without tuning.

Block sizes follow the microkernel and the caches; the loop order comes from
:func:`schedules.space.heuristic`.  Blocks must divide their dimension (the template tiles
exactly), so they are chosen among the dimension's divisors:

* ``bn`` — a multiple of two vectors where possible (the register tile's width), at most 64
  floats so a ``bk x bn`` panel of B stays in L1/L2 next to A's rows;
* ``bm`` — at most 64 rows (the kernel walks them in register tiles, remainder included);
* ``bk`` and ``k_step`` — the whole K in one BRGEMM call (TPP's Algorithm 6), in blocks of at
  most 512 so one batch element's panel of B stays in L2: C never leaves the registers
  between K steps;
* unless K is so long that the whole-K panel of B (``K x bn``) takes more than half of L2,
  where A's rows streaming past would evict it before the next row tile re-reads it: then
  :func:`long_k_config` splits K across calls and packs A, as BLAS does (128x768x3072 on one
  core: 100 -> 115 GFLOPS measured).  Up to half of L2 the panel stays, provided the loop
  over N blocks is outside the one over M blocks (the heuristic's rule 4): 2048^3, whose
  panel is exactly half of L2, measured faster that way than split and packed, on one core
  and more so on two (BENCHMARKS.md).

Examples
--------
>>> from microkernels import isa
>>> cfg = default_config(128, 768, 768, isa.from_name("avx2"), isa.DEFAULT_CACHES, threads=2)
>>> (cfg.bm, cfg.bn, cfg.bk, cfg.k_step)
(64, 64, 384, 2)
"""

from __future__ import annotations

from microkernels.isa import Caches, Isa

from .gemm import GemmConfig
from .space import Candidate, heuristic

__all__ = ["default_config", "whole_k_config", "long_k_config", "divisors", "pick_divisor",
           "near_divisors", "GEMV_ROWS"]


def divisors(n: int) -> list[int]:
    """Divisors of ``n``, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def pick_divisor(n: int, limit: int, multiple: int = 1) -> int:
    """The largest divisor of ``n`` within ``limit``, preferring multiples of ``multiple``."""
    fitting = [d for d in divisors(n) if d <= limit]
    aligned = [d for d in fitting if d % multiple == 0]
    return max(aligned or fitting)


def near_divisors(n: int, current: int, count: int, lo: int = 1, hi: int | None = None,
                  multiple: int = 1) -> list[int]:
    """Up to ``count`` divisors of ``n`` other than ``current``, nearest to it by ratio.

    Only multiples of ``multiple`` within ``[lo, hi]`` count: the tuners' block-size
    alternatives around a default block.

    Examples
    --------
    >>> near_divisors(56, 28, 2, lo=7, hi=64)
    [14, 56]
    >>> near_divisors(64, 64, 1, multiple=8)
    [32]
    """
    options = [d for d in divisors(n) if d != current and d % multiple == 0
               and lo <= d <= (n if hi is None else hi)]
    return sorted(options, key=lambda d: (max(d, current) / min(d, current), d))[:count]


#: Up to this many rows (a register tile or so) the kernel reads B's panel about once anyway,
#: so splitting K and packing A would only add traffic.
GEMV_ROWS = 8


def default_config(m: int, n: int, k: int, isa: Isa, caches: Caches, threads: int) -> GemmConfig:
    """A GEMM configuration from the shape, the ISA's vectors and the caches.

    Parameters
    ----------
    m, n, k
        GEMM sizes (float32).
    isa
        Target ISA: its vector width sets the preferred multiple of ``bn``.
    caches, threads
        Passed to the loop-order heuristic.
    """
    whole = whole_k_config(m, n, k, isa, caches, threads)
    if whole.k_step > 1 and m > GEMV_ROWS and k * whole.bn * 4 > caches.l2 // 2:
        return long_k_config(m, whole.bn, whole.bk, threads)
    return whole


def whole_k_config(m: int, n: int, k: int, isa: Isa, caches: Caches, threads: int
                   ) -> GemmConfig:
    """The whole K in one BRGEMM call, blocks and loop order as the module describes."""
    lanes = isa.lanes("float32")
    if n % lanes == 0:
        bn = pick_divisor(n, max(64, 2 * lanes), 2 * lanes)
    else:
        bn = pick_divisor(n, 64, lanes)
    bk = pick_divisor(k, 512)
    bm = pick_divisor(m, 64)
    k_blocks = k // bk
    candidate = heuristic(k_blocks, m // bm, n // bn, caches, threads, bm=bm, bn=bn, bk=bk,
                          k_step=k_blocks)
    return GemmConfig(bm, bn, bk, candidate)


def long_k_config(m: int, bn: int, bk: int, threads: int) -> GemmConfig:
    """BLAS's ``kc`` loop, for a K too long for one BRGEMM call.

    K blocks run outermost, one per call, and each K block's columns of ``X`` are packed
    once (``pack_a=1``) and reused by every N block; under them N and M blocks are
    parallel.  A ``bk x bn`` panel of B stays in L2 while the call walks its ``bm`` rows.

    Examples
    --------
    >>> long_k_config(2048, 64, 512, threads=2)
    GemmConfig(bm=256, bn=64, bk=512, candidate=Candidate('aCB', {}), pack_a=1)
    """
    return GemmConfig(pick_divisor(m, 256), bn, bk, Candidate("aCB" if threads > 1 else "acb"),
                      pack_a=1)
