"""``tvm-tpp bench-conv``: one conv kernel timed under its default and other configurations."""

import json

import pytest
import tvm_ffi

from microkernels.epilogue import Epilogue, EpilogueOp
from schedules.conv import ConvProblem
from schedules.depthwise import DepthwiseProblem
from schedules.ops import conv_problem, problem_text
from tvm_tpp.cli import main


@pytest.mark.parametrize("problem", [
    ConvProblem(1, 3, 224, 224, 64, 7, 7, stride=2, padding=3),
    ConvProblem(2, 12, 9, 11, 6, 3, 3, stride=(1, 2), padding=(2, 1, 2, 0), dilation=2,
                groups=3),
    ConvProblem(1, 5, 6, 6, 7, 1, 1),
    ConvProblem(1, 16, 9, 5, 8, 3, 1, padding=(1, 0, 0, 0), dilation=(3, 1)),
])
def test_conv_text_names_the_problem_the_tuner_shows(problem):
    shape = problem_text(problem).split()[1]
    assert conv_problem(shape) == problem
    bias = Epilogue((EpilogueOp("bias"),))
    assert conv_problem(shape, "uint8", bias) == ConvProblem(
        *(getattr(problem, f) for f in "nchwkrs"), stride=problem.stride, padding=problem.padding,
        dilation=problem.dilation, groups=problem.groups, dtype="uint8", epilogue=bias)


