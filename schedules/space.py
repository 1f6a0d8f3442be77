"""The PARLOOPER candidate space for a blocked GEMM (:class:`BlockedGemm`), and a default heuristic.

The GEMM runs on blocked tensors ``A[Mb][Kb][bk][bm]``, ``B[Nb][Kb][bn][bk]`` and
``C[Nb][Mb][bn][bm]``. It has three logical loops over blocks (Listing 1):

- ``a``: the K blocks, a reduction. Its step is ``k_step``, the BRGEMM batch count.
- ``b``: the M blocks.
- ``c``: the N blocks.

:func:`generate` follows the generation rules of [PL] §II-D:

1. ``a`` appears up to 2 times, ``b`` and ``c`` up to 3 times.
2. Block steps are prefix products of the ascending prime factors of the loop's trip count,
   times its step. For example 32 blocks give ``2, 4, 8, 16`` × step. The full product is
   excluded: a block equal to the whole loop gives a one-trip outer loop, which is the same
   nest without that occurrence. A loop blocked ``j-1`` times takes any ``j-1`` of its
   factors, in decreasing order (outer first).
3. Only occurrences of ``b`` and ``c`` are parallel, as one run of up to ``max_collapse``
   consecutive upper-case letters (a collapse group). Any occurrence may be chosen.
4. All orders are tried, except those with two adjacent occurrences of the same loop. Such an
   ``xx`` iterates exactly like a single ``x``. PARLOOPER's own generator drops them too.

The full space is large, e.g. about 10^6 candidates for 32×32×32 blocks. ``max_candidates``
therefore keeps a deterministic, stratified sample. The strata are the occurrence-count
patterns ``(#a, #b, #c)``, and each stratum gets an equal share of the budget; strata smaller
than their share are kept whole and pass the rest on. So, with the default budget, the simple
strings (``aBC``, ``BCa``, ...) are all present, and the deep ones are sampled uniformly with
a seeded RNG.

Examples
--------
>>> cands = generate(4, 4, 4, max_candidates=50)
>>> len(cands), cands[0].spec
(50, 'aBc')
>>> heuristic(32, 32, 32, DEFAULT_CACHES, 2).spec
'cBCa'
"""

from __future__ import annotations

import operator
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, combinations, product
from types import MappingProxyType

from microkernels.isa import DEFAULT_CACHES, Caches
from schedules.loop_spec import LoopDecl, LoopSpec, parse

__all__ = [
    "BlockedGemm",
    "Candidate",
    "gemm_loops",
    "block_factors",
    "generate",
    "space_size",
    "heuristic",
    "DEFAULT_CACHES",
]

_LETTERS = "abc"


