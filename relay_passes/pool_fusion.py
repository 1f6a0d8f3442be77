"""Pools that take their elementwise producers: FuseOps fuses ``pool(relu(x * s + b))`` into one
function.

TVM annotates TOPI's pooling functions ``kOutEWiseFusable`` (as it does convolutions), and
FuseOps fuses no producer into such an operator: DenseNet's transition layers, whose average
pool runs before their 1x1 conv (:mod:`relay_passes.pool_first`), then compute the BatchNorm
and ReLU as one pass over the float32 block buffer, writing it back, and pool it in another
(1.8 ms of DenseNet-121's bf16 run at batch 8 on a Zen 5).  A pool is a reduction; annotated
``kCommReduce`` instead, it takes elementwise and broadcast producers as a reduction does,
and the fallback schedules inline them into its window sum (:func:`schedules.fallback.
inline_elementwise`, which keeps a costly producer a window reads several times a block of
its own): one pass reading the buffer.  DenseNet-121 bf16 1.021x at batch 8, bit-identical.

:func:`pools_take_producers` runs between ``AnnotateTIROpPattern`` and ``FuseOps``; a pool is
a function of TOPI's pooling blocks (``pool_sum``, ``pool_max``).
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx

__all__ = ["POOL_BLOCKS", "pools_take_producers"]

#: TOPI's names of the blocks that reduce a pooling window.
POOL_BLOCKS = frozenset({"pool_sum", "pool_max"})
_OUT_ELEMWISE_FUSABLE, _COMM_REDUCE = 4, 3


def _is_pool(func: tirx.PrimFunc) -> bool:
    found = []
    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, lambda b: found.append(
        b.name_hint in POOL_BLOCKS)))
    return any(found)


def pools_take_producers() -> tvm.transform.Pass:
    """Annotate pooling functions ``kCommReduce`` (module doc).

    Examples
    --------
    >>> from tvm import te, topi
    >>> x = te.placeholder((1, 4, 4, 8), "float32", name="x")
    >>> pool = topi.nn.pool2d(x, (2, 2), (2, 2), (1, 1), (0, 0, 0, 0), "avg", layout="NHWC")
    >>> func = te.create_prim_func([x, pool]).with_attr("op_pattern", 4)
    >>> out = pools_take_producers()(tvm.IRModule({"avg_pool2d": func}))
    >>> int(out["avg_pool2d"].attrs["op_pattern"])
    3
    """

    @tvm.transform.module_pass(opt_level=0, name="PoolsTakeProducers")
    def _mark(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updates = {}
        for gv, func in mod.functions.items():
            if (isinstance(func, tirx.PrimFunc) and func.attrs is not None
                    and int(func.attrs.get("op_pattern", -1)) == _OUT_ELEMWISE_FUSABLE
                    and _is_pool(func)):
                updates[gv] = func.with_attr("op_pattern", _COMM_REDUCE)
        if not updates:
            return mod
        mod = mod.clone()
        for gv, func in updates.items():
            mod[gv] = func
        return mod

    return _mark
