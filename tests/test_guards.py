"""Gather indices out of range stop the run with one line instead of reading past the tensor
(relay_passes.guards): TVM's ``take(..., mode="fast")`` would answer garbage, ONNX Runtime
refuses.  In-range indices (negative ones included) still equal ONNX Runtime."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import tvm_tpp
from relay_passes.guards import OUT_OF_RANGE, guard_gathers
from relay_passes.scaffold import is_call_to
from tvm_tpp.errors import UsageError
from tvm_tpp.reference import run_onnxruntime


def _gather_model(index_shape=(2, 2), axis=1):
    data = numpy_helper.from_array(np.arange(4 * 5 * 3, dtype="float32").reshape(4, 5, 3), "d")
    out = [4, *index_shape, 3] if axis == 1 else [*index_shape, 5, 3]
    graph = helper.make_graph(
        [helper.make_node("Gather", ["d", "i"], ["y"], axis=axis)], "gather",
        [helper.make_tensor_value_info("i", TensorProto.INT64, list(index_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)], [data])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _takes_and_checks(mod):
    takes, checks = [], []
    relax.analysis.post_order_visit(mod["main"], lambda e: (
        takes.append(e) if is_call_to(e, "relax.take") else
        checks.append(e) if is_call_to(e, "relax.call_tir") else None))
    return takes, checks


def test_run_time_indices_are_checked_constant_ones_are_not():
    i = relax.Var("i", relax.TensorType((3,), "int64"))
    data = relax.const(np.zeros((5, 2), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [i]):
        with bb.dataflow():
            a = bb.emit(relax.op.take(data, i, axis=0))
            b = bb.emit(relax.op.take(data, relax.const(np.array([1, 4])), axis=0))
            out = bb.emit_output(relax.op.add(a, relax.op.sum(b, axis=0)))
        bb.emit_func_output(out)
    takes, checks = _takes_and_checks(guard_gathers(bb.get()))
    assert len(takes) == 2 and len(checks) == 1
    assert checks[0].args[0].name_hint == "tpp_check_indices_3_in_5"


@pytest.mark.parametrize("axis", [0, 1])
def test_in_range_indices_match_onnxruntime(axis):
    model = _gather_model(axis=axis)
    compiled = tvm_tpp.compile(model, target="tpp")
    size = 4 if axis == 0 else 5
    i = np.array([[0, -1], [size - 1, -size]], "int64")
    np.testing.assert_array_equal(compiled.run(i=i)[0], run_onnxruntime(model, {"i": i})[0])


@pytest.mark.parametrize("bad", [5, -6, 1000])
def test_out_of_range_index_is_one_clear_error(bad):
    model = _gather_model()
    compiled = tvm_tpp.compile(model, target="tpp")
    i = np.array([[0, 1], [bad, 2]], "int64")
    with pytest.raises(Exception, match="out of data bounds"):  # ONNX Runtime refuses too
        run_onnxruntime(model, {"i": i})
    with pytest.raises(UsageError, match=f"{OUT_OF_RANGE}: ONNX's \\[-5, 5\\)") as err:
        compiled.run(i=i)
    assert "\n" not in str(err.value)
