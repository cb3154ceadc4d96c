"""llm-compressor recipes (--recipe): layouts, resolution as llm-compressor does it, CLI overrides, errors."""

from __future__ import annotations

import hashlib
import json

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphcal.config.recipe import parse_recipe, recipe_config
from graphcal.errors import UsageError
from tests.helpers import load_written, run_cli

STAGED = """
quant_stage:
  run_type: oneshot
  quant_modifiers:
    QuantizationModifier:
      targets: [Linear]
      scheme: FP8
      ignore: [lm_head]
"""


def _run(model_dir, out, *args):
    return run_cli("run", str(model_dir / "model.onnx"), "--data", str(model_dir / "calib.npz"),
                   "-o", str(out), "-q", *args)


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _recipe(tmp_path, text, name="recipe.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("text", [
    STAGED,
    "QuantizationModifier:\n  scheme: FP8\n  ignore: [lm_head]\n",  # a bare modifier
    json.dumps({"stage": {"quant_modifiers": {"QuantizationModifier": {"scheme": {"FP8": ["Linear"]},
                                                                       "ignore": ["lm_head"]}}}}),  # JSON, preset map
])
def test_recipe_gives_the_same_files_as_the_same_flags(llama_dir, tmp_path, text):
    flags = _run(llama_dir, tmp_path / "flags", "--scheme", "FP8")
    assert flags.exit_code == 0, flags.output
    recipe = _run(llama_dir, tmp_path / "recipe", "--recipe", str(_recipe(tmp_path, text)))
    assert recipe.exit_code == 0, recipe.output
    for name in ("model.onnx", "qparams.safetensors", "quantization_config.json"):
        assert _digest(tmp_path / "flags" / name) == _digest(tmp_path / "recipe" / name), name


def test_config_groups_observer_fields_and_kv_cache(llama_dir, tmp_path):
    text = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: [lm_head, "re:.*down_proj"]
      weight_observer: memoryless_mse
      config_groups:
        attention:
          targets: ["re:.*self_attn.*"]
          weights: {num_bits: 8, type: int, symmetric: true, strategy: channel}
          input_activations: {num_bits: 8, type: int, symmetric: true, strategy: tensor, dynamic: false}
        mlp:
          targets: ["re:.*mlp.*"]
          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 128}
      kv_cache_scheme: {num_bits: 8, type: float, symmetric: true, strategy: tensor, dynamic: false}
