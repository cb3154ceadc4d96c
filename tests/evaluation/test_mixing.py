"""eval --size-budget / --target-db: mixed precision chosen by measurement, and flags that write it.

The references are independent of graphcal.evaluation.mixing: the switchable model against
onnxruntime running each quantized model itself (ORT_ENABLE_BASIC), and the chosen mix against
`graphcal run` given the printed flags, its size on disk and its outputs measured by a plain eval.
"""

from __future__ import annotations

import json
import shlex

import numpy as np
import onnx
import pytest

from graphcal.evaluation.mixing import MIN_GAIN
from tests.helpers import run_cli


def _run(model, data, out, *flags):
    result = run_cli("run", model, "--data", data, "-o", out, "-q", "--json", *flags)
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


def _sqnr(reference, quantized, data) -> float:
    result = run_cli("eval", reference, quantized, "--data", data, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["outputs"][0]["sqnr_db"]


@pytest.fixture(scope="module")
def llama_forms(llama_dir, tmp_path_factory):
    """tiny-llama as int4 (W4A16, lm_head too) and as int8 (W8A16): the low model and its fallback."""
    root = tmp_path_factory.mktemp("mix")
    for scheme in ("W4A16", "W8A16"):
        _run(llama_dir / "model.onnx", llama_dir / "calib.npz", root / scheme, "--scheme", scheme, "--lm-head")
    return root / "W4A16" / "model.onnx", root / "W8A16" / "model.onnx"


def _mix(llama_dir, low, *flags):
    result = run_cli("eval", llama_dir / "model.onnx", low, "--data", llama_dir / "heldout.npz", "--json", *flags)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["mix"]


def test_the_switchable_model_gives_each_form_and_fp32(llama_dir, llama_forms):
    """Two quantized forms behind nested switches: all off is fp32, every first switch on is the
    int4 model, every second one the int8 model, as onnxruntime runs each model itself."""
    from graphcal.evaluation.sensitivity import quantized_layers
    from graphcal.graph.io import load_model, value_types
    from graphcal.graph.switch import switchable_model
    from graphcal.graph.targets import find_targets
    from graphcal.runtime import run_model

    low, high = llama_forms
    ref = load_model(llama_dir / "model.onnx")
    forms = [load_model(low), load_model(high)]
    layers = quantized_layers(forms[0], ref, find_targets(ref)[0])
    types = {k: v.elem_type for k, v in value_types(ref).items()}
    model, switches = switchable_model(ref, forms, {t.name: t.node for t in layers}, types)
    assert len(switches) == len(layers) == 15 and all(None not in s and len(s) == 2 for s in switches.values())
    feeds = {k: v[:4] for k, v in np.load(llama_dir / "heldout.npz").items()}
    every = [s for names in switches.values() for s in names]
    for on, reference in ((None, llama_dir / "model.onnx"), (0, low), (1, high)):
        state = {s: np.array(on is not None and names.index(s) == on) for names in switches.values() for s in names}
        assert set(state) == set(every)
        got = run_model(model, {**feeds, **state}, ["logits"])["logits"]
        want = run_model(reference, feeds, ["logits"])["logits"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_budget_mix_pasted_into_run_fits_and_gives_the_measured_result(llama_dir, llama_forms, tmp_path):
    low, high = llama_forms
    low_bytes = sum(f.stat().st_size for f in low.parent.glob("model.onnx*"))
    budget = (low_bytes + 60_000) / 1e6
    mix = _mix(llama_dir, low, "--fallback", high, "--size-budget", budget, "--per-layer")
    assert mix["low_bytes"] == low_bytes and mix["budget_bytes"] == round(budget * 1e6)
    chosen = [u for u in mix["units"] if u["chosen"]]
    assert 0 < len(chosen) < len(mix["units"])  # the budget binds
    assert sum(u["bytes_added"] for u in chosen) <= 60_000
    room = 60_000 - sum(u["bytes_added"] for u in chosen)
    best = max(u["gain"] / u["bytes_added"] for u in mix["units"])
    for u in mix["units"]:  # a unit left out does not fit, or removes no more per byte than the first taken
        if not u["chosen"]:
            assert u["bytes_added"] > room or u["gain"] / u["bytes_added"] <= best
    out = tmp_path / "mixed"
    written = _run(llama_dir / "model.onnx", llama_dir / "calib.npz", out, "--scheme", "W4A16", "--lm-head",
                   *mix["flags"])
    assert written["model_bytes"] <= mix["bytes"] <= round(budget * 1e6)
    assert mix["bytes"] - written["model_bytes"] < 256 * len(chosen) + 64  # the protobuf allowance, no more
    predicted = mix["expected_outputs"][0]["sqnr_db"]
    assert predicted > mix["low_sqnr_db"] + 3
    assert _sqnr(llama_dir / "model.onnx", out / "model.onnx", llama_dir / "heldout.npz") == pytest.approx(
        predicted, abs=0.05)
    config = json.loads((out / "quantization_config.json").read_text())
    int8 = {n for g in config["config_groups"].values() if g["weights"]["num_bits"] == 8 for n in g["targets"]}
    assert int8 and "Linear" not in int8  # the promoted layers only


def test_a_target_is_reached_with_fewer_units_and_an_unreachable_one_is_said(llama_dir, llama_forms, tmp_path):
    low, high = llama_forms
    every = _mix(llama_dir, low, "--fallback", high, "--target-db", 200)
    noise = 10 ** (-every["low_sqnr_db"] / 10)
    worth = [u["name"] for u in every["units"] if u["noise_removed"] > MIN_GAIN * noise]
    assert every["reached"] is False and sorted(every["chosen"]) == sorted(worth) and len(worth) >= 4
    target = every["low_sqnr_db"] + 6
    mix = _mix(llama_dir, low, "--fallback", high, "--target-db", target)
    assert mix["reached"] and 0 < len(mix["chosen"]) < len(mix["units"])
    out = tmp_path / "mixed"
    _run(llama_dir / "model.onnx", llama_dir / "calib.npz", out, "--scheme", "W4A16", "--lm-head", *mix["flags"])
    assert _sqnr(llama_dir / "model.onnx", out / "model.onnx", llama_dir / "heldout.npz") >= target


def test_without_a_fallback_promoted_layers_go_float_and_the_ignores_are_kept(llama_dir, tmp_path):
    low = tmp_path / "low"
    _run(llama_dir / "model.onnx", llama_dir / "calib.npz", low, "--scheme", "W4A16")
    low_bytes = sum(f.stat().st_size for f in low.glob("model.onnx*"))
    mix = _mix(llama_dir, low / "model.onnx", "--size-budget", (low_bytes + 40_000) / 1e6, "--per-layer")
    assert mix["high"] == "float" and mix["chosen"]
    assert mix["flags"][:2] == ["--ignore", "lm_head"] and set(mix["flags"][::2]) == {"--ignore"}
    out = tmp_path / "mixed"
    written = _run(llama_dir / "model.onnx", llama_dir / "calib.npz", out, "--scheme", "W4A16", *mix["flags"])
    assert written["model_bytes"] <= mix["bytes"]
    assert _sqnr(llama_dir / "model.onnx", out / "model.onnx", llama_dir / "heldout.npz") == pytest.approx(
        mix["expected_outputs"][0]["sqnr_db"], abs=0.05)


def test_a_tied_table_moves_with_its_lm_head_and_stays_one_table(tied_builder_model, tmp_path):
    folder, calib = tied_builder_model
    common = ["--group-size", "32", "--lm-head", "--matmulnbits"]
    for scheme in ("W4A16", "W8A16"):
        _run(folder / "model.onnx", calib, tmp_path / scheme, "--scheme", scheme, *common,
             "--scheme-for", f"Embedding={scheme}")
    low = tmp_path / "W4A16" / "model.onnx"
    low_bytes = sum(f.stat().st_size for f in low.parent.glob("model.onnx*"))
    result = run_cli("eval", folder / "model.onnx", low, "--data", calib, "--fallback", tmp_path / "W8A16" / "model.onnx",
                     "--target-db", 200, "--json")
    assert result.exit_code == 0, result.output
    mix = json.loads(result.output.strip().splitlines()[-1])["mix"]
    tied = next(u for u in mix["units"] if "model.embed_tokens" in u["layers"])
    assert tied["layers"] == ["lm_head", "model.embed_tokens"] and tied["name"] == "lm_head+model.embed_tokens"
    assert tied["chosen"] and len(mix["chosen"]) >= 3  # out of reach: every unit worth its bytes promoted
    out = tmp_path / "mixed"
    written = _run(folder / "model.onnx", calib, out, "--scheme", "W4A16", *common, "--scheme-for",
                   "Embedding=W4A16", *mix["flags"])
    assert written["model_bytes"] <= mix["bytes"] and mix["low_bytes"] == low_bytes
    model = onnx.load(out / "model.onnx")
    gather = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    head = next(n for n in model.graph.node if n.name == "/lm_head/MatMul")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gather.attribute}
    assert attrs["bits"] == 8 and head.op_type == "MatMulNBits"
    reshape = next(n for n in model.graph.node if n.output[0] == gather.input[0])
    assert reshape.input[0] == head.input[1]  # still one table, now int8


@pytest.mark.parametrize("extra, fragment", [
    (["--size-budget", "0.001"], "over the --size-budget"),
    (["--size-budget", "1", "--target-db", "20"], "give one of --size-budget, --target-db and --target-kl"),
    (["--fallback", "{low}"], "--fallback is the higher form for --size-budget, --target-db or --target-kl"),
    (["--fallback", "{bare}", "--size-budget", "1"], "has no quantization_config.json beside it"),
])
def test_bad_mixing_requests_are_refused_before_any_pass(llama_dir, llama_forms, tmp_path, extra, fragment):
    low, _ = llama_forms
    bare = tmp_path / "bare.onnx"
    bare.write_bytes(low.read_bytes())
    args = [x.format(low=low, bare=bare) for x in extra]
    result = run_cli("eval", llama_dir / "model.onnx", low, "--data", llama_dir / "heldout.npz", *args)
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error:") and fragment in last and "Traceback" not in result.output
    assert "compared on" not in result.output  # refused before the comparison's pass


def test_the_text_report_prints_the_flags_it_measured(llama_dir, llama_forms):
    low, high = llama_forms
    args = ["eval", llama_dir / "model.onnx", low, "--data", llama_dir / "heldout.npz", "--fallback", high,
            "--size-budget", 1]
    result = run_cli(*args)
    assert result.exit_code == 0, result.output
    line = next(ln for ln in result.output.splitlines() if ln.startswith("to write it, add to the command"))
    flags = shlex.split(line.split("model: ", 1)[1])
    assert flags == _mix(llama_dir, low, *args[5:])["flags"]


def test_a_fallback_config_linked_out_of_its_folder_is_refused(llama_dir, llama_forms, tmp_path):
    """The fallback's quantization_config.json is a stranger's file: read only inside its folder."""
    low, high = llama_forms
    folder = tmp_path / "fallback"
    folder.mkdir()
    (folder / "model.onnx").write_bytes(high.read_bytes())
    outside = tmp_path / "elsewhere.json"
    outside.write_text((high.parent / "quantization_config.json").read_text())
    (folder / "quantization_config.json").symlink_to(outside)
    result = run_cli("eval", llama_dir / "model.onnx", low, "--data", llama_dir / "heldout.npz", "--fallback",
                     folder / "model.onnx", "--size-budget", 1)
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert "leads out of the model's folder" in last and "Traceback" not in result.output
