"""ONNX models in: loading with clear errors, static input shapes, conversion to Relax.

Examples
--------
>>> from tvm_tpp import onnx_import, models
>>> proto = models.load("mlp")
>>> [s.name for s in onnx_import.input_specs(proto)]
['x']
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx

from .errors import ModelError
from .quantized import to_qdq

__all__ = ["TensorSpec", "load_onnx", "input_specs", "check_shapes", "to_relax"]


@dataclass(frozen=True)
class TensorSpec:
    """Name, static shape and dtype of one model input."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if any(not isinstance(d, int) or d < 0 for d in self.shape):
            raise ModelError(f"input {self.name!r} has a non-static shape {self.shape}")


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
    """The real graph inputs (initializers excluded) with their static shapes.

    ``shapes`` overrides or fills in shapes by input name; a dimension that stays symbolic or
    unknown is an error naming the input, so the user knows which shape to pass.
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
            for dim in tensor.shape.dim:
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


def check_shapes(proto: onnx.ModelProto, specs: Sequence[TensorSpec]) -> None:
    """ModelError unless the model's operators accept inputs of these shapes (ONNX's strict
    shape inference), so a wrong size given for a symbolic dimension is named as such, not
    as a failure deep in TVM's importer."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    by_name = {s.name: s for s in specs}
    for value in model.graph.input:
        if value.name in by_name:
            dims = value.type.tensor_type.shape.dim
            del dims[:]
            for d in by_name[value.name].shape:
                dims.add().dim_value = d
    try:
        onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as err:
        lines = [line for line in str(err).strip().splitlines() if line.strip()]
        given = ", ".join(f"{s.name}={','.join(map(str, s.shape))}" for s in specs)
        raise ModelError(f"the input shapes ({given}) do not fit the model: "
                         f"{lines[0] if lines else err}") from None


def to_relax(proto: onnx.ModelProto, specs: Sequence[TensorSpec]):
    """Import into a Relax ``IRModule`` with TVM's ONNX frontend (weights become constants).

    Quantized operators the frontend lacks (ONNX Runtime's QOperator and dynamic quantization)
    are first rewritten into QDQ form by :func:`tvm_tpp.quantized.to_qdq`.
    """
    from tvm.relax.frontend.onnx import from_onnx

    proto = to_qdq(proto)
    try:
        return from_onnx(
            proto,
            shape_dict={s.name: list(s.shape) for s in specs},
            dtype_dict={s.name: s.dtype for s in specs},
        )
    except Exception as err:
        # The frontend raises bare TVM errors for unsupported operators; name the op if we can.
        lines = str(err).strip().splitlines()
        raise ModelError(f"TVM's ONNX importer failed: {lines[-1] if lines else err}") from err
