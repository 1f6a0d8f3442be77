"""A built model's layers against ONNX Runtime's on the same ONNX file, in one process.

:func:`compare_layers` times the tpp build per call (:func:`tvm_tpp.profiling.profile_vm`)
and ONNX Runtime per node (its own profiler) in alternating rounds, with the same thread
count, and matches the two by :func:`layer_key`: a convolution by its input, filter, stride
and groups, a dense layer by its ``M x N x K``, a batch matmul of two activations (attention's
``Q K^T`` and ``P V``) by its ``batch x M x N x K`` — what both sides compute, whatever each
fused into it (a bias, an activation, a residual add, a scale); a fused attention kernel by
its batch, queries, keys and Q/K and V widths (no node on the other side has that key); a
dense kernel computing several of their layers at once (Q, K and V) as those layers.
What has no key (pooling, softmax, layout conversions, ONNX Runtime's reorders) is summed
per kind on the tpp side (:data:`tvm_tpp.profiling.KIND_NAMES`) and per operator type on
ONNX Runtime's.

A layer's time is the median over the rounds of its seconds per run, its ratio the median
of the rounds' ratios; ``calls`` counts the layers of that key per run (ResNet-50 has six
``256x14x14 -> 1024 1x1`` convs).  Each side's round starts after a pause and one untimed
run, as ``tvm-tpp bench`` samples: the other runtime's threads spin on after its runs.

Examples
--------
>>> layer_key("tpp_conv2d_1x256x14x14_1024x1x1_s1x1_bias_residual_relu_inplace")
'conv 256x14x14 -> 1024 1x1 s1'
>>> layer_key("tpp_dwconv2d_1x32x56x56_3x3_s2x2_bias")
'conv 32x56x56 -> 32 3x3 s2 g32'
>>> layer_key("tpp_dense_1x1000x2048_bias"), layer_key("fused_transpose_pad")
('dense 1x1000x2048', None)
>>> ort_layer_key("FusedConv", [[1, 256, 14, 14], [1024, 256, 1, 1], [1024]], [[1, 1024, 14, 14]])
'conv 256x14x14 -> 1024 1x1 s1'
>>> ort_layer_key("Gemm", [[1, 2048], [1000, 2048], [1000]], [[1, 1000]])
'dense 1x1000x2048'
>>> layer_key("tpp_qdq_dense_128x3072x768_bias_requantize_u8")
'dense 128x3072x768'
>>> layer_key("tpp_batch_matmul_96x128x128x64_txb12_scale")
'batch matmul 96x128x128x64'
>>> ort_layer_key("MatMul", [[8, 12, 128, 64], [8, 12, 64, 128]], [[8, 12, 128, 128]])
'batch matmul 96x128x128x64'
>>> layer_key("tpp_attention_96x128x128x64x64_txb12_scale_bys12")
'attention 96x128x128x64x64'
>>> ort_layer_key("QLinearConv", [[1, 64, 56, 56], [], [], [256, 64, 1, 1], [256], [256], [], [],
...                               [256]], [[1, 256, 56, 56]])
'conv 64x56x56 -> 256 1x1 s1'
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from .bench.timing import PAUSE_SECONDS
from .profiling import KIND_NAMES, profile_vm
from .reference import onnxruntime_session, openvino_compiled, openvino_request

if TYPE_CHECKING:
    import numpy as np
    import onnx

__all__ = ["AGAINST", "Layer", "LayerComparison", "compare_layers", "layer_key",
           "openvino_layer_key", "ort_layer_key"]

_CONV = re.compile(r"tpp_(dw)?conv2d_\w+?x(\d+)x(\d+)x(\d+)_(?:(\d+)x)?(\d+)x(\d+)_s(\d+)x\d+"
                   r"(?:_d\d+x\d+)?(?:_g(\d+))?")
_DENSE = re.compile(r"tpp_(?:qdq_)?dense_(\w+?)x(\d+)x(\d+)(?:_|$)")
#: A static batch only (a symbolic build's ``n`` names the batch per image).
_BATCH_MATMUL = re.compile(r"tpp_batch_matmul_(\d+)x(\d+)x(\d+)x(\d+)(?:_|$)")
_ATTENTION = re.compile(r"tpp_attention_(\d+)x(\d+)x(\d+)x(\d+)x(\d+)(?:_|$)")
#: ONNX Runtime's operator types of a convolution, with the input its filter is (its int8
#: forms' too: a quantized model's layers meet tpp's int8 kernels).
_ORT_CONVS = {"Conv": 1, "FusedConv": 1, "NhwcFusedConv": 1, "QLinearConv": 3, "ConvInteger": 1}
#: ... and of a dense layer (keyed by A's and Y's shapes alone: B may be transposed), with the
#: input B is (a batch matmul's when it has batch axes too).
_ORT_DENSE = {"Gemm": 1, "FusedGemm": 1, "MatMul": 1, "FusedMatMul": 1, "QGemm": 3,
              "QLinearMatMul": 3, "MatMulInteger": 1, "MatMulIntegerToFloat": 1,
              "DynamicQuantizeMatMul": 1}
#: The widest channel block of ONNX Runtime's NCHWc layout (AVX-512's 16 floats).
_NCHWC_BLOCK = 16


class ConvShape(NamedTuple):
    """What a convolution key names: input channels and map, output channels, filter,
    stride and groups."""

    c: int
    h: int
    w: int
    k: int
    r: int
    s: int
    stride: int
    groups: int

    @property
    def key(self) -> str:
        return (f"conv {self.c}x{self.h}x{self.w} -> {self.k} {self.r}x{self.s} s{self.stride}"
                + (f" g{self.groups}" if self.groups > 1 else ""))

    def padded_to(self, other: ConvShape) -> bool:
        """Whether ``other`` is this conv with its channels rounded up to a block, as ONNX
        Runtime's NCHWc layout runs it (and profiles it) on AVX-512 hosts."""
        same = ("h", "w", "r", "s", "stride")
        return ([getattr(self, f) for f in same] == [getattr(other, f) for f in same]
                and 0 <= other.c - self.c < _NCHWC_BLOCK and 0 <= other.k - self.k < _NCHWC_BLOCK
                and (self.groups == 1) == (other.groups == 1))


