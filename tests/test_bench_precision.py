"""``tvm-tpp bench --precision`` and ``tune --precision``: options, jobs, the int8 model.

The harness runs on a stand-in worker that records each job it is given (fast); the real
workers run in the slow test.
"""

import json
import sys
import textwrap

import numpy as np
import onnx
import pytest
from conftest import INT8_KERNELS, ORT_INT8_EXACT, make_dense_model
from onnx import numpy_helper

import tvm_tpp
from tvm_tpp.bench.networks import FLOAT32, TOLERANCES, BenchConfig, Row, judge, run_bench
from tvm_tpp.bench.protocol import Job
from tvm_tpp.bench.workloads import ModelWorkload
from tvm_tpp.cli import _parser, main
from tvm_tpp.quantized import is_quantized, quantize_static_qdq

# Every job goes to FAKE_RECORD as JSON; outputs are the inputs' first array (all rows agree).
_RECORDING_WORKER = textwrap.dedent("""
    import json, os, sys

    import numpy as np

    job = json.loads(sys.argv[1])
    with open(os.environ["FAKE_RECORD"], "a") as record:
        record.write(json.dumps(job) + "\\n")
    workload = job["workloads"][0]["model"]
    with np.load(workload["inputs"]) as stored:
        np.savez(workload["outputs"], out0=stored[stored.files[0]])

    def send(message):
        print(json.dumps(message), flush=True)

    send({"prepared": 0, "ok": True, "compile_seconds": 0.1, "tune_seconds": None,
          "run_seconds": 0.002, "target": "fake", "notes": ""})
    send({"ready": True})
    for line in sys.stdin:
        if json.loads(line).get("quit"):
            break
        send({"seconds": [0.001 if job["impl"] == "tpp" else 0.002]})
""")


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """``recorded(model, precision)``: (rows, {impl or "reference"/"reference-float32": job})
    of a bench run on the stand-in worker."""
    script = tmp_path / "worker.py"
    script.write_text(_RECORDING_WORKER)
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("FAKE_RECORD", str(record))

    def run(model: str, precision: str) -> tuple[list[Row], dict[str, dict], BenchConfig]:
        record.write_text("")
        cfg = BenchConfig(models=(model,), threads=1, repeat=2, pause=0.0,
                          impls=("tpp", "onnxruntime"), work_dir=tmp_path / "wd",
                          precision=precision, worker_command=(sys.executable, str(script)))
        rows = run_bench(cfg, progress=False)
        jobs = {}
        for line in record.read_text().splitlines():
            job = json.loads(line)
            float_ref = job["impl"] == "reference" and job["precision"] == "float32"
            jobs[job["impl"] + ("-float32" if float_ref and precision == "int8" else "")] = job
        return rows, jobs, cfg

    return run


def _model_path(job: dict) -> str:
    return job["workloads"][0]["model"]["model"]


def test_options_parse():
    parser = _parser()
    assert parser.parse_args(["bench", "mlp"]).precision == "float32"
    assert parser.parse_args(["bench", "mlp", "--precision", "int8"]).precision == "int8"
    assert parser.parse_args(["tune", "mlp", "--precision", "bf16"]).precision == "bf16"


