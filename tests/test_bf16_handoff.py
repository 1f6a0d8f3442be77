"""bf16 layers hand bf16 to bf16 layers: the producer's epilogue converts (relay_passes.conv,
relay_passes.dense, relay_passes.batch_matmul: attention's P @ V for the output projection).

A bf16 conv whose every reader is a conv routed in bf16 (as its input, or as the residual its
epilogue adds: a ResNet's stream; also through reshapes and permutes: ShuffleNet's channel
shuffle; and through a channel concat: a DeepLab head's branches) writes bfloat16 itself,
read through a float32 view that ``simplify_layouts`` cancels against the reader's own cast;
a conv read by anything else (an add of no conv, the graph's output) keeps float32.  Checked
on the rewritten IR, on the layout rule alone (Before/Expected), and numerically against ONNX
Runtime float32.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from conftest import main_calls
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import tvm_tpp
from relay_passes.layouts import simplify_layouts
from relay_passes.pipeline import tpp_rewrites
from relay_passes.scaffold import is_call_to
from tvm_tpp.compiler import import_model
from tvm_tpp.reference import TOLERANCES, max_errors, run_onnxruntime
from tvm_tpp.tpp_target import target as tpp_target


def _weights(seed: int, scale: float, shapes: dict[str, tuple[int, ...]]) -> list:
    """Random float32 initializers of ``shapes``, N(0, ``scale``)."""
    rng = np.random.default_rng(seed)
    return [numpy_helper.from_array((rng.standard_normal(shape) * scale).astype("float32"),
                                    name) for name, shape in shapes.items()]


def _model(name: str, nodes: list, inits: list, x_shape: list[int],
           outputs: dict[str, list[int]]):
    """An opset-17 model of ``nodes`` from the float32 input ``x`` to ``outputs``."""
    graph = helper.make_graph(
        nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, shape)
         for out, shape in outputs.items()], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _convs(extra_reader: bool, residual: bool = False):
    """x -> conv1 -> relu -> conv2 -> y, and with ``extra_reader`` also y2 = relu1 + x; with
    ``residual``, y = relu(conv2 + x) (ResNet's 3x3 conv -> 1x1 conv with the shortcut)."""
    inits = _weights(0, 0.2, {f"w{i}": (8, 8, 3, 3) for i in (1, 2)})
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1] * 4),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2" if residual else "y"], pads=[1] * 4)]
    if residual:
        nodes += [helper.make_node("Add", ["c2", "x"], ["s"]),
                  helper.make_node("Relu", ["s"], ["y"])]
    outputs = {"y": [1, 8, 9, 9]}
    if extra_reader:
        nodes.append(helper.make_node("Add", ["r1", "x"], ["y2"]))
        outputs["y2"] = [1, 8, 9, 9]
    return _model("convs", nodes, inits, [1, 8, 9, 9], outputs)


def _calls(model) -> list[relax.Call]:
    """The calls of the model's main function after the bf16 rewrites, in graph order."""
    mod, _ = import_model(model)
    return main_calls(tpp_rewrites(tpp_target("tpp"), precision="bf16")(mod))


def _is_kernel(call: relax.Call) -> bool:
    return is_call_to(call, "relax.call_tir") and call.args[0].name_hint.startswith("tpp_")


def _dtypes(calls: list[relax.Call], op: str) -> list[str]:
    """The output dtypes of the calls to ``op``, in graph order."""
    return [str(call.ty.dtype) for call in calls if is_call_to(call, op)]


def _kernel_outputs(model) -> list[str]:
    """The output dtypes of the TPP kernel calls, in graph order."""
    return [str(call.ty.dtype) for call in _calls(model) if _is_kernel(call)]


def test_a_conv_read_only_by_a_bf16_conv_writes_bf16():
    assert _kernel_outputs(_convs(extra_reader=False)) == ["bfloat16", "float32"]


def test_a_conv_read_by_a_bf16_conv_with_a_float32_residual_writes_bf16():
    """The reader reads its shortcut in float32 and this conv only through its bf16 cast."""
    assert _kernel_outputs(_convs(extra_reader=False, residual=True)) == ["bfloat16", "float32"]


def test_a_conv_read_by_anything_else_writes_float32():
    assert _kernel_outputs(_convs(extra_reader=True)) == ["float32", "float32"]


