"""The packed input of a conv with its filter rows folded into channels, as one kernel.

:meth:`schedules.conv.ConvProblem.rows_folded` reads, for each output row, the R input rows
its filter covers stacked as channels.  Built from Relax's pad, R strided slices, concat and
the usual transpose and pads, TVM lowers that to a dozen loop nests with a buffer each
(ResNet-50's uint8 stem at batch 8 on a Sapphire Rapids: 7.2 ms, three times its 2.3 ms
conv; this kernel 0.8 ms).  It writes the folded conv's packed input ``X[N][P][Wq][sw][C'']`` (the
:attr:`~schedules.conv.ConvProblem.input_shape` of the folded problem, its last axis split)
straight from the NCHW input in one pass: element ``[n, p, q, phase, r*C + c]`` is input
pixel ``(c, p*sh + r*dh - top, q*sw + phase - left)``, or ``pad_value`` outside the image
and in the padded channels ``R*C .. C''``.  Images and output rows run in parallel.

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
from tvm import s_tir, te

if TYPE_CHECKING:
    from tvm.tirx import PrimFunc

    from .conv import ConvProblem

__all__ = ["stacked_rows_kernel"]


def stacked_rows_kernel(problem: ConvProblem, dtype: str, pad_value: float | int = 0,
                        run_time_batch: bool = False) -> PrimFunc:
    """``(X, Y)``: ``X`` NCHW of ``dtype`` (``problem``'s input), ``Y`` the packed input of
    ``problem.rows_folded()``, its last axis split by the stride's phases (module doc); with
    ``run_time_batch`` the images are a symbolic size of both, ``problem`` one image's."""
    folded = problem.rows_folded()
    images = tvm.tirx.Var("n", "int64") if run_time_batch else problem.n
    c, h, w = problem.c, problem.h, problem.w
    top, left, _, _ = problem.padding
    (sh, sw), dh = problem.stride, problem.dilation[0]
    channels, stacked = folded.padded_c, problem.r * c
    x = te.placeholder((images, c, h, w), dtype, name="X")
    pad = tvm.tirx.const(pad_value, dtype)

    def value(n, p, q, phase, channel):
        row = p * sh + channel // c * dh - top
        col = q * sw + phase - left
        inside = tvm.tirx.all(channel < stacked, row >= 0, row < h, col >= 0, col < w)
        return tvm.tirx.if_then_else(inside, x[n, channel % c, row, col], pad)

    # Each pixel's channels in an unrolled loop: its taps' divisions fold into constants.
    y = te.compute((images, *folded.input_shape[1:3], sw, channels), value, name="stacked")
    sch = s_tir.Schedule(te.create_prim_func([x, y]))
    images_loop, rows, _, _, channel = sch.get_loops(sch.get_sblock("stacked"))
    sch.parallel(sch.fuse(images_loop, rows))
    sch.unroll(channel)
    return sch.mod["main"].with_attr("tirx.noalias", True)
