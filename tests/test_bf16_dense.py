"""bf16 dense layers: ``compile(..., precision="bf16")`` multiplies the dense layers in bfloat16
with float32 accumulation where the target's ISA multiplies bf16 in hardware, in float32
elsewhere; ``"bf16-strict"`` in bfloat16 on every ISA (emulated where it has none: what the
tests below run on any host).  Everything else stays float32.

Outputs are checked against ONNX Runtime in float32 (normwise, 1e-2: bf16 keeps 8 significant
bits of X and W); the report, the rewritten graph and the AMX code say what runs.
"""

import re

import numpy as np
import pytest
import tvm
from conftest import make_dense_model
from tvm import relax

import tvm_tpp
from relay_passes.pipeline import tpp_rewrites
from tvm_tpp import models
from tvm_tpp.cli import main
from tvm_tpp.compiler import STRICT_BF16, import_model, kernel_precision
from tvm_tpp.errors import UsageError
from tvm_tpp.reference import max_errors, random_inputs, run_onnxruntime
from tvm_tpp.tpp_target import target as make_target

BF16 = "bfloat16*bfloat16->float32"


def _bf16_matches_ort(model):
    compiled = tvm_tpp.compile(model, target="tpp", precision=STRICT_BF16, untuned=True)
    inputs = random_inputs(compiled.inputs, seed=1)
    _, rel = max_errors(compiled.run(**inputs), run_onnxruntime(model, inputs))
    assert rel <= 1e-2
    return compiled.report


@pytest.mark.parametrize("name, dense_layers", [
    ("mlp", 3),
    # the same dense kernels as mlp; BERT built in bf16 by default: test_batch_matmul_pass
    pytest.param("bert", 4, marks=pytest.mark.slow),  # Q, K and V as one layer
])
def test_bundled_models_in_bf16(name, dense_layers):
    report = _bf16_matches_ort(models.load(name))
    dense = [r for r in report if r.op.startswith("matmul")]
    assert len(dense) == dense_layers
    for r in dense:
        assert (r.dtypes, r.layout) == (BF16, "vnni2"), r
        assert r.kernel.split()[0].endswith("_bf16"), r
    # The fused attention multiplies in bf16 too (in AMX tiles on an AMX host).
    others = [r for r in report if not r.op.startswith("matmul")]
    assert len(others) == (1 if name == "bert" else 0), others
    assert all(r.dtypes == BF16 for r in others), others


def test_odd_sizes():
    report = _bf16_matches_ort(make_dense_model(m=5, k=37, n=29))
    assert [(r.op, r.shape, r.dtypes) for r in report] == [("matmul+bias+relu", (5, 29, 37), BF16)]


def _bindings(func: relax.Function) -> dict[relax.Var, relax.Expr]:
    return {b.var: b.value for block in func.body.blocks for b in block.bindings}


def test_rewritten_call_takes_packed_bf16_weight_and_converted_activation():
    """K = 37 is padded to whole VNNI-2 groups: the constant is ``[N/bn, 19, bn, 2]`` bf16."""
    tgt = make_target("tpp")
    mod, _ = import_model(make_dense_model(m=5, k=37, n=29))
    with tgt:
        mod = tpp_rewrites(tgt, precision="bf16")(mod)
    bindings = _bindings(mod["main"])
    calls = [v for v in bindings.values() if isinstance(v, relax.Call)
             and v.op.name == "relax.call_tir" and v.args[0].name_hint.startswith("tpp_dense")]
    assert len(calls) == 1
    x, w = calls[0].args[1].fields[:2]
    assert isinstance(w, tvm.ir.expr.Constant)
    assert w.ty.dtype == "bfloat16"
    blocks, groups, bn, alpha = (int(d) for d in w.ty.shape)
    assert (groups, alpha, blocks * bn) == (19, 2, 29)
    converted = bindings.get(x, x)
    assert converted.op.name == "relax.astype" and converted.attrs.dtype == "bfloat16"
    assert calls[0].ty.dtype == "float32"