"""
    result = _run(llama_dir, tmp_path / "o", "--recipe", str(_recipe(tmp_path, text)))
    assert result.exit_code == 0, result.output
    config, params = load_written(tmp_path / "o")
    assert set(config.config_groups) == {"attention", "mlp"} and config.format == "mixed-precision"
    assert config.config_groups["attention"].weights.observer == "memoryless_mse"
    assert config.config_groups["attention"].input_activations.observer is None  # llm-compressor's default (minmax)
    assert config.config_groups["mlp"].weights.strategy == "group"
    assert config.ignore == ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert config.kv_cache_scheme is not None and "model.layers.0.self_attn.k_scale" in params
    assert params["model.layers.0.mlp.gate_proj.weight_scale"].shape == (256, 1)  # groups of 128 over in=128
    assert "model.layers.0.mlp.gate_proj.input_scale" not in params
    assert params["model.layers.0.self_attn.q_proj.input_scale"].shape == (1,)


def test_cli_flags_override_the_recipe(llama_dir, tmp_path):
    recipe = _recipe(tmp_path, STAGED)
    result = _run(llama_dir, tmp_path / "o", "--recipe", str(recipe), "--scheme", "W4A16", "--ignore", "re:.*o_proj")
    assert result.exit_code == 0, result.output
    config, _ = load_written(tmp_path / "o")
    assert config.config_groups["group_0"].weights.num_bits == 4
    # --ignore replaces the recipe's list: lm_head is quantized now
    assert config.ignore == ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]


def test_observer_mapping_and_cli_observer():
    fields = parse_recipe("QuantizationModifier:\n  scheme: W8A8_STATIC\n  observer: {weights: mse, input: static_minmax}\n")
    config = recipe_config(fields)
    assert config.groups["group_0"].weights.observer == "mse"
    assert config.groups["group_0"].input_activations.observer == "static_minmax"
    config = recipe_config(fields, observer="memoryless_minmax")
    assert config.groups["group_0"].weights.observer == "memoryless_minmax"


@pytest.mark.parametrize("text, message", [
    ("QuantizationModifier:\n  scheme: FP8\n  sheme: W8A8\n", "unknown QuantizationModifier key(s) 'sheme'"),
    ("stage:\n  quant_modifiers:\n    GPTQModifier:\n      scheme: W4A16\n      actorder: group\n",
     "Invalid activation ordering group. Only 'weight' and 'static' are supported for GPTQ."),
    ("GPTQModifier: {scheme: W4A16, block_sise: 64}\n", "GPTQModifier.block_sise"),
    ("GPTQModifier: {block_size: 64}\n", "the GPTQModifier gives no scheme or config_groups"),
    ("QuantizationModifier: {scheme: W4A16}\nGPTQModifier: {scheme: W4A16}\n", "give it in one of them"),
    ("GPTQModifier: {scheme: W4A16}\nAWQModifier: {}\n", "AWQModifier comes after the modifier that quantizes"),
    ("AWQModifier: {n_grid: 2}\nQuantizationModifier: {scheme: W4A16}\n", "AWQ n_grid must be an integer >= 3"),
    ("AWQModifier: {mappings: [[a, b]]}\nQuantizationModifier: {scheme: W4A16}\n", "AWQModifier.mappings"),
    ("AWQModifier: {}\nSmoothQuantModifier: {}\nQuantizationModifier: {scheme: W4A16}\n", "use one of them"),
    ("SparseGPTModifier: {}\nQuantizationModifier: {scheme: W4A16}\n", "SparseGPTModifier is not supported"),
    ("stage:\n  quant_modifiers:\n    QuantizationModifier: {scheme: W8A8}\n    SmoothQuantModifier: {}\n",
     "SmoothQuantModifier comes after the modifier that quantizes"),
    ("stage:\n  quant_modifiers:\n    SmoothQuantModifier: {start: 0}\n    QuantizationModifier: {scheme: W8A8}\n",
     "start: 0.0 is not supported (SmoothQuant is one-shot only)"),
    ("SmoothQuantModifier: {alpha: 0.5}\nQuantizationModifier: {scheme: W8A8}\n", "SmoothQuantModifier.alpha"),
    ("SmoothQuantModifier: {mappings: [[a]]}\nQuantizationModifier: {scheme: W8A8}\n", "mappings[0] must be"),
    ("SmoothQuantModifier: {smoothing_strength: .nan}\nQuantizationModifier: {scheme: W8A8}\n",
     "SmoothQuantModifier: smoothing_strength must be a finite number from 0 to 1"),
    ("SmoothQuantModifier: {smoothing_strength: 50}\nQuantizationModifier: {scheme: W8A8}\n",
     "SmoothQuantModifier: smoothing_strength must be from 0 to 1"),
    ("SmoothQuantModifier: {algorithm: magic}\nQuantizationModifier: {scheme: W8A8}\n", "SmoothQuantModifier.algorithm"),
    ("stage:\n  recipe_stuff: {}\n", "unknown key stage.recipe_stuff"),
    ("- a\n- list\n", "a recipe is a mapping"),
    ("QuantizationModifier: [1, 2]\n", "must be a mapping of its fields"),
    ("QuantizationModifier:\n  scheme: W9A9\n", "unknown preset scheme 'W9A9'"),
    ("QuantizationModifier:\n  scheme: FP8\n  config_groups: {g: {targets: [Linear]}}\n", "either scheme or config_groups"),
    ("QuantizationModifier:\n  config_groups: {g: {weights: {num_bits: 8, strategy: galaxy}}}\n", "config_groups.g"),
    ("QuantizationModifier:\n  weight_observer: mse\n  observer: {weights: mse}\n", "not both"),
    ("QuantizationModifier:\n  kv_cache_scheme: {num_bits: 8, strategy: token, dynamic: true}\n", "static tensor or attn_head"),
    ("QuantizationModifier: {scheme: FP8\n", "not valid YAML"),
])
def test_bad_recipes_give_one_line(llama_dir, tmp_path, text, message):
    result = _run(llama_dir, tmp_path / "o", "--recipe", str(_recipe(tmp_path, text)))
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert not (tmp_path / "o").exists()


# -- a key given twice: YAML keeps the last silently, graphcal refuses it -------------------------------

TWICE_STAGED = """quant_stage:
  quant_modifiers:
    QuantizationModifier:
      scheme: W8A8
    QuantizationModifier:
      scheme: W4A16
