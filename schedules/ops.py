"""The operators the tuner handles: one :class:`Op` per template, in :data:`OPS`.

An :class:`Op` tells the tuner, the database and the people reading its output what they
need of one kind of operator: its key, its untuned default, its candidates in measuring
order (with the cost model's verdict where one ranks them), its schedule, its config's JSON
record and one-line text.  A dense GEMM's candidates are ranked by the cache-trace model
within each blocking (:func:`schedules.gemm.ranked_blockings`); a convolution's and a batch
GEMM's short lists are not ranked: measurement decides.

Examples
--------
>>> op_of(ConvProblem(1, 16, 14, 14, 32, 3, 3)).name
'conv2d'
>>> problem_text(ConvProblem(1, 3, 224, 224, 64, 7, 7, stride=2, padding=3))
'conv2d 1x3x224x224x64x7x7/s2x2p3x3x3x3 -'
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple

from microkernels.epilogue import Epilogue
from microkernels.machine import Machine

from . import attention, batch_gemm, conv, depthwise, gemm, winograd
from .attention import AttentionConfig, AttentionProblem
from .batch_gemm import BatchGemmConfig, BatchGemmProblem
from .conv import ConvConfig, ConvProblem
from .depthwise import DepthwiseConfig, DepthwiseProblem
from .gemm import GemmConfig, GemmProblem
from .space import Candidate
from .winograd import WinogradConfig, WinogradProblem

if TYPE_CHECKING:
    from tvm import s_tir

__all__ = ["Problem", "Config", "Choice", "Op", "OPS", "op_of", "problem_text", "config_text",
           "shape_text", "conv_problem", "MODEL_RESOLUTION"]

Problem = (GemmProblem | ConvProblem | BatchGemmProblem | DepthwiseProblem | WinogradProblem
           | AttentionProblem)
Config = (GemmConfig | ConvConfig | BatchGemmConfig | DepthwiseConfig | WinogradConfig
          | AttentionConfig)

#: Predictions closer than this are one class: the model works at slice granularity, and its
#: two engines (exact replay, analytic) typically differ by about this much.
MODEL_RESOLUTION = 0.01


class Choice(NamedTuple):
    """A candidate to measure, with the cost model's verdict (all None when unranked).

    ``rank`` counts the candidates of its blocking predicted strictly faster, ``model_class``
    those predicted faster by more than :data:`MODEL_RESOLUTION` (0-based both).
    """

    rank: int | None
    model_class: int | None
    cycles: float | None
    config: Config


@dataclass(frozen=True)
class Op:
    """What the tuner needs to know of one kind of operator.

    Parameters
    ----------
    name
        The key's op (``"dense"``, ``"conv2d"``, ``"batch_gemm"``).
    problem, config
        Its problem and configuration classes.
    key
        ``problem -> (shape, layout, dtype)`` for the tuning key.
    default
        ``(problem, machine) -> config``: the untuned default.
    choices
        ``(problem, machine, max_candidates) -> (choices, generated)``: the candidates in
        measuring order, the default first, and how many were considered.
    schedule
        ``(problem, config, isa) -> Schedule``.
    to_json, from_json
        A config to and from its database record.
    text
        A config as one short line.

    Examples
    --------
    >>> OPS["conv2d"].text(ConvConfig(bq=28, bc=64, bk=64))
    'ACDebfg bq=28 bc=64 bk=64 c_step=1'
    """

    name: str
    problem: type
    config: type
    key: Callable[[Any], tuple[tuple[int, ...], str, str]]
    default: Callable[[Any, Machine], Any]
    choices: Callable[[Any, Machine, int], tuple[list[Choice], int]]
    schedule: Callable[[Any, Any, str], s_tir.Schedule]
    to_json: Callable[[Any], dict]
    from_json: Callable[[dict], Any]
    text: Callable[[Any], str]

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an Op needs a name")
        for f in fields(self)[3:]:
            if not callable(getattr(self, f.name)):
                raise TypeError(f"Op {self.name!r}: {f.name} must be callable")


def _dense_choices(problem: GemmProblem, machine: Machine, max_candidates: int
                   ) -> tuple[list[Choice], int]:
    """:func:`schedules.gemm.candidates`, each with its model rank and class within its
    blocking (the default's too).

    A candidate's rank counts the candidates of its blocking predicted strictly faster (equal
    predictions share a rank), its class those predicted faster by more than the model's
    resolution (PARLOOPER's "modeled classes", [PL] Fig. 6).
    """
    families = gemm.ranked_blockings(problem, machine, max_candidates)
    verdicts: dict[GemmConfig, tuple[int, int, float]] = {}
    for family in families:
        # Ranks count the candidates predicted faster: bisect the sorted predictions.
        cycles_of = [cycles for cycles, _ in family]
        for cycles, config in family:
            verdicts[config] = (bisect.bisect_left(cycles_of, cycles),
                                bisect.bisect_left(cycles_of, cycles * (1 - MODEL_RESOLUTION)),
                                cycles)
    order = gemm.measuring_order(gemm.default_config(problem, machine), families)
    return [Choice(*verdicts[config], config) for config in order], sum(map(len, families))


def _dense_to_json(config: GemmConfig) -> dict:
    c = config.candidate
    return {"bm": config.bm, "bn": config.bn, "bk": config.bk, "spec": c.spec,
            "block_steps": {k: list(v) for k, v in c.block_steps.items()},
            "steps": dict(c.steps), "pack_a": config.pack_a}


def _dense_from_json(data: dict) -> GemmConfig:
    candidate = Candidate(data["spec"], {k: tuple(v) for k, v in data["block_steps"].items()},
                          data["steps"])
    return GemmConfig(data["bm"], data["bn"], data["bk"], candidate, data.get("pack_a"))


def _fields_to_json(config: ConvConfig | BatchGemmConfig) -> dict:
    """A flat config's fields (block steps as a plain dict): ``type(config)(**json)`` again."""
    values = {f.name: getattr(config, f.name) for f in fields(config)}
    return {name: dict(v) if isinstance(v, Mapping) else v for name, v in values.items()}


def _steps_text(block_steps: Mapping[str, tuple[int, ...]]) -> str:
    return f" {dict(block_steps)}" if block_steps else ""


def _geometry_text(p: ConvProblem | DepthwiseProblem) -> str:
    """Stride, padding and (where not 1) dilation and groups, and a prologue's ops: the key's
    layout part, as the keys of undilated, ungrouped convs were before those existed."""
    (sh, sw), pads = p.stride, "x".join(map(str, p.padding))
    (dh, dw), groups = p.dilation, getattr(p, "groups", 1)
    prologue = getattr(p, "prologue_name", "")
    return (f"s{sh}x{sw}p{pads}" + ("" if (dh, dw) == (1, 1) else f"d{dh}x{dw}")
            + ("" if groups == 1 else f"g{groups}") + (f"+{prologue}" if prologue else ""))


#: What the key's dtype adds for 7-bit weights (``narrow_weights``).
_NARROW_SUFFIX = "_w7"


_CONV_TEXT = re.compile(r"(\d+)x(\d+)x(\d+)x(\d+)x(\d+)x(\d+)x(\d+)"
                        r"(?:/s(\d+)x(\d+)p(\d+)x(\d+)x(\d+)x(\d+)(?:d(\d+)x(\d+))?(?:g(\d+))?)?")


def conv_problem(text: str, dtype: str = "float32", epilogue: Epilogue | None = None
                 ) -> ConvProblem | DepthwiseProblem:
    """The convolution a tuning key's shape text names (as :func:`problem_text` shows it):
    ``NxCxHxWxKxRxS``, then optionally ``/s{sh}x{sw}p{top}x{left}x{bottom}x{right}`` with
    ``d{dh}x{dw}`` and ``g{groups}`` where not 1 (stride 1, no padding without it); ``dtype``
    as the key spells it (``uint8_w7``: u8 input, 7-bit weights).  A depthwise conv
    (``groups = C = K``) is the :class:`~schedules.depthwise.DepthwiseProblem` a network's
    depthwise conv becomes.

    >>> p = ConvProblem(1, 3, 224, 224, 64, 7, 7, stride=2, padding=3)
    >>> conv_problem("1x3x224x224x64x7x7/s2x2p3x3x3x3") == p
    True
    >>> conv_problem("1x8x9x9x8x3x3/s1x1p2x2x2x2d2x2g2").dilation
    (2, 2)
    >>> conv_problem("1x8x9x9x8x3x3", "uint8_w7").narrow_weights
    True
    >>> type(conv_problem("8x32x112x112x32x3x3/s1x1p1x1x1x1g32")).__name__
    'DepthwiseProblem'
    >>> conv_problem("1x64x56x56x64")
    Traceback (most recent call last):
    ...
    ValueError: a conv is NxCxHxWxKxRxS[/s1x1p0x0x0x0[d1x1][g1]], got '1x64x56x56x64'
    """
    match = _CONV_TEXT.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"a conv is NxCxHxWxKxRxS[/s1x1p0x0x0x0[d1x1][g1]], got {text!r}")
    # Groups a text leaves out take their defaults: stride, dilation and groups 1, padding 0.
    defaults = (1, 1, 0, 0, 0, 0, 1, 1, 1)
    values = [int(v) for v in match.groups()[:7]] + [
        d if v is None else int(v) for v, d in zip(match.groups()[7:], defaults, strict=True)]
    n, c, h, w, k, r, s, sh, sw, top, left, bottom, right, dh, dw, groups = values
    narrow = dtype.endswith(_NARROW_SUFFIX)
    if groups > 1 and groups == c == k:
        if narrow:
            raise ValueError("a depthwise conv has no 7-bit-weight kernel: give its dtype "
                             f"without {_NARROW_SUFFIX}")
        return DepthwiseProblem(n, c, h, w, r, s, stride=(sh, sw),
                                padding=(top, left, bottom, right), dtype=dtype,
                                epilogue=epilogue or Epilogue(), dilation=(dh, dw))
    return ConvProblem(n, c, h, w, k, r, s, stride=(sh, sw), padding=(top, left, bottom, right),
                       dtype=dtype.removesuffix(_NARROW_SUFFIX), epilogue=epilogue or Epilogue(),
                       dilation=(dh, dw), groups=groups, narrow_weights=narrow)


