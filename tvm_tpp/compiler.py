"""Build phases of a model: import, tune (a phase of its own), lower, compile; load exports.

Tuning writes a database; compiling only reads it, as with MetaSchedule.

Examples
--------
>>> import numpy as np, tvm_tpp
>>> from tvm_tpp import models
>>> m = tvm_tpp.compile(models.load("mlp"), target="tpp")
>>> (y,) = m.run(x=np.zeros(m.inputs[0].shape, "float32"))
>>> m.export("mlp.so")                                  # doctest: +SKIP
>>> tvm_tpp.load("mlp.so").run(x=...)                   # doctest: +SKIP
>>> tvm_tpp.tune(models.load("mlp"), work_dir="work")   # doctest: +SKIP
>>> tvm_tpp.compile(models.load("mlp"), work_dir="work").report[0].kernel  # doctest: +SKIP
'tpp_dense_1x1024x512_bias_relu [CBa]'
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import onnx
import tvm
from tvm import relax
from tvm.target import Target

from microkernels.machine import is_tpp, machine_of
from relay_passes import Offload, tpp_flops_fraction
from relay_passes.dense import PRECISIONS
from relay_passes.pipeline import tpp_pipeline, tpp_rewrites
from schedules import database as _database_file
from schedules import remote as _remote
from schedules import tuner as _tuner
from schedules.database import StoreError
from schedules.dynamic_parallel import pipeline_for
from schedules.measure import linker
from schedules.tuner import Database, TaskCollector, Tuner, TuneResult

from . import onnx_import
from .errors import DatabaseError, ModelError, NotRunnableError, RemoteError, UsageError
from .onnx_import import TensorSpec
from .tpp_target import remote_target, runs_on_host, spec_isa
from .tpp_target import target as make_target

if TYPE_CHECKING:
    from schedules.batch_gemm import BatchGemmProblem
    from schedules.conv import ConvProblem
    from schedules.gemm import GemmProblem

    from .layer_compare import LayerComparison
    from .profiling import Profile

    Problem = GemmProblem | ConvProblem | BatchGemmProblem

__all__ = ["compile", "tune", "lower", "load", "import_model", "remote_pool", "target_spec",
           "CompiledModel", "Tuned", "PRECISION_CHOICES", "STRICT_BF16", "kernel_precision",
           "precision_note", "int8_note", "library_path", "LIBRARY_SUFFIXES",
           "WORK_DIR", "DATABASE", "ARTIFACT_FORMAT", "native_output"]

#: The work directory :func:`tune` writes by default, and :func:`compile` reads if it exists.
WORK_DIR = Path("tvm_tpp_work")
#: The tuning database's file name in a work directory (an SQLite file; a ``tuning.json``
#: of earlier versions beside it is migrated when the database is first opened).
DATABASE = _database_file.FILE_NAME
_TOP_K = 8  # candidates measured per operator besides its default
_SIDECAR = ".json"  # export writes model.so and model.so.json (format, inputs, target, hash)
_SOURCE_FORMATS = {"asm": "asm", "llvm": "ll"}  # CompiledModel.source's kinds, LLVM's names
#: bf16 kernels on every ISA, emulated (exactly, and slower than float32) where the ISA has
#: no bf16 arithmetic: a bf16 CPU's numbers on any machine.
STRICT_BF16 = "bf16-strict"
#: What ``precision=`` of :func:`compile`, :func:`tune` and :func:`lower` takes.
PRECISION_CHOICES = (*PRECISIONS, STRICT_BF16)
#: What :func:`compile` and :func:`tune` accept as a model.
Model = str | os.PathLike | bytes | onnx.ModelProto | tvm.IRModule


class Tuned(NamedTuple):
    """One operator :func:`tune` handled and its result (``result.cached``: known already)."""

    problem: Problem
    result: TuneResult


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
    report
        What the graph passes routed to TPP kernels (their configs in brackets) and what
        stayed with TVM, and why.
    tune_seconds
        The part of ``compile_seconds`` spent tuning (0 when the database knew every operator).
    database
        The tuning database the configs were looked up in; None: every operator's default.
    requested_precision
        The ``precision`` the build was asked for (None: unknown, as for a loaded export).
    """

    def __init__(
        self,
        executable,
        target: Target,
        inputs: Sequence[TensorSpec],
        compile_seconds: float = 0.0,
        report: Sequence[Offload] = (),
        tune_seconds: float = 0.0,
        database: Path | None = None,
        requested_precision: str | None = None,
    ) -> None:
        self.executable = executable
        self.target = target
        self.inputs = list(inputs)
        self.compile_seconds = compile_seconds
        self.report = list(report)
        self.tune_seconds = tune_seconds
        self.database = database
        self.requested_precision = requested_precision
        self._vm = None

    @property
    def precision(self) -> str | None:
        """What the float layers multiply in, ``"float32"`` or ``"bf16"``
        (:func:`kernel_precision`; None: unknown, as for a loaded export)."""
        if self.requested_precision is None:
            return None
        return kernel_precision(self.requested_precision, self.target)

    @property
    def precision_note(self) -> str | None:
        """Why the float layers run in another precision than the one asked for, or None
        (:func:`precision_note`)."""
        if self.requested_precision is None:
            return None
        return precision_note(self.requested_precision, self.target)

    @property
    def int8_note(self) -> str | None:
        """Why the model's quantized layers multiply in float32, or None (:func:`int8_note`)."""
        return int8_note(self.report, self.target)

    @property
    def tpp_flops_fraction(self) -> float | None:
        """The share of the reported (matmul, conv, attention) operators' FLOPs that TPP
        kernels compute; None if the report counts none."""
        return tpp_flops_fraction(self.report)

    @property
    def runnable(self) -> bool:
        """Whether this machine can execute the code (foreign ISAs can only be exported)."""
        return runs_on_host(self.target)

    def _machine(self) -> relax.VirtualMachine:
        # Every run and time (of a compiled or loaded model) comes here first: for an AMX
        # build, runs_on_host asks Linux for the tile state (once per process) and says no
        # where it is refused, so no tile instruction runs without it (it would be SIGILL).
        # A granted permission lasts for the process, so the first call checks for all.
        if self._vm is None:
            if not self.runnable:
                raise NotRunnableError(
                    f"code for {self.target.attrs.get('model') or self.target} cannot run on "
                    "this CPU; export it or inspect it with `tvm-tpp compile --emit asm`"
                )
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
        batches: dict[str, int] = {}  # a symbolic batch's size, as the first input sets it
        for spec in self.inputs:
            # Not np.ascontiguousarray: it makes a 0-d array (a scalar input) 1-d.
            array = np.require(arrays[spec.name], requirements="C")
            if spec.batch is not None and array.ndim == len(spec.shape) and array.shape[0] >= 1:
                spec = spec.at(batches.setdefault(spec.batch, array.shape[0]))
            if tuple(array.shape) != spec.shape or array.dtype != np.dtype(spec.dtype):
                raise ValueError(
                    f"input {spec.name!r} must be {spec.dtype}{list(spec.shape)}, "
                    f"got {array.dtype}{list(array.shape)}"
                )
            args.append(tvm.runtime.tensor(array, tvm.cpu()))
        return args

    def run(self, **inputs: np.ndarray) -> list[np.ndarray]:
        """Run on numpy inputs given by name; returns the outputs as numpy arrays.

        Raises
        ------
        UsageError
            The inputs hold a value the model refuses, e.g. an index out of a Gather's range
            (:data:`relay_passes.guards.OUT_OF_RANGE`).
        """
        from relay_passes.guards import OUT_OF_RANGE

        try:
            result = self._machine()["main"](*self._arguments(inputs))
        except Exception as err:  # TVM raises the kernels' run-time checks as its own types
            message = str(err)
            if OUT_OF_RANGE not in message:
                raise
            detail = message[message.index(OUT_OF_RANGE):].splitlines()[0]
            raise UsageError(f"the inputs are out of the model's range: {detail}") from None
        return [o.numpy() for o in _flatten(result)]

    def time(
        self, inputs: Mapping[str, np.ndarray], number: int = 5, repeat: int = 5
    ) -> list[float]:
        """Per-run latencies in seconds (``repeat`` samples, each the mean of ``number`` runs)."""
        evaluator = self._machine().time_evaluator("main", tvm.cpu(), number=number, repeat=repeat)
        return list(evaluator(*self._arguments(inputs)).results)

    def profile(self, inputs: Mapping[str, np.ndarray] | None = None, repeat: int = 10
                ) -> Profile:
        """Time per operator: every call of the model's VM over ``repeat`` runs, grouped by
        kind (TPP kernel, layout conversion, TVM fallback, VM builtin) with each one's share
        (:mod:`tvm_tpp.profiling`).  ``inputs`` by name; default: seeded random ones.

        Examples
        --------
        >>> from tvm_tpp import models
        >>> p = compile(models.load("mlp"), target="tpp").profile(repeat=2)
        >>> sorted({o.kind for o in p.operators}), round(sum(p.shares.values()), 6)
        (['builtin', 'tpp'], 1.0)
        """
        from .profiling import profile_vm
        from .reference import random_inputs

        self._machine()  # refuses code this CPU cannot run
        args = self._arguments(random_inputs(self.inputs) if inputs is None else inputs)
        # A VM of its own: the instrument stays off the one run() and time() use.
        return profile_vm(relax.VirtualMachine(self.executable, tvm.cpu()), args, repeat)

    def compare_layers(self, model: onnx.ModelProto | str, inputs: Mapping[str, np.ndarray]
                       | None = None, rounds: int = 3, repeat: int = 10,
                       warmup_seconds: float = 3.0, against: str = "onnxruntime"
                       ) -> LayerComparison:
        """Each conv, dense layer and attention batch matmul's time next to the node of the
        same shape that ONNX Runtime (or OpenVINO, ``against="openvino"`` or
        ``"openvino-f32"``) runs on ``model`` (the ONNX file this was compiled from, or its
        path), timed in this process in alternating rounds with TVM's thread count, after
        ``warmup_seconds`` of both (:mod:`tvm_tpp.layer_compare`).

        Examples
        --------
        >>> from tvm_tpp import models
        >>> mlp = models.load("mlp")
        >>> cmp = compile(mlp, target="tpp").compare_layers(mlp, rounds=1, repeat=1,
        ...                                                 warmup_seconds=0)
        >>> sorted(layer.key for layer in cmp.layers if layer.ratio)
        ['dense 1x1024x1024', 'dense 1x1024x512', 'dense 1x512x1024']
        """
        import tvm_ffi

        from .layer_compare import compare_layers
        from .reference import random_inputs

        self._machine()  # refuses code this CPU cannot run
        inputs = random_inputs(self.inputs) if inputs is None else inputs
        proto = onnx.load(model) if isinstance(model, (str, os.PathLike)) else model
        threads = tvm_ffi.get_global_func("runtime.NumThreads")()
        return compare_layers(relax.VirtualMachine(self.executable, tvm.cpu()),
                              self._arguments(inputs), proto, inputs, threads, rounds, repeat,
                              warmup_seconds, against)

    def source(self, kind: str = "asm") -> str:
        """The generated code of a model compiled in this process: ``"asm"`` or ``"llvm"`` IR.

        Examples
        --------
        >>> "fmla" in tvm_tpp.compile(model, target="tpp -isa=neon").source("asm")  # doctest: +SKIP
        True
        """
        if kind not in _SOURCE_FORMATS:
            raise ValueError(f"kind must be one of {list(_SOURCE_FORMATS)}, got {kind!r}")
        if not isinstance(self.executable, relax.VMExecutable):
            raise UsageError("a loaded model keeps no source; compile it to inspect its code")
        return "\n".join(m.inspect_source(_SOURCE_FORMATS[kind])
                         for m in self.executable.mod.imports)

    def export(self, path: str | os.PathLike) -> Path:
        """Write a shared library plus ``<path>.json`` describing it: its inputs, target, size
        and SHA-256 (:func:`load` checks them before it maps the library).

        Code for another architecture is linked with its cross compiler
        (``<triple>-gcc``, e.g. Debian's gcc-aarch64-linux-gnu); a ``.tar`` path writes the
        object files unlinked instead.

        Raises
        ------
        UsageError
            ``path`` is not a file in an existing, writable directory.
        NotRunnableError
            Foreign code and no cross compiler to link it.
        """
        path = library_path(path)
        if path.is_dir() or not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
            raise UsageError(f"cannot write {path}: not a file in an existing, writable "
                             "directory")
        triple = str(self.target.attrs.get("mtriple", ""))
        with native_output():
            if path.suffix == ".tar" or triple.startswith(platform.machine()) or not triple:
                self.executable.export_library(str(path))
            else:
                compiler = f"{triple.split('-')[0]}-linux-gnu-gcc"
                if shutil.which(compiler) is None:
                    raise NotRunnableError(
                        f"linking {triple} code needs {compiler} on PATH; "
                        "or export to a .tar of object files"
                    )
                from tvm.support import cc

                self.executable.export_library(str(path), fcompile=cc.cross_compiler(compiler))
        meta = {"format": ARTIFACT_FORMAT, "inputs": [asdict(s) for s in self.inputs],
                "target": str(self.target), "arch": _arch(self.target),
                "library": {"name": path.name, "size": path.stat().st_size,
                            "sha256": _sha256(path)}}
        meta["digest"] = _digest(meta)
        Path(str(path) + _SIDECAR).write_text(json.dumps(meta, indent=1))
        return path


