"""The weight phase written tensor by tensor (graph.spill): each tensor the Q/DQ writer makes goes to the output's
data file as it is made. Checked against the writer that keeps them in memory until the model is saved (the path
every model below graph.spill.STREAM_MIN_BYTES takes): the same tensors, the same outputs in onnxruntime; an
interrupted run leaves nothing; the proto held between weights keeps no large tensor; float weights kept
(fp16, bf16) are copied bit for bit."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphcal
from graphcal.graph import spill as spill_module
from graphcal.graph.external import is_external
from graphcal.graph.io import save_with_external_data
from graphcal.graph.qdq import QDQWriter
from graphcal.graph.spill import SPILL_MIN_BYTES, DataSpill
from graphcal.runtime import run_model
from tools.lib import decoder

SHAPE = decoder.DecoderShape(hidden=128, layers=2, intermediate=256, heads=4, kv_heads=2, vocab=128)


def feeds(batch=2, seq=8):
    ids = np.random.default_rng(1).integers(0, SHAPE.vocab, (batch, seq), dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones((batch, seq), dtype=np.int64)}


@pytest.fixture(scope="module", params=["float32", "float16"])
def made(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return decoder.make_decoder(folder, SHAPE, dtype=request.param, seed=2)


def calibrate(model, out, scheme, streamed: bool, monkeypatch):
    monkeypatch.setattr(spill_module, "STREAM_MIN_BYTES", 0 if streamed else 1 << 62)
    return graphcal.calibrate(model, feeds(), out, scheme=scheme)


def tensors(path) -> dict[str, np.ndarray]:
    model = onnx.load(str(path))
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.parametrize("scheme", ["W4A16", "W8A8"])
def test_streamed_output_equals_the_in_memory_one(made, scheme, tmp_path, monkeypatch):
    kept = calibrate(made, tmp_path / "kept", scheme, False, monkeypatch)
    streamed = calibrate(made, tmp_path / "streamed", scheme, True, monkeypatch)
    assert {f.name for f in kept.files} == {f.name for f in streamed.files}
    a, b = tensors(tmp_path / "kept" / "model.onnx"), tensors(tmp_path / "streamed" / "model.onnx")
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name
    graph = onnx.load(str(tmp_path / "streamed" / "model.onnx"), load_external_data=False)
    assert any(is_external(t) for t in graph.graph.initializer)
    if scheme == "W8A8" and "float16" in str(made):
        return  # onnxruntime's CPU provider has no float16 DequantizeLinear (either way): the tensors above suffice
    for x, y in zip(run_model(tmp_path / "kept" / "model.onnx", feeds()), run_model(tmp_path / "streamed" / "model.onnx", feeds()),
                    strict=True):
        np.testing.assert_array_equal(x, y)


def test_the_proto_keeps_no_large_tensor_between_weights(made, tmp_path, monkeypatch):
    seen = []
    original = QDQWriter.quantize_weight

    def checked(self, item, weight):
        original(self, item, weight)
        made_here = [t for t in self.edits.inits if not is_external(t) and len(t.raw_data) >= SPILL_MIN_BYTES]
        held = [t for t in self.graph.initializer if not is_external(t) and len(t.raw_data) >= 1 << 20]
        seen.append(len(self.edits.inits))
        assert not made_here and not held, [t.name for t in made_here + held]

    monkeypatch.setattr(QDQWriter, "quantize_weight", checked)
    calibrate(made, tmp_path / "out", "W4A16", True, monkeypatch)
    assert len(seen) == 7 * SHAPE.layers and seen[-1] > 0


def test_an_interrupted_write_leaves_nothing(made, tmp_path, monkeypatch):
    calls = []
    original = QDQWriter.quantize_weight

    def failing(self, item, weight):
        calls.append(item)
        if len(calls) == 5:
            assert any(f.name == "model.onnx.data" for f in (tmp_path / "runs").rglob("*"))  # the data file was being written
            raise RuntimeError("injected")
        original(self, item, weight)

    (tmp_path / "runs").mkdir()
    monkeypatch.setattr(QDQWriter, "quantize_weight", failing)
    with pytest.raises(RuntimeError, match="injected"):
        calibrate(made, tmp_path / "runs" / "out", "W4A16", True, monkeypatch)
    left = [p for p in (tmp_path / "runs").rglob("*") if not p.name.endswith(".graphcal-lock")]
    assert left == []


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT])
def test_float_tensors_are_copied_bit_for_bit(dtype, tmp_path):
    rng = np.random.default_rng(0)
    values = rng.standard_normal((64, 32)).astype(np.float32)
    np_type = {TensorProto.FLOAT16: np.float16, TensorProto.BFLOAT16: ml_dtypes.bfloat16, TensorProto.FLOAT: np.float32}[dtype]
    raw = values.astype(np_type).tobytes()
    kept = helper.make_tensor("kept", dtype, [64, 32], raw, raw=True)
    codes_array = rng.integers(0, 255, (64, 32), dtype=np.uint8)
    codes = numpy_helper.from_array(codes_array, "codes")
    small = numpy_helper.from_array(np.ones(4, np.float32), "small")
    graph = helper.make_graph([helper.make_node("Identity", ["kept"], ["y"]), helper.make_node("Identity", ["codes"], ["z"])],
                              "g", [], [helper.make_tensor_value_info("y", dtype, [64, 32]),
                                        helper.make_tensor_value_info("z", TensorProto.UINT8, [64, 32])], [kept, small])
    model = helper.make_model(graph)
    folder = tmp_path / "out"
    folder.mkdir()
    spill = DataSpill(folder / "model.onnx.data")
    codes, small = spill.take([codes, small])  # made by the writer: codes spilled, the small one kept in the proto
    assert is_external(codes) and not is_external(small)
    model.graph.initializer.append(codes)
    save_with_external_data(model, folder / "model.onnx", spill=spill)
    back = onnx.load(str(folder / "model.onnx"))
    by_name = {t.name: t for t in back.graph.initializer}
    assert by_name["kept"].data_type == dtype and by_name["kept"].raw_data == raw
    np.testing.assert_array_equal(numpy_helper.to_array(by_name["codes"]), codes_array)
    assert os.path.getsize(folder / "model.onnx.data") == len(raw) + 64 * 32
