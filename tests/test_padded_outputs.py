"""Kernels writing their output into the padded buffer the next conv reads
(relay_passes.padded_outputs).

The PrimFunc rewrite as a Before/Expected pair and numerically on scheduled conv kernels of
odd sizes against numpy (borders prefilled with NaN, so an unwritten one shows), the kernels
it refuses, the Relax rewrite as Before/Expected and through the VM, the graphs it must leave
alone, and networks built with the ``tpp`` target against ONNX Runtime, float32 and int8.
"""

import functools

import ml_dtypes
import numpy as np
import onnx
import pytest
import tvm
import tvm_ffi
from conftest import INT8_KERNELS, main_calls, pixel_rows
from test_qdq_conv import _qdq_reference, _quantized_residual_block
from tvm import relax
from tvm.script import tirx as T

import tvm_tpp
from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.epilogue import reference as epilogue_reference
from microkernels.machine import host
from relay_passes.padded_outputs import padded_output, reading_padded, write_padded_outputs
from relay_passes.pipeline import tpp_rewrites
from relay_passes.scaffold import is_call_to
from schedules.conv import ConvProblem, default_config, pack_input, pack_weight, reference, schedule
from tvm_tpp import compiler, models
from tvm_tpp.reference import max_errors, run_onnxruntime
from tvm_tpp.tpp_target import target as tpp_target

LLVM = tvm.target.Target({"kind": "llvm"})
F32 = "float32"


