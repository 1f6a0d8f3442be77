"""The activations the dense and conv passes absorb into their kernels' epilogues: GELU (erf,
tanh, and both spelled out in elementwise ops as ONNX exports them), sigmoid, SiLU (``x *
sigmoid(x)``) and clamp (ONNX Clip: a maximum and a minimum of scalar constants).

Each chain is checked structurally (the rewritten module is the Expected one: a single call_tir
of the kernel scheduled for the whole chain, on packed constant weights) and numerically (built
with the tpp pipeline and run on random data of odd sizes, against numpy).
"""

import math

import numpy as np
import pytest
import tvm
from numpy.lib.stride_tricks import sliding_window_view
from tvm import relax

from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.machine import machine_of
from relay_passes.conv import rewrite_conv
from relay_passes.dense import rewrite_dense
from relay_passes.layouts import TO_NCHW, TO_NHWC
from relay_passes.pipeline import tpp_pipeline
from relay_passes.scaffold import add_kernel
from schedules import conv, gemm
from schedules.tuner import config_for
from tvm_tpp.tpp_target import target as tpp_target

TARGET = tpp_target("tpp")  # the host's ISA: the numeric checks run the kernels
RNG = np.random.default_rng(0)
erf = np.vectorize(math.erf, otypes=[np.float64])  # numpy has none; no scipy in the test deps


def _spelled_out_gelu(bb: relax.BlockBuilder, h: relax.Expr) -> relax.Expr:
    """``h * (1 + erf(h / sqrt 2)) * 0.5``, as the ONNX importer leaves an exported GELU."""
    scaled = bb.emit(relax.op.divide(h, relax.const(np.float32(math.sqrt(2.0)))))
    one_plus = bb.emit(relax.op.add(bb.emit(relax.op.erf(scaled)), relax.const(np.float32(1))))
    return relax.op.multiply(bb.emit(relax.op.multiply(h, one_plus)),
                             relax.const(np.float32(0.5)))


def _spelled_out_gelu_tanh(bb: relax.BlockBuilder, h: relax.Expr, coef: float = 0.044715,
                           ) -> relax.Expr:
    """``h * 0.5 * (1 + tanh(sqrt(2/pi) * (h + coef * h**3)))`` as the ONNX importer leaves
    GPT-2's GELU, some operands in the other order (exporters differ there)."""
    def c(v):
        return relax.const(np.float32(v))

    cubic = bb.emit(relax.op.multiply(c(coef), bb.emit(relax.op.power(h, c(3)))))
    z = bb.emit(relax.op.multiply(bb.emit(relax.op.add(h, cubic)), c(math.sqrt(2 / math.pi))))
    one_plus = bb.emit(relax.op.add(c(1), bb.emit(relax.op.tanh(z))))
    return relax.op.multiply(bb.emit(relax.op.multiply(h, c(0.5))), one_plus)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


# name -> (emit the activation of h, the epilogue op the kernel applies, numpy's function)
ACTIVATIONS = {
    "gelu": (lambda bb, h: relax.op.nn.gelu(h), EpilogueOp("gelu", variant="erf"),
             lambda x: 0.5 * x * (1 + erf(x / math.sqrt(2)))),
    "gelu_tanh": (lambda bb, h: relax.op.nn.gelu_tanh(h), EpilogueOp("gelu", variant="tanh"),
                  _gelu_tanh),
    "gelu_spelled_out": (_spelled_out_gelu, EpilogueOp("gelu", variant="erf"),
                         lambda x: 0.5 * x * (1 + erf(x / math.sqrt(2)))),
    "gelu_tanh_spelled_out": (_spelled_out_gelu_tanh, EpilogueOp("gelu", variant="tanh"),
                              _gelu_tanh),
    "sigmoid": (lambda bb, h: relax.op.sigmoid(h), EpilogueOp("sigmoid"),
                lambda x: 1 / (1 + np.exp(-x))),
    "silu": (lambda bb, h: relax.op.multiply(h, bb.emit(relax.op.sigmoid(h))), EpilogueOp("silu"),
             lambda x: x / (1 + np.exp(-x))),
    # ONNX Clip (ReLU6) as prepare.te_extrema_to_ops leaves it.
    "clamp": (lambda bb, h: relax.op.minimum(
        bb.emit(relax.op.maximum(h, relax.const(np.float32(-0.5)))), relax.const(np.float32(0.75))),
              EpilogueOp("clamp", lo=-0.5, hi=0.75), lambda x: np.clip(x, -0.5, 0.75)),
}


