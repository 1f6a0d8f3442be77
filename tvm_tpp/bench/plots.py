"""The benchmarks' charts (PNG, matplotlib's Agg backend: no display needed).

:func:`plot` draws ``tvm-tpp bench`` (speedups over each baseline, build cost against
latency), :func:`plot_gemm` draws ``tvm-tpp bench-gemm`` (GFLOPS per shape and thread count).

Examples
--------
>>> plot_gemm([{"m": 8, "n": 8, "k": 8, "threads": 1, "impl": "tpp", "gflops": 1.0}],
...           "gemm.png")  # doctest: +SKIP
PosixPath('gemm.png')
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .gemm import IMPLS as GEMM_IMPLS
from .networks import BASELINES, IMPLS, Row

__all__ = ["plot", "plot_gemm"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(rows: Sequence[Row], path: str | os.PathLike) -> Path:
    """Bar charts of speedups against each baseline, and build cost against latency."""
    plt = _pyplot()
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    path = Path(path)
    ok = [r for r in rows if r.status == "ok" and r.median_ms]
    cases = list(dict.fromkeys((r.model, r.batch) for r in rows))
    baselines = [b for b in BASELINES if any(r.impl == b for r in ok)]
    fig, axes = plt.subplots(1, len(baselines) + 1, figsize=(5.5 * (len(baselines) + 1), 4.5),
                             squeeze=False)
    colours = {impl: f"C{i}" for i, impl in enumerate(IMPLS)}
    labels = [f"{m}\nb{b}" for m, b in cases]
    for ax, baseline in zip(axes[0], baselines, strict=False):
        impls = [i for i in IMPLS if i != baseline and any(r.impl == i for r in ok)]
        width = 0.8 / max(len(impls), 1)
        for j, impl in enumerate(impls):
            found = {(r.model, r.batch): r.speedup.get(baseline) for r in ok if r.impl == impl}
            heights = [found.get(case) or np.nan for case in cases]
            bars = ax.bar(np.arange(len(cases)) + (j - (len(impls) - 1) / 2) * width, heights,
                          width, label=impl, color=colours[impl])
            ax.bar_label(bars, fmt="%.2g", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(np.arange(len(cases)), labels)
        ax.set_ylabel(f"speedup over {baseline} (log)")
        ax.set_title(f"vs {baseline} (higher is better)")
        if impls:
            ax.legend(fontsize="small")
    scatter = axes[0][-1]
    for impl in IMPLS:
        mine = [r for r in ok if r.impl == impl]
        if not mine:
            continue
        cost = [max((r.compile_seconds or 0) + (r.tune_seconds or 0), 1e-2) for r in mine]
        scatter.scatter(cost, [r.median_ms for r in mine], label=impl, color=colours[impl])
        for x, r in zip(cost, mine, strict=True):
            scatter.annotate(f"{r.model} b{r.batch}", (x, r.median_ms), fontsize=7,
                             textcoords="offset points", xytext=(3, 3))
    scatter.set_xscale("log")
    scatter.set_yscale("log")
    scatter.set_xlabel("compile + tune seconds (log)")
    scatter.set_ylabel("median latency ms (log)")
    scatter.set_title("build cost vs latency (lower left is better)")
    if ok:
        scatter.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_gemm(rows: Sequence[dict], path: str | os.PathLike) -> Path:
    """Grouped bars of GFLOPS per shape, one panel per thread count (PNG via matplotlib Agg)."""
    plt = _pyplot()
    threads = sorted({r["threads"] for r in rows})
    shapes = list(dict.fromkeys((r["m"], r["n"], r["k"]) for r in rows))
    impls = [i for i in GEMM_IMPLS if any(r["impl"] == i for r in rows)]
    fig, axes = plt.subplots(len(threads), 1, figsize=(max(6, 1.6 * len(shapes)),
                                                       3.2 * len(threads)), squeeze=False)
    width = 0.8 / max(1, len(impls))
    for ax, t in zip(axes[:, 0], threads, strict=True):
        for n, impl in enumerate(impls):
            values = {(r["m"], r["n"], r["k"]): r["gflops"] for r in rows
                      if r["threads"] == t and r["impl"] == impl}
            xs = [i + (n - (len(impls) - 1) / 2) * width for i in range(len(shapes))]
            ax.bar(xs, [values.get(s) or 0.0 for s in shapes], width, label=impl)
            for x, s in zip(xs, shapes, strict=True):
                if s in values and values[s] is None:  # skipped or failed: say so
                    ax.text(x, 0, "n/a", rotation=90, ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels([f"{m}x{n}x{k}" for m, n, k in shapes], rotation=20, fontsize=8)
        ax.set_ylabel("GFLOPS")
        ax.set_title(f"fp32 GEMM, {t} thread{'s' if t > 1 else ''}")
        ax.legend(fontsize=7, ncol=len(impls))
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
