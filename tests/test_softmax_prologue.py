"""Attention's softmax, and its causal mask, computed inside the ``P @ V`` batch GEMM.

The kernel (``BatchGemmProblem.softmax`` / ``mask_fill``) against numpy, float32 and bf16,
odd sizes (rows no vector divides), interleaved heads and a run-time batch; the problem's
checks; the Relax rewrite as Before/Expected; ONNX attention blocks (BERT's softmax, GPT-2's
``Where`` mask both ways round, a ``-inf`` fill, a per-batch mask that stays) against ONNX
Runtime; and the AMX cross-compile (the tiles still read the normalized bf16 rows).
"""

import math

import numpy as np
import pytest
import tvm
from conftest import main_calls, relax_main
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from microkernels import isa as _isa
from microkernels.machine import Machine, machine_of
from relay_passes.batch_matmul import rewrite_batch_matmul
from relay_passes.pipeline import tpp_pipeline
from relay_passes.scaffold import add_kernel, is_call_to
from schedules.batch_gemm import BatchGemmProblem, default_config, reference, schedule
from schedules.tuner import config_for
from tvm_tpp.compiler import import_model
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime
from tvm_tpp.tpp_target import target as tpp_target

TARGET = tpp_target("tpp")  # the host's ISA: the kernels run
ISA = machine_of(TARGET).isa
FLT_MAX = float(np.finfo(np.float32).max)


