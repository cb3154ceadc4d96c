"""--rotate: the residual stream rotated and folded into the weights, the fp32 model's outputs unchanged.

References: onnxruntime (ORT_ENABLE_BASIC) running the model before and after the rotation, and
numpy's own products for the matrices. The norm scales are made non-trivial first (the shipped
models' are all ones), so folding them into the weights after them is exercised.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import torch
from compressed_tensors.transform import TransformConfig, apply_transform_config
from compressed_tensors.transform.factory.matrix_multiply import RandomMatrixFactory
from onnx import numpy_helper
from torch.nn import Parameter

from graphcal.algorithms.rotation.fold import METADATA_KEY, rotate
from graphcal.algorithms.rotation.hadamard import hadamard, orthogonal
from graphcal.errors import GraphcalError
from graphcal.graph.attention import find_kv_states
from graphcal.graph.io import load_model, save_model, unchecked_ops
from graphcal.graph.targets import find_targets
from graphcal.graph.weight_path import weight_as_consumed
from graphcal.runtime import run_model
from tests.conftest import MODELS
from tests.helpers import run_cli


@pytest.mark.parametrize("n", [1, 2, 12, 20, 36, 64, 128, 576, 768, 960, 1536, 2048])
def test_hadamard_matrices_are_hadamard_and_their_normal_forms_orthogonal(n):
    h = hadamard(n)
    assert h is not None and set(np.unique(h)) <= {-1, 1}
    np.testing.assert_array_equal(h @ h.T, n * np.eye(n, dtype=np.int64))
    q, how = orthogonal(n)
    assert how == f"Hadamard {n}"
    np.testing.assert_allclose(q @ q.T, np.eye(n), atol=1e-12)


def test_widths_without_a_hadamard_matrix_take_a_seeded_random_orthogonal_one():
    assert hadamard(100) is None and hadamard(3) is None
    q, how = orthogonal(100, seed=7)
    assert how == "random orthogonal 100 (seed 7)"
    np.testing.assert_allclose(q @ q.T, np.eye(100), atol=1e-12)
    np.testing.assert_array_equal(q, orthogonal(100, seed=7)[0])
    assert not np.allclose(q, orthogonal(100, seed=8)[0])


def _random_scales(model: onnx.ModelProto, names, rng) -> None:
    """Give the norm scales in ``names`` random positive values (in place)."""
    for t in model.graph.initializer:
        if t.name in names:
            value = numpy_helper.to_array(t)
            t.CopyFrom(numpy_helper.from_array(rng.uniform(0.5, 2.0, value.shape).astype(value.dtype), t.name))


@pytest.mark.parametrize("kind, matrix", [("hadamard", "Hadamard 128"),
                                          ("random-hadamard", "Hadamard 128, random signs (seed 0)"),
                                          ("random-matrix", "random orthogonal 128 (seed 0)")])
def test_a_torch_export_rotated_computes_what_it_did(llama_dir, tmp_path, kind, matrix):
    rng = np.random.default_rng(0)
    model = load_model(llama_dir / "model.onnx")
    _random_scales(model, {"model.layers.0.input_layernorm.weight"}, rng)  # every norm reads it (Identity)
    original = tmp_path / "original.onnx"
    save_model(model, original)
    rotated = load_model(original)
    report = rotate(rotated, str(tmp_path), kind=kind)
    assert report.matrix == matrix and report.norms == 5 and report.untied == []
    # the embedding, 2 x (o_proj, down_proj) writing, 2 x (q, k, v, gate, up) and lm_head reading
    assert len(report.rotated) == 1 + 4 + 11
    # R2 too: each v_proj's 2 value heads and its o_proj's rows for the 4 query heads (grouped-query attention)
    assert report.heads == 2 and report.head_writes == [f"model.layers.{i}.self_attn.v_proj" for i in (0, 1)]
    assert report.head_dim == 32 and report.head_matrix == matrix.replace("128", "32")
    feeds = {k: v[:4] for k, v in np.load(llama_dir / "heldout.npz").items()}
    want = run_model(original, feeds, ["logits"])["logits"]
    got = run_model(rotated, feeds, ["logits"])["logits"]
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
    embed = next(t for t in rotated.graph.initializer if t.name.startswith("model.embed_tokens.rotated"))
    before = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "model.embed_tokens.weight"))
    np.testing.assert_allclose(numpy_helper.to_array(embed), before @ orthogonal(128, 0, kind)[0], atol=1e-6)


def _as_torch_modules(model: onnx.ModelProto, folder) -> dict[str, np.ndarray]:
    """{module name: weight as torch lays it out}: Linear [out, in], the embedding table [vocab, hidden]."""
    inits, nodes = {t.name: t for t in model.graph.initializer}, {n.name: n for n in model.graph.node}
    out = {t.name: weight_as_consumed(inits[t.weight], [nodes[n] for n in t.weight_path], inits, str(folder))
           for t in find_targets(model)[0]}
    out = {name: w.T for name, w in out.items()}  # torch's exporter writes x W: [in, out]
    lookup = next(n for n in model.graph.node if n.op_type == "Gather")
    out["model.embed_tokens"] = numpy_helper.to_array(inits[lookup.input[0]])
    return out


R1_R2_RECIPE = """
quant_stage:
  quant_modifiers:
    SpinQuantModifier: {rotations: [R1, R2], transform_type: %s}
    QuantizationModifier: {targets: [Linear], ignore: [lm_head], scheme: W8A16}
