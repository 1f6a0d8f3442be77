"""The shared harness (tvm_tpp.bench): protocol, timer and sampling policy, MetaSchedule
database reuse, the tuner's explanation.  Fake clocks and stand-in builds: nothing is timed."""

import io
import json
import math
import sys
import types

import numpy as np
import pytest

from tvm_tpp.bench import impls, metaschedule, protocol, timing
from tvm_tpp.bench.protocol import Job
from tvm_tpp.bench.timing import Plan, SamplingPolicy
from tvm_tpp.bench.workloads import GemmWorkload, ModelWorkload


def test_job_round_trips_through_json():
    job = Job("metaschedule", 2, "wd", (ModelWorkload("m.onnx", "i.npz", "o.npz", "m_1",
                                                      {"x": [3, 64]}), GemmWorkload(8, 16, 32)),
              seed=3, ms_trials=16, top_k=2, tune_budget=1.5, explain=True,
              tvm_default_limit=0.5)
    again = Job.from_json(job.to_json())
    assert again == job and isinstance(again.workloads[1], GemmWorkload)
    assert json.loads(job.to_json())["workloads"][1] == {"gemm": {"m": 8, "n": 16, "k": 32}}


@pytest.mark.parametrize("bad, match", [
    ({"impl": "tensorrt"}, "unknown implementation"),
    ({"threads": 0}, "threads"),
    ({"ms_trials": 0}, "ms_trials"),
    ({"tune_budget": 0.0}, "tune_budget"),
    ({"tvm_default_limit": -1.0}, "tvm_default_limit"),
])
def test_job_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        Job(**{"impl": "tpp", "threads": 1, "work_dir": "wd", **bad})


def test_workload_validation_and_kinds():
    with pytest.raises(ValueError, match="positive"):
        GemmWorkload(0, 8, 8)
    with pytest.raises(ValueError, match="unknown workload kind"):
        from tvm_tpp.bench.workloads import from_json

        from_json({"conv": {}})
    gemm = GemmWorkload(8, 8, 8)
    assert not impls.supports("onnxruntime", gemm) and impls.supports("numpy", gemm)
    with pytest.raises(ValueError, match="does not build"):
        impls.build(Job("onnxruntime", 1, "wd"), gemm, print)


def test_gemm_check_measures_against_float64():
    gemm = GemmWorkload(4, 5, 6)
    x, w = gemm.operands(seed=1)
    assert gemm.check([x @ w], seed=1)["max_abs_err"] < 1e-5
    assert gemm.check([x @ w + 0.5], seed=1)["max_abs_err"] == pytest.approx(0.5, abs=1e-5)
    assert not np.array_equal(gemm.operands(seed=2)[0], x)


def _fake_build(outputs, timer=None, raises=None):
    def build(job, workload, say):
        say("tuning 1/1")
        if raises is not None:
            raise raises
        return impls.Built(lambda: outputs, timer, 0.25, 1.5, "fake", "notes",
                           explain={"measured": []})

    return build


def test_worker_prepares_checks_and_probes(monkeypatch):
    gemm = GemmWorkload(2, 2, 2)
    x, w = gemm.operands(0)
    steps = []
    calls = []

    def timer(number, repeat, warmup):
        calls.append((number, repeat, warmup))
        return [1e-3] * repeat

    monkeypatch.setattr(impls, "build", _fake_build([x @ w], timer))
    answer, kept = protocol._prepare(Job("tpp", 1, "wd", explain=True), 0, gemm, steps.append)
    assert kept is timer and steps == ["tuning 1/1", "check"]
    assert answer["ok"] and answer["prepared"] == 0 and answer["max_abs_err"] < 1e-5
    assert (answer["compile_seconds"], answer["tune_seconds"]) == (0.25, 1.5)
    assert answer["explain"] == {"measured": []}
    # A 1 ms run is timed again over 50 ms after the one-run probe.
    assert answer["run_seconds"] == 1e-3 and calls == [(1, 1, True), (50, 1, True)]
    answer, _ = protocol._prepare(Job("tpp", 1, "wd"), 0, gemm, steps.append)
    assert "explain" not in answer


