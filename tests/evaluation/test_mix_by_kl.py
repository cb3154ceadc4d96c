"""eval --size-budget / --target-kl ranked by the logits' next-token KL (or, with labels, the token loss).

The reference is independent of graphcal.evaluation.mixing and next_token: the switchable model run
here with onnxruntime itself (every layer in the low form, one unit's layers in the high one), the KL
taken by torch.nn.functional.kl_div and the token loss by cross_entropy on the fetched logits, and
the greedy choice by gain per byte redone here from those gains."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

from graphcal.evaluation.mixing import MIN_GAIN
from tests.helpers import run_cli


def _run(model, data, out, *flags):
    result = run_cli("run", model, "--data", data, "-o", out, "-q", "--json", *flags)
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


def _eval(*args):
    result = run_cli("eval", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def forms(llama_dir, tmp_path_factory):
    """tiny-llama as W4A16 in groups of 32 (lm_head too), the low model, and as W8A16, its fallback."""
    root = tmp_path_factory.mktemp("kl")
    _run(llama_dir / "model.onnx", llama_dir / "calib.npz", root / "low", "--scheme", "W4A16", "--group-size", "32",
         "--lm-head")
    _run(llama_dir / "model.onnx", llama_dir / "calib.npz", root / "high", "--scheme", "W8A16", "--lm-head")
    return root / "low" / "model.onnx", root / "high" / "model.onnx"


@pytest.fixture(scope="module")
def masked_data(llama_dir, tmp_path_factory):
    """heldout.npz with right padding on half the rows (mask 0, label -100 there) and labels = the tokens."""
    data = dict(np.load(llama_dir / "heldout.npz"))
    mask = data["attention_mask"].copy()
    mask[::2, -6:] = 0
    labels = np.where(mask != 0, data["input_ids"], -100)
    path = tmp_path_factory.mktemp("kl-data")
    np.savez(path / "masked.npz", input_ids=data["input_ids"], attention_mask=mask)
    np.savez(path / "labelled.npz", input_ids=data["input_ids"], attention_mask=mask, labels=labels)
    return path / "masked.npz", path / "labelled.npz"


class Switched:
    """The fp32 model with each quantized layer switchable to the low or the high form, run by onnxruntime here."""

    def __init__(self, llama_dir, low, high, data):
        from graphcal.graph.io import load_model, value_types
        from graphcal.graph.switch import switchable_model
        from graphcal.graph.targets import find_lookups, find_targets

        ref = load_model(llama_dir / "model.onnx")
        layers = {t.name: t.node for t in [*find_targets(ref)[0], *find_lookups(ref)]}
        types = {k: v.elem_type for k, v in value_types(ref).items()}
        quantized = {name: node for name, node in layers.items() if name != "model.embed_tokens"}
        model, self.switches = switchable_model(ref, [load_model(low), load_model(high)], quantized, types)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        arrays = dict(np.load(data))
        self.labels = arrays.pop("labels", None)
        self.feeds = arrays
        self.fp32 = self.logits(set(), every_low=False)

    def logits(self, high: set[str], every_low: bool = True) -> torch.Tensor:
        state = {}
        for layer, (low_switch, high_switch) in self.switches.items():
            state[low_switch] = np.array(every_low and layer not in high)
            state[high_switch] = np.array(layer in high)
        return torch.as_tensor(self.session.run(["logits"], {**self.feeds, **state})[0], dtype=torch.float64)

    def kl(self, logits: torch.Tensor) -> float:
        """Mean KL(p_fp32 || p) over the positions the mask keeps."""
        p, q = torch.log_softmax(self.fp32, -1), torch.log_softmax(logits, -1)
        per = F.kl_div(q, p, log_target=True, reduction="none").sum(-1)
        return float(per[torch.as_tensor(self.feeds["attention_mask"]) != 0].mean())

    def loss(self, logits: torch.Tensor) -> float:
        """transformers' causal LM loss: logits at t score labels at t + 1, -100 ignored."""
        labels = torch.as_tensor(self.labels)[:, 1:].reshape(-1)
        return float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels, ignore_index=-100))


def _greedy(units, gains, room):
    """The units taken by gain per byte, the most first, while they fit (none under MIN_GAIN of the low loss)."""
    def value(u):
        return float("inf") if u["bytes_added"] <= 0 else max(gains[u["name"]], 0.0) / u["bytes_added"]

    chosen = []
    for u in sorted(units, key=lambda u: (-value(u), u["name"])):
        if (gains[u["name"]] > MIN_GAIN * gains[""] or u["bytes_added"] <= 0) and u["bytes_added"] <= room:
            chosen.append(u["name"])
            room -= u["bytes_added"]
    return chosen


