"""The Relax pipeline of the ``tpp`` target.

Graph preparation (:func:`relay_passes.prepare.prepare`: inference-only decompositions,
BatchNorm folded into conv weights, constant folding), then for targets carrying the ``tpp``
key the TPP rewrites and TVM's CPU lowering with schedules for what stayed with TVM
(:mod:`schedules.fallback`); other targets get TVM's default CPU pipeline unchanged.

Examples
--------
>>> import tvm
>>> from relay_passes.pipeline import tpp_pipeline
>>> ex = tvm.compile(mod, target=tgt, relax_pipeline=tpp_pipeline(tgt))   # doctest: +SKIP
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.backend.cpu_generic import pipeline as cpu
from tvm.target import Target

from microkernels.machine import is_tpp
from schedules.fallback import fallback_schedules
from schedules.tuner import Tuner

from .batch_matmul import rewrite_batch_matmul
from .conv import rewrite_conv
from .dense import rewrite_dense
from .prepare import prepare
from .scaffold import Offload

__all__ = ["prepare", "tpp_pipeline"]


def tpp_pipeline(
    target: Target, report: list[Offload] | None = None, tuner: Tuner | None = None
) -> tvm.transform.Pass:
    """Prepare, rewrite to TPP kernels when ``target`` is a tpp target, then lower.

    ``report`` (if given) receives one :class:`~relay_passes.scaffold.Offload` per matched
    operator: the kernel it became or why it stayed with TVM.  ``tuner`` picks the
    configuration of each dense GEMM, convolution and batch GEMM from its database, tuning
    the ones it does not know.
    """

    @tvm.transform.module_pass(opt_level=0, name="TppPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod = prepare()(mod)
        if not is_tpp(target):
            return relax.get_default_pipeline(target)(mod)
        found = report if report is not None else []
        mod = rewrite_dense(mod, target, found, tuner)
        mod = rewrite_conv(mod, target, found, tuner)
        # What dense left: matmuls whose operands both vary.
        mod = rewrite_batch_matmul(mod, target, found, tuner)
        # The rewrites leave reshape-of-reshape chains; fused, one would be a copy kernel.
        mod = relax.transform.RemoveRedundantReshape()(mod)
        with target:
            return tvm.transform.Sequential(
                cpu.library_dispatch_passes(target)
                + cpu.legalize_passes(target)
                + [fallback_schedules()]
                + cpu.dataflow_lower_passes(target)
                + cpu.finalize_passes(target),
                name="TppLower",
            )(mod)

    return _pipeline
