"""The loop_spec tuner: measures the model's top candidates, persists, reuses, and its CLI."""

import json

import numpy as np
import pytest
import tvm

import tvm_tpp
from microkernels import isa
from schedules.blocking import default_config
from schedules.gemm import GemmProblem, pack_weight, schedule
from schedules.tuner import Database, Tuner, TuningKey, tune_gemm

TARGET = tvm_tpp.target("tpp -isa=avx2 -mcpu=haswell -num-cores=1")
PROBLEM = GemmProblem(48, 64, 96)


def test_tune_persists_and_second_call_is_free(tmp_path):
    db = Database(tmp_path / "tuning.json")
    result = tune_gemm(PROBLEM, TARGET, database=db, top_k=2)
    assert not result.cached and result.candidates > 2
    timed = [m for m in result.measurements if m.seconds]
    assert result.best == min(timed, key=lambda m: m.seconds).config
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
