"""tvm-tpp bench (tvm_tpp.bench.networks): round-robin timing, correctness flags, reports.

The default suite drives the harness with stand-in workers that speak the protocol without
TVM; the real workers run in the slow tests.  No timing assertions: latencies are only
checked to exist and be positive.
"""

import io
import json
import sys
import textwrap

import numpy as np
import onnx
import psutil
import pytest
from conftest import make_dense_model

from tvm_tpp.bench.networks import BenchConfig, Row, judge, run_bench
from tvm_tpp.bench.plots import plot
from tvm_tpp.bench.report import print_report
from tvm_tpp.cli import main
from tvm_tpp.compiler import DATABASE
from tvm_tpp.errors import ModelError

ROW_KEYS = {"model", "batch", "threads", "impl", "median_ms", "p10_ms", "p90_ms",
            "compile_seconds", "tune_seconds", "max_rel_err"}
HOST_KEYS = {"cpu", "simd_flags", "cores", "tvm_version", "ort_version"}


@pytest.fixture
def symbolic_dense(tmp_path):
    """A 64x64 MatMul+Add+Relu whose batch dimension is symbolic ("N")."""
    path = tmp_path / "dense.onnx"
    onnx.save(make_dense_model(m=4, k=64, n=64, batch_dim="N"), str(path))
    return path


# A stand-in worker: the reference writes the inputs' first array as its output; the others
# copy it (onnxruntime, tpp), copy it perturbed (tvm-default: WRONG), skip (metaschedule) or
# die on their second sample (tpp-tuned).  Every timing request is recorded.
_FAKE_WORKER = textwrap.dedent("""
    import json, os, shutil, sys
    from pathlib import Path

    import numpy as np

    job = json.loads(sys.argv[1])
    impl, workload = job["impl"], job["workloads"][0]["model"]
    record = open(os.environ["FAKE_RECORD"], "a", buffering=1)
    out = Path(workload["outputs"])
    reference = out.with_name("reference.npz")

    def send(message):
        print(json.dumps(message), flush=True)

    if impl == "metaschedule":
        send({"prepared": 0, "skipped": "not here"})
        send({"ready": True})
        sys.exit(0)
    if impl == "reference":
        with np.load(workload["inputs"]) as stored:
            np.savez(out, out0=stored[stored.files[0]])
    elif impl == "tvm-default":
        with np.load(reference) as stored:
            np.savez(out, out0=stored["out0"] + 1.0)
    else:
        shutil.copy(reference, out)
    send({"step": "build", "workload": 0})
    send({"prepared": 0, "ok": True, "compile_seconds": 0.5, "tune_seconds": None,
          "run_seconds": 0.002, "target": "fake", "notes": f"{impl} notes"})
    send({"ready": True})
    for count, line in enumerate(sys.stdin):
        request = json.loads(line)
        if request.get("quit"):
            break
        record.write(f"{impl} {request['number']} {request['repeat']} {request['warmup']}\\n")
        if impl == "tpp-tuned" and count == 1:
            os._exit(7)
        send({"seconds": [0.001 if impl == "tpp" else 0.002]})
""")


@pytest.fixture
def fake_rows(tmp_path, symbolic_dense, monkeypatch):
    script = tmp_path / "fake_worker.py"
    script.write_text(_FAKE_WORKER)
    record = tmp_path / "record.txt"
    monkeypatch.setenv("FAKE_RECORD", str(record))
    cfg = BenchConfig(models=(str(symbolic_dense),), batches=(3,), threads=2, repeat=3,
                      pause=0.0, work_dir=tmp_path / "wd",
                      worker_command=(sys.executable, str(script)))
    rows = run_bench(cfg, progress=False)
    return cfg, rows, record.read_text().splitlines()


