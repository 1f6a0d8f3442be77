"""``tvm-tpp profile --against onnxruntime|openvino|openvino-f32``: the build's layers matched
to the other runtime's."""

import json

import pytest
import tvm
from tvm import relax

import tvm_tpp
from tvm_tpp import models
from tvm_tpp.cli import main
from tvm_tpp.layer_compare import (
    AGAINST,
    compare_layers,
    layer_key,
    openvino_layer_key,
    ort_layer_key,
)
from tvm_tpp.reference import random_inputs


@pytest.mark.parametrize("name, options", [
    pytest.param("resnet_small", dict(image=32, widths=(16, 32)), marks=pytest.mark.slow),
    pytest.param("mobilenet_v2", dict(image=32, stem=8, blocks=((1, 8, 1, 1), (6, 16, 2, 2)),
                                      head=32), marks=pytest.mark.slow),  # 7 s; the CLI test
                                                                          # compares one too
])
def test_every_kernel_meets_its_onnxruntime_node(name, options):
    """Strided, pointwise, depthwise convs and the classifier (mobilenet_v2), convs with a
    fused residual (resnet_small, slow: the same matching): each key has as many layers on
    both sides, and each side's time is positive."""
    model = models.load(name, **options)
    compiled = tvm_tpp.compile(model, target="tpp")
    inputs = random_inputs(compiled.inputs)
    cmp = compare_layers(relax.VirtualMachine(compiled.executable, tvm.cpu()),
                         compiled._arguments(inputs), model, inputs, threads=1, rounds=2,
                         repeat=1, warmup_seconds=0.0)
    layers = _matched_one_to_one(cmp, compiled)
    assert any(" g" in layer.key for layer in layers) == (name == "mobilenet_v2")
    assert any(" s2" in layer.key for layer in layers) and any("dense" in x.key for x in layers)


def _matched_one_to_one(cmp, compiled) -> list:
    """The keyed layers of ``cmp``, after checking each has as many layers on both sides,
    positive times, and that together they are every kernel call of ``compiled``."""
    layers = [layer for layer in cmp.layers if not layer.key.startswith("other")]
    for layer in layers:
        assert layer.tpp_calls == layer.their_calls > 0, layer
        assert layer.tpp_seconds > 0 and layer.their_seconds > 0 and layer.ratio > 0
    assert sum(layer.tpp_calls for layer in layers) == sum(
        name.startswith("tpp_") for name in _kernel_calls(compiled))
    assert cmp.tpp_run_seconds > 0 and cmp.their_run_seconds > 0
    return layers


@pytest.mark.slow  # 9 s: a whole BERT layer against ONNX Runtime; the keys are checked below
def test_attention_matmuls_meet_onnxruntime_matmuls():
    """A BERT layer's two batch matmuls of activations (``Q K^T`` with its scale and mask,
    ``P V``): ONNX Runtime's MatMul nodes keyed as batch matmuls, beside the dense layers,
    and tpp's one fused attention kernel as a layer of its own (no node has its key)."""
    model = models.load("bert", seq=16, hidden=96, heads=4, ffn=128)
    compiled = tvm_tpp.compile(model, target="tpp")
    inputs = random_inputs(compiled.inputs)
    cmp = compare_layers(relax.VirtualMachine(compiled.executable, tvm.cpu()),
                         compiled._arguments(inputs), model, inputs, threads=1, rounds=1,
                         repeat=1, warmup_seconds=0.0)
    keyed = {layer.key: (layer.tpp_calls, layer.their_calls) for layer in cmp.layers
             if not layer.key.startswith("other")}
    assert keyed == {"batch matmul 4x16x16x24": (0, 1), "batch matmul 4x16x24x16": (0, 1),
                     "attention 4x16x16x24x24": (1, 0), "dense 16x96x96": (4, 4),
                     "dense 16x128x96": (1, 1), "dense 16x96x128": (1, 1)}, keyed


def _kernel_calls(compiled):
    return [o.name for o in compiled.profile(repeat=1).operators for _ in range(o.calls)]