def _operand_text(p: GemmProblem | ConvProblem) -> str:
    """The key's dtype: 7-bit weights run another kernel on some ISAs, so tune apart."""
    return p.dtype + (_NARROW_SUFFIX if p.narrow_weights else "")


def _conv_key(p: ConvProblem) -> tuple[tuple[int, ...], str, str]:
    return (p.n, p.c, p.h, p.w, p.k, p.r, p.s), _geometry_text(p), _operand_text(p)


def _depthwise_key(p: DepthwiseProblem) -> tuple[tuple[int, ...], str, str]:
    return (p.n, p.c, p.h, p.w, p.r, p.s), _geometry_text(p), p.dtype


def _listed(name: str, template: ModuleType, problem: type, config: type,
            key: Callable[[Any], tuple[tuple[int, ...], str, str]],
            text: Callable[[Any], str]) -> Op:
    """The :class:`Op` of a template whose short list of candidates no model ranks
    (measurement decides) and whose config is flat fields: ``config(**json)``."""
    return Op(name, problem, config, key=key, default=template.default_config,
              choices=lambda p, machine, _: _unranked(template.candidates(p, machine)),
              schedule=template.schedule, to_json=_fields_to_json,
              from_json=lambda data: config(**data), text=text)


def _unranked(configs: list[Config]) -> tuple[list[Choice], int]:
    return [Choice(None, None, None, config) for config in configs], len(configs)


