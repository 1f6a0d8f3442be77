"""Casts before reshapes (relay_passes.casts_first): Before/Expected, the values unchanged
through the VM, and a layer norm that now writes the bf16 input of the dense after it."""

import numpy as np
import tvm
from conftest import relax_main
from tvm import relax
from tvm.script import tirx as T

from relay_passes.casts_first import casts_before_reshapes
from relay_passes.pipeline import tpp_pipeline
from tvm_tpp.tpp_target import target as tpp_target

F32 = "float32"
TARGET = tpp_target("tpp")
X = relax.Var("x", relax.TensorType((2, 3, 8), "float32"))


def _norm(bb, x):
    gamma, beta = (relax.const(np.full(8, v, np.float32)) for v in (1.5, 0.25))
    return bb.emit(relax.op.nn.layer_norm(x, gamma, beta, axes=[-1]))


def _before(bb, x):
    flat = bb.emit(relax.op.reshape(_norm(bb, x), (6, 8)))
    return relax.op.astype(flat, "bfloat16")


def _expected(bb, x):
    return relax.op.reshape(bb.emit(relax.op.astype(_norm(bb, x), "bfloat16")), (6, 8))


def test_cast_moves_before_the_reshape():
    after = casts_before_reshapes(relax_main([X], _before))
    tvm.ir.assert_structural_equal(after, relax_main([X], _expected))


def test_a_reshape_read_elsewhere_stays():
    def body(bb, x):
        flat = bb.emit(relax.op.reshape(x, (6, 8)))
        cast = bb.emit(relax.op.astype(flat, "bfloat16"))
        return relax.Tuple([cast, flat])

    def expected(bb, x):
        flat = bb.emit(relax.op.reshape(x, (6, 8)))
        cast = bb.emit(relax.op.reshape(bb.emit(relax.op.astype(x, "bfloat16")), (6, 8)))
        return relax.Tuple([cast, flat])

    tvm.ir.assert_structural_equal(casts_before_reshapes(relax_main([X], body)),
                                   relax_main([X], expected))


@tvm.script.ir_module
class _Kernel:
    @T.prim_func(s_tir=True)
    def double(a: T.Buffer((2, 3, 8), "bfloat16"), b: T.Buffer((2, 3, 8), "bfloat16")):
        for i, j, k in T.grid(2, 3, 8):
            with T.sblock("b"):
                vi, vj, vk = T.axis.remap("SSS", [i, j, k])
                b[vi, vj, vk] = a[vi, vj, vk] + a[vi, vj, vk]

    @T.prim_func(s_tir=True)
    def copy(a: T.Buffer((6, 8), "float32"), b: T.Buffer((6, 8), "float32")):
        for i, j in T.grid(6, 8):
            with T.sblock("b"):
                vi, vj = T.axis.remap("SS", [i, j])
                b[vi, vj] = a[vi, vj]


def _kernel_then_cast(cast_first: bool, read_by_kernel: bool):
    """A bf16 kernel's output reshaped and widened, read by an elementwise op or a kernel."""
    def body(bb, x):
        double = bb.add_func(_Kernel["double"], "double")
        out = bb.emit(relax.call_tir(double, [x], relax.TensorType((2, 3, 8), "bfloat16")))
        if cast_first:
            wide = bb.emit(relax.op.reshape(bb.emit(relax.op.astype(out, F32)), (6, 8)))
        else:
            wide = bb.emit(relax.op.astype(bb.emit(relax.op.reshape(out, (6, 8))), F32))
        if read_by_kernel:
            copy = bb.add_func(_Kernel["copy"], "copy")
            return relax.call_tir(copy, [wide], relax.TensorType((6, 8), F32))
        return relax.op.multiply(wide, relax.const(2.0, F32))

    return relax_main([relax.Var("x", relax.TensorType((2, 3, 8), "bfloat16"))], body)


def test_a_kernels_output_keeps_its_cast_where_a_reader_fuses_it():
    """Nothing fuses into a kernel call: cast first, the cast would be a pass of its own
    (DenseNet's bf16 block buffer); after the reshape it fuses into an elementwise reader.
    Read by a kernel, it is a pass of its own either way: cast first, as elsewhere."""
    before = _kernel_then_cast(cast_first=False, read_by_kernel=False)
    tvm.ir.assert_structural_equal(casts_before_reshapes(before), before)
    tvm.ir.assert_structural_equal(
        casts_before_reshapes(_kernel_then_cast(cast_first=False, read_by_kernel=True)),
        _kernel_then_cast(cast_first=True, read_by_kernel=True))


def test_values_unchanged_and_the_norm_writes_bf16():
    # TVM's own lowering of the original graph against the tpp pipeline (which runs the pass).
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    before = relax_main([X], _before)
    outs = []
    for pipeline in (relax.get_default_pipeline(TARGET), tpp_pipeline(TARGET)):
        vm = relax.VirtualMachine(tvm.compile(before, TARGET, relax_pipeline=pipeline),
                                  tvm.cpu())
        outs.append(vm["main"](tvm.runtime.tensor(x)).numpy().view(np.uint16))
    np.testing.assert_array_equal(outs[1], outs[0])
    lowered = tpp_pipeline(TARGET)(before)
    names = {gv.name_hint for gv, f in lowered.functions.items()
             if isinstance(f, tvm.tirx.PrimFunc)}
    assert "fused_layer_norm_cast" in names and "layer_norm" not in names
