"""Sequential blocks and AWQ parents: each piece, run alone in onnxruntime on cached inputs,
reproduces what the whole model computes (graphcal.graph.taps on the full model is the reference)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphcal.errors import GraphcalError
from graphcal.graph.blocks import (
    block_subgraph,
    blocks,
    layer_prefix,
    needed_initializers,
    parent_inputs,
    parent_output,
    subgraph,
    weight_dependent,
)
from graphcal.graph.io import value_types
from graphcal.graph.taps import add_taps
from graphcal.graph.targets import find_targets
from graphcal.runtime import open_runtime, run_model

TOL = dict(rtol=1e-6, atol=1e-6)


class Loaded:
    def __init__(self, folder, samples=2):
        self.model = onnx.load(folder / "model.onnx")
        self.targets = find_targets(self.model)[0]
        self.by_name = {t.name: t for t in self.targets}
        data = np.load(folder / "calib.npz")
        self.feeds = {k: data[k][:samples] for k in data.files}
        self.types = value_types(self.model)
        self.dependent = weight_dependent(self.model, self.targets)

    def full(self, tensors, model=None):
        """The tensors as the whole model computes them."""
        tapped, fetch = add_taps(model or self.model, list(tensors), self.types)
        return run_model(tapped, self.feeds, fetch)


@pytest.fixture(scope="module")
def llama(llama_dir):
    return Loaded(llama_dir)


@pytest.fixture(scope="module")
def bert(bert_dir):
    return Loaded(bert_dir)


def run_sub(sub, model, values):
    """Run a hollow subgraph, its initializers served from ``model``, fed from ``values``."""
    runtime = open_runtime(sub, [o.name for o in sub.graph.output], device="cpu",
                           weights=needed_initializers(sub, model))
    return runtime.run_numpy({i.name: values[i.name] for i in sub.graph.input})


def chain(loaded, found):
    """Run the blocks one after another on cached tensors: {tensor: value} for every block's
    activations and outputs."""
    cache = dict(loaded.feeds)
    got = {}
    for block in found:
        taps = [t.activation for t in block.targets]
        sub = block_subgraph(loaded.model, block, taps, dependent=loaded.dependent, types=loaded.types)
        fed = {i.name for i in sub.graph.input}
        assert fed == set(block.inputs) | set(block.graph_inputs), block.name
        assert not sub.graph.initializer
        values = run_sub(sub, loaded.model, cache)
        got.update(values)
        cache.update({name: values[name] for name in block.outputs})
    return got


def test_layer_prefix():
    assert layer_prefix("model.layers.3.mlp.up_proj") == "model.layers.3"
    assert layer_prefix("encoder.layer.0.attention.self.query") == "encoder.layer.0"
    assert layer_prefix("lm_head") is None
    assert layer_prefix("h.1x.attn") is None


def test_llama_blocks_are_decoder_layers_on_the_residual_stream(llama):
    found = blocks(llama.model, llama.targets)
    assert [b.name for b in found] == ["model.layers.0", "model.layers.1", "lm_head"]
    assert [len(b.targets) for b in found] == [7, 7, 1]
    assert [b.inputs for b in found] == [(), ("/model/layers.0/Add_1_output_0",), ("/model/layers.1/Add_1_output_0",)]
    assert [b.outputs for b in found] == [("/model/layers.0/Add_1_output_0",), ("/model/layers.1/Add_1_output_0",),
                                          ("logits",)]
    assert [b.graph_inputs for b in found] == [("input_ids", "attention_mask")] * 2 + [()]
    # without lm_head the last layer ends where the rest of the graph (norm, lm_head) starts
    assert blocks(llama.model, llama.targets[:-1])[-1].outputs == ("/model/layers.1/Add_1_output_0",)


def test_llama_chained_blocks_reproduce_the_whole_model(llama):
    found = blocks(llama.model, llama.targets)
    got = chain(llama, found)
    wanted = [t.activation for t in llama.targets] + [o for b in found for o in b.outputs]
    full = llama.full(wanted)
    for name in wanted:
        np.testing.assert_allclose(got[name], full[name], **TOL, err_msg=name)
    np.testing.assert_allclose(got["logits"], run_model(llama.model, llama.feeds)["logits"], **TOL)


def test_bert_blocks_and_chain(bert):
    found = blocks(bert.model, bert.targets)
    ln0 = "/encoder/layer.0/output/LayerNorm/LayerNormalization_output_0"
    assert [b.name for b in found] == ["encoder.layer.0", "encoder.layer.1", "pooler.dense"]
    assert [b.inputs for b in found] == [(), (ln0,), ("last_hidden_state",)]
    assert [b.outputs for b in found] == [(ln0,), ("last_hidden_state",), ("/pooler/dense/Gemm_output_0",)]
    got = chain(bert, found)  # layer 1's query reads its block input: that tap comes out as fed
    wanted = [t.activation for t in bert.targets] + [o for b in found for o in b.outputs]
    full = bert.full(wanted)
    for name in wanted:
        np.testing.assert_allclose(got[name], full[name], **TOL, err_msg=name)


def test_needed_initializers_are_only_those_read(llama):
    lm_head = blocks(llama.model, llama.targets)[-1]
    sub = block_subgraph(llama.model, lm_head, [], dependent=llama.dependent, types=llama.types)
    needed = {t.name for t in needed_initializers(sub, llama.model)}
    assert llama.by_name["lm_head"].weight in needed
    # model.norm.weight is an Identity of this deduplicated initializer (models/README.md)
    assert needed == {llama.by_name["lm_head"].weight, "model.layers.0.input_layernorm.weight"}


def test_external_data_is_never_read(llama, tmp_path):
    """A model loaded without its external data: blocks and subgraphs are built from names, and
    the session reads the weights from the model's folder."""
    from graphcal.graph.io import save_model

    save_model(llama.model, tmp_path / "model.onnx", external=True)
    model = onnx.load(tmp_path / "model.onnx", load_external_data=False)
    targets = find_targets(model)[0]
    assert any(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer)
    block = blocks(model, targets)[1]
    sub = block_subgraph(model, block, [block.targets[0].activation])
    weights = needed_initializers(sub, model)
    assert all(not t.HasField("raw_data") for t in weights if t.data_location == TensorProto.EXTERNAL)
    runtime = open_runtime(sub, [o.name for o in sub.graph.output], device="cpu", weights=weights,
                           external_folder=tmp_path)
    full = llama.full([*block.inputs, *block.outputs])
    got = runtime.run_numpy({**{n: llama.feeds[n] for n in block.graph_inputs}, **{n: full[n] for n in block.inputs}})
    np.testing.assert_allclose(got[block.outputs[0]], full[block.outputs[0]], **TOL)


