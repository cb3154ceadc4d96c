"""Schemes by name or JSON, observer defaults, and which scheme a target gets."""

from __future__ import annotations

import pytest
from compressed_tensors.quantization import preset_name_to_scheme

from graphcal.config import build_config, observer_name, resolve_scheme, scheme_names
from graphcal.config.schemes import resolve_kv_cache
from graphcal.errors import UsageError
from graphcal.types import Target


def _target(name):
    return Target(name, f"/{name}/MatMul", "MatMul", "x", "w", (), "in_out", 4, 4)


def test_presets_are_compressed_tensors_own():
    assert resolve_scheme("w8a8", ["Linear"]) == preset_name_to_scheme("W8A8", ["Linear"])
    assert {"W8A8", "FP8", "NVFP4", "W8A8_STATIC", "INT8_STATIC"} <= set(scheme_names())


def test_static_int8_scheme_is_what_tensorrt_builds():
    s = resolve_scheme("INT8_STATIC", ["Linear"])
    assert s.weights == preset_name_to_scheme("W8A8", ["Linear"]).weights  # compressed-tensors' int8 channel weights
    a = s.input_activations
    assert (a.num_bits, a.strategy, a.dynamic, a.symmetric, a.observer) == (8, "tensor", False, True, "static_minmax")
    # the observer compressed-tensors' own static activation preset (FP8: fp8 per tensor, static) sets
    assert a.observer == preset_name_to_scheme("FP8", ["Linear"]).input_activations.observer


def test_json_scheme_and_its_validation():
    s = resolve_scheme('{"weights": {"num_bits": 8, "strategy": "tensor"}}', ["re:.*proj"])
    assert s.targets == ["re:.*proj"] and s.weights.strategy == "tensor" and s.input_activations is None
    with pytest.raises(UsageError, match="invalid scheme"):
        resolve_scheme('{"weights": {"num_bits": 8, "strategy": "group"}}', ["Linear"])  # group needs group_size
    with pytest.raises(UsageError, match="neither a preset name nor valid JSON"):
        resolve_scheme("{oops", ["Linear"])
    with pytest.raises(UsageError, match="unknown scheme 'W9A9'"):
        resolve_scheme("W9A9", ["Linear"])


def test_json_scheme_with_a_key_given_twice_is_refused():
    """json keeps the last of a key given twice, silently: refused, at any depth."""
    with pytest.raises(UsageError, match="--scheme JSON gives the key 'weights' twice"):
        resolve_scheme('{"weights": {"num_bits": 8}, "weights": {"num_bits": 4}}', ["Linear"])
    with pytest.raises(UsageError, match="--scheme JSON gives the key 'num_bits' twice"):
        resolve_scheme('{"weights": {"num_bits": 8, "strategy": "channel", "num_bits": 4}}', ["Linear"])
    with pytest.raises(UsageError, match="--kv-cache-scheme JSON gives the key 'num_bits' twice"):
        resolve_kv_cache('{"num_bits": 8, "type": "float", "num_bits": 4}')


def test_observer_defaults_follow_llm_compressor():
    s = resolve_scheme("W8A8_STATIC", ["Linear"])
    assert observer_name(s.weights, "weight") == "memoryless_minmax"
    assert observer_name(s.input_activations, "input") == "static_minmax"
    assert observer_name(resolve_scheme("W8A8", ["Linear"]).input_activations, "input") is None  # dynamic
    mse = build_config("W8A8_STATIC", observer="mse").groups["group_0"]
    assert observer_name(mse.weights, "weight") == "memoryless_mse"
    assert observer_name(mse.input_activations, "input") == "mse"
    bare = resolve_scheme('{"weights": {"num_bits": 8}, "input_activations": {"num_bits": 8}}', ["Linear"])
    assert observer_name(bare.input_activations, "input") == "minmax"


def test_most_specific_target_wins():
    """Exact name > regex > class. Each pick is compared with a scheme compressed-tensors builds
    itself (its preset, or its QuantizationScheme from the same fields), not with graphcal's groups."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    config = build_config("W8A8")
    config.groups["group_1"] = resolve_scheme("W8A8_STATIC", ["re:.*q_proj"])
    config.groups["group_2"] = resolve_scheme('{"weights": {"num_bits": 8, "strategy": "tensor"}}', ["a.q_proj"])
    static_input = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False,
                                    observer="static_minmax")
    assert config.scheme_for(_target("a.k_proj")) == preset_name_to_scheme("W8A8", ["Linear"])  # class
    assert config.scheme_for(_target("b.q_proj")) == QuantizationScheme(  # regex
        targets=["re:.*q_proj"], weights=preset_name_to_scheme("W8A8", ["x"]).weights, input_activations=static_input)
    assert config.scheme_for(_target("a.q_proj")) == QuantizationScheme(  # exact name, over the regex and the class
        targets=["a.q_proj"], weights=QuantizationArgs(num_bits=8, strategy="tensor"))


@pytest.mark.parametrize("via_recipe", [False, True])
def test_one_observer_override_rule_for_flags_and_recipes(tmp_path, via_recipe):
    """llm-compressor gives NVFP4's "local" dynamic inputs an observer (their global scale), so an
    observer override reaches them, from a flag or a recipe alike; fully dynamic inputs get none."""
    from graphcal.config import Options, resolve

    recipe = tmp_path / "recipe.yaml"
    for preset, input_observer in (("NVFP4", "mse"), ("W8A8", None), ("FP8", "mse")):
        recipe.write_text(f"QuantizationModifier: {{scheme: {preset}}}\n")
        options = Options(recipe=recipe, observer="mse") if via_recipe else Options(scheme=preset, observer="mse")
        scheme = resolve(options).groups["group_0"]
        assert scheme.weights.observer == "mse"
        assert scheme.input_activations.observer == input_observer
        assert observer_name(scheme.weights, "weight") == "memoryless_mse"
    recipe.write_text("QuantizationModifier: {scheme: NVFP4, input_observer: memoryless_minmax}\n")
    from_recipe = resolve(Options(recipe=recipe)).groups["group_0"]
    assert from_recipe.input_activations.observer == "memoryless_minmax"
    # the input override leaves the weights as compressed-tensors' NVFP4 preset has them (every field),
    # observed by llm-compressor's weight default for an unset observer (initialize_observer: memoryless_minmax)
    assert from_recipe.weights == preset_name_to_scheme("NVFP4", ["Linear"]).weights
    assert from_recipe.weights.observer is None and observer_name(from_recipe.weights, "weight") == "memoryless_minmax"


def test_flags_override_a_recipe_and_fill_defaults_without_one(tmp_path):
    from graphcal.config import Options, resolve

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("QuantizationModifier: {scheme: FP8, ignore: [lm_head, model.x]}\n")
    assert resolve(Options(recipe=recipe)).ignore == ["lm_head", "model.x"]
    assert resolve(Options(recipe=recipe, ignore=("a",))).ignore == ["a"]
    assert resolve(Options(recipe=recipe, scheme="W4A16")).groups["group_0"].weights.num_bits == 4
    bare = resolve(Options())
    assert bare.scheme_name == "W8A8" and bare.ignore == ["lm_head"] and bare.patterns == ["Linear"]
