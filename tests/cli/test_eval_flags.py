"""Number flags are refused at parse time when not finite or out of range (cli.options.Number), and eval's
flags that mean nothing without another are refused in one line naming what they need. Through the CLI on
the shipped tiny llama (compared with itself: a flag that slipped through would run the comparison)."""

from __future__ import annotations

import pytest

from graphcal.errors import UsageError
from graphcal.evaluation import evaluate
from tests.helpers import run_cli


def _eval(llama_dir, *extra):
    model = llama_dir / "model.onnx"
    return run_cli("eval", model, model, "--data", llama_dir / "heldout.npz", *extra)


def _parse_refusal(result, flag):
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(f"error: Invalid value for '{flag}'"), result.output
    assert "Usage:" not in result.output  # one line, as graphcal's other errors
    assert "Traceback" not in result.output and "compared on" not in result.output


@pytest.mark.parametrize("flag, value", [
    ("--size-budget", "nan"), ("--size-budget", "inf"), ("--size-budget", "1e308"), ("--size-budget", "0"),
    ("--size-budget", "-1"), ("--size-budget", "many"),
    ("--target-db", "nan"), ("--target-db", "-inf"), ("--target-db", "1e308"),
    ("--time-limit", "nan"), ("--time-limit", "inf"), ("--time-limit", "-1"),
])
def test_eval_number_flags_refuse_nonfinite_and_out_of_range_values(llama_dir, flag, value):
    _parse_refusal(_eval(llama_dir, flag, value), flag)


@pytest.mark.parametrize("flag, value", [
    ("--dampening-frac", "nan"), ("--dampening-frac", "inf"),
    ("--dampening-frac", "-1"), ("--tap-limit-mb", "nan"), ("--tap-limit-mb", "inf"), ("--tap-limit-mb", "1e400"),
    ("--tap-limit-mb", "0.5"),
])
@pytest.mark.parametrize("verb", ["inspect", "run"])
def test_run_and_inspect_number_flags_refuse_them_too(llama_dir, tmp_path, verb, flag, value):
    extra = ["--algorithm", "gptq"] if flag == "--dampening-frac" else []
    result = run_cli(verb, llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", tmp_path / "out",
                     "--scheme", "W8A8_STATIC", "--observer", "mse", *extra, flag, value)
    _parse_refusal(result, flag)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400"])
def test_smoothing_strength_refuses_nonfinite_values_in_one_line(llama_dir, tmp_path, value):
    """ALPHA|auto: checked by the config as a recipe's smoothing_strength is, before any model is read."""
    result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", tmp_path / "out",
                     "--smoothing-strength", value)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith("error: smoothing strength must be a finite number from 0 to 1"), result.output


def test_smoothing_strength_still_takes_auto_and_a_number(llama_dir):
    for value, shown in (("AUTO", "strength auto"), ("0.25", "strength 0.25")):
        result = run_cli("inspect", llama_dir / "model.onnx", "--smoothing-strength", value)
        assert result.exit_code == 0 and shown in result.output, result.output


@pytest.mark.parametrize("extra, needs", [
    (["--per-layer"], "--per-layer measures each layer with --sensitivity, or mixes layer by layer with --size-budget"),
    (["--time-limit", "5"], "--time-limit bounds the runs of --sensitivity, --size-budget, --target-kl or --target-db"),
    (["--fallback", "{model}"], "--fallback is the higher form for --size-budget, --target-db or --target-kl"),
])
def test_eval_flags_that_need_another_are_refused_naming_it(llama_dir, extra, needs):
    result = _eval(llama_dir, *[x.format(model=llama_dir / "model.onnx") for x in extra])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needs in lines[0], result.output


def test_evaluate_refuses_per_layer_alone_too(llama_dir):
    model = llama_dir / "model.onnx"
    with pytest.raises(UsageError, match="--per-layer measures each layer with --sensitivity"):
        evaluate(model, model, llama_dir / "heldout.npz", per_layer=True)
