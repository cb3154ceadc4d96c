"""graphcal bench on KV-cache decoders: a decode step over a real past, and onnxruntime-genai's own loop.

The model is conftest.py's ``builder_model``: a tiny random-weight Llama built offline by
onnxruntime-genai's model builder (tests/genai_models.py). The decode step's reference is the
model's own full-sequence prefill from an empty cache, fed here with numpy alone: the step's
logits over a past of P tokens must be the full prefill's logits at position P. Timings are only
checked to exist and be consistent (speed belongs to benchmarks, not tests).
"""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import onnxruntime as ort
import pytest

from graphcal.bench.decode import cache_names, first_sample, plan, step_feeds
from graphcal.data import graph_inputs
from graphcal.errors import GraphcalError, UsageError
from graphcal.graph.io import load_model_info
from tests.helpers import run_cli

FAST = ["--rounds", "2", "--warmup", "1", "--no-memory", "--device", "cpu"]
LOOP = ["--genai-tokens", "4", "--genai-rounds", "1"]


@pytest.fixture(scope="module")
def quantized(builder_model, tmp_path_factory):
    """graphcal's W4A16 output of the builder model: a drop-in genai folder."""
    folder, calib = builder_model
    out = tmp_path_factory.mktemp("kv") / "w4"
    result = run_cli("run", str(folder / "model.onnx"), "--data", str(calib), "-o", str(out),
                     "--scheme", "W4A16", "--group-size", "32")
    assert result.exit_code == 0, result.output
    return out / "model.onnx"


def _session(path):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _full_prefill_logits(session, folder, tokens: np.ndarray) -> np.ndarray:
    """The model's logits over ``tokens`` [1, n] from an empty cache, fed without graphcal's code."""
    config = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    heads, size = config["num_key_value_heads"], config["head_size"]
    feeds = {"input_ids": tokens, "attention_mask": np.ones(tokens.shape, np.int64)}
    for i in range(config["num_hidden_layers"]):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = np.zeros((1, heads, 0, size), np.float32)
    return session.run(["logits"], feeds)[0]


@pytest.mark.parametrize("past", [None, 1, 7], ids=["default", "past-1", "past-7"])
def test_the_decode_step_over_a_past_is_the_full_prefill_at_position_p(builder_model, past):
    folder, calib = builder_model
    model = folder / "model.onnx"
    inputs = graph_inputs(load_model_info(model, lazy=True)[0])
    ids = np.load(calib)["input_ids"][:8]
    decode = plan({"input_ids": ids, "attention_mask": np.ones_like(ids)}, past)
    p = 23 if past is None else past  # the default: the sample's 24 tokens minus 1
    assert decode.past == p and decode.token_name == "input_ids"
    np.testing.assert_array_equal(decode.tokens, ids[:1])

    session = _session(model)
    feeds = step_feeds(session, decode, inputs, folder)
    assert feeds["input_ids"].tolist() == [[ids[0, p]]]
    assert feeds["attention_mask"].tolist() == [[1] * (p + 1)]
    assert all(feeds[f"past_key_values.{i}.{k}"].shape == (1, 2, p, 16) for i in (0, 1) for k in ("key", "value"))
    step = session.run(["logits"], feeds)[0]
    full = _full_prefill_logits(session, folder, ids[:1, :p + 1])
    assert step.shape == (1, 1, 256) and full.shape == (1, p + 1, 256)
    np.testing.assert_allclose(step[0, 0], full[0, p], rtol=0, atol=1e-4)
    assert np.abs(step[0, 0] - full[0, p - 1]).max() > 1e-3  # not the logits of the position before


def test_the_first_sample_drops_its_padding_and_past_is_bounded_by_it():
    ids = np.array([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]], np.int64)
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], np.int64)
    assert first_sample({"input_ids": ids, "attention_mask": mask}).tolist() == [[5, 6, 7]]
    assert plan({"input_ids": ids, "attention_mask": mask}, None).past == 2
    with pytest.raises(UsageError, match=r"--past 3: the data's first sample holds 3 tokens; .* needs 4"):
        plan({"input_ids": ids, "attention_mask": mask}, 3)
    with pytest.raises(GraphcalError, match="holds 1 token"):
        plan({"input_ids": ids[:, :1]}, None)


