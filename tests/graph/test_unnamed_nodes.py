"""Models whose nodes carry no names quantize: each MatMul gets a distinct name and the written model runs.
Through the CLI, on models built with onnx.helper; the reference is the fp32 model in onnxruntime."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from tests.graph.toy_models import FF, H, outputs_on_calib, save_with_calib
from tests.helpers import run_cli, sqnr_db

# -- 4. nodes without names -------------------------------------------------------------------------


def _unnamed(folder: Path, kind: str) -> Path:
    rng = np.random.default_rng(2)

    def w(name, shape):
        return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name)

    if kind == "relu":  # two unnamed MatMuls around an unnamed Relu
        nodes = [helper.make_node("MatMul", ["x", "w0"], ["a"], name=""), helper.make_node("Relu", ["a"], ["r"]),
                 helper.make_node("MatMul", ["r", "w1"], ["y"], name="")]
        return save_with_calib(nodes, [w("w0", (H, FF)), w("w1", (FF, H))], folder)
    # four unnamed MatMuls (two reading one input), and a named node taking the name an unnamed one would get
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["a"]), helper.make_node("Relu", ["a"], ["r"], name="matmul_3"),
             helper.make_node("MatMul", ["r", "w1"], ["b"]), helper.make_node("MatMul", ["r", "w2"], ["c"]),
             helper.make_node("Add", ["b", "c"], ["s"]), helper.make_node("MatMul", ["s", "w3"], ["y"])]
    return save_with_calib(nodes, [w("w0", (H, FF)), w("w1", (FF, H)), w("w2", (FF, H)), w("w3", (H, H))], folder)


@pytest.mark.parametrize("kind", ["relu", "four"])
@pytest.mark.parametrize("scheme", ["W8A8", "W4A16"])
def test_models_with_unnamed_nodes_quantize(tmp_path, kind, scheme):
    model = _unnamed(tmp_path / "m", kind)
    before = model.read_bytes()
    flags = [] if scheme == "W8A8" else ["--scheme", scheme]  # W8A8: the default
    inspected = run_cli("inspect", model, *flags, "--json")
    assert inspected.exit_code == 0, inspected.output
    names = json.loads(inspected.stdout)["quantized"]
    assert len(names) == (2 if kind == "relu" else 4) and len(set(names)) == len(names), names
    result = run_cli("run", model, "--data", model.parent / "calib.npz", *flags, "--device", "cpu", "-o", tmp_path / "out", "-q")
    assert result.exit_code == 0, result.output
    assert model.read_bytes() == before  # the input is never modified
    written = tmp_path / "out" / "model.onnx"
    onnx.checker.check_model(str(written), full_check=True)
    assert sqnr_db(outputs_on_calib(model, model.parent), outputs_on_calib(written, model.parent)) > (25 if scheme == "W8A8" else 12)
