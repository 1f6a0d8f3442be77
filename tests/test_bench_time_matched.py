"""MetaSchedule given tpp-tuned's tuning time (``metaschedule-1x``) and ten times it
(``metaschedule-10x``): the budget's clock, the harness that hands tpp-tuned's seconds on,
the configuration's checks, and (slow) a real budgeted search of a small model."""

import json
import sys
import textwrap
import time

import numpy as np
import onnx
import pytest
from conftest import make_dense_model

from tvm_tpp.bench import impls, metaschedule
from tvm_tpp.bench.metaschedule import Deadline, DeadlineReached
from tvm_tpp.bench.networks import BASELINES, BenchConfig, run_bench
from tvm_tpp.bench.protocol import Job
from tvm_tpp.bench.report import _table
from tvm_tpp.bench.workloads import ModelWorkload
from tvm_tpp.onnx_import import input_specs
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime


def test_deadline_counts_and_stops_the_next_batch_after_collecting_those_in_flight(
        monkeypatch):
    now = [100.0]
    monkeypatch.setattr(metaschedule.time, "perf_counter", lambda: now[0])

    class Task:
        def __init__(self, in_flight):
            self.builder_results = ["built"] if in_flight else None

    class Scheduler:
        tasks_ = [Task(True), Task(False), Task(True)]
        joined = []

        def join_running_task(self, i):
            self.joined.append(i)
            deadline.measured(i, [None, "timeout"])  # what the callbacks do on a join

    scheduler = Scheduler()
    deadline = Deadline(30.0).start()
    deadline.measured(0, ["build failed", "build failed"])  # ran nothing
    now[0] = 129.9
    deadline.before_build(scheduler)
    assert (deadline.trials, deadline.measured_tasks, deadline.hit) == (2, set(), False)
    assert scheduler.joined == []
    now[0] = 130.0
    with pytest.raises(DeadlineReached, match="30.0 s budget"):
        deadline.before_build(scheduler)
    assert scheduler.joined == [0, 2]
    assert (deadline.trials, deadline.measured_tasks, deadline.hit) == (6, {0, 2}, True)


def test_deadline_rejects_a_negative_budget():
    with pytest.raises(ValueError, match=">= 0 seconds"):
        Deadline(-1.0)


def test_time_matched_rows_follow_tpp_tuned_and_are_opt_in(tmp_path):
    assert not set(impls.TIME_MATCHED) & set(BenchConfig(models=("mlp",)).impls)
    assert set(impls.TIME_MATCHED) <= set(BASELINES)
    for impls_ in (("metaschedule-1x",), ("metaschedule-10x", "tpp-tuned")):
        with pytest.raises(ValueError, match="put tpp-tuned before it"):
            BenchConfig(models=("mlp",), impls=impls_)
    cfg = BenchConfig(models=("mlp",), impls=("tpp-tuned", "metaschedule-10x"))
    assert cfg.compared == ("tpp-tuned", "metaschedule-10x")
    assert not impls.supports("metaschedule-1x", impls.GemmWorkload(8, 8, 8))


def test_job_carries_the_budget(tmp_path):
    job = Job("metaschedule-1x", 2, "wd", ms_budget=12.5)
    assert Job.from_json(job.to_json()).ms_budget == 12.5
    with pytest.raises(ValueError, match="ms_budget"):
        Job("metaschedule-1x", 2, "wd", ms_budget=-1.0)


def test_a_time_matched_build_without_a_budget_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(impls, "_needs_metaschedule", lambda: None)
    workload = ModelWorkload("m.onnx", "i.npz", "o.npz", "m_1")
    with pytest.raises(ValueError, match="tuning seconds of tpp-tuned"):
        impls.build(Job("metaschedule-10x", 1, str(tmp_path)), workload, print)


# A stand-in worker: every job's impl and budget go to FAKE_RECORD; tpp-tuned reports the
# seconds its search took (or fails, with FAKE_TPP_FAILS), the others copy the reference.
_FAKE_WORKER = textwrap.dedent("""
    import json, os, shutil, sys
    from pathlib import Path

    job = json.loads(sys.argv[1])
    impl, workload = job["impl"], job["workloads"][0]["model"]
    with open(os.environ["FAKE_RECORD"], "a") as record:
        record.write(json.dumps([impl, job["ms_budget"]]) + "\\n")
    out = Path(workload["outputs"])

    def send(message):
        print(json.dumps(message), flush=True)

    if impl == "reference":
        import numpy as np
        with np.load(workload["inputs"]) as stored:
            np.savez(out, out0=stored[stored.files[0]])
    elif impl == "tpp-tuned" and os.environ.get("FAKE_TPP_FAILS"):
        send({"prepared": 0, "error": "RuntimeError: tuning failed"})
        send({"ready": True})
        sys.exit(0)
    else:
        shutil.copy(out.with_name("reference.npz"), out)
    send({"prepared": 0, "ok": True, "compile_seconds": 0.5, "tune_seconds": 0.0,
          "search_seconds": 3.5 if impl == "tpp-tuned" else None, "run_seconds": 0.002,
          "target": "fake", "notes": f"{impl} notes"})
    send({"ready": True})
    for line in sys.stdin:
        if json.loads(line).get("quit"):
            break
        send({"seconds": [0.002]})
""")


