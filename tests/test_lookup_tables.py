"""Elementwise chains between 8-bit tensors as lookup tables (relay_passes.lookup_tables).

The rewrite against its expected IR (``tvm.ir.assert_structural_equal``), the chains it must
leave alone, each table against the chain evaluated in numpy by hand, and QDQ graphs built with
onnx.helper (DenseNet's quantized pre-activation, BERT's erf GELU and GPT-2's tanh GELU with
its cube, each reading the input twice, a signed source) compiled for the tpp target and
compared with ONNX Runtime running them unfused.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm
from conftest import relax_main, run_main
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import tvm_tpp
from microkernels.machine import machine_of
from relay_passes.lookup_tables import chain_table, lookup_kernel, lookup_tables
from relay_passes.pipeline import tpp_rewrites
from relay_passes.scaffold import add_kernel
from tvm_tpp.compiler import import_model
from tvm_tpp.reference import run_onnxruntime

RNG = np.random.default_rng(7)
SHAPE = (2, 5, 7, 13)  # odd sizes, NHWC: 13 channels
SCALE = RNG.uniform(0.5, 1.5, 13).astype("float32")
SHIFT = RNG.uniform(-0.5, 0.5, 13).astype("float32")


def _main(shape, body, dtype="uint8") -> tvm.IRModule:
    return relax_main([relax.Var("x", relax.TensorType(shape, dtype))], body)


def _pre_activation(bb, x, scale=SCALE, shift=SHIFT):
    """DenseNet's quantized batch norm: dequantize, scale, shift, requantize (zero point 0:
    the ReLU the quantizer folded), per channel on the last axis."""
    v = bb.emit(relax.op.dequantize(x, relax.const(0.05), relax.const(3, "uint8")))
    v = bb.emit(relax.op.multiply(v, relax.const(scale)))
    v = bb.emit(relax.op.add(v, relax.const(shift)))
    q = bb.emit(relax.op.quantize(v, relax.const(0.04), relax.const(0, "uint8"),
                                  out_dtype="uint8"))
    v = bb.emit(relax.op.dequantize(q, relax.const(0.04), relax.const(0, "uint8")))
    v = bb.emit(relax.op.nn.relu(bb.emit(relax.op.subtract(v, relax.const(np.float32(0.1))))))
    return relax.op.quantize(v, relax.const(0.03), relax.const(0, "uint8"), out_dtype="uint8")


def _by_hand(x: np.ndarray) -> np.ndarray:
    """:func:`_pre_activation` in numpy, float32 one operator at a time."""
    f32 = np.float32
    v = (x.astype("int32") - 3).astype("float32") * f32(0.05)
    v = v * SCALE + SHIFT
    q = np.clip(np.rint(v / f32(0.04)), 0, 255)
    v = np.maximum(q.astype("float32") * f32(0.04) - f32(0.1), f32(0))
    return np.clip(np.rint(v / f32(0.03)), 0, 255).astype("uint8")


def test_chain_becomes_one_lookup():
    before = _main(SHAPE, _pre_activation)
    func = before["main"]
    _, table, axis = chain_table(func.body.blocks[0].bindings[-1].value,
                                 relax.analysis.get_var2val(func))
    assert axis == 3 and table.shape == (13, 256)

    def expected(bb, x):
        gv = add_kernel(bb, lookup_kernel(SHAPE, "uint8", 13, 3, "uint8"),
                        "tpp_lookup_uint8_2x5x7x13_uint8")
        return relax.call_tir(gv, [x, relax.const(table)], relax.TensorType(SHAPE, "uint8"))

    tvm.ir.assert_structural_equal(lookup_tables(before), _main(SHAPE, expected))


def test_table_is_the_chain_on_every_value():
    func = _main(SHAPE, _pre_activation)["main"]
    _, table, _ = chain_table(func.body.blocks[0].bindings[-1].value,
                              relax.analysis.get_var2val(func))
    values = np.broadcast_to(np.arange(256, dtype="uint8"), (13, 256)).T  # [x, channel]
    np.testing.assert_array_equal(table, _by_hand(values).T)


def test_lookup_runs_like_the_chain_in_numpy():
    x = RNG.integers(0, 256, SHAPE).astype("uint8")
    got = run_main(lookup_tables(_main(SHAPE, _pre_activation)), x, target=tvm_tpp.target("tpp"))
    np.testing.assert_array_equal(got, _by_hand(x))


def _two_axes(bb, x):
    v = bb.emit(relax.op.dequantize(x, relax.const(0.05), relax.const(3, "uint8")))
    v = bb.emit(relax.op.multiply(v, relax.const(np.ones((7, 13), "float32"))))
    return relax.op.quantize(v, relax.const(0.04), relax.const(0, "uint8"), out_dtype="uint8")


def _two_sources(bb, x):
    a = bb.emit(relax.op.dequantize(x, relax.const(0.05), relax.const(3, "uint8")))
    b = bb.emit(relax.op.dequantize(bb.emit(relax.op.flip(x, axis=1)), relax.const(0.05),
                                    relax.const(3, "uint8")))
    return relax.op.quantize(bb.emit(relax.op.add(a, b)), relax.const(0.04),
                             relax.const(0, "uint8"), out_dtype="uint8")


def _broadcast_up(bb, x):  # the constant makes the [1, 13] source [4, 13]
    v = bb.emit(relax.op.dequantize(x, relax.const(0.05), relax.const(3, "uint8")))
    v = bb.emit(relax.op.add(v, relax.const(np.zeros((4, 1), "float32"))))
    return relax.op.quantize(v, relax.const(0.04), relax.const(0, "uint8"), out_dtype="uint8")


def _float_out(bb, x):
    v = bb.emit(relax.op.dequantize(x, relax.const(0.05), relax.const(3, "uint8")))
    return relax.op.multiply(v, relax.const(np.float32(2)))


def _power_of_negatives(bb, x):  # (-0.15)^0.5: no value to quantize
    v = bb.emit(relax.op.dequantize(x, relax.const(0.05), relax.const(3, "uint8")))
    v = bb.emit(relax.op.power(v, relax.const(np.float32(0.5))))
    return relax.op.quantize(v, relax.const(0.04), relax.const(0, "uint8"), out_dtype="uint8")


def _not_elementwise(bb, x):
    v = bb.emit(relax.op.dequantize(x, relax.const(0.05), relax.const(3, "uint8")))
    v = bb.emit(relax.op.nn.softmax(v, axis=-1))
    return relax.op.quantize(v, relax.const(0.01), relax.const(0, "uint8"), out_dtype="uint8")


@pytest.mark.parametrize("body,shape", [(_two_axes, SHAPE), (_two_sources, SHAPE),
                                        (_broadcast_up, (1, 13)), (_float_out, SHAPE),
                                        (_power_of_negatives, SHAPE), (_not_elementwise, SHAPE)],
                         ids=["constant on two axes", "two sources", "broadcast to more",
                              "float output", "square root of negatives", "softmax"])
def test_other_chains_are_left_alone(body, shape):
    before = _main(shape, body)
    tvm.ir.assert_structural_equal(lookup_tables(before), before)


def _qdq_model(kind: str):
    """x -> Q -> DQ -> chain -> Q -> DQ -> y with onnx.helper; every float operator of the
    chain between its own QuantizeLinear/DequantizeLinear pair, as ONNX Runtime's quantizer
    writes it."""
    nodes, inits = [], []
    signed = kind == "signed"
    q_type = "int8" if signed else "uint8"

    def const(name, value, dtype="float32"):
        inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def qdq(x, tag, scale, zero):
        s, z = const(f"s_{tag}", scale), const(f"z_{tag}", zero, q_type)
        nodes.append(helper.make_node("QuantizeLinear", [x, s, z], [f"q_{tag}"]))
        nodes.append(helper.make_node("DequantizeLinear", [f"q_{tag}", s, z], [f"dq_{tag}"]))
        return f"dq_{tag}"

    def op(name, inputs, tag, **attrs):
        nodes.append(helper.make_node(name, inputs, [tag], **attrs))
        return tag

    shape = [1, 6, 9, 11]  # NCHW: per-channel constants on axis 1
    t = qdq("x", "in", 0.03, -5 if signed else 120)
    if kind == "gelu":
        h = op("Div", [t, const("sqrt2", math.sqrt(2))], "h")
        e = qdq(op("Erf", [qdq(h, "h", 0.02, 128)], "e"), "e", 0.008, 128)
        p = qdq(op("Add", [e, const("one", 1.0)], "p"), "p", 0.008, 0)
        y = op("Mul", [op("Mul", [t, p], "tp"), const("half", 0.5)], "y0")
    elif kind == "tanh-gelu":  # GPT-2's: x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        cube = qdq(op("Pow", [t, const("three", 3.0)], "cube"), "cube", 0.4, 128)
        m = qdq(op("Mul", [cube, const("c", 0.044715)], "m"), "m", 0.02, 128)
        i = qdq(op("Add", [t, m], "i"), "i", 0.03, 128)
        k = qdq(op("Mul", [i, const("rt2pi", math.sqrt(2 / math.pi))], "k"), "k", 0.03, 128)
        p = qdq(op("Add", [qdq(op("Tanh", [k], "th"), "th", 0.008, 128), const("one", 1.0)],
                   "p"), "p", 0.008, 0)
        y = op("Mul", [op("Mul", [t, p], "tp"), const("half", 0.5)], "y0")
    else:
        c = (6, 1, 1)
        s = op("Mul", [t, const("scale", RNG.uniform(0.5, 1.5, c))], "s")
        a = op("Add", [qdq(s, "s", 0.04, 0 if not signed else -20),
                       const("shift", RNG.uniform(-0.3, 0.3, c))], "a")
        y = op("Relu", [qdq(a, "a", 0.035, 0 if not signed else -100)], "y0")
    out = qdq(y, "out", 0.02, 0 if not signed else -128)
    graph = helper.make_graph(
        nodes, f"qdq_{kind}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("kind", ["pre-activation", "gelu", "tanh-gelu", "signed"])
def test_qdq_graph_equals_onnxruntime(kind):
    model = _qdq_model(kind)
    target = tvm_tpp.target("tpp")
    with target:
        rewritten = tpp_rewrites(target)(import_model(model)[0])
    lookups = [gv.name_hint for gv in rewritten.functions if "lookup" in gv.name_hint]
    assert len(lookups) == 1, lookups  # the whole chain, input to output quantization ...
    ops = {b.value.op.name for block in rewritten["main"].body.blocks for b in block.bindings
           if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)}
    assert ops == {"relax.quantize", "relax.call_tir", "relax.dequantize"}, ops  # ... alone
    compiled = tvm_tpp.compile(model, "tpp")
    x = RNG.standard_normal((1, 6, 9, 11)).astype("float32") * 2
    (got,) = compiled.run(x=x)
    (want,) = run_onnxruntime(model, {"x": x}, optimize=False)  # ONNX's roundings
    # Equal but for a float32 tie rounded the other way (erf's last bit): one step at most.
    np.testing.assert_allclose(got, want, rtol=0, atol=0.02 * 1.0001)
    assert np.mean(got == want) > 0.99


@pytest.mark.parametrize("shape,axis,source", [((2, 5, 7, 300), 3, "uint8"),
                                               ((1, 3, 67, 130), 3, "int8"),
                                               ((3, 9, 4, 5), 1, "uint8")],
                         ids=["300 channels", "130 int8 channels", "channels not last"])
def test_lookup_in_channel_blocks_matches_numpy(shape, axis, source):
    """Tables of 300 and 130 channels read 16 channels (4 KiB) at a time, over pixel counts
    no tile divides; a table on another axis keeps the plain loop."""
    rows = shape[axis]
    low = np.iinfo(source).min
    x = RNG.integers(low, low + 256, shape).astype(source)
    table = RNG.integers(0, 256, (rows, 256)).astype("uint8")
    channel = np.arange(rows).reshape([rows if a == axis else 1 for a in range(len(shape))])
    kernel = lookup_kernel(shape, source, rows, axis, "uint8", cache_bytes=4 << 10)
    assert ("T.grid" in kernel.script()) == (axis == len(shape) - 1)  # blocked or plain
    lib = tvm.compile(tvm.IRModule({"main": kernel}), target=tvm_tpp.target("tpp"))
    y = tvm.runtime.empty(shape, "uint8", tvm.cpu())
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(table), y)
    np.testing.assert_array_equal(y.numpy(), table[channel, x.astype("int32") - low])


def test_pipeline_reads_tables_in_blocks_of_half_l1():
    """A 512-channel table (128 KiB) is read in blocks that fit half of the host's L1d."""
    shape = (1, 3, 5, 512)
    scale, shift = RNG.uniform(0.5, 1.5, 512), RNG.uniform(-0.5, 0.5, 512)
    before = _main(shape, lambda bb, x: _pre_activation(bb, x, scale.astype("float32"),
                                                         shift.astype("float32")))
    target = tvm_tpp.target("tpp")
    mod = tpp_rewrites(target)(before)
    (kernel,) = [f for gv, f in mod.functions.items() if "lookup" in gv.name_hint]
    half = machine_of(target).caches.l1d // 2
    expected = lookup_kernel(shape, "uint8", 512, 3, "uint8", cache_bytes=half)
    # The pipeline adds its attributes (op pattern, scheduled) to the kernel.
    tvm.ir.assert_structural_equal(kernel, expected.with_attrs(kernel.attrs).without_attr(
        "global_symbol"))
    assert "T.grid" in expected.script()