def test_parent_outputs(llama, bert):
    def parent(loaded, *names):
        return parent_output(loaded.model, [loaded.by_name[n] for n in names])

    attn, mlp = "model.layers.0.self_attn.", "model.layers.1.mlp."
    assert parent(llama, attn + "q_proj", attn + "k_proj", attn + "v_proj") == \
        "/model/layers.0/self_attn/o_proj/MatMul_output_0"
    assert parent(llama, mlp + "gate_proj", mlp + "up_proj") == "/model/layers.1/mlp/down_proj/MatMul_output_0"
    assert parent(llama, attn + "o_proj") == "/model/layers.0/self_attn/o_proj/MatMul_output_0"
    assert parent(llama, "lm_head") == "logits"
    # BERT: the common scope of query/key/value is BertSelfAttention; it hands out the context
    # that attention.output.dense reads (llm-compressor's lowest common ancestor does the same)
    qkv = [f"encoder.layer.1.attention.self.{m}" for m in ("query", "key", "value")]
    assert parent(bert, *qkv) == bert.by_name["encoder.layer.1.attention.output.dense"].activation
    assert parent(bert, "pooler.dense") == "/pooler/dense/Gemm_output_0"


def _scaled(init: onnx.TensorProto, scale: np.ndarray) -> np.ndarray:
    return (numpy_helper.to_array(init) * scale).astype(np.float32)


