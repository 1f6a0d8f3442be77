"""Graph rewrites on Relax: route matmul/dense/conv patterns and their epilogues to TPP kernels.

Everything not matched keeps TVM's own lowering.  :func:`pipeline.tpp_pipeline` is the Relax
pipeline the ``tpp`` target compiles with.
"""

from .dense import Offload

__all__ = ["Offload"]
