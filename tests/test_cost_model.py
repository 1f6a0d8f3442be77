"""schedules.cost_model: trace-driven LRU model of a BRGEMM nest, and its fast analytic twin."""

import numpy as np
import pytest

from microkernels.isa import DEFAULT_CACHES, Caches
from schedules.cost_model import Bandwidths, analyze, predict, rank
from schedules.loop_spec import parse, simulate
from schedules.space import BlockedGemm, Candidate, gemm_loops, generate, heuristic

ENGINES = ("trace", "analytic")


def reference_cycles(spec, gemm, caches, threads, peak, factor=0.75):
    """Brute-force replay: LRU stack distances recomputed from scratch for every access."""
    bw = Bandwidths()
    caps = (caches.l1d * factor, caches.l2 * factor, caches.l3 / threads * factor)
    bws = (bw.l1, bw.l2, bw.l3, bw.mem)
    k_step = spec.loops[0].step
    worst = 0.0
    for t in range(threads):
        stack, sizes, cycles = [], {}, 0.0
        for ik, im, in_ in simulate(spec, threads=threads, thread=t):
            nk = min(k_step, gemm.Kb - ik)
            acc = [(("A", im, ik), gemm.bm * gemm.bk * nk * gemm.dtype_bytes),
                   (("B", in_, ik), gemm.bn * gemm.bk * nk * gemm.dtype_bytes),
                   (("C", in_, im), gemm.bm * gemm.bn * gemm.out_bytes)]
            data = 0.0
            for key, size in acc:
                sizes[key] = size
                if key in stack:
                    pos = stack.index(key)
                    distance = sum(sizes[k] for k in stack[pos:])
                    stack.remove(key)
                else:
                    distance = float("inf")
                stack.append(key)
                level = next((i for i, c in enumerate(caps) if distance <= c), 3)
                data += size / bws[level]
            cycles += max(2.0 * gemm.bm * gemm.bn * gemm.bk * nk / peak, data)
        worst = max(worst, cycles)
    return worst


@pytest.mark.parametrize("text, blocks, threads", [
    ("bcaBCb", {"b": (4, 2), "c": (2,)}, 2),
    ("aCB", {}, 5),  # ragged collapse shares
    ("cbaBC", {"b": (4,), "c": (2,)}, 4),
    ("BCa", {}, 1),
])
def test_trace_engine_is_an_exact_lru_replay(text, blocks, threads):
    gemm = BlockedGemm(256, 192, 224, 32, 32, 32)  # Kb=7, Mb=8, Nb=6
    caches = Caches(8 * 1024, 64 * 1024, 512 * 1024)
    cand = Candidate(text, blocks, {"a": 2})
    spec = cand.parse(*gemm.trips)
    got = predict(cand, gemm, caches, threads, engine="trace", fork_join_cycles=0.0,
                  peak_flops_per_cycle=64.0)
    assert got == pytest.approx(reference_cycles(spec, gemm, caches, threads, 64.0))


def test_streaming_b_through_l3_per_m_block_is_slower_than_keeping_it_in_l2():
    # B is 1 MiB (> 0.75 MiB usable L2). "bca" re-reads all of B for each of the 4 M blocks;
    # "cba" keeps each 64 KiB B panel while it visits the M blocks.
    caches = Caches(32 * 1024, 1 << 20, 8 << 20)
    gemm = BlockedGemm(128, 512, 512, 32, 32, 32)
    for engine in ENGINES:
        stream = analyze("bca", gemm, caches, 1, engine=engine, peak_flops_per_cycle=256.0)
        keep = analyze("cba", gemm, caches, 1, engine=engine, peak_flops_per_cycle=256.0)
        b_bytes = 512 * 512 * 4
        assert stream.traffic["B"][2] == 3 * b_bytes  # three re-reads from L3
        assert keep.traffic["B"][2] == 0 and keep.traffic["B"][1] == 3 * b_bytes
        assert stream.traffic["B"][3] == keep.traffic["B"][3] == b_bytes  # cold misses
        assert stream.cycles > 1.2 * keep.cycles


def test_monotonic_in_problem_size():
    for spec in ("aBC", "BCa", "CBa"):
        cycles = [predict(spec, BlockedGemm(n, n, n, 32, 32, 32), DEFAULT_CACHES, 2)
                  for n in (128, 256, 512, 1024)]
        assert cycles == sorted(cycles) and len(set(cycles)) == 4
    per_k = [predict("BCa", BlockedGemm(512, 512, k, 32, 32, 32), DEFAULT_CACHES, 2)
             for k in (64, 128, 256)]
    assert per_k == sorted(per_k)


