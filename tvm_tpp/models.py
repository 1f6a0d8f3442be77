"""Bundled example networks, built offline as ONNX models with seeded random weights.

These networks are written here with :mod:`onnx.helper` (each shaped by its config class):

- ``"mlp"``: MatMul+Add+Relu layers with one Gemm(transB=1) layer (512 -> 1024 -> 1024 -> 512);
- ``"resnet_small"``: a ResNet-style CNN (conv stem, basic residual blocks, global average pool,
  Gemm classifier) on 3x64x64 images;
- ``"bert"``: one BERT-base encoder layer (hidden 768, 12 heads, FFN 3072, sequence 128) on
  float32 hidden states, with an Erf-based GELU and opset-17 LayerNormalization;
- ``"mobilenet_v2"``: MobileNetV2's inverted residual blocks (1x1 expansion, 3x3 depthwise,
  1x1 projection, ReLU6, residual adds), scaled down, on 3x96x96 images;
- ``"seg_head"``: a DeepLab-style segmentation head (dilated 3x3 convs, concat);
- ``"efficientnet"``: EfficientNet-B0's MBConv blocks (depthwise 3x3/5x5, SiLU,
  squeeze-excite), scaled down;
- ``"inception"``: GoogLeNet's Inception blocks (parallel 1x1, 3x3, 5x5 or factorized 1x7/7x1,
  and pooled branches concatenated on channels), scaled down;
- ``"gpt2"``: one GPT-2 small decoder layer (pre-LayerNorm, fused QKV projection, causal
  self-attention, tanh-GELU MLP) on float32 hidden states.

The others are the real architectures the ``onnx`` wheel ships as
``onnx/backend/test/data/light/light_<name>.onnx`` (resnet50, squeezenet, vgg19, ...).  Every weight
there is ``ConstantOfShape(shape, value=0.02)`` (bar a few pretrained leftovers), so their outputs
are constant; :func:`load` replaces every weight with a seeded random initializer chosen by the
op that consumes it (He for Conv/Gemm weights, BN scale U(0.8, 1.2), variance U(0.5, 1.5),
mean/biases N(0, 0.05)), drops the final Softmax (so logits are compared; resnet50's softmax
saturates otherwise) and sets the batch size.

Only onnx and numpy are used: importing this module does not import tvm.

Examples
--------
>>> model = load("mlp", batch=4, seed=0)
>>> input_shapes(model)
{'x': (4, 512)}
>>> {k: v.shape for k, v in random_inputs(model, seed=1).items()}
{'x': (4, 512)}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "BertConfig",
    "EfficientNetConfig",
    "Gpt2Config",
    "InceptionConfig",
    "MlpConfig",
    "MobileNetConfig",
    "ResNetConfig",
    "SegHeadConfig",
    "input_shapes",
    "load",
    "names",
    "random_inputs",
    "symbolic_batch",
]

_LIGHT_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
# Opset 17 is the first with LayerNormalization; IR 8 is the lowest IR that admits opset 17, which
# keeps the models readable by older onnx/onnxruntime releases than the installed one.
_OPSET = 17
_IR_VERSION = 8
# The light models are opset 9, IR 3; IR 4 is the first that lets initializers not be inputs.
_LIGHT_IR_VERSION = 4
# Upper bound (exclusive) of the token ids random_inputs draws for integer inputs.
_TOKEN_HIGH = 100

_Message = TypeVar("_Message", onnx.NodeProto, onnx.ValueInfoProto)


@dataclass(frozen=True)
class MlpConfig:
    """Layer widths of ``"mlp"``; layer ``gemm_layer`` is a Gemm(transB=1), the others MatMul+Add.

    Every layer but the last is followed by Relu.

    Examples
    --------
    >>> MlpConfig(dims=(64, 32, 10), gemm_layer=0).dims
    (64, 32, 10)
    """

    dims: tuple[int, ...] = (512, 1024, 1024, 512)
    gemm_layer: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", tuple(self.dims))
        if len(self.dims) < 2 or not all(_is_pos_int(d) for d in self.dims):
            raise ValueError(f"dims must be >= 2 positive ints, got {self.dims!r}")
        if not isinstance(self.gemm_layer, int) or not 0 <= self.gemm_layer < len(self.dims) - 1:
            raise ValueError(
                f"gemm_layer must index one of the {len(self.dims) - 1} layers, "
                f"got {self.gemm_layer!r}"
            )


@dataclass(frozen=True)
class ResNetConfig:
    """Shape of ``"resnet_small"``: square input size, stage widths, classifier classes.

    The stem is a stride-2 3x3 conv to ``widths[0]``; stage ``i`` is one basic block to
    ``widths[i]``, with stride 2 and a 1x1 projection shortcut for every stage after the first.

    Examples
    --------
    >>> ResNetConfig(image=32, widths=(16, 32)).widths
    (16, 32)
    """

    image: int = 64
    widths: tuple[int, ...] = (32, 64, 128)
    classes: int = 10

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", tuple(self.widths))
        if not self.widths or not all(_is_pos_int(w) for w in self.widths):
            raise ValueError(f"widths must be >= 1 positive ints, got {self.widths!r}")
        if not _is_pos_int(self.image) or self.image < 2 ** len(self.widths):
            raise ValueError(
                f"image must be an int >= 2**len(widths) = {2 ** len(self.widths)}, "
                f"got {self.image!r}"
            )
        if not _is_pos_int(self.classes):
            raise ValueError(f"classes must be a positive int, got {self.classes!r}")


def _check_inverted_residuals(cfg: Any, fields: str) -> None:
    """The checks MobileNetConfig and EfficientNetConfig share: positive sizes, ``blocks`` as
    tuples of positive ints named by ``fields`` (an odd last one where it names a kernel),
    and an image no smaller than the total stride.  Normalizes ``blocks`` to tuples."""
    object.__setattr__(cfg, "blocks", tuple(tuple(b) for b in cfg.blocks))
    for name in ("image", "stem", "head", "classes"):
        if not _is_pos_int(getattr(cfg, name)):
            raise ValueError(f"{name} must be a positive int, got {getattr(cfg, name)!r}")
    width, kernel = fields.count(",") + 1, "kernel" in fields
    if not cfg.blocks or not all(len(b) == width and all(_is_pos_int(v) for v in b)
                                 and (not kernel or b[-1] % 2) for b in cfg.blocks):
        raise ValueError(f"blocks must be {fields} tuples of positive ints, got {cfg.blocks!r}")
    strides = 2 * math.prod(b[3] for b in cfg.blocks)
    if cfg.image < strides:
        raise ValueError(f"image must be >= the total stride {strides}, got {cfg.image}")


@dataclass(frozen=True)
class MobileNetConfig:
    """Shape of ``"mobilenet_v2"``: MobileNetV2's inverted residual blocks, scaled down.

    A stride-2 3x3 stem to ``stem`` channels, then per ``(expansion, channels, repeats,
    stride)`` of ``blocks`` that many inverted residuals (1x1 expansion, 3x3 depthwise with the
    stride on the first, 1x1 projection; ReLU6 after the first two; a residual add where shape
    allows), a 1x1 conv to ``head`` channels, global average pooling and a Gemm classifier.

    Examples
    --------
    >>> MobileNetConfig(image=32, blocks=((1, 8, 1, 1),)).blocks
    ((1, 8, 1, 1),)
    """

    image: int = 96
    stem: int = 16
    blocks: tuple[tuple[int, int, int, int], ...] = (
        (1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 2, 2), (6, 64, 2, 2))
    head: int = 256
    classes: int = 10

    def __post_init__(self) -> None:
        _check_inverted_residuals(self, "(expansion, channels, repeats, stride)")


@dataclass(frozen=True)
class EfficientNetConfig:
    """Shape of ``"efficientnet"``: EfficientNet-B0's MBConv blocks, scaled down.

    A stride-2 3x3 stem to ``stem`` channels, then per ``(expansion, channels, repeats,
    stride, kernel)`` of ``blocks`` that many MBConv blocks: 1x1 expansion, a ``kernel`` x
    ``kernel`` depthwise conv (the stride on the first), squeeze-excite (global average pool,
    1x1 reduction to a quarter of the block's input channels, SiLU, 1x1 expansion, sigmoid,
    channel-wise multiply), 1x1 projection, a residual add where shape allows; BatchNorm after
    every conv and SiLU (``x * sigmoid(x)``) after all but the projection; a 1x1 head conv to
    ``head``, global average pooling and a Gemm classifier.

    Examples
    --------
    >>> EfficientNetConfig(image=32, blocks=((1, 8, 1, 1, 3),)).blocks
    ((1, 8, 1, 1, 3),)
    """

    image: int = 96
    stem: int = 16
    blocks: tuple[tuple[int, int, int, int, int], ...] = (
        (1, 16, 1, 1, 3), (6, 24, 2, 2, 3), (6, 40, 2, 2, 5), (6, 80, 2, 2, 3))
    head: int = 320
    classes: int = 10

    def __post_init__(self) -> None:
        _check_inverted_residuals(self, "(expansion, channels, repeats, stride, odd kernel)")


@dataclass(frozen=True)
class SegHeadConfig:
    """Shape of ``"seg_head"``: a DeepLab-style segmentation head on a small backbone.

    Two stride-2 3x3 conv-BN-ReLU stages to ``width`` channels, then the atrous spatial
    pyramid: a 1x1 conv and a 3x3 conv per dilation ``rates`` (each BN-ReLU to ``width``), the
    image-level branch (global average pooling, 1x1 conv, ReLU, broadcast back by a
    multiplication with ones), their concatenation, a 1x1 projection and the per-pixel
    classifier (1x1 conv to ``classes``).

    Examples
    --------
    >>> SegHeadConfig(image=32, rates=(2, 4)).rates
    (2, 4)
    """

    image: int = 64
    width: int = 64
    rates: tuple[int, ...] = (6, 12, 18)
    classes: int = 21

    def __post_init__(self) -> None:
        object.__setattr__(self, "rates", tuple(self.rates))
        for name in ("image", "width", "classes"):
            if not _is_pos_int(getattr(self, name)):
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if not self.rates or not all(_is_pos_int(r) for r in self.rates):
            raise ValueError(f"rates must be >= 1 positive ints, got {self.rates!r}")
        if self.image % 4:
            raise ValueError(f"image must be a multiple of 4 (two stride-2 stages), "
                             f"got {self.image}")


@dataclass(frozen=True)
class InceptionConfig:
    """Shape of ``"inception"``: GoogLeNet's Inception blocks (Inception-v3's factorized 7x7
    optionally), scaled down.

    A stride-2 3x3 stem conv to ``stem`` channels and a stride-2 3x3 max-pool, then per
    ``(1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool projection)`` output channels of ``blocks``
    (GoogLeNet's table) an Inception block, after a stride-2 3x3 max-pool for every block but
    the first: four parallel branches (a 1x1 conv; a 1x1 reduction then a 3x3 conv; a 1x1
    reduction then a 5x5 conv, or with ``factorized`` a 1x7 then a 7x1 conv as Inception-v3
    factorizes large kernels; a stride-1 3x3 max-pool then a 1x1 projection) concatenated on
    channels; every conv BatchNorm-ReLU.  Global average pooling and a Gemm classifier.

    Examples
    --------
    >>> InceptionConfig(image=16, blocks=((4, 4, 8, 2, 4, 4),), factorized=True).blocks
    ((4, 4, 8, 2, 4, 4),)
    """

    image: int = 64
    stem: int = 32
    blocks: tuple[tuple[int, int, int, int, int, int], ...] = (
        (16, 24, 32, 4, 8, 8), (32, 32, 48, 8, 24, 16), (48, 24, 52, 4, 12, 16))
    factorized: bool = False
    classes: int = 10

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple(tuple(b) for b in self.blocks))
        for name in ("image", "stem", "classes"):
            if not _is_pos_int(getattr(self, name)):
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if not self.blocks or not all(len(b) == 6 and all(_is_pos_int(v) for v in b)
                                      for b in self.blocks):
            raise ValueError("blocks must be (1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool "
                             f"projection) tuples of positive ints, got {self.blocks!r}")
        if not isinstance(self.factorized, bool):
            raise ValueError(f"factorized must be a bool, got {self.factorized!r}")
        strides = 2 ** (len(self.blocks) + 1)  # stem conv, stem pool, one pool per later block
        if self.image < strides:
            raise ValueError(f"image must be >= the total stride {strides}, got {self.image}")


@dataclass(frozen=True)
class BertConfig:
    """Shape of ``"bert"``, one encoder layer; defaults are BERT-base.

    Examples
    --------
    >>> BertConfig(seq=64, hidden=256, heads=4, ffn=1024).head_dim
    64
    """

    seq: int = 128
    hidden: int = 768
    heads: int = 12
    ffn: int = 3072
    eps: float = 1e-12

    def __post_init__(self) -> None:
        _check_transformer(self)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class Gpt2Config:
    """Shape of ``"gpt2"``, one pre-LayerNorm decoder layer; defaults are GPT-2 small's.

    ``gelu`` is the MLP's activation as exporters spell it out: ``"tanh"``, GPT-2's
    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, or ``"erf"``, the exact
    ``x (1 + erf(x / sqrt 2)) 0.5``.  ``mask`` is how the causal mask reaches the scores:
    ``"where"``, ``Where(tril, scores, float32 min)`` as Hugging Face's GPT-2 exports it, or
    ``"add"``, an added constant that is 0 on and below the diagonal and -1e4 above.

    Examples
    --------
    >>> Gpt2Config(seq=16, hidden=64, heads=4, ffn=256, gelu="erf").head_dim
    16
    """

    seq: int = 128
    hidden: int = 768
    heads: int = 12
    ffn: int = 3072
    gelu: str = "tanh"
    mask: str = "where"
    eps: float = 1e-5

    def __post_init__(self) -> None:
        _check_transformer(self)
        if self.gelu not in ("tanh", "erf"):
            raise ValueError(f"gelu must be 'tanh' or 'erf', got {self.gelu!r}")
        if self.mask not in ("where", "add"):
            raise ValueError(f"mask must be 'where' or 'add', got {self.mask!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _check_transformer(cfg: Any) -> None:
    """The checks BertConfig and Gpt2Config share: positive sizes, whole heads, eps > 0."""
    for name in ("seq", "hidden", "heads", "ffn"):
        if not _is_pos_int(getattr(cfg, name)):
            raise ValueError(f"{name} must be a positive int, got {getattr(cfg, name)!r}")
    if cfg.hidden % cfg.heads:
        raise ValueError(f"hidden ({cfg.hidden}) must be a multiple of heads ({cfg.heads})")
    if not cfg.eps > 0:
        raise ValueError(f"eps must be > 0, got {cfg.eps!r}")


def _is_pos_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


class _Graph:
    """Accumulates nodes and seeded random initializers for one hand-written model."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def he(self, name: str, shape: Sequence[int], fan_in: int) -> str:
        return self.const(name, _he(self.rng, shape, fan_in))

    def normal(self, name: str, shape: Sequence[int], std: float) -> str:
        return self.const(name, self.rng.standard_normal(shape, dtype=np.float32) * np.float32(std))

    def uniform(self, name: str, shape: Sequence[int], low: float, high: float) -> str:
        return self.const(name, self.rng.uniform(low, high, shape).astype(np.float32))

    def op(self, op_type: str, inputs: Sequence[str], out: str, **attrs: Any) -> str:
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def model(
        self, name: str, x: tuple[str, tuple[int, ...]], y: tuple[str, tuple[int, ...]]
    ) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            name,
            [helper.make_tensor_value_info(x[0], TensorProto.FLOAT, x[1])],
            [helper.make_tensor_value_info(y[0], TensorProto.FLOAT, y[1])],
            initializer=self.inits,
        )
        return helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", _OPSET)],
            ir_version=_IR_VERSION,
            producer_name="tvm_tpp.models",
        )


