"""Building and timing candidate configurations in this process.

:func:`build` schedules configurations and compiles them as one LLVM module (one invocation
for several); :func:`measure` builds them and times them side by side
(:func:`time_interleaved`), so drift of the machine's load hits every candidate alike.

Before each timed run every operand but the first is flushed from the caches (TVM's
``cache_flush_cpu_non_first_arg``, as MetaSchedule's CPU runner does): in a network the
activation a kernel reads was just written by the kernel before it, while its weights come
from memory.  Timed warm, the tuner picked blocks that lose in the network: ResNet's
1x1000x2048 classifier ran 1.4x faster at 40 columns than at 8 warm and 1.5x slower cold.

Examples
--------
>>> from schedules.gemm import GemmConfig, GemmProblem
>>> configs = [GemmConfig.of("BCa", 48, 64, 96), GemmConfig.of("aBC", 48, 64, 96)]
>>> measure(GemmProblem(48, 64, 96), configs, target, "avx2")   # doctest: +SKIP
[4.1e-05, 'LoopSpecError: ...']
"""

from __future__ import annotations

import functools
import itertools
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from microkernels.machine import is_tpp, machine_of

from .dynamic_parallel import pipeline_for
from .ops import Config, Problem, op_of
from .register_epilogue import epilogue_in_registers
from .tile_config import configure_tiles_once

if TYPE_CHECKING:
    from tvm.target import Target
    from tvm.tirx import PrimFunc

__all__ = ["build", "measure", "time_interleaved", "flush_operands", "samples", "Artifact",
           "export", "Measurer", "linker", "FLUSH"]

#: Seconds of samples per candidate per round (at least one run each).
_ROUND_SECONDS = 0.05
#: Interleaved rounds of samples.
_ROUNDS = 3
#: TVM's packed function that evicts all operands but the first (module doc).
FLUSH = "cache_flush_cpu_non_first_arg"


class Measurer(Protocol):
    """What :func:`~schedules.search.tune` times candidates with: :func:`measure` (in this
    process) or a :class:`~schedules.remote.RemoteMeasurer` (on RPC servers).  Per config its
    seconds, or the error that kept it from being built or timed; ``built`` is the
    measurer's own cache of what it built for the configs (kept for the final round)."""

    def __call__(self, problem: Problem, configs: list[Config], target: Target, isa: str,
                 rounds: int = ..., round_seconds: float = ...,
                 built: dict[Config, object] | None = None) -> list[float | str]: ...


