"""Schedules for what TVM lowers itself: parallel/vectorized loops, and failing rules skipped."""

import numpy as np
import pytest
import tvm
from tvm import s_tir, te
from tvm.tirx import ForKind

from schedules.fallback import (
    ChannelsLastReduction,
    Guarded,
    ParallelLoops,
    RowReduction,
    fallback_schedules,
    inline_elementwise,
)

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})


def _elementwise():
    x = te.placeholder((6, 40), "float32", name="x")
    y = te.compute((6, 40), lambda i, j: x[i, j] * 2.0 + 1.0, name="y")
    return te.create_prim_func([x, y])


def _loops(func: tvm.tirx.PrimFunc) -> list[tuple[ForKind, int]]:
    """(kind, extent) of the loops around block ``y``, outermost first."""
    sch = s_tir.Schedule(func)
    return [(sch.get(loop).kind, int(sch.get(loop).extent))
            for loop in sch.get_loops(sch.get_sblock("y"))]


def test_parallel_loops_schedule_is_parallel_vectorized_and_correct():
    sch = ParallelLoops().apply(_elementwise(), TARGET, False)
    # Rows in parallel; each row's 40 columns as 5 serial steps of an 8-lane (AVX2) vector.
    assert _loops(sch.mod["main"]) == [
        (ForKind.PARALLEL, 6), (ForKind.SERIAL, 5), (ForKind.VECTORIZED, 8)]
    f = tvm.compile(sch.mod, target=TARGET)
    a = np.random.default_rng(0).standard_normal((6, 40)).astype("float32")
    out = tvm.runtime.empty((6, 40), "float32")
    f(tvm.runtime.tensor(a), out)
    np.testing.assert_allclose(out.numpy(), a * 2 + 1, rtol=1e-6)


def test_failing_rule_leaves_the_function_to_the_next_rule():
    class Broken(s_tir.dlight.ScheduleRule if hasattr(s_tir, "dlight") else object):
        def apply(self, func, target, tunable):
            raise s_tir.ScheduleError("rule does not fit this function")

    assert Guarded(Broken()).apply(_elementwise(), TARGET, False) is None


def test_fallback_pass_schedules_parallel_vectorized_loops():
    mod = tvm.IRModule({"main": _elementwise()})
    with TARGET:
        out = fallback_schedules()(mod)
    kinds = [kind for kind, _ in _loops(out["main"])]
    assert kinds[0] == ForKind.PARALLEL and kinds[-1] == ForKind.VECTORIZED, kinds
    assert out["main"].attrs["tirx.is_scheduled"]


def test_fallback_pass_leaves_scheduled_kernels_alone():
    kernel = _elementwise().with_attr("tirx.is_scheduled", True)
    with TARGET:
        out = fallback_schedules()(tvm.IRModule({"main": kernel}))
    assert all(kind == ForKind.SERIAL for kind, _ in _loops(out["main"]))


def _kinds(func: tvm.tirx.PrimFunc, block: str) -> list[ForKind]:
    sch = s_tir.Schedule(func)
    return [sch.get(loop).kind for loop in sch.get_loops(sch.get_sblock(block))]


def _blocks(func: tvm.tirx.PrimFunc) -> list[str]:
    sch = s_tir.Schedule(func)
    return [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]


def test_elementwise_chain_becomes_one_vectorized_block():
    # dequantize -> erf -> quantize style chain: one pass, no intermediate tensors.
    x = te.placeholder((4, 64), "uint8", name="x")
    a = te.compute((4, 64), lambda i, j: (x[i, j].astype("int32") - 3).astype("float32")
                   * 0.5, name="a")
    b = te.compute((4, 64), lambda i, j: tvm.tirx.erf(a[i, j]), name="b")
    y = te.compute((4, 64), lambda i, j: b[i, j] * a[i, j], name="y")
    func = ParallelLoops().apply(te.create_prim_func([x, y]), TARGET, False).mod["main"]
    assert _blocks(func) == ["y"]
    assert _kinds(func, "y") == [ForKind.PARALLEL, ForKind.SERIAL, ForKind.VECTORIZED]


def test_costly_block_with_two_consumers_is_not_recomputed():
    x = te.placeholder((4, 64), "float32", name="x")
    e = te.compute((4, 64), lambda i, j: tvm.tirx.exp(x[i, j]), name="e")
    c = te.compute((4, 64), lambda i, j: x[i, j] + 1.0, name="c")
    y = te.compute((4, 64), lambda i, j: e[i, j] * c[i, j] + e[i, j], name="y")
    sch = s_tir.Schedule(te.create_prim_func([x, y]))
    assert inline_elementwise(sch)
    assert _blocks(sch.mod["main"]) == ["e", "y"]