def _flatten(result) -> list:
    if isinstance(result, tvm.runtime.Tensor):
        return [result]
    return [leaf for item in result for leaf in _flatten(item)]


#: The sidecar's format: :func:`load` reads only this one (older exports: export again).
ARTIFACT_FORMAT = 2

_native_log = logging.getLogger("tvm_tpp.native")


@contextlib.contextmanager
def native_output() -> Iterator[None]:
    """Keep what native code prints to the process's stderr in the block (TVM's C++ log:
    ``Warning: Scope Saving:``, LLVM's ``Unknown pragma``, ...) out of the terminal: it is
    logged line by line at INFO level on the ``tvm_tpp.native`` logger (``tvm-tpp -v`` shows
    it).  Python's own ``sys.stderr`` keeps writing to the terminal meanwhile.

    Examples
    --------
    >>> with native_output():
    ...     _ = os.write(2, b"Warning: Scope Saving: global\\n")  # not shown
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no fd 2 (embedded): nothing to keep out
        yield
        return
    python_stderr = sys.stderr
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            if python_stderr.fileno() == 2:  # Python's writes still reach the terminal
                sys.stderr = open(saved, "w", buffering=1, closefd=False)  # noqa: SIM115
        except (OSError, ValueError, AttributeError):  # a replaced sys.stderr (tests)
            pass
        try:
            yield
        finally:
            if sys.stderr is not python_stderr:
                sys.stderr.flush()
                sys.stderr = python_stderr
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            for line in sink.read().decode("utf-8", "replace").splitlines():
                if line.strip():
                    _native_log.info(line)


def _arch(tgt: Target) -> str:
    """The architecture code for ``tgt`` runs on (its triple's first part), or the host's."""
    triple = str(tgt.attrs.get("mtriple", "")) if tgt.kind.name == "llvm" else ""
    return triple.split("-")[0] if triple else platform.machine()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _digest(meta: dict) -> str:
    """The SHA-256 of a sidecar's fields but its digest: an edited sidecar (inputs that the
    library does not take) is refused by :func:`load`, not failed on deep in a run."""
    fields = {k: v for k, v in meta.items() if k != "digest"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _sidecar(meta_path: Path) -> dict:
    """The sidecar's contents, every field checked; ModelError naming the first bad one."""

    def bad(what: str) -> ModelError:
        return ModelError(f"{meta_path} is not a valid tvm-tpp sidecar ({what}); "
                          "export the model again")

    try:
        meta = json.loads(meta_path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise bad(f"not JSON: {err}") from None
    if not isinstance(meta, dict):
        raise bad(f"a JSON {type(meta).__name__}, not an object")
    if meta.get("format") != ARTIFACT_FORMAT:
        found = meta.get("format", "none")
        raise ModelError(f"{meta_path} has sidecar format {found}; this tvm-tpp reads format "
                         f"{ARTIFACT_FORMAT}: export the model again")
    if meta.get("digest") != _digest(meta):
        raise ModelError(f"{meta_path} was changed after the export (its digest does not "
                         "match its contents); export the model again")
    library = meta.get("library")
    if not (isinstance(library, dict) and isinstance(library.get("size"), int)
            and isinstance(library.get("sha256"), str)):
        raise bad("no library size and sha256")
    if not isinstance(meta.get("target"), str) or not isinstance(meta.get("arch"), str):
        raise bad("no target")
    inputs = meta.get("inputs")
    if not isinstance(inputs, list):
        raise bad("no input list")
    for i in inputs:
        if not (isinstance(i, dict) and isinstance(i.get("name"), str)
                and isinstance(i.get("shape"), list)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                        or index == 0 and isinstance(d, str) and d.isidentifier()
                        for index, d in enumerate(i["shape"]))
                and isinstance(i.get("dtype"), str)):
            raise bad(f"input {i!r} is not a name, a shape of sizes (the first may be a "
                      "symbolic batch's name) and a dtype")
        try:
            np.dtype(i["dtype"])
        except TypeError:
            raise bad(f"input {i['name']!r} has an unknown dtype {i['dtype']!r}") from None
    return meta


