"""GEMM schedule template: loop_spec strings -> TVM schedules around BRGEMM, checked vs numpy.

Every candidate below is built, run and compared with numpy: the paper's example strings,
candidates drawn from the generated space, grids, epilogues, a single-row GEMM and the errors.
"""

import numpy as np
import pytest
import tvm

from microkernels import isa
from microkernels.epilogue import Epilogue, EpilogueOp, reference
from microkernels.machine import Machine
from schedules.blocking import divisors
from schedules.gemm import GemmConfig, GemmProblem, blockings, default_config, pack_weight, schedule
from schedules.loop_spec import LoopSpecError
from schedules.space import generate

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
BIAS_RELU = Epilogue((EpilogueOp("bias"), EpilogueOp("relu")))
#: L2 sizes the defaults are checked against: 1 MiB (Skylake-SP, Zen 4), 2 MiB (Sapphire
#: Rapids), and a small 64 KiB one.
L2_256KIB = isa.Caches(32 * 1024, 256 << 10, 8 << 20)
L2_1MIB = isa.Caches(32 * 1024, 1 << 20, 32 << 20)
SMALL_L2 = isa.Caches(32 * 1024, 64 * 1024, 1 << 20)


def _avx2(caches: isa.Caches, threads: int = 2) -> Machine:
    return Machine(isa.from_name("avx2"), caches, threads)


def _run(problem, config, isa="avx2", seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((problem.m, problem.k)).astype("float32")
    w = rng.standard_normal((problem.k, problem.n)).astype("float32")
    extra = {op.name: rng.standard_normal(op.shape(problem.m, problem.n)).astype("float32")
             for op in problem.epilogue.inputs("float32")}
    func = tvm.compile(schedule(problem, config, isa).mod, target=TARGET)
    y = tvm.runtime.empty((problem.m, problem.n), "float32")
    func(tvm.runtime.tensor(x), tvm.runtime.tensor(pack_weight(w, config.bn)),
         *[tvm.runtime.tensor(v) for v in extra.values()], y)
    want = (x.astype(np.float64) @ w).astype(np.float32)
    if problem.epilogue.ops:
        want = reference(problem.epilogue, want, extra)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-4, atol=1e-4)
    assert np.abs(y.numpy()).max() > 0


@pytest.mark.parametrize(
    "spec, block_steps, k_step",
    [
        ("aBC", {}, 2),
        ("bCa", {}, 1),
        ("BCa", {}, 4),
        ("bcaBCb", {"b": (4, 2), "c": (2,)}, 1),
        ("bcabcb", {"b": (4, 2), "c": (2,)}, 2),
        ("bC{R:2}aB{C:1}cb", {"b": (4, 2), "c": (2,)}, 1),
        ("bc|aBCb @ schedule(dynamic, 1)", {"b": (4, 2), "c": (2,)}, 1),
    ],
)
def test_paper_specs(spec, block_steps, k_step):
    problem = GemmProblem(64, 128, 96, epilogue=BIAS_RELU)
    _run(problem, GemmConfig.of(spec, 8, 32, 24, k_step=k_step, block_steps=block_steps))


def test_generated_candidates_all_correct():
    """A spread of the PARLOOPER space (blocked 2x/3x, collapses, orders) for one GEMM."""
    problem = GemmProblem(48, 64, 32)
    bm, bn, bk = 6, 16, 8  # trips: K 4, M 8, N 4
    candidates = generate(4, 8, 4, max_candidates=12, seed=1)
    assert len(candidates) == 12
    for candidate in candidates:
        _run(problem, GemmConfig(bm, bn, bk, candidate))


@pytest.mark.parametrize(
    "m, n, k, epilogue",
    [
        (1, 40, 24, BIAS_RELU),  # a single row: GEMV-shaped, unit row loop
        (7, 24, 13, Epilogue()),  # odd everything, no epilogue
        (33, 48, 64, Epilogue((EpilogueOp("bias"), EpilogueOp("residual"),
                               EpilogueOp("gelu", variant="tanh")))),
    ],
)
def test_default_config_odd_shapes(m, n, k, epilogue):
    problem = GemmProblem(m, n, k, epilogue=epilogue)
    _run(problem, default_config(problem, _avx2(isa.DEFAULT_CACHES)))


def test_divisors():
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(97) == [1, 97]


