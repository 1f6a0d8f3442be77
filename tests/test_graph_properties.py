"""Property tests of the graph level (issue 16, item 5): random small ONNX graphs compile with
the tpp target and match ONNX Runtime, or stay with TVM with a reason in the report — never an
exception.

Each drawn graph is a chain over one activation ``x``: MatMul / Gemm (transposed weights, M or
N = 1, prime sizes), Conv (groups: none, two, one per channel; dilation, strides, asymmetric
pads, 1x1 and kxk), Add/Mul of a broadcast constant, Relu / Clip / Sigmoid, Transpose and
Reshape, max / average / global pooling and Concat.  The default run draws a few
examples per property (CI); ``TPP_PROPERTY_EXAMPLES=500 pytest tests/test_graph_properties.py``
is the long run.
"""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import tvm_tpp
from tvm_tpp.reference import max_errors, run_onnxruntime

EXAMPLES = int(os.environ.get("TPP_PROPERTY_EXAMPLES", "4"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
SIZES = st.sampled_from([1, 2, 3, 5, 7, 13, 16, 31, 64])


class _Graph:
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng, self.nodes, self.inits, self.count = rng, [], [], 0

    def const(self, shape, scale=0.3) -> str:
        name = f"c{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(
            (self.rng.standard_normal(shape) * scale).astype("float32"), name))
        return name

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        self.count += 1
        out = f"t{self.count}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out

    def model(self, x_shape, y: str):
        """The model, its output's shape taken from ONNX's shape inference."""
        from onnx import shape_inference

        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)
        probe = helper.make_model(
            helper.make_graph(self.nodes, "g", [x], [helper.make_tensor_value_info(
                y, TensorProto.FLOAT, None)], self.inits),
            opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        (output,) = shape_inference.infer_shapes(probe, strict_mode=True).graph.output
        graph = helper.make_graph(self.nodes, "g", [x], [output], self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                 ir_version=8)


def _check(model, x_shape, seed: int) -> None:
    """Compiles, and matches ONNX Runtime; every matched operator is a kernel or a reason."""
    compiled = tvm_tpp.compile(model, target="tpp")
    assert all(r.kernel or r.reason for r in compiled.report)
    x = np.random.default_rng(seed).standard_normal(x_shape).astype("float32")
    got, want = compiled.run(x=x), run_onnxruntime(model, {"x": x})
    assert max_errors(got, want)[1] <= 1e-4


@SETTINGS
@given(m=SIZES, k=SIZES, n=SIZES, gemm=st.booleans(), trans_b=st.booleans(),
       act=st.sampled_from(["", "Relu", "Sigmoid", "Clip"]), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_dense_chains(m, k, n, gemm, trans_b, act, bias, seed):
    g = _Graph(np.random.default_rng(seed))
    if gemm:
        w = g.const((n, k) if trans_b else (k, n))
        y = g.op("Gemm", ["x", w, *([g.const((n,))] if bias else [])], transB=int(trans_b))
    else:
        y = g.op("MatMul", ["x", g.const((k, n))])
        if bias:
            y = g.op("Add", [y, g.const((n,))])
    if act == "Clip":
        y = g.op("Clip", [y, g.const(()), g.const(())])
    elif act:
        y = g.op(act, [y])
    _check(g.model([m, k], y), [m, k], seed)


@SETTINGS
@given(c=st.sampled_from([1, 3, 4, 8, 12]), k_mult=st.sampled_from([1, 2, 3]),
       size=st.sampled_from([5, 7, 9]), kernel=st.sampled_from([1, 3, 5]),
       stride=st.sampled_from([1, 2]), pads=st.tuples(*[st.integers(0, 2)] * 4),
       grouping=st.sampled_from(["none", "per_channel", "two"]),
       dilation=st.sampled_from([1, 2]), act=st.sampled_from(["", "Relu", "Sigmoid"]),
       post=st.sampled_from(["", "Transpose", "Reshape", "MulAdd"]),
       seed=st.integers(0, 2**16))
def test_conv_chains(c, k_mult, size, kernel, stride, pads, grouping, dilation, act, post,
                     seed):
    span = (kernel - 1) * dilation + 1
    assume(size + min(pads[0] + pads[2], pads[1] + pads[3]) >= span)
    g = _Graph(np.random.default_rng(seed))
    groups = {"none": 1, "per_channel": c, "two": 2 if c % 2 == 0 else 1}[grouping]
    k = groups * k_mult if groups > 1 else 4 * k_mult
    y = g.op("Conv", ["x", g.const((k, c // groups, kernel, kernel)), g.const((k,))],
             strides=[stride] * 2, pads=list(pads), group=groups, dilations=[dilation] * 2)
    if act:
        y = g.op(act, [y])
    if post == "Transpose":
        y = g.op("Transpose", [y], perm=[0, 2, 3, 1])
    elif post == "Reshape":
        shape = numpy_helper.from_array(np.array([1, -1], "int64"), "shape")
        g.inits.append(shape)
        y = g.op("Reshape", [y, "shape"])
    elif post == "MulAdd":
        y = g.op("Add", [g.op("Mul", [y, g.const((k, 1, 1))]), g.const((1, k, 1, 1))])
    _check(g.model([1, c, size, size], y), [1, c, size, size], seed)


@SETTINGS
@given(c=st.sampled_from([3, 4, 8, 16]), size=st.sampled_from([6, 7, 9]),
       pool=st.sampled_from(["MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"]),
       pool_kernel=st.sampled_from([2, 3]), pool_stride=st.sampled_from([1, 2]),
       pool_pad=st.sampled_from([0, 1]),
       broadcast=st.sampled_from(["channel", "scalar", "width", "full"]),
       arith=st.sampled_from(["Add", "Mul"]), concat=st.booleans(),
       clip=st.booleans(), seed=st.integers(0, 2**16))
def test_pooling_concat_broadcast_chains(c, size, pool, pool_kernel, pool_stride, pool_pad,
                                        broadcast, arith, concat, clip, seed):
    """conv -> pooling -> (concat with a second conv's pooled branch) -> Add/Mul of a
    broadcast constant -> (Clip): the data movement between kernels."""
    assume(pool_pad < pool_kernel)
    g = _Graph(np.random.default_rng(seed))
    global_pool = pool.startswith("Global")
    attrs = {} if global_pool else dict(kernel_shape=[pool_kernel] * 2,
                                        strides=[pool_stride] * 2, pads=[pool_pad] * 4)
    branches = []
    for _ in range(2 if concat else 1):
        y = g.op("Relu", [g.op("Conv", ["x", g.const((8, c, 3, 3)), g.const((8,))],
                               pads=[1] * 4)])
        branches.append(g.op(pool, [y], **attrs))
    y = g.op("Concat", branches, axis=1) if concat else branches[0]
    channels = 8 * len(branches)
    out = 1 if global_pool else (size + 2 * pool_pad - pool_kernel) // pool_stride + 1
    shape = {"channel": (channels, 1, 1), "scalar": (1,), "width": (out,),
             "full": (1, channels, out, out)}[broadcast]
    y = g.op(arith, [y, g.const(shape)])
    if clip:
        y = g.op("Clip", [y, g.const(()), g.const(())])
    _check(g.model([1, c, size, size], y), [1, c, size, size], seed)
