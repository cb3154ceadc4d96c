"""Issue 31: SmoothQuant never writes a scale that is not finite, and a CalibrationDataReader is
refused up front where SmoothQuant would read the data twice.

* ``--smoothing-strength`` (and a recipe's ``smoothing_strength``) outside llm-compressor's range
  0..1 is refused before anything is read, by ``run`` and ``inspect`` (50 gave inf/NaN norm
  constants and qparams; -1 on a constant channel gave inf weight scales);
* on a model whose norm has a channel with weight 0 (a constant output channel, range 0), every
  strength in range writes finite constants and qparams, and where the formula still overflows
  (a balance column of denormals at strength 0) the run fails naming the mapping, writing nothing;
* ``calibrate(reader, smoothquant=..., observer="mse")`` is refused before the reader is read.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import helper, numpy_helper

from graphcal.cli import cli

HIDDEN, OUT = 8, 4
ZERO = 3  # the norm channel whose weight (and bias) is 0


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _one_line_error(result, code: int) -> str:
    assert result.exit_code == code, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert "Traceback" not in result.output
    return lines[0]


def _zero_channel_model(path, column_scale: float = 1.0, residual: bool = False, dtype=np.float32, bias: float = 0.0):
    """x [batch, seq, 8] -> LayerNormalization whose scale and bias are 0 on channel ZERO -> q_proj
    and k_proj MatMuls ([8, 4] weights, as the legacy exporter names them). ``column_scale``
    multiplies every balance weight's row ZERO (1e-40: denormals); ``residual``: the norm's output
    is a graph output too (no fold is exact: only an explicit Mul smooths it); ``dtype`` the model's
    float type; ``bias`` the norm's bias on channel ZERO (the channel's constant value)."""
    rng = np.random.default_rng(0)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    gamma = rng.uniform(0.5, 1.5, HIDDEN).astype(dtype)
    beta = rng.uniform(-0.2, 0.2, HIDDEN).astype(dtype)
    gamma[ZERO], beta[ZERO] = 0.0, bias
    inits = [numpy_helper.from_array(gamma, "layers.0.input_layernorm.weight"),
             numpy_helper.from_array(beta, "layers.0.input_layernorm.bias")]
    ln = "/layers.0/input_layernorm/LayerNormalization"
    h = f"{ln}_output_0"
    nodes = [helper.make_node("LayerNormalization", ["x", inits[0].name, inits[1].name], [h], name=ln,
                              axis=-1, epsilon=1e-5)]
    outputs = []
    for i, proj in enumerate(("q_proj", "k_proj")):
        w = rng.normal(0, 0.5, (HIDDEN, OUT)).astype(dtype)
        w[ZERO] *= dtype(column_scale)
        name = f"onnx::MatMul_{100 + i}"
        inits.append(numpy_helper.from_array(w, name))
        path_ = f"/layers.0/self_attn/{proj}/MatMul"
        nodes.append(helper.make_node("MatMul", [h, name], [f"{path_}_output_0"], name=path_))
        outputs.append(helper.make_tensor_value_info(f"{path_}_output_0", elem, ["batch", "seq", OUT]))
    if residual:
        outputs.append(helper.make_tensor_value_info(h, elem, ["batch", "seq", HIDDEN]))
    graph = helper.make_graph(nodes, "zero_norm_channel",
                              [helper.make_tensor_value_info("x", elem, ["batch", "seq", HIDDEN])],
                              outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    path.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path / "model.onnx")
    x = rng.normal(0, 1, (16, 5, HIDDEN)).astype(dtype)
    x[..., 1] *= 20  # an outlier channel for SmoothQuant to move
    np.savez(path / "calib.npz", x=x)
    return path


def _assert_all_finite(out):
    from safetensors.numpy import load_file

    model = onnx.load(out / "model.onnx")
    for init in model.graph.initializer:
        value = numpy_helper.to_array(init)
        if value.dtype.kind == "f":
            assert np.isfinite(value).all(), init.name
    for key, value in load_file(str(out / "qparams.safetensors")).items():
        if value.dtype.kind == "f":
            assert np.isfinite(value).all(), key


# --- the strength outside llm-compressor's range ----------------------------------------------------


@pytest.mark.parametrize("value", ["50", "-1", "1.5", "-0.01"])
@pytest.mark.parametrize("command", ["run", "inspect"])
def test_strength_outside_0_to_1_is_refused_before_calibrating(llama_dir, tmp_path, command, value):
    out = tmp_path / "out"
    result = _cli(command, llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", out,
                  "--scheme", "W8A8_STATIC", "--smoothquant", "all", f"--smoothing-strength={value}")
    line = _one_line_error(result, 2)
    assert "smoothing strength must be from 0 to 1" in line and value in line, line
    assert not out.exists()


@pytest.mark.parametrize("value", ["50", "-1", "1.000001"])
@pytest.mark.parametrize("command", ["run", "inspect"])
def test_recipe_strength_outside_0_to_1_is_refused(llama_dir, tmp_path, command, value):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("quant_stage:\n  quant_modifiers:\n    SmoothQuantModifier:\n"
                      f"      smoothing_strength: {value}\n    QuantizationModifier:\n      scheme: W8A8_STATIC\n")
    out = tmp_path / "out"
    result = _cli(command, llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", out, "--recipe", recipe)
    line = _one_line_error(result, 2)
    assert "SmoothQuantModifier: smoothing_strength must be from 0 to 1" in line and str(recipe) in line, line
    assert not out.exists()


@pytest.mark.parametrize("value", ["0", "1", "0.5"])
def test_strength_at_the_ends_of_the_range_is_accepted(llama_dir, value):
    result = _cli("inspect", llama_dir / "model.onnx", "--scheme", "W8A8_STATIC", "--smoothing-strength", value, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["smoothquant"]["strength"] == float(value)


# --- a norm channel whose weight is 0 -----------------------------------------------------------------


def test_negative_strength_on_a_zero_norm_channel_is_refused(tmp_path):
    model = _zero_channel_model(tmp_path / "m")
    result = _cli("run", model / "model.onnx", "--data", model / "calib.npz", "-o", tmp_path / "out",
                  "--scheme", "W8A8_STATIC", "--smoothing-strength", "-1")
    assert "from 0 to 1" in _one_line_error(result, 2)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("strength", ["0", "0.5", "1", "auto"])
@pytest.mark.parametrize("scope", ["norms", "mul"])
def test_a_zero_norm_channel_writes_finite_constants(tmp_path, strength, scope):
    """The channel's range is 0, so its scale is llm-compressor's floor 1e-5: the folded norm
    constants (or the explicit Mul's 1/s), the balance weights and every qparam stay finite."""
    model = _zero_channel_model(tmp_path / "m", residual=scope == "mul")
    out = tmp_path / "out"
    result = _cli("run", model / "model.onnx", "--data", model / "calib.npz", "-o", out, "-q", "--json",
                  "--scheme", "W8A8_STATIC", "--smoothquant", scope, "--smoothing-strength", strength)
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["smoothquant"]) == 1
    _assert_all_finite(out)
    smoothed = onnx.load(out / "model.onnx")
    assert any(".smoothed_" in i.name or "graphcal_smooth/" in i.name for i in smoothed.graph.initializer)


