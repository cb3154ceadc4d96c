"""The protobuf size check decides from an estimate that reads no weight bytes; protobuf's own
ByteSize is the reference."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphcal.graph.io as io


def _model(initializers):
    graph = helper.make_graph([], "g", [], [], initializer=initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _cases():
    rng = np.random.default_rng(0)
    yield "float32", [numpy_helper.from_array(rng.standard_normal((64, 33)).astype(np.float32), "w")]
    yield "float16 + int64", [numpy_helper.from_array(rng.standard_normal((7, 5)).astype(np.float16), "h"),
                              numpy_helper.from_array(np.arange(9, dtype=np.int64), "i")]
    yield "int4 odd count", [helper.make_tensor("q", TensorProto.INT4, [3, 5], rng.integers(-8, 8, 15).tolist())]
    yield "fp8 raw", [helper.make_tensor("f", TensorProto.FLOAT8E4M3FN, [4, 4], bytes(range(16)), raw=True)]
    yield "typed fields", [helper.make_tensor("t", TensorProto.FLOAT, [2, 3], [1.0] * 6),
                           helper.make_tensor("n", TensorProto.INT32, [4], [-1, -2, 3, 4])]


@pytest.mark.parametrize("name, inits", list(_cases()), ids=[c[0] for c in _cases()])
def test_estimate_is_close_above_protobufs_size(name, inits):
    model = _model(inits)
    true = model.ByteSize()
    estimate = io._estimated_size(model)
    typed = sum(int(np.prod(t.dims)) for t in inits if not t.HasField("raw_data"))  # up to 10 bytes each
    assert true <= estimate <= true + 100 * len(inits) + 10 * typed, (estimate, true)


def test_shipped_models(llama_dir, bert_dir):
    for folder in (llama_dir, bert_dir):
        model = onnx.load(folder / "model.onnx")
        true = model.ByteSize()
        assert true <= io._estimated_size(model) <= true + 100 * len(model.graph.initializer)
        assert io.past_protobuf_limit(model) is False


def test_near_the_limit_protobuf_decides(monkeypatch, llama_dir):
    model = onnx.load(llama_dir / "model.onnx")
    true = model.ByteSize()
    for limit, expected in ((true, True), (true + 1, False)):  # within the margin: the exact size
        monkeypatch.setattr(io, "PROTOBUF_LIMIT", limit)
        assert io.past_protobuf_limit(model) is expected
    monkeypatch.setattr(io, "SIZE_MARGIN", 1000)
    monkeypatch.setattr(io, "PROTOBUF_LIMIT", true // 2)  # far past it: the estimate alone decides
    calls, real = [], onnx.ModelProto.ByteSize

    def counting(self):  # the weightless graph may be sized; the model with its weights must not be
        if len(self.graph.initializer):
            calls.append(1)
        return real(self)

    monkeypatch.setattr(onnx.ModelProto, "ByteSize", counting, raising=False)
    assert io.past_protobuf_limit(model) is True and not calls
    monkeypatch.setattr(io, "PROTOBUF_LIMIT", true * 2)  # far under it: likewise
    assert io.past_protobuf_limit(model) is False and not calls


def test_large_typed_fields_and_strings_are_sized_exactly():
    big = helper.make_tensor("t", TensorProto.FLOAT, [5000], [0.5] * 5000)
    strings = helper.make_tensor("s", TensorProto.STRING, [2], [b"ab", b"c"])
    assert io._estimated_size(_model([big])) is None
    assert io._estimated_size(_model([strings])) is None
    assert io.past_protobuf_limit(_model([big, strings])) is False


def test_model_bytes_counts_the_model_file_and_the_data_it_reads_only(llama_dir, tmp_path):
    """A model's size (tools/ report it): its file and its external data, not the other files beside it."""
    onnx.save(onnx.load(llama_dir / "model.onnx"), tmp_path / "model.onnx", save_as_external_data=True,
              location="weights.bin", size_threshold=0)
    (tmp_path / "tokenizer.json").write_text("{}" * 1000)  # a companion file: not the model's
    assert io.model_bytes(tmp_path / "model.onnx") == sum((tmp_path / n).stat().st_size for n in ("model.onnx", "weights.bin"))
    assert io.model_bytes(llama_dir / "model.onnx") == (llama_dir / "model.onnx").stat().st_size
