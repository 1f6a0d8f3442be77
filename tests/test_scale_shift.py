"""Per-channel scale-shift chains folded into ``x * s + t`` and into the conv before them
(:func:`relay_passes.scale_shift.fold_scale_shift`).

Each rewrite is checked structurally (Before/Expected modules, the constants computed here in
float64 the way the pass promises), each refusal leaves the module as it was, and ONNX
networks of odd sizes with BatchNorm, Caffe's Scale (Mul, Add) and Sub/Div normalisations run
through the ``tpp`` pipeline and TVM's own lowering against ONNX Runtime.
"""

import numpy as np
import onnx
import pytest
import tvm
from conftest import bn_stats, relax_main
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import tvm_tpp
from relay_passes.scale_shift import fold_scale_shift
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime

LLVM = {"kind": "llvm", "mcpu": "haswell"}
X_SHAPE, W_SHAPE = (1, 3, 5, 7), (4, 3, 3, 3)
Y_SHAPE = (1, 4, 5, 7)


def _bn_affine(stats: list[np.ndarray], scale: bool = True, center: bool = True
               ) -> tuple[np.ndarray, np.ndarray]:
    """BatchNorm as ``x * s + t`` per channel, in float64."""
    gamma, beta, mean, var = (a.astype(np.float64) for a in stats)
    s = (gamma if scale else 1.0) / np.sqrt(var + 1e-5)
    return s, (beta if center else 0.0) - mean * s


def _x(shape=X_SHAPE, dtype="float32") -> relax.Var:
    return relax.Var("x", relax.TensorType(shape, dtype))


def _channels(v: np.ndarray) -> relax.Expr:
    return relax.const(v.astype("float32").reshape(1, -1, 1, 1))


def _batchnorm(bb, y, stats, training=False, **attrs):
    norm = bb.emit(relax.op.nn.batch_norm(y, *map(relax.const, stats), axis=1, epsilon=1e-5,
                                          training=training, **attrs))
    return relax.TupleGetItem(norm, 0)


def _conv_bn(w: relax.Expr, stats: list[np.ndarray], own_bias: np.ndarray | None = None,
             **bn_attrs) -> tvm.IRModule:
    def body(bb, x, *_):
        y = bb.emit(relax.op.nn.conv2d(x, w, padding=1))
        if own_bias is not None:
            y = bb.emit(relax.op.add(y, relax.const(own_bias)))
        return _batchnorm(bb, y, stats, **bn_attrs)

    params = [_x()] + ([w] if isinstance(w, relax.Var) else [])
    return relax_main(params, body)


def _conv_plus(w: np.ndarray, scale: np.ndarray | None, shift: np.ndarray) -> tvm.IRModule:
    """Expected: ``conv2d(x, W * scale) + shift``."""
    weight = w if scale is None else (w * scale.reshape(-1, 1, 1, 1)).astype("float32")
    return relax_main([_x()], lambda bb, x: relax.op.add(
        bb.emit(relax.op.nn.conv2d(x, relax.const(weight), padding=1)),
        relax.const(shift.astype("float32"))))


@pytest.mark.parametrize("center, scale", [(True, True), (False, True), (True, False)])
def test_batchnorm_folds_into_conv_weight_and_bias(center, scale):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(W_SHAPE).astype("float32")
    stats = bn_stats(rng, W_SHAPE[0])
    before = _conv_bn(relax.const(w), stats, center=center, scale=scale)
    s, t = _bn_affine(stats, scale, center)
    tvm.ir.assert_structural_equal(fold_scale_shift(before),
                                   _conv_plus(w, s, t.reshape(1, -1, 1, 1)))


@pytest.mark.parametrize("bias_shape", [(1, 4, 1, 1), (4, 1, 1), Y_SHAPE])
def test_conv_bias_batchnorm_and_scale_layer_fold_into_the_conv(bias_shape):
    """``Conv(x, W, B)``, BatchNorm, then Caffe's Scale (Mul, Add), as DenseNet-121's stem
    writes it; an added constant that varies over the image stays an addend of the conv."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal(W_SHAPE).astype("float32")
    c = rng.standard_normal(bias_shape).astype("float32")
    stats = bn_stats(rng, W_SHAPE[0])
    mul, add = (rng.uniform(0.5, 1.5, 4).astype("float32") for _ in range(2))

    def body(bb, x):
        y = bb.emit(relax.op.nn.conv2d(x, relax.const(w), padding=1))
        y = bb.emit(_batchnorm(bb, bb.emit(relax.op.add(y, relax.const(c))), stats))
        return relax.op.add(bb.emit(relax.op.multiply(y, _channels(mul))), _channels(add))

    s, t = _bn_affine(stats)
    s4, t4, m4, a4 = (v.reshape(1, -1, 1, 1) for v in (s, t, mul.astype(np.float64),
                                                      add.astype(np.float64)))
    shift = (c.astype(np.float64) * s4 + t4) * m4 + a4
    tvm.ir.assert_structural_equal(fold_scale_shift(relax_main([_x()], body)),
                                   _conv_plus(w, s * mul, shift))


def test_a_preactivation_chain_becomes_one_multiply_and_add():
    """DenseNet's BatchNorm (as Sub, Div, Mul, Add), Scale layer and ReLU on a concat."""
    rng = np.random.default_rng(5)
    consts = [rng.uniform(0.5, 1.5, 3).astype("float32") for _ in range(6)]
    ops = [relax.op.subtract, relax.op.divide, relax.op.multiply, relax.op.add,
           relax.op.multiply, relax.op.add]

    def body(bb, x):
        y = bb.emit(relax.op.concat([x, x], axis=2))
        for op, c in zip(ops, consts, strict=True):
            y = bb.emit(op(y, _channels(c)))
        return relax.op.nn.relu(y)

    m, d, g, b, m2, b2 = (c.astype(np.float64).reshape(1, -1, 1, 1) for c in consts)
    scale = 1 / d * g * m2
    shift = ((-m * (1 / d)) * g + b) * m2 + b2

    def expected(bb, x):
        y = bb.emit(relax.op.concat([x, x], axis=2))
        y = bb.emit(relax.op.multiply(y, relax.const(scale.astype("float32"))))
        return relax.op.nn.relu(bb.emit(relax.op.add(y, relax.const(shift.astype("float32")))))

    tvm.ir.assert_structural_equal(fold_scale_shift(relax_main([_x()], body)),
                                   relax_main([_x()], expected))


