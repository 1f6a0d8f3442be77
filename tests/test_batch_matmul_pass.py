"""The batch-matmul pass on attention's two shapes, ``softmax(Q @ K^T / c) @ V + b``: each matmul
and its epilogue become one kernel, ``K^T`` is read from K in place.

Checked structurally (Before/Expected) and numerically (built with the tpp pipeline, odd sizes,
against numpy).  ONNX attention blocks, BERT's included, are in test_batch_gemm.py.
"""

import numpy as np
import pytest
import tvm
from tvm import relax

from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.machine import machine_of
from relay_passes.batch_matmul import rewrite_batch_matmul
from relay_passes.pipeline import tpp_pipeline
from relay_passes.scaffold import add_kernel
from schedules.batch_gemm import BatchGemmProblem, schedule
from schedules.tuner import config_for
from tvm_tpp.tpp_target import target as tpp_target

TARGET = tpp_target("tpp")  # the host's ISA: the numeric checks run the kernels
B, S, D = 3, 5, 7  # batch (heads), sequence, head size: odd, so every tile has a remainder
BIAS = np.random.default_rng(0).standard_normal(D).astype("float32")


def _tensor(name: str, shape: tuple[int, ...]) -> relax.Var:
    return relax.Var(name, relax.TensorType(shape, "float32"))


def _scores(bb: relax.BlockBuilder, q: relax.Var, k: relax.Var) -> relax.Expr:
    """``Q @ K^T / 2``."""
    kt = bb.emit(relax.op.permute_dims(k, [0, 2, 1]))
    return relax.op.divide(bb.emit(relax.op.matmul(q, kt)), relax.const(np.float32(2.0)))


def _context(bb: relax.BlockBuilder, p: relax.Var, v: relax.Var) -> relax.Expr:
    """``P @ V + bias``."""
    return relax.op.add(bb.emit(relax.op.matmul(p, v)), relax.const(BIAS))


# name -> (build the body, operand shapes, the kernel's problem, numpy's result)
CASES = {
    "scores": (_scores, [(B, S, D), (B, S, D)],
               BatchGemmProblem(B, S, S, D, b_transposed=True,
                                epilogue=Epilogue((EpilogueOp("scale", value=0.5),))),
               lambda q, k: q @ k.transpose(0, 2, 1) / 2),
    "context": (_context, [(B, S, S), (B, S, D)],
                BatchGemmProblem(B, S, D, S, epilogue=Epilogue((EpilogueOp("bias"),))),
                lambda p, v: p @ v + BIAS),
}


def _before(case: str) -> tvm.IRModule:
    body, shapes, _, _ = CASES[case]
    a, b = _tensor("a", shapes[0]), _tensor("b", shapes[1])
    bb = relax.BlockBuilder()
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(body(bb, a, b))
        bb.emit_func_output(out)
    return bb.get()


def _expected(case: str) -> tvm.IRModule:
    _, shapes, problem, _ = CASES[case]
    config = config_for(problem, TARGET)
    bb = relax.BlockBuilder()
    kernel = add_kernel(bb, schedule(problem, config, machine_of(TARGET).isa).mod["main"],
                        f"tpp_batch_matmul_{problem.name}")
    a, b = _tensor("a", shapes[0]), _tensor("b", shapes[1])
    with bb.function("main", [a, b]):
        with bb.dataflow():
            rows = bb.emit(relax.op.reshape(a, problem.x_shape))  # the batch as one [B*M, K]
            args = [rows, b] + ([relax.const(BIAS)] if case == "context" else [])
            y = bb.emit(relax.call_tir(kernel, args, relax.TensorType(problem.y_shape,
                                                                       "float32")))
            out = bb.emit_output(relax.op.reshape(y, (B, problem.m, problem.n)))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("case", CASES)
def test_matmul_and_epilogue_become_one_kernel(case):
    report = []
    after = rewrite_batch_matmul(_before(case), TARGET, report)
    tvm.ir.assert_structural_equal(after, _expected(case))
    problem = CASES[case][2]
    assert [(r.op, r.shape) for r in report] == [
        ("batch_matmul+" + problem.epilogue.name, (B, problem.m, problem.n, problem.k))]


@pytest.mark.parametrize("case", CASES)
def test_results_match_numpy(case):
    _, shapes, _, reference = CASES[case]
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal(s).astype("float32") for s in shapes)
    report = []
    executable = tvm.compile(_before(case), target=TARGET,
                             relax_pipeline=tpp_pipeline(TARGET, report))
    vm = relax.VirtualMachine(executable, tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
    assert all(r.kernel for r in report), report
    np.testing.assert_allclose(got, reference(a.astype(np.float64), b), rtol=1e-5, atol=1e-5)


def test_bf16_attention_runs_on_amx_tiles():
    # On an AMX target the dense layers and the fused attention both multiply bf16 tiles.
    import tvm_tpp
    from tvm_tpp import models

    small = models.load("bert", seq=16, hidden=64, heads=4, ffn=128)
    report = tvm_tpp.compile(small, target="tpp -isa=amx", precision="bf16").report
    attention = [r for r in report if "attention" in r.op]
    dense = [r for r in report if r.op.startswith("matmul")]
    assert len(attention) == 1 and len(dense) == 4  # Q, K and V as one layer
    assert all((r.dtypes, r.isa) == ("bfloat16*bfloat16->float32", "amx")
               for r in attention + dense), attention + dense