def _mask(m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A causal mask where the rows are the columns, else random rows, none of them empty."""
    mask = np.tril(np.ones((m, k))) if m == k else rng.integers(0, 2, (m, k))
    mask[:, 0] = 1
    return mask.astype(np.uint8)


def _run(problem: BatchGemmProblem, batch: int | None = None) -> None:
    """The scheduled kernel (a run-time ``batch`` of copies, if given) against numpy."""
    machine = Machine(ISA, _isa.DEFAULT_CACHES, 2)
    run_batch = None if batch is None else tvm.tirx.Var("n", "int32")
    func = tvm.compile(schedule(problem, default_config(problem, machine), ISA,
                                run_batch).mod, target=TARGET)
    rng = np.random.default_rng(3)
    copies = batch or 1
    x = (rng.standard_normal((copies * problem.x_shape[0], problem.x_shape[1])) * 4
         ).astype(np.float32)
    b = rng.standard_normal((copies * problem.b_shape[0], *problem.b_shape[1:])
                            ).astype(np.float32)
    extra = {} if problem.mask_fill is None else {"mask": _mask(problem.m, problem.k, rng)}
    y = tvm.runtime.empty((copies * problem.y_shape[0], problem.y_shape[1]), "float32")
    scalars = [] if batch is None else [batch]
    func(*[tvm.runtime.tensor(v) for v in (x, b, *extra.values())], *scalars, y)
    rows = problem.x_shape[0]
    want = np.concatenate([
        reference(problem, x[i * rows:(i + 1) * rows],
                  b[i * problem.b_shape[0]:(i + 1) * problem.b_shape[0]], extra)
        for i in range(copies)])
    tol = 2e-2 if problem.dtype == "bfloat16" else 1e-5
    np.testing.assert_allclose(y.numpy(), want, rtol=tol, atol=tol * np.abs(want).max())
    assert np.abs(want).max() > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch, m, n, k, heads, fill", [
    (12, 128, 64, 128, 12, -FLT_MAX),    # GPT-2 small's P @ V, causal
    (3, 13, 8, 13, 3, None),             # rows of 13: no vector divides them
    (2, 7, 5, 9, 1, -1e9),               # plain layouts, an odd K padded for bf16
    (4, 16, 24, 16, 1, float("-inf")),   # masked_fill(-inf)
    (2, 5, 3, 24, 1, -3.0),              # a fill the softmax does not flush to 0
])
def test_kernel_matches_numpy(dtype, batch, m, n, k, heads, fill):
    _run(BatchGemmProblem(batch, m, n, k, heads=heads, b_interleaved=heads > 1, dtype=dtype,
                          softmax=True, mask_fill=fill))


def test_interleaved_scores_and_run_time_batch():
    # Scores stored heads-interleaved ([S, H*S]), two copies of the problem at run time.
    _run(BatchGemmProblem(6, 9, 8, 16, heads=3, x_interleaved=True, softmax=True,
                          mask_fill=-FLT_MAX), batch=2)


def test_a_task_per_batch_element_by_default():
    # Each row normalized once, not once per N panel: float32 too.
    machine = Machine(_isa.from_name("avx2"), _isa.DEFAULT_CACHES, 2)
    p = BatchGemmProblem(12, 128, 64, 128, softmax=True)
    assert default_config(p, machine).rows_outer
    assert not default_config(BatchGemmProblem(12, 128, 64, 128), machine).rows_outer


def test_masked_rows_select_one_exponential_a_row():
    # exp(fill - max) is a stage of one value a row: no per-element exp of the fill.
    p = BatchGemmProblem(2, 8, 8, 16, softmax=True, mask_fill=-FLT_MAX)
    script = schedule(p, default_config(p, Machine(ISA, _isa.DEFAULT_CACHES, 2)), ISA
                      ).mod["main"].script()
    assert 'sblock("row_fill")' in script and 'sblock("row_exp")' in script
    assert p.layout == "sm" and BatchGemmProblem(2, 8, 8, 16, softmax=True).layout == "s"


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": "uint8", "softmax": True}, "needs float32 scores"),
    ({"mask_fill": -1.0}, "needs softmax=True"),
    ({"softmax": True, "mask_fill": float("nan")}, "must be a number"),
    ({"softmax": True, "mask_fill": True}, "must be a number"),
    ({"softmax": 1}, "must be a bool"),
])
def test_problem_validation(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        BatchGemmProblem(2, 4, 4, 4, **kwargs)


def test_reference_needs_the_mask():
    p = BatchGemmProblem(1, 2, 2, 2, softmax=True, mask_fill=-1.0)
    with pytest.raises(ValueError, match="extra\\['mask'\\]"):
        reference(p, np.zeros(p.x_shape, np.float32), np.zeros(p.b_shape, np.float32))


# --- The Relax rewrite ------------------------------------------------------------------------

B, S, D = 3, 5, 7
CAUSAL = np.tril(np.ones((1, S, S), bool))


def _tensor(name: str, shape: tuple[int, ...]) -> relax.Var:
    return relax.Var(name, relax.TensorType(shape, "float32"))


def _masked_context(bb, scores, v):
    masked = bb.emit(relax.op.where(relax.const(CAUSAL), scores,
                                    relax.const(np.float32(-FLT_MAX))))
    return relax.op.matmul(bb.emit(relax.op.nn.softmax(masked, axis=-1)), v)


def test_rewrite_before_expected():
    params = [_tensor("s", (B, S, S)), _tensor("v", (B, S, D))]
    report = []
    after = rewrite_batch_matmul(relax_main(params, _masked_context), TARGET, report)
    problem = BatchGemmProblem(B, S, D, S, softmax=True, mask_fill=-FLT_MAX)

    def expected_body(bb, s, v):
        func = schedule(problem, config_for(problem, TARGET), ISA).mod["main"]
        kernel = add_kernel(bb, func, f"tpp_batch_matmul_{problem.name}")
        rows = bb.emit(relax.op.reshape(s, problem.x_shape))
        mask = relax.const(np.tril(np.ones((S, S), np.uint8)))
        y = bb.emit(relax.call_tir(kernel, [rows, v, mask],
                                   relax.TensorType(problem.y_shape, "float32")))
        return relax.op.reshape(y, (B, S, D))

    tvm.ir.assert_structural_equal(after, relax_main(params, expected_body))
    assert [(r.op, r.kernel) for r in report] == [
        ("masked_softmax+batch_matmul", "tpp_batch_matmul_3x5x7x5_sm")]


def test_rewrite_runs_like_tvm():
    params = [_tensor("s", (B, S, S)), _tensor("v", (B, S, D))]
    before = relax_main(params, _masked_context)
    rng = np.random.default_rng(2)
    s, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((B, S, S), (B, S, D)))
    outs = []
    for pipeline in (relax.get_default_pipeline(TARGET), tpp_pipeline(TARGET, [])):
        ex = tvm.compile(before, target=TARGET, relax_pipeline=pipeline)
        vm = relax.VirtualMachine(ex, tvm.cpu())
        outs.append(vm["main"](tvm.runtime.tensor(s), tvm.runtime.tensor(v)).numpy())
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-6)


# --- ONNX attention blocks vs ONNX Runtime ---------------------------------------------------


def _attention(s: int, h: int, d: int, mask: np.ndarray | None, fill: float,
               fill_first: bool = False):
    """Attention on [1, H, S, D] Q, K, V: ``softmax(Where(mask, QK^T / sqrt(d), fill)) V``."""
    f32 = np.float32
    consts = {"sqrt_d": f32(math.sqrt(d)), "fill": f32(fill)}
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["qk"]),
             helper.make_node("Div", ["qk", "sqrt_d"], ["scores"])]
    probs_in = "scores"
    if mask is not None:
        consts["mask"] = mask
        branches = ["fill", "scores"] if fill_first else ["scores", "fill"]
        nodes.append(helper.make_node("Where", ["mask", *branches], ["masked"]))
        probs_in = "masked"
    nodes += [helper.make_node("Softmax", [probs_in], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", "v"], ["y"])]
    shape = [1, h, s, d]
    graph = helper.make_graph(
        nodes, "attention", [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)
                             for n in "qkv"],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _compile(model, precision: str = "float32"):
    mod, specs = import_model(model)
    report = []
    ex = tvm.compile(mod, target=TARGET,
                     relax_pipeline=tpp_pipeline(TARGET, report, precision=precision))
    inputs = random_inputs(specs, seed=5)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(inputs[s.name]) for s in specs]).numpy()
    _, rel = max_errors([out], run_onnxruntime(model, inputs))
    return sorted(r.op for r in report if r.kernel), rel


S_ONNX, H_ONNX = 11, 3
CAUSAL_ONNX = np.tril(np.ones((1, 1, S_ONNX, S_ONNX), bool))


@pytest.mark.parametrize("precision, tol", [("float32", 1e-5), ("bf16", 2e-2)])
@pytest.mark.parametrize("mask, fill, fill_first, op", [
    (None, 0.0, False, "attention+scale"),                          # BERT's
    (CAUSAL_ONNX, -FLT_MAX, False, "masked_attention+scale"),       # GPT-2's
    (~CAUSAL_ONNX, -FLT_MAX, True, "masked_attention+scale"),       # Where(~m, fill, x)
    (CAUSAL_ONNX[0, 0], float("-inf"), False, "masked_attention+scale"),  # [S, S]
], ids=["plain", "causal", "fill-first", "minus-inf"])
def test_attention_vs_onnxruntime(precision, tol, mask, fill, fill_first, op):
    # The scores come from Q @ K^T: the whole block is one fused attention kernel, whose
    # context reads the softmax (and the mask) as P @ V does (tests/test_attention.py).
    model = _attention(S_ONNX, H_ONNX, 8, mask, fill, fill_first)
    kernels, rel = _compile(model, precision)
    assert kernels == [op]
    assert rel <= tol


def test_per_batch_mask_stays_with_tvm_softmax_folds():
    # A mask that differs per head is no [S, S] mask: the Where stays, the softmax still folds.
    rng = np.random.default_rng(0)
    mask = rng.integers(0, 2, (1, H_ONNX, S_ONNX, S_ONNX)).astype(bool)
    mask[..., 0] = True
    model = _attention(S_ONNX, H_ONNX, 8, mask, -FLT_MAX)
    kernels, rel = _compile(model)
    assert kernels == ["batch_matmul+scale", "softmax+batch_matmul"]
    assert rel <= 1e-5
    mod = rewrite_batch_matmul(import_model(model)[0], TARGET, [])
    assert any(is_call_to(c, "relax.where") for c in main_calls(mod))


def test_amx_kernel_reads_normalized_bf16_tiles():
    # Cross-compiled for Sapphire Rapids: the softmax's stages and the tile loads together.
    amx = _isa.from_name("amx")
    p = BatchGemmProblem(12, 32, 32, 32, heads=12, b_interleaved=True, dtype="bfloat16",
                         softmax=True, mask_fill=-FLT_MAX)
    sch = schedule(p, default_config(p, Machine(amx, _isa.DEFAULT_CACHES, 2)), amx)
    spr = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids",
                             "mtriple": "x86_64-linux-gnu"})
    asm = tvm.tirx.build(sch.mod, target=spr).inspect_source("s")
    assert "tdpbf16ps" in asm and "tileloadd" in asm