@pytest.mark.parametrize("layer", [0, 1])
def test_parent_subgraph_with_candidate_weights(llama, layer):
    attn = f"model.layers.{layer}.self_attn."
    group = [llama.by_name[attn + m] for m in ("q_proj", "k_proj", "v_proj")]
    out = parent_output(llama.model, group)
    cut = parent_inputs(llama.model, group, out, dependent=llama.dependent)
    assert cut == [group[0].activation]  # masks and rotary tables are recomputed, shapes too
    weights = [t.weight for t in group]
    sub = subgraph(llama.model, [out], cut, weights, dependent=llama.dependent, types=llama.types)
    assert {i.name for i in sub.graph.input} == {*cut, *weights, "input_ids", "attention_mask"}
    inits = {t.name: t for t in llama.model.graph.initializer}
    full = llama.full([out, *cut])
    values = {**llama.feeds, cut[0]: full[cut[0]]}
    original = {w: numpy_helper.to_array(inits[w]) for w in weights}
    np.testing.assert_allclose(run_sub(sub, llama.model, {**values, **original})[out], full[out], **TOL)

    # candidate weights: W [in, out] with its input channels scaled (what AWQ tries)
    rng = np.random.default_rng(layer)
    scale = rng.uniform(0.5, 2.0, size=(group[0].in_features, 1)).astype(np.float32)
    candidate = {w: _scaled(inits[w], scale) for w in weights}
    got = run_sub(sub, llama.model, {**values, **candidate})[out]
    changed = onnx.ModelProto()
    changed.CopyFrom(llama.model)
    for init in changed.graph.initializer:
        if init.name in candidate:
            init.CopyFrom(numpy_helper.from_array(candidate[init.name], init.name))
    reference = llama.full([out], changed)[out]
    assert not np.allclose(reference, full[out], rtol=1e-3, atol=1e-4)  # the weights do matter
    np.testing.assert_allclose(got, reference, **TOL)


def test_bert_parent_on_cached_input(bert):
    group = [bert.by_name[f"encoder.layer.0.attention.self.{m}"] for m in ("query", "key", "value")]
    out = parent_output(bert.model, group)
    cut = parent_inputs(bert.model, group, out)
    assert cut == [group[0].activation]
    sub = subgraph(bert.model, [out], cut, dependent=bert.dependent, types=bert.types)
    full = bert.full([out, *cut])
    got = run_sub(sub, bert.model, {**bert.feeds, cut[0]: full[cut[0]]})[out]
    np.testing.assert_allclose(got, full[out], **TOL)


def test_a_cut_that_does_not_separate_raises(llama):
    with pytest.raises(GraphcalError, match="Add_1_output_0"):
        # the residual stream of layer 1 needs layer 0's output, which the cut is computed from
        subgraph(llama.model, ["/model/layers.1/Add_1_output_0"], ["/model/layers.1/input_layernorm/Mul_1_output_0"],
                 dependent=llama.dependent, types=llama.types)
    with pytest.raises(GraphcalError, match="not an initializer"):
        subgraph(llama.model, ["logits"], [], ["no_such_weight"], dependent=llama.dependent)
    with pytest.raises(GraphcalError, match="not read"):
        subgraph(llama.model, ["logits"], ["/model/layers.1/Add_1_output_0"], [llama.targets[0].weight],
                 dependent=llama.dependent, types=llama.types)
    with pytest.raises(GraphcalError, match="no tensor"):
        subgraph(llama.model, ["nothing"], [], dependent=llama.dependent)


