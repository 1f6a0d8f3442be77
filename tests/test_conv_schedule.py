"""Direct convolution template: loop_spec outer loops around BRGEMM, checked vs numpy.

Each case builds the scheduled PrimFunc, runs it on the packed layouts (NHWC input padded and
width-grouped by the stride, ``[Kb, R, S, C, bk]`` weights, ``[N*P*Q, K]`` output) and compares
with a float64 numpy convolution followed by the epilogue's numpy semantics.
"""

from dataclasses import replace

import numpy as np
import pytest
import tvm
from conftest import pixel_rows

from microkernels import isa
from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.epilogue import reference as epilogue_reference
from microkernels.machine import Machine
from relay_passes.scaffold import dispatched_brgemm
from schedules.conv import (
    ConvConfig,
    ConvProblem,
    can_fold_taps,
    candidates,
    default_config,
    pack_input,
    pack_weight,
    reference,
    schedule,
)
from schedules.loop_spec import LoopSpecError
from schedules.tuner import build

TARGETS = {"avx2": {"kind": "llvm", "mcpu": "haswell"},
           "avx512": {"kind": "llvm", "mcpu": "skylake-avx512"}}
BIAS_RELU = Epilogue((EpilogueOp("bias"), EpilogueOp("relu")))
BIAS_RES_RELU = Epilogue((EpilogueOp("bias"), EpilogueOp("residual"), EpilogueOp("relu")))
#: L2 sizes the defaults are checked against: 1 MiB (Skylake-SP, Zen 4), 2 MiB (Sapphire Rapids).
L2_1MIB = isa.Caches(32 * 1024, 1 << 20, 32 << 20)
L2_2MIB = isa.Caches(48 * 1024, 2 << 20, 105 << 20)


def _run(problem, config, isa_name="avx2", seed=0, func=None):
    """Run ``problem`` and compare with numpy; ``func`` is the kernel when already built."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((problem.n, problem.c, problem.h, problem.w)).astype("float32")
    w = rng.standard_normal((problem.k, problem.c // problem.groups, problem.r, problem.s)
                            ).astype("float32")
    extra = {op.name: rng.standard_normal(op.shape(problem.rows, problem.k)).astype("float32")
             for op in problem.epilogue.inputs("float32")}
    packed_x, packed_w = pack_input(x, problem), pack_weight(w, config.bk, problem)
    assert packed_x.shape == problem.input_shape
    func = func or tvm.compile(schedule(problem, config, isa_name).mod,
                               target=tvm.target.Target(TARGETS[isa_name]))
    y = tvm.runtime.empty((problem.rows, problem.k), "float32")
    func(tvm.runtime.tensor(packed_x), tvm.runtime.tensor(packed_w),
         *[tvm.runtime.tensor(v) for v in extra.values()], y)
    want = pixel_rows(reference(problem, x, w))
    if problem.epilogue.ops:
        want = epilogue_reference(problem.epilogue, want.astype("float32"), extra)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-4, atol=1e-4)
    assert np.abs(y.numpy()).max() > 0


def _machine(isa_name="avx2", caches=isa.DEFAULT_CACHES, threads=2):
    return Machine(isa.from_name(isa_name), caches, threads)


def _default(problem, isa_name="avx2"):
    return default_config(problem, _machine(isa_name))


@pytest.mark.parametrize(
    "problem",
    [
        ConvProblem(1, 8, 7, 7, 24, 1, 1),                                      # 1x1, odd plane
        ConvProblem(2, 16, 13, 13, 32, 3, 3, padding=1, epilogue=BIAS_RES_RELU),
        ConvProblem(1, 16, 56, 56, 16, 3, 3, padding=1, epilogue=BIAS_RELU),   # big plane
        ConvProblem(1, 16, 14, 14, 32, 3, 3, stride=2, padding=1, epilogue=BIAS_RELU),
        ConvProblem(1, 24, 9, 9, 16, 1, 1, stride=2, epilogue=BIAS_RES_RELU),  # projection
        # asymmetric everything: stride (2, 3), padding (t, l, b, r), 3x5 filter
        ConvProblem(2, 8, 9, 11, 8, 3, 5, stride=(2, 3), padding=(1, 2, 0, 1),
                    epilogue=BIAS_RELU),
        # unit BRGEMM dimensions: one pixel (m = 1), one input channel (k = 1), one output
        # channel (n = 1), all three (no BRGEMM left)
        ConvProblem(1, 32, 1, 1, 40, 1, 1, epilogue=BIAS_RELU),
        ConvProblem(1, 1, 9, 9, 8, 1, 1),
        ConvProblem(2, 8, 5, 5, 1, 3, 3, padding=1, epilogue=BIAS_RELU),
        ConvProblem(1, 1, 1, 1, 1, 1, 1),
    ],
    ids=["1x1", "3x3-residual", "56x56", "stride2", "1x1-stride2", "asymmetric", "1-pixel",
         "1-input-channel", "1-output-channel", "all-unit"],
)
def test_default_config(problem):
    _run(problem, _default(problem))


@pytest.mark.parametrize(
    "problem",
    [
        ConvProblem(1, 3, 23, 23, 16, 7, 7, stride=2, padding=3, epilogue=BIAS_RELU),  # stem
        ConvProblem(2, 5, 9, 11, 8, 3, 3, padding=1),                     # odd C, overlapping
        ConvProblem(1, 8, 9, 11, 8, 3, 5, stride=(2, 3), padding=(1, 2, 0, 1),
                    epilogue=BIAS_RES_RELU),                              # S > sw, asymmetric
        ConvProblem(1, 8, 6, 13, 16, 1, 5, padding=(0, 2, 0, 2)),         # 1x5: one call a tile
        ConvProblem(1, 8, 8, 8, 8, 3, 2, stride=2),                       # S = sw: no overlap
    ],
    ids=["rgb-stem", "3x3-odd-channels", "3x5-stride-2x3", "1x5", "2x2-stride-2"],
)
def test_taps_fold_into_one_call_per_filter_row(problem):
    """By default a call over all of a tap's channels reduces the S taps of a filter row at
    once, reading X's rows at the stride of the conv; the same blocks without fold_taps
    make a call per tap.  Both match numpy."""
    folded = replace(_default(problem), batch_rows=False)  # (test_conv_batch_rows.py)
    assert folded.bc == problem.c and folded.fold_taps
    assert dispatched_brgemm(schedule(problem, folded)).batch == problem.s
    _run(problem, folded)
    per_tap = replace(folded, fold_taps=False)
    assert per_tap in candidates(problem, _machine())
    assert dispatched_brgemm(schedule(problem, per_tap)).batch == 1
    _run(problem, per_tap)


def test_taps_fold_only_where_their_channels_are_consecutive():
    """Width dilation, groups and channel blocks keep a tap's channels apart from the next
    tap's: the default makes a call per tap, and asking to fold is an error."""
    dilated = ConvProblem(1, 8, 9, 9, 8, 3, 3, padding=2, dilation=(1, 2))
    grouped = ConvProblem(1, 8, 9, 9, 8, 3, 3, padding=1, groups=2)
    for problem in (dilated, grouped):
        config = _default(problem)
        assert not can_fold_taps(problem, config) and not config.fold_taps
        _run(problem, config)
        with pytest.raises(ValueError, match="fold_taps needs"):
            schedule(problem, replace(config, fold_taps=True))
    blocked = ConvConfig(bq=9, bc=4, bk=8, fold_taps=True)
    assert not can_fold_taps(dilated, blocked)
    with pytest.raises(ValueError, match="fold_taps needs"):
        schedule(replace(dilated, dilation=1, padding=1), blocked)