def test_worker_reports_skips_and_errors(monkeypatch):
    gemm = GemmWorkload(2, 2, 2)
    monkeypatch.setattr(impls, "build", _fake_build([], raises=impls.Unavailable("not here")))
    assert protocol._prepare(Job("tpp", 1, "wd"), 3, gemm, print) == (
        {"prepared": 3, "skipped": "not here"}, None)
    monkeypatch.setattr(impls, "build", _fake_build([], raises=RuntimeError("a\nbad build")))
    assert protocol._prepare(Job("tpp", 1, "wd"), 0, gemm, print) == (
        {"prepared": 0, "error": "RuntimeError: bad build"}, None)


def test_worker_answers_timing_requests():
    ready = {0: lambda number, repeat, warmup: [number * 1e-3] * repeat,
             1: lambda number, repeat, warmup: [math.nan]}
    assert protocol._samples(ready, {"time": 0, "number": 2, "repeat": 3, "warmup": True}) \
        == [2e-3] * 3
    with pytest.raises(ValueError, match="no time measured"):
        protocol._samples(ready, {"time": 1, "number": 1, "repeat": 1, "warmup": False})
    with pytest.raises(ValueError, match="not prepared"):
        protocol._samples(ready, {"time": 2, "number": 1, "repeat": 1, "warmup": False})


def test_send_writes_one_json_line():
    channel = io.StringIO()
    protocol.send(channel, {"ready": True})
    assert channel.getvalue() == '{"ready": true}\n'


def test_loop_timer_on_a_fake_clock(monkeypatch):
    now = [0.0]
    runs = []

    def run():
        runs.append(1)
        now[0] += 0.5  # every run takes half a second of the fake clock

    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    timer = timing.loop_timer(run)
    assert timer(4, 3, True) == [0.5, 0.5, 0.5] and len(runs) == 1 + 4 * 3
    runs.clear()
    assert timer(2, 1, False) == [0.5] and len(runs) == 2  # no warm-up run


def test_probe_averages_short_runs_over_a_probe_duration():
    """A first timed run slowed 10x (waking threads) must not size the samples."""
    calls = []

    def timer(number, repeat, warmup):
        calls.append(number)
        return [600e-6 if number == 1 else 60e-6]  # one cold run, then the steady rate

    assert timing.probe_seconds(timer, first=1e-3) == 60e-6
    assert calls == [1, math.ceil(timing.PROBE_SECONDS / 600e-6)]
    calls.clear()
    assert timing.probe_seconds(timer, first=2.0) == 2.0 and calls == []  # its own probe
    assert timing.probe_seconds(lambda n, r, w: [0.2], first=0.3) == 0.2  # long enough


def test_sampling_policy():
    gemm = SamplingPolicy(samples=10, sample_seconds=1e-3, fill_seconds=0.4,
                          slow_seconds=math.inf, budget_seconds=10.0, min_samples=1)
    assert gemm.plan(1e-5) == Plan(100, 200, True)   # 1 ms samples, 200 fit in 0.4 s
    assert gemm.plan(4e-3) == Plan(1, 100, True)     # fewer fit
    assert gemm.plan(0.2) == Plan(1, 10, True)       # but at least `samples`
    assert gemm.plan(4.0) == Plan(1, 2, True)        # unless they exceed 10 s
    assert gemm.plan(30.0) == Plan(1, 1, True)       # one at least
    assert gemm.plan(0.0).number == 10_000           # capped
    for bad in ({"samples": 0}, {"sample_seconds": 0.0}, {"fill_seconds": -1.0}):
        with pytest.raises(ValueError):
            SamplingPolicy(**bad)


def test_turn_order_rotates_and_reverses():
    assert [timing.turn_order("abcd", r) for r in range(4)] == [
        list("abcd"), list("adcb"), list("cdab"), list("cbad")]
    assert timing.turn_order([], 3) == []


