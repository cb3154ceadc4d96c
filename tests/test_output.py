"""Outputs appear whole or not at all; foreign folders and the input are never overwritten."""

from __future__ import annotations

import pytest

from graphcal.errors import GraphcalError
from graphcal.output import check_output_dir, write_atomically


def test_failed_write_keeps_the_previous_output(tmp_path):
    out = tmp_path / "out"
    write_atomically(out, lambda d: [_file(d / "model.onnx", b"old")])

    def half_then_fail(d):
        _file(d / "model.onnx", b"new")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        write_atomically(out, half_then_fail)
    assert (out / "model.onnx").read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left behind


def test_disk_errors_become_one_line(tmp_path):
    def full(d):
        raise OSError(28, "No space left on device")

    with pytest.raises(GraphcalError, match="No space left on device"):
        write_atomically(tmp_path / "out", full)
    assert not (tmp_path / "out").exists()


def test_output_folder_checks(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(GraphcalError, match="is a file"):
        check_output_dir(tmp_path / "afile", [])
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(GraphcalError, match="holds files graphcal did not write"):
        check_output_dir(tmp_path, [])
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    _file(model_dir / "model.onnx", b"x")
    with pytest.raises(GraphcalError, match="would overwrite the input"):
        check_output_dir(model_dir, [model_dir / "model.onnx"])


def _file(path, data):
    path.write_bytes(data)
    return path
