"""graphcal bench: kernels, shapes, sizes and memory, checked against onnxruntime itself.

The tiny models are built here with onnx.helper (not with graphcal's writer). What each one
becomes is read from onnxruntime's own optimized graph, written by a session opened in the
test; sizes from os.path.getsize. Timings are only checked to be positive and consistent
(speed belongs to benchmarks, not tests).
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.helpers import run_cli

NODE = "/layer/proj/MatMul"  # the legacy exporter's naming: module "layer.proj"
MODULE = "layer.proj"
FAST = ["--rounds", "3", "--warmup", "1"]


def _model(nodes, inits, opset: int, seq="seq") -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", seq, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", seq, 64])
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    onnx.checker.check_model(model)
    return model


def _weight() -> np.ndarray:
    return (np.random.default_rng(0).standard_normal((64, 64)) * 0.1).astype(np.float32)


def fp32_model(seq="seq") -> onnx.ModelProto:
    """(a) MatMul with a [64, 64] fp32 initializer weight."""
    return _model([helper.make_node("MatMul", ["x", "w"], ["y"], name=NODE)], [numpy_helper.from_array(_weight(), "w")],
                  17, seq)


def int4_model(seq="seq") -> onnx.ModelProto:
    """(b) the weight as int4, blocks of 32 along the input axis (DequantizeLinear opset 21, axis 0)."""
    w = _weight()
    scale = (np.abs(w).reshape(2, 32, 64).max(axis=1) / 7).astype(np.float32)
    q = np.clip(np.round(w / np.repeat(scale, 32, axis=0)), -8, 7).astype(ml_dtypes.int4)
    return _model([helper.make_node("DequantizeLinear", ["w_q", "w_s"], ["w_dq"], axis=0, block_size=32, name="w_dq"),
                   helper.make_node("MatMul", ["x", "w_dq"], ["y"], name=NODE)],
                  [numpy_helper.from_array(q, "w_q"), numpy_helper.from_array(scale, "w_s")], 21, seq)


def int8_static_model() -> onnx.ModelProto:
    """(c) static uint8 activation Q/DQ (scalar scale, zero point 128) and int8 per-channel weights (axis 1)."""
    w = _weight()
    scale = (np.abs(w).max(axis=0) / 127).astype(np.float32)
    q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    return _model([helper.make_node("QuantizeLinear", ["x", "x_s", "x_zp"], ["x_q"], name="x_q"),
                   helper.make_node("DequantizeLinear", ["x_q", "x_s", "x_zp"], ["x_dq"], name="x_dq"),
                   helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_zp"], ["w_dq"], axis=1, name="w_dq"),
                   helper.make_node("MatMul", ["x_dq", "w_dq"], ["y"], name=NODE)],
                  [numpy_helper.from_array(np.array(0.02, np.float32), "x_s"),
                   numpy_helper.from_array(np.array(128, np.uint8), "x_zp"), numpy_helper.from_array(q, "w_q"),
                   numpy_helper.from_array(scale, "w_s"), numpy_helper.from_array(np.zeros(64, np.int8), "w_zp")], 17)


def fp8_model(activations: bool = True) -> onnx.ModelProto:
    """(d) fp8 e4m3fn Q/DQ around the MatMul (opset 19, scalar scales); without ``activations``
    only the weight is fp8."""
    w_q = numpy_helper.from_array(_weight().astype(ml_dtypes.float8_e4m3fn), "w_q")
    nodes = [helper.make_node("DequantizeLinear", ["w_q", "w_s"], ["w_dq"], name="w_dq")]
    inits = [w_q, numpy_helper.from_array(np.array(1.0, np.float32), "w_s")]
    x = "x"
    if activations:
        nodes += [helper.make_node("QuantizeLinear", ["x", "x_s", "x_zp"], ["x_q"], name="x_q"),
                  helper.make_node("DequantizeLinear", ["x_q", "x_s", "x_zp"], ["x_dq"], name="x_dq")]
        inits += [numpy_helper.from_array(np.array(0.02, np.float32), "x_s"),
                  helper.make_tensor("x_zp", TensorProto.FLOAT8E4M3FN, [], [0])]
        x = "x_dq"
    return _model(nodes + [helper.make_node("MatMul", [x, "w_dq"], ["y"], name=NODE)], inits, 19)


@pytest.fixture()
def data(tmp_path):
    path = tmp_path / "data.npz"
    np.savez(path, x=np.random.default_rng(1).standard_normal((4, 16, 64)).astype(np.float32))
    return path


def _save(model: onnx.ModelProto, path, external: bool = False):
    if external:
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=path.name + ".data", size_threshold=0)
    else:
        onnx.save(model, str(path))
    return path


def _bench(*args):
    return run_cli("bench", *map(str, args))


def _bench_json(*args) -> dict:
    result = _bench(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _ort_node(path, name: str, feeds=None) -> onnx.NodeProto:
    """The node ``name`` of onnxruntime's optimized graph of ``path`` (ORT_ENABLE_ALL, CPU), written by onnxruntime here."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    optimized = path.with_name(path.stem + ".ort-optimized.onnx")
    opts.optimized_model_filepath = str(optimized)
    ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    graph = onnx.load(str(optimized), load_external_data=False).graph
    optimized.unlink()
    return next(n for n in graph.node if n.name == name)


