"""1x1 convs that compute the BatchNorm and ReLU before them per pixel tile: the conv
template's prologue (schedules.conv) and the rewrite that routes DenseNet's pre-activations
to it (relay_passes.conv).

Scheduled kernels of odd sizes against numpy, the problems and loop orders the template
refuses, the database key, the Relax rewrite as Before/Expected and through the VM, the
chains it must leave alone, and a DenseNet-like network against ONNX Runtime.
"""

from dataclasses import replace

import ml_dtypes
import numpy as np
import onnx
import pytest
import tvm
from conftest import bn_stats, isa_target, pixel_rows, relax_main, run_main, runs_here
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from microkernels import isa
from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.epilogue import reference as epilogue_reference
from microkernels.machine import Machine, host
from relay_passes.conv import _prologue_pays, emit_conv, rewrite_conv
from relay_passes.pipeline import tpp_rewrites
from relay_passes.scaffold import add_kernel, is_call_to
from schedules.conv import (
    ConvConfig,
    ConvProblem,
    candidates,
    default_config,
    pack_input,
    pack_weight,
    reference,
    schedule,
)
from schedules.loop_spec import LoopSpecError
from schedules.ops import problem_text
from tvm_tpp import compiler
from tvm_tpp.reference import max_errors, run_onnxruntime
from tvm_tpp.tpp_target import target as tpp_target

F32 = "float32"
SCALE = EpilogueOp("scale", broadcast="row", name="pre_scale")
SHIFT = EpilogueOp("bias", name="pre_bias")
RELU = EpilogueOp("relu")
BN_RELU = Epilogue((SCALE, SHIFT, RELU))
BIAS_RELU = Epilogue((EpilogueOp("bias"), RELU))
_NUMPY = {F32: np.float32, "bfloat16": ml_dtypes.bfloat16}
#: A ``tpp`` target of two threads whatever the host: the rewrite's choices depend on them.
TARGET = tvm.target.Target({"kind": "llvm", "keys": ["tpp", "cpu"], "model": "avx2",
                            "num-cores": 2})


def _prologue_reference(prologue: Epilogue, x: np.ndarray, operands: dict) -> np.ndarray:
    """numpy: the prologue on NCHW ``x``, per channel."""
    rows = pixel_rows(x)
    out = epilogue_reference(prologue, rows, operands)
    n, c, h, w = x.shape
    return out.reshape(n, h, w, c).transpose(0, 3, 1, 2).astype(F32)


