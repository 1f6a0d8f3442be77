"""The epilogue of a single-call BRGEMM computed on its accumulators before they are stored
(:mod:`schedules.register_epilogue`).

The rewrite as Before/Expected IR; scheduled conv and GEMM kernels of odd sizes, rewritten,
against numpy (outputs first filled with NaN, the residual read and written in place); the
kernels it must leave alone; and a network through the ``tpp`` pipeline against ONNX Runtime.
"""

import functools

import numpy as np
import onnx
import pytest
import tvm
from conftest import pixel_rows
from onnx import TensorProto, helper, numpy_helper
from tvm.script import tirx as T

from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.epilogue import reference as epilogue_reference
from schedules.conv import ConvConfig, ConvProblem, pack_input
from schedules.conv import pack_weight as conv_pack_weight
from schedules.conv import reference as conv_reference
from schedules.conv import schedule as conv_schedule
from schedules.gemm import GemmConfig, GemmProblem, pack_weight
from schedules.gemm import schedule as gemm_schedule
from schedules.register_epilogue import epilogue_in_registers
from schedules.space import Candidate

AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
BIAS_RESIDUAL_RELU = Epilogue((EpilogueOp("bias"), EpilogueOp("residual"), EpilogueOp("relu")))
BIAS_GELU = Epilogue((EpilogueOp("bias"), EpilogueOp("gelu", variant="erf")))


# TVMScript parsed when a test asks: parsed at import, each function costs ~0.3 s per worker.
@functools.cache
def _before_ir():
    @T.prim_func(s_tir=True)
    def _before(a: T.Buffer((4, 8), "float32"), bias: T.Buffer((8,), "float32"),
                r: T.Buffer((4, 8), "float32"), y: T.Buffer((4, 8), "float32")):
        acc = T.sblock_alloc_buffer((4, 8))
        for i0 in range(2):
            with T.sblock("kernel"):
                vi = T.axis.spatial(2, i0)
                T.reads(a[vi * 2:vi * 2 + 2, 0:8])
                T.writes(acc[vi * 2:vi * 2 + 2, 0:8])
                C = T.match_buffer(acc[vi * 2:vi * 2 + 2, 0:8], (2, 8), strides=("sc", 1),
                                   offset_factor=1)
                reg = T.alloc_buffer((8,), scope="local")
                for row in range(2):
                    reg[0:8] = a[vi * 2 + row, T.Ramp(0, 1, 8)] * T.Broadcast(T.float32(2), 8)
                    C[row, 0:8] = reg[T.Ramp(0, 1, 8)]
            for i1, j in T.grid(2, 8):
                with T.sblock("epilogue"):
                    v_i = T.axis.spatial(4, i0 * 2 + i1)
                    v_j = T.axis.spatial(8, j)
                    T.reads(acc[v_i, v_j], bias[v_j], r[v_i, v_j])
                    T.writes(y[v_i, v_j])
                    y[v_i, v_j] = T.max(acc[v_i, v_j] + bias[v_j] + r[v_i, v_j], T.float32(0))
    return _before


@functools.cache
def _expected_ir():
    @T.prim_func(s_tir=True)
    def _expected(a: T.Buffer((4, 8), "float32"), bias: T.Buffer((8,), "float32"),
                  r: T.Buffer((4, 8), "float32"), y: T.Buffer((4, 8), "float32")):
        T.sblock_alloc_buffer((4, 8))
        for i0 in range(2):
            with T.sblock("kernel"):
                vi = T.axis.spatial(2, i0)
                T.reads(a[vi * 2:vi * 2 + 2, 0:8], bias[0:8], r[0:4, 0:8])
                T.writes(y[0:4, 0:8])
                for row in range(2):  # the tile's lines, ahead of the FMAs: r read, y written
                    T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(r[vi * 2 + row, 0]),
                                       0, 3, 1)
                    T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(y[vi * 2 + row, 0]),
                                       1, 3, 1)
                reg = T.alloc_buffer((8,), scope="local")
                for row in range(2):
                    reg[0:8] = a[vi * 2 + row, T.Ramp(0, 1, 8)] * T.Broadcast(T.float32(2), 8)
                    for lane in T.vectorized(8):
                        y[vi * 2 + row, lane] = T.max(
                            reg[lane] + bias[lane] + r[vi * 2 + row, lane], T.float32(0))
    return _expected


