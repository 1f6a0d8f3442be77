"""DenseNet's concat chains written in place into one buffer (relay_passes.concat_chain).

Before/Expected modules checked structurally, the rewrite checked numerically on odd sizes
(channel counts no vector divides, an earlier concat read after later writes), the graphs it
must leave alone, and a small dense block built with onnx.helper against ONNX Runtime.
"""

import numpy as np
import pytest
import tvm
from conftest import run_main
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from relay_passes.concat_chain import copy_kernel, write_concat_chains
from relay_passes.scaffold import add_kernel
from tvm_tpp import compiler
from tvm_tpp.reference import max_errors, run_onnxruntime

F32 = "float32"


def _tensor(*shape):
    return relax.TensorType(shape, F32)


def _grown(c, g: int, seed: int):
    """g new channels from c: relu(sum over c's channels * g weights)."""
    weights = np.random.default_rng(seed).standard_normal(g).astype(F32)
    return relax.op.nn.relu(relax.op.multiply(relax.op.sum(c, axis=[3], keepdims=True),
                                              relax.const(weights)))


def _chain_before(x_shape=(1, 5, 7, 3), grow=(5, 3)) -> tvm.IRModule:
    """c_i = concat(c_{i-1}, new_i), new_i of g_i channels; the output also reads c_1."""
    x = relax.Var("x", _tensor(*x_shape))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            c, first = x, None
            for i, g in enumerate(grow):
                new = bb.emit(_grown(c, g, i))
                c = bb.emit(relax.op.concat([c, new], axis=3))
                first = c if first is None else first
            y = bb.emit_output(relax.op.add(relax.op.sum(first, axis=[3], keepdims=True), c))
        bb.emit_func_output(y)
    return bb.get()


def _chain_expected() -> tvm.IRModule:
    x = relax.Var("x", _tensor(1, 5, 7, 3))
    full = _tensor(1, 5, 7, 11)
    bb = relax.BlockBuilder()
    copy = add_kernel(bb, copy_kernel((1, 5, 7, 3), 11, 0, F32, False), "concat_copy")
    write5 = add_kernel(bb, copy_kernel((1, 5, 7, 5), 11, 3, F32, True), "concat_slice_copy")
    write3 = add_kernel(bb, copy_kernel((1, 5, 7, 3), 11, 8, F32, True), "concat_slice_copy")
    with bb.function("main", [x]):
        with bb.dataflow():
            n1 = bb.emit(_grown(x, 5, 0))
            buf = bb.emit(relax.call_tir(copy, [x], full))
            buf = bb.emit(relax.call_tir_inplace(write5, [buf, n1], [0], full))
            c1 = bb.emit(relax.op.strided_slice(buf, axes=[3], begin=[0], end=[8]))
            n2 = bb.emit(_grown(c1, 3, 1))
            buf = bb.emit(relax.call_tir_inplace(write3, [buf, n2], [0], full))
            c2 = bb.emit(buf)
            y = bb.emit_output(relax.op.add(relax.op.sum(c1, axis=[3], keepdims=True), c2))
        bb.emit_func_output(y)
    return bb.get()


def test_chain_written_in_place():
    before = _chain_before()
    after = write_concat_chains(before)
    tvm.ir.assert_structural_equal(after, _chain_expected())
    x = np.random.default_rng(0).standard_normal((1, 5, 7, 3)).astype(F32)
    np.testing.assert_array_equal(run_main(after, x), run_main(before, x))


@pytest.mark.parametrize("x_shape, grow", [((2, 3, 5, 8), (8, 16, 8)), ((1, 9, 9, 13), (7,) * 5)],
                         ids=["vectors", "odd-channels"])
def test_chains_numerically(x_shape, grow):
    before = _chain_before(x_shape, grow)
    after = write_concat_chains(before)
    assert sum(gv.name_hint.startswith("concat_slice_copy") for gv in after.functions) >= 1
    x = np.random.default_rng(1).standard_normal(x_shape).astype(F32)
    np.testing.assert_array_equal(run_main(after, x), run_main(before, x))


def _scaled_rows_ir(rows: int, c: int):
    """A kernel writing ``[rows, c]`` element by element: twice its input."""
    from tvm.script import tirx as T

    @T.prim_func(private=True, s_tir=True)
    def scaled(x: T.Buffer((rows, c), F32), y: T.Buffer((rows, c), F32)):
        for i, j in T.grid(rows, c):
            with T.sblock("scaled"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] * T.float32(2)
    return scaled


def test_kernel_writes_its_channels_into_the_buffer():
    """New channels a kernel computes (a conv's ``[N*H*W, C]`` output viewed as NHWC, read by
    the concat alone) are written by the kernel into the buffer: no copy of them."""
    x = relax.Var("x", _tensor(1, 2, 3, 4))
    new = relax.TensorType((6, 4), F32)

    def grow(bb, c, kernel):
        rows = bb.emit(relax.op.reshape(relax.op.strided_slice(c, [3], [0], [4]), (6, 4)))
        return bb.emit(relax.op.reshape(bb.emit(relax.call_tir(kernel, [rows], new)),
                                        (1, 2, 3, 4)))

    bb = relax.BlockBuilder()
    kernel = bb.add_func(_scaled_rows_ir(6, 4), "scaled")
    with bb.function("main", [x]):
        with bb.dataflow():
            c1 = bb.emit(relax.op.concat([x, grow(bb, x, kernel)], axis=3))
            c2 = bb.emit_output(relax.op.concat([c1, grow(bb, c1, kernel)], axis=3))
        bb.emit_func_output(c2)
    before = bb.get()
    after = write_concat_chains(before)
    names = sorted(gv.name_hint for gv in after.functions)
    assert names == ["concat_copy", "main", "scaled_sliced", "scaled_sliced1"], names
    xs = np.random.default_rng(3).standard_normal((1, 2, 3, 4)).astype(F32)
    np.testing.assert_array_equal(run_main(after, xs), run_main(before, xs))


