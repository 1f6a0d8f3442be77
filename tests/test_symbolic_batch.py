"""A symbolic batch (issue 15, item 5): a model whose first input dimension is symbolic
compiles once and runs at any batch size, its TPP kernels taking the batch as a run-time loop
extent around static blocks: convs and depthwise convs loop over images, dense layers over
samples (``[n, S, K]``) or over zero-padded blocks of rows (``[n, K]``), attention's batch
GEMMs over samples' heads; float32, bf16 and QDQ int8.  Each case is compared with ONNX
Runtime at several batch sizes, odd ones included."""

import numpy as np
import onnx
import pytest
import tvm
from conftest import INT8_KERNELS, make_dense_model, pixel_rows
from onnx import TensorProto, helper, numpy_helper

import tvm_tpp
from microkernels.machine import host
from schedules import conv, gemm
from schedules.loop_spec import LoopSpecError
from tvm_tpp import models
from tvm_tpp.errors import ModelError
from tvm_tpp.quantized import quantize_static_qdq
from tvm_tpp.reference import TOLERANCES, max_errors, random_inputs, run_onnxruntime
from tvm_tpp.tpp_target import target


def _assert_matches(compiled, model, batches, tolerance=1e-4, optimize=True):
    for batch in batches:
        inputs = random_inputs(compiled.inputs, seed=batch, batch=batch)
        outputs = compiled.run(**inputs)
        assert outputs[0].shape[0] == batch
        _, rel = max_errors(outputs, run_onnxruntime(model, inputs, optimize=optimize))
        assert rel <= tolerance, (batch, rel)


def _kernels(compiled):
    return [r.kernel for r in compiled.report if r.kernel]


#: The run-time batch's dense kernel in the default nest: one row block and one column block
#: (40 columns are 5 blocks on AVX2, 1 on AVX-512), in either order, nothing split.
UNTUNED_DENSE = {f"tpp_dense_n8x40x24_bias_relu [{spec}]" for spec in ("CBa", "BCa")}


def _dense_with_residual(rows: tuple, k: int = 24, n: int = 40) -> onnx.ModelProto:
    """relu(x @ W + b + r) with x ``[*rows, K]`` and the residual r an input too."""
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((k, n)).astype("float32"), "W")
    b = numpy_helper.from_array(rng.standard_normal(n).astype("float32"), "b")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"]),
             helper.make_node("Add", ["mm", "b"], ["biased"]),
             helper.make_node("Add", ["biased", "r"], ["summed"]),
             helper.make_node("Relu", ["summed"], ["y"])]
    graph = helper.make_graph(
        nodes, "dense_residual",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [*rows, k]),
         helper.make_tensor_value_info("r", TensorProto.FLOAT, [*rows, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*rows, n])], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_gemm_kernel_loops_over_run_time_row_blocks():
    problem = gemm.GemmProblem(8, 40, 24)
    config = gemm.default_config(problem, host())
    batch = tvm.tirx.Var("batch", "int32")
    func = gemm.schedule(problem, config, "avx2", batch).mod["main"]
    assert func.params[-2].name == "batch"  # the scalar before the output
    lib = tvm.compile(tvm.IRModule({"main": func}), target=target("tpp"))
    rng = np.random.default_rng(0)
    w = rng.standard_normal((24, 40)).astype("float32")
    for blocks in (1, 3):
        x = rng.standard_normal((blocks * 8, 24)).astype("float32")
        y = tvm.runtime.empty((blocks * 8, 40), "float32")
        lib["main"](tvm.runtime.tensor(x),
                    tvm.runtime.tensor(gemm.pack_weight(w, config.bn, problem)), blocks, y)
        np.testing.assert_allclose(y.numpy(), x @ w, rtol=1e-5, atol=1e-5)


def test_conv_kernel_loops_over_run_time_images():
    problem = conv.ConvProblem(1, 8, 5, 7, 16, 3, 3, padding=1)
    config = conv.default_config(problem, host())
    batch = tvm.tirx.Var("batch", "int32")
    func = conv.schedule(problem, config, "avx2", batch).mod["main"]
    lib = tvm.compile(tvm.IRModule({"main": func}), target=target("tpp"))
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 8, 3, 3)).astype("float32")
    for images in (1, 3):
        p = conv.ConvProblem(images, 8, 5, 7, 16, 3, 3, padding=1)
        x = rng.standard_normal((images, 8, 5, 7)).astype("float32")
        y = tvm.runtime.empty((p.rows, 16), "float32")
        lib["main"](tvm.runtime.tensor(conv.pack_input(x, p)),
                    tvm.runtime.tensor(conv.pack_weight(w, config.bk, p)), images, y)
        want = pixel_rows(conv.reference(p, x, w))
        np.testing.assert_allclose(y.numpy(), want, rtol=1e-4, atol=1e-4)


def test_a_nest_that_splits_the_run_time_loop_is_refused():
    problem = gemm.GemmProblem(16, 40, 24)
    config = gemm.GemmConfig.of("bCab", 8, 40, 24, block_steps={"b": (2,)})
    with pytest.raises(LoopSpecError, match="run-time batch"):
        gemm.schedule(problem, config, "avx2", tvm.tirx.Var("batch", "int32"))


def test_dense_matrix_runs_any_batch_in_padded_row_blocks():
    model = make_dense_model(k=24, n=40, batch_dim="N")
    compiled = tvm_tpp.compile(model)
    assert compiled.inputs[0].shape == ("N", 24)
    (kernel,) = _kernels(compiled)
    assert kernel in UNTUNED_DENSE
    _assert_matches(compiled, model, (1, 7, 8, 9, 17))