def test_harness_times_round_robin_and_judges(fake_rows):
    cfg, rows, requests = fake_rows
    by_impl = {r.impl: r for r in rows}
    assert [r.impl for r in rows] == list(cfg.impls)
    tpp, ort = by_impl["tpp"], by_impl["onnxruntime"]
    for row in (tpp, ort):
        assert (row.model, row.batch, row.threads) == ("dense", 3, 2)  # symbolic N set
        assert row.status == "ok" and row.max_rel_err == 0.0 and row.samples == 3
        assert row.runs_per_sample == 25  # 50 ms samples of a 2 ms run
        assert row.compile_seconds == 0.5 and row.notes == f"{row.impl} notes"
    assert tpp.median_ms == pytest.approx(1.0) and ort.median_ms == pytest.approx(2.0)
    assert tpp.speedup == {"onnxruntime": pytest.approx(2.0)}  # WRONG baselines rank nothing
    wrong = by_impl["tvm-default"]
    assert wrong.status == "WRONG" and wrong.speedup == {} and "tolerance" in wrong.error
    assert by_impl["metaschedule"].status == "skipped"
    assert by_impl["metaschedule"].error == "not here"
    died = by_impl["tpp-tuned"]
    assert died.status == "error" and died.error.startswith("during timing: worker exited "
                                                            "with status 7")
    assert died.samples == 1
    # One sample per request, 25 runs after a warm-up; the first of each round rotates.
    assert set(requests) == {f"{i} 25 1 True" for i in ("tpp", "tpp-tuned", "tvm-default",
                                                       "onnxruntime")}
    order = [line.split()[0] for line in requests]
    assert order[:4] == ["tpp", "tpp-tuned", "tvm-default", "onnxruntime"]
    assert order[4:7] == ["tpp", "onnxruntime", "tvm-default"]  # reversed, tpp-tuned gone
    assert not psutil.Process().children(recursive=True)


