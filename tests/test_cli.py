"""The tvm-tpp command line: each subcommand and each error path (one line, no traceback)."""

import json
import subprocess
import sys

import pytest

from tvm_tpp.cli import main


def _cli(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "tvm_tpp.cli", *args],
                          capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_help_and_info_import_no_tvm():
    """Start-up stays light: neither --help nor info loads TVM (≈1-2 s) or TVMScript."""
    code = ("import sys\nfrom tvm_tpp.cli import main\n"
            "for argv in (['info'], ['info', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('tvm' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False"


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "host ISA" in out and "L1d" in out and "microkernels" in out
    assert "generic" in out


def test_compile_to_library_and_code(tmp_path, dense_file):
    so = tmp_path / "m.so"
    assert main(["compile", str(dense_file), "-o", str(so)]) == 0
    assert so.is_file() and (tmp_path / "m.so.json").is_file()
    asm = tmp_path / "m.s"
    assert main(["compile", str(dense_file), "--target", "tpp -isa=avx2", "--emit", "asm",
                 "-o", str(asm)]) == 0
    assert "vfmadd" in asm.read_text() or "vmulps" in asm.read_text()
    tir = tmp_path / "m.tir"
    assert main(["compile", str(dense_file), "--emit", "tir", "-o", str(tir)]) == 0
    assert "T.prim_func" in tir.read_text()
    ll = tmp_path / "m.ll"
    assert main(["compile", str(dense_file), "--target", "tpp -isa=neon", "--emit", "llvm",
                 "-o", str(ll)]) == 0
    assert "aarch64" in ll.read_text()


def test_run_with_check(dense_file, capsys):
    assert main(["run", str(dense_file), "--check", "onnxruntime", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "max rel err" in out and "[OK]" in out and "latency" in out


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
    ],
)
def test_errors_are_one_line(tmp_path, dense_file, args, message):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"garbage")
    args = [{"DENSE": str(dense_file), "BAD": str(bad)}.get(a, a) for a in args]
    proc = _cli(*args, check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("tvm-tpp: error:")]
    assert len(lines) == 1, proc.stderr
    import re

    assert re.search(message, lines[0]), lines[0]


def test_bench_kernel_json(tmp_path):
    out = tmp_path / "k.json"
    assert main(["bench-kernel", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result) >= {"isa", "dtype", "shape", "gflops", "peak_gflops", "fraction_of_peak"}
    assert result["gflops"] > 0 and 0 < result["fraction_of_peak"]
