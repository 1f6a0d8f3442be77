"""Batch GEMM of two activations: the scheduled kernel vs numpy, and the Relax rewrite of
attention blocks (ONNX, built with onnx.helper) vs ONNX Runtime, BERT included.
"""

import math

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from microkernels import isa as _isa
from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.machine import Machine
from relay_passes.batch_matmul import rewrite_batch_matmul
from relay_passes.dense import rewrite_dense
from relay_passes.pipeline import prepare
from schedules.batch_gemm import (
    BatchGemmConfig,
    BatchGemmProblem,
    candidates,
    default_config,
    reference,
    schedule,
)
from schedules.tuner import Database, TaskCollector, Tuner, build, tune
from tvm_tpp import models
from tvm_tpp.compiler import import_model
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime
from tvm_tpp.tpp_target import target as tpp_target

HASWELL = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
SCALE = Epilogue((EpilogueOp("scale", value=0.125),))
SCALE_BIAS = Epilogue((EpilogueOp("scale", value=1 / math.sqrt(7)), EpilogueOp("bias")))


def _machine(threads: int, isa: str = "avx2") -> Machine:
    return Machine(_isa.from_name(isa), _isa.DEFAULT_CACHES, threads)


def _run(problem, config=None, isa="avx2", target=HASWELL, seed=0, func=None):
    """Run ``problem`` (``func`` when already built) and compare with numpy."""
    config = config or default_config(problem, _machine(2, isa))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(problem.x_shape).astype("float32")
    b = rng.standard_normal(problem.b_shape).astype("float32")
    extra = {op.name: rng.standard_normal(op.shape(*problem.y_shape)).astype("float32")
             for op in problem.epilogue.inputs("float32")}
    func = func or tvm.compile(schedule(problem, config, isa).mod, target=target)
    y = tvm.runtime.empty(problem.y_shape, "float32")
    func(tvm.runtime.tensor(x), tvm.runtime.tensor(b),
         *[tvm.runtime.tensor(v) for v in extra.values()], y)
    np.testing.assert_allclose(y.numpy(), reference(problem, x, b, extra), rtol=1e-5, atol=1e-5)
    assert np.abs(y.numpy()).max() > 0


@pytest.mark.parametrize("problem", [
    BatchGemmProblem(1, 13, 17, 9, b_transposed=True, epilogue=SCALE),
    BatchGemmProblem(1, 13, 17, 9, b_transposed=False),
    BatchGemmProblem(12, 7, 24, 5, b_transposed=True, epilogue=SCALE),
    BatchGemmProblem(12, 7, 24, 5, b_transposed=False, epilogue=SCALE),
    BatchGemmProblem(3, 97, 40, 33, b_transposed=True),  # prime m: one 97-row tile
    BatchGemmProblem(2, 1, 16, 11, b_transposed=True),  # single-row GEMMs
    BatchGemmProblem(2, 5, 9, 4, epilogue=Epilogue((EpilogueOp("residual"),))),
], ids=lambda p: p.name)
def test_plain_layouts(problem):
    _run(problem)


@pytest.mark.parametrize("transposed, x, b, y", [
    (True, True, True, False),  # Q @ K^T straight from the projections
    (False, False, True, True),  # P @ V, context written back interleaved
    (False, True, False, True),
    (True, False, True, True),
])
def test_interleaved_layouts(transposed, x, b, y):
    problem = BatchGemmProblem(6, 7, 24, 12, transposed, SCALE_BIAS, heads=3, x_interleaved=x,
                               b_interleaved=b, y_interleaved=y)
    _run(problem, BatchGemmConfig(bm=7, bn=8, bk=4))


def test_parallel_rows_when_few_tasks():
    problem = BatchGemmProblem(1, 96, 16, 8, epilogue=SCALE)
    config = default_config(problem, _machine(2))
    assert config.parallel_rows and config.bm < problem.m
    _run(problem, config)
    _run(problem, BatchGemmConfig(8, 16, 8, parallel_rows=False))