def _fake_bench(tmp_path, monkeypatch, tpp_fails: bool):
    model = tmp_path / "dense.onnx"
    onnx.save(make_dense_model(m=4, k=16, n=16), str(model))
    script, record = tmp_path / "fake_worker.py", tmp_path / "record.txt"
    script.write_text(_FAKE_WORKER)
    monkeypatch.setenv("FAKE_RECORD", str(record))
    if tpp_fails:
        monkeypatch.setenv("FAKE_TPP_FAILS", "1")
    cfg = BenchConfig(models=(str(model),), threads=1, repeat=2, pause=0.0,
                      impls=("tpp-tuned", "metaschedule-1x", "metaschedule-10x"),
                      work_dir=tmp_path / "wd", worker_command=(sys.executable, str(script)))
    rows = run_bench(cfg, progress=False)
    jobs = [json.loads(line) for line in record.read_text().splitlines()]
    return cfg, {r.impl: r for r in rows}, jobs


def test_harness_gives_the_rows_tpp_tuned_s_search_seconds(tmp_path, monkeypatch):
    cfg, rows, jobs = _fake_bench(tmp_path, monkeypatch, tpp_fails=False)
    assert jobs == [["reference", None], ["tpp-tuned", None], ["metaschedule-1x", 3.5],
                    ["metaschedule-10x", 3.5]]
    assert all(rows[i].status == "ok" for i in cfg.impls)
    _, _, footnotes = _table(list(rows.values()), cfg)
    assert any("1x / 10x the seconds tpp-tuned's search took" in n for n in footnotes)


def test_without_tpp_tuned_s_time_the_rows_are_skipped(tmp_path, monkeypatch):
    _, rows, jobs = _fake_bench(tmp_path, monkeypatch, tpp_fails=True)
    assert [impl for impl, _ in jobs] == ["reference", "tpp-tuned"]
    assert rows["tpp-tuned"].status == "error"
    for impl in impls.TIME_MATCHED:
        assert rows[impl].status == "skipped" and "tpp-tuned" in rows[impl].error


@pytest.mark.slow
def test_a_budgeted_search_stops_and_builds_from_what_it_measured(tmp_path):
    """A 20 s budget on a one-task model: the search ends within a few batches, keeps what
    they measured, and the model built from that database matches ONNX Runtime."""
    pytest.importorskip("xgboost")
    proto = make_dense_model(m=3, k=24, n=40)
    onnx.save(proto, str(tmp_path / "m.onnx"))
    inputs = random_inputs(input_specs(proto), seed=0)
    np.savez(tmp_path / "inputs.npz", **inputs)
    workload = ModelWorkload(str(tmp_path / "m.onnx"), str(tmp_path / "inputs.npz"),
                             str(tmp_path / "out.npz"), "dense_3")
    start = time.perf_counter()
    built = impls.build(Job("metaschedule-10x", 1, str(tmp_path), ms_budget=2.0), workload,
                        lambda text: None)
    assert time.perf_counter() - start < 600
    trials = int(built.notes.split(" budget: ")[1].split()[0])
    assert trials % impls.BUDGET_TRIALS_PER_ITER == 0 and 0 < trials < 1000, built.notes
    assert built.notes.startswith("10x tpp-tuned's search, a 20.0 s budget")
    assert "1 of 1 tasks measured" in built.notes
    _, rel_err = max_errors(built.run(), run_onnxruntime(proto, inputs, 1))
    assert rel_err < 1e-5


def test_tpp_tuned_reports_its_search_seconds_also_when_reused(tmp_path):
    """What the time-matched rows get: this run's search, or the database's when the
    configurations were tuned by an earlier run."""
    proto = make_dense_model(m=3, k=24, n=40)
    onnx.save(proto, str(tmp_path / "m.onnx"))
    np.savez(tmp_path / "inputs.npz", **random_inputs(input_specs(proto), seed=0))
    workload = ModelWorkload(str(tmp_path / "m.onnx"), str(tmp_path / "inputs.npz"),
                             str(tmp_path / "out.npz"), "dense_3")
    job = Job("tpp-tuned", 1, str(tmp_path / "wd"))
    first = impls.build(job, workload, lambda text: None)
    again = impls.build(job, workload, lambda text: None)
    assert first.tune_seconds > 0 and first.search_seconds == first.tune_seconds
    assert again.tune_seconds == 0 and again.search_seconds == pytest.approx(first.tune_seconds)
