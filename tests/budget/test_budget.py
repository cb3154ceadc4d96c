"""`graphcal run --size-budget MB` / `--target-kl NATS`: the mix chosen, written and measured in one run
(graphcal.budget), and the held-out samples it is chosen on (graphcal.data.held_out).

References: the written model's KL is recomputed here from onnxruntime's runs of fp32 and the written model
(ORT_ENABLE_BASIC) on the held-out rows sliced from the .npz by numpy, with torch's kl_div; the written
layers' forms are read from the written graph; sizes from the files on disk."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

from graphcal.budget import DEFAULTS, HIGH_SCHEME, budget_options
from graphcal.config import Options
from graphcal.data.held_out import hold_out
from graphcal.errors import UsageError
from tests.helpers import run_cli, signal_paused_run

HELD = 4  # the default --mix-samples


def _kl(ref: np.ndarray, cand: np.ndarray, mask: np.ndarray) -> float:
    r = torch.log_softmax(torch.as_tensor(ref, dtype=torch.float64), -1)
    c = torch.log_softmax(torch.as_tensor(cand, dtype=torch.float64), -1)
    per = F.kl_div(c, r, log_target=True, reduction="none").sum(-1)
    return float(per[torch.as_tensor(mask) != 0].mean())


def _logits(model: Path, feeds: dict) -> np.ndarray:
    from graphcal.runtime import run_model

    return run_model(str(model), feeds, ["logits"])["logits"]


def _model_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith("model.onnx"))


def _bits(folder: Path) -> dict[str, int]:
    """Each quantized weight's bits, by node name: a MatMulNBits' or GatherBlockQuantized's attribute, a
    weight DequantizeLinear's integer type."""
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    types = {t.name: t.data_type for t in model.graph.initializer}
    four = (onnx.TensorProto.INT4, onnx.TensorProto.UINT4)
    bits = {}
    for n in model.graph.node:
        if n.op_type in ("MatMulNBits", "GatherBlockQuantized"):
            bits[n.name] = next((a.i for a in n.attribute if a.name == "bits"), 4)
        elif n.op_type == "DequantizeLinear" and n.input[0] in types:
            bits[n.name] = 4 if types[n.input[0]] in four else 8
    return bits


@pytest.fixture(scope="module")
def budget_run(llama_dir, tmp_path_factory):
    """One `run --size-budget` on the shipped tiny Llama, between its int4 and int8 sizes: (folder, JSON)."""
    out = tmp_path_factory.mktemp("budget") / "out"
    result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", out,
                     "--size-budget", "0.42", "--json")
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


def test_the_mix_fits_the_budget_and_takes_int8_where_it_chose(budget_run):
    out, report = budget_run
    budget = report["budget"]
    mix = budget["mix"]
    assert budget["defaults"] and budget["held_out"] == HELD and budget["calibrated_on"] == 64 - HELD
    assert 0 < len(mix["chosen"]) < len(mix["units"])
    written = _model_bytes(out)
    assert written == budget["written_bytes"] <= 0.42e6
    assert mix["low_bytes"] < written
    chosen = {layer for unit in mix["units"] if unit["chosen"] for layer in unit["layers"]}
    bits = _bits(out)
    eight = {name for name, b in bits.items() if b == 8}
    assert eight and len(eight) < len(bits)
    # every 8-bit node is one of the chosen layers' (node names carry the layer's module path)
    for name in eight:
        assert any(layer.replace(".", "/") in name or layer in name for layer in chosen), name
    config = json.loads((out / "quantization_config.json").read_text())
    schemes = {g["weights"]["num_bits"] for g in config["config_groups"].values()}
    assert schemes == {4, 8}
    assert not list(out.parent.glob(".out.graphcal-mix-*"))  # the forms' temporary folder is gone


def test_the_reported_kl_is_the_written_models_on_the_held_out_samples(budget_run, llama_dir):
    out, report = budget_run
    arrays = np.load(llama_dir / "calib.npz")
    feeds = {k: arrays[k][-HELD:] for k in ("input_ids", "attention_mask")}
    want = _kl(_logits(llama_dir / "model.onnx", feeds), _logits(out / "model.onnx", feeds), feeds["attention_mask"])
    assert report["budget"]["measured_kl"] == pytest.approx(want, rel=1e-6)
    assert report["budget"]["mix"]["low_kl"] > want  # the mix loses less than the low form
    # the written model is the mix the switches measured: its KL is the one predicted
    assert report["budget"]["mix"]["kl"] == pytest.approx(want, rel=1e-6)