@pytest.mark.parametrize("transposed, x, b, y", [(True, True, True, False),
                                                 (False, False, True, True)])
def test_a_task_per_batch_element(transposed, x, b, y):
    """``rows_outer``: each task one batch element, its M blocks outside its N panels (B
    packed once for all panels; the epilogue still per output tile), interleaved layouts,
    several M blocks and panels; low precision takes it by default where the batch elements
    give every thread two tasks, float32 never."""
    problem = BatchGemmProblem(6, 14, 24, 12, transposed, SCALE_BIAS, heads=3, x_interleaved=x,
                               b_interleaved=b, y_interleaved=y)
    _run(problem, BatchGemmConfig(bm=7, bn=8, bk=4, rows_outer=True))
    assert not default_config(problem, _machine(2)).rows_outer
    low = [BatchGemmProblem(6, 14, 24, 12, transposed, dtype="bfloat16"),
           BatchGemmProblem(3, 14, 24, 12, transposed, dtype="bfloat16")]
    assert [default_config(q, _machine(2)).rows_outer for q in low] == [True, False]
    with pytest.raises(ValueError, match="choose one"):
        BatchGemmConfig(7, 8, 4, parallel_rows=True, rows_outer=True)


@pytest.mark.parametrize("problem", [
    BatchGemmProblem(2, 24, 40, 16, b_transposed=True, epilogue=SCALE),
    BatchGemmProblem(6, 16, 24, 12, False, SCALE_BIAS, heads=3, x_interleaved=True,
                     y_interleaved=True),
], ids=lambda p: p.name)
def test_candidates_are_correct(problem):
    """Every configuration the tuner may pick computes the batch GEMM (one module for all)."""
    found = candidates(problem, _machine(1))
    assert found[0] == default_config(problem, _machine(1))
    assert len(set(found)) == len(found) <= 12 and any(c.parallel_rows for c in found)
    for config, func in zip(found, build(problem, found, HASWELL, "avx2"), strict=True):
        _run(problem, config, func=func)


def test_avx512_kernel():
    if not _isa.from_name("avx512").runs_on(_isa.host_flags()):
        pytest.skip("host lacks AVX-512F")
    problem = BatchGemmProblem(12, 33, 64, 16, True, SCALE, heads=4, x_interleaved=True,
                               b_interleaved=True)
    _run(problem, isa="avx512", target=tpp_target("tpp -isa=avx512"))


def test_default_config_tiles_exactly():
    for m, n, k in [(128, 128, 64), (197, 197, 64), (13, 17, 9), (384, 64, 1024)]:
        problem = BatchGemmProblem(4, m, n, k)
        config = default_config(problem, _machine(2))
        config.check(problem)
        assert config.bm > 1 and config.bn > 1, config


