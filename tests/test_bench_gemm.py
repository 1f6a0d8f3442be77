"""``tvm-tpp bench-gemm`` (tvm_tpp.bench_gemm): workers, rows, JSON, plot, summary."""

import argparse
import json
import sys
import textwrap

import psutil
import pytest

from schedules.tuner import MARGIN
from tvm_tpp.bench_gemm import (
    ROW_KEYS,
    BenchConfig,
    add_arguments,
    parse_shapes,
    run,
    run_bench,
    summary,
)

SHAPES = [(64, 64, 64), (48, 80, 32)]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """One run over two small shapes with every fast implementation, at one thread."""
    out = tmp_path_factory.mktemp("bench_gemm")
    argv = ["--shapes", "64x64x64,48x80x32", "--threads", "1", "--against", "numpy,tvm-default",
            "--top-k", "2", "--repeat", "3", "--rounds", "2", "--work-dir", str(out / "wd"),
            "--json", str(out / "rows.json"), "--plot", str(out / "gflops.png"), "--explain",
            "--quiet"]
    status = run(_args(*argv))
    return status, json.loads((out / "rows.json").read_text()), out


def test_rows_cover_every_shape_and_implementation(bench):
    status, rows, _ = bench
    assert status == 0
    assert [(r["m"], r["n"], r["k"], r["impl"]) for r in rows] == [
        (*s, impl) for s in SHAPES for impl in ("tpp", "tpp-tuned", "numpy", "tvm-default")]
    for r in rows:
        assert set(ROW_KEYS) <= set(r), r
        assert r["threads"] == 1
        assert r["gflops"] > 0, r
        assert r["max_abs_err"] < 1e-4, r
        assert r["fraction_of_peak"] is None or r["fraction_of_peak"] > 0
        assert (r["tune_seconds"] is not None) == (r["impl"] == "tpp-tuned"), r
        # tvm-default is timed in the first round only; the row keeps the best round.
        assert len(r["gflops_rounds"]) == (1 if r["impl"] == "tvm-default" else 2), r
        assert r["gflops"] == max(r["gflops_rounds"])
    tuned = [r for r in rows if r["impl"] == "tpp-tuned"]
    assert all(r["note"].startswith("tuned") for r in tuned)  # the preparation's note
    kernels = [r["note"] for r in rows if r["impl"] in ("tpp", "tpp-tuned")]
    assert all(" kernel, bm x bn x bk x k_step " in note for note in kernels)


def test_explain_relates_model_ranks_to_measurements(bench):
    _, rows, _ = bench
    tuned = [r for r in rows if r["impl"] == "tpp-tuned"]
    for r in tuned:
        ex = r["explain"]
        ranks = [m["model_rank"] for m in ex["measured"]]
        # The default first (with its own model rank), then the model's top 2 other than it
        # (1-based; tied predictions share a rank).
        assert [m["default"] for m in ex["measured"]] == [True, False, False]
        assert len(ranks) == 3 and 1 <= ranks[1] <= ranks[2] <= 3
        best = max((m for m in ex["measured"] if m["gflops"]), key=lambda m: m["gflops"])
        assert ex["best_model_rank"] == best["model_rank"]
        assert ex["best_in_model_top5"] == (best["model_rank"] is not None
                                            and best["model_rank"] <= 5)
        # Classes merge predictions within the model's resolution: never behind the rank.
        assert all(m["model_class"] <= m["model_rank"] for m in ex["measured"])
        assert ex["best_in_model_top5_classes"] == (best["model_class"] <= 5)
        top5 = [m["gflops"] for m in ex["measured"]
                if m["model_rank"] and m["model_rank"] <= 5 and m["gflops"]]
        assert ex["top5_within_margin"] == (max(top5) >= best["gflops"] * (1 - MARGIN))
    assert all("explain" not in r for r in rows if r["impl"] != "tpp-tuned")