def test_an_int8_low_form_mixes_with_float_by_running_again_with_ignores(llama_dir, tmp_path):
    out = tmp_path / "out"
    result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", out,
                     "--scheme", "W8A16", "--size-budget", "0.75", "--json")
    assert result.exit_code == 0, result.output
    budget = json.loads(result.stdout)["budget"]
    assert budget["high"] == "float" and not budget["defaults"] and budget["mix"]["chosen"]
    assert _model_bytes(out) <= 0.75e6
    config = json.loads((out / "quantization_config.json").read_text())
    chosen = [layer for unit in budget["mix"]["units"] if unit["chosen"] for layer in unit["layers"]]
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    quantized = {n.name for n in model.graph.node if n.op_type == "DequantizeLinear"}
    for layer in chosen:  # left in float: no weight dequantized for it, and named by the config's ignore
        assert not any(name.startswith(layer + "/") or f"/{layer.replace('.', '/')}/" in name for name in quantized)
    assert config["ignore"]
    arrays = np.load(llama_dir / "calib.npz")
    feeds = {k: arrays[k][-HELD:] for k in ("input_ids", "attention_mask")}
    want = _kl(_logits(llama_dir / "model.onnx", feeds), _logits(out / "model.onnx", feeds), feeds["attention_mask"])
    assert budget["measured_kl"] == pytest.approx(want, rel=1e-6)


def test_a_target_kl_the_low_form_meets_promotes_nothing(llama_dir, tmp_path):
    result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", tmp_path / "out",
                     "--target-kl", "1", "--mix-samples", "2", "--json")
    assert result.exit_code == 0, result.output
    budget = json.loads(result.stdout)["budget"]
    assert budget["mix"]["chosen"] == [] and budget["mix"]["reached"] and budget["held_out"] == 2
    assert set(_bits(tmp_path / "out").values()) == {4}


@pytest.mark.parametrize("args, fragment", [
    (["--size-budget", "0.1"], "under the low form's expected size"),
    (["--size-budget", "1", "--mix-samples", "64"], "holds out the last 64 calibration samples"),
    (["--size-budget", "1", "--target-kl", "0.1"], "give one of --size-budget and --target-kl"),
    (["--mix-samples", "2"], "--mix-samples is for --size-budget or --target-kl"),
    (["--size-budget", "1", "--recipe", "RECIPE"], "a recipe names one form"),
])
def test_bad_requests_are_refused_in_one_line_before_any_pass(llama_dir, tmp_path, args, fragment):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("quant_stage:\n  quant_modifiers:\n    QuantizationModifier:\n      scheme: W4A16\n")
    args = [str(recipe) if a == "RECIPE" else a for a in args]
    result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", tmp_path / "out", *args)
    assert result.exit_code != 0
    assert fragment in result.output and "Traceback" not in result.output
    assert result.output.count("\n") == 1, result.output
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.graphcal-mix-*"))


def test_under_torchrun_a_budget_is_refused_in_one_line(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", tmp_path / "out",
                     "--size-budget", "1")
    assert result.exit_code != 0 and "without torchrun" in result.output and result.output.count("\n") == 1