"""


@pytest.mark.parametrize("kind", ["hadamard", "random-matrix"])
def test_compressed_tensors_applying_the_recorded_transform_config_gives_the_rotated_weights(
        llama_dir, tmp_path, monkeypatch, kind):
    """A rotated run records compressed-tensors' transform_config. compressed-tensors itself applies
    it (its factories fuse weight transforms into torch modules) to the unrotated weights, and gets
    the weights graphcal rotated: R1 over the hidden width and R2 per value head (v_proj's 2 heads,
    o_proj's 4 query heads). Hadamard: compressed-tensors builds its own matrices of orders 128 and
    32 (Sylvester's, as graphcal's). random-matrix: its factory draws matrices of its own, so it is
    handed graphcal's orthogonal ones, and its transposes and inverses check the locations and
    ``inverse`` flags where a symmetric Hadamard matrix could not. The shipped model's norm scales
    are ones: the config folds none."""
    recipe = tmp_path / "r1r2.yaml"
    recipe.write_text(R1_R2_RECIPE % kind)
    out = tmp_path / "out"
    result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--recipe", recipe,
                     "-o", out, "-q")
    assert result.exit_code == 0, result.output
    recorded = json.loads((out / "quantization_config.json").read_text())["transform_config"]
    config = TransformConfig.model_validate(recorded)
    assert list(config.config_groups) == ["R1", "R2"] and {g.type for g in config.config_groups.values()} == {kind}
    assert config.config_groups["R2"].head_dim == 32
    before = load_model(llama_dir / "model.onnx")
    rotated = load_model(llama_dir / "model.onnx")
    rotate(rotated, str(llama_dir), kind=kind)
    want = _as_torch_modules(rotated, llama_dir)
    monkeypatch.setattr(RandomMatrixFactory, "_create_weight", lambda self, size, device, precision: Parameter(
        torch.tensor(orthogonal(size, 0, kind)[0])))
    root = torch.nn.Module()
    for name, w in _as_torch_modules(before, llama_dir).items():
        *path, leaf = name.split(".")
        parent = root
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        module = (torch.nn.Embedding(*w.shape) if name == "model.embed_tokens"
                  else torch.nn.Linear(w.shape[1], w.shape[0], bias=False))
        module.weight.data = torch.tensor(w)
        parent.add_module(leaf, module)
    apply_transform_config(root, config)
    modules = dict(root.named_modules())
    assert len(want) == 16
    for name, w in want.items():
        np.testing.assert_allclose(modules[name].weight.detach().numpy(), w, rtol=0, atol=1e-6 * np.abs(w).max(),
                                   err_msg=name)


def test_a_run_without_a_rotation_records_an_empty_transform_config(llama_dir, tmp_path):
    """As compressed-tensors writes it for a model with no transform."""
    result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--scheme", "W8A16",
                     "-o", tmp_path / "out", "-q")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out" / "quantization_config.json").read_text())["transform_config"] == {}


def _tied_with_random_scales(folder, dest, rng):
    """The tied builder model with random norm scales, saved into ``dest`` (the folder's other files copied)."""
    model = load_model(folder / "model.onnx")
    scales = {n.input[2] if n.op_type == "SkipSimplifiedLayerNormalization" else n.input[1]
              for n in model.graph.node if "SimplifiedLayerNormalization" in n.op_type}
    _random_scales(model, scales, rng)
    shutil.copytree(folder, dest)
    save_model(model, dest / "model.onnx", external=True, unchecked=unchecked_ops(model))
    return model


def _same_function(reference, rotated, calib, tmp_path):
    """``rotated`` (a ModelProto) computes what ``reference`` (a model file) does: logits and keys to
    float rounding through graphcal eval, and a decode step over each model's own cache."""
    shutil.copytree(reference.parent, tmp_path / "rotated", ignore=shutil.ignore_patterns("model.onnx*"))
    save_model(rotated, tmp_path / "rotated" / "model.onnx", external=True, unchecked=unchecked_ops(rotated))
    result = run_cli("eval", reference, tmp_path / "rotated" / "model.onnx", "--data", calib, "--json")
    assert result.exit_code == 0, result.output
    outputs = {o["name"]: o["sqnr_db"] for o in json.loads(result.output.strip().splitlines()[-1])["outputs"]}
    for name, sqnr in outputs.items():  # float rounding only, except the values R2 turned per head
        assert (sqnr is None or sqnr > 100) == (".value" not in name), (name, sqnr)
    # a decode step over each model's own cache: the turned values give the same next logits
    ids = np.load(calib)["input_ids"][:2]
    want, got = (_prefill_then_step(m, ids) for m in (reference, tmp_path / "rotated" / "model.onnx"))
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)


def test_a_tied_builder_model_rotated_generates_the_same_logits_and_stays_tied(tied_builder_model, tmp_path):
    """The builder's tie (lm_head reads the table, the lookup reads it through a Transpose) is kept:
    one table ``E Q``, and the final norm's scale in a 64 x 64 MatMul before lm_head."""
    folder, calib = tied_builder_model
    original = _tied_with_random_scales(folder, tmp_path / "fp32", np.random.default_rng(1))
    table = next(n for n in original.graph.node if n.name == "/lm_head/MatMul").input[1]
    e = numpy_helper.to_array(next(t for t in original.graph.initializer if t.name == table)).T  # [vocab, hidden]
    rotated = load_model(tmp_path / "fp32" / "model.onnx")
    report = rotate(rotated, str(tmp_path / "fp32"))
    assert report.untied == [] and report.kept_tied == [table]
    assert report.bytes_after - report.bytes_before == 64 * 64 * 4  # the scale's MatMul, not a second table
    assert report.heads == 2 and report.head_matrix == "Hadamard 16"  # R2 in both blocks: 4 heads, 2 kv heads of 16
    nodes = {n.name: n for n in rotated.graph.node}
    (scale_node,) = report.scale_nodes
    lm_head = nodes["/lm_head/MatMul"]
    assert lm_head.input[0] == nodes[scale_node].output[0]
    shared = lm_head.input[1]
    readers = [n for n in rotated.graph.node if shared in n.input]
    assert sorted(n.op_type for n in readers) == ["MatMul", "Transpose"]  # still one table for both
    value = numpy_helper.to_array(next(t for t in rotated.graph.initializer if t.name == shared), str(tmp_path / "fp32"))
    np.testing.assert_allclose(value.T, e.astype(np.float64) @ orthogonal(64)[0], atol=1e-6)  # numpy's E Q
    _same_function(tmp_path / "fp32" / "model.onnx", rotated, calib, tmp_path)


def test_a_tie_lm_head_reads_through_a_transpose_is_untied(tied_builder_model, tmp_path):
    """Where lm_head reads the shared table through a layout path, the table is stored twice (the cost said)."""
    folder, calib = tied_builder_model
    model = _tied_with_random_scales(folder, tmp_path / "src", np.random.default_rng(2))
    lm_head = next(n for n in model.graph.node if n.name == "/lm_head/MatMul")
    table = lm_head.input[1]
    init = next(t for t in model.graph.initializer if t.name == table)
    to_gather = next(n for n in model.graph.node if n.op_type == "Transpose" and n.input[0] == table)
    init.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(init, str(tmp_path / "src")).T),
                                          table))  # stored [vocab, hidden]: the lookup reads it as is
    gather = next(n for n in model.graph.node if to_gather.output[0] in n.input)
    gather.input[0] = table
    model.graph.node.remove(to_gather)
    to_lm_head = onnx.helper.make_node("Transpose", [table], ["lm_head_table_t"], name="/lm_head/Transpose", perm=[1, 0])
    lm_head.input[1] = "lm_head_table_t"
    model.graph.node.insert(list(model.graph.node).index(lm_head), to_lm_head)
    shutil.copytree(folder, tmp_path / "fp32")
    save_model(model, tmp_path / "fp32" / "model.onnx", external=True, unchecked=unchecked_ops(model))
    rotated = load_model(tmp_path / "fp32" / "model.onnx")
    report = rotate(rotated, str(tmp_path / "fp32"))
    assert report.untied == [table] and report.kept_tied == [] and report.scale_nodes == []
    assert report.bytes_after - report.bytes_before == 256 * 64 * 4  # one more fp32 table
    _same_function(tmp_path / "fp32" / "model.onnx", rotated, calib, tmp_path)