def test_one_dimensional_injective_loop_is_vectorized():
    x = te.placeholder((96,), "float32", name="x")
    func = te.create_prim_func([x, te.compute((96,), lambda i: x[i] * 2.0, name="y")])
    out = ParallelLoops().apply(func, TARGET, False).mod["main"]
    assert _kinds(out, "y") == [ForKind.PARALLEL, ForKind.VECTORIZED]


def _softmax_then_scale():
    from tvm import topi

    x = te.placeholder((3, 5, 64), "float32", name="x")
    y = topi.nn.softmax(x, axis=-1)
    z = te.compute(y.shape, lambda *i: y(*i) * 2.0, name="z")
    return te.create_prim_func([x, z])


def test_row_reduction_vectorizes_the_reductions_and_is_correct():
    sch = RowReduction().apply(_softmax_then_scale(), TARGET, False)
    func = sch.mod["main"]
    rf = [name for name in _blocks(func) if name.endswith("_rf")]
    # max and sum each become vector-wide partial reductions ...
    assert len(rf) == 2, _blocks(func)
    for name in rf:
        kinds = _kinds(func, name)
        assert kinds[0] == ForKind.PARALLEL and kinds[-1] == ForKind.VECTORIZED, (name, kinds)
    # ... and the normalize + scale chain is one block.
    assert "T_softmax_norm" not in _blocks(func)
    f = tvm.compile(tvm.IRModule({"main": func}), target=TARGET)
    a = np.random.default_rng(0).standard_normal((3, 5, 64)).astype("float32") * 10
    out = tvm.runtime.empty((3, 5, 64), "float32")
    f(tvm.runtime.tensor(a), out)
    e = np.exp(a - a.max(-1, keepdims=True))
    np.testing.assert_allclose(out.numpy(), 2 * e / e.sum(-1, keepdims=True), rtol=1e-5,
                               atol=1e-7)


def test_row_reduction_leaves_reductions_no_vector_divides():
    from tvm import topi

    x = te.placeholder((3, 30), "float32", name="x")
    func = te.create_prim_func([x, topi.nn.softmax(x, axis=-1)])
    assert RowReduction().apply(func, TARGET, False) is None
    with TARGET:  # DLight's Reduction takes it
        out = fallback_schedules()(tvm.IRModule({"main": func}))
    assert out["main"].attrs["tirx.is_scheduled"]


def _nhwc_pool(dtype: str, kind: str):
    from tvm import topi

    x = te.placeholder((2, 9, 11, 32), dtype, name="x")
    y = topi.nn.pool2d(x, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), kind, layout="NHWC")
    return te.create_prim_func([x, y]), y.shape


def _numpy_pool(a: np.ndarray, kind: str) -> np.ndarray:
    pad = -np.inf if kind == "max" else 0.0
    padded = np.pad(a.astype(np.float64), ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=pad)
    taps = np.stack([padded[:, i:i + 9:2, j:j + 11:2] for i in range(3) for j in range(3)])
    return taps.max(0) if kind == "max" else taps.sum(0) / 9  # count_include_pad


@pytest.mark.parametrize("dtype, kind", [("uint8", "max"), ("float32", "max"),
                                         ("float32", "avg")])
def test_channels_last_pooling_reduces_whole_vectors(dtype, kind):
    func, shape = _nhwc_pool(dtype, kind)
    sch = ChannelsLastReduction().apply(func, TARGET, False)
    assert sch is not None
    out_func = sch.mod["main"]
    update = "pool_max_update" if kind == "max" else "pool_sum_update"
    loops = [sch.get(loop) for loop in sch.get_loops(sch.get_sblock(update))]
    # Pixels (and channel vectors) in parallel, the 3x3 taps, then one AVX2 vector of
    # channels (8 floats, or all 32 bytes).
    assert loops[0].kind == ForKind.PARALLEL and loops[-1].kind == ForKind.VECTORIZED
    assert [int(loop.extent) for loop in loops[1:]] == [3, 3, 8 if dtype == "float32" else 32]
    if kind == "avg":  # the division on each finished vector, in the same parallel loop
        divide = [sch.get(loop) for loop in sch.get_loops(sch.get_sblock("pool_avg"))]
        assert [(loop.kind, int(loop.extent)) for loop in divide] == [
            (ForKind.PARALLEL, int(loops[0].extent)), (ForKind.VECTORIZED, 8)]
    f = tvm.compile(tvm.IRModule({"main": out_func}), target=TARGET)
    rng = np.random.default_rng(0)
    a = (rng.integers(0, 256, (2, 9, 11, 32)) if dtype == "uint8"
         else rng.standard_normal((2, 9, 11, 32))).astype(dtype)
    out = tvm.runtime.empty(tuple(int(d) for d in shape), dtype)
    f(tvm.runtime.tensor(a), out)
    np.testing.assert_allclose(out.numpy(), _numpy_pool(a, kind).astype(dtype), rtol=1e-6,
                               atol=1e-6)