@pytest.mark.parametrize("op, inputs, outputs, key", [
    ("Conv", [[2, 12, 9, 9], [6, 4, 3, 3]], [[2, 6, 5, 5]], "conv 12x9x9 -> 6 3x3 s2 g3"),
    ("FusedConv", [[1, 8, 7, 7], [8, 1, 3, 3], [8]], [[1, 8, 7, 7]],
     "conv 8x7x7 -> 8 3x3 s1 g8"),
    ("MatMul", [[2, 128, 768], [768, 3072]], [[2, 128, 3072]], "dense 256x3072x768"),
    ("QLinearConv", [[1, 16, 8, 8], [], [], [32, 16, 3, 3], [32], [32], [], []],
     [[1, 32, 4, 4]], "conv 16x8x8 -> 32 3x3 s2"),
    ("ConvInteger", [[1, 16, 8, 8], [32, 16, 1, 1], [], []], [[1, 32, 8, 8]],
     "conv 16x8x8 -> 32 1x1 s1"),
    ("QGemm", [[128, 768], [], [], [3072, 768], [3072], [3072], [3072]], [[128, 3072]],
     "dense 128x3072x768"),
    ("MatMul", [[2, 12, 128, 64], [2, 12, 64, 128]], [[2, 12, 128, 128]],
     "batch matmul 24x128x128x64"),
    ("FusedMatMul", [[3, 64, 128], [3, 64, 96]], [[3, 128, 96]],  # A read transposed
     "batch matmul 3x128x96x64"),
    ("QLinearMatMul", [[12, 128, 128], [], [], [12, 128, 64], [], [], [], []],
     [[12, 128, 64]], "batch matmul 12x128x64x128"),
    ("MatMul", [[2, 128, 768], [2, 768, 64]], [[2, 128, 64]], "batch matmul 2x128x64x768"),
    ("QLinearConv", [[1, 16, 8, 8], [], []], [[1, 32, 8, 8]], None),  # no filter recorded
    ("Relu", [[1, 8]], [[1, 8]], None),
    ("Conv", [[1, 8, 16]], [[1, 8, 16]], None),  # a 1-D conv: not a 2-D layer
])
def test_onnxruntime_nodes_keyed_by_their_shapes(op, inputs, outputs, key):
    assert ort_layer_key(op, inputs, outputs) == key


def test_kernel_names_keyed_as_their_layers():
    assert layer_key("tpp_conv2d_nx3x224x224_64x7x7_s2x2_bias_relu_u8s8") == \
        "conv 3x224x224 -> 64 7x7 s2"
    assert layer_key("tpp_conv2d_1x12x9x9_6x3x3_s1x1_d2x2_g3_bias") == \
        "conv 12x9x9 -> 6 3x3 s1 g3"
    assert layer_key("tpp_batch_gemm_12x128x64x128") is None
    assert layer_key("tpp_batch_matmul_12x128x64x128_by12") == "batch matmul 12x128x64x128"
    assert layer_key("tpp_batch_matmul_n12x128x64x128") is None  # per image: a symbolic batch
    assert layer_key("tpp_qdq_dense_128x768x3072_bias_requantize_u8_inplace") == \
        "dense 128x768x3072"


