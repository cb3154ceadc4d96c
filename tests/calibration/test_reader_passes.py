"""A CalibrationDataReader can be read once: where SmoothQuant would read the data twice (an observer that
needs a second pass, whole-tensor taps), ``calibrate(reader, smoothquant=...)`` is refused before the reader
is read; in one pass it still runs. On the shipped tiny llama, through the Python API."""

from __future__ import annotations

import numpy as np
import pytest


class _Reader:
    """An onnxruntime-style CalibrationDataReader that counts what was read."""

    def __init__(self, arrays, batch=8):
        n = len(next(iter(arrays.values())))
        self._batches = iter([{k: v[i:i + batch] for k, v in arrays.items()} for i in range(0, n, batch)])
        self.calls = 0

    def get_next(self):
        self.calls += 1
        return next(self._batches, None)


def test_reader_with_smoothquant_and_mse_is_refused_before_reading(llama_dir, tmp_path):
    from graphcal import UsageError, calibrate

    reader = _Reader(dict(np.load(llama_dir / "calib.npz")))
    with pytest.raises(UsageError) as e:
        calibrate(llama_dir / "model.onnx", reader, tmp_path / "o", scheme="W8A8_STATIC", smoothquant="norms",
                  observer="mse")
    message = str(e.value)
    assert reader.calls == 0, "the reader was read before the refusal"
    assert "\n" not in message and "read once" in message and "mse" in message, message
    assert "pass the arrays" in message and "static_minmax" in message, message
    assert "make a new one" not in message
    assert not (tmp_path / "o").exists()


def test_reader_with_smoothquant_and_whole_tensor_taps_is_refused(llama_dir, tmp_path):
    from graphcal import UsageError, calibrate

    reader = _Reader(dict(np.load(llama_dir / "calib.npz")))
    with pytest.raises(UsageError, match="reduce_in_graph=False"):
        calibrate(llama_dir / "model.onnx", reader, tmp_path / "o", scheme="W8A8_STATIC", smoothquant="norms",
                  reduce_in_graph=False)
    assert reader.calls == 0


def test_reader_with_smoothquant_in_one_pass_still_runs(llama_dir, tmp_path):
    """static_minmax per tensor (W8A8_STATIC's default) is replayed: one pass, so a reader serves."""
    from graphcal import calibrate

    reader = _Reader(dict(np.load(llama_dir / "calib.npz")))
    result = calibrate(llama_dir / "model.onnx", reader, tmp_path / "o", scheme="W8A8_STATIC", smoothquant="norms")
    assert result.transforms["smoothquant"].mappings and result.num_batches == 8
    assert reader.calls == 9  # eight batches and the None that ends them, read once