def test_deterministic_and_rank_sorted():
    gemm = BlockedGemm(512, 512, 512, 32, 32, 32)
    cands = generate(*gemm.trips, max_candidates=80)
    first = rank(cands, gemm, DEFAULT_CACHES, 2)
    assert first == rank(cands, gemm, DEFAULT_CACHES, 2)
    scores = [s for s, _ in first]
    assert scores == sorted(scores) and len(first) == len(cands)
    assert {c for _, c in first} == set(cands)
    assert first[0][0] == predict(first[0][1], gemm, DEFAULT_CACHES, 2)


@pytest.mark.parametrize("gemm, steps, caches, threads", [
    (BlockedGemm(256, 384, 320, 32, 32, 32), (2, 1, 1), DEFAULT_CACHES, 2),
    (BlockedGemm(384, 384, 384, 32, 32, 32), (1, 1, 1), Caches(32768, 131072, 1 << 20), 3),
    (BlockedGemm(512, 256, 384, 32, 32, 32), (2, 1, 1), Caches(32768, 262144, 2 << 20), 4),
])
def test_analytic_engine_agrees_with_trace_replay(gemm, steps, caches, threads):
    cands = generate(*gemm.trips, steps=steps, max_candidates=60, seed=3)
    trace = [analyze(c, gemm, caches, threads, engine="trace") for c in cands]
    fast = [analyze(c, gemm, caches, threads, engine="analytic") for c in cands]
    calls = (-(-gemm.Kb // steps[0])) * gemm.Mb * gemm.Nb
    assert all(t.calls == calls and f.calls == pytest.approx(calls)
               for t, f in zip(trace, fast, strict=True))
    errors = np.array([abs(t.cycles - f.cycles) / t.cycles
                       for t, f in zip(trace, fast, strict=True)])
    assert np.median(errors) < 0.01 and errors.max() < 0.25
    ranks = [np.argsort(np.argsort([p.cycles for p in ps])) for ps in (trace, fast)]
    assert np.corrcoef(*ranks)[0, 1] > 0.9
    # The analytic favourite is among the replay's best few.
    best = int(np.argmin([p.cycles for p in fast]))
    assert ranks[0][best] < 5


def test_auto_engine_depends_on_problem_not_candidate():
    small, big = BlockedGemm(128, 128, 128, 32, 32, 32), BlockedGemm(1024, 1024, 1024, 32, 32, 32)
    assert {analyze(s, small, DEFAULT_CACHES, 2).engine for s in ("aBC", "CBa")} == {"trace"}
    assert {analyze(s, big, DEFAULT_CACHES, 2).engine for s in ("aBC", "CBa")} == {"analytic"}


def test_threads_partition_work_and_idle_threads_show():
    gemm = BlockedGemm(512, 512, 512, 32, 32, 32)
    serial = analyze("abc", gemm, DEFAULT_CACHES, 2)
    parallel = analyze("aBC", gemm, DEFAULT_CACHES, 2)
    assert serial.thread_cycles[1] == 0.0 and parallel.cycles < 0.6 * serial.cycles
    # 16 M blocks over 32 threads: half the threads idle, no faster than 16 threads.
    wide = analyze("Bca", gemm, DEFAULT_CACHES, 32)
    assert sum(c == 0.0 for c in wide.thread_cycles) == 16
    assert wide.cycles == pytest.approx(analyze("Bca", gemm, DEFAULT_CACHES, 16).cycles,
                                        rel=0.05)


@pytest.mark.parametrize("engine", ENGINES)
def test_fork_join_is_charged_per_parallel_entry(engine):
    gemm = BlockedGemm(256, 256, 256, 32, 32, 32)  # Kb = 8
    base = analyze("aBC", gemm, DEFAULT_CACHES, 2, fork_join_cycles=0.0, engine=engine)
    more = analyze("aBC", gemm, DEFAULT_CACHES, 2, fork_join_cycles=1000.0, engine=engine)
    assert more.cycles - base.cycles == pytest.approx(8 * 1000.0)  # one fork per K step
    once = analyze("BCa", gemm, DEFAULT_CACHES, 2, fork_join_cycles=1000.0, engine=engine)
    assert once.cycles - analyze("BCa", gemm, DEFAULT_CACHES, 2, fork_join_cycles=0.0,
                                 engine=engine).cycles == pytest.approx(1000.0)


@pytest.mark.parametrize("engine", ENGINES)
def test_clamped_k_tail_and_grid_mode(engine):
    gemm = BlockedGemm(192, 160, 224, 32, 32, 32)  # Kb=7 with k_step=2: last call has 1 block
    cand = Candidate("bC{R:2}aB{C:2}c", {"b": (2,), "c": (2,)}, {"a": 2})
    p = analyze(cand, gemm, DEFAULT_CACHES, 4, engine=engine)
    assert p.calls == pytest.approx(4 * 6 * 5)
    total_a = sum(p.traffic["A"])
    assert total_a == pytest.approx(6 * 5 * 7 * 32 * 32 * 4)  # every A block read once per N block


def test_inputs():
    gemm = BlockedGemm(128, 128, 128, 32, 32, 32)
    spec = parse("aBC", gemm_loops(*gemm.trips))
    assert predict(spec, gemm) == predict("aBC", gemm) == predict(Candidate("aBC"), gemm)
    with pytest.raises(ValueError, match="block counts"):
        predict(parse("aBC", gemm_loops(4, 4, 8)), gemm)
    with pytest.raises(ValueError, match="3 GEMM loops"):
        predict(parse("aBC", 3), gemm)
    with pytest.raises(TypeError):
        predict(3, gemm)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="engine"):
        predict("aBC", gemm, engine="fast")
    with pytest.raises(ValueError, match="threads"):
        predict("aBC", gemm, DEFAULT_CACHES, 0)
    with pytest.raises(ValueError):
        Bandwidths(mem=0)
    with pytest.raises(ValueError):
        predict("aBC", gemm, capacity_factor=1.5)


def test_heuristic_is_competitive_with_the_modelled_best():
    gemm = BlockedGemm(1024, 1024, 1024, 32, 32, 32)
    cands = generate(*gemm.trips, max_candidates=200)
    best = rank(cands, gemm, DEFAULT_CACHES, 2)[0][0]
    h = heuristic(*gemm.trips, DEFAULT_CACHES, 2)
    assert predict(h, gemm, DEFAULT_CACHES, 2) < 1.1 * best


def test_packing_once_per_k_block_beats_repacking_under_an_n_loop():
    # 1024^3 in 256x64x512 blocks, one core: "acb" packs A's K block once (4 MiB copied in
    # all); "cacb" re-packs it for every pair of N blocks (32 MiB).  Measured 114 vs 85 GFLOPS.
    gemm = BlockedGemm(1024, 1024, 1024, 256, 64, 512)
    once = analyze(Candidate("acb"), gemm, DEFAULT_CACHES, 1, peak_flops_per_cycle=64, pack_a=1)
    again = analyze(Candidate("cacb", {"c": (2,)}), gemm, DEFAULT_CACHES, 1,
                    peak_flops_per_cycle=64, pack_a=2)
    plain = analyze(Candidate("acb"), gemm, DEFAULT_CACHES, 1, peak_flops_per_cycle=64)
    assert plain.pack_cycles == 0 and once.pack_cycles > 0
    assert again.pack_cycles == pytest.approx(8 * once.pack_cycles)
    assert once.cycles == pytest.approx(plain.cycles + once.pack_cycles)
    assert again.cycles > 1.15 * once.cycles


def test_packing_is_shared_by_the_threads():
    gemm = BlockedGemm(1024, 1024, 1024, 256, 64, 512)
    one, two = (analyze(Candidate("aCB"), gemm, DEFAULT_CACHES, t, pack_a=1).pack_cycles
                for t in (1, 2))
    assert two == pytest.approx(one / 2)


@pytest.mark.parametrize("depth", [-1, 4])
def test_pack_depth_beyond_the_nest_is_an_error(depth):
    gemm = BlockedGemm(1024, 1024, 1024, 256, 64, 512)
    with pytest.raises(ValueError, match="not a loop depth"):
        analyze(Candidate("acb"), gemm, DEFAULT_CACHES, 1, pack_a=depth)


def test_parallel_loops_cost_nothing_extra_on_one_thread():
    # TVM runs a parallel loop inline when its pool has one thread: "cBCa" is "cbca" there.
    gemm = BlockedGemm(512, 512, 512, 64, 64, 512)
    par, seq = Candidate("cBCa", {"c": (4,)}), Candidate("cbca", {"c": (4,)})
    assert predict(par, gemm, DEFAULT_CACHES, 1) == predict(seq, gemm, DEFAULT_CACHES, 1)
    forks = analyze(par, gemm, DEFAULT_CACHES, 2, fork_join_cycles=1e6).cycles
    assert forks - analyze(par, gemm, DEFAULT_CACHES, 2, fork_join_cycles=0).cycles >= 2e6


def test_replays_are_shared_by_nests_that_give_a_thread_the_same_share():
    """On one thread parallel letters change nothing but fork/join (not charged there), so
    ``aBC`` reuses the replay of ``abc``; a different order is replayed anew."""
    from schedules import cost_model

    gemm = BlockedGemm(256, 256, 256, 32, 32, 32)
    cost_model._REPLAYS.clear()
    serial = analyze("abc", gemm, threads=1, engine="trace")
    assert len(cost_model._REPLAYS) == 1
    parallel = analyze("aBC", gemm, threads=1, engine="trace")
    assert len(cost_model._REPLAYS) == 1 and parallel == serial
    analyze("acb", gemm, threads=1, engine="trace")
    assert len(cost_model._REPLAYS) == 2
    # Two threads split aBC's B loop: its own replay, charged its fork/join.
    two = analyze("aBC", gemm, threads=2, engine="trace")
    cost_model._REPLAYS.clear()
    assert analyze("aBC", gemm, threads=2, engine="trace") == two
