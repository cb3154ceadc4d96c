"""Target discovery on every export form, checked against the torch model's own weights."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from graphcal.errors import UsageError
from graphcal.graph.targets import find_targets, module_name, select, torch_weight

LLAMA_MODULES = [
    f"model.layers.{i}.{m}"
    for i in range(2)
    for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
] + ["lm_head"]


def _torch_weights(builder) -> dict[str, np.ndarray]:
    model = builder()[0]
    return {n: m.weight.detach().numpy() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


@pytest.fixture(scope="module")
def llama_weights():
    from tools.builders import build_tiny_llama

    return _torch_weights(build_tiny_llama)


def _check_against_torch(model, weights, expected_names):
    targets, skipped = find_targets(model)
    assert [t.name for t in targets] == expected_names
    for t in targets:
        np.testing.assert_array_equal(torch_weight(model, t), weights[t.name])
        assert (t.out_features, t.in_features) == weights[t.name].shape
    # the attention score MatMuls read two activations: never weight targets
    assert len(skipped) == 4 and all("activation" in s.reason for s in skipped)
    return targets


def test_legacy_folded_weights_are_in_out_initializers(llama_dir, llama_weights):
    model = onnx.load(llama_dir / "model.onnx")
    targets = _check_against_torch(model, llama_weights, LLAMA_MODULES)
    assert all(t.layout == "in_out" and t.weight_path == () for t in targets)
    assert targets[0].weight.startswith("onnx::MatMul_")


@pytest.mark.slow
def test_unfolded_transpose_form(exported, llama_weights):
    model = onnx.load(exported("nofold"))
    targets = _check_against_torch(model, llama_weights, LLAMA_MODULES)
    assert targets[0].weight == "model.layers.0.self_attn.q_proj.weight"
    assert len(targets[0].weight_path) == 1


@pytest.mark.slow
def test_dynamo_form_names_come_from_name_scopes(exported, llama_weights):
    model = onnx.load(exported("dynamo"))
    targets = _check_against_torch(model, llama_weights, LLAMA_MODULES)
    assert targets[0].node.startswith("node_linear")


def test_bert_pooler_is_gemm_trans_b(bert_dir):
    from tools.builders import build_tiny_bert

    weights = _torch_weights(build_tiny_bert)
    model = onnx.load(bert_dir / "model.onnx")
    targets, _ = find_targets(model)
    assert {t.name for t in targets} == set(weights)
    pooler = next(t for t in targets if t.name == "pooler.dense")
    assert (pooler.op_type, pooler.layout) == ("Gemm", "out_in")
    for t in targets:
        np.testing.assert_array_equal(torch_weight(model, t), weights[t.name])


def _graph(nodes, inits, x_shape=(2, 4), out="y"):
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], initializer=inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_gemm_without_trans_b_and_cast_path():
    rng = np.random.default_rng(0)
    w_in_out = rng.standard_normal((4, 3)).astype(np.float32)
    w16 = rng.standard_normal((3, 4)).astype(np.float16)  # torch layout, stored fp16 behind Cast+Transpose
    model = _graph(
        [
            helper.make_node("Gemm", ["x", "w0"], ["h"], name="/fc1/Gemm"),
            helper.make_node("Cast", ["w1"], ["w1f"], name="/fc2/Cast", to=TensorProto.FLOAT),
            helper.make_node("Transpose", ["w1f"], ["w1t"], name="/fc2/Transpose", perm=[1, 0]),
            helper.make_node("MatMul", ["h", "w1t"], ["y"], name="/fc2/MatMul"),
        ],
        [numpy_helper.from_array(w_in_out, "w0"), numpy_helper.from_array(w16, "w1")],
    )
    targets, _ = find_targets(model)
    assert [(t.name, t.layout, t.weight_path) for t in targets] == [
        ("fc1", "in_out", ()), ("fc2", "in_out", ("/fc2/Cast", "/fc2/Transpose"))
    ]
    np.testing.assert_array_equal(torch_weight(model, targets[0]), w_in_out.T)
    np.testing.assert_array_equal(torch_weight(model, targets[1]), w16.astype(np.float32))


def test_weight_behind_reshape():
    w = np.arange(12, dtype=np.float32)  # stored flat, reshaped to [in=4, out=3]
    model = _graph(
        [helper.make_node("Reshape", ["w", "shape"], ["w2"], name="/fc/Reshape"),
         helper.make_node("MatMul", ["x", "w2"], ["y"], name="/fc/MatMul")],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([4, 3], np.int64), "shape")],
    )
    (t,), _ = find_targets(model)
    assert (t.name, t.weight_path, t.out_features, t.in_features) == ("fc", ("/fc/Reshape",), 3, 4)
    np.testing.assert_array_equal(torch_weight(model, t), w.reshape(4, 3).T)


def test_module_name_fallbacks():
    node = helper.make_node("MatMul", ["a", "b"], ["c"], name="custom_node")
    assert module_name(node, "encoder.fc.weight", 0) == "encoder.fc"
    assert module_name(node, "onnx::MatMul_5", 0) == "custom_node"
    scoped = helper.make_node("MatMul", ["a", "b"], ["c"], name="node_linear_2")
    prop = scoped.metadata_props.add()
    prop.key, prop.value = "pkg.torch.onnx.name_scopes", "['', 'lm_head', 'linear_2']"
    assert module_name(scoped, "val_1", 0) == "lm_head"


def test_select_exact_regex_class_and_ignore(llama_dir):
    targets, _ = find_targets(onnx.load(llama_dir / "model.onnx"))
    chosen, unmatched = select(targets, ["Linear"], ["lm_head"])
    assert [t.name for t in chosen] == LLAMA_MODULES[:-1] and unmatched == []
    chosen, _ = select(targets, ["re:.*mlp\\..*"], ["re:.*down_proj$"])
    assert [t.name for t in chosen] == [n for n in LLAMA_MODULES if "gate" in n or "up_proj" in n]
    chosen, unmatched = select(targets, ["model.layers.1.self_attn.o_proj", "re:nothing.*"], [])
    assert [t.name for t in chosen] == ["model.layers.1.self_attn.o_proj"] and unmatched == ["re:nothing.*"]
    # `re:` matches from the start, as compressed-tensors' match_name (re.match) does
    assert select(targets, ["re:q_proj"], [])[0] == []
    with pytest.raises(UsageError, match="invalid regex"):
        select(targets, ["re:(unclosed"], [])
