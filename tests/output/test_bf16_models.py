"""bfloat16 models in and out (issue 47, criterion 6): onnxruntime-genai's builder with -p bf16, torch exports of
bf16 checkpoints.

onnxruntime's CPU provider has no bfloat16 kernel for the ops a decoder runs (Mul, MatMul...), so on the CPU:
- the schemes with no data pass (round to nearest: W4A16, W8A8 dynamic, --matmulnbits) run: the weights are read
  as bf16 and quantized as llm-compressor quantizes a bf16 checkpoint (compressed-tensors' math in the weight's
  dtype: bf16 scales), and the scales are written in bf16, at an opset whose Q/DQ take bf16 (19);
- every run with a data pass (static activations, GPTQ, AWQ, SmoothQuant) is refused in one line when its first
  session opens, before any batch: use --device cuda, or convert the model first.

References: compressed-tensors' observer and quantize math on the bf16 weights; onnxruntime (ORT_ENABLE_BASIC,
CPU) on float32 copies of the written model and of the input model with those reference weights in place."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, numpy_helper

from graphcal.arrays import to_torch
from tests.helpers import run_cli
from tools.lib.decoder import DecoderShape, make_decoder
from tools.lib.synthetic import save_npz

SHAPE = DecoderShape(hidden=64, layers=3, intermediate=128, heads=4, kv_heads=2, vocab=128)
REFUSAL = "error: onnxruntime's CPU provider cannot run this bfloat16 model (no kernel for "


@pytest.fixture(scope="module")
def bf16_decoder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bf16")
    make_decoder(folder, SHAPE, dtype="bfloat16", seed=5)
    ids = np.random.default_rng(2).integers(0, SHAPE.vocab, (6, 12), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, 8:] = 0
    save_npz(folder / "calib.npz", {"input_ids": ids, "attention_mask": mask})
    return folder


def as_float32(model: onnx.ModelProto, replace: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """A copy of ``model`` computing in float32 where it computed in bfloat16: initializers and Constants upcast
    (exact), Casts to bf16 made Casts to float, the graph's bf16 inputs and outputs float; ``replace``: initializers
    given new float32 values."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    replace = replace or {}

    def upcast(t: onnx.TensorProto) -> onnx.TensorProto:
        if t.name in replace:
            return numpy_helper.from_array(replace[t.name].astype(np.float32), t.name)
        if t.data_type != TensorProto.BFLOAT16:
            return t
        return numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name)

    inits = [upcast(t) for t in out.graph.initializer]
    del out.graph.initializer[:]
    out.graph.initializer.extend(inits)
    for node in out.graph.node:
        for a in node.attribute:
            if a.name == "to" and a.i == TensorProto.BFLOAT16:
                a.i = TensorProto.FLOAT
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.BFLOAT16:
                a.t.CopyFrom(upcast(a.t))
    for v in (*out.graph.input, *out.graph.output, *out.graph.value_info):
        if v.type.tensor_type.elem_type == TensorProto.BFLOAT16:
            v.type.tensor_type.elem_type = TensorProto.FLOAT
    return out


def logits(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    from graphcal.runtime import run_model

    return run_model(model, feeds)["logits"]


def reference_weights(model: onnx.ModelProto, folder, group: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each Linear weight's W4A16 grid as llm-compressor takes it from a bf16 checkpoint: compressed-tensors'
    min/max qparams per group of ``group`` and its quantize, in bf16 -> {initializer: (int codes [out, in],
    scale [out, in / group])}."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    from graphcal.graph.targets import find_targets

    args = preset_name_to_scheme("W4A16", ["Linear"]).weights.model_copy(update={"group_size": group})
    out = {}
    for t in find_targets(model)[0]:
        if t.name == "lm_head":
            continue
        w = to_torch(numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == t.weight), folder)).t()
        assert w.dtype == torch.bfloat16
        groups = w.reshape(w.shape[0], -1, group)
        scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        out[t.weight] = (quantize(w, scale, zp, args), scale)
    return out


