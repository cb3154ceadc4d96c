"""onnxruntime-genai builder models in, drop-in genai folders out (issue 32).

A tiny random-weight Llama made with transformers, built offline by onnxruntime-genai's own model
builder (fp32, CPU; conftest.py's ``builder_model``, made by tests/genai_models.py), is quantized
by graphcal from token ids alone (the KV cache filled: graphcal.data.fill) and generated with
through onnxruntime-genai's own loop (greedy). The reference is the fp32 builder model in that
same loop: the first tokens and the first step's logits.
"""

from __future__ import annotations

import json
import os

import onnx
import pytest

from tests.genai_models import STEPS, assert_one_table, generate, sqnr
from tests.helpers import run_cli

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai-cuda is not installed (the test extra)")


def test_a_builder_model_fails_onnx_checker_as_graphcal_finds_it(builder_model):
    """The premise: onnx's checker rejects the builder's own output (SimplifiedLayerNormalization in
    the default domain), so graphcal's check of what it writes must pass over exactly that."""
    from graphcal.graph.io import unchecked_ops

    folder, _ = builder_model
    with pytest.raises(onnx.checker.ValidationError, match="SimplifiedLayerNormalization"):
        onnx.checker.check_model(str(folder / "model.onnx"))
    assert unchecked_ops(onnx.load(folder / "model.onnx", load_external_data=False)) == {"SimplifiedLayerNormalization"}


@pytest.mark.parametrize("args", [
    ["--scheme", "W4A16", "--group-size", "32"],
    ["--scheme", "W4A16", "--group-size", "32", "--algorithm", "gptq"],
    ["--scheme", "W4A16", "--group-size", "32", "--algorithm", "awq"],
    ["--scheme", "W8A8"],
    ["--scheme", "W8A8_STATIC", "--smoothquant"],
], ids=["rtn", "gptq", "awq", "w8a8", "w8a8-static-smoothquant"])
def test_graphcal_output_is_a_genai_folder_that_generates_as_fp32_does(builder_model, tmp_path, args):
    folder, calib = builder_model
    out = tmp_path / "out"
    result = run_cli("run", str(folder / "model.onnx"), "--data", str(calib), "-o", str(out), *args)
    assert result.exit_code == 0, result.output
    assert "filled for an empty KV cache: 4 past tensors" in result.output
    for name in ("genai_config.json", "tokenizer.json", "tokenizer_config.json"):  # the drop-in folder
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name
    assert json.loads((out / "genai_config.json").read_text())["model"]["decoder"]["filename"] == "model.onnx"
    ref_tokens, ref_logits = generate(folder)
    tokens, logits = generate(out)
    # random weights give near-uniform logits, so only the first token is sure to survive int4 noise
    assert tokens[0] == ref_tokens[0] and len(tokens) == STEPS
    assert sqnr(ref_logits, logits) > 15  # measured 19.0-28.0 dB on this model; a broken layer gives ~0
    if "--smoothquant" in args or "awq" in args:  # the folds found the builder's norms (SkipSimplifiedLayerNormalization)
        assert "activation(s) first" in result.output


@pytest.mark.parametrize("table", ["W4A16", "W8A16"])
def test_a_tied_builder_model_quantized_whole_generates_from_one_table(tied_builder_model, tmp_path, table):
    """The builder's tied model with lm_head and the embedding quantized (issue 33): int4 in the
    builder's own form (GatherBlockQuantized over lm_head's MatMulNBits bytes, one table), or an
    int8 table beside int4 layers; onnxruntime-genai generates from it as from fp32."""
    folder, calib = tied_builder_model
    out = tmp_path / "out"
    result = run_cli("run", str(folder / "model.onnx"), "--data", str(calib), "-o", str(out),
                     "--scheme", "W4A16", "--group-size", "32", "--lm-head", "--matmulnbits",
                     "--scheme-for", f"lm_head={table}", "--scheme-for", f"Embedding={table}")
    assert result.exit_code == 0, result.output
    assert "quantized 11 MatMul/Gemm targets and 1 embedding lookup" in result.output
    assert_one_table(out / "model.onnx")
    ref_tokens, ref_logits = generate(folder)
    tokens, logits = generate(out)
    assert tokens[0] == ref_tokens[0] and len(tokens) == STEPS
    assert sqnr(ref_logits, logits) > 12  # measured 16.0 dB (int4 table) and 21.9 dB (int8 table)