#: The operators the tuner handles, by the key's op name.
OPS: dict[str, Op] = {op.name: op for op in (
    Op("dense", GemmProblem, GemmConfig,
       key=lambda p: ((p.m, p.n, p.k), "", _operand_text(p)),
       default=gemm.default_config,
       choices=_dense_choices,
       schedule=gemm.schedule,
       to_json=_dense_to_json,
       from_json=_dense_from_json,
       text=lambda c: (f"{c.spec} bm={c.bm} bn={c.bn} bk={c.bk} k_step={c.k_step}"
                       + _steps_text(c.candidate.block_steps)
                       + ("" if c.pack_a is None else f" pack_a={c.pack_a}"))),
    _listed("conv2d", conv, ConvProblem, ConvConfig, key=_conv_key,
            text=lambda c: (f"{c.spec} bq={c.bq} bc={c.bc} bk={c.bk} c_step={c.c_step}"
                            + _steps_text(c.block_steps)
                            + (" taps folded" if c.fold_taps else "")
                            + (" rows batched" if c.batch_rows else ""))),
    _listed("depthwise_conv2d", depthwise, DepthwiseProblem, DepthwiseConfig,
            key=_depthwise_key,
            text=lambda c: (f"bq={c.bq} bc={c.bc}"
                            + (" parallel channels" if c.parallel_channels else ""))),
    _listed("batch_gemm", batch_gemm, BatchGemmProblem, BatchGemmConfig,
            key=lambda p: ((p.batch, p.m, p.n, p.k), p.layout, p.dtype),
            text=lambda c: (f"bm={c.bm} bn={c.bn} bk={c.bk}"
                            + (" parallel rows" if c.parallel_rows else "")
                            + (" rows outer" if c.rows_outer else ""))),
    _listed("attention", attention, AttentionProblem, AttentionConfig,
            key=lambda p: (p.shape, p.layout, p.dtype),
            text=lambda c: f"bm={c.bm} bn={c.bn} bk={c.bk} bn_s={c.bn_s} bk_s={c.bk_s}"),
    _listed("winograd_conv2d", winograd, WinogradProblem, WinogradConfig,
            key=lambda p: (_conv_key(p.conv)[0], f"{_geometry_text(p.conv)}t{p.tile}",
                           p.dtype),
            text=lambda c: f"winograd bt={c.bt} bk={c.bk}"),
)}


