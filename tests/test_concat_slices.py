"""Concat inputs written into their channels by the kernels computing them
(relay_passes.concat_slices).

Before/Expected modules checked structurally and numerically (odd channel counts, an input
no kernel computes, kernels bound in another order than the concat's), the graphs the
rewrite must leave alone, and an Inception-style module built with onnx.helper against
ONNX Runtime.
"""

import numpy as np
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.script import tirx as T

from relay_passes.concat_chain import copy_kernel
from relay_passes.concat_slices import sliced_output, write_concat_slices
from relay_passes.scaffold import add_kernel
from tvm_tpp import compiler
from tvm_tpp.reference import max_errors, run_onnxruntime

LLVM = tvm.target.Target({"kind": "llvm"})
F32 = "float32"
ROWS = 6  # a [1, 2, 3, C] image's pixels


def _scaled_relu(channels: int, scale: float) -> tvm.tirx.PrimFunc:
    """A kernel writing relu(x * scale) element by element: a conv epilogue's store."""

    @T.prim_func(s_tir=True)
    def kernel(x: T.Buffer((ROWS, channels), F32), y: T.Buffer((ROWS, channels), F32)):
        for i, j in T.grid(ROWS, channels):
            with T.sblock("epilogue"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = T.max(x[vi, vj] * T.float32(scale), T.float32(0))

    return kernel


def _tile_writer(channels: int) -> tvm.tirx.PrimFunc:
    """A kernel writing its output through a view of its data: not element by element."""

    @T.prim_func(s_tir=True)
    def kernel(x: T.Buffer((ROWS, channels), F32), y: T.Buffer((ROWS, channels), F32)):
        with T.sblock("root"):
            flat = T.decl_buffer((ROWS * channels,), F32, data=y.data)
            for i in range(ROWS * channels):
                flat[i] = x[i // channels, i % channels]

    return kernel


def _tensor(*shape):
    return relax.TensorType(shape, F32)


def _before(kernels=None, swap: bool = False, extra_reader: bool = False, axis: int = 3
            ) -> tvm.IRModule:
    """concat([k1(x1) viewed NHWC, relu(z), k2(x2) viewed NHWC]) on the channels; ``swap``
    binds k2's call before k1's; ``extra_reader`` has the output read k1's result too."""
    kernels = kernels or (_scaled_relu(5, 2.0), _scaled_relu(3, 0.5))
    x1, x2 = relax.Var("x1", _tensor(ROWS, 5)), relax.Var("x2", _tensor(ROWS, 3))
    z = relax.Var("z", _tensor(1, 2, 3, 4))
    bb = relax.BlockBuilder()
    k1, k2 = (add_kernel(bb, k, f"kernel{i}") for i, k in enumerate(kernels, 1))
    with bb.function("main", [x1, x2, z]):
        with bb.dataflow():
            calls = [(k1, x1, 5), (k2, x2, 3)]
            outs = {}
            for kernel, x, c in (calls[::-1] if swap else calls):
                out = bb.emit(relax.call_tir(kernel, [x], _tensor(ROWS, c)))
                outs[c] = (out, bb.emit(relax.op.reshape(out, (1, 2, 3, c))))
            other = bb.emit(relax.op.nn.relu(z))
            parts = [outs[5][1], other, outs[3][1]]
            if axis != 3:
                parts = [outs[5][1], outs[5][1]]
            y = bb.emit(relax.op.concat(parts, axis=axis))
            if extra_reader:
                y = bb.emit(relax.op.add(relax.op.sum(y), relax.op.sum(outs[5][0])))
            y = bb.emit_output(y)
        bb.emit_func_output(y)
    return bb.get()


def _expected(swap: bool = False) -> tvm.IRModule:
    x1, x2 = relax.Var("x1", _tensor(ROWS, 5)), relax.Var("x2", _tensor(ROWS, 3))
    z = relax.Var("z", _tensor(1, 2, 3, 4))
    rows, nhwc = _tensor(ROWS, 12), _tensor(1, 2, 3, 12)
    bb = relax.BlockBuilder()
    add_kernel(bb, _scaled_relu(5, 2.0), "kernel1")
    add_kernel(bb, _scaled_relu(3, 0.5), "kernel2")
    k1 = add_kernel(bb, sliced_output(_scaled_relu(5, 2.0), 12, 0), "kernel1_sliced")
    k2 = add_kernel(bb, sliced_output(_scaled_relu(3, 0.5), 12, 9), "kernel2_sliced")
    copy = add_kernel(bb, copy_kernel((1, 2, 3, 4), 12, 5, F32, True), "concat_slice_copy")
    with bb.function("main", [x1, x2, z]):
        with bb.dataflow():
            if swap:
                buf = bb.emit(relax.call_tir(k2, [x2], rows))
                buf = bb.emit(relax.call_tir_inplace(k1, [x1, buf], [1], rows))
            else:
                buf = bb.emit(relax.call_tir(k1, [x1], rows))
                buf = bb.emit(relax.call_tir_inplace(k2, [x2, buf], [1], rows))
            other = bb.emit(relax.op.nn.relu(z))
            view = bb.emit(relax.op.reshape(buf, (1, 2, 3, 12)))
            buf = bb.emit(relax.call_tir_inplace(copy, [view, other], [0], nhwc))
            y = bb.emit_output(buf)
        bb.emit_func_output(y)
    return bb.get()


def _run(mod: tvm.IRModule, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s).astype(F32) for s in ((ROWS, 5), (ROWS, 3), (1, 2, 3, 4))]
    vm = relax.VirtualMachine(tvm.compile(mod, LLVM), tvm.cpu())
    return vm["main"](*(tvm.runtime.tensor(a) for a in arrays)).numpy()


@pytest.mark.parametrize("swap", [False, True], ids=["in-order", "kernels-swapped"])
def test_kernels_write_their_channels(swap):
    before = _before(swap=swap)
    after = write_concat_slices(before)
    # The pipeline canonicalizes right after: the concat's var then aliases no other.
    tidy = tvm.transform.Sequential([relax.transform.CanonicalizeBindings(),
                                     relax.transform.DeadCodeElimination()])
    tvm.ir.assert_structural_equal(tidy(after), tidy(_expected(swap)))
    np.testing.assert_array_equal(_run(after), _run(before))


def test_sliced_output_rejects_channels_outside_the_buffer():
    with pytest.raises(ValueError, match=r"channels \[8, 13\) are not inside 12"):
        sliced_output(_scaled_relu(5, 1.0), 12, 8)


@pytest.mark.parametrize("before", [
    _before(extra_reader=True),  # k1's result is read besides the concat: k2's only
    _before(kernels=(_tile_writer(5), _scaled_relu(3, 0.5))),  # k1 writes through a view
], ids=["extra-reader", "view-writer"])
def test_inputs_a_kernel_cannot_write_are_copied(before):
    after = write_concat_slices(before)
    names = sorted(gv.name_hint for gv in after.functions)
    assert "kernel2_sliced" in names and "kernel1_sliced" not in names, names
    assert sum(n.startswith("concat_slice_copy") for n in names) == 2, names
    np.testing.assert_array_equal(_run(after, 1), _run(before, 1))


def _nhwc_doubler() -> tvm.tirx.PrimFunc:
    """An elementwise kernel writing NHWC itself (a quantized branch's lookup table's form)."""

    @T.prim_func(s_tir=True)
    def kernel(x: T.Buffer((1, 2, 3, 4), F32), y: T.Buffer((1, 2, 3, 4), F32)):
        for n, h, w, c in T.grid(1, 2, 3, 4):
            with T.sblock("double"):
                vn, vh, vw, vc = T.axis.remap("SSSS", [n, h, w, c])
                y[vn, vh, vw, vc] = x[vn, vh, vw, vc] * T.float32(2)

    return kernel


def test_a_kernel_writing_nhwc_writes_its_channels():
    """concat([k1(x1) viewed NHWC, double(z)]): the NHWC kernel writes channels 5-8 of the
    buffer viewed as NHWC, after the [rows, C] kernel wrote channels 0-4."""
    x1 = relax.Var("x1", _tensor(ROWS, 5))
    x2 = relax.Var("x2", _tensor(ROWS, 3))
    z = relax.Var("z", _tensor(1, 2, 3, 4))
    bb = relax.BlockBuilder()
    k1 = add_kernel(bb, _scaled_relu(5, 2.0), "kernel1")
    double = add_kernel(bb, _nhwc_doubler(), "double")
    with bb.function("main", [x1, x2, z]):
        with bb.dataflow():
            out = bb.emit(relax.call_tir(k1, [x1], _tensor(ROWS, 5)))
            view = bb.emit(relax.op.reshape(out, (1, 2, 3, 5)))
            doubled = bb.emit(relax.call_tir(double, [z], _tensor(1, 2, 3, 4)))
            y = bb.emit_output(relax.op.concat([view, doubled], axis=3))
        bb.emit_func_output(y)
    before = bb.get()
    after = write_concat_slices(before)
    names = sorted(gv.name_hint for gv in after.functions)
    assert {"kernel1_sliced", "double_sliced"} <= set(names), names
    assert not any(n.startswith("concat_slice_copy") for n in names), names
    np.testing.assert_array_equal(_run(after, 2), _run(before, 2))


def test_concats_on_other_axes_kept():
    before = relax.transform.DeadCodeElimination()(_before(axis=1))
    tvm.ir.assert_structural_equal(write_concat_slices(before), before)


def _inception_module(hw: int = 9, c: int = 6):
    """Three branches (1x1; 3x3; max pool -> 1x1) of odd widths concatenated, then a 1x1
    conv over the concat: GoogLeNet's module, its 1x1 reductions left out."""
    rng = np.random.default_rng(4)
    inits, nodes = [], []

    def conv(x, name, cin, cout, k):
        inits.append(numpy_helper.from_array(
            (rng.standard_normal((cout, cin, k, k)) * 0.3).astype(F32), f"{name}_w"))
        inits.append(numpy_helper.from_array(rng.standard_normal(cout).astype(F32),
                                             f"{name}_b"))
        nodes.append(helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [f"{name}_c"],
                                      pads=[k // 2] * 4))
        nodes.append(helper.make_node("Relu", [f"{name}_c"], [name]))
        return name

    b1 = conv("x", "b1", c, 7, 1)
    b2 = conv("x", "b2", c, 9, 3)
    nodes.append(helper.make_node("MaxPool", ["x"], ["pool"], kernel_shape=[3, 3],
                                  pads=[1] * 4, strides=[1, 1]))
    b3 = conv("pool", "b3", c, 5, 1)
    nodes.append(helper.make_node("Concat", [b1, b2, b3], ["cat"], axis=1))
    out = conv("cat", "project", 21, 8, 1)
    graph = helper.make_graph(
        nodes, "inception_module",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, c, hw, hw])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, [2, 8, hw, hw])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_inception_module_against_onnxruntime():
    model = _inception_module()
    names = [gv.name_hint for gv in compiler.lower(model).functions]
    assert sum(n.endswith("_sliced") for n in names) == 3, names
    assert not any("concatenate" in n for n in names), names
    x = np.random.default_rng(5).standard_normal((2, 6, 9, 9)).astype(F32)
    got = compiler.compile(model, "tpp", untuned=True).run(x=x)
    errors = max_errors(got, run_onnxruntime(model, {"x": x}))
    assert max(errors) < 1e-5, errors