def _module(x_shape, body) -> tvm.IRModule:
    """``main(x)`` whose dataflow block ``body(bb, x)`` computes the output."""
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(body(bb, x))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod: tvm.IRModule, x: np.ndarray) -> tuple[np.ndarray, list]:
    """``mod`` built with the tpp pipeline and run on ``x``; the output and the report."""
    report = []
    executable = tvm.compile(mod, target=TARGET, relax_pipeline=tpp_pipeline(TARGET, report))
    vm = relax.VirtualMachine(executable, tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy(), report


# --- dense: act(x @ W + b) -------------------------------------------------------------------

M, K, N = 7, 13, 9  # odd: every tile of the kernel has a remainder


def _dense_before(activation: str, w: np.ndarray, b: np.ndarray) -> tvm.IRModule:
    emit = ACTIVATIONS[activation][0]

    def body(bb, x):
        mm = bb.emit(relax.op.matmul(x, relax.const(w)))
        return emit(bb, bb.emit(relax.op.add(mm, relax.const(b))))

    return _module((M, K), body)


def _dense_expected(activation: str, w: np.ndarray, b: np.ndarray) -> tvm.IRModule:
    problem = gemm.GemmProblem(M, N, K, epilogue=Epilogue((EpilogueOp("bias"),
                                                           ACTIVATIONS[activation][1])))
    config = config_for(problem, TARGET)
    func = gemm.schedule(problem, config, machine_of(TARGET).isa).mod["main"]
    bb = relax.BlockBuilder()
    kernel = add_kernel(bb, func, f"tpp_dense_{M}x{N}x{K}_{problem.epilogue.name}")
    x = relax.Var("x", relax.TensorType((M, K), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            args = [x, relax.const(gemm.pack_weight(w, config.bn)), relax.const(b)]
            out = bb.emit_output(relax.call_tir(kernel, args,
                                                relax.TensorType((M, N), "float32")))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_dense_activation_is_one_kernel(activation):
    w = RNG.standard_normal((K, N)).astype("float32")
    b = RNG.standard_normal(N).astype("float32")
    report = []
    after = rewrite_dense(_dense_before(activation, w, b), TARGET, report)
    tvm.ir.assert_structural_equal(after, _dense_expected(activation, w, b))
    tag = ACTIVATIONS[activation][1].tag
    assert [r.op for r in report] == [f"matmul+bias+{tag}"]


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_dense_activation_matches_numpy(activation):
    w = RNG.standard_normal((K, N)).astype("float32")
    b = RNG.standard_normal(N).astype("float32")
    x = RNG.standard_normal((M, K)).astype("float32")
    got, report = _run(_dense_before(activation, w, b), x)
    assert all(r.kernel for r in report), report
    want = ACTIVATIONS[activation][2](x.astype(np.float64) @ w + b)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_dense_erf_chain_with_another_divisor_is_not_gelu():
    """``h * (1 + erf(h / 3)) * 0.5`` is not GELU: only the bias joins the kernel."""
    w = RNG.standard_normal((K, N)).astype("float32")

    def body(bb, x):
        h = bb.emit(relax.op.matmul(x, relax.const(w)))
        scaled = bb.emit(relax.op.divide(h, relax.const(np.float32(3.0))))
        one_plus = bb.emit(relax.op.add(bb.emit(relax.op.erf(scaled)),
                                        relax.const(np.float32(1))))
        return relax.op.multiply(bb.emit(relax.op.multiply(h, one_plus)),
                                 relax.const(np.float32(0.5)))

    report = []
    rewrite_dense(_module((M, K), body), TARGET, report)
    assert [r.op for r in report] == ["matmul"]


def test_dense_tanh_chain_with_another_coefficient_is_not_gelu():
    """GPT-2's GELU spelled out with 0.05 for 0.044715 is not GELU: only the bias joins."""
    w = RNG.standard_normal((K, N)).astype("float32")
    b = RNG.standard_normal(N).astype("float32")

    def body(bb, x):
        h = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, relax.const(w))), relax.const(b)))
        return _spelled_out_gelu_tanh(bb, h, coef=0.05)

    report = []
    after = rewrite_dense(_module((M, K), body), TARGET, report)
    assert [r.op for r in report] == ["matmul+bias"]
    ops = []
    relax.analysis.post_order_visit(after["main"], lambda e: ops.append(e.op.name)
                                    if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op)
                                    else None)
    assert "relax.tanh" in ops and "relax.power" in ops


