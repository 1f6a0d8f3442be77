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

__all__ = ["TensorSpec", "load_onnx", "input_specs", "to_relax"]


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