def _spatial_mean(n: int, c: int):
    """An SE block's squeeze as Relax legalizes it: the mean over H and W of an NHWC
    tensor, kept as ``[N, 1, 1, C]``, then cast to bf16 (a sum, a division and a cast, which
    :func:`inline_elementwise` makes one block after the sum)."""
    from tvm import topi

    x = te.placeholder((n, 7, 5, c), "float32", name="x")
    total = topi.sum(x, axis=(1, 2), keepdims=True)
    y = topi.cast(topi.divide(total, tvm.tirx.const(35.0, "float32")), "bfloat16")
    return te.create_prim_func([x, y])


@pytest.mark.parametrize("n", [1, 2])
def test_channels_last_mean_reduces_whole_vectors_at_any_batch(n):
    """At batch 1 the N loop is a unit loop normalize_prim_func drops: the channel vectors
    alone run in parallel (not DLight's Reduction, a scalar sum per channel)."""
    func = _spatial_mean(n, 40)
    sch = ChannelsLastReduction().apply(func, TARGET, False)
    assert sch is not None
    [update] = [b for b in sch.get_child_blocks(sch.get_sblock("root"))
                if sch.get(b).name_hint.endswith("_update")]
    loops = [sch.get(loop) for loop in sch.get_loops(update)]
    # (Images and) channel vectors in parallel, the 7x5 pixels, one AVX2 vector of channels.
    assert loops[0].kind == ForKind.PARALLEL and int(loops[0].extent) == n * 40 // 8
    assert [(loop.kind, int(loop.extent)) for loop in loops[1:]] == [
        (ForKind.SERIAL, 7), (ForKind.SERIAL, 5), (ForKind.VECTORIZED, 8)]
    with TARGET:
        scheduled = fallback_schedules()(tvm.IRModule({"main": func}))
    f = tvm.compile(scheduled, target=TARGET)
    a = np.random.default_rng(2).standard_normal((n, 7, 5, 40)).astype("float32")
    out = tvm.runtime.empty((n, 1, 1, 40), "bfloat16")
    f(tvm.runtime.tensor(a), out)
    expected = a.astype(np.float64).mean(axis=(1, 2), keepdims=True)
    np.testing.assert_allclose(out.numpy().astype("float32"), expected, rtol=1e-2, atol=1e-3)


def _channel_shuffle_pad(groups: int, per_group: int, dtype: str):
    """ShuffleNet's channel shuffle of an NHWC tensor (viewed ``[pixels, C]``) and the pad of
    the depthwise conv after it, as TVM fuses them: ``c % G * C/G + c // G`` per channel."""
    n, h, w, c = 2, 5, 3, groups * per_group
    x = te.placeholder((n * h * w, c), dtype, name="x")
    y = te.compute((n, h + 2, w + 2, c), lambda b, i, j, k: tvm.tirx.if_then_else(
        tvm.tirx.all(i >= 1, i <= h, j >= 1, j <= w),
        x[(b * h + i - 1) * w + j - 1, k % groups * per_group + k // groups],
        tvm.tirx.const(0, dtype)), name="y")
    return te.create_prim_func([x, y]), (n, h, w, c)


@pytest.mark.parametrize("groups, per_group, dtype", [(4, 17, "float32"), (3, 7, "uint8"),
                                                      (2, 24, "float32")])
def test_channel_shuffle_unrolls_its_groups(groups, per_group, dtype):
    func, (n, h, w, c) = _channel_shuffle_pad(groups, per_group, dtype)
    sch = ParallelLoops().apply(func, TARGET, False)
    # Pixels in parallel, then C/G steps, each copying one channel of every group (unrolled,
    # for LLVM to vectorize the steps into loads and shuffles), not vectors of gathers.
    assert _loops(sch.mod["main"]) == [(ForKind.PARALLEL, n * (h + 2) * (w + 2)),
                                       (ForKind.SERIAL, per_group), (ForKind.UNROLLED, groups)]
    f = tvm.compile(sch.mod, target=TARGET)
    a = np.random.default_rng(1).integers(0, 100, (n * h * w, c)).astype(dtype)
    out = tvm.runtime.empty((n, h + 2, w + 2, c), dtype)
    f(tvm.runtime.tensor(a), out)
    shuffled = a.reshape(n, h, w, groups, per_group).transpose(0, 1, 2, 4, 3).reshape(n, h, w, c)
    np.testing.assert_array_equal(out.numpy(), np.pad(shuffled, ((0, 0), (1, 1), (1, 1), (0, 0))))


def test_channels_last_reduction_leaves_channels_first_pooling():
    from tvm import topi

    x = te.placeholder((2, 32, 9, 11), "float32", name="x")
    y = topi.nn.pool2d(x, (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), "max", layout="NCHW")
    assert ChannelsLastReduction().apply(te.create_prim_func([x, y]), TARGET, False) is None
