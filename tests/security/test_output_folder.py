"""The output folder (-o) is safe against users' files, kills and concurrent runs.

graphcal deletes only what it wrote (recognised by its manifest, never by name), refuses links,
mount points and folders holding an input, cleans what killed runs left beside -o, locks -o for
one run at a time, turns SIGTERM into Ctrl-C's clean-up, and keeps the modes of what it replaces.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from graphcal.output import MANIFEST, TMP_MARKER, reserve_output
from tests.helpers import paused_run, run_cli

OURS = [MANIFEST, "model.onnx", "qparams.safetensors", "quantization_config.json"]


def run(model_dir, out, *extra, model=None, data=None):
    return run_cli("run", str(model or model_dir / "model.onnx"), "--data",
                   str(data or model_dir / "calib.npz"), "-o", str(out), "-q", *extra)


def one_error(result, fragment):
    """A user error: non-zero exit, exactly one `error:` line holding ``fragment``, no traceback."""
    text = result.output
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert result.exit_code == 1, text
    assert len(errors) == 1 and fragment in errors[0], text
    assert "Traceback" not in text and "unexpected" not in text, text
    return errors[0]


def snapshot(folder):
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir()) if p.is_file()}


def contents(folder):
    """Each file's bytes, the manifest included (it records content only: the same for the same run)."""
    return contents_of(snapshot(folder))


def contents_of(snap):
    return {name: data for name, (data, _mtime) in snap.items()}


def beside(out):
    """What graphcal may leave beside -o: its temporary folders and lock."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def argv(model_dir, out, *extra):
    return ["run", str(model_dir / "model.onnx"), "--data", str(model_dir / "calib.npz"), "-o", str(out), "-q", *extra]


def slow_writer(tmp_path, model_dir, out):
    """Start a run in a subprocess; return it once it is writing (temp folder made with model.onnx,
    lock held), waiting there until the returned file exists (tests.helpers.paused_run)."""
    return paused_run(argv(model_dir, out), "save_model", tmp_path)


# --- deleting only what graphcal wrote ---------------------------------------------------------


def test_a_user_file_in_a_folder_named_like_ours_survives(tmp_path, bert_dir):
    out = tmp_path / "out"
    assert run(bert_dir, out).exit_code == 0
    (out / "model.onnx.data").mkdir()  # a folder named like graphcal's external data file
    (out / "model.onnx.data" / "thesis.tex").write_text("mine")
    one_error(run(bert_dir, out), "model.onnx.data/ (a folder)")
    assert (out / "model.onnx.data" / "thesis.tex").read_text() == "mine"


def test_own_output_is_replaced_but_not_once_touched(tmp_path, bert_dir):
    out = tmp_path / "out"
    assert run(bert_dir, out).exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == OURS
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["graphcal"] == 2 and sorted(manifest["files"]) == OURS[1:]
    for name, record in manifest["files"].items():  # content only: size and sha256, no time
        data = (out / name).read_bytes()
        assert record == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}, name
    assert run(bert_dir, out, "--scheme", "W8A16").exit_code == 0  # graphcal's own output: replaced
    assert beside(out) == []  # no temporary folder, no lock file left

    def refused(fragment):
        before = snapshot(out)
        one_error(run(bert_dir, out), fragment)
        assert snapshot(out) == before

    config = out / "quantization_config.json"
    original = config.read_bytes()
    written = config.stat()
    config.write_bytes(original + b" ")  # edited: size and content differ
    refused("quantization_config.json (changed since graphcal wrote it)")
    config.write_bytes(bytes([original[0] ^ 1]) + original[1:])  # same size, other bytes
    refused("quantization_config.json (changed since graphcal wrote it)")
    os.utime(config, ns=(written.st_atime_ns, written.st_mtime_ns))  # same size and mtime, other bytes
    refused("quantization_config.json (changed since graphcal wrote it)")
    config.write_bytes(original)  # the bytes graphcal wrote, with a new mtime: unchanged, so replaced
    os.utime(config, ns=(written.st_atime_ns, written.st_mtime_ns + 1_000_000_000))
    assert run(bert_dir, out).exit_code == 0

    assert run(bert_dir, tmp_path / "out2").exit_code == 0
    (tmp_path / "out2" / "notes.txt").write_text("mine")  # an extra file
    out = tmp_path / "out2"
    refused("holds files graphcal did not write (notes.txt)")
    (out / "notes.txt").unlink()
    (out / MANIFEST).unlink()  # a user's folder of the same names
    refused("no graphcal manifest")


def test_a_manifest_nested_past_any_real_one_is_no_manifest(tmp_path, bert_dir):
    """A stranger's manifest nesting 200,000 levels (json would recurse past Python's limit) is read
    within a depth bound: no manifest, so the folder is refused with the usual line, untouched."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.onnx").write_bytes(b"mine")
    (out / MANIFEST).write_text('{"graphcal": 2, "files": ' + "[" * 200_000 + "]" * 200_000 + "}")
    before = snapshot(out)
    one_error(run(bert_dir, out), "holds files graphcal did not write (.graphcal-manifest.json, model.onnx); "
                                  "it has no graphcal manifest")
    assert snapshot(out) == before and beside(out) == []