def test_plot_is_a_png(bench):
    _, _, out = bench
    assert (out / "gflops.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_warm_database_is_reused_and_slow_baselines_are_skipped(bench):
    _, first, out = bench
    argv = ["--shapes", "64x64x64", "--threads", "1", "--against", "tvm-default", "--top-k", "2",
            "--repeat", "2", "--work-dir", str(out / "wd"), "--json", str(out / "again.json"),
            "--tvm-default-limit", "1e-9", "--quiet"]
    assert run(_args(*argv)) == 0
    rows = {r["impl"]: r for r in json.loads((out / "again.json").read_text())}
    tuned = rows["tpp-tuned"]
    assert tuned["note"].startswith("database hit")
    assert tuned["tune_seconds"] == next(r["tune_seconds"] for r in first
                                         if r["impl"] == "tpp-tuned" and r["m"] == 64)
    skipped = rows["tvm-default"]
    assert skipped["gflops"] is None and skipped["max_abs_err"] is None
    assert skipped["note"].startswith("skipped: one run would take")


def test_summary_ratios():
    rows = [
        {"m": 8, "n": 8, "k": 8, "threads": 2, "impl": "tpp-tuned", "gflops": 90.0,
         "tune_seconds": 10.0},
        {"m": 8, "n": 8, "k": 8, "threads": 2, "impl": "numpy", "gflops": 60.0,
         "tune_seconds": None},
        {"m": 8, "n": 8, "k": 8, "threads": 2, "impl": "metaschedule", "gflops": 45.0,
         "tune_seconds": 300.0},
        {"m": 4, "n": 8, "k": 8, "threads": 1, "impl": "tpp-tuned", "gflops": 10.0,
         "tune_seconds": 1.0},
    ]
    first, second = summary(rows)
    assert (first["vs_numpy"], first["vs_metaschedule"], first["ms_tune_time_ratio"]) == (
        1.5, 2.0, 30.0)
    assert (second["m"], second["vs_numpy"], second["vs_metaschedule"]) == (4, None, None)


def test_bad_options_raise_value_errors():
    assert parse_shapes("512x512x512, 128X768x768") == ((512, 512, 512), (128, 768, 768))
    for text in ("64x64", "64x0x64", "axbxc", ""):
        with pytest.raises(ValueError, match="MxNxK"):
            parse_shapes(text)
    with pytest.raises(ValueError, match="--against"):
        run(_args("--against", "onnxruntime"))
    with pytest.raises(ValueError, match="--threads"):
        run(_args("--threads", "0"))
    with pytest.raises(ValueError, match="top_k"):
        run(_args("--top-k", "0"))
    with pytest.raises(ValueError, match="rounds"):
        run(_args("--rounds", "0"))
    assert _args().rounds == 5
    with pytest.raises(ValueError, match="pause"):
        BenchConfig(pause=-1)
    with pytest.raises(ValueError, match="timeout"):
        BenchConfig(timeout=0)


# A stand-in worker that speaks the protocol without TVM, and records what it is asked.
_FAKE_WORKER = textwrap.dedent("""
    import json, os, sys

    job = json.loads(sys.argv[1])
    impl, threads = job["impl"], job["threads"]
    record = open(os.environ["FAKE_RECORD"], "a", buffering=1)
    if impl == "peak":  # 3.0 GFLOPS, then 2.0
        earlier = open(os.environ["FAKE_RECORD"]).read().count("peak")
        record.write(f"peak {os.environ['TVM_NUM_THREADS']}\\n")
        print(json.dumps({"peak": {"isa": "fake", "gflops_per_core": 3.0 - earlier,
                                   "clock_ghz": 1.0}}), flush=True)
        sys.exit(0)
    env = [os.environ[v] for v in ("TVM_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                   "OMP_NUM_THREADS", "MKL_NUM_THREADS")]
    record.write(f"start {impl} {threads} {','.join(env)}\\n")
    for index, (m, n, k) in enumerate(job["shapes"]):
        print(json.dumps({"step": "build", "shape": [m, n, k]}), flush=True)
        row = {"m": m, "n": n, "k": k, "threads": threads, "impl": impl, "gflops": None,
               "fraction_of_peak": None, "tune_seconds": None, "max_abs_err": 0.0,
               "note": "fake", "gflops_rounds": None}
        print(json.dumps({"prepared": index, "row": row, "run_seconds": 1e-3}), flush=True)
    record.write(f"ready {impl} {threads}\\n")
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            break
        record.write(f"time {impl} {threads} {request['time']}\\n")
        print(json.dumps({"seconds": 1e-3}), flush=True)
""")


def test_workers_prepare_in_turn_then_alternate(tmp_path, monkeypatch):
    script = tmp_path / "fake_worker.py"
    script.write_text(_FAKE_WORKER)
    record = tmp_path / "record.txt"
    monkeypatch.setenv("FAKE_RECORD", str(record))
    impls = ("tpp", "tpp-tuned", "numpy", "tvm-default")
    config = BenchConfig(shapes=((64, 64, 64), (32, 32, 32)), threads=(1, 2), impls=impls,
                         work_dir=tmp_path / "wd", rounds=3, pause=0.0,
                         worker_command=(sys.executable, str(script)))
    result = run_bench(config, progress=False)
    lines = record.read_text().splitlines()
    for threads in (1, 2):
        mine = [line for line in lines
                if (line.split()[2] if line.startswith(("start", "ready", "time"))
                    else None) == str(threads)]
        env = ",".join([str(threads)] * 4)
        # One worker after another: each is ready before the next starts, all before timing.
        assert mine[:8] == [x for i in impls for x in (f"start {i} {threads} {env}",
                                                       f"ready {i} {threads}")]
        # Per shape, rounds rotate the first worker and reverse every other round;
        # tvm-default is timed in the first round only.
        order = [[*impls], ["tpp", "numpy", "tpp-tuned"], ["numpy", "tpp", "tpp-tuned"]]
        assert mine[8:] == [f"time {i} {threads} {shape}" for shape in (0, 1)
                            for round_ in order for i in round_]
    # The peak is measured once per thread count, after preparation, on one thread.
    assert [line for line in lines if line.startswith("peak")] == ["peak 1", "peak 1"]
    assert lines.index("peak 1") == lines.index("ready tvm-default 1") + 1
    assert result.peak["gflops_per_core"] == 3.0  # the fastest of the two
    assert len(result.rows) == 2 * 2 * 4
    for row in result.rows:
        assert len(row["gflops_rounds"]) == (1 if row["impl"] == "tvm-default" else 3), row
        assert row["gflops"] == max(row["gflops_rounds"]) > 0
        assert row["note"] == "fake" and row["max_abs_err"] == 0.0
    assert {"tpp/t1", "timing/t1", "tvm-default/t2", "timing/t2"} <= set(result.wall_seconds)
    assert not psutil.Process().children(recursive=True)


# The real worker, with faults: hangs, aborts, and failures in preparation and timing.
_FAULTY_WORKER = textwrap.dedent("""
    import json, os, sys, time

    import tvm_tpp.bench_gemm as bg

    impl = json.loads(sys.argv[1])["impl"]
    if impl == "tpp-tuned":
        time.sleep(600)                               # hangs while preparing
    if impl == "numpy":
        print("numpy gave up", file=sys.stderr, flush=True)
        os.abort()                                    # dies while preparing
    if impl == "tvm-default":                         # the second shape fails to build
        build = bg._PREPARE["tvm-default"]

        def failing(job, m, n, k, *args):
            if m == 48:
                raise RuntimeError("no such luck")
            return build(job, m, n, k, *args)

        bg._PREPARE["tvm-default"] = failing
    if impl == "tpp":                                 # third measurement fails, fourth dies
        best = bg._best_seconds
        calls = []

        def flaky(*args):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("flaky")
            if len(calls) == 4:
                print("dying on purpose", file=sys.stderr, flush=True)
                os._exit(7)
            return best(*args)

        bg._best_seconds = flaky
    sys.exit(bg.worker_main(sys.argv[1:]))
""")


def test_failing_workers_become_error_rows(tmp_path):
    script = tmp_path / "faulty_worker.py"
    script.write_text(_FAULTY_WORKER)
    shapes = ((64, 64, 64), (48, 80, 32), (32, 32, 32))
    config = BenchConfig(shapes=shapes, threads=(1,), work_dir=tmp_path / "wd", repeat=2,
                         rounds=2, pause=0.0, timeout=15,
                         worker_command=(sys.executable, str(script)))
    result = run_bench(config, progress=False)
    rows = {(r["impl"], r["m"]): r for r in result.rows}
    assert len(result.rows) == 4 * 3 and all(set(ROW_KEYS) <= set(r) for r in result.rows)
    for m, _, _ in shapes:
        hung, aborted = rows[("tpp-tuned", m)], rows[("numpy", m)]
        assert hung["note"].startswith("error: during preparation: timed out after 15 s")
        assert aborted["note"].startswith("error: during preparation: worker killed by "
                                          "SIGABRT: numpy gave up")
        for row in (hung, aborted):
            assert row["gflops"] is None and row["gflops_rounds"] == [None, None]
    # tpp: both rounds of the first shape, then an error reply (the worker lives on), then
    # death: the shapes it did not finish are error rows.
    first, flaky, dead = (rows[("tpp", m)] for m, _, _ in shapes)
    assert " kernel, bm x bn x bk x k_step " in first["note"]
    assert first["gflops"] > 0 and len(first["gflops_rounds"]) == 2
    assert None not in first["gflops_rounds"] and first["max_abs_err"] < 1e-4
    assert flaky["note"].startswith("error: timing round 1: RuntimeError: flaky")
    assert flaky["gflops"] is None and flaky["gflops_rounds"] == [None, None]
    assert dead["note"].startswith("error: timing round 1: worker exited with status 7: "
                                   "dying on purpose")
    assert dead["gflops"] is None and dead["max_abs_err"] < 1e-4  # prepared, not timed
    # tvm-default: the failed build is an error row; the other shapes are timed once.
    assert rows[("tvm-default", 48)]["note"] == "error: RuntimeError: no such luck"
    for m in (64, 32):
        row = rows[("tvm-default", m)]
        assert row["gflops"] > 0 and len(row["gflops_rounds"]) == 1
    assert result.peak is not None  # the real peak worker still ran
    assert not psutil.Process().children(recursive=True)  # the hung worker was killed


@pytest.mark.slow
def test_metaschedule_baseline_tunes_then_reuses(tmp_path):
    argv = ["--shapes", "64x64x64", "--threads", "1", "--against", "metaschedule",
            "--ms-trials", "4", "--top-k", "1", "--repeat", "2", "--work-dir", str(tmp_path),
            "--json", str(tmp_path / "rows.json"), "--quiet"]
    assert run(_args(*argv)) == 0
    ms = next(r for r in json.loads((tmp_path / "rows.json").read_text())
              if r["impl"] == "metaschedule")
    assert ms["gflops"] > 0 and ms["max_abs_err"] < 1e-4 and ms["tune_seconds"] > 0
    assert run(_args(*argv)) == 0
    again = next(r for r in json.loads((tmp_path / "rows.json").read_text())
                 if r["impl"] == "metaschedule")
    assert "reused" in again["note"] and again["tune_seconds"] == ms["tune_seconds"]
