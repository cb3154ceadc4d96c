"""Embedding lookups quantized, and a tied lm_head stored once (issue 33).

The reference for every stored table is compressed-tensors' own math: qparams from the rows'
(or groups') min/max by ``calculate_qparams``, then ``fake_quantize``, computed here from the
float table, never read from graphcal's output. The written models run in onnxruntime at
ORT_ENABLE_BASIC (its GatherBlockQuantized kernel, or DequantizeLinear -> Gather) and at its
default settings.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from tests.helpers import WHOLE_INT4_RECIPE, run_cli

V, H = 300, 96  # 96 is no power of two: GatherBlockQuantized's per-row form pads its blocks and trims them


def _model(path, *, tied: str = "same", seed: int = 0):
    """ids -> Gather(table) -> "emb" -> MatMul(mid) -> MatMul(lm_head) -> "logits", named as torch's
    legacy exporter names them. ``tied``: "same" (onnxruntime-genai's builder: lm_head's [H, V] weight,
    read by the Gather through a Transpose), "copy" (torch's exporter: a second initializer with the
    same values) or "none" (an lm_head of its own)."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((V, H)).astype(np.float32)
    table[:, 3] *= 8  # an outlier column, as real tables have
    mid = (rng.standard_normal((H, H)) / np.sqrt(H)).astype(np.float32)
    head = table.T.copy() if tied != "none" else rng.standard_normal((H, V)).astype(np.float32)
    inits = [numpy_helper.from_array(mid, "model.mid.weight_t"), numpy_helper.from_array(head, "lm_head.MatMul.weight")]
    nodes = []
    if tied == "same":
        nodes.append(helper.make_node("Transpose", ["lm_head.MatMul.weight"], ["table_t"], name="/model/embed_tokens/Transpose",
                                      perm=[1, 0]))
        table_name = "table_t"
    else:
        inits.append(numpy_helper.from_array(table, "model.embed_tokens.weight"))
        table_name = "model.embed_tokens.weight"
    nodes += [
        helper.make_node("Gather", [table_name, "input_ids"], ["emb"], name="/model/embed_tokens/Gather"),
        helper.make_node("MatMul", ["emb", "model.mid.weight_t"], ["hidden"], name="/model/mid/MatMul"),
        helper.make_node("MatMul", ["hidden", "lm_head.MatMul.weight"], ["logits"], name="/lm_head/MatMul"),
    ]
    graph = helper.make_graph(nodes, "lookup", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "t"])],
                              [helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["b", "t", H]),
                               helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "t", V])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, path)
    return table


def _data(path, n=8, t=12):
    ids = np.random.default_rng(1).integers(0, V, (n, t)).astype(np.int64)
    np.savez(path, input_ids=ids)
    return ids


