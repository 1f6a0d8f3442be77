"""The ``tvm-tpp`` command line.

Start-up stays fast: only argparse and the ISA module load before a subcommand runs; TVM,
ONNX and the kernels are imported by the subcommand that needs them.  Subcommands call the
library; its errors for a user's mistakes (:class:`~tvm_tpp.errors.TppError`: missing or
malformed model, unknown ISA, bad option, no tuning database) print one line and exit with
status 2, and anything else is a bug that shows its traceback.

Examples
--------
$ tvm-tpp info
$ tvm-tpp tune mlp --budget 2           # writes ./tvm_tpp_work/tuning.db
$ tvm-tpp tune resnet50 --rpc tracker:9190 --key zen4   # measured on the servers under zen4
$ tvm-tpp run mlp --check onnxruntime   # built with the configs tuned in ./tvm_tpp_work
$ tvm-tpp run resnet50 --work-dir resnet_work --report
$ tvm-tpp profile mobilenet_v2          # time per operator: TPP kernels, layouts, fallback
$ tvm-tpp profile resnet50 --against onnxruntime   # each conv/dense layer on both sides
$ tvm-tpp profile vgg19 --batch 8 --precision bf16 --against openvino
$ tvm-tpp run bert --precision bf16 --check onnxruntime   # dense layers in bf16
$ tvm-tpp compile model.onnx --target "tpp -isa=amx" --emit asm -o model.s
$ tvm-tpp bench mlp bert --impls tpp,tvm-default,onnxruntime --json bench.json
$ tvm-tpp bench mlp --precision int8 --impls tpp,onnxruntime   # + tpp-float32, one run
$ tvm-tpp bench-conv 1x64x56x56x64x3x3/s1x1p1x1x1x1 --vs fold_taps=false --threads 1
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import TppError, UsageError

if TYPE_CHECKING:
    from .compiler import CompiledModel

__all__ = ["main", "report_table"]


def _at_least(minimum: float, convert: Callable[[str], float]) -> Callable[[str], float]:
    """An argparse type: ``convert`` the text, then check it is at least ``minimum``."""

    def parse(text: str) -> float:
        value = convert(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value

    parse.__name__ = convert.__name__  # argparse names it in "invalid int value: 'x'"
    return parse


def _shapes(values: Sequence[str] | None) -> dict[str, tuple[int, ...]] | None:
    if not values:
        return None
    shapes = {}
    for value in values:
        name, eq, dims = value.partition("=")
        try:
            if not eq:
                raise ValueError
            shapes[name] = tuple(int(d) for d in dims.split(","))
        except ValueError:
            raise UsageError(f"--shape takes NAME=D0,D1,..., got {value!r}") from None
    return shapes


def _model(name_or_path: str, batch: int | None):
    """A path that exists, else a bundled model by name."""
    if os.path.exists(name_or_path) or name_or_path.endswith(".onnx"):
        if batch is not None:
            raise UsageError("--batch applies to bundled models; use --shape for ONNX files")
        return name_or_path
    from . import models

    if name_or_path not in models.names():
        raise UsageError(
            f"{name_or_path!r} is neither a file nor a bundled model; bundled: "
            + ", ".join(models.names())
        )
    return models.load(name_or_path, batch=batch or 1)


def cmd_info(args: argparse.Namespace) -> int:
    from microkernels import isa, machine

    flags = isa.host_flags()
    caches = isa.caches()
    host = machine.host_isa()
    print(f"host ISA     : {machine.host_isa_text()}")
    print(f"vector       : {host.vector_bits}-bit x {host.vector_registers} registers")
    print(
        f"caches       : L1d {caches.l1d // 1024} KiB, L2 {caches.l2 // 1024} KiB, "
        f"L3 {caches.l3 // 1024 // 1024} MiB ({caches.source})"
    )
    print(f"cores        : {isa.num_cores()} (TVM_NUM_THREADS={os.environ.get('TVM_NUM_THREADS')})")
    relevant = sorted(f for f in flags if any(f.startswith(p) for p in ("avx", "fma", "amx")))
    print(f"CPU flags    : {' '.join(relevant) or '-'}")
    if args.verbose:
        from .tpp_target import target

        print(f"target       : {target('tpp')}")
    from microkernels.brgemm import implementations

    print("microkernels : BRGEMM (isa, dtype of A, layout)")
    for isa_name, dtype, layout in implementations():
        if isa_name == "generic" or machine.runs_here(isa.from_name(isa_name)):
            note = ""
        elif isa.from_name(isa_name).runs_on(flags):  # AMX whose tile permission was refused
            note = " [disabled]"
        else:
            note = " [foreign]"
        print(f"  {isa_name:12s} {dtype:9s} {layout}{note}")
    return 0


def _output(path: str) -> Path:
    """The output file, checked before any time is spent compiling for it."""
    out = Path(path)
    if out.is_dir() or not out.parent.is_dir():
        raise UsageError(f"cannot write {out}: not a file in an existing directory")
    return out


def _write(path: Path, text: str, kind: str) -> None:
    path.write_text(text)
    print(f"wrote {path} ({kind}, {len(text.splitlines())} lines)")


def report_table(compiled: CompiledModel) -> list[str]:
    """The ``--report`` table: per operator its shape, MFLOPs and their share of the
    reported operators', kernel (config in brackets), the ISA whose BRGEMM runs in it, the
    operand dtypes and layout, or why it stayed with TVM.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> from relay_passes import Offload
    >>> report = [Offload("matmul", (4, 40, 24), "tpp_dense [BCa]", isa="amx",
    ...                   dtypes="uint8*int8->int32", layout="vnni4", flops=7680),
    ...           Offload("matmul", (2, 2), reason="weight varies", flops=24)]
    >>> print("\\n".join(report_table(SimpleNamespace(report=report))))
    op      shape    MFLOP  share  kernel                         isa  dtypes             layout
    matmul  4x40x24  0.008  99.7%  tpp_dense [BCa]                amx  uint8*int8->int32  vnni4
    matmul  2x2      0.000   0.3%  stays with TVM: weight varies  -    -                  -
    """
    total = sum(o.flops or 0 for o in compiled.report)
    rows = [("op", "shape", "MFLOP", "share", "kernel", "isa", "dtypes", "layout")]
    for o in compiled.report:
        kernel = o.kernel or f"stays with TVM: {o.reason}"
        known = o.flops is not None
        rows.append((o.op, "x".join(map(str, o.shape)), f"{o.flops / 1e6:.3f}" if known else "?",
                     f"{o.flops / total:.1%}" if known and total else "?", kernel,
                     o.isa or "-", o.dtypes or "-", o.layout or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    right = {2, 3}  # the numbers
    return ["  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                      for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()
            for row in rows]


def report_json(compiled: CompiledModel) -> dict:
    """The ``--report-json`` document: every operator's record (:class:`~relay_passes.Offload`
    fields), the FLOPs TPP kernels compute and in all, then ``tpp_flops_fraction``.

    >>> from types import SimpleNamespace
    >>> from relay_passes import Offload
    >>> doc = report_json(SimpleNamespace(report=[Offload("matmul", (4, 4, 4), "k", flops=128)],
    ...                                   tpp_flops_fraction=1.0))
    >>> list(doc), doc["operators"][0]["shape"]
    (['operators', 'tpp_flops', 'total_flops', 'tpp_flops_fraction'], [4, 4, 4])
    """
    from dataclasses import asdict

    operators = [{**asdict(o), "shape": list(o.shape)} for o in compiled.report]
    return {"operators": operators,
            "tpp_flops": sum(o.flops or 0 for o in compiled.report if o.kernel),
            "total_flops": sum(o.flops or 0 for o in compiled.report),
            "tpp_flops_fraction": compiled.tpp_flops_fraction}


def _print_kernels(compiled: CompiledModel, report: bool, report_file: Path | None = None
                   ) -> None:
    """How many operators became TPP kernels, where their configs came from and the share of
    the FLOPs they compute; with ``report``, the :func:`report_table` below it; with
    ``report_file``, :func:`report_json` written there."""
    kernels = sum(o.kernel is not None for o in compiled.report)
    configs = (f"configs looked up in {compiled.database}" if compiled.database is not None
               else "default configs (no tuning database)")
    print(f"TPP kernels  : {kernels} of {len(compiled.report)} operators, {configs}")
    if compiled.precision_note is not None:
        print(f"precision    : {compiled.precision_note}")
    if compiled.int8_note is not None:
        print(f"int8         : {compiled.int8_note}")
    fraction = compiled.tpp_flops_fraction
    if fraction is not None:
        total = sum(o.flops or 0 for o in compiled.report)
        amount = f"{total / 1e9:.2f} GFLOP" if total >= 1e9 else f"{total / 1e6:.3f} MFLOP"
        print(f"TPP FLOPs    : {fraction:.1%} of {amount} in matmul, conv and attention "
              "operators")
    if report and compiled.report:
        for line in report_table(compiled):
            print(f"  {line}")
    if report_file is not None:
        report_file.write_text(json.dumps(report_json(compiled), indent=1) + "\n")
        print(f"wrote {report_file} (report, {len(compiled.report)} operators)")


def _report_file(args: argparse.Namespace) -> Path | None:
    """``--report-json``'s file, checked before any time is spent compiling."""
    return None if args.report_json is None else _output(args.report_json)