def test_worker_environment_sizes_blas_only_where_timed(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(protocol, "Worker", lambda argv, log, env: seen.append(env))
    for impl in ("numpy", "tpp", "peak"):
        protocol.start_worker(["worker"], Job(impl, 4, "wd"), tmp_path / "log")
    assert [e["OPENBLAS_NUM_THREADS"] for e in seen] == ["4", "1", "1"]
    assert [e["TVM_NUM_THREADS"] for e in seen] == ["4", "4", "1"]


def test_metaschedule_database_is_reused_only_with_the_same_settings(tmp_path, monkeypatch):
    # The one-off tensor-intrinsic import (20-60 s) is not what is tested here.
    monkeypatch.setitem(sys.modules, "tvm.s_tir.tensor_intrin", types.ModuleType("intrin"))
    searches = []

    def run_search(path):
        searches.append(path)
        return "database"

    path = metaschedule.database_dir(tmp_path, "8x8x8", 1)
    first = metaschedule.search(path, {"trials": 4, "seed": 0}, run_search)
    assert first.database == "database" and first.tune_seconds >= 0
    assert first.earlier_seconds is None and "reused" not in first.note()
    again = metaschedule.search(path, {"trials": 4, "seed": 0}, run_search)
    assert len(searches) == 1 and again.tune_seconds == 0.0  # one rule: no search, 0 s
    assert again.earlier_seconds == first.tune_seconds and "reused" in again.note()
    (path / "stale.json").write_text("{}")
    metaschedule.search(path, {"trials": 8, "seed": 0}, run_search)
    assert len(searches) == 2 and not (path / "stale.json").exists()  # started afresh


def test_metaschedule_without_its_packages_is_skipped(monkeypatch):
    monkeypatch.setattr(metaschedule, "missing_packages", lambda: ["xgboost"])
    with pytest.raises(impls.Unavailable, match="needs xgboost.*tvm-tpp\\[tune\\]"):
        impls.build(Job("metaschedule", 1, "wd"), GemmWorkload(8, 8, 8), print)


def test_explanation_ranks_and_flags():
    from schedules.gemm import GemmConfig, GemmProblem
    from schedules.tuner import Measurement
    from tvm_tpp.bench.report import explanation

    problem = GemmProblem(64, 64, 64)
    a, b, c = (GemmConfig.of(spec, 64, 64, 64) for spec in ("BCa", "aBC", "abc"))
    measured = [Measurement(a, 2, 3e5, seconds=1e-5, model_class=1),
                Measurement(b, 0, 1e5, seconds=5e-6, model_class=0),
                Measurement(c, 6, 9e5, error="no build", model_class=5)]
    ex = explanation(measured, problem, b)
    assert [m["model_rank"] for m in ex["measured"]] == [3, 1, 7]
    assert [m["default"] for m in ex["measured"]] == [True, False, False]
    assert [m["kept"] for m in ex["measured"]] == [False, True, False]
    assert ex["measured"][1]["gflops"] == pytest.approx(problem.flops / 5e-6 / 1e9)
    assert ex["measured"][2]["gflops"] is None and ex["measured"][2]["error"] == "no build"
    assert (ex["best_model_rank"], ex["best_model_class"]) == (1, 1)
    assert ex["best_in_model_top5"] and ex["best_in_model_top5_classes"]
    assert ex["top5_within_margin"] is True  # the best is in the top 5 itself
    json.dumps(ex)  # travels from the worker as JSON
    outsider = [*measured[:2], Measurement(c, 6, 9e5, seconds=1e-6, model_class=5)]
    ex = explanation(outsider, problem, c)
    assert (ex["best_model_rank"], ex["best_model_class"]) == (7, 6)
    assert not ex["best_in_model_top5"] and not ex["best_in_model_top5_classes"]
    assert ex["top5_within_margin"] is False  # the top 5 is 5x slower than the best


def test_tune_explain_prints_each_operator(capsys):
    from rich.console import Console

    from schedules.gemm import GemmConfig, GemmProblem
    from schedules.tuner import Measurement, TuneResult
    from tvm_tpp.bench.report import print_tuned

    problem = GemmProblem(64, 64, 64)
    a, b = GemmConfig.of("BCa", 64, 64, 64), GemmConfig.of("aBC", 64, 64, 64)
    fresh = TuneResult(b, False, 1.0, (Measurement(a, 1, 3e5, seconds=1e-5, model_class=0),
                                       Measurement(b, 0, 1e5, seconds=5e-6, model_class=0)),
                       candidates=12)
    cached = TuneResult(a, True, 0.0)
    print_tuned(Console(width=200), [(problem, fresh), (problem, cached)])
    out = capsys.readouterr().out
    assert "model ranking vs measurement (12 candidates)" in out
    assert out.index("aBC") < out.index("BCa")  # model-rank order
    assert "2 (default)" in out and " *" in out and "measured best is model rank 1" in out
    assert "from the database (no new measurements)" in out
