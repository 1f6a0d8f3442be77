"""Tuning and benchmarking on RPC servers (issue #18): a loopback TVM tracker with two servers,
started and stopped here (:class:`tvm_tpp.bench.fleet.Fleet`), every wait bounded; and an
aarch64 server, TVM's own under qemu-aarch64 (``tests/aarch64/python_sysroot.sh`` makes its
Python; without it that test skips and says so).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from microkernels import isa as _isa
from schedules import remote
from schedules.database import Database
from schedules.gemm import GemmProblem
from schedules.search import tune
from tvm_tpp import compiler, models
from tvm_tpp.bench.fleet import Fleet, Server, free_port
from tvm_tpp.cli import main
from tvm_tpp.errors import RemoteError

KEY = "tpp-test"


def _fleet(path: Path) -> Fleet:
    """Two one-thread servers, the second pinned to this host's last core."""
    last = max(os.sched_getaffinity(0))
    return Fleet(path, [Server(KEY, threads=1), Server(KEY, cores=(last,), threads=1)],
                 start_seconds=90)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:  # the fleet's own setting, not conftest's
        env.delenv("TVM_BIND_THREADS", raising=False)
        running = _fleet(tmp_path_factory.mktemp("fleet")).__enter__()
    try:
        yield running
    finally:
        running.__exit__(None, None, None)


def _timed_on(fleet: Fleet) -> list[int]:
    """Per server, the libraries it loaded (its log's ``load_module`` lines)."""
    return [(fleet.log_dir / f"server{i}.log").read_text().count("load_module")
            for i in range(len(fleet.specs))]


# -- without servers --------------------------------------------------------------------------

def test_tracker_address_is_checked():
    assert remote.Tracker.parse("[::1]:9190", "a").host == "[::1]"
    for address, key in (("host", "k"), ("host:x", "k"), ("host:0", "k"), ("host:1", "")):
        with pytest.raises(ValueError):
            remote.Tracker.parse(address, key)


def test_servers_cpu_is_read_from_llvm_as_this_host_reads_its_own():
    # The very queries a server answers, asked here: they must give what detection gives.
    import tvm_ffi

    def ask(name, *args):
        return tvm_ffi.get_global_func(name)(*args)

    features = remote._json_graph_map(str(ask("ffi.ToJSONGraphString",
                                              ask("tvm.codegen.llvm.GetHostCPUFeatures"),
                                              None)))
    cpu = remote.cpu_of_features(str(ask("tvm.codegen.llvm.GetProcessTriple")),
                                 str(ask("tvm.codegen.llvm.GetHostCPUName")), features, 1)
    host = _isa.detect()
    assert cpu.isa().name == ("avx512_bf16" if host.has("amx_tile") else host.name)


def test_amx_and_foreign_isas_are_never_run_remotely():
    cpu = remote.RemoteCpu("x86_64", "sapphirerapids", _isa.from_name("amx").requires, 8)
    assert cpu.isa().name == "avx512_bf16"  # the server never asks for the tile state
    assert not cpu.runs(_isa.from_name("amx")) and not cpu.runs(_isa.from_name("neon"))


