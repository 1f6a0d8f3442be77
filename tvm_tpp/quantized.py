"""Quantized ONNX models in QDQ form: QOperator and integer-only nodes rewritten before import.

ONNX Runtime's ``onnxruntime.quantization`` writes quantized models in three shapes.  QDQ models
(``QuantizeLinear``/``DequantizeLinear`` around float operators) import through TVM's ONNX
frontend as they are.  QOperator models (``QLinearMatMul``, ``QLinearConv``, the
``com.microsoft`` ``QGemm``, ``QLinearAdd``, ...) and dynamic ones (``DynamicQuantizeLinear``
feeding ``MatMulInteger``/``ConvInteger``) use operators TVM 0.27's frontend lacks.
:func:`to_qdq` rewrites each such node into the QDQ form of its float operator, e.g.::

    QLinearMatMul(a, sa, za, b, sb, zb, sy, zy)
        -> QuantizeLinear(MatMul(DequantizeLinear(a, sa, za), DequantizeLinear(b, sb, zb)), sy, zy)

so there is one quantized form for the graph passes to match.  The rewritten node keeps its name
and output names (the last node of its expansion carries them); the helper nodes and values are
named ``<node>/<role>``.  Per-channel scales become per-axis ``DequantizeLinear`` (opset 13).

Exactness: a QLinear* node and its QDQ form compute the same real-valued function; they may
differ by one output quantization step where float rounding lands a value on the other side of
a rounding boundary.  ``MatMulInteger``/``ConvInteger`` become float operators on operands
dequantized with scale 1 and their zero points, followed by a ``Cast`` to int32: every product
and partial sum is then an integer, exact in float32 while it stays below 2**24, i.e. whenever
``K * max|a - za| * max|b - zb| < 2**24`` (K the reduction length: K <= 258 for the worst case
255 * 255, K <= 518 for u8 activations and symmetric s8 weights); beyond that the result is off
by float32 rounding of the accumulation, relative 1e-7 of its magnitude.

Examples
--------
>>> import numpy as np
>>> from onnx import TensorProto, helper, numpy_helper
>>> inits = [numpy_helper.from_array(np.array(v, dtype=t), n) for n, v, t in [
...     ("sa", 0.1, "float32"), ("za", 128, "uint8"), ("b", [[1, -2], [3, 4]], "int8"),
...     ("sb", [0.5, 0.25], "float32"), ("zb", [0, 0], "int8"), ("sy", 0.2, "float32"),
...     ("zy", 128, "uint8")]]
>>> node = helper.make_node("QLinearMatMul", ["a", "sa", "za", "b", "sb", "zb", "sy", "zy"],
...                         ["y"], name="mm")
>>> graph = helper.make_graph(
...     [node], "g", [helper.make_tensor_value_info("a", TensorProto.UINT8, [3, 2])],
...     [helper.make_tensor_value_info("y", TensorProto.UINT8, [3, 2])], inits)
>>> model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
>>> [(n.op_type, n.name) for n in to_qdq(model).graph.node]  # doctest: +NORMALIZE_WHITESPACE
[('DequantizeLinear', 'mm/dq_a'), ('DequantizeLinear', 'mm/dq_b'), ('MatMul', 'mm/float'),
 ('QuantizeLinear', 'mm')]
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .errors import ModelError

__all__ = ["CALIBRATION_SEED", "RECIPE", "RECIPE_REDUCED", "RandomCalibration", "is_quantized",
           "quantize_static_qdq", "to_qdq"]

_MS = "com.microsoft"
# Per-axis QuantizeLinear/DequantizeLinear (a 1-D scale with an ``axis``) exist from opset 13 on.
_QDQ_OPSET = 13
# Quantized operators are recognised by name, so that one we do not rewrite is refused here with
# its name instead of reaching TVM; the three below are the QDQ vocabulary the frontend has.
_QUANTIZED_PREFIXES = ("QLinear", "QGemm", "QAttention", "QOrdered", "QEmbed", "DynamicQuantize")
_FRONTEND_QUANTIZED = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"}


#: Seed of the first calibration batch of :func:`quantize_static_qdq` (batch ``s`` is drawn with
#: ``CALIBRATION_SEED + s``): apart from the benchmark inputs' seeds (0 by default), so a model
#: is not calibrated on exactly the inputs it is then checked on.
CALIBRATION_SEED = 100
#: What :func:`quantize_static_qdq` does, for the caches of its results: another recipe is
#: another model.
RECIPE = "ort-preprocess+qdq+per-channel-s8-weights+u8-activations"
#: The recipe with ``reduce_range``: weights in 7 bits.
RECIPE_REDUCED = RECIPE.replace("s8-weights", "s7-weights")


def is_quantized(model: onnx.ModelProto) -> bool:
    """Whether ``model`` has quantized operators (QDQ, QOperator or integer-only nodes).

    Examples
    --------
    >>> from tvm_tpp import models
    >>> is_quantized(models.load("mlp"))
    False
    """
    return any(node.op_type in _FRONTEND_QUANTIZED or _needs_rewrite(node)
               for node in model.graph.node)


class RandomCalibration:
    """An ``onnxruntime.quantization`` calibration reader over seeded random inputs (drawn as
    :func:`tvm_tpp.reference.random_inputs` draws them): what ``quantize_static`` needs to
    quantize a network without a data set.

    Examples
    --------
    >>> from tvm_tpp import models
    >>> reader = RandomCalibration(models.load("mlp"), samples=1)
    >>> sorted(reader.get_next()), reader.get_next()
    (['x'], None)
    """

    def __init__(self, model: onnx.ModelProto, samples: int = 8,
                 seed: int = CALIBRATION_SEED) -> None:
        from .onnx_import import input_specs
        from .reference import random_inputs

        specs = input_specs(model)
        self._batches = iter([random_inputs(specs, seed=seed + s) for s in range(samples)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._batches, None)


def quantize_static_qdq(model: onnx.ModelProto | str | Path, path: str | Path, samples: int = 8,
                        seed: int = CALIBRATION_SEED, reduce_range: bool = False) -> Path:
    """Quantize a float model statically into QDQ form, calibrated on seeded random inputs.

    The form the int8 kernels run: ONNX Runtime's ``quant_pre_process`` (BatchNorm folded,
    MatMul + Add fused to Gemm), then ``quantize_static`` with ``QuantFormat.QDQ``,
    per-channel ``QInt8`` weights and ``QUInt8`` activations (u8 x s8, what VNNI's
    ``vpdpbusd`` multiplies): :data:`RECIPE`.  Random inputs are no data set: the scales fit
    standard-normal inputs, which is what the benchmarks feed.

    Parameters
    ----------
    model
        A float ONNX model or its file (its inputs must have static shapes).
    path
        Where the quantized model is written.
    samples
        Calibration batches; batch ``s`` is ``random_inputs(specs, seed=seed + s)``.
    seed
        Seed of the first batch.
    reduce_range
        Weights in 7 bits, [-64, 64] (:data:`RECIPE_REDUCED`): ONNX Runtime's advice for
        CPUs without VNNI, whose ``vpmaddubsw`` would saturate on 8-bit weights; tpp's int8
        kernels multiply such weights exactly at about twice the rate there.

    Returns
    -------
    Path
        ``path``.

    Examples
    --------
    >>> import tempfile
    >>> from tvm_tpp import models
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     out = quantize_static_qdq(models.load("mlp"), Path(tmp) / "mlp.int8.onnx", samples=2)
    ...     is_quantized(onnx.load(str(out)))
    True
    """
    import tempfile

    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model))
    if _default_opset(model) < _QDQ_OPSET:
        # Per-channel weights need DequantizeLinear's axis (opset 13); the quantizer writes
        # it whatever the model's opset, and ONNX Runtime then refuses the model.
        model = onnx.version_converter.convert_version(model, _QDQ_OPSET)
    path = Path(path)
    reader = RandomCalibration(model, samples, seed)
    # quantize_static reads a file; the float model is written next to nothing the caller owns.
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "float.onnx"
        onnx.save(model, str(source))
        # ORT's advised pre-processing: its basic graph optimizations fold BatchNorm into
        # the convs and MatMul + Add into Gemm, so each weight layer quantizes with its bias
        # (int32, at scale sx*sw) instead of a separately quantized Add.  Shapes are static.
        prepared = Path(tmp) / "prepared.onnx"
        logging.disable(logging.WARNING)  # both steps log advice on the root logger
        try:
            quant_pre_process(str(source), str(prepared), skip_symbolic_shape=True)
            quantize_static(str(prepared), str(path), reader, quant_format=QuantFormat.QDQ,
                            per_channel=True, reduce_range=reduce_range,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
        finally:
            logging.disable(logging.NOTSET)
    return path


def to_qdq(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every QOperator and integer-only node rewritten into QDQ form.

    Parameters
    ----------
    model
        A checked ONNX model; it is not modified.

    Returns
    -------
    onnx.ModelProto
        ``model`` itself when nothing needs rewriting, else a copy that passes
        ``onnx.checker.check_model``; a default opset below 13 (which per-channel scales need
        for a per-axis ``DequantizeLinear``) is first raised to 13 by ONNX's version converter.
        Nodes inside control-flow bodies (If, Loop) are not rewritten.

    Raises
    ------
    ModelError
        For a quantized operator that has no rewrite (named in the message), or one whose
        scales or zero points have shapes the rewrite cannot know.

    Examples
    --------
    >>> from tvm_tpp import models
    >>> float_model = models.load("mlp")
    >>> to_qdq(float_model) is float_model
    True
    """
    if not any(_needs_rewrite(node) for node in model.graph.node):
        return model
    if _default_opset(model) < _QDQ_OPSET:
        # Converted before the rewrite: the converter has no adapter for a DequantizeLinear
        # in a model older than the operator.
        try:
            model = onnx.version_converter.convert_version(model, _QDQ_OPSET)
        except Exception as err:  # the converter raises bare RuntimeErrors from C++
            raise ModelError(
                f"the QDQ form needs opset {_QDQ_OPSET}; converting the model from opset "
                f"{_default_opset(model)} failed: {err}"
            ) from None
    rewriter = _Rewriter(model)
    nodes = []
    for node in model.graph.node:
        if node.name in rewriter.absorbed:
            continue
        nodes.extend(rewriter.rewrite(node) if _needs_rewrite(node) else [node])
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    out.graph.initializer.extend(rewriter.new_initializers)
    onnx.checker.check_model(out)
    return out


