"""The benchmarks' reports: tables, JSON and the tuner's explanation.

- ``tvm-tpp bench``: :func:`print_report` (a table per model and batch, then footnotes),
  :func:`to_json` / :func:`write_json` (rows, host and command line), :func:`host_info`;
- ``tvm-tpp bench-gemm``: :func:`print_gemm_report`; ``tvm-tpp bench-kernel``:
  :func:`format_bench_kernel`;
- ``bench-gemm --explain`` and ``tvm-tpp tune --explain``: :func:`explanation` relates the
  TPP tuner's model ranking to what it measured, :func:`print_tuned` shows it per operator.

Plots are :mod:`tvm_tpp.bench.plots`.

Examples
--------
>>> print(_ms(0.0123), _ms(123.4), _seconds(None))
0.012 123.4 -
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from microkernels import isa as _isa

from .impls import BUDGET_TRIALS_PER_ITER, TIME_MATCHED
from .networks import BASELINES, TOLERANCE, TOLERANCES, BenchConfig, Row

if TYPE_CHECKING:
    from rich.console import Console

    from schedules.tuner import Measurement

    from .gemm import BenchResult

__all__ = ["explanation", "format_bench_kernel", "host_info", "print_gemm_report",
           "print_report", "print_tuned", "to_json", "write_json"]

# Flags that tell which SIMD units a CPU has (x86 and Arm spellings); "smep" is not Arm SME.
_SIMD_PREFIXES = ("avx", "fma", "amx", "f16c", "asimd", "sve", "sme", "bf16", "i8mm", "fphp")
_NOT_SIMD = frozenset({"smep"})
# Implementations whose worker notes (offload counts, tuning budget, database) are footnoted.
_NOTED = ("tpp", "tpp-tuned", "metaschedule", "metaschedule-1x", "metaschedule-10x", "openvino",
          "openvino-f32")


def _fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _yes(flag: bool | None) -> str:
    return "yes" if flag else "no"


# ------------------------------------------------------------------------------------------
# The tuner's model ranking next to its measurements.


def explanation(measurements: Sequence[Measurement], problem: Any, kept: Any
                ) -> dict[str, Any]:
    """The tuner's model ranking next to what it measured, as JSON values.

    Ranks and classes within each blocking (:class:`schedules.tuner.Choice`) are 1-based;
    the default (measured first) and the ``kept`` configuration are flagged.  For operators
    no model ranks (convs, batch GEMMs) ranks and classes are None.

    Examples
    --------
    >>> from schedules.gemm import GemmProblem
    >>> from schedules.tuner import Measurement
    >>> explanation([], GemmProblem(8, 8, 8), None)["best_model_rank"] is None
    True
    """
    from schedules.tuner import MARGIN, config_text

    def one_based(value: int | None) -> int | None:
        return None if value is None else value + 1

    rows = [{"model_rank": one_based(m.model_rank), "model_class": one_based(m.model_class),
             "default": i == 0, "predicted_cycles": m.predicted_cycles,
             "gflops": m.gflops(problem), "config": config_text(m.config), "error": m.error,
             "kept": m.config == kept}
            for i, m in enumerate(measurements)]
    timed = [r for r in rows if r["gflops"]]
    best = max(timed, key=lambda r: r["gflops"]) if timed else None
    rank = best["model_rank"] if best else None
    model_class = best["model_class"] if best else None
    top5 = [r["gflops"] for r in timed if r["model_rank"] is not None and r["model_rank"] <= 5]
    # Candidates within the tuner's MARGIN of each other are equal as far as timing can tell.
    return {"measured": rows, "best_model_rank": rank, "best_model_class": model_class,
            "best_in_model_top5": rank is not None and rank <= 5,
            "best_in_model_top5_classes": model_class is not None and model_class <= 5,
            "top5_within_margin": bool(best and top5
                                       and max(top5) >= best["gflops"] * (1 - MARGIN))}


def _print_explanation(console: Console, title: str, explained: dict[str, Any]) -> None:
    """One operator's :func:`explanation`: a table in model-rank order (measuring order for
    unranked operators), then how the model fared."""
    from rich.table import Table

    from schedules.tuner import MARGIN

    table = Table(title=title)
    for name in ("model rank", "class", "predicted Mcycles", "measured GFLOPS", "config"):
        table.add_column(name, justify="left" if name == "config" else "right")
    measured = sorted(explained["measured"], key=lambda i: (i["model_rank"] is None,
                                                            i["model_rank"] or 0))
    for item in measured:
        rank = "" if item["model_rank"] is None else str(item["model_rank"])
        label = " ".join(filter(None, (rank, "(default)" if item["default"] else "")))
        cycles = item["predicted_cycles"]
        gflops = _fmt(item["gflops"], ".1f", item["error"] or "-")
        table.add_row(label or "-", _fmt(item["model_class"], "d"),
                      _fmt(cycles and cycles / 1e6, ".2f"),
                      gflops + (" *" if item.get("kept") else ""), item["config"])
    console.print(table)
    kept = "* = kept, which must beat the default by the tuner's margin"
    if explained["best_model_rank"] is not None:
        console.print(
            f"measured best is model rank {_fmt(explained['best_model_rank'], 'd')}, class "
            f"{_fmt(explained['best_model_class'], 'd')}; in the model's top 5: "
            f"{_yes(explained['best_in_model_top5'])}; in its top 5 classes: "
            f"{_yes(explained['best_in_model_top5_classes'])}; top 5 within "
            f"{100 * MARGIN:g} % of it: {_yes(explained['top5_within_margin'])}; {kept}")
    else:
        console.print(f"no cost model ranks this operator: measured in its template's order; "
                      f"{kept}")


def print_tuned(console: Console, tuned: Iterable[tuple[Any, Any]]) -> None:
    """``tvm-tpp tune --explain``: per ``(problem, TuneResult)``, its measurements."""
    from schedules.tuner import problem_text

    for problem, result in tuned:
        what = problem_text(problem)
        if result.cached:
            console.print(f"{what}: from the database (no new measurements); delete the work "
                          "dir to re-measure")
            continue
        _print_explanation(console, f"{what}: model ranking vs measurement "
                                    f"({result.candidates} candidates)",
                           explanation(result.measurements, problem, result.best))


# ------------------------------------------------------------------------------------------
# ``tvm-tpp bench``.


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model name", "Hardware") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def host_info() -> dict[str, Any]:
    """The machine and software versions the numbers belong to."""
    flags = sorted(f for f in _isa.host_flags()
                   if f.startswith(_SIMD_PREFIXES) and f not in _NOT_SIMD)
    return {
        "cpu": _cpu_name(),
        "arch": platform.machine(),
        "simd_flags": flags,
        "cores": _isa.num_cores(),
        "logical_cpus": os.cpu_count(),
        "tvm_version": _version("apache-tvm"),
        "tvm_ffi_version": _version("apache-tvm-ffi"),
        "ort_version": _version("onnxruntime"),
        "onnx_version": _version("onnx"),
        "numpy_version": _version("numpy"),
        "python": platform.python_version(),
        "os": platform.platform(),
    }


def to_json(rows: Sequence[Row], cfg: BenchConfig, wall_seconds: float | None = None
            ) -> dict[str, Any]:
    """The JSON document ``--json`` writes."""
    return {
        "command": cfg.command_line(),
        "host": host_info(),
        "settings": {"threads": cfg.threads, "repeat": cfg.repeat, "impls": list(cfg.compared),
                     "precision": cfg.precision, "reduce_range": cfg.reduce_range,
                     "batches": list(cfg.batches), "ms_trials": cfg.ms_trials,
                     "tolerance": cfg.tolerance, "seed": cfg.seed,
                     "work_dir": str(cfg.work_dir)},
        "wall_seconds": wall_seconds,
        "rows": [asdict(row) for row in rows],
    }


def write_json(path: str | os.PathLike, rows: Sequence[Row], cfg: BenchConfig,
               wall_seconds: float | None = None) -> Path:
    """Write :func:`to_json`'s document to ``path``."""
    path = Path(path)
    path.write_text(json.dumps(to_json(rows, cfg, wall_seconds), indent=1) + "\n")
    return path


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _table(rows: Sequence[Row], cfg: BenchConfig) -> tuple[list[str], list[list[str]],
                                                           list[str]]:
    """Header, cells (one list per row) and footnotes of the report."""
    baselines = [b for b in BASELINES if b in cfg.compared]
    header = ["model", "batch", "impl", "median ms", "p10-p90 ms", "samples",
              *[f"x {b}" for b in baselines], "compile s", "tune s", "rel err", "status"]
    cells, notes = [], []
    for row in rows:
        spread = "-" if row.p10_ms is None else f"{_ms(row.p10_ms)}-{_ms(row.p90_ms)}"
        runs = f"{row.samples}x{row.runs_per_sample}" if row.samples else "-"
        speed = [f"{row.speedup[b]:.2f}x" if b in row.speedup else "-" for b in baselines]
        err = "-" if row.max_rel_err is None else f"{row.max_rel_err:.1e}"
        cells.append([row.model, str(row.batch), row.impl, _ms(row.median_ms), spread, runs,
                      *speed, _seconds(row.compile_seconds), _seconds(row.tune_seconds), err,
                      row.status])
        if row.error:
            notes.append(f"{row.model} b{row.batch} {row.impl} [{row.status}]: {row.error}")
        if row.notes and row.impl in _NOTED:
            notes.append(f"{row.model} b{row.batch} {row.impl}: {row.notes}")
    footnotes = [
        f"{cfg.threads} threads for every implementation (TVM_NUM_THREADS, ONNX Runtime "
        "intra-op threads), each in its own process; samples alternate round-robin.",
        "median/p10-p90 over `samples` timed samples, each the mean of `x` back-to-back runs "
        "after one warm-up run (runs over "
        f"{cfg.slow_seconds:g} s: fewer samples, no warm-up).",
        "x B = median of B / median of this row (> 1: faster than B); rows whose relative "
        f"error (max |error| / max |reference|) exceeds {cfg.tolerance:g} are WRONG and "
        "unranked.",
        "compile s = ONNX import + build; tune s = search time in this run (0: found in the "
        "work dir's database), apart from latency.",
        *_precision_notes(cfg),
        *_openvino_notes(cfg),
        *_time_matched_notes(cfg),
        *notes,
    ]
    return header, cells, footnotes