def test_report_and_json(fake_rows, tmp_path):
    from tvm_tpp.bench.report import to_json, write_json

    cfg, rows, _ = fake_rows
    out = io.StringIO()
    print_report(rows, cfg, wall_seconds=12.0, file=out)
    text = out.getvalue()
    assert "tvm-tpp bench (12 s)" in text and "x onnxruntime" in text and "2.00x" in text
    assert "dense b3 tvm-default [WRONG]" in text and "dense b3 tpp: tpp notes" in text
    assert "tolerance" in text and "0.0001" in text
    doc = json.loads(write_json(tmp_path / "b.json", rows, cfg, 12.0).read_text())
    assert doc == json.loads(json.dumps(to_json(rows, cfg, 12.0)))
    assert doc["command"].startswith("tvm-tpp bench ") and "--batch 3" in doc["command"]
    assert HOST_KEYS <= set(doc["host"]) and doc["host"]["cores"] >= 1
    assert [r["impl"] for r in doc["rows"]] == list(cfg.impls)
    assert all(ROW_KEYS <= set(r) for r in doc["rows"])
    assert plot(rows, tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


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


def test_row_and_config_validation(tmp_path):
    with pytest.raises(ValueError, match="status"):
        Row("m", 1, 2, "tpp", status="fast")
    with pytest.raises(ValueError, match="unknown implementation"):
        Row("m", 1, 2, "numpy")  # a GEMM baseline, not a model's
    with pytest.raises(ValueError, match="implementations must be"):
        BenchConfig(models=("mlp",), impls=("tpp", "tensorrt"))
    with pytest.raises(ValueError, match="repeat"):
        BenchConfig(models=("mlp",), repeat=0)
    with pytest.raises(ModelError, match="neither an ONNX file nor a bundled model"):
        run_bench(BenchConfig(models=("no_such_net",), work_dir=tmp_path), progress=False)


def test_sampling_follows_the_config():
    cfg = BenchConfig(models=("m",), repeat=10, sample_seconds=0.05, slow_seconds=1.0,
                      slow_budget=30.0)
    assert cfg.sampling.plan(0.001) == (50, 10, True)      # fast: many runs per sample
    assert cfg.sampling.plan(0.5) == (1, 10, True)
    assert cfg.sampling.plan(2.0) == (1, 10, False)        # 30 s fit 15 runs: all 10 samples
    assert cfg.sampling.plan(6.0) == (1, 5, False)         # fewer samples for slow runs
    assert cfg.sampling.plan(100.0) == (1, 3, False)       # but never fewer than 3
    assert BenchConfig(models=("m",), repeat=2).sampling.plan(100.0) == (1, 2, False)


def test_cli_bench_usage_errors(capsys):
    assert main(["bench", "mlp", "--impls", "tpp,tensorrt"]) == 2
    assert "implementations must be" in capsys.readouterr().err
    assert main(["bench", "mlp", "--batch", "1,x"]) == 2
    assert "--batch" in capsys.readouterr().err


def test_plot_with_failed_rows(tmp_path):
    rows = judge([_row("tpp", 1.0, 0.0), _row("onnxruntime", 2.0, 0.0),
                  Row("m", 1, 2, "tvm-default", status="error", error="crashed")])
    assert plot(rows, tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_cli_bench_end_to_end(tmp_path, symbolic_dense, capsys):
    out_json = tmp_path / "b.json"
    code = main(["bench", str(symbolic_dense), "--batch", "3", "--impls",
                 "tpp,tvm-default,onnxruntime", "--repeat", "3", "--work-dir",
                 str(tmp_path / "wd"), "--json", str(out_json), "-q"])
    assert code == 0
    assert "tvm-default" in capsys.readouterr().out
    doc = json.loads(out_json.read_text())
    assert doc["host"]["tvm_version"].startswith("0.27")
    assert "fma" in doc["host"]["simd_flags"] or "asimd" in doc["host"]["simd_flags"]
    rows = doc["rows"]
    assert [r["impl"] for r in rows] == ["tpp", "tvm-default", "onnxruntime"]
    for row in rows:
        assert row["status"] == "ok", row
        assert row["max_rel_err"] <= 1e-4 and row["samples"] == 3
        assert 0 < row["p10_ms"] <= row["median_ms"] <= row["p90_ms"]
        assert row["compile_seconds"] >= 0 and row["tune_seconds"] is None
    assert set(rows[0]["speedup"]) == {"tvm-default", "onnxruntime"}


# The real worker, with faults: dies or hangs while building.
_FAULTY_WORKER = textwrap.dedent("""
    import json, os, runpy, time

    impl = json.loads(__import__("sys").argv[1])["impl"]
    if impl == "tvm-default":
        os.abort()                                   # dies while building
    if impl == "tpp":
        time.sleep(600)                              # hangs while building
    runpy.run_module("tvm_tpp.bench", run_name="__main__")
""")


@pytest.mark.slow
def test_failing_real_workers_become_error_rows(tmp_path, symbolic_dense):
    script = tmp_path / "faulty_worker.py"
    script.write_text(_FAULTY_WORKER)
    cfg = BenchConfig(models=(str(symbolic_dense),), impls=("tpp", "tvm-default", "onnxruntime"),
                      repeat=2, timeout=10, work_dir=tmp_path / "wd",
                      worker_command=(sys.executable, str(script)))
    rows = {r.impl: r for r in run_bench(cfg, progress=False)}
    assert rows["tpp"].status == "error" and "timed out" in rows["tpp"].error
    assert rows["tvm-default"].status == "error" and "SIGABRT" in rows["tvm-default"].error
    ort = rows["onnxruntime"]
    assert ort.status == "ok" and ort.samples == 2 and ort.max_rel_err <= 1e-4
    assert not psutil.Process().children(recursive=True)  # the hung worker was killed


@pytest.mark.slow
def test_metaschedule_tunes_then_reuses_database(tmp_path, symbolic_dense):
    cfg = BenchConfig(models=(str(symbolic_dense),), impls=("metaschedule",), repeat=2,
                      ms_trials=4, work_dir=tmp_path / "wd")
    (first,) = run_bench(cfg, progress=False)
    assert first.status == "ok", first.error
    assert first.max_rel_err <= 1e-4 and first.tune_seconds > 0
    assert "per task" in first.notes and "reused" not in first.notes
    db = tmp_path / "wd" / "metaschedule" / f"dense_1_t{cfg.threads}"
    assert (db / "database_tuning_record.json").is_file()
    (second,) = run_bench(cfg, progress=False)
    assert second.status == "ok" and "reused" in second.notes
    assert second.tune_seconds == 0.0  # no search in this run
    assert f"searched earlier in {first.tune_seconds:.1f} s" in second.notes
    assert np.isfinite(second.median_ms)


@pytest.mark.slow
def test_tpp_tuned_uses_what_tune_wrote_in_the_work_dir(tmp_path):
    import tvm_tpp
    from tvm_tpp import models

    work_dir = tmp_path / "wd"
    tuned = tvm_tpp.tune(models.load("mlp"), "tpp -num-cores=1", work_dir=work_dir,
                         budget=1.0)
    cfg = BenchConfig(models=("mlp",), impls=("tpp-tuned",), threads=1, repeat=2,
                      work_dir=work_dir)
    (row,) = run_bench(cfg, progress=False)
    assert row.status == "ok", row.error
    assert row.tune_seconds == 0.0  # tuned before: nothing searched in this run
    assert f"0 operators tuned, {len(tuned)} cached" in row.notes
    assert str(work_dir / DATABASE) in row.notes


@pytest.fixture
def any_size_conv(tmp_path):
    """A 3x3 conv + ReLU on an image whose batch, height and width are all symbolic, as
    exported detectors declare their input."""
    rng = np.random.default_rng(0)
    w = onnx.numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype("float32"), "w")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         onnx.helper.make_node("Relu", ["c"], ["y"])],
        "detector", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT,
                                                        ["n", 3, "h", "w"])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT,
                                             ["n", 8, "h", "w"])], [w])
    path = tmp_path / "detector.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]),
              str(path))
    return path


