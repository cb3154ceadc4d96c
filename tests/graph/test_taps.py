"""graph.taps: the GRAM reduction (GPTQ's x^T x, computed inside onnxruntime) against numpy."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from graphcal.graph.taps import Reduction, TapRequest, build_tapped, gram, gram_chunks


def _model(columns: int, rank: int, elem=TensorProto.FLOAT) -> onnx.ModelProto:
    shape = ["b", "s", columns] if rank == 3 else ["t", columns]
    x = helper.make_tensor_value_info("x", elem, shape)
    y = helper.make_tensor_value_info("y", elem, shape)
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Neg", ["h"], ["y"])],
                              "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("columns, rank", [(64, 3), (600, 3), (1024, 2), (1100, 3)])
def test_gram_is_x_transpose_x(columns, rank):
    model = _model(columns, rank)
    request = TapRequest("h", Reduction.GRAM, columns)
    tapped = build_tapped(model, [request])
    assert len(tapped.outputs[request]) == len(gram_chunks(columns)) * (len(gram_chunks(columns)) + 1) // 2 + 1
    session = ort.InferenceSession(tapped.model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 17, columns) if rank == 3 else (40, columns)).astype(np.float32)
    values = dict(zip(tapped.fetch, session.run(tapped.fetch, {"x": x})))
    got, sequences = gram([torch.from_numpy(values[n]) for n in tapped.outputs[request]], columns)
    rows = np.maximum(x, 0).reshape(-1, columns).astype(np.float64)
    np.testing.assert_allclose(got.numpy(), rows.T @ rows, rtol=1e-5, atol=1e-3)
    assert torch.equal(got, got.T)  # the mirrored blocks are the computed ones, transposed
    assert sequences == (3 if rank == 3 else 1)


def test_gram_of_a_half_precision_tensor_is_summed_in_fp32():
    model = _model(96, 3, TensorProto.FLOAT16)
    request = TapRequest("h", Reduction.GRAM, 96)
    tapped = build_tapped(model, [request])
    session = ort.InferenceSession(tapped.model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.full((2, 300, 96), 20.0, dtype=np.float16)  # x^T x = 600 * 400 = 240000: past fp16's 65504
    values = dict(zip(tapped.fetch, session.run(tapped.fetch, {"x": x})))
    got, _ = gram([torch.from_numpy(values[n]) for n in tapped.outputs[request]], 96)
    assert got.dtype == torch.float32 and float(got[0, 0]) == 240000.0
