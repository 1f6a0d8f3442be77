"""ONNX models in: loading with clear errors, static input shapes, conversion to Relax.

A symbolic first dimension (the batch, ``dim_param`` in ONNX) stays symbolic: the model
compiles once and runs at any batch size (:attr:`TensorSpec.batch`); any other symbolic
dimension needs a size given.

Files exporters write compute shapes in the graph (``Shape -> Gather/Slice/Cast/Mul ->
Concat -> Reshape/Resize``); TVM's importer folds only some of these chains.  With the input
shapes fixed, ONNX Runtime's basic graph optimizations fold them into constants first
(:func:`fold_shapes`), so the importer sees constant shapes.

Examples
--------
>>> from tvm_tpp import onnx_import, models
>>> proto = models.load("mlp")
>>> [s.name for s in onnx_import.input_specs(proto)]
['x']
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx

from .errors import ModelError
from .quantized import to_qdq

__all__ = ["TensorSpec", "load_onnx", "input_specs", "check_shapes", "fold_shapes", "to_relax"]

#: Operators whose output is computed from a tensor's shape, not its values: a graph with
#: them gets its shape computations folded (:func:`fold_shapes`).
SHAPE_OPS = frozenset({"Shape", "Size"})


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one model input: static sizes, except that the first may be
    the name of a symbolic batch (:attr:`batch`), which :meth:`at` fixes.

    Examples
    --------
    >>> spec = TensorSpec("x", ("N", 3, 8, 8), "float32")
    >>> spec.batch, spec.at(4).shape
    ('N', (4, 3, 8, 8))
    """

    name: str
    shape: tuple[int | str, ...]
    dtype: str

    def __post_init__(self) -> None:
        dims = self.shape[1:] if self.batch is not None else self.shape
        if any(not isinstance(d, int) or d < 0 for d in dims):
            raise ModelError(f"input {self.name!r} has a non-static shape {self.shape}")

    @property
    def batch(self) -> str | None:
        """The name of the symbolic first dimension, or None for a static shape."""
        first = self.shape[0] if self.shape else None
        return first if isinstance(first, str) else None

    def at(self, batch: int) -> TensorSpec:
        """This input at ``batch`` (itself if its shape is static)."""
        if self.batch is None:
            return self
        return TensorSpec(self.name, (batch, *self.shape[1:]), self.dtype)


def load_onnx(model: str | os.PathLike | bytes | onnx.ModelProto) -> onnx.ModelProto:
    """An ``onnx.ModelProto`` from a path, serialized bytes or a proto, checked."""
    if isinstance(model, onnx.ModelProto):
        proto = model
    elif isinstance(model, bytes):
        try:
            proto = onnx.load_from_string(model)
        except Exception as err:  # protobuf raises its own DecodeError types
            raise ModelError(f"malformed ONNX bytes: {err}") from None
    else:
        path = Path(model)
        if not path.is_file():
            raise ModelError(f"no such ONNX file: {path}")
        try:
            proto = onnx.load(str(path))
        except Exception as err:
            raise ModelError(f"{path} is not a valid ONNX model: {err}") from None
    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else "invalid model"
        raise ModelError(f"ONNX model failed the checker: {first}") from None
    if not proto.graph.node:
        raise ModelError("ONNX model has an empty graph")
    return proto


