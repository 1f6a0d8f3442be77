"""The loop_spec space as a MetaSchedule design space (schedules.ms_space)."""

import numpy as np
import pytest
import tvm

import tvm_tpp
from microkernels import isa
from microkernels.machine import Machine, machine_of
from schedules.gemm import (
    GemmConfig,
    GemmProblem,
    default_config,
    pack_weight,
    ranked_configs,
    workload,
)
from schedules.ms_space import gemm_space, space_configs, tune_gemm_ms
from schedules.space import Candidate

PROBLEM = GemmProblem(42, 80, 36)
#: L2 sizes of the machines the long-K test describes: 256 KiB (an AVX2 Haswell's) and
#: 1 MiB (Zen 4's).
L2_256KIB = isa.Caches(32 * 1024, 256 << 10, 8 << 20)
L2_1MIB = isa.Caches(48 * 1024, 1 << 20, 32 << 20)


@pytest.fixture(scope="module")
def target():
    return tvm_tpp.target("tpp", num_cores=2)


def _check(sch, bn: int, target) -> None:
    """Build ``sch`` and compare it with numpy float64 on random data."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((PROBLEM.m, PROBLEM.k)).astype("float32")
    w = rng.standard_normal((PROBLEM.k, PROBLEM.n)).astype("float32")
    y = tvm.runtime.empty((PROBLEM.m, PROBLEM.n), "float32")
    tvm.compile(sch.mod, target=target)(tvm.runtime.tensor(x),
                                         tvm.runtime.tensor(pack_weight(w, bn)), y)
    np.testing.assert_allclose(y.numpy(), x.astype("float64") @ w, rtol=1e-4, atol=1e-4)


def test_one_design_space_per_candidate_each_correct(target):
    configs = space_configs(PROBLEM, machine_of(target), top_n=4)
    assert 4 <= len(configs) <= 5 and len(set(configs)) == len(configs)
    space = gemm_space(PROBLEM, target, configs)
    mod = tvm.IRModule({"main": workload(PROBLEM, configs[0].bn)})
    spaces = space.generate_design_space(mod)
    assert len(spaces) == len(configs)
    for sch, config in zip(spaces, configs, strict=True):
        # Each space is its config's schedule, replayed onto MetaSchedule's own Schedule.
        assert f"tpp_brgemm_{target.attrs['model']}_float32_flat_{config.bm}x" in str(sch.trace)
        _check(sch, config.bn, target)
    assert len({str(s.trace) for s in spaces}) == len(spaces)


def test_replayed_k_splits_bind_their_first_call(target):
    """A config whose K takes several calls zeroes C on the first (a flag its schedule binds
    outside the trace): the replayed design space binds it again and computes right."""
    split = GemmConfig.of("BCa", 42, 16, 12, k_step=1)
    space = gemm_space(PROBLEM, target, [split])
    (sch,) = space.generate_design_space(tvm.IRModule({"main": workload(PROBLEM, split.bn)}))
    assert "_beta0first" in str(sch.trace) and "tpp_first_call" not in sch.mod.script()
    _check(sch, split.bn, target)


@pytest.mark.parametrize("caches, packed", [(L2_256KIB, True), (L2_1MIB, False)],
                         ids=["l2-256KiB", "l2-1MiB"])
def test_long_k_space_is_the_tuners_ranking(caches, packed):
    # K = 4096 on 256 rows on AVX2 (the AVX-512 vector kernels never split K by default):
    # the whole-K panel of B (4096 x 16 floats, 256 KiB) outgrows half of a 256 KiB L2, so
    # the default splits K and packs A; the space ranks loop orders with the copies of
    # packing and keeps only orders that reuse the packed A.  Half of a 1 MiB L2 holds the
    # panel: the whole K per call, nothing packed.
    machine = Machine(isa.from_name("avx2"), caches, 2, fp32_flops_per_cycle=32.0)
    problem = GemmProblem(256, 128, 4096)
    base = default_config(problem, machine)
    configs = space_configs(problem, machine, top_n=3)
    assert (base.pack_a is not None) == packed and base in configs
    assert all((c.pack_a is not None) == packed for c in configs)
    assert all(c.reuses_packed_a() for c in configs) or not packed
    ranked = [c for _, c in ranked_configs(problem, base, machine)]
    assert configs[:3] == ranked[:3]


def test_loop_spec_candidates_take_the_default_blocks(target):
    base = space_configs(PROBLEM, machine_of(target), top_n=1)[0]
    space = gemm_space(PROBLEM, target, [Candidate("BCa"), Candidate("bCa")])
    spaces = space.generate_design_space(tvm.IRModule({"main": workload(PROBLEM, base.bn)}))
    assert len(spaces) == 2
    _check(spaces[1], base.bn, target)


def test_bad_candidates_are_rejected_up_front(target):
    with pytest.raises(ValueError, match="share bn"):
        gemm_space(PROBLEM, target, [GemmConfig.of("BCa", 42, 16, 36),
                                     GemmConfig.of("BCa", 42, 40, 36)])
    with pytest.raises(ValueError, match="does not divide"):
        gemm_space(PROBLEM, target, [GemmConfig.of("BCa", 42, 16, 7)])
    with pytest.raises(ValueError, match="empty"):
        gemm_space(PROBLEM, target, [])
    with pytest.raises(TypeError, match="GemmConfig or Candidate"):
        gemm_space(PROBLEM, target, ["BCa"])
    plain = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    with pytest.raises(ValueError, match="not a tpp target"):
        gemm_space(PROBLEM, plain)
    with pytest.raises(ValueError, match="max_trials"):
        tune_gemm_ms(PROBLEM, target, "unused", 0)
    with pytest.raises(ValueError, match="strategy"):
        tune_gemm_ms(PROBLEM, target, "unused", 2, strategy="evolutionary")


@pytest.mark.slow
def test_tune_gemm_ms_measures_each_space_once(target, tmp_path):
    import subprocess
    import sys

    from tvm.s_tir import meta_schedule as ms

    configs = space_configs(PROBLEM, machine_of(target), top_n=3)
    best, database = tune_gemm_ms(PROBLEM, target, tmp_path, max_trials=4, candidates=configs)
    records = database.get_all_tuning_records()
    assert len(records) == min(4, len(configs))
    assert len({str(r.trace) for r in records}) == len(records)
    assert all(r.run_secs and float(r.run_secs[0]) < 1e9 for r in records)
    _check(best, configs[0].bn, target)
    reopened = ms.database.JSONDatabase(work_dir=str(tmp_path))
    assert len(reopened.get_all_tuning_records()) == len(records)

    # A fresh process parses the stored traces only once the intrinsics are registered.
    script = (
        "import sys\n"
        "from tvm.s_tir import meta_schedule as ms\n"
        "from schedules.gemm import GemmConfig\n"
        "from schedules.ms_space import register_intrinsics\n"
        "from schedules.space import Candidate\n"
        "if sys.argv[2] == 'register':\n"
        f"    register_intrinsics([{configs_literal(configs)}], {str(target.attrs['model'])!r})\n"
        "print(len(ms.database.JSONDatabase(work_dir=sys.argv[1]).get_all_tuning_records()))\n"
    )
    runs = {mode: subprocess.run([sys.executable, "-c", script, str(tmp_path), mode],
                                 capture_output=True, text=True, timeout=600)
            for mode in ("register", "bare")}
    assert runs["register"].returncode == 0, runs["register"].stderr[-2000:]
    assert runs["register"].stdout.strip() == str(len(records))
    assert runs["bare"].returncode != 0 and "not registered" in runs["bare"].stderr


def configs_literal(configs) -> str:
    """Python source re-creating ``configs`` in another process."""
    return ", ".join(
        f"GemmConfig({c.bm}, {c.bn}, {c.bk}, Candidate({c.spec!r}, "
        f"{ {k: tuple(v) for k, v in c.candidate.block_steps.items()} !r}, "
        f"{dict(c.candidate.steps)!r}))" for c in configs)
