"""The shipped test models (models/) and graphcal.export's exporter forms.

* the shipped ONNX files pass the full checker, run in onnxruntime on their calibration data and
  match the torch models they were exported from;
* tools/make_models.py regenerates them byte for byte;
* the variant forms the rest of the suite relies on: dynamo (``node_linear_*`` with
  ``pkg.torch.onnx.name_scopes``) and no constant folding (``Transpose(weight)`` before MatMul).
"""

from __future__ import annotations

import zipfile

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tests.helpers import EXPORTER_CHATTER, MODELS

MODELS_DIR = MODELS
MODEL_NAMES = ["tiny-llama", "tiny-bert"]
INPUTS = {
    "tiny-llama": ["input_ids", "attention_mask"],
    "tiny-bert": ["input_ids", "attention_mask", "token_type_ids"],
}
OUTPUTS = {
    "tiny-llama": ["logits"],
    "tiny-bert": ["last_hidden_state", "pooler_output"],
}
NAME_SCOPES = "pkg.torch.onnx.name_scopes"

pytestmark = EXPORTER_CHATTER  # known, harmless exporter warnings


@pytest.fixture(scope="module")
def make_models():
    from tools import make_models

    return make_models


_BUILT: dict = {}


def _built(name):
    """(model, example_inputs, output_names, dynamic_axes), built once per test session."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    if name not in _BUILT:
        from tools.builders import build_tiny_bert, build_tiny_llama

        _BUILT[name] = {"tiny-llama": build_tiny_llama, "tiny-bert": build_tiny_bert}[name]()
    return _BUILT[name]


def _session(path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _producers(model: onnx.ModelProto) -> dict:
    return {out: node for node in model.graph.node for out in node.output}


def _initializers(model: onnx.ModelProto) -> dict:
    return {init.name: init for init in model.graph.initializer}


def _torch_outputs(model, feeds: dict, output_names):
    import torch

    with torch.no_grad():
        result = model(**{k: torch.from_numpy(v) for k, v in feeds.items()})
    return [getattr(result, n).numpy() for n in output_names]


# ------------------------------------------------------------------------------------------
# Shipped files
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_shipped_model_is_valid(name):
    path = MODELS_DIR / name / "model.onnx"
    assert path.stat().st_size < 2_000_000  # small enough to ship in the repository
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version <= 10
    assert {o.domain: o.version for o in model.opset_import}[""] == 17
    assert [i.name for i in model.graph.input] == INPUTS[name]
    assert [o.name for o in model.graph.output] == OUTPUTS[name]
    for inp in model.graph.input:
        assert inp.type.tensor_type.elem_type == onnx.TensorProto.INT64
        assert [d.dim_param for d in inp.type.tensor_type.shape.dim] == ["batch", "seq"]
    # weights are inside the file, not external data
    assert not any(
        init.data_location == onnx.TensorProto.EXTERNAL for init in model.graph.initializer
    )


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("split, samples", [("calib", 64), ("heldout", 16)])
def test_shipped_data_layout(name, split, samples):
    path = MODELS_DIR / name / f"{split}.npz"
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        assert [i.filename for i in infos] == sorted(n + ".npy" for n in INPUTS[name])
        assert all(i.date_time == (1980, 1, 1, 0, 0, 0) for i in infos)
    with np.load(path) as data:
        assert sorted(data.files) == sorted(INPUTS[name])
        for key in data.files:
            arr = data[key]
            assert arr.dtype == np.int64 and arr.shape == (samples, 32), key
        assert data["input_ids"].min() >= 0 and data["input_ids"].max() < 256
        assert len(np.unique(data["input_ids"])) > 100  # random tokens, not a constant
        assert (data["attention_mask"] == 1).all()
        if "token_type_ids" in data.files:
            assert (data["token_type_ids"] == 0).all()


def test_calib_and_heldout_differ():
    for name in MODEL_NAMES:
        with np.load(MODELS_DIR / name / "calib.npz") as c, np.load(
            MODELS_DIR / name / "heldout.npz"
        ) as h:
            assert not np.array_equal(c["input_ids"][:16], h["input_ids"])


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_shipped_model_matches_torch(name):
    model, _, output_names, _ = _built(name)
    sess = _session(MODELS_DIR / name / "model.onnx")
    for split in ("calib", "heldout"):
        with np.load(MODELS_DIR / name / f"{split}.npz") as data:
            feeds = {k: data[k] for k in data.files}
        got = sess.run(output_names, feeds)
        want = _torch_outputs(model, feeds, output_names)
        for out_name, g, w in zip(output_names, got, want):
            assert g.shape == w.shape, out_name
            np.testing.assert_allclose(g, w, atol=1e-4, rtol=0, err_msg=f"{name} {split} {out_name}")


def test_shipped_llama_is_deployed_form():
    """Folded [in, out] weights named onnx::MatMul_*, nodes named by module path."""
    model, _, _, _ = _built("tiny-llama")
    proto = onnx.load(str(MODELS_DIR / "tiny-llama" / "model.onnx"))
    inits = _initializers(proto)
    nodes = {n.name: n for n in proto.graph.node}
    for proj, (out_f, in_f) in {"q_proj": (128, 128), "k_proj": (64, 128), "v_proj": (64, 128),
                                "o_proj": (128, 128)}.items():
        node = nodes[f"/model/layers.0/self_attn/{proj}/MatMul"]
        assert node.op_type == "MatMul"
        w_name = node.input[1]
        assert w_name.startswith("onnx::MatMul_"), w_name
        w = numpy_helper.to_array(inits[w_name])
        assert w.shape == (in_f, out_f)
        torch_w = getattr(model.model.layers[0].self_attn, proj).weight.detach().numpy()
        np.testing.assert_array_equal(w, torch_w.T)
    assert nodes["/lm_head/MatMul"].op_type == "MatMul"
    assert "/model/layers.1/mlp/down_proj/MatMul" in nodes


def test_shipped_bert_has_gemm_pooler():
    proto = onnx.load(str(MODELS_DIR / "tiny-bert" / "model.onnx"))
    gemms = [n for n in proto.graph.node if n.op_type == "Gemm"]
    assert [n.name for n in gemms] == ["/pooler/dense/Gemm"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gemms[0].attribute}
    assert attrs.get("transB") == 1
    assert gemms[0].input[1] == "pooler.dense.weight"
    assert list(_initializers(proto)["pooler.dense.weight"].dims) == [128, 128]
    matmuls = {n.name for n in proto.graph.node if n.op_type == "MatMul"}
    assert "/encoder/layer.0/attention/self/query/MatMul" in matmuls
    assert "/encoder/layer.1/output/dense/MatMul" in matmuls


# ------------------------------------------------------------------------------------------
# Regeneration
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_make_models_is_byte_reproducible(name, make_models, tmp_path):
    pytest.importorskip("transformers")
    make_models.make_model(name, tmp_path / name)
    assert make_models.compare(tmp_path, MODELS_DIR, [name]) == []


def test_save_npz_is_deterministic(make_models, tmp_path):
    arrays = {"b": np.arange(6, dtype=np.int64).reshape(2, 3), "a": np.zeros((2, 3), np.int64)}
    p1 = make_models.save_npz(tmp_path / "x.npz", arrays)
    first = p1.read_bytes()
    p2 = make_models.save_npz(tmp_path / "y.npz", dict(reversed(arrays.items())))
    assert p2.read_bytes() == first
    with np.load(p2) as data:
        assert data.files == ["a", "b"]
        np.testing.assert_array_equal(data["b"], arrays["b"])


# ------------------------------------------------------------------------------------------
# Variant forms exported at test time
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_export_restores_forward_and_keeps_module_names(tmp_path):
    from graphcal.export import export_torch

    model, inputs, output_names, dynamic_axes = _built("tiny-llama")
    assert "forward" not in vars(model)
    path = export_torch(model, inputs, tmp_path / "m.onnx", output_names=output_names,
                        dynamic_axes=dynamic_axes)
    assert "forward" not in vars(model)
    assert not model.training
    # same bytes as the shipped file, and as a second export
    assert path.read_bytes() == (MODELS_DIR / "tiny-llama" / "model.onnx").read_bytes()
    names = {n.name for n in onnx.load(str(path)).graph.node}
    assert "/model/layers.0/self_attn/q_proj/MatMul" in names
    with pytest.raises(ValueError):
        export_torch(model, inputs, tmp_path / "d.onnx", output_names=output_names,
                     dynamo=True, opset=17)


@pytest.mark.slow
def test_dynamo_form_llama(tmp_path):
    from graphcal.export import export_torch

    model, inputs, output_names, _ = _built("tiny-llama")
    p1 = export_torch(model, inputs, tmp_path / "a.onnx", output_names=output_names,
                      dynamo=True, opset=18)
    p2 = export_torch(model, inputs, tmp_path / "b.onnx", output_names=output_names,
                      dynamo=True, opset=18)
    assert p1.read_bytes() == p2.read_bytes()
    assert "forward" not in vars(model)

    proto = onnx.load(str(p1))
    onnx.checker.check_model(proto, full_check=True)
    assert proto.ir_version <= 10
    assert [i.name for i in proto.graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in proto.graph.output] == ["logits"]

    linear = [n for n in proto.graph.node if n.op_type == "MatMul" and n.name.startswith("node_linear")]
    assert len(linear) == 2 * 7 + 1  # q k v o gate up down per layer, plus lm_head
    scopes = {}
    for node in linear:
        meta = {p.key: p.value for p in node.metadata_props}
        assert NAME_SCOPES in meta, node.name
        scopes[node.name] = meta[NAME_SCOPES]
    joined = "\n".join(scopes.values())
    for path in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                 "model.layers.1.mlp.down_proj", "lm_head"):
        assert f"'{path}'" in joined, path
    first = next(n for n in linear if n.name == "node_linear")
    assert "'model.layers.0.self_attn.q_proj'" in scopes[first.name]

    feeds = {k: v.numpy() for k, v in inputs.items()}
    got = _session(p1).run(output_names, feeds)
    want = _torch_outputs(model, feeds, output_names)
    np.testing.assert_allclose(got[0], want[0], atol=1e-4, rtol=0)


@pytest.mark.slow
def test_dynamo_form_bert_name_scopes(tmp_path):
    from graphcal.export import export_torch

    model, inputs, output_names, _ = _built("tiny-bert")
    path = export_torch(model, inputs, tmp_path / "m.onnx", output_names=output_names,
                        dynamo=True, opset=18)
    proto = onnx.load(str(path))
    scopes = [
        {p.key: p.value for p in n.metadata_props}.get(NAME_SCOPES, "")
        for n in proto.graph.node
        if n.op_type in ("MatMul", "Gemm")
    ]
    joined = "\n".join(scopes)
    for module in ("encoder.layer.0.attention.self.query", "encoder.layer.1.output.dense",
                   "pooler.dense"):
        assert f"'{module}'" in joined, module
    feeds = {k: v.numpy() for k, v in inputs.items()}
    got = _session(path).run(output_names, feeds)
    for g, w in zip(got, _torch_outputs(model, feeds, output_names)):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, weight, matmul, shape",
    [
        ("tiny-llama", "model.layers.0.self_attn.q_proj.weight",
         "/model/layers.0/self_attn/q_proj/MatMul", (128, 128)),
        ("tiny-llama", "model.layers.0.self_attn.k_proj.weight",
         "/model/layers.0/self_attn/k_proj/MatMul", (64, 128)),
        ("tiny-bert", "encoder.layer.0.intermediate.dense.weight",
         "/encoder/layer.0/intermediate/dense/MatMul", (256, 128)),
    ],
)
def test_unfolded_form_has_transpose(name, weight, matmul, shape, tmp_path):
    from graphcal.export import export_torch

    model, inputs, output_names, dynamic_axes = _built(name)
    path = export_torch(model, inputs, tmp_path / "m.onnx", output_names=output_names,
                        dynamic_axes=dynamic_axes, constant_folding=False)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    inits = _initializers(proto)
    producers = _producers(proto)
    node = next(n for n in proto.graph.node if n.name == matmul)
    assert node.op_type == "MatMul"
    transpose = producers[node.input[1]]
    assert transpose.op_type == "Transpose"
    assert list(transpose.input) == [weight]
    perm = {a.name: onnx.helper.get_attribute_value(a) for a in transpose.attribute}.get("perm")
    assert perm in (None, [1, 0])
    assert tuple(inits[weight].dims) == shape  # torch layout [out, in]
    torch_w = dict(model.named_parameters())[weight].detach().numpy()
    np.testing.assert_array_equal(numpy_helper.to_array(inits[weight]), torch_w)

    feeds = {k: v.numpy() for k, v in inputs.items()}
    got = _session(path).run(output_names, feeds)
    for g, w in zip(got, _torch_outputs(model, feeds, output_names)):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=0)
