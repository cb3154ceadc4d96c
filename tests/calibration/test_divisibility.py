"""Group and block widths that do not divide a layer's input are found before any pass.

A model with hidden size 576 (as real small Llamas have) under W4A16 (groups of 128): inspect and
run end with one error that counts and names the layers and gives two ways out, and each way,
pasted back into run, works.
"""

from __future__ import annotations

import json
import re
import shlex

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.helpers import run_cli

LAYERS = [(576, 576, "model.layers.0.self_attn.q_proj"), (576, 1536, "model.layers.0.mlp.up_proj"),
          (1536, 576, "model.layers.0.mlp.down_proj"), (576, 576, "model.layers.1.self_attn.q_proj")]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    rng = np.random.default_rng(0)
    folder = tmp_path_factory.mktemp("w576")
    nodes, inits, x = [], [], "x"
    for i, (k, n, name) in enumerate(LAYERS):
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"y{i}"], name="/" + name.replace(".", "/") + "/MatMul"))
        inits.append(numpy_helper.from_array((rng.standard_normal((k, n)) * 0.05).astype(np.float32), f"w{i}"))
        x = f"y{i}"
    graph = helper.make_graph(nodes, "wide", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 576])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["b", "s", 576])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, folder / "model.onnx")
    np.savez(folder / "calib.npz", x=rng.standard_normal((8, 4, 576)).astype(np.float32))
    return folder



def test_inspect_and_run_list_every_layer_the_group_does_not_divide(wide, tmp_path, monkeypatch):
    import graphcal.calibration.pipeline

    def no_pass(*args, **kwargs):
        raise AssertionError("the calibration pass ran before the divisibility check")

    monkeypatch.setattr(graphcal.calibration.pipeline, "run_activation_pass", no_pass)
    for command in (["inspect", wide / "model.onnx"],
                    ["run", wide / "model.onnx", "--data", wide / "calib.npz", "-o", tmp_path / "o"]):
        result = run_cli(*command, "--scheme", "W4A16")
        lines = result.output.strip().splitlines()
        assert result.exit_code == 1 and len(lines) == 1, result.output
        assert "group size 128 does not divide the input features of 3 of 4 targets" in lines[0]
        assert "model.layers.0.self_attn.q_proj (in 576)" in lines[0]  # the first few, named, and the count
        assert "a group size of 64 divides them all" in lines[0]
    assert not (tmp_path / "o").exists()


def _advice(wide) -> str:
    return run_cli("inspect", wide / "model.onnx", "--scheme", "W4A16").output


def test_the_suggested_group_size_pasted_into_run_works(wide, tmp_path):
    size = re.search(r"--group-size (\d+)", _advice(wide)).group(1)
    assert size == "64"
    result = run_cli("run", wide / "model.onnx", "--data", wide / "calib.npz", "-o", tmp_path / "o", "--scheme", "W4A16",
                     "--group-size", size, "--json")
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["quantized"]) == 4
    config = json.loads((tmp_path / "o" / "quantization_config.json").read_text())
    assert config["config_groups"]["group_0"]["weights"]["group_size"] == 64


def test_group_size_refuses_schemes_without_groups(wide, tmp_path):
    result = run_cli("inspect", wide / "model.onnx", "--scheme", "W8A8", "--group-size", "64")
    assert result.exit_code == 2 and "--group-size applies to group and tensor_group weights" in result.output


def test_the_suggested_ignore_pasted_into_run_leaves_exactly_those_layers_in_float(wide, tmp_path):
    flags = shlex.split(_advice(wide).split("or leave them in float: ", 1)[1].strip())
    assert flags[:2] == ["--ignore", "lm_head"]  # the default ignore is kept
    result = run_cli("run", wide / "model.onnx", "--data", wide / "calib.npz", "-o", tmp_path / "o", "--scheme", "W4A16",
                     "--json", *flags)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["quantized"] == ["model.layers.0.mlp.down_proj"]  # in_features 1536 = 12 x 128
    assert sorted(summary["ignored"]) == sorted(n for _, _, n in LAYERS if n != "model.layers.0.mlp.down_proj")


def test_dynamic_input_groups_are_checked_too(wide):
    scheme = '{"weights": {"num_bits": 8}, "input_activations": {"num_bits": 8, "strategy": "group", "group_size": 100, "dynamic": true}}'
    result = run_cli("inspect", wide / "model.onnx", "--scheme", scheme)
    assert result.exit_code == 1 and "group size 100 does not divide the input features of 4 of 4 targets" in result.output
