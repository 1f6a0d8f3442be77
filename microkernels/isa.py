"""Instruction sets, register files and caches: what every layer needs to know about the CPU.

This module is the bottom of the stack and imports nothing heavy (no TVM), so the command line
can answer ``tvm-tpp info`` quickly.  It knows a fixed list of ISAs (:data:`KNOWN`), each with
the LLVM triple/CPU/attributes that make TVM emit its instructions, so code for a foreign ISA
can be generated and inspected on any host.

Examples
--------
>>> from microkernels import isa
>>> isa.from_name("avx2").vector_bits
256
>>> isa.detect(cpuinfo="flags : fpu sse avx avx2 fma\\n").name
'avx2'
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "Isa",
    "Caches",
    "CACHE_LINE",
    "KNOWN",
    "from_name",
    "detect",
    "host_flags",
    "caches",
    "num_cores",
]


@dataclass(frozen=True)
class Isa:
    """One instruction-set level the microkernels are written for.

    Parameters
    ----------
    name
        Short name used by ``tpp -isa=NAME``.
    arch
        ``"x86_64"`` or ``"aarch64"``.
    requires
        CPU flags (as ``/proc/cpuinfo`` spells them) a host must have to run this ISA's code.
    vector_bits, vector_registers
        SIMD register width and count: they fix the register tile of the BRGEMM.
    mtriple, mcpu, mattr
        What LLVM needs to emit the instructions, used for foreign targets.
    """

    name: str
    arch: str
    requires: frozenset[str]
    vector_bits: int
    vector_registers: int
    mtriple: str
    mcpu: str
    mattr: tuple[str, ...] = ()
    parent: str | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if self.arch not in ("x86_64", "aarch64"):
            raise ValueError(f"unknown architecture {self.arch!r}")
        if self.vector_bits not in (128, 256, 512) or self.vector_registers not in (16, 32):
            raise ValueError(f"implausible register file for {self.name}")

    def lineage(self) -> tuple[str, ...]:
        """This ISA's name, then the ISAs whose code it also runs, richest first."""
        chain, isa = [self.name], self
        while isa.parent is not None:
            isa = KNOWN[isa.parent]
            chain.append(isa.name)
        return tuple(chain)

    def has(self, feature: str) -> bool:
        """Whether code for this ISA may use ``feature`` (a cpuinfo flag)."""
        return feature in self.requires

    @property
    def int8_dot(self) -> bool:
        """Whether this ISA multiplies u8 x s8 in one instruction that cannot saturate
        (VNNI's ``vpdpbusd``, AMX tiles, i8mm): without one, 7-bit weights are what make the
        fast ``vpmaddubsw`` path exact.

        >>> [from_name(n).int8_dot for n in ("avx2", "avx512", "avx_vnni", "amx", "neon_i8mm")]
        [False, False, True, True, True]
        """
        return bool(self.requires & {"avx_vnni", "avx512_vnni", "amx_int8", "i8mm"})

    @property
    def bf16_dot(self) -> bool:
        """Whether this ISA multiplies bfloat16 in hardware (AVX512-BF16's ``vdpbf16ps``, AMX
        tiles, Arm's ``bfmmla``): without it, bf16 kernels widen every operand to float32
        and run slower than the float32 kernels.

        >>> [from_name(n).bf16_dot for n in ("avx2", "avx512_vnni", "avx512_bf16", "amx",
        ...                                   "neon", "neon_i8mm")]
        [False, False, True, True, False, True]
        """
        return bool(self.requires & {"avx512_bf16", "amx_bf16", "bf16"})

    def lanes(self, dtype: str) -> int:
        """Elements of ``dtype`` in one vector register."""
        bits = {"float32": 32, "int32": 32, "bfloat16": 16, "int16": 16, "uint8": 8, "int8": 8}
        if dtype not in bits:
            raise ValueError(f"no lane count for dtype {dtype!r}")
        return self.vector_bits // bits[dtype]

    def runs_on(self, flags: frozenset[str]) -> bool:
        """Whether a CPU with these flags executes this ISA's code."""
        return self.requires <= flags


