"""Every mistake a user can make ends in one clear line and a non-zero exit, with nothing written."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.helpers import run_cli


def invoke(model, data, out, *extra):
    result = run_cli("run", str(model), "--data", str(data), "-o", str(out), *extra)
    text = result.output.strip()
    return result.exit_code, text


def assert_one_line_error(code, text, expected_code, fragment):
    assert code == expected_code, text
    errors = [line for line in text.splitlines() if line.startswith("error:") or line.startswith("Error:")]
    assert len(errors) == 1 and fragment in errors[0], text
    assert "Traceback" not in text


@pytest.fixture
def llama(llama_dir):
    return llama_dir / "model.onnx", llama_dir / "calib.npz"


def _tiny_model(path, nodes, inits, x_shape=(2, 4)):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", x_shape[1]])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", None])], initializer=inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


@pytest.mark.parametrize("content, fragment", [
    (b"", "model file is empty"),
    (b"this is not onnx at all", "not a readable ONNX model"),
])
def test_bad_model_files(tmp_path, llama, content, fragment):
    bad = tmp_path / "m.onnx"
    bad.write_bytes(content)
    assert_one_line_error(*invoke(bad, llama[1], tmp_path / "o"), 1, fragment)
    assert not (tmp_path / "o").exists()


def test_truncated_model(tmp_path, llama):
    bad = tmp_path / "m.onnx"
    bad.write_bytes(llama[0].read_bytes()[: 100_000])
    assert_one_line_error(*invoke(bad, llama[1], tmp_path / "o"), 1, "not a readable ONNX model")


def test_missing_external_data(tmp_path, llama):
    model = onnx.load(llama[0])
    onnx.save_model(model, tmp_path / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    (tmp_path / "m.data").unlink()
    assert_one_line_error(*invoke(tmp_path / "m.onnx", llama[1], tmp_path / "o"), 1, "external data")


def test_nothing_to_quantize(tmp_path):
    model = _tiny_model(tmp_path / "m.onnx", [helper.make_node("Relu", ["x"], ["y"])], [])
    np.savez(tmp_path / "d.npz", x=np.ones((2, 4), np.float32))
    assert_one_line_error(*invoke(model, tmp_path / "d.npz", tmp_path / "o"), 1, "nothing to quantize")


@pytest.mark.parametrize("value, observer", [
    (-1.0, "static_minmax"),  # log(-1) = NaN, seen by the in-graph probe
    (-1.0, "mse"),  # NaN in a whole tensor
    (0.0, "mse"),  # log(0) = -Inf in a whole tensor
])
def test_non_finite_activation_inside_the_graph_names_tap_observer_and_batch(tmp_path, value, observer):
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    model = _tiny_model(tmp_path / "m.onnx", [helper.make_node("Log", ["x"], ["h"], name="log"),
                                              helper.make_node("MatMul", ["h", "w"], ["y"], name="/fc/MatMul")], [w])
    x = np.ones((4, 4), np.float32)
    x[3, 0] = value  # in the second batch of 2
    np.savez(tmp_path / "d.npz", x=x)
    code, text = invoke(model, tmp_path / "d.npz", tmp_path / "o", "--scheme", "W8A8_STATIC", "--batch-size", "2",
                        "--observer", observer)
    assert_one_line_error(code, text, 1, f"tap 'h' holds NaN or Inf in batch 1 (observer {observer})")


@pytest.mark.parametrize("mutate, fragment", [
    (lambda d: d.pop("attention_mask"), "no array for model input(s) attention_mask"),
    (lambda d: d.update(extra=np.zeros(2)), "array(s) extra are not model inputs"),
    (lambda d: d.update(input_ids=d["input_ids"].astype(np.int32)), "is int32, the model expects int64"),
    (lambda d: d.update(input_ids=d["input_ids"][..., None]), "has rank 3"),
    (lambda d: d.update(attention_mask=d["attention_mask"][:10]), "disagree on the number of samples"),
    (lambda d: d.update({k: v[:0] for k, v in d.items()}), "zero samples"),
    (lambda d: d.update(input_ids=np.array([None] * 64, dtype=object)), "Python objects"),
])
def test_bad_data(tmp_path, llama, mutate, fragment):
    data = dict(np.load(llama[1]))
    mutate(data)
    np.savez(tmp_path / "d.npz", **data)
    assert_one_line_error(*invoke(llama[0], tmp_path / "d.npz", tmp_path / "o", "--scheme", "W8A8_STATIC"), 1, fragment)
    assert not (tmp_path / "o").exists()


def test_data_missing_or_not_npz(tmp_path, llama):
    assert_one_line_error(*invoke(llama[0], tmp_path / "nope.npz", tmp_path / "o"), 1, "calibration data not found")
    (tmp_path / "d.txt").write_text("1,2,3")
    assert_one_line_error(*invoke(llama[0], tmp_path / "d.txt", tmp_path / "o"), 1, "is not an .npz file")


def test_nan_in_data(tmp_path):
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    model = _tiny_model(tmp_path / "m.onnx", [helper.make_node("MatMul", ["x", "w"], ["y"], name="/fc/MatMul")], [w])
    x = np.ones((3, 4), np.float32)
    x[1, 2] = np.inf
    np.savez(tmp_path / "d.npz", x=x)
    assert_one_line_error(*invoke(model, tmp_path / "d.npz", tmp_path / "o", "--scheme", "W8A8_STATIC"), 1,
                          "holds NaN or Inf (sample 1)")


@pytest.mark.parametrize("args, fragment", [
    (["--batch-size", "0"], "Invalid value for '--batch-size'"),
    (["--num-samples", "-3"], "Invalid value for '--num-samples'"),
    (["--device", "tpu"], "Invalid value for '--device'"),
])
def test_bad_numbers_and_choices_are_usage_errors(tmp_path, llama, args, fragment):
    code, text = invoke(llama[0], llama[1], tmp_path / "o", *args)
    assert code == 2 and fragment in text and "Traceback" not in text


def test_output_that_would_overwrite_the_input(llama):
    model, data = llama
    assert_one_line_error(*invoke(model, data, model.parent), 1, "would overwrite the input")


def test_output_path_is_a_file(tmp_path, llama):
    (tmp_path / "f").write_text("x")
    code, text = invoke(llama[0], llama[1], tmp_path / "f")
    assert code != 0 and "Traceback" not in text and (tmp_path / "f").read_text() == "x"


def test_regex_matching_nothing_warns_but_runs(tmp_path, llama):
    code, text = invoke(llama[0], llama[1], tmp_path / "o", "--ignore", "re:.*nonexistent.*", "-q")
    assert code == 0 and "warning: target or ignore pattern 're:.*nonexistent.*' matches no MatMul/Gemm" in text


def test_cuda_requested_without_a_gpu(tmp_path, llama):
    from graphcal.devices import cuda_usable

    if cuda_usable():
        pytest.skip("a GPU is usable here")
    assert_one_line_error(*invoke(llama[0], llama[1], tmp_path / "o", "--scheme", "W8A8_STATIC", "--device", "cuda"),
                          1, "--device cuda")


def test_debug_shows_the_traceback(tmp_path, llama):
    result = run_cli("run", str(tmp_path / "none.onnx"), "--data", str(llama[1]), "-o",
                     str(tmp_path / "o"), "--debug")
    assert result.exit_code != 0 and result.exception is not None


def test_full_disk_leaves_no_output(tmp_path, llama, monkeypatch):
    import errno

    import graphcal.calibration.pipeline

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(graphcal.calibration.pipeline, "save_model", full)
    assert_one_line_error(*invoke(llama[0], llama[1], tmp_path / "o"), 1, "No space left on device")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("scheme, fragment", [
    ('{"weights": {"num_bits": 4, "strategy": "group", "group_size": 96}}',
     "group size 96 does not divide the input features of 14 of 14 targets: model.layers.0.self_attn.q_proj (in 128)"),
    ('{"weights": {"num_bits": 8}, "input_activations": {"num_bits": 8, "strategy": "group", "group_size": 96, '
     '"dynamic": true}}', "a group size of 64 divides them all"),
])
def test_group_size_that_does_not_divide(tmp_path, llama, scheme, fragment):
    assert_one_line_error(*invoke(*llama, tmp_path / "o", "--scheme", scheme), 1, fragment)
    assert not (tmp_path / "o").exists()


def test_output_folder_not_writable(tmp_path, llama, monkeypatch):
    """As root every folder is writable, so the permission check is made to say no."""
    import os

    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if mode == os.W_OK else real(path, mode))
    assert_one_line_error(*invoke(*llama, tmp_path / "o"), 1, f"cannot write to {tmp_path}: permission denied")
    assert not (tmp_path / "o").exists()


def test_data_the_model_cannot_run_on(tmp_path, llama):
    """Token ids past the vocabulary: onnxruntime's kernel error comes back as one line, nothing written."""
    feeds = dict(np.load(llama[1]))
    feeds["input_ids"] = feeds["input_ids"] + 100_000
    np.savez(tmp_path / "d.npz", **feeds)
    assert_one_line_error(*invoke(llama[0], tmp_path / "d.npz", tmp_path / "o", "--scheme", "W8A8_STATIC"),
                          1, "onnxruntime failed on a batch: Non-zero status code")
    assert not (tmp_path / "o").exists()
