"""Max pooling of an NHWC bfloat16 tensor on its bits, as one kernel.

TVM lowers a vectorized bfloat16 ``max_pool2d`` by computing in float32 and fails storing the
result (a float32 vector into a bf16 buffer), so a bf16 network's pools ran in float32 on a
widened copy: VGG-19's five pools, 17 ms of its bf16 run at batch 8 on a Sapphire Rapids,
reading and writing four bytes a value.  This kernel compares bf16 values as integers: a
value's bits ``b`` (int16) map to the key ``b ^ ((b >> 15) & 0x7fff)``, which orders as the
floats do (the sign-magnitude negatives flipped into two's complement; ``-0.0`` just below
``+0.0``), and the key maps back to the bits by the same formula.  A window's maximum key is
its maximum value's; padding pixels take the smallest key.  Images and output rows run in
parallel, channels in vectors.

Examples
--------
>>> f = max_pool_bf16_kernel((1, 6, 6, 8), (3, 3), (2, 2), (1, 1, 1, 1))
>>> 'pooled: T.Buffer((1, 3, 3, 8), "bfloat16")' in f.script()
True
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import tvm
from tvm import s_tir, te

from microkernels.isa import CACHE_LINE

if TYPE_CHECKING:
    from tvm.tirx import PrimExpr, PrimFunc

__all__ = ["max_pool_bf16_kernel", "pooled_size"]

#: The smallest key: no bf16 value has it, so a padding pixel never wins a window.
_PAD_KEY = -(1 << 15)


def pooled_size(size: int, window: int, stride: int, before: int, after: int) -> int:
    """Output positions of a pool along one axis (floor mode).

    >>> pooled_size(112, 3, 2, 1, 1), pooled_size(224, 2, 2, 0, 0)
    (56, 112)
    """
    return (size + before + after - window) // stride + 1


def _key(bits: PrimExpr) -> PrimExpr:
    return bits ^ ((bits >> 15) & tvm.tirx.const(0x7FFF, "int16"))


def max_pool_bf16_kernel(shape: tuple[int, int, int, int], window: tuple[int, int],
                         strides: tuple[int, int], padding: tuple[int, int, int, int]
                         ) -> PrimFunc:
    """``(X, pooled)``: the ``window`` max pool of the NHWC bf16 ``X`` of ``shape`` with
    ``strides`` and ``padding`` (top, left, bottom, right), floor mode, no dilation."""
    n, h, w, c = shape
    (r, s), (sh, sw), (top, left, bottom, right) = window, strides, padding
    p, q = pooled_size(h, r, sh, top, bottom), pooled_size(w, s, sw, left, right)
    x = te.placeholder(shape, "bfloat16", name="X")

    def key(i, row, col, ch):
        inside = tvm.tirx.all(row >= 0, row < h, col >= 0, col < w)
        bits = tvm.tirx.reinterpret("int16", x[i, row, col, ch])
        return tvm.tirx.if_then_else(inside, _key(bits), tvm.tirx.const(_PAD_KEY, "int16"))

    def window_max(i, y, z, ch):  # the window spelt out (no reduction): a vector a channel
        keys = [key(i, y * sh + dr - top, z * sw + ds - left, ch)
                for dr in range(r) for ds in range(s)]
        return tvm.tirx.reinterpret("bfloat16", _key(functools.reduce(tvm.tirx.max, keys)))

    pooled = te.compute((n, p, q, c), window_max, name="pooled")
    sch = s_tir.Schedule(te.create_prim_func([x, pooled]))
    images, rows, _, channels = sch.get_loops(sch.get_sblock("pooled"))
    sch.parallel(sch.fuse(images, rows))
    lanes = CACHE_LINE // 2  # int16 lanes of a 512-bit vector
    if c % lanes == 0:
        _, inner = sch.split(channels, [None, lanes])
        sch.vectorize(inner)
    return sch.mod["main"].with_attr("tirx.noalias", True)
