"""ConvTranspose as a convolution the conv rewrite routes to TPP kernels (sub-pixel form).

A stride-``s`` transposed convolution scatters each input pixel over a ``k x k`` window of
the output; output row ``i = h*s + a - pad`` takes tap ``a`` of input row ``h``.  Split by
the phase ``r = (i + pad) mod s``, each phase is a plain correlation of the *input* with
every ``s``-th tap, flipped: the taps ``a = r + s*t``, ``t < kq = ceil((k + output_padding)
/ s)`` (the kernel zero-padded to ``kq * s`` taps).  So the whole operator is

1. one ``conv2d`` of ``x`` with ``s_h * s_w * K`` output channels (a ``kq_h x kq_w`` filter
   per phase and output channel), padded by ``kq - 1`` on every side;
2. its phases interleaved into the output rows and columns (``reshape -> permute_dims ->
   reshape``: depth-to-space);
3. the ``pad`` rows and columns cropped (``strided_slice``).

No multiply by an inserted zero (the zero-insertion form would waste ``s^2`` of them), and
step 1 is an ordinary conv with a constant weight: the conv rewrite puts it on a TPP kernel.
For ``k = s`` (PP-OCR's and U-Nets' 2x2, stride-2 upsampling) the conv is a 1x1.  Grouped or
dilated ConvTransposes stay as they are (reported as left to TVM).

Examples
--------
>>> from relay_passes.scaffold import is_call_to
>>> x = relax.Var("x", relax.TensorType((1, 4, 5, 5), "float32"))
>>> bb = relax.BlockBuilder()
>>> with bb.function("main", [x]):
...     w = relax.const(np.ones((4, 3, 2, 2), "float32"))
...     _ = bb.emit_func_output(bb.emit(relax.op.nn.conv2d_transpose(x, w, strides=2)))
>>> convs = []
>>> relax.analysis.post_order_visit(transposed_as_conv(bb.get())["main"], lambda e: convs.append(
...     e) if is_call_to(e, "relax.nn.conv2d") else None)
>>> [(c.args[1].ty.shape, tuple(c.attrs.padding)) for c in convs]
[(R.shape([12, 4, 1, 1]), (0, 0, 0, 0))]
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

from .scaffold import batched_shape, map_functions

__all__ = ["transposed_as_conv", "phase_weight"]


def phase_weight(weight: np.ndarray, stride: tuple[int, int], taps: tuple[int, int]
                 ) -> np.ndarray:
    """The ``[s_h * s_w * K, C, kq_h, kq_w]`` (OIHW) filter of the sub-pixel conv of an
    ``IOHW`` ConvTranspose weight ``[C, K, k_h, k_w]``: output channel ``(r_h * s_w + r_w) *
    K + o`` holds phase ``(r_h, r_w)``'s taps ``r + s * t`` flipped (``kq = taps``).

    Examples
    --------
    >>> w = np.arange(4, dtype="float32").reshape(1, 1, 2, 2)   # taps a, b / c, d
    >>> phase_weight(w, (2, 2), (1, 1))[:, 0, 0, 0]              # one tap per phase
    array([0., 1., 2., 3.], dtype=float32)
    """
    c, k, kh, kw = weight.shape
    (sh, sw), (qh, qw) = stride, taps
    padded = np.zeros((c, k, qh * sh, qw * sw), weight.dtype)
    padded[:, :, :kh, :kw] = weight
    # Tap a = t * s + r: split each kernel axis into (t, r), flip t.
    split = padded.reshape(c, k, qh, sh, qw, sw)[:, :, ::-1, :, ::-1, :]
    return np.ascontiguousarray(split.transpose(3, 5, 1, 0, 2, 4).reshape(sh * sw * k, c, qh, qw))


def transposed_as_conv(mod: tvm.IRModule) -> tvm.IRModule:
    """Every ``conv2d_transpose`` with a constant weight (NCHW, groups 1, dilation 1) as the
    sub-pixel conv, interleave and crop of the module doc.  The caller's module stays as it
    was."""
    pattern = is_op("relax.nn.conv2d_transpose")(wildcard(), is_const())

    def rewriter(orig: relax.Expr, _matches) -> relax.Expr:
        converted = _as_conv(orig)
        return orig if converted is None else converted

    return map_functions(mod, lambda func: rewrite_call(pattern, rewriter, func))


def _as_conv(call: relax.Call) -> relax.Expr | None:
    x, w = call.args
    a = call.attrs
    layouts = (str(a.data_layout), str(a.kernel_layout), str(a.out_layout))
    batched = batched_shape(x.ty.shape) if isinstance(x.ty, relax.TensorType) else None
    out = batched_shape(call.ty.shape) if isinstance(call.ty, relax.TensorType) else None
    if (layouts != ("NCHW", "IOHW", "NCHW") or int(a.groups) != 1 or batched is None
            or out is None or len(batched[0]) != 4 or any(int(d) != 1 for d in a.dilation)
            or str(x.ty.dtype) != "float32" or str(w.ty.dtype) != "float32"):
        return None
    weight = w.value.numpy()
    _, k, kh, kw = weight.shape
    stride = tuple(int(s) for s in a.strides)
    top, left = (int(p) for p in a.padding[:2])
    extra = tuple(int(p) for p in a.output_padding)
    # Enough taps per phase that the interleaved result covers the output with its padding.
    taps = tuple(math.ceil((kk + e) / s) for kk, e, s in zip((kh, kw), extra, stride,
                                                            strict=True))
    conv = relax.op.nn.conv2d(
        x, relax.const(phase_weight(weight, stride, taps)),
        padding=(taps[0] - 1, taps[1] - 1, taps[0] - 1, taps[1] - 1))
    n = x.ty.shape[0]
    _, _, h, wd = batched[0]
    hq, wq = h + taps[0] - 1, wd + taps[1] - 1
    (sh, sw) = stride
    phases = relax.op.reshape(conv, (n, sh, sw, k, hq, wq))
    rows = relax.op.reshape(relax.op.permute_dims(phases, [0, 3, 4, 1, 5, 2]),
                            (n, k, hq * sh, wq * sw))
    ho, wo = out[0][2:]
    return relax.op.strided_slice(rows, axes=[2, 3], begin=[top, left],
                                  end=[top + ho, left + wo])
