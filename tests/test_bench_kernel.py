"""``tvm-tpp bench-kernel`` (tvm_tpp.bench.kernel): the timed block and the result."""

import pytest

from microkernels import amx, x86
from microkernels import isa as _isa
from microkernels import peak as _peak
from microkernels.brgemm import BrgemmShape
from tvm_tpp.bench import kernel
from tvm_tpp.bench.kernel import _default_shape, _own_kernel, bench_kernel, build_kernel
from tvm_tpp.bench.report import format_bench_kernel
from tvm_tpp.errors import UsageError


def test_default_block_is_l1_resident():
    """Whole register tiles, and A, B and C within L1d (else the benchmark times L2)."""
    for isa_name in ("avx2", "avx512"):
        m, n, k, batch = _default_shape(_isa.from_name(isa_name))
        tile = x86.register_tile(BrgemmShape(m=64, n=64, k=8, batch=1, isa=isa_name), x86.FP32)
        assert m % tile.rows == 0 and n % (tile.vectors * tile.lanes) == 0
        assert 4 * (m * k * batch + k * batch * n + m * n) <= _isa.caches().l1d
    assert _default_shape(_isa.from_name("avx2")) == (24, 32, 32, 4)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown dtype"):
        bench_kernel("float16")
    with pytest.raises(ValueError, match="not x86"):
        bench_kernel(isa="neon")
    with pytest.raises(ValueError, match="positive"):
        bench_kernel(rounds=0)


def test_format_names_units_and_ratios():
    result = {"isa": "avx2", "dtype": "int8", "shape": [6, 16, 8, 2], "layout": "vnni4",
              "impl": "avx2", "gflops": 50.0, "peak_gflops": 100.0, "fraction_of_peak": 0.5,
              "clock_ghz": 3.0, "fp32_gflops": 25.0, "ratio_to_fp32": 2.0, "w7_gflops": 75.0,
              "w7_ratio_to_fp32": 3.0}
    text = format_bench_kernel(result)
    assert "BRGEMM avx2 int8 6x16x8x2 (vnni4, avx2 kernel): 50.0 GOPS = 50.0%" in text
    assert "int8 / fp32 = 2.00x" in text and "vnni4_w7" in text and "3.00x fp32" in text


@pytest.mark.slow
def test_bench_kernel_result():
    if not _isa.from_name("avx2").runs_on(_isa.host_flags()):
        pytest.skip("needs an AVX2 host")
    r = bench_kernel("int8", isa="avx2", m=6, n=16, k=8, batch=2, rounds=1, runs=1)
    assert (r["isa"], r["dtype"], r["shape"], r["layout"], r["impl"]) == (
        "avx2", "int8", [6, 16, 8, 2], "vnni4", "avx2")
    assert r["fraction_of_peak"] == pytest.approx(r["gflops"] / r["peak_gflops"], rel=1e-2)
    assert r["ratio_to_fp32"] == pytest.approx(r["gflops"] / r["fp32_gflops"], rel=1e-2)
    assert r["w7_gflops"] > 0


def test_amx_default_block_is_tile_shaped():
    """2 x 2 C tiles, full 64-byte K steps: the block AMX runs at full rate."""
    spr = _isa.from_name("amx")
    for dtype, expected in (("uint8", (32, 32, 64, 8)), ("bfloat16", (32, 32, 32, 8))):
        m, n, k, batch = _default_shape(spr, dtype)
        assert (m, n, k, batch) == expected
        acc, layout = ("float32", "vnni2") if dtype == "bfloat16" else ("int32", "vnni4")
        p = amx.plan(BrgemmShape(m, n, k, batch, dtype, acc, layout, "amx"))
        assert p.num_c == 4 and p.kt * p.elem_bytes == amx.TILE_BYTES


def test_own_kernel_is_the_isa_s_or_inherited():
    assert _own_kernel(BrgemmShape(24, 64, 16, 4, isa="avx512_bf16")) == "avx512"
    assert _own_kernel(BrgemmShape(24, 64, 16, 4, "uint8", "int32", "vnni4",
                                   "avx512_bf16")) == "avx512_vnni"
    assert _own_kernel(BrgemmShape(32, 32, 64, 8, "uint8", "int32", "vnni4", "amx")) == "amx"


@pytest.mark.parametrize("dtype", ["float32", "int8_w7"])
def test_amx_without_tiles_for_the_dtype_is_refused(dtype):
    with pytest.raises(UsageError, match=f"AMX tiles multiply int8 and bfloat16; --isa amx "
                                         f"--dtype {dtype} would time the avx512"):
        bench_kernel(dtype, isa="amx")


def test_block_the_kernel_refuses_is_an_error_not_another_kernel():
    """64 x 64 needs 16 C tiles: find_impl would fall back to AVX-512 VNNI, so: an error."""
    with pytest.raises(UsageError, match=r"the amx int8 kernel refuses block 64x64x64x8 "
                                         r"\(AMX BRGEMM 64x64 needs 4x4 C tiles.*would time "
                                         r"the avx512_vnni kernel instead"):
        bench_kernel("int8", isa="amx", m=64, n=64)


