"""Pools that take their elementwise producers (relay_passes.pool_fusion): the annotation, and
DenseNet's transition ``avg_pool(relu(x * s + b))`` lowered by the tpp pipeline as one
function, against TVM's own lowering, average and max, odd sizes, a padded window."""

import numpy as np
import pytest
import tvm
from conftest import relax_main
from tvm import relax, te, topi

from relay_passes.pipeline import tpp_pipeline
from relay_passes.pool_fusion import pools_take_producers
from tvm_tpp.tpp_target import target as tpp_target

TARGET = tpp_target("tpp")
F32 = "float32"


def test_only_pools_are_annotated():
    x = te.placeholder((1, 4, 4, 8), F32, name="x")
    pool = topi.nn.pool2d(x, (2, 2), (2, 2), (1, 1), (0, 0, 0, 0), "max", layout="NHWC")
    relu = topi.nn.relu(x)
    mod = tvm.IRModule({"max_pool2d": te.create_prim_func([x, pool]).with_attr("op_pattern", 4),
                        "relu": te.create_prim_func([x, relu]).with_attr("op_pattern", 0)})
    out = pools_take_producers()(mod)
    assert [int(out[n].attrs["op_pattern"]) for n in ("max_pool2d", "relu")] == [3, 0]


def _transition(kind: str, pool: int, stride: int, padding: int, shape):
    c = shape[-1]
    rng = np.random.default_rng(7)
    scale = relax.const(rng.uniform(0.5, 1.5, c).astype(F32))
    shift = relax.const(rng.standard_normal(c).astype(F32))
    op = relax.op.nn.avg_pool2d if kind == "avg" else relax.op.nn.max_pool2d

    def body(bb, x):
        act = bb.emit(relax.op.nn.relu(bb.emit(relax.op.add(
            bb.emit(relax.op.multiply(x, scale)), shift))))
        return op(act, pool, stride, padding, layout="NHWC")

    return relax_main([relax.Var("x", relax.TensorType(shape, F32))], body)


@pytest.mark.parametrize("kind, pool, stride, padding, shape", [
    ("avg", 2, 2, 0, (2, 6, 10, 24)),   # DenseNet's transition
    ("avg", 2, 2, 0, (1, 5, 7, 13)),    # odd channels, a ragged last row
    ("max", 3, 2, 1, (1, 9, 9, 16)),    # overlapping, padded windows
])
def test_pool_fuses_its_producers(kind, pool, stride, padding, shape):
    mod = _transition(kind, pool, stride, padding, shape)
    lowered = tpp_pipeline(TARGET)(mod)
    names = [gv.name_hint for gv, f in lowered.functions.items()
             if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(names) == 1 and "pool" in names[0] and "relu" in names[0], names
    x = np.random.default_rng(1).standard_normal(shape).astype(F32)
    outs = []
    for pipeline in (relax.get_default_pipeline(TARGET), tpp_pipeline(TARGET)):
        vm = relax.VirtualMachine(tvm.compile(mod, TARGET, relax_pipeline=pipeline), tvm.cpu())
        outs.append(vm["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6, atol=1e-6)
