"""Elementwise chains between quantized tensors as lookup tables.

A QDQ model's float operators between two quantized tensors — DenseNet's pre-activation
batch norm (``dequantize -> multiply -> add -> quantize -> dequantize -> multiply -> quantize
-> dequantize -> add -> quantize``), a requantization before a concat — map each 8-bit input
value, per channel, to one 8-bit output value.  Lowered as written, every element goes
through the float chain with a division and a rounding per ``quantize``; ONNX Runtime runs
each operator as a kernel of its own.  :func:`lookup_tables` evaluates the chain once, at
compile time, for all 256 input values of every channel and replaces it by a table lookup:
``y[..., c, ...] = table[c, x[..., c, ...]]``.

A chain is taken when it is a tree of the operators in :data:`ELEMENTWISE` (plus
``dequantize``/``quantize``) ending in a ``quantize`` to int8/uint8, whose leaves are
``dequantize`` of one 8-bit tensor and constants, and whose constants (and per-axis
quantization parameters) vary along one axis at most, the same for all.  The table is
computed with numpy in float32, one operator at a time with ONNX's roundings (``quantize``
rounds half to even), as ONNX Runtime's reference evaluation of the QDQ graph does.

Examples
--------
>>> x = relax.Var("x", relax.TensorType((2, 4, 3), "uint8"))
>>> bb = relax.BlockBuilder()
>>> with bb.function("main", [x]):
...     with bb.dataflow():
...         v = relax.op.dequantize(x, relax.const(0.5), relax.const(3, "uint8"), axis=2)
...         v = relax.op.multiply(v, relax.const(np.array([1.0, -2.0, 0.25], "float32")))
...         y = bb.emit_output(relax.op.quantize(v, relax.const(0.25), relax.const(128, "uint8"),
...                                              out_dtype="uint8", axis=2))
...     _ = bb.emit_func_output(y)
>>> mod = lookup_tables(bb.get())
>>> [gv.name_hint for gv in mod.functions]
['main', 'tpp_lookup_uint8_2x4x3_uint8']
>>> func = bb.get()["main"]
>>> source, table, axis = chain_table(func.body.blocks[0].bindings[-1].value,
...                                   relax.analysis.get_var2val(func))
>>> table.shape, axis, int(table[1, 5])  # channel 1, x = 5: (5 - 3) * 0.5 * -2 / 0.25 + 128
((3, 256), 2, 120)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax, s_tir, te

from .scaffold import add_kernel, static_shape

__all__ = ["lookup_tables", "chain_table", "lookup_kernel", "ELEMENTWISE"]

#: Float operators a chain may hold besides ``dequantize``/``quantize``, as numpy evaluates
#: them (results rounded to float32 after each).
ELEMENTWISE: dict[str, Callable[..., np.ndarray]] = {
    "relax.add": np.add,
    "relax.subtract": np.subtract,
    "relax.multiply": np.multiply,
    "relax.divide": np.divide,
    "relax.power": np.power,
    "relax.maximum": np.maximum,
    "relax.minimum": np.minimum,
    "relax.nn.relu": lambda v: np.maximum(v, np.float32(0)),
    "relax.erf": np.vectorize(math.erf, otypes=["float64"]),
    "relax.tanh": np.tanh,
    "relax.sigmoid": lambda v: 1 / (1 + np.exp(-v.astype("float64"))),
    "relax.exp": np.exp,
}
_INT8 = ("int8", "uint8")


class _NotAChain(Exception):
    """The expression is not a chain this pass turns into a table."""


class _Chain:
    """Traces a ``quantize``'s operand back to its 8-bit source, then evaluates it on every
    value of the source for every channel of the axis its constants vary along."""

    def __init__(self, bound: dict[relax.Var, relax.Expr]) -> None:
        self.bound = bound
        self.source: relax.Expr | None = None
        self.shape: tuple[int, ...] | None = None
        self.axis: int | None = None  # the axis constants vary along (None: no such axis)

    def _value(self, expr: relax.Expr) -> relax.Expr:
        return self.bound.get(expr, expr) if isinstance(expr, relax.Var) else expr

    def _constant(self, expr: relax.Expr, axis: int | None = None) -> np.ndarray:
        """A constant operand as a ``[channels, 1]`` (or scalar) float32/int array."""
        expr = self._value(expr)
        if not isinstance(expr, tvm.ir.expr.Constant):
            raise _NotAChain
        value = expr.value.numpy()
        if value.size == 1:
            return value.reshape(())
        rank = len(self.shape)
        if value.ndim == 1 and axis is not None:  # per-axis quantization parameters
            varying = axis % rank
        else:
            if value.ndim > rank:
                raise _NotAChain
            dims = (1,) * (rank - value.ndim) + value.shape
            varying_axes = [i for i, d in enumerate(dims) if d != 1]
            if len(varying_axes) != 1:
                raise _NotAChain
            varying = varying_axes[0]
        if value.size != self.shape[varying] or self.axis not in (None, varying):
            raise _NotAChain
        self.axis = varying
        return value.reshape(-1, 1)

    def trace(self, expr: relax.Expr) -> Callable[[np.ndarray], np.ndarray]:
        """A function of the source's values (``[1, 256]``, broadcast against the constants'
        ``[channels, 1]``) giving ``expr``'s; raises :class:`_NotAChain`."""
        call = self._value(expr)
        if not isinstance(call, relax.Call) or not isinstance(call.op, tvm.ir.Op):
            raise _NotAChain
        name = call.op.name
        if name == "relax.dequantize":
            inner = self._quantized(call.args[0])
            scale = self._constant(call.args[1], call.attrs.axis).astype("float32")
            zero = self._constant(call.args[2], call.attrs.axis).astype("int32")
            return lambda x: (inner(x).astype("int32") - zero).astype("float32") * scale
        if name == "relax.quantize":
            dtype = str(call.attrs.out_dtype)
            if dtype not in _INT8:
                raise _NotAChain
            inner = self.trace(call.args[0])
            scale = self._constant(call.args[1], call.attrs.axis).astype("float32")
            zero = self._constant(call.args[2], call.attrs.axis).astype("float32")
            info = np.iinfo(dtype)

            def quantize(x: np.ndarray) -> np.ndarray:
                value = inner(x)
                if np.isnan(value).any():  # Pow of a negative value, say: no defined integer
                    raise _NotAChain
                return np.clip(np.rint(value / scale) + zero, info.min, info.max).astype(dtype)

            return quantize
        fn = ELEMENTWISE.get(name)
        if fn is None or str(call.ty.dtype) != "float32":
            raise _NotAChain
        if len(call.args) == 1:
            inner = self.trace(call.args[0])
            return lambda x: fn(inner(x)).astype("float32")
        # Each operand a constant or traced to the same source (GELU reads x twice); the
        # traced ones first: a constant's axis is checked against the source's shape.
        constant = [isinstance(self._value(a), tvm.ir.expr.Constant) for a in call.args]
        if all(constant):
            raise _NotAChain
        operands = {i: self.trace(a) for i, a in enumerate(call.args) if not constant[i]}
        for i, a in enumerate(call.args):
            if constant[i]:
                value = self._constant(a).astype("float32")
                operands[i] = lambda _, value=value: value
        lhs, rhs = operands[0], operands[1]
        return lambda x: fn(lhs(x), rhs(x)).astype("float32")

    def _quantized(self, expr: relax.Expr) -> Callable[[np.ndarray], np.ndarray]:
        """A dequantized tensor: traced further where it is a chain's ``quantize``, else the
        source (a kernel's output, a graph input quantized from float)."""
        value = self._value(expr)
        if isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.quantize":
            state = (self.source, self.shape, self.axis)
            try:
                return self.trace(expr)
            except _NotAChain:
                self.source, self.shape, self.axis = state
        return self._leaf(expr)

    def _leaf(self, expr: relax.Expr) -> Callable[[np.ndarray], np.ndarray]:
        if self.source is None:
            dtype = str(expr.ty.dtype) if isinstance(expr.ty, relax.TensorType) else ""
            shape = static_shape(expr.ty.shape) if dtype in _INT8 else None
            if shape is None:
                raise _NotAChain
            self.source, self.shape = expr, shape
        elif not expr.same_as(self.source):
            raise _NotAChain
        return lambda x: x


