"""--skip-nonfinite-weights with SmoothQuant and AWQ: a weight holding NaN is left in float, unscaled, and
every mapping that would fold a scale into it or balance it (or whose activations its NaN reaches) is left
out with one line saying which and why; the rest of the run goes on. On the shipped tiny llama with a NaN
written into layer 1's v_proj (a copy in tmp_path), checked against the fp32 model in onnxruntime."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from graphcal.graph.targets import find_targets
from graphcal.runtime import run_model
from tests.helpers import run_cli, sqnr_db

V_PROJ = "model.layers.1.self_attn.v_proj"
LAYER0_OUT = "/model/layers.0/mlp/down_proj/MatMul_output_0"  # before the NaN: finite in fp32


@pytest.fixture(scope="module")
def nan_llama(tmp_path_factory, llama_dir):
    folder = tmp_path_factory.mktemp("nan_llama")
    model = onnx.load(llama_dir / "model.onnx")
    target = {t.name: t for t in find_targets(model)[0]}[V_PROJ]
    init = next(i for i in model.graph.initializer if i.name == target.weight)
    weight = numpy_helper.to_array(init).copy()
    weight[3, 5] = np.nan
    init.CopyFrom(numpy_helper.from_array(weight, init.name))
    onnx.save(model, folder / "model.onnx")
    shutil.copy(llama_dir / "calib.npz", folder / "calib.npz")
    return folder, weight


@pytest.mark.parametrize("algorithm, key, min_db", [  # min_db: the layer's SQNR against fp32 for its scheme
    (["--smoothquant"], "graphcal.smoothquant", 25),  # W8A8
    (["--algorithm", "awq", "--scheme", "W4A16"], "graphcal.awq", 10),  # int4 on a 128-wide layer: ~12.7 dB
])
def test_a_nan_weight_leaves_its_mappings_out_and_the_run_goes_on(nan_llama, llama_dir, tmp_path, caplog, algorithm, key,
                                                                  min_db):
    folder, weight = nan_llama
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="graphcal"):
        result = run_cli("run", str(folder / "model.onnx"), "--data", str(folder / "calib.npz"),
                         "-o", str(out), *algorithm, "--skip-nonfinite-weights", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{"):])
    assert V_PROJ in summary["ignored"]

    # the q/k/v mapping of layer 1 is reported left out, in one line naming v_proj
    dropped = [r.getMessage() for r in caplog.records if V_PROJ in r.getMessage()
               and ("left out" in r.getMessage() or "skipped" in r.getMessage())]
    assert len(dropped) == 1 and "\n" not in dropped[0], dropped
    assert "model.layers.1.self_attn.q_proj" in dropped[0] and ("NaN" in dropped[0] or "non-finite" in dropped[0])

    # the other mappings (layer 0's) are applied, none of layer 1's
    written = onnx.load(out / "model.onnx")
    record = json.loads(next(p.value for p in written.metadata_props if p.key == key))
    balanced = [b for m in record["mappings"] for b in m["balance"]]
    assert "model.layers.0.self_attn.v_proj" in balanced and "model.layers.0.mlp.up_proj" in balanced
    assert not any(b.startswith("model.layers.1.") for b in balanced), balanced

    # v_proj stays float, its weight as it was (NaN included, no scale folded in)
    node = next(n for n in written.graph.node if n.name == "/model/layers.1/self_attn/v_proj/MatMul")
    init = next(i for i in written.graph.initializer if i.name == node.input[1])
    assert init.data_type == onnx.TensorProto.FLOAT
    np.testing.assert_array_equal(numpy_helper.to_array(init), weight)

    # the output runs in onnxruntime; what the NaN does not reach is finite and close to fp32
    feeds = {k: v[:4] for k, v in np.load(llama_dir / "heldout.npz").items()}
    got, want = (run_model(_with_output(path, LAYER0_OUT), feeds, [LAYER0_OUT, "logits"])
                 for path in (out / "model.onnx", folder / "model.onnx"))
    assert np.isfinite(want[LAYER0_OUT]).all() and np.isfinite(got[LAYER0_OUT]).all()
    assert sqnr_db(want[LAYER0_OUT], got[LAYER0_OUT]) > min_db
    assert got["logits"].shape == want["logits"].shape  # (NaN in fp32 too: v_proj's NaN reaches every logit)


def _with_output(path, tensor: str) -> onnx.ModelProto:
    """The model at ``path`` with ``tensor`` (an activation inside it) among its outputs."""
    model = onnx.load(path)
    model.graph.output.append(onnx.helper.make_tensor_value_info(tensor, onnx.TensorProto.FLOAT, None))
    return model
