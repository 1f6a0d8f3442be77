"""Bundled example networks: valid ONNX, random weights, run in ONNX Runtime, import into Relax."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx

from tvm_tpp import models

BUILTIN = ["mlp", "resnet_small", "bert", "mobilenet_v2", "seg_head", "efficientnet",
           "inception", "gpt2"]
NAMES = models.names()
LIGHT = [n for n in NAMES if n not in BUILTIN]
# Output shapes at batch 1; squeezenet and densenet121 end in a 1x1 spatial map.
OUT_SHAPE = {"mlp": (1, 512), "resnet_small": (1, 10), "bert": (1, 128, 768),
             "mobilenet_v2": (1, 10), "seg_head": (1, 21, 16, 16), "efficientnet": (1, 10),
             "inception": (1, 10), "gpt2": (1, 128, 768)}
OUT_SHAPE |= {
    n: (1, 1000, 1, 1) if n in ("squeezenet", "densenet121") else (1, 1000) for n in LIGHT
}
# vgg19 (144 M weights), zfnet512 (87 M) and bvlc_alexnet (61 M) make every step (draw,
# check, ORT session, Relax import) cost seconds: they run in the slow suite.
HEAVY = {"vgg19", "zfnet512", "bvlc_alexnet"}
PARAMS = [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n for n in NAMES]
# A small BERT keeps the batch and seed checks cheap; the default one is covered by NAMES.
SMALL_BERT = {"seq": 16, "hidden": 64, "heads": 4, "ffn": 128}
SMALL_GPT2 = {"seq": 16, "hidden": 64, "heads": 4, "ffn": 256}


@pytest.fixture(scope="module")
def model() -> Callable[[str], onnx.ModelProto]:
    """load(name) at batch 1, seed 0, loaded once per module (vgg19 takes seconds)."""
    cache: dict[str, onnx.ModelProto] = {}

    def get(name: str) -> onnx.ModelProto:
        if name not in cache:
            cache[name] = models.load(name)
        return cache[name]

    return get


def run_ort(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    (out,) = sess.run(None, inputs)
    return out


def weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def test_names_cover_builtin_and_light_models() -> None:
    assert NAMES[:len(BUILTIN)] == BUILTIN
    assert len(set(NAMES)) == len(NAMES)
    # The onnx wheel has shipped these light models for many releases.
    assert {"resnet50", "squeezenet", "vgg19", "densenet121", "shufflenet"} <= set(LIGHT)
    assert not any(n.startswith("light_") for n in NAMES)


def test_unknown_name_lists_known_models() -> None:
    with pytest.raises(ValueError, match="resnet_small.*squeezenet"):
        models.load("resnet18")


@pytest.mark.parametrize(
    ("name", "kwargs", "error"),
    [
        ("mlp", {"batch": 0}, ValueError),
        ("mlp", {"seed": -1}, ValueError),
        ("mlp", {"seq": 8}, TypeError),
        ("squeezenet", {"hidden": 8}, TypeError),
        ("bert", {"hidden": 100, "heads": 12}, ValueError),
        ("mlp", {"dims": (8,)}, ValueError),
        ("mlp", {"dims": (8, 4), "gemm_layer": 1}, ValueError),
        ("resnet_small", {"image": 4, "widths": (8, 8, 8)}, ValueError),
        ("inception", {"blocks": ((4, 4, 8, 2, 4),)}, ValueError),
        ("inception", {"image": 8, "blocks": ((4, 4, 8, 2, 4, 4),) * 3}, ValueError),
        ("inception", {"factorized": 1}, ValueError),
        ("gpt2", {"hidden": 100, "heads": 12}, ValueError),
        ("gpt2", {"gelu": "relu"}, ValueError),
        ("gpt2", {"mask": "none"}, ValueError),
    ],
)
def test_bad_arguments_raise(name: str, kwargs: dict, error: type[Exception]) -> None:
    with pytest.raises(error):
        models.load(name, **kwargs)


@pytest.mark.parametrize("name", PARAMS)
def test_model_is_valid_with_static_inputs(model, name: str) -> None:
    m = model(name)
    onnx.checker.check_model(m)
    shapes = models.input_shapes(m)
    assert len(shapes) == 1
    (shape,) = shapes.values()
    assert shape[0] == 1 and all(d > 0 for d in shape)
    assert {t.name for t in m.graph.initializer}.isdisjoint(vi.name for vi in m.graph.input)
    if name in LIGHT:
        assert m.ir_version >= 4
        ops = [n.op_type for n in m.graph.node]
        assert "ConstantOfShape" not in ops
        assert ops[-1] != "Softmax"


@pytest.mark.parametrize("name", PARAMS)
def test_runs_in_onnxruntime_with_nonconstant_output(model, name: str) -> None:
    m = model(name)
    out = run_ort(m, models.random_inputs(m, seed=0))
    declared = tuple(d.dim_value for d in m.graph.output[0].type.tensor_type.shape.dim)
    assert out.shape == declared == OUT_SHAPE[name]
    assert np.isfinite(out).all()
    assert out.std() > 0  # with the shipped 0.02 weights every light model's output is constant


@pytest.mark.parametrize("name", PARAMS)
def test_imports_into_relax(model, name: str) -> None:
    m = model(name)
    mod = from_onnx(m, shape_dict=models.input_shapes(m))
    ret = mod["main"].ret_ty
    assert tuple(int(d) for d in ret.shape) == OUT_SHAPE[name]
    assert ret.dtype == "float32"


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("mlp", {}),
        ("resnet_small", {}),
        ("bert", SMALL_BERT),
        ("gpt2", SMALL_GPT2),
        ("inception", {}),
        ("squeezenet", {}),
        ("shufflenet", {}),
        ("inception_v1", {}),
    ],
)
def test_batch_is_per_sample(name: str, options: dict) -> None:
    """Batch 2 computes each sample as batch 1 does (Reshapes carry the batch, weights equal)."""
    one = models.load(name, batch=1, **options)
    two = models.load(name, batch=2, **options)
    ((key, x2),) = models.random_inputs(two, seed=5).items()
    assert x2.shape[0] == 2
    y2 = run_ort(two, {key: x2})
    for i in range(2):
        y1 = run_ort(one, {key: x2[i : i + 1]})
        np.testing.assert_allclose(y2[i : i + 1], y1, rtol=1e-4, atol=1e-4 * np.abs(y1).max())


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("mlp", {}),
        ("resnet_small", {}),
        ("bert", SMALL_BERT),
        ("gpt2", SMALL_GPT2),
        ("inception", {}),
        ("squeezenet", {}),
        ("densenet121", {}),
        ("inception_v1", {}),
    ],
)
def test_weights_are_seeded(name: str, options: dict) -> None:
    a, b = (weights(models.load(name, seed=s, **options)) for s in (3, 3))
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)

    m = models.load(name, seed=4, **options)
    c = weights(m)
    # Every Conv/Gemm/MatMul weight (input 1, possibly through a Reshape) depends on the seed.
    reshaped = {n.output[0]: n.input[0] for n in m.graph.node if n.op_type == "Reshape"}
    mats = {n.input[1] for n in m.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")}
    mats = {reshaped.get(w, w) for w in mats} & c.keys()
    assert mats
    assert all(not np.array_equal(a[k], c[k]) for k in mats)


def test_light_weights_follow_their_consumer() -> None:
    """He-scaled conv weights, BN variance in [0.5, 1.5], scale in [0.8, 1.2]."""
    m = models.load("resnet50")
    w = weights(m)
    bn = [n for n in m.graph.node if n.op_type == "BatchNormalization"]
    for n in bn:
        assert 0.8 <= w[n.input[1]].min() and w[n.input[1]].max() <= 1.2
        assert 0.5 <= w[n.input[4]].min() and w[n.input[4]].max() <= 1.5
    for n in m.graph.node:
        if n.op_type == "Conv":
            kernel = w[n.input[1]]
            fan_in = np.prod(kernel.shape[1:])
            np.testing.assert_allclose(kernel.std(), np.sqrt(2 / fan_in), rtol=0.2)


def test_random_inputs_are_seeded() -> None:
    m = models.load("resnet_small")
    a, b, c = (models.random_inputs(m, seed=s)["x"] for s in (1, 1, 2))
    assert a.dtype == np.float32 and a.shape == (1, 3, 64, 64)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_random_inputs_gives_token_ids_for_integer_inputs() -> None:
    table = numpy_helper.from_array(np.ones((100, 4), np.float32), "table")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["y"])],
        "embed",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, (2, 7))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, (2, 7, 4))],
        initializer=[table],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    ids = models.random_inputs(m, seed=0)["ids"]
    assert ids.dtype == np.int64 and ids.shape == (2, 7)
    assert 0 <= ids.min() and ids.max() < 100 and len(np.unique(ids)) > 1
    assert run_ort(m, {"ids": ids}).shape == (2, 7, 4)


def test_input_shapes_rejects_symbolic_dims() -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ("N", 4))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ("N", 4))],
    )
    with pytest.raises(ValueError, match="'x' has no static shape"):
        models.input_shapes(helper.make_model(graph))


@pytest.mark.parametrize(
    "name", ["mlp", *(pytest.param(n, marks=pytest.mark.slow) for n in ("resnet_small", "bert"))]
)
def test_relax_build_matches_onnxruntime(model, name: str) -> None:
    m = model(name)
    x = models.random_inputs(m, seed=1)
    ref = run_ort(m, x)
    target = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
    mod = from_onnx(m, shape_dict=models.input_shapes(m))
    ex = tvm.compile(mod, target=target, relax_pipeline=relax.get_default_pipeline(target))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](*(tvm.runtime.tensor(v) for v in x.values())).numpy()
    assert np.abs(out - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("mask", ["where", "add"])
def test_gpt2_attention_is_causal(mask: str) -> None:
    """A change at the last position changes no earlier position's output (and does change
    the last one's)."""
    m = models.load("gpt2", **SMALL_GPT2, mask=mask)
    x = models.random_inputs(m, seed=2)["hidden_states"]
    late = x.copy()
    late[:, -1] += 1.0
    y, y_late = (run_ort(m, {"hidden_states": v}) for v in (x, late))
    np.testing.assert_allclose(y[:, :-1], y_late[:, :-1], rtol=0, atol=1e-6 * np.abs(y).max())
    assert not np.allclose(y[:, -1], y_late[:, -1])
