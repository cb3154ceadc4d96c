"""Fused groups by module name, cross-checked by the activation the members read."""

from __future__ import annotations

import onnx

from graphcal.graph.fusion import find_fused_groups
from graphcal.graph.targets import find_targets
from graphcal.types import Target


def test_llama_and_bert_groups(llama_dir, bert_dir):
    groups, warnings = find_fused_groups(find_targets(onnx.load(llama_dir / "model.onnx"))[0])
    assert [g.members for g in groups] == [
        ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"),
        ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"),
        ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj"),
        ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"),
    ]
    assert warnings == []
    groups, warnings = find_fused_groups(find_targets(onnx.load(bert_dir / "model.onnx"))[0])
    assert [g.members[0] for g in groups] == [f"encoder.layer.{i}.attention.self.query" for i in range(2)]
    assert warnings == []


def _t(name, activation):
    return Target(name, name, "MatMul", activation, "w", (), "in_out", 4, 4)


def test_name_and_structure_disagree():
    groups, warnings = find_fused_groups([_t("a.gate_proj", "x"), _t("a.up_proj", "y"), _t("b.w1", "z"), _t("b.extra", "z")])
    assert [g.members for g in groups] == [("a.gate_proj", "a.up_proj")]
    assert any("read different activations" in w for w in warnings)
    assert any("b.extra" in w and "no named fused group" in w for w in warnings)
