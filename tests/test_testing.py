"""graphcal.testing: the golden-file helper for regression tests on exported graphs."""

from __future__ import annotations

import pytest
import torch

from graphcal.calibration.pipeline import calibrate
from graphcal.testing import assert_matches_golden, save_golden


@pytest.fixture(scope="module")
def result(tmp_path_factory, llama_dir):
    return calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path_factory.mktemp("o"),
                     scheme="W8A8_STATIC", device="cpu")


def test_round_trip_from_result_folder_and_file(result, tmp_path):
    golden = save_golden(result, tmp_path / "g.safetensors")
    assert_matches_golden(result, golden)
    assert_matches_golden(result.output_dir, golden)
    assert_matches_golden(result.output_dir / "qparams.safetensors", golden)


def test_differences_are_listed(result, tmp_path):
    q = dict(result.qparams)
    golden = save_golden(q, tmp_path / "g.safetensors")
    key = "model.layers.0.self_attn.q_proj.input_scale"
    changed = dict(q)
    changed[key] = q[key] * (1 + 1e-3)
    del changed["model.layers.1.mlp.up_proj.weight_scale"]
    changed["extra.weight_scale"] = torch.ones(1)
    with pytest.raises(AssertionError) as e:
        assert_matches_golden(changed, golden)
    text = str(e.value)
    assert f"{key}: max relative difference 0.001" in text
    assert "missing: model.layers.1.mlp.up_proj.weight_scale" in text and "not in the golden file: extra.weight_scale" in text
    assert_matches_golden({**q, key: q[key] * (1 + 1e-6)}, golden)  # within the default rtol
    with pytest.raises(AssertionError):
        assert_matches_golden({**q, key: q[key] * (1 + 1e-6)}, golden, rtol=1e-8)


def test_missing_golden_fails_and_update_creates_it(result, tmp_path, monkeypatch):
    golden = tmp_path / "new.safetensors"
    with pytest.raises(AssertionError, match="does not exist; create it with GRAPHCAL_UPDATE_GOLDEN=1"):
        assert_matches_golden(result, golden)
    monkeypatch.setenv("GRAPHCAL_UPDATE_GOLDEN", "1")
    assert_matches_golden(result, golden)
    monkeypatch.delenv("GRAPHCAL_UPDATE_GOLDEN")
    assert_matches_golden(result, golden)
