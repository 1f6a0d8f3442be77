"""This core's fp32 FMA peak, from a clock measured with an FMA-chain microbenchmark.

``peak = FMA units (2) x fp32 lanes (8 AVX2 / 16 AVX-512) x 2 flops x clock``.  The clock is not
the nominal one (``/proc/cpuinfo`` shows the base clock; cores turbo above it, and drop below
it under heavy AVX2/AVX-512 load): it is the rate at which the core retires independent vector
FMAs, divided by the number of FMA units.  The microbenchmark is a TVM kernel that keeps
``chains`` independent accumulators in registers, enough to cover FMA latency x units, so the
FMA ports are the only bottleneck.

Independent chains, not one dependent chain: a latency-bound chain issues an FMA every 4
cycles, which keeps the core at its light-load turbo (about 3.1 GHz on the Cascade Lake
development VM) while a saturated FMA pipe runs at the AVX2 (2.70 GHz) or AVX-512 (2.40 GHz)
license clock; only the latter is reachable by a GEMM.  On cores with a single 512-bit FMA
unit (some Xeon Silver/Gold 5xxx) the measured rate halves: the peak stays right, the
``clock_ghz`` shown is then half the real clock.

Examples
--------
>>> p = measure_peak("avx2")  # doctest: +SKIP
>>> round(p.peak_gflops, 1), round(p.clock_ghz, 2)  # doctest: +SKIP
(86.3, 2.7)
>>> flops_per_cycle("avx512")  # Zen 4: 512-bit FMAs run in two halves  # doctest: +SKIP
32.0
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import isa as _isa
from .script_source import pin_source

if TYPE_CHECKING:
    from tvm.tirx import PrimFunc

# The TVMScript builders below parse the text this module was imported from.
pin_source(__name__)

__all__ = ["Peak", "FMA_UNITS", "FmaChains", "measure_peak", "fma_chain_func", "llvm_target",
           "flops_per_cycle"]

#: FMA pipes per core on every x86 core tvm-tpp targets (Haswell .. Sapphire Rapids, Zen 1-4).
FMA_UNITS = 2


@dataclass(frozen=True)
class Peak:
    """Measured single-core fp32 peak of one ISA's vector width."""

    isa: str
    lanes: int
    clock_ghz: float
    fma_units: int = FMA_UNITS

    def __post_init__(self) -> None:
        if self.lanes < 1 or self.fma_units < 1 or not self.clock_ghz > 0:
            raise ValueError(f"implausible peak measurement: {self}")

    @property
    def peak_gflops(self) -> float:
        """``fma_units x lanes x 2 flops x clock``."""
        return self.fma_units * self.lanes * 2 * self.clock_ghz


def llvm_target(isa: _isa.Isa):
    """The TVM target that emits exactly ``isa``'s instructions (on any host)."""
    import tvm

    return tvm.target.Target(
        {"kind": "llvm", "mtriple": isa.mtriple, "mcpu": isa.mcpu, "mattr": list(isa.mattr)}
    )


def fma_chain_func(lanes: int, chains: int, iters: int) -> PrimFunc:
    """``out = (x * y + ...)``: ``chains`` independent vector FMA chains of ``iters`` steps.

    ``x`` holds the initial accumulator, the multiplier and the addend (``3 * lanes`` floats).
    """
    from tvm.script import tirx as T

    vec = f"float32x{lanes}"

    @T.prim_func(s_tir=True)
    def main(x: T.Buffer((3 * lanes,), "float32"), out: T.Buffer((chains * lanes,), "float32")):
        T.func_attr({"global_symbol": "main", "tirx.noalias": True})
        # "global" scope: a small stack array LLVM promotes to registers.
        acc = T.alloc_buffer((chains * lanes,), "float32")
        for c in T.unroll(chains):
            acc[T.ramp(c * lanes, 1, lanes)] = x[T.ramp(0, 1, lanes)]
        for _ in T.serial(iters):
            for c in T.unroll(chains):
                acc[T.ramp(c * lanes, 1, lanes)] = T.call_llvm_pure_intrin(
                    vec, "llvm.fmuladd", acc[T.ramp(c * lanes, 1, lanes)],
                    x[T.ramp(lanes, 1, lanes)], x[T.ramp(2 * lanes, 1, lanes)])
        for c in T.unroll(chains):
            out[T.ramp(c * lanes, 1, lanes)] = acc[T.ramp(c * lanes, 1, lanes)]

    return main