# TVMScript parsed when a test asks: parsed at import, each function costs ~0.3 s per worker.
@functools.cache
def _relu_ir():
    @T.prim_func(private=True, s_tir=True)
    def relu(x: T.Buffer((6, 8), F32), y: T.Buffer((6, 8), F32)):
        for i, j in T.grid(6, 8):
            with T.sblock("epilogue"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = T.max(x[vi, vj], T.float32(0))
    return relu


# relu's output as 2 images of 1x3 pixels, one row above them and two columns to the right.
@functools.cache
def _relu_padded_ir():
    @T.prim_func(private=True, s_tir=True)
    def relu_padded(x: T.Buffer((6, 8), F32), padded: T.Buffer((20, 8), F32)):
        padded_bits = T.decl_buffer((20, 8), "uint32", data=padded.data)
        for row in range(4):  # a small border: one thread fills it
            image, y = row // 2, row % 2
            base: T.int32 = (image * 2 + y) * 5
            if y < 1 or y >= 2:
                for x_1, v in T.grid(5, 1):
                    for j in T.vectorized(8):
                        padded_bits[base + x_1, v * 8 + j] = T.uint32(0)
            else:
                for x_1, v in T.grid(2, 1):
                    for j in T.vectorized(8):
                        padded_bits[base + 3 + x_1, v * 8 + j] = T.uint32(0)
        for i, j in T.grid(6, 8):
            with T.sblock("epilogue"):
                vi, vj = T.axis.remap("SS", [i, j])
                T.reads(x[vi, vj])
                T.writes(padded[(vi // 3 * 2 + vi % 3 // 3 + 1) * 5 + vi % 3 % 3, vj])
                padded[(vi // 3 * 2 + vi % 3 // 3 + 1) * 5 + vi % 3 % 3, vj] = T.max(
                    x[vi, vj], T.float32(0))
    return relu_padded


def _copy(dtype: str) -> tvm.tirx.PrimFunc:
    @T.prim_func(s_tir=True)
    def copy(x: T.Buffer((35, 4), dtype), y: T.Buffer((35, 4), dtype)):
        for i, j in T.grid(35, 4):
            with T.sblock("epilogue"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj]

    return copy


def test_padded_output_function():
    tvm.ir.assert_structural_equal(padded_output(_relu_ir(), (2, 1, 3), (1, 0, 0, 2), 0.0),
                                   _relu_padded_ir())


@pytest.mark.parametrize(("images", "parallel"), [((8, 48, 48), True), ((1, 48, 48), False)],
                         ids=["batch-8", "batch-1"])
def test_large_borders_filled_in_parallel(images, parallel):
    """A 96-channel 48x48 map's border: 600 KiB at batch 8, filled a row per task by all
    threads; 75 KiB at batch 1, by one (a fork and join cost more than they share)."""
    n, h, w = images

    @T.prim_func(s_tir=True)
    def relu(x: T.Buffer((n * h * w, 96), F32), y: T.Buffer((n * h * w, 96), F32)):
        for i, j in T.grid(n * h * w, 96):
            with T.sblock("epilogue"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = T.max(x[vi, vj], T.float32(0))

    padded = padded_output(relu, images, (1, 1, 1, 1), 0.0)
    kinds = []
    tvm_ffi.structural_walk(padded.body, (tvm.tirx.For, lambda s: kinds.append(s.kind)))
    assert (tvm.tirx.ForKind.PARALLEL in kinds) == parallel
    x = np.random.default_rng(3).standard_normal((n * h * w, 96)).astype(F32)
    out = tvm.runtime.empty((n * (h + 2) * (w + 2), 96), F32)
    tvm.compile(padded, target=tvm.target.Target({"kind": "llvm"}))(tvm.runtime.tensor(x), out)
    np.testing.assert_array_equal(out.numpy(), _padded(np.maximum(x, 0), images, (1, 1, 1, 1), 0))


def _padded(y: np.ndarray, images: tuple[int, int, int], padding, value) -> np.ndarray:
    """numpy: ``[N*H*W, C]`` -> the ``[N*Hp*Wp, C]`` rows of its padded NHWC image."""
    top, bottom, left, right = padding
    nhwc = y.reshape(*images, y.shape[-1])
    out = np.pad(nhwc, [(0, 0), (top, bottom), (left, right), (0, 0)], constant_values=value)
    return out.reshape(-1, y.shape[-1])


def _run_padded(func, args: list[np.ndarray], rows: int, channels: int) -> np.ndarray:
    out = tvm.runtime.tensor(np.full((rows, channels), np.nan, F32))
    tvm.compile(func, target=tpp_target("tpp"))(*[tvm.runtime.tensor(a) for a in args], out)
    return out.numpy()


@pytest.mark.parametrize("c, h, w, k, r, stride, images, padding", [
    (13, 5, 7, 24, 1, 1, 1, (1, 1, 1, 1)),
    (13, 5, 7, 24, 1, 1, 2, (0, 1, 2, 3)),
    (8, 9, 6, 20, 3, 1, 1, (1, 1, 1, 2)),   # a 3x3 conv (the stride-2 consumer's extra column)
    (16, 11, 11, 16, 3, 2, 2, (3, 0, 0, 1)),
], ids=["1x1", "1x1-two-images-asymmetric", "3x3", "3x3-stride2"])
def test_padded_conv_kernels_match_numpy(c, h, w, k, r, stride, images, padding):
    """A scheduled conv kernel with its bias + ReLU epilogue, writing into the padded buffer:
    the interior is the conv, the border the pad value (all of it written)."""
    epilogue = Epilogue((EpilogueOp("bias"), EpilogueOp("relu")))
    problem = ConvProblem(images, c, h, w, k, r, r, stride=stride, padding=r // 2,
                          epilogue=epilogue)
    config = default_config(problem, host())
    func = schedule(problem, config, host().isa.name).mod["main"]
    dims = (problem.n, problem.p, problem.q)
    padded = padded_output(func, dims, padding, 0.0)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((images, c, h, w)).astype(F32)
    weight = rng.standard_normal((k, c, r, r)).astype(F32)
    bias = rng.standard_normal(k).astype(F32)
    conv = pixel_rows(reference(problem, x, weight))
    want = _padded(epilogue_reference(epilogue, conv.astype(F32), {"bias": bias}), dims,
                   padding, 0.0)
    got = _run_padded(padded, [pack_input(x, problem), pack_weight(weight, config.bk, problem),
                               bias], want.shape[0], k)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype, pad_value", [("uint8", 128), ("bfloat16", -1.5)])
def test_border_takes_the_pad_value(dtype, pad_value):
    """A uint8 output padded with a zero point (what a quantized conv's consumer reads), and
    a bfloat16 one (a bf16 conv's)."""
    dims, padding = (1, 5, 7), (2, 1, 1, 0)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    x = np.random.default_rng(1).integers(0, 200, (35, 4)).astype(np_dtype)
    want = _padded(x, dims, padding, pad_value)
    out = tvm.runtime.empty(want.shape, dtype)
    out.copyfrom(np.full(want.shape, 99, np_dtype))
    tvm.compile(padded_output(_copy(dtype), dims, padding, pad_value),
                target=tpp_target("tpp"))(tvm.runtime.tensor(x), out)
    np.testing.assert_array_equal(out.numpy(), want)


def test_kernels_writing_tiles_refused():
    """Without an epilogue the BRGEMM matches its output as a tile of rows, which may cross
    a padded row's border: no padded form."""
    problem = ConvProblem(1, 8, 6, 6, 16, 3, 3, padding=1)
    func = schedule(problem, default_config(problem, host()), host().isa.name).mod["main"]
    assert padded_output(func, (1, 6, 6), (1, 1, 1, 1), 0.0) is None


# ---------------------------------------------------------------------------------------------
# The Relax rewrite
# ---------------------------------------------------------------------------------------------


def _module(emit) -> tvm.IRModule:
    """main(x: [6, 8]) with one dataflow block whose outputs ``emit(bb, relu_gv, x)`` gives."""
    bb = relax.BlockBuilder()
    kernel = bb.add_func(_relu_ir(), "relu")
    x = relax.Var("x", relax.TensorType((6, 8), F32))
    with bb.function("main", [x]):
        with bb.dataflow():
            outs = [bb.emit_output(v) for v in emit(bb, kernel, x)]
        bb.emit_func_output(outs[0] if len(outs) == 1 else relax.Tuple(outs))
    return bb.get()


def _relu_nhwc(bb, kernel, x):
    y = bb.emit(relax.call_tir(kernel, [x], relax.TensorType((6, 8), F32)))
    return bb.emit(relax.op.reshape(y, (2, 1, 3, 8)))


PAD = [0, 0, 1, 0, 0, 2, 0, 0]


def test_pad_written_by_the_kernel():
    def before(bb, kernel, x):
        return [relax.op.nn.pad(_relu_nhwc(bb, kernel, x), PAD)]

    def expected(bb, kernel, x):
        padded = bb.add_func(_relu_padded_ir().with_attrs(
            {"op_pattern": 8, "tirx.is_scheduled": True}), "relu_padded")
        y = bb.emit(relax.call_tir(padded, [x], relax.TensorType((20, 8), F32)))
        return [relax.op.reshape(y, (2, 2, 5, 8))]

    mod = _module(before)
    after = write_padded_outputs(mod)
    dce = relax.transform.DeadCodeElimination(["main"])
    tvm.ir.assert_structural_equal(dce(after), dce(_module(expected)))
    x = np.random.default_rng(0).standard_normal((6, 8)).astype(F32)
    reference_ = np.pad(np.maximum(x, 0).reshape(2, 1, 3, 8), [(0, 0), (1, 0), (0, 2), (0, 0)])
    for built in (mod, after):
        ex = tvm.compile(built, LLVM)
        got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
        np.testing.assert_array_equal(got, reference_)


@functools.cache
def _add_ir():
    @T.prim_func(private=True, s_tir=True)
    def add(x: T.Buffer((6, 8), F32), r: T.Buffer((6, 8), F32), y: T.Buffer((6, 8), F32)):
        for i, j in T.grid(6, 8):
            with T.sblock("epilogue"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] + r[vi, vj]
    return add


def test_a_kernel_reading_the_unpadded_output_reads_the_padded_one():
    """The pad's producer is read by another kernel too (a conv's residual): the producer
    writes the padded buffer, the reader reads its interior, and no copy is left."""
    def before(bb, kernel, x):
        add = bb.add_func(_add_ir(), "add")
        y = bb.emit(relax.call_tir(kernel, [x], relax.TensorType((6, 8), F32)))
        padded = relax.op.nn.pad(bb.emit(relax.op.reshape(y, (2, 1, 3, 8))), PAD)
        return [padded, relax.call_tir(add, [x, y], relax.TensorType((6, 8), F32))]

    bb = relax.BlockBuilder()
    attrs = {"op_pattern": 8, "tirx.is_scheduled": True}
    writes = bb.add_func(_relu_padded_ir().with_attrs(attrs), "relu_padded")
    reads = bb.add_func(reading_padded(_add_ir(), 1, (2, 1, 3), (1, 0, 0, 2))
                        .with_attrs(attrs), "add_from_padded")
    x = relax.Var("x", relax.TensorType((6, 8), F32))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.call_tir(writes, [x], relax.TensorType((20, 8), F32)))
            padded = bb.emit_output(relax.op.reshape(y, (2, 2, 5, 8)))
            flat = bb.emit(relax.op.reshape(padded, (20, 8)))
            added = bb.emit_output(relax.call_tir(reads, [x, flat],
                                                  relax.TensorType((6, 8), F32)))
        bb.emit_func_output(relax.Tuple([padded, added]))

    mod = _module(before)
    after = write_padded_outputs(mod)
    dce = relax.transform.DeadCodeElimination(["main"])
    tvm.ir.assert_structural_equal(dce(after), dce(bb.get()))
    assert not [e for e in main_calls(after) if is_call_to(e, "relax.nn.pad")]
    x = np.random.default_rng(1).standard_normal((6, 8)).astype(F32)
    relu = np.maximum(x, 0)
    want = [np.pad(relu.reshape(2, 1, 3, 8), [(0, 0), (1, 0), (0, 2), (0, 0)]), x + relu]
    for built in (mod, after):
        ex = tvm.compile(built, LLVM)
        got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g.numpy(), w)


def _read_twice(bb, kernel, x):  # the kernel's output is read by the pad and by a relu
    view = _relu_nhwc(bb, kernel, x)
    return [relax.op.nn.pad(view, PAD), relax.op.nn.relu(view)]


def _channels_padded(bb, kernel, x):  # a pad of C (VNNI groups) is not the border
    return [relax.op.nn.pad(_relu_nhwc(bb, kernel, x), [0, 0, 1, 0, 0, 0, 0, 4])]


def _view_returned(bb, kernel, x):  # the unpadded view is an output of the function
    view = bb.emit_output(_relu_nhwc(bb, kernel, x))
    return [relax.op.nn.pad(view, PAD), view]


@pytest.mark.parametrize("emit", [_read_twice, _channels_padded, _view_returned],
                         ids=["read-twice", "channels", "view-returned"])
def test_other_pads_kept(emit):
    mod = _module(emit)
    tvm.ir.assert_structural_equal(write_padded_outputs(mod), mod)


# ---------------------------------------------------------------------------------------------
# Networks
# ---------------------------------------------------------------------------------------------


def _kernels_and_pads(model: onnx.ModelProto, spec: str = "tpp"
                      ) -> tuple[list[str], list[relax.Call]]:
    """The kernels ``tpp_rewrites`` for the target ``spec`` calls in ``model`` and the pads
    of kernel outputs left (outputs that something else reads too, such as a residual add)."""
    mod, _ = compiler.import_model(model)
    target = tpp_target(spec)
    with target:
        mod = tpp_rewrites(target)(mod)
    bound = relax.analysis.get_var2val(mod["main"])
    kernels, pads = [], []

    def visit(expr):
        if is_call_to(expr, "relax.call_tir"):
            kernels.append(expr.args[0].name_hint)
        elif is_call_to(expr, "relax.nn.pad"):
            source = bound.get(expr.args[0])
            source = bound.get(source.args[0]) if is_call_to(source, "relax.reshape") else None
            if is_call_to(source, "relax.call_tir"):
                pads.append(expr)

    relax.analysis.post_order_visit(mod["main"], visit)
    return kernels, pads


@pytest.mark.slow  # 8 s; the int8 block below checks the pass through a network by default
def test_resnet_convs_write_their_padded_outputs():
    """The first conv of each of the three residual blocks writes the padded tensor the
    second one reads; so does the stem, whose output the first block's identity shortcut
    reads from the padded buffer; the other blocks' inputs, read by a strided 1x1 shortcut
    conv too (tiles, no element reads), are padded by a copy."""
    model = models.load("resnet_small")
    kernels, pads = _kernels_and_pads(model)
    writers = [name for name in kernels if name.endswith("_padded") and "_from_" not in name]
    assert len(writers) == 4 and len(pads) == 2, kernels
    assert [name for name in kernels if name.endswith("_from_padded")] == [
        "tpp_conv2d_1x32x32x32_32x3x3_s1x1_bias_residual_relu_from_padded"]
    feeds = models.random_inputs(model, seed=3)
    got = compiler.compile(model, "tpp", untuned=True).run(**feeds)
    errors = max_errors(got, run_onnxruntime(model, feeds))
    assert max(errors) < 1e-5, errors


def test_quantized_conv_writes_its_zero_point_border(tmp_path):
    """int8: the first conv writes uint8 with its consumer's zero point around it."""
    model, layer = _quantized_residual_block(tmp_path)
    kernels, pads = _kernels_and_pads(model, INT8_KERNELS)
    assert not pads and sum(name.endswith("_u8s8_padded") for name in kernels) == 1, kernels
    x = layer.inputs(0)
    got = tvm_tpp.compile(model, target=INT8_KERNELS).run(x=x)[0]
    assert max_errors([got], _qdq_reference(model, {"x": x}))[1] <= 1e-2
