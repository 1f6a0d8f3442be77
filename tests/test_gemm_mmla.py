"""The GEMM template on aarch64 MMLA (``-isa=neon_i8mm``): u8 x s8 through ``usmmla``, bf16
through ``bfmmla``, both operands in MMLA 2-row blocks.

The layout is chosen from the dtype and the ISA (:func:`schedules.gemm.operand_layout`), the
weight packed in MMLA B blocks (:func:`schedules.gemm.pack_weight` with ``isa=``), X packed
into MMLA A blocks inside the function (zero-padded to whole row pairs and K blocks) and odd
M or N cropped from a C of whole pairs.  Each GEMM is cross-compiled for aarch64
(+neon +i8mm +bf16), its assembly checked for the instruction, then run under
``qemu-aarch64 -cpu max`` against numpy (u8 x s8 exactly, bf16 within fp32 accumulation of
bf16 inputs).  The qemu driver has no thread pool, so the runs are scheduled serially (the
loops' parallel annotations left out).

Models: the bundled mlp in bf16 and quantized (QDQ, u8 x s8) is cross-compiled for amx,
avx512_vnni / avx512_bf16 and neon_i8mm, each assembly showing its ISA's multiply; and
every TPP kernel of its neon_i8mm build runs under qemu, matching the host build's kernel of
the same name on the same input.
"""

import ml_dtypes
import numpy as np
import pytest
import tvm
from conftest import INT8_KERNELS
from qemu_aarch64 import TARGET, QemuRunner, missing
from tvm import s_tir

from microkernels import isa
from microkernels.brgemm import BrgemmShape, find_impl
from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.machine import Machine
from microkernels.pack import unpack_mmla
from schedules.gemm import (
    GemmProblem,
    candidates,
    default_config,
    operand_layout,
    pack_weight,
    schedule,
)

INSTRUCTION = {"uint8": "usmmla", "bfloat16": "bfmmla"}
DEQUANT = Epilogue((EpilogueOp("scale", broadcast="row"), EpilogueOp("bias")))
SHAPES = [(5, 6, 9), (37, 50, 100)]  # odd M and K; a larger one with every kind of padding


def _machine(isa_name: str = "neon_i8mm") -> Machine:
    return Machine(isa.from_name(isa_name), isa.DEFAULT_CACHES, 2, fp32_flops_per_cycle=16.0)


def _build(problem: GemmProblem, config):
    return tvm.compile(schedule(problem, config, "neon_i8mm").mod,
                       target=tvm.target.Target(TARGET))


def _asm_ops(executable) -> list[str]:
    return [line.split()[0] for line in executable.mod.inspect_source("asm").splitlines()
            if line.startswith("\t") and line.split()]


def _operands(problem: GemmProblem, rng: np.random.Generator):
    m, n, k = problem.m, problem.n, problem.k
    if problem.dtype == "uint8":
        x = rng.integers(0, 255, (m, k), endpoint=True).astype(np.uint8)
        w = rng.integers(-128, 127, (k, n), endpoint=True).astype(np.int8)
    else:
        x = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
        w = rng.standard_normal((k, n)).astype(np.float32)
    return x, w


def _expected(problem: GemmProblem, x, w) -> np.ndarray:
    if problem.dtype == "uint8":
        return x.astype(np.int64) @ w.astype(np.int64)
    return x.astype(np.float64) @ w.astype(ml_dtypes.bfloat16).astype(np.float64)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    reason = missing()
    if reason:
        pytest.skip(f"cannot run aarch64 code: {reason}")
    return QemuRunner(tmp_path_factory.mktemp("qemu_gemm"))


@pytest.fixture
def serial(monkeypatch):
    """The qemu driver has no TVM thread pool: schedules keep their loops serial."""
    monkeypatch.setattr(s_tir.Schedule, "parallel", lambda self, loop: None)


# ------------------------------------------------------------------------- layout choice


