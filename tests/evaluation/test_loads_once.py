"""eval loads once: the reference, the quantized model and the fallback are each read (and the reference
rotated as a --rotate model was) once per command, and one switchable model serves --sensitivity and the mix.

Counted with counters wrapped around the package's own steps: a model file's parse (graph.io's
check_graph, run once per load), a rotation fold (algorithms.rotation.fold.rotate, which rotate_like
runs), and a switchable model's build (graph.switch's hollow_copy, once per switchable_model).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import run_cli


@pytest.fixture(scope="module")
def forms(llama_dir, tmp_path_factory):
    """tiny-llama as int4 and int8 (weights only, lm_head too), plainly and rotated (--rotate R1)."""
    root = tmp_path_factory.mktemp("loads")
    for name, extra in (("plain", []), ("rotated", ["--rotate", "R1"])):
        for scheme in ("W4A16", "W8A16"):
            result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--scheme", scheme,
                          "--lm-head", *extra, "-o", root / name / scheme, "-q")
            assert result.exit_code == 0, result.output
    return root


@pytest.fixture
def counted(monkeypatch):
    """Counters of model parses (by file), rotations and switchable-model builds while eval runs."""
    import graphcal.algorithms.rotation.fold as fold
    import graphcal.graph.io as graph_io
    import graphcal.graph.switch as switch

    counts = {"parsed": Counter(), "rotations": 0, "switch_models": 0}
    check_graph, rotate, hollow_copy = graph_io.check_graph, fold.rotate, switch.hollow_copy

    def parsed(model, path, *a, **k):
        counts["parsed"][Path(path).resolve()] += 1
        return check_graph(model, path, *a, **k)

    def rotated(*a, **k):
        counts["rotations"] += 1
        return rotate(*a, **k)

    def built(*a, **k):
        counts["switch_models"] += 1
        return hollow_copy(*a, **k)

    monkeypatch.setattr(graph_io, "LAZY_MIN_BYTES", 1)  # tiny-llama's weights are all under 1 MB: keep them on disk
    monkeypatch.setattr(graph_io, "check_graph", parsed)
    monkeypatch.setattr(fold, "rotate", rotated)
    monkeypatch.setattr(switch, "hollow_copy", built)
    return counts


@pytest.mark.parametrize("name", ["plain", "rotated"])
def test_eval_sensitivity_and_mix_load_each_model_once(llama_dir, forms, counted, name):
    """`eval REF LOW --sensitivity --fallback HIGH --size-budget MB`: each of the three files parsed once,
    the reference rotated once where the quantized models were rotated (never otherwise), one switchable
    model for both the sensitivity passes and the mix; and both measured."""
    low, high = forms / name / "W4A16" / "model.onnx", forms / name / "W8A16" / "model.onnx"
    low_bytes = sum(f.stat().st_size for f in low.parent.glob("model.onnx*"))
    result = run_cli("eval", llama_dir / "model.onnx", low, "--data", llama_dir / "heldout.npz", "--num-samples", 2,
                  "--json", "--sensitivity", "--fallback", high, "--size-budget", (low_bytes + 60_000) / 1e6)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["sensitivity"]["alone"] and report["mix"]["units"]
    assert counted["parsed"] == {p.resolve(): 1 for p in (llama_dir / "model.onnx", low, high)}
    assert counted["rotations"] == (1 if name == "rotated" else 0)
    assert counted["switch_models"] == 1


def test_a_plain_eval_of_a_rotated_model_loads_and_rotates_once(llama_dir, forms, counted):
    """The comparison alone, on a rotated model kept apart (--isolated: whole models, not the paired graph):
    each model parsed once, the reference rotated once, no switchable model."""
    low = forms / "rotated" / "W4A16" / "model.onnx"
    result = run_cli("eval", llama_dir / "model.onnx", low, "--data", llama_dir / "heldout.npz", "--num-samples", 2,
                  "--json", "--isolated")
    assert result.exit_code == 0, result.output
    assert counted["parsed"] == {p.resolve(): 1 for p in (llama_dir / "model.onnx", low)}
    assert counted["rotations"] == 1 and counted["switch_models"] == 0