def test_a_budget_mix_is_ranked_and_chosen_by_the_kl_torch_measures(llama_dir, forms, masked_data):
    low, high = forms
    data = masked_data[0]
    low_bytes = sum(f.stat().st_size for f in low.parent.glob("model.onnx*"))
    budget = low_bytes + 60_000
    report = _eval(llama_dir / "model.onnx", low, "--data", data, "--fallback", high, "--size-budget", budget / 1e6,
                   "--per-layer")
    mix = report["mix"]
    assert mix["measure"] == "kl" and mix["logits"] == "logits"
    ref = Switched(llama_dir, low, high, data)
    low_kl = ref.kl(ref.logits(set()))
    assert mix["low_kl"] == pytest.approx(low_kl, rel=1e-4)
    gains = {"": low_kl}
    for u in mix["units"]:
        gains[u["name"]] = low_kl - ref.kl(ref.logits(set(u["layers"])))
        assert u["gain"] == u["kl_removed"] == pytest.approx(gains[u["name"]], rel=1e-3, abs=1e-7), u["name"]
    want = _greedy(mix["units"], gains, budget - low_bytes)
    assert mix["chosen"] == want and 0 < len(want) < len(mix["units"])  # the budget binds
    assert mix["bytes"] <= budget
    layers = {name for u in mix["units"] if u["chosen"] for name in u["layers"]}
    assert mix["kl"] == pytest.approx(ref.kl(ref.logits(layers)), rel=1e-4) and mix["kl"] < low_kl
    # the plain comparison: the low model as written, run by onnxruntime itself, against fp32
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    written = ort.InferenceSession(str(low), options, providers=["CPUExecutionProvider"])
    got = torch.as_tensor(written.run(["logits"], ref.feeds)[0], dtype=torch.float64)
    assert report["next_token"]["kl"] == pytest.approx(ref.kl(got), rel=1e-4)
    assert report["next_token"]["positions"] == int(ref.feeds["attention_mask"].sum())


def test_with_labels_the_token_loss_increase_ranks(llama_dir, forms, masked_data):
    low, high = forms
    data = masked_data[1]
    report = _eval(llama_dir / "model.onnx", low, "--data", data, "--fallback", high, "--size-budget", 100)
    mix = report["mix"]
    assert mix["measure"] == "token loss"
    ref = Switched(llama_dir, low, high, data)
    fp32_loss, low_loss = ref.loss(ref.fp32), ref.loss(ref.logits(set()))
    assert mix["reference_loss"] == pytest.approx(fp32_loss, rel=1e-6)
    assert mix["low_loss"] == pytest.approx(low_loss, rel=1e-5)
    assert report["next_token"]["reference_loss"] == pytest.approx(fp32_loss, rel=1e-6)
    for u in mix["units"]:
        want = low_loss - ref.loss(ref.logits(set(u["layers"])))
        assert u["gain"] == u["loss_removed"] == pytest.approx(want, rel=1e-3, abs=1e-6), u["name"]
    gains = {"": low_loss - fp32_loss, **{u["name"]: u["gain"] for u in mix["units"]}}
    assert mix["chosen"] == _greedy(mix["units"], gains, 100_000_000)  # room for all: those worth their bytes


def test_a_kl_target_is_met_by_the_mix_measured(llama_dir, forms):
    low, high = forms
    every = _eval(llama_dir / "model.onnx", low, "--data", llama_dir / "heldout.npz", "--fallback", high,
                  "--target-kl", 0)
    assert every["mix"]["reached"] is False and every["mix"]["measure"] == "kl"
    target = every["mix"]["low_kl"] / 3
    mix = _eval(llama_dir / "model.onnx", low, "--data", llama_dir / "heldout.npz", "--fallback", high,
                "--target-kl", target)["mix"]
    assert mix["reached"] and mix["kl"] <= target and 0 < len(mix["chosen"]) < len(mix["units"])
    ref = Switched(llama_dir, low, high, llama_dir / "heldout.npz")
    layers = {name for u in mix["units"] if u["chosen"] for name in u["layers"]}
    assert ref.kl(ref.logits(layers)) <= target * (1 + 1e-4)


def test_an_encoder_keeps_sqnr_and_says_so(bert_dir, tmp_path):
    _run(bert_dir / "model.onnx", bert_dir / "calib.npz", tmp_path / "low", "--scheme", "W4A16")
    low = tmp_path / "low" / "model.onnx"
    args = ["eval", bert_dir / "model.onnx", low, "--data", bert_dir / "heldout.npz", "--size-budget", 100]
    result = run_cli(*args)
    assert result.exit_code == 0, result.output
    assert "ranked by output noise (SQNR) removed per byte (last_hidden_state: the model has no logits output)" \
        in result.output and "next-token KL" not in result.output
    report = _eval(*args[1:])
    assert report["mix"]["measure"] == "sqnr" and "next_token" not in report and "low_kl" not in report["mix"]
    refused = run_cli(*args[:5], "--target-kl", "0.1")
    assert refused.exit_code == 2, refused.output
    last = refused.output.strip().splitlines()[-1]
    assert last.startswith("error: --target-kl measures the next-token distributions of a logits output")
    assert "Traceback" not in refused.output and "compared on" not in refused.output


