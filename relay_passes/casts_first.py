"""Casts before reshapes: ``astype(reshape(x, s), t)`` becomes ``reshape(astype(x, t), s)``.

The bf16 kernels read their input as ``astype(reshape(x, [rows, K]), "bfloat16")``
(:mod:`relay_passes.dense`).  Where ``x`` is a layer norm (BERT's and GPT-2's, before every
dense layer in bf16), FuseOps cannot fuse that chain into it: a reshape is injective, and a
layer norm takes only elementwise consumers.  The reshape and the cast then run as one more
pass over the tensor (``fused_reshape_cast``), reading the float32 norm and writing its bf16
copy.  Cast first, the cast fuses into the norm, which writes bf16 itself, and the reshape is
a view.  Commuting the two is exact (a reshape moves no value); the pass runs after the
rewrites that read the ``astype(reshape(x))`` form.  A reshape of a kernel's output, into
which nothing fuses, keeps its cast after it where every reader of the cast takes it in (the
BatchNorm, ReLU and pool reading DenseNet's bf16 block buffer widened): cast first, it would
be a pass of its own.

Examples
--------
>>> x = relax.Var("x", relax.TensorType((2, 3, 4), "float32"))
>>> bb = relax.BlockBuilder()
>>> with bb.function("main", [x]):
...     flat = bb.emit(relax.op.reshape(x, (6, 4)))
...     _ = bb.emit_func_output(bb.emit(relax.op.astype(flat, "bfloat16")))
>>> ops = []
>>> relax.analysis.post_order_visit(casts_before_reshapes(bb.get())["main"],
...     lambda e: ops.append(e.op.name) if isinstance(e, relax.Call) else None)
>>> ops
['relax.astype', 'relax.reshape']
"""

from __future__ import annotations

import tvm
from tvm import relax

from .scaffold import is_call_to, map_functions, readers

__all__ = ["casts_before_reshapes"]


@relax.expr_functor.mutator
class _CastsFirst(relax.PyExprMutator):
    def visit_function_(self, func: relax.Function) -> relax.Expr:
        self._read_by = readers(func)
        return super().visit_function_(func)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        read_by = self._read_by(call) if is_call_to(call, "relax.astype") else None
        call = super().visit_call_(call)
        if not is_call_to(call, "relax.astype"):
            return call
        source = call.args[0]
        reshape = self.lookup_binding(source) if isinstance(source, relax.Var) else source
        if not is_call_to(reshape, "relax.reshape"):
            return call
        x = reshape.args[0]
        producer = self.lookup_binding(x) if isinstance(x, relax.Var) else x
        if _kernel_call(producer) and read_by and not any(_kernel_call(r) for r in read_by):
            return call
        return relax.op.reshape(relax.op.astype(reshape.args[0], call.attrs.dtype),
                                reshape.args[1])


def _kernel_call(value: relax.Expr | None) -> bool:
    """Whether ``value`` calls a kernel (``call_tir``, in place or not): nothing fuses into
    it, nor it into anything."""
    return is_call_to(value, "relax.call_tir") or is_call_to(value, "relax.call_tir_inplace")


def casts_before_reshapes(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every cast of a reshape turned into a reshape of the cast (module doc);
    the reshapes nothing reads any more removed."""
    mod = map_functions(mod, lambda func: _CastsFirst(mod).visit_expr(func))
    return relax.transform.DeadCodeElimination()(mod)