def test_post_dominator_fallback_without_scopes(llama):
    """Nodes without module scopes: the parent is the nearest tensor on every path from the
    targets' outputs: for q/k/v the attention's probs @ V (o_proj reads it after a Transpose and
    Reshape), for gate/up down_proj's input."""
    model = onnx.ModelProto()
    model.CopyFrom(llama.model)
    renamed = {}
    for i, node in enumerate(model.graph.node):
        renamed[node.name], node.name = f"n{i}", f"n{i}"
    unscoped = {t.node: t for t in find_targets(model)[0]}
    by_old = {t.name: unscoped[renamed[t.node]] for t in llama.targets}
    attn, mlp = "model.layers.1.self_attn.", "model.layers.1.mlp."
    qkv = [by_old[attn + m] for m in ("q_proj", "k_proj", "v_proj")]
    assert parent_output(model, qkv) == "/model/layers.1/self_attn/MatMul_1_output_0"
    assert parent_output(model, [by_old[mlp + "gate_proj"], by_old[mlp + "up_proj"]]) == by_old[mlp + "down_proj"].activation
    assert parent_output(model, [by_old[attn + "v_proj"], by_old[attn + "o_proj"]]) == \
        "/model/layers.1/self_attn/o_proj/MatMul_output_0"
    # names without a layer number: one block per target, each ending at its own output (and the
    # residual beside it); chained, they still give the model's logits
    targets = list(unscoped.values())
    found = blocks(model, targets)
    assert [b.targets for b in found] == [(t,) for t in targets]
    k = [b.targets[0] for b in found].index(by_old["model.layers.0.mlp.down_proj"])
    assert found[k].outputs == ("/model/layers.0/mlp/down_proj/MatMul_output_0",)
    # the next block (layer 1's q_proj) reads the residual stream as two summands: down_proj's
    # output and the mid-layer residual (the exporter's fp32 Cast of it, made in gate_proj's block)
    assert found[k + 1].inputs == ("/model/layers.0/post_attention_layernorm/Cast_output_0",
                                   "/model/layers.0/mlp/down_proj/MatMul_output_0")
    loaded = _toy_loaded(model, llama.feeds)
    got = chain(loaded, found)
    np.testing.assert_allclose(got["logits"], run_model(llama.model, llama.feeds)["logits"], **TOL)


# -- hand-built graphs ---------------------------------------------------------------------------

H = 8


def _toy(order=("layers.0.a", "layers.1.b", "layers.2.c")):
    """x -> a -> h0 -> b -> h1 (* sigmoid(m)) -> c -> h2; out = h2 + h0 (a skip across block 1).
    ``m`` is a second graph input that depends on no weight; nodes named by module scope."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []
    src = "x"
    outs = {}
    for k, module in enumerate(order):
        w = f"w{k}"
        inits.append(numpy_helper.from_array(rng.standard_normal((H, H)).astype(np.float32), w))
        scope = "/" + module.replace(".", "/")  # /layers/0/a/MatMul: module layers.0.a
        nodes.append(helper.make_node("MatMul", [src, w], [f"h{k}"], name=f"{scope}/MatMul"))
        outs[module] = f"h{k}"
        src = f"h{k}"
        if k == 0:
            continue
        if k == 1:
            nodes.append(helper.make_node("Sigmoid", ["m"], ["mask"], name="/mask/Sigmoid"))
            nodes.append(helper.make_node("Mul", ["h1", "mask"], ["h1m"], name=f"{scope}/Mul"))
            src = "h1m"
    nodes.append(helper.make_node("Add", ["h2", "h0"], ["out"], name="/layers.2/Add"))
    graph = helper.make_graph(
        nodes, "toy",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", H]),
         helper.make_tensor_value_info("m", TensorProto.FLOAT, ["n", H])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", H])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    feeds = {"x": rng.standard_normal((3, H)).astype(np.float32), "m": rng.standard_normal((3, H)).astype(np.float32)}
    return model, feeds


def _toy_loaded(model, feeds):
    loaded = Loaded.__new__(Loaded)
    loaded.model, loaded.feeds = model, feeds
    loaded.targets = find_targets(model)[0]
    loaded.by_name = {t.name: t for t in loaded.targets}
    loaded.types = value_types(model)
    loaded.dependent = weight_dependent(model, loaded.targets)
    return loaded


def test_skip_connection_across_two_blocks():
    toy = _toy_loaded(*_toy())
    assert [t.name for t in toy.targets] == ["layers.0.a", "layers.1.b", "layers.2.c"]
    found = blocks(toy.model, toy.targets)
    assert [(b.name, b.inputs, b.outputs, b.graph_inputs) for b in found] == [
        ("layers.0", (), ("h0",), ("x",)),
        ("layers.1", ("h0",), ("h1m",), ("m",)),  # the mask is recomputed from m, never cached
        ("layers.2", ("h0", "h1m"), ("out",), ()),  # h0 skips block 1: still cached for block 2
    ]
    got = chain(toy, found)
    full = toy.full(["h0", "h1m", "out"])
    for name in ("h0", "h1m", "out"):
        np.testing.assert_allclose(got[name], full[name], **TOL)


def test_non_contiguous_groups_fall_back_to_one_block_per_target():
    toy = _toy_loaded(*_toy(("layers.0.a", "layers.1.b", "layers.0.c")))
    found = blocks(toy.model, toy.targets)
    assert [b.name for b in found] == ["layers.0.a", "layers.1.b", "layers.0.c"]
    assert [len(b.targets) for b in found] == [1, 1, 1]
    # the closing Add is scoped layers.2, in no block: the last block ends at its target's output
    assert [(b.inputs, b.outputs) for b in found] == [((), ("h0",)), (("h0",), ("h1m",)), (("h1m",), ("h2",))]
    got = chain(toy, found)
    np.testing.assert_allclose(got["h2"], toy.full(["h2"])["h2"], **TOL)


def test_no_common_parent_raises():
    """Two targets on separate branches to separate graph outputs share no post-dominator."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((H, H)).astype(np.float32), n) for n in ("w0", "w1")]
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["y0"], name="p"),
             helper.make_node("MatMul", ["x", "w1"], ["y1"], name="q")]
    graph = helper.make_graph(nodes, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, H])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, H]) for n in ("y0", "y1")],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    targets = find_targets(model)[0]
    with pytest.raises(GraphcalError, match="no single tensor"):
        parent_output(model, targets)
    assert parent_output(model, targets[:1]) == "y0"


