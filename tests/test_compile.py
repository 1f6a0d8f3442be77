"""tvm_tpp.compile and tune: every accepted model form, run, export/load, tuning into a work
directory and building from it, and each error path."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import tvm
from conftest import make_dense_model

import tvm_tpp
from tvm_tpp import compiler
from tvm_tpp.compiler import DATABASE, WORK_DIR, import_model
from tvm_tpp.errors import DatabaseError, ModelError, NotRunnableError, TppError, UsageError
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
    with pytest.raises(UsageError, match="keeps no source"):
        loaded.source("asm")


def test_source_kinds(dense_model):
    compiled = tvm_tpp.compile(dense_model)
    assert "tpp_dense_4x40x24_bias_relu_compute_:" in compiled.source("asm")
    assert "target triple" in compiled.source("llvm")
    with pytest.raises(ValueError, match="kind must be one of"):
        compiled.source("tir")


def test_tune_then_compile_reads_the_database(tmp_path, dense_model, monkeypatch):
    """tune writes the database; compile only reads it: from work_dir, else from
    ./tvm_tpp_work when that has one; compile(tune=True) tunes only what is missing."""
    work = tmp_path / "work"
    tuned = tvm_tpp.tune(dense_model, work_dir=work, budget=0.2, top_k=1)
    assert [t.problem.m for t in tuned] == [4] and not tuned[0].result.cached
    assert (work / DATABASE).is_file()
    again = tvm_tpp.tune(dense_model, work_dir=work)
    assert again[0].result.cached and again[0].result.best == tuned[0].result.best

    seen = []
    compiled = tvm_tpp.compile(dense_model, work_dir=work, tune=True,
                               on_tuned=lambda p, r: seen.append(r))
    assert [r.cached for r in seen] == [True] and compiled.tune_seconds == 0
    assert compiled.database == work / DATABASE
    assert compiled.report[0].kernel.endswith(f"[{tuned[0].result.best.candidate.spec}]")
    _check_against_ort(compiled, dense_model)

    monkeypatch.chdir(tmp_path)
    assert tvm_tpp.compile(dense_model).database is None  # no ./tvm_tpp_work
    shutil.copytree(work, WORK_DIR)
    assert tvm_tpp.compile(dense_model).database == Path(WORK_DIR, DATABASE)
    assert tvm_tpp.compile(dense_model, untuned=True).database is None
    with pytest.raises(UsageError, match="untuned builds"):
        tvm_tpp.compile(dense_model, work_dir=work, untuned=True)


def test_work_dir_without_or_with_corrupt_database(tmp_path, dense_model):
    with pytest.raises(DatabaseError, match="no tuning database in"):
        tvm_tpp.compile(dense_model, work_dir=tmp_path)
    (tmp_path / DATABASE).write_text("{not json")  # set aside, with a warning; built untuned
    assert tvm_tpp.compile(dense_model, work_dir=tmp_path).database == tmp_path / DATABASE
    assert (tmp_path / f"{DATABASE}.corrupt").read_text() == "{not json"


def test_tuning_needs_a_target_this_cpu_runs(tmp_path, dense_model):
    for tune in (lambda: tvm_tpp.tune(dense_model, "tpp -isa=neon", work_dir=tmp_path),
                 lambda: tvm_tpp.compile(dense_model, "tpp -isa=neon", tune=True,
                                         work_dir=tmp_path)):
        with pytest.raises(NotRunnableError, match="tuning measures on this CPU"):
            tune()
    assert not (tmp_path / DATABASE).exists()


def test_user_errors_are_tpp_errors():
    """The command line shows these as one line; the ValueError ones stay ValueErrors."""
    assert issubclass(ModelError, ValueError) and issubclass(DatabaseError, ValueError)
    assert all(issubclass(e, TppError)
               for e in (ModelError, DatabaseError, NotRunnableError, UsageError))


def test_load_missing(tmp_path):
    with pytest.raises(ModelError, match="must both exist"):
        tvm_tpp.load(tmp_path / "nothing.so")


def test_time_returns_samples(dense_model):
    compiled = tvm_tpp.compile(dense_model)
    samples = compiled.time(random_inputs(compiled.inputs), number=2, repeat=3)
    assert len(samples) == 3 and all(s > 0 for s in samples)


def test_symbolic_dimension_after_the_batch_needs_shape():
    model = make_dense_model(batch_dim="N")
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "K"
    with pytest.raises(ModelError, match="symbolic dimension \\(K\\).*--shape x="):
        tvm_tpp.compile(model)


def test_symbolic_batch_given_a_size_compiles_static():
    model = make_dense_model(batch_dim="N")
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


def test_a_database_failing_under_a_build_or_tuner_is_one_error(tmp_path, dense_model,
                                                                 monkeypatch):
    """A database that cannot be read or written meanwhile (a full disk, a lock held past
    the busy timeout) is a DatabaseError naming it, also from inside TVM's passes."""
    from schedules.database import Database, StoreError

    tvm_tpp.tune(dense_model, work_dir=tmp_path, budget=0.05, top_k=1)

    def fail(self, *args, **kwargs):
        raise StoreError(f"tuning database {self.path} cannot be read: disk I/O error")

    monkeypatch.setattr(Database, "get", fail)
    for build in (tvm_tpp.compile, compiler.lower, tvm_tpp.tune):
        with pytest.raises(DatabaseError, match=f"tuning database {tmp_path / DATABASE} "
                           "cannot be read: disk I/O error"):
            build(dense_model, work_dir=tmp_path)
