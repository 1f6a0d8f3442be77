"""The machine a target generates code for: ISA, caches, threads and compute peak.

Every layer that schedules for a target asks this module, never the target's attributes: the
graph passes (which ISA's kernels), the templates' defaults and the cost model (caches,
threads, peak), the tuner (its database key).  It imports no TVM: a target is read through
its ``keys`` and ``attrs`` only, so tests can describe any machine (a Sapphire Rapids with a
2 MiB L2 on a Zen 4 host) by building a :class:`Machine` directly.

Examples
--------
>>> from microkernels.isa import Caches, from_name
>>> spr = Machine(from_name("amx"), Caches(48 << 10, 2 << 20, 105 << 20), threads=2,
...               mcpu="sapphirerapids", fp32_flops_per_cycle=64.0)
>>> spr.key, spr.peak_flops_per_cycle, spr.caches.l2 >> 20
('amx/sapphirerapids/2t', 64.0, 2)

What this process may run is asked here too: :func:`host_isa` and :func:`runs_here` treat AMX
as absent when Linux refuses the tile permission (:func:`microkernels.amx.tiles_usable`), so
nothing picks or runs AMX kernels that would die with SIGILL.

>>> runs_here(from_name("amx")) is (host_isa().name == "amx")
True
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from . import amx as _amx
from . import isa as _isa

__all__ = ["Machine", "host", "host_isa", "host_isa_text", "runs_here", "amx_refused", "is_tpp",
           "machine_of", "HALF_WIDTH_CPUS", "INT8_MODES", "INT8_KEYS"]

#: LLVM's names of the CPUs whose vector units are half as wide as their ISA's registers:
#: each 256-bit instruction issues as two 128-bit halves, integer multiply-adds as FMAs, so
#: without an int8 dot product the exact u8 x s8 kernel runs below the float32 one there
#: (Zen 1: 0.82x, and the 7-bit ``vpmaddubsw`` kernel 0.99x; ``tvm-tpp bench-kernel``).
HALF_WIDTH_CPUS = frozenset({"znver1"})
#: How a target's quantized (QDQ) dense and conv layers compute: ``auto`` (the int8 kernels
#: where they beat float32: :attr:`Machine.int8_in_float`), ``kernels`` or ``float``.
INT8_MODES = ("auto", "kernels", "float")
#: The target key that asks for an ``INT8_MODES`` mode other than ``auto``.
INT8_KEYS = {"kernels": "tpp-int8-kernels", "float": "tpp-int8-float"}


@dataclass(frozen=True)
class Machine:
    """What code for one CPU is scheduled against.

    Parameters
    ----------
    isa
        The ISA the microkernels are generated for.
    caches
        Per-core data caches (L3: the shared cache) the cost model and defaults size blocks by.
    threads
        Threads the generated code runs on.
    mcpu
        LLVM's name of the CPU (part of :attr:`key`; "" when unknown).
    fp32_flops_per_cycle
        One core's fp32 peak; None asks :func:`microkernels.peak.flops_per_cycle` (measured
        on this host for an ISA it runs, nominal otherwise) when first needed.
    int8
        How quantized layers compute, one of :data:`INT8_MODES` (see :attr:`int8_in_float`).
    """

    isa: _isa.Isa
    caches: _isa.Caches
    threads: int = 1
    mcpu: str = ""
    fp32_flops_per_cycle: float | None = None
    int8: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.isa, _isa.Isa) or not isinstance(self.caches, _isa.Caches):
            raise TypeError("a Machine takes an Isa and a Caches")
        if self.int8 not in INT8_MODES:
            raise ValueError(f"int8 must be one of {', '.join(INT8_MODES)}, got {self.int8!r}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.fp32_flops_per_cycle is not None and not self.fp32_flops_per_cycle > 0:
            raise ValueError(f"fp32_flops_per_cycle must be > 0, got "
                             f"{self.fp32_flops_per_cycle}")

    @property
    def peak_flops_per_cycle(self) -> float:
        """fp32 flops per cycle of one core: the cost model's compute peak."""
        if self.fp32_flops_per_cycle is not None:
            return self.fp32_flops_per_cycle
        from .peak import flops_per_cycle  # imports TVM; measures once per process

        return flops_per_cycle(self.isa.name)

    @property
    def int8_in_float(self) -> bool:
        """Whether quantized layers multiply their dequantized values in float32 rather than
        on the int8 kernels: asked for (``int8="float"``), or by default where the ISA has no
        int8 dot product and the CPU's vector units are half its width
        (:data:`HALF_WIDTH_CPUS`), so that float32, and its Winograd convs, are faster.

        >>> from microkernels.isa import DEFAULT_CACHES, from_name
        >>> [Machine(from_name(i), DEFAULT_CACHES, mcpu=c).int8_in_float
        ...  for i, c in (("avx2", "znver1"), ("avx2", "znver3"), ("avx512_vnni", "znver1"))]
        [True, False, False]
        >>> Machine(from_name("avx2"), DEFAULT_CACHES, mcpu="znver1", int8="kernels").int8_in_float
        False
        """
        if self.int8 != "auto":
            return self.int8 == "float"
        return not self.isa.int8_dot and self.mcpu in HALF_WIDTH_CPUS

    @property
    def key(self) -> str:
        """``isa/mcpu/Nt``: what a tuning result measured on this machine is valid for."""
        return f"{self.isa.name}/{self.mcpu}/{self.threads}t"


