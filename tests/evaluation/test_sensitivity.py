"""eval --sensitivity: each kind of layer quantized alone, and advice that does what it predicts.

The reference for "only this kind quantized" is graphcal itself run from scratch with --targets
naming that kind (an independent path: the writer, not graphcal.evaluation.sensitivity.float_except, decides
what stays in float), compared with fp32 by eval. The advice is checked by pasting its flags into
run: the model it gives must match the prediction.
"""

from __future__ import annotations

import json
import shlex

import pytest

from tests.helpers import run_cli


def _output_sqnr(model_dir, quantized) -> float:
    result = run_cli("eval", model_dir / "model.onnx", quantized, "--data", model_dir / "heldout.npz", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["outputs"][0]["sqnr_db"]


@pytest.fixture(scope="module")
def static_llama(llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sens") / "out"
    result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--scheme", "W8A8_STATIC",
                     "-o", out, "-q")
    assert result.exit_code == 0, result.output
    result = run_cli("eval", llama_dir / "model.onnx", out / "model.onnx", "--data", llama_dir / "heldout.npz",
                     "--sensitivity", "--json")
    assert result.exit_code == 0, result.output
    return out, json.loads(result.output)


@pytest.mark.parametrize("kind", ["self_attn.o_proj", "mlp.down_proj", "self_attn.q_proj"])
def test_a_kind_alone_matches_a_run_that_quantizes_only_it(llama_dir, tmp_path, static_llama, kind):
    _, report = static_llama
    alone = {a["name"]: a for a in report["sensitivity"]["alone"]}[kind]
    assert alone["layers"] == [f"model.layers.{i}.{kind}" for i in (0, 1)]
    out = tmp_path / "only"
    result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--scheme", "W8A8_STATIC",
                     "--targets", f"re:.*\\.{kind}$", "-o", out, "-q")
    assert result.exit_code == 0, result.output
    assert alone["outputs"][0]["sqnr_db"] == pytest.approx(_output_sqnr(llama_dir, out / "model.onnx"), abs=0.05)


def test_kinds_are_ranked_by_the_loss_they_cause_alone(static_llama):
    _, report = static_llama
    sqnr = [a["outputs"][0]["sqnr_db"] for a in report["sensitivity"]["alone"]]
    assert sqnr == sorted(sqnr) and len(sqnr) == 7  # q, k, v, o, gate, up, down; lm_head stays in float
    assert sqnr[-1] - sqnr[0] > 10  # the kinds differ: a wrong ranking shows


def test_pasted_advice_gives_the_predicted_result(llama_dir, tmp_path, static_llama):
    out, report = static_llama
    advice = report["sensitivity"]["advice"]
    assert advice is not None and advice["flags"][:2] == ["--ignore", "lm_head"]  # the default ignore is kept
    predicted = advice["expected_outputs"][0]["sqnr_db"]
    now = report["outputs"][0]["sqnr_db"]
    assert predicted > now + 3
    pasted = tmp_path / "pasted"
    result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--scheme", "W8A8_STATIC",
                     "-o", pasted, "-q", *advice["flags"])
    assert result.exit_code == 0, result.output
    assert _output_sqnr(llama_dir, pasted / "model.onnx") == pytest.approx(predicted, abs=0.05)
    config = json.loads((pasted / "quantization_config.json").read_text())
    assert "lm_head" in config["ignore"] and all(f"model.layers.{i}.{k}" in config["ignore"]
                                                 for i in (0, 1) for k in advice["kinds"])


def test_text_report_prints_the_measured_advice(llama_dir, static_llama):
    out, report = static_llama
    result = run_cli("eval", llama_dir / "model.onnx", out / "model.onnx", "--data", llama_dir / "heldout.npz",
                     "--sensitivity")
    assert result.exit_code == 0, result.output
    line = next(ln for ln in result.output.splitlines() if ln.startswith("advice: keep"))
    flags = shlex.split(line.split("run with ", 1)[1])
    assert flags == report["sensitivity"]["advice"]["flags"]


def test_per_layer_and_smoothed_models(llama_dir, tmp_path, static_llama):
    out, _ = static_llama
    result = run_cli("eval", llama_dir / "model.onnx", out / "model.onnx", "--data", llama_dir / "heldout.npz",
                     "--sensitivity", "--per-layer", "--json")
    assert result.exit_code == 0, result.output
    names = {a["name"] for a in json.loads(result.output)["sensitivity"]["alone"]}
    assert "model.layers.1.mlp.down_proj" in names and "mlp.down_proj" in names
    smoothed = tmp_path / "sq"
    assert run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--scheme", "W8A8_STATIC",
                   "--smoothquant", "-o", smoothed, "-q").exit_code == 0
    result = run_cli("eval", llama_dir / "model.onnx", smoothed / "model.onnx", "--data", llama_dir / "heldout.npz",
                     "--sensitivity")
    assert result.exit_code == 2 and "smoothed by SmoothQuant" in result.output


def test_the_switchable_model_is_fp32_with_every_switch_off_and_the_quantized_model_with_every_one_on(
        llama_dir, static_llama):
    """graph.switch against onnxruntime running the two models themselves (ORT_ENABLE_BASIC)."""
    import numpy as np

    from graphcal.evaluation.sensitivity import quantized_layers
    from graphcal.graph.io import load_model, value_types
    from graphcal.graph.switch import switchable_model
    from graphcal.graph.targets import find_targets
    from graphcal.runtime import run_model

    out, _ = static_llama
    ref, cand = load_model(llama_dir / "model.onnx"), load_model(out / "model.onnx")
    layers = quantized_layers(cand, ref, find_targets(ref)[0])
    types = {k: v.elem_type for k, v in value_types(ref).items()}
    model, per_model = switchable_model(ref, [cand], {t.name: t.node for t in layers}, types)
    switches = {layer: names[0] for layer, names in per_model.items()}
    assert len(switches) == len(layers) == 14 and sum(n.op_type == "If" for n in model.graph.node) == 14
    feeds = {k: v[:4] for k, v in np.load(llama_dir / "heldout.npz").items()}
    for on, reference in ((False, llama_dir / "model.onnx"), (True, out / "model.onnx")):
        got = run_model(model, {**feeds, **{s: np.array(on) for s in switches.values()}}, ["logits"])["logits"]
        want = run_model(reference, feeds, ["logits"])["logits"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_sensitivity_says_its_runs_up_front_and_refuses_past_its_time_limit(llama_dir, static_llama, caplog):
    out, _ = static_llama
    args = ["eval", llama_dir / "model.onnx", out / "model.onnx", "--data", llama_dir / "heldout.npz", "--sensitivity"]
    result = run_cli(*args, "--per-layer", "--time-limit", "0.0001")
    assert result.exit_code == 2
    # 1 + 7 + 14 runs (fp32, then each kind and layer alone), then 1 + 3 (fp32, then each option)
    assert "eval --sensitivity: 26 runs of the model over the data (7 kinds, 14 single layers, up to 3 options" in (
        caplog.text)
    refusal = result.output.strip().splitlines()[-1]
    assert refusal.startswith("error: --sensitivity would take about") and "drop --per-layer" in refusal
    assert "advice" not in result.output  # refused before the sensitivity passes
    result = run_cli(*args, "--time-limit", "0")  # no limit
    assert result.exit_code == 0, result.output
