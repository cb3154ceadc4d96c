"""The model's files read once as checked: a model file or data file overwritten in place or
replaced by a rename after the load is refused in one line ("... changed while graphcal was reading
it"), with no output written (graph.identity).

The change is made where a real one would fall: between the load and the weight pass (the lazy
weights are read then), after every weight was read but before the output is kept (onnxruntime
read them by path meanwhile), and between a lazy load and a direct read of a weight."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphcal.calibration import pipeline
from graphcal.errors import GraphcalError
from graphcal.graph.external import is_external, read_tensor_bytes
from graphcal.graph.io import load_model_info
from tests.helpers import run_cli

K, N = 512, 1024  # a 2 MB fp32 weight: past the 1 MB threshold, so run reads it lazily (graph.wire)


def _model(seed: int) -> onnx.ModelProto:
    w = np.random.default_rng(seed).standard_normal((K, N)).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, K])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, N])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "proj.weight"], ["y"], name="/proj/MatMul")], "g",
                              [x], [y], [numpy_helper.from_array(w, "proj.weight")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _files(folder: Path, seed: int, external: bool) -> dict[str, bytes]:
    """The files of the model of ``seed`` (name -> bytes), inline or with its weight in model.onnx.data."""
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save_model(_model(seed), str(folder / "model.onnx"), save_as_external_data=external,
                    location="model.onnx.data", size_threshold=0)
    names = ["model.onnx", "model.onnx.data"] if external else ["model.onnx"]
    return {name: (folder / name).read_bytes() for name in names}


@pytest.fixture(params=["inline", "external"])
def model(request, tmp_path):
    """(model path, the file that will change, the bytes it changes to: same size, other weights)."""
    external = request.param == "external"
    folder = tmp_path / "model"
    other = _files(tmp_path / "other", seed=1, external=external)
    _files(folder, seed=0, external=external)
    np.savez(folder / "calib.npz", x=np.random.default_rng(2).standard_normal((2, 4, K)).astype(np.float32))
    changing = folder / ("model.onnx.data" if external else "model.onnx")
    new = other[changing.name]
    assert len(new) == changing.stat().st_size and new != changing.read_bytes()
    past = time.time_ns() - 10**10  # written 10 s ago: an overwrite now moves its time, whatever the clock's grain
    for name in other:
        os.utime(folder / name, ns=(past, past))
    return folder / "model.onnx", changing, new


def _overwrite(path: Path, data: bytes) -> None:
    """The same file (inode) given other bytes of the same length."""
    inode = path.stat().st_ino
    with open(path, "r+b") as f:
        f.write(data)
    assert path.stat().st_ino == inode and path.stat().st_size == len(data)


def _rename_over(path: Path, data: bytes) -> None:
    """Another file, same name: written beside, then renamed over (as editors and downloaders do)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


CHANGES = {"overwritten": _overwrite, "renamed": _rename_over}


def _run(model_path: Path, out: Path):
    result = run_cli("run", str(model_path), "--data", str(model_path.parent / "calib.npz"),
                     "-o", str(out), "-q")
    return result.exit_code, result.output


def _assert_refused(code: int, output: str, changing: Path) -> None:
    assert code != 0, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    assert f"{changing} changed while graphcal was reading it" in errors[0], output
    assert "Traceback" not in output and "unexpected" not in output, output


@pytest.mark.parametrize("change", CHANGES)
def test_a_model_changed_between_the_load_and_the_weight_pass_is_refused(model, tmp_path, monkeypatch, change):
    path, changing, new = model
    real = pipeline.rounding_for  # called after the load (and any activation pass), before the weight pass

    def changed_then_rounding(*args, **kwargs):
        CHANGES[change](changing, new)
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "rounding_for", changed_then_rounding)
    code, output = _run(path, tmp_path / "out")
    _assert_refused(code, output, changing)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change", CHANGES)
def test_a_model_changed_after_its_weights_were_read_leaves_no_output(model, tmp_path, monkeypatch, change):
    """Every weight read (the check at each open passed), the output being written: the files are checked again."""
    path, changing, new = model
    real = pipeline.copy_companions  # inside the output's writing, after model.onnx is written

    def changed_then_companions(*args, **kwargs):
        CHANGES[change](changing, new)
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "copy_companions", changed_then_companions)
    code, output = _run(path, tmp_path / "out")
    _assert_refused(code, output, changing)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no temporary folder left either


@pytest.mark.parametrize("change", CHANGES)
def test_a_lazy_weight_read_after_a_change_is_refused(model, change):
    path, changing, new = model
    loaded, _ = load_model_info(path, lazy=True)
    weight = next(t for t in loaded.graph.initializer if is_external(t))
    want = numpy_helper.to_array(_model(0).graph.initializer[0]).tobytes()
    assert read_tensor_bytes(weight, path.parent) == want  # unchanged: the model's own bytes
    CHANGES[change](changing, new)
    with pytest.raises(GraphcalError, match="changed while graphcal was reading it"):
        read_tensor_bytes(weight, path.parent)


def test_a_model_loaded_again_after_a_change_is_read_as_it_is_now(model):
    """A new load records the file afresh: the change is refused only for what the earlier load read."""
    path, changing, new = model
    load_model_info(path, lazy=True)
    _overwrite(changing, new)
    loaded, _ = load_model_info(path, lazy=True)
    weight = next(t for t in loaded.graph.initializer if is_external(t))
    want = numpy_helper.to_array(_model(1).graph.initializer[0]).tobytes()
    assert read_tensor_bytes(weight, path.parent) == want


def test_an_unchanged_model_still_calibrates(model, tmp_path):
    path, _, _ = model
    code, output = _run(path, tmp_path / "out")
    assert code == 0, output
    assert (tmp_path / "out" / "model.onnx").is_file()


@pytest.mark.parametrize("change", CHANGES)
def test_a_model_changed_while_eval_runs_it_gives_no_report(model, monkeypatch, change):
    """onnxruntime read the weights by path; the files are checked again before the numbers are reported."""
    from graphcal.evaluation import pipeline as compare  # where eval times its later runs

    path, changing, new = model
    real = compare._check_time  # after the first batches ran

    def changed_then_check(*args, **kwargs):
        CHANGES[change](changing, new)
        return real(*args, **kwargs)

    monkeypatch.setattr(compare, "_check_time", changed_then_check)
    result = run_cli("eval", str(path), str(path), "--data", str(path.parent / "calib.npz"))
    _assert_refused(result.exit_code, result.output, changing)
