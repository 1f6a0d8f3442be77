"""tvm-tpp: Tensor Processing Primitives and PARLOOPER loop schedules for Apache TVM on CPUs.

Examples
--------
>>> import tvm_tpp
>>> tvm_tpp.tune("model.onnx", work_dir="work", budget=5)    # doctest: +SKIP
>>> model = tvm_tpp.compile("model.onnx", work_dir="work")   # doctest: +SKIP
>>> outputs = model.run(input=x)                              # doctest: +SKIP
>>> model.export("model.so"); tvm_tpp.load("model.so")        # doctest: +SKIP

Submodules load on first use so ``import tvm_tpp`` (and the command line) stay fast.
"""

from __future__ import annotations

import importlib
import os

from microkernels import isa as _isa

# TVM's runtime starts a single worker thread on some VMs; size its pool from the cores this
# process may use, unless the user chose.  Must happen before TVM's runtime first runs.
_CORES = _isa.num_cores()
os.environ.setdefault("TVM_NUM_THREADS", str(_CORES))
# TVM binds its pool's threads to the machine's first cores when the pool starts, a
# one-thread pool its calling thread to core 0, even out of the cores this process was given
# (taskset, a cpuset): there the affinity mask places the threads instead.
if _CORES < (os.cpu_count() or 1):
    os.environ.setdefault("TVM_BIND_THREADS", "0")

__version__ = "0.1.0"

_LAZY = {
    "compile": ("tvm_tpp.compiler", "compile"),
    "tune": ("tvm_tpp.compiler", "tune"),
    "load": ("tvm_tpp.compiler", "load"),
    "CompiledModel": ("tvm_tpp.compiler", "CompiledModel"),
    "target": ("tvm_tpp.tpp_target", "target"),
    "models": ("tvm_tpp.models", None),
    "isa": ("tvm_tpp.isa", None),
    "errors": ("tvm_tpp.errors", None),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'tvm_tpp' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value
    return value