@functools.cache
def _cpu() -> tuple[_isa.Isa, frozenset[str]]:
    # This CPU's richest ISA and its flags: /proc/cpuinfo does not change, and reading it
    # is slow on many-core hosts, while runs_here is asked before every model's first run.
    return _isa.detect(), _isa.host_flags()


@functools.cache
def _caches() -> _isa.Caches:
    # sysfs does not change either, and machine_of is asked for every operator a pass routes.
    return _isa.caches()


def amx_refused() -> bool:
    """Whether this CPU has AMX tiles but Linux refused this process their state."""
    return "amx_tile" in _cpu()[1] and not _amx.tiles_usable()


def host_isa() -> _isa.Isa:
    """The richest ISA this process may run: the CPU's (:func:`microkernels.isa.detect`), one
    step down (AVX-512 BF16) when it is AMX and the tile permission is refused."""
    chosen = _cpu()[0]
    while chosen.has("amx_tile") and not _amx.tiles_usable() and chosen.parent is not None:
        chosen = _isa.KNOWN[chosen.parent]
    return chosen


def host_isa_text() -> str:
    """The host's ISA as ``tvm-tpp info`` and the benchmarks describe it, saying when AMX is
    switched off.

    >>> host_isa_text().startswith(host_isa().name)
    True
    """
    text = f"{host_isa().name} ({host_isa().description})"
    if amx_refused():
        text += "; amx (tile permission refused: AMX kernels disabled)"
    return text


def runs_here(isa: _isa.Isa) -> bool:
    """Whether this process may execute ``isa``'s code: the CPU has its flags and, for AMX,
    the tile permission was granted (asked here, once, if not yet)."""
    return isa.runs_on(_cpu()[1]) and (not isa.has("amx_tile") or _amx.tiles_usable())


def host(threads: int | None = None) -> Machine:
    """This machine: the richest ISA it may run (:func:`host_isa`), its caches (sysfs), the
    cores this process may use."""
    return Machine(host_isa(), _caches(),
                   threads if threads is not None else _isa.num_cores())


def is_tpp(target: Any) -> bool:
    """Whether ``target`` (a ``tvm.target.Target``) is a ``tpp`` target."""
    return "tpp" in target.keys


def machine_of(target: Any) -> Machine:
    """The machine a ``tpp`` target schedules for.

    The ISA comes from the target's ``model`` attribute, the thread count from ``num-cores``,
    the int8 mode from its keys (:data:`INT8_KEYS`), the caches from this host (a target
    names no caches).

    Raises
    ------
    ValueError
        If ``target`` is not a ``tpp`` target or names an unknown ISA.
    """
    if not is_tpp(target):
        raise ValueError(f"not a tpp target: {target}")
    attrs = target.attrs
    int8 = next((mode for mode, key in INT8_KEYS.items() if key in target.keys), "auto")
    return Machine(_isa.from_name(str(attrs.get("model", ""))), _caches(),
                   int(attrs.get("num-cores", 1)), str(attrs.get("mcpu", "")), int8=int8)
