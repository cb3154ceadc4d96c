"""Calibration data: validation from headers, batching, folders, and the errors users see."""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcal.data import InputSpec, load_data
from graphcal.errors import GraphcalError, UsageError

SPECS = [
    InputSpec("input_ids", np.dtype(np.int64), ("batch", "seq")),
    InputSpec("attention_mask", np.dtype(np.int64), ("batch", "seq")),
]


def _arrays(n=10, seq=6):
    ids = np.arange(n * seq, dtype=np.int64).reshape(n, seq)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def _save(path, arrays):
    np.savez(path, **arrays)
    return path


def test_batches_cover_the_samples_in_order(tmp_path):
    data = load_data(_save(tmp_path / "c.npz", _arrays(10)), SPECS, batch_size=4)
    batches = list(data.batches())
    assert [b["input_ids"].shape[0] for b in batches] == [4, 4, 2] and data.num_batches == 3
    np.testing.assert_array_equal(np.concatenate([b["input_ids"] for b in batches]), _arrays(10)["input_ids"])


def test_folder_of_files_with_different_sequence_lengths(tmp_path):
    _save(tmp_path / "a.npz", _arrays(3, seq=4))
    _save(tmp_path / "b.npz", _arrays(5, seq=9))
    data = load_data(tmp_path, SPECS, batch_size=2, num_samples=6)
    shapes = [b["input_ids"].shape for b in data.batches()]
    assert shapes == [(2, 4), (1, 4), (2, 9), (1, 9)] and data.num_samples == 6 and data.num_batches == 4


def test_fixed_batch_dimension_sets_the_batch_and_drops_a_short_tail(tmp_path):
    specs = [InputSpec("x", np.dtype(np.float32), (2, 3))]
    data = load_data({"x": np.zeros((5, 3), np.float32)}, specs)
    assert data.batch_size == 2 and [b["x"].shape for b in data.batches()] == [(2, 3), (2, 3)]
    with pytest.raises(UsageError, match="fixed at 2"):
        load_data({"x": np.zeros((4, 3), np.float32)}, specs, batch_size=3)


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"input_ids": np.zeros((2, 3), np.int64)}, "no array for model input"),
        ({**_arrays(2), "extra": np.zeros(2)}, "not model inputs"),
        ({**_arrays(2), "input_ids": np.zeros((2, 6), np.int32)}, r"int32, the model expects int64 .*astype"),
        ({**_arrays(2), "input_ids": np.zeros((2, 6, 1), np.int64)}, "rank 3"),
        ({**_arrays(2), "input_ids": np.zeros((3, 6), np.int64)}, "disagree on the number of samples"),
        ({**_arrays(2), "input_ids": np.zeros((2, 5), np.int64)}, "share dimension 'seq'"),
        ({"input_ids": np.zeros((0, 6), np.int64), "attention_mask": np.zeros((0, 6), np.int64)}, "zero samples"),
    ],
)
def test_bad_data_is_refused_before_anything_runs(tmp_path, arrays, message):
    with pytest.raises(GraphcalError, match=message):
        load_data(_save(tmp_path / "c.npz", arrays), SPECS)


def test_fixed_dimension_mismatch(tmp_path):
    specs = [InputSpec("x", np.dtype(np.float32), ("batch", 8))]
    with pytest.raises(GraphcalError, match="fixes it at 8"):
        load_data({"x": np.zeros((2, 7), np.float32)}, specs)


def test_pickled_object_arrays_are_refused(tmp_path):
    path = tmp_path / "obj.npz"
    np.savez(path, input_ids=np.array([{"a": 1}, None], dtype=object), attention_mask=np.zeros((2, 3), np.int64))
    with pytest.raises(GraphcalError, match="Python objects"):
        load_data(path, SPECS)


@pytest.mark.parametrize("content", [b"", b"not a zip", pickle.dumps({"input_ids": 1})])
def test_not_an_npz(tmp_path, content):
    path = tmp_path / "bad.npz"
    path.write_bytes(content)
    with pytest.raises(GraphcalError, match="not an .npz"):
        load_data(path, SPECS)


def test_missing_path_and_empty_folder(tmp_path):
    with pytest.raises(GraphcalError, match="not found"):
        load_data(tmp_path / "nope.npz", SPECS)
    with pytest.raises(GraphcalError, match="no .npz files"):
        load_data(tmp_path, SPECS)


