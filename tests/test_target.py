"""The tpp target: host detection, foreign ISAs, options, tags and errors."""

import pytest
import tvm

import tvm_tpp
from microkernels import isa
from microkernels.machine import host_isa, is_tpp, machine_of
from tvm_tpp.errors import TargetError
from tvm_tpp.tpp_target import runs_on_host


def test_host_target():
    t = tvm_tpp.target("tpp")
    assert t.kind.name == "llvm"
    assert tuple(t.keys)[:2] == ("tpp", "cpu")
    assert machine_of(t).isa == host_isa()  # the CPU's, minus AMX if its tiles are refused
    assert machine_of(t).threads == isa.num_cores()
    assert int(t.attrs["num-cores"]) == isa.num_cores()
    assert str(t.attrs["mcpu"]) not in ("", "generic")
    assert runs_on_host(t)


@pytest.mark.parametrize(
    "name, mcpu, triple",
    [("amx", "sapphirerapids", "x86_64"), ("avx512_vnni", "cascadelake", "x86_64"),
     ("avx512_bf16", "znver4", "x86_64"), ("neon_i8mm", "generic", "aarch64")],
)
def test_foreign_isa_targets(name, mcpu, triple):
    t = tvm_tpp.target(f"tpp -isa={name}")
    assert is_tpp(t) and machine_of(t).isa.name == name
    assert str(t.attrs["mcpu"]) == mcpu
    assert str(t.attrs["mtriple"]).startswith(triple)
    assert list(t.attrs["mattr"]) == list(isa.from_name(name).mattr)


def test_aarch64_target_never_runs_here():
    assert not runs_on_host(tvm_tpp.target("tpp -isa=neon"))


def test_options():
    t = tvm_tpp.target("tpp -isa=avx2 -num-cores=1 -mcpu=znver3")
    assert int(t.attrs["num-cores"]) == 1 and str(t.attrs["mcpu"]) == "znver3"
    assert int(tvm_tpp.target("tpp", num_cores=3).attrs["num-cores"]) == 3


def test_registered_tags():
    t = tvm_tpp.target("tpp/avx512_vnni")
    assert is_tpp(t) and machine_of(t).isa.name == "avx512_vnni"
    assert is_tpp(tvm.target.Target("tpp/amx"))


def test_passthrough_of_plain_targets():
    plain = tvm_tpp.target({"kind": "llvm", "mcpu": "haswell"})
    assert not is_tpp(plain)
    assert tvm_tpp.target(plain) is plain
    with pytest.raises(ValueError, match="not a tpp target"):
        machine_of(plain)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("tpp -isa=avx9000", "unknown ISA 'avx9000'; known ISAs: avx2"),
        ("tpp -foo=1", "unknown option -foo"),
        ("tpp isa=amx", "malformed option"),
        ("tpp -isa=", "malformed option"),
        ("tpp -num-cores=two", "must be an integer"),
        ("tpp -num-cores=0", ">= 1"),
        ("llvm -mcpu=znver3", "starts with 'tpp'"),
        ("", "starts with 'tpp'"),
        ("tpp/avx9000", "unknown ISA"),
    ],
)
def test_bad_specs(spec, message):
    """A TargetError, which the command line prints as one line, and a ValueError."""
    with pytest.raises(TargetError, match=message) as error:
        tvm_tpp.target(spec)
    assert isinstance(error.value, ValueError)
