"""``tvm-tpp bench --rpc HOST:PORT --key KEY``: whole models built here for the servers under a
tracker's key, exported (cross-linked where their architecture is not this host's), uploaded
and timed there by a Relax VM with TVM's evaluator.

The implementations are the ones built for a target, not run in a process of this host:
``tpp`` (untuned), ``tpp-tuned`` (first tuned on the same servers into ``work_dir``, then
built with those configurations), ``tvm-default`` (TVM's default pipeline for the servers'
LLVM target) and ``metaschedule`` (MetaSchedule's search, its candidates measured by its
``RPCRunner`` on the same tracker's servers; x86 servers only: its builder links for this
host).  The servers' ISA is learned from them (or given), as for ``tune --rpc``.  The
searches run first, each holding the servers it measures on; then one server times every
implementation.

Examples
--------
>>> rows = bench_remote({"mlp": model}, ("tpp", "tvm-default"), "127.0.0.1:9190",
...                     "x86", work_dir=Path("w"))                      # doctest: +SKIP
>>> [(r.model, r.impl) for r in rows]                                      # doctest: +SKIP
[('mlp', 'tpp'), ('mlp', 'tvm-default')]
"""

from __future__ import annotations

import logging
import statistics
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError

__all__ = ["IMPLS", "RemoteRow", "bench_remote", "format_rows"]

#: What ``bench --rpc`` can build for the servers (the first three by default).
IMPLS = ("tpp", "tpp-tuned", "tvm-default", "metaschedule")


@dataclass(frozen=True)
class RemoteRow:
    """One implementation of one model, timed on a server: per-run seconds of each sample."""

    model: str
    impl: str
    target: str
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
        if not self.seconds:
            raise ValueError("a row needs at least one sample")

    @property
    def median_ms(self) -> float:
        return 1e3 * statistics.median(self.seconds)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "impl": self.impl, "target": self.target,
                "seconds": list(self.seconds), "median_ms": self.median_ms}


def _plain_target(tgt: Any) -> Any:
    """TVM's plain LLVM target for the machine of a ``tpp`` target (tvm-default builds)."""
    from tvm.target import Target

    attrs = tgt.attrs
    config = {"kind": "llvm", "mtriple": str(attrs["mtriple"]), "mcpu": str(attrs["mcpu"]),
              "num-cores": int(attrs["num-cores"])}
    if "mattr" in attrs:
        config["mattr"] = [str(a) for a in attrs["mattr"]]
    return Target(config)


def _described(tgt: Any) -> str:
    """A target as a row shows it: the tpp spec, or the plain LLVM target's options."""
    from .. import compiler

    if "tpp" in tgt.keys:
        return compiler.target_spec(tgt)
    attrs = tgt.attrs
    return (f"llvm -mtriple={attrs['mtriple']} -mcpu={attrs['mcpu']} "
            f"-num-cores={int(attrs['num-cores'])}")


def _build(impl: str, model: Any, tgt: Any, work_dir: Path, searched: Any) -> Any:
    """The :class:`~tvm_tpp.compiler.CompiledModel` of ``impl`` for the servers' target
    (``searched``: MetaSchedule's executable, when it is the impl)."""
    from .. import compiler

    spec = compiler.target_spec(tgt)
    if impl == "tpp":
        return compiler.compile(model, spec, untuned=True)
    if impl == "tpp-tuned":
        return compiler.compile(model, spec, work_dir=work_dir)
    import tvm
    from tvm import relax

    plain = _plain_target(tgt)
    mod, specs = compiler.import_model(model)
    if impl == "metaschedule":
        return compiler.CompiledModel(searched, plain, specs)
    with compiler.native_output():
        executable = tvm.compile(relax.transform.DecomposeOpsForInference()(mod),
                                 target=plain, relax_pipeline=relax.get_default_pipeline(plain))
    return compiler.CompiledModel(executable, plain, specs)


