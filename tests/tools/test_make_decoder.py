"""tools/make_decoder.py: a torch-free decoder whose logits are a Llama's (a NumPy forward written here,
from the weights read back from its files), found by graphcal as the torch export models/tiny-llama is,
calibrated through the CLI, reproducible byte for byte."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from graphcal.graph.blocks import blocks
from graphcal.graph.residual import residual_stream
from graphcal.graph.targets import find_targets
from graphcal.runtime import run_model
from tests.helpers import MODELS, REPO, run_cli
from tools.lib import decoder
from tools.lib.synthetic import save_npz

TOOL = REPO / "tools" / "make_decoder.py"
TINY = ["--hidden", "64", "--layers", "2", "--intermediate", "128", "--heads", "4", "--kv-heads", "2", "--vocab", "128"]
HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 2, 4, 2, 128
EPS, THETA = 1e-6, 10000.0  # LlamaConfig's defaults


def make(out, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *TINY, "--out", str(out), *extra], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp32")
    made = make(out, "--seed", "3")
    assert made.returncode == 0, made.stderr
    return out


def feeds(batch=3, seq=9):
    ids = np.random.default_rng(1).integers(0, VOCAB, (batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), dtype=np.int64)
    mask[1, 6:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    return {"input_ids": ids, "attention_mask": mask}


def reference(path, data) -> np.ndarray:
    """A Llama's logits in float64 (transformers' LlamaForCausalLM with eager attention), from the weights the
    files hold: Linear weights found by the node that reads them."""
    model = onnx.load(path)  # reads model.onnx.data
    inits = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    # "/model/layers.0/self_attn/q_proj/MatMul" -> "model.layers.0.self_attn.q_proj"
    by_module = {n.name[1:].rsplit("/", 1)[0].replace("/", "."): n.input[1] for n in model.graph.node
                 if n.op_type == "MatMul" and n.input[1] in inits}

    def linear(module, x):
        return x @ inits[by_module[module]]

    def rms(x, weight):
        return inits[weight] * (x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS))

    ids, mask = data["input_ids"], data["attention_mask"]
    b, s = ids.shape
    d, rep = HIDDEN // HEADS, HEADS // KV_HEADS
    angles = np.arange(s)[:, None] * (1.0 / THETA ** (np.arange(0, d, 2) / d))[None]
    cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))
    allowed = (np.arange(s)[None, :] <= np.arange(s)[:, None])[None, None] & (mask[:, None, None, :] == 1)

    def rotate(x):
        half = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos + half * sin

    h = inits["model.embed_tokens.weight"][ids]
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        x = rms(h, f"{p}.input_layernorm.weight")
        q = linear(f"{p}.self_attn.q_proj", x).reshape(b, s, HEADS, d).transpose(0, 2, 1, 3)
        k = linear(f"{p}.self_attn.k_proj", x).reshape(b, s, KV_HEADS, d).transpose(0, 2, 1, 3)
        v = linear(f"{p}.self_attn.v_proj", x).reshape(b, s, KV_HEADS, d).transpose(0, 2, 1, 3)
        q, k = rotate(q), np.repeat(rotate(k), rep, axis=1)
        scores = np.where(allowed, q @ k.transpose(0, 1, 3, 2) / np.sqrt(d), -1e30)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        context = (probs @ np.repeat(v, rep, axis=1)).transpose(0, 2, 1, 3).reshape(b, s, HIDDEN)
        h = h + linear(f"{p}.self_attn.o_proj", context)
        x = rms(h, f"{p}.post_attention_layernorm.weight")
        gate = linear(f"{p}.mlp.gate_proj", x)
        h = h + linear(f"{p}.mlp.down_proj", gate / (1 + np.exp(-gate)) * linear(f"{p}.mlp.up_proj", x))
    return linear("lm_head", rms(h, "model.norm.weight"))


def check_logits(path, rtol, atol):
    data = feeds()
    got = run_model(onnx.load(path), data)["logits"]  # onnxruntime, ORT_ENABLE_BASIC
    want = reference(path, data)
    real = data["attention_mask"] == 1  # a padded query's output is the model's own business: it is never read
    assert got.shape == want.shape and np.isfinite(got).all()
    np.testing.assert_allclose(got[real].astype(np.float64), want[real], rtol=rtol, atol=atol)
    return got


def test_fp32_logits_are_a_llamas_with_padding(fp32):
    got = check_logits(fp32 / "model.onnx", rtol=1e-4, atol=1e-5)
    assert got.std() > 0.3  # realistic scales: logits neither vanishing nor exploding
    onnx.checker.check_model(str(fp32 / "model.onnx"), full_check=True)


def test_fp16_logits_are_a_llamas(tmp_path):
    assert make(tmp_path, "--dtype", "float16").returncode == 0
    model = onnx.load(tmp_path / "model.onnx", load_external_data=False)
    assert {t.data_type for t in model.graph.initializer} == {onnx.TensorProto.FLOAT16}
    check_logits(tmp_path / "model.onnx", rtol=1e-2, atol=1e-2)  # measured: 3e-3 at most


def test_tied_lm_head_is_the_embedding_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(decoder, "CHUNK", 1000)  # the embedding in 9 chunks, lm_head written band by band
    shape = decoder.DecoderShape(HIDDEN, LAYERS, 128, HEADS, KV_HEADS, VOCAB, tie=True)
    path = decoder.make_decoder(tmp_path, shape, seed=5)
    model = onnx.load(path)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    lm_head = next(n for n in model.graph.node if n.name == "/lm_head/MatMul").input[1]
    embedding = inits["model.embed_tokens.weight"]
    np.testing.assert_array_equal(inits[lm_head], embedding.T)
    assert len({embedding[r].tobytes() for r in range(0, VOCAB, 1000 // HIDDEN)}) == len(range(0, VOCAB, 1000 // HIDDEN))
    check_logits(path, rtol=1e-4, atol=1e-5)
    for t in onnx.load(path, load_external_data=False).graph.initializer:  # each at its own 4 KB-aligned place
        assert int(next(e.value for e in t.external_data if e.key == "offset")) % decoder.ALIGN == 0


def test_graphcal_finds_blocks_and_stream_as_in_the_torch_export(fp32):
    made, export = onnx.load(fp32 / "model.onnx", load_external_data=False), onnx.load(MODELS / "tiny-llama" / "model.onnx")
    names = [[t.name for t in find_targets(m)[0]] for m in (made, export)]
    assert names[0] == names[1] and len(names[0]) == 7 * LAYERS + 1

    def shape_of(found):
        return [(b.name, [t.name for t in b.targets], b.inputs, b.outputs, b.graph_inputs) for b in found]

    found = [blocks(m, find_targets(m)[0]) for m in (made, export)]
    assert shape_of(found[0]) == shape_of(found[1])
    assert [b.name for b in found[0]] == [f"model.layers.{i}" for i in range(LAYERS)] + ["lm_head"]

    def stream_of(s):
        return ([t.name for t in s.lookups], sorted(t.name for t in s.writers),
                sorted((r.target.name, r.scale) for r in s.readers), s.biases, s.scales)

    streams = [residual_stream(made, str(fp32)), residual_stream(export, str(MODELS / "tiny-llama"))]
    assert stream_of(streams[0]) == stream_of(streams[1])
    assert streams[0].hidden == HIDDEN


@pytest.mark.parametrize("args", [["--scheme", "W8A8_STATIC"], ["--scheme", "W4A16", "--algorithm", "gptq", "--group-size", "32"]])
def test_graphcal_run_calibrates_it(fp32, tmp_path, args):
    data = feeds(batch=4, seq=16)
    save_npz(tmp_path / "calib.npz", data)
    result = run_cli("run", fp32 / "model.onnx", "--data", tmp_path / "calib.npz", *args, "-o", tmp_path / "out",
                     "--device", "cpu")
    assert result.exit_code == 0, result.output
    logits = run_model(onnx.load(tmp_path / "out" / "model.onnx"), data)["logits"]
    assert logits.shape == (4, 16, VOCAB) and np.isfinite(logits).all()


def test_imports_no_torch(tmp_path):
    """torch and transformers made unimportable before the tool runs: it still writes the model."""
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
            f"sys.argv = ['make_decoder.py', *{TINY!r}, '--out', {str(tmp_path)!r}]; "
            f"runpy.run_path({str(TOOL)!r}, run_name='__main__')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "model.onnx").exists() and (tmp_path / "model.onnx.data").exists()


def test_same_seed_same_bytes(fp32, tmp_path):
    assert make(tmp_path / "again", "--seed", "3").returncode == 0
    assert make(tmp_path / "other", "--seed", "4").returncode == 0
    for name in ("model.onnx", "model.onnx.data"):
        assert (tmp_path / "again" / name).read_bytes() == (fp32 / name).read_bytes(), name
    assert (tmp_path / "other" / "model.onnx.data").read_bytes() != (fp32 / "model.onnx.data").read_bytes()


def test_refuses_an_existing_model_unless_forced(fp32, tmp_path):
    assert make(tmp_path, "--seed", "4").returncode == 0
    before = (tmp_path / "model.onnx.data").read_bytes()
    refused = make(tmp_path, "--seed", "3")
    assert refused.returncode != 0 and refused.stderr.startswith("error: ") and len(refused.stderr.splitlines()) == 1
    assert (tmp_path / "model.onnx.data").read_bytes() == before
    assert make(tmp_path, "--seed", "3", "--force").returncode == 0
    assert (tmp_path / "model.onnx.data").read_bytes() == (fp32 / "model.onnx.data").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]  # no partial file left


@pytest.mark.parametrize("extra, says", [(["--heads", "5"], "multiple of heads"), (["--kv-heads", "3"], "multiple of kv-heads"),
                                         (["--vocab", "0"], "vocab must be at least 1")])
def test_bad_widths_are_one_line(tmp_path, extra, says):
    run = make(tmp_path, *extra)
    assert run.returncode != 0 and says in run.stderr and len(run.stderr.splitlines()) == 1
    assert not (tmp_path / "model.onnx").exists()
