"""Trace-driven cache model of a BRGEMM loop nest ([PL] §II-E), used to rank loop_specs.

The model works as follows.

1. **Work partition.** :func:`schedules.loop_spec.work_share` gives the share of each thread
   under TVM's static partition. Threads whose shares have the same shape cost the same, so
   each shape is evaluated only once.
2. **Trace.** Each body call ``(ik, im, in)`` touches three tensor slices:
   ``A[im, ik]`` (``m_step·bm × k_step·bk`` elements), ``B[in, ik]``
   (``n_step·bn × k_step·bk``) and ``C[in, im]`` (``m_step·bm × n_step·bn`` accumulator
   elements). The model works at slice granularity, not cache lines.
3. **Caches.** Every thread gets a private 3-level LRU hierarchy, and each level is fully
   associative with a capacity in bytes. The capacities are ``Caches.l1d``, ``Caches.l2``
   and ``Caches.l3 / threads``: the shared L3 is split evenly. Each is scaled by
   ``capacity_factor``, 0.75 as in PARLOOPER's estimator, for conflict misses and data other
   than the operands.
   As in the paper, data sharing between threads is ignored: each thread runs cold and
   re-fetches whatever it reads. A slice is served by the smallest level that holds it, or
   by memory.
4. **Cost of a call.** A call costs ``max(flops / peak_flops_per_cycle,
   Σ_slices bytes / bandwidth[level])``: compute and data movement overlap, and the slower
   one wins. A thread's cycles are the sum over its calls, plus ``fork_join_cycles`` each
   time it enters a parallel loop. TVM forks and joins once per iteration of the sequential
   loops around a collapse group, and once in grid mode; with one thread it runs the loop
   inline (``TVMBackendParallelLaunch``), so nothing is charged. The prediction is the
   maximum over threads, so load imbalance and idle threads show up.

5. **Packing A.** With ``pack_a=d`` (:class:`schedules.gemm.GemmConfig`), the slice of A
   read below loop depth ``d`` is copied to a dense buffer once per iteration of the loops
   above it: each copy reads the slice from where A lives (L2, L3 or memory by A's size)
   and writes it where the buffer fits, at those levels' bandwidths, the copies spread over
   the threads.  Re-packing under an N loop is what makes a packed nest slow: 1024^3 with
   A re-packed per pair of N blocks measured 85 against 114 GFLOPS packed once per K block,
   and this term predicts about that (+25 % against +3 %).

There are two engines. Both compute the same LRU stack distances.

``"trace"``
    Replays each thread's exact trace through three ``OrderedDict`` LRU caches, as the paper
    does. It is exact but O(calls) in Python, roughly 10 µs per call.
``"analytic"``
    Used for long traces. In a box-shaped share, the previous access to a slice lies one
    iteration back of its *carrying* loop. That is the innermost loop that does not index
    the slice and is past its first iteration.

    - **Counting.** A dynamic program over the loop levels counts the calls for each triple
      of carrying loops, at O(depth) cost.
    - **Stack distance.** For a carrying loop it is a closed-form mean over the positions
      inside its body. The carried tensor contributes one iteration's slices. The other two
      tensors contribute the old iteration's slices after the position plus the new one's up
      to it.
    - **Ragged collapse shares** are kept as an explicit list of points between box levels.

    Against the replay it typically agrees within 1%. The error reaches about 20% when reuse
    windows straddle a capacity, because the mean puts every call on one side.
    ``tests/test_cost_model.py`` checks the agreement and the rank correlation.

``engine="auto"`` (the default) replays when the whole GEMM makes at most ``trace_limit`` calls
and counts otherwise. The choice depends only on the problem and the thread count, never on
the candidate, so one ranking never mixes engines.

The default bandwidths are PARLOOPER's Cascade Lake numbers from
``utils/par_loop_cost_estimator.cpp``, in bytes per cycle per core under load: L1 100,
L2 50, LLC 8, DRAM 2. Only their ratios to each other and to the compute peak matter
for ranking.

Examples
--------
>>> gemm = BlockedGemm(512, 512, 512, 32, 32, 32)
>>> cands = [Candidate("aBC"), Candidate("BCa"), Candidate("cbaBC", {"b": (4,), "c": (4,)})]
>>> best = rank(cands, gemm, DEFAULT_CACHES, threads=2)[0][1]
>>> predict(best, gemm, DEFAULT_CACHES, 2) <= predict(cands[0], gemm, DEFAULT_CACHES, 2)
True
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from microkernels.isa import DEFAULT_CACHES, Caches
from schedules.loop_spec import LoopSpec, Piece, parse, simulate, work_share
from schedules.space import BlockedGemm, Candidate, gemm_loops

__all__ = [
    "Bandwidths",
    "Prediction",
    "analyze",
    "predict",
    "rank",
    "DEFAULT_BANDWIDTHS",
    "DEFAULT_CACHES",
    "BlockedGemm",
]

_TENSORS = ("A", "B", "C")
# Letters each tensor is indexed by (0=a/K, 1=b/M, 2=c/N); a loop over the missing letter
# carries its reuse: c carries A, b carries B, a carries C.
_INDEXED = ((0, 1), (0, 2), (1, 2))
_CARRIED_BY = {2: 0, 1: 1, 0: 2}


@dataclass(frozen=True)
class Bandwidths:
    """Sustained bytes per cycle per core from each level (defaults: PARLOOPER on CLX)."""

    l1: float = 100.0
    l2: float = 50.0
    l3: float = 8.0
    mem: float = 2.0

    def __post_init__(self) -> None:
        for name in ("l1", "l2", "l3", "mem"):
            if not getattr(self, name) > 0:
                raise ValueError(f"bandwidth {name} must be > 0, got {getattr(self, name)!r}")

    def as_tuple(self) -> tuple[float, float, float, float]:
        return (self.l1, self.l2, self.l3, self.mem)


DEFAULT_BANDWIDTHS = Bandwidths()


@dataclass(frozen=True)
class Prediction:
    """What :func:`analyze` found for one candidate.

    Attributes
    ----------
    cycles
        Predicted cycles of the whole GEMM (the slowest thread).
    thread_cycles
        Predicted cycles of each thread (0 for idle threads).
    calls
        BRGEMM calls executed, summed over threads (a consistency check).
    traffic
        ``"A"``/``"B"``/``"C"`` → bytes served by ``(L1, L2, L3, memory)``, over all threads.
    engine
        ``"trace"`` or ``"analytic"``.
    pack_cycles
        Cycles each thread spends packing A (included in ``thread_cycles``).
    """

    cycles: float
    thread_cycles: tuple[float, ...]
    calls: float
    traffic: Mapping[str, tuple[float, float, float, float]]
    engine: str
    pack_cycles: float = 0.0


class _Lru:
    """Inclusive LRU hierarchy, fully associative, byte capacities, slice granularity."""

    def __init__(self, capacities: Sequence[float]) -> None:
        self.caps = list(capacities)
        self.levels: list[OrderedDict[int, int]] = [OrderedDict() for _ in capacities]
        self.used = [0] * len(capacities)

    def access(self, key: int, size: int) -> int:
        """Touch a slice; return the level that served it (``len(levels)`` = memory)."""
        hit = len(self.levels)
        for i, od in enumerate(self.levels):
            if key in od:
                hit = min(hit, i)
                od.move_to_end(key)
            else:
                od[key] = size
                self.used[i] += size
                while self.used[i] > self.caps[i]:
                    self.used[i] -= od.popitem(last=False)[1]
        return hit


@dataclass
class _Model:
    spec: LoopSpec
    gemm: BlockedGemm
    steps: tuple[int, int, int]
    caps: tuple[float, float, float]
    bw: tuple[float, float, float, float]
    peak: float
    fork_join: float

    def sizes(self, nk: float, nm: float, nn: float) -> tuple[float, float, float]:
        g = self.gemm
        return (nm * g.bm * nk * g.bk * g.dtype_bytes, nn * g.bn * nk * g.bk * g.dtype_bytes,
                nm * g.bm * nn * g.bn * g.out_bytes)

    def call_cycles(self, nk: float, nm: float, nn: float, where: Sequence[int]) -> float:
        g = self.gemm
        compute = 2.0 * nm * g.bm * nn * g.bn * nk * g.bk / self.peak
        data = sum(s / self.bw[lv] for s, lv in zip(self.sizes(nk, nm, nn), where, strict=True))
        return max(compute, data)

    def level_of(self, distance: float) -> int:
        for i, cap in enumerate(self.caps):
            if distance <= cap:
                return i
        return len(self.caps)

    def pack_cycles(self, depth: int, threads: int) -> float:
        """Cycles per thread of packing A's slices under loop ``depth`` (item 5 above)."""
        occurrences = self.spec.occurrences
        copies = 1
        for o in occurrences[:depth]:
            copies *= o.trips
        extent = []  # blocks of K and M one copy covers
        for loop in (0, 1):
            below = [o.span for o in occurrences[depth:] if o.loop == loop]
            above = [o.step for o in occurrences[:depth] if o.loop == loop]
            extent.append(below[0] if below else above[-1])
        g = self.gemm
        copy = extent[0] * g.bk * extent[1] * g.bm * g.dtype_bytes
        source = self.level_of(g.M * g.K * g.dtype_bytes)
        # A level-1 home means the caches' largest level that holds it, never L1 for a copy.
        read, write = self.bw[max(source, 1)], self.bw[max(self.level_of(copy), 1)]
        return copies * copy * (1 / read + 1 / write) / threads


