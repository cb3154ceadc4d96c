"""The activation pass streamed one layer block at a time (calibration.streamed, issue 47).

The reference is the whole-graph pass (--pass whole-graph), whose numbers the observer and algorithm
vectors pin to llm-compressor's: the streamed pass propagates float block outputs, so every written byte
must be the same. Memory is checked structurally: each session of the streamed pass is handed the
weights of its own block only."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from graphcal.calibration import streamed
from tests.helpers import MODELS, run_cli
from tools.lib.decoder import DecoderShape, make_decoder
from tools.lib.synthetic import save_npz

LLAMA = MODELS / "tiny-llama"
BERT = MODELS / "tiny-bert"
OPTIMUM = MODELS / "tiny-llama-optimum"


def layer_of_weight(model) -> dict[str, str]:
    """Each Linear weight's initializer -> its decoder layer's number (the exporter names them onnx::MatMul_N)."""
    from graphcal.graph.targets import find_targets

    return {t.weight: t.name.split(".")[2] for t in find_targets(model)[0] if t.name.startswith("model.layers.")}


def written(out) -> bytes:
    """Every byte a run wrote that the pass decides: the model (and its data file) and the qparams."""
    return b"".join((out / name).read_bytes() for name in sorted(p.name for p in out.iterdir())
                    if name.startswith("model.onnx") or name == "qparams.safetensors")


def both(tmp_path, model, data, *args) -> tuple[dict, dict]:
    """The run's JSON summary and written bytes with --pass blocks and with --pass whole-graph."""
    got = {}
    for mode in ("blocks", "whole-graph"):
        out = tmp_path / mode
        result = run_cli("run", model, "--data", data, *args, "--pass", mode, "-o", out, "--json")
        assert result.exit_code == 0, result.output
        got[mode] = (json.loads(result.stdout), written(out))
    return got["blocks"], got["whole-graph"]


@pytest.mark.parametrize("args", [
    ("--scheme", "W8A8_STATIC"),
    ("--scheme", "W8A8_STATIC", "--observer", "mse"),
    ("--scheme", "W8A8_STATIC", "--kv-cache-scheme", "FP8"),
    ("--scheme", "W8A8_STATIC", "--exclude-padding"),
    ("--scheme", "W8A8_STATIC", "--smoothquant", "mul"),
    ("--scheme", "W8A8_STATIC", "--smoothquant", "all", "--smoothing-strength", "auto"),
    ("--scheme", "W8A8_STATIC", "--algorithm", "awq"),
    ("--scheme", "NVFP4", "--target", "qdq"),
], ids=lambda a: " ".join(a[1:]))
def test_the_streamed_pass_writes_what_the_whole_graph_pass_writes(tmp_path, args):
    (blocks, a), (whole, b) = both(tmp_path, LLAMA / "model.onnx", LLAMA / "calib.npz", *args)
    assert blocks["pass"].startswith("streamed block by block")
    assert whole["pass"].startswith("whole-graph")
    assert a == b


@pytest.mark.parametrize("model", [BERT, OPTIMUM], ids=["tiny-bert", "tiny-llama-optimum"])
def test_an_encoder_and_an_optimum_export_stream_to_the_same_bytes(tmp_path, model):
    (blocks, a), (_, b) = both(tmp_path, model / "model.onnx", model / "calib.npz", "--scheme", "W8A8_STATIC")
    assert blocks["pass"].startswith("streamed block by block")
    assert a == b


def decoder(folder, dtype: str):
    """A 3-layer Llama with external data (tools/lib/decoder), and token ids with padding."""
    make_decoder(folder, DecoderShape(hidden=64, layers=3, intermediate=128, heads=4, kv_heads=2, vocab=128),
                 dtype=dtype, seed=5)
    ids = np.random.default_rng(2).integers(0, 128, (6, 12), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, 8:] = 0
    save_npz(folder / "calib.npz", {"input_ids": ids, "attention_mask": mask})
    return folder


@pytest.fixture(scope="module")
def fp32_decoder(tmp_path_factory):
    return decoder(tmp_path_factory.mktemp("fp32"), "float32")


@pytest.fixture(scope="module")
def fp16_decoder(tmp_path_factory):
    return decoder(tmp_path_factory.mktemp("fp16"), "float16")