def test_a_kept_tie_quantizes_as_one_table_and_its_scale_stays_float(tied_builder_model, tmp_path):
    """The whole tied model rotated and quantized: the lookup reads lm_head's MatMulNBits bytes, as
    without a rotation, and the rotation's own small MatMul is left in float."""
    folder, calib = tied_builder_model
    _tied_with_random_scales(folder, tmp_path / "src", np.random.default_rng(3))
    folder, out = tmp_path / "src", tmp_path / "out"
    result = run_cli("run", folder / "model.onnx", "--data", calib, "--scheme", "W4A16", "--group-size", "32",
                     "--lm-head", "--scheme-for", "Embedding=W4A16", "--matmulnbits", "--rotate", "R1", "-o", out)
    assert result.exit_code == 0, result.output
    assert "stored twice" not in result.output  # the untie warning
    assert ("rotated the residual stream first (Hadamard 64; R1): 12 weights and 5 norm scales folded; 1 table kept "
            "tied to lm_head (a 64x64 float MatMul before lm_head takes the final norm's scale)") in result.output
    written = onnx.load(out / "model.onnx", load_external_data=False)
    ops = {n.name: n for n in written.graph.node}
    gather = next(n for n in written.graph.node if n.op_type == "GatherBlockQuantized")
    lm_head = ops["/lm_head/MatMul"]
    reshape = next(n for n in written.graph.node if n.output[0] == gather.input[0])
    assert lm_head.op_type == "MatMulNBits" and reshape.input[0] == lm_head.input[1]  # one int4 table
    assert gather.input[2] == lm_head.input[2]  # and its scales
    record = json.loads(next(p.value for p in written.metadata_props if p.key == METADATA_KEY))
    (scale_node,) = record["scale_nodes"]
    assert len(record["kept_tied"]) == 1 and record["untied"] == []
    assert ops[scale_node].op_type == "MatMul"  # float: not quantized
    result = run_cli("eval", folder / "model.onnx", out / "model.onnx", "--data", calib, "--json")
    assert result.exit_code == 0, result.output
    logits = next(o for o in json.loads(result.output.strip().splitlines()[-1])["outputs"] if o["name"] == "logits")
    assert logits["sqnr_db"] > 10  # a quantized model of the same function (broken: about 0 dB)