@pytest.mark.parametrize(
    "spec, c_step, block_steps",
    [
        ("ACbfgde", 1, {}),
        ("ACDbfge", 2, {}),             # taps outside the column blocks, 2 channel blocks/call
        ("bfgACDe", 1, {}),             # reductions outermost: the epilogue runs as its own pass
        ("cACDebfg", 1, {"c": (2,)}),   # K blocked: 2 serial chunks of parallel work
        ("aC{R:2}D{C:2}ebfg", 1, {}),   # thread grid over K blocks x output rows
    ],
)
def test_loop_specs(spec, c_step, block_steps):
    problem = ConvProblem(2, 32, 10, 10, 64, 3, 3, padding=1, epilogue=BIAS_RES_RELU)
    _run(problem, ConvConfig(bq=5, bc=8, bk=16, spec=spec, c_step=c_step,
                             block_steps=block_steps))


@pytest.mark.parametrize(
    "problem",
    [
        ConvProblem(2, 6, 9, 14, 16, 3, 3, padding=1, epilogue=BIAS_RES_RELU),
        # two channel blocks of 512 (a c_step candidate), stride 2 along the width
        ConvProblem(1, 1024, 3, 5, 24, 1, 1, stride=(1, 2), epilogue=BIAS_RELU),
    ],
    ids=["odd-plane", "two-channel-blocks"],
)
def test_candidates_are_correct(problem):
    """Every configuration the tuner may pick computes the conv (all built in one module)."""
    found = candidates(problem, _machine())
    assert found[0] == _default(problem) and len(set(found)) == len(found) <= 14
    assert len({c.spec for c in found}) > 1 and len({(c.bq, c.bk, c.c_step) for c in found}) > 1
    funcs = build(problem, found, tvm.target.Target(TARGETS["avx2"]), "avx2")
    for config, func in zip(found, funcs, strict=True):
        _run(problem, config, func=func)