def op_of(obj: Problem | Config) -> Op:
    """The :class:`Op` of a problem or a config.

    Raises
    ------
    TypeError
        ``obj`` is no problem or config of a registered operator.
    """
    for op in OPS.values():
        if isinstance(obj, (op.problem, op.config)):
            return op
    raise TypeError(f"the tuner handles GEMM, conv, batch GEMM and attention problems and "
                    f"depthwise convs, not {type(obj).__name__}")


def shape_text(shape: tuple[int, ...], layout: str) -> str:
    """A key's shape and layout as people and the database read them.

    >>> shape_text((4, 8, 8, 8), "tx2")
    '4x8x8x8/tx2'
    """
    return "x".join(map(str, shape)) + (f"/{layout}" if layout else "")


def problem_text(problem: Problem) -> str:
    """One line naming ``problem`` for people: op, shape/layout and epilogue."""
    op = op_of(problem)
    shape, layout, _ = op.key(problem)
    return f"{op.name} {shape_text(shape, layout)} {problem.epilogue.name or '-'}"


def config_text(config: Config) -> str:
    """One line describing ``config`` (loop_spec and blocks).

    >>> config_text(GemmConfig.of("aCB", 8, 32, 24, pack_a=1))
    'aCB bm=8 bn=32 bk=24 k_step=1 pack_a=1'
    """
    return op_of(config).text(config)
