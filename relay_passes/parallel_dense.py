"""Dense layers that read one input and whose outputs are only rearranged, as one layer.

An encoder's self-attention multiplies its input by three weight matrices, Q, K and V, each
output only reshaped into heads (BERT's ONNX graph: three MatMuls and bias Adds on one
tensor).  :func:`combine_parallel_dense` makes them one dense layer of the concatenated
weights and biases, split into its parts: one kernel reads the input once and shares three
times the columns among its threads, and the parts are read as GPT-2's fused projection's
are (in place by the attention kernel, :mod:`relay_passes.slice_reads`; written in bf16 for
a bf16 attention, :mod:`relay_passes.dense`).  TVM's ``CombineParallelMatmul`` takes
weights that are parameters only; here they are constants, concatenated at compile time.

A group is two or more ``matmul(x, W)`` (``W`` a constant ``[K, N]`` of ``x``'s dtype) on
the same ``x`` in one dataflow block, each read only by an ``add`` of a constant ``[N]``
bias (all with one, or none without), whose readers only reshape or permute it
(:func:`relay_passes.layouts.moves_data`): no activation or residual a dense kernel would
fuse is separated from its layer by the split.  Functions with symbolic shapes stay as they
are (their split parts would be copies).

Examples
--------
>>> import numpy as np
>>> x = relax.Var("x", relax.TensorType((4, 8), "float32"))
>>> bb = relax.BlockBuilder()
>>> with bb.function("main", [x]):
...     with bb.dataflow():
...         heads = []
...         for n in (6, 10):
...             w = relax.const(np.ones((8, n), "float32"))
...             b = relax.const(np.zeros(n, "float32"))
...             y = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, w)), b))
...             heads.append(bb.emit(relax.op.reshape(y, (4, 2, n // 2))))
...         out = bb.emit_output(relax.Tuple(heads))
...     _ = bb.emit_func_output(out)
>>> main = combine_parallel_dense(bb.get())["main"]
>>> [b.value.op.name for b in main.body.blocks[0].bindings[:3]]
['relax.matmul', 'relax.add', 'relax.split']
>>> tuple(main.body.blocks[0].bindings[0].value.args[1].value.shape)
(8, 16)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from .layouts import moves_data
from .scaffold import (
    is_call_to,
    readers,
    rewrite_static_functions,
    static_shape,
    visit_binding_replaced,
)

__all__ = ["combine_parallel_dense"]


def combine_parallel_dense(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with each group of dense layers on one input, their outputs only rearranged,
    computed as one dense layer and split (module doc)."""
    combiner = _Combiner(mod)
    return rewrite_static_functions(mod, combiner, combiner.pending)


@dataclass(frozen=True)
class _Branch:
    """One dense layer of a group: ``out = add(product, bias)`` (or ``out = product``)."""

    product: relax.Var
    out: relax.Var
    weight: np.ndarray
    bias: np.ndarray | None


def _branch(var: relax.Var, value: relax.Expr, read_by,
            var_of: dict[relax.Expr, relax.Var]) -> tuple[relax.Var, _Branch] | None:
    """``(x, branch)`` when ``var = matmul(x, W)`` starts a layer a group may take."""
    if not is_call_to(value, "relax.matmul") or not isinstance(value.args[0], relax.Var):
        return None
    x, weight = value.args
    dtype = str(x.ty.dtype)
    if (not isinstance(weight, tvm.ir.expr.Constant) or weight.ty.ndim != 2
            or str(weight.ty.dtype) != dtype
            or str(value.attrs.out_dtype or dtype) != dtype):
        return None
    reads = read_by(value)
    if not reads or len(reads) != 1:
        return None
    out, bias = value, None
    if is_call_to(reads[0], "relax.add"):
        out = reads[0]
        other = out.args[1] if out.args[0].same_as(var) else out.args[0]
        if (not isinstance(other, tvm.ir.expr.Constant)
                or static_shape(other.ty.shape) != (int(weight.ty.shape[1]),)):
            return None
        bias = other.value.numpy()
    rearranged = read_by(out)
    if not rearranged or not all(moves_data(r) for r in rearranged):
        return None
    return x, _Branch(var, var_of[out], weight.value.numpy(), bias)


@relax.expr_functor.mutator
class _Combiner(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.pending: dict[relax.Var, list[_Branch]] = {}  # first product -> its group
        self._parts: dict[relax.Var, relax.Expr] = {}  # a branch's out -> its part
        self._products: set[relax.Var] = set()  # each branch's own product, gone

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        read_by = readers(func)
        var_of = {b.value: b.var for blk in func.body.blocks for b in blk.bindings}
        for block in func.body.blocks:
            groups: dict[tuple, list[_Branch]] = {}
            here = {binding.var for binding in block.bindings}
            for binding in block.bindings:
                found = _branch(binding.var, binding.value, read_by, var_of)
                if found is not None and found[1].out in here:  # its part bound in the block
                    x, branch = found
                    groups.setdefault((x, branch.bias is None), []).append(branch)
            for group in groups.values():
                if len(group) > 1:
                    self.pending[group[0].product] = group
                    self._products.update(b.product for b in group)
        return super().visit_function_(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        group = self.pending.get(binding.var)
        if group is not None:
            self._emit_group(self.visit_expr(binding.value.args[0]), group)
        if binding.var in self._parts or binding.var not in self._products:
            visit_binding_replaced(self, binding, self._parts)

    def _emit_group(self, x: relax.Expr, group: list[_Branch]) -> None:
        weight = relax.const(np.concatenate([b.weight for b in group], axis=1))
        y = self.builder_.emit(relax.op.matmul(x, weight))
        if group[0].bias is not None:
            y = self.builder_.emit(relax.op.add(
                y, relax.const(np.concatenate([b.bias for b in group]))))
        cuts = np.cumsum([b.weight.shape[1] for b in group])[:-1]
        parts = self.builder_.emit(relax.op.split(y, [int(c) for c in cuts], axis=-1))
        for i, b in enumerate(group):
            self._parts[b.out] = relax.TupleGetItem(parts, i)
