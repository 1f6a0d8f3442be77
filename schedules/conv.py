"""Direct convolution template: PARLOOPER's conv loops around a BRGEMM over channels.

``Y = epilogue(conv2d(X, W))`` for ``groups = 1``, dilation 1, any stride and padding,
computed as in [PL] Listing 4: seven logical loops

* ``a`` — N (images),
* ``b`` — Cb (input-channel blocks of ``bc``, a reduction; step ``c_step`` blocks),
* ``c`` — Kb (output-channel blocks of ``bk``),
* ``d`` — P (output rows),
* ``e`` — Q blocks (output columns in blocks of ``bq``),
* ``f`` — R, ``g`` — S (filter taps, reductions),

ordered, blocked and parallelized by a loop_spec string, around a BRGEMM call
``C[bq, bk] += A[bq, c_step*bc] @ B[c_step*bc, bk]`` for one output tile and one tap (r, s).

Layouts (row-major)
-------------------
Activations are channels-last.  This is PARLOOPER's blocked ``NCHWc`` with a single channel
block (``Cb = 1``, ``bc = C``) in memory; the ``bc``/``bk`` blocks are column blocks of that
layout.  It keeps the epilogue a plain 2-D ``[pixels, channels]`` chain, and lets any conv
consume any other conv's output, whatever their blocks.

* input ``X[N][Hp][Wq][sw*C']``: NHWC, padded (the kernel never reads out of bounds), the
  padded width rounded up to ``Wq * sw``.  It is the padded NHWC tensor reshaped (no copy)
  so that input column ``w = q*sw + ph`` sits at ``X[.., q, ph*C' + c]``.  For tap ``s`` the
  A rows of output columns ``q0 .. q0+bq`` are then *consecutive* rows ``q0 + s//sw ..`` at
  offset ``(s % sw) * C'``: a stride ``sw`` needs no gather.  ``C'`` is
  :attr:`ConvProblem.padded_c` (C itself in float32).
* weights ``W[Kb][R][S][C][bk]`` (float32): each (kb, r, s) holds a contiguous ``[C, bk]``
  panel, the flat BRGEMM's B; low precision ``W[Kb][R][S][C'/a][bk][a]``, the panel in VNNI
  groups of ``a`` channels (:func:`pack_weight`).
* output ``Y[N*P*Q][K]``: NHWC viewed as a matrix; residual operands have this shape too,
  bias and per-channel scale operands are ``[K]`` (``broadcast="row"``).

The accumulator is zeroed before the first reduction loop (``decompose_reduction``), or, as
:mod:`schedules.gemm` does, by the kernel's first call of each tile where the kernel has
zeroing variants: where the calls over filter rows in the zero border are skipped
(:func:`schedule`), the first call is the one over the first real filter row, and where some
output row has none (a border deeper than the filter) the zeroing pass stays.  The epilogue
(:func:`microkernels.epilogue.apply_te`) runs under the deepest spatial loop above the
reduction, on the finished tile, as :mod:`schedules.gemm` does.

A prologue (``ConvProblem.prologue``: per-channel scale, shift and ReLU, DenseNet's
BatchNorm and ReLU before each 1x1 conv) is computed inside the conv, once per pixel tile,
into a local ``[bq, C]`` tile that the BRGEMM calls of every K block read: the spec keeps the
K- and channel-block loops inside the pixel loops (:meth:`ConvConfig.parse`).  Only 1x1
convs of stride 1 without padding take one, where input pixels are output pixels.  A bf16
conv with a prologue reads float32 X, or bf16 X widened as it loads it
(``ConvProblem.prologue_input``: DenseNet's bf16 block buffers), and rounds the prologue's
result into its bf16 tile (``vcvtneps2bf16`` where whole 16-lane vectors of channels allow
it).

Taps folded into channels (``ConvConfig.fold_taps``, the default wherever
:func:`can_fold_taps`): where a call reduces all of a tap's channels (``bc * c_step = C'``),
no dilation widens the filter and there are no groups, one call reduces a whole filter row,
``S*C'`` values (:meth:`ConvProblem.taps_folded`).  Output column ``q`` reads
input columns ``q*sw .. q*sw + S-1``, whose channels are consecutive in X: the A rows of the
call are X's rows at a stride of ``sw*C'`` elements, each ``S*C'`` long, overlapping when
``S > sw``, and the ``S`` taps' ``[C', bk]`` weight panels are consecutive in W too.  The
kernel reads both through views of its parameters, so its signature, and the packing, stay
those of the conv.  The accumulators then stay in registers across the S taps: a 3x3 conv
makes 3 calls per output tile instead of 9 (ResNet-50's and VGG-19's 3x3 convs 1.00-1.10x
on a Zen 3, one thread), and an RGB stem (C = 3) reduces 21 values a call instead of 3.

Filter rows batched (``ConvConfig.batch_rows``, the default off AMX wherever the taps fold
and the filter has several rows): one call reduces the R filter rows too, as the batch of a
``batched_a`` BRGEMM whose A blocks are the R input rows, a row pitch apart, and whose B runs
on along K through a view of W with its taps and channels as one axis (:func:`weight_shape`'s
``taps_in_k``).  The rows over the zero border are left out inside the call
(``skips_blocks``: counts the schedule binds per output row, :meth:`_Border.skipped_rows`).
The tile's one call starts from zero and takes its epilogue in registers (int8 3x3 convs
1.004-1.05x alone on a Zen 4).  The border columns too, as oneDNN narrows the filter there:
a call whose block starts (ends) the map leaves out its first (last) output column's products
with the taps over the left (right) zero border (``edge_k``, :func:`edge_columns`; flags the
schedule binds per column block): a third of a 3x3 conv's products on those columns, a tenth
of all on a 7x7 map (int8 VGG-19 1.011x / 1.025x at batch 8 / 1, ResNet-50 1.008-1.012x at
batch 8, on a Zen 4; outputs unchanged).

Operand types
-------------
``ConvProblem.dtype`` is X's type, with the GEMM template's kernel families
(:data:`schedules.operands.OPERANDS`): ``"float32"``; ``"bfloat16"`` (bf16 W, float32
accumulation, ``vnni2``); ``"uint8"`` (u8 X by s8 W, int32 accumulation, ``vnni4``).  The
dot-product instructions reduce VNNI groups of ``a`` = 2 or 4 consecutive channels, so the
channels are padded to whole groups, ``C' = padded_c``: the weight with zeros
(:func:`pack_weight`), the input by its producer with any value (:func:`pack_input` takes
a ``pad_value``; it meets zero weights).  Spatial padding takes the same ``pad_value``: a
quantized input pads with its zero point, so that padded pixels are real zeros, and the
caller folds the zero point out (the bias absorbs ``-zx * sum W``).  The
epilogue starts from the accumulator, except that an int32 one meets a chain that takes floats
only (``scale`` first: dequantization) converted to float32.  A uint8 conv writes int32,
float32 (dequantized) or uint8/int8 (``requantize``); float32 convs write float32, bf16
ones float32 or bf16 (a ``convert`` epilogue: a bf16 producer of bf16 convs).
On ``amx`` tile-shaped blocks run AMX tiles (the defaults choose such blocks), others the
AVX-512 kernel (:func:`microkernels.brgemm.find_impl`'s fallback).  The tiles read X in place:
a function parameter, whose bf16 TVM keeps as bf16 (only buffers a function allocates become
float32).

Examples
--------
>>> p = ConvProblem(n=1, c=64, h=56, w=56, k=64, r=3, s=3, padding=1)
>>> (p.p, p.q, p.input_shape)
(56, 56, (1, 58, 58, 64))
>>> cfg = ConvConfig(bq=28, bc=64, bk=64)
>>> sch = schedule(p, cfg, isa="avx2")       # doctest: +SKIP
>>> q = ConvProblem(n=1, c=3, h=8, w=8, k=16, r=3, s=3, padding=1, dtype="uint8")
>>> (q.padded_c, q.input_shape, q.layout, q.out_dtype)
(4, (1, 10, 10, 4), 'vnni4', 'int32')
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np

from microkernels import amx as _amx
from microkernels import isa as _isa
from microkernels import x86 as _x86
from microkernels.brgemm import LAYOUTS, BrgemmShape, dispatch, edge_rows, skipped_blocks
from microkernels.epilogue import Epilogue, expression_isa, vector_lanes
from microkernels.machine import Machine
from microkernels.pack import Packing, padded

from .blocking import divisors, near_divisors, vector_block
from .gemm import _k_block, _tile_blocks, _tile_rows, _tile_width, _weight_values
from .kernel_buffers import redirect
from .loop_spec import LoopDecl, LoopSpec, LoopSpecError, parse
from .nest import (
    bind_call_vars,
    bind_first_call,
    block_realize,
    check_exact,
    check_run_time_loop,
    finish_nest,
    guard,
    nest_loops,
    zeroing_kernel,
)
from .operands import OPERANDS, TypedProblem

if TYPE_CHECKING:
    from tvm import s_tir, te, tirx
    from tvm.s_tir import SBlockRV
    from tvm.tirx import PrimFunc

__all__ = [
    "ConvProblem",
    "ConvConfig",
    "LETTERS",
    "workload",
    "schedule",
    "default_config",
    "can_fold_taps",
    "can_batch_rows",
    "rows_batch_pays",
    "one_row_pays",
    "fold_rows_pays",
    "fold_rows_weight",
    "IMAGE_CHANNELS",
    "candidates",
    "ORDERS",
    "pack_input",
    "pack_weight",
    "reference",
    "weight_shape",
]

#: Loop letters in declaration order: N, Cb, Kb, P, Q blocks, R, S ([PL] Listing 4).
LETTERS = "abcdefg"
_REDUCTIONS = frozenset("bfg")
#: Elementwise ops a prologue applies to the input, per input channel.
_PROLOGUE_KINDS = frozenset({"scale", "bias", "relu"})

#: X's dtype -> the dtypes a conv may write (a chain's last op decides; a float32 conv
#: requantizes where it computes a quantized layer: ``Machine.int8_in_float``).
_OUT_DTYPES: dict[str, tuple[str, ...]] = {
    "float32": ("float32", "uint8", "int8"),
    "bfloat16": ("float32", "bfloat16"),
    "uint8": ("int32", "float32", "uint8", "int8"),
}


def _pair(value, what: str, n: int) -> tuple[int, ...]:
    values = (value,) * n if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        values = tuple(values)
    except TypeError:
        raise TypeError(f"{what} must be an int or a tuple of {n} ints, got {value!r}") from None
    if len(values) != n or any(not isinstance(v, int) or isinstance(v, bool) for v in values):
        raise TypeError(f"{what} must be an int or a tuple of {n} ints, got {value!r}")
    return values


class ConvGeometry(TypedProblem):
    """What a 2-D convolution problem's fields give, and their validation: ``n, h, w, r, s``,
    ``k`` (output channels), ``stride``, ``padding``, ``dilation``, ``dtype`` and ``epilogue``
    (the conv and depthwise templates' problems mix it in).  A dilated filter's taps are
    ``dilation`` input pixels apart: it spans :attr:`span` pixels."""

    def _validate(self, dims: tuple[str, ...], template: str, writer: str) -> None:
        """Check the fields (``dims`` positive ints) and normalize stride and padding;
        ``template`` and ``writer`` name the template and the conv in the messages."""
        for dim in dims:
            value = getattr(self, dim)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{type(self).__name__}.{dim} must be a positive int, "
                                 f"got {value!r}")
        object.__setattr__(self, "stride", _pair(self.stride, "stride", 2))
        object.__setattr__(self, "padding", _pair(self.padding, "padding", 4))
        object.__setattr__(self, "dilation", _pair(self.dilation, "dilation", 2))
        if min(self.stride) < 1:
            raise ValueError(f"strides must be >= 1, got {self.stride}")
        if min(self.padding) < 0:
            raise ValueError(f"padding must be >= 0, got {self.padding}")
        if min(self.dilation) < 1:
            raise ValueError(f"dilations must be >= 1, got {self.dilation}")
        span_h, span_w = self.span
        if self.hp < span_h or self.wp < span_w:
            dilated = "" if self.dilation == (1, 1) else f" dilated by {self.dilation}"
            raise ValueError(f"a {self.r}x{self.s} filter{dilated} does not fit the "
                             f"{self.h}x{self.w} input padded by {self.padding}")
        if self.dtype not in OPERANDS:
            raise ValueError(f"the {template} template handles {', '.join(OPERANDS)}, "
                             f"got {self.dtype!r}")
        if not isinstance(self.epilogue, Epilogue):
            raise TypeError(f"epilogue must be an Epilogue, got {type(self.epilogue).__name__}")
        out = self.out_dtype  # raises for chains that do not type-check
        allowed = _OUT_DTYPES[self.dtype]
        if out not in allowed:
            raise ValueError(f"a {self.dtype} {writer} writes {' or '.join(allowed)}, not "
                             f"{out} (epilogue {self.epilogue.name!r})")

    @property
    def hp(self) -> int:
        """Padded input height."""
        return self.h + self.padding[0] + self.padding[2]

    @property
    def wp(self) -> int:
        """Padded input width."""
        return self.w + self.padding[1] + self.padding[3]

    @property
    def span(self) -> tuple[int, int]:
        """Input rows and columns one output pixel's filter covers: ``(R-1)*dh+1, (S-1)*dw+1``."""
        dh, dw = self.dilation
        return (self.r - 1) * dh + 1, (self.s - 1) * dw + 1

    @property
    def p(self) -> int:
        """Output height."""
        return (self.hp - self.span[0]) // self.stride[0] + 1

    @property
    def q(self) -> int:
        """Output width."""
        return (self.wp - self.span[1]) // self.stride[1] + 1

    @property
    def output_shape(self) -> tuple[int, int, int, int]:
        """NCHW shape of the result."""
        return (self.n, self.k, self.p, self.q)

    @property
    def rows(self) -> int:
        """Output pixels ``N*P*Q``: the rows of the ``[rows, K]`` output matrix."""
        return self.n * self.p * self.q

    def live_taps(self) -> tuple[slice, slice]:
        """The filter rows and columns that read the input for some output pixel: the taps
        outside them read only padding (a dilated filter larger than its input, as DeepLab's
        rate-18 convs on small feature maps), so with zero padding they add nothing.

        Examples
        --------
        >>> from schedules.depthwise import DepthwiseProblem
        >>> DepthwiseProblem(1, 8, 16, 16, 3, 3, padding=18, dilation=18).live_taps()
        (slice(1, 2, None), slice(1, 2, None))
        >>> DepthwiseProblem(1, 8, 16, 16, 3, 3, padding=12, dilation=12).live_taps()
        (slice(0, 3, None), slice(0, 3, None))
        """
        def live(extent: int, size: int, before: int, stride: int, dilation: int, out: int):
            # Tap t reads unpadded index o*stride + t*dilation - before for o in [0, out).
            alive = [t for t in range(extent) if (out - 1) * stride + t * dilation - before >= 0
                     and t * dilation - before < size]
            return slice(alive[0], alive[-1] + 1) if alive else slice(0, extent)

        top, left, _, _ = self.padding
        return (live(self.r, self.h, top, self.stride[0], self.dilation[0], self.p),
                live(self.s, self.w, left, self.stride[1], self.dilation[1], self.q))

    def without_dead_taps(self) -> ConvGeometry:
        """The same problem without the filter rows and columns :meth:`live_taps` leaves out
        (padding reduced to keep every output pixel where it is): the same result where the
        input pads with zeros.  The problem itself if no tap is dead or the padding cannot
        shrink so.

        >>> from schedules.depthwise import DepthwiseProblem
        >>> p = DepthwiseProblem(1, 8, 16, 16, 3, 3, padding=18, dilation=18)
        >>> q = p.without_dead_taps()
        >>> (q.r, q.s, q.padding, q.output_shape == p.output_shape)
        (1, 1, (0, 0, 0, 0), True)
        """
        rows, cols = self.live_taps()
        if (rows.start, rows.stop, cols.start, cols.stop) == (0, self.r, 0, self.s):
            return self
        top, left, bottom, right = self.padding
        (dh, dw), (sh, sw) = self.dilation, self.stride
        r, s = rows.stop - rows.start, cols.stop - cols.start
        top, left = top - rows.start * dh, left - cols.start * dw
        # The smallest padding after the input that keeps the output's size.
        bottom = max(0, (self.p - 1) * sh + (r - 1) * dh + 1 - self.h - top)
        right = max(0, (self.q - 1) * sw + (s - 1) * dw + 1 - self.w - left)
        if min(top, left) < 0:
            return self
        trimmed = replace(self, r=r, s=s, padding=(top, left, bottom, right))
        return trimmed if (trimmed.p, trimmed.q) == (self.p, self.q) else self


@dataclass(frozen=True)
class ConvProblem(ConvGeometry):
    """``Y = epilogue(conv2d(X, W))``: NCHW input, OIHW weights, X in ``dtype``.

    Parameters
    ----------
    n, c, h, w
        Input batch, channels, height, width.
    k, r, s
        Output channels and filter height, width.
    stride
        ``(sh, sw)`` or one int for both.
    padding
        ``(top, left, bottom, right)`` (Relax's order) or one int for all four.
    dtype
        X's type (:data:`schedules.operands.OPERANDS`): ``"float32"``, ``"bfloat16"`` (bf16 W,
        float32 accumulation) or ``"uint8"`` (s8 W, int32 accumulation).
    epilogue
        Elementwise chain on the ``[N*P*Q, K]`` output, from :attr:`epilogue_dtype`: bias
        and scale are per output channel (``"row"``), a residual is a full NHWC tensor.
        float32 and bfloat16 convs write float32; uint8 ones int32, float32 (dequantized:
        ``scale`` first) or uint8/int8 (``requantize`` last).
    dilation
        ``(dh, dw)`` or one int for both: the filter's taps are that many input pixels apart.
    groups
        Channel groups: output channel ``o`` reduces the ``C/groups`` input channels of group
        ``o // (K/groups)`` (weights ``[K, C/groups, R, S]``).  In low precision each group's
        channels are whole VNNI groups.
    zero_border
        The packed input's border (the padding) holds zeros, so a filter row over border
        rows only adds nothing and the kernel skips it (:func:`schedule`).  False for a
        quantized input padded with a non-zero zero point.
    prologue
        Elementwise chain applied to the input before the conv, per input channel:
        ``scale``, ``bias`` (``[C]`` operands, after W among the kernel's parameters, names
        apart from the epilogue's) and ``relu``.  float32 and bf16 1x1 convs of stride 1,
        unpadded and ungrouped only (module doc).
    prologue_input
        The stored X's dtype where there is a prologue (:attr:`input_dtype`): ``float32``, or
        for a bf16 conv ``bfloat16``, widened to float32 for the prologue.
    narrow_weights
        W's int8 values lie in [-64, 64] (:func:`schedules.operands.narrow`): on x86 without
        VNNI the kernel multiplies them with ``vpmaddubsw``, exactly
        (:meth:`~schedules.operands.TypedProblem.brgemm_layout`).

    Examples
    --------
    >>> ConvProblem(1, 3, 224, 224, 64, 7, 7, stride=2, padding=3).output_shape
    (1, 64, 112, 112)
    >>> from microkernels.epilogue import EpilogueOp
    >>> dequant = Epilogue((EpilogueOp("scale", broadcast="row"), EpilogueOp("bias")))
    >>> p = ConvProblem(1, 21, 8, 8, 24, 1, 1, dtype="uint8", epilogue=dequant)
    >>> (p.acc_dtype, p.weight_dtype, p.alpha, p.padded_c, p.epilogue_dtype, p.out_dtype)
    ('int32', 'int8', 4, 24, 'float32', 'float32')
    >>> ConvProblem(1, 3, 4, 4, 8, 5, 5)
    Traceback (most recent call last):
    ...
    ValueError: a 5x5 filter does not fit the 4x4 input padded by (0, 0, 0, 0)
    >>> g = ConvProblem(1, 12, 9, 9, 6, 3, 3, padding=2, dilation=2, groups=3)
    >>> (g.output_shape, g.span, g.group_c, g.group_k, g.flops)
    ((1, 6, 9, 9), (5, 5), 4, 2, 34992)
    """

    n: int
    c: int
    h: int
    w: int
    k: int
    r: int
    s: int
    stride: tuple[int, int] | int = (1, 1)
    padding: tuple[int, int, int, int] | int = (0, 0, 0, 0)
    dtype: str = "float32"
    epilogue: Epilogue = field(default_factory=Epilogue)
    dilation: tuple[int, int] | int = (1, 1)
    groups: int = 1
    zero_border: bool = True
    prologue: Epilogue = field(default_factory=Epilogue)
    narrow_weights: bool = False
    prologue_input: str = "float32"

    def __post_init__(self) -> None:
        self._validate(("n", "c", "h", "w", "k", "r", "s", "groups"), "conv", "conv")
        self._check_narrow_weights()
        if not isinstance(self.zero_border, bool):
            raise TypeError(f"zero_border must be a bool, got {self.zero_border!r}")
        self._check_prologue()
        if self.c % self.groups or self.k % self.groups:
            raise ValueError(f"groups={self.groups} must divide C={self.c} and K={self.k}")
        if self.groups > 1 and (self.c // self.groups) % self.alpha:
            raise ValueError(f"a grouped {self.dtype} conv needs whole VNNI groups of "
                             f"{self.alpha} channels per group, got {self.c // self.groups}")

    def _check_prologue(self) -> None:
        if not isinstance(self.prologue, Epilogue):
            raise TypeError(f"prologue must be an Epilogue, got {type(self.prologue).__name__}")
        if self.prologue_input not in ("float32", "bfloat16"):
            raise ValueError(f"prologue_input must be float32 or bfloat16, got "
                             f"{self.prologue_input!r}")
        if not self.prologue.ops:
            if self.prologue_input != "float32":
                raise ValueError("prologue_input is the input of a prologue: there is none")
            return
        if self.prologue_input == "bfloat16" and self.dtype != "bfloat16":
            raise ValueError("only a bf16 conv's prologue reads bf16 input")
        # Input pixels map one to one onto output pixels: no border the chain would change.
        if (self.dtype not in ("float32", "bfloat16") or (self.r, self.s) != (1, 1)
                or self.stride != (1, 1) or any(self.padding) or self.groups != 1
                or self.padded_c != self.c):
            raise ValueError("a prologue needs a float32 or bf16 1x1 conv of stride 1, "
                             "without padding, groups or padded channels")
        for op in self.prologue.ops:
            per_channel = op.broadcast in ("", "row") or op.value is not None
            if op.kind not in _PROLOGUE_KINDS or not per_channel:
                raise ValueError(f"a prologue takes {', '.join(sorted(_PROLOGUE_KINDS))} per "
                                 f"input channel, got {op.tag!r}")
        names = {o.name for o in self.prologue.inputs()} & {
            o.name for o in self.epilogue.inputs(self.epilogue_dtype)}
        if names:
            raise ValueError(f"prologue and epilogue operands share names {sorted(names)}")

    @property
    def layout(self) -> str:
        """The BRGEMM layout of the packed weight: ``flat``, ``vnni2`` or ``vnni4``."""
        return OPERANDS[self.dtype][1]


    @property
    def alpha(self) -> int:
        """Channels per VNNI group of the packed weight (1: not grouped)."""
        return LAYOUTS[self.layout][0]

    @property
    def padded_c(self) -> int:
        """C rounded up to whole VNNI groups: the channels of the packed input."""
        return padded(self.c, self.alpha)

    @property
    def group_c(self) -> int:
        """The channels one output channel reduces, which the channel blocks tile: the
        padded C, or a group's C/groups channels (whole VNNI groups already)."""
        return self.padded_c if self.groups == 1 else self.c // self.groups

    @property
    def group_k(self) -> int:
        """Output channels per group: K/groups (the K blocks stay within one group)."""
        return self.k // self.groups

    @property
    def wq(self) -> int:
        """Input column groups of ``sw``: the padded width is ``wq * sw`` (rounded up)."""
        return -(-self.wp // self.stride[1])

    @property
    def input_dtype(self) -> str:
        """The dtype of the stored X: :attr:`prologue_input` for a conv with a prologue (a bf16
        conv rounds the prologue's result to bf16 as it computes it); else :attr:`dtype`."""
        return self.prologue_input if self.prologue.ops else self.dtype

    @property
    def prologue_name(self) -> str:
        """The prologue's ops, after ``bf16_`` where it reads bf16 input ('' without one):
        kernel names and tuning keys tell the two inputs apart."""
        if not self.prologue.ops:
            return ""
        return ("bf16_" if self.prologue_input == "bfloat16" else "") + self.prologue.name

    @property
    def input_shape(self) -> tuple[int, int, int, int]:
        """Shape of the packed input ``X[N][Hp][Wq][sw*C']`` (``C' = padded_c``)."""
        return (self.n, self.hp, self.wq, self.stride[1] * self.padded_c)

    @property
    def flops(self) -> int:
        return 2 * self.rows * self.k * (self.c // self.groups) * self.r * self.s

    @property
    def pointwise(self) -> bool:
        """A 1x1 conv of stride 1 without padding or groups: a GEMM over its pixels."""
        return ((self.r, self.s) == (1, 1) and self.stride == (1, 1) and not any(self.padding)
                and self.groups == 1)

    def one_row(self) -> ConvProblem:
        """The same pointwise conv over its ``N*P*Q`` pixels as one image of one row: the same
        NHWC memory, its output tiles free to span image rows (a 7x7 map tiles by at most 7
        pixels otherwise).

        >>> ConvProblem(8, 512, 7, 7, 2048, 1, 1).one_row().input_shape
        (1, 1, 392, 512)
        """
        if not self.pointwise or self.prologue.ops:
            raise ValueError("only a pointwise conv without a prologue is one row of pixels")
        return replace(self, n=1, h=1, w=self.rows)

    def taps_folded(self) -> ConvProblem:
        """The same convolution with the S taps of a filter row as channels: what a kernel
        that folds its taps computes (module doc).

        Input column ``q`` of its input holds the ``S*C'`` values output column ``q`` reads
        in one filter row, ``X'[n, h, q, s*C' + c] = Xpad[n, h, q*sw + s*dw, c]``, each tap's
        channels padded to whole VNNI groups (``C' = padded_c``).  The filter becomes
        ``R x 1`` over ``S*C'`` channels (a height dilation stays; groups 1); dtype and
        epilogue stay.

        Examples
        --------
        >>> p = ConvProblem(1, 3, 224, 224, 64, 7, 7, stride=2, padding=3).taps_folded()
        >>> (p.c, p.w, p.s, p.stride, p.padding, p.q)
        (21, 112, 1, (2, 1), (3, 0, 3, 0), 112)
        >>> ConvProblem(1, 3, 16, 16, 8, 7, 7, padding=3, dtype="uint8").taps_folded().c
        28
        """
        if self.groups != 1:
            raise ValueError("only an ungrouped conv folds its taps")
        top, _, bottom, _ = self.padding
        return ConvProblem(self.n, self.s * self.padded_c, self.h, self.q, self.k, self.r, 1,
                           stride=(self.stride[0], 1), padding=(top, 0, bottom, 0),
                           dtype=self.dtype, epilogue=self.epilogue,
                           dilation=(self.dilation[0], 1), zero_border=self.zero_border,
                           narrow_weights=self.narrow_weights)

    def rows_folded(self) -> ConvProblem:
        """The same convolution with the R rows of the filter as input channels: one kernel
        call then reduces the whole ``R x S`` filter, where a call per filter row of an image's
        few channels reduces a handful of values (:func:`fold_rows_pays`).

        Row ``p`` of its input stacks the R input rows output row ``p`` reads,
        ``X''[n, r*C + c, p, w] = Xpad[n, c, p*sh + r*dh, w]`` (NCHW, rows padded, columns
        not: :func:`fold_rows_weight` orders the filter alike).  The filter becomes ``1 x S``
        over ``R*C`` channels, of stride ``(1, sw)`` and padding ``(0, left, 0, right)``;
        dtype, epilogue and border stay.  Ungrouped convs without a prologue only.

        Examples
        --------
        >>> p = ConvProblem(8, 3, 224, 224, 64, 7, 7, stride=2, padding=3)
        >>> f = p.rows_folded()
        >>> (f.c, f.h, f.w, f.r, f.s, f.stride, f.padding, f.output_shape == p.output_shape)
        (21, 112, 224, 1, 7, (1, 2), (0, 3, 0, 3), True)
        """
        if self.groups != 1 or self.prologue.ops:
            raise ValueError("only an ungrouped conv without a prologue folds its filter rows")
        _, left, _, right = self.padding
        return replace(self, c=self.r * self.c, h=self.p, r=1, stride=(1, self.stride[1]),
                       padding=(0, left, 0, right), dilation=(1, self.dilation[1]))


@dataclass(frozen=True)
class ConvConfig:
    """Block sizes and the loop_spec of one convolution.

    Parameters
    ----------
    bq
        Output columns per BRGEMM (its ``m``); divides Q.
    bc
        Input channels per BRGEMM batch element (its ``k``); divides the problem's
        ``group_c`` and takes whole VNNI groups (a multiple of its ``alpha``).
    bk
        Output channels per tile (the BRGEMM's ``n``, the vector dimension); divides K
        (a grouped conv's K/groups: a tile stays within one group).
    spec
        loop_spec over :data:`LETTERS`; upper-case loops run in parallel.  Reductions
        (``b``, ``f``, ``g``) cannot be parallel.
    c_step
        Channel blocks one BRGEMM call reduces (its ``batch``): step of ``b``.
    block_steps
        Letter -> block steps, outer first, for letters that occur more than once.
    fold_taps
        One BRGEMM call per filter row, its S taps folded into the channel reduction
        (module doc; :func:`can_fold_taps` says where it can).
    batch_rows
        With ``fold_taps``, one call per output tile: the R filter rows as the call's batch,
        each block of A a row of the image after the last (a ``batched_a`` BRGEMM), the
        filter's rows running on along K; the rows over a zero border are left out inside
        the call (``skips_blocks``), as the calls per row over them are skipped.  The
        accumulators then stay in registers across the whole filter, and the call, the
        tile's only one, starts from zero and feeds the epilogue in registers
        (:mod:`schedules.register_epilogue`; :func:`rows_batch_pays`).

    Examples
    --------
    >>> ConvConfig(bq=28, bc=64, bk=64, spec="ACDebfg").spec
    'ACDebfg'
    """

    bq: int
    bc: int
    bk: int
    spec: str = "ACDebfg"
    c_step: int = 1
    block_steps: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    fold_taps: bool = False
    batch_rows: bool = False

    def __post_init__(self) -> None:
        for name in ("bq", "bc", "bk", "c_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ConvConfig.{name} must be a positive int, got {value!r}")
        for name in ("fold_taps", "batch_rows"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ConvConfig.{name} must be a bool, got "
                                f"{getattr(self, name)!r}")
        if self.batch_rows and not self.fold_taps:
            raise ValueError("batch_rows batches the rows of folded taps: it needs fold_taps")
        if not isinstance(self.spec, str):
            raise TypeError(f"spec must be a str, got {type(self.spec).__name__}")
        bad = set(self.block_steps) - set(LETTERS)
        if bad:
            raise ValueError(f"block_steps keys must be conv loop letters a-g, got {sorted(bad)}")
        steps = {k: tuple(self.block_steps[k]) for k in sorted(self.block_steps)}
        object.__setattr__(self, "block_steps", MappingProxyType(steps))

    def __hash__(self) -> int:
        return hash((self.bq, self.bc, self.bk, self.spec, self.c_step,
                     tuple(self.block_steps.items()), self.fold_taps, self.batch_rows))

    def check(self, problem: ConvProblem) -> None:
        """ValueError unless the blocks tile ``problem`` exactly."""
        channels = ("C/groups" if problem.groups > 1
                    else "C" if problem.padded_c == problem.c else "padded C")
        outputs = "K/groups" if problem.groups > 1 else "K"
        for block, dim, name, what in ((self.bq, problem.q, "bq", "Q"),
                                       (self.bc, problem.group_c, "bc", channels),
                                       (self.bk, problem.group_k, "bk", outputs)):
            if dim % block:
                raise ValueError(f"{name}={block} does not divide {what}={dim}")
        if self.bc % problem.alpha:
            raise ValueError(f"bc={self.bc} is not a multiple of {problem.alpha}, the VNNI "
                             f"group of {problem.dtype} convs")
        if (problem.group_c // self.bc) % self.c_step:
            raise ValueError(f"c_step={self.c_step} does not divide "
                             f"{channels}/bc={problem.group_c // self.bc}")
        if self.fold_taps and not can_fold_taps(problem, self):
            raise ValueError("fold_taps needs S > 1 taps, a call over all of a tap's channels "
                             "(bc * c_step = C'), no width dilation or groups, and b and g "
                             "unblocked")
        if self.batch_rows and not can_batch_rows(problem, self):
            raise ValueError("batch_rows needs R > 1 filter rows without height dilation, "
                             "and f unblocked, after the channel-block loop b")

    def loops(self, problem: ConvProblem) -> tuple[LoopDecl, ...]:
        """The seven logical loops of ``problem``, in block units."""
        self.check(problem)
        extents = (("N", problem.n), ("Cb", problem.group_c // self.bc),
                   ("Kb", problem.k // self.bk),
                   ("P", problem.p), ("Qb", problem.q // self.bq), ("R", problem.r),
                   ("S", problem.s))
        return tuple(
            LoopDecl(name, extent, step=self.c_step if letter == "b" else 1,
                     block_steps=self.block_steps.get(letter, ()),
                     reduction=letter in _REDUCTIONS)
            for letter, (name, extent) in zip(LETTERS, extents, strict=True))

    def parse(self, problem: ConvProblem) -> LoopSpec:
        """The parsed loop_spec (LoopSpecError if it does not fit).  A conv with a prologue
        computes it once per pixel tile, for every K block: its K- and channel-block loops
        must run inside its pixel loops (``ADEcbfg``; ``ACbfgde`` would repeat the prologue
        for each K block)."""
        spec = parse(self.spec, self.loops(problem))
        check_exact(spec)
        if problem.prologue.ops:
            looping = [o for o in spec.occurrences if o.trips > 1]
            pixels = [o.position for o in looping if o.letter in "ade"]
            blocks = [o for o in looping if o.letter in "bc"]
            if pixels and blocks and blocks[0].position < max(pixels):
                raise LoopSpecError("a conv with a prologue needs its K- and channel-block "
                                    "loops (c, b) inside its pixel loops (a, d, e)",
                                    self.spec, blocks[0].position)
        return spec


def weight_shape(problem: ConvProblem, bk: int, taps_in_k: bool = False) -> tuple[int, ...]:
    """Shape of the packed weight (:func:`pack_weight`) for output-channel blocks of ``bk``;
    with ``taps_in_k`` the same memory with each K block's taps and channels as one
    reduction axis (what a call over several filter rows reads as its B).

    >>> p = ConvProblem(1, 3, 8, 8, 32, 3, 3, dtype="uint8")
    >>> weight_shape(p, 16), weight_shape(p, 16, taps_in_k=True)
    ((2, 3, 3, 1, 16, 4), (2, 9, 16, 4))
    """
    k, r, s, c, alpha = problem.k, problem.r, problem.s, problem.group_c, problem.alpha
    if problem.group_k % bk:
        raise ValueError(f"bk={bk} does not divide K={k}"
                         + (f"/{problem.groups}" if problem.groups > 1 else ""))
    group = (alpha,) if alpha > 1 else ()
    if taps_in_k:
        return (k // bk, r * s * c // alpha, bk, *group)
    return (k // bk, r, s, c // alpha, bk, *group)


def workload(problem: ConvProblem, bk: int, batch: tirx.Var | None = None,
             isa: str = "generic", taps_in_k: bool = False) -> PrimFunc:
    """The unscheduled PrimFunc ``(X, W, *epilogue operands, Y)`` (layouts: module doc);
    with a run-time ``batch`` (a symbolic batch: the parameter before the output) it has
    ``batch * problem.n`` images; the epilogue's expressions are ``isa``'s
    (:func:`microkernels.epilogue.apply_te`); with ``taps_in_k`` W is declared as
    :func:`weight_shape`'s ``taps_in_k`` view.

    Products are taken in the accumulator's dtype; an epilogue starting in float32 from an
    int32 accumulator reads it converted (dequantization), in the ``view`` stage the
    schedule inlines."""
    from tvm import te

    from microkernels.epilogue import apply_te

    p, q, c, k, alpha = problem.p, problem.q, problem.padded_c, problem.k, problem.alpha
    sh, sw = problem.stride
    dh, dw = problem.dilation
    acc = problem.acc_dtype
    images = problem.n if batch is None else batch * problem.n
    rows = images * p * q
    x = te.placeholder((images, *problem.input_shape[1:]), problem.input_dtype, name="X")
    w = te.placeholder(weight_shape(problem, bk, taps_in_k), problem.weight_dtype, name="W")
    rr = te.reduce_axis((0, problem.r), name="r")
    rs = te.reduce_axis((0, problem.s), name="s")
    rc = te.reduce_axis((0, problem.group_c), name="c")

    def weight(o):  # W[o, rc, rr, rs] in the packed layout
        if taps_in_k:
            at = (rr * problem.s + rs) * problem.group_c + rc
            return w[o // bk, at, o % bk] if alpha == 1 else \
                w[o // bk, at // alpha, o % bk, at % alpha]
        if alpha == 1:
            return w[o // bk, rr, rs, rc, o % bk]
        return w[o // bk, rr, rs, rc // alpha, o % bk, rc % alpha]

    pre_extra, pre = _prologue_te(problem, x, rows, isa)

    def product(n, i, j, o):
        row = rr * dh if dh > 1 else rr  # the tap's offset in the padded input
        col = rs * dw if dw > 1 else rs
        # A group's channels: output channel o reads those of its group only.
        channel = rc if problem.groups == 1 else o // problem.group_k * problem.group_c + rc
        if pre is not None:  # 1x1, stride 1, unpadded: output pixel (n, i, j) is input pixel
            value = pre[(n * p + i) * q + j, rc]
        else:
            value = x[n, i * sh + row, j + col // sw, col % sw * c + channel]
        if problem.dtype == acc:  # float32: no casts in the expression
            return value * weight(o)
        return value.astype(acc) * weight(o).astype(acc)

    conv = te.compute((images, p, q, k),
                      lambda n, i, j, o: te.sum(product(n, i, j, o), axis=[rr, rs, rc]),
                      name="conv")
    start = problem.epilogue_dtype
    extra = {op.name: te.placeholder(op.shape(rows, k), op.dtype, name=op.name)
             for op in problem.epilogue.inputs(start)}
    scalars = [] if batch is None else [batch]
    if not problem.epilogue.ops:
        return te.create_prim_func([x, w, *pre_extra, *scalars, conv])
    # The epilogue is a 2-D chain: it reads the conv through a [rows, K] view (converted
    # to float32 when it dequantizes), which the schedule inlines once the conv's buffer
    # itself is laid out as that matrix.

    def view_value(i, o):
        value = conv[i // (p * q), i // q % p, i % q, o]
        return value if start == acc else value.astype(start)

    view = te.compute((rows, k), view_value, name="view")
    y = apply_te(problem.epilogue, view, extra, isa=isa)
    return te.create_prim_func([x, w, *pre_extra, *extra.values(), *scalars, y])


def _prologue_te(problem: ConvProblem, x: te.Tensor, rows: tirx.PrimExpr, isa: str
                 ) -> tuple[list[te.Tensor], te.Tensor | None]:
    """The prologue's operands and its ``[rows, C]`` stage ``prologue`` over X's pixels
    (through a ``prologue_view`` stage the schedule inlines), rounded to bf16 by ``isa``'s
    conversion for a bf16 conv; no stage without a prologue."""
    from tvm import te

    from microkernels.epilogue import EpilogueOp, apply_te, from_bf16

    if not problem.prologue.ops:
        return [], None
    chain = problem.prologue
    if problem.dtype == "bfloat16":
        chain = Epilogue((*chain.ops, EpilogueOp("convert", dtype="bfloat16")))
    p, q = problem.p, problem.q
    def pixel(i, ch):  # widened where X is bf16: the chain runs in float32
        value = x[i // (p * q), i // q % p, i % q, ch]
        return value if problem.prologue_input == "float32" else from_bf16(value)

    view = te.compute((rows, problem.c), pixel, name="prologue_view")
    extra = {op.name: te.placeholder(op.shape(rows, problem.c), op.dtype, name=op.name)
             for op in problem.prologue.inputs()}
    return list(extra.values()), apply_te(chain, view, extra, name="prologue",
                                          isa=expression_isa(isa, problem.c))


def schedule(problem: ConvProblem, config: ConvConfig, isa: str | _isa.Isa = "avx2",
             batch: tirx.Var | None = None) -> s_tir.Schedule:
    """The scheduled convolution: loop_spec outer loops around the ISA's BRGEMM for the
    problem's dtype and layout (:func:`microkernels.brgemm.dispatch`; on ``amx`` the tile
    kernel when the blocks are tile-shaped, else the AVX-512 one).  With a run-time
    ``batch`` (a symbolic batch: the parameter before the output) the images loop runs
    ``batch * problem.n`` times around the static rest.

    Raises
    ------
    LoopSpecError
        The spec is malformed, misses a loop, parallelizes a reduction, or does not tile.
    ValueError
        Block sizes do not tile the problem, or ``bc`` takes no whole VNNI groups.
    """
    from tvm import s_tir, tirx

    isa_name = isa.name if isinstance(isa, _isa.Isa) else _isa.from_name(isa).name
    config.parse(problem)  # errors in the terms of the conv asked for
    epilogue_isa = expression_isa(isa_name, config.bk)
    rows_batched = config.batch_rows
    edge_k, *edges = edge_columns(problem, config.bq) if rows_batched else (0, False, False)
    if config.fold_taps:  # the same operands, read through views (module doc)
        func = _folded_workload(problem, config.bk, batch, epilogue_isa, rows_batched)
        problem = problem.taps_folded()
        config = replace(config, c_step=problem.c // config.bc, fold_taps=False,
                         batch_rows=False)
    else:
        func = workload(problem, config.bk, batch, epilogue_isa)
    spec = config.parse(problem)
    if batch is not None:
        check_run_time_loop(spec, "a")
    pq = problem.p * problem.q
    sch = s_tir.Schedule(func)
    conv = sch.get_sblock("conv")
    # The accumulator (or the output itself) as the [N*P*Q, K] matrix the epilogue reads:
    # the view stage then inlines to plain 2-D indices.
    sch.transform_layout(conv, ("write", 0),
                         lambda n, i, j, o: (n * pq + i * problem.q + j, o))
    n, p, q, k, r, s, c = sch.get_loops(conv)
    q_blocks, q_body = sch.split(q, [None, config.bq])
    k_blocks, k_body = sch.split(k, [None, config.bk])
    c_blocks, c_body = sch.split(c, [None, config.c_step * config.bc])
    # A 1x1 conv over all channels in one block, or a conv whose calls batch the filter
    # rows: each output tile is one kernel call.
    single_call = all(int(sch.get(loop).extent) == 1
                      for loop in (c_blocks, s) + (() if rows_batched else (r,)))
    logical = dict(zip(LETTERS, (n, c_blocks, k_blocks, p, q_blocks, r, s), strict=True))
    order, grid_loops = nest_loops(sch, spec, logical)
    rows_loop, outer = [], order
    if rows_batched:  # the filter rows inside the tile: the call's batch
        at = next(i for i, o in enumerate(spec.occurrences) if o.letter == "f")
        rows_loop, outer = [(order[at], problem.r)], order[:at] + order[at + 1:]
    sch.reorder(*grid_loops, *outer, q_body, k_body, *(loop for loop, _ in rows_loop), c_body)
    epilogue = None
    if problem.epilogue.ops:
        sch.compute_inline(sch.get_sblock("view"))
        epilogue = sch.get_sblock("epilogue")
    init = finish_nest(sch, spec, order, grid_loops, conv, _REDUCTIONS, epilogue)
    if problem.prologue.ops:
        _prologue_per_pixel_tile(sch, _isa.from_name(isa_name))
    # The BRGEMM desc has no loop for a unit dimension (TVM drops them from the blocks it
    # matches), so each unit loop of the tile is fused into a neighbour.
    inner = [(q_body, config.bq), (k_body, config.bk), *rows_loop,
             (c_body, config.c_step * config.bc)]
    while len(inner) > 1 and any(extent == 1 for _, extent in inner):
        unit = next(i for i, (_, extent) in enumerate(inner) if extent == 1)
        first = min(unit, len(inner) - 2)  # fuse with the loop below, or above if last
        (outer, e0), (under, e1) = inner[first:first + 2]
        inner[first:first + 2] = [(sch.fuse(outer, under), e0 * e1)]
    if inner[0][1] == 1:
        return sch  # a 1x1x1 "GEMM" per step: scalar code is all it needs
    # On amx, blocks that are not tile-shaped get the AVX-512 kernel (find_impl's fallback).
    # The tiles read X in place (a parameter, kept bf16 by TVM) and W's dense VNNI panels.
    # Batched rows: a call's A blocks are the R input rows, each S*C' long (taps folded);
    # the call leaves out those over the zero border, where calls per row are skipped.
    border = _Border(problem, config.bq)
    skips = border.skips and not rows_batched
    shape = BrgemmShape(m=config.bq, n=config.bk,
                        k=problem.c if rows_batched else config.bc,
                        batch=problem.r if rows_batched else config.c_step,
                        dtype_a=problem.dtype, dtype_acc=problem.acc_dtype,
                        layout=problem.brgemm_layout(isa_name), isa=isa_name,
                        batched_a=rows_batched, skips_blocks=rows_batched and border.rows,
                        edge_k=edge_k)
    if single_call or not skips or border.every_tile_live():
        shape = zeroing_kernel(sch, init, shape, whole=single_call)
    call = sch.blockize(inner[0][0])
    sch.tensorize(call, dispatch(shape))
    bound = {}
    if shape.skips_blocks:
        first, last = skipped_blocks()
        bound |= zip((first.name, last.name), border.skipped_rows(sch.get(call)), strict=True)
    if shape.edge_k:
        block = sch.get(call).iter_vars[2]  # iterators (n, i, j, o, r, s, c): j's block
        first, last = (block.var == block.dom.min,
                       block.var == block.dom.min + block.dom.extent - 1)
        bound |= {flag.name: when if edge else tirx.const(False, "bool")
                  for flag, when, edge in zip(edge_rows(), (first, last), edges, strict=True)}
    if bound:
        bind_call_vars(sch, call, bound)
    if skips:
        border.skip(sch, call)
    if shape.first_call_zeroes:
        bind_first_call(sch, call, border.first_call() if skips else None)
    return sch


def can_fold_taps(problem: ConvProblem, config: ConvConfig) -> bool:
    """Whether ``config`` with ``fold_taps`` can reduce each filter row's S taps in one
    BRGEMM call (module doc): a call of it reduces all of a tap's channels, and no width
    dilation or groups keep the taps' channels apart.

    >>> p = ConvProblem(1, 64, 56, 56, 64, 3, 3, padding=1)
    >>> can_fold_taps(p, ConvConfig(28, 64, 16)), can_fold_taps(p, ConvConfig(28, 32, 16))
    (True, False)
    """
    return (problem.s > 1 and problem.dilation[1] == 1 and problem.groups == 1
            and config.bc * config.c_step == problem.padded_c
            and not {"b", "g"} & set(config.block_steps))


def edge_columns(problem: ConvProblem, bq: int) -> tuple[int, bool, bool]:
    """K values of each filter row a call with batched rows leaves out on its block's first
    output column where that is the map's first, and on its last where that is the map's
    last (``BrgemmShape.edge_k``), and whether the map's first and last columns have them:
    the channels of the filter taps that read the zero border there, as oneDNN's kernels
    narrow the filter's width at the edges (as many taps on both sides: the fewer, where both
    sides have some); ``(0, False, False)`` where there are none (no zero border, a width
    dilation, or more than half the filter over the border).

    >>> edge_columns(ConvProblem(1, 62, 14, 14, 64, 3, 3, padding=1, dtype="uint8"), 14)
    (64, True, True)
    >>> edge_columns(ConvProblem(1, 64, 56, 56, 64, 3, 3, padding=1, stride=2), 7)  # even W
    (64, True, False)
    """
    _, left, _, _ = problem.padding
    first = min(left, problem.s)  # taps of output column 0 over the left border
    last = max(0, (problem.q - 1) * problem.stride[1] + problem.s - left - problem.w)
    taps = min(first, last) if first and last else first or last
    if not (problem.zero_border and problem.dilation[1] == 1 and bq > 1
            and 0 < 2 * taps <= problem.s):
        return 0, False, False
    return taps * problem.padded_c, first > 0, last > 0


def can_batch_rows(problem: ConvProblem, config: ConvConfig) -> bool:
    """Whether ``config`` with ``fold_taps`` can also reduce the R filter rows in its one call
    (``batch_rows``): rows a row of the image apart (no height dilation), the spec's ``f``
    unblocked and after its first reduction loop ``b`` (which zeroes the tile).

    >>> p = ConvProblem(1, 64, 56, 56, 64, 3, 3, padding=1)
    >>> can_batch_rows(p, ConvConfig(28, 64, 16, fold_taps=True))
    True
    >>> can_batch_rows(replace(p, dilation=(2, 1), padding=2), ConvConfig(28, 64, 16))
    False
    """
    return (problem.r > 1 and problem.dilation[0] == 1 and "f" not in config.block_steps
            and config.spec.lower().index("b") < config.spec.lower().index("f"))


def _folded_workload(problem: ConvProblem, bk: int, batch: tirx.Var | None, isa: str,
                     taps_in_k: bool = False) -> PrimFunc:
    """The workload of ``problem.taps_folded()`` on ``problem``'s own packed X and W: it
    reads them through views declared over their data (module doc), W's with its filter
    rows along K where ``taps_in_k``."""
    from tvm import tirx

    func = workload(problem.taps_folded(), bk, batch, isa, taps_in_k)
    x_taps, w_taps = func.params[:2]
    _, hp, wq, row = problem.input_shape
    x = tirx.decl_buffer((x_taps.ty.shape[0], hp, wq, row), problem.dtype, "X")
    w = tirx.decl_buffer(weight_shape(problem, bk), problem.weight_dtype, "W")
    # View column q starts at input column q*sw: its S*C' values run on, consecutive.
    x_view = tirx.decl_buffer(x_taps.ty.shape, problem.dtype, "X_taps", data=x.data,
                              strides=(hp * wq * row, wq * row,
                                       problem.stride[1] * problem.padded_c, 1))
    w_view = tirx.decl_buffer(w_taps.ty.shape, problem.weight_dtype, "W_taps", data=w.data)
    on_x = tirx.PrimFunc(func.params, redirect(func, x_taps, x_view), func.ret_type,
                         func.attrs)
    body = redirect(on_x, w_taps, w_view, before=[tirx.DeclBuffer(x_view, data=x.data),
                                                   tirx.DeclBuffer(w_view, data=w.data)])
    return tirx.PrimFunc([x, w, *func.params[2:]], body, func.ret_type, func.attrs)


def _prologue_per_pixel_tile(sch: s_tir.Schedule, target: _isa.Isa) -> None:
    """Compute the prologue under the deepest loop above the conv's first K- or channel-block
    loop: once per pixel tile, into a local tile every K block then reads (the spec puts
    those loops inside the pixel loops: :meth:`ConvConfig.parse`), vectorized over channels."""
    from tvm import tirx

    sch.compute_inline(sch.get_sblock("prologue_view"))
    update = sch.get_sblock("conv_update")
    realize = block_realize(sch, update)
    # The block's iterators are the conv's (n, i, j, o, r, s, c).
    blocks = (realize.iter_values[3], realize.iter_values[6])
    above = None
    for loop in sch.get_loops(update)[:-3]:  # the spec's loops, above the kernel's tile
        stmt = sch.get(loop)
        if int(stmt.extent) > 1 and any(stmt.loop_var.same_as(v) for e in blocks
                                        for v in tirx.analysis.undefined_vars(e)):
            break
        above = loop
    pro = sch.get_sblock("prologue")
    if above is not None:  # else a single pixel tile: the prologue runs once, at the root
        sch.compute_at(pro, above)
    channels = sch.get_loops(pro)[-1]
    # A bf16 conversion instruction takes vectors of its own lanes.
    lanes = vector_lanes(sch.get(pro)) or target.lanes("float32")
    extent = int(sch.get(channels).extent)
    if extent % lanes == 0:
        sch.vectorize(sch.split(channels, [None, lanes])[1])


@dataclass(frozen=True)
class _Border:
    """Which BRGEMM calls of a conv read only its zero border, so add nothing: those whose
    filter row lies in the top or bottom border (``rows``), and those whose filter column
    lies in the left or right border for a whole block of ``bq`` output columns
    (``columns``: a dilated filter on a small map, DeepLab's).

    >>> dilated = _Border(ConvProblem(1, 8, 16, 16, 8, 3, 3, padding=12, dilation=12), 4)
    >>> dilated.rows, dilated.columns
    (True, True)
    >>> _Border(ConvProblem(1, 8, 16, 16, 8, 3, 3, padding=1), bq=4).columns
    False
    """

    problem: ConvProblem
    bq: int

    @functools.cached_property
    def rows(self) -> bool:
        top, _, bottom, _ = self.problem.padding
        return self.problem.zero_border and self.problem.r > 1 and (top > 0 or bottom > 0)

    @functools.cached_property
    def columns(self) -> bool:
        p = self.problem
        return p.zero_border and p.s > 1 and any(
            not _live_columns(p, self.bq, block, tap)
            for block in range(p.q // self.bq) for tap in range(p.s))

    @property
    def skips(self) -> bool:
        return self.rows or self.columns

    def live(self, out_row: tirx.PrimExpr, block: tirx.PrimExpr, row_tap: tirx.PrimExpr,
             column_tap: tirx.PrimExpr) -> tirx.PrimExpr | bool:
        """Whether the call of filter tap ``(row_tap, column_tap)`` on output row ``out_row``
        and column block ``block`` reads some real input (the skipped kinds only)."""
        row = _live_row(self.problem, out_row, row_tap) if self.rows else True
        column = (_live_columns(self.problem, self.bq, block, column_tap)
                  if self.columns else True)
        return _both(row, column)

    def skipped_rows(self, call: s_tir.SBlock) -> tuple[tirx.PrimExpr, tirx.PrimExpr]:
        """How many filter rows of the call's output row lie over the top border and over
        the bottom one: those a call over all of them (``batch_rows``, no height dilation)
        leaves out.

        >>> b = _Border(ConvProblem(1, 8, 5, 5, 8, 3, 3, stride=2, padding=(2, 0, 2, 0)), 2)
        >>> [tuple(int(n) for n in b._skipped_rows(i)) for i in range(b.problem.p)]
        [(2, 0), (0, 0), (0, 0), (0, 2)]
        """
        return self._skipped_rows(call.iter_vars[1].var)  # iterators (n, i, j, o, r, s, c)

    def _skipped_rows(self, out_row: tirx.PrimExpr) -> tuple[tirx.PrimExpr, tirx.PrimExpr]:
        from tvm import tirx

        p = self.problem
        top = p.padding[0]
        row = out_row * p.stride[0]  # its first filter row's, in the padded input

        def clamp(rows: tirx.PrimExpr) -> tirx.PrimExpr:
            return tirx.min(tirx.max(rows, 0), p.r)

        return clamp(top - row), clamp(row + p.r - (top + p.h))

    def every_tile_live(self) -> bool:
        """Whether every output tile has a call over real input: a call then starts each C
        block's reduction where the border's calls are skipped.

        >>> _Border(ConvProblem(1, 8, 4, 4, 8, 3, 3, padding=1), 4).every_tile_live()
        True
        >>> _Border(ConvProblem(1, 8, 4, 4, 8, 3, 3, padding=(5, 1, 5, 1)), 4
        ...            ).every_tile_live()
        False
        """
        p = self.problem
        return all(any(self.live(i, b, r, s) for r in range(p.r) for s in range(p.s))
                   for i in range(p.p) for b in range(p.q // self.bq))

    def first_call(self) -> Callable[[s_tir.SBlock], tirx.PrimExpr]:
        """The first call of a C block where the border's calls are skipped: the channel
        block at its first value and each filter index at its first live one (the tap
        before it, if any, is in the border: the live taps are a contiguous range)."""
        from tvm import tirx

        def first(block: s_tir.SBlock) -> tirx.PrimExpr:
            # The call's iterators are the conv's (n, i, j, o, r, s, c), j in blocks of bq.
            out_row, column_block, row_tap, column_tap, channel = (
                block.iter_vars[i].var for i in (1, 2, 4, 5, 6))
            row_first = tirx.any(row_tap == 0, tirx.Not(
                self.live(out_row, column_block, row_tap - 1, column_tap)))
            column_first = tirx.any(column_tap == 0, tirx.Not(
                self.live(out_row, column_block, row_tap, column_tap - 1)))
            return tirx.all(channel == 0, row_first, column_first)

        return first

    def skip(self, sch: s_tir.Schedule, call: SBlockRV) -> None:
        """Predicate each BRGEMM ``call`` on reading real input.  DeepLab's rate-12 3x3 conv
        on a 16x16 map then makes 24 of its 48 row calls, a 3x3 conv on a 7x7 map 19 of
        21; in blocks of 4 columns the rate-12 conv makes 48 of its 192 calls."""
        def live(realize: s_tir.SBlockRealize) -> tirx.PrimExpr:
            i, j, r, s = (realize.iter_values[k] for k in (1, 2, 4, 5))
            return self.live(i, j, r, s)

        guard(sch, call, live)


def _live_row(problem: ConvProblem, out_row: tirx.PrimExpr, tap: tirx.PrimExpr
              ) -> tirx.PrimExpr | bool:
    """Whether filter row ``tap`` of output row ``out_row`` reads a real input row."""
    row = out_row * problem.stride[0] + tap * problem.dilation[0]  # in the padded input
    top = problem.padding[0]
    return _both(row >= top, row < top + problem.h)


def _live_columns(problem: ConvProblem, bq: int, block: tirx.PrimExpr,
                  tap: tirx.PrimExpr) -> tirx.PrimExpr | bool:
    """Whether filter column ``tap`` reads a real input column for some output column
    of block ``block`` (``bq`` columns)."""
    sw, dw = problem.stride[1], problem.dilation[1]
    first = block * bq * sw + tap * dw  # in the padded input
    last = first + (bq - 1) * sw
    left = problem.padding[1]
    return _both(last >= left, first < left + problem.w)


def _both(a: tirx.PrimExpr | bool, b: tirx.PrimExpr | bool) -> tirx.PrimExpr | bool:
    """``a and b`` of Python bools (loop-free checks) or TIR conditions (predicates)."""
    from tvm import tirx

    if isinstance(a, bool) and isinstance(b, bool):
        return a and b
    if a is True:
        return b
    if b is True:
        return a
    return tirx.all(a, b)


def default_config(problem: ConvProblem, machine: Machine) -> ConvConfig:
    """Blocks and loop order from the shape, the ISA's vectors and the caches.

    * ``bk`` — one register tile of columns where it divides K (16 channels on AVX2, 64 on
      AVX-512: :func:`_column_block`; on a Zen 1, ResNet-50 ran 1.5-2.5 % faster with 16
      than with 64, VGG-19 and DenseNet-121 alike), else at most 64 output channels, a
      multiple of the accumulator's vector width where possible
      (:func:`~schedules.blocking.vector_block`: a group of 68 channels is one block of 68,
      not two of 34);
    * ``bc`` — all input channels (at most 512, whole VNNI groups of the padded C) in one
      BRGEMM: C stays in registers across the whole channel reduction of a tap; a 1x1 conv
      over more channels reduces all its blocks in the same call (``c_step``), which is then
      the whole reduction, its epilogue applied in registers
      (:mod:`schedules.register_epilogue`: 1.05-1.07x for ResNet-50's 1024- and
      2048-channel 1x1 convs on a Zen 3);
    * ``fold_taps`` wherever :func:`can_fold_taps`: one call per filter row (on a Zen 3, one
      thread, ResNet-50's and VGG-19's 3x3 convs 1.00-1.10x, none slower beyond noise, with
      weight panels from 12 to 96 KiB; the RGB stem 1.41x a call per tap); and
      ``batch_rows`` too where :func:`rows_batch_pays`: one call per output tile;
    * ``bq`` — the largest divisor of Q up to 28 rows, or, when that gives fewer than 7 rows
      (Q prime, say), the smallest divisor from 7 up: tails would need predicated kernels;
    * on ``amx`` (low precision), tile-shaped blocks instead: ``(bq, bk)`` the tile-shaped
      pair with the largest C block (:func:`schedules.gemm._tile_blocks`: at most 32 x 32,
      48 x 16 or 16 x 48), ``bc`` preferring whole 64-byte tile rows; but a bf16 conv in
      the ``ACbfgde`` order below (pixel loops inside the taps: every call adds one filter
      row into a C block of the plane) takes one row tile, ``bq <= 16`` (Sapphire Rapids,
      batch 8, each network built both ways in one process: VGG-19 1.35x, DenseNet-121
      1.19x, ResNet-50 1.03x; a 128-channel 3x3 conv on 28x28 1.85x alone; int8 stays: VGG-19
      0.84x, ResNet-50 1.10x);
    * order — ``ACDebfg`` (parallel over images, K blocks and output rows; every output tile
      finishes its taps while hot).  When the images and K blocks alone give every thread
      two tasks and a K block's output fits in half of L2, ``ACbfgde`` instead: each weight
      panel is then reused across the whole output plane, which matters in the deep layers
      whose weights outgrow L2.  When the whole filter fits in half of L1 and K spans several
      blocks (MobileNet's expanding 1x1 convs), ``ADEcbfg``: each task writes whole output
      rows, every K block of them, instead of block-wide slivers of rows; with large filters
      the K blocks stay outer, each weight panel read once per sweep.  Also ``ADEcbfg`` when
      a K block's slice of an output row ends inside a cache line (``bk`` of 28 or 68 floats):
      tasks over K blocks would then share the lines at their edges.  And ``ADEcbfg`` when
      K spans several blocks, the filter fits in half of L3 and the output does not fit in
      L2 (ResNet's and DenseNet's 1x1 and 3x3 convs on 56 x 56 maps, VGG's 3x3 convs up to
      256 channels, on a 512 KiB L2): a task's K-block slivers, or a K block's whole plane,
      would stream the output to memory block by block; whole rows go out sequentially
      while the filter is re-read from L2 or L3 (on a Zen 1, in one process: with filters
      up to half of L2, ResNet-50 3.6 % faster at batch 1, 1.3 % at batch 8, DenseNet-121
      2.1 %; up to half of L3, VGG-19 a further 0.9-2.3 %, the others unchanged), but at
      most 8 L2s' worth: on a Zen 3 (32 MiB of L3) VGG-19's 512-channel 3x3 convs on 28x28
      maps (9.4 MB of filter) ran 1.41x faster with their K blocks outside (``ACbfgde``),
      its 256-channel ones (2.4 MB) 1.12x faster with rows outside.
      Always ``ADEcbfg`` with a prologue: it is then computed once per pixel tile
      (:meth:`ConvConfig.parse`).

    Examples
    --------
    >>> from microkernels import isa
    >>> p = ConvProblem(1, 512, 7, 7, 512, 3, 3, padding=1)
    >>> cfg = default_config(p, Machine(isa.from_name("avx2"), isa.DEFAULT_CACHES, threads=2))
    >>> (cfg.bq, cfg.bc, cfg.bk, cfg.spec)
    (7, 512, 16, 'ACbfgde')
    >>> expand56 = ConvProblem(1, 64, 56, 56, 256, 1, 1)
    >>> cfg = default_config(expand56, Machine(isa.from_name("avx2"), isa.DEFAULT_CACHES, 2))
    >>> (cfg.bk, cfg.spec)
    (16, 'ADEcbfg')
    >>> expand = ConvProblem(1, 16, 48, 48, 96, 1, 1)
    >>> default_config(expand, Machine(isa.from_name("avx2"), isa.DEFAULT_CACHES, threads=2)).spec
    'ADEcbfg'
    >>> grouped = ConvProblem(1, 272, 14, 14, 272, 1, 1, groups=4)  # ShuffleNet's
    >>> cfg = default_config(grouped, Machine(isa.from_name("avx2"), isa.DEFAULT_CACHES, threads=2))
    >>> (cfg.bk, cfg.spec)
    (68, 'ADEcbfg')
    >>> zen3 = Machine(isa.from_name("avx2"), isa.Caches(32 << 10, 512 << 10, 32 << 20), 2)
    >>> [default_config(ConvProblem(1, c, h, h, c, 3, 3, padding=1), zen3).spec
    ...  for c, h in ((256, 56), (512, 28))]  # VGG-19's: 2.4 and 9.4 MB of filter
    ['ADEcbfg', 'ACbfgde']
    >>> u8 = ConvProblem(1, 64, 56, 56, 64, 3, 3, padding=1, dtype="uint8")
    >>> cfg = default_config(u8, Machine(isa.from_name("amx"), isa.DEFAULT_CACHES, threads=2))
    >>> (cfg.bq, cfg.bc, cfg.bk)
    (28, 64, 32)
    >>> bf16 = ConvProblem(8, 128, 28, 28, 128, 3, 3, padding=1, dtype="bfloat16")
    >>> cfg = default_config(bf16, Machine(isa.from_name("amx"), isa.DEFAULT_CACHES, threads=2))
    >>> (cfg.bq, cfg.bk, cfg.spec)
    (14, 32, 'ACbfgde')
    """
    alpha = problem.alpha
    tiles = (_tile_blocks(problem.q, problem.group_k) if _uses_tiles(problem, machine)
             else None)
    if tiles is not None and tiles[0] >= min(7, problem.q):  # else: a Q without tile rows
        bq, bk = tiles
        bc = _k_block(problem.group_c, alpha, _amx.TILE_BYTES // problem.element_bytes)
    else:
        bk = _column_block(problem.group_k, machine.isa)
        bc = _k_block(problem.group_c, alpha, alpha)
        bq = _default_bq(problem.q, lambda rows: _keeps_fmas_busy(problem, rows, bk, machine))
        bq = _skipping_bq(problem, bq)
    plane = problem.p * problem.q * bk * 4
    tasks = problem.n * (problem.k // bk)
    filters = problem.r * problem.s * problem.group_c * problem.k * problem.element_bytes
    slivers = (bk * 4) % _isa.CACHE_LINE != 0  # a K block's output row ends mid-line
    k_blocks = problem.group_k // bk  # per group
    small_filter = filters <= machine.caches.l1d // 2
    # The filter is re-read from L3 for every row of output tiles: up to 8 L2s' worth (4 MiB
    # on the Zen 1 and Zen 3 hosts, whose 8 and 32 MiB L3s other VMs share too).
    rereads_fit = filters <= min(machine.caches.l3 // 2, 8 * machine.caches.l2)
    big_output = rereads_fit and plane * (problem.k // bk) > machine.caches.l2
    c_step = problem.group_c // bc if problem.r == problem.s == 1 else 1
    if problem.prologue.ops or problem.k // bk > 1 and (
            k_blocks > 1 and (small_filter or big_output) or slivers):
        spec = "ADEcbfg"
    elif tasks >= 2 * machine.threads and plane <= machine.caches.l2 // 2:
        spec = "ACbfgde"
    else:
        spec = "ACDebfg"
    if tiles is not None and problem.dtype == "bfloat16" and spec == "ACbfgde" \
            and bq > _amx.TILE_ROWS:  # one row tile (see above)
        bq = max(d for d in divisors(problem.q) if d <= _amx.TILE_ROWS)
    config = ConvConfig(bq=bq, bc=bc, bk=bk, spec=spec, c_step=c_step)
    config = replace(config, fold_taps=can_fold_taps(problem, config))
    return replace(config, batch_rows=config.fold_taps and can_batch_rows(problem, config)
                   and rows_batch_pays(problem, machine))


def rows_batch_pays(problem: ConvProblem, machine: Machine) -> bool:
    """Whether ``batch_rows`` (one call over the R filter rows of an output tile, those over
    the zero border left out) should beat a call per filter row: wherever the filter has
    several rows, off AMX tiles (their kernel reads A along K).  The calls it saves cost
    about two K steps of the register tile each (loading and storing the tile, and the
    epilogue's pass over it), against ``S*C'/alpha`` steps a filter row.  On a Zen 4, batch
    8, each conv alone: int8 3x3 convs 1.03-1.05x at 64 channels, 1.01-1.02x at 128, 1.004-1.012x
    at 256 and 512 (maps of 7x7 to 224x224); bf16 1.00-1.035x, float32 0.997-1.021x, the
    float32 RGB stem 1.12x.

    >>> from microkernels import isa
    >>> zen4 = Machine(isa.from_name("avx512_bf16"), isa.DEFAULT_CACHES, threads=2)
    >>> amx = Machine(isa.from_name("amx"), isa.DEFAULT_CACHES, threads=2)
    >>> p = ConvProblem(8, 512, 7, 7, 512, 3, 3, padding=1, dtype="uint8")
    >>> rows_batch_pays(p, zen4), rows_batch_pays(p, amx)
    (True, False)
    """
    return problem.r > 1 and not _uses_tiles(problem, machine)


def _column_block(k: int, target: _isa.Isa) -> int:
    """``bk`` off AMX tiles: one register tile of columns where it divides ``k``
    (:func:`microkernels.x86.tile_columns`; each call's results are stored tile by tile, and
    the epilogue follows every 16 columns on AVX2), else :func:`vector_block`'s up to 64."""
    lanes = target.lanes("float32")
    width = _tile_width(target)
    if width and k % width == 0:
        return vector_block(k, lanes, limit=width)
    return vector_block(k, lanes)


def _uses_tiles(problem: ConvProblem, machine: Machine) -> bool:
    return problem.dtype != "float32" and machine.isa.has("amx_tile")


def _default_bq(q: int, busy: Callable[[int], bool] = lambda rows: True) -> int:
    """The largest divisor of ``q`` from 7 to 28 whose register tiles keep the FMA units
    ``busy``, else the smallest such divisor up to 64; failing both, the largest divisor up
    to 28, or the smallest from 7 up if that is below 7 (tails would need predicated
    kernels).

    >>> _default_bq(56), _default_bq(49), _default_bq(49, lambda rows: rows != 7)
    (28, 7, 49)
    """
    q_divisors = divisors(q)
    fitting = [d for d in q_divisors if min(7, q) <= d <= 64 and busy(d)]
    if fitting:
        return max((d for d in fitting if d <= 28), default=min(fitting))
    bq = max(d for d in q_divisors if d <= 28)
    if bq < 7:
        bq = min(d for d in q_divisors if d >= min(7, q))
    return bq


def _skipping_bq(problem: ConvProblem, bq: int) -> int:
    """``bq`` or a smaller divisor of Q, from 4 rows up, whose column blocks leave out the
    most of a dilated filter's calls over the zero border (:class:`_Border`): the fewest
    rows in calls over real input, the largest such block on a tie.  On a Zen 1, batch 8,
    DeepLab's rate-6 and rate-12 3x3 convs on 16x16 maps ran as fast per call with 4 rows
    as with 16.

    >>> _skipping_bq(ConvProblem(8, 64, 16, 16, 64, 3, 3, padding=12, dilation=12), 16)
    4
    >>> _skipping_bq(ConvProblem(8, 64, 16, 16, 64, 3, 3, padding=1), 16)
    16
    """
    if problem.dilation[1] == 1 or not problem.zero_border:
        return bq

    def rows_computed(block: int) -> int:
        return block * sum(_live_columns(problem, block, b, s)
                           for b in range(problem.q // block) for s in range(problem.s))

    options = [d for d in divisors(problem.q) if min(4, bq) <= d <= bq]
    return min(options, key=lambda d: (rows_computed(d), -d))


def _keeps_fmas_busy(problem: ConvProblem, rows: int, bk: int, machine: Machine) -> bool:
    """Whether a float32 x86 kernel of ``rows x bk`` keeps its FMA units busy
    (:func:`microkernels.x86.keeps_fmas_busy`); other kernels are not judged (True)."""
    if problem.dtype != "float32" or machine.isa.arch != "x86_64":
        return True
    return _x86.keeps_fmas_busy(BrgemmShape(m=rows, n=bk, k=1, isa=machine.isa.name),
                                _x86.FP32)


def one_row_pays(problem: ConvProblem, machine: Machine) -> bool:
    """Whether :meth:`ConvProblem.one_row` gives ``problem`` register tiles that keep the FMA
    units busy where its rows of pixels cannot: ResNet-50's 1x1 convs on 7x7 maps (rows of
    7 pixels: register tiles of 4 and 3) 1.19x as one row of 49 at batch 1, 1.35-1.42x of
    392 at batch 8 (Zen 3, 2 threads); a 14x14 map's rows of 14 already tile well.

    >>> from microkernels import isa
    >>> machine = Machine(isa.from_name("avx2"), isa.DEFAULT_CACHES, threads=2)
    >>> one_row_pays(ConvProblem(1, 512, 7, 7, 2048, 1, 1), machine)
    True
    >>> one_row_pays(ConvProblem(1, 256, 14, 14, 1024, 1, 1), machine)
    False
    """
    if not problem.pointwise or problem.prologue.ops:
        return False

    def busy(p: ConvProblem) -> bool:
        config = default_config(p, machine)
        return _keeps_fmas_busy(p, config.bq, config.bk, machine)

    return not busy(problem) and busy(problem.one_row())


#: Input channels up to which a conv is an image's first (RGB(A), grey), whose filter rows
#: :func:`fold_rows_pays` folds into channels.
IMAGE_CHANNELS = 4


def fold_rows_pays(problem: ConvProblem) -> bool:
    """Whether ``problem`` should run as :meth:`ConvProblem.rows_folded`: a network's first
    conv over an image's few channels (at most :data:`IMAGE_CHANNELS`), in low precision,
    with several filter rows, ungrouped, without a prologue.  A call per filter row reduces
    only ``S*C'`` values there (28 for ResNet's bf16 RGB stem: one AMX tile step), so the
    calls' overhead (tiles configured, accumulators loaded and stored) outweighs their
    products; folded, one call reduces the whole filter.  Its input grows ``R/sh`` times
    (3.5x for the stem), which an image's channels afford
    (:func:`schedules.stacked_rows.stacked_rows_kernel` writes it).  On a Sapphire Rapids,
    2 threads, the stem alone ran 3-4x faster in bf16 and uint8, and whole networks A/B in
    one process: ResNet-50 at batch 8 1.16x (bf16) and 1.07x (int8), 1.07x at batch 1
    (int8); VGG-19 1.00-1.03x.  In float32 the stem alone gains 1.3x, which stacking its
    four-byte values costs again (ResNet-50 batch 8 1.003x): it stays as it is.

    >>> stem = ConvProblem(1, 3, 224, 224, 64, 7, 7, stride=2, padding=3, dtype="bfloat16")
    >>> fold_rows_pays(stem), fold_rows_pays(replace(stem, dtype="float32"))
    (True, False)
    >>> fold_rows_pays(ConvProblem(1, 64, 56, 56, 64, 3, 3, padding=1, dtype="uint8"))
    False
    """
    return (problem.dtype != "float32" and problem.c <= IMAGE_CHANNELS and problem.r > 1
            and problem.groups == 1 and not problem.prologue.ops)


#: Loop orders :func:`candidates` tries: :func:`default_config`'s two; the taps outside the
#: column blocks (a row's accumulators stay hot while each weight panel sweeps the row); and
#: the K blocks innermost of the spatial loops (each input tile reused by every K block).
ORDERS = ("ACDebfg", "ACbfgde", "ACDbfge", "ADEcbfg")


def candidates(problem: ConvProblem, machine: Machine) -> list[ConvConfig]:
    """A short list of configurations worth measuring, :func:`default_config`'s first.

    Measurement only: no cost model ranks these (the cache-trace model covers GEMMs); the
    tuner times them all, so the list stays short.  After the default come

    * the default blocks in each order of :data:`ORDERS`,
    * then, each in the default's order and in the other of :func:`default_config`'s two,
      the nearest other ``bk`` (a multiple of two vectors or more, up to 64) and the widest
      (:func:`~schedules.blocking.vector_block`'s, where the default is one register tile
      narrower), the two nearest other ``bq``
      (divisors of Q from 7 to 64 rows), and, when C spans several channel blocks,
      ``c_step`` reducing all of them in one BRGEMM call;
    * the default with a call per tap where it folds the taps, and off AMX tiles with a
      call per filter row where it batches them (:func:`rows_batch_pays`).

    Configurations whose parallel loop has fewer iterations than ``threads`` are left out
    (the default excepted), as are duplicates: sixteen configurations at most.  On ``amx``
    (low precision) the other blocks stay tile-shaped: ``bk`` up to 48, ``bq`` up to the
    tile rows its ``bk`` leaves (:func:`schedules.gemm._tile_rows`).

    Examples
    --------
    >>> from microkernels import isa
    >>> p = ConvProblem(1, 64, 56, 56, 64, 3, 3, padding=1)
    >>> machine = Machine(isa.from_name("avx2"), isa.DEFAULT_CACHES, threads=2)
    >>> found = candidates(p, machine)
    >>> found[0] == default_config(p, machine)
    True
    >>> [(c.bq, c.bk, c.spec) for c in found[:4]]
    [(28, 16, 'ACbfgde'), (28, 16, 'ACDebfg'), (28, 16, 'ACDbfge'), (28, 16, 'ADEcbfg')]
    >>> sorted({c.bk for c in found})  # one register tile, the nearest other, the widest
    [16, 32, 64]
    """
    base = default_config(problem, machine)
    tiles = _uses_tiles(problem, machine)
    lanes = machine.isa.lanes("float32")
    if tiles:
        bks = near_divisors(problem.group_k, base.bk, 1, hi=48, multiple=_amx.TILE_ROWS)
    else:
        bks = (near_divisors(problem.group_k, base.bk, 1, lo=2 * lanes, hi=64, multiple=lanes)
               or near_divisors(problem.group_k, base.bk, 1, lo=lanes, hi=128))
        wide = vector_block(problem.group_k, lanes)
        bks += [wide] if wide != base.bk and wide not in bks else []
    blocks = [replace(base, bk=bk) for bk in bks
              if not tiles or base.bq <= _tile_rows(bk)]
    blocks += [replace(base, bq=bq) for bq in near_divisors(
        problem.q, base.bq, 2, lo=min(7, problem.q),
        hi=_tile_rows(base.bk) if tiles else 64)]
    channel_blocks = problem.group_c // base.bc
    if channel_blocks > 1:  # the other of one call per channel block and one per tap
        blocks.append(replace(base, c_step=1 if base.c_step == channel_blocks
                              else channel_blocks, fold_taps=False))
    other = ORDERS[1] if base.spec == ORDERS[0] else ORDERS[0]
    per_tap = [replace(base, fold_taps=False, batch_rows=False)] if base.fold_taps else []
    if base.fold_taps and can_batch_rows(problem, base) and rows_batch_pays(problem, machine):
        per_tap.append(replace(base, batch_rows=not base.batch_rows))
    found = [base]
    for config in [replace(base, spec=spec) for spec in ORDERS] + [
            replace(block, spec=spec) for spec in (base.spec, other) for block in blocks
    ] + per_tap:
        if config not in found and _parallel_tasks(problem, config) >= machine.threads:
            found.append(config)
    return found


def _parallel_tasks(problem: ConvProblem, config: ConvConfig) -> int:
    """Iterations of the parallel loop of ``config`` (0 if its spec does not fit)."""
    try:
        spec = config.parse(problem)
    except LoopSpecError:
        return 0
    return math.prod(o.trips for o in spec.occurrences if o.parallel)


# --------------------------------------------------------------------------------------------
# numpy layouts and semantics (tests, and the graph pass's weight packing)


def _input_values(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` as a ``dtype`` array: float32; bfloat16 rounded (to nearest even) from float32
    or taken as ``ml_dtypes.bfloat16``; uint8 from integers in [0, 255]."""
    x = np.asarray(x)
    if dtype == "float32":
        return x.astype(np.float32, copy=False)
    if dtype == "bfloat16":
        import ml_dtypes

        if x.dtype not in (np.float32, ml_dtypes.bfloat16):
            raise ValueError(f"bfloat16 inputs come as float32 or ml_dtypes.bfloat16, "
                             f"got {x.dtype}")
        return x.astype(ml_dtypes.bfloat16)
    if not np.issubdtype(x.dtype, np.integer) or x.size and (x.min() < 0 or x.max() > 255):
        raise ValueError(f"uint8 inputs must be integers in [0, 255], got {x.dtype} "
                         f"values{f' in [{x.min()}, {x.max()}]' if x.size else ''}")
    return x.astype(np.uint8)


def _padded_nhwc(x: np.ndarray, problem: ConvProblem, pad_value, right: int) -> np.ndarray:
    """NCHW ``x`` -> NHWC in ``problem.dtype``, padded by the top/left/bottom padding and
    ``right`` columns, all with ``pad_value`` (checked against the dtype's range)."""
    if x.shape != (problem.n, problem.c, problem.h, problem.w):
        raise ValueError(f"x must be NCHW {[problem.n, problem.c, problem.h, problem.w]}, "
                         f"got {list(x.shape)}")
    top, left, bottom, _ = problem.padding
    nhwc = _input_values(np.transpose(x, (0, 2, 3, 1)), problem.dtype)
    return np.pad(nhwc, ((0, 0), (top, bottom), (left, right), (0, 0)),
                  constant_values=_pad_scalar(pad_value, problem.dtype))


def _pad_scalar(pad_value: float | int, dtype: str) -> np.generic:
    """``pad_value`` as a ``dtype`` scalar (uint8: an int in [0, 255])."""
    if dtype == "uint8":
        if not isinstance(pad_value, (int, np.integer)) or not 0 <= pad_value <= 255:
            raise ValueError(f"a uint8 input pads with an int in [0, 255], got {pad_value!r}")
        return np.uint8(pad_value)
    return _input_values(np.asarray([pad_value], np.float32), dtype)[0]


def _pad_channels(x: np.ndarray, channels: int, pad_value: float | int, dtype: str
                  ) -> np.ndarray:
    """NHWC ``x`` with its channels padded up to ``channels`` with ``pad_value``."""
    extra = channels - x.shape[3]
    if not extra:
        return x
    return np.pad(x, ((0, 0), (0, 0), (0, 0), (0, extra)),
                  constant_values=_pad_scalar(pad_value, dtype))


def pack_input(x: np.ndarray, problem: ConvProblem, pad_value: float | int = 0) -> np.ndarray:
    """NCHW ``x`` -> the kernel's padded ``X[N][Hp][Wq][sw*C']`` in ``problem.dtype``.

    The border (and the width's rounding up to whole stride groups) and the channels up to
    ``C' = problem.padded_c`` hold ``pad_value``: a quantized input's zero point, so that
    padded pixels are real zeros; padded channels meet zero weights.  uint8 problems take
    integers in [0, 255]; bfloat16 ones float32 (rounded to nearest even) or
    ``ml_dtypes.bfloat16``.

    Examples
    --------
    >>> p = ConvProblem(1, 3, 1, 2, 8, 1, 1, padding=(0, 1, 0, 0), dtype="uint8")
    >>> x = np.arange(6, dtype=np.uint8).reshape(1, 3, 1, 2)
    >>> pack_input(x, p, pad_value=9)[0, 0].tolist()    # 1 + 2 columns, C' = 4
    [[9, 9, 9, 9], [0, 2, 4, 9], [1, 3, 5, 9]]
    """
    _, left, _, _ = problem.padding
    width = problem.wq * problem.stride[1]
    padded = _padded_nhwc(x, problem, pad_value, width - problem.w - left)
    padded = _pad_channels(padded, problem.padded_c, pad_value, problem.dtype)
    return np.ascontiguousarray(padded.reshape(problem.input_shape))


def fold_rows_weight(w: np.ndarray) -> np.ndarray:
    """OIHW ``w`` -> the filter of :meth:`ConvProblem.rows_folded`: ``[K, R*C, 1, S]``, its
    channel ``r*C + c`` the tap ``(r, c)`` of ``w``.

    >>> fold_rows_weight(np.arange(8).reshape(1, 2, 2, 2))[0, :, 0].tolist()
    [[0, 1], [4, 5], [2, 3], [6, 7]]
    """
    k, c, r, s = w.shape
    return np.ascontiguousarray(w.transpose(0, 2, 1, 3)).reshape(k, r * c, 1, s)


def pack_weight(w: np.ndarray, bk: int, problem: ConvProblem | None = None) -> np.ndarray:
    """OIHW ``w`` -> the packed weight of ``problem`` (default: a float32 conv).

    float32: ``W[K/bk][R][S][C][bk]``, a contiguous ``[C, bk]`` panel per tap: the GEMM
    operand ``B[R*S*C, K]`` packed in ``K`` blocks (:meth:`~microkernels.pack.Packing.blocked_b`),
    each block's rows in tap order.  bfloat16 and uint8 problems: ``W[K/bk][R][S][C'/a][bk][a]``,
    C zero-padded to ``C' = problem.padded_c`` in every tap, i.e. ``B[R*S*C', K]`` packed in
    VNNI groups of ``a`` channels (:meth:`~microkernels.pack.Packing.vnni_blocked_b`), each
    tap's ``[C'/a, bk, a]`` panel contiguous.  bfloat16 weights are taken as
    ``ml_dtypes.bfloat16`` or rounded to it from float32 (to nearest even); uint8 problems
    take integer weights in [-128, 127] and return int8.  A grouped conv's
    ``[K, C/groups, R, S]`` filter packs the same way: each K block's panels hold its own
    group's channels.

    Examples
    --------
    >>> w = np.arange(2 * 3, dtype="float32").reshape(2, 3, 1, 1)   # K=2, C=3, 1x1
    >>> pack_weight(w, 2)[0, 0, 0].tolist()                        # [C, bk] of the tap
    [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
    >>> p = ConvProblem(1, 3, 1, 1, 2, 1, 1, dtype="uint8")
    >>> pack_weight(w.astype("int8"), 2, p)[0, 0, 0, 0].tolist()   # [bk, 4]: C padded
    [[0, 1, 2, 0], [3, 4, 5, 0]]
    """
    k, c, r, s = w.shape
    if k % bk or problem is not None and problem.group_k % bk:
        raise ValueError(f"bk={bk} does not divide K={k}"
                         + (f"/{problem.groups}" if problem and problem.groups > 1 else ""))
    want = (None if problem is None
            else (problem.k, problem.c // problem.groups, problem.r, problem.s))
    if want is not None and (k, c, r, s) != want:
        raise ValueError(f"W must be OIHW {list(want)}, got {list(w.shape)}")
    if problem is None or problem.layout == "flat":
        b = np.asarray(w, np.float32).transpose(2, 3, 1, 0).reshape(r * s * c, k)
        return Packing.blocked_b(bk).pack(b).reshape(k // bk, r, s, c, bk)
    alpha, cp = problem.alpha, problem.group_c
    values = _weight_values(np.asarray(w), problem.weight_dtype)
    values = np.pad(values, ((0, 0), (0, cp - c), (0, 0), (0, 0)))  # zeros: padded channels
    b = values.transpose(2, 3, 1, 0).reshape(r * s * cp, k)
    packed = Packing.vnni_blocked_b(alpha, bk).pack(b)
    return packed.reshape(weight_shape(problem, bk))


def reference(problem: ConvProblem, x: np.ndarray, w: np.ndarray,
              pad_value: float | int = 0) -> np.ndarray:
    """NCHW ``conv2d(x, w)`` of the input padded with ``pad_value``, without the epilogue
    (numpy, tap by tap, group by group): int64 when ``x`` and ``w`` are integers (exact),
    else float64 (exact products of bfloat16 values).

    Examples
    --------
    >>> p = ConvProblem(1, 1, 1, 1, 1, 1, 3, padding=(0, 1, 0, 1), dtype="uint8")
    >>> reference(p, np.full((1, 1, 1, 1), 2, "uint8"), np.ones((1, 1, 1, 3), "int8"), 5)
    array([[[[12]]]])
    """
    top, left, bottom, right = problem.padding
    (sh, sw), (dh, dw) = problem.stride, problem.dilation
    x, w = np.asarray(x), np.asarray(w)
    exact = np.issubdtype(x.dtype, np.integer) and np.issubdtype(w.dtype, np.integer)
    wide = np.int64 if exact else np.float64
    xp = np.pad(x.astype(wide), ((0, 0), (0, 0), (top, bottom), (left, right)),
                constant_values=pad_value)
    out = np.zeros(problem.output_shape, wide)
    cg, kg = problem.c // problem.groups, problem.group_k
    for g in range(problem.groups):
        for i in range(problem.r):
            for j in range(problem.s):
                taps = xp[:, g * cg:(g + 1) * cg, i * dh:i * dh + (problem.p - 1) * sh + 1:sh,
                          j * dw:j * dw + (problem.q - 1) * sw + 1:sw]
                out[:, g * kg:(g + 1) * kg] += np.einsum(
                    "nchw,kc->nkhw", taps, w[g * kg:(g + 1) * kg, :, i, j].astype(wide))
    return out