def test_inspect_plans_the_low_form_a_budget_starts_from(llama_dir, tmp_path):
    result = run_cli("inspect", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--size-budget", "0.42")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "--size-budget 0.42 MB: the plan above is the low form (graphcal's defaults for a budget)" in text
    assert "the last 4 samples held out, calibrated on the 60 before them" in text and "W4A16_ASYM" in text
    low = run_cli("inspect", llama_dir / "model.onnx", "--size-budget", "0.1")
    assert low.exit_code != 0 and "under the low form's expected size" in low.output and low.output.count("\n") == 1


def test_the_defaults_apply_only_when_no_config_flag_is_given():
    low, high, defaults = budget_options(Options())
    assert defaults and low.scheme == DEFAULTS["scheme"] and low.algorithm == "gptq" and low.lm_head
    assert high.scheme == HIGH_SCHEME and high.algorithm is None and high.group_size == 64
    assert high.scheme_for == (f"Embedding={HIGH_SCHEME}",)
    low, high, defaults = budget_options(Options(scheme="W4A16", group_size=32, algorithm="awq"))
    assert not defaults and low.scheme == "W4A16" and low.lm_head is None
    assert high.scheme == HIGH_SCHEME and high.group_size == 32 and high.algorithm is None
    low, high, _ = budget_options(Options(scheme="W8A16"))
    assert high is None  # 8-bit weights: the high form is float


def test_held_out_rows_are_the_last_of_the_last_file(tmp_path):
    ids = np.arange(40).reshape(10, 4)
    np.savez(tmp_path / "one.npz", input_ids=ids, labels=ids + 1)
    held = hold_out(tmp_path / "one.npz", 3)
    assert held.calibrate_on == 7 and held.count == 3
    np.testing.assert_array_equal(held.arrays["input_ids"], ids[7:])
    np.testing.assert_array_equal(held.arrays["labels"], ids[7:] + 1)
    held = hold_out(tmp_path / "one.npz", 2, num_samples=6)  # within --num-samples
    assert held.calibrate_on == 4
    np.testing.assert_array_equal(held.arrays["input_ids"], ids[4:6])
    folder = tmp_path / "many"
    folder.mkdir()
    np.savez(folder / "a.npz", input_ids=ids[:6])
    np.savez(folder / "b.npz", input_ids=ids[6:, :2])  # another sequence length: the tail comes from this file
    held = hold_out(folder, 3)
    assert held.calibrate_on == 7
    np.testing.assert_array_equal(held.arrays["input_ids"], ids[7:, :2])
    held = hold_out({"input_ids": ids}, 1)
    np.testing.assert_array_equal(held.arrays["input_ids"], ids[9:])
    with pytest.raises(UsageError, match="the data gives 10"):
        hold_out(tmp_path / "one.npz", 10)

    class Reader:
        def get_next(self):
            return None

    with pytest.raises(UsageError, match="not a CalibrationDataReader"):
        hold_out(Reader(), 1)


def test_a_builder_model_keeps_its_tied_table_and_its_folder(tied_builder_model, tmp_path):
    """MatMulNBits in both forms, lm_head tied to the table: the written model is the one measured (the
    8-bit MatMulNBits computes at its accuracy level in the switches' branches as in the written graph)."""
    folder, data = tied_builder_model
    probe = run_cli("run", folder / "model.onnx", "--data", data, "-o", tmp_path / "probe", "--size-budget", "0.1",
                    "--mix-samples", "2", "--json")
    assert probe.exit_code == 0, probe.output
    budget = json.loads(probe.stdout)["budget"]
    units = {u["name"]: u for u in budget["mix"]["units"]}
    tied = [name for name in units if "+" in name]
    assert len(tied) == 1  # lm_head and the embedding: one unit, one table
    assert 0 < len(budget["mix"]["chosen"]) < len(units)
    assert budget["measured_kl"] == pytest.approx(budget["mix"]["kl"], rel=1e-6)
    assert (tmp_path / "probe" / "genai_config.json").exists()
    bits = _bits(tmp_path / "probe")
    assert sum(1 for n in onnx.load(str(tmp_path / "probe" / "model.onnx"), load_external_data=False).graph.node
               if n.op_type == "GatherBlockQuantized") == 1
    assert set(bits.values()) == {4, 8}
    from tests.genai_models import generate

    tokens, _ = generate(tmp_path / "probe")  # onnxruntime-genai's own loop runs the written folder
    assert len(tokens) > 0


PAUSED_CHOICE = """
import os, pathlib, sys, time
import graphcal.evaluation.pipeline as pipeline
def paused(*args, **kwargs):
    pathlib.Path(os.environ["GC_PAUSED"]).touch()
    time.sleep(600)
pipeline.measure_mix = paused
from graphcal.cli import main
sys.argv = ["graphcal", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_the_forms_folder_is_gone_after_sigterm_and_ctrl_c(llama_dir, tmp_path, sig, code):
    work = tmp_path / "work"
    work.mkdir()

    def check():
        forms = [p for p in work.iterdir() if ".graphcal-mix-" in p.name]
        assert forms and (forms[0] / "low" / "model.onnx").exists() and (forms[0] / "high" / "model.onnx").exists()

    returncode, err = signal_paused_run(PAUSED_CHOICE, ["run", llama_dir / "model.onnx", "--data",
                                                        llama_dir / "calib.npz", "--size-budget", "0.42", "-o",
                                                        work / "o"], tmp_path, sig, "its choice", check)
    assert returncode == code, err
    assert err.strip().splitlines()[-1] == "interrupted; no output was written", err
    assert list(work.iterdir()) == []  # both forms, the lock and -o: nothing left