def _chain_counts(spec: LoopSpec, piece: Piece, letter: int) -> tuple[dict[int, float], float]:
    """Average trips of each occurrence of ``letter`` in ``piece`` and the mean body extent.

    The averages multiply to the exact number of body values; the mean extent is the average
    number of blocks a body value covers (``min(step, extent - v)``), for clamped tails.
    """
    chain = [i for i, o in enumerate(spec.occurrences) if o.loop == letter]
    counts = [0] * len(chain)
    covered = 0
    extent = spec.loops[letter].extent  # type: ignore[index]
    step = spec.occurrences[chain[-1]].step
    env = [0] * len(spec.occurrences)

    def walk(k: int) -> None:
        nonlocal covered
        i = chain[k]
        if piece.ragged and i in piece.ragged:
            pos = {p[piece.ragged.index(i)] for p in piece.points}
            lo, hi = min(pos), max(pos) + 1
        else:
            lo, hi = piece.ranges[i]
        for v in spec.values(i, env, lo, hi):
            counts[k] += 1
            env[i] = v
            if k + 1 < len(chain):
                walk(k + 1)
            else:
                covered += min(step, extent - v)  # type: ignore[operator]

    walk(0)
    trips = {}
    prev = 1
    for i, c in zip(chain, counts, strict=True):
        trips[i] = c / prev if prev else 0.0
        prev = c
    return trips, (covered / counts[-1] if counts[-1] else 0.0)


