"""Outputs appear whole or not at all; foreign folders and the input are never overwritten."""

from __future__ import annotations

import hashlib
import json
import os
import time

import pytest

import graphcal.output.manifest
from graphcal.errors import GraphcalError
from graphcal.output import MANIFEST, check_output_dir, write_atomically


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


def _two_files(d):
    return [_file(d / "model.onnx", b"weights"), _file(d / "config.json", b"{}")]


def test_the_manifest_records_content_not_time_or_place(tmp_path):
    """Size and sha256 of each file, sorted: the same bytes for the same files, whatever -o is called."""
    write_atomically(tmp_path / "a", _two_files)
    time.sleep(0.01)  # other mtimes
    write_atomically(tmp_path / "elsewhere" / "b", _two_files)
    text = (tmp_path / "a" / MANIFEST).read_bytes()
    assert text == (tmp_path / "elsewhere" / "b" / MANIFEST).read_bytes()
    manifest = json.loads(text)
    assert manifest["graphcal"] == 2
    assert manifest["files"] == {n: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)}
                                 for n, d in (("config.json", b"{}"), ("model.onnx", b"weights"))}
    assert b"mtime" not in text and str(tmp_path).encode() not in text


def test_a_digest_kept_from_an_earlier_check_does_not_hide_an_edit(tmp_path, monkeypatch):
    """Digests are kept per (inode, size, mtime, ctime); an edit that keeps the size and puts the
    mtime back still changes the ctime, so the file is hashed again and refused."""
    out = tmp_path / "out"
    write_atomically(out, _two_files)
    time.sleep(0.05)  # the edit below lands on another tick of the file system's clock than the write
    monkeypatch.setattr(graphcal.output.manifest, "SETTLED_NS", 0)  # keep every digest
    check_output_dir(out)  # hashed, and the digests kept
    model = out / "model.onnx"
    st = model.stat()
    model.write_bytes(b"WEIGHTS")
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(GraphcalError, match=r"model.onnx \(changed since graphcal wrote it\)"):
        check_output_dir(out)
    model.write_bytes(b"weights")  # the bytes graphcal wrote: vouched for again
    check_output_dir(out)


def _file(path, data):
    path.write_bytes(data)
    return path
