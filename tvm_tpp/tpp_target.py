"""The ``tpp`` target: an LLVM CPU target tagged so the TPP graph passes know to run.

TVM 0.27 registers target kinds in C++ only and rejects CLI-style target strings, so the
``tpp`` target is an ``llvm`` target (everything downstream — lowering, LLVM codegen,
MetaSchedule's CPU rules — works unchanged) carrying the key ``tpp`` and, in its ``model``
attribute, the name of the ISA the microkernels are generated for.  A registered tag
``tpp/<isa>`` exists for every known ISA as well.

Spec strings understood by :func:`target`::

    tpp                         this host: its ISA, its LLVM CPU, the cores this process may use
                                (AVX-512 BF16, not AMX, when Linux refuses the tile permission)
    tpp -isa=amx                a foreign ISA (LLVM triple/CPU/attributes filled in)
    tpp -isa=avx2 -num-cores=1  options: -isa, -mcpu, -num-cores, -conv, -int8
    tpp -conv=direct            every conv direct: none in Winograd's form (schedules.winograd;
                                the default, -conv=auto, takes it where it pays)
    tpp -int8=kernels           quantized layers on the int8 kernels (-int8=float: on float32
                                ones, their values dequantized; the default, -int8=auto, the
                                int8 kernels where they beat float32: Machine.int8_in_float)

Examples
--------
>>> import tvm_tpp
>>> t = tvm_tpp.target("tpp -isa=avx512_vnni")
>>> tuple(t.keys), t.attrs["mcpu"], t.attrs["model"]
(('tpp', 'cpu'), 'cascadelake', 'avx512_vnni')
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import tvm
from tvm.target import Target

from microkernels import isa as _isa
from microkernels.machine import INT8_KEYS, INT8_MODES, host_isa, is_tpp, machine_of, runs_here
from schedules.winograd import DIRECT_KEY

from .errors import TargetError

if TYPE_CHECKING:
    from schedules.remote import RemoteCpu

__all__ = ["target", "remote_target", "spec_isa", "is_tpp", "runs_on_host", "TAG_PREFIX"]

TAG_PREFIX = "tpp/"
_OPTIONS = ("isa", "mcpu", "num-cores", "conv", "int8")
#: Values of ``-conv``: ``direct`` marks the target with :data:`schedules.winograd.DIRECT_KEY`.
_CONV_CHOICES = ("auto", "direct")
#: The options with a fixed set of values, the default first (in :func:`target`'s order).
_CHOICES = {"conv": _CONV_CHOICES, "int8": INT8_MODES}


def _config(chosen: _isa.Isa, mcpu: str | None, num_cores: int, direct_convs: bool = False,
            int8: str = "auto") -> dict[str, Any]:
    config: dict[str, Any] = {
        "kind": "llvm",
        "keys": ["tpp", "cpu"] + ([DIRECT_KEY] if direct_convs else [])
        + ([INT8_KEYS[int8]] if int8 in INT8_KEYS else []),
        "mtriple": chosen.mtriple,
        "mcpu": mcpu or chosen.mcpu,
        "model": chosen.name,
        "num-cores": num_cores,
    }
    if chosen.mattr:
        config["mattr"] = list(chosen.mattr)
    return config


@functools.cache
def _register_tags() -> None:
    from tvm.target import register_tag

    for chosen in _isa.KNOWN.values():
        register_tag(TAG_PREFIX + chosen.name, _config(chosen, None, 1))


def _isa_named(name: str) -> _isa.Isa:
    try:
        return _isa.from_name(name)
    except ValueError as err:  # the ISA table lives below this layer, with no TppError
        raise TargetError(str(err)) from None


def _host_mcpu(chosen: _isa.Isa) -> str:
    # LLVM's name for this very CPU gives the best scheduling model; fall back to the ISA's
    # representative CPU when LLVM does not know the host (then it answers "generic").
    system = tvm.target.codegen.llvm_get_system_cpu()
    return system if system and system != "generic" else chosen.mcpu


def _parse(spec: str) -> dict[str, str]:
    words = spec.split()
    if not words or words[0] != "tpp":
        raise TargetError(f"a tpp target spec starts with 'tpp', got {spec!r}")
    options: dict[str, str] = {}
    for word in words[1:]:
        key, eq, value = word.lstrip("-").partition("=")
        if not word.startswith("-") or not eq or not value:
            raise TargetError(f"malformed option {word!r} in target {spec!r}; expected -key=value")
        if key not in _OPTIONS:
            raise TargetError(
                f"unknown option -{key} in target {spec!r}; known: "
                + ", ".join(f"-{o}" for o in _OPTIONS)
            )
        options[key] = value
    return options


def target(spec: str | dict | Target = "tpp", num_cores: int | None = None) -> Target:
    """Build the ``tvm.target.Target`` for a ``tpp`` spec.

    Parameters
    ----------
    spec
        ``"tpp"`` (the host), ``"tpp -isa=NAME [-mcpu=CPU] [-num-cores=N]"``, a registered tag
        ``"tpp/NAME"``, or an existing ``Target``/dict, returned as a ``Target`` unchanged.
    num_cores
        Threads the generated code is tuned for; default: the cores this process may use.

    Raises
    ------
    TargetError
        Unknown ISA (the message lists the known ones), unknown option or malformed spec; a
        ``ValueError``.
    """
    if isinstance(spec, Target):
        return spec
    if isinstance(spec, dict):
        return Target(spec)
    _register_tags()
    if spec.startswith(TAG_PREFIX):
        _isa_named(spec[len(TAG_PREFIX):])
        return Target(spec)
    options = _parse(spec)
    if "num-cores" in options:
        try:
            num_cores = int(options["num-cores"])
        except ValueError:
            value = options["num-cores"]
            raise TargetError(f"-num-cores must be an integer, got {value!r}") from None
    cores = num_cores if num_cores is not None else _isa.num_cores()
    if cores < 1:
        raise TargetError(f"num-cores must be >= 1, got {cores}")
    if "isa" in options:
        # A named ISA gets its representative CPU: LLVM's name for a VM's CPU can be one
        # without the ISA (a Sapphire Rapids guest reads as "rocketlake", which has no AMX).
        chosen = _isa_named(options["isa"])
        mcpu = options.get("mcpu")
    else:
        chosen = host_isa()
        mcpu = options.get("mcpu") or _host_mcpu(chosen)
    if "mcpu" in options:
        _check_mcpu(options["mcpu"], chosen)
    conv, int8 = (_choice(options, name, choices) for name, choices in _CHOICES.items())
    return Target(_config(chosen, mcpu, cores, conv == "direct", int8))


def _choice(options: dict[str, str], name: str, choices: tuple[str, ...]) -> str:
    """Option ``-name``'s value (its first choice, ``auto``, when not given), checked."""
    value = options.get(name, choices[0])
    if value not in choices:
        raise TargetError(f"-{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _check_mcpu(mcpu: str, chosen: _isa.Isa) -> None:
    """TargetError unless LLVM knows ``mcpu`` for the ISA's architecture (else LLVM prints
    its complaints for every function it compiles and builds for a generic CPU)."""
    if not tvm.target.codegen.llvm_is_valid_cpu(mcpu, chosen.mtriple):
        raise TargetError(f"-mcpu={mcpu} is not a CPU LLVM knows for {chosen.mtriple} "
                          f"(e.g. -mcpu={chosen.mcpu})")


def spec_isa(spec: str) -> str | None:
    """The ISA a ``tpp`` spec names with ``-isa=``, or None.

    >>> spec_isa("tpp -isa=neon -num-cores=4"), spec_isa("tpp")
    ('neon', None)
    """
    return _parse(spec).get("isa")


def remote_target(spec: str, chosen: _isa.Isa, cpu: RemoteCpu | None) -> Target:
    """The target of RPC servers whose CPU is ``cpu`` (None: unknown), for ISA ``chosen``.

    The spec's options win; otherwise the LLVM CPU is the servers' own when ``chosen`` is
    the richest ISA they run (else the ISA's representative CPU, as for ``tpp -isa=``), and
    the threads are the servers' TVM thread count (1 when unknown).

    Examples
    --------
    >>> from schedules.remote import RemoteCpu
    >>> cpu = RemoteCpu("x86_64", "znver1", frozenset({"avx2", "fma"}), 4)
    >>> t = remote_target("tpp -num-cores=1", _isa.from_name("avx2"), cpu)
    >>> t.attrs["mcpu"], int(t.attrs["num-cores"]), t.attrs["model"]
    ('znver1', 1, 'avx2')
    """
    options = _parse(spec)
    if options.get("isa", chosen.name) != chosen.name:
        raise TargetError(f"the target names -isa={options['isa']} and the ISA is "
                          f"{chosen.name}: give one")
    mcpu = options.get("mcpu")
    if mcpu is None and cpu is not None and cpu.flags is not None and cpu.isa() == chosen and \
            tvm.target.codegen.llvm_is_valid_cpu(cpu.mcpu, chosen.mtriple):
        mcpu = cpu.mcpu
    cores = options.get("num-cores") or (cpu.threads if cpu is not None else 1)
    words = ["tpp", f"-isa={chosen.name}", f"-num-cores={cores}"] + \
        ([f"-mcpu={mcpu}"] if mcpu else []) + \
        [f"-{o}={options[o]}" for o in ("conv", "int8") if o in options]
    return target(" ".join(words))


def runs_on_host(tgt: Target) -> bool:
    """Whether code built for ``tgt`` can execute on this machine."""
    triple = str(tgt.attrs.get("mtriple", "")) or None
    host = host_isa()
    if triple is not None and not triple.startswith(host.arch):
        return False
    if is_tpp(tgt):
        return runs_here(machine_of(tgt).isa)
    return True
