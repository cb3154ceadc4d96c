"""``expand`` and the expanded-range observers reach the written qparams, through a recipe and through flags.

On models/tiny-llama: the run's qparams.safetensors holds, for a layer, exactly what graphcal's observer
gives when called directly on that layer's weight with the same args (the Python path that
tests/observers/test_llmc014_vectors.py checks against llm-compressor 0.14.0.1 itself). o_proj is used for
tensor_group schemes: it is in no fused group, so its global scale is its own.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
import yaml
from compressed_tensors.quantization import QuantizationArgs
from onnx import numpy_helper

from graphcal.observers import Observer
from tests.helpers import load_written, run_cli

NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
                 "scale_dtype": "torch.float8_e4m3fn"}
INT4_GROUP = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 16}


def _run(llama_dir, out, *args):
    result = run_cli("run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                     "-o", str(out), "-q", "--device", "cpu", *args)
    assert result.exit_code == 0, result.output
    return load_written(out)


def _weight(llama_dir, module: str) -> torch.Tensor:
    """The layer's weight as graphcal observes it: the MatMul's [in, out] initializer seen as [out, in]."""
    model = onnx.load(str(llama_dir / "model.onnx"))
    node = next(n for n in model.graph.node if n.name == f"/model/layers.0/{module}/MatMul")
    init = next(i for i in model.graph.initializer if i.name == node.input[1])
    return torch.from_numpy(np.array(numpy_helper.to_array(init))).T


def _direct(weight: torch.Tensor, observer: str, fields: dict, kwargs: dict) -> dict:
    obs = Observer.load_from_registry(observer, base_name="weight",
                                      args=QuantizationArgs(**fields, observer=observer, observer_kwargs=kwargs))
    obs(weight)
    return obs.get_qparams()


def _same(params: dict, prefix: str, qparams: dict) -> None:
    assert torch.equal(params[f"{prefix}.weight_scale"], qparams["scale"].reshape(params[f"{prefix}.weight_scale"].shape))
    if qparams["global_scale"] is not None:
        assert torch.equal(params[f"{prefix}.weight_global_scale"].reshape(-1), qparams["global_scale"].reshape(-1))
    if f"{prefix}.weight_zero_point" in params:
        assert torch.equal(params[f"{prefix}.weight_zero_point"].reshape(-1), qparams["zero_point"].reshape(-1))


def test_recipe_weight_observer_with_expand_kwarg(llama_dir, tmp_path):
    """The modifier-level weight_observer names nvfp4_expanded_mse; the config group's observer_kwargs give
    expand 1.5 (llm-compressor keeps a group's observer_kwargs when weight_observer replaces its observer)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"QuantizationModifier": {
        "ignore": ["lm_head"], "weight_observer": "nvfp4_expanded_mse",
        "config_groups": {"g": {"targets": ["Linear"], "weights": {**NVFP4_WEIGHTS, "observer_kwargs": {"expand": 1.5}}}}}}))
    config, params = _run(llama_dir, tmp_path / "o", "--recipe", str(recipe), "--target", "qdq")
    weights = config.config_groups["g"].weights
    assert weights.observer == "nvfp4_expanded_mse" and weights.observer_kwargs == {"expand": 1.5}
    direct = _direct(_weight(llama_dir, "self_attn/o_proj"), "nvfp4_expanded_mse", NVFP4_WEIGHTS, {"expand": 1.5})
    _same(params, "model.layers.0.self_attn.o_proj", direct)
    # expand reached the observer: its default (1.8) gives other scales on this weight
    default = _direct(_weight(llama_dir, "self_attn/o_proj"), "nvfp4_expanded_mse", NVFP4_WEIGHTS, {})
    assert not torch.equal(default["scale"], direct["scale"])


@pytest.mark.parametrize("observer,kwargs", [("memoryless_mse", {"expand": 1.5}), ("nvfp4_expanded_mse", {})])
def test_flags_observer_and_expand_kwarg(llama_dir, tmp_path, observer, kwargs):
    """--observer names the observer, and a JSON --scheme gives its observer_kwargs (expand)."""
    scheme = json.dumps({"weights": {**INT4_GROUP, "observer_kwargs": kwargs}})
    config, params = _run(llama_dir, tmp_path / "o", "--scheme", scheme, "--observer", observer)
    weights = config.config_groups["group_0"].weights
    assert weights.observer == observer and weights.observer_kwargs == kwargs
    changed = False
    for module in ("self_attn/q_proj", "mlp/down_proj"):
        weight = _weight(llama_dir, module)
        direct = _direct(weight, observer, INT4_GROUP, kwargs)
        _same(params, "model.layers.0." + module.replace("/", "."), direct)
        changed |= not torch.equal(_direct(weight, "memoryless_mse", INT4_GROUP, {})["scale"], direct["scale"])
    assert changed  # the expanded search reached these weights: plain memoryless_mse gives other scales
