"""The tvm-tpp command line: each subcommand, tuned builds from a work directory, and each
error path (a user's mistake: one line, exit 2; a bug: its traceback)."""

import json
import platform
import re
import sqlite3
import subprocess
import sys

import pytest

from microkernels import isa
from tvm_tpp import compiler
from tvm_tpp.cli import main

KERNEL = "tpp_dense_4x40x24_bias_relu"  # what the dense fixture's matmul+bias+relu becomes


def _cli(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "tvm_tpp.cli", *args],
                          capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_help_and_info_import_no_tvm():
    """Start-up stays light: neither --help nor info loads TVM (≈1-2 s) or TVMScript; every
    help text formats (argparse %-expands them: a bare % crashes --help) and exits 0."""
    code = ("import sys\nfrom tvm_tpp.cli import main\n"
            "for argv in (['info'], ['--help'], *([c, '--help'] for c in ("
            "'info', 'compile', 'run', 'profile', 'tune', 'bench-gemm', 'bench-kernel', "
            "'bench'))):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n"
            "        assert e.code == 0, (argv, e.code)\n"
            "print('tvm' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False"


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "host ISA" in out and "L1d" in out and "microkernels" in out
    assert "generic" in out


def _emit(tmp_path, dense_file, kind, *target) -> str:
    out = tmp_path / f"m.{kind}"
    assert main(["compile", str(dense_file), *target, "--emit", kind, "-o", str(out)]) == 0
    return out.read_text()


def _function(asm: str, name: str) -> str:
    """One function's assembly: from its label to LLVM's end-of-function label."""
    start = asm.index(f"\n{name}:")
    return asm[start:asm.index(".Lfunc_end", start)]


def _kernel_code(asm: str) -> str:
    """The dense kernel's assembly: its function and the parallel loop bodies TVM outlines
    from it (``.L__tvm_parallel_lambda*``, where its column blocks run in parallel)."""
    lambdas = re.findall(r"\n(\.L__tvm_parallel_lambda[\w.]*):", asm)
    return "".join(_function(asm, name) for name in [f"{KERNEL}_compute_", *lambdas])


@pytest.fixture
def no_work_dir(tmp_path, monkeypatch):
    """A current directory without ./tvm_tpp_work, whose database builds would read."""
    monkeypatch.chdir(tmp_path)


def test_compile_to_library(tmp_path, dense_file, capsys, no_work_dir):
    so = tmp_path / "m.so"
    report = tmp_path / "report.json"
    assert main(["compile", str(dense_file), "-o", str(so), "--report",
                 "--report-json", str(report)]) == 0
    assert so.is_file() and (tmp_path / "m.so.json").is_file()
    out = capsys.readouterr().out
    assert "TPP kernels  : 1 of 1 operators, default configs (no tuning database)" in out
    assert "TPP FLOPs    : 100.0% of 0.008 MFLOP in matmul, conv and attention" in out
    header, row = (line.split() for line in out.splitlines()[-3:-1])
    assert header == ["op", "shape", "MFLOP", "share", "kernel", "isa", "dtypes", "layout"]
    # The kernel's BRGEMM: float32, flat, the host's fp32 implementation (AVX-512 or AVX2).
    assert row[:5] == ["matmul+bias+relu", "4x40x24", "0.008", "100.0%", KERNEL]
    assert row[5].startswith("[")
    assert row[-3] in ("avx512", "avx2") and row[-2:] == ["float32*float32->float32", "flat"]
    doc = json.loads(report.read_text())
    assert list(doc)[-1] == "tpp_flops_fraction" and doc["tpp_flops_fraction"] == 1.0
    assert doc["operators"][0]["flops"] == doc["tpp_flops"] == 2 * 4 * 40 * 24


@pytest.mark.skipif(platform.machine() != "x86_64", reason="checks x86 assembly")
def test_emit_asm_has_the_brgemm_fma_on_host_vectors(tmp_path, dense_file):
    """The kernel's inner product is FMAs on the registers of the host's vector width."""
    register = {512: "zmm", 256: "ymm"}[isa.detect().vector_bits]
    body = _kernel_code(_emit(tmp_path, dense_file, "asm"))
    assert re.search(rf"vfmadd\d+ps\s[^\n]*%{register}", body), body[:2000]


def test_emit_aarch64_asm_has_neon_fmla(tmp_path, dense_file):
    body = _kernel_code(_emit(tmp_path, dense_file, "asm", "--target", "tpp -isa=neon"))
    assert re.search(r"fmla\s+v\d+\.4s", body), body[:2000]


def test_emit_llvm_and_tir_name_the_kernel(tmp_path, dense_file):
    lanes = isa.detect().vector_bits // 32
    ll = _emit(tmp_path, dense_file, "llvm")
    assert re.search(rf"define [^\n]*@{KERNEL}_compute_\(", ll)
    assert f"@llvm.fmuladd.v{lanes}f32" in ll
    tir = _emit(tmp_path, dense_file, "tir")
    assert re.search(rf"def {KERNEL}\(", tir) and f"cls.{KERNEL}(x, " in tir  # main calls it


def test_run_with_check(dense_file, capsys, no_work_dir):
    assert main(["run", str(dense_file), "--check", "onnxruntime", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "max rel err" in out and "[OK]" in out and "latency" in out
    assert "1 of 1 operators, default configs" in out


def test_tune_then_compile_and_run_use_the_work_dir(tmp_path, dense_file, capsys, no_work_dir):
    work = tmp_path / "work"
    assert main(["tune", str(dense_file), "--work-dir", str(work), "--budget", "0.2"]) == 0
    assert "dense 4x40x24 bias_relu -> " in " ".join(capsys.readouterr().out.split())  # rich wraps
    # The tuner keeps the default unless a candidate beats it, so only a stored config that
    # is not the default shows whether a build reads the database: store a measured one.
    database = work / compiler.DATABASE
    with sqlite3.connect(database) as db:
        (key, text), = db.execute("SELECT key, record FROM records").fetchall()
        record = json.loads(text)
        default = record["measured"][0]["config"]
        other = next(m["config"] for m in record["measured"]
                     if m["seconds"] and m["config"]["spec"] != default["spec"])
        db.execute("UPDATE records SET record = ? WHERE key = ?",
                   (json.dumps({**record, "config": other}), key))
    db.close()

    so = tmp_path / "m.so"
    for argv in (["compile", "-o", str(so)], ["run", "--repeat", "1"]):
        assert main([*argv, str(dense_file), "--work-dir", str(work), "-v"]) == 0
        out = capsys.readouterr().out
        assert f"configs looked up in {database}" in out
        assert f"{KERNEL} [{other['spec']}" in out, out
    assert main(["run", str(dense_file), "--repeat", "1", "-v"]) == 0  # no ./tvm_tpp_work
    assert f"{KERNEL} [{default['spec']}" in capsys.readouterr().out


@pytest.mark.parametrize("error", [RuntimeError("internal bug"), ValueError("internal bug")])
def test_bugs_keep_their_traceback(monkeypatch, dense_file, error):
    """Only the project's error types become one-line messages; a ValueError from a bug too
    propagates out of main()."""

    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(compiler, "compile", broken)
    with pytest.raises(type(error), match="internal bug"):
        main(["run", str(dense_file)])


@pytest.mark.parametrize("argv", [["run", "mlp", "--batch", "0"], ["run", "mlp", "--repeat", "0"],
                                  ["tune", "mlp", "--budget", "-1"]])
def test_bad_numbers_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and "must be >= " in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "missing.onnx"], "no such ONNX file"),
        (["run", "no_such_model"], "neither a file nor a bundled model"),
        (["run", "DENSE", "--target", "tpp -isa=avx9000"], "unknown ISA 'avx9000'"),
        (["run", "DENSE", "--shape", "x=1,,2"], "--shape takes NAME=D0,D1"),
        (["run", "DENSE", "--shape", "q=1,2"], "unknown inputs"),
        (["run", "BAD"], "not a valid ONNX model|failed the checker"),
        (["run", "DENSE", "--target", "tpp -isa=neon"], "cannot run on this CPU"),
        (["tune", "DENSE", "--target", "tpp -isa=neon"], "tuning measures on this CPU"),
        (["run", "DENSE", "--work-dir", "EMPTY"], "no tuning database in .*; write it with"),
        (["compile", "DENSE", "-o", "EMPTY/no/m.so"], "cannot write"),
        (["bench-kernel", "--isa", "amx"], "AMX tiles multiply int8 and bfloat16"),
    ],
)
def test_errors_are_one_line(tmp_path, dense_file, args, message, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"garbage")
    paths = {"DENSE": dense_file, "BAD": bad, "EMPTY": tmp_path}
    for name, path in paths.items():
        args = [a.replace(name, str(path)) for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("tvm-tpp: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.search(message, lines[0]), lines[0]


def test_a_user_error_ends_the_process_with_status_2_and_one_line(tmp_path):
    """The same as a real process: exit status 2, one line on stderr, no traceback."""
    proc = _cli("run", str(tmp_path / "missing.onnx"), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"tvm-tpp: error: no such ONNX file: {tmp_path / 'missing.onnx'}"]


def test_bench_kernel_json(tmp_path):
    out = tmp_path / "k.json"
    assert main(["bench-kernel", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result) >= {"isa", "dtype", "shape", "gflops", "peak_gflops", "fraction_of_peak"}
    assert result["gflops"] > 0 and 0 < result["fraction_of_peak"]
