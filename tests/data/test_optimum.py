"""Hugging Face Optimum's ``text-generation-with-past`` exports (issue 32): models/tiny-llama-optimum.

That model is the shipped tiny Llama (the same weights) exported by Optimum with its KV cache
(tools/make_optimum_model.py, run in a virtual environment of its own: Optimum pulls plain
onnxruntime). graphcal calibrates it from token ids alone, filling the empty past tensors, the
mask and ``position_ids``. References: the shipped torch export run by onnxruntime (the same
function), and onnxruntime running the Optimum model before and after graphcal (``graphcal eval``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from graphcal.runtime import run_model
from tests.conftest import MODELS
from tests.helpers import run_cli

OPTIMUM = MODELS / "tiny-llama-optimum"


def _feeds(ids: np.ndarray, pasts: list[str]) -> dict[str, np.ndarray]:
    rows, seq = ids.shape
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.tile(np.arange(seq), (rows, 1)),
            **{p: np.zeros((rows, 2, 0, 32), np.float32) for p in pasts}}


def test_the_optimum_export_is_the_shipped_llama_with_a_kv_cache(llama_dir):
    import onnx

    model = onnx.load(OPTIMUM / "model.onnx")
    inputs = [i.name for i in model.graph.input]
    pasts = [n for n in inputs if n.startswith("past_key_values.")]
    assert inputs[:3] == ["input_ids", "attention_mask", "position_ids"] and len(pasts) == 4
    assert [o.name for o in model.graph.output][1:] == [p.replace("past_key_values", "present") for p in pasts]
    ids = np.load(OPTIMUM / "heldout.npz")["input_ids"][:4]
    want = run_model(llama_dir / "model.onnx", {"input_ids": ids, "attention_mask": np.ones_like(ids)}, ["logits"])
    got = run_model(OPTIMUM / "model.onnx", _feeds(ids, pasts), ["logits"])
    np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("args, floor", [
    (["--scheme", "W8A8_STATIC", "--smoothquant"], 25),
    (["--scheme", "W8A8"], 30),
    (["--scheme", "W4A16", "--group-size", "32", "--algorithm", "gptq"], 15),
    (["--scheme", "W4A16", "--group-size", "32", "--algorithm", "awq"], 12),
], ids=["w8a8-static-smoothquant", "w8a8", "gptq", "awq"])
def test_an_optimum_export_calibrates_from_token_ids_alone(tmp_path, args, floor):
    out = tmp_path / "out"
    result = run_cli("run", str(OPTIMUM / "model.onnx"), "--data", str(OPTIMUM / "calib.npz"),
                     "-o", str(out), *args)
    assert result.exit_code == 0, result.output
    assert ("filled for an empty KV cache: 4 past tensors (past_key_values.*.key/value, length 0, 2 heads x 32), "
            "attention_mask (ones), position_ids (0, 1, ... per row)") in result.output
    if "--smoothquant" in args or "awq" in args:  # the folds found the decomposed RMSNorms before q/k/v and gate/up
        assert "activation(s) first" in result.output
    result = run_cli("eval", str(OPTIMUM / "model.onnx"), str(out / "model.onnx"), "--data",
                     str(OPTIMUM / "heldout.npz"), "--json")
    assert result.exit_code == 0, result.output
    outputs = {o["name"]: o["sqnr_db"] for o in json.loads(result.output.strip().splitlines()[-1])["outputs"]}
    print(args, {k: round(v, 1) for k, v in outputs.items()})
    assert set(outputs) == {"logits", "present.0.key", "present.0.value", "present.1.key", "present.1.value"}
    assert min(outputs.values()) > floor  # the same function, quantized (a broken layer gives about 0 dB)
