"""The ``openvino`` and ``openvino-f32`` rows of ``tvm-tpp bench`` (the optional extra).

Built in this process (as a worker builds them) on a tiny dense model and checked against
ONNX Runtime; without ``openvino`` the rows are skipped with the reason.
"""

import builtins
import sys

import numpy as np
import onnx
import pytest
from conftest import make_dense_model, runs_here

from tvm_tpp.bench import impls
from tvm_tpp.bench.networks import IMPLS, TOLERANCE, TOLERANCES, Row, judge
from tvm_tpp.bench.protocol import Job, _prepare
from tvm_tpp.bench.workloads import ModelWorkload
from tvm_tpp.onnx_import import input_specs
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime


@pytest.fixture
def tiny(tmp_path):
    """(workload, ONNX Runtime's outputs) of a 4x24 @ 24x40 + b -> relu model."""
    proto = make_dense_model()
    onnx.save(proto, str(tmp_path / "m.onnx"))
    inputs = random_inputs(input_specs(proto), seed=0)
    np.savez(tmp_path / "inputs.npz", **inputs)
    workload = ModelWorkload(str(tmp_path / "m.onnx"), str(tmp_path / "inputs.npz"),
                             str(tmp_path / "out.npz"), "dense_4")
    return workload, run_onnxruntime(proto, inputs, 1)


def test_openvino_rows_are_bench_implementations():
    assert IMPLS[-2:] == ("openvino", "openvino-f32")


@pytest.mark.parametrize("impl", ["openvino", "openvino-f32"])
def test_openvino_builds_runs_and_matches_onnxruntime(tiny, tmp_path, impl):
    pytest.importorskip("openvino")
    workload, expected = tiny
    built = impls.build(Job(impl, 1, str(tmp_path)), workload, lambda text: None)
    _, rel_err = max_errors(built.run(), expected)
    ran = built.notes.partition(":")[0]
    assert ran in ("float32", "bf16")
    assert rel_err <= TOLERANCES[ran]
    assert built.target.startswith("openvino ") and built.compile_seconds > 0
    assert all(s > 0 for s in built.timer(2, 2, True))


def test_openvino_f32_sets_the_precision_hint(tiny, tmp_path, monkeypatch):
    ov = pytest.importorskip("openvino")
    import openvino.properties.hint as hints

    compiled = []
    original = ov.Core.compile_model

    def spy(self, *args, **kwargs):
        compiled.append(original(self, *args, **kwargs))
        return compiled[-1]

    monkeypatch.setattr(ov.Core, "compile_model", spy)
    workload, expected = tiny
    built = impls.build(Job("openvino-f32", 1, str(tmp_path)), workload, lambda text: None)
    assert compiled[0].get_property(hints.inference_precision) == ov.Type.f32
    assert built.notes.startswith("float32: INFERENCE_PRECISION_HINT f32")
    _, rel_err = max_errors(built.run(), expected)
    assert rel_err <= TOLERANCE
    # The default row leaves the precision to OpenVINO and says which it chose.
    built = impls.build(Job("openvino", 1, str(tmp_path)), workload, lambda text: None)
    chosen = compiled[1].get_property(hints.inference_precision).get_type_name()
    assert f"its inference precision here: {chosen}" in built.notes


def test_without_openvino_the_rows_are_skipped(tiny, tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_openvino(name, *args, **kwargs):
        if name == "openvino" or name.startswith("openvino."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    for module in [m for m in sys.modules if m == "openvino" or m.startswith("openvino.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setattr(builtins, "__import__", no_openvino)
    workload, _ = tiny
    for impl in ("openvino", "openvino-f32"):
        answer, timer = _prepare(Job(impl, 1, str(tmp_path), (workload,)), 0, workload,
                                 lambda text: None)
        assert timer is None
        assert answer["skipped"].startswith("openvino not installed")


def test_a_row_that_chose_bf16_gets_the_bf16_tolerance():
    rows = [Row("m", 1, 2, "openvino", median_ms=1.0, max_rel_err=5e-3,
                notes="bf16: OpenVINO's defaults (its inference precision here: bf16)"),
            Row("m", 1, 2, "openvino-f32", median_ms=1.0, max_rel_err=5e-3,
                notes="float32: INFERENCE_PRECISION_HINT f32"),
            Row("m", 1, 2, "onnxruntime", median_ms=2.0, max_rel_err=5e-3, notes="bf16: x")]
    assert [r.status for r in judge(rows, TOLERANCE)] == ["ok", "WRONG", "WRONG"]
    # A run whose tolerance is larger keeps it.
    rows[0] = Row("m", 1, 2, "openvino", median_ms=1.0, max_rel_err=3e-2, notes="bf16: x")
    assert judge(rows, TOLERANCES["int8"])[0].status == "ok"


def test_openvino_runs_the_int8_file(tiny, tmp_path):
    pytest.importorskip("openvino")
    from tvm_tpp.quantized import quantize_static_qdq

    workload, _ = tiny
    quantize_static_qdq(onnx.load(workload.model), tmp_path / "m.int8.onnx")
    quantized = ModelWorkload(str(tmp_path / "m.int8.onnx"), workload.inputs, workload.outputs,
                              "dense_4_int8")
    proto, specs, inputs = quantized.load()
    expected = run_onnxruntime(proto, {s.name: a for s, a in zip(specs, inputs, strict=True)},
                               1, False)
    built = impls.build(Job("openvino", 1, str(tmp_path), precision="int8"), quantized,
                        lambda text: None)
    assert "the int8 file (QDQ)" in built.notes
    _, rel_err = max_errors(built.run(), expected)
    if not any(runs_here(name) for name in ("avx512_vnni", "avx_vnni", "amx")):
        # oneDNN multiplies u8 x s8 with vpmaddubsw there, whose int16 sums saturate (0.23
        # from the reference on a Zen 1): the bench marks such a row WRONG, as it should.
        pytest.skip(f"OpenVINO's int8 without VNNI saturates: {rel_err:.2g} from the reference")
    assert rel_err <= TOLERANCES["int8"]
