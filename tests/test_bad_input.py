"""Issue #16's table: what a new user's bad input gets.  One test per row, each asserting the
message (one line, non-zero exit) or the right result; and four tuner processes on one work
directory, every one of whose results is found afterwards."""

import json
import os
import platform
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import make_dense_model
from onnx import TensorProto, helper, numpy_helper

import tvm_tpp
from relay_passes.dense import ONE_COLUMN
from schedules.database import LEGACY_NAME, Database, TuningKey
from schedules.gemm import GemmProblem
from tvm_tpp.cli import main
from tvm_tpp.compiler import DATABASE, CompiledModel, native_output
from tvm_tpp.errors import ModelError, UsageError
from tvm_tpp.reference import run_onnxruntime

#: One core: tuning in several processes at once stays fair to the 2-core host.
TARGET = "tpp -num-cores=1"


def _errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines()
            if line.startswith("tvm-tpp: error:")]


def _fails(argv, capsys) -> str:
    """The one error line of a CLI call that must exit 2 (argparse's too)."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse: the usage line, then the message
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


def _warnings(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines()
            if line.startswith("tvm-tpp: warning:")]


def _dense_key(m: int = 4) -> str:
    from microkernels.epilogue import Epilogue, EpilogueOp

    problem = GemmProblem(m, 40, 24, epilogue=Epilogue((EpilogueOp("bias"),
                                                         EpilogueOp("relu"))))
    return TuningKey.of(problem, tvm_tpp.target(TARGET)).text()


def _tune(model_file, work, capsys) -> list[str]:
    """Tune the dense model into ``work`` (the CLI, in this process); its warning lines."""
    assert main(["tune", str(model_file), "--target", TARGET, "--work-dir", str(work),
                 "--budget", "0.1"]) == 0
    return _warnings(capsys)


# -- row 1: two tuners at once on one work dir (and the "done when": four) --------------

_TUNE = [sys.executable, "-m", "tvm_tpp.cli", "tune", "--target", TARGET, "--budget", "0.05"]


@pytest.mark.slow  # four processes tuning: 8 s on a 2-core Zen 1
def test_four_tuner_processes_on_one_work_dir_lose_nothing(tmp_path):
    """Each process tunes its own dense layer (and all share one) into the same work dir at
    once; afterwards the database holds every result.  (The JSON file kept only the last
    writer's.)"""
    work = tmp_path / "work"
    files = []
    for m in (4, 8, 12, 16):
        path = tmp_path / f"dense{m}.onnx"
        onnx.save(make_dense_model(m=m), str(path))
        files.append(path)
    shared = tmp_path / "shared.onnx"
    onnx.save(make_dense_model(m=20), str(shared))
    procs = [subprocess.Popen([*_TUNE, str(f), str(shared), "--work-dir", str(work)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for f in files]
    outputs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err[-2000:] for _, err in outputs]
    assert not any(err.strip() for _, err in outputs), [err for _, err in outputs]
    keys = Database(work / DATABASE).keys()
    assert sorted(keys) == sorted(_dense_key(m) for m in (4, 8, 12, 16, 20))


# -- row 2: the database's put from two processes -----------------------------------------

_PUTS = """
import sys
from schedules.database import Database, TuningKey
from schedules.gemm import GemmConfig
db = Database(sys.argv[1])
for m in range(int(sys.argv[2]), int(sys.argv[2]) + 200):
    db.put(TuningKey("dense", (m, 8, 8), "", "float32", "", "x"), GemmConfig.of("BCa", 1, 8, 8))
"""


@pytest.mark.slow  # test_database.test_processes_lose_nothing: four writers at once
def test_put_from_two_processes(tmp_path):
    path = tmp_path / DATABASE
    procs = [subprocess.Popen([sys.executable, "-c", _PUTS, str(path), str(first)],
                              stderr=subprocess.PIPE, text=True) for first in (1, 1001)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    assert len(Database(path)) == 400


# -- row 3: valid JSON of the wrong type, a record of a bad structure, spec "zzz" ------------

@pytest.mark.parametrize("content", ["[]", "42"])
def test_a_json_database_of_the_wrong_type(tmp_path, dense_file, capsys, content):
    (tmp_path / LEGACY_NAME).write_text(content)
    (line,) = _tune(dense_file, tmp_path, capsys)
    assert line == (f"tvm-tpp: warning: old tuning database {tmp_path / LEGACY_NAME} is not a "
                    "JSON object of records: moved it to tuning.json.corrupt (its operators "
                    "will be tuned again)")
    assert Database(tmp_path / DATABASE).keys() == [_dense_key()]  # tuned


@pytest.mark.parametrize("config, why", [
    ({"spec": "zzz", "bm": 4, "bn": 40, "bk": 24, "block_steps": {}, "steps": {}},
     "does not fit its operator: letter 'z' names loop 26 but only 3 loops are declared"),
    ({"spec": "BCa", "bm": 3, "bn": 40, "bk": 24, "block_steps": {}, "steps": {}},
     "does not fit its operator: bm=3 does not divide 4"),
    ({"spec": "BCa"}, "bad config: missing field 'block_steps'"),
    ({"spec": "BCa", "bm": "four", "bn": 40, "bk": 24, "block_steps": {}, "steps": {}},
     "bad config: GemmConfig.bm must be a positive int, got 'four'"),
])
def test_a_bad_record_is_dropped_and_retuned(tmp_path, dense_file, capsys, config, why):
    """In an old JSON database (migrated: only well-formed records are imported) or in the
    SQLite one, a record that cannot be read or does not fit its operator is deleted and
    tuned again, with one line naming the file."""
    key = _dense_key()
    (tmp_path / LEGACY_NAME).write_text(json.dumps({key: {"config": config}}))
    lines = _tune(dense_file, tmp_path, capsys)
    fits = why.startswith("does not fit")
    assert lines[0] == (f"tvm-tpp: warning: migrated {int(fits)} tuning records from "
                        f"{tmp_path / LEGACY_NAME} into {tmp_path / DATABASE}"
                        f"{'' if fits else ', dropped 1 invalid (to be tuned again)'}; "
                        "the old file is now tuning.json.migrated")
    dropped = (f"tvm-tpp: warning: tuning database {tmp_path / DATABASE}: dropped the invalid "
               f"record of {key} ({why}")
    assert len(lines) == 1 + fits and (not fits or lines[1].startswith(dropped))
    database = Database(tmp_path / DATABASE)
    assert database.keys() == [key] and database.get(TuningKey(*_split(key))) is not None

    with sqlite3.connect(tmp_path / DATABASE) as conn:  # the same record, now in SQLite
        conn.execute("UPDATE records SET record = ?", (json.dumps({"config": config}),))
    conn.close()
    (line,) = _tune(dense_file, tmp_path, capsys)
    assert line.startswith(dropped) and line.endswith("; it will be tuned again")
    assert database.get(TuningKey(*_split(key))) is not None  # re-tuned


def _split(key: str) -> tuple:
    op, shape, dtype, epilogue, target = key.split("|")
    return op, tuple(map(int, shape.split("x"))), "", dtype, epilogue, target


# -- rows 4 and 5: random bytes; a corrupt database is set aside, not left in place -------

def test_a_database_of_random_bytes_is_set_aside_once(tmp_path, dense_file, capsys):
    junk = b"\xa1\xff\x00" + os.urandom(3000)
    (tmp_path / DATABASE).write_bytes(junk)
    (line,) = _tune(dense_file, tmp_path, capsys)
    assert line == (f"tvm-tpp: warning: tuning database {tmp_path / DATABASE} is not a tuning "
                    "database: moved it to tuning.db.corrupt and started an empty one (its "
                    "operators will be tuned again)")
    assert (tmp_path / f"{DATABASE}.corrupt").read_bytes() == junk
    assert _tune(dense_file, tmp_path, capsys) == []  # the next run: nothing to say
    assert Database(tmp_path / DATABASE).keys() == [_dense_key()]


def test_an_old_json_database_of_random_bytes(tmp_path, dense_file, capsys):
    (tmp_path / LEGACY_NAME).write_bytes(b"\xa1" * 100)
    (line,) = _tune(dense_file, tmp_path, capsys)
    assert f"old tuning database {tmp_path / LEGACY_NAME} is not a JSON object" in line


# -- rows 6 to 8: artifacts are checked before they are loaded -------------------------------

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = tmp_path_factory.mktemp("export") / "dense.so"
    return tvm_tpp.compile(make_dense_model(), TARGET).export(path)


def _copy(exported, tmp_path, library=None, sidecar=None):
    so = tmp_path / "m.so"
    so.write_bytes(exported.read_bytes() if library is None else library)
    meta = Path_json(exported)
    (tmp_path / "m.so.json").write_text(meta if sidecar is None else sidecar)
    return so


def Path_json(so) -> str:  # noqa: N802 - the sidecar's text
    return (so.parent / (so.name + ".json")).read_text()


def test_a_library_cut_in_half_is_refused_before_it_is_mapped(exported, tmp_path):
    data = exported.read_bytes()
    so = _copy(exported, tmp_path, library=data[:len(data) // 2])
    with pytest.raises(ModelError, match=rf"m.so is {len(data) // 2} bytes, its export wrote "
                       rf"{len(data)}: the file is truncated or was replaced"):
        tvm_tpp.load(so)
    changed = bytearray(data)
    changed[len(data) // 2] ^= 0xFF
    so = _copy(exported, tmp_path, library=bytes(changed))
    with pytest.raises(ModelError, match="does not match the SHA-256 its export recorded"):
        tvm_tpp.load(so)


def _edited(exported, **fields) -> str:
    meta = json.loads(Path_json(exported))
    meta.update(fields)
    return json.dumps(meta)


@pytest.mark.parametrize("sidecar, message", [
    ("{not json", r"m.so.json is not a valid tvm-tpp sidecar \(not JSON: "),
    ("[]", r"is not a valid tvm-tpp sidecar \(a JSON list, not an object\)"),
    ("{}", "has sidecar format none; this tvm-tpp reads format 2: export the model again"),
    ("EDITED", r"was changed after the export \(its digest does not match its contents\)"),
    ("REHASHED", r"input .* is not a name, a shape of sizes .* and a dtype"),
])
def test_a_bad_sidecar_is_one_line(exported, tmp_path, sidecar, message):
    if sidecar == "EDITED":  # shapes the library does not take
        sidecar = _edited(exported, inputs=[{"name": "x", "shape": [4, 25], "dtype": "float32"}])
    elif sidecar == "REHASHED":  # consistent, but of the wrong structure
        from tvm_tpp.compiler import _digest

        meta = json.loads(_edited(exported, inputs=[{"name": "x", "shape": "4x24"}]))
        sidecar = json.dumps({**meta, "digest": _digest(meta)})
    with pytest.raises(ModelError, match=message):
        tvm_tpp.load(_copy(exported, tmp_path, sidecar=sidecar))


def test_an_aarch64_tar_is_refused_on_another_machine(tmp_path):
    if platform.machine() == "aarch64":
        pytest.skip("this host runs aarch64 code")
    tar = tvm_tpp.compile(make_dense_model(), "tpp -isa=neon").export(tmp_path / "arm.tar")
    with pytest.raises(ModelError, match=rf"arm.tar holds aarch64 code and this machine is "
                       rf"{platform.machine()}: load it where aarch64 code runs"):
        tvm_tpp.load(tar)


def test_export_and_load_still_round_trip(exported):
    model = tvm_tpp.load(exported)
    x = np.ones((4, 24), "float32")
    (y,) = model.run(x=x)
    assert y.shape == (4, 40)


# -- row 9: a scalar (rank-0) input runs ---------------------------------------------------

def _if_model() -> onnx.ModelProto:
    """y = x + 1 if c else x - 1, with c a rank-0 bool."""
    def branch(op, out):
        return helper.make_graph([helper.make_node(op, ["x", "one"], [out])], out, [],
                                 [helper.make_tensor_value_info(out, TensorProto.FLOAT, [4])])

    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=branch("Add", "t"),
                          else_branch=branch("Sub", "e"))], "if",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(np.ones(4, "float32"), "one")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_scalar_input_runs(tmp_path, capsys):
    model = _if_model()
    compiled = tvm_tpp.compile(model)
    assert compiled.inputs[0].shape == ()
    x = np.arange(4, dtype="float32")
    for c in (True, False):
        inputs = {"c": np.array(c), "x": x}
        np.testing.assert_array_equal(compiled.run(**inputs)[0],
                                      run_onnxruntime(model, inputs)[0])
    path = tmp_path / "if.onnx"
    onnx.save(model, str(path))
    assert main(["run", str(path), "--check", "onnxruntime", "--repeat", "1"]) == 0
    assert "[OK]" in capsys.readouterr().out


# -- rows 10 and 11: output and work directories that are not there, or are files ------------

def test_compile_into_a_missing_directory(dense_file, tmp_path, capsys):
    line = _fails(["compile", str(dense_file), "-o", "/nonexistent/dir/x.so"], capsys)
    assert line == ("tvm-tpp: error: cannot write /nonexistent/dir/x.so: not a file in an "
                    "existing directory")
    with pytest.raises(UsageError, match="cannot write /nonexistent/dir/x.so: not a file in "
                       "an existing, writable directory"):
        tvm_tpp.compile(make_dense_model()).export("/nonexistent/dir/x.so")


def test_a_library_named_so_it_could_never_be_loaded(dense_file, tmp_path, capsys):
    """TVM picks a library's loader by its suffix: ``export("m.tpp")`` would write a file
    that ``load`` cannot read, so it is refused, before any compiling in the CLI."""
    out = tmp_path / "model.tpp"
    line = _fails(["compile", str(dense_file), "-o", str(out)], capsys)
    assert line == (f"tvm-tpp: error: cannot write {out}: a model is exported as a shared "
                    "library (.so) or a .tar of object files; name it model.so")
    with pytest.raises(UsageError, match="name it model.so"):
        tvm_tpp.compile(make_dense_model()).export(tmp_path / "model")
    assert not out.exists() and not (tmp_path / "model").exists()
    assert tvm_tpp.load(tvm_tpp.compile(make_dense_model()).export(tmp_path / "m.so")).run(
        x=np.ones((4, 24), np.float32))[0].shape == (4, 40)


@pytest.mark.parametrize("command", [["tune"], ["run"], ["compile", "-o", "OUT"]])
def test_a_work_dir_that_is_a_file(dense_file, tmp_path, capsys, command):
    work = tmp_path / "work"
    work.write_text("")
    argv = [a.replace("OUT", str(tmp_path / "m.so")) for a in command]
    line = _fails([*argv, str(dense_file), "--work-dir", str(work)], capsys)
    assert line == f"tvm-tpp: error: work directory {work} is a file; name a directory"


# -- rows 12 and 13: --shape against the model's declared shapes ------------------------------

def test_shape_overriding_a_static_input(dense_file, capsys):
    line = _fails(["run", str(dense_file), "--shape", "x=8,24", "--check", "onnxruntime"],
                  capsys)
    assert line == ("tvm-tpp: error: input 'x' has the static shape [4, 24]; a given shape may "
                    "only set its symbolic dimensions, got [8, 24]")


def test_shape_with_a_wrong_inner_size(tmp_path, capsys):
    path = tmp_path / "n.onnx"
    onnx.save(make_dense_model(batch_dim="N"), str(path))
    line = _fails(["run", str(path), "--shape", "x=4,100"], capsys)
    assert line == ("tvm-tpp: error: input 'x' is declared [N, 24]; a given shape may only set "
                    "its symbolic dimensions, got [4, 100]")
    model = make_dense_model(batch_dim="N")  # both dimensions symbolic: ONNX's inference says
    dim = model.graph.input[0].type.tensor_type.shape.dim[1]
    dim.ClearField("dim_value")
    dim.dim_param = "K"
    onnx.save(model, str(path))
    line = _fails(["run", str(path), "--shape", "x=4,100"], capsys)
    assert line.startswith("tvm-tpp: error: the input shapes (x=4,100) do not fit the model: ")
    assert "Incompatible dimensions for matrix multiplication" in line


# -- row 14: options out of range or unknown ------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["run", "mlp", "--batch", "0"], "argument --batch: must be >= 1, got 0"),
    (["run", "DENSE", "--shape", "q=1,2"], "shapes given for unknown inputs ['q']; inputs are: x"),
    (["tune", "mlp", "--budget", "-5"], "argument --budget: must be >= 0, got -5"),
    (["run", "DENSE", "--target", "tpp -mcpu=notacpu"],
     "-mcpu=notacpu is not a CPU LLVM knows for "),
])
def test_bad_options(dense_file, capsys, argv, message):
    line = _fails([a.replace("DENSE", str(dense_file)) for a in argv], capsys)
    assert message in line


# -- row 15: a model ending in Gemm with N = 1 ---------------------------------------------

def test_a_gemm_with_one_output_column():
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "b"], ["y"])], "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 1])],
        [numpy_helper.from_array(rng.standard_normal((32, 1)).astype("float32"), "W"),
         numpy_helper.from_array(rng.standard_normal(1).astype("float32"), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              ir_version=8)
    compiled = tvm_tpp.compile(model)
    assert [r.reason for r in compiled.report] == [ONE_COLUMN]
    x = rng.standard_normal((4, 32)).astype("float32")
    np.testing.assert_allclose(compiled.run(x=x)[0], run_onnxruntime(model, {"x": x})[0],
                               rtol=1e-5, atol=1e-5)


# -- row 16: TVM's log noise stays out of the terminal (shown with -v) -----------------------

def _noisy_export(self, path):
    """An export during which native code prints to the process's stderr, as TVM's C++ log
    does when it saves a VM executable with memory scopes."""
    with native_output():
        os.write(2, b"[12:00:00] executable.cc:276: Warning: Scope Saving:global\n")
    Path(path).write_bytes(b"")
    return Path(path)


@pytest.mark.parametrize("verbose", [False, True])
def test_native_log_is_kept_out_and_shown_with_verbose(tmp_path, capfd, monkeypatch,
                                                        dense_file, verbose):
    monkeypatch.setattr(CompiledModel, "export", _noisy_export)
    argv = ["compile", str(dense_file), "-o", str(tmp_path / "m.so")]
    assert main(argv + ["-v"] * verbose) == 0
    err = capfd.readouterr().err
    assert err == ("tvm: [12:00:00] executable.cc:276: Warning: Scope Saving:global\n"
                   if verbose else "")


def test_export_and_load_print_nothing(exported, tmp_path, capfd, dense_file):
    tvm_tpp.load(exported)
    assert main(["compile", str(dense_file), "-o", str(tmp_path / "m.so")]) == 0
    assert capfd.readouterr().err == ""