@pytest.mark.parametrize("n, c, h, w, k, prologue, epilogue", [
    (1, 24, 5, 7, 16, BN_RELU, BIAS_RELU),
    (2, 21, 3, 6, 48, BN_RELU, BIAS_RELU),       # C not whole vectors: a scalar prologue
    (1, 40, 4, 4, 24, Epilogue((SHIFT, RELU)), Epilogue()),
    (1, 16, 7, 3, 32, Epilogue((EpilogueOp("scale", value=0.5), RELU)), BIAS_RELU),
], ids=["bn-relu", "two-images-odd-c", "shift-no-epilogue", "constant-scale"])
def test_prologue_kernel_matches_numpy(n, c, h, w, k, prologue, epilogue):
    problem = ConvProblem(n, c, h, w, k, 1, 1, epilogue=epilogue, prologue=prologue)
    config = default_config(problem, host())
    func = schedule(problem, config, host().isa.name).mod["main"]
    rng = np.random.default_rng(11)
    x = rng.standard_normal((n, c, h, w)).astype(F32)
    weight = rng.standard_normal((k, c, 1, 1)).astype(F32)
    pre = {"pre_scale": rng.uniform(0.5, 1.5, c).astype(F32),
           "pre_bias": rng.standard_normal(c).astype(F32)}
    post = {"bias": rng.standard_normal(k).astype(F32)}
    pre = {o.name: pre[o.name] for o in prologue.inputs()}
    post = {o.name: post[o.name] for o in epilogue.inputs()}
    activated = _prologue_reference(prologue, x, pre)
    conv = pixel_rows(reference(problem, activated, weight))
    want = epilogue_reference(epilogue, conv.astype(F32), post)
    out = tvm.runtime.tensor(np.full((problem.rows, k), np.nan, F32))
    args = [pack_input(x, problem), pack_weight(weight, config.bk, problem), *pre.values(),
            *post.values()]
    tvm.compile(func, target=tpp_target("tpp"))(*[tvm.runtime.tensor(a) for a in args], out)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa_name, c", [
    ("avx512_bf16", 64),  # whole 16-lane vectors: rounded by vcvtneps2bf16
    ("avx512_bf16", 22),  # rounded on the bits
    ("avx2", 40),         # no bf16 arithmetic: the generic bf16 kernel
])
@pytest.mark.parametrize("stored", [F32, "bfloat16"])
def test_bf16_prologue_rounds_the_activated_input(isa_name, c, stored):
    """A bf16 conv reads float32 X, or bf16 X it widens (DenseNet's bf16 block buffers),
    and rounds its prologue's result to bf16 per pixel tile: against numpy on the rounded
    values where the host runs ``isa_name``; the conversion instruction in the assembly
    either way."""
    problem = ConvProblem(2, c, 3, 5, 32, 1, 1, dtype="bfloat16", epilogue=BIAS_RELU,
                          prologue=BN_RELU, prologue_input=stored)
    assert problem.input_dtype == stored
    config = default_config(problem, Machine(isa.from_name(isa_name), isa.DEFAULT_CACHES, 2))
    func = tvm.compile(schedule(problem, config, isa_name).mod,
                       target=isa_target(isa_name, "znver4" if isa_name != "avx2" else None))
    assert ("vcvtneps2bf16" in func.mod.inspect_source("asm")) == (c % 16 == 0
                                                                   and isa_name != "avx2")
    if not runs_here(isa_name):
        pytest.skip(f"host lacks {isa_name}: the assembly is checked above")
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, c, 3, 5)).astype(F32)
    if stored == "bfloat16":  # the values the buffer holds
        x = x.astype(ml_dtypes.bfloat16).astype(F32)
    weight = rng.standard_normal((32, c, 1, 1)).astype(F32)
    pre = {"pre_scale": rng.uniform(0.5, 1.5, c).astype(F32),
           "pre_bias": rng.standard_normal(c).astype(F32)}
    bias = rng.standard_normal(32).astype(F32)
    activated = _prologue_reference(BN_RELU, x, pre).astype(ml_dtypes.bfloat16)
    rounded = weight.astype(ml_dtypes.bfloat16).astype(np.float64)
    conv = np.einsum("nchw,kc->nhwk", activated.astype(np.float64), rounded[:, :, 0, 0])
    want = np.maximum(conv.reshape(-1, 32) + bias, 0)
    out = tvm.runtime.empty((problem.rows, 32), F32)
    args = [np.ascontiguousarray(x.transpose(0, 2, 3, 1)).astype(_NUMPY[stored]),
            pack_weight(weight, config.bk, problem), *pre.values(), bias]
    func(*[tvm.runtime.tensor(a) for a in args], out)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_prologue_computed_once_per_pixel_tile():
    """The prologue stage sits under the pixel loops, above the K blocks: outside the loop
    over K blocks that runs the kernel calls."""
    problem = ConvProblem(1, 32, 4, 8, 48, 1, 1, epilogue=BIAS_RELU, prologue=BN_RELU)
    config = ConvConfig(bq=8, bc=32, bk=16, spec="ADEcbfg")
    sch = schedule(problem, config, "avx2")
    above_prologue = {sch.get(loop).loop_var.name for loop in
                      sch.get_loops(sch.get_sblock("prologue"))}
    above_calls = [sch.get(loop) for loop in sch.get_loops(sch.get_sblock("conv_update_o"))]
    k_blocks = next(loop for loop in above_calls if int(loop.extent) == 3)
    assert k_blocks.loop_var.name not in above_prologue
    assert above_calls[0].loop_var.name in above_prologue  # the parallel pixel loop