def _reference(table: np.ndarray, bits: int, strategy: str, symmetric: bool, group: int | None = None) -> np.ndarray:
    """compressed-tensors' fake-quantized table: qparams from min/max (memoryless min-max, the weight
    observer llm-compressor uses), computed here from the float table."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group)
    w = torch.from_numpy(table)
    rows = w.reshape(V, -1, group) if strategy == "group" else w.reshape(V, 1, H)
    lo = torch.clamp(rows.amin(dim=-1), max=0)
    hi = torch.clamp(rows.amax(dim=-1), min=0)
    scale, zp = calculate_qparams(lo, hi, args)
    if strategy == "channel":
        scale, zp = scale.reshape(V, 1), zp.reshape(V, 1)
    return fake_quantize(w, scale, zp, args).numpy()


def _run(model, ids, level=ort.GraphOptimizationLevel.ORT_ENABLE_BASIC):
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    return session.run(["emb", "logits"], {"input_ids": ids})


def _invoke(*args):
    return run_cli("run", *map(str, args))


SCHEMES = [  # (--scheme-for Embedding=..., bits, strategy, symmetric, group)
    ('{"weights": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel"}}', 8, "channel", True, None),
    ('{"weights": {"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group", "group_size": 32}}',
     4, "group", True, 32),
    ('{"weights": {"num_bits": 4, "type": "int", "symmetric": false, "strategy": "group", "group_size": 32}}',
     4, "group", False, 32),
    ('{"weights": {"num_bits": 8, "type": "int", "symmetric": false, "strategy": "group", "group_size": 16}}',
     8, "group", False, 16),
    ('{"weights": {"num_bits": 4, "type": "int", "symmetric": true, "strategy": "channel"}}', 4, "channel", True, None),
]


@pytest.mark.parametrize("target", ["onnxruntime", "qdq"])
@pytest.mark.parametrize("scheme,bits,strategy,symmetric,group", SCHEMES,
                         ids=["int8-row", "int4-g32", "int4-g32-asym", "int8-g16-asym", "int4-row"])
def test_a_quantized_table_gathers_compressed_tensors_rows(tmp_path, target, scheme, bits, strategy, symmetric, group):
    """GatherBlockQuantized (onnxruntime's kernel) and DequantizeLinear -> Gather return exactly the
    rows compressed-tensors' fake quantization gives the table."""
    table = _model(tmp_path / "m.onnx", tied="none")
    ids = _data(tmp_path / "d.npz")
    out = tmp_path / "out"
    result = _invoke(tmp_path / "m.onnx", "--data", tmp_path / "d.npz", "-o", out, "--scheme", "W4A16",
                     "--group-size", "32", "--scheme-for", f"Embedding={scheme}", "--target", target)
    assert result.exit_code == 0, result.output
    assert "quantized 1 MatMul/Gemm target and 1 embedding lookup with W4A16; left in float: lm_head" in result.output
    written = onnx.load(out / "model.onnx")
    ops = {n.op_type for n in written.graph.node}
    assert ("GatherBlockQuantized" in ops) == (target == "onnxruntime")
    assert "model.embed_tokens.weight" not in {i.name for i in written.graph.initializer}  # the float table is gone
    ref = _reference(table, bits, strategy, symmetric, group)[ids]
    for level in (ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        emb, _ = _run(out / "model.onnx", ids, level)
        np.testing.assert_allclose(emb, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tied", ["same", "copy"])
@pytest.mark.parametrize("target", ["onnxruntime", "qdq"])
def test_a_tied_table_is_stored_once_and_read_by_both(tmp_path, tied, target):
    """--lm-head with the same format for both: one quantized table, read by lm_head and the lookup
    (the builder's one initializer, or torch's two copies found equal); no float copy stays."""
    table = _model(tmp_path / "m.onnx", tied=tied)
    ids = _data(tmp_path / "d.npz")
    out = tmp_path / "out"
    flags = ["--matmulnbits", "0"] if target == "onnxruntime" else ["--target", "qdq"]
    result = _invoke(tmp_path / "m.onnx", "--data", tmp_path / "d.npz", "-o", out, "--scheme", "W4A16",
                     "--group-size", "32", "--scheme-for", "Embedding=W4A16", "--lm-head", *flags)
    assert result.exit_code == 0, result.output
    assert "tied to" not in result.output  # no "stored twice" note
    written = onnx.load(out / "model.onnx")
    inits = {i.name: i for i in written.graph.initializer}
    assert not [n for n, i in inits.items() if i.data_type == TensorProto.FLOAT and V * H in (np.prod(i.dims),)]
    quantized = [n for n, i in inits.items() if np.prod(i.dims) * (2 if i.data_type == TensorProto.UINT8 else 1) >= V * H]
    assert len(quantized) == 1, quantized  # one table
    readers = [n for n in written.graph.node if quantized[0] in n.input]
    if target == "onnxruntime":  # MatMulNBits and a Reshape into GatherBlockQuantized
        assert sorted(n.op_type for n in readers) == ["MatMulNBits", "Reshape"]
        assert any(n.op_type == "GatherBlockQuantized" for n in written.graph.node)
    else:  # one DequantizeLinear: lm_head reads it, the Gather through a Transpose
        assert [n.op_type for n in readers] == ["DequantizeLinear"]
        dq = readers[0].output[0]
        assert sorted(n.op_type for n in written.graph.node if dq in n.input) == ["MatMul", "Transpose"]
    ref = _reference(table, 4, "group", True, 32)
    emb, logits = _run(out / "model.onnx", ids)
    np.testing.assert_allclose(emb, ref[ids], rtol=1e-6, atol=1e-6)
    qp = json.loads((out / "quantization_config.json").read_text())
    assert any(g["targets"] == ["Embedding"] for g in qp["config_groups"].values())


def test_a_tie_given_two_formats_is_stored_twice_and_said(tmp_path):
    _model(tmp_path / "m.onnx", tied="same")
    _data(tmp_path / "d.npz")
    result = _invoke(tmp_path / "m.onnx", "--data", tmp_path / "d.npz", "-o", tmp_path / "out", "--scheme", "W4A16",
                     "--group-size", "32", "--scheme-for", "Embedding=W8A16", "--lm-head", "--matmulnbits")
    assert result.exit_code == 0, result.output
    assert "model.embed_tokens is tied to lm_head, but their schemes give them different formats: both tables are " \
           "stored" in result.output
    ops = [n.op_type for n in onnx.load(tmp_path / "out" / "model.onnx").graph.node]
    assert ops.count("GatherBlockQuantized") == 1 and "Reshape" not in ops


def test_a_tie_with_lm_head_in_float_is_said_with_the_flag_that_shares_it(tmp_path):
    _model(tmp_path / "m.onnx", tied="same")
    result = run_cli("inspect", str(tmp_path / "m.onnx"), "--scheme", "W4A16", "--group-size", "32",
                     "--scheme-for", "Embedding=W4A16")
    assert result.exit_code == 0, result.output
    assert "model.embed_tokens is tied to lm_head, which stays in float" in result.output
    assert "--lm-head quantizes lm_head" in result.output
    assert "lookup   model.embed_tokens (node /model/embed_tokens/Gather, table [300, 96]): quantized" in result.output


@pytest.mark.parametrize("args,fragment", [
    (["--scheme", "W4A8", "--targets", "Linear", "--targets", "Embedding"], "must be weight-only"),
    (["--scheme", "W8A16", "--scheme-for", 'Embedding={"weights": {"num_bits": 8, "type": "float", "strategy": '
      '"channel"}}'], "GatherBlockQuantized takes int4/int8 tables"),
    (["--scheme", "W8A16", "--scheme-for",
      'Embedding={"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 24}}'],
     "GatherBlockQuantized takes blocks of 16 or more, a power of two"),
    (["--scheme", "W8A16", "--scheme-for", "Embedding=W4A16", "--observer", "imatrix_mse"], "an embedding lookup has none"),
    (["--scheme", "W8A16", "--scheme-for", "Embedding"], "--scheme-for takes TARGET=SCHEME"),
])
def test_a_lookup_scheme_with_no_form_is_refused_before_any_pass(tmp_path, args, fragment):
    _model(tmp_path / "m.onnx", tied="none")
    _data(tmp_path / "d.npz")
    result = _invoke(tmp_path / "m.onnx", "--data", tmp_path / "d.npz", "-o", tmp_path / "out", "--group-size", "32",
                     *args)
    assert result.exit_code != 0
    assert fragment in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out" / "model.onnx").exists()


def test_the_summary_says_how_much_of_the_written_model_is_float(tmp_path):
    _model(tmp_path / "m.onnx", tied="none")
    _data(tmp_path / "d.npz")
    result = _invoke(tmp_path / "m.onnx", "--data", tmp_path / "d.npz", "-o", tmp_path / "out", "--scheme", "W8A16",
                     "--group-size", "32", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    written = onnx.load(tmp_path / "out" / "model.onnx")
    floats = sum(int(np.prod(i.dims)) * 4 for i in written.graph.initializer if i.data_type == TensorProto.FLOAT)
    assert summary["float_bytes"] == floats >= (V * H * 4) * 2  # the table and lm_head stay float
    assert summary["model_bytes"] == (tmp_path / "out" / "model.onnx").stat().st_size


@pytest.mark.parametrize("model,scheme", [("tiny-llama", "W8A16"), ("tiny-bert", "W8A16")])
def test_shipped_models_keep_their_outputs_with_int8_embeddings(tmp_path, model, scheme):
    """Accuracy on the shipped models: int8 tables (groups of 128 along the hidden size) cost the
    outputs' cosine to fp32 over held-out data less than 1e-4 beyond what the int8 linear layers cost
    (measured: tiny-bert's three tables 2e-5; a wrong row or scale costs well over 1e-2)."""
    src = f"models/{model}"
    outs = {}
    for label, extra in (("linear", []), ("all", ["--scheme-for", "Embedding=W8A16"])):
        out = tmp_path / label
        result = _invoke(f"{src}/model.onnx", "--data", f"{src}/calib.npz", "-o", out, "--scheme", scheme, *extra)
        assert result.exit_code == 0, result.output
        outs[label] = out / "model.onnx"
    data = dict(np.load(f"{src}/heldout.npz"))
    session = ort.InferenceSession(f"{src}/model.onnx", providers=["CPUExecutionProvider"])
    feeds = {i.name: data[i.name][:4] for i in session.get_inputs()}
    ref = session.run(None, feeds)[0].astype(np.float64).ravel()

    def cosine(path):
        got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        got = got.astype(np.float64).ravel()
        return float(ref @ got / np.linalg.norm(ref) / np.linalg.norm(got))

    linear, both = cosine(outs["linear"]), cosine(outs["all"])
    assert both > 0.9995 and linear - both < 1e-4
    assert "embedding lookup" in _invoke(f"{src}/model.onnx", "--data", f"{src}/calib.npz", "-o", tmp_path / "again",
                                         "--scheme", scheme, "--scheme-for", "Embedding=W8A16").output


def test_a_recipe_config_group_targets_embedding_as_llm_compressor_writes_it(tmp_path):
    _model(tmp_path / "m.onnx", tied="same")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(WHOLE_INT4_RECIPE)
    result = run_cli("inspect", str(tmp_path / "m.onnx"), "--recipe", str(recipe), "--matmulnbits")
    assert result.exit_code == 0, result.output
    assert "lookup   model.embed_tokens (node /model/embed_tokens/Gather, table [300, 96]): quantized, table; reads " \
           "lm_head's quantized weight (tied)" in result.output
