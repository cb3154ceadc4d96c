"""An inline model read lazily (graph.wire): its large weights referenced where they lie in its file.

References: onnx's own loader (the tensors' bytes), and graphcal reading the same file whole (the
written outputs and eval's numbers must not change with the lazy read)."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import graphcal
import graphcal.graph.io as io
from graphcal.evaluation import evaluate
from graphcal.graph.external import is_external, read_tensor_bytes
from graphcal.graph.wire import strip_inline_weights


@pytest.fixture
def small_threshold(monkeypatch):
    """The shipped models' weights are under the 1 MB lazy threshold: lower it so they are referenced."""
    monkeypatch.setattr(io, "LAZY_MIN_BYTES", 1024)


def test_referenced_bytes_are_the_tensors_onnx_loads(llama_dir, small_threshold):
    whole = {t.name: t for t in onnx.load(llama_dir / "model.onnx").graph.initializer}
    model, files = io.load_model_info(llama_dir / "model.onnx", lazy=True)
    lazy = [t for t in model.graph.initializer if is_external(t)]
    assert files == () and len(lazy) >= 10  # the model file is no data file of its own
    for t in model.graph.initializer:
        expected = numpy_helper.to_array(whole[t.name])
        if is_external(t):
            got = np.frombuffer(read_tensor_bytes(t, llama_dir), dtype=expected.dtype).reshape(expected.shape)
        else:
            assert len(t.raw_data or b"") < 1024 or not t.HasField("raw_data")
            got = numpy_helper.to_array(t)
        np.testing.assert_array_equal(got, expected)
    assert len(model.SerializeToString()) < 0.2 * (llama_dir / "model.onnx").stat().st_size


@pytest.mark.parametrize("cut", [1, 7, 100, -3, -1000])
def test_a_truncated_or_corrupt_file_falls_back_to_the_ordinary_read(llama_dir, tmp_path, cut):
    data = (llama_dir / "model.onnx").read_bytes()
    path = tmp_path / "model.onnx"
    path.write_bytes(data[:cut] if cut > 0 else data[:cut] + b"\xff\xff\xff")
    with open(path, "rb") as f:
        assert strip_inline_weights(f.fileno(), path.name, 1024) is None or cut < 0
    with pytest.raises(graphcal.GraphcalError, match="not a readable ONNX model|model"):
        io.load_model_info(path, lazy=True)


def test_run_and_eval_give_the_same_bytes_and_numbers_read_lazily(llama_dir, tmp_path, monkeypatch):
    model = tmp_path / "in" / "model.onnx"
    model.parent.mkdir()
    shutil.copy(llama_dir / "model.onnx", model)
    outputs = {}
    for label, threshold in (("whole", 1 << 40), ("lazy", 1024)):
        monkeypatch.setattr(io, "LAZY_MIN_BYTES", threshold)
        for scheme in ("W8A8_STATIC", "W4A16"):
            out = tmp_path / f"{label}-{scheme}"
            graphcal.calibrate(model, llama_dir / "calib.npz", scheme=scheme, output_dir=out)
            outputs[label, scheme] = {f.name: f.read_bytes() for f in out.iterdir()}
        report = evaluate(model, tmp_path / f"{label}-W8A8_STATIC" / "model.onnx", llama_dir / "heldout.npz")
        outputs[label, "eval"] = report.as_dict()
    for key in ("W8A8_STATIC", "W4A16", "eval"):
        assert outputs["lazy", key] == outputs["whole", key], key
    assert model.read_bytes() == (llama_dir / "model.onnx").read_bytes()  # the input is never modified
