"""Schedules for what TVM lowers itself: parallel/vectorized loops, and failing rules skipped."""

import numpy as np
import tvm
from tvm import s_tir, te

from schedules.fallback import Guarded, ParallelLoops, fallback_schedules

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})


def _elementwise():
    x = te.placeholder((6, 40), "float32", name="x")
    y = te.compute((6, 40), lambda i, j: x[i, j] * 2.0 + 1.0, name="y")
    return te.create_prim_func([x, y])


def test_parallel_loops_schedule_is_parallel_vectorized_and_correct():
    sch = ParallelLoops().apply(_elementwise(), TARGET, False)
    text = sch.mod.script()
    assert "T.parallel" in text and "T.vectorized" in text
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


def test_fallback_pass_marks_functions_scheduled():
    mod = tvm.IRModule({"main": _elementwise()})
    with TARGET:
        out = fallback_schedules()(mod)
    assert out["main"].attrs["tirx.is_scheduled"]