def _build_mlp(cfg: MlpConfig, batch: int, rng: np.random.Generator) -> onnx.ModelProto:
    g = _Graph(rng)
    h = "x"
    last = len(cfg.dims) - 2
    for i, (k, n) in enumerate(zip(cfg.dims[:-1], cfg.dims[1:], strict=True)):
        out = "y" if i == last else f"fc{i}"
        b = g.normal(f"fc{i}.bias", (n,), 0.05)
        if i == cfg.gemm_layer:
            h = g.op("Gemm", [h, g.he(f"fc{i}.weight", (n, k), k), b], out, transB=1)
        else:
            w = g.he(f"fc{i}.weight", (k, n), k)
            h = g.op("Add", [g.op("MatMul", [h, w], f"fc{i}.matmul"), b], out)
        if i < last:
            h = g.op("Relu", [h], f"fc{i}.relu")
    return g.model("mlp", ("x", (batch, cfg.dims[0])), ("y", (batch, cfg.dims[-1])))


def _conv_bn(g: _Graph, x: str, name: str, cin: int, cout: int, k: int | tuple[int, int],
             stride: int = 1, groups: int = 1, dilation: int = 1) -> str:
    """A ``k x k`` conv (``kh x kw`` for a pair; He-initialized, padded to keep the size at
    stride 1) and an inference BatchNorm of seeded statistics: every bundled CNN's layer
    before its activation."""
    kh, kw = (k, k) if isinstance(k, int) else k
    w = g.he(f"{name}.weight", (cout, cin // groups, kh, kw), cin // groups * kh * kw)
    attrs = {"group": groups} if groups > 1 else {}
    if dilation > 1:
        attrs["dilations"] = [dilation] * 2
    pads = [dilation * (kh // 2), dilation * (kw // 2)] * 2  # ONNX: begins, then ends
    y = g.op("Conv", [x, w], name, kernel_shape=[kh, kw], strides=[stride, stride], pads=pads,
             **attrs)
    bn = [
        g.uniform(f"{name}.bn.scale", (cout,), 0.8, 1.2),
        g.normal(f"{name}.bn.bias", (cout,), 0.05),
        g.normal(f"{name}.bn.mean", (cout,), 0.05),
        g.uniform(f"{name}.bn.var", (cout,), 0.5, 1.5),
    ]
    return g.op("BatchNormalization", [y, *bn], f"{name}.bn", epsilon=1e-5)


def _build_mobilenet_v2(cfg: MobileNetConfig, batch: int, rng: np.random.Generator
                        ) -> onnx.ModelProto:
    g = _Graph(rng)
    low, high = g.const("relu6.min", np.float32(0)), g.const("relu6.max", np.float32(6))

    def conv(x: str, name: str, cin: int, cout: int, k: int, stride: int = 1,
             groups: int = 1, act: bool = True) -> str:
        y = _conv_bn(g, x, name, cin, cout, k, stride, groups)
        return g.op("Clip", [y, low, high], f"{name}.relu6") if act else y

    blocks = tuple((*block, 3) for block in cfg.blocks)  # 3x3 depthwise convs throughout
    return _inverted_residual_net(g, "mobilenet_v2", conv, blocks, cfg, batch)


def _inverted_residual_net(
    g: _Graph, name: str, conv: Callable[..., str],
    blocks: Sequence[tuple[int, int, int, int, int]], cfg: MobileNetConfig | EfficientNetConfig,
    batch: int, excite: Callable[[str, str, int, int], str] | None = None,
) -> onnx.ModelProto:
    """MobileNetV2's skeleton, which EfficientNet shares: a stride-2 3x3 stem, per ``(expansion,
    channels, repeats, stride, kernel)`` block that many inverted residuals (1x1 expansion,
    depthwise conv, ``excite(y, name, channels, squeezed)`` if given, 1x1 projection without
    activation, a residual add where shape allows), a 1x1 head conv, global average pooling
    and a Gemm classifier.  ``conv(x, name, cin, cout, k, stride=1, groups=1, act=True)``
    is the network's conv + BatchNorm + activation."""
    h = conv("x", "stem", 3, cfg.stem, 3, 2)
    cin = cfg.stem
    for i, (expansion, cout, repeats, first_stride, k) in enumerate(blocks):
        for j in range(repeats):
            block, stride, hidden = f"block{i}.{j}", first_stride if j == 0 else 1, cin * expansion
            y = h if expansion == 1 else conv(h, f"{block}.expand", cin, hidden, 1)
            y = conv(y, f"{block}.depthwise", hidden, hidden, k, stride, groups=hidden)
            if excite is not None:
                y = excite(y, f"{block}.se", hidden, max(1, cin // 4))
            y = conv(y, f"{block}.project", hidden, cout, 1, act=False)
            h = g.op("Add", [h, y], f"{block}.add") if stride == 1 and cin == cout else y
            cin = cout
    h = conv(h, "head", cin, cfg.head, 1)
    h = g.op("Flatten", [g.op("GlobalAveragePool", [h], "pool")], "flatten", axis=1)
    w = g.he("fc.weight", (cfg.classes, cfg.head), cfg.head)
    g.op("Gemm", [h, w, g.normal("fc.bias", (cfg.classes,), 0.05)], "y", transB=1)
    return g.model(name, ("x", (batch, 3, cfg.image, cfg.image)), ("y", (batch, cfg.classes)))


def _build_efficientnet(cfg: EfficientNetConfig, batch: int, rng: np.random.Generator
                        ) -> onnx.ModelProto:
    g = _Graph(rng)

    def silu(x: str) -> str:
        return g.op("Mul", [x, g.op("Sigmoid", [x], f"{x}.sigmoid")], f"{x}.silu")

    def conv(x: str, name: str, cin: int, cout: int, k: int, stride: int = 1, groups: int = 1,
             act: bool = True) -> str:
        y = _conv_bn(g, x, name, cin, cout, k, stride, groups)
        return silu(y) if act else y

    def squeeze_excite(x: str, name: str, channels: int, squeezed: int) -> str:
        s = g.op("GlobalAveragePool", [x], f"{name}.pool")
        w1 = g.he(f"{name}.reduce.weight", (squeezed, channels, 1, 1), channels)
        s = silu(g.op("Conv", [s, w1, g.normal(f"{name}.reduce.bias", (squeezed,), 0.05)],
                      f"{name}.reduce", kernel_shape=[1, 1]))
        w2 = g.he(f"{name}.expand.weight", (channels, squeezed, 1, 1), squeezed)
        s = g.op("Conv", [s, w2, g.normal(f"{name}.expand.bias", (channels,), 0.05)],
                 f"{name}.expand", kernel_shape=[1, 1])
        return g.op("Mul", [x, g.op("Sigmoid", [s], f"{name}.gate")], f"{name}.scale")

    return _inverted_residual_net(g, "efficientnet", conv, cfg.blocks, cfg, batch,
                                  squeeze_excite)


def _build_seg_head(cfg: SegHeadConfig, batch: int, rng: np.random.Generator
                    ) -> onnx.ModelProto:
    g = _Graph(rng)
    w, side = cfg.width, cfg.image // 4

    def conv(x: str, name: str, cin: int, cout: int, k: int, stride: int = 1,
             dilation: int = 1) -> str:
        y = _conv_bn(g, x, name, cin, cout, k, stride, dilation=dilation)
        return g.op("Relu", [y], f"{name}.relu")

    h = conv(conv("x", "stem1", 3, w // 2, 3, 2), "stem2", w // 2, w, 3, 2)
    branches = [conv(h, "aspp.1x1", w, w, 1)]
    branches += [conv(h, f"aspp.rate{r}", w, w, 3, dilation=r) for r in cfg.rates]
    pooled = conv(g.op("GlobalAveragePool", [h], "aspp.pool"), "aspp.image", w, w, 1)
    ones = g.const("aspp.ones", np.ones((1, 1, side, side), np.float32))
    branches.append(g.op("Mul", [pooled, ones], "aspp.broadcast"))
    h = g.op("Concat", branches, "aspp.concat", axis=1)
    h = conv(h, "project", w * len(branches), w, 1)
    classes = g.he("classifier.weight", (cfg.classes, w, 1, 1), w)
    g.op("Conv", [h, classes, g.normal("classifier.bias", (cfg.classes,), 0.05)], "y",
         kernel_shape=[1, 1])
    return g.model("seg_head", ("x", (batch, 3, cfg.image, cfg.image)),
                   ("y", (batch, cfg.classes, side, side)))


def _build_resnet_small(cfg: ResNetConfig, batch: int, rng: np.random.Generator) -> onnx.ModelProto:
    g = _Graph(rng)
    h = g.op("Relu", [_conv_bn(g, "x", "stem", 3, cfg.widths[0], 3, 2)], "stem.relu")
    cin = cfg.widths[0]
    for i, cout in enumerate(cfg.widths):
        stride = 1 if i == 0 else 2
        p = f"block{i}"
        r = g.op("Relu", [_conv_bn(g, h, f"{p}.conv1", cin, cout, 3, stride)], f"{p}.relu1")
        r = _conv_bn(g, r, f"{p}.conv2", cout, cout, 3, 1)
        shortcut = h
        if stride != 1 or cin != cout:
            shortcut = _conv_bn(g, h, f"{p}.proj", cin, cout, 1, stride)
        h = g.op("Relu", [g.op("Add", [r, shortcut], f"{p}.add")], f"{p}.relu")
        cin = cout
    h = g.op("Flatten", [g.op("GlobalAveragePool", [h], "pool")], "flatten", axis=1)
    w = g.he("fc.weight", (cfg.classes, cin), cin)
    b = g.normal("fc.bias", (cfg.classes,), 0.05)
    g.op("Gemm", [h, w, b], "y", transB=1)
    return g.model(
        "resnet_small", ("x", (batch, 3, cfg.image, cfg.image)), ("y", (batch, cfg.classes))
    )


def _build_inception(cfg: InceptionConfig, batch: int, rng: np.random.Generator
                     ) -> onnx.ModelProto:
    g = _Graph(rng)

    def conv(x: str, name: str, cin: int, cout: int, k: int | tuple[int, int],
             stride: int = 1) -> str:
        return g.op("Relu", [_conv_bn(g, x, name, cin, cout, k, stride)], f"{name}.relu")

    def max_pool(x: str, name: str, stride: int) -> str:
        return g.op("MaxPool", [x], name, kernel_shape=[3, 3], strides=[stride, stride],
                    pads=[1, 1, 1, 1])

    h = max_pool(conv("x", "stem", 3, cfg.stem, 3, 2), "stem.pool", 2)
    cin = cfg.stem
    for i, (c1, r3, c3, r5, c5, proj) in enumerate(cfg.blocks):
        p = f"block{i}"
        if i:
            h = max_pool(h, f"{p}.downsample", 2)
        wide = conv(h, f"{p}.5x5.reduce", cin, r5, 1)
        if cfg.factorized:
            wide = conv(conv(wide, f"{p}.1x7", r5, c5, (1, 7)), f"{p}.7x1", c5, c5, (7, 1))
        else:
            wide = conv(wide, f"{p}.5x5", r5, c5, 5)
        branches = [
            conv(h, f"{p}.1x1", cin, c1, 1),
            conv(conv(h, f"{p}.3x3.reduce", cin, r3, 1), f"{p}.3x3", r3, c3, 3),
            wide,
            conv(max_pool(h, f"{p}.pool", 1), f"{p}.pool.proj", cin, proj, 1),
        ]
        h, cin = g.op("Concat", branches, f"{p}.concat", axis=1), c1 + c3 + c5 + proj
    h = g.op("Flatten", [g.op("GlobalAveragePool", [h], "pool")], "flatten", axis=1)
    w = g.he("fc.weight", (cfg.classes, cin), cin)
    g.op("Gemm", [h, w, g.normal("fc.bias", (cfg.classes,), 0.05)], "y", transB=1)
    return g.model("inception", ("x", (batch, 3, cfg.image, cfg.image)),
                   ("y", (batch, cfg.classes)))


class _Transformer:
    """A transformer layer's parts in a graph: dense layers with BERT's and GPT-2's
    initializer (N(0, 0.02) weights), LayerNorm over ``hidden`` features."""

    def __init__(self, g: _Graph, hidden: int, eps: float) -> None:
        self.g, self.hidden, self.eps = g, hidden, eps

    def dense(self, x: str, name: str, k: int, n: int) -> str:
        g = self.g
        w = g.normal(f"{name}.weight", (k, n), 0.02)
        return g.op(
            "Add",
            [g.op("MatMul", [x, w], f"{name}.matmul"), g.normal(f"{name}.bias", (n,), 0.05)],
            name,
        )

    def layer_norm(self, x: str, name: str) -> str:
        g = self.g
        gamma = g.uniform(f"{name}.gamma", (self.hidden,), 0.8, 1.2)
        beta = g.normal(f"{name}.beta", (self.hidden,), 0.05)
        return g.op("LayerNormalization", [x, gamma, beta], name, axis=-1, epsilon=self.eps)


class _Heads:
    """Multi-head attention's reshapes: ``[b, s, hidden]`` into heads and back."""

    def __init__(self, g: _Graph, b: int, s: int, heads: int, head_dim: int) -> None:
        self.g, self.head_dim = g, head_dim
        self.heads_shape = g.const("heads_shape", np.array([b, s, heads, head_dim], np.int64))
        self.hidden_shape = g.const("hidden_shape", np.array([b, s, heads * head_dim], np.int64))

    def split(self, x: str, name: str, perm: list[int]) -> str:
        g = self.g
        return g.op(
            "Transpose", [g.op("Reshape", [x, self.heads_shape], f"{name}.split")], name,
            perm=perm,
        )

    def attend(self, q: str, k: str, v: str, mask: Callable[[str], str] | None = None) -> str:
        """``softmax(mask(q k / sqrt d)) v`` of q ``[b, nh, s, d]``, k ``[b, nh, d, s]`` and
        v ``[b, nh, s, d]``, back in ``[b, s, hidden]``."""
        g = self.g
        scores = g.op("Div", [g.op("MatMul", [q, k], "qk"),
                              g.const("sqrt_d", np.float32(math.sqrt(self.head_dim)))],
                      "scores")
        probs = g.op("Softmax", [mask(scores) if mask else scores], "probs", axis=-1)
        ctx = g.op("Transpose", [g.op("MatMul", [probs, v], "ctx.heads")], "ctx.t",
                   perm=[0, 2, 1, 3])
        return g.op("Reshape", [ctx, self.hidden_shape], "ctx")


def _build_bert(cfg: BertConfig, batch: int, rng: np.random.Generator) -> onnx.ModelProto:
    g = _Graph(rng)
    b, s, hid, nh, d = batch, cfg.seq, cfg.hidden, cfg.heads, cfg.head_dim
    f32 = np.float32
    layers = _Transformer(g, hid, cfg.eps)
    dense, layer_norm = layers.dense, layers.layer_norm

    heads = _Heads(g, b, s, nh, d)
    x = "hidden_states"
    q = heads.split(dense(x, "query", hid, hid), "q", [0, 2, 1, 3])  # [b, nh, s, d]
    k = heads.split(dense(x, "key", hid, hid), "k", [0, 2, 3, 1])  # [b, nh, d, s]
    v = heads.split(dense(x, "value", hid, hid), "v", [0, 2, 1, 3])  # [b, nh, s, d]
    attn = dense(heads.attend(q, k, v), "attn_out", hid, hid)
    h1 = layer_norm(g.op("Add", [attn, x], "attn_residual"), "attn_ln")

    inter = dense(h1, "ffn_in", hid, cfg.ffn)
    # Erf GELU, x * (1 + erf(x / sqrt 2)) * 0.5, as exporters emit it: Gelu itself is opset 20.
    sqrt2, one, half = (
        g.const("sqrt2", f32(math.sqrt(2.0))),
        g.const("one", f32(1)),
        g.const("half", f32(0.5)),
    )
    erf = g.op("Erf", [g.op("Div", [inter, sqrt2], "gelu.div")], "gelu.erf")
    gelu = g.op("Mul", [inter, g.op("Add", [erf, one], "gelu.add")], "gelu.mul")
    gelu = g.op("Mul", [gelu, half], "gelu")
    out = dense(gelu, "ffn_out", cfg.ffn, hid)
    layer_norm(g.op("Add", [out, h1], "ffn_residual"), "y")
    return g.model("bert", ("hidden_states", (b, s, hid)), ("y", (b, s, hid)))


def _build_gpt2(cfg: Gpt2Config, batch: int, rng: np.random.Generator) -> onnx.ModelProto:
    g = _Graph(rng)
    b, s, hid, nh, d = batch, cfg.seq, cfg.hidden, cfg.heads, cfg.head_dim
    f32 = np.float32
    layers = _Transformer(g, hid, cfg.eps)
    dense, layer_norm = layers.dense, layers.layer_norm

    def gelu(x: str) -> str:
        if cfg.gelu == "erf":
            erf = g.op("Erf", [g.op("Div", [x, g.const("sqrt2", f32(math.sqrt(2.0)))],
                                    "gelu.div")], "gelu.erf")
            y = g.op("Mul", [x, g.op("Add", [erf, g.const("one", f32(1))], "gelu.add")],
                     "gelu.mul")
            return g.op("Mul", [y, g.const("half", f32(0.5))], "gelu")
        # Hugging Face's NewGELUActivation, op for op as torch.onnx exports it.
        cube = g.op("Pow", [x, g.const("three", f32(3))], "gelu.pow")
        inner = g.op("Add", [x, g.op("Mul", [cube, g.const("coef", f32(0.044715))],
                                     "gelu.cubic")], "gelu.inner")
        z = g.op("Mul", [inner, g.const("sqrt_2_pi", f32(math.sqrt(2 / math.pi)))], "gelu.z")
        one_plus = g.op("Add", [g.op("Tanh", [z], "gelu.tanh"), g.const("one", f32(1))],
                        "gelu.add")
        return g.op("Mul", [g.op("Mul", [x, g.const("half", f32(0.5))], "gelu.half"), one_plus],
                    "gelu")

    def mask(scores: str) -> str:
        causal = np.tril(np.ones((1, 1, s, s), bool))
        if cfg.mask == "where":
            return g.op("Where", [g.const("causal", causal), scores,
                                  g.const("mask_value", f32(np.finfo(f32).min))], "masked")
        return g.op("Add", [scores, g.const("causal_bias", np.where(causal, 0, -1e4)
                                            .astype(f32))], "masked")

    heads = _Heads(g, b, s, nh, d)
    x = "hidden_states"
    qkv = dense(layer_norm(x, "ln_1"), "c_attn", hid, 3 * hid)  # GPT-2's fused projection
    splits = [f"{name}.proj" for name in "qkv"]
    g.nodes.append(helper.make_node("Split", [qkv, g.const("qkv_split", np.full(3, hid))],
                                    splits, name="qkv_split", axis=-1))
    q = heads.split(splits[0], "q", [0, 2, 1, 3])  # [b, nh, s, d]
    k = heads.split(splits[1], "k", [0, 2, 3, 1])  # [b, nh, d, s]
    v = heads.split(splits[2], "v", [0, 2, 1, 3])  # [b, nh, s, d]
    h1 = g.op("Add", [x, dense(heads.attend(q, k, v, mask), "c_proj", hid, hid)],
              "attn_residual")
    out = dense(gelu(dense(layer_norm(h1, "ln_2"), "mlp.c_fc", hid, cfg.ffn)), "mlp.c_proj",
                cfg.ffn, hid)
    g.op("Add", [h1, out], "y")
    return g.model("gpt2", ("hidden_states", (b, s, hid)), ("y", (b, s, hid)))


_BUILTIN: dict[str, tuple[type, Callable[..., onnx.ModelProto]]] = {
    "mlp": (MlpConfig, _build_mlp),
    "resnet_small": (ResNetConfig, _build_resnet_small),
    "bert": (BertConfig, _build_bert),
    "mobilenet_v2": (MobileNetConfig, _build_mobilenet_v2),
    "seg_head": (SegHeadConfig, _build_seg_head),
    "efficientnet": (EfficientNetConfig, _build_efficientnet),
    "inception": (InceptionConfig, _build_inception),
    "gpt2": (Gpt2Config, _build_gpt2),
}

# (consumer op, input index) -> how a light model's weight is initialised.
_LIGHT_INIT = {
    ("Conv", 1): "he",
    ("Gemm", 1): "he",
    ("Conv", 2): "bias",
    ("Gemm", 2): "bias",
    ("BatchNormalization", 1): "scale",
    ("BatchNormalization", 2): "bias",
    ("BatchNormalization", 3): "bias",  # running mean
    ("BatchNormalization", 4): "var",
    ("Mul", 1): "scale",  # caffe2 Scale layer after BN: Mul(bn, Unsqueeze(scale))
    ("Add", 1): "bias",
}


def _light_names() -> list[str]:
    return sorted(p.stem.removeprefix("light_") for p in _LIGHT_DIR.glob("light_*.onnx"))


def names() -> list[str]:
    """All bundled model names: the hand-written ones, then the onnx wheel's light models.

    Examples
    --------
    >>> names()[:3]
    ['mlp', 'resnet_small', 'bert']
    """
    return [*_BUILTIN, *_light_names()]


def load(name: str, batch: int | str = 1, seed: int = 0, **options: Any) -> onnx.ModelProto:
    """Build bundled model ``name`` for ``batch`` samples with weights drawn from ``seed``.

    Parameters
    ----------
    name
        One of :func:`names`.
    batch
        The first dimension of the input (and of every batch-carrying Reshape); a name
        (e.g. ``"N"``) makes it symbolic, as exporters write a dynamic batch: the model
        then runs at any batch size.
    seed
        Seed of the weights; equal seeds give identical models.
    **options
        Fields of the model's config (:class:`MlpConfig`, :class:`ResNetConfig`,
        :class:`BertConfig`, :class:`MobileNetConfig`, :class:`SegHeadConfig`,
        :class:`EfficientNetConfig`, :class:`InceptionConfig`, :class:`Gpt2Config`); the light
        models take none.

    Returns
    -------
    onnx.ModelProto
        A model that passes ``onnx.checker.check_model`` and has static input shapes.

    Examples
    --------
    >>> model = load("bert", seq=16, hidden=64, heads=4, ffn=128)
    >>> input_shapes(model)
    {'hidden_states': (1, 16, 64)}
    """
    symbolic = batch if isinstance(batch, str) and batch.isidentifier() else None
    if symbolic is None and not _is_pos_int(batch):
        raise ValueError(f"batch must be a positive int or a dimension name, got {batch!r}")
    if symbolic is not None:
        return symbolic_batch(load(name, 1, seed, **options), symbolic)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    rng = np.random.default_rng(seed)
    if name in _BUILTIN:
        config_cls, build = _BUILTIN[name]
        known = {f.name for f in fields(config_cls)}
        if unknown := sorted(set(options) - known):
            raise TypeError(f"model {name!r} has no option(s) {unknown}; known: {sorted(known)}")
        model = build(config_cls(**options), batch, rng)
    elif name in _light_names():
        if options:
            raise TypeError(f"light model {name!r} takes no options, got {sorted(options)}")
        model = _materialize_light(name, batch, rng)
    else:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(names())}")
    onnx.checker.check_model(model)
    return model


def input_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Static shapes of the model's real inputs (graph inputs that are not initializers).

    Raises ValueError if a dimension is symbolic or unknown.

    Examples
    --------
    >>> input_shapes(load("resnet_small", batch=2))
    {'x': (2, 3, 64, 64)}
    """
    shapes = {}
    for vi in _real_inputs(model.graph):
        dims = vi.type.tensor_type.shape.dim
        if not dims or not all(d.HasField("dim_value") and d.dim_value > 0 for d in dims):
            shown = [d.dim_param or d.dim_value or "?" for d in dims]
            raise ValueError(f"input {vi.name!r} has no static shape: {shown}")
        shapes[vi.name] = tuple(d.dim_value for d in dims)
    return shapes


def random_inputs(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random inputs for every real input of ``model``.

    Floating inputs are N(0, 1) (like normalised images or hidden states); integer inputs are
    token ids in ``[0, 100)``.

    Examples
    --------
    >>> random_inputs(load("mlp"), seed=3)["x"].dtype
    dtype('float32')
    """
    rng = np.random.default_rng(seed)
    out = {}
    shapes = input_shapes(model)
    for vi in _real_inputs(model.graph):
        shape = shapes[vi.name]
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))
        if dtype.kind == "f":
            out[vi.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind in "iu":
            out[vi.name] = rng.integers(0, _TOKEN_HIGH, shape).astype(dtype)
        else:
            raise ValueError(f"input {vi.name!r} has unsupported dtype {dtype}")
    return out


def _real_inputs(graph: onnx.GraphProto) -> list[onnx.ValueInfoProto]:
    inits = {t.name for t in graph.initializer}
    return [vi for vi in graph.input if vi.name not in inits]


def symbolic_batch(model: onnx.ModelProto, dim: str = "N") -> onnx.ModelProto:
    """``model``, built for batch 1, with a symbolic batch named ``dim`` as exporters write a
    dynamic batch: the first dimension of its inputs and outputs, and the batch of its
    data-path Reshapes' constant targets (1 there becomes 0: "copy the input's size").

    Examples
    --------
    >>> symbolic_batch(load("mlp")).graph.input[0].type.tensor_type.shape.dim[0].dim_param
    'N'
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    weights = {t.name: t for t in g.initializer}
    for node in g.node:
        target = weights.get(node.input[1]) if node.op_type == "Reshape" else None
        if target is None or node.input[0] in weights:
            continue
        values = numpy_helper.to_array(target).copy()
        if values.size and values[0] == 1:
            values[0] = 0
            node.input[1] = f"{target.name}_any_batch"
            if node.input[1] not in weights:
                weights[node.input[1]] = numpy_helper.from_array(values, node.input[1])
                g.initializer.append(weights[node.input[1]])
    used = {x for node in g.node for x in node.input}
    kept = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(kept)
    for value in (*g.input, *g.output):
        if value.name not in weights:
            value.type.tensor_type.shape.dim[0].dim_param = dim
    del g.value_info[:]
    return out


def _materialize_light(name: str, batch: int, rng: np.random.Generator) -> onnx.ModelProto:
    src = onnx.load(_LIGHT_DIR / f"light_{name}.onnx")
    g = src.graph
    consts = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in g.node:
        for i, x in enumerate(node.input):
            consumers.setdefault(x, []).append((node, i))
    # Every weight is re-drawn: the ConstantOfShape ones, and also the few float initializers
    # (pretrained leftovers such as BN variances down to 1e-44 that do not fit random weights,
    # blow activations up and put denormals into timings).
    shapes = [
        (n.output[0], tuple(int(d) for d in consts[n.input[0]]))
        for n in g.node
        if n.op_type == "ConstantOfShape"
    ]
    shapes += [(k, a.shape) for k, a in consts.items() if a.dtype.kind == "f" and k in consumers]
    weights = {k: _light_weight(rng, k, shape, consumers, consts) for k, shape in shapes}

    nodes = [_copy(n) for n in g.node if n.op_type != "ConstantOfShape"]
    out_name = g.output[0].name
    if nodes[-1].op_type == "Softmax" and list(nodes[-1].output) == [out_name]:
        out_name = nodes.pop().input[0]
    # Data-path Reshapes hard-code batch 1 as their first target dim (weight Reshapes do not).
    for node in nodes:
        if node.op_type == "Reshape" and node.input[0] not in weights and batch != 1:
            target = consts[node.input[1]].copy()
            if target[0] != 1:
                raise ValueError(f"{name}: Reshape {node.name!r} does not start with batch 1")
            target[0] = batch
            node.input[1] = f"{node.input[1]}_batch{batch}"
            consts[node.input[1]] = target
    used = {x for n in nodes for x in n.input}
    shape_inits = [
        numpy_helper.from_array(a, k) for k, a in consts.items() if k in used and k not in weights
    ]
    inputs = [_copy(vi) for vi in _real_inputs(g)]
    for vi in inputs:
        vi.type.tensor_type.shape.dim[0].dim_value = batch

    # Infer the output shape (new batch, dropped Softmax) on a skeleton that declares the weights
    # as typed inputs: inferring on the full model would serialise every weight twice.
    elem_type = g.output[0].type.tensor_type.elem_type
    skeleton = helper.make_graph(
        nodes,
        g.name,
        inputs
        + [
            helper.make_tensor_value_info(k, TensorProto.FLOAT, a.shape) for k, a in weights.items()
        ],
        [helper.make_tensor_value_info(out_name, elem_type, None)],
        initializer=shape_inits,
    )
    ir_version = max(src.ir_version, _LIGHT_IR_VERSION)
    inferred = onnx.shape_inference.infer_shapes(
        helper.make_model(skeleton, opset_imports=src.opset_import, ir_version=ir_version),
        strict_mode=True,
    )
    model = helper.make_model(
        helper.make_graph(nodes, g.name, inputs, inferred.graph.output, initializer=shape_inits),
        opset_imports=src.opset_import,
        ir_version=ir_version,
        producer_name="tvm_tpp.models",
    )
    for k, a in weights.items():
        # Built in place: make_model/extend would copy every weight once more.
        model.graph.initializer.add(
            name=k,
            data_type=TensorProto.FLOAT,
            dims=a.shape,
            raw_data=np.asarray(a, dtype="<f4").tobytes(),
        )
    return model


def _copy(proto: _Message) -> _Message:
    """A detached copy of an onnx message."""
    out = type(proto)()
    out.CopyFrom(proto)
    return out


def _he(rng: np.random.Generator, shape: Sequence[int], fan_in: int) -> np.ndarray:
    """He (Kaiming) uniform init: U(-a, a) with the He-normal variance 2 / fan_in.

    Uniform rather than normal because drawing it is ~3x faster (vgg19 has 144 M weights).
    """
    a = np.float32(math.sqrt(6.0 / fan_in))
    w = rng.random(shape, dtype=np.float32)
    w *= 2 * a
    w -= a
    return w


def _light_weight(
    rng: np.random.Generator,
    name: str,
    shape: tuple[int, ...],
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]],
    inits: dict[str, np.ndarray],
) -> np.ndarray:
    """A random value for ConstantOfShape output ``name``, chosen by the op that really uses it."""
    use_shape = shape
    while True:
        uses = consumers.get(name, [])
        if len(uses) != 1:
            raise ValueError(f"weight {name!r} has {len(uses)} consumers, expected 1")
        node, idx = uses[0]
        if node.op_type == "Reshape" and idx == 0:
            # A weight reshaped before use (inception_v1's classifier): He fan-in of the target.
            target = [
                use_shape[i] if t == 0 else int(t) for i, t in enumerate(inits[node.input[1]])
            ]
            use_shape = np.empty(use_shape, dtype=bool).reshape(target).shape
        elif node.op_type != "Unsqueeze" or idx != 0:
            break
        name = node.output[0]

    kind = _LIGHT_INIT.get((node.op_type, idx))
    if kind == "he":
        trans_b = any(a.name == "transB" and a.i for a in node.attribute)
        fan_in = math.prod(use_shape[1:]) if node.op_type == "Conv" or trans_b else use_shape[0]
        arr = _he(rng, use_shape, fan_in)
    elif kind == "scale":
        arr = rng.uniform(0.8, 1.2, use_shape).astype(np.float32)
    elif kind == "var":
        arr = rng.uniform(0.5, 1.5, use_shape).astype(np.float32)
    elif kind == "bias":
        arr = rng.standard_normal(use_shape, dtype=np.float32) * np.float32(0.05)
    else:
        raise ValueError(f"no initialisation rule for a weight used as {node.op_type} input {idx}")
    return arr.reshape(shape)
