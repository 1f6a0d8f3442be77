"""AMX tiles configured once per thread's chunk of a kernel (schedules.tile_config).

The rewritten nest's structure on any host (one ``ldtilecfg`` and one ``tilerelease`` a chunk,
none left in the calls, the chunks covering every iteration once, a remainder guarded);
functions it must leave alone; and, where the CPU has AMX, the rewritten kernels against numpy
(odd sizes, a chunk count that does not divide the loop) and a network against ONNX Runtime.
"""

import numpy as np
import pytest
import tvm
import tvm_ffi
from conftest import make_dense_model, runs_here
from tvm import tirx

import tvm_tpp
from microkernels.epilogue import Epilogue, EpilogueOp
from schedules.gemm import GemmConfig, GemmProblem, pack_weight, schedule
from schedules.tile_config import _calls, configure_tiles_once
from tvm_tpp.reference import max_errors, run_onnxruntime
from tvm_tpp.tpp_target import target as tpp_target

BIAS_RELU = Epilogue((EpilogueOp("bias"), EpilogueOp("relu")))
NEEDS_AMX = pytest.mark.skipif(not runs_here("amx"), reason="host lacks AMX (or Linux refused "
                               "the tile state): the rewrite is checked structurally instead")


def _gemm(m: int = 96, n: int = 64, k: int = 80, dtype: str = "bfloat16", spec: str = "CBa"):
    problem = GemmProblem(m, n, k, dtype=dtype, epilogue=BIAS_RELU)
    return problem, schedule(problem, GemmConfig.of(spec, 32, 32, k), "amx").mod["main"]


def _parallel_loops(func: tirx.PrimFunc) -> list[tirx.For]:
    found = []
    tvm_ffi.structural_walk(func.body, (tirx.For, lambda f: found.append(f)
                                        if f.kind == tirx.ForKind.PARALLEL else None))
    return found


@pytest.mark.parametrize("threads,chunk,guarded", [(2, 3, False), (4, 2, True)])
def test_each_chunk_configures_the_tiles_once(threads, chunk, guarded):
    _, func = _gemm()  # 3 x 2 = 6 output blocks in one parallel loop
    once = configure_tiles_once(func, threads)
    (loop,) = _parallel_loops(once)
    assert int(loop.extent) == threads
    body = list(loop.body.seq)
    # The chunk: configure, its serial share of the blocks, release; the calls do neither.
    assert len(_calls(tirx.SeqStmt(body[:-2]), "ldtilecfg")) == 1
    assert len(_calls(body[-1], "tilerelease")) == 1
    inner = body[-2]
    assert isinstance(inner, tirx.For) and int(inner.extent) == chunk
    assert not _calls(inner, "ldtilecfg") and not _calls(inner, "tilerelease")
    assert isinstance(inner.body, tirx.IfThenElse) is guarded  # 4 chunks of 2 over 6 blocks
    assert len(_calls(func.body, "ldtilecfg")) == len(_calls(func.body, "tilerelease")) == 1


@pytest.mark.parametrize("make", [
    lambda: schedule(GemmProblem(64, 64, 64), GemmConfig.of("CBa", 32, 32, 64), "amx"),  # fp32
    lambda: schedule(*(lambda p: (p, GemmConfig.of("cba", 32, 32, 64)))(
        GemmProblem(64, 64, 64, dtype="bfloat16")), "amx"),  # no parallel loop
])
def test_functions_without_one_parallel_tile_configuration_stay(make):
    func = make().mod["main"]
    assert configure_tiles_once(func, threads=2).same_as(func)


@NEEDS_AMX
@pytest.mark.parametrize("dtype", ["bfloat16", "uint8"])
def test_rewritten_kernel_matches_numpy(dtype):
    """Four chunks over six blocks (the last one guarded, half empty), on the real tiles."""
    import ml_dtypes

    problem, func = _gemm(m=96, n=64, k=80 if dtype == "bfloat16" else 128, dtype=dtype)
    kernel = tvm.compile(tvm.IRModule({"main": configure_tiles_once(func, threads=4)}),
                         target=tpp_target("tpp"))
    rng = np.random.default_rng(0)
    if dtype == "bfloat16":
        x = rng.standard_normal((problem.m, problem.k)).astype(ml_dtypes.bfloat16)
        w = rng.standard_normal((problem.k, problem.n)).astype(ml_dtypes.bfloat16)
        bias = rng.standard_normal(problem.n).astype(np.float32)
        want = x.astype(np.float64) @ w.astype(np.float64) + bias
    else:
        x = rng.integers(0, 256, (problem.m, problem.k)).astype(np.uint8)
        w = rng.integers(-128, 128, (problem.k, problem.n)).astype(np.int8)
        bias = rng.integers(-5000, 5000, problem.n).astype(np.int32)
        want = x.astype(np.int64) @ w.astype(np.int64) + bias
    out = tvm.runtime.empty((problem.m, problem.n), problem.out_dtype)
    kernel(tvm.runtime.tensor(x), tvm.runtime.tensor(pack_weight(w, 32, problem)),
           tvm.runtime.tensor(bias), out)
    np.testing.assert_allclose(out.numpy(), np.maximum(want, 0), rtol=1e-5, atol=1e-3)


@NEEDS_AMX
def test_network_on_amx_matches_onnxruntime():
    model = make_dense_model(m=5, k=40, n=48)
    x = np.random.default_rng(1).standard_normal((5, 40)).astype("float32")
    got = tvm_tpp.compile(model, target="tpp", precision="bf16").run(x=x)
    assert max_errors(got, run_onnxruntime(model, {"x": x}))[1] <= 2e-2
