"""NonMaxSuppression (issue 16, item 4): compiles with the tpp target (a fallback schedule rule
that fails on one of its functions leaves it to the next rule, not the build) and selects
exactly what ONNX Runtime selects, for boxes whose corners come in either order, boxes given by
their centres, and ties in the scores."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import tvm_tpp
from tvm_tpp.reference import run_onnxruntime


def _nms(batch: int, classes: int, boxes: int, center: int, max_out: int, iou: float,
         score: float):
    consts = [numpy_helper.from_array(np.array([max_out], "int64"), "max_out"),
              numpy_helper.from_array(np.array([iou], "float32"), "iou"),
              numpy_helper.from_array(np.array([score], "float32"), "score")]
    graph = helper.make_graph(
        [helper.make_node("NonMaxSuppression", ["boxes", "scores", "max_out", "iou", "score"],
                          ["selected"], center_point_box=center)], "nms",
        [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [batch, boxes, 4]),
         helper.make_tensor_value_info("scores", TensorProto.FLOAT, [batch, classes, boxes])],
        [helper.make_tensor_value_info("selected", TensorProto.INT64, [None, 3])], consts)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _draw(case: str, rng: np.random.Generator, shape_boxes, shape_scores):
    if case == "ties":  # integer corners (degenerate boxes too), three score levels
        return (rng.integers(0, 4, shape_boxes).astype("float32"),
                rng.integers(0, 3, shape_scores).astype("float32") / 2)
    boxes = rng.uniform(0, 4, shape_boxes).astype("float32")  # corners in either order
    if case == "centers":
        boxes[..., 2:] = rng.uniform(0.5, 2, (*shape_boxes[:-1], 2))
    return boxes, rng.uniform(0, 1, shape_scores).astype("float32")


@pytest.mark.parametrize("case, center, max_out, iou, score", [
    ("corners", 0, 5, 0.4, 0.2),
    pytest.param("centers", 1, 5, 0.4, 0.2, marks=pytest.mark.slow),  # a build each: budget
    ("ties", 0, 30, 0.3, 0.0)])
def test_selects_what_onnxruntime_selects(case, center, max_out, iou, score):
    batch, classes, boxes = 2, 3, 24
    model = _nms(batch, classes, boxes, center, max_out, iou, score)
    compiled = tvm_tpp.compile(model, target="tpp")
    flipped = 0
    for seed in range(4):
        b, s = _draw(case, np.random.default_rng(seed), (batch, boxes, 4),
                     (batch, classes, boxes))
        flipped += int(np.sum(b[..., 0] > b[..., 2]))
        (got,) = compiled.run(boxes=b, scores=s)
        (want,) = run_onnxruntime(model, {"boxes": b, "scores": s})
        assert len(want) > 3
        np.testing.assert_array_equal(got, want)
    assert case == "centers" or flipped > 0