def test_single_pixel_tile_with_k_blocks_outermost():
    """One image row in one tile: the spec may put the K blocks first (parse allows it, no
    pixel loop iterates), and the prologue then runs once over the whole input."""
    problem = ConvProblem(1, 16, 1, 6, 32, 1, 1, prologue=Epilogue((SHIFT, RELU)))
    config = ConvConfig(bq=6, bc=16, bk=16, spec="ACbfgde")
    func = schedule(problem, config, host().isa.name).mod["main"]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 16, 1, 6)).astype(F32)
    weight = rng.standard_normal((32, 16, 1, 1)).astype(F32)
    shift = rng.standard_normal(16).astype(F32)
    activated = np.maximum(x + shift[None, :, None, None], 0)
    want = pixel_rows(reference(problem, activated, weight))
    out = tvm.runtime.tensor(np.full((6, 32), np.nan, F32))
    args = [pack_input(x, problem), pack_weight(weight, 16, problem), shift]
    tvm.compile(func, target=tpp_target("tpp"))(*[tvm.runtime.tensor(a) for a in args], out)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("changes, message", [
    ({"r": 3, "s": 3, "padding": 1}, "1x1 conv"),
    ({"stride": 2}, "stride 1"),
    ({"groups": 2}, "groups"),
    ({"dtype": "uint8"}, "float32 or bf16"),
    ({"dtype": "bfloat16", "c": 15}, "padded channels"),  # odd: half a VNNI pair
    ({"prologue": Epilogue((EpilogueOp("gelu", variant="erf"),))}, "per input channel"),
    ({"prologue": Epilogue((EpilogueOp("bias", broadcast="col", name="b"), RELU))},
     "per input channel"),
    ({"prologue": Epilogue((EpilogueOp("bias"), RELU))}, "share names"),
    ({"prologue_input": "bfloat16"}, "bf16 conv's prologue"),
    ({"dtype": "bfloat16", "prologue_input": "uint8"}, "prologue_input must be"),
    ({"prologue": Epilogue(), "prologue_input": "bfloat16"}, "there is none"),
], ids=["3x3", "stride", "groups", "uint8", "bf16-odd-c", "gelu", "per-pixel",
        "name-clash", "bf16-input-float32-conv", "uint8-input", "bf16-input-no-prologue"])
def test_problems_without_a_prologue_form_refused(changes, message):
    fields = {"n": 1, "c": 16, "h": 4, "w": 4, "k": 16, "r": 1, "s": 1,
              "epilogue": BIAS_RELU, "prologue": BN_RELU}
    with pytest.raises(ValueError, match=message):
        ConvProblem(**{**fields, **changes})


def test_block_loops_stay_inside_the_pixel_loops():
    """An order that would repeat the prologue for every K block is refused; the default and
    every candidate keep the K- and channel-block loops inside the pixel loops."""
    problem = ConvProblem(1, 64, 14, 14, 128, 1, 1, epilogue=BIAS_RELU, prologue=BN_RELU)
    plain = replace(problem, prologue=Epilogue())
    config = ConvConfig(bq=14, bc=64, bk=16, spec="ACbfgde")
    config.parse(plain)
    with pytest.raises(LoopSpecError, match="inside its pixel loops"):
        config.parse(problem)
    machine = Machine(isa.from_name("avx2"), isa.DEFAULT_CACHES, threads=2)
    assert default_config(problem, machine).spec == "ADEcbfg"
    found = candidates(problem, machine)
    assert len(found) > 3
    for config in found:
        config.parse(problem)


