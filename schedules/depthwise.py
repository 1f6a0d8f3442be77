"""Depthwise convolution template: a batch-reduce over the filter taps, an elementwise FMA per
channel vector.

``Y[n, p, q, c] = epilogue(sum_{r,s} X[n, p*sh + r, q*sw + s, c] * W[r, s, c])`` for a
``groups = C = K`` conv (one filter per channel, MobileNet's 3x3 depthwise layers), as
oneDNN's depthwise BRGEMM computes it: there is no reduction over channels, so each output
tile ``[bq columns, bc channels]`` is a set of accumulator vectors (the channels are the
vector lanes) that the ``R x S`` taps update with one elementwise multiply-add each -- the
batch-reduce of the taps runs inside the tile, and the tile is finished (epilogue) while it
is still in registers.

Layouts (row-major)
-------------------
* input ``X[N][Hp][Wp][C]``: NHWC, padded by the caller (the kernel never reads out of
  bounds) with a pad value -- a quantized input's zero point, whose products the epilogue's
  bias folds out.  A stride reads every ``sw``-th column: each tap still loads whole
  contiguous channel vectors.
* weights ``W[R][S][C]``: each tap's ``C`` filter values contiguous (:func:`pack_weight`
  from the OIHW ``[C, 1, R, S]`` filter).
* output ``Y[N*P*Q][C]``: NHWC viewed as a matrix, the epilogue's ``[rows, channels]`` (bias
  and per-channel scales ``[C]``, ``broadcast="row"``; a residual ``[N*P*Q, C]``), exactly as
  :mod:`schedules.conv`'s.

Operand types (:data:`schedules.operands.OPERANDS`): ``"float32"``; ``"bfloat16"`` (bf16 X
and W, converted to float32 and accumulated there); ``"uint8"`` (u8 X by s8 W, products and
sums in int32).  No VNNI groups: the taps, not the channels, are reduced, so nothing is
padded along C.

Schedule
--------
``n, p`` (and channel blocks when there are few rows) in one parallel loop; then, per output
channel block ``bc`` (a vector of the accumulator's lanes, or a divisor of C) and block of
``bq`` output columns, the accumulators are zeroed, the ``R x S`` taps (unrolled) each update
the ``bq`` vectors (unrolled, the channel loop vectorized), and the epilogue runs on the
finished tile.

Examples
--------
>>> p = DepthwiseProblem(n=1, c=144, h=56, w=56, r=3, s=3, stride=2, padding=1)
>>> (p.p, p.q, p.input_shape, p.k)
(28, 28, (1, 58, 58, 144), 144)
>>> from microkernels import isa
>>> from microkernels.machine import Machine
>>> cfg = default_config(p, Machine(isa.from_name("avx512"), isa.DEFAULT_CACHES, threads=2))
>>> (cfg.bq, cfg.bc)
(14, 16)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from microkernels import isa as _isa
from microkernels.epilogue import Epilogue, expression_isa, vector_lanes
from microkernels.machine import Machine

from .blocking import divisors, near_divisors
from .conv import ConvGeometry, _input_values, _pad_scalar
from .gemm import _weight_values

if TYPE_CHECKING:
    from tvm import s_tir, tirx
    from tvm.tirx import PrimFunc

__all__ = ["DepthwiseProblem", "DepthwiseConfig", "workload", "schedule", "default_config",
           "candidates", "pack_input", "pack_weight", "reference"]

#: Accumulator vectors one tile keeps in registers at most (of 32 on AVX-512, 16 on AVX2:
#: the rest hold the input and weight vectors of a tap).
_MAX_TILE_VECTORS = 14


@dataclass(frozen=True)
class DepthwiseProblem(ConvGeometry):
    """``Y = epilogue(depthwise_conv2d(X, W))``: NCHW input of C channels, ``[C, 1, R, S]``
    weights (``groups = C``, one output channel per input channel), X in ``dtype``.

    Parameters are :class:`schedules.conv.ConvProblem`'s without ``k`` (K = C): ``stride``
    ``(sh, sw)``, ``padding`` ``(top, left, bottom, right)``, ``dtype`` float32, bfloat16 or
    uint8, the ``epilogue`` on the ``[N*P*Q, C]`` output, and ``dilation`` ``(dh, dw)``.

    Examples
    --------
    >>> DepthwiseProblem(1, 32, 112, 112, 3, 3, padding=1).output_shape
    (1, 32, 112, 112)
    >>> DepthwiseProblem(1, 32, 28, 28, 3, 3, padding=4, dilation=4).output_shape
    (1, 32, 28, 28)
    >>> DepthwiseProblem(1, 8, 2, 2, 3, 3)
    Traceback (most recent call last):
    ...
    ValueError: a 3x3 filter does not fit the 2x2 input padded by (0, 0, 0, 0)
    """

    n: int
    c: int
    h: int
    w: int
    r: int
    s: int
    stride: tuple[int, int] | int = (1, 1)
    padding: tuple[int, int, int, int] | int = (0, 0, 0, 0)
    dtype: str = "float32"
    epilogue: Epilogue = field(default_factory=Epilogue)
    dilation: tuple[int, int] | int = (1, 1)

    def __post_init__(self) -> None:
        self._validate(("n", "c", "h", "w", "r", "s"), "depthwise", "depthwise conv")

    @property
    def k(self) -> int:
        """Output channels: C."""
        return self.c

    @property
    def input_shape(self) -> tuple[int, int, int, int]:
        """Shape of the packed input ``X[N][Hp][Wp][C]``."""
        return (self.n, self.hp, self.wp, self.c)

    @property
    def weight_shape(self) -> tuple[int, int, int]:
        """Shape of the packed weight ``W[R][S][C]``."""
        return (self.r, self.s, self.c)

    @property
    def flops(self) -> int:
        return 2 * self.rows * self.c * self.r * self.s


@dataclass(frozen=True)
class DepthwiseConfig:
    """Blocks of one depthwise convolution.

    Parameters
    ----------
    bq
        Output columns per tile; divides Q.
    bc
        Channels per tile (the vector dimension); divides C.
    parallel_channels
        Whether the channel blocks join ``n, p`` in the parallel loop (else they run inside
        each row task).

    Examples
    --------
    >>> DepthwiseConfig(bq=14, bc=16)
    DepthwiseConfig(bq=14, bc=16, parallel_channels=False)
    """

    bq: int
    bc: int
    parallel_channels: bool = False

    def __post_init__(self) -> None:
        for name in ("bq", "bc"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DepthwiseConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.parallel_channels, bool):
            raise TypeError("parallel_channels must be a bool")

    def check(self, problem: DepthwiseProblem) -> None:
        """ValueError unless the blocks tile ``problem`` exactly."""
        for block, dim, name, what in ((self.bq, problem.q, "bq", "Q"),
                                       (self.bc, problem.c, "bc", "C")):
            if dim % block:
                raise ValueError(f"{name}={block} does not divide {what}={dim}")


def workload(problem: DepthwiseProblem, batch: tirx.Var | None = None,
             epilogue_isa: str = "generic") -> PrimFunc:
    """The unscheduled PrimFunc ``(X, W, *epilogue operands, Y)`` (layouts: module doc);
    with a run-time ``batch`` (a symbolic batch: the parameter before the output) it has
    ``batch * problem.n`` images; the epilogue's expressions are ``epilogue_isa``'s
    (:func:`microkernels.epilogue.apply_te`)."""
    from tvm import te

    from microkernels.epilogue import apply_te

    p, q, c = problem.p, problem.q, problem.c
    (sh, sw), (dh, dw) = problem.stride, problem.dilation
    acc = problem.acc_dtype
    images = problem.n if batch is None else batch * problem.n
    rows = images * p * q
    x = te.placeholder((images, *problem.input_shape[1:]), problem.dtype, name="X")
    w = te.placeholder(problem.weight_shape, problem.weight_dtype, name="W")
    rr = te.reduce_axis((0, problem.r), name="r")
    rs = te.reduce_axis((0, problem.s), name="s")

    def product(n, i, j, o):
        row = rr * dh if dh > 1 else rr  # the tap's offset in the padded input
        col = rs * dw if dw > 1 else rs
        value, weight = x[n, i * sh + row, j * sw + col, o], w[rr, rs, o]
        if problem.dtype == acc:
            return value * weight
        return value.astype(acc) * weight.astype(acc)

    conv = te.compute((images, p, q, c),
                      lambda n, i, j, o: te.sum(product(n, i, j, o), axis=[rr, rs]),
                      name="conv")
    start = problem.epilogue_dtype
    extra = {op.name: te.placeholder(op.shape(rows, c), op.dtype, name=op.name)
             for op in problem.epilogue.inputs(start)}
    scalars = [] if batch is None else [batch]
    if not problem.epilogue.ops:
        return te.create_prim_func([x, w, *scalars, conv])

    def view_value(i, o):
        value = conv[i // (p * q), i // q % p, i % q, o]
        return value if start == acc else value.astype(start)

    view = te.compute((rows, c), view_value, name="view")
    y = apply_te(problem.epilogue, view, extra, isa=epilogue_isa)
    return te.create_prim_func([x, w, *extra.values(), *scalars, y])


def schedule(problem: DepthwiseProblem, config: DepthwiseConfig,
             isa: str | _isa.Isa = "avx2", batch: tirx.Var | None = None) -> s_tir.Schedule:
    """The scheduled depthwise convolution (module doc): plain vectorized TIR, LLVM picks
    the instructions of the target, but for the epilogue's ISA-specific expressions
    (``isa``'s one-instruction bf16 conversion where whole 16-lane vectors tile ``bc``).
    With a run-time ``batch`` (a symbolic batch: the parameter before the output) the
    images loop runs ``batch * problem.n`` times.

    Raises
    ------
    ValueError
        Block sizes do not tile the problem.
    """
    from tvm import s_tir

    isa_name = isa.name if isinstance(isa, _isa.Isa) else _isa.from_name(isa).name
    config.check(problem)
    pq = problem.p * problem.q
    sch = s_tir.Schedule(workload(problem, batch, expression_isa(isa_name, config.bc)))
    conv = sch.get_sblock("conv")
    sch.transform_layout(conv, ("write", 0),
                         lambda n, i, j, o: (n * pq + i * problem.q + j, o))
    n, p, q, c, r, s = sch.get_loops(conv)
    q_blocks, q_body = sch.split(q, [None, config.bq])
    c_blocks, c_body = sch.split(c, [None, config.bc])
    if config.parallel_channels:
        sch.reorder(n, p, c_blocks, q_blocks, r, s, q_body, c_body)
        task = sch.fuse(n, p, c_blocks)
    else:
        sch.reorder(n, p, c_blocks, q_blocks, r, s, q_body, c_body)
        task = sch.fuse(n, p)
    if problem.epilogue.ops:
        sch.compute_inline(sch.get_sblock("view"))
        epilogue = sch.get_sblock("epilogue")
        sch.reverse_compute_at(epilogue, q_blocks)
        *_, e_rows, e_cols = sch.get_loops(epilogue)
        lanes = vector_lanes(sch.get(epilogue).body)  # a 16-lane conversion instruction's
        if lanes is not None and config.bc > lanes:
            e_cols = sch.split(e_cols, [None, lanes])[1]
        sch.vectorize(e_cols)
        sch.unroll(e_rows)
    else:
        # The tile accumulates in a local buffer, written back once.
        store = sch.cache_write(conv, 0, "local")
        sch.reverse_compute_at(store, q_blocks)
        *_, s_rows, s_cols = sch.get_loops(store)
        sch.vectorize(s_cols)
        sch.unroll(s_rows)
    sch.parallel(task)
    # Annotated while the conv is still a whole reduction block (vectorize checks that).
    sch.unroll(r)
    sch.unroll(s)
    sch.unroll(q_body)
    sch.vectorize(c_body)
    init = sch.decompose_reduction(conv, r)
    *_, i_rows, i_cols = sch.get_loops(init)
    sch.vectorize(i_cols)
    sch.unroll(i_rows)
    return sch


def _lanes(machine: Machine) -> int:
    return machine.isa.lanes("float32")  # = int32 lanes: the accumulators' vectors


def _default_bc(c: int, lanes: int) -> int:
    """One accumulator vector of channels where it divides C; else the divisor of C up to two
    vectors whose channels take the fewest vector operations each, in whole, half and
    quarter vectors (:func:`_vector_ops`), the larger of equals.  A channel left over from
    those costs a scalar operation and its own inserts: ShuffleNet's 136 channels in blocks
    of 17 (16 + 1) ran 1.77x slower than in blocks of 8 (half vectors) on a Zen 4.

    >>> _default_bc(136, 16), _default_bc(40, 16), _default_bc(136, 8), _default_bc(21, 16)
    (8, 20, 8, 21)
    """
    if c % lanes == 0:
        return lanes
    return max((d for d in divisors(c) if d <= 2 * lanes),
               key=lambda d: (d / _vector_ops(d, lanes), d))


def _vector_ops(channels: int, lanes: int) -> int:
    """Operations on ``channels`` lanes: whole vectors, then a half and a quarter vector
    where they fit, then a scalar operation per channel left, weighted as four (the inserts
    and extracts around it)."""
    ops = channels // lanes
    left = channels % lanes
    for width in (lanes // 2, lanes // 4):
        if width >= 4 and left >= width:
            ops, left = ops + 1, left - width
    return ops + 4 * left


def default_config(problem: DepthwiseProblem, machine: Machine) -> DepthwiseConfig:
    """Blocks from the shape and the ISA's vectors.

    * ``bc`` -- one accumulator vector (16 channels on AVX-512, 8 on AVX2) when it divides
      C, else the divisor of C up to two vectors that is fewest vector operations per
      channel (:func:`_default_bc`);
    * ``bq`` -- the largest divisor of Q whose tile takes at most 14 accumulator vectors;
    * the channel blocks join the parallel loop when ``N*P`` alone gives a thread fewer than
      four tasks.

    Examples
    --------
    >>> from microkernels import isa
    >>> m = Machine(isa.from_name("avx2"), isa.DEFAULT_CACHES, threads=2)
    >>> default_config(DepthwiseProblem(1, 40, 7, 7, 3, 3, padding=1), m)
    DepthwiseConfig(bq=7, bc=8, parallel_channels=True)
    """
    lanes = _lanes(machine)
    bc = _default_bc(problem.c, lanes)
    vectors = -(-bc // lanes)
    bq = max(d for d in divisors(problem.q) if d * vectors <= _MAX_TILE_VECTORS or d == 1)
    few = problem.n * problem.p < 4 * machine.threads
    return DepthwiseConfig(bq=bq, bc=bc, parallel_channels=few)


def candidates(problem: DepthwiseProblem, machine: Machine) -> list[DepthwiseConfig]:
    """A short list of configurations worth measuring, :func:`default_config`'s first: the
    other parallel loop, two nearest other ``bq`` and ``bc`` (up to two vectors).

    Examples
    --------
    >>> from microkernels import isa
    >>> m = Machine(isa.from_name("avx512"), isa.DEFAULT_CACHES, threads=2)
    >>> found = candidates(DepthwiseProblem(1, 144, 56, 56, 3, 3, padding=1), m)
    >>> found[0] == default_config(DepthwiseProblem(1, 144, 56, 56, 3, 3, padding=1), m)
    True
    """
    base = default_config(problem, machine)
    lanes = _lanes(machine)
    found = [base, replace(base, parallel_channels=not base.parallel_channels)]
    found += [replace(base, bq=bq) for bq in near_divisors(problem.q, base.bq, 2, hi=28)]
    found += [replace(base, bc=bc) for bc in near_divisors(problem.c, base.bc, 2,
                                                           hi=2 * lanes)]
    unique: list[DepthwiseConfig] = []
    for config in found:
        if config not in unique:
            unique.append(config)
    return unique


# --------------------------------------------------------------------------------------------
# numpy layouts and semantics (tests, and the graph pass's weight packing)


def pack_input(x: np.ndarray, problem: DepthwiseProblem, pad_value: float | int = 0
               ) -> np.ndarray:
    """NCHW ``x`` -> the kernel's padded NHWC ``X[N][Hp][Wp][C]`` in ``problem.dtype``, the
    border holding ``pad_value`` (a quantized input's zero point).

    Examples
    --------
    >>> p = DepthwiseProblem(1, 2, 1, 1, 1, 2, padding=(0, 1, 0, 0), dtype="uint8")
    >>> pack_input(np.array([[[[3]], [[4]]]], "uint8"), p, pad_value=9)[0, 0].tolist()
    [[9, 9], [3, 4]]
    """
    if x.shape != (problem.n, problem.c, problem.h, problem.w):
        raise ValueError(f"x must be NCHW {[problem.n, problem.c, problem.h, problem.w]}, "
                         f"got {list(x.shape)}")
    top, left, bottom, right = problem.padding
    nhwc = _input_values(np.transpose(x, (0, 2, 3, 1)), problem.dtype)
    padded = np.pad(nhwc, ((0, 0), (top, bottom), (left, right), (0, 0)),
                    constant_values=_pad_scalar(pad_value, problem.dtype))
    return np.ascontiguousarray(padded)


def pack_weight(w: np.ndarray, problem: DepthwiseProblem) -> np.ndarray:
    """``[C, 1, R, S]`` ``w`` -> ``W[R][S][C]`` in ``problem.weight_dtype`` (bfloat16 rounded
    to nearest even from float32; uint8 problems take integers in [-128, 127]).

    Examples
    --------
    >>> p = DepthwiseProblem(1, 2, 3, 3, 1, 2)
    >>> pack_weight(np.arange(4, dtype="float32").reshape(2, 1, 1, 2), p)[0].tolist()
    [[0.0, 2.0], [1.0, 3.0]]
    """
    want = (problem.c, 1, problem.r, problem.s)
    if tuple(w.shape) != want:
        raise ValueError(f"W must be [C, 1, R, S] {list(want)}, got {list(w.shape)}")
    values = (np.asarray(w, np.float32) if problem.dtype == "float32"
              else _weight_values(np.asarray(w), problem.weight_dtype))
    return np.ascontiguousarray(values[:, 0].transpose(1, 2, 0))


def reference(problem: DepthwiseProblem, x: np.ndarray, w: np.ndarray,
              pad_value: float | int = 0) -> np.ndarray:
    """NCHW depthwise ``conv2d(x, w)`` of the input padded with ``pad_value``, without the
    epilogue: int64 when ``x`` and ``w`` are integers (exact), else float64.

    Examples
    --------
    >>> p = DepthwiseProblem(1, 1, 1, 1, 1, 3, padding=(0, 1, 0, 1), dtype="uint8")
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
    for i in range(problem.r):
        for j in range(problem.s):
            taps = xp[:, :, i * dh:i * dh + (problem.p - 1) * sh + 1:sh,
                      j * dw:j * dw + (problem.q - 1) * sw + 1:sw]
            out += taps * w[:, 0, i, j].astype(wide)[None, :, None, None]
    return out
