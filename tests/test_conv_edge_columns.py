"""A conv's first and last output columns leave out the filter taps over the zero border
(``BrgemmShape.edge_k``, :func:`schedules.conv.edge_columns`): with its rows batched, a call
whose block starts (ends) the map skips its first (last) row's products with those taps.

Numerics against numpy on odd maps cut into several column blocks (a middle block skips
nothing), a 5x5 filter over a border two columns deep, several register tiles per call,
stride 2 (with and without a right border) and unequal borders, in uint8, bfloat16 and
float32; the rule that sets ``edge_k`` and the flags the schedule binds.
"""

from dataclasses import replace

import pytest
import tvm_ffi
from conftest import runs_here
from test_conv_lowp import REQUANT as REQUANTIZE
from test_conv_lowp import _check as check_lowp
from test_conv_schedule import _run as check_float32
from tvm import tirx

from microkernels.epilogue import Epilogue, EpilogueOp
from relay_passes.scaffold import dispatched_brgemm
from schedules.conv import ConvConfig, ConvProblem, edge_columns, schedule

BIAS_RELU = Epilogue((EpilogueOp("bias"), EpilogueOp("relu")))
VNNI = "avx512_vnni" if runs_here("avx512_vnni") else "avx2"
BF16 = "avx512_bf16" if runs_here("avx512_bf16") else "avx2"

# (problem, bq, bk): 10 columns in blocks of 10 (two register tiles of 5 rows at bk=64), 5
# and 2 (a middle block leaves nothing out); a 5x5 filter, two border columns each side.
CASES = [
    (ConvProblem(1, 8, 6, 10, 64, 3, 3, padding=1), 10, 64),
    (ConvProblem(1, 8, 6, 10, 64, 3, 3, padding=1), 5, 16),
    (ConvProblem(2, 12, 5, 10, 20, 3, 3, padding=1), 2, 4),
    (ConvProblem(1, 4, 7, 9, 16, 5, 5, padding=2), 9, 16),
]


def _config(problem: ConvProblem, bq: int, bk: int) -> ConvConfig:
    config = ConvConfig(bq=bq, bc=problem.padded_c, bk=bk, spec="ADEcbfg", fold_taps=True,
                        batch_rows=True)
    config.check(problem)
    return config


@pytest.mark.parametrize("problem,bq,bk", CASES)
def test_uint8_against_numpy(problem, bq, bk):
    problem = replace(problem, dtype="uint8", epilogue=REQUANTIZE)
    check_lowp(problem, _config(problem, bq, bk), VNNI)


@pytest.mark.parametrize("problem,bq,bk", CASES[:2] + CASES[3:])
def test_bfloat16_against_numpy(problem, bq, bk):
    problem = replace(problem, dtype="bfloat16", epilogue=BIAS_RELU)
    check_lowp(problem, _config(problem, bq, bk), BF16)


@pytest.mark.parametrize("problem,bq,bk", CASES)
def test_float32_against_numpy(problem, bq, bk):
    check_float32(replace(problem, epilogue=BIAS_RELU), _config(problem, bq, bk))


def test_edge_k_rule():
    p = ConvProblem(1, 12, 14, 14, 16, 3, 3, padding=1, dtype="uint8")
    assert edge_columns(p, 14) == (12, True, True)
    assert edge_columns(replace(p, c=62), 14) == (64, True, True)  # whole VNNI groups
    assert edge_columns(ConvProblem(1, 4, 7, 9, 16, 5, 5, padding=2), 9) == (8, True, True)
    # Stride 2 over an even width: the last column reads no border; over an odd one it does.
    assert edge_columns(replace(p, stride=(1, 2)), 7) == (12, True, False)
    assert edge_columns(replace(p, w=13, stride=(1, 2)), 7) == (12, True, True)
    # Borders of one and two columns: the first column's one tap on both sides.
    assert edge_columns(replace(p, padding=(1, 1, 1, 2)), 5) == (12, True, True)
    for other in (replace(p, zero_border=False), replace(p, padding=(1, 0, 1, 0)),
                  ConvProblem(1, 12, 14, 14, 16, 3, 3, padding=2),  # more than half the filter
                  ConvProblem(1, 8, 14, 14, 8, 3, 3, padding=2, dilation=(1, 2))):
        assert edge_columns(other, 14) == (0, False, False)
    assert edge_columns(p, 1) == (0, False, False)  # a one-pixel block is both edges at once


@pytest.mark.parametrize("problem,bq", [
    (ConvProblem(1, 8, 9, 10, 16, 3, 3, stride=2, padding=1), 5),  # no right border
    (ConvProblem(2, 8, 9, 9, 16, 3, 3, stride=2, padding=1), 5),   # both, one block
    (ConvProblem(1, 8, 6, 10, 16, 3, 3, padding=(1, 1, 1, 2)), 11)])  # borders 1 and 2 deep
def test_strided_and_unequal_borders_against_numpy(problem, bq):
    uint8 = replace(problem, dtype="uint8", epilogue=REQUANTIZE)
    check_lowp(uint8, _config(uint8, bq, 16), VNNI)
    check_float32(replace(problem, epilogue=BIAS_RELU), _config(problem, bq, 16))
    assert dispatched_brgemm(schedule(uint8, _config(uint8, bq, 16), VNNI)).edge_k == 8


@pytest.mark.parametrize("dtype,isa_name", [("uint8", "avx512_vnni"), ("float32", "avx512")])
def test_the_schedule_binds_the_flags_per_column_block(dtype, isa_name):
    problem = ConvProblem(1, 8, 6, 10, 64, 3, 3, padding=1, dtype=dtype)
    sch = schedule(problem, _config(problem, 5, 16), isa_name)
    shape = dispatched_brgemm(sch)
    assert (shape.batched_a, shape.edge_k, shape.name.endswith(f"_edges{problem.padded_c}")) \
        == (True, problem.padded_c, True)
    free = []
    tvm_ffi.structural_walk(sch.mod["main"].body, (tirx.Var, lambda v: free.append(v.name)
                                                   if v.name.startswith("tpp_") else None))
    assert not free  # both flags replaced by the block's conditions
    script = sch.mod["main"].script()
    assert script.count("== 0") >= 1 and script.count("== 1") >= 1  # first, last of 2 blocks
    none = replace(problem, padding=(1, 0, 1, 2))  # Q stays 10; two border taps on the right
    assert dispatched_brgemm(schedule(none, _config(none, 5, 16), isa_name)).edge_k == 0
