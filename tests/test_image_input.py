"""An image's first conv reads its packed input written by one kernel from the NCHW image
(:mod:`schedules.stacked_rows`): its padded NHWC rows (:func:`padded_image_kernel`) or its
filter rows stacked as channels (:func:`stacked_rows_kernel`), a block of pixels at a time
by one shuffle of its channel planes.

Both kernels against numpy bit for bit (float32, bfloat16, uint8 with a zero point as the
pad value; odd sizes, strides, dilation, asymmetric padding, widths with and without vector
blocks; a fixed and a run-time batch; a float32 image rounded to bfloat16 as it is packed,
portably and by AVX512-BF16's instruction), and the graph: a float32 RGB stem reads
``transpose_pad`` (a layout conversion in the profiles; no transpose or pad left to TVM), a
bf16 one reads the float32 image itself (no cast before it), checked against ONNX Runtime in
``test_rows_folded_conv.py``.
"""

import ml_dtypes
import numpy as np
import pytest
import tvm
import tvm_ffi
from conftest import isa_target, runs_here
from tvm import relax, tirx

from microkernels.epilogue import Epilogue, EpilogueOp, reference
from relay_passes.conv import rewrite_conv
from relay_passes.prepare import prepare
from relay_passes.scaffold import is_call_to
from schedules.conv import ConvProblem
from schedules.stacked_rows import padded_image_kernel, stacked_rows_kernel
from tvm_tpp.compiler import import_model
from tvm_tpp.profiling import operator_kind
from tvm_tpp.tpp_target import target as make_target

PROBLEMS = [
    ConvProblem(2, 3, 9, 37, 8, 3, 3, stride=2, padding=1),      # two blocks and a tail
    ConvProblem(1, 3, 11, 16, 8, 7, 7, stride=2, padding=3),     # one block, no tail
    ConvProblem(2, 1, 7, 13, 4, 3, 3, padding=(1, 0, 2, 1)),     # no block
    ConvProblem(1, 4, 10, 21, 6, 3, 2, stride=(3, 1), padding=2, dilation=(2, 3)),
]
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "uint8": np.uint8}


def _expected(problem: ConvProblem, rows: int, x: np.ndarray, pad) -> np.ndarray:
    """The packed input by its definition: pixel ``j`` of output row ``p``, channel ``k`` is
    image pixel ``(k % C, p * step + k // C * dh - top, j - left)``, else ``pad``."""
    packed = problem.rows_folded() if rows > 1 else problem
    n, c, h, w = x.shape
    top, left, _, _ = problem.padding
    step = problem.stride[0] if rows > 1 else 1
    sw = packed.stride[1]
    y = np.full((n, packed.input_shape[1], packed.wq * sw, packed.padded_c), pad, x.dtype)
    for p in range(y.shape[1]):
        for k in range(rows * c):
            row = p * step + k // c * problem.dilation[0] - top
            if 0 <= row < h:
                y[:, p, left:left + w, k] = x[:, k % c, row]
    return y.reshape(n, packed.input_shape[1], packed.wq, sw, packed.padded_c)


def _run(func: tirx.PrimFunc, x: np.ndarray, shape: tuple, dtype: str,
         target: tvm.target.Target | None = None) -> np.ndarray:
    ex = tvm.compile(tvm.IRModule({"main": func}), target=target or make_target("tpp"))
    y = tvm.runtime.empty(shape, dtype)
    ex(tvm.runtime.tensor(x), y)
    return y.numpy()


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: f"{p.c}x{p.h}x{p.w}_{p.r}x{p.s}")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("folded", [False, True])
def test_packed_input_matches_numpy(problem, dtype, folded):
    problem = ConvProblem(**{**problem.__dict__, "dtype": "uint8" if dtype == "uint8"
                             else dtype})
    pad = 7 if dtype == "uint8" else 0.0  # a zero point, or zeros
    x = np.random.default_rng(0).integers(1, 250, (problem.n, problem.c, problem.h,
                                                   problem.w)).astype(DTYPES[dtype])
    kernel = stacked_rows_kernel if folded else padded_image_kernel
    want = _expected(problem, problem.r if folded else 1, x, DTYPES[dtype](pad))
    got = _run(kernel(problem, dtype, pad), x, want.shape, dtype)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    # A run-time batch: the same kernel over however many images the call passes.
    batched = np.concatenate([x, x[::-1]])
    got = _run(kernel(problem, dtype, pad, run_time_batch=True), batched,
               (2 * want.shape[0], *want.shape[1:]), dtype)
    np.testing.assert_array_equal(got.view(np.uint8),
                                  np.concatenate([want, want[::-1]]).view(np.uint8))