def test_database_key_names_the_prologue():
    problem = ConvProblem(1, 64, 14, 14, 128, 1, 1, prologue=BN_RELU)
    assert problem_text(problem) == "conv2d 1x64x14x14x128x1x1/s1x1p0x0x0x0+scale_bias_relu -"
    assert problem_text(replace(problem, prologue=Epilogue())).endswith("p0x0x0x0 -")
    widened = replace(problem, dtype="bfloat16", prologue_input="bfloat16")
    assert problem_text(widened).endswith("+bf16_scale_bias_relu -")


@pytest.mark.parametrize("c, h, w, threads, pays", [
    (64, 7, 7, 2, False), (64, 14, 14, 2, True), (64, 7, 7, 1, True), (64, 8, 12, 3, True),
    (64, 7, 9, 2, False), (512, 14, 14, 2, True), (768, 14, 14, 2, False),
])
def test_prologue_where_it_pays(c, h, w, threads, pays):
    """Seven rows of pixel tiles on two threads leave one idle an eighth of the time; a
    filter over half of L2 would be read from L3 again for every tile."""
    problem = ConvProblem(1, c, h, w, 128, 1, 1, prologue=BN_RELU)
    caches = replace(isa.DEFAULT_CACHES, l2=512 * 1024)
    machine = Machine(isa.from_name("avx2"), caches, threads=threads)
    assert _prologue_pays(problem, machine) is pays


# ---------------------------------------------------------------------------------------------
# The Relax rewrite
# ---------------------------------------------------------------------------------------------

C, H, W, K = 24, 8, 12, 32
RNG = np.random.default_rng(5)
WEIGHT = RNG.standard_normal((K, C, 1, 1)).astype(F32) / 4
GAIN = RNG.uniform(0.5, 1.5, (1, C, 1, 1)).astype(F32)
SHIFT_VALUES = RNG.standard_normal((1, C, 1, 1)).astype(F32)


def _x(c: int = C) -> relax.Var:
    return relax.Var("x", relax.TensorType((1, c, H, W), F32))


def _preactivated(bb, x):
    scaled = bb.emit(relax.op.multiply(x, relax.const(GAIN)))
    return bb.emit(relax.op.nn.relu(bb.emit(relax.op.add(scaled, relax.const(SHIFT_VALUES)))))


def _conv(bb, x, weight=WEIGHT, padding=0):
    return bb.emit(relax.op.nn.conv2d(x, relax.const(weight), padding=padding))


def _numpy(x: np.ndarray) -> np.ndarray:
    activated = np.maximum(x * GAIN + SHIFT_VALUES, 0).astype(np.float64)
    return np.einsum("nchw,kc->nkhw", activated, WEIGHT[:, :, 0, 0])


def test_preactivation_becomes_the_kernels_prologue():
    before = relax_main([_x()], lambda bb, x: _conv(bb, _preactivated(bb, x)))
    after = relax.transform.DeadCodeElimination()(rewrite_conv(before, TARGET, []))

    def expected_body(bb, x):
        problem = ConvProblem(1, C, H, W, K, 1, 1, prologue=BN_RELU)
        out, _, _ = emit_conv(x, problem, WEIGHT, [relax.const(GAIN.reshape(C)),
                                                   relax.const(SHIFT_VALUES.reshape(C))],
                              lambda func, name: add_kernel(bb, func, name), TARGET, None)
        return out

    expected = relax_main([_x()], expected_body)
    tvm.ir.assert_structural_equal(after, expected)
    names = [gv.name_hint for gv in after.functions if gv.name_hint != "main"]
    assert names == ["tpp_conv2d_1x24x8x12_32x1x1_s1x1_pre_scale_bias_relu"]
    x = RNG.standard_normal((1, C, H, W)).astype(F32)
    got = run_main(before, x, target=tpp_target("tpp"))
    np.testing.assert_allclose(got, _numpy(x), rtol=1e-4, atol=1e-4)