def test_nan_in_float_input_names_the_sample(tmp_path):
    specs = [InputSpec("x", np.dtype(np.float32), ("batch", 3))]
    x = np.zeros((4, 3), np.float32)
    x[2, 1] = np.nan
    data = load_data({"x": x}, specs, batch_size=2)
    with pytest.raises(GraphcalError, match=r"NaN or Inf \(sample 2\)"):
        list(data.batches())


@pytest.mark.parametrize("kwargs", [{"batch_size": 0}, {"num_samples": -1}])
def test_non_positive_sizes(kwargs):
    with pytest.raises(UsageError, match="must be positive"):
        load_data(_arrays(2), SPECS, **kwargs)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 7), min_size=1, max_size=4),
    batch=st.integers(1, 5),
    cap=st.one_of(st.none(), st.integers(1, 30)),
)
def test_batches_are_the_data_truncated_to_num_samples(tmp_path_factory, sizes, batch, cap):
    folder = tmp_path_factory.mktemp("d")
    parts = []
    for i, n in enumerate(sizes):
        arrays = {k: v + 1000 * i for k, v in _arrays(n, seq=3 + i).items()}
        _save(folder / f"{i:02d}.npz", arrays)
        parts.append(arrays["input_ids"])
    data = load_data(folder, SPECS, batch_size=batch, num_samples=cap)
    batches = list(data.batches())
    expected = [row for part in parts for row in part][: cap or None]
    got = [row for b in batches for row in b["input_ids"]]
    assert len(got) == data.num_samples == len(expected) and len(batches) == data.num_batches
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    assert all(len(b["input_ids"]) <= batch for b in batches)


# -- onnxruntime CalibrationDataReader ---------------------------------------------------------


class _Reader:
    """A quantize_static-style reader: get_next() returns a batch dict, then None."""

    def __init__(self, batches):
        self._it = iter(batches)

    def get_next(self):
        return next(self._it, None)


def _llama_batches(llama_dir, size):
    data = dict(np.load(llama_dir / "calib.npz"))
    return [{k: v[i:i + size] for k, v in data.items()} for i in range(0, 64, size)]


def test_reader_gives_the_same_files_as_the_npz(llama_dir, tmp_path):
    from graphcal.calibration.pipeline import calibrate

    via_reader = calibrate(llama_dir / "model.onnx", _Reader(_llama_batches(llama_dir, 4)), tmp_path / "r",
                           scheme="W8A8_STATIC", device="cpu")
    calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "n", scheme="W8A8_STATIC",
              device="cpu", batch_size=4)
    assert (via_reader.num_samples, via_reader.num_batches) == (64, 16)
    for name in ("model.onnx", "qparams.safetensors"):
        assert (tmp_path / "r" / name).read_bytes() == (tmp_path / "n" / name).read_bytes()


def test_reader_num_samples_cap_and_errors(llama_dir):
    import onnx

    from graphcal.data import graph_inputs

    inputs = graph_inputs(onnx.load(llama_dir / "model.onnx"))
    capped = load_data(_Reader(_llama_batches(llama_dir, 8)), inputs, num_samples=20)
    assert [len(b["input_ids"]) for b in capped.batches()] == [8, 8, 4] and capped.num_samples == 20
    with pytest.raises(GraphcalError, match="can be read once"):
        list(capped.batches())
    with pytest.raises(UsageError, match="batch_size does not apply to a CalibrationDataReader"):
        load_data(_Reader([]), inputs, batch_size=4)
    cases = [
        ([], "gave no batches"),
        ([{"input_ids": np.zeros((2, 8), np.int64)}], "CalibrationDataReader batch 0: no array for model input(s) attention_mask"),
        ([[1, 2]], "is a list, not a mapping"),
        (_llama_batches(llama_dir, 8)[:1] + [{"input_ids": np.zeros((2, 8), np.int32),
                                               "attention_mask": np.ones((2, 8), np.int64)}],
         "CalibrationDataReader batch 1: input 'input_ids' is int32"),
    ]
    for batches, message in cases:
        with pytest.raises(GraphcalError, match=re.escape(message)):
            list(load_data(_Reader(batches), inputs).batches())

    class Broken:
        def get_next(self):
            raise RuntimeError("disk gone")

    with pytest.raises(GraphcalError, match="CalibrationDataReader failed on batch 0: RuntimeError: disk gone"):
        list(load_data(Broken(), inputs).batches())