@pytest.mark.parametrize("argv, message", [
    (["bench", "mlp", "--precision", "fp16"], "precision must be one of float32, bf16, int8"),
    (["tune", "mlp", "--precision", "int8"], "precision must be one of float32, bf16"),
])
def test_bad_precision_is_a_one_line_error(tmp_path, capsys, argv, message):
    assert main([*argv, "--work-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tvm-tpp: error: {message}") and err.count("\n") == 1


def test_job_carries_the_precision():
    job = Job("tpp", 1, "wd", (ModelWorkload("m.onnx", "i.npz", "o.npz", "m_1"),),
              precision="bf16")
    assert Job.from_json(job.to_json()).precision == "bf16"
    assert Job("tpp", 1, "wd").precision == "float32"
    with pytest.raises(ValueError, match="precision must be one of"):
        Job("tpp", 1, "wd", precision="fp16")


def test_config_adds_the_float32_row_below_float32():
    assert BenchConfig(models=("mlp",), impls=("tpp",)).compared == ("tpp",)
    bf16 = BenchConfig(models=("mlp",), impls=("tpp", "tpp-tuned"), precision="bf16")
    assert bf16.compared == ("tpp", "tpp-tuned", FLOAT32)
    assert bf16.tolerance == TOLERANCES["bf16"] == 2e-2
    assert "--precision bf16" in bf16.command_line()
    with pytest.raises(ValueError, match="adds it"):
        BenchConfig(models=("mlp",), impls=("tpp", FLOAT32), precision="bf16")


def test_judge_holds_the_float32_row_to_the_float32_tolerance():
    rows = [Row("m", 1, 1, "tpp", median_ms=1.0, max_rel_err=5e-3),
            Row("m", 1, 1, FLOAT32, median_ms=2.0, max_rel_err=1e-3)]
    tpp, ref = judge(rows, tolerance=1e-2)
    assert tpp.status == "ok" and ref.status == "WRONG" and "0.0001" in ref.error
    good = judge([rows[0], Row("m", 1, 1, FLOAT32, median_ms=2.0, max_rel_err=1e-6)], 1e-2)
    assert good[0].speedup == {FLOAT32: pytest.approx(2.0)}


def test_bf16_run_builds_tpp_at_bf16_and_float32(recorded, tmp_path):
    path = tmp_path / "dense.onnx"
    onnx.save(make_dense_model(m=4, k=64, n=64), str(path))
    rows, jobs, _ = recorded(str(path), "bf16")
    assert [r.impl for r in rows] == ["tpp", FLOAT32, "onnxruntime"]
    assert all(r.status == "ok" for r in rows)
    assert {i: j["precision"] for i, j in jobs.items()} == {
        "reference": "bf16", "tpp": "bf16", FLOAT32: "float32", "onnxruntime": "bf16"}
    assert len({_model_path(j) for j in jobs.values()}) == 1  # one float model for all
    assert rows[0].speedup == {FLOAT32: pytest.approx(2.0), "onnxruntime": pytest.approx(2.0)}


def test_int8_run_quantizes_once_and_keeps_float32_for_its_row(recorded, tmp_path):
    path = tmp_path / "dense.onnx"
    onnx.save(make_dense_model(m=4, k=64, n=64), str(path))
    rows, jobs, cfg = recorded(str(path), "int8")
    assert [r.impl for r in rows] == ["tpp", FLOAT32, "onnxruntime"]
    assert all(r.status == "ok" for r in rows), rows
    int8 = _model_path(jobs["tpp"])
    assert int8 != str(path) and is_quantized(onnx.load(int8))
    for impl in ("reference", "onnxruntime"):  # ONNX Runtime checks and runs the same file
        assert (_model_path(jobs[impl]), jobs[impl]["precision"]) == (int8, "int8")
    for impl in (FLOAT32, "reference-float32"):
        assert (_model_path(jobs[impl]), jobs[impl]["precision"]) == (str(path), "float32")
    assert jobs["tpp"]["workloads"][0]["model"]["key"] == "dense_4_int8"
    assert cfg.tolerance == TOLERANCES["int8"] == 5e-2
    stamp = (tmp_path / int8).stat().st_mtime_ns
    _, again, _ = recorded(str(path), "int8")
    assert _model_path(again["tpp"]) == int8 and (tmp_path / int8).stat().st_mtime_ns == stamp


def test_reduce_range_quantizes_7bit_weights_into_another_file(tmp_path):
    from tvm_tpp.bench.networks import _int8_model

    model = make_dense_model(m=4, k=64, n=64)
    path = tmp_path / "dense.onnx"
    onnx.save(model, str(path))
    full, _ = _int8_model(model, path, tmp_path)
    reduced, float_path = _int8_model(model, path, tmp_path, reduce_range=True)
    assert full != reduced and float_path == path
    weights = {str(p): [numpy_helper.to_array(t) for t in onnx.load(str(p)).graph.initializer
                        if t.data_type == onnx.TensorProto.INT8 and len(t.dims) == 2]
               for p in (full, reduced)}
    assert max(np.abs(w).max() for w in weights[str(full)]) == 127
    assert max(np.abs(w).max() for w in weights[str(reduced)]) <= 64
    cfg = BenchConfig(models=("mlp",), impls=("tpp",), precision="int8", reduce_range=True)
    assert cfg.command_line().endswith("--precision int8 --reduce-range")
    with pytest.raises(ValueError, match="needs precision int8"):
        BenchConfig(models=("mlp",), impls=("tpp",), reduce_range=True)
    assert _parser().parse_args(["bench", "mlp", "--reduce-range"]).reduce_range


def test_int8_run_takes_a_quantized_file_as_it_is(recorded, tmp_path):
    quantized = quantize_static_qdq(make_dense_model(m=4, k=64, n=64), tmp_path / "q.onnx",
                                    samples=2)
    rows, jobs, _ = recorded(str(quantized), "int8")
    assert _model_path(jobs["tpp"]) == str(quantized)
    by_impl = {r.impl: r for r in rows}
    assert by_impl[FLOAT32].status == "skipped" and "quantized" in by_impl[FLOAT32].error
    assert by_impl["tpp"].status == "ok" and FLOAT32 not in jobs


def test_quantize_static_qdq_dense_layers_run_on_int8_kernels(tmp_path):
    model = make_dense_model(m=4, k=64, n=64)
    quantized = onnx.load(str(quantize_static_qdq(model, tmp_path / "q.onnx", samples=2)))
    kinds = {n.op_type for n in quantized.graph.node}
    # ONNX Runtime's pre-processing fuses the MatMul and its bias Add into one Gemm.
    assert {"QuantizeLinear", "DequantizeLinear", "Gemm"} <= kinds and "Add" not in kinds
    int8 = [list(t.dims) for t in quantized.graph.initializer
            if t.data_type == onnx.TensorProto.INT8]
    assert [64, 64] in int8 and [64] in int8  # s8 weights and their per-channel zero points
    report = tvm_tpp.compile(quantized, target=INT8_KERNELS, untuned=True).report
    assert len(report) == 1
    assert report[0].kernel is not None
    assert (report[0].dtypes, report[0].layout) == ("uint8*int8->int32", "vnni4")


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_cli_bench_precision_end_to_end(tmp_path, capsys, precision):
    out = tmp_path / "bench.json"
    code = main(["bench", "mlp", "--precision", precision, "--impls", "tpp,onnxruntime",
                 "--repeat", "3", "--work-dir", str(tmp_path / "wd"), "--json", str(out), "-q"])
    document = json.loads(out.read_text())
    assert document["settings"]["precision"] == precision
    rows = {r["impl"]: r for r in document["rows"]}
    assert set(rows) == {"tpp", FLOAT32, "onnxruntime"}
    # Without VNNI ONNX Runtime's fused u8 x s8 kernels saturate (conftest.ORT_INT8_EXACT):
    # the bench marks that row WRONG and exits 1, as it should; tpp's rows stay exact.
    ort_wrong = precision == "int8" and not ORT_INT8_EXACT
    assert code == (1 if ort_wrong else 0), capsys.readouterr()
    assert rows["onnxruntime"]["status"] == ("WRONG" if ort_wrong else "ok")
    assert rows["tpp"]["status"] == rows[FLOAT32]["status"] == "ok"
    assert rows["tpp"]["notes"].startswith(f"{precision}: 3/3 matched operators")


def test_tpp_row_says_where_bf16_builds_float32_kernels(tmp_path):
    """A bf16 run's tpp row on a CPU without bf16 arithmetic builds float32 kernels (as
    OpenVINO's default does there) and its note says so."""
    import numpy as np

    import tvm_tpp
    from tvm_tpp import compiler
    from tvm_tpp.bench import impls

    onnx.save(make_dense_model(m=2, k=8, n=4), str(tmp_path / "m.onnx"))
    np.savez(tmp_path / "i.npz", x=np.ones((2, 8), "float32"))
    workload = ModelWorkload(str(tmp_path / "m.onnx"), str(tmp_path / "i.npz"),
                             str(tmp_path / "o.npz"), "m_1")
    built = impls.build(Job("tpp", 1, str(tmp_path), (workload,), precision="bf16"),
                        workload, print)
    note = compiler.precision_note("bf16", tvm_tpp.target("tpp"))
    assert built.notes.startswith("bf16: 1/1 matched operators on TPP kernels")
    assert (note in built.notes) if note else "no bf16 arithmetic" not in built.notes


@pytest.mark.parametrize("precision, optimized", [("float32", True), ("bf16", True),
                                                  ("int8", False)])
def test_int8_reference_is_the_unfused_qdq_graph(tmp_path, monkeypatch, precision, optimized):
    # ONNX Runtime's fused int8 kernels round otherwise than the QDQ graph specifies; the
    # reference of an int8 run is the graph as written, and ORT's own row is checked against it.
    import numpy as np

    from tvm_tpp import reference
    from tvm_tpp.bench import impls
    from tvm_tpp.bench.protocol import REFERENCE

    model = make_dense_model(m=2, k=8, n=4)
    onnx.save(model, str(tmp_path / "m.onnx"))
    np.savez(tmp_path / "i.npz", x=np.ones((2, 8), "float32"))
    calls = []
    monkeypatch.setattr(reference, "run_onnxruntime",
                        lambda proto, inputs, threads=None, optimize=True: calls.append(optimize))
    workload = ModelWorkload(str(tmp_path / "m.onnx"), str(tmp_path / "i.npz"),
                             str(tmp_path / "o.npz"), "m_1")
    built = impls.build(Job(REFERENCE, 1, str(tmp_path), (workload,), precision=precision),
                        workload, print)
    built.run()
    assert calls == [optimized]