@pytest.mark.parametrize("kwargs, message", [
    ({"batch": 0}, "batch must be a positive int"),
    ({"m": 2.0}, "m must be a positive int"),
    ({"heads": 5, "x_interleaved": True}, "does not divide batch"),
    ({"heads": 2}, "heads > 1 exactly when"),
    ({"x_interleaved": True}, "heads > 1 exactly when"),
    ({"epilogue": Epilogue((EpilogueOp("requantize", value=0.5, dtype="uint8"),))},
     "must end in one, not uint8"),
])
def test_problem_validation(kwargs, message):
    args = {"batch": 4, "m": 8, "n": 8, "k": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        BatchGemmProblem(**args)


def test_config_and_operand_errors():
    problem = BatchGemmProblem(2, 6, 8, 4)
    with pytest.raises(ValueError, match="bn=3 does not divide 8"):
        schedule(problem, BatchGemmConfig(6, 3, 4))
    with pytest.raises(TypeError, match="BatchGemmConfig"):
        schedule(problem, (6, 8, 4))
    with pytest.raises(TypeError, match="BatchGemmProblem"):
        schedule((2, 6, 8, 4), BatchGemmConfig(6, 8, 4))
    with pytest.raises(ValueError, match="stored shape"):
        reference(problem, np.zeros((2, 6, 4), np.float32), np.zeros(problem.b_shape))
    with pytest.raises(TypeError, match="must be a bool"):
        BatchGemmProblem(2, 6, 8, 4, b_transposed=1)


# --- The Relax rewrite ------------------------------------------------------------------------

TARGET = tpp_target("tpp -isa=avx2 -num-cores=2")


def _compile(model, tuner=None):
    """The tpp pipeline's rewrites plus the batch matmul one (with ``tuner``), then TVM's
    default lowering.

    Returns the executable, the input specs, the report and the ops left after the rewrites.
    """
    report, left = [], set()

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            left.add(expr.op.name)

    @tvm.transform.module_pass(opt_level=0, name="WithBatchMatmul")
    def pipeline(mod, _ctx):
        mod = rewrite_dense(prepare()(mod), TARGET, report)
        mod = rewrite_batch_matmul(mod, TARGET, report, tuner)
        mod = relax.transform.RemoveRedundantReshape()(mod)
        relax.analysis.post_order_visit(mod["main"], visit)
        return relax.get_default_pipeline(TARGET)(mod)

    mod, specs = import_model(model)
    executable = tvm.compile(mod, target=TARGET, relax_pipeline=pipeline)
    return executable, specs, report, left


def _check(model, rtol, tuner=None):
    """Run against ONNX Runtime; returns the report and the Relax ops left to TVM."""
    executable, specs, report, left = _compile(model, tuner)
    inputs = random_inputs(specs, seed=1)
    vm = relax.VirtualMachine(executable, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(inputs[s.name]) for s in specs])
    _, rel = max_errors([out.numpy()], run_onnxruntime(model, inputs))
    assert rel <= rtol
    return report, left


def _model(nodes, inputs, output, consts=None):
    graph = helper.make_graph(
        nodes, "attention",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(output[0], TensorProto.FLOAT, output[1])],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in (consts or {}).items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _kernels(report):
    return sorted((r.op, r.shape, r.kernel) for r in report
                  if r.kernel and ("batch" in r.op or "attention" in r.op))