def _sizes(*paths) -> int:
    return sum(os.path.getsize(p) for p in paths)


def _layer(report: dict, label: str) -> dict:
    (layer,) = report[label]["kernels"]["layers"]
    assert layer["module"] == MODULE and layer["node"] == NODE
    return layer


def _check_timing(shape: dict, batch: int, seq: int) -> None:
    assert shape["measured"] and shape["skipped"] is None and (shape["batch"], shape["seq"]) == (batch, seq)
    for label in ("reference", "quantized"):
        t = shape[label]
        assert 0 < t["min_s"] <= t["p10_s"] <= t["median_s"] <= t["p90_s"] <= t["max_s"]
        assert t["rounds"] == 3 and t["calls_per_sample"] >= 1
        assert t["samples_per_s"] == pytest.approx(batch / t["median_s"])
        assert t["tokens_per_s"] == pytest.approx(batch * seq / t["median_s"])
    assert shape["ratio"] == pytest.approx(shape["quantized"]["median_s"] / shape["reference"]["median_s"])


def test_int4_weights_run_as_matmulnbits_at_both_shapes(tmp_path, data):
    ref, quant = _save(fp32_model(), tmp_path / "ref.onnx"), _save(int4_model(), tmp_path / "q.onnx")
    report = _bench_json(ref, quant, "--data", data, "--batch-size", "2", "--device", "cpu", "--no-memory", *FAST)

    node = _ort_node(quant, NODE)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert node.op_type == "MatMulNBits" and attrs["bits"] == 4 and attrs["block_size"] == 32
    layer = _layer(report, "quantized")
    assert (layer["kind"], layer["op_type"], layer["bits"], layer["block_size"]) == ("matmulnbits", "MatMulNBits", 4, 32)
    assert layer["accuracy_level"] == attrs.get("accuracy_level", 0)
    assert layer["kernel"] == f"MatMulNBits 4-bit acc{layer['accuracy_level']}"
    assert layer["provider"] == "CPUExecutionProvider"
    assert report["quantized"]["kernels"]["summary"] == {layer["kernel"]: 1}
    assert _ort_node(ref, NODE).op_type == "MatMul"
    ref_layer = _layer(report, "reference")
    assert (ref_layer["kind"], ref_layer["op_type"], ref_layer["weight_from"]) == ("float", "MatMul", "initializer")
    assert report["reference"]["kernels"]["summary"] == {"float (weight folded to fp32 at load)": 1}

    assert (report["device"], report["provider"], report["onnxruntime"]) == ("cpu", "CPUExecutionProvider", ort.__version__)
    assert report["optimization"] == "ORT_ENABLE_ALL" and report["cpu_count"] == os.cpu_count()
    shapes = report["shapes"]
    assert shapes["prefill"]["inputs"] == {"x": [2, 16, 64]} and shapes["decode"]["inputs"] == {"x": [1, 1, 64]}
    _check_timing(shapes["prefill"], 2, 16)
    _check_timing(shapes["decode"], 1, 1)
    assert report["ratios"] == {name: shapes[name]["ratio"] for name in ("prefill", "decode")}
    assert shapes["decode"]["past"] is None and report["genai_loop"] is None  # no KV cache: no past, no genai loop
    assert report["reference"]["size_bytes"] == _sizes(ref) and report["quantized"]["size_bytes"] == _sizes(quant)
    assert report["size_ratio"] == pytest.approx(_sizes(quant) / _sizes(ref))
    assert report["memory_skipped"] == "--no-memory" and report["quantized"]["memory"] is None