def _prefill_then_step(model, ids: np.ndarray) -> np.ndarray:
    """The logits of one decode step after a prefill of ``ids``, the model fed its own KV cache."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    pasts = [i.name for i in session.get_inputs() if i.name.startswith("past_key_values")]
    rows, seq = ids.shape
    feeds = {"input_ids": ids.astype(np.int64), "attention_mask": np.ones((rows, seq), np.int64),
             **{p: np.zeros((rows, 2, 0, 16), np.float32) for p in pasts}}
    names = ["logits", *(p.replace("past_key_values", "present") for p in pasts)]
    out = dict(zip(names, session.run(names, feeds)))
    step = {"input_ids": ids[:, -1:].astype(np.int64), "attention_mask": np.ones((rows, seq + 1), np.int64),
            **{p: out[p.replace("past_key_values", "present")] for p in pasts}}
    return session.run(["logits"], step)[0]


def test_an_encoder_with_layernorm_is_refused_in_one_line(bert_dir, tmp_path):
    with pytest.raises(GraphcalError, match="LayerNormalization .* reads the residual stream"):
        rotate(load_model(bert_dir / "model.onnx"), str(bert_dir))
    result = run_cli("run", bert_dir / "model.onnx", "--data", bert_dir / "calib.npz", "--rotate", "-o", tmp_path / "o")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1].startswith("error: LayerNormalization")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("extra", [[], ["--smoothquant"], ["--algorithm", "gptq"], ["--algorithm", "awq"]])
def test_run_rotate_composes_and_records_the_rotation(llama_dir, tmp_path, extra):
    before = (llama_dir / "model.onnx").read_bytes()
    out = tmp_path / "out"
    scheme = "W8A8_STATIC" if extra == ["--smoothquant"] else "W4A16"
    result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--scheme", scheme, "--rotate",
                     "-o", out, "-q", *extra)
    assert result.exit_code == 0, result.output
    assert (llama_dir / "model.onnx").read_bytes() == before  # the input is never modified
    written = onnx.load(out / "model.onnx")
    record = json.loads(next(p.value for p in written.metadata_props if p.key == METADATA_KEY))
    assert record["matrix"] == "Hadamard 128" and record["weights"] == 16 and record["norms"] == 5
    result = run_cli("eval", llama_dir / "model.onnx", out / "model.onnx", "--data", llama_dir / "heldout.npz", "--json")
    assert result.exit_code == 0, result.output
    floor = 25 if scheme == "W8A8_STATIC" else 12  # unrotated: 30.8 and 13.4 dB on these random weights
    assert json.loads(result.output)["outputs"][0]["sqnr_db"] > floor  # a quantized model of the same function


def test_rotations_are_chosen_by_spinquants_names(tied_builder_model, tmp_path):
    folder, calib = tied_builder_model
    for value, heads in (("R1", 0), ("r1,R2", 2)):
        out = tmp_path / value.replace(",", "")
        result = run_cli("run", folder / "model.onnx", "--data", calib, "--scheme", "W8A16", "--group-size", "32",
                         "--rotate", value, "-o", out, "-q")
        assert result.exit_code == 0, result.output
        written = onnx.load(out / "model.onnx", load_external_data=False)
        assert json.loads(next(p.value for p in written.metadata_props if p.key == METADATA_KEY))["heads"] == heads
    for bad in ("R3", "R2", "R1,R5"):
        result = run_cli("run", folder / "model.onnx", "--data", calib, "--rotate", bad, "-o", tmp_path / "bad")
        assert result.exit_code == 2 and "--rotate takes R1 or R1,R2" in result.output.strip().splitlines()[-1]


SPINQUANT_RECIPE = """
quant_stage:
  quant_modifiers:
    SpinQuantModifier: {rotations: [R1, R2], transform_type: %s}
    QuantizationModifier: {targets: [Linear], ignore: [lm_head], scheme: W8A8}
