"""DenseNet's block buffers in bf16 where bf16 convs grow them (relay_passes.bf16_concat_chains).

The rewrite as Before/Expected, the chains it must leave alone, the same values through the
VM as the graph computes on bf16-rounded parts, and a dense block through the ``tpp`` rewrites:
a bf16 buffer its growth convs write and its 1x1 convs' prologues widen, against ONNX Runtime.
"""

import ml_dtypes
import numpy as np
import pytest
import tvm
from conftest import main_calls, relax_main, run_main
from test_conv_prologue import _dense_block
from tvm import relax

from relay_passes.bf16_concat_chains import concat_chains_in_bf16
from relay_passes.pipeline import tpp_rewrites
from tvm_tpp import compiler
from tvm_tpp.reference import max_errors, run_onnxruntime
from tvm_tpp.tpp_target import target as tpp_target

F32, BF16 = "float32", "bfloat16"
RNG = np.random.default_rng(45)
C, GROWTH, HW = 6, 4, (5, 7)
#: The growth convs' filters: 3x3 over everything before them.
FILTERS = [RNG.standard_normal((GROWTH, C + i * GROWTH, 3, 3)).astype(F32) / 8
           for i in range(3)]


def _x() -> relax.Var:
    return relax.Var("x", relax.TensorType((1, C, *HW), F32))


def _grow(bb, c, filters):
    return bb.emit(relax.op.nn.conv2d(c, relax.const(filters), padding=1))


def _block(bb, x, grow=_grow, first=None):
    """``x``'s ReLU, then three layers each concatenating a conv of everything before."""
    c = bb.emit(relax.op.nn.relu(x)) if first is None else first(bb, x)
    for filters in FILTERS:
        c = bb.emit(relax.op.concat([c, grow(bb, c, filters)], axis=1))
    return c


def test_rewrite_before_expected():
    def expected(bb, x):
        c = bb.emit(relax.op.nn.relu(x))
        narrow = bb.emit(relax.op.astype(c, BF16))
        wide = bb.emit(relax.op.astype(narrow, F32))
        for filters in FILTERS:
            part = bb.emit(relax.op.astype(_grow(bb, wide, filters), BF16))
            narrow = bb.emit(relax.op.concat([narrow, part], axis=1))
            wide = bb.emit(relax.op.astype(narrow, F32))
        return wide

    got = concat_chains_in_bf16(relax_main([_x()], _block))
    tvm.ir.assert_structural_equal(got, relax_main([_x()], expected))


def _rounded(values: np.ndarray) -> np.ndarray:
    return values.astype(ml_dtypes.bfloat16).astype(F32)


def test_values_are_the_rounded_parts():
    """Through the VM, the chain's output is what the float32 graph computes with each part
    rounded to bf16 as it is concatenated (the convs themselves in float32 here)."""
    x = RNG.standard_normal((1, C, *HW)).astype(F32)
    got = run_main(concat_chains_in_bf16(relax_main([_x()], _block)), x)

    def rounding(bb, c, filters):  # the float32 graph's parts, rounded as the buffer holds
        return bb.emit(relax.op.astype(relax.op.astype(_grow(bb, c, filters), BF16), F32))

    def first(bb, x):
        return bb.emit(relax.op.astype(relax.op.astype(relax.op.nn.relu(x), BF16), F32))

    want = run_main(relax_main([_x()], lambda bb, x: _block(bb, x, rounding, first)), x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.array_equal(got, run_main(relax_main([_x()], _block), x))  # it did round
    np.testing.assert_array_equal(got, _rounded(got))


def _relu_part(bb, c, filters):  # a part no conv computes
    return bb.emit(relax.op.nn.relu(_grow(bb, c, filters)))


def _part_read_twice(bb, x):
    grown = []

    def grow(bb, c, filters):
        grown.append(_grow(bb, c, filters))
        return grown[-1]

    c = _block(bb, x, grow)
    return relax.Tuple([c, grown[0]])


def _one_concat(bb, x):  # a single concat is no chain (relay_passes.concat_chain)
    c = bb.emit(relax.op.nn.relu(x))
    return bb.emit(relax.op.concat([c, _grow(bb, c, FILTERS[0])], axis=1))


@pytest.mark.parametrize("body", [
    lambda bb, x: _block(bb, x, _relu_part),
    _part_read_twice,
    _one_concat,
], ids=["part-not-a-conv", "part-read-twice", "one-concat"])
def test_chains_left_alone(body):
    before = relax_main([_x()], body)
    after = concat_chains_in_bf16(before)
    assert not [c for c in main_calls(after) if c.op.name == "relax.astype"]
    tvm.ir.assert_structural_equal(after, before)


@pytest.mark.parametrize("layers", [2, 3])
def test_dense_block_buffer_in_bf16(layers):
    """Through the ``tpp`` rewrites: the block's buffer is bf16, the growth convs write their
    channels into it, the 1x1 convs' prologues widen it; against ONNX Runtime in float32."""
    model = _dense_block(c=14, growth=6, layers=layers)
    mod, _ = compiler.import_model(model)
    target = tpp_target("tpp")
    with target:
        mod = tpp_rewrites(target, precision="bf16")(mod)
    calls = [c for c in main_calls(mod) if c.op.name in ("relax.call_tir",
                                                         "relax.call_tir_inplace")]
    names = {c.args[0].name_hint: c for c in calls}
    copies = [c for name, c in names.items() if name.startswith("concat_copy")]
    assert copies and all(str(c.ty.dtype) == BF16 for c in copies), names
    assert sum("_sliced" in name for name in names) == layers, names
    assert sum("_pre_bf16_scale_bias_relu" in name for name in names) == layers + 1, names
    feeds = {"x": RNG.standard_normal((1, 8, 8, 12)).astype(F32)}
    got = compiler.compile(model, "tpp", untuned=True, precision="bf16").run(**feeds)
    errors = max_errors(got, run_onnxruntime(model, feeds))
    assert errors[1] < 2e-2, errors
