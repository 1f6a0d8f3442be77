"""``tvm-tpp bench-dense``: one dense layer's kernel timed under its default and other
configurations."""

import json

import pytest

from tvm_tpp.cli import main


def test_rows_time_the_default_and_each_variant(tmp_path, capsys):
    out = tmp_path / "dense.json"
    assert main(["bench-dense", "37x48x40", "--epilogue", "bias,relu", "--vs", "bm=1",
                 "--vs", "spec=BCa,bk=8,k_step=5", "--warmup", "0", "--rounds", "1",
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.startswith("dense 37x48x40, float32, epilogue bias_relu") and "warm" in table
    data = json.loads(out.read_text())
    assert data["dense"] == "37x48x40" and data["flops"] == 2 * 37 * 48 * 40
    rows = data["rows"]
    assert [r["label"] for r in rows] == ["default", "vs bm=1", "vs spec=BCa,bk=8,k_step=5"]
    assert all(r["seconds"] > 0 and not r["error"] for r in rows)
    assert rows[1]["config"]["bm"] == 1
    assert (rows[2]["config"]["spec"], rows[2]["config"]["bk"], rows[2]["config"]["steps"]) \
        == ("BCa", 8, {"a": 5})
    for row in rows:  # each row's line: label, time, GFLOPS, ratio to the first
        line = next(t for t in table.splitlines() if t.startswith(row["label"] + " "))
        assert f"{row['seconds'] * 1e3:.4f}" in line


@pytest.mark.slow  # 5 s of int8 builds; the float rows above check the command
def test_int8_rows_and_the_tuners_candidates(capsys):
    assert main(["bench-dense", "16x32x64", "--dtype", "uint8", "--cold", "--candidates",
                 "--warmup", "0", "--rounds", "1"]) == 0
    table = capsys.readouterr().out
    assert "uint8" in table and "operands flushed before each run" in table
    assert "default" in table and "candidate 0" in table and "GOPS" in table


@pytest.mark.parametrize("args, message", [
    (["64x64"], "a dense layer is MxNxK"),
    (["0x8x8"], "GemmProblem.m must be a positive int"),
    (["37x48x40", "--vs", "bm=5"], "bm=5 does not divide 37"),
    (["37x48x40", "--vs", "k_step=3"], "k_step=3 does not divide"),
    (["37x48x40", "--vs", "spec=ZZZ"], "--vs spec=ZZZ"),
    (["37x48x40", "--vs", "candidate=x"], "--vs takes FIELD=VALUE"),
    (["37x48x40", "--epilogue", "bias,sparkle"], "unknown epilogue op 'sparkle'"),
    (["37x48x40", "--epilogue", "gelu_sigmoid"], "unknown gelu variant 'sigmoid'"),
])
def test_bad_input_is_one_line(args, message, capsys):
    assert main(["bench-dense", *args, "--warmup", "0", "--rounds", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tvm-tpp: error: ") and message in err[0], err
