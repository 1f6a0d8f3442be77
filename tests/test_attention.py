"""Attention as one kernel (``schedules.attention``): ``softmax(epi(Q @ K^T)) @ V`` with the
scores kept in the kernel.

The kernel against numpy (float32 and bf16, odd sizes, queries and keys of different
lengths, interleaved heads, causal and ``-inf`` masks, a bias on the scores, a run-time
batch); the problem's and config's checks; the tuner's key and record; the Relax rewrite as
Before/Expected and numerically, and what stays two kernels (scores read elsewhere); the AMX
cross-compile.
"""

import math

import ml_dtypes
import numpy as np
import pytest
import tvm
from conftest import relax_main
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import tvm_tpp
from microkernels import isa as _isa
from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.machine import Machine, machine_of
from relay_passes.batch_matmul import rewrite_batch_matmul
from relay_passes.pipeline import tpp_pipeline
from relay_passes.scaffold import add_kernel
from schedules.attention import (
    AttentionConfig,
    AttentionProblem,
    candidates,
    default_config,
    reference,
    schedule,
    stored,
)
from schedules.batch_gemm import BatchGemmProblem
from schedules.database import TuningKey
from schedules.ops import OPS, op_of
from schedules.tuner import config_for
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime
from tvm_tpp.tpp_target import target as tpp_target

TARGET = tpp_target("tpp")  # the host's ISA: the kernels run
ISA = machine_of(TARGET).isa
FLT_MAX = float(np.finfo(np.float32).max)


def _scale(value: float = 0.125) -> Epilogue:
    return Epilogue((EpilogueOp("scale", value=value),))


def _problem(batch, m, n, d, dv, heads=1, dtype="float32", fill=None, scores_ops=None,
             key_bias=0, bf16_inputs=False):
    """Q [m, d] and K [n, d] per batch element (K^T read transposed), V [n, dv]; heads > 1:
    every operand interleaved, as BERT's projections are; ``bf16_inputs``: Q, K and V
    stored in bf16."""
    inter = heads > 1
    scores = BatchGemmProblem(batch, m, n, d, True, scores_ops or _scale(), heads=heads,
                              x_interleaved=inter, b_interleaved=inter, dtype=dtype,
                              bf16_inputs=bf16_inputs)
    context = BatchGemmProblem(batch, m, dv, n, heads=heads, b_interleaved=inter,
                               y_interleaved=inter, dtype=dtype, softmax=True, mask_fill=fill,
                               bf16_inputs=bf16_inputs)
    return AttentionProblem(scores, context, key_bias)


def _run(problem: AttentionProblem, config: AttentionConfig | None = None,
         batch: int | None = None) -> None:
    """The scheduled kernel (``batch`` copies at run time, if given) against numpy."""
    machine = Machine(ISA, _isa.DEFAULT_CACHES, 2)
    config = config or default_config(problem, machine)
    run_batch = None if batch is None else tvm.tirx.Var("n", "int32")
    func = tvm.compile(schedule(problem, config, ISA, run_batch).mod, target=TARGET)
    rng = np.random.default_rng(4)
    copies = batch or 1
    shapes = stored(problem)
    stored_as = [problem.scores.io_dtype] * 2 + [problem.context.io_dtype]
    q, k, v = ((rng.standard_normal((copies * s[0], *s[1:])) * 2).astype(
        ml_dtypes.bfloat16 if t == "bfloat16" else np.float32)
        for s, t in zip(shapes[:3], stored_as, strict=True))
    extra = {}
    for op in problem.scores.epilogue.inputs("float32"):
        extra[op.name] = rng.standard_normal(op.shape(*problem.scores.y_shape)).astype(
            np.float32)
    c = problem.context
    if c.mask_fill is not None:
        mask = np.tril(np.ones((c.m, c.k))) if c.m == c.k else rng.integers(0, 2, (c.m, c.k))
        mask[:, 0] = 1
        extra["mask"] = mask.astype(np.uint8)
    if problem.key_bias:  # a padding mask: 0 or -10000 per key
        rows, n = problem.key_bias_shape(batch)
        extra["key_bias"] = np.where(rng.random((rows, n)) < 0.3, -1e4, 0).astype(np.float32)
    y_shape = (copies * shapes[3][0], shapes[3][1])
    y = tvm.runtime.empty(y_shape, "float32")
    args = [q, k, v, *(extra[name] for name in ("mask", "key_bias") if name in extra),
            *(extra[op.name] for op in problem.scores.epilogue.inputs("float32"))]
    func(*[tvm.runtime.tensor(a) for a in args], *([] if batch is None else [batch]), y)

    def part(a, shape, i):
        return a[i * shape[0]:(i + 1) * shape[0]]

    def copy(i):  # the i-th copy's operands, its rows of the key bias
        rows = 0 if not problem.key_bias else problem.key_bias_shape()[0]
        ops = {**extra, **({"key_bias": extra["key_bias"][i * rows:(i + 1) * rows]}
                           if rows else {})}
        return reference(problem, *(part(a, s, i) for a, s in
                                    zip((q, k, v), shapes, strict=False)), ops)

    want = np.concatenate([copy(i) for i in range(copies)])
    tol = 2e-2 if problem.dtype == "bfloat16" else 1e-5
    np.testing.assert_allclose(y.numpy(), want, rtol=tol, atol=tol * np.abs(want).max())
    assert np.abs(want).max() > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch, m, n, d, dv, heads, fill", [
    (6, 13, 13, 8, 8, 3, None),             # BERT's layout, rows no vector divides
    (2, 7, 9, 5, 6, 1, None),               # cross attention: 7 queries, 9 keys; odd d
    (4, 16, 16, 16, 16, 2, -FLT_MAX),       # GPT-2's causal mask
    (2, 11, 11, 8, 8, 1, float("-inf")),    # masked_fill(-inf)
    (3, 1, 9, 8, 8, 1, -FLT_MAX),           # one query (a decoder's step): no row loop
])
def test_kernel_matches_numpy(dtype, batch, m, n, d, dv, heads, fill):
    _run(_problem(batch, m, n, d, dv, heads, dtype, fill))