def layer_key(name: str) -> str | None:
    """The layer a tpp kernel (by its function name) computes, or None for anything else."""
    if match := _CONV.match(name):
        dw, c, h, w, k, r, s, stride, groups = match.groups()
        if dw:  # depthwise: one filter per channel
            k, groups = c, c
        return ConvShape(*map(int, (c, h, w, k, r, s, stride, groups or 1))).key
    if match := _DENSE.match(name):
        rows, n, k = match.groups()
        return f"dense {rows}x{n}x{k}"
    if match := _BATCH_MATMUL.match(name):
        return "batch matmul {}x{}x{}x{}".format(*match.groups())
    if match := _ATTENTION.match(name):
        return "attention {}x{}x{}x{}x{}".format(*match.groups())
    return None


def _ort_conv(op: str, inputs: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]
              ) -> ConvShape | None:
    weight = _ORT_CONVS.get(op, 0)
    if not (weight and len(inputs) > weight and len(inputs[0]) == 4 and len(inputs[weight]) == 4
            and outputs and len(outputs[0]) == 4):
        return None
    (_, c, h, w), (k, group_c, r, s), (_, _, p, _) = inputs[0], inputs[weight], outputs[0]
    stride = max(1, round(h / p)) if p > 1 else 1  # the profile has no strides
    return ConvShape(c, h, w, k, r, s, stride, c // group_c if group_c else 1)


def ort_layer_key(op: str, inputs: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]
                  ) -> str | None:
    """The layer an ONNX Runtime node computes, from its operator type and its inputs' and
    outputs' shapes (its profile records no attributes), or None."""
    if conv := _ort_conv(op, inputs, outputs):
        return conv.key
    if op in _ORT_DENSE and len(inputs) >= 2 and inputs[0] and outputs and outputs[0]:
        a, y = inputs[0], outputs[0]
        b = inputs[_ORT_DENSE[op]] if len(inputs) > _ORT_DENSE[op] else ()
        if len(a) >= 3 and len(b) >= 3 and len(y) >= 3:  # both operands batched: activations
            m, n = y[-2], y[-1]
            k = a[-1] if a[-2] == m else a[-2]  # FusedMatMul may read A transposed
            return f"batch matmul {math.prod(y[:-2])}x{m}x{n}x{k}"
        return f"dense {math.prod(a[:-1])}x{y[-1]}x{a[-1]}"
    return None


