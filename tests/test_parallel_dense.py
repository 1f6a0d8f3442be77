"""Dense layers on one input, their outputs only rearranged, as one (relay_passes.parallel_dense).

The rewrite as Before/Expected, the groups it must leave alone, the same result through the
VM, and BERT layers at odd sizes against ONNX Runtime in float32 and bf16 with their Q, K and
V projections as one kernel.
"""

import numpy as np
import pytest
import tvm
from conftest import main_calls, relax_main
from tvm import relax

import tvm_tpp
from relay_passes.parallel_dense import combine_parallel_dense
from tvm_tpp import models
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime

F32 = "float32"
RNG = np.random.default_rng(44)
WIDTHS = (6, 10, 6)
WEIGHTS = [RNG.standard_normal((8, n)).astype(F32) for n in WIDTHS]
BIASES = [RNG.standard_normal(n).astype(F32) for n in WIDTHS]


def _x() -> relax.Var:
    return relax.Var("x", relax.TensorType((2, 5, 8), F32))


def _heads(bb, y, n):
    return bb.emit(relax.op.reshape(y, (2, 5, 2, n // 2)))


def _projections(bb, x, biased=(True, True, True), then=_heads):
    outs = []
    for w, b, on in zip(WEIGHTS, BIASES, biased, strict=True):
        y = bb.emit(relax.op.matmul(x, relax.const(w)))
        if on:
            y = bb.emit(relax.op.add(y, relax.const(b)))
        outs.append(then(bb, y, w.shape[1]))
    return relax.Tuple(outs)


def test_rewrite_before_expected():
    def expected(bb, x):
        y = bb.emit(relax.op.matmul(x, relax.const(np.concatenate(WEIGHTS, axis=1))))
        y = bb.emit(relax.op.add(y, relax.const(np.concatenate(BIASES))))
        parts = bb.emit(relax.op.split(y, [6, 16], axis=-1))
        return relax.Tuple([_heads(bb, bb.emit(relax.TupleGetItem(parts, i)), n)
                            for i, n in enumerate(WIDTHS)])

    got = combine_parallel_dense(relax_main([_x()], _projections))
    tvm.ir.assert_structural_equal(got, relax_main([_x()], expected))


def test_same_result():
    before = relax_main([_x()], _projections)
    after = combine_parallel_dense(before)
    assert [c.op.name for c in main_calls(after)].count("relax.matmul") == 1
    x = RNG.standard_normal((2, 5, 8)).astype(F32)
    for want, got in zip(_run(before, x), _run(after, x), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _activated(bb, y, n):
    return _heads(bb, bb.emit(relax.op.nn.relu(y)), n)


def _other_inputs(bb, x):
    outs = []
    for i, w in enumerate(WEIGHTS):
        xi = bb.emit(relax.op.multiply(x, relax.const(float(i + 1), F32)))
        outs.append(_heads(bb, bb.emit(relax.op.matmul(xi, relax.const(w))), w.shape[1]))
    return relax.Tuple(outs)


def _one_biased(bb, x):
    return _projections(bb, x, biased=(True, False, False))


def _read_twice(bb, x):
    y = bb.emit(relax.op.matmul(x, relax.const(WEIGHTS[0])))
    z = bb.emit(relax.op.matmul(x, relax.const(WEIGHTS[1])))
    return relax.Tuple([_heads(bb, y, 6), y, _heads(bb, z, 10)])


def _activated_projections(bb, x):
    return _projections(bb, x, then=_activated)


@pytest.mark.parametrize("body", [_activated_projections, _other_inputs, _read_twice],
                         ids=["activated", "other-inputs", "read-unrearranged"])
def test_groups_kept(body):
    mod = relax_main([_x()], body)
    tvm.ir.assert_structural_equal(combine_parallel_dense(mod), mod)


def test_biased_and_unbiased_layers_group_apart():
    # One biased layer has no partner; the two unbiased ones are a group of their own.
    after = combine_parallel_dense(relax_main([_x()], _one_biased))
    products = [c for c in main_calls(after) if c.op.name == "relax.matmul"]
    assert sorted(int(c.ty.shape[-1]) for c in products) == [6, 16]


def _run(mod: tvm.IRModule, x: np.ndarray) -> list[np.ndarray]:
    ex = tvm.compile(mod, tvm.target.Target({"kind": "llvm"}))
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x))
    return [o.numpy() for o in out]


@pytest.mark.parametrize("precision, tol", [("float32", 1e-5), ("bf16", 2e-2)])
def test_bert_projections_one_kernel(precision, tol):
    # Odd sizes: 7 tokens, 3 heads of 12; Q, K and V as one 36 -> 108 dense layer whose parts
    # the fused attention reads in place.
    model = models.load("bert", batch=2, seq=7, hidden=36, heads=3, ffn=20)
    compiled = tvm_tpp.compile(model, precision=precision)
    dense = [r.kernel for r in compiled.report if r.kernel and r.kernel.startswith("tpp_dense")]
    assert sum(k.startswith("tpp_dense_14x108x36_bias") for k in dense) == 1, dense
    assert not any(k.startswith("tpp_dense_14x36x36_bias ") for k in dense), dense
    inputs = random_inputs(compiled.inputs, seed=5)
    got = compiled.run(**inputs)
    assert max_errors(got, run_onnxruntime(model, inputs))[1] <= tol
