"""Pointwise convs on small maps as one row of pixels (:meth:`ConvProblem.one_row`,
:func:`schedules.conv.one_row_pays`): the kernel's tiles span image rows.

Kernels whose tiles cross image rows (odd sizes, two images) against numpy; the problems
that are not one row; and the graph rewrite: a 7x7 map's 1x1 conv reads its input as one row
(a 14x14 map's does not), checked against ONNX Runtime.
"""

import numpy as np
import onnx
import pytest
import tvm
from conftest import pixel_rows
from onnx import TensorProto, helper, numpy_helper

from microkernels import isa
from microkernels.epilogue import Epilogue, EpilogueOp
from microkernels.epilogue import reference as epilogue_reference
from microkernels.machine import Machine
from relay_passes.conv import rewrite_conv
from relay_passes.pipeline import tpp_pipeline
from relay_passes.prepare import prepare
from schedules.conv import ConvConfig, ConvProblem, default_config, one_row_pays, pack_input
from schedules.conv import pack_weight as conv_pack_weight
from schedules.conv import reference as conv_reference
from schedules.conv import schedule as conv_schedule
from tvm_tpp.compiler import CompiledModel, import_model
from tvm_tpp.reference import max_errors, run_onnxruntime
from tvm_tpp.tpp_target import target as make_target

AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
MACHINE = Machine(isa.from_name("avx2"), isa.DEFAULT_CACHES, threads=2)
BIAS_RESIDUAL_RELU = Epilogue((EpilogueOp("bias"), EpilogueOp("residual"), EpilogueOp("relu")))


@pytest.mark.parametrize("bq", [None, 10, 35])  # the default, and tiles across rows of 7
def test_kernel_tiles_span_image_rows(bq):
    problem = ConvProblem(2, 12, 5, 7, 24, 1, 1, epilogue=BIAS_RESIDUAL_RELU)
    flat = problem.one_row()
    assert (flat.n, flat.h, flat.w, flat.rows) == (1, 1, 70, 70)
    config = default_config(flat, MACHINE)
    config = config if bq is None else ConvConfig(bq=bq, bc=12, bk=8, spec="ACDebfg")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 12, 5, 7)).astype("float32")
    w = rng.standard_normal((24, 12, 1, 1)).astype("float32")
    bias = rng.standard_normal(24).astype("float32")
    residual = rng.standard_normal((70, 24)).astype("float32")
    out = tvm.runtime.tensor(np.full((70, 24), np.nan, "float32"))
    kernel = tvm.compile(conv_schedule(flat, config, "avx2").mod, target=AVX2)
    kernel(*map(tvm.runtime.tensor, (pack_input(x, problem).reshape(flat.input_shape),
                                     conv_pack_weight(w, config.bk, flat), bias, residual)),
           out)
    conv = pixel_rows(conv_reference(problem, x, w))
    want = epilogue_reference(BIAS_RESIDUAL_RELU, conv.astype("float32"),
                              {"bias": bias, "residual": residual})
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("problem", [
    ConvProblem(1, 8, 7, 7, 16, 3, 3, padding=1),
    ConvProblem(1, 8, 7, 7, 16, 1, 1, stride=2),
    ConvProblem(1, 8, 7, 7, 16, 1, 1, padding=1),
    ConvProblem(1, 8, 7, 7, 16, 1, 1, groups=2),
    ConvProblem(1, 8, 7, 7, 16, 1, 1, prologue=Epilogue((EpilogueOp("relu"),))),
])
def test_only_pointwise_convs_are_one_row(problem):
    assert not one_row_pays(problem, MACHINE)
    with pytest.raises(ValueError, match="pointwise"):
        problem.one_row()


def test_rows_of_seven_pay_rows_of_fourteen_do_not():
    assert one_row_pays(ConvProblem(1, 512, 7, 7, 2048, 1, 1), MACHINE)
    assert one_row_pays(ConvProblem(8, 2048, 7, 7, 512, 1, 1), MACHINE)
    assert not one_row_pays(ConvProblem(1, 256, 14, 14, 1024, 1, 1), MACHINE)
    # The one-row default takes all 49 pixels: tiles of 6 and 5 rows, not 4 and 3.
    assert default_config(ConvProblem(1, 512, 7, 7, 2048, 1, 1).one_row(), MACHINE).bq == 49


def _model(batch: int, hw: int) -> onnx.ModelProto:
    """``relu(conv1x1(x) + b + x')`` with ``x' = relu(conv1x1(x))``: a residual chain."""
    rng = np.random.default_rng(1)
    weights = {"w0": rng.standard_normal((40, 24, 1, 1)) / 5, "b0": rng.normal(0, 0.1, 40),
               "w1": rng.standard_normal((40, 24, 1, 1)) / 5, "b1": rng.normal(0, 0.1, 40)}
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["c0"]),
             helper.make_node("Relu", ["c0"], ["r0"]),
             helper.make_node("Conv", ["x", "w1", "b1"], ["c1"]),
             helper.make_node("Add", ["c1", "r0"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 24, hw, hw])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 40, hw, hw])],
        [numpy_helper.from_array(v.astype("float32"), k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("batch,hw,one_row", [(1, 7, True), (2, 7, True), (1, 14, False)])
def test_graph_reads_small_maps_as_one_row(batch, hw, one_row):
    model = _model(batch, hw)
    tgt = make_target("tpp -isa=avx2")
    mod, specs = import_model(model)
    mod = rewrite_conv(prepare()(mod), tgt, [])
    inputs = [func.params[0].ty.shape for gv, func in mod.functions.items()
              if "conv2d" in gv.name_hint]
    rows = batch * hw * hw
    assert len(inputs) == 2
    assert all([int(d) for d in shape] == ([1, 1, rows, 24] if one_row else [batch, hw, hw, 24])
               for shape in inputs)
    executable = tvm.compile(mod, target=tgt, relax_pipeline=tpp_pipeline(tgt))
    x = np.random.default_rng(2).standard_normal((batch, 24, hw, hw)).astype("float32")
    _, rel = max_errors(CompiledModel(executable, tgt, specs).run(x=x),
                        run_onnxruntime(model, {"x": x}))
    assert rel <= 1e-5