"""


def test_a_spinquant_recipe_folds_its_rotations_as_rotate_does(tied_builder_model, tmp_path):
    """llm-compressor's SpinQuantModifier in a recipe: R1 and R2 by its transform type, folded in
    before calibrating, recorded as --rotate records them."""
    folder, calib = tied_builder_model
    for kind, matrix in (("hadamard", "Hadamard 64"), ("random-matrix", "random orthogonal 64 (seed 0)")):
        recipe = tmp_path / f"{kind}.yaml"
        recipe.write_text(SPINQUANT_RECIPE % kind)
        out = tmp_path / kind
        result = run_cli("run", folder / "model.onnx", "--data", calib, "--recipe", recipe, "-o", out, "-q")
        assert result.exit_code == 0, result.output
        written = onnx.load(out / "model.onnx", load_external_data=False)
        record = json.loads(next(p.value for p in written.metadata_props if p.key == METADATA_KEY))
        assert record["matrix"] == matrix and record["heads"] == 2, record
        # R2 turns only the packed qkv_proj's value columns, which compressed-tensors cannot say: R1 alone
        groups = json.loads((out / "quantization_config.json").read_text())["transform_config"]["config_groups"]
        assert list(groups) == ["R1"] and groups["R1"]["type"] == kind
        assert {a["location"] for a in groups["R1"]["apply"]} == {"weight_input", "weight_output"}


@pytest.mark.parametrize("body, message", [
    ("{rotations: [R1, R3]}", "rotations R3 are online"),
    ("{rotations: [R2]}", "rotations must be [R1] or [R1, R2]"),
    ("{randomize: true}", "randomize: true is not supported"),
    ("{transform_block_size: 32}", "transform_block_size is not supported"),
    ("{transform_type: givens}", "transform_type: Input should be 'hadamard'"),
    ("{rotation: [R1]}", "SpinQuantModifier.rotation: Extra inputs are not permitted"),
])
def test_what_a_spinquant_recipe_asks_that_graphcal_cannot_fold_is_refused(llama_dir, tmp_path, body, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(SPINQUANT_RECIPE.replace("{rotations: [R1, R2], transform_type: %s}", body))
    result = run_cli("inspect", llama_dir / "model.onnx", "--recipe", recipe)
    assert result.exit_code == 2 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_spinquant_modifier_after_the_quantizer_is_refused(llama_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("quant_stage:\n  quant_modifiers:\n    QuantizationModifier: {targets: [Linear], scheme: W8A16}\n"
                      "    SpinQuantModifier: {rotations: [R1]}\n")
    result = run_cli("inspect", llama_dir / "model.onnx", "--recipe", recipe)
    assert result.exit_code == 2 and "comes after the modifier that quantizes" in result.output, result.output


def _json(result):
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


def test_eval_measures_a_rotated_model_layer_by_layer_against_its_unrotated_fp32(llama_dir, tmp_path):
    """eval rotates the fp32 reference as the quantized models were: every layer's output compares in
    one basis, and a mix chosen with --fallback, pasted into run with --rotate, gives the SQNR eval
    predicted (round to nearest: a layer's qparams do not depend on the others)."""
    calib, heldout = llama_dir / "calib.npz", llama_dir / "heldout.npz"
    for scheme in ("W4A16", "W8A16"):
        _json(run_cli("run", llama_dir / "model.onnx", "--data", calib, "--scheme", scheme, "--lm-head", "--rotate", "R1",
                      "-o", tmp_path / scheme, "-q", "--json"))
    low, high = tmp_path / "W4A16" / "model.onnx", tmp_path / "W8A16" / "model.onnx"
    report = _json(run_cli("eval", llama_dir / "model.onnx", low, "--data", heldout, "--json"))
    layers = {layer["name"]: layer["sqnr_db"] for layer in report["layers"]}
    assert len(layers) == 15 and min(layers.values()) > 8  # measured 9.9-19.2 dB; unrotated fp32: writers ~0 dB
    low_bytes = sum(f.stat().st_size for f in low.parent.glob("model.onnx*"))
    mix = _json(run_cli("eval", llama_dir / "model.onnx", low, "--data", heldout, "--json", "--fallback", high,
                        "--size-budget", (low_bytes + 60_000) / 1e6, "--per-layer"))["mix"]
    assert 0 < sum(u["chosen"] for u in mix["units"]) < len(mix["units"])
    predicted = mix["expected_outputs"][0]["sqnr_db"]
    assert predicted > mix["low_sqnr_db"] + 2
    _json(run_cli("run", llama_dir / "model.onnx", "--data", calib, "--scheme", "W4A16", "--lm-head", "--rotate", "R1",
                  "-o", tmp_path / "mixed", "-q", "--json", *mix["flags"]))
    measured = _json(run_cli("eval", llama_dir / "model.onnx", tmp_path / "mixed" / "model.onnx", "--data", heldout,
                             "--json"))["outputs"][0]["sqnr_db"]
    assert measured == pytest.approx(predicted, abs=0.05)
    sensitivity = _json(run_cli("eval", llama_dir / "model.onnx", low, "--data", heldout, "--json", "--sensitivity"))
    assert sensitivity["sensitivity"]["alone"]  # each kind measured (it swaps layers between the two)


def test_models_rotated_otherwise_are_refused_in_one_line_before_any_pass(llama_dir, tmp_path):
    calib = llama_dir / "calib.npz"
    for name in ("r1", "random"):
        extra = ["--recipe", tmp_path / "r.yaml"] if name == "random" else ["--rotate", "R1"]
        if name == "random":
            (tmp_path / "r.yaml").write_text(SPINQUANT_RECIPE.replace("rotations: [R1, R2], transform_type: %s",
                                                                      "rotations: [R1], transform_type: random-matrix")
                                             .replace("scheme: W8A8", "scheme: W8A16"))
        _json(run_cli("run", llama_dir / "model.onnx", "--data", calib, "--scheme", "W4A16", "-o", tmp_path / name, "-q",
                      "--json", *extra))
    result = run_cli("eval", tmp_path / "r1" / "model.onnx", tmp_path / "random" / "model.onnx", "--data", calib,
                     "--sensitivity")
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert result.output.startswith("error: the reference was rotated otherwise (Hadamard 128) than the quantized "
                                    "model (random orthogonal 128 (seed 0))")


@pytest.mark.parametrize("change", [{"kind": "givens"}, {"seed": "0; rm"}, {"rotations": ["R3"]}, {"kind": None}])
def test_a_stranger_s_rotation_record_is_checked_before_it_is_used(llama_dir, tmp_path, change):
    """eval re-applies the rotation a quantized model's metadata names: a record graphcal would not
    write is refused in one line, before any pass."""
    _json(run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--scheme", "W4A16", "--rotate",
                  "R1", "-o", tmp_path / "q", "-q", "--json"))
    model = onnx.load(tmp_path / "q" / "model.onnx")
    prop = next(p for p in model.metadata_props if p.key == METADATA_KEY)
    prop.value = json.dumps({k: v for k, v in {**json.loads(prop.value), **change}.items() if v is not None})
    onnx.save(model, tmp_path / "q" / "model.onnx")
    result = run_cli("eval", llama_dir / "model.onnx", tmp_path / "q" / "model.onnx", "--data", llama_dir / "calib.npz")
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert result.output.startswith("error: the graphcal.rotation record")


