"""Schedules for what TVM lowers itself: parallel/vectorized loops, and failing rules skipped."""

import numpy as np
import tvm
from tvm import s_tir, te
from tvm.tirx import ForKind

from schedules.fallback import Guarded, ParallelLoops, fallback_schedules

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