def _level_trips(spec: LoopSpec, piece: Piece) -> tuple[list[float], tuple[float, ...]]:
    """Average trips per nest level and mean blocks per call along K, M, N for one piece."""
    trips = [0.0] * len(spec.occurrences)
    extents = []
    for x in range(3):
        t, e = _chain_counts(spec, piece, x)
        for i, v in t.items():
            trips[i] = v
        extents.append(e)
    if piece.ragged:  # a ragged collapse share: keep its true size on its outermost member
        inner = 1.0
        for i in piece.ragged[1:]:
            inner *= trips[i]
        trips[piece.ragged[0]] = len(piece.points) / inner if inner else 0.0
    return trips, tuple(extents)


def _entries(m: _Model, trips: Sequence[float]) -> float:
    """Times a thread enters a parallel loop (one fork/join each)."""
    if m.spec.mode == "serial":
        return 0.0
    if m.spec.mode == "grid":
        return 1.0
    first = m.spec.parallel_groups()[0][0]
    out = 1.0
    for t in trips[:first]:
        out *= t
    return out


def _carriers(levels: Sequence[int], trips: Sequence[float],
              letters: Sequence[int]) -> dict[tuple[int, int, int], float]:
    """Count iterations of a box nest by the level carrying each tensor's reuse.

    The result maps ``(jA, jB, jC)`` to a number of iterations. ``j`` is the innermost level
    of ``levels`` that does not index the tensor and is past its first iteration, or -1 if
    there is none. The last access to the slice then lies one iteration of ``j`` back.
    """
    states: dict[tuple[int, int, int], float] = {(-1, -1, -1): 1.0}
    for lvl in reversed(levels):
        t, tensor = trips[lvl], _CARRIED_BY[letters[lvl]]
        nxt: dict[tuple[int, int, int], float] = {}
        for state, w in states.items():
            # One first iteration and t-1 later ones (a ragged share may average t < 1).
            nxt[state] = nxt.get(state, 0.0) + w * min(t, 1.0)
            if t > 1:
                moved = list(state)
                if moved[tensor] < 0:
                    moved[tensor] = lvl
                key = (moved[0], moved[1], moved[2])
                nxt[key] = nxt.get(key, 0.0) + w * (t - 1)
        states = nxt
    return states


