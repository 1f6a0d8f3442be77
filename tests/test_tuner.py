"""The loop_spec tuner: measures the model's top candidates, persists, reuses, and its CLI."""

import json

import numpy as np
import pytest
import tvm

import tvm_tpp
from microkernels import isa
from schedules import tuner as tuner_module
from schedules.blocking import default_config
from schedules.gemm import GemmConfig, GemmProblem, pack_weight, schedule
from schedules.tuner import MARGIN, Database, Tuner, TuningKey, build, time_interleaved, tune_gemm

TARGET = tvm_tpp.target("tpp -isa=avx2 -mcpu=haswell -num-cores=1")
PROBLEM = GemmProblem(48, 64, 96)


def test_tune_persists_and_second_call_is_free(tmp_path):
    db = Database(tmp_path / "tuning.json")
    result = tune_gemm(PROBLEM, TARGET, database=db, top_k=2)
    assert not result.cached and result.candidates > 2
    assert result.best in [m.config for m in result.measurements if m.seconds]
    default = default_config(48, 64, 96, isa.from_name("avx2"), isa.caches(), threads=1)
    assert default in [m.config for m in result.measurements]  # the default is always measured
    key = TuningKey.of(PROBLEM, TARGET).text()
    record = json.loads((tmp_path / "tuning.json").read_text())[key]
    assert record["config"]["spec"] == result.best.spec and record["gflops"] > 0

    again = tune_gemm(PROBLEM, TARGET, database=Database(tmp_path / "tuning.json"))
    assert again.cached and again.tune_seconds == 0 and again.best == result.best


def test_tuned_config_is_correct(tmp_path):
    best = tune_gemm(PROBLEM, TARGET, database=Database(tmp_path / "t.json"), top_k=2).best
    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, 96)).astype("float32")
    w = rng.standard_normal((96, 64)).astype("float32")
    f = tvm.compile(schedule(PROBLEM, best, "avx2").mod, target=TARGET)
    y = tvm.runtime.empty((48, 64), "float32")
    f(tvm.runtime.tensor(x), tvm.runtime.tensor(pack_weight(w, best.bn)), y)
    np.testing.assert_allclose(y.numpy(), x @ w, rtol=1e-4, atol=1e-4)


def test_lookup_only_tuner_returns_none_for_unknown(tmp_path):
    tuner = Tuner(Database(tmp_path / "t.json"), tune_missing=False)
    assert tuner.config(PROBLEM, TARGET) is None


def test_corrupt_database_is_a_clear_error(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        Database(path)


def test_tune_cli_explain(tmp_path, dense_file, capsys):
    from tvm_tpp.cli import main

    assert main(["tune", str(dense_file), "--work-dir", str(tmp_path), "--explain"]) == 0
    out = capsys.readouterr().out
    assert "model ranking vs measurement" in out and "top 5" in out
    assert (tmp_path / "tuning.json").is_file()


def _fake_measure(monkeypatch, seconds_of, calls=None, delay=0.0):
    """Replace building and timing by ``seconds_of(config)``; record each batch's configs."""
    import time

    def fake(problem, configs, target, isa):
        if calls is not None:
            calls.append(list(configs))
        time.sleep(delay)
        return [seconds_of(c) for c in configs]

    monkeypatch.setattr(tuner_module, "measure", fake)


@pytest.mark.parametrize("speedup,wins", [(MARGIN / 2, False), (3 * MARGIN, True)])
def test_candidate_must_beat_default_by_margin(monkeypatch, speedup, wins):
    default = default_config(48, 64, 96, isa.from_name("avx2"), isa.caches(), threads=1)
    picked = []

    def seconds_of(config):
        if config == default:
            return 1.0
        if not picked:
            picked.append(config)
        return 1.0 - speedup if config == picked[0] else 2.0

    _fake_measure(monkeypatch, seconds_of)
    result = tune_gemm(PROBLEM, TARGET, top_k=6)
    assert result.best == (picked[0] if wins else default)


def test_incumbent_is_retimed_with_each_batch(monkeypatch):
    calls = []
    _fake_measure(monkeypatch, lambda c: 1.0, calls)
    result = tune_gemm(PROBLEM, TARGET, top_k=2 * tuner_module.BATCH)
    assert len(calls) >= 2 and calls[0][0] == result.best  # nothing beat the default...
    assert all(batch[-1] == result.best for batch in calls[1:])  # ...which ran in every batch


def test_budget_stops_after_the_first_batch(monkeypatch):
    calls = []
    _fake_measure(monkeypatch, lambda c: 1.0, calls, delay=0.2)
    result = tune_gemm(PROBLEM, TARGET, top_k=3 * tuner_module.BATCH, budget_seconds=0.1)
    assert len(calls) == 1 and len(result.measurements) == tuner_module.BATCH


def test_build_reports_unbuildable_candidates():
    good = default_config(48, 64, 96, isa.from_name("avx2"), isa.caches(), threads=1)
    bad = GemmConfig.of("aBCa", good.bm, good.bn, good.bk)  # a parallel loop inside K's
    funcs = build(PROBLEM, [good, bad], TARGET, "avx2")
    assert callable(funcs[0]) and isinstance(funcs[1], str) and funcs[1]


def test_time_interleaved_runs_every_function_each_round():
    counts = [0, 0]

    def run(i):
        def f():
            counts[i] += 1
        return f

    seconds = time_interleaved([run(0), run(1)], rounds=2, round_seconds=0.0)
    assert len(seconds) == 2 and all(s >= 0 for s in seconds)
    assert counts == [3, 3]  # a warm-up and one sample per round