def test_scores_bias_and_every_candidate():
    # A [N] bias on the scores (BERT's [1, 1, 1, S] mask add), under each candidate config.
    ops = Epilogue((EpilogueOp("scale", value=0.3), EpilogueOp("bias")))
    p = _problem(4, 32, 32, 16, 16, 2, "bfloat16", scores_ops=ops)
    found = candidates(p, Machine(ISA, _isa.DEFAULT_CACHES, 2))
    assert len(found) > 1 and found[0] == default_config(p, Machine(ISA, _isa.DEFAULT_CACHES,
                                                                    2))
    for config in found:
        _run(p, config)


@pytest.mark.parametrize("d", [8, 7])  # 7: Q's rows padded to whole pairs, not read in place
def test_bf16_inputs(d):
    # Q, K and V handed over in bf16: packed and read without rounding.
    _run(_problem(6, 13, 13, d, 8, 3, "bfloat16", -FLT_MAX, bf16_inputs=True))


def test_single_row_blocks():
    _run(_problem(2, 4, 9, 8, 8), AttentionConfig(1, 8, 9, 9, 8))


def test_run_time_batch():
    _run(_problem(6, 9, 9, 8, 8, 3, "float32", -FLT_MAX), batch=2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_key_bias_a_row_per_sample(dtype):
    # BERT's padding mask: [samples, keys] added to the scores of each sample's 3 heads.
    _run(_problem(6, 13, 13, 8, 8, 3, dtype, key_bias=3))


def test_key_bias_and_run_time_batch():
    _run(_problem(4, 9, 9, 8, 8, 2, "float32", key_bias=2), batch=3)


@pytest.mark.parametrize("change, message", [
    ({"context": BatchGemmProblem(2, 3, 6, 4, softmax=True)}, "the scores' N, the keys"),
    ({"context": BatchGemmProblem(2, 3, 6, 5)}, "softmax=True"),
    ({"context": BatchGemmProblem(2, 4, 6, 5, softmax=True)}, "same batch and rows"),
    ({"context": BatchGemmProblem(2, 3, 6, 5, softmax=True, dtype="bfloat16")},
     "one of float32, bfloat16"),
    ({"scores": BatchGemmProblem(2, 3, 5, 4, True, Epilogue(
        (EpilogueOp("convert", dtype="bfloat16"),)))}, "float32 scores"),
    ({"scores": (2, 3, 5, 4)}, "must be a BatchGemmProblem"),
    ({"scores": BatchGemmProblem(2, 3, 1, 4, True),
      "context": BatchGemmProblem(2, 3, 6, 1, softmax=True)}, "one key"),
    ({"key_bias": 3}, "divisor of the batch"),
])
def test_problem_validation(change, message):
    parts = {"scores": BatchGemmProblem(2, 3, 5, 4, True),
             "context": BatchGemmProblem(2, 3, 6, 5, softmax=True)}
    with pytest.raises((ValueError, TypeError), match=message):
        AttentionProblem(**{**parts, **change})


def test_config_checks():
    p = _problem(2, 8, 8, 8, 8)
    with pytest.raises(ValueError, match="bn=3 does not divide 8"):
        schedule(p, AttentionConfig(8, 3, 8, 8, 8), ISA)
    with pytest.raises(ValueError, match="positive int"):
        AttentionConfig(8, 0, 8, 8, 8)
    with pytest.raises(TypeError, match="AttentionConfig"):
        schedule(p, (8, 8, 8, 8, 8), ISA)
    with pytest.raises(ValueError, match="two keys or more"):
        schedule(p, AttentionConfig(8, 8, 8, 1, 8), ISA)


def test_prime_lengths_on_amx_take_whole_blocks():
    # ViT's 197 tokens: AMX's tile-shaped blocks would be single rows and keys.
    amx = Machine(_isa.from_name("amx"), _isa.DEFAULT_CACHES, 2)
    config = default_config(_problem(12, 197, 197, 64, 64, 12, "bfloat16"), amx)
    assert (config.bm, config.bn_s) == (197, 197)


def test_tuning_key_and_record():
    p = _problem(12, 128, 128, 64, 64, 12, "bfloat16")
    op = op_of(p)
    assert op is OPS["attention"]
    assert TuningKey.of(p, TARGET).text().startswith(
        "attention|12x128x128x64x64/txb12bf16_scale_bys12bf16|bfloat16|")
    config = AttentionConfig(32, 64, 128, 32, 64)
    assert op.from_json(op.to_json(config)) == config
    assert op.text(config) == "bm=32 bn=64 bk=128 bn_s=32 bk_s=64"


# --- The Relax rewrite ------------------------------------------------------------------------

B, S, D = 3, 9, 5


def _tensor(name: str, shape: tuple[int, ...]) -> relax.Var:
    return relax.Var(name, relax.TensorType(shape, "float32"))


def _attention_body(bb, q, k, v):
    scores = bb.emit(relax.op.multiply(
        relax.op.matmul(q, bb.emit(relax.op.permute_dims(k, [0, 2, 1]))),
        relax.const(np.float32(0.5))))
    return relax.op.matmul(bb.emit(relax.op.nn.softmax(scores, axis=-1)), v)


PARAMS = [_tensor("q", (B, S, D)), _tensor("k", (B, S, D)), _tensor("v", (B, S, D))]


def test_rewrite_before_expected():
    report = []
    after = rewrite_batch_matmul(relax_main(PARAMS, _attention_body), TARGET, report)
    problem = _problem(B, S, S, D, D, scores_ops=_scale(0.5))

    def expected_body(bb, q, k, v):
        func = schedule(problem, config_for(problem, TARGET), ISA).mod["main"]
        kernel = add_kernel(bb, func, f"tpp_attention_{problem.name}")
        q_shape, _, _, y_shape = stored(problem)
        rows = bb.emit(relax.op.reshape(q, q_shape))
        y = bb.emit(relax.call_tir(kernel, [rows, k, v], relax.TensorType(y_shape, "float32")))
        return relax.op.reshape(y, (B, S, D))

    tvm.ir.assert_structural_equal(after, relax_main(PARAMS, expected_body))
    assert [(r.op, r.shape, r.kernel) for r in report] == [
        ("attention+scale", (B, S, S, D, D), f"tpp_attention_{problem.name}")]


def _run_both(body, params):
    rng = np.random.default_rng(2)
    values = [rng.standard_normal([int(d) for d in p.ty.shape]).astype(np.float32)
              for p in params]
    before, outs, reports = relax_main(params, body), [], []
    for report in (None, []):
        pipeline = (relax.get_default_pipeline(TARGET) if report is None
                    else tpp_pipeline(TARGET, report))
        ex = tvm.compile(before, target=TARGET, relax_pipeline=pipeline)
        out = relax.VirtualMachine(ex, tvm.cpu())["main"](*map(tvm.runtime.tensor, values))
        outs.append([o.numpy() for o in out] if isinstance(out, tvm.ir.Array) else
                    [out.numpy()])
        reports.append(report)
    for got, want in zip(outs[1], outs[0], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    return sorted(r.op for r in reports[1] if r.kernel)


def test_rewrite_runs_like_tvm():
    assert _run_both(_attention_body, PARAMS) == ["attention+scale"]


def test_scores_read_elsewhere_stay_two_kernels():
    # The scores are a result too: the kernel keeping them inside would not write them, so
    # Q @ K^T and the softmax-reading P @ V stay two batch GEMMs.
    def body(bb, q, k, v):
        scores = bb.emit(relax.op.multiply(
            relax.op.matmul(q, bb.emit(relax.op.permute_dims(k, [0, 2, 1]))),
            relax.const(np.float32(0.5))))
        context = bb.emit(relax.op.matmul(bb.emit(relax.op.nn.softmax(scores, axis=-1)), v))
        return relax.Tuple([context, scores])

    assert _run_both(body, PARAMS) == ["batch_matmul+scale", "softmax+batch_matmul"]


@pytest.mark.parametrize("bf16_inputs", [False, True])
def test_amx_cross_compile_multiplies_bf16_tiles(bf16_inputs):
    # Sapphire Rapids, BERT's sizes: both products on tiles, the softmax's rows between them
    # (the float32 scores kept out of the storage of the bf16 operands the tiles read).
    amx = _isa.from_name("amx")
    p = _problem(12, 128, 128, 64, 64, 12, "bfloat16", -FLT_MAX, bf16_inputs=bf16_inputs)
    sch = schedule(p, default_config(p, Machine(amx, _isa.DEFAULT_CACHES, 2)), amx)
    spr = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids",
                             "mtriple": "x86_64-linux-gnu"})
    asm = tvm.tirx.build(sch.mod, target=spr).inspect_source("s")
    assert asm.count("tdpbf16ps") >= 2 and "tileloadd" in asm


