"""tvm_tpp.compile: every accepted model form, run, export/load, and each error path."""

import numpy as np
import pytest
import tvm
from conftest import make_dense_model

import tvm_tpp
from tvm_tpp.compiler import NotRunnableError, import_model
from tvm_tpp.onnx_import import ModelError
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime


def _check_against_ort(compiled, proto):
    inputs = random_inputs(compiled.inputs, seed=3)
    got = compiled.run(**inputs)
    _, rel = max_errors(got, run_onnxruntime(proto, inputs))
    assert rel <= 1e-5


def test_compile_proto_path_bytes_and_relax(dense_model, dense_file):
    for model in (dense_model, dense_file, str(dense_file), dense_model.SerializeToString()):
        compiled = tvm_tpp.compile(model, target="tpp")
        assert [(s.name, s.shape, s.dtype) for s in compiled.inputs] == [("x", (4, 24), "float32")]
        _check_against_ort(compiled, dense_model)
    mod, _ = import_model(dense_model)
    _check_against_ort(tvm_tpp.compile(mod), dense_model)


def test_plain_tvm_target_also_builds(dense_model):
    compiled = tvm_tpp.compile(dense_model, target={"kind": "llvm", "mcpu": "haswell"})
    _check_against_ort(compiled, dense_model)


def test_export_and_load(tmp_path, dense_model):
    compiled = tvm_tpp.compile(dense_model)
    inputs = random_inputs(compiled.inputs)
    path = compiled.export(tmp_path / "dense.so")
    loaded = tvm_tpp.load(path)
    assert loaded.inputs == compiled.inputs
    np.testing.assert_array_equal(loaded.run(**inputs)[0], compiled.run(**inputs)[0])


def test_load_missing(tmp_path):
    with pytest.raises(ModelError, match="must both exist"):
        tvm_tpp.load(tmp_path / "nothing.so")


def test_time_returns_samples(dense_model):
    compiled = tvm_tpp.compile(dense_model)
    samples = compiled.time(random_inputs(compiled.inputs), number=2, repeat=3)
    assert len(samples) == 3 and all(s > 0 for s in samples)


def test_symbolic_batch_needs_shape():
    model = make_dense_model(batch_dim="N")
    with pytest.raises(ModelError, match="symbolic dimension \\(N\\).*--shape x="):
        tvm_tpp.compile(model)
    compiled = tvm_tpp.compile(model, input_shapes={"x": (3, 24)})
    assert compiled.inputs[0].shape == (3, 24)
    _check_against_ort(compiled, make_dense_model(m=3))


def test_shape_for_unknown_input(dense_model):
    with pytest.raises(ModelError, match="unknown inputs \\['y'\\]"):
        tvm_tpp.compile(dense_model, input_shapes={"y": (1, 2)})


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ModelError, match="no such ONNX file"):
        tvm_tpp.compile(tmp_path / "absent.onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00\x01 this is not protobuf")
    with pytest.raises(ModelError, match="not a valid ONNX model|failed the checker"):
        tvm_tpp.compile(bad)


def test_checker_failure(dense_model):
    broken = type(dense_model)()
    broken.CopyFrom(dense_model)
    broken.graph.node[0].input[1] = "does_not_exist"
    with pytest.raises(ModelError, match="checker"):
        tvm_tpp.compile(broken)


def test_wrong_inputs_rejected(dense_model):
    compiled = tvm_tpp.compile(dense_model)
    with pytest.raises(ValueError, match="missing \\['x'\\]"):
        compiled.run()
    with pytest.raises(ValueError, match="must be float32\\[4, 24\\]"):
        compiled.run(x=np.zeros((4, 25), "float32"))
    with pytest.raises(ValueError, match="unexpected \\['z'\\]"):
        compiled.run(x=np.zeros((4, 24), "float32"), z=np.zeros(1))


def test_foreign_isa_builds_but_does_not_run(dense_model, tmp_path):
    compiled = tvm_tpp.compile(dense_model, target="tpp -isa=neon")
    assert not compiled.runnable
    with pytest.raises(NotRunnableError, match="cannot run on this CPU"):
        compiled.run(x=np.zeros((4, 24), "float32"))
    assert compiled.export(tmp_path / "arm.tar").is_file()


def test_relax_module_without_main():
    with pytest.raises(ModelError, match="no 'main'"):
        tvm_tpp.compile(tvm.IRModule({}))
