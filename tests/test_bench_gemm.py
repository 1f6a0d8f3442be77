"""``tvm-tpp bench-gemm`` (tvm_tpp.bench.gemm): workers, rows, JSON, plot, summary.

Stand-in workers drive the harness in the default suite; real workers run in the slow tests.
"""

import argparse
import json
import sys
import textwrap

import numpy as np
import psutil
import pytest

from schedules.tuner import MARGIN
from tvm_tpp.bench.gemm import (
    ROW_KEYS,
    BenchConfig,
    BenchResult,
    add_arguments,
    parse_shapes,
    run,
    run_bench,
    summary,
)
from tvm_tpp.errors import UsageError

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


@pytest.mark.slow
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


@pytest.mark.slow
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
        assert sum(m["kept"] for m in ex["measured"]) == 1
    assert all("explain" not in r for r in rows if r["impl"] != "tpp-tuned")


@pytest.mark.slow
def test_plot_is_a_png(bench):
    _, _, out = bench
    assert (out / "gflops.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_warm_database_is_reused_and_slow_baselines_are_skipped(bench):
    _, first, out = bench
    argv = ["--shapes", "64x64x64", "--threads", "1", "--against", "tvm-default", "--top-k", "2",
            "--repeat", "2", "--work-dir", str(out / "wd"), "--json", str(out / "again.json"),
            "--tvm-default-limit", "1e-9", "--quiet"]
    assert run(_args(*argv)) == 0
    rows = {r["impl"]: r for r in json.loads((out / "again.json").read_text())}
    tuned = rows["tpp-tuned"]
    earlier = next(r["tune_seconds"] for r in first if r["impl"] == "tpp-tuned" and r["m"] == 64)
    assert tuned["note"].startswith(f"database hit (cached: tuned earlier in {earlier:.1f} s)")
    assert tuned["tune_seconds"] == 0.0  # nothing searched in this run
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
    with pytest.raises(UsageError, match="--against"):
        run(_args("--against", "onnxruntime"))
    with pytest.raises(UsageError, match="--threads"):
        run(_args("--threads", "0"))
    with pytest.raises(UsageError, match="top_k"):
        run(_args("--top-k", "0"))
    with pytest.raises(UsageError, match="rounds"):
        run(_args("--rounds", "0"))
    with pytest.raises(UsageError, match="samples"):
        run(_args("--repeat", "0"))
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

    def send(message):
        print(json.dumps(message), flush=True)

    if impl == "peak":  # 3.0 GFLOPS, then 2.0
        earlier = open(os.environ["FAKE_RECORD"]).read().count("peak")
        record.write(f"peak {os.environ['TVM_NUM_THREADS']}\\n")
        send({"peak": {"isa": "fake", "gflops_per_core": 3.0 - earlier, "clock_ghz": 1.0}})
        sys.exit(0)
    env = [os.environ[v] for v in ("TVM_NUM_THREADS", "OMP_NUM_THREADS",
                                   "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")]
    record.write(f"start {impl} {threads} {','.join(env)}\\n")
    for index, workload in enumerate(job["workloads"]):
        send({"step": "build", "workload": index})
        if impl == "tvm-default" and index == 1:
            send({"prepared": index, "skipped": "too slow"})
            continue
        send({"prepared": index, "ok": True, "compile_seconds": 0.0, "tune_seconds": None,
              "run_seconds": 1e-3, "target": "", "notes": "fake", "max_abs_err": 0.0})
    record.write(f"ready {impl} {threads}\\n")
    send({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            break
        record.write(f"time {impl} {threads} {request['time']} {request['number']} "
                     f"{request['repeat']} {request['warmup']}\\n")
        send({"seconds": [2e-3, 1e-3, 4e-3]})
""")


def test_workers_prepare_in_turn_then_alternate(tmp_path, monkeypatch):
    script = tmp_path / "fake_worker.py"
    script.write_text(_FAKE_WORKER)
    record = tmp_path / "record.txt"
    monkeypatch.setenv("FAKE_RECORD", str(record))
    impls = ("tpp", "tpp-tuned", "numpy", "tvm-default")
    shapes = ((64, 64, 64), (32, 32, 32))
    config = BenchConfig(shapes=shapes, threads=(1, 2), impls=impls, work_dir=tmp_path / "wd",
                         rounds=3, pause=0.0, worker_command=(sys.executable, str(script)))
    result = run_bench(config, progress=False)
    lines = record.read_text().splitlines()
    for threads in (1, 2):
        mine = [line for line in lines
                if (line.split()[2] if line.startswith(("start", "ready", "time"))
                    else None) == str(threads)]
        # Thread pools get the job's threads; BLAS only where it is timed (numpy).
        env = {i: f"{threads},{threads}," + (f"{threads},{threads}" if i == "numpy" else "1,1")
               for i in impls}
        # One worker after another: each is ready before the next starts, all before timing.
        assert mine[:8] == [x for i in impls for x in (f"start {i} {threads} {env[i]}",
                                                       f"ready {i} {threads}")]
        # Per shape, rounds rotate the first worker and reverse every other round;
        # tvm-default is timed in the first round only, and not at all where it skipped.
        # A 1 ms run: samples of one run, as many as fit in 0.4 s, at most 200.
        order = [[*impls], ["tpp", "numpy", "tpp-tuned"], ["numpy", "tpp", "tpp-tuned"]]
        assert mine[8:] == [f"time {i} {threads} {shape} 1 200 True" for shape in (0, 1)
                            for round_ in order for i in round_
                            if (i, shape) != ("tvm-default", 1)]
    # The peak is measured once per thread count, after preparation, on one thread.
    assert [line for line in lines if line.startswith("peak")] == ["peak 1", "peak 1"]
    assert lines.index("peak 1") == lines.index("ready tvm-default 1") + 1
    assert result.peak["gflops_per_core"] == 3.0  # the fastest of the two
    assert len(result.rows) == 2 * 2 * 4
    for row in result.rows:
        if (row["impl"], row["m"]) == ("tvm-default", 32):
            assert row["note"] == "skipped: too slow" and row["gflops"] is None
            continue
        assert len(row["gflops_rounds"]) == (1 if row["impl"] == "tvm-default" else 3), row
        # The fastest sample makes a round's figure.
        assert row["gflops"] == max(row["gflops_rounds"]) == pytest.approx(
            2 * row["m"] ** 3 / 1e-3 / 1e9)
        assert row["fraction_of_peak"] == pytest.approx(row["gflops"] / 3.0 / row["threads"])
        assert row["note"] == "fake" and row["max_abs_err"] == 0.0
    assert {"tpp/t1", "timing/t1", "tvm-default/t2", "timing/t2"} <= set(result.wall_seconds)
    assert not psutil.Process().children(recursive=True)


def test_report_prints_rows_summary_and_explanation(capsys):
    from tvm_tpp.bench.report import print_gemm_report

    explained = {"measured": [
        {"model_rank": 2, "model_class": 1, "default": True, "predicted_cycles": 3e6,
         "gflops": 10.0, "config": "BCa bm=64", "error": None, "kept": False},
        {"model_rank": 1, "model_class": 1, "default": False, "predicted_cycles": 2e6,
         "gflops": 12.0, "config": "aBC bm=32", "error": None, "kept": True}],
        "best_model_rank": 1, "best_model_class": 1, "best_in_model_top5": True,
        "best_in_model_top5_classes": True, "top5_within_margin": True}
    rows = [{"m": 8, "n": 8, "k": 8, "threads": 1, "impl": "tpp-tuned", "gflops": 12.0,
             "fraction_of_peak": 0.5, "tune_seconds": 0.0, "max_abs_err": 1e-6,
             "note": "database hit (cached)", "gflops_rounds": [12.0], "explain": explained},
            {"m": 8, "n": 8, "k": 8, "threads": 1, "impl": "numpy", "gflops": 6.0,
             "fraction_of_peak": 0.25, "tune_seconds": None, "max_abs_err": 1e-6,
             "note": None, "gflops_rounds": [6.0]}]
    print_gemm_report(BenchResult(rows, {"isa": "fake", "gflops_per_core": 24.0,
                                         "clock_ghz": 1.5}, {"timing/t1": 3.0}), explain=True)
    out = capsys.readouterr().out
    assert "database hit (cached)" in out and "50.0" in out and "2.00" in out  # vs numpy
    assert "24.0 GFLOPS per core" in out and "timing/t1 3 s" in out
    table = out[out.index("model ranking vs measurement"):]
    assert table.index("aBC bm=32") < table.index("BCa bm=64")  # in model-rank order
    assert "2 (default)" in table and "12.0 *" in table and "* = kept" in table
    assert "over 1 tunings" in out


# The real worker, with faults: hangs, aborts, and failures in preparation and timing.
_FAULTY_WORKER = textwrap.dedent("""
    import dataclasses, json, os, sys, time

    from tvm_tpp.bench import impls, protocol

    impl = json.loads(sys.argv[1])["impl"]
    if impl == "tpp-tuned":
        time.sleep(600)                               # hangs while preparing
    if impl == "numpy":
        print("numpy gave up", file=sys.stderr, flush=True)
        os.abort()                                    # dies while preparing
    build = impls.build
    calls = []

    def faulty(job, workload, say):
        if job.impl == "tvm-default" and workload.m == 48:
            raise RuntimeError("no such luck")        # the second shape fails to build
        built = build(job, workload, say)
        if job.impl != "tpp":
            return built

        def timer(number, repeat, warmup):            # third measurement fails, fourth dies
            if repeat > 1:                            # a measurement, not a probe
                calls.append(1)
                if len(calls) == 3:
                    raise RuntimeError("flaky")
                if len(calls) == 4:
                    print("dying on purpose", file=sys.stderr, flush=True)
                    os._exit(7)
            return built.timer(number, repeat, warmup)

        return dataclasses.replace(built, timer=timer)

    impls.build = faulty
    sys.exit(protocol.main(sys.argv[1:]))
""")


@pytest.mark.slow
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
    assert "reused" in again["note"] and again["tune_seconds"] == 0.0
    assert f"searched earlier in {ms['tune_seconds']:.1f} s" in again["note"]


# ------------------------------------------------------------------------------------------
# --dtype int8 | bfloat16: low-precision GEMMs against tpp float32 and torch.


def test_dtype_option_parses_and_picks_the_rows():
    from tvm_tpp.bench.gemm import _config

    assert _args().dtype == "float32" and _config(_args()).impls == (
        "tpp", "tpp-tuned", "numpy", "tvm-default")  # float32 as before
    int8 = _config(_args("--dtype", "int8", "--shapes", "8x8x8"))
    assert int8.dtype == "int8"
    assert int8.impls == ("tpp", "tpp-tuned", "tpp-float32", "numpy", "torch")
    assert _config(_args("--dtype", "bfloat16", "--against", "none")).impls == (
        "tpp", "tpp-tuned", "tpp-float32")
    # The torch row runs the low-precision GEMMs; tpp-float32 and numpy the float32 ones.
    jobs = {i: int8.job(i, 1) for i in int8.impls}
    assert {i: j.impl for i, j in jobs.items()} == {i: i for i in int8.impls}
    assert {i: j.workloads[0].dtype for i, j in jobs.items()} == {
        "tpp": "int8", "tpp-tuned": "int8", "tpp-float32": "float32", "numpy": "float32",
        "torch": "int8"}


@pytest.mark.parametrize("argv, match", [
    (("--dtype", "int4"), "--dtype takes float32, int8, bfloat16, got 'int4'"),
    (("--dtype", "int8", "--against", "tvm-default"), "tvm-default runs float32 GEMMs only"),
    (("--against", "numpy,torch"), "torch runs GEMMs in int8 or bfloat16 only"),
])
def test_wrong_dtype_is_one_error_line(argv, match, capsys):
    from tvm_tpp.cli import main

    with pytest.raises(UsageError, match=match):
        run(_args(*argv))
    assert main(["bench-gemm", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tvm-tpp: error: ") and match in err


def test_low_precision_checks():
    from tvm_tpp.bench.workloads import GemmWorkload

    int8 = GemmWorkload(5, 6, 7, "int8")
    x, w = int8.operands(0)
    assert (x.dtype, w.dtype) == (np.uint8, np.int8) and x.max() > 127 and w.min() < 0
    exact = (x.astype(np.int64) @ w.astype(np.int64)).astype(np.int32)
    assert int8.check([exact], 0) == {"max_abs_err": 0.0}
    with pytest.raises(ValueError, match="not exact: 1 of 30 outputs"):
        int8.check([exact + (np.arange(30).reshape(5, 6) == 3)], 0)
    bf16 = GemmWorkload(5, 6, 64, "bfloat16")
    x, w = bf16.operands(0)
    y = x.astype(np.float32) @ w.astype(np.float32)
    assert bf16.check([y], 0)["max_abs_err"] < 1e-4
    # A bf16 output (a library's) is within the tolerance; an error of 1 % is not.
    assert bf16.check([y.astype(x.dtype).astype(np.float32)], 0)["max_abs_err"] > 1e-4
    with pytest.raises(ValueError, match="bf16 GEMM outside tolerance"):
        bf16.check([y * 1.01], 0)


@pytest.mark.parametrize("dtype, shape", [("int8", (16, 32, 64)), ("int8", (3, 16, 10)),
                                          ("bfloat16", (16, 32, 32)), ("bfloat16", (4, 16, 9))])
def test_tpp_low_precision_gemms_pass_their_checks(dtype, shape):
    from tvm_tpp.bench import impls, protocol
    from tvm_tpp.bench.workloads import GemmWorkload

    answer, timer = protocol._prepare(protocol.Job("tpp", 1, "wd"), 0,
                                      GemmWorkload(*shape, dtype), print)
    assert answer.get("ok"), answer
    assert timer is not None and answer["run_seconds"] > 0
    if dtype == "int8":
        assert answer["max_abs_err"] == 0.0
    from microkernels.machine import host_isa

    feature = impls.native_feature(host_isa(), dtype)
    assert answer["notes"].startswith({"int8": "uint8 x int8 -> int32 ",
                                       "bfloat16": "bfloat16 x bfloat16 -> float32 "}[dtype])
    assert (f"on {feature};" if feature else "EMULATED") in answer["notes"]


def test_emulated_dtype_says_so():
    from tvm_tpp.bench import impls, protocol
    from tvm_tpp.bench.workloads import GemmWorkload
    from tvm_tpp.tpp_target import target

    workload = GemmWorkload(8, 16, 8, "bfloat16")
    avx2 = target("tpp -isa=avx2 -num-cores=1")
    from microkernels.machine import machine_of
    from schedules.gemm import default_config

    config = default_config(impls.gemm_problem(workload), machine_of(avx2))
    built = impls._tpp_gemm(protocol.Job("tpp", 1, "wd"), workload, config, avx2)
    assert built.notes.startswith("bfloat16 x bfloat16 -> float32 EMULATED (avx2 lacks ")
    assert workload.check(built.run(), 0)["max_abs_err"] < 1e-4


@pytest.mark.parametrize("dtype, units", [("int8", "uint8 x int8 -> int32 on amx_int8"),
                                          ("bfloat16", "bfloat16 x bfloat16 -> float32 on "
                                                       "amx_bf16")])
def test_amx_builds_tile_shaped_defaults(dtype, units):
    """Built (not run: any host compiles AMX code) for ``tpp -isa=amx``: the default blocks are
    tile-shaped and the AMX kernel multiplies them."""
    from microkernels.machine import machine_of
    from schedules.gemm import default_config
    from tvm_tpp.bench import impls, protocol
    from tvm_tpp.bench.workloads import GemmWorkload
    from tvm_tpp.tpp_target import target

    workload = GemmWorkload(64, 64, 128, dtype)
    amx = target("tpp -isa=amx -num-cores=1")
    config = default_config(impls.gemm_problem(workload), machine_of(amx))
    built = impls._tpp_gemm(protocol.Job("tpp", 1, "wd"), workload, config, amx)
    assert built.notes.startswith(f"{units}; amx kernel, bm x bn x bk x k_step 32x32x")


def test_torch_absent_skips_its_row(monkeypatch):
    from tvm_tpp.bench import protocol
    from tvm_tpp.bench.workloads import GemmWorkload

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    for dtype in ("int8", "bfloat16"):
        assert protocol._prepare(protocol.Job("torch", 1, "wd"), 2,
                                 GemmWorkload(8, 8, 8, dtype), print) == (
            {"prepared": 2, "skipped": "torch not installed"}, None)


# A stand-in worker for a low-precision run: 1 ms per float32 GEMM, 0.25 ms per int8 one;
# the torch job has no torch.
_FAKE_LOWP_WORKER = textwrap.dedent("""
    import json, os, sys

    job = json.loads(sys.argv[1])
    record = open(os.environ["FAKE_RECORD"], "a", buffering=1)

    def send(message):
        print(json.dumps(message), flush=True)

    if job["impl"] == "peak":
        send({"peak": {"isa": "fake", "gflops_per_core": 3.0, "clock_ghz": 1.0}})
        sys.exit(0)
    dtypes = [w["gemm"].get("dtype", "float32") for w in job["workloads"]]
    record.write(f"start {job['impl']} {','.join(dtypes)}\\n")
    for index, dtype in enumerate(dtypes):
        if job["impl"] == "torch":
            send({"prepared": index, "skipped": "torch not installed"})
            continue
        send({"prepared": index, "ok": True, "compile_seconds": 0.0, "tune_seconds": None,
              "run_seconds": 1e-3, "target": "", "notes": dtype, "max_abs_err": 0.0})
    send({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            break
        send({"seconds": [1e-3 if dtypes[request["time"]] == "float32" else 2.5e-4]})
""")


def test_low_precision_rows_have_ratios_and_fractions(tmp_path, monkeypatch, capsys):
    from microkernels.machine import host_isa
    from tvm_tpp.bench.gemm import dtype_peak, print_lowp_report

    script = tmp_path / "fake_lowp_worker.py"
    script.write_text(_FAKE_LOWP_WORKER)
    record = tmp_path / "record.txt"
    monkeypatch.setenv("FAKE_RECORD", str(record))
    config = BenchConfig(shapes=((64, 64, 64), (32, 32, 32)), threads=(1,), dtype="int8",
                         impls=("tpp", "numpy", "torch"), work_dir=tmp_path / "wd", rounds=2,
                         pause=0.0, worker_command=(sys.executable, str(script)))
    result = run_bench(config, progress=False)
    assert record.read_text().splitlines() == [
        "start tpp int8,int8", "start tpp-float32 float32,float32",
        "start numpy float32,float32", "start torch int8,int8"]
    assert [(r["m"], r["impl"], r["dtype"]) for r in result.rows] == [
        (m, impl, dtype) for m in (64, 32) for impl, dtype in (
            ("tpp", "int8"), ("tpp-float32", "float32"), ("numpy", "float32"),
            ("torch", "int8"))]
    peak = dtype_peak("int8", host_isa(), result.peak)
    assert result.dtype == "int8" and result.dtype_peak["gops_per_core"] == (
        peak and peak[0])
    for row in result.rows:
        assert set(ROW_KEYS) <= set(row), row
        if row["impl"] == "torch":
            assert row["note"] == "skipped: torch not installed" and row["gflops"] is None
            assert row["ratio_to_fp32"] is None and row["fraction_of_dtype_peak"] is None
            continue
        gops = 2 * row["m"] ** 3 / (2.5e-4 if row["dtype"] == "int8" else 1e-3) / 1e9
        assert row["gflops"] == pytest.approx(gops)
        assert row["ratio_to_fp32"] == pytest.approx(4.0 if row["impl"] == "tpp" else 1.0)
        assert row["fraction_of_peak"] == pytest.approx(gops / 3.0)
        assert row["fraction_of_dtype_peak"] == (peak and pytest.approx(gops / peak[0]))
    print_lowp_report(result)
    out = capsys.readouterr().out
    assert "int8 GEMM Y = X @ W, uint8 X x int8 W -> int32" in out
    assert "skipped: torch not installed" in out and "4.00" in out
    result.rows[0]["explain"] = {"measured": [
        {"model_rank": None, "model_class": None, "default": True, "predicted_cycles": None,
         "gflops": 10.0, "config": "BCa bm=64", "error": None, "kept": True}],
        "best_model_rank": None}
    print_lowp_report(result, explain=True)
    assert "64x64x64 t1 int8: model ranking vs measurement" in capsys.readouterr().out
    assert not psutil.Process().children(recursive=True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_low_precision_run_end_to_end(dtype, tmp_path):
    argv = ["--dtype", dtype, "--shapes", "32x32x64", "--threads", "1", "--top-k", "1",
            "--repeat", "1", "--rounds", "1", "--work-dir", str(tmp_path / "wd"), "--json",
            str(tmp_path / "rows.json"), "--quiet"]
    assert run(_args(*argv)) == 0
    rows = {r["impl"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    assert set(rows) == {"tpp", "tpp-tuned", "tpp-float32", "numpy", "torch"}
    for impl in ("tpp", "tpp-tuned", "tpp-float32", "numpy"):
        row = rows[impl]
        assert row["gflops"] > 0 and row["ratio_to_fp32"] > 0, row
        assert row["dtype"] == (dtype if impl.startswith("tpp") and impl != "tpp-float32"
                                else "float32")
    assert rows["tpp-float32"]["ratio_to_fp32"] == 1.0
    if dtype == "int8":
        assert rows["tpp"]["max_abs_err"] == 0.0 == rows["tpp-tuned"]["max_abs_err"]
    try:
        import torch  # noqa: F401
    except ImportError:
        assert rows["torch"]["note"] == "skipped: torch not installed"
    else:  # PyTorch's matmul in the same units, checked as tpp's
        assert rows["torch"]["gflops"] > 0 and rows["torch"]["dtype"] == dtype, rows["torch"]
        assert rows["torch"]["note"].startswith("torch ")
