"""Where TVM's thread pool runs: inside the cores the process was given (``taskset``), not
moved to the machine's first cores when the pool starts."""

import os
import shutil
import subprocess
import sys

import pytest

_STARTS_POOL = ("import os, tvm_tpp, tvm, tvm_ffi; "
                "tvm_ffi.get_global_func('runtime.NumThreads')(); "
                "print(sorted(os.sched_getaffinity(0)))")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or shutil.which("taskset") is None,
                    reason="needs two cores to tell them apart, and taskset (util-linux)")
def test_pool_stays_on_the_core_taskset_gave():
    last = max(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items()
           if k not in ("TVM_NUM_THREADS", "TVM_BIND_THREADS")}
    out = subprocess.run(["taskset", "-c", str(last), sys.executable, "-c", _STARTS_POOL],
                         env=env, capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == f"[{last}]"
