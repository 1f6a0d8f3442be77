"""Run-time checks where TVM's lowering would read out of bounds and answer garbage.

ONNX ``Gather`` takes indices in ``[-d, d)`` along its axis and ONNX Runtime refuses others;
TVM's importer maps the negative ones into ``[0, d)`` and then gathers with ``take(...,
mode="fast")``, which reads whatever lies past the tensor for an index out of range (a wrong
answer, silently, and a read out of bounds).  :func:`guard_gathers` routes the indices of
every such ``take`` whose indices are computed at run time through a small kernel that checks
them and stops the run with :data:`OUT_OF_RANGE` and the bounds; constant indices were checked
by ONNX's checker and the importer.

Examples
--------
>>> data = relax.const(np.zeros((5, 3), "float32"))
>>> i = relax.Var("i", relax.TensorType((2,), "int64"))
>>> bb = relax.BlockBuilder()
>>> with bb.function("main", [i]):
...     with bb.dataflow():
...         y = bb.emit_output(relax.op.take(data, i, axis=0))
...     _ = bb.emit_func_output(y)
>>> [gv.name_hint for gv in guard_gathers(bb.get()).functions]
['main', 'tpp_check_indices_2_in_5']
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx

from microkernels.script_source import pin_source

from .scaffold import add_kernel, static_shape

# The TVMScript builders below parse the text this module was imported from.
pin_source(__name__)

__all__ = ["guard_gathers", "OUT_OF_RANGE"]

#: What a run stopped by an index out of range says first (the bounds follow).
OUT_OF_RANGE = "a Gather index is out of range"


def guard_gathers(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with the run-time indices of every unchecked ``take`` checked first."""
    guard = _Guard(mod)
    changed = {gv: guard.visit_expr(f) for gv, f in mod.functions.items()
               if isinstance(f, relax.Function)}
    out = guard.builder_.get()  # with the checking kernels it added
    for gv, f in changed.items():
        out[gv] = f
    return out


@relax.expr_functor.mutator
class _Guard(relax.PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.take"
                and str(call.attrs.mode) == "fast"):
            return call
        data, indices = call.args
        if isinstance(indices, tvm.ir.expr.Constant) or call.attrs.axis is None:
            return call
        data_shape = static_shape(data.ty.shape)
        shape = static_shape(indices.ty.shape)
        if data_shape is None or shape is None:
            return call
        size = data_shape[int(call.attrs.axis) % len(data_shape)]
        n = int(np.prod(shape))
        dtype = str(indices.ty.dtype)
        name = f"tpp_check_indices_{n}_in_{size}"
        gv = add_kernel(self.builder_, _checker(n, size, dtype), name)
        flat = relax.op.reshape(indices, (n,)) if len(shape) != 1 else indices
        checked = relax.call_tir(gv, [flat], relax.TensorType((n,), dtype))
        if len(shape) != 1:
            checked = relax.op.reshape(checked, shape)
        return relax.op.take(data, checked, call.attrs.axis, mode="fast")


def _checker(n: int, size: int, dtype: str) -> tirx.PrimFunc:
    """``out = idx``, stopping with :data:`OUT_OF_RANGE` if an ``idx`` is outside
    ``[0, size)`` (the importer's image of ONNX's ``[-size, size)``)."""
    from tvm.script import tirx as T

    message = f"{OUT_OF_RANGE}: ONNX's [-{size}, {size}) along the gathered axis"

    @T.prim_func(s_tir=True)
    def check(idx: T.Buffer((n,), dtype), out: T.Buffer((n,), dtype)):
        # Serial, one compare per index (a handful of them); add_kernel marks it scheduled.
        T.func_attr({"tirx.noalias": True})
        for i in range(n):
            with T.sblock("check"):
                vi = T.axis.spatial(n, i)
                T.Assert(tirx.all(idx[vi] >= T.cast(0, dtype), idx[vi] < T.cast(size, dtype)),
                         message)
                out[vi] = idx[vi]

    return check