def test_pixels_move_in_shuffled_blocks():
    """Sixteen pixels a block: a 37-pixel row runs two blocks by one shuffle each, a 13-pixel
    one none (an element at a time)."""
    def shuffles(problem: ConvProblem) -> list[int]:
        found = []
        tvm_ffi.structural_walk(padded_image_kernel(problem, "float32").body, (
            tirx.Shuffle, lambda s: found.append(len(s.indices))))
        return found

    assert shuffles(PROBLEMS[0]) == [16 * 3]
    assert shuffles(PROBLEMS[2]) == []


def test_a_float32_stem_reads_its_padded_image():
    from test_rows_folded_conv import _stem_model

    mod, _ = import_model(_stem_model(2))
    mod = rewrite_conv(prepare()(mod), make_target("tpp -isa=avx2"), [])
    calls = []
    relax.analysis.post_order_visit(mod["main"], lambda e: calls.append(e) if isinstance(
        e, relax.Call) else None)
    kernels = [c.args[0].name_hint for c in calls if is_call_to(c, "relax.call_tir")]
    assert kernels[0] == "transpose_pad" and operator_kind(kernels[0]) == "layout"
    # The stem's input is the graph's: nothing transposes or pads it before the kernel.
    first = next(i for i, c in enumerate(calls) if is_call_to(c, "relax.call_tir"))
    assert not any(is_call_to(c, op) for c in calls[:first]
                   for op in ("relax.permute_dims", "relax.nn.pad"))


@pytest.mark.parametrize("problem", PROBLEMS[:2], ids=lambda p: f"{p.c}x{p.h}x{p.w}_{p.r}x{p.s}")
@pytest.mark.parametrize("isa", ["generic", "avx512_bf16"])
@pytest.mark.parametrize("folded", [False, True])
def test_a_float32_image_is_rounded_to_bf16_as_it_is_packed(problem, isa, folded):
    """Bits as the epilogue's ``convert`` rounds them (to nearest even, NaNs quieted): ties,
    infinities and NaNs among normal values (AVX512-BF16's instruction flushes denormals)."""
    problem = ConvProblem(**{**problem.__dict__, "dtype": "bfloat16"})
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((problem.n, problem.c, problem.h, problem.w)) * 100
         ).astype(np.float32)
    x.view(np.uint32).reshape(-1)[:6] = [0x3F808000, 0x3F818000, 0x7F800000, 0xFF800000,
                                         0x7FA00001, 0x3F80FFFF]
    rounded = reference(Epilogue((EpilogueOp("convert", dtype="bfloat16"),)), x.reshape(1, -1))
    want = _expected(problem, problem.r if folded else 1, rounded.reshape(x.shape), 0)
    kernel = (stacked_rows_kernel if folded else padded_image_kernel)(
        problem, "bfloat16", 0, source_dtype="float32", isa=isa)
    target = isa_target("avx512_bf16", "sapphirerapids")
    if isa != "generic":
        asm = tvm.compile(tvm.IRModule({"main": kernel}), target=target).mod.inspect_source(
            "asm")
        assert "vcvtneps2bf16" in asm
        if not runs_here(isa):
            pytest.skip(f"host lacks {isa}: its kernel checked in cross-compiled assembly only")
    got = _run(kernel, x, want.shape, "bfloat16", target if isa != "generic" else None)
    np.testing.assert_array_equal(got.view(np.uint16), want)


def test_a_bf16_stem_reads_the_float32_image():
    from test_rows_folded_conv import _stem_model

    mod, _ = import_model(_stem_model(2))
    mod = rewrite_conv(prepare()(mod), make_target("tpp -isa=avx512_bf16"), [],
                       precision="bf16")
    calls = []
    relax.analysis.post_order_visit(mod["main"], lambda e: calls.append(e) if isinstance(
        e, relax.Call) else None)
    first = next(c for c in calls if is_call_to(c, "relax.call_tir"))
    assert first.args[0].name_hint in ("pad_stack_rows", "transpose_pad")
    [image] = first.args[1].fields
    assert str(image.ty.dtype) == "float32" and not any(
        is_call_to(c, "relax.astype") for c in calls[:calls.index(first)])