def test_layout_is_chosen_by_dtype_and_isa():
    for dtype, default in (("uint8", "vnni4"), ("bfloat16", "vnni2")):
        assert operand_layout(dtype) == default
        for x86 in ("avx2", "avx512_vnni", "avx512_bf16", "amx"):
            assert operand_layout(dtype, x86) == default
        assert operand_layout(dtype, "neon") == default  # no MMLA on plain NEON
        assert operand_layout(dtype, "neon_i8mm") == "mmla"
    assert operand_layout("float32", "neon_i8mm") == "flat"
    problem = GemmProblem(5, 6, 9, "uint8")
    assert problem.layout == "vnni4" and problem.on("neon_i8mm").layout == "mmla"
    bound = problem.on("neon_i8mm")
    assert (bound.padded_m, bound.padded_n, bound.padded_k, bound.alpha) == (6, 6, 16, 8)
    assert bound.on("avx2") is bound  # a bound problem keeps its layout
    with pytest.raises(ValueError, match="unknown ISA|known"):
        GemmProblem(5, 6, 9, "uint8", isa="sparc")


@pytest.mark.parametrize("dtype", ["uint8", "bfloat16"])
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_default_and_candidates_fit_the_mmla_kernel(dtype, m, n, k):
    """Every candidate's blocks are even, fit the 32 vector registers (the MMLA impl runs,
    not the generic fallback) and take whole K blocks of 8."""
    problem = GemmProblem(m, n, k, dtype)
    bound = problem.on("neon_i8mm")
    found = candidates(problem, _machine(), max_candidates=10)
    assert found[0] == default_config(problem, _machine())
    for config in found:
        config.check(bound)
        shape = BrgemmShape(config.bm, config.bn, config.bk, config.k_step, dtype,
                            bound.acc_dtype, "mmla", "neon_i8mm")
        assert find_impl(shape)[0] == "neon_i8mm", config


def test_pack_weight_mmla_blocks():
    rng = np.random.default_rng(0)
    w = rng.integers(-128, 127, (9, 5), endpoint=True).astype(np.int8)
    problem = GemmProblem(3, 5, 9, "uint8")
    packed = pack_weight(w, 2, problem, isa="neon_i8mm")
    assert packed.shape == (3, 2, 2, 8) and packed.dtype == np.int8  # N 5->6, K 9->16
    np.testing.assert_array_equal(unpack_mmla(packed, (16, 6), "b")[:9, :5], w)
    assert not unpack_mmla(packed, (16, 6), "b")[9:].any()
    assert not unpack_mmla(packed, (16, 6), "b")[:, 5:].any()
    # the same bound problem packs the same without isa=; x86 keeps VNNI-4 panels
    np.testing.assert_array_equal(pack_weight(w[:, :4], 2, GemmProblem(3, 4, 9, "uint8",
                                                                       isa="neon_i8mm")),
                                  pack_weight(w[:, :4], 2, GemmProblem(3, 4, 9, "uint8"),
                                              isa="neon_i8mm"))
    assert pack_weight(w[:, :4], 2, GemmProblem(3, 4, 9, "uint8")).shape == (2, 3, 2, 4)
    wf = rng.standard_normal((9, 5)).astype(np.float32)
    bf = pack_weight(wf, 2, GemmProblem(3, 5, 9, "bfloat16"), isa="neon_i8mm")
    assert bf.shape == (3, 4, 2, 4) and bf.dtype == ml_dtypes.bfloat16  # K 9->16 in 4s
    with pytest.raises(ValueError, match="even"):
        pack_weight(w, 3, problem, isa="neon_i8mm")


# ------------------------------------------------------------------- aarch64 asm and qemu


@pytest.mark.parametrize("dtype", ["uint8", "bfloat16"])
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_mmla_gemm_asm_and_qemu(runner, serial, dtype, m, n, k):
    problem = GemmProblem(m, n, k, dtype)
    config = default_config(problem, _machine())
    executable = _build(problem, config)
    ops = _asm_ops(executable)
    assert INSTRUCTION[dtype] in ops
    x, w = _operands(problem, np.random.default_rng(m + n + k))
    y = np.zeros((m, n), problem.out_dtype)
    got = runner.run(executable.mod, [x, pack_weight(w, config.bn, problem, isa="neon_i8mm"),
                                      y])[2]
    want = _expected(problem, x, w)
    if dtype == "uint8":
        np.testing.assert_array_equal(got, want)
    else:  # fp32 accumulation of exact bf16 products
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * k)


