"""The Relax pipeline of the ``tpp`` target.

Graph preparation (:func:`relay_passes.prepare.prepare`: scale-shift chains such as BatchNorm
folded, into conv weights where a conv precedes them, inference-only decompositions,
constant folding), then for targets carrying the ``tpp``
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

from microkernels.fast_math import fast_math
from microkernels.machine import is_tpp, machine_of
from schedules.fallback import fallback_schedules
from schedules.register_epilogue import register_epilogues
from schedules.tile_config import configure_tiles_once_pass
from schedules.tuner import TaskCollector, Tuner

from .batch_matmul import rewrite_batch_matmul
from .bf16_concat_chains import concat_chains_in_bf16
from .bf16_pools import max_pools_in_bf16
from .casts_first import casts_before_reshapes
from .concat_chain import write_concat_chains
from .concat_slices import write_concat_slices
from .conv import rewrite_conv
from .dense import rewrite_dense
from .guards import guard_gathers
from .inplace import write_over_dead_operands
from .keep_int8 import keep_int8
from .lookup_tables import lookup_tables
from .padded_outputs import write_padded_outputs
from .parallel_dense import combine_parallel_dense
from .pool_fusion import pools_take_producers
from .prepare import prepare, sum_to_add
from .qdq import rewrite_qdq
from .scaffold import Offload
from .slice_reads import read_slices_in_place

__all__ = ["prepare", "tpp_rewrites", "tpp_pipeline"]


def tpp_rewrites(
    target: Target, report: list[Offload] | None = None, tuner: Tuner | TaskCollector | None = None,
    precision: str = "float32",
) -> tvm.transform.Pass:
    """Route a ``tpp`` target's int8 (QDQ) dense layers, prepare, then route its float dense,
    conv and attention chains to TPP kernels (other targets: preparation only); no lowering.

    ``report`` (if given) receives one :class:`~relay_passes.scaffold.Offload` per matched
    operator: the kernel it became or why it stayed with TVM.  ``tuner`` gives each GEMM,
    convolution and batch GEMM its tuned configuration (a :class:`~schedules.tuner.Tuner`),
    or records them as tuning tasks (a :class:`~schedules.tuner.TaskCollector`); operators
    without one get their defaults.  ``precision`` (``"float32"`` or ``"bf16"``:
    :data:`relay_passes.dense.PRECISIONS`) is what the float dense layers, convolutions and
    attention's batch GEMMs multiply in.
    """

    @tvm.transform.module_pass(opt_level=0, name="TppRewrites")
    def _rewrites(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        # ONNX's bounds where TVM's take would read past its tensor (any target).
        mod = guard_gathers(mod)
        if not is_tpp(target):
            return prepare()(mod)
        found = report if report is not None else []
        # Quantized (QDQ) layers first: prepare's FoldConstant would fold dequantize(W_q)
        # into float32 weights and lose the int8 values and their scales.  Before them, the
        # round trips through float32 around data movement go, so the kernels read integers.
        mod = rewrite_qdq(sum_to_add(keep_int8(mod)), target, found, tuner)
        mod = prepare()(mod)
        # Attention's Q, K and V projections as one dense layer, split (read in place).
        mod = rewrite_dense(combine_parallel_dense(mod), target, found, tuner, precision)
        if precision == "bf16":  # DenseNet's block buffers in bf16, as its bf16 convs use them
            mod = concat_chains_in_bf16(mod)
        mod = rewrite_conv(mod, target, found, tuner, precision)
        # Max pools between bf16 convs pool the bf16 tensors the convs hand over.
        mod = max_pools_in_bf16(mod)
        # What dense left: matmuls whose operands both vary.
        mod = rewrite_batch_matmul(mod, target, found, tuner, precision)
        # Elementwise chains between int8 tensors (DenseNet's quantized pre-activations),
        # their tables read a block of channels at a time from half of L1.
        mod = lookup_tables(mod, machine_of(target).caches.l1d // 2)
        # DenseNet's concat chains: each layer's channels written into one buffer; the other
        # concats' inputs written into their channels by the kernels computing them.
        mod = write_concat_slices(write_concat_chains(mod))
        # The rewrites leave reshape-of-reshape chains; fused, one would be a copy kernel.
        # Cancelled permutes leave var-to-var aliases, across which FuseOps would not fuse
        # a chain into its consumer (HardSwish into the pad of the depthwise conv after it).
        mod = relax.transform.CanonicalizeBindings()(
            relax.transform.RemoveRedundantReshape()(mod))
        # Kernels read channel prefixes of DenseNet's block buffers in place, and each conv
        # before a pad writes the padded tensor itself (both need the aliases gone).
        mod = write_padded_outputs(read_slices_in_place(mod))
        # Last, as it changes the astype(reshape(x)) form the rewrites read: casts fuse into
        # their producers (a layer norm writes the bf16 input of the dense after it).
        return casts_before_reshapes(mod)

    return _rewrites


def tpp_pipeline(
    target: Target, report: list[Offload] | None = None, tuner: Tuner | None = None,
    precision: str = "float32",
) -> tvm.transform.Pass:
    """:func:`tpp_rewrites`, then TVM's CPU lowering with schedules for what stayed with TVM
    (a target without the ``tpp`` key gets TVM's default pipeline after the preparation);
    float32 exp/erf/tanh/sigmoid become vectorizable polynomials
    (:func:`microkernels.fast_math.fast_math`)."""

    @tvm.transform.module_pass(opt_level=0, name="TppPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod = tpp_rewrites(target, report, tuner, precision)(mod)
        if not is_tpp(target):
            return relax.get_default_pipeline(target)(mod)
        with target:
            return tvm.transform.Sequential(
                cpu.library_dispatch_passes(target)
                + _legalize_passes(target)
                + [fallback_schedules(), fast_math()]
                + _dataflow_lower_passes(target)
                # After the in-place pass, which reads each epilogue as a block of its own.
                + [register_epilogues(),
                   configure_tiles_once_pass(machine_of(target).threads)]
                + cpu.finalize_passes(target),
                name="TppLower",
            )(mod)

    return _pipeline


def _legalize_passes(target: Target) -> list[tvm.transform.Pass]:
    """TVM's CPU legalization with :func:`~.pool_fusion.pools_take_producers` right after
    ``AnnotateTIROpPattern``, before ``FuseOps`` reads the patterns."""
    passes = cpu.legalize_passes(target)
    names = [p.info.name for p in passes]
    if "AnnotateTIROpPattern" not in names or "FuseOps" not in names:
        raise RuntimeError(f"TVM's CPU legalization is {names}: no AnnotateTIROpPattern "
                           "before FuseOps")
    at = names.index("AnnotateTIROpPattern") + 1
    return [*passes[:at], pools_take_producers(), *passes[at:]]


def _dataflow_lower_passes(target: Target) -> list[tvm.transform.Pass]:
    """TVM's CPU dataflow lowering with :func:`~.inplace.write_over_dead_operands` right after
    ``RewriteDataflowReshape``: every view is a ``reshape`` by then, and the dataflow blocks
    whose liveness it reads are still there."""
    passes = cpu.dataflow_lower_passes(target)
    first = passes[0].info.name
    if first != "RewriteDataflowReshape":
        raise RuntimeError(f"TVM's CPU dataflow lowering starts with {first}, "
                           "not RewriteDataflowReshape")
    return [passes[0], write_over_dead_operands(), *passes[1:]]