#: The suffixes :meth:`CompiledModel.export` writes and :func:`load` reads (TVM picks a
#: library's loader by its suffix: a library named otherwise could never be loaded again).
LIBRARY_SUFFIXES = (".so", ".tar")


def library_path(path: str | os.PathLike) -> Path:
    """``path`` as a :meth:`CompiledModel.export` target; UsageError unless it ends in
    ``.so`` (a shared library) or ``.tar`` (object files, for a cross-compile).

    >>> library_path("model.so").name
    'model.so'
    >>> library_path("model.tpp")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tvm_tpp.errors.UsageError: cannot write model.tpp: ... name it model.so
    """
    path = Path(path)
    if path.suffix not in LIBRARY_SUFFIXES:
        raise UsageError(f"cannot write {path}: a model is exported as a shared library (.so) "
                         f"or a .tar of object files; name it {path.stem}.so")
    return path


def load(path: str | os.PathLike) -> CompiledModel:
    """Load a model written by :meth:`CompiledModel.export`.

    Before anything is mapped into the process the sidecar is checked: its format, that the
    library has the size and SHA-256 the export wrote (not truncated, not replaced), and that
    its code is for this machine's architecture.  Loading runs no kernel; running the model
    first checks that this process may (for an AMX build: that Linux granted the tile
    permission, requested then).

    Raises
    ------
    ModelError
        A missing, truncated, changed or foreign library, or a bad sidecar: one line saying
        which.
    """
    path = Path(path)
    meta_path = Path(str(path) + _SIDECAR)
    if not path.is_file() or not meta_path.is_file():
        raise ModelError(f"{path} (and {meta_path.name}) must both exist; write them with export()")
    meta = _sidecar(meta_path)
    library = meta["library"]
    size = path.stat().st_size
    if size != library["size"]:
        raise ModelError(f"{path} is {size} bytes, its export wrote {library['size']}: the file "
                         "is truncated or was replaced; export the model again")
    if _sha256(path) != library["sha256"]:
        raise ModelError(f"{path} does not match the SHA-256 its export recorded in "
                         f"{meta_path.name}: the file was changed; export the model again")
    if meta["arch"] != platform.machine():
        raise ModelError(f"{path} holds {meta['arch']} code and this machine is "
                         f"{platform.machine()}: load it where {meta['arch']} code runs")
    try:
        tgt = Target(json.loads(meta["target"]))
        inputs = [TensorSpec(i["name"], tuple(i["shape"]), i["dtype"]) for i in meta["inputs"]]
    except (ValueError, TypeError, RuntimeError) as err:
        first = str(err).strip().splitlines()
        raise ModelError(f"{meta_path} names an invalid target or input: "
                         f"{first[0] if first else err!r}") from None
    try:
        with native_output():
            module = tvm.runtime.load_module(str(path))
    except RuntimeError as err:  # the sidecar matched but the library does not load here
        first = [line for line in str(err).strip().splitlines() if line.strip()]
        raise ModelError(f"{path} could not be loaded: {first[-1] if first else err!r}"
                         ) from None
    return CompiledModel(module, tgt, inputs)