@pytest.mark.parametrize("pack_a", [None, 1])
def test_mmla_gemm_epilogue_and_split_k_under_qemu(runner, serial, pack_a):
    """Dequantizing epilogue on an odd output, K split across calls with A packed under
    the K loop (the long-K blocking) or in one copy before the loops."""
    from dataclasses import replace

    from microkernels.epilogue import reference
    from schedules.gemm import GemmConfig

    problem = GemmProblem(13, 10, 40, "uint8", DEQUANT)
    base = GemmConfig.of("acb", 2, 10, 8, pack_a=1) if pack_a else \
        GemmConfig.of("bca", 2, 10, 8, k_step=5)
    config = replace(base, pack_a=pack_a)
    executable = _build(problem, config)
    assert "usmmla" in _asm_ops(executable)
    rng = np.random.default_rng(5)
    x, w = _operands(problem, rng)
    scale = rng.uniform(0.5e-4, 2e-4, problem.n).astype(np.float32)
    bias = rng.standard_normal(problem.n).astype(np.float32)
    got = runner.run(executable.mod, [x, pack_weight(w, config.bn, problem, isa="neon_i8mm"),
                                      scale, bias, np.zeros((13, 10), np.float32)])[4]
    acc = _expected(problem, x, w).astype(np.float32)
    want = reference(DEQUANT, acc, {"scale": scale, "bias": bias})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_x86_gemms_keep_vnni():
    """The same problems on x86 ISAs are scheduled with the VNNI kernels as before."""
    for dtype, isa_name in (("uint8", "avx512_vnni"), ("bfloat16", "avx512_bf16")):
        problem = GemmProblem(5, 6, 9, dtype)
        config = default_config(problem, _machine(isa_name))
        mod = schedule(problem, config, isa_name).mod
        assert "mmla" not in mod.script()


# ------------------------------------------------------------------------ a whole model


def test_bf16_model_cross_compiled_for_neon_i8mm_uses_bfmmla():
    import tvm_tpp
    from tvm_tpp import models

    model = tvm_tpp.compile(models.load("mlp"), target="tpp -isa=neon_i8mm", precision="bf16")
    asm = model.source("asm")
    assert "bfmmla" in asm
    routed = [entry for entry in model.report if entry.kernel]
    assert routed and all("bf16" in entry.kernel for entry in routed if "dense" in entry.kernel)


# ------------------------------------------------------- a model's kernels, run under qemu


def _kernel_calls(mod: tvm.IRModule) -> dict[str, tuple]:
    """The TPP kernels ``main`` of a lowered module calls: name -> (PrimFunc, arguments),
    each argument a constant's array or the (shape, dtype) of a tensor made at run time."""
    from tvm import relax

    calls = {}
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            call = binding.value
            if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.GlobalVar)
                    and call.op.name_hint.startswith("tpp_")):
                continue
            args = []
            for arg in call.args:
                if isinstance(arg, tvm.ir.expr.Constant):
                    args.append(arg.value.numpy())
                else:
                    info = arg.ty
                    args.append((tuple(int(d) for d in info.shape), str(info.dtype)))
            calls[call.op.name_hint] = (mod[call.op], args)
    return calls


def _draw(shape: tuple[int, ...], dtype: str, rng: np.random.Generator) -> np.ndarray:
    if dtype == "uint8":
        return rng.integers(0, 255, shape, endpoint=True).astype(np.uint8)
    if dtype == "bfloat16":
        return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    return np.zeros(shape, dtype)


def _as_main(func) -> tvm.IRModule:
    return tvm.IRModule({"main": func.with_attr("global_symbol", "main")})


