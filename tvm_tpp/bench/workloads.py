"""What a benchmark worker computes: an ONNX model on stored inputs, or one GEMM
(float32, int8 or bfloat16).

A workload knows its operands and how a run's outputs are checked; how an implementation
builds it is :mod:`tvm_tpp.bench.impls`.  Workloads travel to the worker as JSON
(:func:`to_json`, :func:`from_json`).

Examples
--------
>>> from_json(to_json(GemmWorkload(64, 32, 16)))
GemmWorkload(m=64, n=32, k=16, dtype='float32')
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

__all__ = ["BF16_OUTPUT_ROUNDING", "GEMM_DTYPES", "GemmWorkload", "ModelWorkload", "Workload",
           "from_json", "to_json"]


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
    symbolic_batch
        Inputs of ``input_shapes`` whose symbolic batch was set to this run's size: a build
        may keep it symbolic (one build for every batch size).
    """

    model: str
    inputs: str
    outputs: str
    key: str
    input_shapes: dict[str, list[int]] | None = None
    symbolic_batch: tuple[str, ...] = ()

    def fixed_shapes(self) -> dict[str, list[int]] | None:
        """The input shapes a build with a symbolic batch takes (those given by the user)."""
        fixed = {k: v for k, v in (self.input_shapes or {}).items()
                 if k not in self.symbolic_batch}
        return fixed or None

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("a model workload needs a key")
        object.__setattr__(self, "symbolic_batch", tuple(self.symbolic_batch))

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


#: bench-gemm's GEMM dtypes: ``float32``; ``int8`` (uint8 X, int8 W, int32 Y); ``bfloat16``
#: (bf16 X and W, float32 Y).
GEMM_DTYPES = ("float32", "int8", "bfloat16")
#: The output error a bf16 GEMM may have, relative to ``|X| @ |W|`` of the rounded operands:
#: one bf16 rounding of the output (a library may return bf16) plus the float32 accumulation.
BF16_OUTPUT_ROUNDING = 2.0 ** -8


@dataclass(frozen=True)
class GemmWorkload:
    """``Y[m, n] = X[m, k] @ W[k, n]`` on seeded random operands of ``dtype``
    (:data:`GEMM_DTYPES`).

    ``float32``: standard normal X and W.  ``int8``: X uniform in [0, 255] (uint8), W in
    [-128, 127] (int8), Y in int32, checked exactly.  ``bfloat16``: standard normal X and W
    rounded to bf16 (``ml_dtypes.bfloat16``), Y in float32, checked against float64 on the
    rounded operands within :data:`BF16_OUTPUT_ROUNDING` plus ``k`` float32 roundings of
    ``|X| @ |W|``.

    >>> GemmWorkload(4, 4, 4, "int8").key, GemmWorkload(4, 4, 4, "int8").float32()
    ('4x4x4_int8', GemmWorkload(m=4, n=4, k=4, dtype='float32'))
    """

    m: int
    n: int
    k: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if min(self.m, self.n, self.k) < 1:
            raise ValueError(f"GEMM sizes must be positive, got {self.m}x{self.n}x{self.k}")
        if self.dtype not in GEMM_DTYPES:
            raise ValueError(f"GEMM dtype must be one of {', '.join(GEMM_DTYPES)}, "
                             f"got {self.dtype!r}")

    @property
    def key(self) -> str:
        shape = f"{self.m}x{self.n}x{self.k}"
        return shape if self.dtype == "float32" else f"{shape}_{self.dtype}"

    @property
    def flops(self) -> int:
        """Operations of one run: 2 per multiply-add, whatever the dtype."""
        return 2 * self.m * self.n * self.k

    def float32(self) -> GemmWorkload:
        """The float32 GEMM of the same shape (a low-precision run's 1x reference)."""
        return GemmWorkload(self.m, self.n, self.k)

    def operands(self, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """``X`` and ``W``, the same for every implementation."""
        import numpy as np

        rng = np.random.default_rng([seed, self.m, self.n, self.k])
        if self.dtype == "int8":
            return (rng.integers(0, 256, (self.m, self.k)).astype("uint8"),
                    rng.integers(-128, 128, (self.k, self.n)).astype("int8"))
        x = rng.standard_normal((self.m, self.k)).astype("float32")
        w = rng.standard_normal((self.k, self.n)).astype("float32")
        if self.dtype == "bfloat16":
            import ml_dtypes

            return x.astype(ml_dtypes.bfloat16), w.astype(ml_dtypes.bfloat16)
        return x, w

    def check(self, outputs: list[np.ndarray], seed: int) -> dict[str, Any]:
        """``max_abs_err`` of ``Y`` against numpy in float64 (int8: in int64).

        Raises
        ------
        ValueError
            A low-precision ``Y`` of the wrong shape, an int8 ``Y`` that is not exact, or a
            bf16 ``Y`` outside the tolerance (the class docstring).
        """
        import numpy as np

        x, w = self.operands(seed)
        y = np.asarray(outputs[0])
        if self.dtype == "int8":
            reference = x.astype(np.int64) @ w.astype(np.int64)
            if y.shape != reference.shape:
                raise ValueError(f"int8 GEMM: Y is {list(y.shape)}, not {list(reference.shape)}")
            err = np.abs(y.astype(np.int64) - reference)
            wrong = int(np.count_nonzero(err))
            if wrong:
                raise ValueError(f"int8 GEMM not exact: {wrong} of {err.size} outputs differ "
                                 f"from the int64 product, by up to {int(err.max())}")
            return {"max_abs_err": 0.0}
        x64, w64 = x.astype(np.float64), w.astype(np.float64)
        reference = x64 @ w64
        if y.shape != reference.shape:
            raise ValueError(f"{self.dtype} GEMM: Y is {list(y.shape)}, not "
                             f"{list(reference.shape)}")
        err = np.abs(y.astype(np.float64) - reference)
        if self.dtype == "bfloat16":
            bound = (BF16_OUTPUT_ROUNDING + self.k * 2.0 ** -24) * (np.abs(x64) @ np.abs(w64))
            over = err > bound
            if np.any(over) or not np.all(np.isfinite(y)):
                worst = float(np.max(err / np.maximum(bound, np.finfo(np.float64).tiny)))
                raise ValueError(f"bf16 GEMM outside tolerance: {int(np.count_nonzero(over))} "
                                 f"of {err.size} outputs, worst at {worst:.3g}x the bound")
        return {"max_abs_err": float(np.max(err))}


Workload = ModelWorkload | GemmWorkload
_KINDS: dict[str, type] = {"model": ModelWorkload, "gemm": GemmWorkload}


def to_json(workload: Workload) -> dict[str, Any]:
    """``{kind: fields}``, the form a :class:`~tvm_tpp.bench.protocol.Job` carries."""
    kind = next(name for name, cls in _KINDS.items() if isinstance(workload, cls))
    fields = asdict(workload)
    if isinstance(workload, GemmWorkload) and workload.dtype == "float32":
        del fields["dtype"]  # the default: a float32 GEMM's JSON is as before dtypes
    return {kind: fields}


def from_json(data: dict[str, Any]) -> Workload:
    """The workload :func:`to_json` described."""
    ((kind, fields),) = data.items()
    if kind not in _KINDS:
        raise ValueError(f"unknown workload kind {kind!r}; known: {', '.join(_KINDS)}")
    return _KINDS[kind](**fields)
