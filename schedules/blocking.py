"""Block sizes that tile a dimension exactly: its divisors, the one a template prefers and
the ones a tuner tries around it.

The templates tile exactly (no tails), so every block size is a divisor of its dimension.

Examples
--------
>>> pick_divisor(768, 64, multiple=16)
64
>>> near_divisors(768, 384, 2, hi=512)
[256, 192]
"""

from __future__ import annotations

__all__ = ["divisors", "pick_divisor", "near_divisors", "vector_block"]


def divisors(n: int) -> list[int]:
    """Divisors of ``n``, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def pick_divisor(n: int, limit: int, multiple: int = 1) -> int:
    """The largest divisor of ``n`` within ``limit``, preferring multiples of ``multiple``."""
    fitting = [d for d in divisors(n) if d <= limit]
    aligned = [d for d in fitting if d % multiple == 0]
    return max(aligned or fitting)


def vector_block(n: int, lanes: int, limit: int = 64) -> int:
    """A block of ``n`` output columns for vectors of ``lanes``: the largest divisor within
    ``limit`` that is a multiple of ``lanes`` and spans two vectors or more; else (ShuffleNet's
    groups of 68 or 136 channels) the divisor within ``2 * limit`` whose last vector is
    fullest, since each partial vector costs a whole one, then of two vectors or more, then
    the larger.  So 136 columns take blocks of one vector, not 68 (8 full vectors and a
    half): ShuffleNet's 544-channel 1x1 conv in 4 groups, AVX2, 1.20-1.95x with ``bk=8``
    (``tvm-tpp bench-conv 1x544x7x7x544x1x1/s1x1p0x0x0x0g4``, warm and ``--cold``, batch 1
    and 8, BENCHMARKS.md thirty-second session).

    >>> vector_block(256, 8), vector_block(68, 8), vector_block(136, 8), vector_block(21, 8)
    (64, 68, 8, 21)
    """
    aligned = [d for d in divisors(n) if d <= limit and d % lanes == 0]
    if aligned and max(aligned) >= 2 * lanes:
        return max(aligned)
    fitting = [d for d in divisors(n) if d <= 2 * limit]
    return max(fitting, key=lambda d: (d / (lanes * -(-d // lanes)), d >= 2 * lanes, d))


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
