"""The pipeline's observer plan on a real graph: shared input observers and fused global scales."""

from __future__ import annotations

import onnx
import torch

from graphcal.config import resolve_scheme
from graphcal.fusion import find_fused_groups
from graphcal.graph.targets import find_targets, torch_weight
from graphcal.pipeline import _ObserverPlan


def test_tensor_group_weights_of_a_fused_group_share_one_global_scale(llama_dir):
    from graphcal.export import build_tiny_llama

    model = onnx.load(llama_dir / "model.onnx")
    targets = [t for t in find_targets(model)[0] if t.name != "lm_head"]
    scheme = resolve_scheme("NVFP4A16", ["Linear"])
    plan = _ObserverPlan(targets, {t.name: scheme for t in targets})
    for t in targets:
        plan.weight_observers[t.name](torch.from_numpy(torch_weight(model, t)))
    groups, _ = find_fused_groups(targets)
    plan.fuse(groups)
    items = {t.name: plan.qparams(t, scheme) for t in targets}

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
    model = onnx.load(llama_dir / "model.onnx")
    targets = [t for t in find_targets(model)[0] if t.name != "lm_head"]
    scheme = resolve_scheme("W8A8_STATIC", ["Linear"])
    plan = _ObserverPlan(targets, {t.name: scheme for t in targets})
    # 2 layers x (qkv input, o input, gate/up input, down input)
    assert len(plan.taps) == 8 and all(len(c) == 1 for c in plan.taps.values())
    q, k = (plan.input_observers[f"model.layers.0.self_attn.{p}_proj"] for p in "qk")
    assert q is k


def test_in_graph_reductions_give_the_same_files(llama_dir, tmp_path):
    """Min/max observers fed ReduceMin/ReduceMax from the graph write what whole tensors write;
    for static per-tensor inputs no whole activation leaves onnxruntime."""
    import hashlib

    from graphcal.pipeline import calibrate

    def digests(folder):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()
                if p.name != ".graphcal-manifest.json"}  # the manifest records mtimes

    cases = [("W8A8_STATIC", None), ("NVFP4", None),
             ("FP8", '{"num_bits": 8, "type": "float", "strategy": "attn_head"}')]
    for i, (scheme, kv) in enumerate(cases):
        a = calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / f"a{i}", scheme=scheme,
                      kv_cache=kv, device="cpu")
        calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / f"b{i}", scheme=scheme,
                  kv_cache=kv, device="cpu", reduce_in_graph=False)
        assert digests(tmp_path / f"a{i}") == digests(tmp_path / f"b{i}"), scheme
        assert a.num_batches == 8

    model = onnx.load(llama_dir / "model.onnx")
    targets = [t for t in find_targets(model)[0] if t.name != "lm_head"]
    scheme = resolve_scheme("W8A8_STATIC", ["Linear"])
    full, reduced = _ObserverPlan(targets, {t.name: scheme for t in targets}).fetches(True)
    assert full == [] and len(reduced) == 8
    mse = resolve_scheme('{"weights": {"num_bits": 8}, "input_activations": {"num_bits": 8, "observer": "mse"}}',
                         ["Linear"])
    full, reduced = _ObserverPlan(targets, {t.name: mse for t in targets}).fetches(True)
    assert len(full) == 8 and reduced == []  # MSE needs whole tensors


def test_each_weight_is_read_once(llama_dir, tmp_path, monkeypatch):
    """The weight phase reads a weight, observes it, quantizes it into the output and drops it."""
    from collections import Counter

    import graphcal.graph.qdq
    import graphcal.pipeline
    from graphcal.pipeline import calibrate

    reads = Counter()
    real = graphcal.pipeline.torch_weight

    def counting(model, target, base_dir=None):
        reads[target.name] += 1
        return real(model, target, base_dir)

    monkeypatch.setattr(graphcal.pipeline, "torch_weight", counting)
    monkeypatch.setattr(graphcal.graph.qdq.writer, "torch_weight", counting)
    result = calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "o", scheme="NVFP4", device="cpu")
    assert set(reads) == {i.target.name for i in result.targets} and set(reads.values()) == {1}
