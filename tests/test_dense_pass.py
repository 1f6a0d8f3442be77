"""Relax dense rewrite: chains of matmul + epilogue become TPP kernels; the rest is reported.

Each network is built with onnx.helper, compiled with the tpp target and checked against ONNX
Runtime; the report says which operators became which kernels and why others did not.
"""

import re

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvm_tpp
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime


def _model(nodes, inputs, outputs, weights, opset=17):
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _weights(seed=0, **shapes):
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_normal(s) / np.sqrt(s[0])).astype("float32")
            for k, s in shapes.items()}


def _compile_and_check(model):
    compiled = tvm_tpp.compile(model, target="tpp")
    inputs = random_inputs(compiled.inputs, seed=1)
    _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
    assert rel <= 1e-5
    return compiled.report


def test_gemm_transb_bias_relu_and_plain_matmul():
    w = _weights(W1=(24, 40), b1=(40,), W2=(40, 16))
    w["W1t"] = np.ascontiguousarray(w.pop("W1").T)  # Gemm(transB=1) stores [N, K]
    nodes = [helper.make_node("Gemm", ["x", "W1t", "b1"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["y"])]
    report = _compile_and_check(_model(nodes, [("x", [5, 24])], [("y", [5, 16])], w))
    kernels = [r.op for r in report if r.kernel]
    assert kernels == ["matmul+bias+relu", "matmul"], report


def test_rank3_input_residual_and_sigmoid():
    w = _weights(W=(32, 32), b=(32,))
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"]),
             helper.make_node("Add", ["mm", "b"], ["biased"]),
             helper.make_node("Add", ["x", "biased"], ["res"]),  # residual on the left
             helper.make_node("Sigmoid", ["res"], ["y"])]
    report = _compile_and_check(_model(nodes, [("x", [2, 7, 32])], [("y", [2, 7, 32])], w))
    assert [(r.op, r.shape) for r in report if r.kernel] == [
        ("matmul+bias+residual+sigmoid", (14, 32, 32))]


def test_attention_matmul_goes_to_the_batch_kernel():
    """Two activations: not dense's (no constant weight), so the batch-matmul pass takes it."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["y"])]
    report = _compile_and_check(
        _model(nodes, [("q", [2, 8, 16]), ("k", [2, 8, 16])], [("y", [2, 8, 8])], {}))
    assert [(r.op, r.shape) for r in report if r.kernel] == [("batch_matmul", (2, 8, 8, 16))]
    assert all(r.kernel for r in report)


def test_non_float32_falls_back():
    w = {"W": np.ones((8, 8), "float64")}
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [4, 8])],
        [numpy_helper.from_array(w["W"], "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    compiled = tvm_tpp.compile(model)
    x = np.random.default_rng(0).standard_normal((4, 8))
    np.testing.assert_allclose(compiled.run(x=x)[0], x @ w["W"], rtol=1e-12)
    assert [r.reason for r in compiled.report] == [
        "dtype float64 x float64: only float32 dense is routed to TPP"]


def test_plain_llvm_target_rewrites_nothing():
    w = _weights(W=(16, 16))
    model = _model([helper.make_node("MatMul", ["x", "W"], ["y"])],
                   [("x", [3, 16])], [("y", [3, 16])], w)
    compiled = tvm_tpp.compile(model, target={"kind": "llvm", "mcpu": "haswell"})
    assert compiled.report == []


#: The vector registers each x86 ISA's kernels compute in.
VECTOR_REGISTER = {"avx2": "ymm", "avx512": "zmm"}


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_kernels_for_each_x86_isa_build(isa):
    """The same network builds for each x86 ISA: its kernel's FMAs use the ISA's vector
    registers, and where the host runs the ISA the result matches ONNX Runtime."""
    w = _weights(W=(64, 48), b=(48,))
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"]),
             helper.make_node("Add", ["mm", "b"], ["y"])]
    model = _model(nodes, [("x", [6, 64])], [("y", [6, 48])], w)
    compiled = tvm_tpp.compile(model, target=f"tpp -isa={isa}")
    assert [r.kernel is not None for r in compiled.report] == [True]
    fma = rf"vfmadd\d+ps\s[^\n]*%{VECTOR_REGISTER[isa]}"
    assert re.search(fma, compiled.source("asm")), f"no {isa} FMA in the assembly"
    if not compiled.runnable:
        pytest.skip(f"this host cannot run {isa}: only the assembly was checked")
    inputs = random_inputs(compiled.inputs)
    _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
    assert rel <= 1e-5


def _dense_gelu_model(divisor: float):
    """Dense + bias, then x * (1 + erf(x / divisor)) * 0.5 spelled out as ONNX exports it."""
    w = _weights(W=(32, 48), b=(48,))
    w.update({"div": np.array(divisor, "float32"), "one": np.array(1.0, "float32"),
              "half": np.array(0.5, "float32")})
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"]),
             helper.make_node("Add", ["mm", "b"], ["h"]),
             helper.make_node("Div", ["h", "div"], ["d"]),
             helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["a"]),
             helper.make_node("Mul", ["h", "a"], ["m"]),
             helper.make_node("Mul", ["m", "half"], ["y"])]
    return _model(nodes, [("x", [9, 32])], [("y", [9, 48])], w)


def test_spelled_out_erf_gelu_is_fused():
    report = _compile_and_check(_dense_gelu_model(float(np.sqrt(2.0))))
    assert [r.op for r in report if r.kernel] == ["matmul+bias+gelu_erf"]


def test_other_constants_are_not_mistaken_for_gelu():
    report = _compile_and_check(_dense_gelu_model(3.0))
    assert [r.op for r in report if r.kernel] == ["matmul+bias"]


def test_long_k_dense_packs_a(monkeypatch):
    """A K long enough for the packed K-split default (with a small L2, on any ISA) stays
    exact."""
    from microkernels import isa, machine
    from schedules import gemm

    monkeypatch.setattr(machine, "_caches", lambda: isa.Caches(32 * 1024, 64 * 1024, 1 << 20))
    monkeypatch.setattr(gemm, "_splits_long_k", lambda problem, machine: True)
    w = _weights(W=(1024, 64), b=(64,))
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"]),
             helper.make_node("Add", ["mm", "b"], ["biased"]),
             helper.make_node("Add", ["biased", "x2"], ["y"])]
    report = _compile_and_check(_model(nodes, [("x", [20, 1024]), ("x2", [20, 64])],
                                       [("y", [20, 64])], w))
    [dense] = [r for r in report if r.kernel]
    assert dense.op == "matmul+bias+residual" and "pack_a=1" in dense.kernel, report
