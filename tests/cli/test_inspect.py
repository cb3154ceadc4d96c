"""graphcal inspect through the CLI, checked against the original ONNX and against real runs.

References, never inspect's own output: find_targets on the original model and the
initializers' dims for shapes and layouts; the size of the model.onnx that `graphcal run`
really writes for the expected size; hand-computed bytes for the size rule.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphcal.calibration.sizing import expected_model_size, size_parts
from graphcal.config import resolve_scheme
from graphcal.graph.targets import find_targets
from graphcal.types import QuantizedTarget
from tests.helpers import run_cli

LLAMA_GROUPS = {
    f"model.layers.{i}.{parent}": [f"model.layers.{i}.{parent}.{m}" for m in members]
    for i in (0, 1)
    for parent, members in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
}
BERT_GROUPS = {
    f"encoder.layer.{i}.attention.self": [f"encoder.layer.{i}.attention.self.{m}" for m in ("query", "key", "value")]
    for i in (0, 1)
}
# schemes whose written size is checked: channel, group with zero points, NVFP4 (fp8 scales and a
# global scale), blocks, MX (e8m0 scales), FP8 per tensor
SIZE_SCHEMES = ["W8A8", "W4A16_ASYM", "NVFP4A16", "FP8_BLOCK", "MXFP4A16", "FP8"]
SIZE_CASES = [(model, scheme) for model in ("tiny-llama", "tiny-bert") for scheme in SIZE_SCHEMES]


def inspect(*args):
    return run_cli("inspect", *map(str, args))


def inspect_json(*args) -> dict:
    result = inspect(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def initializer_shapes(model_path) -> dict[str, tuple[list[int], str]]:
    """node name -> (torch [out, in] shape, layout), read straight from the initializers' dims."""
    model = onnx.load(model_path)
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    shapes = {}
    for node in model.graph.node:
        if node.op_type in ("MatMul", "Gemm") and node.input[1] in dims:
            trans_b = any(a.name == "transB" and a.i for a in node.attribute)
            d = dims[node.input[1]]
            shapes[node.name] = (d, "out_in") if trans_b else (d[::-1], "in_out")
    return shapes


