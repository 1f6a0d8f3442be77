"""Shared fixtures: tiny ONNX models built with onnx.helper (seeded weights, no downloads)."""

import logging
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

# pytest-xdist's workers share the cores: each TVM thread pool gets its share, or a pool's
# threads spinning idle after a parallel kernel take the CPU from the other worker (2 workers
# on 2 cores: 5 min 10 s of suite and 1 min 26 s of system time, against 4 min 17 s and 16 s).
# Set over what a worker inherits: the controller's import of tvm_tpp sized it to all cores.
# Nor may a pool bind its threads to cores: a one-thread pool pins its main thread to core 0
# once it starts (runtime.NumThreads, bench-conv, profile), and two workers pinned there left
# the other core idle for the rest of the run (6 min 25-42 s of suite against 4 min 44 s).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ["TVM_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // _WORKERS))
    os.environ["TVM_BIND_THREADS"] = "0"

# The seeded random calibration reader the quantization tests share is the library's own.
from tvm_tpp.quantized import RandomCalibration  # noqa: F401, E402


@pytest.fixture(autouse=True)
def _meta_schedule_loggers_propagate():
    """pytest attaches its log-capture handlers, which have no name, to every logger that does
    not propagate when a test phase starts.  MetaSchedule's loggers stop propagating in its
    first in-process search, and its next search names every handler on them in a logging
    config: AttributeError in ``meta_schedule.logging``.  They propagate again after each test,
    so a later test's search finds only its own handlers there."""
    yield
    for name, logger in logging.root.manager.loggerDict.items():
        if name.startswith("tvm.s_tir.meta_schedule") and isinstance(logger, logging.Logger):
            logger.propagate = True


def make_dense_model(m: int = 4, k: int = 24, n: int = 40, relu: bool = True,
                     batch_dim: int | str = None, seed: int = 0) -> onnx.ModelProto:
    """x[m,k] @ W[k,n] + b (-> relu): the smallest network with a TPP pattern in it."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.standard_normal((k, n)).astype("float32"), "W")
    b = numpy_helper.from_array(rng.standard_normal(n).astype("float32"), "b")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"]),
             helper.make_node("Add", ["mm", "b"], ["y" if not relu else "z"])]
    if relu:
        nodes.append(helper.make_node("Relu", ["z"], ["y"]))
    rows = m if batch_dim is None else batch_dim
    graph = helper.make_graph(
        nodes, "dense",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])],
        [w, b],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.fixture
def dense_model():
    return make_dense_model()


@pytest.fixture
def dense_file(tmp_path, dense_model):
    path = tmp_path / "dense.onnx"
    onnx.save(dense_model, str(path))
    return path


@pytest.fixture(scope="session", autouse=True)
def amx_tile_permission():
    """Ask Linux for the AMX tile state once, before any test runs a kernel: on an AMX host a
    test process without it dies with SIGILL at the first tile instruction (on other hosts,
    and where it is refused, AMX is simply not picked or run)."""
    from microkernels.amx import tiles_usable

    return tiles_usable()


@pytest.fixture
def fake_amx_host(monkeypatch):
    """``fake_amx_host(granted, flags=AMX's)`` fakes an AMX host whose tile permission Linux
    grants or refuses; returns the list of permission requests made."""
    from microkernels import amx, isa, machine

    real_flags = isa.host_flags

    def forget() -> None:  # the per-process caches of what the CPU and Linux said
        amx.tiles_usable.cache_clear()
        machine._cpu.cache_clear()

    def fake(granted: bool, flags: frozenset[str] = isa.from_name("amx").requires):
        asked: list[bool] = []

        def request() -> bool:
            asked.append(granted)
            return granted

        monkeypatch.setattr(isa, "host_flags",
                            lambda cpuinfo=None: flags if cpuinfo is None else real_flags(cpuinfo))
        monkeypatch.setattr(amx, "request_permission", request)
        forget()
        return asked

    yield fake
    forget()  # the next call asks the real host again


@pytest.fixture(scope="session")
def amx_emulator(tmp_path_factory):
    """The C emulator of the AMX instructions (tests/amx/amx_emu.c), built and loaded once per
    session: the LLVM JIT resolves the emulated kernels' calls from the first such library
    loaded into the process, so a second copy would never see a call."""
    import ctypes
    import shutil
    import subprocess
    from pathlib import Path

    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no host C compiler to build the AMX emulator")
    lib = tmp_path_factory.mktemp("amx") / "amx_emu.so"
    source = Path(__file__).parent / "amx" / "amx_emu.c"
    subprocess.run([compiler, "-O2", "-ffp-contract=off", "-shared", "-fPIC", str(source),
                    "-o", str(lib)], check=True)
    emu = ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)  # the JIT resolves from here
    for name in ("faults", "configs", "releases"):
        getattr(emu, f"tpp_amx_emu_{name}").restype = ctypes.c_int64
    return emu


def emulated_dispatch(shape) -> str:
    """:func:`~microkernels.brgemm.dispatch`, with AMX kernels calling the C emulator of
    :func:`amx_emulator` (monkeypatched into a schedule module in place of ``dispatch``)."""
    import tvm

    from microkernels import amx
    from microkernels.brgemm import desc_func, dispatch, find_impl

    if find_impl(shape)[0] != "amx":
        return dispatch(shape)
    name = shape.name + "_emulated"
    if tvm.s_tir.TensorIntrin.get(name, allow_missing=True) is None:
        tvm.s_tir.TensorIntrin.register(name, desc_func(shape),
                                        amx.impl_func(shape, emulate=True))
    return name


# -- ISAs: which this host runs, skip marks, and cross-compile targets -----------------------

def runs_here(isa_name: str) -> bool:
    """Whether this host has every CPU flag ``isa_name`` needs."""
    from microkernels import isa

    return isa.from_name(isa_name).requires <= isa.host_flags()


def needs_isa(isa_name: str) -> pytest.MarkDecorator:
    """Skip unless the host runs ``isa_name``, naming the flags it lacks."""
    from microkernels import isa

    missing = sorted(isa.from_name(isa_name).requires - isa.host_flags())
    return pytest.mark.skipif(bool(missing), reason=f"host lacks {' '.join(missing)}")


#: The host's ``tpp`` target with quantized layers on the int8 kernels whatever this CPU's
#: default (``-int8=auto`` computes them in float32 where that is faster: a Zen 1).
INT8_KERNELS = "tpp -int8=kernels"


def isa_target(isa_name: str, mcpu: str | None = None):
    """An x86-64 LLVM target for ``isa_name``'s representative CPU (or ``mcpu``)."""
    import tvm

    from microkernels import isa

    return tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-pc-linux-gnu",
                              "mcpu": mcpu or isa.KNOWN[isa_name].mcpu})


