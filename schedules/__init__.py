"""PARLOOPER-style outer-loop schedules: loop_spec strings, their candidate space, a cost model,
the operator templates and their tuner.

This package is the layer above :mod:`microkernels`. The pure-Python half needs no TVM:

:mod:`schedules.loop_spec`
    Parses, validates and interprets loop_spec strings such as ``"bcaBCb"`` or
    ``"bC{R:16}aB{C:4}cb"``. It documents how each construct maps onto TVM's thread pool.
:mod:`schedules.space`
    PARLOOPER's generation rules for a blocked GEMM (:class:`BlockedGemm`). It provides
    :class:`Candidate`, :func:`generate` and a default :func:`heuristic`.
:mod:`schedules.cost_model`
    The trace-driven LRU cache model of [PL] §II-E. :func:`predict` and :func:`rank`
    order candidates without measuring them.

Only these light modules are re-exported here. The others import TVM when they build, and
must be imported explicitly:

* the operator templates, each with its problem, config, workload, schedule, default config
  and candidates: :mod:`schedules.gemm`, :mod:`schedules.conv`, :mod:`schedules.batch_gemm`
  (block sizes from :mod:`schedules.blocking`, loop nests from :mod:`schedules.nest`);
* the tuner, split by job: :mod:`schedules.ops` (the operator registry),
  :mod:`schedules.database`, :mod:`schedules.measure`, :mod:`schedules.search` (``tune``)
  and :mod:`schedules.tuner`, the interface the graph passes and the compiler use;
* :mod:`schedules.ms_space` (the space as MetaSchedule design spaces) and
  :mod:`schedules.fallback` (schedules for what stays with TVM).

Examples
--------
>>> from schedules import BlockedGemm, generate, rank
>>> gemm = BlockedGemm(256, 256, 256, 32, 32, 32)
>>> best_cycles, best = rank(generate(*gemm.trips, max_candidates=20), gemm, threads=2)[0]
>>> best.parse(*gemm.trips).mode
'collapse'
"""

from schedules.cost_model import Bandwidths, Prediction, analyze, predict, rank
from schedules.loop_spec import LoopDecl, LoopSpec, LoopSpecError, Occurrence, parse, simulate
from schedules.space import BlockedGemm, Candidate, gemm_loops, generate, heuristic

__all__ = [
    "Bandwidths",
    "Candidate",
    "BlockedGemm",
    "LoopDecl",
    "LoopSpec",
    "LoopSpecError",
    "Occurrence",
    "Prediction",
    "analyze",
    "gemm_loops",
    "generate",
    "heuristic",
    "parse",
    "predict",
    "rank",
    "simulate",
]