@dataclass(frozen=True)
class Layer:
    """One key's seconds per run on each side (None: that side has no such layer), how many
    layers of that key a run has on each, and ``ratio``: the other runtime's time over tpp's
    (> 1: tpp is faster), the median of the rounds' ratios (a round's two halves run a few
    seconds apart, so drift of the host's load cancels in them)."""

    key: str
    tpp_seconds: float | None
    their_seconds: float | None
    tpp_calls: int
    their_calls: int
    ratio: float | None


@dataclass(frozen=True)
class LayerComparison:
    """Matched layers (slowest on either side first), the unmatched rest per kind, each
    side's median wall time of an unprofiled run and each round's ratio of those (the other
    runtime's over tpp's); ``against`` names that runtime (:data:`AGAINST`)."""

    against: str
    layers: tuple[Layer, ...]
    tpp_run_seconds: float
    their_run_seconds: float
    round_ratios: tuple[float, ...]
    threads: int
    rounds: int
    repeat: int

    @property
    def run_ratio(self) -> float:
        """The median of the rounds' ratios: where the rounds disagree (a noisy host) it can
        differ from the ratio of the two medians, so the rounds' spread is shown beside it."""
        return statistics.median(self.round_ratios)

    def to_json(self) -> dict[str, Any]:
        return {"against": self.against, "layers": [vars(layer) for layer in self.layers],
                "tpp_run_seconds": self.tpp_run_seconds,
                "their_run_seconds": self.their_run_seconds, "run_ratio": self.run_ratio,
                "round_ratios": list(self.round_ratios),
                "threads": self.threads, "rounds": self.rounds, "repeat": self.repeat}


def _model_convs(model: onnx.ModelProto) -> dict[str, list[ConvShape]]:
    """Node name -> the convolutions of ``model`` that node is, or follows within a few
    nodes (the one ONNX Runtime names a conv fused with its BatchNorm, activation or add
    after), with their shapes before ONNX Runtime pads any channels."""
    import onnx

    graph = onnx.shape_inference.infer_shapes(model).graph
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in (*graph.input, *graph.value_info, *graph.output)}
    shapes.update({t.name: list(t.dims) for t in graph.initializer})
    producer = {out: node for node in graph.node for out in node.output}
    found: dict[str, list[ConvShape]] = {}
    for node in graph.node:
        frontier, convs = [node], []
        for _ in range(4):  # a conv, its BatchNorm, its activation, an add
            for n in frontier:
                if conv := _ort_conv(n.op_type, [shapes.get(i, []) for i in n.input],
                                     [shapes.get(o, []) for o in n.output]):
                    convs.append(conv)
            frontier = [producer[i] for n in frontier if n.op_type not in _ORT_CONVS
                        for i in n.input if i in producer]
        found[node.name] = convs
    return found