def test_avx512_kernel():
    if not isa.from_name("avx512").runs_on(isa.host_flags()):
        pytest.skip("this host has no AVX-512F (the AVX2 cases cover the template)")
    problem = ConvProblem(1, 32, 13, 13, 48, 3, 3, padding=1, epilogue=BIAS_RES_RELU)
    _run(problem, _default(problem, "avx512"), "avx512")


@pytest.mark.parametrize("caches", [L2_1MIB, L2_2MIB], ids=["l2-1MiB", "l2-2MiB"])
def test_default_config_choices(caches):
    machine = _machine(caches=caches)
    # AVX2: K blocks of one register tile (16 columns).
    deep = default_config(ConvProblem(1, 512, 7, 7, 512, 3, 3, padding=1), machine)
    assert (deep.bq, deep.bc, deep.bk, deep.spec) == (7, 512, 16, "ACbfgde")
    wide = default_config(ConvProblem(1, 64, 56, 56, 64, 3, 3, padding=1), machine)
    assert (wide.bq, wide.bc, wide.bk, wide.spec) == (28, 64, 16, "ACbfgde")
    prime = default_config(ConvProblem(1, 8, 29, 29, 8, 1, 1), machine)
    assert prime.bq == 29  # no divisor of 29 between 7 and 28: one block
    # 32 K blocks give each thread two tasks or more; a K block's 28 x 28 output plane fits in
    # half of either L2, so each weight panel sweeps the whole plane, unless the 256 KiB
    # filter fits in half of L3 and the 1.5 MiB output does not fit in L2: whole output rows
    # then, instead of streaming the output to memory K block by K block.
    mid = default_config(ConvProblem(1, 128, 28, 28, 512, 1, 1), machine)
    assert mid.spec == ("ADEcbfg" if caches is L2_1MIB else "ACbfgde")
    # VGG's 2.25 MiB 3x3 filter: re-read from L3 for each row of its 3 MiB output, unless it
    # outgrows half of L3.
    vgg = ConvProblem(1, 256, 56, 56, 256, 3, 3, padding=1)
    assert default_config(vgg, machine).spec == "ADEcbfg"
    small_l3 = _machine(caches=isa.Caches(32 * 1024, 512 * 1024, 4 << 20))
    assert default_config(vgg, small_l3).spec == "ACbfgde"
    # The same with AVX-512's 64-channel K blocks: a 64 KiB filter, a 3 MiB output.
    expand = default_config(ConvProblem(1, 64, 56, 56, 256, 1, 1), _machine("avx512", caches))
    assert (expand.bk, expand.spec) == (64, "ADEcbfg")
    # A width the register tile does not divide keeps vector_block's wider block.
    assert default_config(ConvProblem(1, 64, 8, 8, 24, 1, 1), machine).bk == 24
    # 136 channels a group (ShuffleNet's 544 in 4 groups): whole vectors, not 68 (8.5 vectors).
    assert default_config(ConvProblem(1, 544, 7, 7, 544, 1, 1, groups=4), machine).bk == 8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), "ConvProblem.n must be a positive int"),
        (dict(r=9), "a 9x3 filter does not fit"),
        (dict(stride=0), "strides must be >= 1"),
        (dict(padding=(1, 1)), "padding must be an int or a tuple of 4 ints"),
        (dict(padding=-1), "padding must be >= 0"),
        (dict(dtype="int8"), "float32"),
        (dict(epilogue=Epilogue((EpilogueOp("convert", dtype="bfloat16"),))), "writes float32"),
    ],
)
def test_bad_problems(kwargs, message):
    args = dict(n=1, c=8, h=8, w=8, k=8, r=3, s=3) | kwargs
    with pytest.raises((ValueError, TypeError), match=message):
        ConvProblem(**args)


def test_bad_configs():
    problem = ConvProblem(1, 16, 8, 8, 32, 3, 3, padding=1)
    with pytest.raises(ValueError, match="bq=3 does not divide Q=8"):
        schedule(problem, ConvConfig(bq=3, bc=16, bk=16))
    with pytest.raises(ValueError, match="c_step=3 does not divide"):
        schedule(problem, ConvConfig(bq=8, bc=4, bk=16, c_step=3))
    with pytest.raises(LoopSpecError, match="reduction"):
        schedule(problem, ConvConfig(bq=8, bc=16, bk=16, spec="ACDeBfg"))
    with pytest.raises(LoopSpecError):
        schedule(problem, ConvConfig(bq=8, bc=16, bk=16, spec="ACDebf"))  # g missing
    with pytest.raises(ValueError, match="loop letters"):
        ConvConfig(bq=8, bc=16, bk=16, block_steps={"x": (2,)})