def _mean_window(levels: Sequence[int], trips: Sequence[float], letters: Sequence[int],
                 carrier: int) -> list[float]:
    """Mean distinct slices of each tensor in a reuse window carried by a loop of ``carrier``.

    The window runs from a slice's previous access, one iteration of the carrying loop back,
    up to the current access. ``levels`` are the box levels inside the carrying loop. Let
    ``p`` be the position inside that box; levels of ``carrier`` sit at 0 there, the others
    are uniform.

    - The carried tensor is not indexed by ``carrier``. Its window holds every slice of one
      iteration of the box.
    - The other two tensors are indexed by ``carrier``, so both iterations contribute. The
      window holds the slices the old iteration touches after ``p``, plus those the new one
      touches up to ``p``.

    For a lexicographic box these two counts have closed forms: rank arithmetic up to the
    outermost level that does not index the tensor and still has iterations left (after
    ``p``), or has had some (before ``p``).
    """
    out = []
    for t in range(3):
        rel = [lvl for lvl in levels if letters[lvl] in _INDEXED[t]]
        if carrier not in _INDEXED[t]:
            n = 1.0
            for lvl in rel:
                n *= trips[lvl]
            out.append(n)
            continue
        place, w = {}, 1.0
        for lvl in reversed(rel):
            place[lvl] = w
            w *= trips[lvl]
        mean = {lvl: 0.0 if letters[lvl] == carrier else (trips[lvl] - 1) / 2 for lvl in rel}
        before = after = 0.0  # E[# slices up to p], E[# slices after p]
        reach = 1.0  # probability that every irrelevant level so far is pinned
        done_rel = 0.0  # partial rank sums over relevant levels outside the current one
        done_rev = 0.0
        for lvl in levels:
            if lvl in place:
                done_rel += mean[lvl] * place[lvl]
                done_rev += (trips[lvl] - 1 - mean[lvl]) * place[lvl]
                continue
            free = 1.0 - 1.0 / trips[lvl] if trips[lvl] > 1 else 0.0
            tail = 1.0
            for r in rel:
                if r > lvl:
                    tail *= trips[r]
            before += reach * free * (done_rel + tail)
            after += reach * free * (done_rev + tail)
            reach *= 1.0 - free
        before += reach * (done_rel + 1.0)
        after += reach * done_rev
        out.append(before + after)
    return out


def _share_classes(piece: Piece, letters: Sequence[int], per_slice: Sequence[float]
                   ) -> tuple[dict[tuple[float, float, float], float], list[int]]:
    """Reuse inside a ragged collapse share, which is run as a list of points.

    Returns two things. The first is ``{(dA, dB, dC): points}``, where ``d`` is the stack
    distance in bytes back to the previous point with the same slice of that tensor, or -1
    when the point is the first with that slice. The second is the number of distinct slices
    of each tensor over the whole share.
    """
    members = [letters[i] for i in piece.ragged]
    proj = [[k for k, x in enumerate(members) if x in _INDEXED[t]] for t in range(3)]
    keys = [[tuple(p[k] for k in proj[t]) for p in piece.points] for t in range(3)]
    last: list[dict[tuple[int, ...], int]] = [{}, {}, {}]
    classes: dict[tuple[float, float, float], float] = {}
    for r in range(len(piece.points)):
        dist = []
        for t in range(3):
            prev = last[t].get(keys[t][r])
            last[t][keys[t][r]] = r
            if prev is None:
                dist.append(-1.0)
            else:
                dist.append(sum(per_slice[u] * len(set(keys[u][prev + 1:r + 1]))
                                for u in range(3)))
        key = (dist[0], dist[1], dist[2])
        classes[key] = classes.get(key, 0.0) + 1.0
    return classes, [len(set(k)) for k in keys]


