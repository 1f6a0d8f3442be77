"""``tvm-tpp bench-gemm`` (tvm_tpp.bench_gemm): workers, rows, JSON, plot, summary."""

import argparse
import json

import pytest

from schedules.tuner import MARGIN
from tvm_tpp.bench_gemm import ROW_KEYS, add_arguments, parse_shapes, run, summary

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
        # tvm-default runs in the first round only; the row keeps the best round.
        assert len(r["gflops_rounds"]) == (1 if r["impl"] == "tvm-default" else 2), r
        assert r["gflops"] == max(r["gflops_rounds"])
    tuned = [r for r in rows if r["impl"] == "tpp-tuned"]
    assert all(r["note"].startswith("tuned") for r in tuned)  # the tuning round's note
    kernels = [r["note"] for r in rows if r["impl"] in ("tpp", "tpp-tuned")]
    assert all(" kernel, bm x bn x bk x k_step " in note for note in kernels)


def test_explain_relates_model_ranks_to_measurements(bench):
    _, rows, _ = bench
    tuned = [r for r in rows if r["impl"] == "tpp-tuned"]
    for r in tuned:
        ex = r["explain"]
        ranks = [m["model_rank"] for m in ex["measured"]]
        # The default first, then the model's top 2 other than the default.
        assert ranks[0] is None and len(ranks) == 3 and ranks[1] < ranks[2] <= 3
        best = max((m for m in ex["measured"] if m["gflops"]), key=lambda m: m["gflops"])
        assert ex["best_model_rank"] == best["model_rank"]
        assert ex["best_in_model_top5"] == (best["model_rank"] is not None)
        top5 = [m["gflops"] for m in ex["measured"] if m["model_rank"] and m["gflops"]]
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
