"""Graph rewrites on Relax: route matmul/dense/conv patterns and their epilogues to TPP kernels.

Everything not matched keeps TVM's own lowering.  :func:`pipeline.tpp_pipeline` is the Relax
pipeline the ``tpp`` target compiles with.

Modules: :mod:`.scaffold` (what the passes share: the :class:`Offload` record, epilogue patterns,
the rewrite loop, kernel marking, the leftover report), :mod:`.scale_shift` (BatchNorm and the
other per-channel scale-shift chains folded, into the conv before them where there is one),
:mod:`.prepare` (the ONNX Sum repair, :func:`~.prepare.prepare`), :mod:`.dense`, :mod:`.conv` and
:mod:`.batch_matmul` (the three offload passes), :mod:`.layouts` (NHWC/NCHW cancellation between
TPP convs), :mod:`.concat_chain` (concat chains written into one buffer), :mod:`.inplace`
(outputs written over dead operands) and :mod:`.pipeline`.
"""

from .scaffold import Offload, tpp_flops_fraction

__all__ = ["Offload", "tpp_flops_fraction"]