def _ort_rounds(events: list[dict], rounds: int, repeat: int,
                convs: Mapping[str, Sequence[ConvShape]] | None = None,
                ) -> list[dict[str, tuple[float, int]]]:
    """Per round: key -> (seconds per run, nodes), from ONNX Runtime's profile events: the
    last ``rounds * (repeat + 1)`` calls of each node (the warm-up runs come first), each
    round's first call its warm-up run.  ``convs`` (:func:`_model_convs`) keys a conv whose
    channels ONNX Runtime padded by the model's conv it ran."""
    convs = convs or {}
    known = {conv for found in convs.values() for conv in found}
    calls: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        args = event["args"]
        shapes = [[list(d.values())[0] for d in args.get(f"{side}_type_shape", [])]
                  for side in ("input", "output")]
        op = args.get("op_name", "?")
        conv = _ort_conv(op, *shapes)
        if conv is not None and known and conv not in known:  # channels padded by NCHWc
            node = event["name"].removesuffix("_kernel_time").removesuffix("_nchwc")
            conv = next((c for c in convs.get(node, ()) if c.padded_to(conv)), conv)
        key = (conv.key if conv else ort_layer_key(op, *shapes)) or f"other: ONNX Runtime {op}"
        calls[event["name"]].append((key, event["dur"] * 1e-6))
    per_round: list[dict[str, tuple[float, int]]] = [{} for _ in range(rounds)]
    for node_calls in calls.values():
        node_calls = node_calls[-rounds * (repeat + 1):]
        for r in range(rounds):
            part = node_calls[r * (repeat + 1) + 1:(r + 1) * (repeat + 1)]
            if part:
                seconds, nodes = per_round[r].get(part[0][0], (0.0, 0))
                per_round[r][part[0][0]] = (seconds + sum(d for _, d in part) / repeat, nodes + 1)
    return per_round


#: OpenVINO's layer types (its executed graph's ``layerType``) by the ONNX operator whose
#: shapes they have.
_OPENVINO_TYPES = {"Convolution": "Conv", "GroupConvolution": "Conv", "FullyConnected": "Gemm",
                   "FullyConnectedQuantized": "Gemm", "FullyConnectedQuantizedLegacy": "Gemm",
                   "MatMul": "MatMul"}


def openvino_layer_key(layer_type: str, inputs: Sequence[Sequence[int]],
                       outputs: Sequence[Sequence[int]]) -> str | None:
    """The layer a node of OpenVINO's executed graph computes, from its layer type and its
    inputs' and outputs' shapes, or None: its convolutions and fully connected layers
    (float or int8) keyed as ONNX Runtime's ``Conv`` and ``Gemm``, a grouped filter
    ``[G, K/G, C/G, R, S]`` as ONNX's ``[K, C/G, R, S]``.

    >>> openvino_layer_key("Convolution", [[8, 3, 224, 224], [64, 3, 3, 3], [64]],
    ...                    [[8, 64, 224, 224]])
    'conv 3x224x224 -> 64 3x3 s1'
    >>> openvino_layer_key("Convolution", [[1, 32, 56, 56], [32, 1, 1, 3, 3]], [[1, 32, 28, 28]])
    'conv 32x56x56 -> 32 3x3 s2 g32'
    >>> openvino_layer_key("FullyConnectedQuantizedLegacy", [[8, 25088], [4096, 25088]],
    ...                    [[8, 4096]])
    'dense 8x4096x25088'
    >>> openvino_layer_key("Reorder", [[1, 8]], [[1, 8]]) is None
    True
    """
    op = _OPENVINO_TYPES.get(layer_type)
    if op is None:
        return None
    inputs = [list(shape) for shape in inputs]
    if op == "Conv" and len(inputs) > 1 and len(inputs[1]) == 5:
        groups, per_group, *rest = inputs[1]
        inputs[1] = [groups * per_group, *rest]
    return ort_layer_key(op, inputs, outputs)


class _OnnxRuntime:
    """ONNX Runtime's session with its profiler on; its per-node times come from the profile
    it writes at the end (:func:`_ort_rounds`)."""

    name = "ONNX Runtime"

    def __init__(self, model: onnx.ModelProto, inputs: Mapping[str, np.ndarray], threads: int,
                 profile_dir: str) -> None:
        self.model, self.feeds = model, dict(inputs)
        self.session = onnxruntime_session(model, threads,
                                           profile_prefix=os.path.join(profile_dir, "ort"))

    def run(self) -> None:
        self.session.run(None, self.feeds)

    def start_round(self) -> None:
        """Nothing to mark: the profile keeps every call (the rounds are its last ones)."""

    def recorded(self) -> None:
        """Nothing to read after a run (as above)."""

    def per_round(self, rounds: int, repeat: int) -> list[dict[str, tuple[float, int]]]:
        with open(self.session.end_profiling()) as f:
            events = json.load(f)
        return _ort_rounds(events, rounds, repeat, _model_convs(self.model))