def _precision_notes(cfg: BenchConfig) -> list[str]:
    """What a low-precision run compared (nothing for float32)."""
    if cfg.precision == "float32":
        return []
    what = ("tpp rows: dense, conv and attention on bf16 kernels (float32 accumulation) on "
            "CPUs with bf16 arithmetic, on float32 kernels elsewhere (as the row's note says), "
            "checked against ONNX Runtime float32" if cfg.precision == "bf16" else
            "every row but tpp-float32 runs the QDQ-quantized model"
            + (" (7-bit weights: reduce_range)" if cfg.reduce_range else "")
            + ", checked against that "
            "file's QDQ graph as ONNX Runtime runs it without its fusions (the ONNX spec's "
            "roundings; the onnxruntime row is its fused int8 execution)")
    return [f"precision {cfg.precision}: {what}; tpp-float32 = tpp on the float32 model "
            f"(tolerance {TOLERANCE:g} vs ONNX Runtime on it).", *_saturation_notes(cfg)]


def _saturation_notes(cfg: BenchConfig, target: _isa.Isa | None = None) -> list[str]:
    """On an x86 CPU without an int8 dot product, full-range int8 weights: what the
    baselines' int8 kernels trade for their speed there (nothing elsewhere).

    >>> cfg = BenchConfig(models=("bert",), precision="int8")
    >>> _saturation_notes(cfg, _isa.from_name("avx2"))[0][:44]
    'no int8 dot product (VNNI) on this CPU: ONNX'
    >>> _saturation_notes(cfg, _isa.from_name("avx512_vnni"))
    []
    """
    target = target or _isa.detect()
    if cfg.precision != "int8" or cfg.reduce_range or target.int8_dot or target.arch != "x86_64":
        return []
    return ["no int8 dot product (VNNI) on this CPU: ONNX Runtime's and OpenVINO's fused u8 x s8 "
            "kernels multiply with vpmaddubsw, whose int16 pair sums saturate on full-range "
            "weights (wrong where two large products of one sign meet; random inputs rarely "
            "reach them), at about 1.6x the rate of tpp's exact int8 kernel; --reduce-range "
            "compares on 7-bit weights, where no kernel saturates."]


