"""graphcal run end to end through the CLI, checked against compressed-tensors and onnxruntime.

References, never graphcal's own numbers:
- per layer: on the activations the written model really computes, each quantized MatMul's
  output equals fake_quantize(x) @ fake_quantize(W).T by compressed-tensors' own functions
  with the written qparams (dynamic scales by compressed-tensors' compute_dynamic_scales_and_zp);
- end to end: the torch model with the written config applied by compressed-tensors'
  apply_quantization_config. Float rounding upstream (RMSNorm/LayerNorm differ by an ulp
  between torch and onnxruntime) flips a few roundings, so here the bound is relative: the
  median held-out sample is at least 15 dB closer to compressed-tensors than to fp32;
- each weight DequantizeLinear yields compressed-tensors' fake-quantized weight;
- models with fp4 / e8m0 types, which onnxruntime's CPU provider cannot run, go through
  onnx.reference's ReferenceEvaluator instead;
- and the written model stays close to fp32 on held-out data.
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from graphcal.graph.external import expected_bytes
from graphcal.graph.taps import add_taps
from graphcal.graph.targets import find_targets, torch_weight
from graphcal.runtime import run_model
from tests.helpers import (
    INT8_SATURATES,
    SATURATION_REASON,
    ct_layer_reference,
    ct_torch_reference,
    load_written,
    run_cli,
    run_cli_process,
    sqnr_db,
)

# scheme -> (format compressed-tensors infers, ONNX type of the stored weight, opset written, weight bits)
SCHEMES = {
    "W8A8": ("int-quantized", onnx.TensorProto.INT8, 17, 8),
    "W8A8_STATIC": ("int-quantized", onnx.TensorProto.INT8, 17, 8),
    "W8A16": ("pack-quantized", onnx.TensorProto.INT8, 21, 8),
    "W4A16": ("pack-quantized", onnx.TensorProto.INT4, 21, 4),
    "W4A16_ASYM": ("pack-quantized", onnx.TensorProto.INT4, 21, 4),
    "W4A8": ("int-quantized", onnx.TensorProto.INT4, 21, 4),
    "FP8": ("float-quantized", onnx.TensorProto.FLOAT8E4M3FN, 19, 8),
    "FP8_DYNAMIC": ("float-quantized", onnx.TensorProto.FLOAT8E4M3FN, 19, 8),
    "FP8_BLOCK": ("float-quantized", onnx.TensorProto.FLOAT8E4M3FN, 21, 8),
    "NVFP4A16": ("nvfp4-pack-quantized", onnx.TensorProto.FLOAT4E2M1, 23, 4),
    "NVFP4": ("nvfp4-pack-quantized", onnx.TensorProto.FLOAT4E2M1, 23, 4),
    "MXFP4A16": ("mxfp4-pack-quantized", onnx.TensorProto.FLOAT4E2M1, 24, 4),
}
# min SQNR (dB) of the written model against fp32 on held-out data (random-init models, so 4-bit
# schemes sit low); about 3 dB under what `python tools/accuracy.py` measures (README table).
FP32_SQNR_FLOOR = {
    "tiny-llama": {"W8A8": 33, "W8A8_STATIC": 27, "W8A16": 35, "W4A16": 11, "W4A16_ASYM": 11, "W4A8": 11,
                   "FP8": 21, "FP8_DYNAMIC": 21, "FP8_BLOCK": 21, "NVFP4A16": 12, "NVFP4": 10, "MXFP4A16": 11},
    "tiny-bert": {"W8A8": 57, "W8A8_STATIC": 54, "W8A16": 60, "W4A16": 36, "W4A16_ASYM": 37, "W4A8": 36,
                  "FP8": 46, "FP8_DYNAMIC": 46, "FP8_BLOCK": 46, "NVFP4A16": 38, "NVFP4": 35, "MXFP4A16": 36},
}
FP4 = ("NVFP4A16", "NVFP4", "MXFP4A16")  # onnxruntime has no fp4 kernels: written for --target qdq only
# every scheme in the forms written for onnxruntime (its fast kernels) and as literal standard Q/DQ
CASES = [(m, s, t) for m in FP32_SQNR_FLOOR for s in SCHEMES for t in ("onnxruntime", "qdq")
         if t == "qdq" or s not in FP4]


def _builder(model_name):
    from tools.builders import build_tiny_bert, build_tiny_llama

    return {"tiny-llama": build_tiny_llama, "tiny-bert": build_tiny_bert}[model_name]


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each (model, scheme) calibrated once through the CLI."""
    from tests.conftest import MODELS

    done = {}

    def get(model_name, scheme, target=None):
        target = target or ("qdq" if scheme in FP4 else "onnxruntime")
        if (model_name, scheme, target) not in done:
            src = MODELS / model_name
            before = _digest(src / "model.onnx")
            out = tmp_path_factory.mktemp(f"{model_name}-{scheme}-{target}")
            result = run_cli(
                "run", str(src / "model.onnx"), "--data", str(src / "calib.npz"),
                "--scheme", scheme, "-o", str(out), "--device", "cpu", "--target", target)
            assert result.exit_code == 0, result.output
            assert _digest(src / "model.onnx") == before, "the input model was modified"
            done[model_name, scheme, target] = (src, out, result.output)
        return done[model_name, scheme, target]

    return get