def chain_table(call: relax.Call, bound: dict[relax.Var, relax.Expr] | None = None
                ) -> tuple[relax.Expr, np.ndarray, int | None] | None:
    """The 8-bit source, the table ``[channels, 256]`` (``[1, 256]`` when nothing varies
    along an axis) and that axis of the chain ending in the ``quantize`` ``call``; None
    when ``call`` ends no such chain.  ``bound`` maps the variables of the function the call
    is in to their values.  Row ``c`` of the table holds the outputs for the source values
    ``-128..127`` (int8) or ``0..255`` (uint8) of channel ``c``."""
    if not (isinstance(call, relax.Call) and getattr(call.op, "name", "") == "relax.quantize"):
        return None
    chain = _Chain(bound or {})
    try:
        evaluate = chain.trace(call)
    except _NotAChain:
        return None
    if chain.source is None or static_shape(call.ty.shape) != chain.shape:
        return None  # no 8-bit source, or constants broadcast the source to a larger shape
    info = np.iinfo(str(chain.source.ty.dtype))
    values = np.arange(info.min, info.max + 1, dtype=str(chain.source.ty.dtype)).reshape(1, -1)
    with np.errstate(all="ignore"):
        try:
            table = evaluate(values)
        except _NotAChain:
            return None
    rows = 1 if chain.axis is None else chain.shape[chain.axis]
    return chain.source, np.ascontiguousarray(np.broadcast_to(table, (rows, 256))), chain.axis


