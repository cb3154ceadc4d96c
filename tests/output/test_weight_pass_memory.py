"""The weight pass's memory is bounded by the tensor in hand, not by the model (issue 47, criteria 2 and 6).

With the output written tensor by tensor (graph.spill), each tensor the Q/DQ writer makes must be freed once its
bytes are in the data file: protobuf's upb runtime keeps a message's bytes until the message itself is freed
(ClearField frees nothing), so a writer that only cleared them held every code it wrote until the save. Checked
three ways: no tensor the writer made with bytes stays referenced once the writer moves on (a seam), the process's
anonymous memory does not grow with what was written (a child process, a wide margin), and the output is the one
the writer that keeps everything in memory writes (tests/output/test_streamed_writer.py compares more forms)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import graphcal
from graphcal.graph import spill as spill_module
from graphcal.graph.qdq import QDQWriter
from graphcal.graph.qdq import edits as edits_module
from graphcal.graph.spill import SPILL_MIN_BYTES
from tests.helpers import REPO
from tools.lib import decoder

SHAPE = decoder.DecoderShape(hidden=128, layers=2, intermediate=256, heads=4, kv_heads=2, vocab=128)


def feeds(vocab: int, batch=2, seq=8):
    ids = np.random.default_rng(1).integers(0, vocab, (batch, seq), dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones((batch, seq), dtype=np.int64)}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return decoder.make_decoder(tmp_path_factory.mktemp("decoder"), SHAPE, seed=4)


@pytest.mark.parametrize("scheme", ["W4A16", "W8A8"])
def test_no_written_tensor_is_held_once_the_writer_moves_on(made, scheme, tmp_path, monkeypatch):
    """Every initializer the writer makes (edits.add_initializer) holding spillable bytes is referenced by
    nothing but this test once the weight it belongs to is written: its bytes are freed with it."""
    made_here: list = [onnx.TensorProto(name="sentinel")]  # referenced by this list only
    original_add = edits_module.add_initializer

    def recorded(initializers, names, base, array):
        name = original_add(initializers, names, base, array)
        if len(initializers[-1].raw_data) >= SPILL_MIN_BYTES:
            made_here.append(initializers[-1])
        return name

    held_after: list[int] = []
    original_quantize = QDQWriter.quantize_weight

    def checked(self, item, weight):
        original_quantize(self, item, weight)
        # referenced as the sentinel, which nothing else references, is (by made_here, the loop and getrefcount's
        # argument): neither the writer nor the model holds it
        counts = [sys.getrefcount(t) for t in made_here]
        held_after.append(sum(c > counts[0] for c in counts[1:]))

    monkeypatch.setattr(edits_module, "add_initializer", recorded)
    monkeypatch.setattr(QDQWriter, "quantize_weight", checked)
    monkeypatch.setattr(spill_module, "STREAM_MIN_BYTES", 0)
    graphcal.calibrate(made, feeds(SHAPE.vocab), tmp_path / "out", scheme=scheme)
    assert len(made_here) > 1 and len(held_after) == 7 * SHAPE.layers
    assert max(held_after) == 0, held_after


def test_the_output_equals_the_one_held_in_memory(made, tmp_path, monkeypatch):
    """The streamed output (lm_head quantized too) against the writer that keeps every tensor until the save (a model
    below STREAM_MIN_BYTES): the same nodes, every tensor's bytes, the same metadata files byte for byte (the data
    file's order differs: streamed codes come first)."""
    out = {}
    for streamed in (False, True):
        monkeypatch.setattr(spill_module, "STREAM_MIN_BYTES", 0 if streamed else 1 << 62)
        folder = tmp_path / str(streamed)
        graphcal.calibrate(made, feeds(SHAPE.vocab), folder, scheme="W4A16", lm_head=True)
        model = onnx.load(str(folder / "model.onnx"))
        out[streamed] = ([n.SerializeToString() for n in model.graph.node],
                         {t.name: (t.data_type, tuple(t.dims), numpy_helper.to_array(t).tobytes()) for t in model.graph.initializer},
                         [(folder / name).read_bytes() for name in ("quantization_config.json", "qparams.safetensors")])
    assert out[False] == out[True]


# A child: the weight pass over a decoder whose int8 codes are ~45 MB, the anonymous memory (RssAnon) read when the
# writer starts and when it finishes (before the save reads the float tensors kept). Held codes would add them all.
CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import graphcal
    from graphcal.graph import spill
    from graphcal.graph.qdq import QDQWriter

    def anon():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))

    seen = {}
    quantize, finish = QDQWriter.quantize_weight, QDQWriter.finish

    def first(self, item, weight):
        seen.setdefault("start", anon())
        seen["codes"] = seen.get("codes", 0) + weight.numel()  # one byte each (int8)
        quantize(self, item, weight)

    def last(self):
        seen["end"] = anon()
        return finish(self)

    QDQWriter.quantize_weight, QDQWriter.finish = first, last
    spill.STREAM_MIN_BYTES = 0
    ids = np.random.default_rng(1).integers(0, 1024, (1, 8), dtype=np.int64)
    graphcal.calibrate(sys.argv[1], {"input_ids": ids, "attention_mask": np.ones_like(ids)}, sys.argv[2], scheme="W8A16")
    print(json.dumps(seen))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from /proc")
def test_memory_does_not_grow_with_what_was_written(tmp_path):
    shape = decoder.DecoderShape(hidden=1024, layers=4, intermediate=2816, heads=16, kv_heads=4, vocab=1024)
    model = decoder.make_decoder(tmp_path / "decoder", shape, seed=5)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", CHILD, str(model), str(tmp_path / "out")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["codes"] > 40e6
    # held codes: growth >= the codes less the first weight's; freed: a few MB of small tensors and allocator slack
    assert seen["end"] - seen["start"] < 0.25 * seen["codes"], seen
