"""The networks of issue 15 whole (float32): each compiles with at least 95 % of its matmul and
conv FLOPs on TPP kernels and matches ONNX Runtime at batch 1 and 8 (normwise 1e-4): an
EfficientNet-B0-style network (depthwise 3x3 and 5x5, SiLU, squeeze-excite's broadcast
multiply), a DeepLab-style head (dilated convs, concat), MobileNetV2 (depthwise, ReLU6), the
ShuffleNet of the ``onnx`` package (grouped convs, channel shuffle, concat), GoogLeNet-style
Inception blocks (parallel 1x1/3x3/5x5 or factorized 1x7-7x1 and pooled branches, concat) and a
GPT-2 decoder layer (fused QKV split into heads, causal mask by Where or by an added bias, tanh
or erf GELU spelled out).  The default suite builds scaled-down variants; the bundled sizes run
in the slow suite.

PP-OCRv4's text detector, a trained network from the ``rapidocr_onnxruntime`` wheel, runs in the
slow suite where that package is installed (``pip install -e ".[ocr]"``)."""

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import pytest

import tvm_tpp
from tvm_tpp import models
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime

SMALL_GPT2 = dict(seq=16, hidden=64, heads=4, ffn=256)
#: Case id -> (bundled model, options of its scaled-down variant).
SMALL = {
    "efficientnet": ("efficientnet", dict(image=32, stem=8,
                                          blocks=((1, 8, 1, 1, 3), (4, 16, 2, 2, 5)), head=32)),
    "seg_head": ("seg_head", dict(image=32, width=16, rates=(2, 4, 12))),
    "mobilenet_v2": ("mobilenet_v2", dict(image=32, stem=8, blocks=((1, 8, 1, 1), (6, 16, 2, 2)),
                                          head=32)),
    "inception": ("inception", dict(image=32, stem=8, factorized=True,
                                    blocks=((4, 4, 8, 2, 4, 4), (8, 8, 12, 4, 8, 4)))),
    "gpt2": ("gpt2", SMALL_GPT2),
    "gpt2-erf-add": ("gpt2", dict(SMALL_GPT2, gelu="erf", mask="add")),
}
#: The default suite's batch of each small variant; the other one runs in the slow suite, as
#: both of inception's, mobilenet_v2's and efficientnet's do (the default suite's budget:
#: inception's concat and pooling chains are there in test_concat_chain and
#: test_graph_properties, the inverted residuals of depthwise convs in test_layer_compare's
#: mobilenet_v2, efficientnet's SiLU and squeeze-excite scaling in test_epilogue_patterns and
#: test_layouts).
DEFAULT_BATCH = {"efficientnet": None, "seg_head": 1, "mobilenet_v2": None, "inception": None,
                 "gpt2": 1, "gpt2-erf-add": 1}
CASES = [pytest.param(name, options, batch, id=f"{case}-small-b{batch}",
                      marks=() if batch == DEFAULT_BATCH[case] else pytest.mark.slow)
         for case, (name, options) in SMALL.items() for batch in (1, 8)]
CASES += [pytest.param(name, options, batch, id=f"{case}-b{batch}", marks=pytest.mark.slow)
          for case, name, options in [
              *((n, n, {}) for n in ("efficientnet", "seg_head", "mobilenet_v2", "shufflenet",
                                     "inception", "gpt2")),
              ("inception-factorized", "inception", dict(factorized=True)),
              ("gpt2-erf-add", "gpt2", dict(gelu="erf", mask="add"))]
          for batch in (1, 8)]


@pytest.mark.parametrize("name, options, batch", CASES)
def test_network_runs_on_tpp_kernels_and_matches_onnxruntime(name, options, batch):
    model = models.load(name, batch=batch, **options)
    compiled = tvm_tpp.compile(model, target="tpp")
    assert compiled.tpp_flops_fraction >= 0.95, [r for r in compiled.report if not r.kernel]
    if name == "gpt2":  # the MLP's spelled-out GELU runs in its dense kernel's epilogue
        gelu = f"matmul+bias+gelu_{options.get('gelu', 'tanh')}"
        assert [r.op for r in compiled.report].count(gelu) == 1, compiled.report
    inputs = random_inputs(compiled.inputs, seed=batch)
    _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
    assert rel <= 1e-4


def _page(rng: np.random.Generator, side: int) -> np.ndarray:
    """A synthetic page, normalized as PP-OCR's preprocessing does: dark strokes in lines on
    light paper.  On it the detector finds text (random noise gives a probability map of
    about 1e-4 everywhere, whose relative error says nothing)."""
    img = np.full((side, side, 3), 235.0) + rng.normal(0, 8, (side, side, 3))
    for _ in range(side // 24):
        y, x = rng.integers(side // 32, side - side // 16, 2)
        h, w = rng.integers(8, 20), rng.integers(side // 8, side // 3)
        for j in range(x, min(x + w, side - 2), 6):
            img[y:y + h, j:j + 3] = rng.uniform(0, 60)
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    return ((img / 255 - mean) / std).transpose(2, 0, 1)[None].astype(np.float32)


def _pp_ocrv4_detector() -> Path:
    """The detector's file in the installed ``rapidocr_onnxruntime`` (found without importing
    the package, which needs OpenCV); skips the test when it is not there."""
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip('PP-OCRv4\'s detector ships in rapidocr_onnxruntime: pip install -e ".[ocr]"')
    path = Path(spec.submodule_search_locations[0]) / "models" / "ch_PP-OCRv4_det_infer.onnx"
    if not path.is_file():
        pytest.skip(f"this rapidocr_onnxruntime ships no {path.name}")
    return path


@pytest.mark.slow
def test_pp_ocrv4_detector_runs_on_tpp_kernels_and_matches_onnxruntime():
    """PP-OCRv4's trained text detector (depthwise convs, hard-swish, Resize, ConvTranspose,
    concat) at 1x3x320x320: all of its FLOPs on TPP kernels, its two ConvTransposes as
    sub-pixel convs."""
    model = onnx.load(_pp_ocrv4_detector())
    (name,) = [i.name for i in model.graph.input]
    compiled = tvm_tpp.compile(model, target="tpp", input_shapes={name: (1, 3, 320, 320)})
    assert compiled.tpp_flops_fraction == 1.0, [r for r in compiled.report if not r.kernel]
    inputs = {name: _page(np.random.default_rng(0), 320)}
    want = run_onnxruntime(model, inputs)
    assert want[0].max() > 0.1  # the detector sees text on the page
    _, rel = max_errors(compiled.run(**inputs), want)
    assert rel <= 1e-4