class _OpenVino:
    """OpenVINO's CPU plugin (:func:`tvm_tpp.reference.openvino_compiled`) with its per-node
    counters on, read after each timed run and keyed by its executed graph's shapes."""

    def __init__(self, model: onnx.ModelProto, inputs: Mapping[str, np.ndarray], threads: int,
                 f32: bool) -> None:
        compiled = openvino_compiled(model, {k: v.shape for k, v in inputs.items()}, threads,
                                     f32=f32, profile=True)
        self.name = "OpenVINO f32" if f32 else "OpenVINO"
        self.request = openvino_request(compiled, inputs)
        self.keys: dict[str, str] = {}
        for op in compiled.get_runtime_model().get_ordered_ops():
            info = op.get_rt_info()
            kind = str(info["layerType"].astype(str))
            shapes = [[[d.get_length() for d in port.get_partial_shape()]
                       if port.get_partial_shape().is_static else [] for port in ports]
                      for ports in (op.inputs(), op.outputs())]
            self.keys[op.get_friendly_name()] = (openvino_layer_key(kind, *shapes)
                                                 or f"other: {self.name} {kind}")
        self.rounds: list[dict[str, tuple[float, frozenset[str]]]] = []

    def run(self) -> None:
        self.request.infer()

    def start_round(self) -> None:
        self.rounds.append({})

    def recorded(self) -> None:
        """Adds the last run's per-node times to the current round."""
        current = self.rounds[-1]
        for node in self.request.profiling_info:
            seconds = node.real_time.total_seconds()
            if seconds > 0:
                key = self.keys.get(node.node_name, f"other: {self.name} {node.node_type}")
                total, names = current.get(key, (0.0, frozenset()))
                current[key] = (total + seconds, names | {node.node_name})

    def per_round(self, rounds: int, repeat: int) -> list[dict[str, tuple[float, int]]]:
        return [{key: (seconds / repeat, len(names)) for key, (seconds, names) in r.items()}
                for r in self.rounds]


#: What :func:`compare_layers` times against, by ``tvm-tpp profile --against`` name.
AGAINST = ("onnxruntime", "openvino", "openvino-f32")


_DENSE_KEY = re.compile(r"dense (\d+)x(\d+)x(\d+)$")


