"""A model reached through a Hugging Face cache snapshot: every file of
``models--ORG--NAME/snapshots/REV/`` is a symbolic link to ``../../blobs/HASH``. run, inspect and
eval read it (external data and an inline model's large weights alike, and the tokenizer beside it);
a link leading anywhere else, in the cache or out of it, is still refused (graphcal.limits.confinement).

Reference: onnxruntime (ORT_ENABLE_BASIC) running the same model from a plain folder of copies."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.security.test_hostile_models import SECRET, _run, assert_refused

K, N = 512, 1024  # a 2 MB fp32 weight: past the 1 MB threshold, so it stays on disk (lazy)
REV = "0123456789abcdef0123456789abcdef01234567"


def _model() -> onnx.ModelProto:
    w = np.random.default_rng(0).standard_normal((K, N)).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, K])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, N])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "proj.weight"], ["y"], name="/proj/MatMul")], "g",
                              [x], [y], [numpy_helper.from_array(w, "proj.weight")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _cache(tmp_path: Path, external: bool) -> tuple[Path, Path, Path]:
    """(the snapshot's model.onnx, the repository folder, a plain folder holding copies of the same files)."""
    plain = tmp_path / "plain"
    plain.mkdir()
    onnx.save_model(_model(), str(plain / "model.onnx"), save_as_external_data=external, location="model.onnx.data",
                    size_threshold=0)
    (plain / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / REV
    for folder in (repo / "blobs", repo / "refs", snapshot):
        folder.mkdir(parents=True)
    (repo / "refs" / "main").write_text(REV)
    for file in plain.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)  # as huggingface_hub links
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(1).standard_normal((4, 4, K)).astype(np.float32))
    return snapshot / "model.onnx", repo, plain


def _basic(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("external", [True, False], ids=["external-data", "inline"])
def test_a_model_in_a_hugging_face_snapshot_is_read(tmp_path, external):
    model, _, plain = _cache(tmp_path, external)
    data, out = tmp_path / "calib.npz", tmp_path / "out"
    code, output = _run("inspect", model)
    assert code == 0 and "proj" in output, output
    code, output = _run("eval", model, model, "--data", data)
    assert code == 0, output
    code, output = _run("run", model, "--data", data, "-o", out, "-q")
    assert code == 0, output
    assert (out / "tokenizer.json").read_bytes() == (plain / "tokenizer.json").read_bytes()  # the companion too
    x = np.load(data)["x"]
    want = _basic(plain / "model.onnx").run(None, {"x": x})[0]  # fp32, from plain copies
    got = _basic(out / "model.onnx").run(None, {"x": x})[0]
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()  # W8A8 of the same weights


@pytest.mark.parametrize("target", ["secret", "refs"])
def test_a_snapshot_link_out_of_the_blobs_is_refused(tmp_path, target):
    """Out of the repository (a file of the user's), or into it but not to a blob: refused as before."""
    model, repo, _ = _cache(tmp_path, external=True)
    link = model.with_name("model.onnx.data")
    size = link.stat().st_size
    if target == "secret":
        (tmp_path / "secret.bin").write_bytes((SECRET * (size // len(SECRET) + 1))[:size])
        goal = Path("..") / ".." / ".." / ".." / "secret.bin"  # tmp_path/secret.bin
    else:
        (repo / "refs" / "weights").write_bytes(link.read_bytes())
        goal = Path("..") / ".." / "refs" / "weights"
    link.unlink()
    link.symlink_to(goal)
    assert link.stat().st_size == size  # the link works: only where it leads is wrong
    out = tmp_path / "out"
    for code, output in (_run("inspect", model), _run("eval", model, model, "--data", tmp_path / "calib.npz"),
                         _run("run", model, "--data", tmp_path / "calib.npz", "-o", out, "-q")):
        assert_refused(code, output, "leads outside the model's folder")
    assert not out.exists()


def test_a_folder_that_only_looks_like_a_snapshot_gets_no_blobs(tmp_path):
    """A snapshots/REV folder whose repository has no blobs folder: only the folder itself is inside."""
    model, repo, _ = _cache(tmp_path, external=True)
    os.rename(repo / "blobs", tmp_path / "elsewhere")
    (tmp_path / "hub" / "blobs").symlink_to(tmp_path / "elsewhere")
    for name in ("model.onnx", "model.onnx.data"):
        link = model.with_name(name)
        blob = Path(os.readlink(link)).name
        link.unlink()
        link.symlink_to(Path("..") / ".." / ".." / "blobs" / blob)  # hub/blobs, a link: not the repository's own
    code, output = _run("inspect", model)
    assert_refused(code, output, "leads outside the model's folder")


def test_a_model_file_linked_from_another_folder_is_read_whole(tmp_path):
    """A model file that is a link out of its folder (not a snapshot): the user named it, so it is read,
    but whole: its weights are not referenced in place (that reference would lead out of the folder)."""
    _, _, plain = _cache(tmp_path, external=False)
    work = tmp_path / "work"
    work.mkdir()
    (work / "model.onnx").symlink_to(plain / "model.onnx")
    code, output = _run("run", work / "model.onnx", "--data", tmp_path / "calib.npz", "-o", tmp_path / "out", "-q")
    assert code == 0, output