def _openvino_notes(cfg: BenchConfig) -> list[str]:
    """What the OpenVINO rows are (nothing without them)."""
    if not any(i.startswith("openvino") for i in cfg.compared):
        return []
    return ["openvino = OpenVINO's CPU plugin with its defaults (what a user gets: bf16 "
            "inference precision on CPUs with AVX512-BF16 or AMX, then checked with the bf16 "
            f"tolerance {TOLERANCES['bf16']:g} if the run's is lower); openvino-f32 = the same "
            "with INFERENCE_PRECISION_HINT f32; both with INFERENCE_NUM_THREADS = the threads "
            "above" + (" and on the int8 (QDQ) file" if cfg.precision == "int8" else "")
            + "; each row's note begins with the precision it ran in."]


def _time_matched_notes(cfg: BenchConfig) -> list[str]:
    """What the time-matched MetaSchedule rows are (nothing without them)."""
    matched = [i for i in cfg.compared if i in TIME_MATCHED]
    if not matched:
        return []
    return [f"{' / '.join(matched)} = MetaSchedule searching for "
            f"{' / '.join(f'{TIME_MATCHED[i]:g}x' for i in matched)} the seconds tpp-tuned's "
            "search took (its database's, where it reused one), in batches of "
            f"{BUDGET_TRIALS_PER_ITER} trials; at the budget no new batch starts, and the "
            "batches being measured are waited for (tune s can exceed the budget by that)."]


