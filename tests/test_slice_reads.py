"""Kernels reading a channel prefix of a wider tensor in place (relay_passes.slice_reads).

The PrimFunc rewrite as a Before/Expected pair and numerically on scheduled conv kernels
(the extra channels filled with NaN, so a read of them shows), the kernels it refuses, and
the Relax rewrite as Before/Expected and through the VM, with the slices it must keep.
"""

import functools

import numpy as np
import pytest
import tvm
from conftest import main_calls, pixel_rows, relax_main
from tvm import relax
from tvm.script import tirx as T

from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.machine import host
from relay_passes.scaffold import add_kernel, is_call_to
from relay_passes.slice_reads import read_slices_in_place, reading_wider
from schedules.conv import ConvProblem, default_config, pack_weight, reference, schedule
from tvm_tpp.tpp_target import target as tpp_target

F32 = "float32"
LLVM = tvm.target.Target({"kind": "llvm"})


# TVMScript parsed when a test asks: parsed at import, each function costs ~0.3 s per worker.
@functools.cache
def _double_ir():
    @T.prim_func(private=True, s_tir=True)
    def double(x: T.Buffer((2, 3, 4), F32), y: T.Buffer((2, 3, 4), F32)):
        for i, j, c in T.grid(2, 3, 4):
            with T.sblock("double"):
                vi, vj, vc = T.axis.remap("SSS", [i, j, c])
                y[vi, vj, vc] = x[vi, vj, vc] * T.float32(2)
    return double


@functools.cache
def _double_from6_ir():
    @T.prim_func(private=True, s_tir=True)
    def double_from6(x: T.Buffer((2, 3, 6), F32), y: T.Buffer((2, 3, 4), F32)):
        for i, j, c in T.grid(2, 3, 4):
            with T.sblock("double"):
                vi, vj, vc = T.axis.remap("SSS", [i, j, c])
                T.reads(x[vi, vj, vc])
                T.writes(y[vi, vj, vc])
                y[vi, vj, vc] = x[vi, vj, vc] * T.float32(2)
    return double_from6


@functools.cache
def _dense_tile_ir():
    @T.prim_func(private=True, s_tir=True)
    def dense_tile(x: T.Buffer((2, 3, 4), F32), y: T.Buffer((2, 3, 4), F32)):
        for i in range(2):
            with T.sblock("tile"):
                vi = T.axis.spatial(2, i)
                tile = T.match_buffer(x[vi, 0:3, 0:4], (3, 4))  # dense: assumes rows of 4
                for j, c in T.grid(3, 4):
                    y[vi, j, c] = tile[j, c]
    return dense_tile


def test_reading_wider_function():
    tvm.ir.assert_structural_equal(reading_wider(_double_ir(), 0, 6), _double_from6_ir())


def test_dense_matched_tiles_refused():
    assert reading_wider(_dense_tile_ir(), 0, 6) is None
    assert reading_wider(_double_ir(), 0, 3) is None  # narrower than the parameter


def _run_wide(func, problem: ConvProblem, config, extra: int, x: np.ndarray,
              operands: list[np.ndarray]) -> np.ndarray:
    """Run the kernel with its input's channels widened by ``extra`` NaN channels."""
    wide = reading_wider(func, 0, problem.c + extra)
    assert wide is not None
    nhwc = np.transpose(x, (0, 2, 3, 1))
    padded = np.concatenate([nhwc, np.full((*nhwc.shape[:3], extra), np.nan, F32)], axis=3)
    out = tvm.runtime.empty((problem.rows, problem.k), F32)
    args = [padded, pack_weight(operands[0], config.bk, problem), *operands[1:]]
    tvm.compile(wide, target=tpp_target("tpp"))(*[tvm.runtime.tensor(a) for a in args], out)
    return out.numpy()


@pytest.mark.parametrize("c, h, w, k, extra, prologue", [
    (24, 5, 7, 16, 8, True),
    (13, 3, 6, 24, 19, False),   # the BRGEMM reads the input itself, odd channels
], ids=["prologue-conv", "plain-conv"])
def test_wider_conv_kernels_match_numpy(c, h, w, k, extra, prologue):
    relu = EpilogueOp("relu")
    pre = Epilogue((EpilogueOp("bias", name="pre_bias"), relu)) if prologue else Epilogue()
    problem = ConvProblem(1, c, h, w, k, 1, 1, epilogue=Epilogue((relu,)), prologue=pre)
    config = default_config(problem, host())
    func = schedule(problem, config, host().isa.name).mod["main"]
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, c, h, w)).astype(F32)
    weight = rng.standard_normal((k, c, 1, 1)).astype(F32)
    shift = rng.standard_normal(c).astype(F32)
    activated = np.maximum(x + shift[None, :, None, None], 0) if prologue else x
    want = np.maximum(reference(problem, activated, weight), 0)
    got = _run_wide(func, problem, config, extra, x, [weight] + ([shift] if prologue else []))
    np.testing.assert_allclose(got, pixel_rows(want), rtol=1e-4,
                               atol=1e-4)