def cmd_compile(args: argparse.Namespace) -> int:
    from . import compiler

    output, report_file = _output(args.output), _report_file(args)
    if args.emit == "so":
        compiler.library_path(output)  # a wrong suffix fails now, not after compiling
    model, shapes = _model(args.model, args.batch), _shapes(args.shape)
    if args.emit == "tir":
        module = compiler.lower(model, args.target, shapes, work_dir=args.work_dir,
                                precision=args.precision)
        _write(output, module.script(), args.emit)
        return 0
    compiled = compiler.compile(model, args.target, shapes, work_dir=args.work_dir,
                                precision=args.precision)
    if args.emit == "so":
        compiled.export(output)
        print(f"wrote {output} and {output}.json ({compiled.compile_seconds:.1f} s)")
    else:
        _write(output, compiled.source(args.emit), args.emit)
    _print_kernels(compiled, args.report, report_file)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    import numpy as np

    from . import compiler, onnx_import
    from .reference import TOLERANCES, max_errors, random_inputs, run_onnxruntime

    model, report_file = _model(args.model, args.batch), _report_file(args)
    compiled = compiler.compile(model, args.target, _shapes(args.shape), work_dir=args.work_dir,
                                precision=args.precision)
    inputs = random_inputs(compiled.inputs, seed=args.seed)
    outputs = compiled.run(**inputs)
    times = compiled.time(inputs, number=args.number, repeat=args.repeat)
    from microkernels.machine import amx_refused

    refused = "; amx (tile permission refused: AMX kernels disabled)" if amx_refused() else ""
    print(f"compiled in {compiled.compile_seconds:.1f} s for "
          f"{compiled.target.attrs['model']}{refused}")
    _print_kernels(compiled, args.report, report_file)
    print(f"latency      : median {1e3 * float(np.median(times)):.3f} ms over {args.repeat} runs")
    if args.check == "onnxruntime":
        from .quantized import is_quantized

        proto = onnx_import.load_onnx(model)
        # A quantized model's reference is its QDQ graph as the ONNX spec computes it: ONNX
        # Runtime unfused (its fused int8 kernels round otherwise).
        quantized = is_quantized(proto)
        expected = run_onnxruntime(proto, inputs, optimize=not quantized)
        abs_err, rel_err = max_errors(outputs, expected)
        rtol = args.rtol if args.rtol is not None else TOLERANCES[
            "int8" if quantized else compiled.precision]
        status = "OK" if rel_err <= rtol else "MISMATCH"
        what = "vs ORT unfused" if quantized else "vs ORT      "
        print(f"{what} : max abs err {abs_err:.3e}, max rel err {rel_err:.3e} [{status}]")
        return 0 if status == "OK" else 1
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from . import compiler
    from .profiling import KIND_NAMES, KINDS
    from .reference import random_inputs

    model, report_file = _model(args.model, args.batch), _report_file(args)
    compiled = compiler.compile(model, args.target, _shapes(args.shape), work_dir=args.work_dir,
                                precision=args.precision)
    inputs = random_inputs(compiled.inputs, seed=args.seed)
    prof = compiled.profile(inputs, repeat=args.repeat)
    console = Console()
    if not console.is_terminal:  # a file or pipe: never fold the operator names
        console = Console(width=max(100, 60 + max((len(o.name) for o in prof.operators),
                                                  default=0)))
    console.print(f"compiled in {compiled.compile_seconds:.1f} s for "
                  f"{compiled.target.attrs['model']}", highlight=False)
    _print_kernels(compiled, args.report, report_file)
    ms = 1e3
    table = Table(title=f"slowest operators ({len(prof.operators)} called, {args.repeat} "
                  "profiled runs)")
    for name in ("operator", "kind", "calls", "ms/run", "share"):
        table.add_column(name, justify="left" if name in ("operator", "kind") else "right")
    for o in prof.top(args.top):
        table.add_row(o.name, KIND_NAMES[o.kind], str(o.calls), f"{o.seconds * ms:.3f}",
                      f"{o.share:.1%}")
    console.print(table)
    kinds = Table(title="by kind")
    for name in ("kind", "operators", "calls", "ms/run", "share"):
        kinds.add_column(name, justify="left" if name == "kind" else "right")
    for kind in KINDS:
        count = sum(o.kind == kind for o in prof.operators)
        kinds.add_row(KIND_NAMES[kind], str(count), str(prof.calls[kind]),
                      f"{prof.seconds[kind] * ms:.3f}", f"{prof.shares[kind]:.1%}")
    kinds.add_section()
    kinds.add_row("total in calls", str(len(prof.operators)), str(sum(prof.calls.values())),
                  f"{prof.measured_seconds * ms:.3f}", "100.0%")
    console.print(kinds)
    console.print(f"a profiled run: {prof.run_seconds * ms:.3f} ms (each call timed from "
                  f"Python); unprofiled: {prof.latency_seconds * ms:.3f} ms", highlight=False)
    report = prof.to_json()
    if args.against:
        report[f"against_{args.against}"] = _print_against(console, compiled, model, inputs,
                                                           args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def _print_against(console, compiled: CompiledModel, model, inputs,
                   args: argparse.Namespace) -> dict:
    """``profile --against RUNTIME``: the table of :mod:`tvm_tpp.layer_compare`."""
    from rich.table import Table

    try:
        cmp = compiled.compare_layers(model, inputs, rounds=args.rounds, repeat=args.repeat,
                                      warmup_seconds=args.warmup, against=args.against)
    except ImportError as err:  # openvino is an optional extra
        raise UsageError(f"--against {args.against}: {err.name} is not installed (pip install "
                         "'tvm-tpp[openvino]')") from None
    them = cmp.against
    table = Table(title=f"layers against {them} ({cmp.threads} threads each, one process, "
                  f"{args.rounds} alternating rounds of {args.repeat} runs; medians of the rounds, "
                  "a run's ratio with the rounds' range)")
    for name in ("layer", "count tpp/them", "tpp ms", f"{them} ms", f"{them} / tpp"):
        table.add_column(name, justify="left" if name == "layer" else "right")
    ms = 1e3
    for layer in cmp.layers[:args.top] + tuple(
            x for x in cmp.layers[args.top:] if x.key.startswith("other")):
        table.add_row(layer.key, f"{layer.tpp_calls}/{layer.their_calls}",
                      "-" if layer.tpp_seconds is None else f"{layer.tpp_seconds * ms:.3f}",
                      "-" if layer.their_seconds is None else f"{layer.their_seconds * ms:.3f}",
                      "-" if layer.ratio is None else f"{layer.ratio:.2f}x")
    table.add_section()
    table.add_row("a run (unprofiled, median)", "", f"{cmp.tpp_run_seconds * ms:.3f}",
                  f"{cmp.their_run_seconds * ms:.3f}",
                  f"{cmp.run_ratio:.2f}x ({min(cmp.round_ratios):.2f}-"
                  f"{max(cmp.round_ratios):.2f})")
    console.print(table)
    return cmp.to_json()


def cmd_tune(args: argparse.Namespace) -> int:
    from rich.console import Console

    from schedules.tuner import config_text, problem_text

    from . import compiler

    console = Console()
    work_dir = args.work_dir or compiler.WORK_DIR

    def on_tuned(problem, result) -> None:
        how = "database" if result.cached else f"{result.tune_seconds:.1f} s"
        console.print(f"  {problem_text(problem)} -> {config_text(result.best)} ({how})")

    tuned = []
    remote = _remote(args)
    targets = []  # the servers' target, with --rpc
    if remote:
        remote["on_target"] = targets.append
        remote["rpc_exclusive"] = args.exclusive
    elif args.exclusive:
        raise UsageError("--exclusive is for measuring on RPC servers: give the tracker "
                         "with --rpc HOST:PORT")
    for name in args.model:
        console.print(f"[bold]{name}[/bold]: tuning each GEMM, conv and batch GEMM")
        with console.status("tuning", spinner="dots"):
            tuned += compiler.tune(_model(name, args.batch), args.target, work_dir=work_dir,
                                   budget=args.budget, on_tuned=on_tuned,
                                   precision=args.precision, **remote)
    if args.explain:
        _explain(console, tuned)
    if targets:
        spec = compiler.target_spec(targets[0])
        console.print(f"measured on the servers under key {args.key!r} at {args.rpc}; build "
                      f'for them with --target "{spec}"', highlight=False)
    console.print(f"tuning database: {Path(work_dir) / compiler.DATABASE} (read by "
                  f"`tvm-tpp run/compile --work-dir {work_dir}`)")
    return 0


def _remote(args: argparse.Namespace) -> dict:
    """``--rpc``/``--key``/``--isa`` as the library's keywords (none without ``--rpc``)."""
    if args.rpc is None:
        if args.key is not None or args.isa is not None:
            raise UsageError("--key and --isa are for measuring on RPC servers: give the "
                             "tracker with --rpc HOST:PORT")
        return {}
    if args.key is None:
        raise UsageError("--rpc needs --key KEY: the device key the servers registered under")
    return {"rpc": args.rpc, "key": args.key, "isa": args.isa}


def _rpc_options(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--rpc", metavar="HOST:PORT", help=f"{what} on the RPC servers of the TVM "
                   "tracker at HOST:PORT (python -m tvm.exec.rpc_tracker), not on this CPU")
    p.add_argument("--key", help="with --rpc: the device key the servers registered under "
                   "(python -m tvm.exec.rpc_server --tracker HOST:PORT --key KEY)")
    p.add_argument("--isa", help="with --rpc: the ISA to build for (default: the richest the "
                   "servers run, as they say)")


def _explain(console, tuned) -> None:
    """Per tuned operator, its measurements next to the cost model's ranking (the report
    ``bench-gemm --explain`` shows too)."""
    from .bench.report import print_tuned

    print_tuned(console, tuned)


def cmd_bench_configs(args: argparse.Namespace) -> int:
    from .bench.configs import run

    return run(args)


def cmd_bench_gemm(args: argparse.Namespace) -> int:
    from .bench.gemm import run

    return run(args)


def cmd_bench_kernel(args: argparse.Namespace) -> int:
    from .bench.kernel import bench_kernel
    from .bench.report import format_bench_kernel

    result = bench_kernel(dtype=args.dtype, isa=args.isa)
    print(format_bench_kernel(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _bench_remote(args: argparse.Namespace) -> int:
    """``bench --rpc``: the models built here for the servers and timed on one of them."""
    from .bench.remote import IMPLS, bench_remote, format_rows

    remote = _remote(args)
    impls = IMPLS[:3] if args.impls is None else tuple(
        i.strip() for i in args.impls.split(",") if i.strip())
    try:
        batch = int(args.batch)
    except ValueError:
        raise UsageError(f"with --rpc, --batch takes one size, got {args.batch!r}") from None
    models = {name: _model(name, batch) for name in args.model}
    work_dir = Path(args.work_dir or "tvm_tpp_work")
    rows = bench_remote(models, impls, remote["rpc"], remote["key"], remote["isa"],
                        work_dir=work_dir, repeat=args.repeat, seed=args.seed,
                        ms_trials=args.ms_trials)
    for line in format_rows(rows):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_json() for r in rows], indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from microkernels import isa

    if args.rpc is not None or args.key is not None:
        if args.shape:
            raise UsageError("--shape is for local runs; with --rpc give a file of fixed shape")
        return _bench_remote(args)
    args.impls = args.impls or "tpp,tpp-tuned,tvm-default,metaschedule,onnxruntime"

    from .bench.networks import BenchConfig, default_work_dir, run_bench
    from .bench.plots import plot
    from .bench.report import print_report, write_json

    try:
        batches = tuple(int(b) for b in args.batch.split(","))
    except ValueError:
        raise UsageError(f"--batch takes sizes like 1,8, got {args.batch!r}") from None
    try:
        config = BenchConfig(
            models=tuple(args.model), batches=batches, threads=args.threads or isa.num_cores(),
            repeat=args.repeat,
            impls=tuple(i.strip() for i in args.impls.split(",") if i.strip()),
            ms_trials=args.ms_trials, work_dir=Path(args.work_dir or default_work_dir()),
            seed=args.seed, timeout=args.timeout, precision=args.precision,
            reduce_range=args.reduce_range, shapes=_shapes(args.shape) or {},
            tolerance=args.rtol,
        )
    except ValueError as err:  # an option out of range
        raise UsageError(str(err)) from None
    start = time.perf_counter()
    rows = run_bench(config, progress=not args.quiet)
    wall = time.perf_counter() - start
    print_report(rows, config, wall)
    if args.json:
        print(f"wrote {write_json(args.json, rows, config, wall)}")
    if args.plot:
        print(f"wrote {plot(rows, args.plot)}")
    return 1 if any(r.status in ("WRONG", "error") for r in rows) else 0


def _kernel_bench_options(p: argparse.ArgumentParser, example: str) -> None:
    """The options ``bench-conv`` and ``bench-dense`` share (:mod:`tvm_tpp.bench.configs`)."""
    p.add_argument("--epilogue", default="", help="comma-separated ops without parameters, "
                   "GELU as gelu_erf or gelu_tanh, bf16 as convert_bf16 (the output) and "
                   "residual_bf16, e.g. bias,residual,relu")
    p.add_argument("--vs", action="append", metavar="FIELD=VALUE,...",
                   help=f"a row with these fields of the default changed, e.g. {example} "
                   "(repeatable)")
    p.add_argument("--candidates", action="store_true", help="also time the tuner's candidates")
    p.add_argument("--cold", action="store_true",
                   help="evict every operand but the input before each run, as the tuner times")
    p.add_argument("--threads", type=_at_least(1, int),
                   help="threads of TVM's pool and of the schedule (default: all cores)")
    p.add_argument("--warmup", type=_at_least(0, float), default=5.0,
                   help="seconds of untimed runs first (default 5)")
    p.add_argument("--rounds", type=_at_least(1, int), default=10,
                   help="interleaved rounds of 0.3 s per row (default 10)")
    p.add_argument("--json", help="write the rows as JSON")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tvm-tpp",
        description="Compile and benchmark deep-learning models with TPP microkernels on TVM.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func: Callable[[argparse.Namespace], int], help: str):
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=func)
        return p

    def model_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("model", help="ONNX file or bundled model: mlp, resnet_small, bert, "
                       "mobilenet_v2, seg_head, efficientnet, inception, gpt2, or an "
                       "architecture shipped in "
                       "onnx (resnet50, squeezenet, vgg19, ...)")
        p.add_argument("--target", default="tpp", help='"tpp" (host) or "tpp -isa=NAME"')
        p.add_argument("--shape", action="append", metavar="NAME=D0,D1,...",
                       help="input shape, for symbolic dimensions (repeatable)")
        p.add_argument("--batch", type=_at_least(1, int), help="batch size of a bundled model")
        p.add_argument("--work-dir", help="build with the tuning database `tvm-tpp tune` wrote "
                       "there (default: ./tvm_tpp_work, if it has one)")
        p.add_argument("--report", "-v", "--verbose", dest="report", action="store_true",
                       help="print the report table: each operator's shape, TPP kernel and "
                       "config, the ISA of its BRGEMM (amx where the tile kernel runs), "
                       "operand dtypes and layout, or why it stayed with TVM (-v/--verbose: "
                       "the same, and what TVM and LLVM printed while building)")
        p.add_argument("--report-json", metavar="FILE",
                       help="write the report as JSON: each operator's record, then the "
                       "FLOPs on TPP kernels and tpp_flops_fraction")
        # No argparse choices: a bad value is then compiler's one-line UsageError, not a
        # usage dump.
        p.add_argument("--precision", default="float32", metavar="{float32,bf16,bf16-strict}",
                       help="bf16: dense layers, convolutions and attention multiply in "
                       "bfloat16, accumulating in float32 (everything else stays float32), "
                       "on CPUs with bf16 arithmetic (AVX512-BF16, AMX, Arm BF16), elsewhere "
                       "in float32 (emulated bf16 is slower there); bf16-strict: in bfloat16 "
                       "on every CPU; a quantized (int8) model runs its int8 layers on int8 "
                       "kernels whatever this says")

    p = add("info", cmd_info, "host ISA, caches, target and registered microkernels")
    p.add_argument("-v", "--verbose", action="store_true", help="also print the tpp target")

    p = add("compile", cmd_compile, "compile a model to a shared library or show its code")
    model_options(p)
    p.add_argument("-o", "--output", required=True, help="output file")
    p.add_argument("--emit", choices=("so", "asm", "llvm", "tir"), default="so",
                   help="what to write: shared library (default), assembly, LLVM IR or TIR")

    p = add("run", cmd_run, "compile and run a model on random inputs, optionally checked")
    model_options(p)
    p.add_argument("--check", choices=("onnxruntime",), help="compare outputs with ONNX Runtime")
    p.add_argument("--rtol", type=float, help="max relative error for --check (default: "
                   "1e-4, 2e-2 where the layers multiply in bf16, for a quantized model 5e-2 "
                   "against its QDQ graph run unfused by ONNX Runtime)")
    p.add_argument("--repeat", type=_at_least(1, int), default=10, help="timed samples")
    p.add_argument("--number", type=_at_least(1, int), default=1, help="runs per timed sample")
    p.add_argument("--seed", type=int, default=0)

    p = add("profile", cmd_profile, "time per operator of the built model, grouped by kind "
            "(TPP kernel, layout conversion, TVM fallback, VM builtin) with each one's share")
    model_options(p)
    p.add_argument("--repeat", type=_at_least(1, int), default=10, help="profiled runs")
    p.add_argument("--top", type=_at_least(1, int), default=20,
                   help="slowest operators listed (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--json", help="write every operator's time and the totals as JSON")
    # layer_compare.AGAINST, spelt out: importing it (ONNX) would slow every command down.
    p.add_argument("--against", choices=("onnxruntime", "openvino", "openvino-f32"),
                   help="also time ONNX Runtime or OpenVINO (its defaults: bf16 on AMX hosts; "
                   "or openvino-f32) per node on the same file, in this process, and list "
                   "each conv, dense layer and attention batch matmul's time on both sides")
    p.add_argument("--rounds", type=_at_least(1, int), default=3,
                   help="alternating rounds of --repeat runs each for --against (default 3)")
    p.add_argument("--warmup", type=_at_least(0, float), default=3.0,
                   help="seconds of both runtimes' runs before --against's rounds (default 3)")

    p = add("tune", cmd_tune, "tune every GEMM, conv and batch GEMM of the models over their "
            "loop_spec spaces")
    p.add_argument("model", nargs="+", help="ONNX files or bundled model names")
    p.add_argument("--target", default="tpp", help='"tpp" (host) or "tpp -num-cores=N"')
    p.add_argument("--batch", type=_at_least(1, int), help="batch size of bundled models")
    p.add_argument("--work-dir", help="where the tuning database is written "
                   "(default: ./tvm_tpp_work)")
    p.add_argument("--budget", type=_at_least(0, float),
                   help="seconds of tuning per operator (default: no limit)")
    p.add_argument("--explain", action="store_true",
                   help="show the measurements (next to the cost model's ranking for GEMMs)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also show what TVM and LLVM print while building candidates")
    p.add_argument("--precision", default="float32", metavar="{float32,bf16,bf16-strict}",
                   help="tune the GEMMs a build of this precision runs (as compile's "
                   "--precision)")
    _rpc_options(p, "measure candidates (built here, in parallel across the servers)")
    p.add_argument("--exclusive", action="store_true", help="with --rpc: the servers share "
                   "one machine; they time one at a time (building still overlaps)")

    p = add("bench-gemm", cmd_bench_gemm,
            "GEMM GFLOPS (--dtype float32) or GOPS (int8, bfloat16: x tpp-float32, %% of "
            "the dtype's peak): tpp, tuned tpp, numpy, torch, TVM default, MetaSchedule")
    from .bench.gemm import add_arguments

    add_arguments(p)

    p = add("bench-kernel", cmd_bench_kernel, "BRGEMM GFLOPS and fraction of this core's peak")
    p.add_argument("--dtype", choices=("float32", "int8", "int8_w7", "bfloat16"),
                   default="float32",
                   help="int8: full-range u8 x s8; int8_w7: weights in [-64, 64] (vnni4_w7)")
    p.add_argument("--isa", help="ISA to benchmark (default: the host's); the kernel timed "
                   "is that ISA's own, never silently another; amx: the AMX tile kernel "
                   "(--dtype int8 or bfloat16) on a 32x32 tile block, with its fraction of "
                   "the AMX peak, where this process may run AMX")
    p.add_argument("--json", help="write the result as JSON")

    p = add("bench-conv", cmd_bench_configs, "one conv kernel's time under its default and "
            "other configurations, interleaved (warm, or --cold as the tuner times)")
    p.add_argument("conv", help="NxCxHxWxKxRxS[/s1x1p0x0x0x0[d1x1][g1]] as the tuner names it, "
                   "e.g. 1x64x56x56x64x3x3/s1x1p1x1x1x1")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "uint8", "uint8_w7"),
                   default="float32", help="the input's type (uint8: u8 x s8 -> int32; "
                   "uint8_w7: with 7-bit weights, vpmaddubsw on CPUs without VNNI)")
    _kernel_bench_options(p, "fold_taps=false or bq=14,bk=32")
    p.add_argument("--after", metavar="CONV", help="a conv run untimed before each run, writing "
                   "this one's input as the layer before does in a network (this conv: 1x1, "
                   "stride 1, no padding), e.g. 1x256x14x14x256x3x3/s1x1p1x1x1x1")
    p.add_argument("--after-epilogue", default="bias,relu",
                   help="the --after conv's epilogue (default bias,relu)")
    p.add_argument("--winograd", action="store_true",
                   help="also time the conv's Winograd forms, F(4x4, 3x3) and F(2x2, 3x3), "
                   "each in its default blocks (float32 or bfloat16 3x3 convs of stride 1 "
                   "padded by 1)")

    p = add("bench-dense", cmd_bench_configs, "one dense layer's kernel time under its default "
            "and other configurations, interleaved (warm, or --cold as the tuner times)")
    p.add_argument("dense", help="MxNxK as the tuner names it, e.g. 1024x3072x768")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "uint8"), default="float32",
                   help="the input's type (uint8: u8 x s8 -> int32)")
    _kernel_bench_options(p, "bm=64 or bn=32,bk=256")

    p = add("bench", cmd_bench, "compare with TVM, MetaSchedule, ONNX Runtime and OpenVINO (fair "
            "timing)")
    p.add_argument("model", nargs="+", help="bundled model names or ONNX files")
    p.add_argument("--batch", default="1", help="batch sizes of bundled models, e.g. 1,8")
    p.add_argument("--shape", action="append", metavar="NAME=D0,D1,...",
                   help="input shape of an ONNX file with symbolic dimensions besides the "
                   "batch, e.g. a detector's x=1,3,640,640 (repeatable)")
    p.add_argument("--threads", type=int, help="threads of every implementation (default: all)")
    p.add_argument("--repeat", type=int, default=10, help="timed samples per implementation")
    p.add_argument("--impls",
                   help="comma-separated implementations to compare (default: tpp,tpp-tuned,"
                   "tvm-default,metaschedule,onnxruntime; with --rpc: tpp,tpp-tuned,"
                   "tvm-default, and metaschedule may be added), of tpp, tpp-tuned, "
                   "tvm-default, metaschedule (--ms-trials trials), metaschedule-1x and "
                   "metaschedule-10x (MetaSchedule searching as long as tpp-tuned tuned, and "
                   "10 times as long: after tpp-tuned), "
                   "onnxruntime, openvino (OpenVINO's defaults: bf16 "
                   "on CPUs with AVX512-BF16 or AMX), openvino-f32 (its f32 precision hint); "
                   "the openvino rows need pip install 'tvm-tpp[openvino]'")
    p.add_argument("--ms-trials", type=int, default=64,
                   help="MetaSchedule's total trials (the metaschedule row)")
    p.add_argument("--work-dir", help="models, logs and tuning databases "
                   "(default: ~/.cache/tvm-tpp/bench; reused by later runs)")
    p.add_argument("--json", help="write rows, host and command line as JSON")
    p.add_argument("--plot", help="write speedup and build-cost charts (PNG)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights, inputs and tuning")
    p.add_argument("--rtol", type=float, help="largest relative error against ONNX Runtime "
                   "that counts as correct (default: 1e-4; bf16 2e-2, int8 5e-2); for outputs "
                   "near zero on random inputs, where ONNX Runtime's own runs differ more")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds one implementation may spend building and tuning")
    # No choices, as for run: a bad value is BenchConfig's one-line error.
    p.add_argument("--precision", default="float32", metavar="{float32,bf16,int8}",
                   help="bf16: tpp rows built with run's --precision bf16 (dense, conv and "
                   "attention in bf16 on CPUs with bf16 arithmetic, float32 elsewhere, as "
                   "OpenVINO's default does); int8: every "
                   "row on a QDQ-quantized model (a float one is quantized with ONNX Runtime's "
                   "pre-processing and seeded random calibration, cached in the work dir); "
                   "below float32 a tpp-float32 row is added (default tolerance: bf16 2e-2 vs "
                   "ONNX Runtime on the float model, int8 5e-2 vs the int8 file's QDQ graph run "
                   "unfused by ONNX Runtime)")
    p.add_argument("--reduce-range", action="store_true",
                   help="with --precision int8: quantize a float model's weights to 7 bits "
                   "(ONNX Runtime's reduce_range, its advice for CPUs without VNNI, where "
                   "8-bit weights saturate its int8 kernels; tpp's kernel multiplies them "
                   "exactly at about twice its 8-bit rate there); every row runs that file")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress display")
    _rpc_options(p, "build the models for the servers and time them (tpp, tpp-tuned tuned on "
                 "the same servers, tvm-default, metaschedule measured through the same "
                 "tracker)")
    return parser


