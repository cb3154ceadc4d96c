"""Whole-tensor taps in bounded runs (graphcal.activations.TapRuns, --tap-limit-mb).

onnxruntime keeps every fetched output of a run alive until the run ends, so a batch whose whole
taps add up past the limit runs once per share of them. The shares must not change a single
written byte, and no run may fetch more than the limit (beyond a single tap larger than it).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import graphcal.limits
from graphcal.activations import TAP_LIMIT_MB, _slices
from graphcal.cli import cli
from graphcal.pipeline import calibrate
from graphcal.runtime import Runtime


def _files(out):
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file() and not p.name.startswith(".graphcal")}


def _recorded(monkeypatch):
    """Every Runtime.run: (the outputs asked for, the bytes of the float tensors fetched)."""
    calls = []
    real = Runtime.run

    def run(self, feeds, outputs=None):
        values = real(self, feeds, outputs)
        calls.append((outputs, {n: v.nbytes for n, v in values.items() if v.is_floating_point() and v.ndim >= 2}))
        return values

    monkeypatch.setattr(Runtime, "run", run)
    return calls


def test_slices_keep_order_and_stay_under_the_limit():
    sizes = {"a": 4, "b": 4, "c": 9, "d": 1, "e": 3}
    assert _slices(list(sizes), sizes, 8) == [["a", "b"], ["c"], ["d", "e"]]  # c alone: larger than the limit
    assert _slices(list(sizes), sizes, 100) == [list(sizes)]
    assert _slices(["x"], {"x": 5}, 1) == [["x"]]


@pytest.mark.parametrize("scheme, options", [
    ("W8A8_STATIC", {"observer": "mse"}),  # whole activations for llm-compressor's MSE search
    ('{"weights": {"num_bits": 4, "strategy": "group", "group_size": 32, "observer": "imatrix_mse"}}', {}),
    ("W8A8_STATIC", {"exclude_padding": True}),  # every tap whole, rows picked in torch
])
def test_runs_in_shares_write_the_same_bytes(llama_dir, tmp_path, monkeypatch, scheme, options):
    whole = calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "whole", scheme=scheme,
                      **options)
    calls = _recorded(monkeypatch)
    limit_mb = 0.3  # tiny-llama's whole taps: about 1.3 MB a batch of 8 x 32 tokens
    shared = calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "shared", scheme=scheme,
                       tap_limit_mb=limit_mb, **options)
    assert _files(tmp_path / "whole") == _files(tmp_path / "shared")
    assert not any("tap-limit-mb" in w for w in whole.warnings)
    assert [w for w in shared.warnings if "tap-limit-mb" in w], shared.warnings
    # the first batch: one run for the reductions and the taps' shapes, then the shares; later batches
    # the shares alone; each run holds at most the limit of whole taps, or one tap
    batches = whole.num_batches
    assert len(calls) > 2 * batches
    for outputs, fetched in calls:
        assert outputs is not None
        assert sum(fetched.values()) <= limit_mb * 1e6 or len(fetched) == 1, fetched


def test_under_the_limit_a_batch_runs_once_after_the_first(llama_dir, tmp_path, monkeypatch):
    calls = _recorded(monkeypatch)
    result = calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "out", scheme="W8A8_STATIC",
                       observer="mse")
    # the first batch of each shape: the probe, then one run of every whole tap; then one run a batch
    assert len(calls) == result.num_batches + 1
    assert TAP_LIMIT_MB == 1024


def test_min_max_observers_need_no_probe(llama_dir, tmp_path, monkeypatch):
    calls = _recorded(monkeypatch)
    result = calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "out", scheme="W8A8_STATIC")
    assert len(calls) == result.num_batches and all(outputs is None for outputs, _ in calls)


def test_the_flag_reaches_the_pass(llama_dir, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                                      "--scheme", "W8A8_STATIC", "--observer", "mse", "--tap-limit-mb", "1",
                                      "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert any("each batch ran 2 times" in w for w in json.loads(result.stdout)["warnings"])
    bad = CliRunner().invoke(cli, ["run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                                   "--tap-limit-mb", "0", "-o", str(tmp_path / "bad")])
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
    result = CliRunner().invoke(cli, ["run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                                      "--recipe", str(recipe), "-o", str(out)])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the observers' statistics need"), result.output
    assert "lower the histogram observers' bins" in lines[0]
    assert not out.exists() or not any(out.iterdir())
    # 8 distinct taps x 16 MB fit where there is room for them
    monkeypatch.setattr(graphcal.limits, "available_memory", lambda: 1 << 30)
    ok = CliRunner().invoke(cli, ["run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                                  "--recipe", str(recipe), "-o", str(out), "-q"])
    assert ok.exit_code == 0, ok.output
