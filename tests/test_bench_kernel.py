"""``tvm-tpp bench-kernel`` (tvm_tpp.bench.kernel): the timed block and the result."""

import pytest

from microkernels import isa as _isa
from microkernels import x86
from microkernels.brgemm import BrgemmShape
from tvm_tpp.bench.kernel import _default_shape, bench_kernel
from tvm_tpp.bench.report import format_bench_kernel


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