def test_constant_first_steps_and_a_scalar():
    """``c - x`` is ``x * -1 + c``, ``c * x`` and ``c + x`` as their mirror; a scalar is a
    channel vector of one value."""
    c = np.array([1.0, 2.0, 3.0], "float32")

    def body(bb, x):
        y = bb.emit(relax.op.subtract(_channels(c), x))
        y = bb.emit(relax.op.multiply(relax.const(np.float32(2.0)), y))
        return relax.op.add(relax.const(np.float32(0.5)), y)

    def expected(bb, x):
        y = bb.emit(relax.op.multiply(x, relax.const(np.float32(-2.0))))
        return relax.op.add(y, _channels(c * 2 + 0.5))

    tvm.ir.assert_structural_equal(fold_scale_shift(relax_main([_x()], body)),
                                   relax_main([_x()], expected))


def test_batchnorm_after_a_conv_with_varying_weights_becomes_a_scale_shift():
    rng = np.random.default_rng(1)
    stats = bn_stats(rng, W_SHAPE[0])
    w = relax.Var("w", relax.TensorType(W_SHAPE, "float32"))
    s, t = _bn_affine(stats)

    def expected(bb, x, w):
        y = bb.emit(relax.op.nn.conv2d(x, w, padding=1))
        return relax.op.add(bb.emit(relax.op.multiply(y, _channels(s))), _channels(t))

    tvm.ir.assert_structural_equal(
        fold_scale_shift(_conv_bn(w, stats)),
        relax_main([_x(), relax.Var("w", relax.TensorType(W_SHAPE, "float32"))], expected))


def _two_steps(first, second, shape=X_SHAPE, dtype="float32"):
    """``main(x) = second(first(x))``, each a function of one expression."""
    def body(bb, x):
        y = bb.emit(first(x))
        return second(y)

    return relax_main([_x(shape, dtype)], body)


_C3 = np.array([1.0, 0.0, 2.0], "float32").reshape(1, 3, 1, 1)


@pytest.mark.parametrize("case", [
    "one add", "one multiply", "divisor with a zero", "c divided by x", "enlarging constant",
    "float16", "varying tensor operand", "spatial scale of a conv", "training batch norm"])
def test_what_is_no_chain_stays(case):
    rng = np.random.default_rng(7)
    full = relax.const(rng.standard_normal((2, 3, 5, 7)).astype("float32"))
    k = relax.const(np.float32(3.0))
    before = {
        "one add": lambda: _two_steps(lambda x: relax.op.add(x, k), relax.op.nn.relu),
        "one multiply": lambda: _two_steps(lambda x: relax.op.multiply(x, k), relax.op.nn.relu),
        "divisor with a zero": lambda: _two_steps(
            lambda x: relax.op.add(x, k), lambda y: relax.op.divide(y, relax.const(_C3))),
        "c divided by x": lambda: _two_steps(
            lambda x: relax.op.add(x, k), lambda y: relax.op.divide(k, y)),
        "enlarging constant": lambda: _two_steps(
            lambda x: relax.op.add(x, k), lambda y: relax.op.multiply(y, full)),
        "float16": lambda: _two_steps(
            lambda x: relax.op.add(x, relax.const(np.float16(3.0))),
            lambda y: relax.op.multiply(y, relax.const(np.float16(2.0))), dtype="float16"),
        "varying tensor operand": lambda: relax_main([_x(), relax.Var("v", relax.TensorType(
            X_SHAPE, "float32"))], lambda bb, x, v: relax.op.multiply(
                bb.emit(relax.op.add(x, k)), v)),
        "spatial scale of a conv": lambda: relax_main([_x()], lambda bb, x: relax.op.multiply(
            bb.emit(relax.op.nn.conv2d(x, relax.const(rng.standard_normal(W_SHAPE).astype(
                "float32")), padding=1)), relax.const(rng.uniform(0.5, 2, (1, 1, 5, 7)).astype(
                    "float32")))),
        "training batch norm": lambda: relax_main([_x()], lambda bb, x: _batchnorm(
            bb, x, bn_stats(rng, 3), training=True)),
    }[case]()
    tvm.ir.assert_structural_equal(fold_scale_shift(before), before)


