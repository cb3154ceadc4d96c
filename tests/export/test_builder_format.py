"""An onnxruntime-genai model is written in its builder's format by default (issue 48, criterion 3).

With no --matmulnbits, a model with a genai_config.json beside it has its weight-only integer layers
written as com.microsoft.MatMulNBits at the accuracy level onnxruntime-genai's builder writes for the
folder's provider (4 on the CPU, 0 on CUDA: shared/reference/onnxruntime_genai.md), so the tied table
stays one table (GatherBlockQuantized reads lm_head's MatMulNBits bytes) however the request is
written, flags or an llm-compressor recipe. Layers MatMulNBits cannot take (static input
activations) keep their Q/DQ form; ``--matmulnbits off`` writes DequantizeLinear weights; a model
without a genai_config.json is written as before.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest

from tests.genai_models import STEPS, assert_one_table, generate, sqnr
from tests.helpers import WHOLE_INT4_RECIPE, run_cli

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai-cuda is not installed (the test extra)")



def _ops(path) -> dict[str, list[onnx.NodeProto]]:
    model = onnx.load(path, load_external_data=False)
    ops: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        ops.setdefault(n.op_type, []).append(n)
    return ops


def _level(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "accuracy_level"), 0)


def test_a_builder_model_is_written_as_matmulnbits_by_default(builder_model, tmp_path):
    """The default equals --matmulnbits 4 byte for byte on the builder's CPU model, and generates in
    onnxruntime-genai's loop as the fp32 model does."""
    folder, calib = builder_model
    args = [str(folder / "model.onnx"), "--data", str(calib), "--scheme", "W4A16", "--group-size", "32"]
    result = run_cli("run", *args, "-o", str(tmp_path / "default"))
    assert result.exit_code == 0, result.output
    ops = _ops(tmp_path / "default" / "model.onnx")
    assert len(ops["MatMulNBits"]) == 10 and {_level(n) for n in ops["MatMulNBits"]} == {4}  # lm_head stays float
    assert "DequantizeLinear" not in ops
    asked = run_cli("run", *args, "--matmulnbits", "-o", str(tmp_path / "asked"))
    assert asked.exit_code == 0, asked.output
    for name in ("model.onnx", "model.onnx.data"):
        if (tmp_path / "asked" / name).exists():
            assert (tmp_path / "default" / name).read_bytes() == (tmp_path / "asked" / name).read_bytes(), name
    ref_tokens, ref_logits = generate(folder)
    tokens, logits = generate(tmp_path / "default")
    assert tokens[0] == ref_tokens[0] and len(tokens) == STEPS
    assert sqnr(ref_logits, logits) > 15  # int4 g32 on random weights; a broken layer gives ~0 dB


def test_off_and_a_model_without_genai_config_keep_dequantizelinear(builder_model, tmp_path):
    folder, calib = builder_model
    result = run_cli("run", str(folder / "model.onnx"), "--data", str(calib), "--scheme", "W4A16", "--group-size",
                     "32", "--matmulnbits", "off", "-o", str(tmp_path / "off"))
    assert result.exit_code == 0, result.output
    ops = _ops(tmp_path / "off" / "model.onnx")
    assert "MatMulNBits" not in ops and len(ops["DequantizeLinear"]) >= 10
    plain = Path(__file__).resolve().parents[2] / "models" / "tiny-llama"  # a torch export: no genai_config.json
    result = run_cli("run", str(plain / "model.onnx"), "--data", str(plain / "calib.npz"), "--scheme", "W4A16",
                     "--group-size", "32", "-o", str(tmp_path / "plain-out"))
    assert result.exit_code == 0, result.output
    assert "MatMulNBits" not in _ops(tmp_path / "plain-out" / "model.onnx")


def test_static_activations_keep_their_qdq_form_on_a_builder_model(builder_model, tmp_path):
    """MatMulNBits quantizes inputs only dynamically: the default passes over layers with static input
    scales (an explicit --matmulnbits refuses them)."""
    folder, calib = builder_model
    args = [str(folder / "model.onnx"), "--data", str(calib), "--scheme", "W8A8_STATIC"]
    result = run_cli("run", *args, "-o", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    ops = _ops(tmp_path / "out" / "model.onnx")
    assert "MatMulNBits" not in ops and "QuantizeLinear" in ops
    refused = run_cli("inspect", *args, "--matmulnbits")
    assert refused.exit_code == 1 and "drop --matmulnbits" in refused.output, refused.output


def test_a_cuda_builder_folder_gets_the_builders_cuda_level(builder_model, tmp_path):
    """genai_config.json naming the CUDA provider: accuracy level 0, as the builder writes for CUDA."""
    folder, calib = builder_model
    cuda = tmp_path / "cuda"
    shutil.copytree(folder, cuda)
    config = json.loads((cuda / "genai_config.json").read_text())
    config["model"]["decoder"].setdefault("session_options", {})["provider_options"] = [{"cuda": {}}]
    (cuda / "genai_config.json").write_text(json.dumps(config))
    result = run_cli("run", str(cuda / "model.onnx"), "--data", str(calib), "--scheme", "W4A16", "--group-size", "32",
                     "--device", "cpu", "-o", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    assert {_level(n) for n in _ops(tmp_path / "out" / "model.onnx")["MatMulNBits"]} == {0}


def test_a_recipe_for_linear_and_embedding_keeps_the_tied_table_one_table(tied_builder_model, tmp_path):
    """llm-compressor's recipe for the whole model (config_groups for Linear and Embedding, nothing
    ignored) on the builder's tied model: one table, read by the lookup and lm_head, with no flag."""
    folder, calib = tied_builder_model
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(WHOLE_INT4_RECIPE)
    out = tmp_path / "out"
    result = run_cli("run", str(folder / "model.onnx"), "--data", str(calib), "--recipe", str(recipe), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "stored twice" not in result.output and "both tables are stored" not in result.output
    assert_one_table(out / "model.onnx")
    tokens, _ = generate(out)
    assert len(tokens) == STEPS


@pytest.mark.parametrize("value", ["7", "on", "4.0"])
def test_a_bad_level_is_refused_in_one_line(value):
    plain = Path(__file__).resolve().parents[2] / "models" / "tiny-llama"
    result = run_cli("inspect", str(plain / "model.onnx"), "--scheme", "W4A16", "--matmulnbits", value)
    assert result.exit_code == 2 and "not an accuracy level 0..4 or off" in result.output, result.output
    assert result.output.strip().count("\n") == 0