@pytest.mark.parametrize(
    "spec, block_steps, message, position",
    [
        ("aBd", {}, "only 3 loops are declared", 2),
        ("bCA", {}, "reduction", 2),
        ("bcaBCb", {"b": (3, 2)}, "must nest perfectly", None),
        ("bc{R:3}aBCb", {"b": (4, 2), "c": (2,)}, "only upper-case", 2),
        ("bC{R:3}aB{C:1}cb", {"b": (4, 2), "c": (2,)}, "teams do not divide", 1),
    ],
)
def test_bad_specs(spec, block_steps, message, position):
    problem = GemmProblem(64, 128, 96)
    with pytest.raises(ValueError, match=message) as err:
        schedule(problem, GemmConfig.of(spec, 8, 32, 24, block_steps=block_steps))
    if position is not None:
        assert isinstance(err.value, LoopSpecError) and err.value.position == position


def test_blocks_must_tile():
    with pytest.raises(ValueError, match="bm=7 does not divide 64"):
        schedule(GemmProblem(64, 128, 96), GemmConfig.of("bCa", 7, 32, 24))
    with pytest.raises(ValueError, match="k_step=3 does not divide"):
        schedule(GemmProblem(64, 128, 96), GemmConfig.of("bCa", 8, 32, 24, k_step=3))
    with pytest.raises(ValueError, match="handles float32, bfloat16, uint8, got 'int8'"):
        GemmProblem(4, 4, 4, dtype="int8")


@pytest.mark.parametrize(
    "spec, block_steps, k_step, pack_a",
    [
        ("acb", {}, 1, 0),  # all of X packed before the loops
        ("acb", {}, 1, 1),  # one K block's columns, reused by every N block
        ("aCB", {}, 1, 1),  # the copy runs in parallel ahead of the parallel loop
        ("cabc", {"c": (2,)}, 1, 3),  # an M x K block under the M loop (BLAS's mc x kc)
        ("BCa", {}, 2, 2),  # inside the parallel loop: each task packs its own rows
        ("bcaBCb", {"b": (4, 2), "c": (2,)}, 1, 5),  # under the last collapsed loop
        ("bC{R:2}aB{C:1}cb", {"b": (4, 2), "c": (2,)}, 1, 3),  # inside a thread grid
    ],
)
def test_packed_a(spec, block_steps, k_step, pack_a):
    problem = GemmProblem(64, 128, 96, epilogue=BIAS_RELU)
    _run(problem, GemmConfig.of(spec, 8, 32, 24, k_step=k_step, block_steps=block_steps,
                                pack_a=pack_a))


def test_packed_a_odd_sizes():
    """Ragged register tiles and K steps read from the packed buffer."""
    _run(GemmProblem(35, 40, 63), GemmConfig.of("aCb", 7, 8, 21, pack_a=1))
    _run(GemmProblem(13, 24, 45), GemmConfig.of("bCa", 13, 24, 9, k_step=5, pack_a=1))


def test_long_k_default_packs_a():
    problem = GemmProblem(40, 64, 1024, epilogue=BIAS_RELU)
    config = default_config(problem, _avx2(SMALL_L2))  # K x bn panel > L2 / 2
    assert config.pack_a == 1 and config.k_step == 1 and config.spec.startswith("a")
    _run(problem, config)
    roomy = default_config(problem, _avx2(isa.DEFAULT_CACHES))
    assert roomy.pack_a is None and roomy.k_step == 1024 // roomy.bk


@pytest.mark.parametrize("caches, long_k", [(L2_256KIB, True), (L2_1MIB, False)],
                         ids=["l2-256KiB", "l2-1MiB"])
