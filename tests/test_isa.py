"""ISA detection from faked cpuinfo, lineage, cache sizes from a faked sysfs."""

import pytest

from microkernels import isa

ZEN3 = "processor : 0\nflags : fpu sse sse2 avx avx2 fma bmi2\n"
CASCADELAKE = "flags : avx avx2 fma avx512f avx512bw avx512vl avx512dq avx512_vnni\n"
SAPPHIRE = CASCADELAKE.rstrip() + " avx512_bf16 amx_tile amx_int8 amx_bf16\n"
ZEN4 = CASCADELAKE.rstrip() + " avx512_bf16\n"
ALDERLAKE = "flags : avx avx2 fma avx_vnni\n"
GRAVITON3 = "Features : fp asimd evtstrm aes pmull sha1 sha2 crc32 i8mm bf16 sve\n"
CORTEX_A72 = "Features : fp asimd evtstrm crc32\n"


@pytest.mark.parametrize(
    "cpuinfo, expected",
    [
        (ZEN3, "avx2"),
        (CASCADELAKE, "avx512_vnni"),
        (ZEN4, "avx512_bf16"),
        (SAPPHIRE, "amx"),
        (ALDERLAKE, "avx_vnni"),
        (GRAVITON3, "neon_i8mm"),
        (CORTEX_A72, "neon"),
    ],
)
def test_detect_from_cpuinfo(cpuinfo, expected):
    assert isa.detect(cpuinfo=cpuinfo).name == expected


def test_detect_rejects_cpu_without_avx2():
    with pytest.raises(RuntimeError, match="none of the ISAs"):
        isa.detect(cpuinfo="flags : fpu sse sse2 sse4_2\n")


def test_detect_host_picks_the_richest_it_runs():
    # No ISA that extends the detected one (has it in its lineage) also runs here.
    host, flags = isa.detect(), isa.host_flags()
    richer = [i.name for i in isa.KNOWN.values()
              if i != host and host.name in i.lineage() and i.runs_on(flags)]
    assert not richer, f"detected {host.name} although {richer} also run on this host"


def test_register_files_and_lanes():
    avx2, avx512, neon = isa.from_name("avx2"), isa.from_name("avx512"), isa.from_name("neon")
    assert (avx2.vector_bits, avx2.vector_registers) == (256, 16)
    assert (avx512.vector_bits, avx512.vector_registers) == (512, 32)
    assert (neon.vector_bits, neon.vector_registers) == (128, 32)
    assert avx2.lanes("float32") == 8 and avx512.lanes("uint8") == 64
    assert neon.lanes("bfloat16") == 8
    with pytest.raises(ValueError, match="dtype"):
        avx2.lanes("complex64")


def test_lineage_falls_back_to_poorer_isas():
    assert isa.from_name("amx").lineage() == (
        "amx", "avx512_bf16", "avx512_vnni", "avx512", "avx2")
    assert isa.from_name("neon_i8mm").lineage() == ("neon_i8mm", "neon")
    for chosen in isa.KNOWN.values():  # every ancestor's requirements are implied
        for name in chosen.lineage():
            assert isa.from_name(name).requires <= chosen.requires


def test_unknown_isa_lists_known_ones():
    with pytest.raises(ValueError, match="known ISAs: avx2, .*amx"):
        isa.from_name("avx1024")


def test_invalid_isa_definition_rejected():
    with pytest.raises(ValueError, match="architecture"):
        isa.Isa("x", "riscv", frozenset(), 128, 32, "riscv64", "generic")


def _fake_sysfs(tmp_path, entries):
    for index, (level, kind, size) in enumerate(entries):
        d = tmp_path / f"index{index}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    return tmp_path


def test_caches_from_sysfs(tmp_path):
    root = _fake_sysfs(tmp_path, [(1, "Data", "48K"), (1, "Instruction", "32K"),
                                  (2, "Unified", "2048K"), (3, "Unified", "105M")])
    c = isa.caches(root)
    assert c.levels() == (48 * 1024, 2 * 1024 * 1024, 105 * 1024 * 1024)
    assert c.source == "sysfs"


def test_caches_default_without_sysfs(tmp_path):
    assert isa.caches(tmp_path / "missing") == isa.DEFAULT_CACHES


def test_caches_host_plausible():
    c = isa.caches()
    assert 8 * 1024 <= c.l1d <= c.l2 <= c.l3


def test_num_cores_positive():
    assert isa.num_cores() >= 1


def test_reexported_as_tvm_tpp_isa():
    import tvm_tpp

    assert tvm_tpp.isa.detect is isa.detect