def test_static_int8_runs_as_an_integer_kernel_and_memory_is_measured(tmp_path, data):
    ref = _save(fp32_model(), tmp_path / "ref.onnx")
    quant = _save(int8_static_model(), tmp_path / "q.onnx", external=True)  # sizes count the data file
    report = _bench_json(ref, quant, "--data", data, "--device", "cpu", "--no-decode", *FAST)

    assert _ort_node(quant, NODE).op_type == "MatMulIntegerToFloat"
    layer = _layer(report, "quantized")
    assert (layer["kind"], layer["kernel"], layer["provider"]) == ("integer", "MatMulIntegerToFloat", "CPUExecutionProvider")
    assert report["shapes"]["decode"] == {**report["shapes"]["decode"], "measured": False, "skipped": "--no-decode"}
    _check_timing(report["shapes"]["prefill"], 4, 16)  # the data's 4 samples (fewer than the default 8)
    files = report["quantized"]["files"]
    assert sorted(files) == sorted([str(quant), str(quant) + ".data"])
    assert files == {str(quant): os.path.getsize(quant), str(quant) + ".data": os.path.getsize(str(quant) + ".data")}
    assert report["quantized"]["size_bytes"] == _sizes(quant, str(quant) + ".data")
    for label in ("reference", "quantized"):
        memory = report[label]["memory"]
        assert memory["rss_after_imports_bytes"] > 0 and memory["peak_rss_bytes"] > memory["rss_after_imports_bytes"]
        assert memory["increase_bytes"] == memory["peak_rss_bytes"] - memory["rss_after_imports_bytes"] > 0
        assert memory["provider"] == "CPUExecutionProvider" and memory["device_bytes"] is None
    assert report["memory_skipped"] is None


def test_a_weight_left_behind_dequantize_is_dequantized_at_run_time(tmp_path, data):
    ref, quant = _save(fp32_model(), tmp_path / "ref.onnx"), _save(fp8_model(activations=False), tmp_path / "q.onnx")
    report = _bench_json(ref, quant, "--data", data, "--device", "cpu", "--no-memory", "--no-decode", *FAST)
    node = _ort_node(quant, NODE)
    assert node.op_type == "MatMul"
    layer = _layer(report, "quantized")
    assert (layer["kind"], layer["kernel"]) == ("dequantized", "float (dequantized at run time)")
    assert layer["weight_from"] == "DequantizeLinear"


def test_fp8_activations_do_not_load_at_enable_all(tmp_path, data):
    ref, quant = _save(fp32_model(), tmp_path / "ref.onnx"), _save(fp8_model(), tmp_path / "q.onnx")
    with pytest.raises(Exception) as refused:  # onnxruntime itself refuses the model at its default level
        ort.InferenceSession(str(quant), providers=["CPUExecutionProvider"])
    result = _bench(ref, quant, "--data", data, "--device", "cpu", "--no-memory", *FAST)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output
    assert lines[0].startswith(f"error: {quant} does not load in onnxruntime at ORT_ENABLE_ALL: ")
    assert str(refused.value).strip().splitlines()[0].strip() in lines[0]


def test_fixed_sequence_skips_decode_and_text_lists_layers(tmp_path, data):
    ref, quant = _save(fp32_model(seq=16), tmp_path / "ref.onnx"), _save(int4_model(seq=16), tmp_path / "q.onnx")
    report = _bench_json(ref, quant, "--data", data, "--device", "cpu", "--no-memory", *FAST)
    decode = report["shapes"]["decode"]
    assert not decode["measured"] and decode["ratio"] is None and decode["quantized"] is None
    assert decode["skipped"] == "input 'x' fixes axis 1 at 16 (no one-token shape)"
    _check_timing(report["shapes"]["prefill"], 4, 16)

    result = _bench(ref, quant, "--data", data, "--device", "cpu", "--no-memory", "--layers", *FAST)
    assert result.exit_code == 0, result.output
    text = result.output
    assert "decode           skipped: input 'x' fixes axis 1 at 16" in text
    assert "prefill 4x16" in text and "ratio" in text and "not measured (--no-memory)" in text
    assert "genai loop" not in text
    layer = _layer(report, "quantized")
    assert f"quantized: {layer['kernel']}: 1" in text
    assert any(line.startswith(MODULE) and "MatMulNBits 4-bit" in line and "block 32" in line
               for line in text.splitlines())


@pytest.mark.parametrize("case, expected", [
    ("missing", "model file not found"),
    ("not_a_model", "is not a readable ONNX model"),
    ("other_inputs", "takes other inputs than"),
    ("data_lacks_input", "no array for model input(s) x"),
])
def test_bad_input_is_one_error_line(tmp_path, data, case, expected):
    ref = _save(fp32_model(), tmp_path / "ref.onnx")
    quant = _save(int4_model(), tmp_path / "q.onnx")
    if case == "missing":
        quant = tmp_path / "absent.onnx"
    elif case == "not_a_model":
        quant = tmp_path / "junk.onnx"
        quant.write_bytes(b"this is not a protobuf \xff\xff\xff")
    elif case == "other_inputs":
        other = fp32_model()
        other.graph.input[0].name = "z"
        other.graph.node[0].input[0] = "z"
        quant = _save(other, tmp_path / "other.onnx")
    else:
        data = tmp_path / "wrong.npz"
        np.savez(data, z=np.zeros((2, 16, 64), np.float32))
    result = _bench(ref, quant, "--data", data, "--device", "cpu", "--no-memory", *FAST)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(  # nothing written beside the models
        p.name for p in tmp_path.iterdir() if p.suffix in (".onnx", ".npz"))