def _metaschedule(name: str, model: Any, tgt: Any, tracker: Any, servers: int, work_dir: Path,
                  trials: int, seed: int, say: Callable[[str], None]) -> Any:
    """MetaSchedule's executable of ``model`` for the servers' plain LLVM target, its
    candidates measured on them through the tracker."""
    from tvm import relax

    from schedules.ms_space import rpc_runner

    from .. import compiler
    from . import metaschedule
    from .impls import metaschedule_relax

    missing = metaschedule.missing_packages()
    if missing:
        raise UsageError(f"MetaSchedule needs {', '.join(missing)}: pip install "
                         "'tvm-tpp[tune]'")
    plain = _plain_target(tgt)
    mod, _ = compiler.import_model(model)
    # MetaSchedule logs every step to stdout below WARNING; its log files keep them.
    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    with compiler.native_output():
        executable, _, note = metaschedule_relax(
            relax.transform.DecomposeOpsForInference()(mod), plain,
            work_dir / "metaschedule" / f"{name}_rpc_{tracker.key}", trials, seed,
            rpc_runner(tracker, servers), say)
    say(f"{name} metaschedule: {note}")
    return executable


def bench_remote(models: Mapping[str, Any], impls: Sequence[str], rpc: str, key: str,
                 isa: str | None = None, *, work_dir: Path, repeat: int = 10, number: int = 1,
                 budget: float | None = None, seed: int = 0, ms_trials: int = 64,
                 say: Callable[[str], None] = print) -> list[RemoteRow]:
    """Time ``impls`` of each model (name -> what :func:`~tvm_tpp.compiler.compile` takes)
    on a server under ``key`` at the tracker ``rpc``.

    Raises
    ------
    UsageError
        An implementation that cannot be built for the servers, or bad ``repeat``/``number``.
    RemoteError
        As for :func:`~tvm_tpp.compiler.tune` with ``rpc``; also a model that failed to run
        on ``tries`` servers.
    """
    from .. import compiler
    from ..reference import random_inputs

    unknown = [i for i in impls if i not in IMPLS]
    if unknown or not impls:
        raise UsageError(f"on RPC servers bench runs {', '.join(IMPLS)}; got "
                         f"{', '.join(unknown) or 'none'}")
    if repeat < 1 or number < 1:
        raise UsageError("--repeat and --number must be >= 1")
    with compiler.remote_pool("tpp", rpc, key, isa) as (pool, tgt):  # what the servers are
        tracker, servers = pool.tracker, pool.size
    rows = []
    for name, model in models.items():
        # The searches first: each holds the servers it measures on while it runs.
        if "tpp-tuned" in impls:
            say(f"{name}: tuning on the servers under {key!r} into {work_dir}")
            compiler.tune(model, compiler.target_spec(tgt), work_dir=work_dir, budget=budget,
                          rpc=rpc, key=key, isa=isa)
        searched = (_metaschedule(name, model, tgt, tracker, servers, work_dir, ms_trials,
                                  seed, say) if "metaschedule" in impls else None)
        with compiler.remote_pool(compiler.target_spec(tgt), rpc, key, isa) as (pool, _), \
                tempfile.TemporaryDirectory(prefix="tpp-bench-") as directory:
            for impl in impls:
                built = _build(impl, model, tgt, work_dir, searched)
                library = built.export(Path(directory) / f"{name}-{impl}.so")
                inputs = list(random_inputs(built.inputs, seed=seed).values())
                seconds = pool.run(lambda s, lib=library, x=inputs:
                                   s.time_model(lib, x, number, repeat),
                                   expected=60.0, what=f"{name} {impl} runs")
                rows.append(RemoteRow(name, impl, _described(built.target), tuple(seconds)))
                say(f"{name} {impl}: median {rows[-1].median_ms:.3f} ms on a server under "
                    f"{key!r}")
    return rows


def format_rows(rows: Sequence[RemoteRow]) -> list[str]:
    """The table ``bench --rpc`` prints.

    Examples
    --------
    >>> print("\\n".join(format_rows([RemoteRow("mlp", "tpp", "tpp -isa=avx2", (0.001,))])))
    model  impl  median ms  samples  target
    mlp    tpp       1.000        1  tpp -isa=avx2
    """
    table = [("model", "impl", "median ms", "samples", "target")]
    table += [(r.model, r.impl, f"{r.median_ms:.3f}", str(len(r.seconds)), r.target)
              for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return ["  ".join(c.rjust(w) if i in (2, 3) else c.ljust(w)
                      for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()
            for row in table]