def _needs_rewrite(node: onnx.NodeProto) -> bool:
    op = node.op_type
    if node.domain not in ("", "ai.onnx", _MS):
        return False
    if node.domain == _MS and op in ("QuantizeLinear", "DequantizeLinear"):
        return True
    if op in _FRONTEND_QUANTIZED:
        return False
    return op.startswith(_QUANTIZED_PREFIXES) or op in ("MatMulInteger", "ConvInteger",
                                                         "MatMulIntegerToFloat")


def _default_opset(model: onnx.ModelProto) -> int:
    return max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=1)


class _Rewriter:
    """Expansions of single nodes, with what they need to know about the graph around them."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        # Shape inference gives the element types and shapes of computed scales and zero points
        # (e.g. DynamicQuantizeLinear's); it skips the com.microsoft ops it has no schema for.
        inferred = onnx.shape_inference.infer_shapes(model).graph
        self.types: dict[str, onnx.TypeProto.Tensor] = {
            v.name: v.type.tensor_type
            for v in [*inferred.input, *inferred.value_info, *inferred.output]
        }
        self.used = {name for node in model.graph.node for name in [*node.input, *node.output]}
        self.readers: dict[str, list[onnx.NodeProto]] = {}
        for node in model.graph.node:
            for name in node.input:
                self.readers.setdefault(name, []).append(node)
        self.outputs = {v.name for v in model.graph.output}
        # Nodes a rewrite made part of its own (by name): the caller drops them.
        self.absorbed: set[str] = set()
        self.used |= {node.name for node in model.graph.node} | set(self.constants)
        self.new_initializers: list[onnx.TensorProto] = []
        self.emitted: list[onnx.NodeProto] = []
        self.node = onnx.NodeProto()

    # -- graph facts ---------------------------------------------------------------------------

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The static shape of a value, or None when it is not known."""
        if name in self.constants:
            return tuple(self.constants[name].shape)
        tensor = self.types.get(name)
        if tensor is None or not tensor.HasField("shape"):
            return None
        dims = tensor.shape.dim
        if not all(d.HasField("dim_value") for d in dims):
            return None
        return tuple(d.dim_value for d in dims)

    def elem_type(self, name: str) -> int:
        """The ``TensorProto`` element type of a value."""
        if name in self.constants:
            return helper.np_dtype_to_tensor_dtype(self.constants[name].dtype)
        tensor = self.types.get(name)
        if tensor is None or not tensor.elem_type:
            self.fail(f"the element type of {name!r} is unknown")
        return tensor.elem_type

    def only_float_cast(self, name: str) -> onnx.NodeProto | None:
        """The ``Cast`` to float32 that is the only reader of value ``name``, if it is one
        (and has a name to be dropped by)."""
        readers = self.readers.get(name, [])
        if name in self.outputs or len(readers) != 1:
            return None
        cast = readers[0]
        if cast.op_type != "Cast" or not cast.name or _attrs(cast).get("to") != TensorProto.FLOAT:
            return None
        return cast

    def fail(self, why: str) -> NoReturn:
        """Refuse the node being rewritten, saying why."""
        node = self.node
        raise ModelError(f"quantized operator {node.op_type} ({node.name!r}): {why}")

    # -- emitting ------------------------------------------------------------------------------

    def fresh(self, role: str) -> str:
        """An unused name for a helper node or value: ``<node name or first output>/<role>``."""
        base = f"{self.node.name or self.node.output[0]}/{role}"
        name, i = base, 1
        while name in self.used:
            name, i = f"{base}_{i}", i + 1
        self.used.add(name)
        return name

    def emit(self, op: str, inputs: Sequence[str], role: str, output: str | None = None,
             **attrs: object) -> str:
        """Append a helper node (or, with ``output``, the node that replaces the original)."""
        name = self.fresh(role) if output is None else self.node.name
        out = output if output is not None else name
        self.emitted.append(helper.make_node(op, list(inputs), [out], name=name, **attrs))
        return out

    def constant(self, value: np.ndarray, role: str) -> str:
        name = self.fresh(role)
        self.new_initializers.append(numpy_helper.from_array(value, name))
        self.constants[name] = value
        return name

    def axis_attrs(self, scale: str, axis: int) -> dict[str, int]:
        """``axis`` for a DequantizeLinear/QuantizeLinear whose scale has more than one value."""
        shape = self.shape(scale)
        if shape is None:
            self.fail(f"the shape of scale/zero point {scale!r} is unknown")
        return {"axis": axis} if int(np.prod(shape)) > 1 else {}

    def dq(self, x: str, scale: str, zero_point: str, role: str, axis: int = 1) -> str:
        """A helper DequantizeLinear; ``axis`` is where a per-channel scale's channels are."""
        inputs = [x, scale] + ([zero_point] if zero_point else [])
        return self.emit("DequantizeLinear", inputs, role, **self.axis_attrs(scale, axis))

    def q(self, y: str, scale: str, zero_point: str, like: str) -> str:
        """Quantize ``y`` into the node's first output; a missing zero point is 0 of ``like``'s
        type (QuantizeLinear without one would make uint8, whatever the input type was)."""
        if not zero_point:
            dtype = helper.tensor_dtype_to_np_dtype(self.elem_type(like))
            zero_point = self.constant(np.array(0, dtype=dtype), "zero_point")
        return self.emit("QuantizeLinear", [y, scale, zero_point], "", self.node.output[0],
                         **self.axis_attrs(scale, 1))

    def product(self, names: Sequence[str], factor: float, role: str) -> str:
        """``factor * prod(names)``: a constant when they all are, else Mul nodes."""
        if all(n in self.constants for n in names):
            values = [self.constants[n] for n in names]
            value = np.float32(factor) * functools.reduce(np.multiply, values)
            return self.constant(np.asarray(value, dtype=np.float32), role)
        shapes = [self.shape(n) for n in names]
        if any(shape is None for shape in shapes):
            self.fail(f"the shapes of the scales {list(names)} are unknown")
        result = names[0]
        for name in [*names[1:], self.constant(np.array(factor, np.float32), f"{role}_factor")]:
            result = self.emit("Mul", [result, name], role)
        # Recorded for axis_attrs: shape inference ran before these values existed.
        product_type = helper.make_tensor_type_proto(TensorProto.FLOAT,
                                                     np.broadcast_shapes(*shapes))
        self.types[result] = product_type.tensor_type
        return result

    def unit_scale(self, zero_point: str, role: str) -> str:
        """Ones shaped like ``zero_point``: DequantizeLinear then subtracts the zero point only."""
        shape = self.shape(zero_point) if zero_point else ()
        if shape is None:
            self.fail(f"the shape of zero point {zero_point!r} is unknown")
        return self.constant(np.ones(shape, np.float32), role)

    # -- the rewrites --------------------------------------------------------------------------

    def rewrite(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        self.node = node
        self.emitted = []
        rule = _RULES.get(node.op_type)
        if rule is None:
            domain = node.domain or "ai.onnx"
            raise ModelError(
                f"quantized operator {node.op_type} (domain {domain}, node {node.name!r}) is not "
                f"supported; supported: {', '.join(sorted(_RULES))}"
            )
        rule(self, _padded(node), _attrs(node))
        return self.emitted


# A rewrite: (rewriter, the node's inputs with absent optional ones as "", its attributes).
_Rule = Callable[[_Rewriter, list[str], dict], None]


def _padded(node: onnx.NodeProto, length: int = 9) -> list[str]:
    """The node's inputs with absent optional ones as ""."""
    return [*node.input, *[""] * max(0, length - len(node.input))]


def _attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _qlinear_binary(float_op: str) -> _Rule:
    """QLinearAdd/QLinearMul(A, sa, za, B, sb, zb, sc, zc)."""

    def rule(r: _Rewriter, i: list[str], attrs: dict) -> None:
        a = r.dq(i[0], i[1], i[2], "dq_a")
        b = r.dq(i[3], i[4], i[5], "dq_b")
        r.q(r.emit(float_op, [a, b], "float"), i[6], i[7], like=i[0])

    return rule


def _qlinear_unary(float_op: str, keep: Sequence[str] = (),
                   defaults: dict | None = None) -> _Rule:
    """QLinear<op>(X, sx, zx, sy, zy) with the float op's attributes ``keep``."""

    def rule(r: _Rewriter, i: list[str], attrs: dict) -> None:
        if attrs.get("channels_last", 0):
            r.fail("channels_last=1 (NHWC) is not supported")
        kept = {**(defaults or {}), **{k: v for k, v in attrs.items() if k in keep}}
        x = r.dq(i[0], i[1], i[2], "dq_x")
        r.q(r.emit(float_op, [x], "float", **kept), i[3], i[4], like=i[0])

    return rule


def _qlinear_softmax(r: _Rewriter, i: list[str], attrs: dict) -> None:
    """QLinearSoftmax(X, sx, zx, sy, zy) with Softmax's ``axis``; its ``opset`` attribute says
    whose Softmax: before 13 it normalised over all dimensions from ``axis`` on, which is the
    opset-13 Softmax only for the last axis."""
    axis = int(attrs.get("axis", -1 if attrs.get("opset", 13) >= 13 else 1))
    rank = len(r.shape(i[0]) or ())
    if attrs.get("opset", 13) < 13 and axis not in (-1, rank - 1):
        r.fail(f"the Softmax of opset {attrs['opset']} on axis {axis} is not supported")
    x = r.dq(i[0], i[1], i[2], "dq_x")
    r.q(r.emit("Softmax", [x], "float", axis=axis), i[3], i[4], like=i[0])


def _qlinear_matmul(r: _Rewriter, i: list[str], attrs: dict) -> None:
    a = r.dq(i[0], i[1], i[2], "dq_a", axis=-2)
    b = r.dq(i[3], i[4], i[5], "dq_b", axis=-1)
    r.q(r.emit("MatMul", [a, b], "float"), i[6], i[7], like=i[0])


def _qlinear_conv(r: _Rewriter, i: list[str], attrs: dict) -> None:
    """QLinearConv(x, sx, zx, w, sw, zw, sy, zy, B): the int32 bias has scale sx * sw."""
    x = r.dq(i[0], i[1], i[2], "dq_x")
    w = r.dq(i[3], i[4], i[5], "dq_w", axis=0)
    inputs = [x, w]
    if i[8]:
        inputs.append(r.dq(i[8], r.product([i[1], i[4]], 1.0, "bias_scale"), "", "dq_bias",
                           axis=0))
    r.q(r.emit("Conv", inputs, "float", **attrs), i[6], i[7], like=i[0])


def _qgemm(r: _Rewriter, i: list[str], attrs: dict) -> None:
    """QGemm(A, sa, za, B, sb, zb, C, sy, zy) = alpha * sa * sb * (A'B' + C), quantized with
    (sy, zy) or float without them; C is int32 with scale alpha * sa * sb."""
    alpha = float(attrs.get("alpha", 1.0))
    trans_b = int(attrs.get("transB", 0))
    a = r.dq(i[0], i[1], i[2], "dq_a")
    b = r.dq(i[3], i[4], i[5], "dq_b", axis=0 if trans_b else 1)
    inputs = [a, b]
    if i[6]:
        inputs.append(r.dq(i[6], r.product([i[1], i[4]], alpha, "bias_scale"), "", "dq_c",
                           axis=-1))
    gemm = {"alpha": alpha, "transA": int(attrs.get("transA", 0)), "transB": trans_b}
    if i[7]:
        r.q(r.emit("Gemm", inputs, "float", **gemm), i[7], i[8], like=i[0])
    else:
        r.emit("Gemm", inputs, "", r.node.output[0], **gemm)


def _qlinear_concat(r: _Rewriter, i: list[str], attrs: dict) -> None:
    """QLinearConcat(sy, zy, x0, s0, z0, x1, s1, z1, ...)."""
    inputs = r.node.input
    parts = [r.dq(inputs[k], inputs[k + 1], inputs[k + 2], f"dq_{(k - 2) // 3}")
             for k in range(2, len(inputs), 3)]
    r.q(r.emit("Concat", parts, "float", axis=attrs["axis"]), inputs[0], inputs[1],
        like=inputs[2])


def _integer_op(float_op: str, a_axis: int, b_axis: int) -> _Rule:
    """MatMulInteger/ConvInteger(a, b, za, zb) -> Cast<int32>(op(a - za, b - zb)) in float;
    where the int32 result is only cast back to float (ONNX Runtime's dynamic quantization:
    then scaled), the float op's result itself, without the round trip through int32."""

    def rule(r: _Rewriter, i: list[str], attrs: dict) -> None:
        a = r.dq(i[0], r.unit_scale(i[2], "unit_a"), i[2], "dq_a", axis=a_axis)
        b = r.dq(i[1], r.unit_scale(i[3], "unit_b"), i[3], "dq_b", axis=b_axis)
        cast = r.only_float_cast(r.node.output[0])
        if cast is not None:
            r.absorbed.add(cast.name)
            r.emit(float_op, [a, b], "", cast.output[0], **attrs)
            return
        y = r.emit(float_op, [a, b], "float", **attrs)
        r.emit("Cast", [y], "", r.node.output[0], to=TensorProto.INT32)

    return rule


def _matmul_integer_to_float(r: _Rewriter, i: list[str], attrs: dict) -> None:
    """MatMulIntegerToFloat(A, B, sa, sb, za, zb, bias) = DQ(A) @ DQ(B) + bias."""
    a = r.dq(i[0], i[2], i[4], "dq_a", axis=-2)
    b = r.dq(i[1], i[3], i[5], "dq_b", axis=-1)
    _matmul_bias(r, a, b, i[6])


def _dynamic_quantize_matmul(r: _Rewriter, i: list[str], attrs: dict) -> None:
    """DynamicQuantizeMatMul(A, B, sb, zb, bias): A quantized to uint8 on the fly."""
    roles = ("a_quantized", "a_scale", "a_zero_point")
    qa, sa, za = (r.fresh(role) for role in roles)
    r.emitted.append(helper.make_node("DynamicQuantizeLinear", [i[0]], [qa, sa, za],
                                       name=r.fresh("quantize_a")))
    r.types[sa] = r.types[za] = onnx.TypeProto.Tensor(shape=onnx.TensorShapeProto())
    a = r.dq(qa, sa, za, "dq_a")
    b = r.dq(i[1], i[2], i[3], "dq_b", axis=-1)
    _matmul_bias(r, a, b, i[4])


def _matmul_bias(r: _Rewriter, a: str, b: str, bias: str) -> None:
    if bias:
        r.emit("Add", [r.emit("MatMul", [a, b], "float"), bias], "", r.node.output[0])
    else:
        r.emit("MatMul", [a, b], "", r.node.output[0])


def _contrib_qdq(float_op: str) -> _Rule:
    """com.microsoft Quantize/DequantizeLinear: the standard op when its types are 8-bit."""

    def rule(r: _Rewriter, i: list[str], attrs: dict) -> None:
        if i[2] and r.elem_type(i[2]) not in (TensorProto.UINT8, TensorProto.INT8):
            r.fail("only 8-bit (u)int types have a standard-domain equivalent")
        r.emit(float_op, [n for n in i[:3] if n], "", r.node.output[0], **attrs)

    return rule


_RULES: dict[str, _Rule] = {
    "QLinearMatMul": _qlinear_matmul,
    "QLinearConv": _qlinear_conv,
    "QGemm": _qgemm,
    "QLinearAdd": _qlinear_binary("Add"),
    "QLinearMul": _qlinear_binary("Mul"),
    "QLinearGlobalAveragePool": _qlinear_unary("GlobalAveragePool"),
    "QLinearAveragePool": _qlinear_unary(
        "AveragePool", keep=("auto_pad", "ceil_mode", "count_include_pad", "kernel_shape",
                             "pads", "strides")),
    "QLinearSigmoid": _qlinear_unary("Sigmoid"),
    "QLinearLeakyRelu": _qlinear_unary("LeakyRelu", keep=("alpha",), defaults={"alpha": 0.01}),
    "QLinearConcat": _qlinear_concat,
    "QLinearSoftmax": _qlinear_softmax,
    "MatMulInteger": _integer_op("MatMul", a_axis=-2, b_axis=-1),
    "ConvInteger": _integer_op("Conv", a_axis=1, b_axis=0),
    "MatMulIntegerToFloat": _matmul_integer_to_float,
    "DynamicQuantizeMatMul": _dynamic_quantize_matmul,
    "QuantizeLinear": _contrib_qdq("QuantizeLinear"),
    "DequantizeLinear": _contrib_qdq("DequantizeLinear"),
}
