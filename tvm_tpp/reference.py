"""Reference results: ONNX Runtime on the same inputs, and how errors are measured.

The relative error is normwise, ``max|got - want| / max|want|`` per output (an elementwise
ratio explodes on outputs near zero), and the worst output counts.

Examples
--------
>>> import numpy as np
>>> abs_err, rel_err = max_errors([np.array([1.0, 2.0])], [np.array([1.0, 2.002])])
>>> round(abs_err, 6), round(rel_err, 6)
(0.002, 0.000999)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from .onnx_import import TensorSpec

__all__ = ["random_inputs", "onnxruntime_session", "openvino_compiled", "openvino_request",
           "run_onnxruntime", "max_errors"]


def random_inputs(specs: Sequence[TensorSpec], seed: int = 0, batch: int = 1
                  ) -> dict[str, np.ndarray]:
    """Seeded inputs: standard normal floats, small non-negative integers (ids, indices);
    ``batch`` images or samples where the batch is symbolic."""
    rng = np.random.default_rng(seed)
    inputs = {}
    for spec in (s.at(batch) for s in specs):
        if np.issubdtype(np.dtype(spec.dtype), np.floating):
            inputs[spec.name] = rng.standard_normal(spec.shape).astype(spec.dtype)
        else:
            inputs[spec.name] = rng.integers(0, 8, spec.shape).astype(spec.dtype)
    return inputs


#: How far an output may be from the reference, by precision (max |error| / max |reference|,
#: :func:`max_errors`).  float32: rounding only.  bf16 rounds X and W to 8 significant bits
#: (about 1e-3 over a few thousand-term dot products), and the errors grow with depth: VGG-19
#: at batch 8 came out 1.07e-2 from float32 in tpp's bf16 and 1.14e-2 in OpenVINO's (Sapphire
#: Rapids, 2026-11-29).  int8: against the model's QDQ graph as
#: ONNX Runtime runs it unfused (the ONNX spec's roundings); ONNX Runtime's own fused int8 run
#: differs from that by up to 3.2 % (BERT, measured 2026-11-25; tpp 0.8 %).
TOLERANCES = {"float32": 1e-4, "bf16": 2e-2, "int8": 5e-2}


def onnxruntime_session(proto: onnx.ModelProto, threads: int | None = None,
                        optimize: bool = True, profile_prefix: str | None = None):
    """ONNX Runtime's CPU session on ``proto``: ``threads`` intra-op threads and one inter-op
    thread (its default otherwise), ``optimize=False`` without graph optimizations, and with
    ``profile_prefix`` its per-node profiler on, writing there."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if threads is not None:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return ort.InferenceSession(proto.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def openvino_compiled(proto: onnx.ModelProto, shapes: Mapping[str, Sequence[int]],
                      threads: int, f32: bool = False, profile: bool = False):
    """OpenVINO's CPU plugin on ``proto`` with its inputs reshaped to ``shapes`` and
    ``INFERENCE_NUM_THREADS`` = ``threads``; otherwise its defaults (bf16 where the CPU has
    AVX512-BF16 or AMX: what a user gets) or, with ``f32``, ``INFERENCE_PRECISION_HINT`` f32;
    ``profile`` turns its per-node counters on (``PERF_COUNT``).

    Raises
    ------
    ImportError
        ``openvino`` is not installed (the ``openvino`` extra).
    """
    import openvino as ov
    import openvino.properties as props
    import openvino.properties.hint as hints

    core = ov.Core()
    model = core.read_model(proto.SerializeToString())
    model.reshape({name: list(shape) for name, shape in shapes.items()})
    config: dict = {props.inference_num_threads: threads}
    if f32:
        config[hints.inference_precision] = ov.Type.f32
    if profile:
        config[props.enable_profiling] = True
    return core.compile_model(model, "CPU", config)


def openvino_request(compiled, inputs: Mapping[str, np.ndarray]):
    """An infer request of an :func:`openvino_compiled` model with ``inputs`` bound once, by
    name: ``request.infer()`` runs it on them."""
    import openvino as ov

    request = compiled.create_infer_request()
    for index, port in enumerate(compiled.inputs):
        # A copy the tensor owns: a shared one would not keep the array alive.
        request.set_input_tensor(index, ov.Tensor(inputs[port.get_any_name()]))
    return request


def run_onnxruntime(
    proto: onnx.ModelProto, inputs: Mapping[str, np.ndarray], threads: int | None = None,
    optimize: bool = True,
) -> list[np.ndarray]:
    """Outputs of ONNX Runtime's CPU provider; ``optimize=False`` runs the graph as written
    (no fusions: a QDQ model's DequantizeLinear, float op and QuantizeLinear each as the ONNX
    specification defines them, where the optimized run fuses them into integer kernels)."""
    return onnxruntime_session(proto, threads, optimize).run(None, dict(inputs))


def max_errors(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> tuple[float, float]:
    """(max absolute error, max normwise relative error) over all outputs."""
    if len(got) != len(want):
        raise ValueError(f"{len(got)} outputs, reference has {len(want)}")
    abs_err = rel_err = 0.0
    for g, w in zip(got, want, strict=True):
        if g.shape != w.shape:
            raise ValueError(f"output shape {g.shape} differs from reference {w.shape}")
        diff = float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64)), initial=0.0))
        scale = float(np.max(np.abs(w.astype(np.float64)), initial=0.0))
        abs_err = max(abs_err, diff)
        rel_err = max(rel_err, diff / scale if scale > 0 else diff)
    return abs_err, rel_err
