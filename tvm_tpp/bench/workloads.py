"""What a benchmark worker computes: an ONNX model on stored inputs, or one fp32 GEMM.

A workload knows its operands and how a run's outputs are checked; how an implementation
builds it is :mod:`tvm_tpp.bench.impls`.  Workloads travel to the worker as JSON
(:func:`to_json`, :func:`from_json`).

Examples
--------
>>> from_json(to_json(GemmWorkload(64, 32, 16)))
GemmWorkload(m=64, n=32, k=16)
>>> GemmWorkload(64, 32, 16).key, GemmWorkload(64, 32, 16).flops
('64x32x16', 65536)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import onnx

    from ..onnx_import import TensorSpec

__all__ = ["GemmWorkload", "ModelWorkload", "Workload", "from_json", "to_json"]


@dataclass(frozen=True)
class ModelWorkload:
    """An ONNX model on the inputs of an ``.npz``; its outputs go to another ``.npz``, which
    the harness checks against ONNX Runtime's.

    Parameters
    ----------
    model
        Path of the ONNX model.
    inputs
        ``.npz`` of the inputs, keyed by input name.
    outputs
        ``.npz`` the worker writes its outputs to (``out0``, ``out1``, ...).
    key
        Names the model and batch in per-workload files (``"mlp_1"``).
    input_shapes
        Shapes by input name, for symbolic dimensions.
    """

    model: str
    inputs: str
    outputs: str
    key: str
    input_shapes: dict[str, list[int]] | None = None

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("a model workload needs a key")

    def load(self) -> tuple[onnx.ModelProto, list[TensorSpec], list[np.ndarray]]:
        """The model, its input specs and its inputs in the specs' order."""
        import numpy as np

        from ..onnx_import import input_specs, load_onnx

        proto = load_onnx(self.model)
        specs = input_specs(proto, self.input_shapes)
        with np.load(self.inputs) as stored:
            inputs = [np.ascontiguousarray(stored[s.name]) for s in specs]
        return proto, specs, inputs

    def check(self, outputs: list[np.ndarray], seed: int) -> dict[str, Any]:
        """Write ``outputs`` for the harness (which holds the reference); nothing to report."""
        import numpy as np

        np.savez(self.outputs, **{f"out{i}": np.asarray(o) for i, o in enumerate(outputs)})
        return {}


@dataclass(frozen=True)
class GemmWorkload:
    """``Y[m, n] = X[m, k] @ W[k, n]`` in float32 on seeded random operands."""

    m: int
    n: int
    k: int

    def __post_init__(self) -> None:
        if min(self.m, self.n, self.k) < 1:
            raise ValueError(f"GEMM sizes must be positive, got {self.m}x{self.n}x{self.k}")

    @property
    def key(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    def operands(self, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """``X`` and ``W``, the same for every implementation."""
        import numpy as np

        rng = np.random.default_rng([seed, self.m, self.n, self.k])
        return (rng.standard_normal((self.m, self.k)).astype("float32"),
                rng.standard_normal((self.k, self.n)).astype("float32"))

    def check(self, outputs: list[np.ndarray], seed: int) -> dict[str, Any]:
        """``max_abs_err`` of ``Y`` against numpy in float64."""
        import numpy as np

        x, w = self.operands(seed)
        reference = x.astype(np.float64) @ w.astype(np.float64)
        return {"max_abs_err": float(np.max(np.abs(np.asarray(outputs[0]) - reference)))}


Workload = ModelWorkload | GemmWorkload
_KINDS: dict[str, type] = {"model": ModelWorkload, "gemm": GemmWorkload}


def to_json(workload: Workload) -> dict[str, Any]:
    """``{kind: fields}``, the form a :class:`~tvm_tpp.bench.protocol.Job` carries."""
    kind = next(name for name, cls in _KINDS.items() if isinstance(workload, cls))
    return {kind: asdict(workload)}


def from_json(data: dict[str, Any]) -> Workload:
    """The workload :func:`to_json` described."""
    ((kind, fields),) = data.items()
    if kind not in _KINDS:
        raise ValueError(f"unknown workload kind {kind!r}; known: {', '.join(_KINDS)}")
    return _KINDS[kind](**fields)