def _padded_batch_attention(b: int, s: int, h: int, d: int):
    """BERT's attention with its padding mask, as exporters write it: a ``[B, S]`` 0/1
    ``attention_mask`` input turned into ``(1 - mask) * -10000`` of shape ``[B, 1, 1, S]``
    and added to the scaled scores."""
    f32 = np.float32
    consts = {"heads": np.array([b, s, h, d], np.int64), "merged": np.array([b, s, h * d]),
              "sqrt_d": f32(math.sqrt(d)), "one": f32(1), "big": f32(-10000),
              "axes": np.array([1, 2], np.int64)}
    nodes = [helper.make_node("Reshape", [f"x{t}", "heads"], [f"{t}4"]) for t in "qkv"] + [
        helper.make_node("Transpose", ["q4"], ["q"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
        helper.make_node("Transpose", ["v4"], ["v"], perm=[0, 2, 1, 3]),
        helper.make_node("Unsqueeze", ["attention_mask", "axes"], ["m4"]),
        helper.make_node("Sub", ["one", "m4"], ["inverted"]),
        helper.make_node("Mul", ["inverted", "big"], ["key_bias"]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
        helper.make_node("Div", ["qk", "sqrt_d"], ["scores"]),
        helper.make_node("Add", ["scores", "key_bias"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["ctx"]),
        helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["ctx_t", "merged"], ["y"]),
    ]
    inputs = [helper.make_tensor_value_info(f"x{t}", TensorProto.FLOAT, [b, s, h * d])
              for t in "qkv"]
    inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.FLOAT, [b, s]))
    graph = helper.make_graph(
        nodes, "padded_attention", inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [b, s, h * d])],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("precision, tol", [("float32", 1e-5), ("bf16", 2e-2)])
