"""A conv's filter rows as its BRGEMM's batch (``ConvConfig.batch_rows``): one call per output
tile over the whole filter, A's blocks a row of the image apart (``BrgemmShape.batched_a``),
those over the zero border left out (``skips_blocks``).

Numerics against numpy on odd sizes in every dtype (borders deeper than the filter, a zero
point's border computed), the single zeroing call it schedules and the epilogue it then takes
in registers, the rule that picks it and the tuner's candidates.
"""

from dataclasses import replace

import pytest
from conftest import runs_here
from test_conv_lowp import REQUANT as REQUANTIZE
from test_conv_lowp import _check as check_lowp
from test_conv_schedule import _run as check_float32

from microkernels import isa
from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.machine import Machine
from relay_passes.scaffold import dispatched_brgemm
from schedules.conv import (
    ConvConfig,
    ConvProblem,
    can_batch_rows,
    candidates,
    default_config,
    rows_batch_pays,
    schedule,
)
from schedules.register_epilogue import epilogue_in_registers

BIAS_RELU = Epilogue((EpilogueOp("bias"), EpilogueOp("relu")))
VNNI = "avx512_vnni" if runs_here("avx512_vnni") else "avx2"
BF16 = "avx512_bf16" if runs_here("avx512_bf16") else "avx2"

# Odd maps and channels, strides, a 5x5 filter, paddings deeper on one side, one deeper than
# the filter (its first output row reads nothing but the border).
PROBLEMS = [
    ConvProblem(2, 12, 9, 7, 20, 3, 3, padding=1),
    ConvProblem(1, 8, 11, 10, 16, 3, 3, stride=2, padding=(1, 1, 0, 0)),
    ConvProblem(1, 4, 8, 9, 24, 5, 5, padding=(2, 1, 3, 2)),
    ConvProblem(1, 8, 6, 7, 16, 3, 3, padding=(4, 1, 2, 1)),
]


def _rows_batched(problem: ConvProblem, bq: int, bk: int) -> ConvConfig:
    config = ConvConfig(bq=bq, bc=problem.padded_c, bk=bk, spec="ADEcbfg", fold_taps=True,
                        batch_rows=True)
    config.check(problem)
    return config


def _blocks(problem: ConvProblem) -> tuple[int, int]:
    return max(d for d in range(1, 8) if problem.q % d == 0), 4 if problem.k % 8 else 8


@pytest.mark.parametrize("problem", PROBLEMS)
def test_uint8_against_numpy(problem):
    problem = replace(problem, dtype="uint8", epilogue=REQUANTIZE)
    check_lowp(problem, _rows_batched(problem, *_blocks(problem)), VNNI)


def test_uint8_zero_point_border():
    """A non-zero border (a quantized input's zero point) is computed like any input."""
    problem = replace(PROBLEMS[0], dtype="uint8")
    config = _rows_batched(problem, 7, 4)
    check_lowp(problem, config, VNNI, pad_value=7)
    assert not dispatched_brgemm(schedule(replace(problem, zero_border=False), config,
                                          VNNI)).skips_blocks


@pytest.mark.parametrize("problem", PROBLEMS[:2])
def test_bfloat16_against_numpy(problem):
    problem = replace(problem, dtype="bfloat16", epilogue=BIAS_RELU)
    check_lowp(problem, _rows_batched(problem, *_blocks(problem)), BF16)


@pytest.mark.parametrize("problem", PROBLEMS)
def test_float32_against_numpy(problem):
    problem = replace(problem, epilogue=BIAS_RELU)
    check_float32(problem, _rows_batched(problem, *_blocks(problem)))


def test_one_zeroing_call_per_tile_and_the_epilogue_in_registers():
    problem = replace(PROBLEMS[0], dtype="uint8", epilogue=REQUANTIZE)
    batched = _rows_batched(problem, 7, 4)
    sch = schedule(problem, batched, "avx512_vnni")
    shape = dispatched_brgemm(sch)
    assert (shape.batch, shape.k, shape.batched_a, shape.skips_blocks, shape.beta) == (
        3, 3 * 12, True, True, 0)
    func = sch.mod["main"]
    assert '"epilogue"' in func.script()
    assert '"epilogue"' not in epilogue_in_registers(func).script()
    # A call per filter row: each skips the border's rows, adds to C after the first, and
    # leaves the epilogue a pass of its own.
    per_row = schedule(problem, replace(batched, batch_rows=False), "avx512_vnni")
    shape = dispatched_brgemm(per_row)
    assert (shape.batch, shape.batched_a, shape.first_call_zeroes) == (3, False, True)
    func = per_row.mod["main"]
    assert epilogue_in_registers(func) is func


def test_config_validation():
    problem = PROBLEMS[0]
    with pytest.raises(ValueError, match="needs fold_taps"):
        ConvConfig(bq=7, bc=12, bk=4, batch_rows=True)
    dilated = ConvProblem(1, 8, 12, 12, 8, 3, 3, padding=2, dilation=(2, 1))
    with pytest.raises(ValueError, match="without height dilation"):
        ConvConfig(bq=7, bc=8, bk=8, fold_taps=True, batch_rows=True).check(dilated)
    assert not can_batch_rows(problem, ConvConfig(7, 12, 4, spec="ACDefbg", fold_taps=True))
    with pytest.raises(TypeError, match="batch_rows must be a bool"):
        ConvConfig(bq=7, bc=12, bk=4, fold_taps=True, batch_rows=1)


ZEN4 = Machine(isa.from_name("avx512_bf16"), isa.Caches(32 << 10, 1 << 20, 32 << 20), 2)
AMX = Machine(isa.from_name("amx"), isa.Caches(48 << 10, 2 << 20, 105 << 20), 2)


@pytest.mark.parametrize("c,h,dtype", [(64, 56, "uint8"), (512, 7, "uint8"),
                                        (128, 28, "bfloat16"), (256, 56, "float32")])
def test_the_default_batches_every_folded_filter_off_amx(c, h, dtype):
    problem = ConvProblem(8, c, h, h, c, 3, 3, padding=1, dtype=dtype)
    assert rows_batch_pays(problem, ZEN4) and default_config(problem, ZEN4).batch_rows
    assert default_config(replace(problem, zero_border=False), ZEN4).batch_rows


def test_never_on_amx_tiles_and_both_among_the_candidates():
    problem = ConvProblem(8, 64, 56, 56, 64, 3, 3, padding=1, dtype="uint8")
    assert not rows_batch_pays(problem, AMX) and not default_config(problem, AMX).batch_rows
    assert not any(c.batch_rows for c in candidates(problem, AMX))
    found = candidates(problem, ZEN4)
    assert found[0].batch_rows and any(c.fold_taps and not c.batch_rows for c in found)
    # A 1x1 conv has no filter rows to batch.
    assert not any(c.batch_rows for c in candidates(ConvProblem(8, 64, 56, 56, 64, 1, 1,
                                                                dtype="uint8"), ZEN4))
