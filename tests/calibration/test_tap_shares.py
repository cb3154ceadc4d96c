"""Whole-tensor taps in bounded passes (graphcal.calibration.activations.tap_shares, --tap-limit-mb): the
whole-graph pass (--pass whole-graph; the streamed pass holds one block's taps at a time).

onnxruntime keeps every output of a graph alive until a run ends, fetched or not, so a batch's whole
taps are held at once. Past the limit the data runs once per share of them, each pass on a graph
whose outputs are that share alone. The shares must not change a single written byte, and no
pass's graph may hold more than the limit of whole taps (beyond a single tap larger than it).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import graphcal.calibration.activations
import graphcal.limits
from graphcal.calibration.activations import TAP_LIMIT_MB, _slices
from graphcal.calibration.pipeline import calibrate
from graphcal.graph.taps import TapRequest, build_tapped, tap_bytes
from graphcal.runtime import Runtime
from tests.helpers import run_cli


def _files(out):
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file() and not p.name.startswith(".graphcal")}


def _passes(monkeypatch):
    """Every session the activation pass opens: [its graph's outputs, the float bytes of each batch's run]."""
    passes = []
    real_open, real_run = graphcal.calibration.activations.open_runtime, Runtime.run

    def open_runtime(model, outputs, *args, **kwargs):
        assert {o.name for o in model.graph.output} == set(outputs)  # nothing else held until a run ends
        passes.append([list(outputs), []])
        return real_open(model, outputs, *args, **kwargs)

    def run(self, feeds):
        values = real_run(self, feeds)
        passes[-1][1].append(sum(v.nbytes for v in values.values() if v.is_floating_point() and v.ndim >= 2))
        return values

    monkeypatch.setattr(graphcal.calibration.activations, "open_runtime", open_runtime)
    monkeypatch.setattr(Runtime, "run", run)
    return passes


def test_slices_keep_order_and_stay_under_the_limit():
    sizes = {"a": 4, "b": 4, "c": 9, "d": 1, "e": 3}
    assert _slices(list(sizes), sizes, 8) == [["a", "b"], ["c"], ["d", "e"]]  # c alone: larger than the limit
    assert _slices(list(sizes), sizes, 100) == [list(sizes)]
    assert _slices(["x"], {"x": 5}, 1) == [["x"]]


def test_tap_sizes_from_shape_inference_are_the_tensors_onnxruntime_makes(llama_dir):
    """The first batch's dims fixed, onnx shape inference (with data propagation through the
    exporter's Shape -> Reshape chains) gives every tapped activation's size; checked against the
    tensors onnxruntime returns."""
    from graphcal.runtime import run_model

    model = onnx.load(llama_dir / "model.onnx")
    tensors = list(dict.fromkeys(n.input[0] for n in model.graph.node if n.op_type == "MatMul"))
    feeds = {k: v[:8] for k, v in np.load(llama_dir / "calib.npz").items()}
    sizes = tap_bytes(model, tensors, {k: v.shape for k, v in feeds.items()})
    tapped = build_tapped(model, [TapRequest(t) for t in tensors]).model
    tapped.graph.initializer.extend(model.graph.initializer)  # the tapped copy is weightless
    got = run_model(tapped, feeds, tensors)
    assert sizes == {t: got[t].nbytes for t in tensors}


@pytest.mark.parametrize("scheme, options", [
    ("W8A8_STATIC", {"observer": "mse"}),  # whole activations for llm-compressor's MSE search
    ('{"weights": {"num_bits": 4, "strategy": "group", "group_size": 32, "observer": "imatrix_mse"}}', {}),
    ("W8A8_STATIC", {"exclude_padding": True}),  # every tap whole, rows picked in torch
    ("W8A8_STATIC", {"observer": "mse", "smoothquant": "norms"}),  # taps of x * (1/s) the model lacks
    # one tensor, two consumers in two passes: imatrix's whole tap in a share, the input's min/max in the last
    ('{"weights": {"num_bits": 4, "strategy": "group", "group_size": 32, "observer": "imatrix_mse"}, '
     '"input_activations": {"num_bits": 8, "strategy": "tensor", "dynamic": false}}', {}),
])
def test_passes_in_shares_write_the_same_bytes(llama_dir, tmp_path, monkeypatch, scheme, options):
    whole = calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "whole", pass_mode="whole-graph", scheme=scheme,
                      **options)
    passes = _passes(monkeypatch)
    limit_mb = 0.3  # tiny-llama's whole taps: about 1.3 MB a batch of 8 x 32 tokens
    shared = calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "shared", pass_mode="whole-graph", scheme=scheme,
                       tap_limit_mb=limit_mb, **options)
    assert _files(tmp_path / "whole") == _files(tmp_path / "shared")
    assert not any("tap-limit-mb" in w for w in whole.warnings)
    assert [w for w in shared.warnings if "tap-limit-mb" in w], shared.warnings
    calibration = [p for p in passes if p[1]]
    assert len(calibration) > 2
    for outputs, runs in calibration:
        assert len(runs) == whole.num_batches  # every pass reads all the data
        assert max(runs) <= limit_mb * 1e6 or len(outputs) <= 3, (outputs, runs)  # one tap (+ its min, max)
    assert shared.padding_share == whole.padding_share


def test_under_the_limit_one_pass(llama_dir, tmp_path, monkeypatch):
    passes = _passes(monkeypatch)
    result = calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "out", pass_mode="whole-graph", scheme="W8A8_STATIC",
                       observer="mse")
    assert [len(runs) for _, runs in passes] == [result.num_batches]
    assert TAP_LIMIT_MB == 1024


def test_the_flag_reaches_the_pass(llama_dir, tmp_path):
    out = tmp_path / "out"
    result = run_cli("run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"), "--pass", "whole-graph",
                     "--scheme", "W8A8_STATIC", "--observer", "mse", "--tap-limit-mb", "1",
                     "-o", str(out), "--json")
    assert result.exit_code == 0, result.output
    assert any("the data ran 2 times" in w for w in json.loads(result.stdout)["warnings"])
    bad = run_cli("run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                  "--tap-limit-mb", "0", "-o", str(tmp_path / "bad"))
    assert bad.exit_code == 2 and "--tap-limit-mb" in bad.output


def test_histograms_that_would_not_fit_are_refused_before_the_pass(llama_dir, tmp_path, monkeypatch):
    """Per-tap state is counted before any batch runs: 2 * bins float64 counts per histogram."""
    monkeypatch.setattr(graphcal.limits, "available_memory", lambda: 64 << 20)  # half: 33.5 MB
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("""
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      targets: [Linear]
      ignore: [lm_head]
      config_groups:
        group_0:
          targets: [Linear]
          weights: {num_bits: 8, type: int, symmetric: true, strategy: channel}
          input_activations: {num_bits: 8, type: int, symmetric: true, strategy: tensor, dynamic: false,
                              observer: percentile, observer_kwargs: {bins: 1048576}}