def test_cli_prints_and_writes_both_sides(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["profile", "mlp", "--against", "onnxruntime", "--repeat", "2", "--rounds", "2",
                 "--warmup", "0", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "layers against ONNX Runtime" in table
    against = json.loads(out.read_text())["against_onnxruntime"]
    ratios = against["round_ratios"]  # each round's ratio, their median the run's
    assert len(ratios) == 2 and against["run_ratio"] == pytest.approx(sum(ratios) / 2)
    run_row = next(line for line in table.splitlines() if "a run (unprofiled" in line)
    assert f"({min(ratios):.2f}-{max(ratios):.2f})" in run_row
    layers = against["layers"]
    dense = [layer for layer in layers if layer["key"].startswith("dense")]
    assert dense and all(x["tpp_seconds"] and x["their_seconds"] for x in dense)


def test_convs_onnxruntime_padded_keep_the_models_key():
    """On AVX-512 hosts ONNX Runtime's NCHWc layout rounds channels up to 16 and profiles
    the padded shapes, under the name of the node a conv's fused chain ends in."""
    from tvm_tpp.layer_compare import _model_convs, _ort_rounds

    model = models.load("mobilenet_v2", image=32, stem=8, blocks=((1, 8, 1, 1),), head=32)

    def event(name, op, inputs, output):
        return {"cat": "Node", "name": f"{name}_kernel_time", "dur": 5,
                "args": {"op_name": op, "input_type_shape": [{"float": s} for s in inputs],
                         "output_type_shape": [{"float": output}]}}

    events = [event("stem.relu6_nchwc", "Conv", [[1, 3, 32, 32], [16, 3, 3, 3]], [1, 16, 16, 16]),
              event("block0.0.depthwise.relu6_nchwc", "Conv",
                    [[1, 16, 16, 16], [16, 1, 3, 3]], [1, 16, 16, 16]),
              event("head.relu6_nchwc", "Conv", [[1, 8, 16, 16], [32, 8, 1, 1]], [1, 32, 16, 16])]
    (keys,) = _ort_rounds(events * 2, rounds=1, repeat=1, convs=_model_convs(model))
    assert sorted(keys) == ["conv 3x32x32 -> 8 3x3 s2", "conv 8x16x16 -> 32 1x1 s1",
                            "conv 8x16x16 -> 8 3x3 s1 g8"]
    (padded,) = _ort_rounds(events * 2, rounds=1, repeat=1)  # without the model's convs
    assert "conv 16x16x16 -> 16 3x3 s1 g16" in padded


@pytest.fixture(scope="module")
def small_mobilenet():
    """A small mobilenet_v2 and its build, shared by the OpenVINO comparisons (7 s a build)."""
    model = models.load("mobilenet_v2", image=32, stem=8, blocks=((1, 8, 1, 1), (6, 16, 2, 2)),
                        head=32)
    return model, tvm_tpp.compile(model, target="tpp")


@pytest.mark.parametrize("against", ["openvino", "openvino-f32"])
def test_every_kernel_meets_its_openvino_node(small_mobilenet, against):
    """OpenVINO's executed graph keys its convolutions (strided, pointwise, depthwise: a
    grouped filter) and fully connected layer as tpp's kernels are, one node per layer."""
    pytest.importorskip("openvino", reason="the openvino extra is not installed")
    model, compiled = small_mobilenet
    inputs = random_inputs(compiled.inputs)
    cmp = compiled.compare_layers(model, inputs, rounds=2, repeat=2, warmup_seconds=0.0,
                                  against=against)
    assert cmp.against == {"openvino": "OpenVINO", "openvino-f32": "OpenVINO f32"}[against]
    layers = _matched_one_to_one(cmp, compiled)
    assert any(" g" in x.key for x in layers) and any("dense" in x.key for x in layers)


@pytest.mark.parametrize("layer_type, inputs, outputs, key", [
    ("Convolution", [[2, 12, 9, 9], [3, 2, 4, 3, 3]], [[2, 6, 5, 5]], "conv 12x9x9 -> 6 3x3 s2 g3"),
    ("GroupConvolution", [[1, 8, 7, 7], [8, 1, 1, 3, 3]], [[1, 8, 7, 7]],
     "conv 8x7x7 -> 8 3x3 s1 g8"),
    ("FullyConnected", [[2, 128, 768], [3072, 768]], [[2, 128, 3072]], "dense 256x3072x768"),
    ("MatMul", [[2, 12, 128, 64], [2, 12, 64, 128]], [[2, 12, 128, 128]],
     "batch matmul 24x128x128x64"),
    ("Convolution", [[1, 8, 7, 7], []], [[1, 8, 7, 7]], None),  # a dynamic filter shape
    ("Subgraph", [[1, 8]], [[1, 8]], None),
])
def test_openvino_nodes_keyed_by_their_shapes(layer_type, inputs, outputs, key):
    assert openvino_layer_key(layer_type, inputs, outputs) == key


def test_cli_names_the_runtimes_compare_layers_takes():
    from tvm_tpp.cli import _parser

    (commands,) = [a for a in _parser()._actions if a.dest == "command"]
    (against,) = [a for a in commands.choices["profile"]._actions if a.dest == "against"]
    assert tuple(against.choices) == AGAINST