def test_past_inputs_find_their_present_outputs_by_layer_and_kind(tmp_path):
    names = ["past_key_values.0.key", "past_key_values.1.key", "past_key_values.0.value", "past_key_values.1.value"]
    assert cache_names(names, None) == {n: n.replace("past_key_values", "present") for n in names}
    config = {"model": {"decoder": {"inputs": {"past_key_names": "past_key_values.%d.key",
                                               "past_value_names": "past_key_values.%d.value"},
                                    "outputs": {"present_key_names": "cache.%d.k", "present_value_names": "cache.%d.v"}}}}
    (tmp_path / "genai_config.json").write_text(json.dumps(config))
    assert cache_names(names, tmp_path) == {"past_key_values.0.key": "cache.0.k", "past_key_values.1.key": "cache.1.k",
                                            "past_key_values.0.value": "cache.0.v", "past_key_values.1.value": "cache.1.v"}
    config["model"]["decoder"]["outputs"]["present_key_names"] = "cache.%s.k"
    (tmp_path / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(GraphcalError, match="present_key_names is 'cache.%s.k', not a name with one %d"):
        cache_names(names, tmp_path)


def test_bench_times_the_decode_step_and_the_genai_loop(builder_model, quantized):
    folder, calib = builder_model
    result = run_cli("bench", str(folder / "model.onnx"), str(quantized), "--data", str(calib),
                     *FAST, *LOOP, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert list(report["shapes"]) == ["decode", "prefill"] and report["shapes"]["prefill"]["past"] is None
    decode = report["shapes"]["decode"]
    assert decode["measured"] and decode["skipped"] is None
    assert (decode["name"], decode["past"], decode["batch"], decode["seq"]) == ("decode", 23, 1, 1)
    assert decode["inputs"] == {"input_ids": [1, 1], "attention_mask": [1, 24],
                                **{f"past_key_values.{i}.{k}": [1, 2, 23, 16] for i in (0, 1) for k in ("key", "value")}}
    for label in ("reference", "quantized"):
        t = decode[label]
        assert t["median_s"] > 0 and t["tokens_per_s"] == pytest.approx(1 / t["median_s"])
    assert decode["ratio"] == pytest.approx(decode["quantized"]["median_s"] / decode["reference"]["median_s"])
    assert report["ratios"]["decode"] == decode["ratio"]

    loop = report["genai_loop"]
    assert loop["measured"] and loop["skipped"] is None and loop["provider"] == "cpu"
    assert (loop["prompt_tokens"], loop["new_tokens"], loop["rounds"]) == (23, 4, 1)
    assert loop["onnxruntime_genai"] == pytest.importorskip("onnxruntime_genai").__version__
    for label in ("reference", "quantized"):
        t = loop[label]
        assert t["generated_tokens"] == 4 and t["rounds"] == 1
        assert 0 < t["ttft_min_s"] <= t["ttft_median_s"] <= t["ttft_max_s"]
        assert t["decode_median_s"] > 0 and t["decode_tokens_per_s"] == pytest.approx(1 / t["decode_median_s"])
    assert loop["ttft_ratio"] == pytest.approx(loop["quantized"]["ttft_median_s"] / loop["reference"]["ttft_median_s"])
    assert loop["decode_ratio"] == pytest.approx(loop["quantized"]["decode_median_s"] / loop["reference"]["decode_median_s"])

    text = run_cli("bench", str(folder / "model.onnx"), str(quantized), "--data", str(calib),
                   *FAST, *LOOP, "--past", "5")
    assert text.exit_code == 0, text.output
    lines = text.output.splitlines()
    assert any(line.startswith("decode (past 5) 1x1") and "reference" in line for line in lines), text.output
    (at,) = [i for i, line in enumerate(lines) if line.startswith("genai loop")]
    assert "a prompt of 5 tokens, 4 new" in lines[at]
    assert [lines[at + k].split()[0] for k in (1, 2, 3, 4)] == ["model", "reference", "quantized", "ratio"]
    assert "TTFT" in lines[at + 4] and "time per decoded token" in lines[at + 4]


def test_the_genai_loop_is_skipped_in_one_line_where_it_cannot_run(builder_model, quantized, tmp_path, monkeypatch):
    folder, calib = builder_model
    bare = tmp_path / "bare"  # the quantized model without its genai_config.json
    bare.mkdir()
    for name in ("model.onnx", "model.onnx.data"):
        shutil.copy(quantized.parent / name, bare / name)
    result = run_cli("bench", str(folder / "model.onnx"), str(bare / "model.onnx"), "--data",
                     str(calib), *FAST, *LOOP)
    assert result.exit_code == 0, result.output
    assert f"genai loop       skipped: {bare} holds no genai_config.json (not an onnxruntime-genai folder)" in result.output
    assert "decode (past 23) 1x1" in result.output  # the decode step needs no genai folder for the quantized model

    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # import fails as when it is not installed
    result = run_cli("bench", str(folder / "model.onnx"), str(quantized), "--data", str(calib),
                     *FAST, *LOOP, "--json")
    assert result.exit_code == 0, result.output
    loop = json.loads(result.output)["genai_loop"]
    assert not loop["measured"] and loop["reference"] is None and loop["ttft_ratio"] is None
    assert loop["skipped"].startswith("onnxruntime-genai is not installed")

    result = run_cli("bench", str(folder / "model.onnx"), str(quantized), "--data", str(calib),
                     *FAST, "--genai-tokens", "0", "--no-decode")
    assert result.exit_code == 0, result.output
    assert "genai loop       skipped: --genai-tokens 0" in result.output
    assert "decode           skipped: --no-decode" in result.output


def test_a_past_longer_than_the_first_sample_is_a_usage_error(builder_model, quantized):
    folder, calib = builder_model
    result = run_cli("bench", str(folder / "model.onnx"), str(quantized), "--data", str(calib),
                     *FAST, "--past", "24")
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "--past 24: the data's first sample holds 24 tokens; a step over a past of 24 needs 25" in result.output


def test_a_model_without_kv_cache_keeps_its_shapes(llama_dir):
    """tiny-llama has no KV cache: the decode shape stays one token without a past, no genai loop."""
    args = [str(llama_dir / "model.onnx"), str(llama_dir / "model.onnx"), "--data", str(llama_dir / "heldout.npz"),
            *FAST]
    report = json.loads(run_cli("bench", *args, "--json").output)
    assert [(s["name"], s["batch"], s["seq"], s["past"]) for s in report["shapes"].values()] == [
        ("decode", 1, 1, None), ("prefill", 8, 32, None)]
    assert report["shapes"]["decode"]["inputs"] == {"attention_mask": [1, 1], "input_ids": [1, 1]}
    assert report["genai_loop"] is None
    text = run_cli("bench", *args).output
    assert "decode 1x1" in text and "genai loop" not in text and "past" not in text
    result = run_cli("bench", *args, "--past", "3")
    assert result.exit_code == 2 and "takes no past tensors (no KV cache)" in result.output