def test_padding_mask_added_in_the_kernel(precision, tol):
    # A [B, 1, 1, S] mask is no epilogue operand of the scores' product: the fused kernel
    # adds each sample's row of it to its heads' scores.
    model = _padded_batch_attention(2, 11, 3, 8)
    compiled = tvm_tpp.compile(model, precision=precision)
    assert [r.op for r in compiled.report if r.kernel] == ["attention+scale+key_bias"]
    inputs = random_inputs(compiled.inputs, seed=3)
    keep = np.random.default_rng(3).random((2, 11)) < 0.7
    keep[:, 0] = True
    inputs["attention_mask"] = keep.astype(np.float32)
    got = compiled.run(**inputs)
    assert max_errors(got, run_onnxruntime(model, inputs))[1] <= tol


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_bf16_layers_any_batch(name):
    # One build for every batch size: the fused attention's run-time batch, its Q, K and V
    # handed over in bf16 (GPT-2's through its projection's split), within bf16's error.
    from tvm_tpp import models

    model = models.load(name, batch="N", seq=16, hidden=64, heads=4, ffn=128)
    compiled = tvm_tpp.compile(model, precision="bf16-strict")
    fused = [r.kernel for r in compiled.report if r.kernel and "attention" in r.op]
    assert len(fused) == 1 and fused[0].startswith("tpp_attention_n") and "bi4bf16" in fused[0]
    for batch in (1, 3):
        x = np.random.default_rng(batch).standard_normal((batch, 16, 64)).astype(np.float32)
        got = compiled.run(hidden_states=x)
        assert max_errors(got, run_onnxruntime(model, {"hidden_states": x}))[1] <= 1e-2