def _as_their_layers(per_key: dict[str, tuple[float, int]], their_keys: set[str]
                     ) -> dict[str, tuple[float, int]]:
    """tpp's dense layers that compute several of theirs in one kernel (attention's Q, K and
    V projections: :mod:`relay_passes.parallel_dense`) as those layers: a key ``M x N x K``
    they lack counts as ``N / N'`` calls of their one ``M x N' x K`` whose ``N'`` divides ``N``.

    >>> _as_their_layers({"dense 16x288x96": (3.0, 1), "dense 16x96x96": (1.0, 1)},
    ...                  {"dense 16x96x96"})
    {'dense 16x96x96': (4.0, 4)}
    """
    out = dict(per_key)
    for key, (seconds, calls) in per_key.items():
        found = _DENSE_KEY.match(key)
        if found is None or key in their_keys:
            continue
        rows, n, k = map(int, found.groups())
        parts = [(their, int(m[2])) for their in their_keys
                 if (m := _DENSE_KEY.match(their)) is not None
                 and (int(m[1]), int(m[3])) == (rows, k) and int(m[2]) < n and n % int(m[2]) == 0]
        if len(parts) == 1:
            part, width = parts[0]
            del out[key]
            before, before_calls = out.get(part, (0.0, 0))
            out[part] = (before + seconds, before_calls + calls * (n // width))
    return out


def compare_layers(vm, args: Sequence[Any], model: onnx.ModelProto,
                   inputs: Mapping[str, np.ndarray], threads: int, rounds: int = 3,
                   repeat: int = 10, warmup_seconds: float = 3.0,
                   against: str = "onnxruntime") -> LayerComparison:
    """Time ``vm["main"](*args)`` per call and another runtime per node on ``model`` fed
    ``inputs`` (the same values), in ``rounds`` alternating rounds of ``repeat`` runs each
    (after ``warmup_seconds`` of both), matched by :func:`layer_key`.  ``against``: ONNX
    Runtime, OpenVINO with its defaults (bf16 on AMX or AVX512-BF16 hosts) or OpenVINO in
    float32 (:data:`AGAINST`), with ``threads`` threads (TVM's pool is this process's).
    ``vm`` gets an instrument: give it a VM of its own
    (:meth:`tvm_tpp.compiler.CompiledModel.compare_layers` does)."""
    if rounds < 1 or repeat < 1:
        raise ValueError(f"rounds and repeat must be >= 1, got {rounds} and {repeat}")
    if against not in AGAINST:
        raise ValueError(f"against must be one of {', '.join(AGAINST)}, got {against!r}")
    with tempfile.TemporaryDirectory() as profile_dir:
        them = (_OnnxRuntime(model, inputs, threads, profile_dir) if against == "onnxruntime"
                else _OpenVino(model, inputs, threads, f32=against == "openvino-f32"))
        end = time.perf_counter() + warmup_seconds
        while time.perf_counter() < end:
            vm["main"](*args)
            them.run()
        tpp_rounds, tpp_runs, their_runs = [], [], []
        for _ in range(rounds):
            # Quiet first: the other runtime's threads spin on after its runs (ONNX Runtime's
            # took a 0.1 ms MLP to 12 ms), then one untimed run wakes this one's.
            time.sleep(PAUSE_SECONDS)
            prof = profile_vm(vm, args, repeat, warmup=1)
            tpp_runs.append(prof.latency_seconds)
            per_key: dict[str, tuple[float, int]] = {}
            for op in prof.operators:
                key = layer_key(op.name) or f"other: tpp {KIND_NAMES[op.kind]}"
                seconds, calls = per_key.get(key, (0.0, 0))
                per_key[key] = (seconds + op.seconds, calls + op.calls)
            tpp_rounds.append(per_key)
            time.sleep(PAUSE_SECONDS)
            them.run()  # the round's warm-up run, left out of its profile
            them.start_round()
            seconds = []
            for _ in range(repeat):  # each run timed: a median, as profile_vm's latency is
                start = time.perf_counter()
                them.run()
                seconds.append(time.perf_counter() - start)
                them.recorded()
            their_runs.append(statistics.median(seconds))
        their_rounds = them.per_round(rounds, repeat)
    their_keys = {k for r in their_rounds for k in r}
    tpp_rounds = [_as_their_layers(r, their_keys) for r in tpp_rounds]

    def median(per_round: list[dict[str, tuple[float, int]]], key: str
               ) -> tuple[float | None, int]:
        if not any(key in r for r in per_round):
            return None, 0
        return (statistics.median(r.get(key, (0.0, 0))[0] for r in per_round),
                max(r.get(key, (0.0, 0))[1] for r in per_round))

    def ratio(key: str) -> float | None:
        pairs = [(t[key][0], o[key][0]) for t, o in zip(tpp_rounds, their_rounds, strict=True)
                 if key in t and key in o and t[key][0] > 0]
        return statistics.median(o / t for t, o in pairs) if pairs else None

    layers = []
    for key in {k for r in (*tpp_rounds, *their_rounds) for k in r}:
        (tpp, tpp_calls), (their, their_calls) = median(tpp_rounds, key), median(their_rounds, key)
        layers.append(Layer(key, tpp, their, tpp_calls, their_calls, ratio(key)))
    layers.sort(key=lambda layer: (layer.key.startswith("other"),
                                   -max(layer.tpp_seconds or 0.0, layer.their_seconds or 0.0)))
    return LayerComparison(them.name, tuple(layers), statistics.median(tpp_runs),
                           statistics.median(their_runs),
                           tuple(o / t for t, o in zip(tpp_runs, their_runs, strict=True)),
                           threads, rounds, repeat)