def test_genai_config_naming_another_model_file_is_pointed_at_graphcals(builder_model, tmp_path):
    import shutil

    folder, calib = builder_model
    src = tmp_path / "src"
    shutil.copytree(folder, src)
    (src / "model.onnx").rename(src / "decoder.onnx")
    config = json.loads((src / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = "decoder.onnx"
    (src / "genai_config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    result = run_cli("run", str(src / "decoder.onnx"), "--data", str(calib), "-o", str(out),
                     "--scheme", "W4A16", "--group-size", "32")
    assert result.exit_code == 0, result.output
    written = json.loads((out / "genai_config.json").read_text())
    assert written["model"]["decoder"]["filename"] == "model.onnx"
    written["model"]["decoder"]["filename"] = "decoder.onnx"
    assert written == config  # nothing else changed
    assert generate(out)[0][0] == generate(folder)[0][0]


@pytest.mark.parametrize("make, fragment", [
    (lambda p, tmp: p.symlink_to(tmp / "secret.json"), "leads out of the model's folder"),
    (lambda p, tmp: os.mkfifo(p), "not a regular file"),
    (lambda p, tmp: p.write_bytes(b" " * (64 << 20) + b"{}"), "companion files of at most"),
], ids=["symlink-out", "fifo", "too-big"])
def test_a_hostile_companion_file_is_refused_before_any_pass(llama_dir, tmp_path, make, fragment):
    """-o receives the input folder's genai_config.json and tokenizer: a link out of the folder, a FIFO or
    an oversized one is refused in one line before calibrating, and -o is not created."""
    import shutil

    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(llama_dir / "model.onnx", src / "model.onnx")
    (tmp_path / "secret.json").write_text("{}")
    make(src / "tokenizer.json", tmp_path)
    result = run_cli("run", str(src / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                     "-o", str(tmp_path / "out"), "--scheme", "W8A8_STATIC")
    assert result.exit_code == 1 and fragment in result.output, result.output
    assert result.output.count("\n") == 1 and not (tmp_path / "out").exists()
    assert "calibrat" not in result.output


def test_export_genai_says_in_one_line_what_the_builder_refused(builder_model, tmp_path):
    import shutil

    folder, _ = builder_model
    hf = tmp_path / "hf"
    shutil.copytree(folder.parent / "hf", hf)
    (hf / "config.json").write_text('{"model_type": "no-such-architecture", "architectures": ["NoSuchForCausalLM"]}')
    result = run_cli("export", str(hf), "--genai", "fp32", "-o", str(tmp_path / "out"))
    assert result.exit_code == 1 and result.output.startswith("error: onnxruntime-genai's model builder failed")
    assert result.output.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def fp16_builder_model(builder_model, tmp_path_factory):
    """The same Llama built by the builder at fp16 (its q/k/v stay three MatMuls there)."""
    folder, calib = builder_model
    out = tmp_path_factory.mktemp("genai16") / "fp16"
    result = run_cli("export", str(folder.parent / "hf"), "--genai", "fp16", "-o", str(out))
    assert result.exit_code == 0, result.output
    return out, calib


@pytest.mark.parametrize("args", [
    ["--scheme", "W4A16", "--group-size", "32", "--matmulnbits"],
    ["--scheme", "FP8"],
    ["--scheme", "W8A16", "--group-size", "64"],
    ["--scheme", "W4A16", "--group-size", "32", "--target", "qdq"],
    ["--scheme", "NVFP4A16", "--target", "qdq"],  # opset 23: the converter passes over SimplifiedLayerNormalization
], ids=["matmulnbits", "fp8", "w8a16", "qdq-int4", "nvfp4-qdq"])
@pytest.mark.parametrize("build", ["fp32", "fp16"])
def test_every_scheme_writes_for_fp32_and_fp16_builds(builder_model, fp16_builder_model, tmp_path, args, build):
    from graphcal.graph.io import UNCHECKED_DOMAIN, check_written, runs_in_onnxruntime, unchecked_ops

    folder, calib = builder_model if build == "fp32" else fp16_builder_model
    out = tmp_path / "out"
    result = run_cli("run", str(folder / "model.onnx"), "--data", str(calib), "-o", str(out), *args)
    assert result.exit_code == 0, result.output
    written = onnx.load(out / "model.onnx", load_external_data=False)
    assert unchecked_ops(written) == {"SimplifiedLayerNormalization"}  # back in the default domain
    assert UNCHECKED_DOMAIN not in {o.domain for o in written.opset_import}
    check_written(out / "model.onnx", unchecked_ops(written))  # onnx's checker, as graphcal held it
    if runs_in_onnxruntime(written) and build == "fp32":  # (run loaded it in onnxruntime already)
        # the builder's own fp16 CPU model stops in onnxruntime-genai 0.18's loop on the CPU (a Cast
        # reusing a buffer of another shape), so fp16 builds are held to the checker and the load
        tokens, _ = generate(out)
        assert len(tokens) == STEPS


@pytest.mark.parametrize("text, fragment", [
    ("{not json", "genai_config.json is not valid JSON"),
    ('{"model": {"decoder": {"filename": "a.onnx", "filename": "b.onnx"}}}', "gives the key 'filename' twice"),
], ids=["not-json", "duplicate-key"])
def test_a_bad_genai_config_is_refused_before_any_pass(llama_dir, tmp_path, text, fragment):
    """-o would receive the folder's genai_config.json (its model file name set to graphcal's): it is
    read and parsed before calibrating, with the KV-cache fill's checks, never after the pass."""
    import shutil

    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(llama_dir / "model.onnx", src / "model.onnx")
    (src / "genai_config.json").write_text(text)
    args = [str(src / "model.onnx"), "--data", str(llama_dir / "calib.npz"), "--scheme", "W8A8_STATIC"]
    inspected = run_cli("inspect", *args)  # no pass at all: refused from the plan
    assert inspected.exit_code == 1 and fragment in inspected.output, inspected.output
    result = run_cli("run", *args, "-o", str(tmp_path / "out"))
    assert result.exit_code == 1 and fragment in result.output, result.output
    assert result.output.count("\n") == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("args", [["--scheme", "FP8"], ["--scheme", "W8A8_STATIC", "--smoothquant"],
                                  ["--scheme", "W4A16", "--group-size", "32", "--algorithm", "gptq"]],
                         ids=["fp8", "w8a8-static-sq", "gptq"])
def test_a_cuda_fp16_build_calibrates_on_the_cpu(builder_model, tmp_path, args):
    """The builder's CUDA fp16 model (GroupQueryAttention over fp16 past tensors, built offline on this
    machine) calibrates on the CPU, where onnxruntime's planner once gave the present output the empty
    past's buffer in the tapped graph, and the output is held by eval (onnxruntime) against that model."""
    folder, calib = builder_model
    build = tmp_path / "cuda16"
    result = run_cli("export", str(folder.parent / "hf"), "--genai", "fp16", "--genai-provider",
                     "cuda", "-o", str(build))
    assert result.exit_code == 0, result.output
    model = onnx.load(build / "model.onnx", load_external_data=False)
    past = next(i for i in model.graph.input if i.name == "past_key_values.0.key")
    assert past.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert any(n.op_type == "GroupQueryAttention" for n in model.graph.node)
    out = tmp_path / "out"
    result = run_cli("run", str(build / "model.onnx"), "--data", str(calib), "-o", str(out), "-q",
                     *args)
    assert result.exit_code == 0, result.output
    result = run_cli("eval", str(build / "model.onnx"), str(out / "model.onnx"), "--data", str(calib),
                     "--json")
    assert result.exit_code == 0, result.output
    logits = next(o for o in json.loads(result.output.strip().splitlines()[-1])["outputs"] if o["name"] == "logits")
    assert logits["sqnr_db"] > 10