def test_value_states_read_elsewhere_leave_that_attention_s_heads_unturned(llama_dir, tmp_path):
    """R2 on a torch export only where the value states reach nothing but the attention: layer 0's
    made a graph output too is left (R1 only there), layer 1's heads turn, and the logits and that
    output are what they were."""
    model = load_model(llama_dir / "model.onnx")
    state = find_kv_states(model)[0][0]
    model.graph.output.append(onnx.helper.make_tensor_value_info(state.value, onnx.TensorProto.FLOAT, ["b", 2, "s", 32]))
    original = tmp_path / "original.onnx"
    save_model(model, original)
    rotated = load_model(original)
    report = rotate(rotated, str(tmp_path))
    assert report.heads == 1 and report.head_writes == ["model.layers.1.self_attn.v_proj"]
    feeds = {k: v[:4] for k, v in np.load(llama_dir / "heldout.npz").items()}
    want = run_model(original, feeds, ["logits", state.value])
    got = run_model(rotated, feeds, ["logits", state.value])
    for name in ("logits", state.value):
        np.testing.assert_allclose(got[name], want[name], atol=1e-5 * np.abs(want[name]).max(), rtol=0)


def test_r2_asked_where_no_attention_is_recognised_says_only_r1_was_folded(tmp_path):
    """Optimum's export with a KV cache writes its attention in a form graphcal does not recognise
    (find_kv_states reports it): --rotate folds R1 and says that R2 was not."""
    folder = MODELS / "tiny-llama-optimum"
    result = run_cli("run", folder / "model.onnx", "--data", folder / "calib.npz", "--scheme", "W8A16", "--rotate",
                     "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "warning: --rotate R2: no attention's value and output projections were recognised" in result.output
    groups = json.loads((tmp_path / "out" / "quantization_config.json").read_text())["transform_config"]["config_groups"]
    assert list(groups) == ["R1"]


def test_inspect_and_run_say_what_the_rotation_folds(llama_dir, tmp_path):
    """inspect --rotate (text and JSON) and run name the matrices, the weights and norms folded, and
    the attentions whose heads R2 turned."""
    args = [llama_dir / "model.onnx", "--scheme", "W4A16", "--rotate"]
    result = run_cli("inspect", *args)
    assert result.exit_code == 0, result.output
    line = ("(Hadamard 128; R1,R2): 16 weights and 5 norm scales folded; R2 on 2 attention(s) (Hadamard 32)")
    assert f"rotation {line}" in result.output
    result = run_cli("inspect", *args, "--json")
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)["rotation"]
    assert record["heads"] == 2 and record["rotations"] == ["R1", "R2"] and record["weights"] == 16
    result = run_cli("run", *args, "--data", llama_dir / "calib.npz", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert f"rotated the residual stream first {line}" in result.output