def _relu_read_twice(bb, x):
    activated = _preactivated(bb, x)
    return bb.emit(relax.op.add(_conv(bb, activated), relax.op.mean(activated)))


def _padded_3x3(bb, x):  # the border would get relu(b), not zero
    weight = RNG.standard_normal((K, C, 3, 3)).astype(F32)
    return _conv(bb, _preactivated(bb, x), weight, padding=1)


def _uneven_tiles(bb, x):  # 7 pixel rows of one tile each on two threads
    sliced = bb.emit(relax.op.strided_slice(x, axes=[2], begin=[0], end=[7]))
    return _conv(bb, _preactivated(bb, bb.emit(relax.op.strided_slice(
        sliced, axes=[3], begin=[0], end=[7]))))


def _no_relu(bb, x):
    scaled = bb.emit(relax.op.multiply(x, relax.const(GAIN)))
    return _conv(bb, bb.emit(relax.op.add(scaled, relax.const(SHIFT_VALUES))))


def _after_a_conv(bb, x):
    """The chain is the 3x3 conv's epilogue; the 1x1 conv's own residual epilogue, longer,
    is matched first (ResNet's bottlenecks)."""
    first = _conv(bb, x, RNG.standard_normal((C, C, 3, 3)).astype(F32), padding=1)
    shifted = bb.emit(relax.op.add(first, relax.const(SHIFT_VALUES)))
    second = _conv(bb, bb.emit(relax.op.nn.relu(shifted)))
    residual = bb.emit(relax.op.concat(
        [x, bb.emit(relax.op.strided_slice(x, axes=[1], begin=[0], end=[K - C]))], axis=1))
    return bb.emit(relax.op.nn.relu(bb.emit(relax.op.add(second, residual))))


@pytest.mark.parametrize("body", [_relu_read_twice, _padded_3x3, _uneven_tiles, _no_relu,
                                  _after_a_conv],
                         ids=["relu-read-twice", "padded-3x3", "uneven-tiles", "no-relu",
                              "after-a-conv"])
def test_chains_left_outside_the_kernel(body):
    """The conv still reads a ReLU (or the affine chain) computed by TVM."""
    mod = rewrite_conv(relax_main([_x()], body), TARGET, [])
    kernels = [gv.name_hint for gv in mod.functions if gv.name_hint != "main"]
    assert kernels and not any("_pre_" in name for name in kernels), kernels


def test_per_tensor_gain_stays_outside():
    """A multiply by one scalar for all channels is no per-channel constant: it stays with
    TVM, the shift and the ReLU go into the kernel, and the result is the same."""
    def body(bb, x):
        scaled = bb.emit(relax.op.multiply(x, relax.const(np.float32(1.5))))
        shifted = bb.emit(relax.op.add(scaled, relax.const(SHIFT_VALUES)))
        return _conv(bb, bb.emit(relax.op.nn.relu(shifted)))

    before = relax_main([_x()], body)
    after = relax.transform.DeadCodeElimination()(rewrite_conv(before, TARGET, []))
    ops = []
    relax.analysis.post_order_visit(after["main"], lambda e: ops.append(e.op.name) if (
        isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op)) else None)
    assert "relax.multiply" in ops and "relax.add" not in ops and "relax.nn.relu" not in ops
    assert any(gv.name_hint.endswith("_pre_bias_relu") for gv in after.functions)
    x = RNG.standard_normal((1, C, H, W)).astype(F32)
    want = np.einsum("nchw,kc->nkhw", np.maximum(x * 1.5 + SHIFT_VALUES, 0), WEIGHT[:, :, 0, 0])
    got = run_main(before, x, target=tpp_target("tpp"))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# A network
# ---------------------------------------------------------------------------------------------