def test_stores_go_through_the_epilogue():
    tvm.ir.assert_structural_equal(epilogue_in_registers(_before_ir()),
                                   _expected_ir().with_attr("global_symbol", "_before"))


def test_kernel_reading_its_tile_is_left_alone():
    """A kernel that loads C (a reduction over several calls) keeps its epilogue pass."""
    @T.prim_func(s_tir=True)
    def accumulating(a: T.Buffer((2, 8), "float32"), y: T.Buffer((2, 8), "float32")):
        acc = T.sblock_alloc_buffer((2, 8))
        for _ in range(3):
            with T.sblock("kernel"):
                C = T.match_buffer(acc[0:2, 0:8], (2, 8), strides=("sc", 1), offset_factor=1)
                for row in range(2):
                    C[row, 0:8] = C[row, T.Ramp(0, 1, 8)] + a[row, T.Ramp(0, 1, 8)]
        for i, j in T.grid(2, 8):
            with T.sblock("epilogue"):
                v_i, v_j = T.axis.remap("SS", [i, j])
                y[v_i, v_j] = T.max(acc[v_i, v_j], T.float32(0))

    assert epilogue_in_registers(accumulating) is accumulating


def test_epilogue_reading_another_element_is_left_alone():
    @T.prim_func(s_tir=True)
    def shifted(a: T.Buffer((2, 8), "float32"), y: T.Buffer((2, 8), "float32")):
        acc = T.sblock_alloc_buffer((2, 8))
        with T.sblock("kernel"):
            T.reads(a[0:2, 0:8])
            T.writes(acc[0:2, 0:8])
            C = T.match_buffer(acc[0:2, 0:8], (2, 8), strides=("sc", 1), offset_factor=1)
            reg = T.alloc_buffer((8,), scope="local")
            for row in range(2):
                reg[0:8] = a[row, T.Ramp(0, 1, 8)]
                C[row, 0:8] = reg[T.Ramp(0, 1, 8)]
        for i, j in T.grid(2, 8):
            with T.sblock("epilogue"):
                v_i, v_j = T.axis.remap("SS", [i, j])
                y[v_i, v_j] = acc[v_i, (v_j + 1) % 8]

    assert epilogue_in_registers(shifted) is shifted


def _fused(sch):
    func = sch.mod["main"]
    fused = epilogue_in_registers(func)
    return func, fused, '"epilogue"' not in fused.script()


def _conv_case(problem, config, in_place):
    """The rewritten conv kernel's output against numpy (NaN before the run)."""
    func, fused, rewritten = _fused(conv_schedule(problem, config, "avx2"))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((problem.n, problem.c, problem.h, problem.w)).astype("float32")
    w = rng.standard_normal((problem.k, problem.c, problem.r, problem.s)).astype("float32")
    bias = rng.standard_normal(problem.k).astype("float32")
    residual = rng.standard_normal((problem.rows, problem.k)).astype("float32")
    conv = pixel_rows(conv_reference(problem, x, w)).astype("float32")
    operands = {"bias": bias, "residual": residual}
    want = epilogue_reference(problem.epilogue, conv, operands)
    args = [tvm.runtime.tensor(a) for a in (pack_input(x, problem),
                                            conv_pack_weight(w, config.bk, problem))]
    args += [tvm.runtime.tensor(operands[op.name]) for op in problem.epilogue.inputs()]
    out = args[-1] if in_place else tvm.runtime.tensor(
        np.full((problem.rows, problem.k), np.nan, "float32"))
    tvm.compile(fused, target=AVX2)(*args, out)
    return rewritten, out.numpy(), want