def test_the_text_report_shows_the_measure_and_the_kls(llama_dir, forms):
    low, high = forms
    result = run_cli("eval", llama_dir / "model.onnx", low, "--data", llama_dir / "heldout.npz", "--fallback", high,
                     "--size-budget", 100)
    assert result.exit_code == 0, result.output
    text = result.output
    assert "logits: next-token KL from fp32" in text and "ranked by next-token KL from fp32 (nats) removed per byte" in text
    assert "KL removed" in text and next(ln for ln in text.splitlines() if ln.startswith("chosen:")).count(", KL ") == 1


@pytest.mark.parametrize("extra, fragment", [
    (["--target-kl", "0.1", "--target-db", "20"], "give one of --size-budget, --target-db and --target-kl"),
    (["--target-kl", "0.1", "--size-budget", "1"], "give one of --size-budget, --target-db and --target-kl"),
    (["--target-kl", "-1"], "--target-kl"),
])
def test_bad_kl_targets_are_one_line_errors(llama_dir, forms, extra, fragment):
    low, _ = forms
    result = run_cli("eval", llama_dir / "model.onnx", low, "--data", llama_dir / "heldout.npz", *extra)
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error:") and fragment in last and "Traceback" not in result.output


def test_labels_that_do_not_fit_the_tokens_are_refused_in_one_line(llama_dir, forms, tmp_path):
    low, _ = forms
    data = dict(np.load(llama_dir / "heldout.npz"))
    np.savez(tmp_path / "bad.npz", **data, labels=data["input_ids"][:, :-1])
    result = run_cli("eval", llama_dir / "model.onnx", low, "--data", tmp_path / "bad.npz")
    assert result.exit_code != 0 and "'labels' must be integer token ids shaped as 'input_ids'" in result.output
    assert "Traceback" not in result.output


def test_the_switched_reference_is_the_models_themselves(llama_dir, forms):
    """The reference's switch states give the fp32 and low models as onnxruntime runs them."""
    low, high = forms
    ref = Switched(llama_dir, low, high, llama_dir / "heldout.npz")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    for path, logits in ((llama_dir / "model.onnx", ref.fp32), (low, ref.logits(set()))):
        model = onnx.load(path)
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(session.run(["logits"], ref.feeds)[0], logits.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_a_kl_mix_on_cuda_gives_the_cpus_numbers_reduced_on_the_gpu(llama_dir, forms, masked_data, monkeypatch):
    """On CUDA the logits stay on the GPU as torch tensors and the KL is taken there: the same numbers as the
    CPU's (to GPU float error), the same choice."""
    from graphcal.evaluation.next_token import NextTokenLoss

    seen = []
    add = NextTokenLoss._add_torch

    def spy(self, ref, cand, mask, labels):
        seen.append((ref.device.type, cand.device.type))
        return add(self, ref, cand, mask, labels)

    monkeypatch.setattr(NextTokenLoss, "_add_torch", spy)
    low, high = forms
    args = [llama_dir / "model.onnx", low, "--data", masked_data[0], "--fallback", high, "--size-budget", 100]
    cpu, cuda = _eval(*args, "--device", "cpu"), _eval(*args, "--device", "cuda")
    assert cuda["provider"] == "CUDAExecutionProvider" and seen and all(d == ("cuda", "cuda") for d in seen)
    assert cuda["next_token"]["kl"] == pytest.approx(cpu["next_token"]["kl"], rel=0.02)
    assert cuda["next_token"]["positions"] == cpu["next_token"]["positions"]
    base = cpu["mix"]["low_kl"]
    assert cuda["mix"]["low_kl"] == pytest.approx(base, rel=0.02)
    for got, want in zip(cuda["mix"]["units"], cpu["mix"]["units"], strict=True):
        assert got["name"] == want["name"] and got["kl_removed"] == pytest.approx(want["kl_removed"], abs=0.02 * base)
    assert sorted(cuda["mix"]["chosen"]) == sorted(cpu["mix"]["chosen"])
    assert cuda["mix"]["kl"] == pytest.approx(cpu["mix"]["kl"], rel=0.02)


def test_labels_ride_beside_a_kv_cache_models_filled_inputs(tmp_path):
    """Token data and labels for an Optimum model with a past: the filled inputs are fed, the labels are not."""
    from tests.helpers import MODELS

    folder = MODELS / "tiny-llama-optimum"
    data = dict(np.load(folder / "heldout.npz"))
    labels = data["input_ids"].copy()
    labels[:, :4] = -100
    np.savez(tmp_path / "labelled.npz", **data, labels=labels)
    report = _eval(folder / "model.onnx", folder / "model.onnx", "--data", tmp_path / "labelled.npz")
    rows, seq = labels.shape
    assert report["next_token"]["kl"] == 0.0 and report["next_token"]["positions"] == rows * seq
    assert report["next_token"]["tokens"] == rows * (seq - 4)  # the first label scored is at position 4
    assert report["next_token"]["loss"] == report["next_token"]["reference_loss"] > 0