# ---------------------------------------------------------------------------------------------
# The Relax rewrite
# ---------------------------------------------------------------------------------------------


def _buffer() -> relax.Var:
    return relax.Var("buf", relax.TensorType((2, 3, 6), F32))


def _slice_then(axes=(2,), begin=0, end=4, step=1):
    def body(bb, buf):
        kernel = bb.add_func(_double_ir(), "double")
        part = bb.emit(relax.op.strided_slice(buf, axes=list(axes), begin=[begin], end=[end],
                                              strides=[step]))
        return relax.call_tir(kernel, [part], relax.TensorType((2, 3, 4), F32))

    return body


def test_slice_read_in_place():
    before = relax_main([_buffer()], _slice_then())

    def expected_body(bb, buf):
        kernel = add_kernel(bb, _double_from6_ir(), "double_from6")
        return relax.call_tir(kernel, [buf], relax.TensorType((2, 3, 4), F32))

    after = read_slices_in_place(before)
    expected = relax_main([_buffer()], expected_body)
    tvm.ir.assert_structural_equal(after, expected)
    buf = np.random.default_rng(0).standard_normal((2, 3, 6)).astype(F32)
    for mod in (before, after):
        ex = tvm.compile(mod, LLVM)
        got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(buf)).numpy()
        np.testing.assert_array_equal(got, buf[..., :4] * 2)


def _split_then(bb, buf):
    kernel = bb.add_func(_double_ir(), "double")
    parts = bb.emit(relax.op.split(buf, [2], axis=-1))  # channels [0, 2) and [2, 6)
    part = bb.emit(relax.TupleGetItem(parts, 1))
    return relax.call_tir(kernel, [part], relax.TensorType((2, 3, 4), F32))


def _flat_split_then(bb, buf):  # GPT-2's Q: a split part reshaped to rows, channels kept
    kernel = bb.add_func(_double_ir(), "double")
    parts = bb.emit(relax.op.split(buf, [2], axis=-1))
    part = bb.emit(relax.op.reshape(bb.emit(relax.TupleGetItem(parts, 1)), (6, 4)))
    flat = bb.emit(relax.op.reshape(part, (2, 3, 4)))
    return relax.call_tir(kernel, [flat], relax.TensorType((2, 3, 4), F32))


@pytest.mark.parametrize("body", [_slice_then(begin=2, end=6), _split_then, _flat_split_then],
                         ids=["slice", "split", "reshaped-split"])
def test_channels_from_an_offset_read_in_place(body):
    """A slice of channels [2, 6) of the 6 and a split's second part (GPT-2's K and V of one
    dense's output), reshaped or not, are read where they lie: the kernel reads the whole
    buffer with its channel index 2 further on."""
    before = relax_main([_buffer()], body)
    after = read_slices_in_place(before)
    kernels = [gv.name_hint for gv in after.get_global_vars() if gv.name_hint != "main"]
    assert kernels == ["double_from6at2"], kernels
    wide = after["double_from6at2"]
    want = reading_wider(_double_ir(), 0, 6, 2)
    tvm.ir.assert_structural_equal(wide.body, want.body)
    assert not [e for e in main_calls(after) if is_call_to(e, "relax.split")
                or is_call_to(e, "relax.strided_slice")]
    buf = np.random.default_rng(1).standard_normal((2, 3, 6)).astype(F32)
    for mod in (before, after):
        ex = tvm.compile(mod, LLVM)
        got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(buf)).numpy()
        np.testing.assert_array_equal(got, buf[..., 2:] * 2)


@pytest.mark.parametrize("shape, slicing", [
    ((2, 3, 8), dict(step=2, end=8)),
    ((2, 6, 4), dict(axes=(1,), end=3)),
], ids=["strided", "not-channels"])
def test_other_slices_kept(shape, slicing):
    mod = relax_main([relax.Var("buf", relax.TensorType(shape, F32))], _slice_then(**slicing))
    tvm.ir.assert_structural_equal(read_slices_in_place(mod), mod)