def _per_tensor(levels: Iterable[int], trips: Sequence[float],
                letters: Sequence[int]) -> list[float]:
    """Distinct slices of each tensor over a box of levels.

    Per tensor, this is the product of the trips of those levels whose letter indexes it.
    """
    out = [1.0, 1.0, 1.0]
    for lvl in levels:
        for t in range(3):
            if letters[lvl] in _INDEXED[t]:
                out[t] *= trips[lvl]
    return out


def _analytic_piece(m: _Model, piece: Piece) -> tuple[float, list[list[float]], float]:
    letters = [o.loop for o in m.spec.occurrences]
    depth = len(letters)
    trips, (nk, nm, nn) = _level_trips(m.spec, piece)
    sizes = m.sizes(nk, nm, nn)
    # A ragged collapse share splits the nest into three parts: box levels outside it, the
    # share's points, and box levels inside it. A box share is all "outside".
    g0, g1 = (piece.ragged[0], piece.ragged[-1] + 1) if piece.ragged else (depth, depth)
    inner = _per_tensor(range(g1, depth), trips, letters)
    per_slice = [s * n for s, n in zip(sizes, inner, strict=True)]
    if piece.ragged:
        classes, share = _share_classes(piece, letters, per_slice)
    else:
        classes, share = {(-1.0, -1.0, -1.0): 1.0}, [1, 1, 1]

    levels: dict[tuple[str, int], int] = {}

    def level(where: str, j: int) -> int:
        """Cache level serving a reuse carried by level j (memoized)."""
        if (where, j) not in levels:
            if where == "box" or not piece.ragged:
                counts = _mean_window(range(j + 1, depth), trips, letters, letters[j])
                window = sum(s * n for s, n in zip(sizes, counts, strict=True))
            else:  # outside a ragged share: one iteration, the whole share inside
                box = _per_tensor(range(j + 1, g0), trips, letters)
                window = sum(p * b * d for p, b, d in zip(per_slice, box, share, strict=True))
            levels[where, j] = m.level_of(window)
        return levels[where, j]

    cycles, calls = 0.0, 0.0
    traffic = [[0.0] * 4 for _ in _TENSORS]
    outer = _carriers(range(g0), trips, letters)
    inside = _carriers(range(g1, depth), trips, letters)
    for so, wo in outer.items():
        for sc, wc in classes.items():
            for si, wi in inside.items():
                where = tuple(
                    level("box", si[t]) if si[t] >= 0
                    else m.level_of(sc[t]) if sc[t] >= 0
                    else level("outer", so[t]) if so[t] >= 0
                    else 3
                    for t in range(3)
                )
                w = wo * wc * wi
                cycles += w * m.call_cycles(nk, nm, nn, where)
                calls += w
                for t, lv in enumerate(where):
                    traffic[t][lv] += w * sizes[t]
    cycles += m.fork_join * _entries(m, trips)
    return cycles, traffic, calls


def _analytic(m: _Model, pieces: Sequence[Piece]) -> tuple[float, list[list[float]], float]:
    cycles, calls = 0.0, 0.0
    traffic = [[0.0] * 4 for _ in _TENSORS]
    for piece in pieces:
        c, tr, n = _analytic_piece(m, piece)
        cycles += c
        calls += n
        for t in range(3):
            for lv in range(4):
                traffic[t][lv] += tr[t][lv]
    return cycles, traffic, calls


#: Replayed traces by what fixes them (nest structure, the thread's share, the machine):
#: loop orders that differ only in which loops are parallel often give a thread the same
#: share (always on one thread), and the replay is the model's costliest part.
_REPLAYS: dict[tuple, tuple[float, tuple[tuple[float, ...], ...], float]] = {}
_REPLAYS_MAX = 8192


def _trace(m: _Model, thread: int, threads: int,
           pieces: Sequence[Piece]) -> tuple[float, list[list[float]], float]:
    key = (tuple((o.loop, o.step, o.span) for o in m.spec.occurrences), tuple(pieces), m.gemm,
           m.steps, m.caps, m.bw, m.peak)
    replay = _REPLAYS.get(key)
    if replay is None:
        if len(_REPLAYS) >= _REPLAYS_MAX:
            _REPLAYS.clear()
        replay = _REPLAYS[key] = _replay(m, thread, threads)
    cycles, traffic, calls = replay
    for piece in pieces:
        cycles += m.fork_join * _entries(m, _level_trips(m.spec, piece)[0])
    return cycles, [list(row) for row in traffic], calls