def lookup_kernel(shape: tuple[int, ...], source_dtype: str, rows: int, axis: int | None,
                  out_dtype: str, cache_bytes: int = 0) -> tvm.tirx.PrimFunc:
    """``Y[i] = table[i[axis], X[i] - min(source_dtype)]`` over ``shape``: the leading axes
    fused and run in parallel, the last one serial: a byte load per element, faster on Zen 3
    than ``vpgatherdd`` on a table widened to int32, and on a Zen 4's two vCPUs (BENCHMARKS.md).

    A table over the last axis (NHWC channels) larger than ``cache_bytes`` (half of L1d; 0:
    any size) is read a block of channels at a time: each task takes tiles of
    :data:`PIXEL_TILE` pixels and looks up one block of their channels after another, so
    the rows of the table in use stay in L1 (DenseNet's 256- to 1024-channel tables are
    64-256 KiB: an [8, 56, 56, 256] lookup 1.8x faster on a Zen 4, BENCHMARKS.md).

    >>> f = lookup_kernel((2, 8, 8, 256), "uint8", 256, 3, "uint8", cache_bytes=16 << 10)
    >>> loops = [line.strip() for line in f.script().splitlines() if " in T." in line]
    >>> for line in loops:  # 4 pixel tiles; 4 blocks of 64 channels x 32 pixels
    ...     print(line)
    for i0_i1_i2_fused_0 in T.parallel(4):
    for i3_0, i0_i1_i2_fused_1, i3_1 in T.grid(4, 32, 64):
    """
    x = te.placeholder(shape, source_dtype, name="X")
    table = te.placeholder((rows, 256), out_dtype, name="table")
    low = int(np.iinfo(source_dtype).min)

    def lookup(*i):
        row = 0 if axis is None else i[axis]
        return table[row, x[i].astype("int32") - low]

    y = te.compute(shape, lookup, name="lookup")
    sch = s_tir.Schedule(te.create_prim_func([x, table, y]))
    loops = sch.get_loops(sch.get_sblock("lookup"))
    if len(loops) > 1:
        pixels = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
        table_bytes = rows * 256 * tvm.DataType(out_dtype).bits // 8
        if axis == len(shape) - 1 and cache_bytes and table_bytes > cache_bytes:
            count = math.prod(shape[:-1])  # tiles for four tasks at least (7x7 maps)
            pixels, tile = sch.split(pixels, [None, min(PIXEL_TILE, math.ceil(count / 4))])
            channels, block = sch.split(loops[-1], [math.ceil(table_bytes / cache_bytes), None])
            sch.reorder(pixels, channels, tile, block)
        sch.parallel(pixels)
    return sch.mod["main"].with_attr("tirx.noalias", True)


#: Pixels a task looks up a block of channels for at a time (:func:`lookup_kernel`): on a
#: Zen 4, tiles of 16 ran 1.06-1.27x slower than tiles of 64 (256 and 512 channels).
PIXEL_TILE = 64


def lookup_tables(mod: tvm.IRModule, cache_bytes: int = 0) -> tvm.IRModule:
    """``mod`` with each elementwise chain between 8-bit tensors (module docstring) replaced
    by a table lookup; the operators only the chains read go.  Tables over more than
    ``cache_bytes`` (half of the target's L1d) are read in blocks (:func:`lookup_kernel`)."""
    lookups = _Lookups(mod, cache_bytes)
    changed = {}
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            lookups.bound = relax.analysis.get_var2val(func)
            changed[gv] = lookups.visit_expr(func)
    out = lookups.builder_.get()  # with the lookup kernels it added
    for gv, func in changed.items():
        out[gv] = func
    return relax.transform.DeadCodeElimination()(out)


@relax.expr_functor.mutator
class _Lookups(relax.PyExprMutator):
    #: The variables of the function being visited, bound to their values.
    bound: dict[relax.Var, relax.Expr] = {}

    def __init__(self, mod: tvm.IRModule, cache_bytes: int) -> None:
        super().__init__(mod)
        #: Table bytes a lookup reads at once (:func:`lookup_kernel`).
        self.cache_bytes = cache_bytes

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        found = chain_table(call, self.bound)
        if found is None:
            return super().visit_call_(call)
        source, table, axis = found
        shape = static_shape(call.ty.shape)
        dtype, source_dtype = str(call.attrs.out_dtype), str(source.ty.dtype)
        name = f"tpp_lookup_{source_dtype}_{'x'.join(map(str, shape))}_{dtype}"
        gv = add_kernel(self.builder_, lookup_kernel(shape, source_dtype, table.shape[0], axis,
                                                     dtype, self.cache_bytes), name)
        return relax.call_tir(gv, [self.visit_expr(source), relax.const(table)],
                              relax.TensorType(list(shape), dtype))
