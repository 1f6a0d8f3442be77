"""Kernels writing their result over a dead operand (relay_passes.inplace).

The PrimFunc check (which parameter a function may overwrite), the Relax rewrite as
Before/Expected pairs checked structurally and numerically, the cases it must leave alone,
and real networks with residual blocks built with the ``tpp`` target against ONNX Runtime.
"""

import functools

import numpy as np
import pytest
import tvm
from conftest import run_main
from tvm import relax
from tvm.script import tirx as T

from relay_passes.inplace import elementwise_operands, in_place, write_over_dead_operands
from tvm_tpp import compiler, models
from tvm_tpp.reference import max_errors, run_onnxruntime

F32 = "float32"


@functools.cache
def kernels() -> dict[str, tvm.tirx.PrimFunc]:
    """The test kernels by name, parsed when a test first asks: TVMScript parsed during an
    import costs every pytest worker about 0.1 s a function (``inspect.stack``)."""
    @T.prim_func(private=True, s_tir=True)
    def add_relu(x: T.Buffer((5, 7), F32), r: T.Buffer((5, 7), F32), y: T.Buffer((5, 7), F32)):
        for i, j in T.grid(5, 7):
            with T.sblock("epilogue"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = T.max(x[vi, vj] + r[vi, vj], T.float32(0))

    @T.prim_func(private=True, s_tir=True)
    def add_relu_inplace(x: T.Buffer((5, 7), F32), r: T.Buffer((5, 7), F32)):
        for i, j in T.grid(5, 7):
            with T.sblock("epilogue"):
                vi, vj = T.axis.remap("SS", [i, j])
                r[vi, vj] = T.max(x[vi, vj] + r[vi, vj], T.float32(0))

    @T.prim_func(private=True, s_tir=True)
    def double(x: T.Buffer((5, 7), F32), y: T.Buffer((5, 7), F32)):
        for i, j in T.grid(5, 7):
            with T.sblock("double"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] * T.float32(2)

    @T.prim_func(private=True, s_tir=True)
    def shifted(x: T.Buffer((5, 7), F32), r: T.Buffer((5, 7), F32), y: T.Buffer((5, 7), F32)):
        for i, j in T.grid(5, 7):
            with T.sblock("epilogue"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] + r[vi, (vj + 1) % 7]  # reads a neighbour's element

    @T.prim_func(private=True, s_tir=True)
    def two_writers(x: T.Buffer((5, 7), F32), r: T.Buffer((5, 7), F32), y: T.Buffer((5, 7), F32)):
        for i, j in T.grid(5, 7):
            with T.sblock("first"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj]
        for i, j in T.grid(5, 7):
            with T.sblock("second"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = y[vi, vj] + r[vi, vj]  # r would be overwritten by "first"

    @T.prim_func(private=True, s_tir=True)
    def read_twice(x: T.Buffer((5, 7), F32), r: T.Buffer((5, 7), F32), y: T.Buffer((5, 7), F32)):
        t = T.sblock_alloc_buffer((5, 7), F32)
        for i, j in T.grid(5, 7):
            with T.sblock("epilogue"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] + r[vi, vj]
        for i, j in T.grid(5, 7):
            with T.sblock("later"):
                vi, vj = T.axis.remap("SS", [i, j])
                t[vi, vj] = r[vi, vj]  # another block reads r

    @T.prim_func(private=True, s_tir=True)
    def transposed(x: T.Buffer((5, 5), F32), r: T.Buffer((5, 5), F32), y: T.Buffer((5, 5), F32)):
        for i, j in T.grid(5, 5):
            with T.sblock("epilogue"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] + r[vj, vi]

    @T.prim_func(private=True, s_tir=True)
    def other_dtype(x: T.Buffer((5, 7), F32), r: T.Buffer((5, 7), "int32"),
                    y: T.Buffer((5, 7), F32)):
        for i, j in T.grid(5, 7):
            with T.sblock("epilogue"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] + T.Cast(F32, r[vi, vj])

    return {name: f for name, f in locals().items() if isinstance(f, tvm.tirx.PrimFunc)}


# ---------------------------------------------------------------------------------------------
# Which parameter a PrimFunc may write its output over
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, expected", [
    ("add_relu", (0, 1)), ("double", (0,)), ("shifted", (0,)), ("two_writers", ()),
    ("read_twice", (0,)), ("transposed", (0,)), ("other_dtype", (0,))])
def test_elementwise_operands(name, expected):
    """x is read at each output's own element; r is not, where the name says why."""
    assert elementwise_operands(kernels()[name]) == expected


def test_in_place_function():
    k = kernels()
    tvm.ir.assert_structural_equal(in_place(k["add_relu"], 1), k["add_relu_inplace"])


# ---------------------------------------------------------------------------------------------
# The Relax rewrite
# ---------------------------------------------------------------------------------------------


TENSOR = relax.TensorType((5, 7), F32)


def _module(emit, params=("x",), outputs=1) -> tvm.IRModule:
    """main(params) with one dataflow block, ``emit(bb, kernels, *params)`` returning the
    block's outputs, over the kernels double, add_relu, shifted and add_relu_inplace."""
    bb = relax.BlockBuilder()
    added = {name: bb.add_func(kernels()[name], name)
             for name in ("double", "add_relu", "shifted", "add_relu_inplace")}
    args = [relax.Var(name, TENSOR) for name in params]
    with bb.function("main", args):
        with bb.dataflow():
            outs = [bb.emit_output(v) for v in emit(bb, added, *args)]
        bb.emit_func_output(outs[0] if len(outs) == 1 else relax.Tuple(outs))
    return relax.transform.DeadCodeElimination(["main"])(bb.get()) if outputs else bb.get()


