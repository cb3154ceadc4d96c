"""Same inputs, same bytes; a run killed at any moment leaves the previous output or none."""

from __future__ import annotations

import hashlib

import pytest

from graphcal.output import MANIFEST, TMP_MARKER
from tests.helpers import PAUSE_POINTS, paused_run, run_cli


def _digests(folder):
    """{name: sha256} of a folder's files, the manifest included (it records content, not times)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _run(model_dir, out, scheme):
    result = run_cli("run", str(model_dir / "model.onnx"), "--data", str(model_dir / "calib.npz"),
                     "--scheme", scheme, "-o", str(out), "-q")
    assert result.exit_code == 0, result.output


def test_outputs_are_byte_identical_across_runs(tmp_path, bert_dir):
    _run(bert_dir, tmp_path / "a", "W8A8_STATIC")
    _run(bert_dir, tmp_path / "b", "W8A8_STATIC")
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b")


def test_runs_to_different_folders_are_byte_identical_manifest_included(tmp_path, llama_dir):
    """`graphcal run` to -o A and to -o B (other names, other parent folders): the same bytes in
    every file, the manifest included (it records sizes and sha256s, nothing of time or of -o)."""
    a, b = tmp_path / "one" / "A", tmp_path / "two" / "deeper" / "B"
    for out in (a, b):
        result = run_cli("run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                         "-o", str(out), "-q")
        assert result.exit_code == 0, result.output
    assert sorted(p.name for p in a.iterdir()) == [MANIFEST, "model.onnx", "qparams.safetensors",
                                                   "quantization_config.json"]
    assert _digests(a) == _digests(b)
    assert {p.name: p.read_bytes() for p in a.iterdir()} == {p.name: p.read_bytes() for p in b.iterdir()}


def _tree(folder):
    """{name: sha256} of a folder's files: to show a folder set aside or left half-way is exactly what it was."""
    return _digests(folder)


@pytest.mark.slow
@pytest.mark.parametrize("point", PAUSE_POINTS)
def test_killed_runs_leave_the_previous_output_or_none(tmp_path, bert_dir, point):
    """SIGKILL at each named point of the write (tests.helpers.PAUSE_POINTS: before anything is
    written, with model.onnx alone in the temporary folder, with the temporary folder complete, and
    between the two renames of the swap): -o holds the previous output, whole, or (between the
    renames) nothing; what lies beside it is the previous output set aside and/or the new one in its
    temporary folder, each whole or marked as unfinished. The next run clears them and writes its own."""
    out = tmp_path / "out"
    _run(bert_dir, tmp_path / "new", "W8A8")
    _run(bert_dir, out, "W8A8_STATIC")
    old, new = _digests(out), _digests(tmp_path / "new")
    assert old != new  # the two outputs can be told apart: a precondition, not the check
    old_tree = _tree(out)
    cmd = ["run", bert_dir / "model.onnx", "--data", bert_dir / "calib.npz", "--scheme", "W8A8", "-o", out, "-q"]
    proc, _go = paused_run(cmd, point, tmp_path)
    proc.kill()  # SIGKILL: no clean-up of any kind runs
    proc.communicate(timeout=60)
    tmp = sorted(tmp_path.glob(".out.tmp-*"))
    aside = sorted(tmp_path.glob(".out.old-*"))
    if point == "moved_aside":
        assert not out.exists()  # none: the previous output is set aside whole, the new one complete beside it
        assert len(aside) == 1 and _tree(aside[0]) == old_tree
        assert len(tmp) == 1 and _digests(tmp[0]) == new and (tmp[0] / MANIFEST).is_file()
    else:
        assert _tree(out) == old_tree and aside == []  # the previous output, whole and untouched
        if point == "write":
            assert tmp == []
        elif point == "save_model":  # unfinished: marked as graphcal's temporary folder, no manifest yet
            assert len(tmp) == 1 and sorted(p.name for p in tmp[0].iterdir()) == [TMP_MARKER, "model.onnx"]
        else:  # swap: complete, the marker replaced by the manifest
            assert len(tmp) == 1 and _digests(tmp[0]) == new and (tmp[0] / MANIFEST).is_file()
            assert not (tmp[0] / TMP_MARKER).exists()
    _run(bert_dir, out, "W8A8")  # the next run removes what the killed one left and writes its own
    assert _digests(out) == new
    assert sorted(p.name for p in tmp_path.glob(".out.*")) == []  # no temporary folder, set-aside output or lock left


def test_models_past_the_protobuf_limit_go_through_external_data(llama_dir, tmp_path, monkeypatch):
    """The >2 GB path, forced with a tiny limit: onnxruntime gets a hollow graph plus one data
    file (the in-memory model is left whole), and the output keeps external data; numbers as usual."""
    import numpy as np

    import graphcal.graph.io
    from graphcal.calibration.pipeline import calibrate
    from graphcal.runtime import run_model

    normal = calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "normal", scheme="W8A8_STATIC",
                       device="cpu")
    monkeypatch.setattr(graphcal.graph.io, "PROTOBUF_LIMIT", 1)
    big = calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "big", scheme="W8A8_STATIC",
                    device="cpu")
    assert sorted(p.name for p in big.files) == ["model.onnx", "model.onnx.data", "qparams.safetensors",
                                                 "quantization_config.json"]
    assert (tmp_path / "big" / "qparams.safetensors").read_bytes() == (tmp_path / "normal" / "qparams.safetensors").read_bytes()
    feeds = {k: v[:2] for k, v in np.load(llama_dir / "heldout.npz").items()}
    np.testing.assert_array_equal(run_model(tmp_path / "big" / "model.onnx", feeds)["logits"],
                                  run_model(tmp_path / "normal" / "model.onnx", feeds)["logits"])
    assert normal.num_batches == big.num_batches == 8


def test_an_external_data_model_past_the_protobuf_limit_calibrates_as_usual(llama_dir, tmp_path, monkeypatch):
    """The >2 GB session path on a model whose weights live in external data: the tapped graph and
    every weight go to one temporary file pair, and the scales are the inline run's."""
    import onnx

    import graphcal.graph.io
    from graphcal.calibration.pipeline import calibrate

    src = tmp_path / "src"
    src.mkdir()
    onnx.save_model(onnx.load(llama_dir / "model.onnx"), src / "model.onnx", save_as_external_data=True,
                    all_tensors_to_one_file=True, location="weights.bin", size_threshold=1024)
    normal = calibrate(src / "model.onnx", llama_dir / "calib.npz", tmp_path / "normal", scheme="W8A8_STATIC",
                       device="cpu")
    monkeypatch.setattr(graphcal.graph.io, "PROTOBUF_LIMIT", 1)
    big = calibrate(src / "model.onnx", llama_dir / "calib.npz", tmp_path / "big", scheme="W8A8_STATIC", device="cpu")
    assert big.num_batches == normal.num_batches == 8
    assert (tmp_path / "big" / "qparams.safetensors").read_bytes() == \
        (tmp_path / "normal" / "qparams.safetensors").read_bytes()