def test_rows_time_the_default_and_each_variant(tmp_path, capsys):
    out = tmp_path / "conv.json"
    assert main(["bench-conv", "1x8x7x7x16x3x3/s1x1p1x1x1x1", "--epilogue", "bias,relu",
                 "--vs", "fold_taps=false", "--vs", "bk=8,spec=ACbfgde", "--warmup", "0",
                 "--rounds", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "epilogue bias_relu" in table and "warm" in table
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [r["label"] for r in rows] == ["default", "vs fold_taps=false",
                                          "vs bk=8,spec=ACbfgde"]
    assert all(r["seconds"] > 0 and not r["error"] for r in rows)
    assert rows[0]["config"]["fold_taps"] and not rows[1]["config"]["fold_taps"]
    assert (rows[2]["config"]["bk"], rows[2]["config"]["spec"]) == (8, "ACbfgde")
    assert data["flops"] == 2 * 7 * 7 * 16 * 8 * 9
    for row in rows:  # each row's line: label, time, GFLOPS, ratio to the first
        line = next(t for t in table.splitlines() if t.startswith(row["label"] + " "))
        assert f"{row['seconds'] * 1e3:.4f}" in line


def test_cold_rows_and_the_tuners_candidates(capsys):
    assert main(["bench-conv", "1x16x6x6x16x1x1", "--cold", "--candidates", "--warmup", "0",
                 "--rounds", "1"]) == 0
    table = capsys.readouterr().out
    assert "operands flushed before each run" in table
    assert "default" in table and "candidate 0" in table


def test_winograd_rows_beside_the_direct_conv(tmp_path, capsys):
    out = tmp_path / "conv.json"
    assert main(["bench-conv", "1x16x8x8x16x3x3/s1x1p1x1x1x1", "--winograd", "--warmup", "0",
                 "--rounds", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [r["label"] for r in rows] == ["default", "winograd F4", "winograd F2"]
    assert all(r["seconds"] > 0 and not r["error"] for r in rows)
    assert set(rows[1]["config"]) == {"bt", "bk"}
    assert "winograd bt=" in table


def test_a_depthwise_conv_times_the_depthwise_kernel(tmp_path, capsys):
    """``g = C = K``: the kernel a network's depthwise conv runs, not a grouped conv."""
    shape = "2x24x9x7x24x3x3/s2x1p1x1x1x1g24"
    assert conv_problem(shape, "bfloat16") == DepthwiseProblem(
        2, 24, 9, 7, 3, 3, stride=(2, 1), padding=1, dtype="bfloat16")
    out = tmp_path / "dw.json"
    assert main(["bench-conv", shape, "--dtype", "bfloat16", "--epilogue", "bias,relu",
                 "--vs", "bc=8", "--candidates", "--warmup", "0", "--rounds", "1",
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.startswith("conv 2x24x9x7 -> 24 3x3 depthwise, bfloat16")
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert all(r["seconds"] > 0 and not r["error"] for r in rows)
    assert {"bq", "bc"} <= set(rows[0]["config"]) and rows[1]["config"]["bc"] == 8
    assert data["flops"] == 2 * 2 * 5 * 7 * 24 * 9


@pytest.mark.parametrize("args, message", [
    (["1x64x56x56x64"], "a conv is NxCxHxWxKxRxS"),
    (["1x3x4x4x8x5x5"], "does not fit"),
    (["1x8x7x7x16x3x3", "--vs", "bq=3"], "bq=3 does not divide Q=5"),
    (["1x8x7x7x16x3x3", "--vs", "colour=5"], "--vs takes FIELD=VALUE"),
    (["1x8x7x7x16x3x3", "--vs", "fold_taps=maybe"], "takes true or false"),
    (["1x8x7x7x16x3x3", "--vs", "spec=ZZZ"], "--vs spec=ZZZ"),
    (["1x8x7x7x16x3x3", "--epilogue", "bias,sparkle"], "unknown epilogue op 'sparkle'"),
    (["1x8x7x7x16x3x3/s2x2p1x1x1x1", "--winograd"], "--winograd: Winograd takes"),
    (["1x8x7x7x8x3x3/s1x1p1x1x1x1g8", "--winograd"], "depthwise conv has no Winograd form"),
    (["1x8x7x7x8x3x3/s1x1p1x1x1x1g8", "--vs", "bc=3"], "bc=3 does not divide C=8"),
    (["1x8x7x7x8x3x3/s1x1p1x1x1x1g8", "--dtype", "uint8_w7"], "no 7-bit-weight kernel"),
])
def test_bad_input_is_one_line(args, message, capsys):
    assert main(["bench-conv", *args, "--warmup", "0", "--rounds", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tvm-tpp: error: ") and message in err[0], err


def test_threads_are_refused_once_the_pool_runs(monkeypatch, capsys):
    running = tvm_ffi.get_global_func("runtime.NumThreads")()  # starts the pool if need be
    monkeypatch.setenv("TVM_NUM_THREADS", str(running))  # restored after the test
    assert main(["bench-conv", "1x8x7x7x16x1x1", "--threads", str(running + 1)]) == 2
    assert "already has" in capsys.readouterr().err


def test_after_writes_the_conv_s_input():
    """The producer's output is a view of the input the rows share: running it changes that
    input to exactly what the producer computes."""
    import numpy as np
    import tvm

    from microkernels.machine import machine_of
    from schedules.conv import default_config
    from schedules.measure import measure
    from tvm_tpp.bench.configs import _producer
    from tvm_tpp.tpp_target import target

    tpp = target("tpp")
    problem = conv_problem("1x16x6x6x32x1x1")
    config = default_config(problem, machine_of(tpp))
    built = {}
    measure(problem, [config], tpp, machine_of(tpp).isa.name, rounds=0, built=built)
    after = conv_problem("1x8x6x6x16x3x3/s1x1p1x1x1x1", epilogue=Epilogue((EpilogueOp("relu"),)))
    producer = _producer(after, problem, [built[config]], tpp)
    x = built[config].args[0]
    before = x.numpy().copy()
    producer()
    y = tvm.runtime.empty((after.rows, after.k), "float32")
    producer.func(*producer.args[:-1], y)
    assert np.array_equal(x.numpy().reshape(y.shape), y.numpy())
    assert not np.array_equal(before, x.numpy())


def test_after_runs_before_each_timed_run(capsys):
    assert main(["bench-conv", "1x16x6x6x32x1x1", "--after", "1x8x6x6x16x3x3/s1x1p1x1x1x1",
                 "--cold", "--warmup", "0", "--rounds", "1"]) == 0
    assert "after conv2d 1x8x6x6x16x3x3/s1x1p1x1x1x1 bias_relu" in capsys.readouterr().out
    # The 3x3 conv's packed input has a border: no producer writes it as it is.
    assert main(["bench-conv", "1x16x6x6x32x3x3/s1x1p1x1x1x1", "--after",
                 "1x8x6x6x16x3x3/s1x1p1x1x1x1", "--warmup", "0", "--rounds", "1"]) == 2
    assert "--after takes the conv before a 1x1 conv" in capsys.readouterr().err
