"""Direct convolution template: PARLOOPER's conv loops around a BRGEMM over channels.

``Y = epilogue(conv2d(X, W))`` for float32, ``groups = 1``, dilation 1, any stride and padding,
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

* input ``X[N][Hp][Wq][sw*C]``: NHWC, zero-padded (the kernel never reads out of bounds),
  the padded width rounded up to ``Wq * sw``.  It is the padded NHWC tensor reshaped
  (no copy) so that input column ``w = q*sw + ph`` sits at ``X[.., q, ph*C + c]``.  For tap
  ``s`` the A rows of output columns ``q0 .. q0+bq`` are then *consecutive* rows
  ``q0 + s//sw ..`` at offset ``(s % sw) * C``: a stride ``sw`` needs no gather.
* weights ``W[Kb][R][S][C][bk]``: each (kb, r, s) holds a contiguous ``[C, bk]`` panel,
  the flat BRGEMM's B.
* output ``Y[N*P*Q][K]``: NHWC viewed as a matrix; residual operands have this shape too,
  bias operands are ``[K]`` (``broadcast="row"``).

The accumulator is zeroed before the first reduction loop (``decompose_reduction``), and the
epilogue (:func:`microkernels.epilogue.apply_te`) runs under the deepest spatial loop above
it, on the finished tile, as :mod:`schedules.gemm` does.

With few input channels (an RGB stem) each call would reduce only C values;
:meth:`ConvProblem.unfold_width` turns such a conv into an ``R x 1`` one over ``S*C``
channels of an input unfolded along the width (:func:`unfold_input`).

Examples
--------
>>> p = ConvProblem(n=1, c=64, h=56, w=56, k=64, r=3, s=3, padding=1)
>>> (p.p, p.q, p.input_shape)
(56, 56, (1, 58, 58, 64))
>>> cfg = ConvConfig(bq=28, bc=64, bk=64)
>>> sch = schedule(p, cfg, isa="avx2")       # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np

from microkernels import isa as _isa
from microkernels.brgemm import BrgemmShape, dispatch
from microkernels.epilogue import Epilogue
from microkernels.machine import Machine
from microkernels.pack import Packing

from .blocking import divisors, near_divisors, pick_divisor
from .loop_spec import LoopDecl, LoopSpec, LoopSpecError, parse
from .nest import check_exact, finish_nest, nest_loops

if TYPE_CHECKING:
    from tvm import s_tir
    from tvm.tirx import PrimFunc

__all__ = [
    "ConvProblem",
    "ConvConfig",
    "LETTERS",
    "workload",
    "schedule",
    "default_config",
    "candidates",
    "ORDERS",
    "pack_input",
    "pack_weight",
    "unfold_input",
    "unfold_weight",
    "reference",
]

#: Loop letters in declaration order: N, Cb, Kb, P, Q blocks, R, S ([PL] Listing 4).
LETTERS = "abcdefg"
_REDUCTIONS = frozenset("bfg")


def _pair(value, what: str, n: int) -> tuple[int, ...]:
    values = (value,) * n if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        values = tuple(values)
    except TypeError:
        raise TypeError(f"{what} must be an int or a tuple of {n} ints, got {value!r}") from None
    if len(values) != n or any(not isinstance(v, int) or isinstance(v, bool) for v in values):
        raise TypeError(f"{what} must be an int or a tuple of {n} ints, got {value!r}")
    return values


@dataclass(frozen=True)
class ConvProblem:
    """``Y = epilogue(conv2d(X, W))``: NCHW input, OIHW weights, float32, groups 1.

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
    epilogue
        Elementwise chain on the ``[N*P*Q, K]`` output: bias is per output channel
        (``"row"``), a residual is a full NHWC tensor.

    Examples
    --------
    >>> ConvProblem(1, 3, 224, 224, 64, 7, 7, stride=2, padding=3).output_shape
    (1, 64, 112, 112)
    >>> ConvProblem(1, 3, 4, 4, 8, 5, 5)
    Traceback (most recent call last):
    ...
    ValueError: a 5x5 filter does not fit the 4x4 input padded by (0, 0, 0, 0)
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

    def __post_init__(self) -> None:
        for dim in ("n", "c", "h", "w", "k", "r", "s"):
            value = getattr(self, dim)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ConvProblem.{dim} must be a positive int, got {value!r}")
        object.__setattr__(self, "stride", _pair(self.stride, "stride", 2))
        object.__setattr__(self, "padding", _pair(self.padding, "padding", 4))
        if min(self.stride) < 1:
            raise ValueError(f"strides must be >= 1, got {self.stride}")
        if min(self.padding) < 0:
            raise ValueError(f"padding must be >= 0, got {self.padding}")
        if self.hp < self.r or self.w + self.padding[1] + self.padding[3] < self.s:
            raise ValueError(f"a {self.r}x{self.s} filter does not fit the {self.h}x{self.w} "
                             f"input padded by {self.padding}")
        if self.dtype != "float32":
            raise ValueError(f"the conv template handles float32, got {self.dtype!r}")
        if not isinstance(self.epilogue, Epilogue):
            raise TypeError(f"epilogue must be an Epilogue, got {type(self.epilogue).__name__}")
        if self.epilogue.out_dtype("float32") != "float32":
            raise ValueError(f"the conv template writes float32, not {self.epilogue.name!r}")

    @property
    def p(self) -> int:
        """Output height."""
        return (self.hp - self.r) // self.stride[0] + 1

    @property
    def q(self) -> int:
        """Output width."""
        return (self.w + self.padding[1] + self.padding[3] - self.s) // self.stride[1] + 1

    @property
    def hp(self) -> int:
        """Padded input height."""
        return self.h + self.padding[0] + self.padding[2]

    @property
    def wq(self) -> int:
        """Input column groups of ``sw``: the padded width is ``wq * sw`` (rounded up)."""
        return -(-(self.w + self.padding[1] + self.padding[3]) // self.stride[1])

    @property
    def input_shape(self) -> tuple[int, int, int, int]:
        """Shape of the packed input ``X[N][Hp][Wq][sw*C]``."""
        return (self.n, self.hp, self.wq, self.stride[1] * self.c)

    @property
    def output_shape(self) -> tuple[int, int, int, int]:
        """NCHW shape of the result."""
        return (self.n, self.k, self.p, self.q)

    @property
    def rows(self) -> int:
        """Output pixels ``N*P*Q``: the rows of the ``[rows, K]`` output matrix."""
        return self.n * self.p * self.q

    @property
    def flops(self) -> int:
        return 2 * self.rows * self.k * self.c * self.r * self.s

    def unfold_width(self) -> ConvProblem:
        """The same convolution on its input unfolded along the width (im2col of the S taps).

        Input column ``q`` of the unfolded tensor holds the ``S*C`` values output column ``q``
        reads in one filter row: ``X'[n, h, q, s*C + c] = Xpad[n, h, q*sw + s, c]``.  The
        filter becomes ``R x 1`` over ``S*C`` channels.  Worth it when C is small (an RGB
        stem): each BRGEMM call then reduces ``S*C`` channels instead of ``C``, at the price
        of an S-fold copy of a small input.

        Examples
        --------
        >>> p = ConvProblem(1, 3, 224, 224, 64, 7, 7, stride=2, padding=3).unfold_width()
        >>> (p.c, p.w, p.s, p.stride, p.padding, p.q)
        (21, 112, 1, (2, 1), (3, 0, 3, 0), 112)
        """
        top, _, bottom, _ = self.padding
        return ConvProblem(self.n, self.s * self.c, self.h, self.q, self.k, self.r, 1,
                           stride=(self.stride[0], 1), padding=(top, 0, bottom, 0),
                           epilogue=self.epilogue)


@dataclass(frozen=True)
class ConvConfig:
    """Block sizes and the loop_spec of one convolution.

    Parameters
    ----------
    bq
        Output columns per BRGEMM (its ``m``); divides Q.
    bc
        Input channels per BRGEMM batch element (its ``k``); divides C.
    bk
        Output channels per tile (the BRGEMM's ``n``, the vector dimension); divides K.
    spec
        loop_spec over :data:`LETTERS`; upper-case loops run in parallel.  Reductions
        (``b``, ``f``, ``g``) cannot be parallel.
    c_step
        Channel blocks one BRGEMM call reduces (its ``batch``): step of ``b``.
    block_steps
        Letter -> block steps, outer first, for letters that occur more than once.

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

    def __post_init__(self) -> None:
        for name in ("bq", "bc", "bk", "c_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ConvConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.spec, str):
            raise TypeError(f"spec must be a str, got {type(self.spec).__name__}")
        bad = set(self.block_steps) - set(LETTERS)
        if bad:
            raise ValueError(f"block_steps keys must be conv loop letters a-g, got {sorted(bad)}")
        steps = {k: tuple(self.block_steps[k]) for k in sorted(self.block_steps)}
        object.__setattr__(self, "block_steps", MappingProxyType(steps))

    def __hash__(self) -> int:
        return hash((self.bq, self.bc, self.bk, self.spec, self.c_step,
                     tuple(self.block_steps.items())))

    def check(self, problem: ConvProblem) -> None:
        """ValueError unless the blocks tile ``problem`` exactly."""
        for block, dim, name, what in ((self.bq, problem.q, "bq", "Q"),
                                       (self.bc, problem.c, "bc", "C"),
                                       (self.bk, problem.k, "bk", "K")):
            if dim % block:
                raise ValueError(f"{name}={block} does not divide {what}={dim}")
        if (problem.c // self.bc) % self.c_step:
            raise ValueError(f"c_step={self.c_step} does not divide C/bc={problem.c // self.bc}")

    def loops(self, problem: ConvProblem) -> tuple[LoopDecl, ...]:
        """The seven logical loops of ``problem``, in block units."""
        self.check(problem)
        extents = (("N", problem.n), ("Cb", problem.c // self.bc), ("Kb", problem.k // self.bk),
                   ("P", problem.p), ("Qb", problem.q // self.bq), ("R", problem.r),
                   ("S", problem.s))
        return tuple(
            LoopDecl(name, extent, step=self.c_step if letter == "b" else 1,
                     block_steps=self.block_steps.get(letter, ()),
                     reduction=letter in _REDUCTIONS)
            for letter, (name, extent) in zip(LETTERS, extents, strict=True))

    def parse(self, problem: ConvProblem) -> LoopSpec:
        """The parsed loop_spec (LoopSpecError if it does not fit)."""
        spec = parse(self.spec, self.loops(problem))
        check_exact(spec)
        return spec


def workload(problem: ConvProblem, bk: int) -> PrimFunc:
    """The unscheduled PrimFunc ``(X, W, *epilogue operands, Y)`` (layouts: module doc)."""
    from tvm import te

    from microkernels.epilogue import apply_te

    p, q, c, k = problem.p, problem.q, problem.c, problem.k
    sh, sw = problem.stride
    if k % bk:
        raise ValueError(f"bk={bk} does not divide K={k}")
    x = te.placeholder(problem.input_shape, "float32", name="X")
    w = te.placeholder((k // bk, problem.r, problem.s, c, bk), "float32", name="W")
    rr = te.reduce_axis((0, problem.r), name="r")
    rs = te.reduce_axis((0, problem.s), name="s")
    rc = te.reduce_axis((0, c), name="c")
    conv = te.compute(
        (problem.n, p, q, k),
        lambda n, i, j, o: te.sum(
            x[n, i * sh + rr, j + rs // sw, rs % sw * c + rc]
            * w[o // bk, rr, rs, rc, o % bk], axis=[rr, rs, rc]),
        name="conv")
    extra = {op.name: te.placeholder(op.shape(problem.rows, k), op.dtype, name=op.name)
             for op in problem.epilogue.inputs("float32")}
    if not problem.epilogue.ops:
        return te.create_prim_func([x, w, conv])
    # The epilogue is a 2-D chain: it reads the conv through a [rows, K] view, which the
    # schedule inlines once the conv's buffer itself is laid out as that matrix.
    view = te.compute((problem.rows, k),
                      lambda i, o: conv[i // (p * q), i // q % p, i % q, o], name="view")
    y = apply_te(problem.epilogue, view, extra)
    return te.create_prim_func([x, w, *extra.values(), y])


def schedule(problem: ConvProblem, config: ConvConfig, isa: str | _isa.Isa = "avx2"
             ) -> s_tir.Schedule:
    """The scheduled convolution: loop_spec outer loops around the ISA's BRGEMM.

    Raises
    ------
    LoopSpecError
        The spec is malformed, misses a loop, parallelizes a reduction, or does not tile.
    ValueError
        Block sizes do not tile the problem.
    """
    from tvm import s_tir

    isa_name = isa.name if isinstance(isa, _isa.Isa) else _isa.from_name(isa).name
    spec = config.parse(problem)
    pq = problem.p * problem.q
    sch = s_tir.Schedule(workload(problem, config.bk))
    conv = sch.get_sblock("conv")
    # The accumulator (or the output itself) as the [N*P*Q, K] matrix the epilogue reads:
    # the view stage then inlines to plain 2-D indices.
    sch.transform_layout(conv, ("write", 0),
                         lambda n, i, j, o: (n * pq + i * problem.q + j, o))
    n, p, q, k, r, s, c = sch.get_loops(conv)
    q_blocks, q_body = sch.split(q, [None, config.bq])
    k_blocks, k_body = sch.split(k, [None, config.bk])
    c_blocks, c_body = sch.split(c, [None, config.c_step * config.bc])
    logical = dict(zip(LETTERS, (n, c_blocks, k_blocks, p, q_blocks, r, s), strict=True))
    order, grid_loops = nest_loops(sch, spec, logical)
    sch.reorder(*grid_loops, *order, q_body, k_body, c_body)
    epilogue = None
    if problem.epilogue.ops:
        sch.compute_inline(sch.get_sblock("view"))
        epilogue = sch.get_sblock("epilogue")
    finish_nest(sch, spec, order, grid_loops, conv, _REDUCTIONS, epilogue)
    # The BRGEMM desc has no loop for a unit dimension (TVM drops them from the blocks it
    # matches), so each unit loop of the tile is fused into a neighbour.
    inner = [(q_body, config.bq), (k_body, config.bk), (c_body, config.c_step * config.bc)]
    while len(inner) > 1 and any(extent == 1 for _, extent in inner):
        unit = next(i for i, (_, extent) in enumerate(inner) if extent == 1)
        first = min(unit, len(inner) - 2)  # fuse with the loop below, or above if last
        (outer, e0), (under, e1) = inner[first:first + 2]
        inner[first:first + 2] = [(sch.fuse(outer, under), e0 * e1)]
    if inner[0][1] == 1:
        return sch  # a 1x1x1 "GEMM" per step: scalar code is all it needs
    shape = BrgemmShape(m=config.bq, n=config.bk, k=config.bc, batch=config.c_step,
                        layout="flat", isa=isa_name)
    sch.tensorize(inner[0][0], dispatch(shape))
    return sch


def default_config(problem: ConvProblem, machine: Machine) -> ConvConfig:
    """Blocks and loop order from the shape, the ISA's vectors and the caches.

    * ``bk`` — at most 64 output channels, a multiple of the vector width where possible;
    * ``bc`` — all input channels (at most 512) in one BRGEMM: C stays in registers across
      the whole channel reduction of a tap;
    * ``bq`` — the largest divisor of Q up to 28 rows, or, when that gives fewer than 7 rows
      (Q prime, say), the smallest divisor from 7 up: tails would need predicated kernels;
    * order — ``ACDebfg`` (parallel over images, K blocks and output rows; every output tile
      finishes its taps while hot).  When the images and K blocks alone give every thread
      two tasks and a K block's output fits in half of L2, ``ACbfgde`` instead: each weight
      panel is then reused across the whole output plane, which matters in the deep layers
      whose weights outgrow L2.

    Examples
    --------
    >>> from microkernels import isa
    >>> p = ConvProblem(1, 512, 7, 7, 512, 3, 3, padding=1)
    >>> cfg = default_config(p, Machine(isa.from_name("avx2"), isa.DEFAULT_CACHES, threads=2))
    >>> (cfg.bq, cfg.bc, cfg.bk, cfg.spec)
    (7, 512, 64, 'ACbfgde')
    """
    lanes = machine.isa.lanes("float32")
    bk = pick_divisor(problem.k, 64, lanes)
    bc = pick_divisor(problem.c, 512)
    q_divisors = divisors(problem.q)
    bq = max(d for d in q_divisors if d <= 28)
    if bq < 7:
        bq = min(d for d in q_divisors if d >= min(7, problem.q))
    plane = problem.p * problem.q * bk * 4
    tasks = problem.n * (problem.k // bk)
    spec = ("ACbfgde" if tasks >= 2 * machine.threads and plane <= machine.caches.l2 // 2
            else "ACDebfg")
    return ConvConfig(bq=bq, bc=bc, bk=bk, spec=spec)


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
      the nearest other ``bk`` (a vector multiple up to 64), the two nearest other ``bq``
      (divisors of Q from 7 to 64 rows), and, when C spans several channel blocks,
      ``c_step`` reducing all of them in one BRGEMM call.

    Configurations whose parallel loop has fewer iterations than ``threads`` are left out
    (the default excepted), as are duplicates: twelve configurations at most.

    Examples
    --------
    >>> from microkernels import isa
    >>> p = ConvProblem(1, 64, 56, 56, 64, 3, 3, padding=1)
    >>> machine = Machine(isa.from_name("avx2"), isa.DEFAULT_CACHES, threads=2)
    >>> found = candidates(p, machine)
    >>> found[0] == default_config(p, machine)
    True
    >>> [(c.bq, c.bk, c.spec) for c in found[:4]]  # one K block: ACbfgde has one task
    [(28, 64, 'ACDebfg'), (28, 64, 'ACDbfge'), (28, 64, 'ADEcbfg'), (28, 32, 'ACDebfg')]
    """
    base = default_config(problem, machine)
    blocks = [replace(base, bk=bk) for bk in near_divisors(
        problem.k, base.bk, 1, hi=64, multiple=machine.isa.lanes("float32"))]
    blocks += [replace(base, bq=bq) for bq in near_divisors(
        problem.q, base.bq, 2, lo=min(7, problem.q), hi=64)]
    channel_blocks = problem.c // base.bc
    if channel_blocks > 1:
        blocks.append(replace(base, c_step=channel_blocks))
    other = ORDERS[1] if base.spec == ORDERS[0] else ORDERS[0]
    found = [base]
    for config in [replace(base, spec=spec) for spec in ORDERS] + [
            replace(block, spec=spec) for spec in (base.spec, other) for block in blocks]:
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


def pack_input(x: np.ndarray, problem: ConvProblem) -> np.ndarray:
    """NCHW ``x`` -> the kernel's padded ``X[N][Hp][Wq][sw*C]``."""
    top, left, bottom, right = problem.padding
    width = problem.wq * problem.stride[1]
    nhwc = np.transpose(x, (0, 2, 3, 1))
    padded = np.pad(nhwc, ((0, 0), (top, bottom), (left, width - problem.w - left), (0, 0)))
    return np.ascontiguousarray(padded.reshape(problem.input_shape), dtype=np.float32)


def pack_weight(w: np.ndarray, bk: int) -> np.ndarray:
    """OIHW ``w`` -> ``W[K/bk][R][S][C][bk]``: a contiguous ``[C, bk]`` panel per tap.

    The filter is the GEMM operand ``B[R*S*C, K]`` packed in ``K`` blocks
    (:meth:`~microkernels.pack.Packing.blocked_b`), each block's rows in tap order.

    Examples
    --------
    >>> w = np.arange(2 * 3, dtype="float32").reshape(2, 3, 1, 1)   # K=2, C=3, 1x1
    >>> pack_weight(w, 2)[0, 0, 0].tolist()                        # [C, bk] of the tap
    [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
    """
    k, c, r, s = w.shape
    if k % bk:
        raise ValueError(f"bk={bk} does not divide K={k}")
    b = np.asarray(w, np.float32).transpose(2, 3, 1, 0).reshape(r * s * c, k)
    return Packing.blocked_b(bk).pack(b).reshape(k // bk, r, s, c, bk)


def unfold_input(x: np.ndarray, problem: ConvProblem) -> np.ndarray:
    """NCHW ``x`` -> the packed input of ``problem.unfold_width()``."""
    top, left, bottom, right = problem.padding
    sw = problem.stride[1]
    padded = np.pad(np.transpose(x, (0, 2, 3, 1)), ((0, 0), (top, bottom), (left, right), (0, 0)))
    taps = [padded[:, :, s:s + (problem.q - 1) * sw + 1:sw] for s in range(problem.s)]
    return np.ascontiguousarray(np.concatenate(taps, axis=3), dtype=np.float32)


def unfold_weight(w: np.ndarray) -> np.ndarray:
    """OIHW ``w`` -> the ``[K, S*C, R, 1]`` filter of :meth:`ConvProblem.unfold_width`."""
    k, c, r, s = w.shape
    return np.ascontiguousarray(w.transpose(0, 3, 1, 2).reshape(k, s * c, r, 1))


def reference(problem: ConvProblem, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float64 NCHW ``conv2d(x, w)`` without the epilogue (numpy, tap by tap)."""
    top, left, bottom, right = problem.padding
    sh, sw = problem.stride
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (top, bottom), (left, right)))
    out = np.zeros(problem.output_shape)
    for i in range(problem.r):
        for j in range(problem.s):
            taps = xp[:, :, i:i + (problem.p - 1) * sh + 1:sh, j:j + (problem.q - 1) * sw + 1:sw]
            out += np.einsum("nchw,kc->nkhw", taps, w[:, :, i, j].astype(np.float64))
    return out
