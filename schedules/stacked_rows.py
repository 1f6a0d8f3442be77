"""The packed input of an image's first conv, written from the NCHW image by one kernel.

A network's first conv reads the image (3 channels: RGB) in the conv template's padded
channels-last layout.  :func:`padded_image_kernel` writes that layout itself;
:func:`stacked_rows_kernel` the input of :meth:`schedules.conv.ConvProblem.rows_folded`,
which reads, for each output row, the R input rows its filter covers stacked as channels.
Built from Relax's transpose and pads (and, folded, R strided slices and a concat), TVM
lowered these to loop nests writing an element at a time under a division per index
(ResNet-50's uint8 stem at batch 8 on a Sapphire Rapids: 7.2 ms, three times its 2.3 ms
conv; MobileNet-V2's float32 input at batch 8 on a Zen 4: 5 % of the profiled run).

Element ``[n, p, q, phase, r*C + c]`` of the packed input ``X[N][P][Wq][sw][C'']`` (the
:attr:`~schedules.conv.ConvProblem.input_shape`, its last axis split) is input pixel ``(c,
row, q*sw + phase - left)`` with ``row = p*sh + r*dh - top`` folded (``p - top`` unfolded,
``r = 0``), or ``pad_value`` outside the image and in the padded channels ``R*C .. C''``.
Images and output rows run in parallel; a row's pixels in blocks of 16, each channel plane a
vector load and the block's channels interleaved by one shuffle (``vpermt2ps`` on x86).  On
a Zen 4, 2 threads: ResNet-50's uint8 stem input at batch 8 0.43 -> 0.14 ms, MobileNet-V2's
float32 one 0.013 ms (TVM's 0.155 in the profile); whole networks, both builds in one
process: MobileNet-V2 float32 at batch 8 1.04x, int8 ResNet-50 1.02x.

Examples
--------
>>> from schedules.conv import ConvProblem
>>> f = stacked_rows_kernel(ConvProblem(1, 3, 9, 9, 8, 3, 3, stride=2, padding=1), "float32")
>>> 'stacked: T.Buffer((1, 5, 6, 2, 9), "float32")' in f.script()  # N, P, Wq, sw, R*C
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import tvm
from tvm import s_tir

from microkernels.epilogue import bf16_bits

from .kernel_buffers import bits_of

if TYPE_CHECKING:
    from tvm.tirx import PrimFunc

    from .conv import ConvProblem

__all__ = ["padded_image_kernel", "stacked_rows_kernel"]


def stacked_rows_kernel(problem: ConvProblem, dtype: str, pad_value: float | int = 0,
                        run_time_batch: bool = False, source_dtype: str | None = None,
                        isa: str = "generic") -> PrimFunc:
    """``(X, Y)``: ``X`` NCHW of ``source_dtype`` (``dtype`` if None: ``problem``'s input),
    ``Y`` the packed input of ``problem.rows_folded()`` in ``dtype``, its last axis split by
    the stride's phases (module doc); with ``run_time_batch`` the images are a symbolic size
    of both, ``problem`` one image's.  A float32 ``X`` of a bfloat16 ``Y`` is rounded as it
    is moved (to nearest even, :func:`microkernels.epilogue.bf16_bits`, one instruction per
    vector where ``isa`` has one): the image's cast needs no pass of its own."""
    return _image_kernel(problem, problem.rows_folded(), dtype, pad_value, run_time_batch,
                         source_dtype, isa)


def padded_image_kernel(problem: ConvProblem, dtype: str, pad_value: float | int = 0,
                        run_time_batch: bool = False, source_dtype: str | None = None,
                        isa: str = "generic") -> PrimFunc:
    """``(X, Y)``: ``X`` NCHW of ``source_dtype`` (rounded to a bfloat16 ``dtype`` as
    :func:`stacked_rows_kernel` says), ``Y`` ``problem``'s own packed input (padded NHWC,
    its last axis split by the stride's phases): an image's first conv that does not fold its
    filter rows (float32), whose input TVM's fused transpose and pads would write a scalar
    element at a time under a division per index (MobileNet-V2's at batch 8: 5 % of the run).

    >>> from schedules.conv import ConvProblem
    >>> f = padded_image_kernel(ConvProblem(1, 3, 9, 9, 8, 3, 3, stride=2, padding=1), "float32")
    >>> 'stacked: T.Buffer((1, 11, 6, 2, 3), "float32")' in f.script()  # N, Hp, Wq, sw, C'
    True
    """
    return _image_kernel(problem, problem, dtype, pad_value, run_time_batch, source_dtype, isa)


#: Pixels a vector block of the kernel moves: each of its planes (an input row of one channel)
#: is one load of so many values, the block's channels interleaved by one shuffle.
_LANES = 16


def _image_kernel(problem: ConvProblem, packed: ConvProblem, dtype: str,
                  pad_value: float | int, run_time_batch: bool,
                  source_dtype: str | None = None, isa: str = "generic") -> PrimFunc:
    """The kernel writing ``packed``'s input from ``problem``'s NCHW input: ``problem``
    itself (its padded rows), or its rows folded (each row the filter's input rows stacked
    as channels).

    An output row is its pixels' channels in order; channel ``k`` of every pixel comes from
    one plane, image row ``row(k // C)`` of channel ``k % C`` (or ``pad_value``).  The image's
    columns run in blocks of :data:`_LANES` pixels: a load per plane, one shuffle
    interleaving them, one store; the border columns and the last columns short of a block
    an element at a time.  It moves bits, through unsigned views of both buffers (TVM
    legalizes no bfloat16 vector); a float32 ``X`` of a bfloat16 ``Y`` is rounded on them."""
    source = source_dtype or dtype
    if source != dtype and (source, dtype) != ("float32", "bfloat16"):
        raise ValueError(f"an image's packed input is its own dtype or float32 rounded to "
                         f"bfloat16, not {source} -> {dtype}")
    pad = bits_of(pad_value, dtype)
    word, source_word = str(pad.ty), str(bits_of(0, source).ty)

    def narrowed(bits: tvm.tirx.PrimExpr) -> tvm.tirx.PrimExpr:
        """``X``'s bits as ``Y``'s: themselves, or a float32's rounded to bfloat16 (by
        ``isa``'s instruction in whole vectors)."""
        if source == dtype:
            return bits
        lanes = str(bits.ty).removeprefix(source_word)
        return bf16_bits(tvm.tirx.reinterpret(f"float32{lanes}", bits),
                         isa if lanes == f"x{_LANES}" else "generic")

    index = "int64" if run_time_batch else "int32"

    def const(v: int) -> tvm.tirx.PrimExpr:
        return tvm.tirx.const(v, index)

    images = tvm.tirx.Var("n", "int64") if run_time_batch else const(problem.n)
    c, h, w = problem.c, problem.h, problem.w
    top, left, _, _ = problem.padding
    (sh, sw), dh = problem.stride, problem.dilation[0]
    rows = packed.c // c  # input rows a packed row stacks: the filter's, or itself
    step = sh if packed is not problem else 1  # a folded row starts an output row
    channels, planes = packed.padded_c, rows * c
    out_rows, wq = packed.input_shape[1], packed.wq
    pixels = wq * sw
    x = tvm.tirx.decl_buffer((images, const(c), const(h), const(w)), source, "X")
    y = tvm.tirx.decl_buffer((images, const(out_rows), const(wq), const(sw), const(channels)),
                             dtype, "stacked")
    xw = tvm.tirx.decl_buffer(x.shape, source_word, "X_bits", data=x.data)
    yw = tvm.tirx.decl_buffer((images * const(out_rows * pixels * channels),), word, "Y_bits",
                              data=y.data)
    nr, b = (tvm.tirx.Var(name, index) for name in ("nr", "b"))
    n, p = nr // const(out_rows), nr % const(out_rows)
    base = nr * const(pixels * channels)

    def row_of(plane: tvm.tirx.PrimExpr) -> tvm.tirx.PrimExpr:
        return p * const(step) + plane // const(c) * const(dh) - const(top)

    def pixels_from(first: int, end: int) -> tvm.tirx.Stmt:
        """The pixels ``first .. end`` of the row, an element at a time."""
        pixel, k = tvm.tirx.Var("j", index), tvm.tirx.Var("k", index)
        row, col = row_of(k), pixel - const(left)
        inside = tvm.tirx.all(k < const(planes), row >= const(0), row < const(h),
                              col >= const(0), col < const(w))
        value = tvm.tirx.if_then_else(
            inside, narrowed(tvm.tirx.BufferLoad(xw, [n, k % const(c), row, col])), pad)
        store = tvm.tirx.BufferStore(yw, value, [base + pixel * const(channels) + k])
        return tvm.tirx.For(pixel, const(first), const(end - first), tvm.tirx.ForKind.SERIAL,
                            tvm.tirx.For(k, const(0), const(channels),
                                         tvm.tirx.ForKind.UNROLLED, store))

    def plane(q: int, col0: tvm.tirx.PrimExpr) -> tvm.tirx.PrimExpr:
        """Channel ``q`` of the block of pixels from ``col0`` on (``pad`` outside the image)."""
        fill = tvm.tirx.Broadcast(pad, _LANES)
        if q >= planes:
            return fill
        row = row_of(const(q))
        load = narrowed(tvm.tirx.BufferLoad(xw, [n, const(q % c), row,
                                                 tvm.tirx.Ramp(col0, const(1), _LANES)]))
        return tvm.tirx.if_then_else(tvm.tirx.all(row >= const(0), row < const(h)), load, fill)

    blocks = w // _LANES
    done = left + blocks * _LANES  # the first pixel after the vector blocks
    order = [q * _LANES + i for i in range(_LANES) for q in range(channels)]  # pixel-major
    col0 = b * const(_LANES)
    vector = tvm.tirx.BufferStore(
        yw, tvm.tirx.Shuffle([plane(q, col0) for q in range(channels)], order),
        [tvm.tirx.Ramp(base + (const(left) + col0) * const(channels), const(1),
                       _LANES * channels)])
    parts = [pixels_from(0, left)] if left else []
    if blocks:
        parts.append(tvm.tirx.For(b, const(0), const(blocks), tvm.tirx.ForKind.SERIAL, vector))
    if pixels > done:
        parts.append(pixels_from(done, pixels))
    loop = tvm.tirx.For(nr, const(0), images * const(out_rows), tvm.tirx.ForKind.PARALLEL,
                        tvm.tirx.SeqStmt(parts) if len(parts) > 1 else parts[0])
    body = tvm.tirx.SeqStmt([tvm.tirx.DeclBuffer(xw, data=x.data),
                             tvm.tirx.DeclBuffer(yw, data=y.data), loop])
    # A root block, as every PrimFunc Relax analyses (its reshape pattern) has.
    root = s_tir.SBlock([], [], [], "root", body)
    func = tvm.tirx.PrimFunc([x, y], s_tir.SBlockRealize([], True, root))
    return func.with_attr({"tirx.noalias": True, "tirx.is_scheduled": True,
                           "global_symbol": "main"})
