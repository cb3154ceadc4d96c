"""Companion files (tokenizer, genai_config.json, ...) are copied into -o only as they were checked.

The inside-the-folder check runs before the pass (find_companions); a file swapped afterwards for a
link out of the folder, or for another file, must not reach -o: copy_companions opens each file
once and refuses it unless it is still the file checked (device, inode, size), and the run's
output is then absent (the previous one kept).
"""

from __future__ import annotations

import os
import re
import shutil

import pytest

import graphcal.calibration.pipeline
from graphcal.errors import GraphcalError
from graphcal.output.companions import copy_companions, find_companions
from tests.helpers import run_cli

SECRET = b'{"secret": "outside the model folder"}'


def _folder(tmp_path, llama_dir):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(llama_dir / "model.onnx", src / "model.onnx")
    (src / "tokenizer.json").write_bytes(b'{"version": "1.0", "model": {}}    ')
    (src / "vocab.txt").write_bytes(b"a\nb\n")
    (tmp_path / "secret.json").write_bytes(SECRET)
    return src


def _swap_for_link_out(src, tmp_path):
    os.unlink(src / "tokenizer.json")
    os.symlink(tmp_path / "secret.json", src / "tokenizer.json")


def _swap_for_same_size(src, tmp_path):
    other = src / "other.json"
    other.write_bytes(bytes(len((src / "tokenizer.json").read_bytes())))  # same size, other inode
    os.replace(other, src / "tokenizer.json")


def _grow(src, tmp_path):
    with open(src / "tokenizer.json", "ab") as f:  # the same file, written to
        f.write(b" ")


@pytest.mark.parametrize("swap, fragment", [
    (_swap_for_link_out, "was replaced since the run began (now a link to"),
    (_swap_for_same_size, "was replaced since the run began (now another file)"),
    (_grow, "changed size since the run began"),
], ids=["link-out", "same-size-file", "grown"])
def test_a_companion_changed_after_the_check_is_not_copied(llama_dir, tmp_path, swap, fragment):
    src = _folder(tmp_path, llama_dir)
    found = find_companions(src / "model.onnx", "model.onnx")
    assert sorted(c.path.name for c in found.files) == ["tokenizer.json", "vocab.txt"]
    swap(src, tmp_path)
    into = tmp_path / "into"
    into.mkdir()
    with pytest.raises(GraphcalError, match=re.escape(fragment)):
        copy_companions(found, into)
    assert not (into / "tokenizer.json").exists()


def test_unchanged_companions_are_copied_byte_for_byte(llama_dir, tmp_path):
    src = _folder(tmp_path, llama_dir)
    (src / "vocab.txt").unlink()
    os.symlink("tokenizer.json", src / "vocab.txt")  # a link inside the folder is fine
    into = tmp_path / "into"
    into.mkdir()
    written = copy_companions(find_companions(src / "model.onnx", "model.onnx"), into)
    assert sorted(p.name for p in written) == ["tokenizer.json", "vocab.txt"]
    assert (into / "vocab.txt").read_bytes() == (into / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


def test_a_run_whose_tokenizer_is_swapped_mid_run_writes_nothing(llama_dir, tmp_path, monkeypatch):
    """The swap happens after the pass, just before the output is written (the pipeline's own call of
    copy_companions, wrapped): one error line, no -o, nothing from outside the folder anywhere in tmp_path."""
    src = _folder(tmp_path, llama_dir)
    real = graphcal.calibration.pipeline.copy_companions

    def swapped_then_copied(companions, into):
        _swap_for_link_out(src, tmp_path)
        return real(companions, into)

    monkeypatch.setattr(graphcal.calibration.pipeline, "copy_companions", swapped_then_copied)
    out = tmp_path / "out"
    result = run_cli("run", str(src / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                     "-o", str(out), "--scheme", "W8A16", "-q")
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 1 and len(errors) == 1, result.output
    assert f"{src / 'tokenizer.json'} was replaced since the run began" in errors[0]
    assert "Traceback" not in result.output
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret.json", "src"]  # no temporary folder, no lock