def _error(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"[:200]


def _scheduled(problem: Problem, configs: list[Config], target: Target, isa: str
               ) -> list[PrimFunc | str]:
    """Per config its scheduled PrimFunc as a model runs it (the epilogue in registers where
    it can be: :mod:`.register_epilogue`; AMX tiles configured once per thread's chunk:
    :mod:`.tile_config`), named ``candidate<i>``, or why it has none."""
    schedule = op_of(problem).schedule
    threads = machine_of(target).threads if is_tpp(target) else None
    out: list[PrimFunc | str] = []
    for i, config in enumerate(configs):
        try:
            func = epilogue_in_registers(schedule(problem, config, isa).mod["main"])
            if threads is not None:  # the tpp pipeline's rewrite; other targets run as built
                func = configure_tiles_once(func, threads)
            out.append(func.with_attr("global_symbol", f"candidate{i}"))
        except Exception as err:  # a candidate that cannot be scheduled is recorded, skipped
            out.append(_error(err))
    return out


def _compile(scheduled: list[PrimFunc | str], target: Target) -> list[tuple[object, str] | str]:
    """Compile the PrimFuncs of ``scheduled`` as one module: per candidate the executable that
    holds it and its function's name; errors pass through."""
    import tvm

    out: list[tuple[object, str] | str] = list(scheduled)  # type: ignore[arg-type]
    funcs = {i: f for i, f in enumerate(scheduled) if not isinstance(f, str)}
    if not funcs:
        return out
    pipeline = pipeline_for(target)
    try:
        ex = tvm.compile(tvm.IRModule({f"candidate{i}": f for i, f in funcs.items()}),
                         target=target, tir_pipeline=pipeline)
        for i in funcs:
            out[i] = (ex, f"candidate{i}")
    except Exception:  # one bad function fails the module: find which, one by one
        for i, func in funcs.items():
            try:
                out[i] = (tvm.compile(tvm.IRModule({f"candidate{i}": func}), target=target,
                                      tir_pipeline=pipeline), f"candidate{i}")
            except Exception as err:
                out[i] = _error(err)
    return out


def _function(compiled: tuple[object, str] | str) -> Callable[..., object] | str:
    """The callable of a :func:`_compile` result (an error passes through)."""
    if isinstance(compiled, str):
        return compiled
    executable, name = compiled
    return executable.mod[name]  # type: ignore[attr-defined]


def build(problem: Problem, configs: list[Config], target: Target, isa: str
          ) -> list[Callable[..., object] | str]:
    """Schedule ``configs`` and compile them as one module: per config its function, or the
    error that kept it from being built."""
    return [_function(c) for c in _compile(_scheduled(problem, configs, target, isa), target)]


def _arguments(funcs: list[PrimFunc]) -> list[list[object]]:
    """Arguments for each of ``funcs``: random inputs and an output, both shared by every
    function with a parameter of the same shape and dtype (a config's packed weights are
    just another shape).  Values do not matter for timing: no packing, no padding zeros."""
    import numpy as np
    import tvm

    rng = np.random.default_rng(0)
    made: dict[tuple[tuple[int, ...], str, bool], object] = {}
    out = []
    for func in funcs:
        args = []
        for i, param in enumerate(func.params):
            shape, dtype = tuple(int(d) for d in param.ty.shape), str(param.ty.dtype)
            output = i == len(func.params) - 1  # every template's PrimFunc ends with Y
            if (shape, dtype, output) not in made:
                made[(shape, dtype, output)] = (
                    tvm.runtime.empty(shape, dtype) if output
                    else tvm.runtime.tensor(rng.standard_normal(shape).astype(dtype)))
            args.append(made[(shape, dtype, output)])
        out.append(args)
    return out


def samples(round_seconds: float, estimate: float) -> int:
    """Runs of a candidate in one round: ``round_seconds`` of them at ``estimate`` seconds
    each, at least 1 and at most 20 (a fast kernel needs no more to find its minimum).

    >>> samples(0.05, 0.01), samples(0.05, 1.0), samples(0.05, 1e-6)
    (5, 1, 20)
    """
    return max(1, min(20, int(round_seconds / estimate))) if estimate > 0 else 20


def time_interleaved(runs: list[Callable[[], None]], rounds: int = _ROUNDS,
                     round_seconds: float = _ROUND_SECONDS,
                     before: list[Callable[[], None]] | None = None) -> list[float]:
    """Seconds of one call of each function: the fastest of samples taken in ``rounds``
    interleaved rounds, so drift of the machine's load hits every candidate alike and the
    minimum is a run that went undisturbed.  ``before[i]``, untimed, precedes each run of
    ``runs[i]`` (a cache flush).

    Examples
    --------
    >>> len(time_interleaved([lambda: None, lambda: None], rounds=1, round_seconds=0.0))
    2
    """
    before = before or [lambda: None] * len(runs)
    best = [float("inf")] * len(runs)

    def timed(i: int) -> float:
        before[i]()
        start = time.perf_counter()
        runs[i]()
        return time.perf_counter() - start

    for i in range(len(runs)):  # warm-up, and a first estimate
        best[i] = timed(i)
    for _ in range(rounds):
        for i in range(len(runs)):
            for _ in range(samples(round_seconds, best[i])):
                best[i] = min(best[i], timed(i))
    return best


def flush_operands(args: list[object]) -> Callable[[], None]:
    """Evicts every operand in ``args`` but the first from the CPU caches when called."""
    import tvm_ffi

    flush = tvm_ffi.get_global_func(FLUSH)
    return functools.partial(flush, *args)


def _then(first: Callable[[], object] | None, second: Callable[[], object] | None
          ) -> Callable[[], None]:
    def run() -> None:
        for step in (first, second):
            if step is not None:
                step()

    return run


def measure(problem: Problem, configs: list[Config], target: Target, isa: str,
            rounds: int = _ROUNDS, round_seconds: float = _ROUND_SECONDS,
            built: dict[Config, Callable[[], object]] | None = None, cold: bool = True,
            before: Callable[[], object] | None = None) -> list[float | str]:
    """Build ``configs`` together and time them interleaved (see :func:`time_interleaved`):
    seconds of one run, or the error of a candidate that could not be built.

    ``built`` maps configs to ready runs (built, with arguments): those are not built again,
    and the new ones are added to it.  ``cold``: operands flushed before each run (module
    doc); otherwise each run finds them where the previous run of any candidate left them.
    ``before`` runs, untimed, before each run (after the flush): e.g. the kernel that writes
    the candidates' input, as the layer before does in a network."""
    built = {} if built is None else built
    new = [c for c in dict.fromkeys(configs) if c not in built]
    scheduled = _scheduled(problem, new, target, isa)
    compiled = [_function(c) for c in _compile(scheduled, target)]
    errors = {new[i]: f for i, f in enumerate(compiled) if isinstance(f, str)}
    ok = [i for i, f in enumerate(compiled) if not isinstance(f, str)]
    arguments = _arguments([scheduled[i] for i in ok])  # type: ignore[misc]
    for i, args in zip(ok, arguments, strict=True):
        built[new[i]] = functools.partial(compiled[i], *args)  # type: ignore[arg-type]
    timed = [c for c in configs if c in built]
    times = time_runs([built[c] for c in timed], rounds, round_seconds, cold, before)
    seconds = dict(zip(timed, times, strict=True))
    return [seconds[c] if c in seconds else errors[c] for c in configs]


def time_runs(runs: list[functools.partial], rounds: int = _ROUNDS,
              round_seconds: float = _ROUND_SECONDS, cold: bool = True,
              before: Callable[[], object] | None = None) -> list[float]:
    """:func:`time_interleaved` of built runs (:func:`measure`'s ``built`` values, of one
    problem or several), each run's operands flushed first where ``cold``, then ``before``."""
    flushes = [flush_operands(list(run.args)) if cold else None for run in runs]
    return time_interleaved(runs, rounds, round_seconds,
                            [_then(flush, before) for flush in flushes])


@dataclass(frozen=True)
class Artifact:
    """A candidate compiled into a shared library, to be timed elsewhere: the library (several
    candidates share one), the function's name and its parameters' shapes and dtypes (the last
    is the output)."""

    library: Path
    name: str
    params: tuple[tuple[tuple[int, ...], str], ...]

    def __post_init__(self) -> None:
        if not self.params:
            raise ValueError(f"candidate {self.name} has no parameters")


_exported = itertools.count()


def linker(triple: str) -> Callable[..., None] | None:
    """The linker for code of ``triple``: None (the host's) or its ``<arch>-linux-gnu-gcc``;
    RuntimeError naming the missing cross compiler."""
    arch = triple.split("-")[0] if triple else platform.machine()
    if arch == platform.machine():
        return None
    compiler = f"{arch}-linux-gnu-gcc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"linking {arch} candidates needs {compiler} on PATH "
                           f"(Debian: gcc-{arch.replace('_', '-')}-linux-gnu)")
    from tvm.support import cc

    return cc.cross_compiler(compiler)