def _quantized_targets(src):
    return [t for t in find_targets(onnx.load(src / "model.onnx"))[0] if t.name != "lm_head"]


def _weight_read(model: onnx.ModelProto, t) -> tuple[str, bool]:
    """The tensor the written node reads as its weight, and whether it is [in, out] (MatMul, or a
    Gemm with transB=0: the onnxruntime form stores a Gemm's weight that way)."""
    node = next(n for n in model.graph.node if n.name == t.node)
    trans_b = next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "transB"), 0)
    return node.input[1], node.op_type == "MatMul" or not trans_b


@pytest.mark.parametrize("model_name, scheme, target", CASES)
def test_written_model_is_valid_and_weights_are_stored_quantized(runs, model_name, scheme, target):
    src, out, output = runs(model_name, scheme, target)
    model = onnx.load(out / "model.onnx")
    onnx.checker.check_model(model, full_check=True)
    _, storage, opset, bits = SCHEMES[scheme]
    assert next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) == opset
    assert model.ir_version <= 13, "onnxruntime 1.31 loads IR <= 13"
    inits = {t.name: t for t in model.graph.initializer}
    for t in _quantized_targets(src):
        stored = inits[f"{t.name}.weight_quantized"]
        assert stored.data_type == storage
        # packed: bits per element, two 4-bit values per byte
        assert len(stored.raw_data) == -(-t.out_features * t.in_features * bits // 8), t.name
        assert t.weight not in inits, f"float weight of {t.name} is still stored"
    # read through DequantizeLinear, or (fp8, and integer weights no integer kernel takes, for
    # onnxruntime) Cast -> Mul, which onnxruntime folds at load
    expanded = [n for n in model.graph.node if n.name.endswith(("/weight/DequantizeLinear", "/weight/Cast"))]
    assert len(expanded) == len(_quantized_targets(src))
    assert "quantized" in output and "wrote:" in output


@pytest.mark.parametrize("model_name, scheme, target", CASES)
def test_each_dequantized_weight_equals_compressed_tensors(runs, model_name, scheme, target):
    """The weight each quantized node reads is compressed-tensors' fake-quantized weight."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    src, out, _ = runs(model_name, scheme, target)
    original = onnx.load(src / "model.onnx")
    config, params = load_written(out)
    args = config.config_groups["group_0"].weights
    written = onnx.load(out / "model.onnx")
    targets = _quantized_targets(src)
    reads = [_weight_read(written, t) for t in targets]
    tapped, names = add_taps(written, [name for name, _ in reads])
    feeds = {k: v[:1] for k, v in np.load(src / "heldout.npz").items()}
    values = run_model(tapped, feeds, names)
    for t, name, (_, in_out) in zip(targets, names, reads):
        w = torch.from_numpy(torch_weight(original, t))
        scale = params[f"{t.name}.weight_scale"]
        zp = params.get(f"{t.name}.weight_zero_point", torch.zeros_like(scale).to(torch.int8))
        ref = fake_quantize(w, scale, zp, args, global_scale=params.get(f"{t.name}.weight_global_scale")).numpy()
        got = values[name].T if in_out else values[name]
        # exact but for NVFP4's DQ(fp8 scale, 1/global_scale) against compressed-tensors' scale / global_scale
        np.testing.assert_allclose(got, ref, rtol=2e-7, atol=0, err_msg=t.name)


@pytest.mark.parametrize("model_name, scheme, target", CASES)
def test_every_layer_matches_compressed_tensors(runs, model_name, scheme, target):
    src, out, _ = runs(model_name, scheme, target)
    original = onnx.load(src / "model.onnx")
    config, params = load_written(out)
    scheme_ = config.config_groups["group_0"]
    targets = _quantized_targets(src)
    # the original node's output and bias: the onnxruntime form may move both after the node,
    # under the same tensor names
    nodes = {n.name: n for n in original.graph.node}
    written = onnx.load(out / "model.onnx")
    # fetch each target's float activation (before its Q/DQ) and its MatMul/Gemm output
    fetch = []
    for t in targets:
        fetch += [t.activation, nodes[t.node].output[0]]
        if t.op_type == "Gemm" and len(nodes[t.node].input) > 2:
            fetch.append(nodes[t.node].input[2])  # bias (an Identity output in the shipped BERT)
    tapped, names = add_taps(written, fetch)
    feeds = {k: v[:4] for k, v in np.load(src / "heldout.npz").items()}
    values = run_model(tapped, feeds, names)
    for t in targets:
        x = torch.from_numpy(values[t.activation])
        y = values[nodes[t.node].output[0]]
        w = torch.from_numpy(torch_weight(original, t))
        ref = ct_layer_reference(x, w, scheme_, params, t.name).numpy()
        if t.op_type == "Gemm" and len(nodes[t.node].input) > 2:  # Gemm adds its bias inside the node
            ref = ref + values[nodes[t.node].input[2]]
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(), err_msg=t.name)


@pytest.mark.parametrize("model_name, scheme, target", CASES)
def test_end_to_end_against_compressed_tensors_and_fp32(runs, model_name, scheme, target):
    src, out, _ = runs(model_name, scheme, target)
    feeds = dict(np.load(src / "heldout.npz"))
    got = next(iter(run_model(onnx.load(out / "model.onnx"), feeds).values()))
    fp32 = next(iter(run_model(src / "model.onnx", feeds).values()))
    ref = ct_torch_reference(_builder(model_name), out, feeds)
    to_fp32 = sqnr_db(fp32, got)
    assert to_fp32 >= FP32_SQNR_FLOOR[model_name][scheme]
    # per sample: how much closer the written model is to compressed-tensors than to fp32. A 1-ulp
    # difference upstream (torch vs onnxruntime norms) can flip an activation rounding and make a
    # sample diverge, so the median sample is what must agree (most sit at 100+ dB).
    margins = [sqnr_db(ref[i], got[i]) - sqnr_db(fp32[i], got[i]) for i in range(len(got))]
    assert np.median(margins) >= 15, margins


@pytest.mark.parametrize("model_name, scheme", [(m, s) for m, s, t in CASES if t == "onnxruntime"])
def test_onnxruntime_form_loads_at_its_default_level_and_keeps_the_numbers(runs, model_name, scheme):
    """At ORT_ENABLE_ALL (onnxruntime's default: its Q/DQ fusions and integer kernels) the model
    loads and stays with what it computes at ORT_ENABLE_BASIC (the Q/DQ spec). Through many
    layers a last-bit difference can flip a later activation's rounding, so the bound is relative:
    the gap to BASIC is at least 6 dB under the quantization error (10 dB where nothing rounds on
    the way). Weight-only int schemes are compared at MatMulNBits accuracy level 0: at the
    default level 4 the kernel also quantizes its input (tests/graph/test_ort_forms.py bounds that)."""
    if INT8_SATURATES and scheme in ("W8A8", "W8A8_STATIC"):  # their u8 x s8 kernels
        pytest.skip(SATURATION_REASON)
    src, out, _ = runs(model_name, scheme, "onnxruntime")
    feeds = {k: v[:8] for k, v in np.load(src / "heldout.npz").items()}
    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # onnxruntime's default level is ORT_ENABLE_ALL
    weight_only = SCHEMES[scheme][0] == "pack-quantized"
    if weight_only:
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    session = ort.InferenceSession(str(out / "model.onnx"), opts, providers=["CPUExecutionProvider"])
    fast = session.run(None, feeds)[0]
    spec = next(iter(run_model(out / "model.onnx", feeds).values()))
    fp32 = next(iter(run_model(src / "model.onnx", feeds).values()))
    margin = 10 if weight_only else 6
    assert sqnr_db(spec, fast) >= sqnr_db(fp32, spec) + margin


@pytest.mark.parametrize("model_name, scheme", sorted({(m, s) for m, s, _ in CASES}))
def test_metadata_as_compressed_tensors_writes_it(runs, model_name, scheme):
    """quantization_config.json validates, and qparams.safetensors holds exactly the parameters
    compressed-tensors' apply_quantization_config registers on the torch model: names, shapes, dtypes."""
    from compressed_tensors.quantization import apply_quantization_config

    src, out, _ = runs(model_name, scheme)
    config, params = load_written(out)  # validates through compressed-tensors' QuantizationConfig
    assert config.quant_method == "compressed-tensors" and config.format == SCHEMES[scheme][0]
    assert config.quantization_status == "frozen"
    assert config.ignore == (["lm_head"] if model_name == "tiny-llama" else [])
    model = _builder(model_name)()[0]
    apply_quantization_config(model, config, show_progress=False)
    args = {"weight": config.config_groups["group_0"].weights, "input": config.config_groups["group_0"].input_activations}
    expected = {}
    for name, p in model.named_parameters():
        base, _, kind = name.rsplit(".", 1)[-1].partition("_")
        if base in args and kind:
            # compressed-tensors registers zero points always but saves them only for asymmetric args
            if kind == "zero_point" and args[base].symmetric:
                continue
            expected[name] = p
    assert set(params) == set(expected)
    for name, value in params.items():
        assert value.shape == expected[name].shape and value.dtype == expected[name].dtype, name


@pytest.mark.slow
@pytest.mark.parametrize("form", ["dynamo", "nofold"])
def test_other_export_forms(exported, tmp_path, form, llama_dir):
    model_path = exported(form)
    data = dict(np.load(llama_dir / "calib.npz"))
    if form == "dynamo":  # exported with the example's static shapes; the loader batches to them
        data = {k: v[:8] for k, v in data.items()}
    np.savez(tmp_path / "calib.npz", **data)
    out = tmp_path / "out"
    result = run_cli("run", str(model_path), "--data", str(tmp_path / "calib.npz"),
                     "--scheme", "W8A8", "-o", str(out), "-q")
    assert result.exit_code == 0, result.output
    written = onnx.load(out / "model.onnx")
    onnx.checker.check_model(written, full_check=True)
    # Transpose(weight) paths are folded into the stored int8 weight and removed
    assert not [n for n in written.graph.node if n.op_type == "Transpose" and "proj" in n.name]
    assert not any(i.name.endswith("proj.weight") for i in written.graph.initializer)
    batch = onnx.load(model_path).graph.input[0].type.tensor_type.shape.dim[0].dim_value or 1
    feeds = {k: v[:batch] for k, v in data.items()}
    got = next(iter(run_model(out / "model.onnx", feeds).values()))
    ref = next(iter(run_model(model_path, feeds).values()))
    assert sqnr_db(ref, got) >= 35
    _, params = load_written(out)
    assert "model.layers.0.self_attn.q_proj.weight_scale" in params


def test_help_tells_a_newcomer_what_to_type():
    result = run_cli("run", "--help")
    assert result.exit_code == 0
    assert "graphcal run models/tiny-llama/model.onnx --data" in result.output
    assert "W8A8_STATIC" in result.output


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--scheme", "NOPE"], 2, "unknown scheme 'NOPE'"),
        (["--scheme", '{"weights": {"num_bits": 8, "strategy": "galaxy"}}'], 2, "invalid scheme"),
        (["--targets", "re:(bad"], 2, "invalid regex"),
        (["--targets", "nothing_matches"], 1, "no target left to quantize"),
        (["--scheme", "W8A8_STATIC", "--observer", "nope"], 2, "unknown observer 'nope'; choose one of: memoryless_minmax"),
        (["--scheme", '{"weights": {"num_bits": 8, "observer": "mse", "observer_kwargs": {"bogus": 1}}}'], 2,
         "unknown observer kwarg(s) 'bogus'"),
        (["--scheme", '{"weights": {"num_bits": 8}, "output_activations": {"num_bits": 8}}'], 1,
         "output_activations are not written to ONNX"),
    ],
)
def test_bad_options_give_one_line_and_exit_code(llama_dir, tmp_path, args, code, message):
    result = run_cli("run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                     "-o", str(tmp_path / "o"), *args)
    assert result.exit_code == code, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "o").exists()


