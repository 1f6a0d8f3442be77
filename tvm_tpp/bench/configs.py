"""``tvm-tpp bench-conv`` and ``bench-dense``: one conv or dense kernel timed under several
configurations, side by side in one process.

The kernel is named as the tuner names it (``tvm-tpp tune --explain``, the tuning database):
a conv ``NxCxHxWxKxRxS/s{sh}x{sw}p{top}x{left}x{bottom}x{right}`` (:func:`schedules.ops.
conv_problem`; ``g{C}`` with ``K = C``: the depthwise kernel a network's depthwise conv
runs), a dense layer ``MxNxK``.  Its rows: the untuned default (its template's
``default_config``), each ``--vs`` variant (fields of the default replaced, e.g.
``fold_taps=false`` or ``bq=14,bk=32`` of a conv, ``bm=64`` of a dense layer) and, with
``--candidates``, the tuner's list.  They are built together and timed as the tuner times
them (:func:`schedules.measure.measure`: interleaved rounds, the fastest sample), after
``--warmup`` seconds of runs of each in turn (a VM's first seconds after a build run slower);
warm, or with ``--cold`` every operand but the input evicted from the caches before each
run, as the tuner measures.  Only the kernel is timed: its input packed and padded, its
weights packed, as in a built network.

``--threads N`` sizes TVM's thread pool (it must not have started yet: a fresh process) and
schedules for N cores.

Examples
--------
$ tvm-tpp bench-conv 1x3x224x224x64x7x7/s2x2p3x3x3x3 --epilogue bias,relu --vs fold_taps=false
$ tvm-tpp bench-conv 1x256x14x14x1024x1x1 --epilogue bias,residual,relu --cold --candidates
$ tvm-tpp bench-dense 1024x3072x768 --epilogue bias --cold --vs bm=64
>>> from tvm_tpp.tpp_target import target
>>> rows = bench_configs(conv_problem("1x8x6x6x16x3x3/s1x1p1x1x1x1"), target("tpp"),
...                      [("default", None)], warmup=0.0, rounds=1)
>>> [(r.label, r.seconds > 0) for r in rows]
[('default', True)]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from microkernels.epilogue import DTYPE_TAGS, Epilogue, EpilogueOp
from microkernels.machine import machine_of
from schedules.conv import ConvProblem
from schedules.depthwise import DepthwiseProblem
from schedules.gemm import GemmConfig, GemmProblem
from schedules.measure import measure, time_runs
from schedules.ops import Config, Problem, config_text, conv_problem, op_of, problem_text
from schedules.search import MAX_CANDIDATES
from schedules.space import Candidate
from schedules.winograd import TILES, WinogradProblem

from ..errors import UsageError

if TYPE_CHECKING:
    from tvm.target import Target

__all__ = ["ConfigRow", "bench_configs", "dense_problem", "epilogue_of", "variant",
           "format_rows", "run", "tuner_candidates"]


@dataclass(frozen=True)
class ConfigRow:
    """One configuration's time: ``seconds`` of one run, or the ``error`` that kept it from
    being built."""

    label: str
    config: Config
    seconds: float | None
    error: str = ""


#: Kernel names' tags of requantization's output types.
_QUANTIZED = {DTYPE_TAGS[dtype]: dtype for dtype in ("uint8", "int8")}


def epilogue_of(text: str) -> Epilogue:
    """The epilogue ``--epilogue`` names: kinds that take no parameter, GELU by its variant,
    bf16 and requantization as kernel names spell them (``gelu_erf``, ``gelu_tanh``;
    ``convert_bf16`` the output, ``residual_bf16`` a bf16 residual; ``requantize_u8`` and
    ``requantize_s8`` with per-channel scales, as quantized networks' convs), comma-separated.

    >>> epilogue_of("bias,residual,relu").name
    'bias_residual_relu'
    >>> epilogue_of("bias,gelu_erf").name
    'bias_gelu_erf'
    >>> epilogue_of("bias,residual_bf16,relu,convert_bf16").name
    'bias_residual_bf16_relu_convert_bf16'
    >>> epilogue_of("bias,requantize_u8").name
    'bias_requantize_u8'
    >>> epilogue_of("")
    Epilogue(ops=())
    """
    def op(name: str) -> EpilogueOp:
        kind, _, variant = name.partition("_")
        if kind == "gelu":
            return EpilogueOp(kind, variant=variant)
        if kind in ("convert", "residual") and variant == "bf16":
            return EpilogueOp(kind, dtype="bfloat16")
        if kind == "requantize" and variant in _QUANTIZED:
            return EpilogueOp(kind, broadcast="row", dtype=_QUANTIZED[variant])
        return EpilogueOp(name)

    try:
        return Epilogue(tuple(op(name.strip()) for name in text.split(",") if name.strip()))
    except (ValueError, TypeError) as err:
        raise UsageError(f"--epilogue: {err}") from None


def _value(field_type: str, name: str, text: str) -> object:
    if "None" in field_type and text.lower() == "none":
        return None
    if "bool" in field_type:
        if text.lower() not in ("true", "false", "1", "0"):
            raise UsageError(f"--vs {name} takes true or false, got {text!r}")
        return text.lower() in ("true", "1")
    if "int" in field_type:
        try:
            return int(text)
        except ValueError:
            raise UsageError(f"--vs {name} takes an int, got {text!r}") from None
    return text


def dense_problem(text: str, dtype: str = "float32", epilogue: Epilogue | None = None
                  ) -> GemmProblem:
    """The dense layer ``MxNxK`` names (as the tuner shows it).

    >>> dense_problem("1024x3072x768").flops
    4831838208
    """
    try:
        m, n, k = (int(d) for d in text.split("x"))
    except ValueError:
        raise UsageError(f"a dense layer is MxNxK, e.g. 1024x3072x768; got {text!r}") from None
    try:
        return GemmProblem(m, n, k, dtype, epilogue or Epilogue())
    except ValueError as err:
        raise UsageError(str(err)) from None


#: Fields ``--vs`` cannot set: block steps (the tuner's candidates have them).
_UNSETTABLE = ("block_steps", "candidate")


def variant(config: Config, text: str, problem: Problem) -> Config:
    """``config`` with the fields ``text`` sets (``name=value,...``), checked against
    ``problem``.

    >>> from schedules.conv import ConvConfig
    >>> p = conv_problem("1x64x56x56x64x3x3/s1x1p1x1x1x1")
    >>> variant(ConvConfig(bq=28, bc=64, bk=64), "bq=14,spec=ACbfgde", p).bq
    14
    >>> variant(GemmConfig.of("CBa", 256, 16, 384, k_step=2), "bm=64,spec=BCa",
    ...         dense_problem("1024x3072x768")).spec
    'BCa'
    >>> variant(GemmConfig.of("aCB", 128, 64, 512, pack_a=1), "pack_a=none",
    ...         dense_problem("128x768x3072")).pack_a is None
    True
    """
    settable = {f.name: str(f.type) for f in fields(config) if f.name not in _UNSETTABLE}
    dense = isinstance(config, GemmConfig)
    if dense:  # its loop order is its candidate's, which also holds k_step
        settable |= {"spec": "str", "k_step": "int"}
    changes: dict[str, object] = {}
    for item in text.split(","):
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or name not in settable:
            raise UsageError(f"--vs takes FIELD=VALUE,... of {', '.join(settable)}; got {item!r}")
        changes[name] = _value(settable[name], name, value.strip())
    if changes.get("fold_taps") is False and "batch_rows" in settable:
        changes.setdefault("batch_rows", False)  # the rows it batches are folded taps'
    try:
        if dense and {"spec", "k_step"} & changes.keys():
            steps = {**config.candidate.steps, "a": changes.pop("k_step", config.k_step)}
            if steps["a"] == 1:  # as GemmConfig.of writes it: the default step is no entry
                del steps["a"]
            candidate = Candidate(changes.pop("spec", config.spec), {}, steps)
            changes["candidate"] = candidate
        changed = replace(config, **changes)
        # Blocks that tile the problem, a loop_spec that fits them (a depthwise conv's config
        # has blocks only).
        getattr(changed, "parse", changed.check)(problem)
    except Exception as err:  # ValueError, LoopSpecError: the user's variant does not fit
        raise UsageError(f"--vs {text}: {err}") from None
    return changed


def bench_configs(problem: Problem, target: Target,
                  variants: Sequence[tuple[str, Config | None]], *, cold: bool = False,
                  warmup: float = 5.0, rounds: int = 10, round_seconds: float = 0.3,
                  after: ConvProblem | None = None,
                  forms: Sequence[tuple[str, Problem]] = ()) -> list[ConfigRow]:
    """Time each ``(label, config)`` of ``problem`` (None: the default), and each
    ``(label, form)`` (another problem computing the same, e.g. the conv's Winograd form, in
    its default config), interleaved.

    Parameters
    ----------
    problem, target
        The conv or dense layer and the ``tpp`` target it is scheduled and built for.
    variants
        Labelled configurations; one built once however often it is listed.
    cold
        Evict every operand but the input before each run (in a network the previous
        layer has just written it).
    warmup
        Seconds of runs, each configuration in turn, before the timing.
    rounds, round_seconds
        Of :func:`schedules.measure.time_interleaved`.
    after
        A conv (its default config) that writes ``problem``'s input before each run, untimed,
        as the layer before does in a network: its output, ``[N*P*Q, K]`` pixels by
        channels, is ``problem``'s packed input where ``problem`` is a 1x1 conv of stride 1
        without padding over its ``P x Q`` map and ``K`` channels (ValueError otherwise).
    forms
        Labelled problems timed beside ``problem``'s configurations, each in its default.
    """
    machine = machine_of(target)
    rows = [(label, problem, config or op_of(problem).default(problem, machine))
            for label, config in variants]
    rows += [(label, form, op_of(form).default(form, machine)) for label, form in forms]
    built: dict = {}  # (problem, config) -> run, or the error that kept it from being built
    for one in dict.fromkeys(p for _, p, _ in rows):
        configs = list(dict.fromkeys(c for _, p, c in rows if p == one))
        mine: dict = {}
        errors = measure(one, configs, target, machine.isa.name, rounds=0, built=mine)
        built |= {(one, c): mine.get(c, e) for c, e in zip(configs, errors, strict=True)}
    runs = [r for r in dict.fromkeys(built.values()) if not isinstance(r, str)]
    producer = _producer(after, problem, runs, target) if after is not None and runs else None
    end = time.perf_counter() + warmup
    while runs and time.perf_counter() < end:
        for run in runs:
            if producer is not None:
                producer()
            run()
    seconds = dict(zip(runs, time_runs(runs, rounds, round_seconds, cold, producer),
                       strict=True))
    return [ConfigRow(label, config, seconds[built[(p, config)]], "")
            if not isinstance(built[(p, config)], str)
            else ConfigRow(label, config, None, built[(p, config)])
            for label, p, config in rows]


def _producer(after: ConvProblem, problem: ConvProblem, runs: list, target: Target):
    """``after``'s kernel writing into the input the ``runs`` share (their first argument)."""
    feeds = (after.n, after.p, after.q, after.k, after.out_dtype) == (
        problem.n, problem.h, problem.w, problem.c, problem.dtype)
    if not (feeds and isinstance(problem, ConvProblem) and problem.pointwise
            and not problem.prologue.ops):
        raise ValueError(f"the output of {problem_text(after)} is not the packed input of "
                         f"{problem_text(problem)}: --after takes the conv before a 1x1 conv "
                         "of stride 1 without padding, its P x Q x K that conv's H x W x C")
    machine = machine_of(target)
    config = op_of(after).default(after, machine)
    built: dict = {}
    measure(after, [config], target, machine.isa.name, rounds=0, built=built)
    if config not in built:
        raise ValueError(f"{problem_text(after)} could not be built")
    run = built[config]
    x = runs[0].args[0]
    return functools.partial(run.func, *run.args[:-1], x._create_view((after.rows, after.k)))


def tuner_candidates(problem: Problem, target: Target) -> list[tuple[str, Config]]:
    """The tuner's candidates for ``problem`` in its measuring order, labelled ``candidate
    N``."""
    choices, _ = op_of(problem).choices(problem, machine_of(target), MAX_CANDIDATES)
    return [(f"candidate {i}", c.config) for i, c in enumerate(choices)]


def format_rows(problem: Problem, rows: Sequence[ConfigRow], cold: bool, threads: int,
                after: ConvProblem | None = None) -> str:
    """The rows as a table: time, GFLOPS (GOPS below float32) and speed relative to the
    first row."""
    unit = "GFLOPS" if problem.dtype == "float32" else "GOPS"
    width = max([14, *(len(row.label) for row in rows)])
    what = (f"dense {problem.m}x{problem.n}x{problem.k}" if isinstance(problem, GemmProblem)
            else f"conv {problem.n}x{problem.c}x{problem.h}x{problem.w} -> {problem.k} "
            f"{problem.r}x{problem.s}" + ("" if isinstance(problem, ConvProblem)
                                          else " depthwise"))
    lines = [f"{what}, {problem.dtype}, epilogue "
             f"{problem.epilogue.name or '-'}; {threads} thread{'s' if threads > 1 else ''}, "
             f"{'operands flushed before each run' if cold else 'warm'}"
             + (f"; after {problem_text(after)}, untimed, writing its input" if after else ""),
             f"{'':{width}s} {'ms':>9s} {unit:>7s} {'x first':>8s}  config"]
    first = rows[0].seconds if rows else None
    for row in rows:
        if row.seconds is None:
            lines.append(f"{row.label:{width}s} {'error':>9s} {'':7s} {'':8s}  "
                         f"{config_text(row.config)}: {row.error}")
            continue
        ratio = f"{first / row.seconds:7.3f}x" if first else ""
        lines.append(f"{row.label:{width}s} {row.seconds * 1e3:9.4f} "
                     f"{problem.flops / row.seconds / 1e9:7.1f} {ratio:>8s}  "
                     f"{config_text(row.config)}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """``tvm-tpp bench-conv`` (``args.conv``) or ``bench-dense`` (``args.dense``): 0, or 1
    when a row could not be built."""
    if args.threads is not None:  # before TVM's thread pool starts (checked below)
        os.environ["TVM_NUM_THREADS"] = str(args.threads)
    import tvm_ffi

    from ..tpp_target import target

    threads = tvm_ffi.get_global_func("runtime.NumThreads")()
    if args.threads is not None and threads != args.threads:
        raise UsageError(f"--threads {args.threads}: TVM's thread pool of this process already "
                         f"has {threads} threads")
    conv = getattr(args, "conv", None)
    epilogue = epilogue_of(args.epilogue)
    try:
        problem = (conv_problem(conv, args.dtype, epilogue) if conv
                   else dense_problem(args.dense, args.dtype, epilogue))
    except ValueError as err:
        raise UsageError(str(err)) from None
    try:
        after = (conv_problem(args.after, args.dtype, epilogue_of(args.after_epilogue))
                 if getattr(args, "after", None) else None)
    except ValueError as err:
        raise UsageError(f"--after: {err}") from None
    tpp = target("tpp", num_cores=threads)
    op = op_of(problem)
    default = op.default(problem, machine_of(tpp))
    variants = [("default", default)] + [(f"vs {text}", variant(default, text, problem))
                                         for text in args.vs or ()]
    if args.candidates:
        variants += tuner_candidates(problem, tpp)
    forms = []
    if getattr(args, "winograd", False):
        if isinstance(problem, DepthwiseProblem):
            raise UsageError("--winograd: a depthwise conv has no Winograd form")
        try:
            forms = [(f"winograd F{m}", WinogradProblem(problem, m)) for m in TILES]
        except (TypeError, ValueError) as err:
            raise UsageError(f"--winograd: {err}") from None
    try:
        rows = bench_configs(problem, tpp, variants, cold=args.cold, warmup=args.warmup,
                             rounds=args.rounds, after=after, forms=forms)
    except ValueError as err:
        raise UsageError(f"--after: {err}") from None
    print(format_rows(problem, rows, args.cold, threads, after))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({op.name: conv or args.dense, "dtype": args.dtype,
                       "epilogue": problem.epilogue.name, "threads": threads, "cold": args.cold,
                       "flops": problem.flops,
                       "rows": [{"label": r.label, "seconds": r.seconds, "error": r.error,
                                 "config": op_of(r.config).to_json(r.config)} for r in rows]},
                      f, indent=1)
    return 0 if all(r.seconds is not None for r in rows) else 1