def test_kernel_bound_before_the_buffer_is_copied():
    """New channels computed before the concat they extend is bound (from the chain's input):
    the buffer does not exist yet where the kernel runs, so its output is copied as before."""
    x = relax.Var("x", _tensor(1, 2, 3, 4))
    bb = relax.BlockBuilder()
    kernel = bb.add_func(_scaled_rows_ir(6, 4), "scaled")
    with bb.function("main", [x]):
        with bb.dataflow():
            rows = bb.emit(relax.op.reshape(x, (6, 4)))
            early = bb.emit(relax.op.reshape(bb.emit(relax.call_tir(
                kernel, [rows], relax.TensorType((6, 4), F32))), (1, 2, 3, 4)))
            c1 = bb.emit(relax.op.concat([x, bb.emit(relax.op.nn.relu(x))], axis=3))
            c2 = bb.emit_output(relax.op.concat([c1, early], axis=3))
        bb.emit_func_output(c2)
    before = bb.get()
    after = write_concat_chains(before)
    names = sorted(gv.name_hint for gv in after.functions)
    assert names == ["concat_copy", "concat_slice_copy", "concat_slice_copy1", "main",
                     "scaled"], names
    xs = np.random.default_rng(4).standard_normal((1, 2, 3, 4)).astype(F32)
    np.testing.assert_array_equal(run_main(after, xs), run_main(before, xs))


def _single(bb, x):  # one concat: nothing to gain
    return relax.op.concat([x, relax.op.nn.relu(x)], axis=3)


def _fork(bb, x):  # c1 is the first input of two concats: both would write channels 4-7
    c1 = bb.emit(relax.op.concat([x, relax.op.nn.relu(x)], axis=3))
    a = bb.emit(relax.op.concat([c1, relax.op.nn.relu(c1)], axis=3))
    b = bb.emit(relax.op.concat([c1, relax.op.sigmoid(c1)], axis=3))
    return relax.op.add(a, b)


def _other_axis(bb, x):  # concats along H, not channels
    c1 = bb.emit(relax.op.concat([x, relax.op.nn.relu(x)], axis=1))
    return relax.op.concat([c1, relax.op.nn.relu(c1)], axis=1)


def _three_inputs(bb, x):  # Inception's: not a chain of two-input concats
    c1 = bb.emit(relax.op.concat([x, x, relax.op.nn.relu(x)], axis=3))
    return relax.op.concat([c1, x, relax.op.nn.relu(x)], axis=3)


@pytest.mark.parametrize("emit", [_single, _fork, _other_axis, _three_inputs],
                         ids=["single", "fork", "other-axis", "three-inputs"])
def test_not_chains_kept(emit):
    x = relax.Var("x", _tensor(1, 3, 3, 4))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(emit(bb, x))
        bb.emit_func_output(y)
    mod = bb.get()
    tvm.ir.assert_structural_equal(write_concat_chains(mod), mod)


def _dense_block(layers: int = 3, growth: int = 5, channels: int = 6, hw: int = 9):
    """BN-ReLU-conv3x3 layers whose outputs are concatenated to their inputs (DenseNet)."""
    rng = np.random.default_rng(2)
    # A stem conv first: the chain then starts from a kernel's NHWC output, as in DenseNet.
    inits = [numpy_helper.from_array((rng.standard_normal((channels, 3, 3, 3)) * 0.3).astype(F32),
                                     "stem_w")]
    nodes = [helper.make_node("Conv", ["x", "stem_w"], ["stem"], pads=[1, 1, 1, 1])]
    c, x = channels, "stem"
    for i in range(layers):
        for name, shape in (("scale", (c,)), ("bias", (c,)), ("mean", (c,)), ("var", (c,))):
            value = rng.uniform(0.5, 1.5, shape) if name in ("scale", "var") else (
                rng.standard_normal(shape))
            inits.append(numpy_helper.from_array(value.astype(F32), f"{name}{i}"))
        inits.append(numpy_helper.from_array(
            (rng.standard_normal((growth, c, 3, 3)) * 0.2).astype(F32), f"w{i}"))
        nodes += [
            helper.make_node("BatchNormalization", [x, f"scale{i}", f"bias{i}", f"mean{i}",
                                                    f"var{i}"], [f"bn{i}"]),
            helper.make_node("Relu", [f"bn{i}"], [f"relu{i}"]),
            helper.make_node("Conv", [f"relu{i}", f"w{i}"], [f"new{i}"], pads=[1, 1, 1, 1]),
            helper.make_node("Concat", [x, f"new{i}"], [f"cat{i}"], axis=1),
        ]
        x, c = f"cat{i}", c + growth
    graph = helper.make_graph(
        nodes, "dense_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, hw, hw])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, c, hw, hw])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_dense_block_against_onnxruntime():
    model = _dense_block()
    names = [gv.name_hint for gv in compiler.lower(model).functions]
    assert sum(n.startswith("concat_slice_copy") for n in names) >= 2, names
    x = np.random.default_rng(3).standard_normal((1, 3, 9, 9)).astype(F32)
    got = compiler.compile(model, "tpp", untuned=True).run(x=x)
    errors = max_errors(got, run_onnxruntime(model, {"x": x}))
    assert max(errors) < 1e-5, errors
