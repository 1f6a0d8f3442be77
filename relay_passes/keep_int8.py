"""Keep quantized tensors quantized through the operators that only move or select values.

A QDQ model wraps every operator in ``dequantize`` / ``quantize`` pairs, also those that do
no arithmetic: ``quantize(reshape(dequantize(x, s, z)), s, z)`` is ``reshape(x)``.  Lowered
as written, each becomes a float32 round trip (and, where a fusion boundary falls between,
float32 tensors four times the size in memory).  This pass rewrites them to run on the
integers, as ONNX Runtime's and OpenVINO's int8 graphs do:

* ``reshape``, ``permute_dims``, ``flatten``, ``squeeze``, ``expand_dims``, ``strided_slice``
  and ``max_pool2d`` (monotone, so max and rounding commute) on ``x`` itself, when the
  ``quantize`` after uses the ``dequantize``'s scale and zero point;
* ``relu`` between equal quantizations as ``maximum(x, z)`` (the zero point is real 0);
* ``concat`` of dequantized tensors on their integers, each input first requantized to the
  output's scale and zero point unless it has them already;
* ``quantize(dequantize(x, s, z), s, z)``, which the rewrites above leave, as ``x``.

All are exact: with equal scale and zero point, ``quantize`` gives back the integer
``dequantize`` started from.  Only per-tensor (scalar) quantization is taken; a per-channel
one is left as it is.  The pass runs on the imported module, before the QDQ kernels are
matched (they then read the integers).

Examples
--------
>>> x = relax.Var("x", relax.TensorType((2, 6), "uint8"))
>>> s, z = relax.const(0.5), relax.const(3, "uint8")
>>> bb = relax.BlockBuilder()
>>> with bb.function("main", [x]):
...     with bb.dataflow():
...         y = bb.emit(relax.op.reshape(relax.op.dequantize(x, s, z), (3, 4)))
...         y = bb.emit_output(relax.op.quantize(y, s, z, out_dtype="uint8"))
...     _ = bb.emit_func_output(y)
>>> mod = keep_int8(bb.get())
>>> [b.value.op.name for b in mod["main"].body.blocks[0].bindings]
['relax.reshape']
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import (
    CallPattern,
    DFPattern,
    ExprPattern,
    is_const,
    is_op,
    rewrite_call,
    wildcard,
)

__all__ = ["keep_int8", "MOVES"]

#: Operators that move or select values, whatever their dtype.
MOVES = ("relax.reshape", "relax.permute_dims", "relax.flatten", "relax.squeeze",
         "relax.expand_dims", "relax.strided_slice", "relax.nn.max_pool2d")


def _dequantized() -> tuple[DFPattern, DFPattern, DFPattern, DFPattern]:
    x, s, z = wildcard(), is_const(), is_const()
    return is_op("relax.dequantize")(x, s, z), x, s, z


def keep_int8(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with the quantize/dequantize round trips around data movement, ReLU and
    concatenation removed (module docstring); other functions and calls are unchanged."""
    out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs)
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            for rewrite in (_moves, _relu, _concat, _identity):
                func = rewrite(func)
            out[gv] = func
    return relax.transform.DeadCodeElimination()(out)


def _param(expr: relax.Expr) -> float | int | None:
    """A scalar constant's value (None if it is per channel)."""
    value = expr.value.numpy()
    return value.item() if value.size == 1 else None


def _same_quantization(dq: relax.Call, q: relax.Call) -> bool:
    """Whether ``q`` quantizes back to ``dq``'s integers: same scalar scale and zero point,
    same integer type."""
    _, s1, z1 = dq.args
    _, s2, z2 = q.args
    params = [_param(e) for e in (s1, z1, s2, z2)]
    return (None not in params and params[0] == params[2] and params[1] == params[3]
            and str(q.attrs.out_dtype) == str(dq.args[0].ty.dtype))


def _moves(func: relax.Function) -> relax.Function:
    dq, x, _, _ = _dequantized()
    move = CallPattern(ExprPattern(tvm.ir.Op.get(MOVES[0])), [dq], varg_default_wildcard=True)
    for name in MOVES[1:]:
        move |= CallPattern(ExprPattern(tvm.ir.Op.get(name)), [dq],
                            varg_default_wildcard=True)
    root = is_op("relax.quantize")(move, is_const(), is_const())

    def rewriter(orig: relax.Call, matches: Mapping[DFPattern, relax.Expr]) -> relax.Expr:
        inner = matches[move]
        if not _same_quantization(matches[dq], orig):
            return orig
        return relax.Call(inner.op, [matches[x], *inner.args[1:]], inner.attrs)

    return rewrite_call(root, rewriter, func)


def _relu(func: relax.Function) -> relax.Function:
    dq, x, _, z = _dequantized()
    root = is_op("relax.quantize")(is_op("relax.nn.relu")(dq), is_const(), is_const())

    def rewriter(orig: relax.Call, matches: Mapping[DFPattern, relax.Expr]) -> relax.Expr:
        if not _same_quantization(matches[dq], orig):
            return orig
        zero = relax.const(np.array(_param(matches[z]), str(matches[x].ty.dtype)))
        return relax.op.maximum(matches[x], zero)

    return rewrite_call(root, rewriter, func)


def _concat(func: relax.Function) -> relax.Function:
    bound = relax.analysis.get_var2val(func)
    concat = is_op("relax.concat")(wildcard())
    root = is_op("relax.quantize")(concat, is_const(), is_const())

    def value(e: relax.Expr) -> relax.Expr:
        return bound.get(e, e) if isinstance(e, relax.Var) else e

    def rewriter(orig: relax.Call, matches: Mapping[DFPattern, relax.Expr]) -> relax.Expr:
        fields = value(matches[concat].args[0])
        if not isinstance(fields, relax.Tuple):
            return orig
        parts = []
        for field in fields.fields:
            dq = value(field)
            if not (isinstance(dq, relax.Call) and dq.op.name == "relax.dequantize"
                    and all(isinstance(a, tvm.ir.expr.Constant) for a in dq.args[1:])
                    and str(dq.args[0].ty.dtype) == str(orig.attrs.out_dtype)):
                return orig
            # An input quantized otherwise is requantized to the output's scale and zero
            # point: the one rounding the float concat then quantize would do.
            parts.append(dq.args[0] if _same_quantization(dq, orig) else relax.Call(
                orig.op, [field, *orig.args[1:]], orig.attrs))
        return relax.Call(matches[concat].op, [relax.Tuple(parts)], matches[concat].attrs)

    return rewrite_call(root, rewriter, func)


def _identity(func: relax.Function) -> relax.Function:
    dq, x, _, _ = _dequantized()
    root = is_op("relax.quantize")(dq, is_const(), is_const())

    def rewriter(orig: relax.Call, matches: Mapping[DFPattern, relax.Expr]) -> relax.Expr:
        return matches[x] if _same_quantization(matches[dq], orig) else orig

    return rewrite_call(root, rewriter, func)
