"""--kv-cache-scheme: the key/value states entering attention are tapped, observed and Q/DQ'd.

References: the torch model's own key/value states at compressed-tensors' QuantizedKVCache (after
RoPE, before repeat_kv), compressed-tensors' calculate_qparams on them, the parameters
compressed-tensors' apply_quantization_config registers, and the torch model with the written
config applied by compressed-tensors (which fake-quantizes k/v at the cache).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
import torch

from graphcal.graph.attention import find_kv_states
from graphcal.graph.taps import add_taps
from graphcal.runtime import run_model
from tests.helpers import ct_torch_reference, load_written, run_cli, sqnr_db
from tools.builders import build_tiny_llama

PER_HEAD = '{"num_bits": 8, "type": "float", "strategy": "attn_head", "observer": "static_minmax"}'
LAYERS = ("model.layers.0.self_attn", "model.layers.1.self_attn")


@pytest.fixture(scope="module")
def kv_run(tmp_path_factory):
    from tests.conftest import MODELS

    src = MODELS / "tiny-llama"
    out = tmp_path_factory.mktemp("kv")
    result = run_cli("run", str(src / "model.onnx"), "--data", str(src / "calib.npz"),
                     "--scheme", "FP8", "--kv-cache-scheme", PER_HEAD, "-o", str(out), "-q")
    assert result.exit_code == 0, result.output
    return src, out


def _torch_states(config, feeds, batch_size=8):
    """Key/value states per attention module, as compressed-tensors' QuantizedKVCache receives them
    (quantization disabled), one entry per calibration batch."""
    from compressed_tensors.quantization import apply_quantization_config

    model = build_tiny_llama()[0]
    apply_quantization_config(model, config, show_progress=False)
    states = {name: [] for name in LAYERS}
    for name, module in model.named_modules():
        module.quantization_enabled = False
        if name in states:
            module.kv_cache.register_forward_pre_hook(
                lambda _m, args, name=name: states[name].append((args[0].clone(), args[1].clone())))
    n = len(next(iter(feeds.values())))
    with torch.no_grad():
        for i in range(0, n, batch_size):
            model(**{k: torch.from_numpy(v[i:i + batch_size]) for k, v in feeds.items()})
    return states


def test_finds_key_and_value_states_of_every_attention(llama_dir, bert_dir):
    states, problems = find_kv_states(onnx.load(llama_dir / "model.onnx"))
    assert [s.name for s in states] == list(LAYERS) and not problems
    # BERT's attention modules (encoder.layer.N.attention.self) are not compressed-tensors kv-cache targets
    assert find_kv_states(onnx.load(bert_dir / "model.onnx")) == ([], [])


def test_tapped_states_are_the_torch_models_and_scales_are_compressed_tensors(kv_run):
    from compressed_tensors.quantization.utils import calculate_qparams

    src, out = kv_run
    config, params = load_written(out)
    feeds = dict(np.load(src / "calib.npz"))
    torch_states = _torch_states(config, feeds)
    states, _ = find_kv_states(onnx.load(src / "model.onnx"))
    tapped, names = add_taps(onnx.load(src / "model.onnx"), [s.key for s in states] + [s.value for s in states])
    first = run_model(tapped, {k: v[:8] for k, v in feeds.items()}, names)
    for s in states:
        k, v = torch_states[s.name][0]
        np.testing.assert_allclose(first[s.key], k.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(first[s.value], v.numpy(), rtol=1e-5, atol=1e-6)
        for base, index in (("k", 0), ("v", 1)):
            # static_minmax over all batches, per kv head: amin/amax over (batch, seq, head_dim)
            x = torch.cat([pair[index] for pair in torch_states[s.name]])
            lo, hi = x.amin(dim=(0, 2, 3)).reshape(-1, 1, 1), x.amax(dim=(0, 2, 3)).reshape(-1, 1, 1)
            ref, _ = calculate_qparams(lo, hi, config.kv_cache_scheme)
            np.testing.assert_allclose(params[f"{s.name}.{base}_scale"].numpy(), ref.numpy(), rtol=1e-5, err_msg=base)


def test_metadata_is_what_compressed_tensors_registers(kv_run):
    from compressed_tensors.quantization import apply_quantization_config

    _, out = kv_run
    config, params = load_written(out)
    assert config.kv_cache_scheme.strategy == "attn_head" and config.kv_cache_scheme.type == "float"
    model = build_tiny_llama()[0]
    apply_quantization_config(model, config, show_progress=False)
    registered = {n: p for n, p in model.named_parameters() if n.endswith(("k_scale", "v_scale"))}
    assert set(registered) == {f"{m}.{b}_scale" for m in LAYERS for b in "kv"}
    for name, p in registered.items():
        assert params[name].shape == p.shape == (2, 1, 1) and params[name].dtype == p.dtype


def test_written_model_quantizes_kv_as_compressed_tensors_does(kv_run, tmp_path):
    src, out = kv_run
    model = onnx.load(out / "model.onnx")
    onnx.checker.check_model(model, full_check=True)
    # fp8 for onnxruntime: Div -> Cast(fp8) -> Cast -> Mul by the [kv_heads, 1, 1] scale (no
    # DequantizeLinear for its Q/DQ propagation to move past repeat_kv's Unsqueeze)
    kv_q = [n for n in model.graph.node if n.op_type == "Cast" and n.name.endswith(("/k/CastFp8", "/v/CastFp8"))]
    assert len(kv_q) == 4
    inits = {t.name: list(t.dims) for t in model.graph.initializer}
    assert all(inits[f"{m}.{b}_scale"] == [2, 1, 1] for m in LAYERS for b in "kv")
    onnxruntime_default = onnxruntime.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    assert onnxruntime_default.get_session_options().graph_optimization_level == \
        onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL  # it loads at onnxruntime's default level
    feeds = dict(np.load(src / "heldout.npz"))
    got = run_model(out / "model.onnx", feeds)["logits"]
    fp32 = run_model(src / "model.onnx", feeds)["logits"]
    ref = ct_torch_reference(build_tiny_llama, out, feeds)
    margins = [sqnr_db(ref[i], got[i]) - sqnr_db(fp32[i], got[i]) for i in range(len(got))]
    assert np.median(margins) >= 15, margins
    # and the k/v Q/DQ matter: without them the model is further from compressed-tensors
    no_kv = tmp_path / "no_kv"
    result = run_cli("run", str(src / "model.onnx"), "--data", str(src / "calib.npz"),
                     "--scheme", "FP8", "-o", str(no_kv), "-q")
    assert result.exit_code == 0
    assert sqnr_db(ref, run_model(no_kv / "model.onnx", feeds)["logits"]) < sqnr_db(ref, got) - 10


@pytest.mark.parametrize("args, code, message", [
    (["--kv-cache-scheme", "FP4"], 2, "unknown kv-cache scheme 'FP4'"),
    (["--kv-cache-scheme", '{"num_bits": 8, "strategy": "token", "dynamic": true}'], 2, "static tensor or attn_head"),
    (["--kv-cache-scheme", PER_HEAD, "--scheme", "FP8", "--target", "tensorrt"], 1, "TensorRT takes int8/fp8 key/value"),
])
def test_bad_kv_cache_schemes(llama_dir, tmp_path, args, code, message):
    result = run_cli("run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                     "-o", str(tmp_path / "o"), *args)
    assert result.exit_code == code, result.output
    assert message in result.output and "Traceback" not in result.output


def test_model_without_kv_cache_attention_warns(bert_dir, tmp_path):
    result = run_cli("run", str(bert_dir / "model.onnx"), "--data", str(bert_dir / "calib.npz"),
                     "--kv-cache-scheme", "FP8", "-o", str(tmp_path / "o"), "-q")
    assert result.exit_code == 0
    assert "warning: kv-cache scheme: no attention module" in result.output
    config, params = load_written(tmp_path / "o")
    assert config.kv_cache_scheme is None and not [k for k in params if k.endswith(("k_scale", "v_scale"))]


def test_literal_qdq_form_keeps_per_head_quantize_linear(kv_run, tmp_path):
    src, _ = kv_run
    out = tmp_path / "qdq"
    result = run_cli("run", str(src / "model.onnx"), "--data", str(src / "calib.npz"), "--scheme",
                     "FP8", "--kv-cache-scheme", PER_HEAD, "--target", "qdq", "-o", str(out), "-q")
    assert result.exit_code == 0, result.output
    model = onnx.load(out / "model.onnx")
    kv_q = [n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.name.endswith(("/k/QuantizeLinear", "/v/QuantizeLinear"))]
    assert len(kv_q) == 4 and all(a.i == 1 for n in kv_q for a in n.attribute if a.name == "axis")
    feeds = {k: v[:4] for k, v in np.load(src / "heldout.npz").items()}
    got = run_model(out / "model.onnx", feeds)["logits"]
    fast = run_model(kv_run[1] / "model.onnx", feeds)["logits"]
    np.testing.assert_allclose(got, fast, rtol=0, atol=1e-5 * np.abs(got).max())  # the same numbers, two forms