@pytest.mark.parametrize("problem", [
    ConvProblem(1, 16, 16, 16, 16, 3, 3, padding=12, dilation=12),  # DeepLab's rate 12
    ConvProblem(2, 5, 7, 9, 12, 3, 3, stride=(2, 1), padding=(2, 1, 0, 1), dilation=(2, 1)),
    ConvProblem(1, 8, 7, 7, 16, 3, 3, padding=1, epilogue=BIAS_RELU),  # ResNet's last stage
])
def test_filter_rows_over_the_zero_border_are_skipped(problem):
    """With a zero border a BRGEMM call whose filter row reads border rows only is skipped:
    NaN in those rows never reaches the output, which still equals the convolution."""
    config = _default(problem)
    assert "T.where" in schedule(problem, config).mod.script()
    rng = np.random.default_rng(5)
    x = rng.standard_normal((problem.n, problem.c, problem.h, problem.w)).astype("float32")
    w = rng.standard_normal((problem.k, problem.c, problem.r, problem.s)).astype("float32")
    packed = pack_input(x, problem)
    top, _, bottom, _ = problem.padding
    packed[:, :top] = np.nan
    packed[:, top + problem.h:] = np.nan
    func = tvm.compile(schedule(problem, config).mod, target=tvm.target.Target(TARGETS["avx2"]))
    extra = {op.name: rng.standard_normal(op.shape(problem.rows, problem.k)).astype("float32")
             for op in problem.epilogue.inputs("float32")}
    y = tvm.runtime.empty((problem.rows, problem.k), "float32")
    func(tvm.runtime.tensor(packed), tvm.runtime.tensor(pack_weight(w, config.bk, problem)),
         *[tvm.runtime.tensor(v) for v in extra.values()], y)
    want = pixel_rows(reference(problem, x, w))
    if problem.epilogue.ops:
        want = epilogue_reference(problem.epilogue, want.astype("float32"), extra)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec", ["ACbfgde", "ACDebfg", "ADEcbfg", "aCdgfbe"])
def test_filter_columns_over_the_zero_border_are_skipped(spec):
    """A dilated filter's calls whose column reads border columns only, for a whole block of
    output columns, are skipped too: in blocks of 4 columns this conv never reads its border,
    NaN there never reaches the output, whatever the order of the taps' loops."""
    problem = ConvProblem(2, 5, 8, 8, 12, 3, 3, padding=4, dilation=4, epilogue=BIAS_RELU)
    config = replace(_default(problem), spec=spec)
    assert config.bq == 4
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 5, 8, 8)).astype("float32")
    w = rng.standard_normal((12, 5, 3, 3)).astype("float32")
    packed = pack_input(x, problem)
    packed[:, :4] = packed[:, 12:] = np.nan
    packed[:, :, :4] = packed[:, :, 12:] = np.nan
    func = tvm.compile(schedule(problem, config).mod, target=tvm.target.Target(TARGETS["avx2"]))
    bias = rng.standard_normal(12).astype("float32")
    y = tvm.runtime.empty((problem.rows, 12), "float32")
    func(tvm.runtime.tensor(packed), tvm.runtime.tensor(pack_weight(w, config.bk, problem)),
         tvm.runtime.tensor(bias), y)
    want = np.maximum(pixel_rows(reference(problem, x, w)) + bias, 0)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bq", [4, 8, 16])
def test_column_blocks_without_a_real_call_keep_the_zeroing_pass(bq):
    """A border wider than the filter leaves whole column blocks without a call over real
    input: they are zeroed, then take the epilogue (ReLU of the bias)."""
    problem = ConvProblem(1, 8, 4, 4, 16, 3, 3, padding=(1, 8, 1, 8), dilation=(1, 2),
                          epilogue=BIAS_RELU)
    assert _default(problem).bq == 4
    _run(problem, replace(_default(problem), bq=bq))


def test_a_border_of_other_values_is_read_whole():
    """``zero_border=False`` (a zero point pads the input): every filter row is computed."""
    problem = ConvProblem(1, 8, 6, 5, 16, 3, 3, padding=2, dilation=2, zero_border=False)
    config = _default(problem)
    script = schedule(problem, config).mod.script()
    # No call is guarded (the dropped zeroing pass is never run: where False).
    assert all("T.where(T.bool(False))" in line for line in script.splitlines()
               if "T.where" in line)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, 8, 6, 5)).astype("float32")
    w = rng.standard_normal((16, 8, 3, 3)).astype("float32")
    func = tvm.compile(schedule(problem, config).mod, target=tvm.target.Target(TARGETS["avx2"]))
    y = tvm.runtime.empty((problem.rows, 16), "float32")
    func(tvm.runtime.tensor(pack_input(x, problem, pad_value=3.0)),
         tvm.runtime.tensor(pack_weight(w, config.bk, problem)), y)
    want = pixel_rows(reference(problem, x, w, pad_value=3.0))
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-4, atol=1e-4)