def test_tiny_llama_w4a16_every_target_is_matmulnbits(tmp_path, llama_dir):
    from graphcal.calibration.pipeline import calibrate

    result = calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "w4", scheme="W4A16", device="cpu")
    quant = tmp_path / "w4" / "model.onnx"
    report = _bench_json(llama_dir / "model.onnx", quant, "--data", llama_dir / "heldout.npz", "--device", "cpu",
                         "--no-memory", "--rounds", "2", "--warmup", "1")
    layers = {layer["module"]: layer for layer in report["quantized"]["kernels"]["layers"]}
    quantized = [t.target.name for t in result.targets]
    assert result.ignored == ["lm_head"] and set(layers) == {*quantized, "lm_head"}
    for name in quantized:
        layer = layers[name]
        assert (layer["kind"], layer["bits"], layer["provider"]) == ("matmulnbits", 4, "CPUExecutionProvider"), name
        assert _ort_node(quant, layer["optimized_node"]).op_type == "MatMulNBits"
    assert layers["lm_head"]["kind"] == "float" and layers["lm_head"]["op_type"] == "MatMul"
    assert all(layer["kind"] == "float" for layer in report["reference"]["kernels"]["layers"])
    assert report["shapes"]["prefill"]["inputs"] == {"attention_mask": [8, 32], "input_ids": [8, 32]}
    assert report["shapes"]["decode"]["measured"] and report["shapes"]["decode"]["batch"] == 1


@pytest.mark.gpu
@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(), reason="needs onnxruntime-gpu")
def test_bench_on_cuda_reports_the_provider_kernels_and_gpu_memory(tmp_path, llama_dir):
    """On CUDA: both models time on the CUDA provider, every quantized layer is a MatMulNBits that
    ran there (read from onnxruntime's profile), and the GPU memory of each model's process is measured."""
    from graphcal.calibration.pipeline import calibrate

    calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "w4", scheme="W4A16", device="cpu")
    quant = tmp_path / "w4" / "model.onnx"
    report = _bench_json(llama_dir / "model.onnx", quant, "--data", llama_dir / "heldout.npz", "--device", "cuda",
                         "--rounds", "3", "--warmup", "1")
    assert report["device"] == "cuda" and report["provider"] == "CUDAExecutionProvider"
    layers = [layer for layer in report["quantized"]["kernels"]["layers"] if layer["module"] != "lm_head"]
    assert layers and all((layer["kind"], layer["provider"]) == ("matmulnbits", "CUDAExecutionProvider")
                          for layer in layers)
    for label in ("reference", "quantized"):
        memory = report[label]["memory"]
        assert memory["peak_rss_bytes"] > 0 and memory["provider"] == "CUDAExecutionProvider"
        assert memory["device"] == "nvidia-smi" and memory["device_bytes"] > 0, memory
    assert report["shapes"]["prefill"]["quantized"]["median_s"] > 0


@pytest.mark.parametrize("saturates", [True, False])
def test_int8_kernels_that_saturate_are_noted(tmp_path, data, monkeypatch, saturates):
    """bench runs the model on this CPU: where onnxruntime's u8 x s8 kernels saturate
    (tests/test_saturation.py) and the quantized model runs one, the report says so."""
    import graphcal.devices
    from graphcal.devices import INT8_SATURATION_NOTE

    monkeypatch.setattr(graphcal.devices, "_SATURATES", saturates)
    ref = _save(fp32_model(), tmp_path / "ref.onnx")
    quant = _save(int8_static_model(), tmp_path / "q.onnx")
    report = _bench_json(ref, quant, "--data", data, "--device", "cpu", "--no-decode", "--no-memory", *FAST)
    assert report["notes"] == ([INT8_SATURATION_NOTE] if saturates else [])
    text = _bench(ref, quant, "--data", data, "--device", "cpu", "--no-decode", "--no-memory", *FAST)
    assert text.exit_code == 0 and (INT8_SATURATION_NOTE in text.output) is saturates
    # a float model runs no integer kernel: nothing to note
    report = _bench_json(ref, ref, "--data", data, "--device", "cpu", "--no-decode", "--no-memory", *FAST)
    assert report["notes"] == []