def test_a_decoder_with_external_data_streams_to_the_same_bytes(tmp_path, fp32_decoder):
    (blocks, a), (_, b) = both(tmp_path, fp32_decoder / "model.onnx", fp32_decoder / "calib.npz",
                               "--scheme", "W8A8_STATIC", "--batch-size", "4", "--kv-cache-scheme", "FP8")
    assert blocks["pass"] == "streamed block by block (3 blocks)"
    assert a == b


def test_an_fp16_decoder_streams_within_an_fp16_rounding(tmp_path, fp16_decoder):
    """onnxruntime's CPU provider runs an fp16 graph's nodes it has no fp16 kernel for in fp32, with Casts
    around the regions it picks: across a block boundary the residual stream is the graph's fp16, inside
    one session it may stay fp32. The weights' qparams are the same; an input scale moves by an fp16
    rounding at most."""
    from safetensors.torch import load_file

    both(tmp_path, fp16_decoder / "model.onnx", fp16_decoder / "calib.npz", "--scheme", "W8A8_STATIC",
         "--batch-size", "4")
    a = load_file(tmp_path / "blocks" / "qparams.safetensors")
    b = load_file(tmp_path / "whole-graph" / "qparams.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        if "input" in key:
            assert (a[key].float() - b[key].float()).abs().max() <= 2e-3 * b[key].float().abs().max(), key
        else:
            assert (a[key] == b[key]).all(), key


def test_each_block_session_reads_its_own_weights_only(tmp_path, fp16_decoder, monkeypatch):
    """What bounds the pass's memory: no session of it holds another layer's weights, and the embedding
    table only the first block's (it computes that block's input)."""
    import graphcal.calibration.blockwise as blockwise

    sessions = []
    real = blockwise.open_runtime

    def recording(model, outputs, *args, weights=(), **kwargs):
        sessions.append({t.name for t in weights})
        return real(model, outputs, *args, weights=weights, **kwargs)

    monkeypatch.setattr(blockwise, "open_runtime", recording)
    result = run_cli("run", fp16_decoder / "model.onnx", "--data", fp16_decoder / "calib.npz", "--scheme", "W8A8_STATIC",
                     "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert len(sessions) == 3
    import onnx

    of = layer_of_weight(onnx.load(fp16_decoder / "model.onnx", load_external_data=False))
    assert len(of) == 3 * 7
    for k, names in enumerate(sessions):
        assert {of[n] for n in names if n in of} == {str(k)}, names
        if k < 2:  # the last block computes its taps only: its down_proj's weight is never read
            assert {n for n, layer in of.items() if layer == str(k)} <= names
        assert ("model.embed_tokens.weight" in names) == (k == 0)
        assert "lm_head.weight" not in names


def test_the_summary_and_inspect_say_which_pass(tmp_path):
    result = run_cli("run", LLAMA / "model.onnx", "--data", LLAMA / "calib.npz", "--scheme", "W8A8_STATIC",
                     "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "streamed block by block (2 blocks)" in result.output
    shown = run_cli("inspect", LLAMA / "model.onnx", "--scheme", "W8A8_STATIC", "--pass", "whole-graph")
    assert "pass     whole-graph (--pass whole-graph)" in shown.output
    weight_only = run_cli("inspect", LLAMA / "model.onnx", "--scheme", "W4A16")
    assert "pass     none (no activation statistics to take)" in weight_only.output


def test_a_graph_without_layer_blocks_keeps_the_whole_graph_pass(tmp_path, layers):
    folder, _ = layers
    result = run_cli("run", folder / "model.onnx", "--data", folder / "calib.npz", "--scheme", "W8A8_STATIC",
                     "-o", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["pass"].startswith("whole-graph (the targets form no two layer blocks")
    refused = run_cli("run", folder / "model.onnx", "--data", folder / "calib.npz", "--scheme", "W8A8_STATIC",
                      "--pass", "blocks", "-o", tmp_path / "out2")
    assert refused.exit_code != 0
    assert refused.output.strip().splitlines()[-1].startswith("error: --pass blocks: the targets form no two layer")
    assert not (tmp_path / "out2").exists()


def test_a_reader_read_once_keeps_the_whole_graph_pass():
    class Once:
        rereadable = False

    from graphcal.calibration.plan import load, plan
    from graphcal.config import Options, resolve

    config = resolve(Options(scheme="W8A8_STATIC"))
    loaded = load(LLAMA / "model.onnx", config)
    run = plan(LLAMA / "model.onnx", config, loaded=loaded)
    assert streamed.choose_pass(run, loaded, None).streamed_blocks == 2
    chosen = streamed.choose_pass(run, loaded, Once())
    assert chosen.streamed_blocks == 0 and "read once" in chosen.pass_note


def test_the_pre_flight_counts_one_block_of_weights_and_the_cache_budget(fp32_decoder):
    """inspect's estimate of the streamed pass holds the first block's weights with the embedding table
    (its session's), not the model's; --cache-mb bounds the cache held in memory."""
    import onnx

    model = onnx.load(fp32_decoder / "model.onnx", load_external_data=False)
    size = {t.name: int(np.prod(t.dims)) * 4 for t in model.graph.initializer}
    first = sum(size[w] for w, layer in layer_of_weight(model).items() if layer == "0")
    args = ("inspect", fp32_decoder / "model.onnx", "--data", fp32_decoder / "calib.npz", "--scheme", "W8A8_STATIC",
            "--json")
    streamed_run = json.loads(run_cli(*args).stdout)["memory"]
    whole = json.loads(run_cli(*args, "--pass", "whole-graph").stdout)["memory"]
    assert streamed_run["pass"] == "streamed" and whole["pass"] == "whole-graph"
    assert whole["parts"]["weights in onnxruntime"] == sum(size.values())
    if "weights in onnxruntime" in streamed_run["parts"]:  # the pass's parts, where the pass is the peak
        assert streamed_run["parts"]["weights in onnxruntime"] == first + size["model.embed_tokens.weight"]
    bounded = json.loads(run_cli(*args, "--cache-mb", "0").stdout)["memory"]
    assert bounded["parts"].get("block cache", 0) == 0


@pytest.mark.gpu
def test_on_cuda_the_streamed_pass_keeps_the_blocks_on_the_gpu_and_gives_the_cpu_scales(tmp_path, fp32_decoder):
    """On CUDA (IOBinding: the cached block outputs stay torch tensors on the GPU) the streamed pass gives
    the whole-graph pass's scales, and both the CPU's to float tolerance."""
    from safetensors.torch import load_file

    got = {}
    for device in ("cuda", "cpu"):
        for mode in ("blocks", "whole-graph"):
            out = tmp_path / f"{device}-{mode}"
            result = run_cli("run", fp32_decoder / "model.onnx", "--data", fp32_decoder / "calib.npz", "--scheme",
                             "W8A8_STATIC", "--pass", mode, "--device", device, "-o", out, "--json")
            assert result.exit_code == 0, result.output
            summary = json.loads(result.stdout)
            assert summary["provider"] == ("CUDAExecutionProvider" if device == "cuda" else "CPUExecutionProvider")
            got[device, mode] = load_file(out / "qparams.safetensors")
    reference = got["cpu", "whole-graph"]
    for key, value in reference.items():
        for run in got:
            assert torch.allclose(got[run][key].float(), value.float(), rtol=1e-4, atol=0), (run, key)


CHILD = r"""
import ctypes, json, sys
import graphcal.calibration.blockwise as bw
from graphcal.calibration.pipeline import calibrate

libc = ctypes.CDLL("libc.so.6")
after = []
keep = bw.Blockwise.keep

def recording(self, k, outputs):
    keep(self, k, outputs)
    libc.malloc_trim(0)
    after.append(next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")) * 1024)

bw.Blockwise.keep = recording
calibrate(sys.argv[1], sys.argv[2], sys.argv[3], scheme="W8A8_STATIC", batch_size=8)
print(json.dumps(after))
"""


def test_the_pass_holds_no_memory_from_the_blocks_it_has_run(tmp_path):
    """What a block's session allocated is given back when it closes: the process's anonymous memory after
    the last block is that after the second (an observer kept its first batch's extrema as a view of
    onnxruntime's output, which pinned each block session's whole memory arena: +10 MB a block here,
    +120 MB a block on the Llama-3-8B's widths)."""
    import os
    import subprocess
    import sys

    from tests.helpers import REPO

    make_decoder(tmp_path, DecoderShape(hidden=256, layers=8, intermediate=1024, heads=8, kv_heads=2, vocab=32000))
    ids = np.random.default_rng(0).integers(0, 32000, (4, 128), dtype=np.int64)
    save_npz(tmp_path / "calib.npz", {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    done = subprocess.run([sys.executable, "-c", CHILD, tmp_path / "model.onnx", tmp_path / "calib.npz", tmp_path / "out"],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    after = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(after) == 8
    assert after[-1] - after[1] < 16 * 2**20, [a // 2**20 for a in after]