def test_the_writer_rounds_the_float32_draw_to_bf16(tmp_path):
    """make_decoder's bfloat16 weights are its float32 draw rounded to nearest even (the bit arithmetic below),
    each at its offset in the data file (tied tables included)."""
    from tools.lib.decoder import build, chunks

    shape = DecoderShape(hidden=64, layers=1, intermediate=128, heads=4, kv_heads=2, vocab=128, tie=True)
    model = onnx.load(make_decoder(tmp_path, shape, dtype="bfloat16", seed=5))
    onnx.checker.check_model(model, full_check=True)
    stored = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    assert {a.dtype.name for a in stored.values()} == {"bfloat16"}
    _, weights = build(shape, "bfloat16")
    drawn = {w.name: np.concatenate([c for _, c in chunks(w, 5, np.float32)]).reshape(w.shape) for w in weights
             if not w.tied_to}
    drawn.update({w.name: drawn[w.tied_to].T for w in weights if w.tied_to})
    for name, f32 in drawn.items():
        bits = f32.view(np.uint32).astype(np.uint64)
        want = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round half to even, no NaN here
        assert np.array_equal(stored[name].view(np.uint16), want), name


@pytest.mark.parametrize("nbits", [False, True], ids=["dq", "matmulnbits"])
def test_round_to_nearest_w4a16_runs_on_the_cpu(tmp_path, bf16_decoder, nbits):
    """W4A16 (no data pass) on a bf16 model (MatMulNBits at accuracy level 0: level 4 would quantize the activations
    itself): the codes and bf16 scales are compressed-tensors' on the bf16 weights,
    the output is valid ONNX whose scales are bf16, and its float32 copy computes what the input model computes
    with those weights dequantized in its place."""
    out = tmp_path / "out"
    result = run_cli("run", bf16_decoder / "model.onnx", "--data", bf16_decoder / "calib.npz", "--scheme", "W4A16",
                     "--group-size", "64", *(["--matmulnbits", "0"] if nbits else []), "-o", out, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["pass"] == ""  # no data pass
    written = onnx.load(out / "model.onnx")
    source = onnx.load(bf16_decoder / "model.onnx")
    want = reference_weights(source, bf16_decoder, 64)
    dequantized = {}
    for name, (codes, scale) in want.items():
        dequantized[name] = (codes.float() * scale.float().repeat_interleave(64, dim=1)).t().numpy()  # [in, out]
    scales = [i for i in written.graph.initializer if i.name.endswith(".weight_scale")]
    assert len(scales) == len(want) and {s.data_type for s in scales} == {TensorProto.BFLOAT16}
    got_scales = sorted(numpy_helper.to_array(s).astype(np.float32).tobytes() for s in scales)
    if nbits:  # [out, blocks]
        want_scales = sorted(s.float().numpy().tobytes() for _, s in want.values())
    else:  # the DQ's [in / group, out]
        want_scales = sorted(s.float().t().contiguous().numpy().tobytes() for _, s in want.values())
    assert got_scales == want_scales
    if not nbits:
        onnx.checker.check_model(written, full_check=True)
        assert max(o.version for o in written.opset_import if o.domain in ("", "ai.onnx")) >= 21
        codes = sorted(numpy_helper.to_array(i).astype(np.int8).tobytes() for i in written.graph.initializer
                       if i.name.endswith(".weight_quantized"))
        assert codes == sorted(c.to(torch.int8).t().contiguous().numpy().tobytes() for c, _ in want.values())
    feeds = {"input_ids": np.arange(10, dtype=np.int64).reshape(2, 5) % SHAPE.vocab,
             "attention_mask": np.ones((2, 5), np.int64)}
    reference = logits(as_float32(onnx.load(bf16_decoder / "model.onnx"), dequantized), feeds)
    got = logits(as_float32(written), feeds)
    assert np.allclose(got, reference, rtol=1e-4, atol=1e-4), np.abs(got - reference).max()


def test_dynamic_w8a8_writes_bf16_scales_at_opset_19(tmp_path, bf16_decoder):
    """W8A8 (dynamic activations: no data pass) runs; Q/DQ take bf16 scales from opset 19 only (at 13 a bf16 or
    fp16 scale is a type error onnxruntime refuses at load)."""
    out = tmp_path / "out"
    result = run_cli("run", bf16_decoder / "model.onnx", "--data", bf16_decoder / "calib.npz", "--scheme", "W8A8",
                     "-o", out)
    assert result.exit_code == 0, result.output
    written = onnx.load(out / "model.onnx")
    onnx.checker.check_model(written, full_check=True)
    assert max(o.version for o in written.opset_import if o.domain in ("", "ai.onnx")) >= 19
    assert {i.data_type for i in written.graph.initializer if i.name.endswith(".weight_scale")} == {TensorProto.BFLOAT16}
    feeds = {"input_ids": np.arange(10, dtype=np.int64).reshape(2, 5), "attention_mask": np.ones((2, 5), np.int64)}
    assert np.isfinite(logits(as_float32(written), feeds)).all()


def test_an_fp16_static_output_loads_in_onnxruntime(tmp_path):
    """The same opset rule for fp16: W8A8_STATIC on an fp16 decoder wrote fp16 scales into opset-13 Q/DQ, a model
    onnxruntime refused to load (INVALID_GRAPH)."""
    import onnxruntime as ort

    make_decoder(tmp_path, SHAPE, dtype="float16", seed=5)
    ids = np.random.default_rng(2).integers(0, SHAPE.vocab, (4, 8), dtype=np.int64)
    save_npz(tmp_path / "calib.npz", {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    result = run_cli("run", tmp_path / "model.onnx", "--data", tmp_path / "calib.npz", "--scheme", "W8A8_STATIC",
                     "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    onnx.checker.check_model(str(tmp_path / "out" / "model.onnx"), full_check=True)
    session = ort.InferenceSession(str(tmp_path / "out" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert np.isfinite(session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]).all()


@pytest.mark.parametrize("args", [
    ("--scheme", "W8A8_STATIC", "--pass", "blocks"),
    ("--scheme", "W8A8_STATIC", "--pass", "whole-graph"),
    ("--scheme", "W4A16", "--group-size", "64", "--algorithm", "gptq"),
    ("--scheme", "W4A16", "--group-size", "64", "--algorithm", "gptq", "--pass", "whole-graph"),
], ids=lambda a: " ".join(a))
def test_a_data_pass_on_the_cpu_is_refused_in_one_line(tmp_path, bf16_decoder, args):
    """Every run that needs onnxruntime to run the bf16 graph stops when its first session opens (before any
    batch), in one line that says what to do, and writes nothing."""
    result = run_cli("run", bf16_decoder / "model.onnx", "--data", bf16_decoder / "calib.npz", *args,
                     "--device", "cpu", "-o", tmp_path / "out")
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(REFUSAL), result.output
    assert "--device cuda" in lines[0] and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.gpu
def test_on_cuda_a_bf16_decoder_streams_to_the_whole_graph_scales(tmp_path, bf16_decoder):
    """On CUDA (bf16 kernels) W8A8_STATIC runs on the bf16 decoder with either pass: the weights' qparams are the
    same bit for bit, the input scales within a bf16 rounding of each other (the residual stream is handed over
    in bf16 at each block boundary, as inside the whole graph); and both within bf16 error of the CPU's scales
    on the model's float32 copy (which would catch a pass that fed the wrong tensors)."""
    from safetensors.torch import load_file

    fp32 = tmp_path / "fp32"
    fp32.mkdir()
    onnx.save(as_float32(onnx.load(bf16_decoder / "model.onnx")), fp32 / "model.onnx")
    runs = {("cuda", "blocks"): bf16_decoder, ("cuda", "whole-graph"): bf16_decoder, ("cpu", "whole-graph"): fp32}
    got = {}
    for (device, mode), folder in runs.items():
        out = tmp_path / f"{device}-{mode}"
        result = run_cli("run", folder / "model.onnx", "--data", bf16_decoder / "calib.npz", "--scheme", "W8A8_STATIC",
                         "--pass", mode, "--device", device, "-o", out, "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["pass"].startswith("streamed" if mode == "blocks" else "whole-graph")
        got[device, mode] = load_file(out / "qparams.safetensors")
    blocks, whole, cpu = got["cuda", "blocks"], got["cuda", "whole-graph"], got["cpu", "whole-graph"]
    assert blocks.keys() == whole.keys() == cpu.keys()
    for key in whole:
        assert whole[key].dtype == torch.bfloat16 or "zero_point" in key, key
        if "input" in key:
            assert (blocks[key].float() - whole[key].float()).abs().max() <= 2 ** -7 * whole[key].float().abs().max(), key
            assert (whole[key].float() - cpu[key].float()).abs().max() <= 3e-2 * cpu[key].float().abs().max(), key
        else:
            assert torch.equal(blocks[key], whole[key]), key
            assert (whole[key].float() - cpu[key].float()).abs().max() <= 2 ** -7 * cpu[key].float().abs().max(), key
