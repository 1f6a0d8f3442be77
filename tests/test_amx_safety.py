"""AMX is safe to run: the tile permission is asked once, and where it is refused (or the CPU
has no tiles) no AMX ISA is picked, dispatched or run, and the host description says so.

This Zen 4 has no AMX, so the AMX host is faked (``fake_amx_host`` in conftest.py): its CPU
flags (``isa.host_flags``) and Linux's answer (``amx.request_permission``) are monkeypatched,
and the per-process caches (``tiles_usable``, the CPU flags) are cleared around each test.
"""

import numpy as np
import pytest
from conftest import needs_isa

import tvm_tpp
from microkernels import amx, isa, machine
from tvm_tpp import cli
from tvm_tpp.errors import NotRunnableError
from tvm_tpp.tpp_target import runs_on_host

REFUSED = "amx (tile permission refused: AMX kernels disabled)"


def test_refused_permission_disables_amx(fake_amx_host):
    asked = fake_amx_host(granted=False)
    assert machine.host_isa().name == "avx512_bf16"
    assert machine.host().isa.name == "avx512_bf16"
    assert machine.amx_refused()
    assert not machine.runs_here(isa.from_name("amx"))
    assert machine.runs_here(isa.from_name("avx512_bf16"))
    assert REFUSED in machine.host_isa_text()
    assert tvm_tpp.target("tpp").attrs["model"] == "avx512_bf16"
    assert not runs_on_host(tvm_tpp.target("tpp -isa=amx"))
    assert runs_on_host(tvm_tpp.target("tpp -isa=avx512_bf16"))
    assert asked == [False], "the permission is asked once per process"


def test_granted_permission_enables_amx(fake_amx_host):
    asked = fake_amx_host(granted=True)
    assert machine.host_isa().name == "amx"
    assert not machine.amx_refused()
    assert machine.runs_here(isa.from_name("amx"))
    assert "refused" not in machine.host_isa_text()
    assert tvm_tpp.target("tpp").attrs["model"] == "amx"
    assert runs_on_host(tvm_tpp.target("tpp -isa=amx"))
    assert asked == [True]


def test_no_tiles_asks_nothing(fake_amx_host):
    asked = fake_amx_host(granted=True, flags=isa.from_name("avx512_bf16").requires)
    assert not amx.tiles_usable() and not machine.amx_refused()
    assert machine.host_isa().name == "avx512_bf16"
    assert "refused" not in machine.host_isa_text()
    assert asked == []


def test_info_says_amx_is_disabled(fake_amx_host, capsys):
    fake_amx_host(granted=False)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "host ISA     : avx512_bf16 (" in out and REFUSED in out
    amx_rows = [line for line in out.splitlines() if line.strip().startswith("amx ")]
    assert amx_rows and all(line.endswith("[disabled]") for line in amx_rows)


@needs_isa("avx512_bf16")  # it runs the model on the faked host's fallback ISA
def test_run_says_amx_is_disabled(fake_amx_host, dense_file, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./tvm_tpp_work database
    fake_amx_host(granted=False)
    assert cli.main(["run", str(dense_file), "--repeat", "1"]) == 0
    assert f"for avx512_bf16; {REFUSED}" in capsys.readouterr().out


def test_amx_build_does_not_run_when_refused(fake_amx_host, dense_model, tmp_path):
    """Compiled and loaded AMX builds ask before running, and refuse (no SIGILL)."""
    compiled = tvm_tpp.compile(dense_model, target="tpp -isa=amx")
    asked = fake_amx_host(granted=False)
    x = np.zeros(compiled.inputs[0].shape, "float32")
    with pytest.raises(NotRunnableError, match="cannot run on this CPU"):
        compiled.run(x=x)
    compiled.export(tmp_path / "dense.so")
    with pytest.raises(NotRunnableError):
        tvm_tpp.load(tmp_path / "dense.so").time({"x": x})
    assert asked == [False]


def test_bench_worker_asks_before_any_job(monkeypatch):
    """The worker's first act (after parking stdout) is the tile request; its job comes after."""
    from tvm_tpp.bench import protocol

    order: list[str] = []
    monkeypatch.setattr(protocol, "tiles_usable", lambda: order.append("tiles") or False)

    class Stop(Exception):
        pass

    def job_from_json(text: str):
        order.append("job")
        raise Stop

    monkeypatch.setattr(protocol.Job, "from_json", staticmethod(job_from_json))
    monkeypatch.setattr(protocol.os, "dup2", lambda *fds: None)  # keep pytest's stdout
    with pytest.raises(Stop):
        protocol.main(["{}"])
    assert order == ["tiles", "job"]


def _spr():
    return machine.Machine(isa.from_name("amx"), isa.Caches(48 << 10, 2 << 20, 105 << 20),
                           threads=1, mcpu="sapphirerapids", fp32_flops_per_cycle=64.0)


@pytest.mark.parametrize("dtype, pack_a, expected", [
    ("uint8", None, ("amx", "uint8*int8->int32", "vnni4")),
    ("bfloat16", None, ("amx", "bfloat16*bfloat16->float32", "vnni2")),
    # A bf16 A the template copies is read by the tiles too (through uint16 views).
    ("bfloat16", 0, ("amx", "bfloat16*bfloat16->float32", "vnni2")),
    ("float32", None, ("avx512", "float32*float32->float32", "flat")),  # no fp32 tiles
])
def test_report_names_the_brgemm_the_template_dispatched(dtype, pack_a, expected):
    """The report reads the kernel from the schedule (its tensorize), so 'amx' appears
    exactly where the tile kernel runs (cross-compiled for Sapphire Rapids: nothing runs)."""
    from dataclasses import replace

    from relay_passes.scaffold import Offload, dispatched_brgemm
    from schedules.gemm import GemmProblem, default_config, schedule

    problem = GemmProblem(64, 64, 256, dtype=dtype)
    config = default_config(problem, _spr())
    if pack_a is not None:
        config = replace(config, pack_a=pack_a)
    sch = schedule(problem, config, "amx")
    o = Offload.routed("matmul", (64, 64, 256), "tpp_dense", dispatched_brgemm(sch))
    assert (o.isa, o.dtypes, o.layout) == expected