"""
TWICE_BARE = """QuantizationModifier: {scheme: W8A8}
QuantizationModifier: {scheme: FP8}
"""
TWICE_NESTED = """quant_stage:
  quant_modifiers:
    QuantizationModifier:
      targets: [Linear]
      scheme: W8A8
      ignore: [lm_head]
      scheme: W4A16
"""
TWICE_DEEP = """QuantizationModifier:
  config_groups:
    g:
      targets: [Linear]
      weights: {num_bits: 8, strategy: channel, num_bits: 4}
"""
TWICE_STAGE = """stage:
  quant_modifiers:
    QuantizationModifier: {scheme: W8A8}
stage:
  quant_modifiers:
    QuantizationModifier: {scheme: FP8}
"""


@pytest.mark.parametrize("text, key, lines", [
    (TWICE_STAGED, "QuantizationModifier", (3, 5)),
    (TWICE_BARE, "QuantizationModifier", (1, 2)),
    (TWICE_NESTED, "scheme", (5, 7)),
    (TWICE_DEEP, "num_bits", (5, 5)),
    (TWICE_STAGE, "stage", (1, 4)),
])
@pytest.mark.parametrize("command", ["run", "inspect"])
def test_a_key_given_twice_is_refused(llama_dir, tmp_path, text, key, lines, command):
    out = tmp_path / "o"
    result = run_cli(command, str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                     "-o", str(out), "--recipe", str(_recipe(tmp_path, text)))
    assert result.exit_code == 2, result.output
    out_lines = result.output.strip().splitlines()
    assert len(out_lines) == 1 and "Traceback" not in result.output, result.output
    assert f"the key '{key}' is given twice in one mapping (line {lines[0]}, then line {lines[1]})" in out_lines[0], \
        out_lines[0]
    assert "recipe.yaml" in out_lines[0]
    assert not out.exists()


def test_keys_equal_once_read_are_the_same_key_and_merges_may_override():
    with pytest.raises(UsageError, match="the key '8' is given twice"):  # 010 is YAML 1.1's octal 8
        parse_recipe("QuantizationModifier:\n  scheme: W8A8\n  ignore: {8: a, 010: b}\n")
    # a merge brings keys that the mapping may override, as YAML allows: not a key given twice
    text = "QuantizationModifier:\n  <<: {scheme: FP8, targets: [Linear]}\n  scheme: W8A8\n"
    assert parse_recipe(text).quantization["scheme"] == "W8A8"


def test_targets_cannot_override_config_groups(llama_dir, tmp_path):
    text = "QuantizationModifier:\n  config_groups: {g: {targets: [Linear], weights: {num_bits: 8}}}\n"
    result = _run(llama_dir, tmp_path / "o", "--recipe", str(_recipe(tmp_path, text)), "--targets", "re:.*mlp.*")
    assert result.exit_code == 2 and "--targets cannot override a recipe's config_groups" in result.output


def test_missing_recipe_file(llama_dir, tmp_path):
    result = _run(llama_dir, tmp_path / "o", "--recipe", str(tmp_path / "nope.yaml"))
    assert result.exit_code == 2 and "recipe file not found" in result.output


# -- property: whatever the text, the parser and resolver end in a result or a UsageError ----------

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.text(max_size=12),
                     st.sampled_from(["W8A8", "FP8", "NVFP4", "Linear", "lm_head", "re:.*", "mse", "tensor",
                                      "group", "float", "int", "attn_head"]))
_keys = st.sampled_from(["QuantizationModifier", "quant_stage", "quant_modifiers", "scheme", "config_groups",
                         "targets", "ignore", "kv_cache_scheme", "weight_observer", "observer", "weights",
                         "input_activations", "num_bits", "strategy", "type", "group_size", "dynamic", "weights",
                         "GPTQModifier", "AWQModifier", "block_size", "actorder", "n_grid", "duo_scaling", "start", "bogus", "SmoothQuantModifier", "mappings", "smoothing_strength",
                         "algorithm"])
_trees = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(_keys, inner, max_size=4)), max_leaves=12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=_trees)
def test_any_recipe_parses_or_fails_with_a_usage_error(tree):
    text = yaml.safe_dump(tree)
    try:
        fields = parse_recipe(text)
        recipe_config(fields)
    except UsageError as e:
        assert str(e) and "\n" not in str(e)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_any_text_parses_or_fails_with_a_usage_error(text):
    try:
        recipe_config(parse_recipe(text))
    except UsageError as e:
        assert str(e)


def test_python_api_takes_a_recipe(llama_dir, tmp_path):
    from graphcal.calibration.pipeline import calibrate

    recipe = _recipe(tmp_path, STAGED)
    calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "api", recipe=recipe, device="cpu")
    assert _run(llama_dir, tmp_path / "cli", "--recipe", str(recipe)).exit_code == 0
    for name in ("model.onnx", "qparams.safetensors", "quantization_config.json"):
        assert _digest(tmp_path / "api" / name) == _digest(tmp_path / "cli" / name), name


def test_recipe_names_graphcals_histogram_observers_with_kwargs(llama_dir, tmp_path):
    """input_observer and observer_kwargs reach graphcal's percentile observer: the written input scale
    is the one a percentile observer at 99.0 gives on the same activation (the first layer's input)."""
    import numpy as np
    import onnxruntime as ort
    import torch
    from compressed_tensors.quantization import QuantizationArgs

    from graphcal.observers import Observer

    args = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False,
            "observer_kwargs": {"percentile": 99.0}}
    text = yaml.safe_dump({"QuantizationModifier": {
        "ignore": ["lm_head"], "input_observer": "percentile",
        "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "strategy": "channel"},
                                "input_activations": args}}}})
    result = _run(llama_dir, tmp_path / "o", "--recipe", str(_recipe(tmp_path, text)))
    assert result.exit_code == 0, result.output
    config, params = load_written(tmp_path / "o")
    assert config.config_groups["g"].input_activations.observer == "percentile"
    assert config.config_groups["g"].weights.observer is None  # the weights kept llm-compressor's default
    # the q_proj input is the first layer norm's output: fetch it with onnxruntime and observe it directly
    model = __import__("onnx").load(str(llama_dir / "model.onnx"))
    q_proj = next(n for n in model.graph.node if n.op_type == "MatMul" and "q_proj" in (n.name + n.input[1]))
    model.graph.output.append(__import__("onnx").helper.make_tensor_value_info(q_proj.input[0], 1, None))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    data = dict(np.load(llama_dir / "calib.npz"))
    obs = Observer.load_from_registry("percentile", base_name="input", args=QuantizationArgs(**args))
    n = len(next(iter(data.values())))
    for i in range(0, n, 8):
        obs(torch.from_numpy(session.run([q_proj.input[0]], {k: v[i:i + 8] for k, v in data.items()})[0]))
    assert torch.equal(params["model.layers.0.self_attn.q_proj.input_scale"], obs.get_qparams()["scale"])