def import_model(
    model: Model,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
) -> tuple[tvm.IRModule, list[TensorSpec]]:
    """A Relax module and its input specs from any accepted model form."""
    if isinstance(model, tvm.IRModule):
        return model, _relax_inputs(model, input_shapes)
    proto = onnx_import.load_onnx(model)
    specs = onnx_import.input_specs(proto, input_shapes)
    if input_shapes:
        onnx_import.check_shapes(proto, specs)
    with native_output():  # a failed import's BlockBuilder warns as it is freed
        return onnx_import.to_relax(proto, specs), specs


def _relax_inputs(
    mod: tvm.IRModule, shapes: Mapping[str, Sequence[int]] | None
) -> list[TensorSpec]:
    if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
        raise ModelError("the Relax module has no 'main' function")
    specs = []
    for param in mod["main"].params:
        ty = param.ty
        dims = list(shapes[param.name] if shapes and param.name in shapes else ty.shape)
        if dims and isinstance(dims[0], tvm.tirx.Var):
            dims[0] = dims[0].name  # a symbolic batch: the kernels take any size
        try:
            shape = tuple(d if isinstance(d, str) and i == 0 else int(d)
                          for i, d in enumerate(dims))
        except (TypeError, ValueError):
            raise ModelError(
                f"Relax input {param.name!r} has a symbolic shape {ty.shape}; pass input_shapes"
            ) from None
        specs.append(TensorSpec(param.name, shape, str(ty.dtype)))
    return specs