def test_bad_model_file(tmp_path, llama_dir):
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"\x08\x07garbage")
    result = run_cli("run", str(bad), "--data", str(llama_dir / "calib.npz"), "-o", str(tmp_path / "o"))
    assert result.exit_code == 1 and "not a readable ONNX model" in result.output


def test_imatrix_weights_get_activation_importance(llama_dir, tmp_path, runs):
    """imatrix_mse needs E[x^2] of each target's input: the run taps activations even for W8A8.

    With strict=True the observer raises (as llm-compressor's does) when importance is missing
    or does not match in_features, so a clean run shows every weight observer got its own.
    """
    out = tmp_path / "imatrix"
    scheme = ('{"weights": {"num_bits": 8, "strategy": "channel", "observer": "imatrix_mse", '
              '"observer_kwargs": {"strict": true}}}')
    result = run_cli("run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                     "--scheme", scheme, "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "calibrated on 64 samples" in result.output
    _, minmax = load_written(runs("tiny-llama", "W8A8")[1])
    config, imatrix = load_written(out)
    assert config.config_groups["group_0"].weights.observer == "imatrix_mse"
    assert set(imatrix) == set(minmax)
    for key, scale in imatrix.items():
        assert torch.all(scale <= minmax[key] * (1 + 1e-6)), key  # the search only ever shrinks the range


def test_python_dash_m_and_console_script(tmp_path, bert_dir):
    out = tmp_path / "o"
    proc = run_cli_process("run", bert_dir / "model.onnx", "--data", bert_dir / "calib.npz", "--scheme", "W8A8_STATIC",
                           "--num-samples", "16", "--batch-size", "4", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert "calibrated on 16 samples in 4 batches with onnxruntime CPUExecutionProvider" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == [".graphcal-manifest.json", "model.onnx", "qparams.safetensors",
                                                    "quantization_config.json"]
    bad = run_cli_process("run", tmp_path / "missing.onnx", "--data", "x.npz", "-o", tmp_path / "o2")
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == [f"error: model file not found: {tmp_path / 'missing.onnx'}"]


# -- --target tensorrt ----------------------------------------------------------------------


def _trt_fp4_dynamic_quantize():
    """trt::TRT_FP4DynamicQuantize for onnx.reference, as NVIDIA documents it: per block of
    ``block_size`` along the last axis, scale = fp8(amax / 6 / global), x -> fp4(x / (scale * global));
    outputs (x fp4, scales fp8). The arithmetic follows compressed-tensors' dynamic "local" scales."""
    import ml_dtypes
    from onnx.reference.op_run import OpRun

    class TRT_FP4DynamicQuantize(OpRun):  # noqa: N801 -- the op's name
        op_domain = "trt"

        def _run(self, x, scale, axis=-1, block_size=16, scale_type=None):
            blocks = x.reshape(*x.shape[:-1], -1, block_size)
            gs = np.float32(1.0) / scale.astype(np.float32)
            s = np.clip(np.abs(blocks).max(-1) / np.float32(6.0) * gs, -448, 448).astype(ml_dtypes.float8_e4m3fn)
            s_eff = np.where(s.astype(np.float32) == 0, np.float32(0.125), s.astype(np.float32)) / gs
            q = np.clip(blocks / s_eff[..., None], -6, 6).astype(ml_dtypes.float4_e2m1fn)
            return q.reshape(x.shape), s

    return TRT_FP4DynamicQuantize


def test_tensorrt_nvfp4_form_computes_what_the_standard_form_does(runs, tmp_path, llama_dir):
    """NVFP4 for TensorRT: fp4 weights [out, in] blocked on the last axis (+ Transpose for MatMul),
    activations through trt::TRT_FP4DynamicQuantize; same numbers as the standard ONNX form."""
    from onnx.reference import ReferenceEvaluator

    out = tmp_path / "trt"
    result = run_cli("run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                     "--scheme", "NVFP4", "--target", "tensorrt", "-o", str(out), "-q")
    assert result.exit_code == 0, result.output
    model = onnx.load(out / "model.onnx")
    onnx.checker.check_model(model, full_check=True)
    assert {o.domain: o.version for o in model.opset_import}["trt"] == 1
    custom = [n for n in model.graph.node if n.op_type == "TRT_FP4DynamicQuantize"]
    assert len(custom) == 8 and all(n.domain == "trt" for n in custom)  # 4 distinct activations per layer
    inits = {t.name: t for t in model.graph.initializer}
    q_proj = "model.layers.0.self_attn.q_proj"
    assert list(inits[f"{q_proj}.weight_quantized"].dims) == [128, 128] and \
        list(inits[f"{q_proj}.weight_scale"].dims) == [128, 8]  # [out, in / 16]
    assert not [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    feeds = {k: v[:4] for k, v in np.load(llama_dir / "heldout.npz").items()}
    # Not graphcal.runtime.run_model: the trt:: custom op runs in neither onnxruntime nor stock
    # onnx.reference, so this one evaluator is given its implementation (new_ops) by hand.
    got = ReferenceEvaluator(model, new_ops=[_trt_fp4_dynamic_quantize()]).run(None, feeds)[0]
    standard = run_model(onnx.load(runs("tiny-llama", "NVFP4")[1] / "model.onnx"), feeds)["logits"]
    np.testing.assert_allclose(got, standard, rtol=1e-5, atol=1e-5)
    _, params = load_written(out)
    _, params_std = load_written(runs("tiny-llama", "NVFP4")[1])
    assert params.keys() == params_std.keys() and all(torch.equal(params[k], params_std[k]) for k in params)


@pytest.mark.parametrize("scheme", ["W8A8_STATIC", "FP8", "W4A16"])
def test_tensorrt_forms_that_are_standard_onnx_are_written_as_for_qdq(runs, tmp_path, llama_dir, scheme):
    out = tmp_path / "trt"
    result = run_cli("run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                     "--scheme", scheme, "--target", "tensorrt", "-o", str(out), "-q")
    assert result.exit_code == 0, result.output
    assert _digest(out / "model.onnx") == _digest(runs("tiny-llama", scheme, "qdq")[1] / "model.onnx")


@pytest.mark.parametrize("scheme, reason", [
    ("W8A8", "int8/fp8 activations per tensor with a static scale, not dynamic token; use W8A8_STATIC or FP8"),
    ("FP8_DYNAMIC", "not dynamic token"),
    ("FP8_BLOCK", "int8/fp8 weights per tensor or per channel, not per block"),
    ("W8A16", "int8/fp8 weights per tensor or per channel, not per group"),
    ("W4A16_ASYM", "symmetric quantization only"),
    ("W4A8", "int4 as weight-only"),
    ("MXFP4A16", "fp4 as NVFP4 only"),
    ('{"weights": {"num_bits": 4, "strategy": "group", "group_size": 32}}', "int4 weights in blocks of 64 or 128"),
])
def test_tensorrt_refuses_what_it_cannot_build(llama_dir, tmp_path, scheme, reason):
    result = run_cli("run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                     "--scheme", scheme, "--target", "tensorrt", "-o", str(tmp_path / "o"))
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "--target tensorrt" in lines[0] and reason in lines[0], result.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("scheme", FP4)
def test_fp4_is_refused_for_onnxruntime_and_written_for_qdq_with_a_warning(runs, llama_dir, tmp_path, scheme):
    result = run_cli("run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                     "--scheme", scheme, "-o", str(tmp_path / "o"))
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert "no float4 kernels" in lines[0] and "--target qdq" in lines[0]
    assert not (tmp_path / "o").exists()
    assert "onnxruntime 1.31 has no float4" in runs("tiny-llama", scheme, "qdq")[2]
    assert "no float4" not in runs("tiny-llama", "W4A16", "qdq")[2]


def test_external_data_in_gives_external_data_out(runs, tmp_path, llama_dir):
    """A model whose weights live in external data is written the same way, with the same numbers."""
    src = tmp_path / "src"
    src.mkdir()
    onnx.save_model(onnx.load(llama_dir / "model.onnx"), src / "model.onnx", save_as_external_data=True,
                    all_tensors_to_one_file=True, location="weights.bin", size_threshold=1024)
    before = _digest(src / "weights.bin")
    out = tmp_path / "out"
    result = run_cli("run", str(src / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                     "--scheme", "W4A16", "-o", str(out), "-q")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == [".graphcal-manifest.json", "model.onnx", "model.onnx.data",
                                                    "qparams.safetensors", "quantization_config.json"]
    inline_size = (runs("tiny-llama", "W4A16")[1] / "model.onnx").stat().st_size
    assert (out / "model.onnx").stat().st_size < 0.3 * inline_size < (out / "model.onnx.data").stat().st_size
    assert _digest(src / "weights.bin") == before
    feeds = {k: v[:4] for k, v in np.load(llama_dir / "heldout.npz").items()}
    got = run_model(out / "model.onnx", feeds)["logits"]
    inline = run_model(runs("tiny-llama", "W4A16")[1] / "model.onnx", feeds)["logits"]
    np.testing.assert_array_equal(got, inline)


@pytest.mark.parametrize("scheme", ["NVFP4A16", "NVFP4"])
def test_fused_groups_share_the_written_global_scale(runs, scheme):
    """q/k/v and gate/up store one weight_global_scale, 448 * 6 / joint absmax of the torch weights."""
    _, params = load_written(runs("tiny-llama", scheme)[1])
    weights = {n: m.weight.detach() for n, m in _builder("tiny-llama")()[0].named_modules()
               if isinstance(m, torch.nn.Linear)}
    for layer in (0, 1):
        for members in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
            names = [f"model.layers.{layer}.{members[0]}.{m}" for m in members[1]]
            joint = max(weights[n].abs().max() for n in names)
            for n in names:
                torch.testing.assert_close(params[f"{n}.weight_global_scale"], (2688.0 / joint).reshape(1))


def test_json_summary_for_scripts(llama_dir, tmp_path):
    import json

    result = run_cli("run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                     "--scheme", "W8A8_STATIC", "-o", str(tmp_path / "o"), "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["ignored"] == ["lm_head"] and len(summary["quantized"]) == 14
    assert (summary["samples"], summary["batches"], summary["ranks"]) == (64, 8, 1)
    assert sorted(summary["files"]) == sorted(str(p) for p in (tmp_path / "o").iterdir()
                                              if p.name != ".graphcal-manifest.json")  # files: the outputs, not it


def test_verbose_logs_each_stage(llama_dir, tmp_path):
    result = run_cli("-v", "run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                     "--scheme", "W8A8_STATIC", "-o", str(tmp_path / "o"), "-q")
    assert result.exit_code == 0, result.output
    for line in ("graphcal: loaded", "graphcal: 15 weight MatMul/Gemm found, 14 to quantize",
                 "0 whole tensors and 8 reductions fetched per batch", "graphcal: observing and quantizing 14 weights",
                 "graphcal: wrote"):
        assert line in result.output, line


def test_external_weights_stay_on_disk_until_read(tmp_path, llama_dir, runs, monkeypatch):
    """With external data, the model in memory keeps only references for big tensors (1 MB; 30 KB
    here, so the tiny model's weights count as big); with every tensor external (threshold 0,
    shape constants included) the numbers are the inline run's."""
    from graphcal.graph import io as graph_io

    monkeypatch.setattr(graph_io, "LAZY_MIN_BYTES", 30_000)
    src = tmp_path / "src"
    src.mkdir()
    onnx.save_model(onnx.load(llama_dir / "model.onnx"), src / "model.onnx", save_as_external_data=True,
                    all_tensors_to_one_file=True, location="all.bin", size_threshold=0)
    model, external = graph_io.load_model_info(src / "model.onnx", lazy=True)
    assert external
    for t in model.graph.initializer:
        on_disk = t.data_location == onnx.TensorProto.EXTERNAL
        assert on_disk == (expected_bytes(t) >= graph_io.LAZY_MIN_BYTES), t.name
        assert on_disk != bool(t.raw_data)
    assert sum(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer) == 16  # weights, embeddings
    out = tmp_path / "out"
    result = run_cli("run", str(src / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                     "--scheme", "W8A8_STATIC", "-o", str(out), "-q")
    assert result.exit_code == 0, result.output
    inline = runs("tiny-llama", "W8A8_STATIC")[1]
    assert (out / "qparams.safetensors").read_bytes() == (inline / "qparams.safetensors").read_bytes()
    feeds = {k: v[:4] for k, v in np.load(llama_dir / "heldout.npz").items()}
    np.testing.assert_array_equal(run_model(out / "model.onnx", feeds)["logits"],
                                  run_model(inline / "model.onnx", feeds)["logits"])