def test_dense_residual_computed_from_its_own_result_is_not_a_residual():
    """``h + exp(h)``, h = x @ W + b: exp(h) is no residual of h's kernel (h would be computed
    twice, once for exp); the kernel stops at the bias and the add stays."""
    w = RNG.standard_normal((K, N)).astype("float32")
    b = RNG.standard_normal(N).astype("float32")

    def body(bb, x):
        h = bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, relax.const(w))), relax.const(b)))
        return relax.op.add(h, bb.emit(relax.op.exp(h)))

    report = []
    after = rewrite_dense(_module((M, K), body), TARGET, report)
    problem = gemm.GemmProblem(M, N, K, epilogue=Epilogue((EpilogueOp("bias"),)))
    config = config_for(problem, TARGET)
    bb = relax.BlockBuilder()
    kernel = add_kernel(bb, gemm.schedule(problem, config, machine_of(TARGET).isa).mod["main"],
                        f"tpp_dense_{M}x{N}x{K}_bias")
    x = relax.Var("x", relax.TensorType((M, K), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            args = [x, relax.const(gemm.pack_weight(w, config.bn)), relax.const(b)]
            h = bb.emit(relax.call_tir(kernel, args, relax.TensorType((M, N), "float32")))
            out = bb.emit_output(relax.op.add(h, bb.emit(relax.op.exp(h))))
        bb.emit_func_output(out)
    tvm.ir.assert_structural_equal(after, bb.get())
    assert [r.op for r in report] == ["matmul+bias"]


# --- conv: act(conv2d(x, W) + b) -------------------------------------------------------------

X_SHAPE, W_SHAPE = (1, 16, 7, 9), (8, 16, 3, 3)  # odd H and W


def _conv_before(activation: str, w: np.ndarray, b: np.ndarray) -> tvm.IRModule:
    emit = ACTIVATIONS[activation][0]

    def body(bb, x):
        y = bb.emit(relax.op.nn.conv2d(x, relax.const(w), padding=1))
        return emit(bb, bb.emit(relax.op.add(y, relax.const(b.reshape(1, -1, 1, 1)))))

    return _module(X_SHAPE, body)


def _conv_expected(activation: str, w: np.ndarray, b: np.ndarray) -> tvm.IRModule:
    n, c, h, wd = X_SHAPE
    k, _, r, s = W_SHAPE
    problem = conv.ConvProblem(n=n, c=c, h=h, w=wd, k=k, r=r, s=s, stride=(1, 1),
                               padding=(1, 1, 1, 1),
                               epilogue=Epilogue((EpilogueOp("bias"), ACTIVATIONS[activation][1])))
    config = config_for(problem, TARGET)
    func = conv.schedule(problem, config, machine_of(TARGET).isa).mod["main"]
    bb = relax.BlockBuilder()
    name = f"tpp_conv2d_{n}x{c}x{h}x{wd}_{k}x{r}x{s}_s1x1_{problem.epilogue.name}"
    kernel = add_kernel(bb, func, name)
    x = relax.Var("x", relax.TensorType(X_SHAPE, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            nhwc = bb.emit(relax.op.permute_dims(x, TO_NHWC))
            # The kernel reads whole row blocks: the right padding reaches its padded width.
            right = 1 + problem.wq - (wd + 2)
            padded = bb.emit(relax.op.nn.pad(nhwc, [0, 0, 1, 1, 1, right, 0, 0]))
            args = [padded, relax.const(conv.pack_weight(w, config.bk)), relax.const(b)]
            y = bb.emit(relax.call_tir(kernel, args,
                                       relax.TensorType((problem.rows, k), "float32")))
            y = bb.emit(relax.op.reshape(y, (n, problem.p, problem.q, k)))
            out = bb.emit_output(relax.op.permute_dims(y, TO_NCHW))
        bb.emit_func_output(out)
    return bb.get()


def _conv_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """numpy's 3x3 convolution, padding 1, stride 1 (float64)."""
    padded = np.pad(x.astype(np.float64), [(0, 0), (0, 0), (1, 1), (1, 1)])
    windows = sliding_window_view(padded, w.shape[2:], axis=(2, 3))
    return np.einsum("ncpqrs,kcrs->nkpq", windows, w)


# The conv pass takes relax's activation ops only, not a spelled-out GELU.
CONV_ACTIVATIONS = ["gelu", "gelu_tanh", "sigmoid"]


@pytest.mark.parametrize("activation", CONV_ACTIVATIONS)
def test_conv_activation_is_one_kernel(activation):
    w = (RNG.standard_normal(W_SHAPE) / 12).astype("float32")
    b = RNG.standard_normal(W_SHAPE[0]).astype("float32")
    report = []
    after = rewrite_conv(_conv_before(activation, w, b), TARGET, report)
    tvm.ir.assert_structural_equal(after, _conv_expected(activation, w, b))
    assert [r.op for r in report] == [f"conv2d+bias+{ACTIVATIONS[activation][1].tag}"]


@pytest.mark.parametrize("activation", CONV_ACTIVATIONS)
def test_conv_activation_matches_numpy(activation):
    w = (RNG.standard_normal(W_SHAPE) / 12).astype("float32")
    b = RNG.standard_normal(W_SHAPE[0]).astype("float32")
    x = RNG.standard_normal(X_SHAPE).astype("float32")
    got, report = _run(_conv_before(activation, w, b), x)
    assert all(r.kernel for r in report), report
    want = ACTIVATIONS[activation][2](_conv_reference(x, w) + b.reshape(1, -1, 1, 1))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