def _database(work_dir: str | os.PathLike) -> Database:
    """``work_dir``'s database (a corrupt one is set aside by the store, with a warning)."""
    work = Path(work_dir)
    if work.exists() and not work.is_dir():
        raise DatabaseError(f"work directory {work} is a file; name a directory")
    try:
        return Database(work / DATABASE)
    except ValueError as err:  # the tuner's layer has no TppError to raise
        raise DatabaseError(str(err)) from None


def _existing_database(work_dir: str | os.PathLike | None) -> Database | None:
    """The database to build with: ``work_dir``'s, which must exist when given, else the
    default work directory's if it has one."""
    work = Path(WORK_DIR if work_dir is None else work_dir)
    if (work / DATABASE).is_file() or (work / _database_file.LEGACY_NAME).is_file():
        return _database(work)
    if work.exists() and not work.is_dir():
        raise DatabaseError(f"work directory {work} is a file; name a directory")
    if work_dir is not None:  # asked for tuned code: building untuned would hide a typo
        raise DatabaseError(f"no tuning database in {work_dir}; write it with "
                            f"`tvm-tpp tune MODEL --work-dir {work_dir}` or tvm_tpp.tune")
    return None


@dataclass(frozen=True)
class _Lookup(Tuner):
    """A :class:`Tuner` that only looks configs up, for a build: a database that cannot be
    read meanwhile is noted (an exception raised inside TVM's passes would reach the user as
    a RuntimeError traceback) and raised by :meth:`check` after it as one DatabaseError."""

    failures: list = field(default_factory=list)

    def config(self, problem, target):
        try:
            return super().config(problem, target)
        except StoreError as err:
            self.failures.append(err)
            return None

    def check(self) -> None:
        if self.failures:
            raise DatabaseError(str(self.failures[0]))


def _lookup(database: Database | None) -> _Lookup | None:
    """A tuner that only looks configs up (the passes use defaults for the others)."""
    return _Lookup(database) if database is not None else None


@contextlib.contextmanager
def _store_errors() -> Iterator[None]:
    """The database failing under a tuner: one DatabaseError line, not a traceback."""
    try:
        yield
    except StoreError as err:
        raise DatabaseError(str(err)) from None


def _precision(precision: str) -> None:
    """``precision`` checked: a user's typo is a one-line error, not a pass's ValueError."""
    if precision not in PRECISION_CHOICES:
        raise UsageError(f"precision must be one of {', '.join(PRECISION_CHOICES)}, "
                         f"got {precision!r}")


def kernel_precision(precision: str, tgt: Target) -> str:
    """What the float layers of a ``precision`` build for ``tgt`` multiply in: ``"bf16"``
    only where the target's ISA multiplies bf16 in hardware (AVX512-BF16, AMX, Arm BF16),
    float32 elsewhere — emulated bf16 is slower than float32 there, and OpenVINO's bf16 hint
    runs float32 on those CPUs too; :data:`STRICT_BF16` asks for bf16 kernels anyway.

    Raises
    ------
    UsageError
        ``precision`` is not one of :data:`PRECISION_CHOICES`.

    Examples
    --------
    >>> [kernel_precision("bf16", make_target(f"tpp -isa={isa}")) for isa in ("avx2", "amx")]
    ['float32', 'bf16']
    >>> kernel_precision("bf16-strict", make_target("tpp -isa=avx2"))
    'bf16'
    """
    _precision(precision)
    if precision == STRICT_BF16:
        return "bf16"
    if precision == "bf16" and is_tpp(tgt) and not machine_of(tgt).isa.bf16_dot:
        return "float32"
    return precision


def precision_note(precision: str, tgt: Target) -> str | None:
    """Why the float layers of a ``precision`` build for ``tgt`` multiply in another type
    than ``precision`` names (:func:`kernel_precision`), or None.

    >>> precision_note("bf16", make_target("tpp -isa=avx512_vnni"))[:52]
    'bf16 asked for, but avx512_vnni has no bf16 arithmet'
    >>> precision_note("bf16", make_target("tpp -isa=amx")) is None
    True
    """
    if precision != "bf16" or kernel_precision(precision, tgt) == "bf16":
        return None
    return (f"bf16 asked for, but {machine_of(tgt).isa.name} has no bf16 arithmetic: float32 "
            f"kernels, faster than emulated bf16 ({STRICT_BF16!r} emulates it)")