def test_kv_cache_outputs_do_not_end_a_parent(llama):
    """A KV-cache decoder (Optimum's text-generation-with-past) hands k_proj's and v_proj's states out
    as present.N.key/value: AWQ's parent of q/k/v is still the attention output (llm-compressor's loss
    is on the module's output, not its cache)."""
    from onnx import helper

    model = onnx.ModelProto()
    model.CopyFrom(llama.model)
    attn = "model.layers.0.self_attn."
    for kind, proj in (("key", "k_proj"), ("value", "v_proj")):
        out = llama.by_name[attn + proj]
        node = next(n for n in model.graph.node if n.name == out.node)
        name = f"present.0.{kind}"
        model.graph.node.append(helper.make_node("Identity", [node.output[0]], [name],
                                                 name=f"/model/layers.0/self_attn/present_{kind}"))
        model.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    group = [llama.by_name[attn + m] for m in ("q_proj", "k_proj", "v_proj")]
    assert parent_output(model, group) == "/model/layers.0/self_attn/o_proj/MatMul_output_0"


def test_a_packed_qkv_projections_parent_is_the_attention_output(builder_model):
    """onnxruntime-genai's qkv_proj is q, k and v in one MatMul: its AWQ parent is the attention
    module's output (o_proj's), as separate q/k/v's is, not the projection itself; a single layer
    that feeds no attention op (o_proj, down_proj) stays its own parent."""
    folder, _ = builder_model
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    by_name = {t.name: t for t in find_targets(model)[0]}
    qkv = by_name["model.layers.0.attn.qkv_proj"]
    o_proj = by_name["model.layers.0.attn.o_proj"]
    o_out = next(n.output[0] for n in model.graph.node if n.name == o_proj.node)
    assert parent_output(model, [qkv]) == o_out
    assert parent_output(model, [o_proj]) == o_out
    down = by_name["model.layers.0.mlp.down_proj"]
    assert parent_output(model, [down]) == next(n.output[0] for n in model.graph.node if n.name == down.node)
    assert parent_inputs(model, [qkv], o_out) == [qkv.activation]