def print_report(rows: Sequence[Row], cfg: BenchConfig, wall_seconds: float | None = None,
                 file: IO[str] | None = None) -> None:
    """Print the ``bench`` table, then its footnotes."""
    from rich.console import Console
    from rich.table import Table

    file = file or sys.stdout
    header, cells, footnotes = _table(rows, cfg)
    title = ("tvm-tpp bench" + ("" if cfg.precision == "float32" else f", {cfg.precision}")
             + (f" ({wall_seconds:.0f} s)" if wall_seconds is not None else ""))
    table = Table(title=title)
    for name in header:
        table.add_column(name, justify="left" if name in ("model", "impl", "status")
                         else "right")
    styles = {"ok": "green", "WRONG": "bold red", "error": "red", "skipped": "yellow",
              "unchecked": "yellow"}
    previous = None
    for row, values in zip(rows, cells, strict=True):
        if previous is not None and (row.model, row.batch) != previous:
            table.add_section()
        previous = (row.model, row.batch)
        table.add_row(*values[:-1], f"[{styles[row.status]}]{values[-1]}[/]")
    console = Console(file=file)
    if not console.is_terminal:  # a file or pipe: as wide as the table, never truncated
        widths = [max(len(v) for v in column) for column in zip(header, *cells, strict=True)]
        console = Console(file=file, width=sum(widths) + 3 * len(widths) + 1)
    console.print(table)
    for note in footnotes:
        console.print(note, style="dim", highlight=False, markup=False)



# ------------------------------------------------------------------------------------------
# ``tvm-tpp bench-kernel``.


def format_bench_kernel(result: dict[str, Any]) -> str:
    """``tvm-tpp bench-kernel``: human-readable lines for a
    :func:`~tvm_tpp.bench.kernel.bench_kernel` result; the kernel named is the ISA whose
    implementation ran (``result["impl"]``), and a low-precision kernel's lines also give its
    fraction of its own instruction's peak.

    >>> print(format_bench_kernel({
    ...     "isa": "amx", "dtype": "bfloat16", "shape": [32, 32, 32, 8], "layout": "vnni2",
    ...     "impl": "amx", "gflops": 1536.0, "peak_gflops": 192.0, "fraction_of_peak": 8.0,
    ...     "clock_ghz": 3.0, "dtype_peak_gops": 3072.0, "fraction_of_dtype_peak": 0.5,
    ...     "dtype_peak_basis": "AMX 1024 bfloat16 ops per cycle x 3.00 GHz"}))
    ... # doctest: +NORMALIZE_WHITESPACE
    BRGEMM amx bfloat16 32x32x32x8 (vnni2, amx kernel): 1536.0 GOPS = 800.0% of the 192.0
    GFLOPS fp32 FMA peak (measured clock 3.00 GHz x 2 FMA units)
      50.0% of the 3072.0 GOPS bfloat16 peak (AMX 1024 bfloat16 ops per cycle x 3.00 GHz)
    """
    m, n, k, batch = result["shape"]
    unit = "GFLOPS" if result["dtype"] == "float32" else "GOPS"
    lines = [
        f"BRGEMM {result['isa']} {result['dtype']} {m}x{n}x{k}x{batch} ({result['layout']}, "
        f"{result['impl']} kernel): {result['gflops']:.1f} {unit} = "
        f"{100 * result['fraction_of_peak']:.1f}% of the {result['peak_gflops']:.1f} GFLOPS "
        f"fp32 FMA peak (measured clock {result['clock_ghz']:.2f} GHz x 2 FMA units)"
    ]
    if "dtype_peak_gops" in result:
        lines.append(f"  {100 * result['fraction_of_dtype_peak']:.1f}% of the "
                     f"{result['dtype_peak_gops']:.1f} GOPS {result['dtype']} peak "
                     f"({result['dtype_peak_basis']})")
    if "ratio_to_fp32" in result:
        lines.append(f"  fp32 kernel, same shape: {result['fp32_gflops']:.1f} GFLOPS; "
                     f"{result['dtype']} / fp32 = {result['ratio_to_fp32']:.2f}x")
    if "w7_gflops" in result:
        lines.append(f"  7-bit weights (vnni4_w7 layout, vpmaddubsw): "
                     f"{result['w7_gflops']:.1f} GOPS = "
                     f"{result['w7_ratio_to_fp32']:.2f}x fp32")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# ``tvm-tpp bench-gemm``.