def int8_note(report: Sequence[Offload], tgt: Target) -> str | None:
    """Why the quantized (QDQ) layers of a build for ``tgt`` with this ``report`` multiply in
    float32 on their dequantized values rather than on the int8 kernels, or None (they do
    not, or the model has none).

    >>> entry = Offload("conv2d_qdq", (1, 8, 7, 7), "k", dtypes="float32*float32->float32")
    >>> int8_note([entry], make_target("tpp -isa=avx2 -mcpu=znver1"))[:62]
    'int8 layers computed in float32 on their dequantized values: z'
    >>> on_int8 = Offload("conv2d_qdq", (1, 8, 7, 7), "k", dtypes="uint8*int8->int32")
    >>> int8_note([on_int8], make_target("tpp -isa=avx2 -mcpu=znver3")) is None
    True
    >>> winograd = Offload("conv2d_qdq", (1, 64, 14, 14), "k_winograd4 [..]",
    ...                    dtypes="float32*float32->float32")
    >>> print(int8_note([winograd, on_int8], make_target("tpp -isa=avx2 -mcpu=znver3")))
    int8 layers computed in float32 on their dequantized values: 1 of 2 quantized layers
    (3x3 convs in Winograd form): avx2 has no int8 dot product, ...
    """
    machine = machine_of(tgt)
    quantized = [o for o in report if o.kernel and o.op.startswith(("conv2d_qdq", "matmul_qdq"))]
    in_float = [o for o in quantized if o.dtypes.startswith("float32")]
    if not in_float:
        return None
    if machine.int8_in_float:
        why = ("as -int8=float asks" if machine.int8 == "float" else
               f"{machine.mcpu} has no int8 dot product and half-width vector units, where "
               "float32 (and its Winograd convs) is faster")
    else:
        why = (f"{len(in_float)} of {len(quantized)} quantized layers (3x3 convs in Winograd "
               f"form): {machine.isa.name} has no int8 dot product, and float32's Winograd "
               "needs a quarter to 4/9 of the exact int8 kernel's products")
    return (f"int8 layers computed in float32 on their dequantized values: {why} "
            "(-int8=kernels: the int8 kernels)")


def _measurable(tgt: Target) -> None:
    if not runs_on_host(tgt):
        raise NotRunnableError(f"tuning measures on this CPU, which cannot run {tgt}")


def _tune_tasks(mod: tvm.IRModule, tgt: Target, database: Database, budget: float | None,
                top_k: int, on_tuned: Callable[[Problem, TuneResult], None] | None,
                precision: str, pool: _remote.RemotePool | None = None) -> list[Tuned]:
    # The graph passes find the operators; tuning them here, outside the lowering, keeps
    # the measurements' own builds from running inside the model's.
    collector = TaskCollector()
    with tgt:
        # The rewrites name the tasks (bf16 GEMMs are problems, and keys, of their own).
        tpp_rewrites(tgt, tuner=collector, precision=kernel_precision(precision, tgt))(mod)
    problems = list(collector.tasks.values())
    if pool is not None:
        return _tune_remote(problems, tgt, database, budget, top_k, on_tuned, pool)
    tuned = []
    for problem in problems:
        with native_output(), _store_errors():
            result = _tuner.tune(problem, tgt, database=database, top_k=top_k,
                                 budget_seconds=budget)
        tuned.append(Tuned(problem, result))
        if on_tuned is not None:
            on_tuned(problem, result)
    return tuned


def _tune_remote(problems: list[Problem], tgt: Target, database: Database,
                 budget: float | None, top_k: int,
                 on_tuned: Callable[[Problem, TuneResult], None] | None,
                 pool: _remote.RemotePool) -> list[Tuned]:
    """Tune ``problems`` at once, as many as the pool has servers: each one's search builds
    here while the others' candidates are timed there.  Each result is in the database as
    soon as its operator is done."""
    results: dict[int, TuneResult] = {}
    with tempfile.TemporaryDirectory(prefix="tpp-candidates-") as directory, \
            native_output(), _store_errors(), _remote_errors(), \
            ThreadPoolExecutor(pool.size, thread_name_prefix="tpp-tune") as tuners:
        measurer = _remote.RemoteMeasurer(pool, directory)
        futures = {tuners.submit(_tuner.tune, problem, tgt, database=database, top_k=top_k,
                                 budget_seconds=budget, measurer=measurer): i
                   for i, problem in enumerate(problems)}
        try:
            for future in as_completed(futures):
                i = futures[future]
                results[i] = future.result()
                if on_tuned is not None:
                    on_tuned(problems[i], results[i])
        except BaseException:
            for future in futures:  # the first failure ends the run
                future.cancel()
            raise
    return [Tuned(problem, results[i]) for i, problem in enumerate(problems)]


@contextlib.contextmanager
def _remote_errors() -> Iterator[None]:
    """The tracker or its servers failing: one RemoteError line, not a traceback."""
    try:
        yield
    except _remote.RemoteError as err:
        raise RemoteError(str(err)) from None


def target_spec(tgt: Target) -> str:
    """The ``tpp`` spec that builds for ``tgt`` (and finds what was tuned for it).

    >>> target_spec(make_target("tpp -isa=neon -num-cores=4"))
    'tpp -isa=neon -mcpu=generic -num-cores=4'
    """
    return (f"tpp -isa={tgt.attrs['model']} -mcpu={tgt.attrs['mcpu']} "
            f"-num-cores={int(tgt.attrs['num-cores'])}")