def test_an_output_inside_a_chain_ends_it():
    """``y = x + a`` is also an output: ``y * b + c`` folds alone, ``y`` stays."""
    a, b, c = (relax.const(np.float32(v)) for v in (1.0, 2.0, 3.0))
    x = _x()
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.add(x, a))
            z = bb.emit_output(relax.op.add(bb.emit(relax.op.multiply(y, b)), c))
        bb.emit_func_output(relax.Tuple([y, z]))
    before = bb.get()
    tvm.ir.assert_structural_equal(fold_scale_shift(before), before)


def test_an_intermediate_read_twice_ends_the_chain():
    """``y = x + a`` is read by ``y * b`` and by ``y * 2``: neither continues its chain."""
    a, b, c = (relax.const(np.float32(v)) for v in (1.0, 2.0, 3.0))

    def body(bb, x):
        y = bb.emit(relax.op.add(x, a))
        z = bb.emit(relax.op.add(bb.emit(relax.op.multiply(y, b)), c))
        return relax.Tuple([z, bb.emit(relax.op.multiply(y, relax.const(np.float32(2.0))))])

    before = relax_main([_x()], body)
    tvm.ir.assert_structural_equal(fold_scale_shift(before), before)


def _densenet_like(c: int = 5) -> onnx.ModelProto:
    """Conv(B) BN Mul Add Relu, Concat with the input, BN Mul Add Relu, 1x1 Conv, Sub, Div:
    DenseNet-121's stem and pre-activation spellings at odd sizes."""
    rng = np.random.default_rng(3)
    w = {"w1": rng.standard_normal((c, c, 3, 3)).astype("float32") / 6,
         "b1": rng.standard_normal(c).astype("float32"),
         "w2": rng.standard_normal((c, 2 * c, 1, 1)).astype("float32") / 4}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["y"], kernel_shape=[3, 3],
                              pads=[1] * 4)]
    prev = "y"
    for i, width in ((1, c), (2, 2 * c)):
        w.update((f"{k}{i}", v) for k, v in zip("gbmv", bn_stats(rng, width), strict=True))
        w[f"mul{i}"] = rng.uniform(0.5, 1.5, (width, 1, 1)).astype("float32")
        w[f"add{i}"] = rng.normal(0, 0.2, (width, 1, 1)).astype("float32")
        nodes += [helper.make_node("BatchNormalization", [prev] + [f"{k}{i}" for k in "gbmv"],
                                   [f"n{i}"]),
                  helper.make_node("Mul", [f"n{i}", f"mul{i}"], [f"s{i}"]),
                  helper.make_node("Add", [f"s{i}", f"add{i}"], [f"a{i}"]),
                  helper.make_node("Relu", [f"a{i}"], [f"r{i}"])]
        if i == 1:
            nodes.append(helper.make_node("Concat", ["r1", "x"], ["cat"], axis=1))
            prev = "cat"
    w["mean"] = rng.normal(0, 0.1, (c, 1, 1)).astype("float32")
    w["std"] = rng.uniform(0.5, 2.0, (c, 1, 1)).astype("float32")
    nodes += [helper.make_node("Conv", ["r2", "w2"], ["z"], kernel_shape=[1, 1]),
              helper.make_node("Sub", ["z", "mean"], ["zc"]),
              helper.make_node("Div", ["zc", "std"], ["out"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 7, 9])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, c, 7, 9])],
        [numpy_helper.from_array(v, k) for k, v in w.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("target", ["tpp", LLVM], ids=["tpp", "llvm"])
def test_folded_network_matches_onnxruntime(target):
    model = _densenet_like()
    compiled = tvm_tpp.compile(model, target=target)
    inputs = random_inputs(compiled.inputs, seed=4)
    _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
    assert rel <= 1e-5


def test_densenet_like_network_keeps_no_batchnorm_and_two_scale_shifts():
    """After ``prepare``: the stem's and the last conv's chains are in their convs; the
    pre-activation's BN-Mul-Add is one multiply and one add."""
    from relay_passes.prepare import prepare
    from tvm_tpp.compiler import import_model

    mod, _ = import_model(_densenet_like())
    ops = []
    relax.analysis.post_order_visit(prepare()(mod)["main"], lambda e: ops.append(
        e.op.name) if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) else None)
    assert sorted(ops) == sorted(["relax.nn.conv2d", "relax.add", "relax.nn.relu",
                                  "relax.concat", "relax.multiply", "relax.add",
                                  "relax.nn.relu", "relax.nn.conv2d", "relax.add"])