@pytest.mark.parametrize("residual", [False, True])
def test_handoff_matches_onnxruntime_float32(residual):
    model = _convs(extra_reader=False, residual=residual)
    x = np.random.default_rng(1).standard_normal((1, 8, 9, 9)).astype("float32")
    got = tvm_tpp.compile(model, target="tpp", precision="bf16-strict").run(x=x)
    assert max_errors(got, run_onnxruntime(model, {"x": x}))[1] <= 1e-2


def _residual_blocks():
    """``s0 = relu(conv0(x))``, then two blocks ``s = relu(conv(relu(conv(s))) + s)``: a
    residual stream between convs, the last block's output the graph's."""
    inits = _weights(2, 0.15, {f"w{i}": (8, 8, 3, 3) for i in range(5)})
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[1] * 4),
             helper.make_node("Relu", ["c0"], ["s0"])]
    for block, (first, second) in enumerate(((1, 2), (3, 4))):
        stream, out = f"s{block}", "y" if block else "s1"
        nodes += [helper.make_node("Conv", [stream, f"w{first}"], [f"c{first}"], pads=[1] * 4),
                  helper.make_node("Relu", [f"c{first}"], [f"r{first}"]),
                  helper.make_node("Conv", [f"r{first}", f"w{second}"], [f"c{second}"],
                                   pads=[1] * 4),
                  helper.make_node("Add", [f"c{second}", stream], [f"a{second}"]),
                  helper.make_node("Relu", [f"a{second}"], [out])]
    return _model("blocks", nodes, inits, [1, 8, 9, 9], {"y": [1, 8, 9, 9]})


def test_a_residual_stream_between_bf16_convs_stays_bf16():
    """Every conv writes bf16 but the last, the graph's output; the blocks' convs add their
    shortcut in bf16, and nothing casts between them."""
    calls = _calls(_residual_blocks())
    kernels = [call for call in calls if _is_kernel(call)]
    assert [str(call.ty.dtype) for call in kernels] == ["bfloat16"] * 4 + ["float32"]
    assert ["residual_bf16" in call.args[0].name_hint for call in kernels] \
        == [False, False, True, False, True]
    assert _dtypes(calls, "relax.astype") == ["bfloat16"]  # the graph's input, once


def test_a_bf16_residual_stream_matches_onnxruntime_float32():
    model = _residual_blocks()
    x = np.random.default_rng(3).standard_normal((1, 8, 9, 9)).astype("float32")
    got = tvm_tpp.compile(model, target="tpp", precision="bf16").run(x=x)
    assert max_errors(got, run_onnxruntime(model, {"x": x}))[1] <= TOLERANCES["bf16"]