@pytest.mark.slow  # 9 s: a real bench of every row; test_bench_shapes_* check the option
def test_bench_takes_the_shape_of_an_input_with_symbolic_sizes(tmp_path, any_size_conv, capsys):
    """``--shape`` fixes what ``--batch`` cannot (a detector's height and width); every
    implementation runs that shape, and the tpp build is a static one."""
    out_json = tmp_path / "b.json"
    args = ["bench", str(any_size_conv), "--impls", "tpp,onnxruntime", "--repeat", "3",
            "--work-dir", str(tmp_path / "wd"), "--json", str(out_json), "-q"]
    assert main(args) == 2  # without the shape: one line naming the flag, before any worker
    assert "give its shape, e.g. --shape x=" in capsys.readouterr().err
    assert main([*args, "--shape", "x=1,3,13,11", "--rtol", "1e-5"]) == 0
    rows = json.loads(out_json.read_text())["rows"]
    assert [(r["impl"], r["status"], r["batch"]) for r in rows] == [
        ("tpp", "ok", 1), ("onnxruntime", "ok", 1)]
    assert rows[0]["max_rel_err"] <= 1e-5 and "symbolic" not in rows[0]["notes"]
    with np.load(tmp_path / "wd" / "runs" / "detector_1" / "tpp.npz") as out:
        assert out["out0"].shape == (1, 8, 13, 11)


def test_bench_shapes_apply_to_files_only(capsys):
    assert main(["bench", "mlp", "--shape", "x=1,64", "--impls", "tpp"]) == 2
    assert "apply to ONNX files" in capsys.readouterr().err
    assert main(["bench", "mlp", "--shape", "x=1,64", "--rpc", "127.0.0.1:1", "--key", "k"]) == 2
    assert "--shape" in capsys.readouterr().err