def _dense_block(c: int = 16, growth: int = 8, layers: int = 3) -> onnx.ModelProto:
    """A DenseNet block at odd sizes after a 3x3 stem conv and ReLU (the block then works
    channels-last): each layer BN, ReLU, 1x1 conv, BN, ReLU, 3x3 conv, its channels
    concatenated to everything before; then BN, ReLU and a 1x1 transition conv."""
    rng = np.random.default_rng(9)
    inits = {"stem": rng.standard_normal((c, 8, 3, 3)).astype(F32) / 8}
    nodes = [helper.make_node("Conv", ["x", "stem"], ["s"], kernel_shape=[3, 3], pads=[1] * 4),
             helper.make_node("Relu", ["s"], ["stem_relu"])]
    prev, width = "stem_relu", c

    def bn_relu(name: str, src: str, channels: int) -> str:
        inits.update((f"{name}_{k}", v) for k, v in zip("gbmv", bn_stats(rng, channels),
                                                        strict=True))
        nodes.extend([helper.make_node("BatchNormalization", [src] + [f"{name}_{k}"
                                                                      for k in "gbmv"],
                                       [f"{name}_bn"]),
                      helper.make_node("Relu", [f"{name}_bn"], [f"{name}_relu"])])
        return f"{name}_relu"

    for i in range(layers):
        inits[f"w{i}a"] = rng.standard_normal((4 * growth, width, 1, 1)).astype(F32) / width
        inits[f"w{i}b"] = rng.standard_normal((growth, 4 * growth, 3, 3)).astype(F32) / 12
        a = bn_relu(f"l{i}a", prev, width)
        nodes.append(helper.make_node("Conv", [a, f"w{i}a"], [f"l{i}c1"], kernel_shape=[1, 1]))
        b = bn_relu(f"l{i}b", f"l{i}c1", 4 * growth)
        nodes += [helper.make_node("Conv", [b, f"w{i}b"], [f"l{i}c3"], kernel_shape=[3, 3],
                                   pads=[1] * 4),
                  helper.make_node("Concat", [prev, f"l{i}c3"], [f"cat{i}"], axis=1)]
        prev, width = f"cat{i}", width + growth
    inits["wt"] = rng.standard_normal((width // 2, width, 1, 1)).astype(F32) / width
    nodes.append(helper.make_node("Conv", [bn_relu("t", prev, width), "wt"], ["out"],
                                  kernel_shape=[1, 1]))
    graph = helper.make_graph(
        nodes, "dense_block", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                             [1, 8, 8, 12])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, width // 2, 8, 12])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("precision, tolerance", [("float32", 1e-5), ("bf16", 2e-2)])
def test_dense_block_matches_onnxruntime(precision, tolerance):
    """Every 1x1 conv computes its BN and ReLU; those after the first layer read the block's
    buffer in place (relay_passes.slice_reads), the transition conv all of it.  In bf16
    the buffer is bf16 (relay_passes.bf16_concat_chains): the convs widen what they read and
    round what their prologue computes."""
    model = _dense_block()
    mod, _ = compiler.import_model(model)
    target = tpp_target("tpp")
    with target:
        mod = tpp_rewrites(target, precision=precision)(mod)
    kernels = []
    relax.analysis.post_order_visit(mod["main"], lambda e: kernels.append(
        e.args[0].name_hint) if is_call_to(e, "relax.call_tir") else None)
    reads = "_pre_bf16_scale_bias_relu" if precision == "bf16" else "_pre_scale_bias_relu"
    prologue = [name for name in kernels if reads in name]
    assert len(prologue) == 4, kernels
    assert sum("_from40" in name for name in prologue) == 2, prologue
    feeds = {"x": np.random.default_rng(2).standard_normal((1, 8, 8, 12)).astype(F32)}
    got = compiler.compile(model, "tpp", untuned=True, precision=precision).run(**feeds)
    errors = max_errors(got, run_onnxruntime(model, feeds))
    assert errors[1] < tolerance, errors
