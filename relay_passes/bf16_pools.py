"""Max pooling between bf16 convolutions, in bf16.

A bf16 conv whose readers are max pools read only by bf16 convs writes bf16
(:mod:`relay_passes.conv`), handed on through a float32 view: ``max_pool2d(astype(x,
float32))``.  A max commutes with that exact widening, so :func:`max_pools_in_bf16` pools
``x`` itself with :func:`schedules.bf16_max_pool.max_pool_bf16_kernel` (TVM cannot lower a
vectorized bf16 pool) and widens the result, a view the next conv's cast to bf16 cancels
(:func:`relay_passes.layouts.simplify_layouts`).  VGG-19's pools then read and write two bytes
a value instead of four, and the casts around them go.

Examples
--------
>>> x = relax.Var("x", relax.TensorType((1, 4, 4, 32), "bfloat16"))
>>> bb = relax.BlockBuilder()
>>> with bb.function("main", [x]):
...     with bb.dataflow():
...         wide = bb.emit(relax.op.astype(x, "float32"))
...         pooled = bb.emit(relax.op.nn.max_pool2d(wide, 2, 2, layout="NHWC"))
...         y = bb.emit_output(relax.op.astype(pooled, "bfloat16"))
...     _ = bb.emit_func_output(y)
>>> main = max_pools_in_bf16(bb.get())["main"]
>>> [b.value.op.name for b in main.body.blocks[0].bindings]
['relax.call_tir']
"""

from __future__ import annotations

import tvm
from tvm import relax

from schedules.bf16_max_pool import max_pool_bf16_kernel

from .layouts import simplify_layouts
from .scaffold import add_kernel, is_call_to, static_shape

__all__ = ["max_pool_in_bf16", "max_pools_in_bf16"]


def max_pool_in_bf16(call: relax.Call) -> bool:
    """Whether :func:`max_pools_in_bf16` can pool ``call``'s input in bf16: a static 4-D
    ``max_pool2d`` in floor mode without dilation (NCHW until the layouts move it to NHWC)."""
    attrs = call.attrs
    return (static_shape(call.args[0].ty.shape) is not None and call.ty.ndim == 4
            and not attrs.ceil_mode and all(int(d) == 1 for d in attrs.dilation)
            and str(attrs.layout) == str(attrs.out_layout) in ("NCHW", "NHWC"))


def max_pools_in_bf16(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every NHWC max pool of a widened bf16 tensor pooled in bf16 (module doc);
    the caller's module stays as it was."""
    mutator = _Bf16Pools(mod)
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    if not mutator.kernels:  # no pool rewritten (a float32 or int8 model): nothing to cancel
        return mod
    mod = simplify_layouts(mutator.builder_.get())
    return relax.transform.DeadCodeElimination()(relax.transform.CanonicalizeBindings()(mod))


@relax.expr_functor.mutator
class _Bf16Pools(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.kernels: dict[tuple, tvm.ir.GlobalVar] = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (is_call_to(call, "relax.nn.max_pool2d") and max_pool_in_bf16(call)
                and str(call.attrs.layout) == "NHWC"):
            return call
        arg = call.args[0]
        wide = self.lookup_binding(arg) if isinstance(arg, relax.Var) else arg
        if not (is_call_to(wide, "relax.astype") and str(wide.attrs.dtype) == "float32"
                and str(wide.args[0].ty.dtype) == "bfloat16"):
            return call
        attrs = call.attrs
        key = (static_shape(arg.ty.shape), *(tuple(int(v) for v in a) for a in (
            attrs.pool_size, attrs.strides, attrs.padding)))
        if key not in self.kernels:
            self.kernels[key] = add_kernel(self.builder_, max_pool_bf16_kernel(*key),
                                           "max_pool2d_bf16")
        shape = static_shape(call.ty.shape)
        pooled = relax.call_tir(self.kernels[key], [wide.args[0]],
                                relax.TensorType(shape, "bfloat16"))
        return relax.op.astype(pooled, "float32")