class FmaChains:
    """The compiled FMA-chain microbenchmark of one ISA, ready to be timed repeatedly.

    Raises
    ------
    ValueError
        If ``isa`` is unknown, not x86, or not supported by this CPU.
    """

    def __init__(self, isa: str | None = None) -> None:
        import numpy as np
        import tvm

        target_isa = _isa.detect() if isa is None else _isa.from_name(isa)
        if target_isa.arch != "x86_64":
            raise ValueError(f"the FMA-chain benchmark is x86 code; {target_isa.name} is not x86")
        if not target_isa.runs_on(_isa.host_flags()):
            raise ValueError(f"this CPU cannot run {target_isa.name} code")
        self.isa = target_isa
        self.lanes = target_isa.lanes("float32")
        # 4-5 cycle FMA latency x 2 units needs >= 10 chains; leave registers for the operands.
        self.chains = min(target_isa.vector_registers - 4, 16)
        self.iters = 1_000_000 // self.chains
        ex = tvm.compile(fma_chain_func(self.lanes, self.chains, self.iters),
                         target=llvm_target(target_isa))
        self._timer = ex.mod.time_evaluator("main", tvm.cpu(), number=1, repeat=1)
        self._args = (tvm.runtime.tensor(np.full(3 * self.lanes, 0.5, "float32")),
                      tvm.runtime.tensor(np.zeros(self.chains * self.lanes, "float32")))

    def best_seconds(self, repeat: int) -> float:
        """Fastest of ``repeat`` runs (each ~0.2 ms: short enough to run undisturbed)."""
        return min(min(self._timer(*self._args).results) for _ in range(repeat))

    def peak(self, seconds: float) -> Peak:
        """The peak implied by one run taking ``seconds``."""
        fmas_per_second = self.chains * self.iters / seconds
        return Peak(self.isa.name, self.lanes, fmas_per_second / FMA_UNITS / 1e9)


@functools.cache
def measure_peak(isa: str | None = None, repeat: int = 200) -> Peak:
    """Measure the fp32 FMA peak of ``isa`` (default: the host's richest x86 ISA) on one core.

    The ISA must run on this host.  Takes about a second; cached per ISA.

    Raises
    ------
    ValueError
        If ``isa`` is unknown, not x86, or not supported by this CPU.
    """
    chains = FmaChains(isa)
    return chains.peak(chains.best_seconds(repeat))


#: A 512-bit ISA whose FMA-chain rate is below this multiple of AVX2's has 256-bit FMA pipes.
_FULL_WIDTH_RATIO = 1.4


@functools.cache
def flops_per_cycle(isa: str) -> float:
    """fp32 flops per cycle of one core running ``isa``'s FMA kernels: the cost model's peak.

    Nominally ``FMA_UNITS x lanes x 2`` (32 for AVX2, 64 for AVX-512).  Zen 4 executes a
    512-bit FMA in two halves on its 256-bit pipes, so its AVX-512 kernels peak at AVX2's
    32 (measured here: 118.2 GFLOPS either way), and a model assuming 64 sees half the
    compute time next to the same data movement.  Flags cannot tell (Cooper Lake has the
    same ISA and full-width pipes), so for a 512-bit ``isa`` this host runs, the FMA-chain
    rates of ``isa`` and AVX2 are compared (about 0.4 s, once per process): below
    1.4x AVX2's rate the pipes are 256 bits wide (Cascade Lake measures 1.78x, Zen 4 1.0x).
    Other ISAs, and ISAs this host cannot run, get the nominal figure.
    """
    target = _isa.from_name(isa)
    nominal = float(FMA_UNITS * target.lanes("float32") * 2)
    if target.vector_bits <= 256 or target.arch != "x86_64" \
            or not target.runs_on(_isa.host_flags()):
        return nominal
    ratio = measure_peak(isa).peak_gflops / measure_peak("avx2").peak_gflops
    return nominal if ratio >= _FULL_WIDTH_RATIO else nominal / 2
