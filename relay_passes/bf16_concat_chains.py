"""DenseNet's block buffers in bf16 where the convs growing them run in bf16.

A dense block concatenates each layer's new channels, a conv's output, to everything before
them (:mod:`relay_passes.concat_chain`), and each layer's BatchNorm + ReLU reads the whole
concatenation, computed per pixel tile as the prologue of the 1x1 conv after it
(:mod:`relay_passes.conv`).  With bf16 convs a float32 buffer costs twice the bytes it
needs: its growth convs widen what they would hand over in bf16, and every 1x1 conv reads
four bytes a value from a buffer that outgrows L2 (DenseNet-121's first block at batch 8:
25.7 MB in float32).  OpenVINO keeps the buffer in bf16; so does
:func:`concat_chains_in_bf16`, before the convs are routed:

* ``b_0 = astype(c_0, bfloat16)`` for the chain's first tensor (a pool or conv output);
* ``b_i = concat(b_{i-1}, astype(n_i, bfloat16))`` for each concat of the chain;
* each ``c_i`` becomes ``astype(b_i, float32)``, for its other readers.

The growth convs then hand over bf16 (their only reader is a cast to bf16), the 1x1 convs'
prologues read ``b_i`` itself (:attr:`schedules.conv.ConvProblem.prologue_input`), and
:func:`~relay_passes.concat_chain.write_concat_chains` writes the bf16 chain in place.  Every
reader sees the bf16-rounded values, as a bf16 conv reading them would.  A chain qualifies
where each concat's new part is a conv (plus a constant bias) routed in bf16
(:func:`relay_passes.conv.is_bf16_conv_chain`) that only its concat reads; channel concats
of NCHW tensors (before the convs' layouts), float32, static shapes.

Examples
--------
>>> import numpy as np
>>> x = relax.Var("x", relax.TensorType((1, 8, 6, 6), "float32"))
>>> bb = relax.BlockBuilder()
>>> with bb.function("main", [x]):
...     with bb.dataflow():
...         c = bb.emit(relax.op.nn.relu(x))
...         for channels in (8, 16):
...             w = relax.const(np.ones((8, channels, 3, 3), "float32"))
...             grown = bb.emit(relax.op.nn.conv2d(c, w, padding=1))
...             c = bb.emit(relax.op.concat([c, grown], axis=1))
...         out = bb.emit_output(c)
...     _ = bb.emit_func_output(out)
>>> main = concat_chains_in_bf16(bb.get())["main"]
>>> [str(b.var.ty.dtype) for b in main.body.blocks[0].bindings
...  if isinstance(b.value, relax.Call) and b.value.op.name == "relax.concat"]
['bfloat16', 'bfloat16']
"""

from __future__ import annotations

import tvm
from tvm import relax

from .concat_chain import chains, concats
from .conv import is_bf16_conv_chain
from .scaffold import only_reader, readers, rewrite_static_functions, visit_binding_replaced

__all__ = ["concat_chains_in_bf16"]

#: NCHW's channel axis: the chains are found before the convs move them to NHWC.
_NCHW_CHANNELS = 1


def concat_chains_in_bf16(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every concat chain grown by bf16 convs held in bf16 (module doc)."""
    rewriter = _Bf16Chains(mod)
    return relax.transform.DeadCodeElimination()(
        rewrite_static_functions(mod, rewriter, rewriter.pending))


@relax.expr_functor.mutator
class _Bf16Chains(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        # each chain's first tensor and concat -> the concat's new part (None: the first tensor)
        self.pending: dict[relax.Var, relax.Expr | None] = {}
        self._narrow: dict[relax.Var, relax.Var] = {}  # c_i -> b_i

    def visit_function_(self, func: relax.Function) -> relax.Expr:
        bound, read_by = relax.analysis.get_var2val(func), readers(func)
        for block in func.body.blocks:
            here = {b.var for b in block.bindings}
            joined = concats(list(block.bindings), _NCHW_CHANNELS)
            for chain in chains(joined):
                first = joined[chain[0]][0]
                grown = [joined[var][1] for var in chain]
                if (str(chain[0].ty.dtype) == "float32" and first in here
                        and all(_grown_by_bf16_conv(n, c, bound, read_by)
                                for n, c in zip(grown, chain, strict=True))):
                    self.pending[first] = None
                    self.pending.update(zip(chain, grown, strict=True))
        return super().visit_function_(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var not in self.pending:
            super().visit_var_binding_(binding)
            return
        grown = self.pending[binding.var]
        if grown is None:  # the chain's first tensor: computed as it was, then narrowed
            value = self.builder_.emit(self.visit_expr(binding.value))
            narrow = self.builder_.emit(relax.op.astype(value, "bfloat16"))
        else:
            part = self.builder_.emit(relax.op.astype(self.visit_expr(grown), "bfloat16"))
            previous = self._narrow[binding.value.args[0].fields[0]]
            narrow = self.builder_.emit(relax.op.concat([previous, part], axis=_NCHW_CHANNELS))
        self._narrow[binding.var] = narrow
        # Bound to the same variable, so its other readers read the widened bf16 values.
        visit_binding_replaced(self, binding, {binding.var: relax.op.astype(narrow, "float32")})


def _grown_by_bf16_conv(part: relax.Expr, concat: relax.Var, bound, read_by) -> bool:
    """Whether ``part`` is a bf16-routed conv's output (plus a constant bias) that only the
    concat ``concat`` reads."""
    return (isinstance(part, relax.Var) and is_bf16_conv_chain(part, bound)
            and only_reader(read_by(bound[part]), bound[concat]))
