"""graphcal run --exclude-padding: positions where attention_mask == 0 leave the activation statistics.

References are computed here by hand (numpy/torch row selection) and compressed-tensors'
calculate_qparams; the MSE reference is the brute-force search of tests/observers/test_mse.py.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import calculate_qparams
from onnx import TensorProto, helper, numpy_helper

from graphcal.calibration.pipeline import calibrate
from tests.helpers import run_cli
from tests.observers.test_mse import reference_search

B, S, H, HID = 4, 6, 8, 16
# per sample: how many leading positions are real; samples 2 and 3 (the second batch of 2) are all padding
LENGTHS = [6, 3, 0, 0]
PADDED_SHARE = sum(S - n for n in LENGTHS) / (B * S)  # 15 / 24
INT8_TENSOR = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False)


def _weights():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(H, HID)).astype(np.float32), rng.normal(size=(HID, 4)).astype(np.float32),
            rng.normal(size=(H, 4)).astype(np.float32))


def build_model(path, with_mask: bool = True):
    """x [batch, seq, 8] -> fc1 -> Relu -> fc2; pool: mean over seq (a 2-D [batch, 8] activation) -> MatMul.
    The attention_mask input is read only by a Cast to an extra output."""
    w1, w2, w3 = _weights()
    nodes = [
        helper.make_node("MatMul", ["x", "fc1.weight"], ["h"], name="/fc1/MatMul"),
        helper.make_node("Relu", ["h"], ["hr"], name="/act/Relu"),
        helper.make_node("MatMul", ["hr", "fc2.weight"], ["y"], name="/fc2/MatMul"),
        helper.make_node("ReduceMean", ["x"], ["p"], name="/pool/ReduceMean", axes=[1], keepdims=0),
        helper.make_node("MatMul", ["p", "pool.weight"], ["z"], name="/pool/MatMul"),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", H])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 4]),
               helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 4])]
    if with_mask:
        nodes.append(helper.make_node("Cast", ["attention_mask"], ["m"], name="/mask/Cast", to=TensorProto.FLOAT))
        inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]))
        outputs.append(helper.make_tensor_value_info("m", TensorProto.FLOAT, ["batch", "seq"]))
    inits = [numpy_helper.from_array(w, n) for w, n in zip(_weights(), ["fc1.weight", "fc2.weight", "pool.weight"])]
    graph = helper.make_graph(nodes, "padded", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def make_data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(B, S, H)).astype(np.float32)
    mask = np.zeros((B, S), dtype=np.int64)
    for b, n in enumerate(LENGTHS):
        mask[b, :n] = 1
    x[mask == 0] = 1000.0  # padding that would dominate the range if it were counted
    x[mask == 0, 0] = -1000.0
    return x, mask


@pytest.fixture
def padded(tmp_path):
    x, mask = make_data()
    np.savez(tmp_path / "calib.npz", x=x, attention_mask=mask)
    return build_model(tmp_path / "model.onnx"), tmp_path / "calib.npz", x, mask


def _fc_inputs(x):
    """The fc1 and fc2 inputs the model computes, by hand."""
    w1 = _weights()[0]
    return x, np.maximum(x @ w1, 0)


def _minmax_scale(a: np.ndarray) -> torch.Tensor:
    lo, hi = torch.tensor([float(a.min())]), torch.tensor([float(a.max())])
    return calculate_qparams(lo, hi, INT8_TENSOR)[0]


def _run(args, *extra):
    # on the CPU: the references are computed in numpy, and a GPU's TF32 matmuls would move the
    # second layer's input by more than the exact comparisons allow (tests/calibration/test_cuda.py has the CUDA pass)
    return run_cli("run", *map(str, args), "--device", "cpu", *extra)


def _scales(out):
    from safetensors.torch import load_file

    return load_file(str(out / "qparams.safetensors"))


@pytest.mark.parametrize("exclude", [False, True])
def test_static_minmax_scales_use_only_unpadded_rows(padded, tmp_path, exclude):
    model, data, x, mask = padded
    out = tmp_path / "out"
    flags = ["--exclude-padding"] if exclude else []
    result = _run([model, "--data", data, "-o", out, "--scheme", "W8A8_STATIC", "--batch-size", 2], *flags)
    assert result.exit_code == 0, result.output
    scales = _scales(out)
    keep = mask != 0 if exclude else np.ones_like(mask, dtype=bool)
    for name, act in zip(["fc1", "fc2"], _fc_inputs(x)):
        expected = _minmax_scale(act[keep])
        torch.testing.assert_close(scales[f"{name}.input_scale"].reshape(-1), expected.reshape(-1), rtol=1e-6, atol=0)
    # the pooled input is [batch, 8]: observed whole (mean over padded positions included), with a warning
    pooled = x.mean(axis=1)
    torch.testing.assert_close(scales["pool.input_scale"].reshape(-1), _minmax_scale(pooled).reshape(-1),
                               rtol=1e-5, atol=0)
    if exclude:
        assert scales["fc1.input_scale"].item() < 0.1  # 1000 / 127 would be ~7.9
        warnings = [line for line in result.output.splitlines() if line.startswith("warning: --exclude-padding")]
        assert len(warnings) == 1 and "p [2, 8]" in warnings[0], result.output
        assert "fc1" not in warnings[0]
    share = f"{PADDED_SHARE:.1%}"
    assert share == "62.5%"
    line = f"calibration data: {share} of positions are padding (attention_mask == 0); "
    assert line + ("left out of the statistics" if exclude else "--exclude-padding leaves them out") in result.output


def test_mse_observer_sees_only_unpadded_rows(padded, tmp_path):
    model, data, x, mask = padded
    out = tmp_path / "out"
    # batch 2 (samples 2, 3) is all padding: skipped, so the moving average holds batch 1's search alone
    result = _run([model, "--data", data, "-o", out, "--scheme", "W8A8_STATIC", "--observer", "mse",
                   "--batch-size", 2, "--exclude-padding", "--json"])
    assert result.exit_code == 0, result.output
    scales = _scales(out)
    for name, act in zip(["fc1", "fc2"], _fc_inputs(x)):
        rows = torch.from_numpy(act[mask != 0])  # [N, H] by hand
        lo, hi = reference_search(rows.reshape(1, -1), INT8_TENSOR)
        expected = calculate_qparams(lo, hi, INT8_TENSOR)[0]
        torch.testing.assert_close(scales[f"{name}.input_scale"].reshape(-1), expected.reshape(-1), rtol=1e-6, atol=0)
    summary = json.loads(result.stdout.splitlines()[-1])
    assert summary["padding_share"] == pytest.approx(15 / 24) and summary["exclude_padding"] is True


def test_python_api_and_json_without_the_option(padded, tmp_path):
    model, data, x, mask = padded
    result = calibrate(model, data, tmp_path / "api", scheme="W8A8_STATIC", device="cpu", exclude_padding=True,
                       batch_size=2)
    assert result.padding_share == pytest.approx(15 / 24) and result.exclude_padding
    torch.testing.assert_close(result.qparams["fc1.input_scale"].reshape(-1),
                               _minmax_scale(x[mask != 0]).reshape(-1), rtol=1e-6, atol=0)
    plain = _run([model, "--data", data, "-o", tmp_path / "j", "--scheme", "W8A8", "--json"])
    assert plain.exit_code == 0, plain.output
    summary = json.loads(plain.stdout.splitlines()[-1])
    assert summary["padding_share"] == pytest.approx(15 / 24) and summary["exclude_padding"] is False


def test_no_attention_mask_is_a_one_line_usage_error(tmp_path):
    model = build_model(tmp_path / "model.onnx", with_mask=False)
    np.savez(tmp_path / "calib.npz", x=make_data()[0])
    for command in (["run", "-o", tmp_path / "o"], ["inspect"]):
        result = run_cli(command[0], model, "--data", tmp_path / "calib.npz", *command[1:], "--exclude-padding")
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and str(tmp_path / "calib.npz") in lines[0] and "attention_mask" in lines[0], lines
    assert not (tmp_path / "o").exists()
    # and without the option the same data runs, with no padding line
    result = _run([model, "--data", tmp_path / "calib.npz", "-o", tmp_path / "o2", "--scheme", "W8A8_STATIC"])
    assert result.exit_code == 0 and "padding" not in result.output, result.output


def test_inspect_accepts_the_option(padded):
    model, data, *_ = padded
    result = run_cli("inspect", str(model), "--data", str(data), "--exclude-padding")
    assert result.exit_code == 0, result.output


def test_kv_cache_states_are_observed_whole_with_a_warning(llama_dir, tmp_path):
    data = dict(np.load(llama_dir / "calib.npz"))
    mask = data["attention_mask"].copy()
    mask[::2, 20:] = 0  # every other sample: its last 12 of 32 positions are padding
    data["attention_mask"] = mask
    np.savez(tmp_path / "calib.npz", **data)
    outs = {}
    for flag in ([], ["--exclude-padding"]):
        out = tmp_path / f"out{len(flag)}"
        result = _run([llama_dir / "model.onnx", "--data", tmp_path / "calib.npz", "-o", out, "--scheme",
                       "W8A8_STATIC", "--kv-cache-scheme", "FP8"], *flag)
        assert result.exit_code == 0, result.output
        assert f"{32 * 12 / (64 * 32):.1%} of positions are padding" in result.output
        warned = [line for line in result.output.splitlines() if line.startswith("warning: --exclude-padding")]
        assert len(warned) == (1 if flag else 0), result.output
        if flag:
            assert warned[0].count("[8, 2, 32, 32]") == 4  # k and v of both layers
        outs[bool(flag)] = _scales(out)
    # k/v states are observed as without the option
    kv = [k for k in outs[False] if k.endswith(("k_scale", "v_scale"))]
    assert kv and all(torch.equal(outs[False][k], outs[True][k]) for k in kv)
