"""``CompiledModel.profile()`` and ``tvm-tpp profile``: time per operator, grouped by kind.

No timing is asserted: only what was called, how it is classified and that shares add up.
"""

import json

import numpy as np
import pytest

import tvm_tpp
from tvm_tpp import models
from tvm_tpp.cli import main
from tvm_tpp.profiling import KIND_NAMES, KINDS, Profile, operator_kind


@pytest.fixture(scope="module")
def mlp_profile():
    compiled = tvm_tpp.compile(models.load("mlp"), target="tpp", untuned=True)
    return compiled, compiled.profile(repeat=3)


def test_the_bundled_mlp_is_mostly_tpp_kernels(mlp_profile):
    _, prof = mlp_profile
    assert isinstance(prof, Profile) and prof.repeat == 3
    assert set(prof.seconds) == set(prof.shares) == set(KINDS)
    assert sum(prof.shares.values()) == pytest.approx(1.0)
    assert sum(o.share for o in prof.operators) == pytest.approx(1.0)
    assert prof.shares["tpp"] > 0 and prof.seconds["builtin"] > 0
    kernels = [o for o in prof.operators if o.kind == "tpp"]
    assert len(kernels) == 3 and all(o.calls == 1 for o in kernels)  # three dense layers
    assert {o.kind for o in prof.operators} >= {"tpp", "builtin"}
    assert [o.seconds for o in prof.operators] == sorted((o.seconds for o in prof.operators),
                                                         reverse=True)
    assert prof.measured_seconds == pytest.approx(sum(prof.seconds.values()))
    assert prof.run_seconds > 0 and prof.latency_seconds > 0
    json.dumps(prof.to_json())


def test_profile_takes_inputs_by_name(mlp_profile):
    compiled, _ = mlp_profile
    x = np.zeros(compiled.inputs[0].shape, "float32")
    assert compiled.profile({"x": x}, repeat=1).operators
    with pytest.raises(ValueError, match="inputs must be exactly"):
        compiled.profile({"y": x})
    with pytest.raises(ValueError, match="repeat"):
        compiled.profile(repeat=0)


@pytest.mark.parametrize(("name", "kind"), [
    ("tpp_batch_matmul_12x128x128x64_txb12_scale", "tpp"),
    ("tpp_conv2d_1x16x48x48_96x1x1_s1x1_bias", "tpp"),
    ("fused_transpose_pad_strided_slice_strided_slice1_strided_slice2_concatenate", "layout"),
    ("layout_transform3", "layout"),
    ("fused_reshape2_astype", "layout"),
    ("pad1", "layout"),
    ("fused_reshape5_transpose7_maximum3_minimum3_transpose8", "tvm"),
    ("softmax", "tvm"),
    ("layer_norm", "tvm"),
    ("vm.builtin.alloc_tensor", "builtin"),
    ("vm.builtin.reshape", "builtin"),
])
def test_operator_kinds(name, kind):
    assert operator_kind(name) == kind


def test_cli_prints_the_tables(capsys, tmp_path):
    out_json = tmp_path / "p.json"
    # --top large enough for every operator: which ones are slowest depends on the timing.
    assert main(["profile", "mlp", "--repeat", "2", "--top", "100", "--json",
                 str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "slowest operators" in out and "by kind" in out
    assert "tpp_dense_1x1024x512_bias_relu" in out
    for name in KIND_NAMES.values():
        assert name in out
    assert "total in calls" in out and "100.0%" in out
    stored = json.loads(out_json.read_text())
    assert sum(stored["shares"].values()) == pytest.approx(1.0)


def test_cli_bad_model_is_one_error_line(capsys, tmp_path):
    assert main(["profile", str(tmp_path / "missing.onnx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tvm-tpp: error:")
