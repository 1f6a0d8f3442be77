"""schedules.loop_spec: PARLOOPER loop_spec grammar, nests, errors and exact coverage."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules.loop_spec import (
    LoopDecl,
    LoopSpecError,
    Piece,
    parse,
    simulate,
    work_share,
)


def gemm(kb=8, mb=16, nb=8, *, k_step=1, a=(), b=(), c=()):
    return [LoopDecl("K", kb, k_step, a, reduction=True), LoopDecl("M", mb, 1, b),
            LoopDecl("N", nb, 1, c)]


def space(loops):
    return sorted(itertools.product(*(range(0, d.extent, d.step) for d in loops)))


# ------------------------------------------------------------------------------------------
# The paper's examples


@pytest.mark.parametrize("text, loops", [
    ("aBC", gemm()),
    ("bcaBCb", gemm(b=(8, 2), c=(4,))),
    ("bcabcb", gemm(b=(8, 2), c=(4,))),
    ("bC{R:2}aB{C:1}cb", gemm(b=(8, 2), c=(4,))),
    ("bc|aBCb", gemm(b=(8, 2), c=(4,))),
    ("bcaBCb @ schedule(dynamic, 1)", gemm(b=(8, 2), c=(4,))),
    ("Abcdefg", [LoopDecl(n, e) for n, e in zip("NCKPQRS", (2, 3, 2, 4, 4, 3, 3), strict=True)]),
])
def test_paper_examples_parse_and_cover_the_space(text, loops):
    spec = parse(text, loops)
    assert sorted(simulate(spec)) == space(loops)
    assert sorted(simulate(spec, threads=3)) == space(loops)
    assert parse(str(spec), loops) == spec


def test_listing2_bcaBCb():
    spec = parse("bcaBCb", gemm(b=(8, 2), c=(4,)))
    occ = spec.occurrences
    assert [(o.var, o.step, o.span, o.parallel) for o in occ] == [
        ("b0", 8, 16, False), ("c0", 4, 8, False), ("a0", 1, 8, False),
        ("b1", 2, 8, True), ("c1", 1, 4, True), ("b2", 1, 2, False)]
    assert spec.mode == "collapse"
    assert spec.parallel_groups() == ((3, 4),)
    assert spec.body_indices() == (2, 5, 4)  # ind = {a0, b2, c1}
    assert [o.var for o in spec.occurrences_of("B")] == ["b0", "b1", "b2"]
    nest = spec.nest()
    assert [(n.var, n.start, n.stop, n.step) for n in nest] == [
        ("b0", "0", "16", "8"), ("c0", "0", "8", "4"), ("a0", "0", "8", "1"),
        ("b1", "b0", "b0 + 8", "2"), ("c1", "c0", "c0 + 4", "1"), ("b2", "b1", "b1 + 2", "1")]
    assert [n.pragma for n in nest] == [None, None, None, "omp for collapse(2) nowait", None, None]
    assert "body(a0, b2, c1)" in spec.pseudocode()
    # The serial part runs in Listing 2's order.
    assert simulate("bcabcb", gemm(b=(8, 2), c=(4,)))[:3] == [(0, 0, 0), (0, 1, 0), (0, 0, 1)]


def test_listing3_grid_teams_follow_parlooper_tid_decomposition():
    spec = parse("bC{R:16}aB{C:4}cb", gemm(mb=64, nb=64, b=(16, 4), c=(4,)))
    assert spec.mode == "grid"
    assert spec.grid_shape() == (1, 16, 4)
    assert spec.parallel_groups() == ((1, 3),)  # fused in L, R, C order
    assert str(spec) == "bC{R:16}aB{C:4}cb"
    # 64 threads, one cell each: tid 5 is row 1, col 1 (row = tid / cols, col = tid % cols).
    (piece,) = work_share(spec, 5, 64)
    assert piece.ranges[1] == (1, 2)  # c0 has 16 trips, one per row team
    assert piece.ranges[3] == (1, 2)  # b1 has 4 trips, one per column team
    # Each thread's bodies are its own; together they cover the space once.
    assert sorted(simulate(spec, threads=64)) == space(spec.loops)


def test_directive_and_barrier_are_recorded():
    spec = parse("bc | aBCb @ schedule(dynamic,1)", gemm(b=(8, 2), c=(4,)))
    assert spec.directive == "schedule(dynamic,1)"
    assert [o.barrier_after for o in spec.occurrences] == [False, True, False, False, False,
                                                            False]
    assert str(spec) == "bc|aBCb @ schedule(dynamic,1)"
    assert spec.nest()[3].pragma == "omp for collapse(2) schedule(dynamic,1) nowait"
    assert "barrier  # end of c0" in spec.pseudocode()


def test_single_parallel_loop_and_three_d_grid():
    loops = gemm(b=(8, 2), c=(4,))
    assert parse("aBc", loops).parallel_groups() == ((1,),)
    split_k = LoopDecl("K", 6, reduction=True, parallel_reduction="rfactor")
    grid = parse("bC{R:2}B{C:2}cbA{L:3}", [split_k, *loops[1:]])
    assert grid.grid_shape() == (3, 2, 2)
    assert grid.parallel_groups() == ((5, 1, 2),)
    assert sorted(simulate(grid, threads=5)) == space(grid.loops)


def test_syntax_only_parse_has_symbolic_nest():
    spec = parse("bcaBCb", 3)
    assert spec.loops is None and spec.occurrences[0].step is None
    assert [(n.start, n.stop, n.step) for n in spec.nest()][3] == (
        "b0", "b0 + b.block[0]", "b.block[1]")
    with pytest.raises(ValueError, match="declarations"):
        simulate(spec)
    with pytest.raises(ValueError, match="declarations"):
        _ = spec.occurrences[0].trips


def test_clamped_blocks_render_min_and_cover_once():
    loops = [LoopDecl("M", 10, 1, (4,)), LoopDecl("N", 7, 2)]
    spec = parse("abA", loops)
    assert spec.nest()[2].stop == "min(a0 + 4, 10)"
    assert sorted(simulate(spec, threads=3)) == space(loops)


def test_parallel_reduction_needs_a_strategy():
    with pytest.raises(LoopSpecError) as err:
        parse("bcA", gemm())
    assert err.value.position == 2
    loops = gemm()
    loops[0] = LoopDecl("K", 8, reduction=True, parallel_reduction="rfactor")
    assert parse("bcA", loops).occurrences[2].parallel


# ------------------------------------------------------------------------------------------
# Errors point at the offending character


@pytest.mark.parametrize("text, position, fragment", [
    ("", 0, "empty loop_spec"),
    ("   ", 0, "empty loop_spec"),
    ("abx", 2, "names loop 24"),
    ("ab#c", 2, "unexpected character '#'"),
    ("ab", 2, "never appears"),
    ("abc @", 4, "empty directive"),
    ("abcc", 3, "appears 2 times"),
    ("aBcB", 3, "must be consecutive"),
    ("Abc", 0, "reduction"),
    ("ab{R:2}c", 2, "sequential loop 'b'"),
    ("{R:2}abc", 0, "must directly follow"),
    ("aB{R:0}c", 5, "at least 1 team"),
    ("aB{Q:2}c", 3, "grid axis R, C or L"),
    ("aB{R2}c", 4, "expected ':'"),
    ("aB{R:}c", 5, "number of teams"),
    ("aB{R:2c", 6, "expected '}'"),
    ("aB{R:2}{C:2}c", 7, "must directly follow"),
    ("aB{R:2}C{R:4}", 9, "already used"),
    ("aB{R:2}bC", 8, "has no grid size"),
    ("|abc", 0, "must follow a loop letter"),
    ("a||bc", 2, "duplicate barrier"),
    ("aBC|", 3, "inside a parallel loop"),
    ("aB{R:2}c|", 8, "grid mode"),
    ("abc @ schedule(static)", 4, "needs a parallel"),
    ("aB{R:2}c @ schedule(static)", 9, "collapse-mode"),
    ("a[0,8,1,(4)]bc", 1, "JIT bounds"),
])
def test_errors_have_position_and_caret(text, position, fragment):
    with pytest.raises(LoopSpecError) as err:
        parse(text, gemm(b=(4,)))
    e = err.value
    assert fragment in e.message
    assert e.position == position
    assert e.text == text
    caret = str(e).splitlines()[-1]
    assert caret.index("^") - 2 == position  # two-space indent, as in the text line


def test_too_many_occurrences_points_at_the_extra_one():
    with pytest.raises(LoopSpecError) as err:
        parse("bcabcbb", gemm(b=(8, 2), c=(4,)))
    assert err.value.position == 6


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(name="M", extent=0), "extent"),
    (dict(name="M", extent=8, step=0), "step"),
    (dict(name="M", extent=8, block_steps=(4, 3)), "does not divide"),
    (dict(name="M", extent=8, step=2, block_steps=(3,)), "not a multiple of the step"),
    (dict(name="M", extent=8, parallel_reduction="rfactor"), "reduction loop"),
    (dict(name="", extent=8), "name"),
    (dict(name="M", extent=True), "extent"),
])
def test_loop_decl_validation(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        LoopDecl(**kwargs)


def test_bad_argument_types():
    with pytest.raises(TypeError):
        parse(b"abc", 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        parse("abc", ["x"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="26"):
        parse("a", 27)
    with pytest.raises(ValueError, match="thread"):
        work_share(parse("aBc", gemm()), 2, 2)


# ------------------------------------------------------------------------------------------
# Work partition


def test_collapse_share_is_contiguous_static_chunk():
    spec = parse("aBC", gemm(kb=2, mb=3, nb=4))
    shares = [simulate(spec, threads=5, thread=t) for t in range(5)]
    # 12 fused (b, c) iterations, ceil(12/5) = 3 per thread, the last thread idles.
    assert [len(s) for s in shares] == [6, 6, 6, 6, 0]
    assert shares[1][:3] == [(0, 0, 3), (0, 1, 0), (0, 1, 1)]
    ragged = work_share(spec, 1, 5)
    assert ragged[0].ragged == (1, 2) and len(ragged[0].points) == 3
    assert work_share(spec, 4, 5) == ()


def test_serial_spec_runs_on_thread_zero():
    spec = parse("abc", gemm(kb=2, mb=2, nb=2))
    assert work_share(spec, 1, 2) == ()
    assert work_share(spec, 0, 2) == (Piece(((0, 2), (0, 2), (0, 2))),)


# ------------------------------------------------------------------------------------------
# Property: every valid spec covers the iteration space exactly once


@st.composite
def random_specs(draw):
    n = draw(st.integers(1, 3))
    loops, letters = [], []
    for x in range(n):
        step = draw(st.sampled_from([1, 1, 2, 3]))
        depth = draw(st.integers(0, 2))
        blocks, b = [], step
        for _ in range(depth):
            b *= draw(st.sampled_from([2, 3]))
            blocks.append(b)
        extent = draw(st.integers(1, 13))
        loops.append(LoopDecl(f"L{x}", extent, step, tuple(reversed(blocks))))
        letters += [chr(97 + x)] * draw(st.integers(1, depth + 1))
    order = draw(st.permutations(letters))
    mode = draw(st.sampled_from(["serial", "collapse", "grid"]))
    items = list(order)
    if mode == "collapse":
        start = draw(st.integers(0, len(items) - 1))
        length = draw(st.integers(1, len(items) - start))
        for k in range(start, start + length):
            items[k] = items[k].upper()
    elif mode == "grid":
        chosen = draw(st.lists(st.integers(0, len(items) - 1), min_size=1, max_size=3,
                               unique=True))
        axes = draw(st.permutations("RCL"))
        for k, axis in zip(chosen, axes, strict=False):
            items[k] = f"{items[k].upper()}{{{axis}:{draw(st.integers(1, 4))}}}"
    return "".join(items), loops


@settings(max_examples=150, deadline=None)
@given(random_specs(), st.integers(1, 6))
def test_random_specs_cover_space_exactly_once(spec_loops, threads):
    text, loops = spec_loops
    spec = parse(text, loops)
    bodies = simulate(spec, threads=threads)
    assert sorted(bodies) == space(loops)
    assert parse(str(spec), loops) == spec