def export(problem: Problem, configs: list[Config], target: Target, isa: str,
           directory: Path) -> list[Artifact | str]:
    """Schedule ``configs``, compile them as one module for ``target`` and write it to a
    shared library in ``directory`` (cross-linked when the target's architecture is not
    this host's): per config its :class:`Artifact`, or the error that kept it from being
    built.

    Examples
    --------
    >>> from schedules.gemm import GemmConfig, GemmProblem
    >>> export(GemmProblem(48, 64, 96), [GemmConfig.of("BCa", 48, 64, 96)], target, "avx2",
    ...        Path("work"))                                  # doctest: +SKIP
    [Artifact(library=PosixPath('work/candidates0.so'), name='candidate0', params=...)]
    """
    fcompile = linker(str(target.attrs.get("mtriple", "")))
    scheduled = _scheduled(problem, configs, target, isa)
    out: list[Artifact | str] = []
    libraries: dict[int, Path] = {}
    for func, compiled in zip(scheduled, _compile(scheduled, target), strict=True):
        if isinstance(compiled, str):
            out.append(compiled)
            continue
        executable, name = compiled
        if id(executable) not in libraries:
            path = directory / f"candidates{next(_exported)}.so"
            try:
                executable.export_library(str(path), fcompile=fcompile)  # type: ignore[attr-defined]
            except Exception as err:  # a link error fails this module's candidates only
                out.append(_error(err))
                continue
            libraries[id(executable)] = path
        params = tuple((tuple(int(d) for d in p.ty.shape), str(p.ty.dtype))
                       for p in func.params)  # type: ignore[union-attr]
        out.append(Artifact(libraries[id(executable)], name, params))
    return out