def input_specs(
    proto: onnx.ModelProto, shapes: Mapping[str, Sequence[int]] | None = None
) -> list[TensorSpec]:
    """The real graph inputs (initializers excluded) with their shapes.

    ``shapes`` overrides or fills in shapes by input name.  A symbolic first dimension stays
    symbolic (its name in :attr:`TensorSpec.shape`); any other dimension that stays symbolic
    or unknown is an error naming the input, so the user knows which shape to pass.
    """
    shapes = dict(shapes or {})
    initializers = {i.name for i in proto.graph.initializer}
    specs = []
    for value in proto.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
        if value.name in shapes:
            shape = tuple(int(d) for d in shapes.pop(value.name))
            _fits_declared(value.name, shape, tensor)
        else:
            dims = []
            for axis, dim in enumerate(tensor.shape.dim):
                if axis == 0 and dim.dim_param and not dim.HasField("dim_value"):
                    dims.append(dim.dim_param)  # the batch: compiled for any size
                    continue
                if not dim.HasField("dim_value") or dim.dim_value <= 0:
                    what = dim.dim_param or "unknown"
                    raise ModelError(
                        f"input {value.name!r} has a symbolic dimension ({what}); "
                        f"give its shape, e.g. --shape {value.name}=1,3,224,224"
                    )
                dims.append(dim.dim_value)
            shape = tuple(dims)
        specs.append(TensorSpec(value.name, shape, dtype))
    if shapes:
        known = ", ".join(s.name for s in specs)
        raise ModelError(f"shapes given for unknown inputs {sorted(shapes)}; inputs are: {known}")
    return specs


def _fits_declared(name: str, shape: tuple[int, ...], tensor) -> None:
    """ModelError unless a shape given for an input keeps its declared rank and static sizes
    (a given shape only fills in symbolic dimensions)."""
    if any(d < 1 for d in shape):
        raise ModelError(f"input {name!r}: shape sizes must be >= 1, got {list(shape)}")
    if not tensor.HasField("shape"):  # no declared shape: any is taken
        return
    declared = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0
                else (d.dim_param or "?") for d in tensor.shape.dim]
    fixed = [d for d in declared if isinstance(d, int)]
    if len(declared) != len(shape) or any(isinstance(d, int) and d != s
                                          for d, s in zip(declared, shape, strict=True)):
        what = "has the static shape" if len(fixed) == len(declared) else "is declared"
        raise ModelError(f"input {name!r} {what} {_dims(declared)}; a given shape may only set "
                         f"its symbolic dimensions, got {_dims(shape)}")


def _dims(dims) -> str:
    return "[" + ", ".join(map(str, dims)) + "]"


def _with_input_shapes(proto: onnx.ModelProto, specs: Sequence[TensorSpec]) -> onnx.ModelProto:
    """A copy of ``proto`` whose graph inputs declare the static shapes of ``specs``."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    by_name = {s.name: s for s in specs}
    for value in model.graph.input:
        if value.name in by_name:
            dims = value.type.tensor_type.shape.dim
            del dims[:]
            for d in by_name[value.name].shape:
                if isinstance(d, str):
                    dims.add().dim_param = d
                else:
                    dims.add().dim_value = d
    return model


def check_shapes(proto: onnx.ModelProto, specs: Sequence[TensorSpec]) -> None:
    """ModelError unless the model's operators accept inputs of these shapes (ONNX's strict
    shape inference), so a wrong size given for a symbolic dimension is named as such, not
    as a failure deep in TVM's importer."""
    model = _with_input_shapes(proto, specs)
    try:
        onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as err:
        lines = [line for line in str(err).strip().splitlines() if line.strip()]
        given = ", ".join(f"{s.name}={','.join(map(str, s.shape))}" for s in specs)
        raise ModelError(f"the input shapes ({given}) do not fit the model: "
                         f"{lines[0] if lines else err}") from None