@contextlib.contextmanager
def remote_pool(target: str, rpc: str, key: str | None, isa: str | None = None, *,
                timeout: float = 120.0, tries: int = 3, exclusive: bool = False
                ) -> Iterator[tuple[_remote.RemotePool, Target]]:
    """The servers under ``key`` at the tracker ``rpc`` (``HOST:PORT``) and their target.

    The ISA is ``isa`` (or the target spec's ``-isa=``), else the richest the servers run,
    as they say; the target's LLVM CPU and threads are theirs unless the spec gives them
    (:func:`~tvm_tpp.tpp_target.remote_target`).  ``exclusive``: the servers share one
    machine and time one at a time (:class:`~schedules.remote.RemotePool`).

    Raises
    ------
    UsageError
        A malformed tracker address or key, or a target that is no ``tpp`` spec.
    TargetError
        An unknown ISA.
    RemoteError
        The tracker cannot be reached, has no server under ``key``, or its servers cannot
        run the ISA (or cannot say what they run and no ISA was given).
    NotRunnableError
        The servers' architecture is not this host's and its cross linker is missing.

    Examples
    --------
    >>> with remote_pool("tpp", "127.0.0.1:9190", "x86") as (pool, tgt):  # doctest: +SKIP
    ...     print(pool.size, tgt.attrs["model"])
    2 avx2
    """
    if not isinstance(target, str):
        raise UsageError("measuring on RPC servers takes a tpp target spec (e.g. "
                         f"'tpp -num-cores=4'), got {type(target).__name__}")
    try:
        tracker = _remote.Tracker.parse(rpc, key or "")
    except ValueError as err:
        raise UsageError(str(err)) from None
    wanted = isa or spec_isa(target)
    if wanted is not None:
        make_target(f"tpp -isa={wanted}")  # an unknown ISA: TargetError listing the known
    with _remote_errors():
        pool = _remote.RemotePool(tracker, wanted, timeout=timeout, tries=tries,
                                  exclusive=exclusive)
    try:
        tgt = remote_target(target, pool.isa, pool.cpu)
        try:
            linker(str(tgt.attrs.get("mtriple", "")))
        except RuntimeError as err:
            raise NotRunnableError(str(err)) from None
        yield pool, tgt
    finally:
        pool.close()


def tune(
    model: Model,
    target: str | dict | Target = "tpp",
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    work_dir: str | os.PathLike = WORK_DIR,
    budget: float | None = None,
    top_k: int = _TOP_K,
    on_tuned: Callable[[Problem, TuneResult], None] | None = None,
    precision: str = "float32",
    rpc: str | None = None,
    key: str | None = None,
    isa: str | None = None,
    rpc_timeout: float = 120.0,
    rpc_tries: int = 3,
    rpc_exclusive: bool = False,
    on_target: Callable[[Target], None] | None = None,
) -> list[Tuned]:
    """Tune each GEMM, conv and batch GEMM of a model into ``work_dir/tuning.db``.

    Operators the database knows cost nothing; :func:`compile` with the same ``work_dir``
    then builds with the tuned configurations.

    Parameters
    ----------
    model, target, input_shapes
        As for :func:`compile`; the target must be one this CPU runs (tuning measures).
    work_dir
        Where the database is written (created if missing).
    budget
        Seconds the tuner may spend per operator (default: measure all ``top_k``).
    top_k
        Candidates measured per operator besides its default.
    on_tuned
        Called with ``(problem, TuneResult)`` after each operator (a GemmProblem, ConvProblem
        or BatchGemmProblem), e.g. to show progress.
    precision
        As for :func:`compile`: tune the GEMMs a build of that precision runs.
    rpc, key
        Measure on the RPC servers registered under device ``key`` at the TVM tracker
        ``rpc`` (``HOST:PORT``) instead of this CPU: candidates are built here for their
        target (:func:`remote_pool`), timed there in parallel across the servers, and the
        results stored under that target's key.  ``target`` is then a ``tpp`` spec whose
        options (``-num-cores``, ``-mcpu``, ``-isa``) override what the servers say.
    isa
        With ``rpc``: the ISA to build for (default: the richest the servers run).
    rpc_timeout, rpc_tries
        With ``rpc``: seconds a server may stay silent on a batch before it is taken for
        hung, and servers a batch is tried on before its candidates are reported failed.
    rpc_exclusive
        With ``rpc``: the servers share one machine (several servers on one many-core host,
        or loopback); they time one at a time, as they would undisturbed on machines of
        their own, while candidates are still built and uploaded in parallel.
    on_target
        With ``rpc``: called with the servers' target once it is known (the results are
        stored under it; :func:`compile` finds them with :func:`target_spec` of it).

    Returns
    -------
    list of Tuned
        One per distinct operator (its problem and result), in the order the passes met them.

    Raises
    ------
    NotRunnableError
        The target is not one this CPU runs (without ``rpc``).
    UsageError
        ``precision`` is not one of :data:`PRECISION_CHOICES`; ``key`` or ``isa`` without
        ``rpc``.
    RemoteError
        With ``rpc``: the tracker is unreachable, no server is (or stays) under ``key``, or
        the servers cannot run ``isa``.

    Examples
    --------
    >>> from tvm_tpp import models
    >>> [t.result.best.spec for t in tune(models.load("mlp"), budget=1.0)]  # doctest: +SKIP
    ['BCa', 'aBC', 'BCa']
    >>> tune(models.load("mlp"), rpc="10.0.0.5:9190", key="zen4")  # doctest: +SKIP
    """
    _precision(precision)
    if rpc is None:
        if key is not None or isa is not None or rpc_exclusive:
            raise UsageError("a device key, an ISA and exclusive timing are for measuring on RPC "
                             "servers: give the tracker too (rpc='HOST:PORT')")
        tgt = make_target(target)
        _measurable(tgt)
        mod, _ = import_model(model, input_shapes)
        return _tune_tasks(mod, tgt, _database(work_dir), budget, top_k, on_tuned,
                           precision)
    database = _database(work_dir)
    mod, _ = import_model(model, input_shapes)
    with remote_pool(target, rpc, key, isa, timeout=rpc_timeout, tries=rpc_tries,
                     exclusive=rpc_exclusive) as (pool, tgt):  # type: ignore[arg-type]
        if on_target is not None:
            on_target(tgt)
        return _tune_tasks(mod, tgt, database, budget, top_k, on_tuned, precision, pool)


