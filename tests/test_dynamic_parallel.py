"""Chunked parallel loops (schedules.dynamic_parallel): the rewrite's IR, and builds that use
it computing what numpy and ONNX Runtime do, on sizes that leave partial chunks."""

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm.script import tirx as T

import tvm_tpp
from schedules.dynamic_parallel import (
    CHUNKS_PER_THREAD,
    chunk_size,
    dynamic_parallel,
    pipeline_for,
    tir_pipeline,
)
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime


def _rewritten(func, threads=2):
    mod = dynamic_parallel(threads)(tvm.IRModule({"main": func}))
    return mod["main"]


def test_parallel_loop_becomes_tasks_taking_chunks():
    @T.prim_func(private=True)
    def before(a: T.Buffer((37,), "float32")):
        for i in T.parallel(37):
            a[i] = a[i] * T.float32(2)

    @T.prim_func(private=True)
    def expected(a: T.Buffer((37,), "float32")):
        T.attr(0, "pragma_import_llvm", "")
        tpp_next = T.alloc_buffer((1,), "int32")
        tpp_next[0] = 0
        for _tpp_task in T.parallel(8):
            tpp_start = T.alloc_buffer((1,), "int32")
            tpp_start[0] = T.call_extern("int32", "tpp_fetch_add", tpp_next.data, 3)
            while tpp_start[0] < 37:
                for tpp_j in range(T.min(3, 37 - tpp_start[0])):
                    i: T.let[T.int32] = tpp_start[0] + tpp_j
                    a[i] = a[i] * T.float32(2)
                tpp_start[0] = T.call_extern("int32", "tpp_fetch_add", tpp_next.data, 3)

    after = _rewritten(before)
    # The linked LLVM text is the one difference: compare the bodies under the attribute.
    assert after.body.attr_key == "pragma_import_llvm"
    assert "atomicrmw add" in after.body.value.value
    tvm.ir.assert_structural_equal(after.body.body, expected.body.body, map_free_vars=True)


def test_function_without_parallel_loop_is_unchanged():
    @T.prim_func(private=True)
    def serial(a: T.Buffer((5,), "float32")):
        for i in range(5):
            a[i] = a[i] + T.float32(1)

    assert _rewritten(serial).same_as(serial)


def test_parallel_loop_with_a_step_keeps_tvms_split():
    """Only unit-step loops are chunked: a stepped one's iterations are not ``min + i``."""
    @T.prim_func(private=True)
    def stepped(a: T.Buffer((10,), "float32")):
        for i in T.parallel(0, 10, step=2):
            a[i] = a[i] * T.float32(2)

    assert _rewritten(stepped).same_as(stepped)


def test_pipeline_names():
    assert tir_pipeline(3) == "tpp_dynamic_parallel_3"
    assert pipeline_for(tvm_tpp.target("tpp", num_cores=2)) == "tpp_dynamic_parallel_2"
    assert pipeline_for(tvm.target.Target({"kind": "llvm"})) == "default"
    with pytest.raises(ValueError, match="at least one thread"):
        dynamic_parallel(0)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("extent", [1, 2, 7, 50])
def test_every_iteration_runs_once(threads, extent):
    """However many tasks and chunks: each iteration once (fewer iterations than tasks too)."""
    @T.prim_func
    def count(a: T.Buffer((64,), "int32"), n: T.int32):
        for i in T.parallel(n):
            a[i] = a[i] + 1

    mod = tvm.IRModule({"main": count})
    target = tvm_tpp.target("tpp", num_cores=threads)
    lib = tvm.compile(mod, target=target, tir_pipeline=pipeline_for(target))
    out = tvm.runtime.tensor(np.zeros(64, "int32"))
    lib["main"](out, extent)
    np.testing.assert_array_equal(out.numpy(), (np.arange(64) < extent).astype("int32"))


def _conv_dense_model():
    rng = np.random.default_rng(0)
    w = {"W": rng.standard_normal((13, 3, 3, 3)).astype("float32") / 5,
         "D": rng.standard_normal((13 * 9 * 11, 37)).astype("float32") / 30}
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Flatten", ["r"], ["f"]),
             helper.make_node("MatMul", ["f", "D"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3, 9, 11])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 37])],
        [numpy_helper.from_array(v, k) for k, v in w.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_network_build_uses_chunks_and_matches_onnxruntime():
    model = _conv_dense_model()
    compiled = tvm_tpp.compile(model, target="tpp")
    assert "atomicrmw add" in compiled.source("llvm")
    inputs = random_inputs(compiled.inputs, seed=1)
    _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
    assert rel <= 1e-5


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("extent", [1, 5, 7, 28, 37, 49, 98, 224, 1000, 4099])
def test_chunks_leave_no_thread_more_than_its_share(threads, extent):
    """Chunks taken in turn by equally fast threads: nobody runs more than its share (1 %
    over on long loops), and chunks are as long as that allows, up to a quarter share."""
    def busiest(chunk):
        loads = [0] * threads
        for start in range(0, extent, chunk):
            loads[loads.index(min(loads))] += min(chunk, extent - start)
        return max(loads)

    share = -(-extent // threads)
    chunk = chunk_size(extent, threads)
    largest = max(1, extent // (CHUNKS_PER_THREAD * threads))
    assert 1 <= chunk <= largest
    assert busiest(chunk) <= share + share // 100
    assert all(busiest(c) > share + share // 100 for c in range(chunk + 1, largest + 1))