@pytest.mark.parametrize("rows, kernel", [(("N",), "tpp_dense_n8x40x24"),
                                          (("N", 5), "tpp_dense_n5x40x24")])
def test_dense_residual_follows_the_rows(rows, kernel):
    model = _dense_with_residual(rows)
    compiled = tvm_tpp.compile(model)
    assert _kernels(compiled)[0].startswith(f"{kernel}_bias_residual_relu")
    _assert_matches(compiled, model, (1, 3, 9))


@pytest.mark.parametrize("name, options, batches", [
    pytest.param("resnet_small", dict(image=32, widths=(16, 32)), (1, 3),
                 marks=pytest.mark.slow),  # its convs' batch loop: the int8 case below has it
    pytest.param("mobilenet_v2", dict(image=32, stem=8, blocks=((1, 8, 1, 1), (6, 16, 2, 2)),
                                      head=32), (2, 5), marks=pytest.mark.slow),
    ("bert", dict(seq=16, hidden=64, heads=4, ffn=128), (1, 3)),
])
def test_network_compiles_once_and_runs_any_batch(name, options, batches):
    model = models.load(name, batch="N", **options)
    compiled = tvm_tpp.compile(model)
    assert compiled.inputs[0].batch == "N"
    assert compiled.tpp_flops_fraction >= 0.95, [r for r in compiled.report if not r.kernel]
    # Every kernel takes the batch at run time ("n" in its name): none was built per size.
    assert all("_n" in kernel.split()[0] for kernel in _kernels(compiled)), _kernels(compiled)
    _assert_matches(compiled, model, batches)


@pytest.mark.slow  # the float32 and int8 cases cover the same kernels' batch loop
def test_bf16_network_runs_any_batch():
    model = models.load("resnet_small", batch="N", image=32, widths=(16, 32))
    compiled = tvm_tpp.compile(model, precision="bf16-strict")
    assert {r.dtypes for r in compiled.report if r.kernel} == {"bfloat16*bfloat16->float32"}
    _assert_matches(compiled, model, (1, 3), TOLERANCES["bf16"])


def test_quantized_network_runs_any_batch_on_int8_kernels(tmp_path):
    float_model = models.load("resnet_small", image=32, widths=(16, 32))
    model = models.symbolic_batch(onnx.load(str(quantize_static_qdq(float_model,
                                                                    tmp_path / "q.onnx"))))
    compiled = tvm_tpp.compile(model, target=INT8_KERNELS)
    assert compiled.tpp_flops_fraction == 1.0
    assert {r.dtypes for r in compiled.report if r.kernel} == {"uint8*int8->int32"}
    # The int8 reference: the QDQ graph run unfused (ONNX's roundings, exact on any host).
    _assert_matches(compiled, model, (1, 3), TOLERANCES["int8"], optimize=False)


def test_inputs_sharing_a_batch_must_agree():
    compiled = tvm_tpp.compile(_dense_with_residual(("N",)))
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="input 'r' must be float32\\[2, 40\\]"):
        compiled.run(x=rng.standard_normal((2, 24)).astype("float32"),
                     r=rng.standard_normal((3, 40)).astype("float32"))


def test_export_and_load_keep_the_symbolic_batch(tmp_path):
    compiled = tvm_tpp.compile(make_dense_model(batch_dim="N"))
    loaded = tvm_tpp.load(compiled.export(tmp_path / "dense.so"))
    assert loaded.inputs == compiled.inputs
    inputs = random_inputs(loaded.inputs, seed=5, batch=5)
    np.testing.assert_array_equal(loaded.run(**inputs)[0], compiled.run(**inputs)[0])


def test_given_shape_still_compiles_a_static_batch():
    compiled = tvm_tpp.compile(make_dense_model(batch_dim="N"), input_shapes={"x": (16, 24)})
    assert compiled.inputs[0].shape == (16, 24)
    assert _kernels(compiled)[0].startswith("tpp_dense_16x40x24")


def test_shapes_computed_from_a_symbolic_batch_ask_for_a_size():
    from test_exported_files import _exported

    model = models.symbolic_batch(_exported())
    with pytest.raises(ModelError, match=r"computes shapes from the symbolic batch 'N': compile "
                                         r"it for a batch size, e\.g\. --shape x=1,3,"):
        tvm_tpp.compile(model)
    compiled = tvm_tpp.compile(model, input_shapes={"x": (2, 3, 5, 7)})
    _assert_matches(compiled, model, (2,))


def test_a_tuned_nest_that_splits_the_run_time_loop_gives_way_to_the_default(tmp_path):
    from microkernels.epilogue import Epilogue, EpilogueOp
    from schedules.tuner import Database, TuningKey
    from tvm_tpp.compiler import DATABASE

    problem = gemm.GemmProblem(8, 40, 24, "float32",
                               Epilogue((EpilogueOp("bias"), EpilogueOp("relu")))).on("avx2")
    splitting = gemm.GemmConfig.of("bCab", 4, 40, 24, block_steps={"b": (1,)})
    tgt = target("tpp")
    Database(tmp_path / DATABASE).put(TuningKey.of(problem, tgt), splitting)
    model = make_dense_model(k=24, n=40, batch_dim="N")
    static = tvm_tpp.compile(make_dense_model(m=8, k=24, n=40), work_dir=tmp_path)
    assert "[bCab]" in _kernels(static)[0]  # the tuned nest, where the rows are static
    compiled = tvm_tpp.compile(model, work_dir=tmp_path)
    (kernel,) = _kernels(compiled)
    assert kernel in UNTUNED_DENSE
    _assert_matches(compiled, model, (1, 9))