def print_gemm_report(result: BenchResult, explain: bool = False) -> None:
    """The results table, the per-shape summary, ``--explain`` details and wall times."""
    from rich.console import Console
    from rich.table import Table

    from schedules.tuner import MARGIN, MODEL_RESOLUTION

    from .gemm import summary

    rows, peak = result.rows, result.peak
    # Piped output would wrap at 80 columns and fold the notes.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    table = Table(title="fp32 GEMM Y = X @ W (GFLOPS: fastest sample)")
    for name, justify in (("M x N x K", "left"), ("thr", "right"), ("impl", "left"),
                          ("GFLOPS", "right"), ("% peak", "right"), ("tune s", "right"),
                          ("max abs err", "right"), ("note", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        fraction = r["fraction_of_peak"]
        table.add_row(f"{r['m']}x{r['n']}x{r['k']}", str(r["threads"]), r["impl"],
                      _fmt(r["gflops"], ".1f"), _fmt(fraction and 100 * fraction, ".1f"),
                      _fmt(r["tune_seconds"], ".1f"), _fmt(r["max_abs_err"], ".1e"),
                      r["note"] or "")
    console.print(table)
    if peak is None:
        console.print(f"fp32 peak unknown ({result.peak_error}): fraction_of_peak is null")
    else:
        console.print(f"peak: {peak['gflops_per_core']:.1f} GFLOPS per core ({peak['isa']} FMA "
                      f"at {peak['clock_ghz']:.2f} GHz, measured); % peak = GFLOPS / (threads x "
                      "that)")
    lines = Table(title="tuned tpp vs baselines (ratios of GFLOPS; tuning time MS / tpp-tuned)")
    for name in ("M x N x K", "thr", "tpp-tuned / numpy", "tpp-tuned / MetaSchedule",
                 "tuning time MS / tpp-tuned"):
        lines.add_column(name, justify="left" if name == "M x N x K" else "right")
    for s in summary(rows):
        lines.add_row(f"{s['m']}x{s['n']}x{s['k']}", str(s["threads"]),
                      _fmt(s["vs_numpy"], ".2f"), _fmt(s["vs_metaschedule"], ".2f"),
                      _fmt(s["ms_tune_time_ratio"], ".1f"))
    console.print(lines)
    if explain:
        for r in rows:
            if "explain" in r:
                title = f"{r['m']}x{r['n']}x{r['k']} t{r['threads']}: model ranking vs measurement"
                _print_explanation(console, title, r["explain"])
        explained = [r["explain"] for r in rows if "explain" in r]
        counts = {key: sum(bool(ex.get(key)) for ex in explained) for key in
                  ("best_in_model_top5", "best_in_model_top5_classes", "top5_within_margin")}
        console.print(
            f"model vs measurement over {len(explained)} tunings: the fastest measured is in "
            f"the model's top 5 in {counts['best_in_model_top5']}, in its top 5 classes "
            f"(predictions {100 * MODEL_RESOLUTION:g} % apart) in "
            f"{counts['best_in_model_top5_classes']}, and a top-5 candidate is within "
            f"{100 * MARGIN:g} % of it in {counts['top5_within_margin']}")
    walls = ", ".join(f"{key} {seconds:.0f} s" for key, seconds in result.wall_seconds.items())
    console.print(f"wall times (impl/tN: preparing that worker; timing/tN: the alternating "
                  f"rounds): {walls}")
    if result.load_average is not None:
        before, after = result.load_average
        console.print(f"1-minute load average: {before:.1f} before, {after:.1f} after "
                      f"({os.cpu_count()} CPUs; other processes distort the timings)")