def lower(
    model: Model,
    target: str | dict | Target = "tpp",
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    work_dir: str | os.PathLike | None = None,
    precision: str = "float32",
) -> tvm.IRModule:
    """The Relax+TIR module after the target's graph passes, configs and precision as
    :func:`compile` picks them (what ``tvm-tpp compile --emit tir`` shows).

    Examples
    --------
    >>> from tvm_tpp import models
    >>> "tpp_dense" in lower(models.load("mlp")).script()  # doctest: +SKIP
    True
    """
    tgt = make_target(target)
    _precision(precision)
    mod, _ = import_model(model, input_shapes)
    lookup = _lookup(_existing_database(work_dir))
    with tgt, native_output():  # the graph pipeline without code generation
        lowered = tpp_pipeline(tgt, tuner=lookup,
                               precision=kernel_precision(precision, tgt))(mod)
    if lookup is not None:
        lookup.check()
    return lowered


def compile(  # noqa: A001 - the public name users expect, as in tvm.compile
    model: Model,
    target: str | dict | Target = "tpp",
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    work_dir: str | os.PathLike | None = None,
    tune: bool = False,
    tune_budget: float | None = None,
    on_tuned: Callable[[Problem, TuneResult], None] | None = None,
    untuned: bool = False,
    precision: str = "float32",
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
    work_dir
        The work directory whose ``tuning.db`` gives the configurations of the operators it
        knows (the others get their defaults); it must hold one unless ``tune``.  Default:
        ``./tvm_tpp_work``, if it holds one.
    tune
        First :func:`tune` the model into ``work_dir`` (seconds per operator; needs a target
        this CPU runs), then build with the results.
    tune_budget
        With ``tune``: seconds the tuner may spend per operator (default: no limit).
    on_tuned
        With ``tune``: called with ``(problem, TuneResult)`` after each operator.
    untuned
        Build every operator with its untuned default, whatever a work directory holds (the
        baseline the tuner is measured against).
    precision
        ``"float32"``, or ``"bf16"``: dense layers, convolutions and attention multiply in
        bfloat16 with float32 accumulation (weights rounded and packed at compile time,
        activations converted as each kernel reads them; inputs, outputs and epilogues stay
        float32) where the target's ISA multiplies bf16 in hardware, in float32 elsewhere
        (:func:`kernel_precision`; the model's ``precision_note`` says so); ``"bf16-strict"``:
        in bfloat16 on every ISA.  Expect a normwise error vs float32 of a few 1e-3 instead
        of 1e-6.  A quantized (int8) model runs its quantized layers on int8 kernels whatever
        this is.

    Raises
    ------
    ModelError
        Missing or malformed model, symbolic shapes, unsupported operators.
    TargetError
        Unknown ISA or malformed target spec.
    NotRunnableError
        ``tune`` for a target this CPU does not run.
    DatabaseError
        The given ``work_dir`` has no database, or its database is corrupt.
    UsageError
        ``precision`` is not one of :data:`PRECISION_CHOICES`, or ``untuned`` with tuning.
    """
    tgt = make_target(target)
    kernels = kernel_precision(precision, tgt)  # checks it before any time is spent
    if untuned and (tune or work_dir is not None):
        raise UsageError("untuned builds read no work directory and tune nothing")
    if tune:
        _measurable(tgt)
        database: Database | None = _database(work_dir or WORK_DIR)
    else:
        database = None if untuned else _existing_database(work_dir)
    start = time.perf_counter()
    mod, specs = import_model(model, input_shapes)
    tuned = (_tune_tasks(mod, tgt, database, tune_budget, _TOP_K, on_tuned, precision)
             if tune else [])
    report: list[Offload] = []
    lookup = _lookup(database)
    with native_output():
        executable = tvm.compile(mod, target=tgt, relax_pipeline=tpp_pipeline(
            tgt, report, lookup, kernels), tir_pipeline=pipeline_for(tgt))
    if lookup is not None:
        lookup.check()
    return CompiledModel(executable, tgt, specs, time.perf_counter() - start, report,
                         sum(t.result.tune_seconds for t in tuned),
                         database.path if database is not None else None, precision)