def _replay(m: _Model, thread: int, threads: int
            ) -> tuple[float, tuple[tuple[float, ...], ...], float]:
    """Cycles, traffic and calls of one thread's exact trace through its LRU caches."""
    k_step, m_step, n_step = m.steps
    kbs, mbs, nbs = m.gemm.Kb, m.gemm.Mb, m.gemm.Nb
    lru = _Lru(m.caps)
    cycles, calls = 0.0, 0.0
    traffic = [[0.0] * 4 for _ in _TENSORS]
    # Calls differ only in clamped tails and residency: memoize their cost.
    memo: dict[tuple[int, int, int, int, int, int], float] = {}
    access = lru.access
    for ik, im, in_ in simulate(m.spec, threads=threads, thread=thread):
        nk, nm, nn = min(k_step, kbs - ik), min(m_step, mbs - im), min(n_step, nbs - in_)
        sa, sb, sc = m.sizes(nk, nm, nn)
        la = access((im * kbs + ik) * 3, sa)
        lb = access((in_ * kbs + ik) * 3 + 1, sb)
        lc = access((in_ * mbs + im) * 3 + 2, sc)
        key = (nk, nm, nn, la, lb, lc)
        cost = memo.get(key)
        if cost is None:
            cost = memo[key] = m.call_cycles(nk, nm, nn, (la, lb, lc))
        cycles += cost
        calls += 1
        traffic[0][la] += sa
        traffic[1][lb] += sb
        traffic[2][lc] += sc
    return cycles, tuple(map(tuple, traffic)), calls


def _signature(pieces: Sequence[Piece], spec: LoopSpec) -> tuple:
    """Shape of a thread's share: equal shapes are translates of each other and cost the same.

    A range's offset only matters when it reaches the end of an occurrence that clamps.
    """
    tails = []
    for o in spec.occurrences:
        extent = spec.loops[o.loop].extent  # type: ignore[index]
        tails.append((o.trips, extent % o.step != 0 or extent % o.span != 0))
    return tuple(
        (tuple((hi - lo, clamps and hi == n)
               for (lo, hi), (n, clamps) in zip(p.ranges, tails, strict=True)),
         p.ragged, p.points)
        for p in pieces
    )


def _as_spec(candidate: Candidate | LoopSpec | str, gemm: BlockedGemm) -> LoopSpec:
    if isinstance(candidate, Candidate):
        return candidate.parse(*gemm.trips)
    if isinstance(candidate, str):
        return parse(candidate, gemm_loops(*gemm.trips))
    if isinstance(candidate, LoopSpec):
        if candidate.loops is None or len(candidate.loops) != 3:
            raise ValueError("the cost model needs a spec parsed against the 3 GEMM loops")
        extents = tuple(d.extent for d in candidate.loops)
        if extents != gemm.trips:
            raise ValueError(f"spec declares block counts (Kb, Mb, Nb) = {extents} but the "
                             f"problem has {gemm.trips}")
        return candidate
    raise TypeError(f"expected a Candidate, LoopSpec or str, got {type(candidate).__name__}")