# -- ONNX Runtime's int8 as a reference --------------------------------------------------------

#: Whether ONNX Runtime's fused u8 x s8 kernels are exact on this host.  Without VNNI its MLAS
#: multiplies with vpmaddubsw, whose int16 sums of two products saturate (up to 29 output steps
#: off on a Zen 1, measured 2026-11-27); ONNX Runtime's remedy is 7-bit weights (reduce_range).
#: A QDQ model's reference is its graph run unfused (ONNX's roundings, exact on any host);
#: models of integer operators (QLinear*, MatMulInteger) get 7-bit weights on such hosts.
ORT_INT8_EXACT = runs_here("avx512_vnni") or runs_here("avx_vnni")
#: The int8 weights whose products ONNX Runtime sums exactly on this host.
S8_WEIGHTS = (-128, 127) if ORT_INT8_EXACT else (-64, 63)


def bn_stats(rng: np.random.Generator, c: int) -> list[np.ndarray]:
    """BatchNorm's gamma, beta, mean and variance for ``c`` channels."""
    return [rng.uniform(0.8, 1.2, c).astype("float32"), rng.normal(0, 0.1, c).astype("float32"),
            rng.normal(0, 0.1, c).astype("float32"), rng.uniform(0.5, 1.5, c).astype("float32")]


def relax_main(params: list, body):
    """An IRModule ``main(*params)`` whose dataflow block ``body(bb, *params)`` computes the
    output."""
    from tvm import relax

    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *params))
        bb.emit_func_output(out)
    return bb.get()


def run_main(mod, *arrays: np.ndarray, target=None) -> np.ndarray:
    """``mod``'s main function built for ``target`` (default: plain LLVM) and run in the VM
    on ``arrays``: its one output."""
    import tvm
    from tvm import relax

    ex = tvm.compile(mod, target or tvm.target.Target({"kind": "llvm"}))
    return relax.VirtualMachine(ex, tvm.cpu())["main"](
        *(tvm.runtime.tensor(a) for a in arrays)).numpy()


def main_calls(mod) -> list:
    """The calls of ``mod``'s main function, in graph order."""
    from tvm import relax

    found = []
    relax.analysis.post_order_visit(mod["main"], lambda e: found.append(e)
                                    if isinstance(e, relax.Call) else None)
    return found


def pixel_rows(nchw: np.ndarray) -> np.ndarray:
    """An NCHW tensor as the ``[N*H*W, C]`` matrix of pixels the conv kernels read and write."""
    return nchw.transpose(0, 2, 3, 1).reshape(-1, nchw.shape[1])