def table_rows(text: str) -> dict[str, list[str]]:
    """module -> [op, node, out, in, layout, status, group] from the text table."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("module "))
    rows = {}
    for line in lines[start + 1:]:
        if not line.strip():
            break
        module, op, node, out, inp, layout, status, group = line.split()
        rows[module] = [op, node, int(out.strip("[,")), int(inp.strip("]")), layout, status, group]
    return rows


@pytest.mark.parametrize("which", ["llama", "bert"])
def test_table_lists_every_target_with_torch_shape_and_layout(which, llama_dir, bert_dir):
    model_path = (llama_dir if which == "llama" else bert_dir) / "model.onnx"
    result = inspect(model_path)
    assert result.exit_code == 0, result.output
    rows = table_rows(result.stdout)
    found, _ = find_targets(onnx.load(model_path))
    shapes = initializer_shapes(model_path)
    assert list(rows) == [t.name for t in found]
    assert set(shapes) == {t.node for t in found}  # the shipped models have no weight paths
    for t in found:
        op, node, out, inp, layout, status, group = rows[t.name]
        assert (op, node, layout) == (t.op_type, t.node, t.layout)
        assert [out, inp] == [t.out_features, t.in_features] == shapes[t.node][0]
        assert layout == shapes[t.node][1]
        ignored = which == "llama" and t.name == "lm_head"
        assert (status, group) == (("ignored", "-") if ignored else ("quantized", "group_0")), t.name
    if which == "bert":
        assert rows["pooler.dense"][0] == "Gemm" and rows["pooler.dense"][4] == "out_in"
        assert "ignored  none" in result.stdout
    else:
        assert "ignored  lm_head (matches ignore 'lm_head')" in result.stdout
    groups = LLAMA_GROUPS if which == "llama" else BERT_GROUPS
    for parent, members in groups.items():
        assert f"  {parent}: {', '.join(m.rpartition('.')[2] for m in members)}" in result.stdout


@pytest.mark.parametrize("which", ["llama", "bert"])
def test_json_carries_the_same_facts(which, llama_dir, bert_dir):
    model_path = (llama_dir if which == "llama" else bert_dir) / "model.onnx"
    data = inspect_json(model_path)
    text_rows = table_rows(inspect(model_path).stdout)
    found, skipped = find_targets(onnx.load(model_path))
    shapes = initializer_shapes(model_path)
    assert [t["module"] for t in data["targets"]] == [t.name for t in found] == list(text_rows)
    for row, t in zip(data["targets"], found):
        assert row["weight_shape"] == shapes[t.node][0] and row["layout"] == shapes[t.node][1]
        assert (row["op_type"], row["node"], row["weight"]) == (t.op_type, t.node, t.weight)
        assert row["status"] == text_rows[t.name][5]
    expected_ignored = ["lm_head"] if which == "llama" else []
    assert data["ignored"] == expected_ignored
    assert data["quantized"] == [t.name for t in found if t.name not in expected_ignored]
    groups = LLAMA_GROUPS if which == "llama" else BERT_GROUPS
    assert {g["parent"]: g["members"] for g in data["fused_groups"]} == groups
    assert [s["node"] for s in data["not_targets"]] == [s.node for s in skipped]
    assert data["scheme"] == "W8A8" and data["unmatched_patterns"] == [] and data["warnings"] == []
    assert data["size"]["input_bytes"] == model_path.stat().st_size
    assert data["size"]["expected_bytes"] == data["size"]["input_bytes"] + sum(data["size"]["parts"].values())
    assert list(data) == sorted(data)


@pytest.mark.parametrize("scheme, opset", [("W8A8", 17), ("FP8", 19)])
def test_opset(llama_dir, scheme, opset):
    data = inspect_json(llama_dir / "model.onnx", "--scheme", scheme)
    assert data["opset"]["model"] == 17  # the shipped models are opset 17 already
    assert data["opset"]["output"] == opset
    text = inspect(llama_dir / "model.onnx", "--scheme", scheme).stdout
    assert f"output {opset}" in text


@pytest.mark.parametrize("model_name, scheme", SIZE_CASES)
def test_expected_size_matches_the_written_model(tmp_path, model_name, scheme):
    from tests.conftest import MODELS

    src = MODELS / model_name
    target = "qdq" if "FP4" in scheme else "onnxruntime"
    expected = inspect_json(src / "model.onnx", "--scheme", scheme, "--target", target)["size"]["expected_bytes"]
    out = tmp_path / "out"
    result = run_cli("run", str(src / "model.onnx"), "--data", str(src / "calib.npz"),
                     "--scheme", scheme, "-o", str(out), "--device", "cpu", "-q", "--target", target)
    assert result.exit_code == 0, result.output
    actual = (out / "model.onnx").stat().st_size
    # the rule counts weights, scales and zero points; graph records (Q/DQ nodes, initializer
    # headers, value_info from an opset conversion) are left out: up to ~10% of these tiny outputs
    assert 0 <= actual - expected <= 0.12 * actual, (expected, actual)


def test_inspect_writes_nothing(tmp_path, llama_dir, monkeypatch):
    model = tmp_path / "model.onnx"
    model.write_bytes((llama_dir / "model.onnx").read_bytes())
    monkeypatch.chdir(tmp_path)

    def listing():
        return sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))

    before = listing()
    for scheme in ("W8A8", "FP8"):
        result = inspect(model, "--scheme", scheme)
        assert result.exit_code == 0, result.output
    assert listing() == before
    assert model.read_bytes() == (llama_dir / "model.onnx").read_bytes()


def _matmul_model(path, out_f, in_f, dtype=TensorProto.FLOAT16, gemm=False):
    """One weight MatMul (weight [in, out]) or Gemm transB=1 (weight [out, in]) with a float16 or float32 weight."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    shape = (out_f, in_f) if gemm else (in_f, out_f)
    w = numpy_helper.from_array(np.ones(shape, dtype=np_dtype), "w")
    node = (helper.make_node("Gemm", ["x", "w"], ["y"], name="/fc/Gemm", transB=1) if gemm
            else helper.make_node("MatMul", ["x", "w"], ["y"], name="/fc/MatMul"))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", dtype, ["b", in_f])],
                              [helper.make_tensor_value_info("y", dtype, ["b", out_f])], initializer=[w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), path)
    return path