def test_default_splits_k_when_its_panel_outgrows_half_of_l2(caches, long_k):
    # 256 x 128 x 4096: bn = 16 (one AVX2 register tile), so the whole-K panel of B is
    # 4096 x 16 floats = 256 KiB.
    config = default_config(GemmProblem(256, 128, 4096), _avx2(caches))
    if long_k:
        assert (config.bm, config.bn, config.bk, config.spec, config.pack_a) == \
            (256, 16, 512, "aCB", 1)
    else:
        assert (config.bm, config.bn, config.bk, config.k_step, config.pack_a) == \
            (64, 16, 512, 8, None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_avx512_vector_kernels_keep_the_whole_k_however_long(dtype):
    # BERT's FFN-out GEMM: a 3072 x 64 panel (768 KiB in float32) outgrows half of a 1 MiB
    # L2, as 8192 x 64 in bf16 does; AVX2 splits such a K, AMX tiles too.
    k = 3072 if dtype == "float32" else 8192
    problem = GemmProblem(128, 768, k, dtype)
    config = default_config(problem, Machine(isa.from_name("avx512_bf16"), L2_1MIB, 2))
    assert (config.bn, config.k_step * config.bk, config.pack_a) == (64, k, None)
    assert default_config(problem, _avx2(SMALL_L2)).pack_a == 1


def test_an_m_with_few_divisors_runs_in_tall_calls_not_rows():
    """197 rows (ViT's tokens) have no divisor between 1 and 197: one call of 197 rows, not
    197 calls of one (3.3x slower on a Zen 3)."""
    machine = _avx2(isa.DEFAULT_CACHES)
    assert default_config(GemmProblem(197, 768, 768), machine).bm == 197
    assert default_config(GemmProblem(1576, 768, 768, "uint8"), machine).bm == 197
    problem = GemmProblem(197, 40, 24, epilogue=BIAS_RELU)
    _run(problem, default_config(problem, machine))


def test_default_columns_are_one_register_tile():
    """x86 GEMMs take one register tile of columns per call where it divides N (16 on
    AVX2, 64 on AVX-512): the call streams its panel of B; the tuner still tries the wide
    blocks of up to 64 columns."""
    problem = GemmProblem(128, 3072, 768)
    assert default_config(problem, _avx2(isa.DEFAULT_CACHES)).bn == 16
    avx512 = Machine(isa.from_name("avx512"), isa.DEFAULT_CACHES, threads=2)
    assert default_config(problem, avx512).bn == 64
    assert {c.bn for c in blockings(problem, _avx2(isa.DEFAULT_CACHES))} == {16, 64}
    assert default_config(GemmProblem(128, 40, 768), _avx2(isa.DEFAULT_CACHES)).bn == 40


def test_with_candidate_packs_under_the_outermost_k_loop():
    from schedules.space import Candidate

    packed = GemmConfig.of("acb", 8, 32, 24, pack_a=1)
    assert packed.with_candidate(Candidate("cBCa")).pack_a == 4
    assert packed.with_candidate(Candidate("bcaBCb")).pack_a == 3
    assert GemmConfig.of("acb", 8, 32, 24).with_candidate(Candidate("BCa")).pack_a is None
    # Depth counts loops, not characters: a thread grid's "{R:2}" is no loop.
    grid = packed.with_candidate(Candidate("bC{R:2}aB{C:1}cb", {"b": (4, 2), "c": (2,)}))
    assert grid.pack_a == 3
    _run(GemmProblem(64, 128, 96), grid)


@pytest.mark.parametrize(
    "spec, pack_a, message, position",
    [
        ("BCa", 4, "deeper than the 3 loops", 3),
        ("BCa", 1, "splits the collapsed parallel loops", 0),
    ],
)
def test_bad_pack_depth(spec, pack_a, message, position):
    with pytest.raises(LoopSpecError, match=message) as err:
        schedule(GemmProblem(64, 128, 96), GemmConfig.of(spec, 8, 32, 24, pack_a=pack_a))
    assert err.value.position == position
    with pytest.raises(ValueError, match="pack_a"):
        GemmConfig.of(spec, 8, 32, 24, pack_a=-1)


@pytest.mark.parametrize("spec", ["abc", "aBC"])
def test_zeroing_pass_before_an_outermost_k_loop_is_parallel(spec):
    """With K outermost, C is zeroed in a pass of its own: one fused parallel loop (a serial
    constant nest is unrolled by LLVM into thousands of stores), and the result is right."""
    problem = GemmProblem(48, 64, 96)
    config = GemmConfig.of(spec, 8, 32, 24, k_step=2)
    sch = schedule(problem, config)
    outer, inner = sch.get_loops(sch.get_sblock("C_init"))
    assert sch.get(outer).kind == tvm.tirx.ForKind.PARALLEL
    assert sch.get(outer).extent == 48 * 64 // 32  # every row and vector of C, fused
    assert sch.get(inner).kind == tvm.tirx.ForKind.VECTORIZED
    _run(problem, config)


def test_a_gemv_streams_whole_vectors_where_no_register_tile_divides_n():
    """ResNet's classifier (N = 1000): 8 columns per call, one stream of B per call; more
    rows keep the wider blocks (single-vector tiles broadcast A for every FMA)."""
    machine = _avx2(isa.DEFAULT_CACHES)
    assert default_config(GemmProblem(1, 1000, 2048), machine).bn == 8
    assert default_config(GemmProblem(128, 1000, 2048), machine).bn == 40
    # The tuner measures B warm, where wide blocks win: a GEMV is offered its streams only.
    assert {c.bn for c in blockings(GemmProblem(1, 1000, 2048), machine)} == {8}
    _run(GemmProblem(3, 40, 70), default_config(GemmProblem(3, 40, 70), machine))