def _as_format_1(folder):
    """Rewrite ``folder``'s manifest as graphcal wrote it before format 2: each file's size and mtime."""
    files = {p.name: {"mtime_ns": p.stat().st_mtime_ns, "size": p.stat().st_size}
             for p in sorted(folder.iterdir()) if p.name != MANIFEST}
    about = "graphcal wrote this folder; a later run replaces it only while these files are unchanged and nothing else is in it"
    (folder / MANIFEST).write_text(json.dumps({"graphcal": 1, "files": files, "about": about}, indent=1, sort_keys=True)
                                   + "\n", encoding="utf-8")


def test_an_older_graphcals_output_is_still_recognised_by_size_and_mtime(tmp_path, bert_dir):
    """A format-1 manifest (size and mtime) vouches for its files as it did when it was written: an
    upgraded graphcal replaces an untouched older output, and refuses one whose files were touched."""
    out = tmp_path / "out"
    assert run(bert_dir, out).exit_code == 0
    fresh = contents(out)
    _as_format_1(out)
    assert run(bert_dir, out).exit_code == 0  # replaced by a format-2 output
    assert contents(out) == fresh and json.loads((out / MANIFEST).read_text())["graphcal"] == 2

    _as_format_1(out)
    config = out / "quantization_config.json"
    st = config.stat()
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touched, bytes unchanged
    before = snapshot(out)
    one_error(run(bert_dir, out), "quantization_config.json (changed since graphcal wrote it)")
    assert snapshot(out) == before

    for unknown in (3, True, "2"):  # a format this graphcal cannot read: no manifest
        manifest = json.loads((out / MANIFEST).read_text())
        (out / MANIFEST).write_text(json.dumps({**manifest, "graphcal": unknown}))
        one_error(run(bert_dir, out), "no graphcal manifest")


def test_a_link_as_output_is_refused(tmp_path, bert_dir):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model.onnx").write_bytes(b"my own model")
    link = tmp_path / "out"
    link.symlink_to(mine)
    one_error(run(bert_dir, link), f"-o {link} is a symbolic link to {mine}; give the real folder")
    assert (mine / "model.onnx").read_bytes() == b"my own model" and link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "out"]


def test_inputs_inside_the_output_are_refused(tmp_path, bert_dir):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.onnx").symlink_to(bert_dir / "model.onnx")  # the input, as a link inside -o
    one_error(run(bert_dir, out, model=out / "model.onnx"), "would overwrite the input")
    assert (out / "model.onnx").is_symlink() and (out / "model.onnx").exists()

    own = tmp_path / "own"
    assert run(bert_dir, own).exit_code == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "q.onnx").symlink_to(own / "model.onnx")  # given through a link outside -o
    before = snapshot(own)
    one_error(run(bert_dir, own, model=elsewhere / "q.onnx"), "would overwrite the input")
    assert snapshot(own) == before


# --- leftovers of killed runs ------------------------------------------------------------------


def test_leftovers_of_killed_runs_are_removed_by_the_next_run(tmp_path, bert_dir):
    out = tmp_path / "out"
    assert run(bert_dir, out).exit_code == 0
    stale = tmp_path / ".out.tmp-4242-deadbeef"  # a killed run's temporary folder
    stale.mkdir()
    (stale / TMP_MARKER).write_text("graphcal 4242\n")
    (stale / "model.onnx").write_bytes(b"\0" * 1_000_000)
    aside = tmp_path / ".out.old-4242-0123abcd"  # a previous output set aside, killed before removal
    shutil.copytree(out, aside, copy_function=shutil.copy)  # new mtimes: the manifest vouches by content
    strange = tmp_path / ".out.tmp-7-abcdef12"  # named like ours but unmarked: not ours to delete
    strange.mkdir()
    (strange / "mine.txt").write_text("mine")
    (tmp_path / ".out.graphcal-lock").write_text("graphcal 4242\n")  # a killed run's lock file

    result = run(bert_dir, out)
    assert result.exit_code == 0, result.output
    assert not stale.exists() and not aside.exists()
    assert (strange / "mine.txt").read_text() == "mine"
    assert f"warning: left alone {strange}" in result.output
    assert beside(out) == [".out.tmp-7-abcdef12"]


@pytest.mark.slow
def test_sigkill_while_writing_leaves_a_temp_folder_the_next_run_removes(tmp_path, bert_dir):
    out = tmp_path / "out"
    assert run(bert_dir, out, "--scheme", "W8A16").exit_code == 0
    before = snapshot(out)
    proc, _go = slow_writer(tmp_path, bert_dir, out)
    proc.kill()
    proc.communicate()
    left = [p for p in tmp_path.glob(".out.tmp-*")]
    assert len(left) == 1 and (left[0] / TMP_MARKER).is_file() and (left[0] / "model.onnx").is_file()
    assert snapshot(out) == before  # the previous output, whole
    result = run(bert_dir, out)
    assert result.exit_code == 0, result.output
    assert beside(out) == []
    assert run(bert_dir, tmp_path / "fresh").exit_code == 0  # the same run into an empty folder
    assert contents(out) == contents(tmp_path / "fresh") != contents_of(before)  # the new run's files, whole


