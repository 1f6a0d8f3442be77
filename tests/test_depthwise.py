"""Depthwise convolution: the template vs numpy (float32, bf16, u8 x s8), the float32 graph
pass vs ONNX Runtime, QDQ depthwise convs on the int8 kernel, and mobilenet_v2."""

import numpy as np
import pytest
import tvm
from conftest import isa_target

from microkernels import isa
from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.epilogue import reference as epilogue_reference
from microkernels.machine import Machine
from schedules.depthwise import (
    DepthwiseConfig,
    DepthwiseProblem,
    candidates,
    default_config,
    pack_input,
    pack_weight,
    reference,
    schedule,
)

BIAS_RELU = Epilogue((EpilogueOp("bias"), EpilogueOp("relu")))
BIAS_RELU6 = Epilogue((EpilogueOp("bias"), EpilogueOp("clamp", lo=0.0, hi=6.0)))
REQUANT = Epilogue((EpilogueOp("bias"), EpilogueOp("relu"),
                    EpilogueOp("requantize", broadcast="row", zero_point=3, dtype="uint8")))
DEQUANT = Epilogue((EpilogueOp("scale", broadcast="row"), EpilogueOp("bias"),
                    EpilogueOp("clamp", lo=0.0, hi=6.0)))


def _machine(isa_name="avx512"):
    return Machine(isa.from_name(isa_name), isa.DEFAULT_CACHES, threads=2)


def _operands(problem, rng):
    out = {}
    for op in problem.epilogue.inputs(problem.epilogue_dtype):
        shape = op.shape(problem.rows, problem.c)
        if op.dtype == "int32":
            out[op.name] = rng.integers(-500, 500, shape).astype("int32")
        elif "scale" in op.name:
            out[op.name] = rng.uniform(0.001, 0.01, shape).astype("float32")
        else:
            out[op.name] = rng.standard_normal(shape).astype("float32")
    return out


def _run(problem, config=None, isa_name="avx2", pad_value=0, seed=0):
    rng = np.random.default_rng(seed)
    shape_x = (problem.n, problem.c, problem.h, problem.w)
    shape_w = (problem.c, 1, problem.r, problem.s)
    if problem.dtype == "uint8":
        x = rng.integers(0, 256, shape_x).astype("uint8")
        w = rng.integers(-128, 128, shape_w).astype("int8")
    else:
        x = rng.standard_normal(shape_x).astype("float32")
        w = rng.standard_normal(shape_w).astype("float32")
        if problem.dtype == "bfloat16":  # the reference multiplies the rounded values
            import ml_dtypes
            x = x.astype(ml_dtypes.bfloat16).astype("float32")
            w = w.astype(ml_dtypes.bfloat16).astype("float32")
    extra = _operands(problem, rng)
    config = config or default_config(problem, _machine(isa_name))
    packed_x = pack_input(x, problem, pad_value)
    assert packed_x.shape == problem.input_shape
    func = tvm.compile(schedule(problem, config, isa_name).mod, target=isa_target(isa_name))
    y = tvm.runtime.empty((problem.rows, problem.c), problem.out_dtype)
    func(tvm.runtime.tensor(packed_x), tvm.runtime.tensor(pack_weight(w, problem)),
         *[tvm.runtime.tensor(v) for v in extra.values()], y)
    acc = reference(problem, x, w, pad_value).transpose(0, 2, 3, 1).reshape(problem.rows,
                                                                            problem.c)
    if problem.dtype == "uint8":
        acc = acc.astype(problem.epilogue_dtype)  # the dequantizing chains start in float32
        want = epilogue_reference(problem.epilogue, acc, extra) if problem.epilogue.ops else acc
        if problem.out_dtype == "float32":
            np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)
        else:  # exact
            np.testing.assert_array_equal(y.numpy(), want)
    else:
        want = acc.astype("float32")
        if problem.epilogue.ops:
            want = epilogue_reference(problem.epilogue, want, extra)
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)
    assert np.abs(y.numpy().astype("float64")).max() > 0


SHAPES = [(1, 5, 7, 7, 1), (1, 24, 9, 9, 2), (2, 40, 7, 9, 1), (1, 40, 9, 7, 2),
          (1, 24, 7, 9, 2)]


@pytest.mark.parametrize("n,c,h,w,stride", SHAPES)
@pytest.mark.parametrize("epilogue", [Epilogue(), BIAS_RELU, BIAS_RELU6],
                         ids=["none", "bias_relu", "bias_relu6"])
def test_float32_matches_numpy(n, c, h, w, stride, epilogue):
    _run(DepthwiseProblem(n, c, h, w, 3, 3, stride=stride, padding=1, epilogue=epilogue))


@pytest.mark.parametrize("n,c,h,w,stride", SHAPES[:3])
def test_float32_on_avx512_and_odd_padding(n, c, h, w, stride):
    _run(DepthwiseProblem(n, c, h, w, 3, 3, stride=stride, padding=1, epilogue=BIAS_RELU6),
         isa_name="avx512")
    _run(DepthwiseProblem(n, c, h, w, 3, 5, stride=(stride, 1), padding=(1, 2, 0, 2),
                          epilogue=BIAS_RELU))


@pytest.mark.parametrize("n,c,h,w,stride", SHAPES[:4])
@pytest.mark.parametrize("epilogue", [Epilogue(), BIAS_RELU6], ids=["none", "bias_relu6"])
def test_bfloat16_matches_numpy(n, c, h, w, stride, epilogue):
    _run(DepthwiseProblem(n, c, h, w, 3, 3, stride=stride, padding=1, dtype="bfloat16",
                          epilogue=epilogue))


@pytest.mark.parametrize("n,c,h,w,stride", SHAPES)
@pytest.mark.parametrize("epilogue", [Epilogue(), REQUANT, DEQUANT],
                         ids=["int32", "requantize", "dequantize"])
def test_uint8_matches_exact_reference(n, c, h, w, stride, epilogue):
    _run(DepthwiseProblem(n, c, h, w, 3, 3, stride=stride, padding=1, dtype="uint8",
                          epilogue=epilogue), pad_value=117)


def test_every_candidate_runs():
    p = DepthwiseProblem(1, 24, 9, 9, 3, 3, stride=2, padding=1, epilogue=BIAS_RELU6)
    found = candidates(p, _machine("avx2"))
    assert found[0] == default_config(p, _machine("avx2")) and len(found) >= 3
    for config in found:
        _run(p, config)


def test_problem_and_config_are_checked():
    with pytest.raises(ValueError, match="does not divide"):
        _run(DepthwiseProblem(1, 24, 7, 7, 3, 3, padding=1), DepthwiseConfig(bq=4, bc=8))
    with pytest.raises(ValueError, match="writes"):
        DepthwiseProblem(1, 8, 7, 7, 3, 3, epilogue=REQUANT)  # a float conv writes float32
    with pytest.raises(ValueError, match="handles"):
        DepthwiseProblem(1, 8, 7, 7, 3, 3, dtype="int8")
