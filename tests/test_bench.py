"""tvm-tpp bench: workers, round-robin timing, correctness flags, JSON, table and plot.

No timing assertions: latencies are only checked to exist and be positive.
"""

import json
import math
import sys
import textwrap

import numpy as np
import onnx
import psutil
import pytest
from conftest import make_dense_model

from tvm_tpp import bench, bench_worker
from tvm_tpp.bench import BenchConfig, Row, format_table, judge, plan_timing, run_bench
from tvm_tpp.cli import main

ROW_KEYS = {"model", "batch", "threads", "impl", "median_ms", "p10_ms", "p90_ms",
            "compile_seconds", "tune_seconds", "max_rel_err"}
HOST_KEYS = {"cpu", "simd_flags", "cores", "tvm_version", "ort_version"}


@pytest.fixture
def symbolic_dense(tmp_path):
    """A 64x64 MatMul+Add+Relu whose batch dimension is symbolic ("N")."""
    path = tmp_path / "dense.onnx"
    onnx.save(make_dense_model(m=4, k=64, n=64, batch_dim="N"), str(path))
    return path


def test_cli_bench_end_to_end(tmp_path, symbolic_dense, capsys):
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    code = main(["bench", str(symbolic_dense), "--batch", "3", "--impls",
                 "tpp,tvm-default,onnxruntime", "--repeat", "3", "--work-dir",
                 str(tmp_path / "wd"), "--json", str(out_json), "--plot", str(out_png), "-q"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "tvm-default" in printed and "rel err" in printed

    doc = json.loads(out_json.read_text())
    assert doc["command"].startswith("tvm-tpp bench ") and "--impls tpp,tvm-default" in \
        doc["command"]
    assert HOST_KEYS <= set(doc["host"]) and doc["host"]["cores"] >= 1
    assert doc["host"]["tvm_version"].startswith("0.27")
    assert "fma" in doc["host"]["simd_flags"] or "asimd" in doc["host"]["simd_flags"]
    rows = doc["rows"]
    assert [r["impl"] for r in rows] == ["tpp", "tvm-default", "onnxruntime"]
    for row in rows:
        assert ROW_KEYS <= set(row), row
        assert row["model"] == "dense" and row["batch"] == 3  # symbolic N set to --batch
        assert row["status"] == "ok", row
        assert row["max_rel_err"] <= 1e-4
        assert row["samples"] == 3 and row["runs_per_sample"] >= 1
        assert 0 < row["p10_ms"] <= row["median_ms"] <= row["p90_ms"]
        assert row["compile_seconds"] >= 0 and row["tune_seconds"] is None
    assert set(rows[0]["speedup"]) == {"tvm-default", "onnxruntime"}
    assert rows[1]["speedup"]["tvm-default"] == pytest.approx(1.0)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


_FAULTY_WORKER = textwrap.dedent("""
    import json, os, runpy, shutil, sys, time
    from pathlib import Path

    job = json.loads(sys.argv[1])
    impl = job["impl"]
    if impl == "tvm-default":
        os.abort()                                   # dies while building
    if impl == "tpp":
        time.sleep(600)                              # hangs while building
    if impl == "metaschedule":
        print(json.dumps({"skipped": "not here"}), flush=True)
        sys.exit(0)
    if impl == "tpp-tuned":                          # builds, then dies on the first sample
        out = Path(job["outputs"])
        shutil.copy(out.with_name("reference.npz"), out)
        print(json.dumps({"ok": True, "compile_seconds": 0.0, "tune_seconds": None,
                          "run_seconds": 0.001}), flush=True)
        sys.stdin.readline()
        os._exit(7)
    runpy.run_module("tvm_tpp.bench_worker", run_name="__main__")
""")


def test_failing_workers_become_error_rows(tmp_path, symbolic_dense):
    script = tmp_path / "faulty_worker.py"
    script.write_text(_FAULTY_WORKER)
    cfg = BenchConfig(models=(str(symbolic_dense),), repeat=2, timeout=10,
                      work_dir=tmp_path / "wd", worker_command=(sys.executable, str(script)))
    rows = {r.impl: r for r in run_bench(cfg, progress=False)}
    assert rows["tpp"].status == "error" and "timed out" in rows["tpp"].error
    assert rows["tvm-default"].status == "error" and "SIGABRT" in rows["tvm-default"].error
    assert rows["tpp-tuned"].status == "error"
    assert "during timing" in rows["tpp-tuned"].error and "status 7" in rows["tpp-tuned"].error
    assert rows["metaschedule"].status == "skipped" and rows["metaschedule"].error == "not here"
    ort = rows["onnxruntime"]
    assert ort.status == "ok" and ort.samples == 2 and ort.max_rel_err <= 1e-4
    assert ort.speedup == {"onnxruntime": pytest.approx(1.0)}  # the failed baselines rank nothing
    assert not psutil.Process().children(recursive=True)  # the hung worker was killed


def test_metaschedule_skipped_without_its_dependencies(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "xgboost" else real(name, *a))
    job = bench_worker.Job("metaschedule", "m.onnx", "i.npz", "o.npz", 1, str(tmp_path))
    with pytest.raises(bench_worker.Unavailable, match="needs xgboost.*tvm-tpp\\[tune\\]"):
        bench_worker._build_metaschedule(job, None, [], [])


def _row(impl, median, err, model="m"):
    return Row(model, 1, 2, impl, median_ms=median, p10_ms=median, p90_ms=median,
               max_rel_err=err, samples=3, runs_per_sample=1)


def test_judge_flags_wrong_rows_and_ranks_only_correct_ones():
    rows = judge([
        _row("tpp", 1.0, 3e-6),
        _row("tpp-tuned", 0.5, 2e-3),            # fast but wrong
        _row("tvm-default", 100.0, 1e-6),
        _row("metaschedule", 2.0, float("nan")),  # NaN error must not pass as "not > tol"
        _row("onnxruntime", 4.0, 0.0),
        _row("tpp", 8.0, None, model="other"),    # no reference: unchecked
    ], tolerance=1e-4)
    by_impl = {(r.model, r.impl): r for r in rows}
    tpp = by_impl[("m", "tpp")]
    assert tpp.status == "ok"
    assert tpp.speedup == {"tvm-default": 100.0, "onnxruntime": 4.0}  # not vs metaschedule
    wrong = by_impl[("m", "tpp-tuned")]
    assert wrong.status == "WRONG" and wrong.speedup == {} and "2.00e-03" in wrong.error
    assert by_impl[("m", "metaschedule")].status == "WRONG"
    assert by_impl[("other", "tpp")].status == "unchecked"
    assert by_impl[("other", "tpp")].speedup == {}  # other model's baselines do not count

    cfg = BenchConfig(models=("m",), threads=2)
    text = format_table(rows, cfg)
    assert "WRONG" in text and "x tvm-default" in text and "100.00x" in text
    assert "tolerance 0.0001" in text


def test_row_and_config_validation(tmp_path):
    with pytest.raises(ValueError, match="status"):
        Row("m", 1, 2, "tpp", status="fast")
    with pytest.raises(ValueError, match="unknown implementation"):
        Row("m", 1, 2, "tensorrt")
    with pytest.raises(ValueError, match="implementations must be"):
        BenchConfig(models=("mlp",), impls=("tpp", "tensorrt"))
    with pytest.raises(ValueError, match="repeat"):
        BenchConfig(models=("mlp",), repeat=0)
    with pytest.raises(ValueError, match="neither an ONNX file nor a bundled model"):
        run_bench(BenchConfig(models=("no_such_net",), work_dir=tmp_path), progress=False)


def test_cli_bench_usage_errors(capsys):
    assert main(["bench", "mlp", "--impls", "tpp,tensorrt"]) == 2
    assert "implementations must be" in capsys.readouterr().err
    assert main(["bench", "mlp", "--batch", "1,x"]) == 2
    assert "--batch" in capsys.readouterr().err


def test_plan_timing():
    cfg = BenchConfig(models=("m",), repeat=10, sample_seconds=0.05, slow_seconds=1.0,
                      slow_budget=30.0)
    assert plan_timing(0.001, cfg) == (50, 10, True)       # fast: many runs per sample
    assert plan_timing(0.5, cfg) == (1, 10, True)
    assert plan_timing(2.0, cfg) == (1, 10, False)         # 30 s fit 15 runs: all 10 samples
    assert plan_timing(6.0, cfg) == (1, 5, False)          # fewer samples for slow runs
    assert plan_timing(100.0, cfg) == (1, 3, False)        # but never fewer than 3
    assert plan_timing(100.0, BenchConfig(models=("m",), repeat=2)) == (1, 2, False)


def test_plot_with_failed_rows(tmp_path):
    rows = judge([_row("tpp", 1.0, 0.0), _row("onnxruntime", 2.0, 0.0),
                  Row("m", 1, 2, "tvm-default", status="error", error="crashed")])
    path = bench.plot(rows, tmp_path / "p.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_metaschedule_tunes_then_reuses_database(tmp_path, symbolic_dense):
    cfg = BenchConfig(models=(str(symbolic_dense),), impls=("metaschedule",), repeat=2,
                      ms_trials=4, work_dir=tmp_path / "wd")
    (first,) = run_bench(cfg, progress=False)
    assert first.status == "ok", first.error
    assert first.max_rel_err <= 1e-4 and first.tune_seconds > 0
    assert "per task" in first.notes and "reused" not in first.notes
    assert (tmp_path / "wd" / "ms" / "dense_1" / "database_tuning_record.json").is_file()
    (second,) = run_bench(cfg, progress=False)
    assert second.status == "ok" and "reused" in second.notes
    assert second.tune_seconds == pytest.approx(first.tune_seconds)
    assert np.isfinite(second.median_ms)


def test_probe_averages_short_runs_over_a_probe_duration():
    """A first timed run slowed 10x (waking threads) must not size the samples."""
    calls = []

    def timed(number, warmup):
        calls.append(number)
        return 600e-6 if number == 1 else 60e-6  # one cold run, then the steady rate

    built = bench_worker._Built(run=list, time=timed, compile_seconds=0.0)
    assert bench_worker.probe_seconds(built, first=1e-3) == 60e-6
    assert calls == [1, math.ceil(bench_worker._PROBE_SECONDS / 600e-6)]
    calls.clear()
    assert bench_worker.probe_seconds(built, first=2.0) == 2.0 and calls == []  # its own probe