def _model_kernels_match_the_host(runner, model, precision: str, instruction: str) -> None:
    """Lower ``model`` for neon_i8mm and for this host; every kernel of the aarch64 build has
    ``instruction`` and, run under qemu, matches the host's kernel of the same name (the
    same operator with its operands packed the host's way) on the same input."""
    import tvm_tpp
    from tvm_tpp.compiler import lower

    arm = _kernel_calls(lower(model, target="tpp -isa=neon_i8mm", precision=precision))
    host_target = tvm_tpp.target(INT8_KERNELS)
    host = _kernel_calls(lower(model, target=host_target, precision=precision))
    assert arm and set(arm) == set(host)
    rng = np.random.default_rng(11)
    for name, (func, args) in arm.items():
        executable = tvm.compile(_as_main(func), target=tvm.target.Target(TARGET))
        assert instruction in _asm_ops(executable), name
        x = _draw(*args[0], rng)  # the activation; the output comes last
        arm_args = [x, *args[1:-1], _draw(*args[-1], rng)]
        got = runner.run(executable.mod, arm_args)[-1]
        host_func, host_args = host[name]
        out = tvm.runtime.tensor(_draw(*host_args[-1], rng))
        tvm.compile(_as_main(host_func), target=host_target)(
            *[tvm.runtime.tensor(a) for a in [x, *host_args[1:-1]]], out)
        want = out.numpy()
        if want.dtype == np.uint8:  # requantized: equal, or one step apart at a rounding tie
            assert np.abs(got.astype(np.int32) - want).max() <= 1, name
        elif want.dtype != np.float32:  # a bf16 hand-off: one bf16 rounding apart at most
            np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32),
                                       rtol=2.0**-7, atol=1e-4 * np.abs(want).max(),
                                       err_msg=name)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max(),
                                       err_msg=name)


def test_bf16_model_kernels_run_under_qemu(runner, serial):
    from tvm_tpp import models

    _model_kernels_match_the_host(runner, models.load("mlp"), "bf16-strict", "bfmmla")


def test_int8_model_kernels_run_under_qemu(runner, serial, quantized_mlp):
    _model_kernels_match_the_host(runner, quantized_mlp, "float32", "usmmla")


@pytest.fixture(scope="module")
def quantized_mlp(tmp_path_factory):
    import onnx

    from tvm_tpp import models
    from tvm_tpp.quantized import quantize_static_qdq

    tmp = tmp_path_factory.mktemp("qdq")
    onnx.save(models.load("mlp"), str(tmp / "mlp.onnx"))
    return onnx.load(str(quantize_static_qdq(tmp / "mlp.onnx", tmp / "mlp_qdq.onnx", samples=2)))


@pytest.mark.parametrize("precision, isa_name, instruction", [
    ("int8", "amx", "tdpbusd"),
    ("int8", "avx512_vnni", "vpdpbusd"),
    ("int8", "neon_i8mm", "usmmla"),
    ("bf16", "amx", "tdpbf16ps"),
    ("bf16", "avx512_bf16", "vdpbf16ps"),
    ("bf16", "neon_i8mm", "bfmmla"),
])
def test_models_cross_compiled_have_the_instruction(quantized_mlp, precision, isa_name,
                                                    instruction):
    """The same quantized (QDQ) and bf16 mlp cross-compiled for each ISA: its assembly has
    the ISA's low-precision multiply."""
    import tvm_tpp
    from tvm_tpp import models

    model = quantized_mlp if precision == "int8" else models.load("mlp")
    compiled = tvm_tpp.compile(model, target=f"tpp -isa={isa_name}",
                               precision="float32" if precision == "int8" else "bf16")
    ops = {line.split()[0] for line in compiled.source("asm").splitlines()
           if line.startswith("\t") and line.split()}
    assert instruction in ops


@pytest.mark.slow  # every candidate under qemu; the default's run is in the model tests
def test_candidates_run_under_qemu(runner, serial):
    """Loop orders and A packings of the tuner's candidates (A's MMLA copy under different
    loops) compute the same GEMM."""
    problem = GemmProblem(37, 50, 600, "uint8")
    found = candidates(problem, _machine(), max_candidates=30)
    picked = {}
    for config in found:  # one per blocking, packing depth and outermost loop
        picked.setdefault((config.bm, config.bk, config.k_step, config.pack_a,
                           config.spec[0].lower()), config)
    assert len({c.pack_a for c in picked.values()}) >= 2 and len(picked) >= 4
    x, w = _operands(problem, np.random.default_rng(2))
    want = _expected(problem, x, w)
    for config in list(picked.values())[:8]:
        got = runner.run(_build(problem, config).mod,
                         [x, pack_weight(w, config.bn, problem, isa="neon_i8mm"),
                          np.zeros((37, 50), np.int32)])[2]
        np.testing.assert_array_equal(got, want, err_msg=str(config))