def _pos(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class BlockedGemm:
    """``C[M,N] += A[M,K] @ B[K,N]`` computed on ``bm×bn`` C blocks with ``bk`` K blocks.

    ``dtype_bytes`` is the element size of A and B; ``out_bytes`` the one of the C
    accumulator (4 for fp32/int32). Dimensions that are not multiples of the block are padded.
    """

    M: int
    N: int
    K: int
    bm: int
    bn: int
    bk: int
    dtype_bytes: int = 4
    out_bytes: int = 4

    def __post_init__(self) -> None:
        for name in ("M", "N", "K", "bm", "bn", "bk", "dtype_bytes", "out_bytes"):
            _pos(getattr(self, name), name)

    @property
    def Mb(self) -> int:  # noqa: N802 - the paper's names
        return -(-self.M // self.bm)

    @property
    def Nb(self) -> int:  # noqa: N802
        return -(-self.N // self.bn)

    @property
    def Kb(self) -> int:  # noqa: N802
        return -(-self.K // self.bk)

    @property
    def trips(self) -> tuple[int, int, int]:
        """Block counts in loop order ``(Kb, Mb, Nb)`` = loops ``a, b, c``."""
        return (self.Kb, self.Mb, self.Nb)


@dataclass(frozen=True, eq=True)
class Candidate:
    """One point of the space: a loop_spec string plus the block steps it consumes.

    Parameters
    ----------
    spec
        The loop_spec string over ``a`` (K), ``b`` (M), ``c`` (N).
    block_steps
        Letter → block steps, outer first. A missing letter has none.
    steps
        Letter → base step. A missing letter has step 1. ``steps["a"]`` is ``k_step``, the
        number of K blocks one BRGEMM call reduces.

    Examples
    --------
    >>> c = Candidate("bcaBCb", {"b": (8, 2), "c": (8,)})
    >>> c.parse(32, 32, 32).occurrences[3].var
    'b1'
    """

    spec: str
    block_steps: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    steps: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.spec, str):
            raise TypeError(f"spec must be a str, got {type(self.spec).__name__}")
        for what, mapping in (("block_steps", self.block_steps), ("steps", self.steps)):
            bad = set(mapping) - set(_LETTERS)
            if bad:
                raise ValueError(f"{what} keys must be GEMM loop letters a/b/c, got {sorted(bad)}")
        blocks = {k: tuple(self.block_steps[k]) for k in sorted(self.block_steps)}
        steps = {k: _pos(self.steps[k], f"step of {k!r}") for k in sorted(self.steps)}
        object.__setattr__(self, "block_steps", MappingProxyType(blocks))
        object.__setattr__(self, "steps", MappingProxyType(steps))

    def __hash__(self) -> int:
        return hash((self.spec, tuple(self.block_steps.items()), tuple(self.steps.items())))

    def __repr__(self) -> str:
        extra = f", steps={dict(self.steps)}" if self.steps else ""
        return f"Candidate({self.spec!r}, {dict(self.block_steps)}{extra})"

    def step(self, letter: str) -> int:
        """Base step of loop ``letter`` (1 unless given)."""
        return self.steps.get(letter, 1)

    def loops(self, Kb: int, Mb: int, Nb: int, *,  # noqa: N803
              parallel_reduction: str | None = None) -> tuple[LoopDecl, LoopDecl, LoopDecl]:
        """The three :class:`LoopDecl` for these trip counts (see :func:`gemm_loops`)."""
        return gemm_loops(Kb, Mb, Nb, steps=tuple(self.step(x) for x in _LETTERS),
                          block_steps=self.block_steps, parallel_reduction=parallel_reduction)

    def parse(self, Kb: int, Mb: int, Nb: int) -> LoopSpec:  # noqa: N803
        """The parsed spec for these trip counts."""
        return parse(self.spec, self.loops(Kb, Mb, Nb))


def gemm_loops(
    Kb: int,  # noqa: N803
    Mb: int,  # noqa: N803
    Nb: int,  # noqa: N803
    *,
    steps: Sequence[int] = (1, 1, 1),
    block_steps: Mapping[str, Sequence[int]] | None = None,
    parallel_reduction: str | None = None,
) -> tuple[LoopDecl, LoopDecl, LoopDecl]:
    """Listing 1's declarations: ``a`` = K blocks (a reduction), ``b`` = M, ``c`` = N.

    Examples
    --------
    >>> gemm_loops(8, 4, 4, steps=(2, 1, 1))[0]
    LoopDecl(name='K', extent=8, step=2, block_steps=(), reduction=True, parallel_reduction=None)
    """
    blocks = block_steps or {}
    ka, kb, kc = steps
    return (
        LoopDecl("K", Kb, ka, tuple(blocks.get("a", ())), reduction=True,
                 parallel_reduction=parallel_reduction),
        LoopDecl("M", Mb, kb, tuple(blocks.get("b", ()))),
        LoopDecl("N", Nb, kc, tuple(blocks.get("c", ()))),
    )


def _prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    if n > 1:
        out.append(n)
    return out


def block_factors(trips: int, step: int = 1) -> tuple[int, ...]:
    """Candidate block steps of a loop with ``trips`` iterations of ``step`` (rule 2).

    Examples
    --------
    >>> block_factors(32)
    (2, 4, 8, 16)
    >>> block_factors(12, step=2)
    (4, 8)
    >>> block_factors(7)
    ()
    """
    _pos(trips, "trips")
    _pos(step, "step")
    return tuple(p * step for p in accumulate(_prime_factors(trips), operator.mul) if p < trips)


def _orders(counts: dict[str, int], last: str = "") -> Iterator[str]:
    """Distinct arrangements of the letter multiset with no two equal letters adjacent."""
    if not any(counts.values()):
        yield ""
        return
    for x in _LETTERS:
        if counts.get(x) and x != last:
            counts[x] -= 1
            for rest in _orders(counts, x):
                yield x + rest
            counts[x] += 1


@dataclass(frozen=True)
class _Stratum:
    counts: tuple[int, int, int]
    structures: tuple[str, ...]  # spec strings with case applied
    blocks: tuple[dict[str, tuple[int, ...]], ...]

    @property
    def size(self) -> int:
        return len(self.structures) * len(self.blocks)

    def candidate(self, index: int, steps: dict[str, int]) -> Candidate:
        s, b = divmod(index, len(self.blocks))
        return Candidate(self.structures[s], self.blocks[b], steps)


def _strata(trips: Sequence[int], steps: Sequence[int], max_occurrences: Sequence[int],
            max_collapse: int, require_parallel: bool) -> list[_Stratum]:
    factors = [block_factors(-(-t // s), s) for t, s in zip(trips, steps, strict=True)]
    ranges = [range(1, min(m, len(f) + 1) + 1)
              for m, f in zip(max_occurrences, factors, strict=True)]
    out = []
    for counts in sorted(product(*ranges), key=lambda c: (sum(c), c)):
        structures = []
        for order in _orders(dict(zip(_LETTERS, counts, strict=True))):
            if not require_parallel:
                structures.append(order)
            for start in range(len(order)):
                for length in range(1, max_collapse + 1):
                    run = order[start:start + length]
                    if len(run) < length or "a" in run:
                        break
                    structures.append(order[:start] + run.upper() + order[start + length:])
        per_letter = [
            [tuple(sorted(c, reverse=True)) for c in combinations(f, n - 1)]
            for f, n in zip(factors, counts, strict=True)
        ]
        blocks = tuple({x: bs for x, bs in zip(_LETTERS, combo, strict=True) if bs}
                       for combo in product(*per_letter))
        if structures:
            out.append(_Stratum(counts, tuple(structures), blocks))
    return out


def _check_args(trips: Sequence[int], steps: Sequence[int], max_occurrences: Sequence[int],
                max_collapse: int) -> None:
    for name, values in (("trip counts", trips), ("steps", steps),
                         ("max_occurrences", max_occurrences)):
        if len(values) != 3:
            raise ValueError(f"{name} must have 3 entries (a=K, b=M, c=N), got {len(values)}")
        for v in values:
            _pos(v, name)
    _pos(max_collapse, "max_collapse")


def space_size(
    Kb: int, Mb: int, Nb: int, *,  # noqa: N803
    steps: Sequence[int] = (1, 1, 1),
    max_occurrences: Sequence[int] = (2, 3, 3),
    max_collapse: int = 2,
    require_parallel: bool = True,
) -> int:
    """Number of candidates :func:`generate` would return without ``max_candidates``."""
    _check_args((Kb, Mb, Nb), steps, max_occurrences, max_collapse)
    return sum(s.size for s in _strata((Kb, Mb, Nb), steps, max_occurrences, max_collapse,
                                       require_parallel))


def generate(
    Kb: int, Mb: int, Nb: int, *,  # noqa: N803
    steps: Sequence[int] = (1, 1, 1),
    max_occurrences: Sequence[int] = (2, 3, 3),
    max_collapse: int = 2,
    require_parallel: bool = True,
    max_candidates: int | None = 1000,
    seed: int = 0,
) -> list[Candidate]:
    """PARLOOPER's GEMM candidates for ``Kb × Mb × Nb`` blocks (module docstring has the rules).

    Parameters
    ----------
    Kb, Mb, Nb
        Trip counts of the block loops ``a``, ``b``, ``c``.
    steps
        Base steps ``(k_step, m_step, n_step)``.
    max_occurrences
        Most appearances of ``a``, ``b``, ``c`` (paper: 2, 3, 3).
    max_collapse
        Longest run of consecutive parallel letters (PARLOOPER's tuner uses 2).
    require_parallel
        Drop fully sequential strings (keep them for single-threaded tuning).
    max_candidates
        Cap on the result (``None``: the whole space, which may be very large).
    seed
        Seed of the stratified sampler; the same arguments always give the same list.

    Returns
    -------
    list[Candidate]
        Distinct candidates, simple strata first. Each one parses against ``Candidate.loops``.
    """
    _check_args((Kb, Mb, Nb), steps, max_occurrences, max_collapse)
    if max_candidates is not None:
        _pos(max_candidates, "max_candidates")
    strata = _strata((Kb, Mb, Nb), steps, max_occurrences, max_collapse, require_parallel)
    step_map = {x: s for x, s in zip(_LETTERS, steps, strict=True) if s != 1}
    total = sum(s.size for s in strata)
    budget = total if max_candidates is None else min(max_candidates, total)
    take: dict[int, int] = {}
    left = budget
    order = sorted(range(len(strata)), key=lambda k: strata[k].size)
    for n, k in enumerate(order):
        take[k] = min(strata[k].size, left // (len(order) - n))
        left -= take[k]
    rng = random.Random(seed)
    out = []
    for k, stratum in enumerate(strata):
        if take[k] == stratum.size:
            picks = range(stratum.size)
        else:
            picks = sorted(rng.sample(range(stratum.size), take[k]))
        out.extend(stratum.candidate(i, step_map) for i in picks)
    return out


def heuristic(
    Kb: int, Mb: int, Nb: int,  # noqa: N803
    caches: Caches, threads: int, *,
    bm: int = 32, bn: int = 32, bk: int = 32, dtype_bytes: int = 4, k_step: int = 1,
) -> Candidate:
    """A sensible default without tuning, for ``Kb × Mb × Nb`` blocks (as :func:`generate`).

    1. Parallelize M and N blocks as one collapse group, with the larger dimension outer.
       Each thread then owns a range of the larger operand's panels, and only the smaller
       operand is read by every thread.
    2. Put ``a`` (K) innermost outside the kernel. Every C block then finishes all its K
       steps while it is hot, and is never re-read from memory.
    3. The inner parallel loop walks every panel of the other operand once per outer block.
       When those panels (``trips × b × K × dtype``) exceed half of L2, block that loop.
       The block is the largest rule-2 factor whose panels fit in half of L2 and still leaves
       at least ``threads`` parallel iterations. The result looks like ``cBCa``.
    4. When one panel fits in half of L2 but two do not, swap the two loops instead: each of
       those panels is then read once and stays in L2 while the inner loop streams the other
       operand, instead of being fetched anew for every block of it (2048^3 measured a quarter
       to a third faster than ``BCa``; see BENCHMARKS.md).  A panel larger than
       that is fetched once per call either way: no blocking then.  With fewer than two of
       those panels per thread, the plain order: with one each, every thread would stream
       all of the other operand, which the plain order splits between them (BERT's
       128 x 768 x 768 in two row blocks on a 512 KiB L2 measured 2.31 ms swapped, 1.99 ms
       with the columns split between the threads).
    5. Neither 3 nor 4 when the outer operand outgrows half of L3 and the inner one fits
       there: both would read the outer operand from memory once per (block of) inner
       panels, where the plain order reads it once and re-reads only the inner operand, from
       L3 (BERT's 128 x 3072 x 768 GEMM on a 512 KiB L2: swapped, each thread's one row
       block streams all of the 9 MiB weight).
    6. Neither 3 nor 4 when the inner loop walks row blocks of A (more N blocks than M
       blocks): the plain order keeps each call's panel of B in cache while consecutive row
       blocks of A, contiguous in memory, stream past it.  Keeping row blocks of A resident
       instead and streaming B's panels past them ran 0.80-0.84x as fast (1024 x 3072 x 768,
       the GPT-2 layer's at batch 8, 64-row blocks on a Zen 3; the whole layer 1.12x faster
       plain; BENCHMARKS.md): rules 3 and 4 keep panels of B resident, never of A.

    Examples
    --------
    >>> heuristic(64, 64, 8, DEFAULT_CACHES, 4, bm=64, bn=64, bk=64)
    Candidate('BCa', {})
    >>> heuristic(32, 32, 32, DEFAULT_CACHES, 2)  # all of B is 4 MiB: block N by 4
    Candidate('cBCa', {'c': (4,)})
    >>> heuristic(4, 32, 32, DEFAULT_CACHES, 2, bm=64, bn=64, bk=512)  # one B panel: 512 KiB
    Candidate('CBa', {})
    >>> zen1 = Caches(32 << 10, 512 << 10, 8 << 20)  # B: 9 MiB, A: 384 KiB
    >>> heuristic(2, 2, 48, zen1, 2, bm=64, bn=64, bk=384, k_step=2)
    Candidate('CBa', {}, steps={'a': 2})
    """
    for name, v in (("Kb", Kb), ("Mb", Mb), ("Nb", Nb), ("threads", threads), ("bm", bm),
                    ("bn", bn), ("bk", bk), ("dtype_bytes", dtype_bytes), ("k_step", k_step)):
        _pos(v, name)
    outer, inner = ("b", "c") if Mb >= Nb else ("c", "b")
    inner_trips, outer_trips = (Nb, Mb) if inner == "c" else (Mb, Nb)
    panel = (bn if inner == "c" else bm) * Kb * bk * dtype_bytes
    steps = {"a": k_step} if k_step != 1 else {}
    par = outer.upper() + inner.upper()
    if inner == "b" or inner_trips * panel <= caches.l2 // 2:  # rule 6; 3 with nothing to block
        return Candidate(par + "a", {}, steps)
    outer_bytes = outer_trips * (bm if outer == "b" else bn) * Kb * bk * dtype_bytes
    if outer_bytes > caches.l3 // 2 >= inner_trips * panel:  # rule 5
        return Candidate(par + "a", {}, steps)
    if panel <= caches.l2 // 2 < 2 * panel:  # rule 4
        return Candidate((par[::-1] if inner_trips >= 2 * threads else par) + "a", {}, steps)
    fits = [f for f in block_factors(inner_trips)
            if f * panel <= caches.l2 // 2 and f * outer_trips >= threads]
    if not fits:
        return Candidate(par + "a", {}, steps)
    return Candidate(inner + par + "a", {inner: (fits[-1],)}, steps)
