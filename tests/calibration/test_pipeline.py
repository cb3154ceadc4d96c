"""The pipeline's stages on a real graph: shared input observers, fused global scales, typed taps."""

from __future__ import annotations

import torch

from graphcal.calibration.observe import ObserverSet
from graphcal.calibration.plan import load, plan
from graphcal.config import build_config
from graphcal.graph.taps import Reduction
from graphcal.graph.targets import torch_weight
from tests.helpers import run_cli


def _observers(llama_dir, scheme: str, target: str = "onnxruntime"):
    """The plan, its observers, and the model it was made on (the plan holds no model)."""
    loaded = load(llama_dir / "model.onnx", build_config(scheme))
    run = plan(llama_dir / "model.onnx", build_config(scheme), target, loaded=loaded)
    return run, ObserverSet(run), loaded


def test_tensor_group_weights_of_a_fused_group_share_one_global_scale(llama_dir):
    from tools.builders import build_tiny_llama

    run, observers, loaded = _observers(llama_dir, "NVFP4A16", "qdq")
    targets, groups = run.chosen, run.groups
    for t in targets:
        observers.weight_observers[t.name](torch.from_numpy(torch_weight(loaded.model, t)))
    for group in groups:
        observers.share_global_scales(list(group.members))
    items = {t.name: observers.qparams(t, run.schemes[t.name]) for t in targets}

    torch_model = build_tiny_llama()[0]
    weights = {n: m.weight.detach() for n, m in torch_model.named_modules() if isinstance(m, torch.nn.Linear)}
    for group in groups:
        joint = max(weights[n].abs().max() for n in group.members)
        expected = torch.tensor(2688.0) / joint  # compressed-tensors' generate_gparam: 448 * 6 / absmax
        for name in group.members:
            torch.testing.assert_close(items[name].qparams["weight"].global_scale, expected.reshape(1))
    # o_proj and down_proj belong to no group: their own absmax
    alone = "model.layers.0.self_attn.o_proj"
    own = torch.tensor(2688.0) / weights[alone].abs().max()
    torch.testing.assert_close(items[alone].qparams["weight"].global_scale, own.reshape(1))
    q, k = (items[f"model.layers.0.self_attn.{p}_proj"].qparams["weight"].global_scale for p in "qk")
    assert torch.equal(q, k)


def test_q_k_v_share_one_input_observer_per_activation(llama_dir):
    _, observers, _ = _observers(llama_dir, "W8A8_STATIC")
    taps = observers.by_tensor()
    # 2 layers x (qkv input, o input, gate/up input, down input)
    assert len(taps) == 8 and all(len(c) == 1 for c in taps.values())
    q, k = (observers.input_observers[f"model.layers.0.self_attn.{p}_proj"] for p in "qk")
    assert q is k


def test_in_graph_reductions_give_the_same_files(llama_dir, tmp_path):
    """Min/max observers fed ReduceMin/ReduceMax from the graph write what whole tensors write;
    for static per-tensor inputs no whole activation leaves onnxruntime."""
    import hashlib

    from graphcal.calibration.pipeline import calibrate

    def digests(folder):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}  # the manifest too

    cases = [("W8A8_STATIC", None), ("NVFP4", None),
             ("FP8", '{"num_bits": 8, "type": "float", "strategy": "attn_head"}')]
    for i, (scheme, kv) in enumerate(cases):
        target = "qdq" if scheme == "NVFP4" else "onnxruntime"
        a = calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / f"a{i}", scheme=scheme,
                      kv_cache=kv, device="cpu", target=target)
        calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / f"b{i}", scheme=scheme,
                  kv_cache=kv, device="cpu", reduce_in_graph=False, target=target)
        assert digests(tmp_path / f"a{i}") == digests(tmp_path / f"b{i}"), scheme
        assert a.num_batches == 8

    requests = _observers(llama_dir, "W8A8_STATIC")[1].requests(in_graph=True)
    assert len(requests) == 8 and {r.reduction for r in requests} == {Reduction.ALL}
    assert {r.reduction for r in _observers(llama_dir, "W8A8_STATIC")[1].requests(in_graph=False)} == {Reduction.WHOLE}
    mse = '{"weights": {"num_bits": 8}, "input_activations": {"num_bits": 8, "observer": "mse"}}'
    requests = _observers(llama_dir, mse)[1].requests(in_graph=True)
    assert len(requests) == 8 and {r.reduction for r in requests} == {Reduction.WHOLE}  # MSE needs whole tensors


def test_each_weight_is_read_once(llama_dir, tmp_path, monkeypatch):
    """The weight phase reads a weight, observes it, quantizes it into the output and drops it."""
    from collections import Counter

    import graphcal.calibration.weights
    from graphcal.calibration.pipeline import calibrate

    reads = Counter()
    real = graphcal.calibration.weights.weight_tensor

    def counting(model, target, base_dir=None):
        reads[target.name] += 1
        return real(model, target, base_dir)

    monkeypatch.setattr(graphcal.calibration.weights, "weight_tensor", counting)
    result = calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "o", scheme="NVFP4", device="cpu",
                       target="qdq")
    assert set(reads) == {i.target.name for i in result.targets} and set(reads.values()) == {1}


def test_the_input_model_is_not_mutated_for_the_taps(llama_dir):
    """The tapped graph is a weightless copy: the plan's model keeps its nodes and outputs, and the
    copy holds no weight of the model."""
    from graphcal.graph.taps import build_tapped

    run, observers, loaded = _observers(llama_dir, "W8A8_STATIC")
    model = loaded.model
    before = model.SerializeToString()
    tapped = build_tapped(model, observers.requests(in_graph=True), dict(loaded.types))
    assert model.SerializeToString() == before
    weights = {t.name for t in model.graph.initializer}
    assert not weights & {t.name for t in tapped.model.graph.initializer}
    assert len(tapped.model.graph.output) > len(model.graph.output)


def test_run_and_inspect_agree_by_construction(llama_dir, tmp_path):
    """inspect reports the plan run executes: same quantized and ignored modules, opset and warnings."""
    import json

    from graphcal.calibration.pipeline import calibrate

    args = ["--scheme", "NVFP4", "--kv-cache-scheme", "FP8", "--ignore", "lm_head", "--ignore", "re:.*down_proj",
            "--target", "qdq"]
    shown = run_cli("inspect", str(llama_dir / "model.onnx"), *args, "--json")
    assert shown.exit_code == 0, shown.output
    report = json.loads(shown.stdout)
    result = calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "o", scheme="NVFP4",
                       target="qdq", kv_cache="FP8", ignore=["lm_head", "re:.*down_proj"], device="cpu")
    assert report["quantized"] == [i.target.name for i in result.targets]
    assert report["ignored"] == result.ignored
    assert report["warnings"] == result.warnings  # the fp4 runtime note included
    assert len(report["kv_states"]) == 2
    import onnx

    assert report["opset"]["output"] == next(o.version for o in onnx.load(tmp_path / "o" / "model.onnx").opset_import
                                             if o.domain == "")