def test_scales_that_overflow_in_range_fail_naming_the_mapping(tmp_path):
    """Strength 0 divides by the balance columns' maximum: a column of denormals (1e-40) makes
    1 / 2e-40, past float32's range. The run fails naming the mapping and writes nothing."""
    model = _zero_channel_model(tmp_path / "m", column_scale=1e-40)
    out = tmp_path / "out"
    result = _cli("run", model / "model.onnx", "--data", model / "calib.npz", "-o", out,
                  "--scheme", "W8A8_STATIC", "--smoothing-strength", "0")
    line = _one_line_error(result, 1)
    assert "SmoothQuant" in line and "layers.0.input_layernorm" in line and "q_proj" in line, line
    assert "not finite" in line and "overflows" in line, line
    assert not out.exists()


def test_a_float16_constant_channel_whose_1_over_s_overflows_fails_naming_the_mapping(tmp_path):
    """float16: a constant channel's scale is the floor 1e-5, and 1/s = 1e5 is past float16's 65504
    (the taps and an explicit Mul multiply by it; the bias 1 divided by s would be too). It fails
    naming the mapping; nothing is written."""
    model = _zero_channel_model(tmp_path / "m", dtype=np.float16, bias=1.0)
    out = tmp_path / "out"
    result = _cli("run", model / "model.onnx", "--data", model / "calib.npz", "-o", out,
                  "--scheme", "W8A8_STATIC", "--smoothquant", "norms")
    line = _one_line_error(result, 1)
    assert "SmoothQuant" in line and "layers.0.input_layernorm" in line and "1/s in float16" in line, line
    assert "s down to 1e-05" in line, line
    assert not out.exists()


# --- a CalibrationDataReader where SmoothQuant needs two passes -----------------------------------------


class _Reader:
    """An onnxruntime-style CalibrationDataReader that counts what was read."""

    def __init__(self, arrays, batch=8):
        n = len(next(iter(arrays.values())))
        self._batches = iter([{k: v[i:i + batch] for k, v in arrays.items()} for i in range(0, n, batch)])
        self.calls = 0

    def get_next(self):
        self.calls += 1
        return next(self._batches, None)


def test_reader_with_smoothquant_and_mse_is_refused_before_reading(llama_dir, tmp_path):
    from graphcal import UsageError, calibrate

    reader = _Reader(dict(np.load(llama_dir / "calib.npz")))
    with pytest.raises(UsageError) as e:
        calibrate(llama_dir / "model.onnx", reader, tmp_path / "o", scheme="W8A8_STATIC", smoothquant="norms",
                  observer="mse")
    message = str(e.value)
    assert reader.calls == 0, "the reader was read before the refusal"
    assert "\n" not in message and "read once" in message and "mse" in message, message
    assert "pass the arrays" in message and "static_minmax" in message, message
    assert "make a new one" not in message
    assert not (tmp_path / "o").exists()


def test_reader_with_smoothquant_and_whole_tensor_taps_is_refused(llama_dir, tmp_path):
    from graphcal import UsageError, calibrate

    reader = _Reader(dict(np.load(llama_dir / "calib.npz")))
    with pytest.raises(UsageError, match="reduce_in_graph=False"):
        calibrate(llama_dir / "model.onnx", reader, tmp_path / "o", scheme="W8A8_STATIC", smoothquant="norms",
                  reduce_in_graph=False)
    assert reader.calls == 0


def test_reader_with_smoothquant_in_one_pass_still_runs(llama_dir, tmp_path):
    """static_minmax per tensor (W8A8_STATIC's default) is replayed: one pass, so a reader serves."""
    from graphcal import calibrate

    reader = _Reader(dict(np.load(llama_dir / "calib.npz")))
    result = calibrate(llama_dir / "model.onnx", reader, tmp_path / "o", scheme="W8A8_STATIC", smoothquant="norms")
    assert result.transforms["smoothquant"].mappings and result.num_batches == 8
    assert reader.calls == 9  # eight batches and the None that ends them, read once