def analyze(
    candidate: Candidate | LoopSpec | str,
    gemm: BlockedGemm,
    caches: Caches = DEFAULT_CACHES,
    threads: int = 1,
    *,
    peak_flops_per_cycle: float = 32.0,
    bandwidths: Bandwidths = DEFAULT_BANDWIDTHS,
    capacity_factor: float = 0.75,
    fork_join_cycles: float = 2000.0,
    engine: str = "auto",
    trace_limit: int = 512,
    pack_a: int | None = None,
) -> Prediction:
    """Predict the cycles of one loop instantiation of ``gemm``, with the details.

    Parameters
    ----------
    candidate
        A :class:`~schedules.space.Candidate`, or a spec string (no blocking, unit steps), or
        a :class:`~schedules.loop_spec.LoopSpec` parsed against this problem's loops.
    gemm
        The blocked GEMM.
    caches
        Per-core L1d/L2 and the shared L3 (see :func:`microkernels.isa.caches`).
    threads
        Size of TVM's thread pool.
    peak_flops_per_cycle
        Per-core peak of the BRGEMM kernel. The default 32 is fp32 AVX2: 2 FMA ports × 8
        lanes × 2 flops; AVX-512 is 64 where the pipes are 512 bits wide and 32 on Zen 4
        (:func:`microkernels.peak.flops_per_cycle` tells which).
    bandwidths
        Bytes per cycle per core from L1, L2, L3 and memory.
    capacity_factor
        Fraction of each cache the operands may use.
    fork_join_cycles
        Cost of one entry into a TVM parallel loop. The default 2000 is roughly TVM's
        thread-pool launch plus join, about 1 µs.  Not charged when ``threads`` is 1.
    engine
        ``"auto"``, ``"trace"`` or ``"analytic"`` (see the module docstring).
    trace_limit
        Most calls (of the whole GEMM) for which ``"auto"`` replays the exact trace.
    pack_a
        None, or the loop depth under which A is packed (``GemmConfig.pack_a``): adds the
        copies' cycles (item 5 of the module docstring).
    """
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    if engine not in ("auto", "trace", "analytic"):
        raise ValueError(f"engine must be 'auto', 'trace' or 'analytic', got {engine!r}")
    if not peak_flops_per_cycle > 0 or not 0 < capacity_factor <= 1 or fork_join_cycles < 0:
        raise ValueError("need peak_flops_per_cycle > 0, 0 < capacity_factor <= 1 and "
                         "fork_join_cycles >= 0")
    spec = _as_spec(candidate, gemm)
    if pack_a is not None and not 0 <= pack_a <= len(spec.occurrences):
        raise ValueError(f"pack_a={pack_a} is not a loop depth of {spec.text!r}")
    steps = tuple(d.step for d in spec.loops)  # type: ignore[union-attr]
    caps = (caches.l1d * capacity_factor, caches.l2 * capacity_factor,
            caches.l3 / threads * capacity_factor)
    model = _Model(spec, gemm, steps, caps, bandwidths.as_tuple(),  # type: ignore[arg-type]
                   float(peak_flops_per_cycle), float(fork_join_cycles) if threads > 1 else 0.0)
    if engine == "auto":
        total = 1
        for d in spec.loops:  # type: ignore[union-attr]
            total *= d.trips
        engine = "trace" if total <= trace_limit else "analytic"

    packing = 0.0 if pack_a is None else model.pack_cycles(pack_a, threads)
    per_shape: dict[tuple, tuple[float, list[list[float]], float]] = {}
    thread_cycles, calls = [], 0.0
    traffic = [[0.0] * 4 for _ in _TENSORS]
    for t in range(threads):
        pieces = work_share(spec, t, threads)
        sig = _signature(pieces, spec)
        if sig not in per_shape:
            per_shape[sig] = (_trace(model, t, threads, pieces) if engine == "trace"
                              else _analytic(model, pieces))
        c, tr, n = per_shape[sig]
        thread_cycles.append(c + packing if n else c)
        calls += n
        for k in range(3):
            for lv in range(4):
                traffic[k][lv] += tr[k][lv]
    return Prediction(
        cycles=max(thread_cycles),
        thread_cycles=tuple(thread_cycles),
        calls=calls,
        traffic=MappingProxyType(
            {name: tuple(row) for name, row in zip(_TENSORS, traffic, strict=True)}),
        engine=engine,
        pack_cycles=packing,
    )


def predict(
    candidate: Candidate | LoopSpec | str,
    gemm: BlockedGemm,
    caches: Caches = DEFAULT_CACHES,
    threads: int = 1,
    **options: object,
) -> float:
    """Predicted cycles of one candidate: ``analyze(...).cycles`` (same options)."""
    return analyze(candidate, gemm, caches, threads, **options).cycles  # type: ignore[arg-type]


def rank(
    candidates: Iterable[Candidate],
    gemm: BlockedGemm,
    caches: Caches = DEFAULT_CACHES,
    threads: int = 1,
    **options: object,
) -> list[tuple[float, Candidate]]:
    """``(predicted cycles, candidate)`` pairs, best first (stable for ties).

    The options are those of :func:`analyze`.
    """
    scored = [(predict(c, gemm, caches, threads, **options), c) for c in candidates]
    return sorted(scored, key=lambda pair: pair[0])
