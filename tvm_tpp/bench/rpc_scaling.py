"""Does tuning over more RPC servers take less wall time, for the same choices?

``python -m tvm_tpp.bench.rpc_scaling MODEL`` starts a loopback tracker (:mod:`.fleet`) with
one server under the key ``solo`` and two under ``pair``, each server pinned to one core
(``taskset``, ``TVM_NUM_THREADS=1``), then tunes MODEL's operators twice in this one
invocation, into two fresh databases with the same settings (``--top-k`` candidates per
operator, no time budget, so both runs consider the same candidates): first on ``solo``, then
on ``pair``.  It prints each run's wall time and which operators' kept configurations differ,
and writes both as JSON.  The candidates are built on this host in either case (one
operator at a time on ``solo``, two on ``pair``), at the lowest CPU priority (``nice 19``),
so that builds do not pre-empt the servers' timing runs on the cores they share, and the
two servers take turns to time (``rpc_exclusive``): timing at once, each would measure the
other's traffic in the shared L3 and memory, which servers on machines of their own never
see.  What runs in parallel is the building, uploading and timing of different operators.

Examples
--------
$ python -m tvm_tpp.bench.rpc_scaling resnet50 --control --json rpc_scaling.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from microkernels import isa as _isa

from .fleet import Fleet, Server

__all__ = ["main", "run"]


def _tune(model, address: str, key: str, work_dir: Path, top_k: int
          ) -> tuple[float, dict[str, str], dict[str, dict[str, float]], dict[str, float]]:
    """Wall seconds of tuning ``model`` on the servers under ``key``, the kept configs by
    operator, every measured config's seconds by operator, and each operator's tie margin
    (the final round's measured noise, see :func:`schedules.search.tune`)."""
    from schedules.tuner import config_text, problem_text

    from .. import compiler

    start = time.perf_counter()
    tuned = compiler.tune(model, "tpp", work_dir=work_dir, rpc=address, key=key, top_k=top_k,
                          rpc_exclusive=True)  # the servers share this host
    wall = time.perf_counter() - start
    kept = {problem_text(t.problem): config_text(t.result.best) for t in tuned}
    seconds = {problem_text(t.problem): {config_text(m.config): m.seconds
                                         for m in t.result.measurements if m.seconds}
               for t in tuned}
    margins = {problem_text(t.problem): t.result.tie_margin for t in tuned}
    return wall, kept, seconds, margins


def run(name: str, top_k: int, log_dir: Path, control: bool = False) -> dict:
    """Both runs of bundled model ``name`` (with ``control``, a third: one server again,
    whose choices against the first run's show what timing noise alone changes); the
    figures as a JSON-ready dict."""
    from .. import models

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("this comparison needs two cores to pin two servers to")
    servers = [Server("solo", (cores[0],), 1), Server("pair", (cores[0],), 1),
               Server("pair", (cores[1],), 1)]
    model = models.load(name)
    with Fleet(log_dir, servers) as fleet, tempfile.TemporaryDirectory() as work:
        # The servers share this host's cores with the builds: building at the lowest
        # priority keeps LLVM from pre-empting a server's timing runs (on a fleet the
        # servers have machines of their own).
        os.nice(19)
        one_wall, one, one_s, one_m = _tune(model, fleet.address, "solo", Path(work) / "solo",
                                            top_k)
        print(f"one server : {one_wall:7.1f} s, {len(one)} operators", flush=True)
        two_wall, two, two_s, two_m = _tune(model, fleet.address, "pair", Path(work) / "pair",
                                            top_k)
        print(f"two servers: {two_wall:7.1f} s", flush=True)
        again = _tune(model, fleet.address, "solo", Path(work) / "again", top_k)[1] \
            if control else None
    differ = sorted(k for k in one if one[k] != two.get(k))
    noise = ({"one_server_again_same_configs": sum(again.get(k) == v for k, v in one.items())}
             if again is not None else {})

    def gap(seconds: dict[str, float], key: str) -> float | None:
        """How much slower one run measured the other run's choice than its own (%)."""
        a, b = seconds.get(one[key]), seconds.get(two.get(key, ""))
        return None if a is None or b is None else 100 * (max(a, b) / min(a, b) - 1)
    return {"model": name, "top_k": top_k, "operators": len(one),
            "one_server_seconds": one_wall, "two_servers_seconds": two_wall,
            "speedup": one_wall / two_wall, "same_configs": len(one) - len(differ),
            "differing": {k: {"one_server": one[k], "two_servers": two.get(k),
                              "gap_percent_in_one_server_run": gap(one_s[k], k),
                              "gap_percent_in_two_servers_run": gap(two_s[k], k),
                              "tie_margin_percent": [100 * one_m[k], 100 * two_m[k]]}
                          for k in differ},
            "median_tie_margin_percent": [100 * statistics.median(m.values())
                                          for m in (one_m, two_m)],
            "cpu_flags": sorted(f for f in _isa.host_flags()
                                if f.startswith(("avx", "fma", "amx"))),
            "cores": cores[:2], **noise}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tvm_tpp.bench.rpc_scaling",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="resnet50", help="bundled model")
    parser.add_argument("--top-k", type=int, default=8, help="candidates per operator "
                        "besides its default (default 8, as tvm-tpp tune)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--control", action="store_true", help="tune a third time on the one "
                        "server and count how many choices timing noise alone changes")
    parser.add_argument("--logs", default=None, help="tracker and server logs (default: a "
                        "temporary directory)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as logs:
        result = run(args.model, args.top_k, Path(args.logs or logs), args.control)
    print(f"speedup {result['speedup']:.2f}x; {result['same_configs']} of "
          f"{result['operators']} operators kept the same configuration")
    if args.control:
        print(f"control: one server tuned again kept "
              f"{result['one_server_again_same_configs']} of {result['operators']} of its "
              "first run's configurations")
    print("median tie margin (measured noise): "
          + ", ".join(f"{m:.1f} %" for m in result["median_tie_margin_percent"]))
    for key, d in result["differing"].items():
        gaps = [d["gap_percent_in_one_server_run"], d["gap_percent_in_two_servers_run"]]
        print(f"  {key}: one server {d['one_server']}, two servers {d['two_servers']} "
              "(apart by " + " and ".join("?" if g is None else f"{g:.1f} %" for g in gaps)
              + " in the two runs' own measurements; tie margins "
              + " and ".join(f"{m:.1f} %" for m in d["tie_margin_percent"]) + ")")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