def fold_shapes(proto: onnx.ModelProto, specs: Sequence[TensorSpec]) -> onnx.ModelProto:
    """``proto`` with its shape computations folded into constants for inputs of ``specs``'
    shapes, by ONNX Runtime's basic (platform-independent) graph optimizations: constant
    folding, which evaluates ``Shape`` of a statically shaped tensor, and the removal of
    redundant nodes.  A graph without :data:`SHAPE_OPS` is returned as it is, as is one ONNX
    Runtime cannot load (TVM's importer then speaks for it).

    Examples
    --------
    >>> from onnx import helper, TensorProto
    >>> nodes = [helper.make_node("Shape", ["x"], ["s"]),
    ...          helper.make_node("Reshape", ["x", "s"], ["y"])]
    >>> graph = helper.make_graph(
    ...     nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
    ...     [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    >>> model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    >>> folded = fold_shapes(model, [TensorSpec("x", (2, 3), "float32")])
    >>> [n.op_type for n in folded.graph.node], [i.name for i in folded.graph.initializer]
    (['Reshape'], ['s'])
    """
    if not any(node.op_type in SHAPE_OPS for node in proto.graph.node):
        return proto
    import tempfile

    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.log_severity_level = 3
    with tempfile.TemporaryDirectory() as tmp:
        options.optimized_model_filepath = str(Path(tmp) / "folded.onnx")
        try:
            ort.InferenceSession(_with_input_shapes(proto, specs).SerializeToString(), options,
                                 providers=["CPUExecutionProvider"])
        except Exception:  # noqa: BLE001 - ONNX Runtime's own errors have no common type
            return proto
        return onnx.load(options.optimized_model_filepath)


def to_relax(proto: onnx.ModelProto, specs: Sequence[TensorSpec]):
    """Import into a Relax ``IRModule`` with TVM's ONNX frontend (weights become constants).

    Shape computations are folded first (:func:`fold_shapes`); quantized operators the
    frontend lacks (ONNX Runtime's QOperator and dynamic quantization) are rewritten into
    QDQ form by :func:`tvm_tpp.quantized.to_qdq`.  What the frontend still cannot convert is
    a :class:`~tvm_tpp.errors.ModelError` naming the operator and its node.
    """
    import contextlib
    import io

    from tvm.relax.frontend.onnx import from_onnx

    proto = to_qdq(fold_shapes(proto, specs))
    said = io.StringIO()  # the frontend prints which operator failed, with its inputs' IR
    try:
        with contextlib.redirect_stdout(said):
            # An input with a symbolic batch keeps the model's own declaration (its
            # dim_param becomes a symbolic size in Relax).
            return from_onnx(
                proto,
                shape_dict={s.name: list(s.shape) for s in specs if s.batch is None},
                dtype_dict={s.name: s.dtype for s in specs},
            )
    except Exception as err:
        lines = str(err).strip().splitlines()
        message = _import_failure(proto, lines[-1] if lines else str(err), said.getvalue())
        err.with_traceback(None)  # frees the frontend's state now, not when the error is
    symbolic = [s for s in specs if s.batch is not None]
    if symbolic and any(node.op_type in SHAPE_OPS for node in proto.graph.node):
        # Shapes computed from a symbolic size fold only once the size is known.
        example = symbolic[0]
        message += (f"; the graph computes shapes from the symbolic batch {example.batch!r}: "
                    f"compile it for a batch size, e.g. --shape {example.name}="
                    + ",".join(map(str, example.at(1).shape)))
    raise ModelError(message) from None


def _import_failure(proto: onnx.ModelProto, why: str, said: str) -> str:
    """One line for a failed import: the operator and its node where the frontend names
    them (operators it lacks, or the one whose conversion failed)."""
    lacking = re.search(r"operators are not supported for frontend ONNX: (.+)", why)
    failed = re.search(r"Error converting operator (\w+)", said)
    if lacking is None and failed is None:
        return f"TVM's ONNX importer failed: {why}"
    ops = [op.strip() for op in lacking.group(1).split(",")] if lacking else [failed.group(1)]
    places = []
    for op in ops:
        nodes = [n.name or n.output[0] for n in proto.graph.node if n.op_type == op]
        places.append(f"{op} (node {nodes[0]!r})" if len(nodes) == 1
                      else f"{op} ({len(nodes)} nodes, e.g. {nodes[0]!r})" if nodes else op)
    if lacking:
        return f"TVM's ONNX importer has no conversion for {', '.join(places)}"
    return f"TVM's ONNX importer cannot convert {places[0]}: {why}"