def test_amx_cross_compile_runs_tiles():
    """A tile-shaped layer on ``tpp -isa=amx`` multiplies with ``tdpbf16ps`` (built, not run)."""
    compiled = tvm_tpp.compile(make_dense_model(m=32, k=64, n=64), target="tpp -isa=amx",
                               precision="bf16", untuned=True)
    assert [(r.isa, r.dtypes, r.layout) for r in compiled.report] == [("amx", BF16, "vnni2")]
    assert re.search(r"\btdpbf16ps\b", compiled.source("asm"))


def test_bf16_where_the_isa_multiplies_it():
    """``"bf16"`` is bf16 on an ISA with bf16 arithmetic and float32 (said so) elsewhere."""
    model = make_dense_model(m=5, k=37, n=29)
    avx2 = tvm_tpp.compile(model, target="tpp -isa=avx2", precision="bf16", untuned=True)
    assert [r.dtypes for r in avx2.report] == ["float32*float32->float32"]
    assert avx2.precision == "float32"
    assert avx2.precision_note.startswith("bf16 asked for, but avx2 has no bf16 arithmetic")
    native = tvm_tpp.compile(model, target="tpp -isa=avx512_bf16", precision="bf16",
                             untuned=True)
    assert [r.dtypes for r in native.report] == [BF16]
    assert (native.precision, native.precision_note) == ("bf16", None)
    strict = tvm_tpp.compile(model, target="tpp -isa=avx2", precision=STRICT_BF16,
                             untuned=True)
    assert [r.dtypes for r in strict.report] == [BF16]
    assert (strict.precision, strict.precision_note) == ("bf16", None)


def test_bad_precision():
    with pytest.raises(UsageError, match="precision must be one of float32, bf16, bf16-strict"):
        tvm_tpp.compile(make_dense_model(), precision="fp16", untuned=True)


def test_cli_precision(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no ./tvm_tpp_work for the build to read
    assert main(["run", "mlp", "--precision", STRICT_BF16, "--report", "--check", "onnxruntime",
                 "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count(BF16) == 3 and out.count("vnni2") == 3 and "[OK]" in out
    assert main(["compile", "mlp", "--precision", "bf16", "--target", "tpp -isa=avx2",
                 "--report", "-o", str(tmp_path / "m.so")]) == 0
    out = capsys.readouterr().out
    assert "precision    : bf16 asked for, but avx2 has no bf16 arithmetic" in out
    assert out.count("float32*float32->float32") == 3
    assert main(["compile", "mlp", "--precision", "bfloat", "-o", str(tmp_path / "m.so")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["tvm-tpp: error: precision must be one of float32, bf16, "
                                "bf16-strict, got 'bfloat'"]


def test_float32_is_unchanged():
    """The default precision builds the float32 kernels, bit-identical to no precision."""
    model = make_dense_model()
    inputs = random_inputs(import_model(model)[1], seed=1)
    default = tvm_tpp.compile(model, untuned=True)
    explicit = tvm_tpp.compile(model, untuned=True, precision="float32")
    np.testing.assert_array_equal(default.run(**inputs)[0], explicit.run(**inputs)[0])
    assert explicit.report[0].dtypes == "float32*float32->float32"


def test_tune_then_compile_in_bf16(tmp_path):
    """bf16 GEMMs are tuning tasks of their own, which the bf16 build then looks up."""
    model = make_dense_model(m=64, k=96, n=64)
    tuned = tvm_tpp.tune(model, work_dir=tmp_path, budget=1.0, top_k=2, precision=STRICT_BF16)
    assert [t.problem.dtype for t in tuned] == ["bfloat16"]
    compiled = tvm_tpp.compile(model, work_dir=tmp_path, precision=STRICT_BF16)
    assert f"[{tuned[0].result.best.spec}" in compiled.report[0].kernel
    assert compiled.report[0].dtypes == BF16
    # "bf16" tunes what its build runs on this host: bf16 GEMMs only with bf16 arithmetic.
    hinted = tvm_tpp.tune(model, work_dir=tmp_path, budget=1.0, top_k=2, precision="bf16")
    bf16_here = kernel_precision("bf16", make_target("tpp")) == "bf16"
    assert [t.problem.dtype for t in hinted] == ["bfloat16" if bf16_here else "float32"]