_X86 = "x86_64-pc-linux-gnu"
_ARM = "aarch64-linux-gnu"
_AVX2 = frozenset({"avx2", "fma"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}

#: Known ISAs, richest last within each architecture (detection picks the last that runs).
KNOWN: dict[str, Isa] = {
    i.name: i
    for i in (
        Isa("avx2", "x86_64", _AVX2, 256, 16, _X86, "haswell", ("+avx2", "+fma"),
            None, "AVX2 + FMA3 (Haswell, Zen 1-3)"),
        Isa("avx_vnni", "x86_64", _AVX2 | {"avx_vnni"}, 256, 16, _X86, "alderlake",
            ("+avx2", "+fma", "+avxvnni"), "avx2", "AVX2 + AVX-VNNI (Alder Lake)"),
        Isa("avx512", "x86_64", _AVX512, 512, 32, _X86, "skylake-avx512",
            ("+avx512f", "+avx512bw", "+avx512vl", "+avx512dq"), "avx2",
            "AVX-512 F/BW/VL/DQ (Skylake-SP)"),
        Isa("avx512_vnni", "x86_64", _AVX512 | {"avx512_vnni"}, 512, 32, _X86, "cascadelake",
            ("+avx512f", "+avx512bw", "+avx512vl", "+avx512vnni"), "avx512",
            "AVX-512 + VNNI (Cascade Lake)"),
        Isa("avx512_bf16", "x86_64", _AVX512 | {"avx512_vnni", "avx512_bf16"}, 512, 32, _X86,
            "znver4", ("+avx512f", "+avx512bw", "+avx512vl", "+avx512vnni", "+avx512bf16"),
            "avx512_vnni", "AVX-512 + VNNI + BF16 (Zen 4, Cooper Lake)"),
        Isa("amx", "x86_64",
            _AVX512 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"},
            512, 32, _X86, "sapphirerapids",
            ("+avx512f", "+avx512bw", "+avx512vl", "+avx512vnni", "+avx512bf16", "+amx-tile",
             "+amx-int8", "+amx-bf16"), "avx512_bf16", "AMX tiles + AVX-512 (Sapphire Rapids)"),
        Isa("neon", "aarch64", frozenset({"asimd"}), 128, 32, _ARM, "generic", ("+neon",),
            None, "Armv8 Advanced SIMD"),
        Isa("neon_i8mm", "aarch64", frozenset({"asimd", "i8mm", "bf16"}), 128, 32, _ARM,
            "generic", ("+neon", "+i8mm", "+bf16"), "neon",
            "Armv8.6 NEON + int8/bf16 matrix multiply"),
    )
}


def from_name(name: str) -> Isa:
    """The ISA called ``name``; a ``ValueError`` listing the known names otherwise.

    Examples
    --------
    >>> from_name("amx").mcpu
    'sapphirerapids'
    """
    try:
        return KNOWN[name]
    except KeyError:
        raise ValueError(f"unknown ISA {name!r}; known ISAs: {', '.join(KNOWN)}") from None


def host_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """CPU flags of this host (or of the given ``/proc/cpuinfo`` text).

    aarch64 kernels list ``Features``; x86 ones list ``flags``. Both are read.
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def detect(cpuinfo: str | None = None, arch: str | None = None) -> Isa:
    """The richest known ISA this host (or the described CPU) runs.

    Parameters
    ----------
    cpuinfo
        ``/proc/cpuinfo`` text to use instead of the host's, e.g. in tests.
    arch
        Architecture to assume; defaults to this machine's when ``cpuinfo`` is not given and
        to the one the flags imply otherwise.

    Raises
    ------
    RuntimeError
        When the CPU runs none of the known ISAs (e.g. x86 without AVX2).
    """
    flags = host_flags(cpuinfo)
    if arch is None:
        if cpuinfo is None:
            arch = {"arm64": "aarch64"}.get(platform.machine(), platform.machine())
        else:
            arch = "aarch64" if "asimd" in flags else "x86_64"
    candidates = [i for i in KNOWN.values() if i.arch == arch and i.runs_on(flags)]
    if not candidates:
        raise RuntimeError(
            f"this {arch} CPU supports none of the ISAs tvm-tpp has kernels for "
            f"({', '.join(KNOWN)}); its flags: {' '.join(sorted(flags)) or 'unknown'}"
        )
    return candidates[-1]


#: Bytes of a cache line on every CPU tvm-tpp targets (x86-64 and the Arm cores it knows).
CACHE_LINE = 64


@dataclass(frozen=True)
class Caches:
    """Per-core data cache sizes in bytes (L3 is the whole shared cache)."""

    l1d: int
    l2: int
    l3: int
    source: str = field(default="sysfs", compare=False)

    def levels(self) -> tuple[int, int, int]:
        return (self.l1d, self.l2, self.l3)


#: Used when sysfs says nothing (containers, non-Linux): a typical server core.
DEFAULT_CACHES = Caches(32 * 1024, 1024 * 1024, 32 * 1024 * 1024, source="default")


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse cache size {text!r}")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2).upper()]


def caches(sysfs_cpu: str | os.PathLike = "/sys/devices/system/cpu/cpu0/cache") -> Caches:
    """L1d, L2 and L3 sizes from sysfs (``index*/{level,type,size}``), defaults if absent."""
    found: dict[int, int] = {}
    for index in sorted(Path(sysfs_cpu).glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = _parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified"):
            found[level] = size
    if not found:
        return DEFAULT_CACHES
    d = DEFAULT_CACHES
    return Caches(found.get(1, d.l1d), found.get(2, d.l2), found.get(3, d.l3))


def num_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