def _call(bb, kernel, *args):
    return bb.emit(relax.call_tir(kernel, list(args), TENSOR))


def test_dead_residual_written_over():
    def before(bb, k, x):
        r = _call(bb, k["double"], x)
        return [relax.call_tir(k["add_relu"], [x, r], TENSOR)]

    def expected(bb, k, x):
        r = _call(bb, k["double"], x)
        return [relax.call_tir_inplace(k["add_relu_inplace"], [x, r], [1], TENSOR)]

    mod = _module(before, outputs=0)
    after = write_over_dead_operands()(mod)
    tvm.ir.assert_structural_equal(relax.transform.DeadCodeElimination(["main"])(after),
                                   _module(expected))
    x = np.random.default_rng(0).standard_normal((5, 7)).astype(F32)
    for built in (mod, after):
        np.testing.assert_allclose(run_main(built, x), np.maximum(3 * x, 0), rtol=1e-6)


def _read_later(bb, k, x):  # r read again after the call (by a call that cannot take it)
    r = _call(bb, k["double"], x)
    return [relax.call_tir(k["add_relu"], [x, r], TENSOR),
            relax.call_tir(k["shifted"], [x, r], TENSOR)]


def _view_read_later(bb, k, x):  # a view of r (a reshape shares its memory) read after it
    r = _call(bb, k["double"], x)
    v = bb.emit(relax.op.reshape(r, (35,)))
    y = _call(bb, k["add_relu"], x, r)
    return [y, relax.call_tir(k["shifted"], [x, relax.op.reshape(v, (5, 7))], TENSOR)]


def _parameters(bb, k, x, r):  # function parameters are never written over
    return [relax.call_tir(k["add_relu"], [x, r], TENSOR)]


def _same_twice(bb, k, x):  # one tensor as both operands: writing one changes the other
    r = _call(bb, k["double"], x)
    return [relax.call_tir(k["shifted"], [r, r], TENSOR)]


def _block_output(bb, k, x):  # r outlives the block
    r = bb.emit_output(relax.call_tir(k["double"], [x], TENSOR))
    return [relax.call_tir(k["add_relu"], [x, r], TENSOR)]


@pytest.mark.parametrize("emit, params", [
    (_read_later, ("x",)), (_view_read_later, ("x",)), (_parameters, ("x", "r")),
    (_same_twice, ("x",)), (_block_output, ("x",))],
    ids=["read-later", "view-read-later", "parameters", "same-twice", "block-output"])
def test_live_operands_kept(emit, params):
    mod = _module(emit, params, outputs=0)
    tvm.ir.assert_structural_equal(write_over_dead_operands()(mod), mod)


def test_symbolic_functions_kept():
    """A function with symbolic shapes is left as it is (re-emitted, it could lose where a
    shape expression is computed)."""
    bb = relax.BlockBuilder()
    k = {name: bb.add_func(kernels()[name], name) for name in ("double", "add_relu")}
    n = tvm.tirx.Var("n", "int64")
    x, s = relax.Var("x", TENSOR), relax.Var("s", relax.TensorType((n,), F32))
    with bb.function("main", [x, s]):
        with bb.dataflow():
            r = _call(bb, k["double"], x)
            y = bb.emit_output(relax.call_tir(k["add_relu"], [x, r], TENSOR))
            t = bb.emit_output(relax.op.add(s, s))
        bb.emit_func_output(relax.Tuple([y, t]))
    mod = bb.get()
    tvm.ir.assert_structural_equal(write_over_dead_operands()(mod), mod)


# ---------------------------------------------------------------------------------------------
# Real networks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [
    "resnet_small",
    pytest.param("mobilenet_v2", marks=pytest.mark.slow),  # 13 s; resnet_small's 7 s suffice
])
def test_networks_with_residuals(name, monkeypatch):
    """Each residual block's conv writes over its dead residual, but the first's (below);
    outputs match ONNX Runtime."""
    import relay_passes.pipeline as pipeline

    written_over = []

    def counting():
        inner = write_over_dead_operands()

        @tvm.transform.module_pass(opt_level=0, name="Counting")
        def count(mod, ctx):
            out = inner(mod)
            relax.analysis.post_order_visit(out["main"], lambda e: written_over.append(
                e.args[0].name_hint) if isinstance(e, relax.Call) and isinstance(
                e.op, tvm.ir.Op) and e.op.name == "relax.call_tir_inplace" else None)
            return out
        return count

    monkeypatch.setattr(pipeline, "write_over_dead_operands", counting)
    model = models.load(name)
    feeds = models.random_inputs(model, seed=3)
    got = compiler.compile(model, "tpp", untuned=True).run(**feeds)
    errors = max_errors(got, run_onnxruntime(model, feeds))
    assert max(errors) < 1e-5, errors
    residual_convs = [k for k in written_over if k.startswith("tpp_conv2d") and "residual" in k]
    # The first block's shortcut reads the stem conv's padded output (relay_passes.
    # padded_outputs), which its conv cannot write over: a buffer of another shape.
    assert len(residual_convs) == {"resnet_small": 2, "mobilenet_v2": 3}[name], written_over
