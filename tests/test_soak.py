"""Soak: every bundled network compiled and run many times in one process (issue 16).

Each network is compiled once and run :data:`RUNS` times on the same inputs: every output must
equal the first bit for bit (no state leaks between runs, no races in the parallel kernels).
Then the mlp is compiled :data:`RUNS` times: the process's resident memory must stop growing
(:data:`GROWTH_MIB` over the last half of the compiles; what a leaking build would exceed).
Slow: a few minutes (``pytest -m slow tests/test_soak.py``).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

import tvm_tpp
from tvm_tpp import models

RUNS = 20
#: Resident memory the second half of RUNS compiles of the mlp may add (MiB).  Measured
#: 2026-11-25: 306, 310, then 312 MiB from the third compile on (0 MiB over the second half).
GROWTH_MIB = 16

pytestmark = pytest.mark.slow


def _resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.parametrize("name", models.names())
def test_runs_give_identical_outputs(name):
    model = models.load(name)
    compiled = tvm_tpp.compile(model, target="tpp")
    inputs = models.random_inputs(model, seed=0)
    first = compiled.run(**inputs)
    for _ in range(RUNS - 1):
        for got, want in zip(compiled.run(**inputs), first, strict=True):
            np.testing.assert_array_equal(got, want)


def test_repeated_compiles_do_not_grow_memory():
    model = models.load("mlp")
    sizes = []
    for _ in range(RUNS):
        compiled = tvm_tpp.compile(model, target="tpp", untuned=True)
        compiled.run(**models.random_inputs(model, seed=0))
        del compiled
        gc.collect()
        sizes.append(_resident_mib())
    growth = sizes[-1] - sizes[RUNS // 2]
    assert growth <= GROWTH_MIB, f"resident memory grew {growth:.0f} MiB: {sizes}"