def _casts(first: str, second: str) -> tvm.IRModule:
    x = relax.Var("x", relax.TensorType((4,), "bfloat16" if first == "float32" else "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.astype(x, first))
            y = bb.emit_output(relax.op.astype(y, second))
        bb.emit_func_output(y)
    return bb.get()


def _astypes(mod: tvm.IRModule) -> int:
    return len(_dtypes(main_calls(mod), "relax.astype"))


def test_a_widening_round_trip_cancels():
    before = _casts("float32", "bfloat16")  # bf16 -> float32 -> bf16: exact both ways
    assert _astypes(before) == 2
    assert _astypes(relax.transform.DeadCodeElimination()(simplify_layouts(before))) == 0


def test_a_narrowing_round_trip_stays():
    before = _casts("bfloat16", "float32")  # float32 -> bf16 -> float32 rounds: not identity
    tvm.ir.assert_structural_equal(simplify_layouts(before), before)


def _shuffle_unit():
    """ShuffleNet's ``relu(group conv)``, channel shuffle (reshape, transpose, reshape), then
    a depthwise 3x3 conv and a 1x1 conv."""
    inits = [*_weights(4, 0.3, {"wg": (8, 4, 1, 1), "wd": (8, 1, 3, 3), "wp": (8, 8, 1, 1)}),
             numpy_helper.from_array(np.array([1, 2, 4, 6, 5], "int64"), "split"),
             numpy_helper.from_array(np.array([1, 8, 6, 5], "int64"), "merged")]
    nodes = [helper.make_node("Conv", ["x", "wg"], ["g"], group=2),
             helper.make_node("Relu", ["g"], ["r"]),
             helper.make_node("Reshape", ["r", "split"], ["s"]),
             helper.make_node("Transpose", ["s"], ["t"], perm=[0, 2, 1, 3, 4]),
             helper.make_node("Reshape", ["t", "merged"], ["m"]),
             helper.make_node("Conv", ["m", "wd"], ["d"], group=8, pads=[1] * 4),
             helper.make_node("Conv", ["d", "wp"], ["y"])]
    return _model("shuffle", nodes, inits, [1, 8, 6, 5], {"y": [1, 8, 6, 5]})


def test_a_channel_shuffle_between_bf16_convs_moves_bf16():
    """The group conv writes bf16 and the shuffle moves those bf16 values, and the depthwise
    conv hands bf16 to the 1x1 conv: no cast but the graph input's."""
    calls = _calls(_shuffle_unit())
    assert [str(call.ty.dtype) for call in calls if _is_kernel(call)] \
        == ["bfloat16", "bfloat16", "float32"]
    shuffles = [call for call in calls if is_call_to(call, "relax.permute_dims")
                and call.ty.ndim == 5]
    assert [str(call.ty.dtype) for call in shuffles] == ["bfloat16"]
    assert _dtypes(calls, "relax.astype") == ["bfloat16"]  # the graph's input


def test_a_bf16_channel_shuffle_matches_onnxruntime_float32():
    model = _shuffle_unit()
    x = np.random.default_rng(5).standard_normal((1, 8, 6, 5)).astype("float32")
    got = tvm_tpp.compile(model, target="tpp", precision="bf16").run(x=x)
    assert max_errors(got, run_onnxruntime(model, {"x": x}))[1] <= TOLERANCES["bf16"]


def test_a_widening_round_trip_cancels_through_a_permute():
    x = relax.Var("x", relax.TensorType((2, 3, 4), "bfloat16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            wide = bb.emit(relax.op.astype(x, "float32"))
            moved = bb.emit(relax.op.permute_dims(wide, [0, 2, 1]))
            y = bb.emit_output(relax.op.astype(moved, "bfloat16"))
        bb.emit_func_output(y)
    bb2 = relax.BlockBuilder()
    with bb2.function("main", [x]):
        with bb2.dataflow():
            y = bb2.emit_output(relax.op.permute_dims(x, [0, 2, 1]))
        bb2.emit_func_output(y)
    after = relax.transform.DeadCodeElimination()(simplify_layouts(bb.get()))
    tvm.ir.assert_structural_equal(after, bb2.get())


def test_a_widening_round_trip_cancels_through_a_split():
    # GPT-2's Q, K and V: a part of a split of the float32 view is that part of a split of x.
    x = relax.Var("x", relax.TensorType((2, 6), "bfloat16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            wide = bb.emit(relax.op.astype(x, "float32"))
            parts = bb.emit(relax.op.split(wide, [2, 4], axis=-1))
            middle = bb.emit(relax.TupleGetItem(parts, 1))
            y = bb.emit_output(relax.op.astype(middle, "bfloat16"))
        bb.emit_func_output(y)
    bb2 = relax.BlockBuilder()
    with bb2.function("main", [x]):
        with bb2.dataflow():
            parts = bb2.emit(relax.op.split(x, [2, 4], axis=-1))
            y = bb2.emit_output(relax.TupleGetItem(parts, 1))
        bb2.emit_func_output(y)
    after = relax.transform.DeadCodeElimination()(simplify_layouts(bb.get()))
    tvm.ir.assert_structural_equal(after, bb2.get())


def _aspp():
    """A DeepLab-style concat: two conv branches (one dilated) and a computed one (a scaled
    copy of the input: no conv) concatenated on channels, then a 1x1 conv."""
    inits = [*_weights(6, 0.3, {"w1": (8, 8, 1, 1), "w2": (8, 8, 3, 3), "wp": (5, 24, 1, 1)}),
             numpy_helper.from_array(np.array(0.5, "float32"), "half")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["x", "w2"], ["c2"], pads=[2] * 4, dilations=[2, 2]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Mul", ["x", "half"], ["scaled"]),
             helper.make_node("Concat", ["r1", "r2", "scaled"], ["cat"], axis=1),
             helper.make_node("Conv", ["cat", "wp"], ["y"])]
    return _model("aspp", nodes, inits, [2, 8, 7, 9], {"y": [2, 5, 7, 9]})


def test_convs_concatenated_for_a_bf16_conv_write_bf16():
    """Both branch convs write bf16, the concat joins bf16 tensors and the branch of no conv
    is cast to bf16 before it: no float32 concat is written and cast for the 1x1 conv."""
    calls = _calls(_aspp())
    assert [str(call.ty.dtype) for call in calls if _is_kernel(call)] \
        == ["bfloat16", "bfloat16", "float32"]
    concats = _dtypes(calls, "relax.concat") + _dtypes(calls, "relax.call_tir_inplace")
    assert concats and set(concats) == {"bfloat16"}


def test_a_bf16_concat_matches_onnxruntime_float32():
    model = _aspp()
    x = np.random.default_rng(7).standard_normal((2, 8, 7, 9)).astype("float32")
    got = tvm_tpp.compile(model, target="tpp", precision="bf16-strict").run(x=x)
    assert max_errors(got, run_onnxruntime(model, {"x": x}))[1] <= TOLERANCES["bf16"]


def test_a_narrowing_cast_of_a_concat_moves_into_its_parts():
    """``astype(concat([astype(a, f32), b]), bf16)`` -> ``concat([a, astype(b, bf16)])``: the
    widened part cancels, the other is cast on its own (exact: a cast is elementwise)."""
    a = relax.Var("a", relax.TensorType((1, 2, 2, 4), "bfloat16"))
    b = relax.Var("b", relax.TensorType((1, 2, 2, 3), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [a, b]):
        with bb.dataflow():
            wide = bb.emit(relax.op.astype(a, "float32"))
            joined = bb.emit(relax.op.concat([wide, b], axis=3))
            y = bb.emit_output(relax.op.astype(joined, "bfloat16"))
        bb.emit_func_output(y)
    expected = relax.BlockBuilder()
    with expected.function("main", [a, b]):
        with expected.dataflow():
            y = expected.emit_output(relax.op.concat([a, relax.op.astype(b, "bfloat16")],
                                                     axis=3))
        expected.emit_func_output(y)
    after = relax.transform.DeadCodeElimination()(simplify_layouts(bb.get()))
    tvm.ir.assert_structural_equal(after, relax.transform.Normalize()(expected.get()))


def test_a_concat_of_widened_bf16_parts_widens_once_after_it():
    """``concat([astype(a, f32), astype(b, f32)])`` -> ``astype(concat([a, b]), f32)``: the
    bf16 max pool after it (Inception's) then pools the bf16 concat."""
    a = relax.Var("a", relax.TensorType((1, 2, 2, 4), "bfloat16"))
    b = relax.Var("b", relax.TensorType((1, 2, 2, 3), "bfloat16"))
    bb = relax.BlockBuilder()
    with bb.function("main", [a, b]):
        with bb.dataflow():
            parts = [bb.emit(relax.op.astype(v, "float32")) for v in (a, b)]
            y = bb.emit_output(relax.op.concat(parts, axis=3))
        bb.emit_func_output(y)
    expected = relax.BlockBuilder()
    with expected.function("main", [a, b]):
        with expected.dataflow():
            y = expected.emit_output(relax.op.astype(relax.op.concat([a, b], axis=3),
                                                     "float32"))
        expected.emit_func_output(y)
    after = relax.transform.DeadCodeElimination()(simplify_layouts(bb.get()))
    tvm.ir.assert_structural_equal(after, relax.transform.Normalize()(expected.get()))


def _inception_block():
    """Two conv branches concatenated, a stride-2 max pool of the concat, then a 1x1 conv."""
    inits = _weights(8, 0.3, {"w1": (8, 8, 1, 1), "w3": (16, 8, 3, 3), "wp": (5, 24, 1, 1)})
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["x", "w3"], ["c3"], pads=[1] * 4),
             helper.make_node("Relu", ["c3"], ["r3"]),
             helper.make_node("Concat", ["r1", "r3"], ["cat"], axis=1),
             helper.make_node("MaxPool", ["cat"], ["pool"], kernel_shape=[3, 3],
                              strides=[2, 2], pads=[1] * 4),
             helper.make_node("Conv", ["pool", "wp"], ["y"])]
    return _model("inception", nodes, inits, [2, 8, 9, 10], {"y": [2, 5, 5, 5]})


def test_branches_concatenated_before_a_max_pool_stay_bf16():
    calls = _calls(_inception_block())
    tir = [(call.args[0].name_hint.split("_")[0], str(call.ty.dtype)) for call in calls
           if is_call_to(call, "relax.call_tir") or is_call_to(call, "relax.call_tir_inplace")]
    assert ("max", "bfloat16") in tir  # max_pool2d_bf16
    assert [d for k, d in tir if k == "tpp"] == ["bfloat16", "bfloat16", "float32"]
    assert _dtypes(calls, "relax.astype") == ["bfloat16"]  # the graph's input


def test_a_bf16_concat_before_a_max_pool_matches_onnxruntime_float32():
    model = _inception_block()
    x = np.random.default_rng(9).standard_normal((2, 8, 9, 10)).astype("float32")
    got = tvm_tpp.compile(model, target="tpp", precision="bf16-strict").run(x=x)
    assert max_errors(got, run_onnxruntime(model, {"x": x}))[1] <= TOLERANCES["bf16"]


def test_dense_layers_hand_bf16_to_dense_layers():
    from tvm_tpp import models

    calls = _calls(models.load("mlp"))
    kernels = [str(call.ty.dtype) for call in calls if _is_kernel(call)]
    casts = [(str(call.args[0].ty.dtype), str(call.attrs.dtype)) for call in calls
             if is_call_to(call, "relax.astype")]
    # Layers 1 and 2 write bf16 for the next; the last writes the float32 output; only the
    # graph's input is cast (no bf16 -> float32 -> bf16 round trip is left).
    assert kernels == ["bfloat16", "bfloat16", "float32"]
    assert casts == [("float32", "bfloat16")]


def _attention():
    from tvm_tpp import models

    return models.load("bert", seq=16, hidden=64, heads=4, ffn=128)


def test_attention_hands_its_context_to_the_output_projection_in_bf16():
    """The fused attention writes its context in bf16 for the bf16 dense layer after it
    (through the heads' permute and reshape); its float32 scores never leave the kernel."""
    calls = _calls(_attention())
    fused = [str(call.ty.dtype) for call in calls
             if _is_kernel(call) and "attention" in call.args[0].name_hint]
    casts = [(str(call.args[0].ty.dtype), str(call.attrs.dtype)) for call in calls
             if is_call_to(call, "relax.astype")]
    assert fused == ["bfloat16"]
    # The graph's input and the layer norm's output (read in float32 by the residual too).
    assert casts == [("float32", "bfloat16")] * 2


def test_projections_hand_q_k_v_to_the_attention_in_bf16(monkeypatch):
    """The Q, K and V dense layers write bf16 (through the heads' reshape and permutes), which
    the fused attention packs as it is: no float32 Q, K or V, no cast between.  Kept apart
    (as a cross-attention's are, on two inputs), not one layer split in three."""
    monkeypatch.setattr("relay_passes.pipeline.combine_parallel_dense", lambda mod: mod)
    calls = _calls(_attention())
    kernels = [call for call in calls if _is_kernel(call)]
    fused = next(call for call in kernels if "attention" in call.args[0].name_hint)
    assert [str(a.ty.dtype) for a in fused.args[1].fields[:3]] == ["bfloat16"] * 3
    assert "_txbi4bf16_" in fused.args[0].name_hint  # bf16 inputs ("i") in its layout
    projections = [c for c in kernels[:4] if "dense" in c.args[0].name_hint]
    assert [str(c.ty.dtype) for c in projections] == ["bfloat16"] * 3


def test_a_fused_projection_hands_its_split_q_k_v_over_in_bf16():
    """GPT-2's one QKV projection, split in three: it writes bf16, which the fused attention
    reads in place (the split's parts as channel ranges of the one buffer), and the layer
    stays within bf16's error of ONNX Runtime in float32."""
    from tvm_tpp import models

    model = models.load("gpt2", seq=16, hidden=64, heads=4, ffn=128)
    kernels = [call for call in _calls(model) if _is_kernel(call)]
    fused = next(call for call in kernels if "attention" in call.args[0].name_hint)
    projection = kernels[kernels.index(fused) - 1]
    assert "dense_16x192x64" in projection.args[0].name_hint
    assert str(projection.ty.dtype) == "bfloat16"
    operands = fused.args[1].fields[:3]
    assert [str(a.ty.dtype) for a in operands] == ["bfloat16"] * 3
    assert all(int(a.ty.shape[-1]) == 192 for a in operands)  # the whole buffer, in place
    x = np.random.default_rng(2).standard_normal((1, 16, 64)).astype("float32")
    compiled = tvm_tpp.compile(model, target="tpp", precision="bf16-strict")
    got = compiled.run(hidden_states=x)
    assert max_errors(got, run_onnxruntime(model, {"hidden_states": x}))[1] <= 1e-2


def test_a_bf16_context_matches_onnxruntime_float32():
    model = _attention()
    x = np.random.default_rng(1).standard_normal((1, 16, 64)).astype("float32")
    compiled = tvm_tpp.compile(model, target="tpp", precision="bf16-strict")
    assert any("attention" in r.op and r.kernel.endswith("_convert_bf16")
               for r in compiled.report)
    got = compiled.run(hidden_states=x)
    assert max_errors(got, run_onnxruntime(model, {"hidden_states": x}))[1] <= 1e-2