def _attention(s, h, d):
    """BERT's attention on [1, S, H*D] projections Q, K, V, with a [1, 1, 1, S] mask."""
    f32 = np.float32
    consts = {"heads": np.array([1, s, h, d], np.int64), "merged": np.array([1, s, h * d]),
              "sqrt_d": f32(math.sqrt(d))}
    nodes = [helper.make_node("Reshape", [f"x{t}", "heads"], [f"{t}4"]) for t in "qkv"] + [
        helper.make_node("Transpose", ["q4"], ["q"], perm=[0, 2, 1, 3]),
        # K^T in two steps, as some exporters write it: composed into one permutation.
        helper.make_node("Transpose", ["k4"], ["k"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("Transpose", ["v4"], ["v"], perm=[0, 2, 1, 3]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
        helper.make_node("Div", ["qk", "sqrt_d"], ["scores"]),
        helper.make_node("Add", ["scores", "mask"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["ctx"]),
        helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["ctx_t", "merged"], ["y"]),
    ]
    inputs = [(f"x{t}", [1, s, h * d]) for t in "qkv"] + [("mask", [1, 1, 1, s])]
    return _model(nodes, inputs, ("y", [1, s, h * d]), consts)


def test_attention_heads_interleaved():
    """BERT's layout: [1, S, H*D] projections split into heads by Reshape + Transpose, the
    context merged back: every Transpose is absorbed into the fused attention kernel, and so
    is the mask add (a [1, 1, 1, S] mask is one value per column of the scores: a bias)."""
    report, left = _check(_attention(13, 3, 8), 1e-5)
    assert _kernels(report) == [
        ("attention+scale+bias", (3, 13, 13, 8, 8),
         "tpp_attention_3x13x13x8x8_txb3_scale_bias_bys3"),
    ]
    assert left == {"relax.reshape", "relax.call_tir"}  # the softmax is the kernel's


@pytest.mark.slow  # tuning a batch GEMM: test_tuner.test_conv_and_batch_gemm_tune_persist_and_reuse
def test_attention_tuned(tmp_path):
    """The fused attention is one tuning task (keyed by both products' layouts), tuned before
    the build; built with a tuner that looks the results up, the model still matches ONNX
    Runtime."""
    model = _attention(11, 2, 8)
    collector = TaskCollector()
    _check(model, 1e-5, collector)  # the defaults meanwhile
    assert sorted(key.text().split("|")[:2] for key in collector.tasks) == [
        ["attention", "2x11x11x8x8/txb2_scale_bias_bys2"]]
    database = Database(tmp_path / "t.json")
    results = {p: tune(p, TARGET, database=database, top_k=2) for p in collector.tasks.values()}
    assert not any(r.cached for r in results.values()) and len(database) == 1
    lookup = Tuner(Database(tmp_path / "t.json"))
    assert all(lookup.config(p, TARGET) == r.best for p, r in results.items())
    _check(model, 1e-5, lookup)


def test_attention_plain_layout_multiply_and_bias():
    """Q, K, V given as [B, H, S, D]: K^T by a last-two-axes Transpose, scaling by Mul, a
    constant bias after the second matmul, a residual add after a rank-3 matmul."""
    b, h, s, d = 2, 3, 11, 7
    rng = np.random.default_rng(0)
    consts = {"inv_sqrt_d": np.float32(1 / math.sqrt(d)),
              "bias": rng.standard_normal(d).astype(np.float32)}
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
        helper.make_node("Mul", ["inv_sqrt_d", "qk"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["ctx"]),
        helper.make_node("Add", ["ctx", "bias"], ["ctx_b"]),
        helper.make_node("Reshape", ["ctx_b", "flat"], ["ctx3"]),
        helper.make_node("MatMul", ["ctx3", "w"], ["mixed"]),  # w is an input: an activation
        helper.make_node("Add", ["res", "mixed"], ["y"]),
    ]
    consts["flat"] = np.array([b * h, s, d], np.int64)
    inputs = [("q", [b, h, s, d]), ("k", [b, h, s, d]), ("v", [b, h, s, d]),
              ("w", [b * h, d, 5]), ("res", [b * h, s, 5])]
    report, left = _check(_model(nodes, inputs, ("y", [b * h, s, 5]), consts), 1e-5)
    assert [(op, shape) for op, shape, _ in _kernels(report)] == [
        ("attention+scale+bias", (6, 11, 11, 7, 7)),
        ("batch_matmul+residual", (6, 11, 5, 7)),
    ]
    assert "relax.matmul" not in left and "relax.permute_dims" not in left


def test_rank2_activations():
    nodes = [helper.make_node("MatMul", ["a", "b"], ["y"])]
    report, left = _check(_model(nodes, [("a", [5, 7]), ("b", [7, 3])], ("y", [5, 3])), 1e-5)
    assert _kernels(report) == [("batch_matmul", (1, 5, 3, 7), "tpp_batch_matmul_1x5x3x7")]
    assert "relax.matmul" not in left


def test_broadcast_batch_stays_with_tvm():
    nodes = [helper.make_node("MatMul", ["a", "b"], ["y"])]
    model = _model(nodes, [("a", [2, 3, 4, 5]), ("b", [1, 3, 5, 6])], ("y", [2, 3, 4, 6]))
    report, left = _check(model, 1e-5)
    assert "relax.matmul" in left
    assert [(r.op, r.reason) for r in report if "batch" in (r.reason or "")] == [
        ("matmul", "batch dimensions (2, 3) and (1, 3) differ (broadcasting unsupported)")]
    assert not _kernels(report)


@pytest.mark.slow  # BERT-base's layer end to end; the attention kernels have smaller tests
def test_bert_layer_vs_onnxruntime():
    model = models.load("bert")
    report, left = _check(model, 1e-4)
    assert "relax.matmul" not in left and "relax.permute_dims" not in left
    assert _kernels(report) == [
        ("attention+scale", (12, 128, 128, 64, 64),
         "tpp_attention_12x128x128x64x64_txb12_scale_bys12"),
    ]