class _Warnings(logging.StreamHandler):
    """The library's warnings (a tuning database set aside, a record dropped) as one line
    each, ``tvm-tpp: warning: ...``, on whatever ``sys.stderr`` is when they are emitted."""

    def __init__(self, form: str = "tvm-tpp: warning: %(message)s",
                 level: int = logging.WARNING) -> None:
        super().__init__()
        self.setLevel(level)
        self.setFormatter(logging.Formatter(form))

    @property
    def stream(self):  # noqa: D102 - sys.stderr at emit time (tests swap it)
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _show_warnings(verbose: bool) -> None:
    """The library's warnings on stderr; with ``verbose`` also what TVM and LLVM printed
    (:func:`tvm_tpp.compiler.native_output` keeps it out of the terminal otherwise)."""
    for name in ("schedules", "tvm_tpp"):
        logger = logging.getLogger(name)
        if not any(isinstance(h, _Warnings) for h in logger.handlers):
            logger.addHandler(_Warnings())
    native = logging.getLogger("tvm_tpp.native")
    native.setLevel(logging.INFO if verbose else logging.WARNING)
    if not any(isinstance(h, _Warnings) for h in native.handlers):
        native.addHandler(_Warnings("tvm: %(message)s", logging.INFO))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _show_warnings(getattr(args, "report", False) or getattr(args, "verbose", False))
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except TppError as err:  # a user's mistake; any other exception keeps its traceback
        message = str(err).strip().splitlines()
        print(f"tvm-tpp: error: {message[0] if message else type(err).__name__}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