@pytest.mark.parametrize("scheme, gemm, quantized, scales, zero_points", [
    # W8A8: int8 per channel, fp32 scales
    ("W8A8", False, 96 * 256, 96 * 4, 0),
    # W4A16: int4 groups of 128 along in, packed two per byte
    ("W4A16", False, 96 * 256 // 2, 96 * 2 * 4, 0),
    # asymmetric: int4 zero points, one per scale
    ("W4A16_ASYM", False, 96 * 256 // 2, 96 * 2 * 4, 96 * 2 // 2),
    # NVFP4A16: fp4 groups of 16 with fp8 scales, plus one fp32 global scale
    ("NVFP4A16", False, 96 * 256 // 2, 96 * 16 + 4, 0),
    # FP8_BLOCK 128x128: MatMul scales expanded per row; Gemm keeps the blocks
    ("FP8_BLOCK", False, 96 * 256, 96 * 2 * 4, 0),
    ("FP8_BLOCK", True, 96 * 256, 1 * 2 * 4, 0),
])
def test_size_rule(tmp_path, scheme, gemm, quantized, scales, zero_points):
    path = _matmul_model(tmp_path / "m.onnx", out_f=96, in_f=256, gemm=gemm)
    model = onnx.load(path)
    target = find_targets(model)[0][0]
    items = [QuantizedTarget(target, resolve_scheme(scheme, ["Linear"]))]
    parts = size_parts(model, path, items)
    assert parts["input"] == path.stat().st_size
    assert parts["float_weights"] == -96 * 256 * 2  # float16 initializer
    assert (parts["quantized_weights"], parts["scales"], parts["zero_points"]) == (quantized, scales, zero_points)
    assert expected_model_size(model, path, items) == sum(parts.values())


def test_warnings_for_patterns_that_match_nothing(llama_dir):
    result = inspect(llama_dir / "model.onnx", "--ignore", "lm_head", "--ignore", "re:.*nothing.*")
    assert result.exit_code == 0, result.output
    assert "warning: target or ignore pattern 're:.*nothing.*' matches no MatMul/Gemm" in result.stderr
    data = inspect_json(llama_dir / "model.onnx", "--targets", "re:.*mlp\\..*")
    assert data["quantized"] == [f"model.layers.{i}.mlp.{m}" for i in (0, 1) for m in ("gate_proj", "up_proj", "down_proj")]
    reasons = {t["module"]: t["reason"] for t in data["targets"] if t["status"] == "ignored"}
    assert reasons["lm_head"] == "matches ignore 'lm_head'"
    assert reasons["model.layers.0.self_attn.q_proj"] == "matches no target pattern"
    assert {g["parent"] for g in data["fused_groups"]} == {"model.layers.0.mlp", "model.layers.1.mlp"}


def one_line_error(result, code: int, fragment: str) -> None:
    assert result.exit_code == code, result.output
    errors = [line for line in result.output.splitlines() if line.lower().startswith("error:")]
    assert len(errors) == 1 and fragment in errors[0], result.output
    assert "Traceback" not in result.output


def test_errors(tmp_path, llama_dir):
    missing = tmp_path / "nope.onnx"
    one_line_error(inspect(missing), 1, f"error: model file not found: {missing}")
    one_line_error(inspect(llama_dir / "model.onnx", "--scheme", "NOPE"), 2, "unknown scheme 'NOPE'")
    one_line_error(inspect(llama_dir / "model.onnx", "--targets", "nothing_matches"), 1, "no target left to quantize")
    # a scheme the Q/DQ writer has no form for ends as run ends: one line, exit 1
    no_form = '{"weights": {"num_bits": 8, "strategy": "channel"}, "output_activations": {"num_bits": 8, "strategy": "tensor"}}'
    one_line_error(inspect(llama_dir / "model.onnx", "--scheme", no_form), 1, "output_activations")
    assert not list(tmp_path.iterdir())


def test_target_tensorrt_checks_the_scheme_as_run_does(llama_dir):
    one_line_error(inspect(llama_dir / "model.onnx", "--scheme", "W8A8", "--target", "tensorrt"), 1,
                   "--target tensorrt: TensorRT takes int8/fp8 activations per tensor with a static scale")
    assert inspect_json(llama_dir / "model.onnx", "--scheme", "NVFP4", "--target", "tensorrt")["opset"]["output"] == 23


def test_inspect_takes_every_option_run_takes(llama_dir, tmp_path):
    """So `inspect` can stand in for `run` as a dry run: the same options, and with them the same checks."""
    from graphcal.cli import inspect_command, run

    def options(command):
        return {opt for p in command.params if isinstance(p, __import__("click").Option) for opt in p.opts}

    assert options(run) - options(inspect_command) == {"--quiet", "-q"}  # run's summary switch only
    args = ["--data", str(llama_dir / "calib.npz"), "--scheme", "W8A8_STATIC", "--observer", "mse",
            "--kv-cache-scheme", "FP8", "--batch-size", "4", "--num-samples", "8", "--device", "cpu",
            "-o", str(tmp_path / "out")]
    report = inspect_json(llama_dir / "model.onnx", *args)
    assert len(report["kv_states"]) == 2 and report["scheme_groups"]["group_0"]["input_activations"]["observer"] == "mse"
    assert not (tmp_path / "out").exists()  # nothing written
    bad = tmp_path / "bad.npz"
    np.savez(bad, input_ids=np.zeros((4, 8), np.int32))
    one_line_error(inspect(llama_dir / "model.onnx", "--data", bad), 1, "input_ids")  # data checked as run checks it