def test_unreachable_tracker_is_one_line(capsys):
    port = free_port()  # nothing listens there
    assert main(["tune", "mlp", "--rpc", f"127.0.0.1:{port}", "--key", KEY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"tvm-tpp: error: cannot reach the RPC tracker at 127.0.0.1:{port}")


def test_rpc_options_go_together(capsys):
    assert main(["tune", "mlp", "--key", KEY]) == 2
    assert main(["tune", "mlp", "--rpc", "127.0.0.1:1"]) == 2
    assert [line.split(":")[2].strip() for line in capsys.readouterr().err.splitlines()] == [
        "--key and --isa are for measuring on RPC servers", "--rpc needs --key KEY"]


# -- on the loopback fleet --------------------------------------------------------------------

@pytest.mark.slow  # the loopback fleet: 13 s to start, for the slow suite
def test_cli_tunes_over_both_servers(fleet, tmp_path, capsys):
    assert main(["tune", "mlp", "--rpc", fleet.address, "--key", KEY, "--work-dir",
                 str(tmp_path), "--budget", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    spec = out.split('--target "')[1].split('"')[0]
    assert spec.startswith("tpp -isa=") and spec.endswith("-num-cores=1")
    keys = Database(tmp_path / "tuning.db").keys()
    assert len(keys) == 3 and all(k.endswith("/1t") for k in keys)  # the servers' target
    assert all(n > 0 for n in _timed_on(fleet)), "both servers time candidates"
    # The results are the servers' target's: a build for it finds them.
    built = compiler.compile(models.load("mlp"), spec, work_dir=tmp_path)
    assert all("[" in o.kernel for o in built.report if o.kernel)


@pytest.mark.slow  # the loopback fleet: 13 s to start, for the slow suite
def test_sessions_keep_their_servers_cores(fleet):
    """A one-thread TVM pool moves its main thread to core 0 when it starts, unless told not
    to: the fleet's servers, pinned or not, would all time on core 0."""
    import psutil
    from tvm import rpc

    host, port = fleet.address.split(":")
    tracker = rpc.connect_tracker(host, int(port))
    sessions = [tracker.request(KEY, session_timeout=60) for _ in fleet.servers]
    assert all(s.get_function("runtime.NumThreads")() == 1 for s in sessions)  # pools started
    cores = [os.sched_getaffinity(0), {max(os.sched_getaffinity(0))}]
    for server, want in zip(fleet.servers, cores, strict=True):
        forked = psutil.Process(server.pid).children(recursive=True)
        assert forked and all(set(p.cpu_affinity()) == want for p in forked)
    del sessions


@pytest.mark.slow  # the loopback fleet: 13 s to start, for the slow suite
def test_unknown_key_and_missing_isa_are_one_line(fleet, capsys):
    assert main(["tune", "mlp", "--rpc", fleet.address, "--key", "nobody"]) == 2
    assert main(["tune", "mlp", "--rpc", fleet.address, "--key", KEY, "--isa", "neon"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert "no RPC server is registered under key 'nobody'" in err[0]
    assert "cannot run neon code" in err[1]


@pytest.mark.slow  # the loopback fleet: 13 s to start, for the slow suite
def test_measurer_sends_only_the_servers_isa(fleet, tmp_path):
    with compiler.remote_pool("tpp", fleet.address, KEY) as (pool, target):
        measurer = remote.RemoteMeasurer(pool, tmp_path)
        other = "neon" if pool.isa.name != "neon" else "avx2"
        with pytest.raises(remote.RemoteError, match=f"candidates for {other} cannot go"):
            measurer(GemmProblem(16, 32, 64), [], target, other)
        assert not list(tmp_path.iterdir())  # nothing was even built


@pytest.mark.slow  # 9 s: it waits out the hung server's timeout
def test_hung_server_costs_only_its_batch(fleet, tmp_path, caplog):
    problems = [GemmProblem(16, 32 * (i + 1), 64) for i in range(4)]
    try:
        with compiler.remote_pool("tpp", fleet.address, KEY, timeout=3) as (pool, target):
            for _ in range(100):  # both sessions open before one server stops answering
                if pool._opened == 2:
                    break
                threading.Event().wait(0.1)
            fleet.kill(0, signal.SIGSTOP)
            measurer = remote.RemoteMeasurer(pool, tmp_path)
            with caplog.at_level(logging.WARNING, "schedules.remote"):
                results = _tune_all(problems, target, measurer)
    finally:
        fleet.kill(0, signal.SIGCONT)
    assert all(r.measurements[0].seconds for r in results)
    assert "go to another server" in caplog.text


def _tune_all(problems, target, measurer):
    out: dict[int, object] = {}

    def run(i):
        out[i] = tune(problems[i], target, top_k=2, measurer=measurer)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(problems))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(out) == len(problems), "every task finished"
    return [out[i] for i in range(len(problems))]


@pytest.mark.slow  # the loopback fleet: 13 s to start, for the slow suite
def test_exclusive_servers_time_one_at_a_time(fleet, tmp_path, monkeypatch):
    """Servers that share a machine (``exclusive``) take turns: no two timing calls overlap,
    while the operators are still tuned concurrently and on both servers."""
    calls: list[tuple[float, float, int]] = []
    real = remote.Session.time

    def recorded(session, *args):
        start = time.perf_counter()
        try:
            time.sleep(0.3)  # a longer timing run: without turns, the servers' would overlap
            return real(session, *args)
        finally:
            calls.append((start, time.perf_counter(), id(session)))

    monkeypatch.setattr(remote.Session, "time", recorded)
    before = _timed_on(fleet)
    with compiler.remote_pool("tpp", fleet.address, KEY, exclusive=True) as (pool, target):
        problems = [GemmProblem(16, 32, 64), GemmProblem(24, 48, 32), GemmProblem(8, 64, 48)]
        _tune_all(problems, target, remote.RemoteMeasurer(pool, tmp_path))
    calls.sort()
    assert len(calls) >= 6 and len({c[2] for c in calls}) == 2, "both servers timed"
    assert all(end <= start for (_, end, _), (start, _, _) in itertools.pairwise(calls))
    assert all(a < b for a, b in zip(before, _timed_on(fleet), strict=True))


@pytest.mark.slow  # 17 s: a fleet of its own, a tuning run before and after the kill
def test_killed_server_run_completes_with_every_result(tmp_path, capsys):
    with _fleet(tmp_path / "fleet") as own:
        killed = []

        def on_tuned(problem, result):
            if not killed:  # mid-run: the other operators are being measured
                own.kill(0)
                killed.append(problem)
            stored = Database(tmp_path / "tuning.db").keys()
            assert len(stored) >= len(done) + 1  # each result is stored when it is done
            done.append(problem)

        done: list = []
        tuned = compiler.tune(models.load("mlp"), work_dir=tmp_path, rpc=own.address, key=KEY,
                              top_k=3, on_tuned=on_tuned, rpc_timeout=20)
        assert killed and len(tuned) == 3 == len(done)
        assert len(Database(tmp_path / "tuning.db").keys()) == 3
        # With the last server gone too, a run stops with one line.
        own.kill(1)
        capsys.readouterr()  # the warning lines of the first run (when the CLI shows them)
        assert main(["tune", "resnet_small", "--rpc", own.address, "--key", KEY,
                     "--work-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tvm-tpp: error: ")


def test_code_for_an_arm_server_is_cross_linked(tmp_path):
    from qemu_aarch64 import CC

    from schedules.gemm import GemmConfig
    from schedules.measure import export
    from tvm_tpp.tpp_target import target as make_target

    if shutil.which(CC) is None:
        pytest.skip(f"{CC} not installed")
    arm = make_target("tpp -isa=neon -num-cores=1")
    problem = GemmProblem(16, 64, 64)
    (artifact,) = export(problem, [GemmConfig.of("BCa", 16, 64, 64)], arm, "neon", tmp_path)
    library = compiler.compile(models.load("mlp"), arm).export(tmp_path / "mlp.so")
    for path in (artifact.library, library):  # ELF machine 183: AArch64
        assert int.from_bytes(path.read_bytes()[18:20], "little") == 183


@pytest.mark.slow  # about 40 s: TVM's import alone takes 20 s under qemu
def test_arm_server_under_qemu(tmp_path):
    """An aarch64 server: it cannot say its features under qemu (LLVM reads the host's
    /proc/cpuinfo there), so the ISA is given; candidates are cross-linked and timed there."""
    from qemu_aarch64 import PYTHON, python_missing

    if (why := python_missing()) is not None:
        pytest.skip(why)
    arm = Server("arm", threads=1, python=(str(PYTHON),))
    with Fleet(tmp_path / "fleet", [arm], start_seconds=240) as own:
        with pytest.raises(RemoteError, match="cannot say which CPU features"):
            with compiler.remote_pool("tpp", own.address, "arm"):
                pass
        with pytest.raises(RemoteError, match="cannot run avx2 code"):
            with compiler.remote_pool("tpp", own.address, "arm", "avx2"):
                pass
        with compiler.remote_pool("tpp", own.address, "arm", "neon_i8mm", timeout=300
                                  ) as (pool, target):
            assert (pool.cpu.arch, target.attrs["mtriple"]) == ("aarch64", "aarch64-linux-gnu")
            result = tune(GemmProblem(16, 64, 64), target, top_k=2,
                          measurer=remote.RemoteMeasurer(pool, tmp_path / "candidates"))
    assert all(m.seconds for m in result.measurements)
    assert "load_module" in (own.log_dir / "server0.log").read_text()


def test_json_graph_map_reads_tvm_output():
    text = json.dumps({"root_index": 4, "nodes": [
        {"type": "ffi.String", "data": "avx2"}, {"type": "int", "data": 1},
        {"type": "ir.IntImm", "data": {"span": 5, "ty": 5, "value": 1}},
        {"type": "ffi.String", "data": "avx512f"},
        {"type": "ffi.Map", "data": [0, 2, 3, 6]}, {"type": "None"},
        {"type": "int", "data": 0}]})
    assert remote._json_graph_map(text) == {"avx2": True, "avx512f": False}


@pytest.mark.slow
def test_bench_times_models_on_a_server(fleet, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "mlp", "--rpc", fleet.address, "--key", KEY, "--impls",
                 "tpp,tvm-default", "--repeat", "3", "--work-dir", str(tmp_path),
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["impl"] for r in rows] == ["tpp", "tvm-default"]
    assert all(len(r["seconds"]) == 3 and r["median_ms"] > 0 for r in rows)
    assert rows[0]["target"].endswith("-num-cores=1")


def test_bench_rpc_takes_only_what_builds_for_the_servers(capsys):
    assert main(["bench", "mlp", "--rpc", "127.0.0.1:1", "--key", KEY, "--impls",
                 "tpp,onnxruntime"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "on RPC servers bench runs tpp" in err[0]


@pytest.mark.slow
def test_metaschedule_baseline_measures_on_the_same_tracker(fleet, tmp_path):
    # In a process of its own: a second MetaSchedule search in one pytest process trips over
    # pytest's log capture (see tests/test_ms_space.py).
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "tvm_tpp.cli", "bench", "mlp", "--rpc",
                           fleet.address, "--key", KEY, "--impls", "metaschedule",
                           "--ms-trials", "8", "--repeat", "2", "--work-dir", str(tmp_path),
                           "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert rows[0]["impl"] == "metaschedule" and rows[0]["median_ms"] > 0
    assert list((tmp_path / "metaschedule").glob("*/logs/*.log")), "MetaSchedule searched"