@pytest.mark.parametrize("granted, flags, message", [
    (False, "amx", "Linux refused this process the AMX tile permission"),
    (True, "avx512_bf16", "this CPU lacks amx_bf16 amx_int8 amx_tile"),
])
def test_amx_refused_where_not_usable(fake_amx_host, granted, flags, message):
    fake_amx_host(granted, _isa.from_name(flags).requires)
    with pytest.raises(UsageError, match=f"cannot run amx kernels here: {message}"):
        bench_kernel("bfloat16", isa="amx")


class _FakeChains:
    """The FMA-peak microbenchmark's stand-in: 16 flops a cycle at 3 GHz, 192 GFLOPS."""

    def __init__(self, isa: str) -> None:
        self.isa = isa

    def best_seconds(self, repeat: int) -> float:
        return 1.0

    def peak(self, seconds: float) -> _peak.Peak:
        return _peak.Peak(self.isa, 16, 3.0)


def test_amx_result_reports_the_tile_kernel_and_its_peak(fake_amx_host, monkeypatch):
    """On a (faked) AMX host the tile kernel is what is timed and named; the timers are
    stand-ins here, as this host cannot execute tile instructions."""
    fake_amx_host(granted=True)
    timed: list[BrgemmShape] = []

    def fake_timer(shape):
        timed.append(shape)
        return lambda: 6144.0 if shape.dtype_a == "uint8" else 96.0

    monkeypatch.setattr(kernel, "kernel_timer", fake_timer)
    monkeypatch.setattr(_peak, "FmaChains", _FakeChains)
    r = bench_kernel("int8", isa="amx", rounds=1, runs=1)
    assert (r["isa"], r["impl"], r["shape"], r["layout"]) == ("amx", "amx", [32, 32, 64, 8],
                                                              "vnni4")
    assert [s.isa for s in timed] == ["amx", "amx"]  # the tile kernel, the fp32 reference
    assert r["dtype_peak_gops"] == 6144.0 and r["fraction_of_dtype_peak"] == 1.0
    assert r["ratio_to_fp32"] == 64.0
    text = format_bench_kernel(r)
    assert "(vnni4, amx kernel)" in text
    assert "100.0% of the 6144.0 GOPS int8 peak (AMX 2048 int8 ops per cycle x 3.00 GHz)" in text


@pytest.mark.parametrize("dtype, isa_name, factor", [("int8", "avx512_vnni", 4),
                                                     ("bfloat16", "avx512_bf16", 2),
                                                     ("int8", "avx512", None)])
def test_dot_product_kernels_are_measured_against_their_instruction_s_peak(
        fake_amx_host, monkeypatch, dtype, isa_name, factor):
    """vpdpbusd does 4 u8 x s8 products per 32-bit lane, vdpbf16ps 2 bf16 ones, at the FMA's
    rate: their kernels' share of that peak; a kernel emulating its dtype (AVX-512 int8
    without VNNI) has none."""
    fake_amx_host(granted=False, flags=_isa.from_name(isa_name).requires)

    monkeypatch.setattr(kernel, "kernel_timer",
                        lambda shape: lambda: 96.0 if shape.dtype_a == "float32" else 288.0)
    monkeypatch.setattr(_peak, "FmaChains", _FakeChains)
    r = bench_kernel(dtype, isa=isa_name, rounds=1, runs=1)
    assert r["impl"] == isa_name and r["peak_gflops"] == 192.0
    if factor is None:
        assert "dtype_peak_gops" not in r
        return
    assert r["dtype_peak_gops"] == 192.0 * factor
    assert r["fraction_of_dtype_peak"] == pytest.approx(288.0 / (192.0 * factor), abs=1e-4)
    assert f"GOPS {dtype} peak ({isa_name}: {factor} x the fp32 FMA peak)" in \
        format_bench_kernel(r)


@pytest.mark.parametrize("dtype, instruction", [("uint8", "tdpbusd"), ("bfloat16", "tdpbf16ps")])
def test_amx_default_block_times_the_tile_kernel(dtype, instruction):
    """What an AMX host would time: the tile program (asm for sapphirerapids, not run here)."""
    acc, layout = ("float32", "vnni2") if dtype == "bfloat16" else ("int32", "vnni4")
    m, n, k, batch = _default_shape(_isa.from_name("amx"), dtype)
    ex, reps = build_kernel(BrgemmShape(m, n, k, batch, dtype, acc, layout, "amx"))
    ops = [line.split()[0] for line in ex.mod.inspect_source("asm").splitlines()
           if line.startswith("\t") and line.split()]
    assert reps > 1 and instruction in ops and "ldtilecfg" in ops and "tilerelease" in ops