@pytest.mark.parametrize("problem,config", [
    # Row tails (7 = 4 + 3, 13 = 5 + 4 + 4) and columns narrower than a vector (20 = 16 + 4).
    (ConvProblem(2, 12, 5, 7, 24, 1, 1, epilogue=BIAS_RESIDUAL_RELU),
     ConvConfig(bq=7, bc=12, bk=8, spec="ADEcbfg")),
    (ConvProblem(1, 20, 3, 13, 40, 1, 1, epilogue=BIAS_RESIDUAL_RELU),
     ConvConfig(bq=13, bc=20, bk=20, spec="ACbfgde")),
    # Two channel blocks reduced in one call.
    (ConvProblem(1, 32, 4, 6, 16, 1, 1, epilogue=BIAS_RESIDUAL_RELU),
     ConvConfig(bq=6, bc=16, bk=16, spec="ACDebfg", c_step=2)),
])
@pytest.mark.parametrize("in_place", [False, True])
def test_conv_kernels(problem, config, in_place):
    rewritten, got, want = _conv_case(problem, config, in_place)
    assert rewritten
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_gelu_epilogue():
    problem = ConvProblem(1, 16, 3, 9, 32, 1, 1, epilogue=BIAS_GELU)
    rewritten, got, want = _conv_case(problem, ConvConfig(bq=9, bc=16, bk=16), False)
    assert rewritten
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("problem,config", [
    # Three taps per row, or two channel blocks in two calls: each call adds to C.
    (ConvProblem(1, 8, 6, 6, 16, 3, 3, padding=1, epilogue=BIAS_RESIDUAL_RELU),
     ConvConfig(bq=6, bc=8, bk=16)),
    (ConvProblem(1, 32, 4, 6, 16, 1, 1, epilogue=BIAS_RESIDUAL_RELU),
     ConvConfig(bq=6, bc=16, bk=16, c_step=1)),
])
def test_multi_call_convs_keep_their_epilogue_pass(problem, config):
    rewritten, got, want = _conv_case(problem, config, False)
    assert not rewritten
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k_step,rewritten", [(3, True), (1, False)])
def test_gemm_kernels(k_step, rewritten):
    problem = GemmProblem(13, 24, 48, epilogue=BIAS_GELU)
    config = GemmConfig(bm=13, bn=8, bk=16, candidate=Candidate("BCa", {}, {"a": k_step}))
    func, fused, done = _fused(gemm_schedule(problem, config, "avx2"))
    assert done == rewritten and (fused is func) != rewritten
    rng = np.random.default_rng(1)
    x = rng.standard_normal((13, 48)).astype("float32")
    w = rng.standard_normal((48, 24)).astype("float32")
    bias = rng.standard_normal(24).astype("float32")
    y = tvm.runtime.tensor(np.full((13, 24), np.nan, "float32"))
    tvm.compile(fused, target=AVX2)(tvm.runtime.tensor(x),
                                    tvm.runtime.tensor(pack_weight(w, config.bn)),
                                    tvm.runtime.tensor(bias), y)
    np.testing.assert_allclose(y.numpy(), epilogue_reference(BIAS_GELU, x @ w, {"bias": bias}),
                               rtol=1e-4, atol=1e-4)


def _bottleneck() -> onnx.ModelProto:
    """``h = relu(conv(x))``, then ResNet's bottleneck on ``h``: two 1x1 convs, the second
    adding ``h`` (dead afterwards, so written over in place)."""
    rng = np.random.default_rng(2)

    def conv(name, x, cin, cout):
        w = numpy_helper.from_array((rng.standard_normal((cout, cin, 1, 1))
                                     / np.sqrt(cin)).astype("float32"), name + "_w")
        b = numpy_helper.from_array(rng.standard_normal(cout).astype("float32"), name + "_b")
        return helper.make_node("Conv", [x, w.name, b.name], [name]), [w, b]

    nodes, weights = [], []
    for name, x, cin, cout in (("h0", "x", 16, 24), ("a0", "h", 24, 8), ("b", "a", 8, 24)):
        node, ws = conv(name, x, cin, cout)
        nodes.append(node)
        weights += ws
        if name != "b":
            nodes.append(helper.make_node("Relu", [name], [name[0]]))
    nodes += [helper.make_node("Add", ["b", "h"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    graph = helper.make_graph(
        nodes, "bottleneck", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 7, 9])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 24, 7, 9])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_bottleneck_through_the_pipeline():
    """The ``tpp`` pipeline rewrites after the in-place pass, which still finds the residual
    conv's epilogue block; the network against ONNX Runtime."""
    import onnxruntime as ort

    import tvm_tpp

    model = _bottleneck()
    x = np.random.default_rng(3).standard_normal((1, 16, 7, 9)).astype("float32")
    compiled = tvm_tpp.compile(model, target="tpp -isa=avx2")
    llvm = compiled.source("llvm")
    assert "_inplace" in llvm and "llvm.prefetch" in llvm  # in place, and rewritten
    (got,) = compiled.run(x=x)
    (want,) = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
