"""calibrate(model, data, output_dir, options): one record (graphcal.Options) holds every `graphcal run`
option; the CLI builds it from its flags, and the keyword form maps onto it."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

import graphcal
from graphcal.cli.run import run as run_command
from graphcal.config import Options, resolve
from graphcal.errors import UsageError
from tests.helpers import run_cli

MODELS = Path(__file__).resolve().parents[2] / "models"

# Each of run's flags, a value other than its default, and the field it must reach in graphcal.Options with
# that value: a flag added to run without an entry here fails test_the_table_covers_every_run_flag.
FLAGS = {
    "scheme": (["--scheme", "W4A16"], "scheme", "W4A16"),
    "targets": (["--targets", "re:.*proj$", "--targets", "Linear"], "targets", ("re:.*proj$", "Linear")),
    "ignore": (["--ignore", "model.x"], "ignore", ("model.x",)),
    "scheme_for": (["--scheme-for", "Embedding=W4A16"], "scheme_for", ("Embedding=W4A16",)),
    "lm_head": (["--lm-head"], "lm_head", True),
    "rotate": (["--rotate", "R1"], "rotate", "R1"),
    "observer": (["--observer", "mse"], "observer", "mse"),
    "kv_cache": (["--kv-cache-scheme", "FP8"], "kv_cache", "FP8"),
    "recipe": (["--recipe", "recipe.yaml"], "recipe", Path("recipe.yaml")),
    "target_runtime": (["--target", "qdq"], "target", "qdq"),
    "smoothquant": (["--smoothquant", "all"], "smoothquant", "all"),
    "smoothing_strength": (["--smoothing-strength", "0.3"], "smoothing_strength", "0.3"),
    "algorithm": (["--algorithm", "awq+gptq"], "algorithm", "awq+gptq"),
    "group_size": (["--group-size", "64"], "group_size", 64),
    "block_size": (["--block-size", "32"], "block_size", 32),
    "dampening_frac": (["--dampening-frac", "0.05"], "dampening_frac", 0.05),
    "actorder": (["--actorder", "weight"], "actorder", "weight"),
    "gptq_order": (["--gptq-order", "one-pass"], "gptq_order", "one-pass"),
    "duo_scaling": (["--duo-scaling", "both"], "duo_scaling", "both"),
    "n_grid": (["--n-grid", "7"], "n_grid", 7),
    "awq_samples": (["--awq-samples", "3"], "awq_samples", 3),
    "awq_clip": (["--awq-clip"], "awq_clip", True),
    "matmulnbits": (["--matmulnbits", "0"], "matmulnbits", 0),
    "batch_size": (["--batch-size", "2"], "batch_size", 2),
    "num_samples": (["--num-samples", "5"], "num_samples", 5),
    "device": (["--device", "cpu"], "device", "cpu"),
    "skip_nonfinite_weights": (["--skip-nonfinite-weights"], "skip_nonfinite_weights", True),
    "exclude_padding": (["--exclude-padding"], "exclude_padding", True),
    "tap_limit_mb": (["--tap-limit-mb", "5"], "tap_limit_mb", 5.0),
    "cache_mb": (["--cache-mb", "0"], "cache_mb", 0.0),
    "ignore_memory_check": (["--ignore-memory-check"], "ignore_memory_check", True),
    "pass_mode": (["--pass", "whole-graph"], "pass_mode", "whole-graph"),
    "as_json": (["--json"], "progress", False),  # --json and --quiet: no progress bar
    "quiet": (["--quiet"], "progress", False),
}
POSITIONAL = {"model", "data", "output"}  # calibrate's model, data, output_dir
CLI_ONLY = {"debug"}  # how errors show (tracebacks), not what the run does
# run --size-budget's flags: calibrate_within's goal (graphcal.budget.Goal) and mix_samples, not Options fields
BUDGET = {"size_budget": "goal", "target_kl": "goal", "mix_samples": "mix_samples"}
API_ONLY = {"rotation_type", "reduce_in_graph"}  # a recipe's transform_type; reductions in torch (no flags)


def test_the_table_covers_every_run_flag():
    names = {p.name for p in run_command.params}
    assert names - POSITIONAL - CLI_ONLY - set(BUDGET) == set(FLAGS)
    import inspect

    from graphcal.budget import Goal, calibrate_within

    assert set(BUDGET.values()) <= set(inspect.signature(calibrate_within).parameters)
    assert {"size_budget_bytes", "target_kl"} <= set(inspect.signature(Goal).parameters)


def test_every_option_field_is_a_run_flag_or_listed_as_api_only():
    reached = {field for _, field, _ in FLAGS.values()}
    assert {f.name for f in fields(Options)} - reached == API_ONLY


def test_every_run_flag_reaches_calibrate_in_the_record(monkeypatch, tmp_path):
    """graphcal run with every flag given: calibrate gets them all, in one Options, by field."""
    import graphcal.calibration.pipeline as pipeline
    from graphcal.calibration.result import CalibrationResult

    seen = {}

    def fake_calibrate(model, data, output_dir, options=None, **keywords):
        seen.update(model=model, data=data, output_dir=output_dir, options=options, keywords=keywords)
        return CalibrationResult(output_dir, [], [], [], None, 0, 0, 0.0, rank=1)  # rank 1: run prints nothing

    monkeypatch.setattr(pipeline, "calibrate", fake_calibrate)
    args = [arg for flag, _, _ in FLAGS.values() for arg in flag]
    out = run_cli("run", "m.onnx", "--data", "d.npz", "-o", tmp_path / "out", *args)
    assert out.exit_code == 0, out.output
    assert seen["keywords"] == {}
    assert (seen["model"], seen["data"], seen["output_dir"]) == (Path("m.onnx"), Path("d.npz"), tmp_path / "out")
    options = seen["options"]
    assert isinstance(options, Options)
    for name, (_, field, value) in FLAGS.items():
        assert getattr(options, field) == value, name
    assert (options.rotation_type, options.reduce_in_graph) == (None, True)  # the API-only fields keep their defaults


def test_run_without_flags_gives_the_default_record(monkeypatch, tmp_path):
    import graphcal.calibration.pipeline as pipeline
    from graphcal.calibration.result import CalibrationResult

    seen = []
    monkeypatch.setattr(pipeline, "calibrate", lambda m, d, o, options=None, **kw: seen.append((options, kw))
                        or CalibrationResult(o, [], [], [], None, 0, 0, 0.0, rank=1))
    out = run_cli("run", "m.onnx", "--data", "d.npz", "-o", tmp_path / "out")
    assert out.exit_code == 0, out.output
    assert seen == [(Options(progress=True), {})]


def test_keywords_map_onto_the_record():
    from graphcal.config.options import with_keywords

    assert with_keywords(None, {"scheme": "W8A8_STATIC", "targets": ["a", "b"]}) == Options(scheme="W8A8_STATIC",
                                                                                            targets=("a", "b"))
    assert with_keywords(Options(device="cpu"), {"n_grid": 5}) == Options(device="cpu", n_grid=5)
    # one pattern given bare is one pattern, not its letters
    assert with_keywords(None, {"targets": "Linear", "ignore": "lm_head"}) == Options(targets=("Linear",),
                                                                                      ignore=("lm_head",))
    with pytest.raises(TypeError, match="sheme"):
        with_keywords(None, {"sheme": "W8A8"})
    with pytest.raises(TypeError, match="graphcal.Options"):
        with_keywords({"scheme": "W8A8"}, {})


def test_rotation_type_from_python():
    assert resolve(Options(rotate="R1", rotation_type="random-matrix")).rotation_type == "random-matrix"
    assert resolve(Options(rotate="R1")).rotation_type == "hadamard"
    with pytest.raises(UsageError, match="rotation_type"):
        resolve(Options(rotate="R1", rotation_type="fourier"))


def test_a_bad_option_is_refused_before_the_output_folder(tmp_path):
    """Resolved first, as run resolves its flags: the option's error, not the folder's, and nothing written."""
    out = tmp_path / "file"
    out.write_text("not a folder")
    with pytest.raises(UsageError, match="rotation_type"):
        graphcal.calibrate(MODELS / "tiny-llama" / "model.onnx", MODELS / "tiny-llama" / "calib.npz", out,
                           graphcal.Options(rotate="R1", rotation_type="fourier"))
    assert out.read_text() == "not a folder"


def test_the_record_reaches_what_only_config_reached(tmp_path):
    """--rotate, --lm-head, --scheme-for and GPTQ's knobs from Python, without building a RunConfig; the
    summary beside the result, as run prints it."""
    llama = MODELS / "tiny-llama"
    options = graphcal.Options(scheme="W4A16", rotate="R1", lm_head=True, scheme_for=("re:.*down_proj$=W8A16",),
                               algorithm="gptq", gptq_order="one-pass", block_size=64, device="cpu")
    result = graphcal.calibrate(llama / "model.onnx", llama / "calib.npz", tmp_path / "out", options, num_samples=8)
    assert result.transforms["rotation"].folded["rotations"] == ["R1"]
    assert "lm_head" not in result.ignored and "lm_head" in {t.target.name for t in result.targets}
    assert result.transforms["gptq"].order == "one-pass"
    written = json.loads((tmp_path / "out" / "quantization_config.json").read_text())["config_groups"]
    by_target = {tuple(g["targets"]): g["weights"]["num_bits"] for g in written.values()}
    assert by_target[("re:.*down_proj$",)] == 8 and by_target[("Linear",)] == 4  # compressed-tensors' W8A16 / W4A16
    lines = result.summary_lines()
    assert lines[0] == "quantized 15 MatMul/Gemm targets with W4A16"
    assert lines[-4:] == ["done in %.1f s; wrote:" % result.seconds, *[f"  {f}" for f in result.files]]
    assert result.as_dict()["samples"] == 8
