"""``tvm_tpp.compile``: ONNX or Relax in, a runnable and exportable model out.

Examples
--------
>>> import numpy as np, tvm_tpp
>>> from tvm_tpp import models
>>> m = tvm_tpp.compile(models.load("mlp"), target="tpp")
>>> (y,) = m.run(x=np.zeros(m.inputs[0].shape, "float32"))
>>> m.export("mlp.so")                                  # doctest: +SKIP
>>> tvm_tpp.load("mlp.so").run(x=...)                   # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import onnx
import tvm
from tvm import relax
from tvm.target import Target

from relay_passes.dense import Offload
from relay_passes.pipeline import tpp_pipeline
from schedules.tuner import Database, Tuner

from . import onnx_import
from .onnx_import import ModelError, TensorSpec
from .tpp_target import runs_on_host
from .tpp_target import target as make_target

__all__ = ["compile", "load", "CompiledModel", "ModelError", "NotRunnableError"]

_SIDECAR = ".json"  # export writes model.so and model.so.json (inputs, target)


class NotRunnableError(RuntimeError):
    """The model was built for an ISA this CPU does not execute."""


class CompiledModel:
    """A built model: run it on numpy arrays, time it, export it.

    Parameters
    ----------
    executable
        The Relax ``VMExecutable`` (or a loaded runtime module of one).
    target
        The target it was built for.
    inputs
        Names, shapes and dtypes of the inputs, in call order.
    compile_seconds
        Wall time of import + build, tuning included.
    tune_seconds
        The part of it spent tuning GEMMs (0 when the database knew them all).
    report
        What the graph passes routed to TPP kernels and what stayed with TVM, and why.
    """

    def __init__(
        self,
        executable,
        target: Target,
        inputs: Sequence[TensorSpec],
        compile_seconds: float = 0.0,
        report: Sequence[Offload] = (),
        tune_seconds: float = 0.0,
    ) -> None:
        self.executable = executable
        self.target = target
        self.inputs = list(inputs)
        self.compile_seconds = compile_seconds
        self.report = list(report)
        self.tune_seconds = tune_seconds
        self._vm = None

    @property
    def runnable(self) -> bool:
        """Whether this machine can execute the code (foreign ISAs can only be exported)."""
        return runs_on_host(self.target)

    def _machine(self) -> relax.VirtualMachine:
        if not self.runnable:
            raise NotRunnableError(
                f"code for {self.target.attrs.get('model') or self.target} cannot run on this "
                "CPU; export it or inspect it with `tvm-tpp compile --emit asm`"
            )
        if self._vm is None:
            self._vm = relax.VirtualMachine(self.executable, tvm.cpu())
        return self._vm

    def _arguments(self, arrays: Mapping[str, np.ndarray]) -> list:
        missing = [s.name for s in self.inputs if s.name not in arrays]
        extra = sorted(set(arrays) - {s.name for s in self.inputs})
        if missing or extra:
            raise ValueError(
                f"inputs must be exactly {[s.name for s in self.inputs]}; "
                f"missing {missing}, unexpected {extra}"
            )
        args = []
        for spec in self.inputs:
            array = np.ascontiguousarray(arrays[spec.name])
            if tuple(array.shape) != spec.shape or array.dtype != np.dtype(spec.dtype):
                raise ValueError(
                    f"input {spec.name!r} must be {spec.dtype}{list(spec.shape)}, "
                    f"got {array.dtype}{list(array.shape)}"
                )
            args.append(tvm.runtime.tensor(array, tvm.cpu()))
        return args

    def run(self, **inputs: np.ndarray) -> list[np.ndarray]:
        """Run on numpy inputs given by name; returns the outputs as numpy arrays."""
        result = self._machine()["main"](*self._arguments(inputs))
        return [o.numpy() for o in _flatten(result)]

    def time(
        self, inputs: Mapping[str, np.ndarray], number: int = 5, repeat: int = 5
    ) -> list[float]:
        """Per-run latencies in seconds (``repeat`` samples, each the mean of ``number`` runs)."""
        evaluator = self._machine().time_evaluator("main", tvm.cpu(), number=number, repeat=repeat)
        return list(evaluator(*self._arguments(inputs)).results)

    def export(self, path: str | os.PathLike) -> Path:
        """Write a shared library plus ``<path>.json`` describing its inputs and target.

        Code for another architecture is linked with its cross compiler
        (``<triple>-gcc``, e.g. Debian's gcc-aarch64-linux-gnu); a ``.tar`` path writes the
        object files unlinked instead.
        """
        path = Path(path)
        triple = str(self.target.attrs.get("mtriple", ""))
        if path.suffix == ".tar" or triple.startswith(platform.machine()) or not triple:
            self.executable.export_library(str(path))
        else:
            compiler = f"{triple.split('-')[0]}-linux-gnu-gcc"
            if shutil.which(compiler) is None:
                raise NotRunnableError(
                    f"linking {triple} code needs {compiler} on PATH; "
                    "or export to a .tar of object files"
                )
            from tvm.contrib import cc

            self.executable.export_library(str(path), fcompile=cc.cross_compiler(compiler))
        meta = {"inputs": [asdict(s) for s in self.inputs], "target": str(self.target)}
        Path(str(path) + _SIDECAR).write_text(json.dumps(meta, indent=1))
        return path


def _flatten(result) -> list:
    if isinstance(result, tvm.runtime.Tensor):
        return [result]
    return [leaf for item in result for leaf in _flatten(item)]


def load(path: str | os.PathLike) -> CompiledModel:
    """Load a model written by :meth:`CompiledModel.export`."""
    path = Path(path)
    meta_path = Path(str(path) + _SIDECAR)
    if not path.is_file() or not meta_path.is_file():
        raise ModelError(f"{path} (and {meta_path.name}) must both exist; write them with export()")
    meta = json.loads(meta_path.read_text())
    inputs = [TensorSpec(i["name"], tuple(i["shape"]), i["dtype"]) for i in meta["inputs"]]
    return CompiledModel(
        tvm.runtime.load_module(str(path)), Target(json.loads(meta["target"])), inputs
    )


def lower(mod: tvm.IRModule, target: Target) -> tvm.IRModule:
    """The Relax+TIR module after the target's graph pipeline (what ``--emit tir`` shows)."""
    with target:
        return tpp_pipeline(target)(mod)


def import_model(
    model: str | os.PathLike | bytes | onnx.ModelProto | tvm.IRModule,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
) -> tuple[tvm.IRModule, list[TensorSpec]]:
    """A Relax module and its input specs from any accepted model form."""
    if isinstance(model, tvm.IRModule):
        return model, _relax_inputs(model, input_shapes)
    proto = onnx_import.load_onnx(model)
    specs = onnx_import.input_specs(proto, input_shapes)
    return onnx_import.to_relax(proto, specs), specs


def _relax_inputs(
    mod: tvm.IRModule, shapes: Mapping[str, Sequence[int]] | None
) -> list[TensorSpec]:
    if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
        raise ModelError("the Relax module has no 'main' function")
    specs = []
    for param in mod["main"].params:
        ty = param.ty
        dims = shapes[param.name] if shapes and param.name in shapes else ty.shape
        try:
            shape = tuple(int(d) for d in dims)
        except (TypeError, ValueError):
            raise ModelError(
                f"Relax input {param.name!r} has a symbolic shape {ty.shape}; pass input_shapes"
            ) from None
        specs.append(TensorSpec(param.name, shape, str(ty.dtype)))
    return specs


def compile(  # noqa: A001 - the public name users expect, as in tvm.compile
    model: str | os.PathLike | bytes | onnx.ModelProto | tvm.IRModule,
    target: str | dict | Target = "tpp",
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    tune: bool = False,
    tune_budget: float | None = None,
    work_dir: str | os.PathLike | None = None,
    on_tuned: Callable | None = None,
) -> CompiledModel:
    """Import, rewrite to TPP kernels, and build a model.

    Parameters
    ----------
    model
        An ONNX file path, serialized ONNX bytes, an ``onnx.ModelProto`` or a Relax
        ``IRModule`` (its ``main`` function's parameters are the inputs).
    target
        ``"tpp"`` (this host), ``"tpp -isa=NAME"`` (a foreign ISA: build and export only), or
        any TVM target (dict or ``Target``): non-tpp targets get TVM's plain lowering.
    input_shapes
        Shapes by input name, for inputs with symbolic dimensions.
    tune
        Tune the loop_spec space of each GEMM, conv and batch GEMM (seconds each; needs a
        target this CPU runs).  Results persist in ``work_dir/tuning.json`` and are reused
        by later compiles.
    tune_budget
        Seconds the tuner may spend per operator (default: measure all its candidates).
    work_dir
        Where the tuning database lives (default ``./tvm_tpp_work``); read even without
        ``tune`` when it holds the database, so tuned models rebuild tuned.
    on_tuned
        Called with ``(problem, TuneResult)`` after each operator is tuned or looked up
        (a GemmProblem, ConvProblem or BatchGemmProblem).

    Raises
    ------
    ModelError
        Missing or malformed model, symbolic shapes, unsupported operators.
    ValueError
        Unknown ISA or malformed target spec.
    """
    tgt = make_target(target)
    if tune and not runs_on_host(tgt):
        raise NotRunnableError(f"tuning measures on this CPU, which cannot run {tgt}")
    db_path = Path(work_dir or "tvm_tpp_work") / "tuning.json"
    use_db = tune or (work_dir is not None and db_path.is_file())
    tuned: list[float] = []

    def record(problem, result) -> None:
        tuned.append(result.tune_seconds)
        if on_tuned is not None:
            on_tuned(problem, result)

    tuner = Tuner(Database(db_path), budget_seconds=tune_budget, tune_missing=tune,
                  on_result=record) if use_db else None
    start = time.perf_counter()
    mod, specs = import_model(model, input_shapes)
    report: list[Offload] = []
    executable = tvm.compile(mod, target=tgt, relax_pipeline=tpp_pipeline(tgt, report, tuner))
    return CompiledModel(executable, tgt, specs, time.perf_counter() - start, report, sum(tuned))