def test_sigterm_while_writing_cleans_up_like_ctrl_c(tmp_path, bert_dir):
    out = tmp_path / "out"
    assert run(bert_dir, out).exit_code == 0
    before = snapshot(out)
    proc, _go = slow_writer(tmp_path, bert_dir, out)
    assert len(list(tmp_path.glob(".out.tmp-*"))) == 1
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "interrupted; no output was written" in err.splitlines() and "Traceback" not in err
    assert beside(out) == [] and snapshot(out) == before


def test_sigterm_while_calibrating(tmp_path, llama_dir):
    import numpy as np

    out = tmp_path / "out"
    out.mkdir()
    big = tmp_path / "big.npz"  # enough batches that the MSE pass is still running when the signal comes
    np.savez(big, **{k: np.tile(v, (64, 1)) for k, v in np.load(llama_dir / "calib.npz").items()})
    proc = subprocess.Popen([sys.executable, "-m", "graphcal", *argv(llama_dir, out, "--scheme", "W8A8_STATIC",
                                                                     "--observer", "mse", "--data", str(big))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / ".out.graphcal-lock").exists():  # reserved: the calibration has begun
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "interrupted; no output was written" in err and "Traceback" not in err
    assert beside(out) == [] and list(out.iterdir()) == []


# --- one run at a time -------------------------------------------------------------------------


def test_a_held_lock_refuses_a_second_run_at_once(tmp_path, bert_dir, monkeypatch):
    import graphcal.calibration.prepare

    out = tmp_path / "out"
    with reserve_output(out):
        monkeypatch.setattr(graphcal.calibration.prepare, "plan", _never)  # refused before any work
        one_error(run(bert_dir, out), f"another graphcal run is writing to -o {out} (pid {os.getpid()})")
        monkeypatch.undo()
    assert beside(out) == []
    assert run(bert_dir, out).exit_code == 0  # released: the next run goes ahead


def test_two_concurrent_runs_end_with_one_lock_error(tmp_path, bert_dir):
    out = tmp_path / "out"
    proc, go = slow_writer(tmp_path, bert_dir, out)
    try:
        one_error(run(bert_dir, out), "another graphcal run is writing to -o")
    finally:
        go.touch()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert sorted(p.name for p in out.iterdir()) == OURS and beside(out) == []


# --- modes, mount points, the final swap -------------------------------------------------------


def test_modes_of_a_replaced_output_are_kept(tmp_path, bert_dir):
    out = tmp_path / "out"
    assert run(bert_dir, out).exit_code == 0
    out.chmod(0o750)
    (out / "model.onnx").chmod(0o640)
    (out / "qparams.safetensors").chmod(0o604)
    assert run(bert_dir, out).exit_code == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    assert stat.S_IMODE((out / "model.onnx").stat().st_mode) == 0o640
    assert stat.S_IMODE((out / "qparams.safetensors").stat().st_mode) == 0o604


def test_a_new_output_follows_the_umask(tmp_path, bert_dir):
    previous = os.umask(0o027)
    try:
        assert run(bert_dir, tmp_path / "out").exit_code == 0
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o750
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").iterdir()} == dict.fromkeys(OURS, 0o640)


def test_a_mount_point_is_refused_before_calibrating(tmp_path, bert_dir, monkeypatch):
    import graphcal.calibration.prepare

    out = tmp_path / "mnt"
    out.mkdir()
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == out or real(p))
    monkeypatch.setattr(graphcal.calibration.prepare, "plan", _never)
    one_error(run(bert_dir, out), f"-o {out} is a mount point; graphcal replaces the folder whole: "
                                  "give a folder inside it")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mnt"]


def test_a_failed_swap_keeps_the_previous_output(tmp_path, bert_dir, monkeypatch):
    import errno

    out = tmp_path / "out"
    assert run(bert_dir, out).exit_code == 0
    before = snapshot(out)
    real = os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".out.tmp-"):  # moving the new folder in fails, halfway through the swap
            raise OSError(errno.EBUSY, "Device or resource busy")
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    one_error(run(bert_dir, out, "--scheme", "W8A16"),
              f"could not move the outputs into {out}: Device or resource busy; the previous output is unchanged")
    assert snapshot(out) == before and beside(out) == []


# --- graphcal export ---------------------------------------------------------------------------


def test_export_follows_the_same_rules(tmp_path):
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")  # refused before the model is read
    out = tmp_path / "exported"
    out.mkdir()
    (out / "model.onnx").write_bytes(b"my own model")
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    result = run_cli("export", str(model_dir), "-o", str(out))
    one_error(result, f"output folder {out} holds files graphcal did not write (model.onnx, notes.txt)")
    assert snapshot(out) == before
    link = tmp_path / "link"
    link.symlink_to(out)
    one_error(run_cli("export", str(model_dir), "-o", str(link)), "is a symbolic link to")
    one_error(run_cli("export", str(model_dir), "-o", str(tmp_path)), "would overwrite the input")


def _never(*_args, **_kwargs):
    raise AssertionError("the run went past the output checks")
