"""The networks of issue 15 whole (float32): each compiles with at least 95 % of its matmul and
conv FLOPs on TPP kernels and matches ONNX Runtime at batch 1 and 8 (normwise 1e-4): an
EfficientNet-B0-style network (depthwise 3x3 and 5x5, SiLU, squeeze-excite's broadcast
multiply), a DeepLab-style head (dilated convs, concat), MobileNetV2 (depthwise, ReLU6), the
ShuffleNet of the ``onnx`` package (grouped convs, channel shuffle, concat), GoogLeNet-style
Inception blocks (parallel 1x1/3x3/5x5 or factorized 1x7-7x1 and pooled branches, concat) and a
GPT-2 decoder layer (fused QKV split into heads, causal mask by Where or by an added bias, tanh
or erf GELU spelled out).  The default suite builds scaled-down variants; the bundled sizes run
in the slow suite."""

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
#: The default suite's batch of each small variant; the other one runs in the slow suite.
DEFAULT_BATCH = {"efficientnet": 8, "seg_head": 1, "mobilenet_v2": 8, "inception": 1, "gpt2": 1,
                 "gpt2-erf-add": 8}
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

