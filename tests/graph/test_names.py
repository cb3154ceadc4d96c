"""Strangers' module-name regexes are bounded (graph.names): backtracking patterns in flags and recipe
mappings are refused at once in one line, and ordinary patterns match as compressed-tensors' match_name
does. Through the CLI, on a toy decoder built with onnx.helper (tests/graph/toy_models.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from graphcal.errors import UsageError
from graphcal.graph.names import NameMatcher, check_pattern, match_name
from tests.graph.toy_models import H, toy_decoder
from tests.helpers import run_cli, run_cli_process

HANG_GUARD_S = 60  # a hang guard, not a benchmark: the refusal itself takes well under a second




# -- 2. a stranger's regex is bounded -----------------------------------------------------------------


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return toy_decoder(tmp_path_factory.mktemp("unnumbered"), [("encoder.self_attn", "encoder.mlp"),
                                                            ("decoder.self_attn", "decoder.mlp")])


@pytest.mark.parametrize("flag", ["--ignore", "--targets"])
def test_a_backtracking_regex_flag_is_refused_at_once(decoder, tmp_path, flag):
    start = time.monotonic()
    done = run_cli_process("run", decoder, "--data", decoder.parent / "calib.npz", "--scheme", "W4A16", "-o",
                           tmp_path / "out", flag, "re:(.*.*)*q_projX", cwd=tmp_path, timeout=HANG_GUARD_S)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "re:(.*.*)*q_projX" in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "out" / "model.onnx").exists()
    assert time.monotonic() - start < HANG_GUARD_S


@pytest.mark.parametrize("command", ["run", "inspect"])
def test_a_backtracking_regex_is_refused_before_the_model_is_read(tmp_path, command):
    (tmp_path / "model.onnx").write_bytes(b"not a model")
    np.savez(tmp_path / "calib.npz", x=np.zeros((1, 8, H), np.float32))
    args = [command, tmp_path / "model.onnx", "--ignore", "lm_head", "--ignore", "re:(.*.*)*q_projX"]
    result = run_cli(*args, *(["--data", tmp_path / "calib.npz", "-o", tmp_path / "out"] if command == "run" else []))
    assert result.exit_code == 2 and "re:(.*.*)*q_projX" in result.output and "readable" not in result.output, \
        result.output


@pytest.mark.parametrize("modifier", ["SmoothQuantModifier", "AWQModifier"])
def test_a_backtracking_regex_in_a_recipe_mapping_is_refused_at_once(decoder, tmp_path, modifier):
    if modifier == "SmoothQuantModifier":
        recipe = ("SmoothQuantModifier:\n  mappings: [[['re:(.*.*)*q_projX'], 're:.*norm']]\n"
                  "QuantizationModifier: {scheme: W8A8}\n")
    else:
        recipe = ("AWQModifier:\n  mappings: [{smooth_layer: 're:.*norm', balance_layers: ['re:(.*.*)*q_projX']}]\n"
                  "QuantizationModifier: {scheme: W4A16}\n")
    (tmp_path / "recipe.yaml").write_text(recipe)
    done = run_cli_process("run", decoder, "--data", decoder.parent / "calib.npz", "--recipe", tmp_path / "recipe.yaml",
                           "-o", tmp_path / "out", cwd=tmp_path, timeout=HANG_GUARD_S)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "re:(.*.*)*q_projX" in lines[0], done.stderr


def test_a_regex_that_backtracks_past_its_budget_is_a_usage_error():
    """What the nesting check lets through still ends: the matcher's time budget (graph.names)."""
    match = NameMatcher("--ignore", budget_s=0.05)
    start = time.monotonic()
    with pytest.raises(UsageError, match="took over") as raised:
        for _ in range(1000):
            match("model.layers.0.self_attn.q_proj_weight_name_that_is_long", r"re:(.|\w)*\d$")
    assert "re:(.|" in str(raised.value) and "\n" not in str(raised.value)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("pattern", ["re:(a+)*b", "re:(?:\\d+\\.)*q", "re:(x{1,3})+y", "re:((a|b)*c)*"])
def test_nested_repeats_are_refused_before_matching(pattern):
    with pytest.raises(UsageError, match="repeats a repeat"):
        check_pattern(pattern, "--ignore")


@pytest.mark.parametrize("pattern", ["re:.*q_proj", "re:model\\.layers\\.\\d+\\.mlp", "re:.*(q|k|v)_proj$", "q_proj",
                                     "re:layers\\.[0-3]\\.", "re:(?i).*Q_PROJ", "re:lm_head", "re:.*proj(?!x)",
                                     "re:(?:model\\.)?layers\\.1\\b", "re:self_attn"])
def test_ordinary_patterns_match_as_compressed_tensors_does(pattern):
    """compressed-tensors' match_name: re.match (anchored at the start only), or the exact name."""
    from compressed_tensors.utils.match import match_name as ct_match_name

    names = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head", "q_proj", "self_attn.v_proj",
             "model.layers.12.self_attn.k_projx", "layers.1.mlp"]
    for name in names:
        assert match_name(name, pattern) == ct_match_name(name, pattern), (name, pattern)