""")
    out = tmp_path / "out"
    result = run_cli("run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"), "--pass", "whole-graph",
                     "--recipe", str(recipe), "-o", str(out))
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the observers' statistics need"), result.output
    assert "lower the histogram observers' bins" in lines[0]
    assert not out.exists() or not any(out.iterdir())
    # 8 distinct taps x 16 MB fit where there is room for them
    monkeypatch.setattr(graphcal.limits, "available_memory", lambda: 1 << 30)
    ok = run_cli("run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"), "--pass", "whole-graph",
                 "--recipe", str(recipe), "-o", str(out), "-q")
    assert ok.exit_code == 0, ok.output


def test_sizes_shape_inference_cannot_tell_are_measured(llama_dir, tmp_path, monkeypatch):
    """Where shape inference leaves a tap's size open, a run that fetches only the taps' shapes
    measures it: the same shares, the same bytes."""
    from graphcal.calibration.activations import tap_shares

    seen = {}
    real = tap_shares

    def shares(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.setdefault("shares", []).append([[r.tensor for r in share] for share in out[0]] + [out[1]])
        return out

    monkeypatch.setattr(graphcal.calibration.activations, "tap_shares", shares)
    calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "inferred", pass_mode="whole-graph", scheme="W8A8_STATIC",
              observer="mse", tap_limit_mb=0.3)
    monkeypatch.setattr(graphcal.calibration.activations, "tap_bytes", lambda model, tensors, *a: {t: None for t in tensors})
    calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "measured", pass_mode="whole-graph", scheme="W8A8_STATIC",
              observer="mse", tap_limit_mb=0.3)
    inferred, measured = seen["shares"]
    assert inferred == measured and len(inferred) > 2
    assert _files(tmp_path / "inferred") == _files(tmp_path / "measured")


@pytest.mark.parametrize("observer", [None, "mse"])
def test_weights_also_listed_as_graph_inputs_are_handed_over(tmp_path, observer):
    """Exporters with keep_initializers_as_inputs list every weight as a graph input too: the tapped
    graph (which keeps the model's inputs) still gets them as weights, not as inputs to feed. The
    second layer's input is computed with the first layer's weight."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), f"model.{n}.weight")
               for n in ("up", "down")]

    def model(weights_as_inputs: bool):
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])]
        if weights_as_inputs:
            inputs += [helper.make_tensor_value_info(w.name, TensorProto.FLOAT, [16, 16]) for w in weights]
        nodes = [helper.make_node("MatMul", ["x", weights[0].name], ["h"], name="/model/up/MatMul"),
                 helper.make_node("MatMul", ["h", weights[1].name], ["y"], name="/model/down/MatMul")]
        graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])],
                                  weights)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)

    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((16, 16)).astype(np.float32))
    written = {}
    for as_inputs in (False, True):
        folder = tmp_path / f"m{as_inputs}"
        folder.mkdir()
        onnx.save(model(as_inputs), folder / "model.onnx")
        calibrate(folder / "model.onnx", tmp_path / "calib.npz", tmp_path / f"out{as_inputs}", pass_mode="whole-graph", scheme="W8A8_STATIC",
                  observer=observer)
        written[as_inputs] = (tmp_path / f"out{as_inputs}" / "qparams.safetensors").read_bytes()
    assert written[True] == written[False]
