"""schedules.space: PARLOOPER's GEMM candidate rules, sampling, heuristic."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from microkernels.isa import DEFAULT_CACHES, Caches
from schedules.loop_spec import simulate
from schedules.space import (
    BlockedGemm,
    Candidate,
    block_factors,
    gemm_loops,
    generate,
    heuristic,
    space_size,
)


def check_rules(cand: Candidate, trips, steps=(1, 1, 1), max_collapse=2):
    """Assert one candidate obeys [PL] §II-D's generation rules."""
    spec = cand.spec
    assert re.fullmatch(r"[abcBC]+", spec), spec
    lower = spec.lower()
    counts = {x: lower.count(x) for x in "abc"}
    assert 1 <= counts["a"] <= 2 and 1 <= counts["b"] <= 3 and 1 <= counts["c"] <= 3
    assert all(x != y for x, y in zip(lower, lower[1:], strict=False)), "adjacent duplicates"
    caps = [k for k, ch in enumerate(spec) if ch.isupper()]
    assert caps == list(range(caps[0], caps[0] + len(caps))) and len(caps) <= max_collapse
    for k, x in enumerate("abc"):
        blocks = cand.block_steps.get(x, ())
        assert len(blocks) == counts[x] - 1
        allowed = block_factors(-(-trips[k] // steps[k]), steps[k])
        assert set(blocks) <= set(allowed)
        chain = (*blocks, steps[k])
        assert all(o % i == 0 and o > i for o, i in zip(chain, chain[1:], strict=False))
    cand.parse(*trips)  # accepted by the parser


def test_block_factors_are_prefix_products_times_step():
    assert block_factors(32) == (2, 4, 8, 16)
    assert block_factors(24, step=2) == (4, 8, 16)
    assert block_factors(12) == (2, 4)
    assert block_factors(7) == () and block_factors(1) == ()
    with pytest.raises(ValueError):
        block_factors(0)


@pytest.mark.parametrize("trips, steps", [((4, 8, 6), (1, 1, 1)), ((8, 4, 4), (2, 1, 1)),
                                          ((6, 9, 8), (3, 1, 1))])
def test_full_space_obeys_rules_and_is_distinct(trips, steps):
    cands = generate(*trips, steps=steps, max_candidates=None)
    assert len(cands) == space_size(*trips, steps=steps)
    assert len(set(cands)) == len(cands)
    for c in cands:
        check_rules(c, trips, steps)
        assert c.step("a") == steps[0]


def test_space_contains_the_papers_strings():
    cands = generate(8, 8, 8, max_candidates=None)
    specs = {c.spec for c in cands}
    # Strings PARLOOPER's scripts use for GEMM (libxsmm/parlooper samples/gemm).
    assert {"aBC", "aCB", "BCa", "bcaBCb", "bcabCb", "aBCb", "aBCbcbc"} <= specs
    assert "abcb" not in specs  # serial strings need require_parallel=False
    assert Candidate("bcaBCb", {"b": (4, 2), "c": (4,)}) in cands
    assert not any(c.spec.count("A") for c in cands)


def test_sampling_is_deterministic_stratified_and_capped():
    a = generate(32, 32, 32)
    assert len(a) == 1000 == len(set(a))
    assert a == generate(32, 32, 32)
    assert a != generate(32, 32, 32, seed=1)
    # The small strata are kept whole: all 16 one-occurrence strings are present.
    simple = {c.spec for c in a if len(c.spec) == 3}
    assert len(simple) == 16 and {"aBC", "BCa", "CBa"} <= simple
    for c in a[::37]:
        check_rules(c, (32, 32, 32))
    assert space_size(32, 32, 32) > 100_000


def test_options():
    serial = generate(4, 4, 4, require_parallel=False, max_candidates=None)
    assert "abc" in {c.spec for c in serial}
    wide = generate(4, 4, 4, max_collapse=3, max_candidates=None)
    assert any(sum(ch.isupper() for ch in c.spec) == 3 for c in wide)
    flat = generate(16, 16, 16, max_occurrences=(1, 1, 1), max_candidates=None)
    assert all(len(c.spec) == 3 for c in flat) and len(flat) == 16
    with pytest.raises(ValueError):
        generate(0, 4, 4)
    with pytest.raises(ValueError):
        generate(4, 4, 4, steps=(1, 1))
    with pytest.raises(ValueError):
        generate(4, 4, 4, max_candidates=0)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(1, 9), st.sampled_from([1, 2, 3]),
       st.integers(1, 5), st.data())
def test_generated_candidates_cover_space_exactly_once(kb, mb, nb, k_step, threads, data):
    cands = generate(kb, mb, nb, steps=(k_step, 1, 1), max_candidates=40, seed=kb)
    cand = data.draw(st.sampled_from(cands))
    check_rules(cand, (kb, mb, nb), (k_step, 1, 1))
    spec = cand.parse(kb, mb, nb)
    expect = sorted((k, m, n) for k in range(0, kb, k_step) for m in range(mb) for n in range(nb))
    assert sorted(simulate(spec, threads=threads)) == expect


def test_candidate_value_semantics():
    c = Candidate("bcaBCb", {"c": [4], "b": (8, 2)})
    assert c == Candidate("bcaBCb", {"b": (8, 2), "c": (4,)})
    assert hash(c) == hash(Candidate("bcaBCb", {"b": (8, 2), "c": (4,)}))
    assert c.block_steps["c"] == (4,) and c.step("a") == 1
    assert repr(c) == "Candidate('bcaBCb', {'b': (8, 2), 'c': (4,)})"
    with pytest.raises(TypeError):
        c.block_steps["a"] = (2,)  # type: ignore[index]
    with pytest.raises(ValueError, match="a/b/c"):
        Candidate("abc", {"d": (2,)})
    with pytest.raises(ValueError):
        Candidate("abc", steps={"a": 0})
    loops = Candidate("aBC", steps={"a": 4}).loops(8, 2, 2)
    assert loops == gemm_loops(8, 2, 2, steps=(4, 1, 1))
    assert loops[0].reduction and not loops[1].reduction


def test_blocked_gemm():
    g = BlockedGemm(100, 64, 48, 32, 32, 16, dtype_bytes=2)
    assert (g.Mb, g.Nb, g.Kb) == (4, 2, 3) and g.trips == (3, 4, 2)
    with pytest.raises(ValueError):
        BlockedGemm(0, 1, 1, 1, 1, 1)


def test_heuristic():
    small = heuristic(8, 8, 4, DEFAULT_CACHES, 2)
    assert small == Candidate("BCa")  # everything fits: collapse M (larger) outer, K innermost
    assert heuristic(8, 4, 8, DEFAULT_CACHES, 2) == Candidate("CBa")
    # All of B (32 panels of 128 KiB) overflows half of a 1 MiB L2: block N by 4 panels.
    big = heuristic(32, 32, 32, DEFAULT_CACHES, 2)
    assert big == Candidate("cBCa", {"c": (4,)})
    check_rules(big, (32, 32, 32))
    # Too small an L2 for even one panel: no blocking.
    assert heuristic(32, 32, 32, Caches(32768, 65536, 1 << 20), 2) == Candidate("BCa")
    # 2048^3 in 64x64x512 blocks, the whole K per call: one B panel is half of L2, so the
    # loop over B's panels goes outside (rule 4) and each panel is read once.
    assert heuristic(4, 32, 32, DEFAULT_CACHES, 1, bm=64, bn=64, bk=512, k_step=4) == \
        Candidate("CBa", {}, {"a": 4})
    assert heuristic(2, 32, 32, DEFAULT_CACHES, 1, bm=64, bn=64, bk=512, k_step=2) == \
        Candidate("cBCa", {"c": (2,)}, {"a": 2})  # 1024 x 64 panels: blocks of two fit
    # BERT's 128 x 3072 x 768 (two row blocks, 48 column blocks, A 384 KiB, B 9 MiB) on a
    # 512 KiB L2 and an 8 MiB L3: B would come from memory once per row block, not swapped
    # (rule 5).
    # Nor ever when the inner loop walks row blocks of A (rule 6: only B's panels are kept
    # resident): however many row blocks per thread, and GPT-2's 1024 x 3072 x 768 in
    # 64 x 16 blocks (each row block 192 KiB, under half of L2: rule 4 used to swap it).
    bert_ffn = dict(bm=64, bn=64, bk=384, k_step=2)
    big_l3 = Caches(32 << 10, 512 << 10, 32 << 20)
    assert heuristic(2, 2, 48, big_l3, 2, **bert_ffn) == Candidate("CBa", {}, {"a": 2})
    assert heuristic(2, 4, 48, big_l3, 2, **bert_ffn) == Candidate("CBa", {}, {"a": 2})
    assert heuristic(2, 4, 48, big_l3, 4, **bert_ffn) == Candidate("CBa", {}, {"a": 2})
    assert heuristic(2, 16, 192, big_l3, 2, bm=64, bn=16, bk=384, k_step=2) == \
        Candidate("CBa", {}, {"a": 2})
    # The same blocks the other way round (B's panels inner) still swap (rule 4).
    assert heuristic(2, 192, 16, big_l3, 2, bm=16, bn=64, bk=384, k_step=2) == \
        Candidate("CBa", {}, {"a": 2})
    assert heuristic(2, 2, 48, Caches(32 << 10, 512 << 10, 8 << 20), 2, **bert_ffn) == \
        Candidate("CBa", {}, {"a": 2})
    assert heuristic(32, 32, 32, DEFAULT_CACHES, 2, k_step=4).step("a") == 4
    with pytest.raises(ValueError):
        heuristic(32, 32, 32, DEFAULT_CACHES, 0)
