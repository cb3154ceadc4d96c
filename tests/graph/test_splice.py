"""graph.splice: the low form with some layers as the high form computes them, at the top level.

Reference: onnxruntime (ORT_ENABLE_BASIC) running eval's switchable model (graph.switch, itself checked
against each form run whole in tests/evaluation/test_mixing.py) with the same layers switched to the
high form; and the high form run whole where every layer is taken."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from tests.helpers import run_cli


@pytest.fixture(scope="module")
def forms(llama_dir, tmp_path_factory):
    """tiny-llama as int4 weights (W4A16) and as static int8 (W8A8_STATIC: q, k and v read one input Q/DQ)."""
    root = tmp_path_factory.mktemp("splice")
    for scheme in ("W4A16", "W8A8_STATIC"):
        result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", root / scheme,
                         "--scheme", scheme, "-q")
        assert result.exit_code == 0, result.output
    return root / "W4A16" / "model.onnx", root / "W8A8_STATIC" / "model.onnx"


def _layers(ref, low):
    from graphcal.evaluation.sensitivity import quantized_layers
    from graphcal.graph.targets import find_targets

    return {t.name: t.node for t in quantized_layers(low, ref, find_targets(ref)[0])}


@pytest.mark.parametrize("taken", [["q_proj"], ["q_proj", "k_proj"], ["q_proj", "k_proj", "v_proj", "down_proj"]])
def test_the_spliced_model_computes_what_the_switches_measured(llama_dir, forms, taken):
    from graphcal.graph.io import load_model, value_types
    from graphcal.graph.splice import HIGH, splice
    from graphcal.graph.switch import switchable_model
    from graphcal.runtime import run_model

    ref = load_model(llama_dir / "model.onnx")
    low, high = load_model(forms[0]), load_model(forms[1])
    every = _layers(ref, low)
    chosen = {name: node for name, node in every.items() if name.startswith("model.layers.0.")
              and name.rsplit(".", 1)[1] in taken}
    assert len(chosen) == len(taken)
    spliced = splice(low, high, ref, chosen)
    onnx.checker.check_model(spliced)
    outputs = [o for n in spliced.graph.node for o in n.output]
    assert len(outputs) == len(set(outputs))  # the shared input Q/DQ once, however many layers read it
    assert any(n.name.startswith(HIGH) for n in spliced.graph.node)
    types = {k: v.elem_type for k, v in value_types(ref).items()}
    switched, switches = switchable_model(ref, [load_model(forms[0]), load_model(forms[1])], every, types)
    state = {s: np.array((names.index(s) == 1) == (layer in chosen)) for layer, names in switches.items()
             for s in names}
    feeds = {k: v[:4] for k, v in np.load(llama_dir / "heldout.npz").items()}
    want = run_model(switched, {**feeds, **state}, ["logits"])["logits"]
    got = run_model(spliced, feeds, ["logits"])["logits"]
    np.testing.assert_array_equal(got, want)
    from graphcal.graph.switch import fp32_computed, layer_reads

    nodes = [n for n in ref.graph.node if n.name in every.values()]
    reads = layer_reads(low, nodes, fp32_computed(ref))
    theirs = {r for layer, node in chosen.items() for r in reads[node]}
    others = {r for layer, node in every.items() if layer not in chosen for r in reads[node]}
    kept = {t.name for t in spliced.graph.initializer}
    assert theirs - others and not (theirs - others) & kept  # the taken layers' low weights are gone
    assert others <= kept  # the other layers' stay


def test_every_layer_taken_is_the_high_form(llama_dir, forms):
    from graphcal.graph.io import load_model
    from graphcal.graph.splice import splice
    from graphcal.runtime import run_model

    ref, low = load_model(llama_dir / "model.onnx"), load_model(forms[0])
    spliced = splice(low, load_model(forms[1]), ref, _layers(ref, low))
    feeds = {k: v[:4] for k, v in np.load(llama_dir / "heldout.npz").items()}
    np.testing.assert_allclose(run_model(spliced, feeds, ["logits"])["logits"],
                               run_model(forms[1], feeds, ["logits"])["logits"], rtol=1e-6, atol=1e-6)
