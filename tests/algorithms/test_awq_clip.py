"""AWQ's clip search (graphcal.algorithms.awq.clip, ``--awq-clip``) against the original AWQ's.

The reference is the original AWQ's clip search written out here as it states it, on tokens:
each group's partial output ``x_g · w_g`` over every token, the candidate bound ``max|w_g| * (1 - i/20)``
for i < 10, the clamped weight rounded on compressed-tensors' own grid (``calculate_qparams`` of its
min and max, ``fake_quantize``), and per row and group the bound whose partial output moves least
(mean square over tokens; the first on ties). graphcal scores the same from the Gram matrix.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from onnx import numpy_helper

from graphcal.algorithms.awq import clip as awq_clip
from tests.helpers import run_cli


def _inputs(tokens: int, columns: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, columns, generator=g, dtype=torch.float64)
    x[:, ::7] *= 8  # outlier channels, as an LLM's activations have
    return x


def _weight(rows: int, columns: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, columns, generator=g) * 0.05
    w[torch.rand(rows, columns, generator=g) < 0.01] *= 12  # a few large weights set each group's range
    return w


def _reference(w: torch.Tensor, x: torch.Tensor, args: QuantizationArgs, size: int) -> torch.Tensor:
    """The clip search on tokens, on compressed-tensors' grid: the (low, high) bound per row and group.

    Symmetric: the original AWQ's ``±max|w_g| * (1 - i/20)``. Asymmetric: the high end shrunk by the
    same factors (the low end kept), then the low end with the chosen high end."""
    rows, columns = w.shape
    groups = columns // size
    wg = w.float().reshape(rows, 1, groups, size)  # the bounds and the clamp in the weight's fp32 (a
    xg = x.double().reshape(1, -1, groups, size)  # clamped value sits on a rounding tie of the grid)
    original = (xg * wg.double()).sum(dim=-1)  # [rows, tokens, groups]

    def error(lo, hi):
        clamped = torch.maximum(torch.minimum(wg, hi), lo).reshape(rows, groups, size)
        low = torch.minimum(clamped.amin(dim=-1), torch.zeros(()))
        high = torch.maximum(clamped.amax(dim=-1), torch.zeros(()))
        scale, zero = calculate_qparams(low.float(), high.float(), args)
        q = fake_quantize(clamped.reshape(rows, columns).float(), scale, zero, args)
        err = ((xg * q.double().reshape(rows, 1, groups, size)).sum(dim=-1) - original).pow(2).mean(dim=1)
        return err.reshape(rows, 1, groups, 1)

    if args.symmetric:
        peak = wg.abs().amax(dim=-1, keepdim=True)  # [rows, 1, groups, 1]
        lo, hi, ends = -peak, peak, [("both", peak)]
    else:
        lo = wg.amin(dim=-1, keepdim=True).clamp(max=0)
        hi = wg.amax(dim=-1, keepdim=True).clamp(min=0)
        ends = [("high", hi), ("low", lo)]
    least = error(lo, hi)
    for end, full in ends:
        for i in range(1, 10):
            r = full * (1 - i / 20)
            trial = {"both": (-r, r), "high": (lo, r), "low": (r, hi)}[end]
            err = error(*trial)
            better = err < least
            least = torch.where(better, err, least)
            lo, hi = torch.where(better, trial[0], lo), torch.where(better, trial[1], hi)
    return torch.stack([lo, hi], dim=-1).reshape(rows, groups, 2)


def _gram(x: torch.Tensor) -> torch.Tensor:
    return (x.T @ x).float()


@pytest.mark.parametrize("symmetric, size", [(True, 32), (False, 32), (True, 128)])
def test_the_bounds_are_the_original_awqs(symmetric, size):
    w, x = _weight(48, 128, 1), _inputs(2048, 128, 2)
    strategy = "channel" if size == 128 else "group"
    args = QuantizationArgs(num_bits=4, symmetric=symmetric, strategy=strategy,
                            group_size=size if strategy == "group" else None)
    found = awq_clip.search(w, args, _gram(x))
    want = _reference(w, x, args, size)
    assert found.bound.shape == want.shape
    equal = torch.isclose(found.bound, want, rtol=1e-6, atol=0)
    assert equal.all(), f"{int((~equal).sum())} of {equal.numel()} bounds differ"
    grouped = w.reshape(48, -1, size)
    high, low = found.bound[..., 1], found.bound[..., 0]
    shrunk = high < grouped.amax(-1) if not symmetric else high < grouped.abs().amax(-1)
    assert shrunk.any()  # it clips somewhere
    if symmetric:
        assert torch.equal(low, -high)
    else:  # each end on its own: some groups lose only their low end
        low_only = (low > grouped.amin(-1)) & (high == grouped.amax(-1))
        assert low_only.any()
        shrunk = shrunk | (low > grouped.amin(-1))
    assert found.shrunk == pytest.approx(float(shrunk.float().mean()))
    assert found.after < found.before


@pytest.mark.parametrize("args", [
    QuantizationArgs(num_bits=8, type="float", strategy="channel"),
    QuantizationArgs(num_bits=4, strategy="tensor"),
    QuantizationArgs(num_bits=4, strategy="group", group_size=48),  # does not divide 64 columns
])
def test_nothing_to_clip(args):
    assert awq_clip.search(_weight(8, 64, 5), args, torch.eye(64)) is None



def _record(folder):
    model = onnx.load(str(folder / "model.onnx"))
    return json.loads(next(p.value for p in model.metadata_props if p.key == "graphcal.awq"))


def _dequantized(folder) -> dict[str, np.ndarray]:
    """Each quantized layer's weight as the written Q/DQ graph gives it (onnx.reference)."""
    from onnx.reference import ReferenceEvaluator

    model = onnx.load(str(folder / "model.onnx"))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in inits and inits[node.input[0]].ndim == 2:
            sub = onnx.helper.make_model(onnx.helper.make_graph(
                [node], "dq", [], [onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None)],
                [onnx.numpy_helper.from_array(inits[i], i) for i in node.input if i]),
                opset_imports=model.opset_import)
            out[node.input[0]] = ReferenceEvaluator(sub).run(None, {})[0]
    return out


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM"])
def test_awq_clip_end_to_end(llama_dir, tmp_path, scheme):
    """--awq-clip: every layer is clipped, q and k included (the record says so), and each layer's
    grids narrow against AWQ without it (on the asymmetric grid each end is searched on its own:
    test_the_bounds_are_the_original_awqs)."""
    from safetensors.numpy import load_file

    flags = ["--data", llama_dir / "calib.npz", "--scheme", scheme, "--group-size", "32", "--algorithm", "awq",
             "--target", "qdq", "-q"]
    plain, clipped = tmp_path / "plain", tmp_path / "clipped"
    assert run_cli("run", llama_dir / "model.onnx", *flags, "-o", plain).exit_code == 0
    result = run_cli("run", llama_dir / "model.onnx", *flags, "--awq-clip", "-o", clipped)
    assert result.exit_code == 0, result.output
    record = _record(clipped)
    layers = {c["layer"].rsplit(".", 1)[1] for c in record["clip"]}
    assert layers == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert all(c["best_error"] < c["initial_error"] and c["groups_clipped"] > 0 for c in record["clip"])
    assert "clip" not in _record(plain)
    qa, qb = (load_file(str(f / "qparams.safetensors")) for f in (plain, clipped))
    assert qa.keys() == qb.keys()
    for k in (k for k in qa if k.endswith("weight_scale")):  # a clipped group's grid only narrows
        assert (qb[k] <= qa[k] * (1 + 1e-6)).all() and (qb[k] < qa[k]).any(), k


def test_the_bounds_set_the_grid_and_gptq_rounds_the_unclamped_weight(llama_dir, tmp_path):
    """awq+gptq --awq-clip: each clipped layer's grid (its written scales) ends inside the one
    awq+gptq writes without the clip; the weight pass's observer sees
    the clamped weight while the weight it rounds stays whole."""
    from safetensors.numpy import load_file

    from graphcal.calibration.transforms.channel_scales import ChannelScales

    flags = ["--data", llama_dir / "calib.npz", "--scheme", "W4A16", "--group-size", "32", "--algorithm",
             "awq+gptq", "--target", "qdq", "-q"]
    plain, clipped = tmp_path / "plain", tmp_path / "clipped"
    assert run_cli("run", llama_dir / "model.onnx", *flags, "-o", plain).exit_code == 0
    assert run_cli("run", llama_dir / "model.onnx", *flags, "--awq-clip", "-o", clipped).exit_code == 0
    a, b = load_file(str(plain / "qparams.safetensors")), load_file(str(clipped / "qparams.safetensors"))
    for name in a:
        if not name.endswith("weight_scale"):
            continue
        assert (b[name] <= a[name] * (1 + 1e-6)).all() and (b[name] < a[name]).any(), name
    # the weight pass observes the clamped weight and rounds the one it was given
    t = type("T", (), {"name": "layer"})()
    scales = ChannelScales([], {}, clips={"layer": torch.tensor([[[-0.5, 0.5], [-1.0, 1.5]]])})
    w = torch.tensor([[0.9, -0.2, 2.0, -3.0]])
    assert torch.equal(scales.weight(t, w), w)
    assert torch.equal(scales.observed(t, w), torch.tensor([[0.5, -0.2, 1.5, -1.0]]))


def test_awq_clip_needs_awq(llama_dir):
    result = run_cli("inspect", llama_dir / "model.onnx", "--scheme", "W4A16", "--awq-clip")
    assert result.exit_code == 2 and "--awq-clip needs --algorithm awq" in result.output, result.output


def test_inspect_lists_the_layers_the_clip_takes(llama_dir):
    args = ["inspect", llama_dir / "model.onnx", "--scheme", "W4A16", "--group-size", "32", "--algorithm", "awq",
            "--awq-clip"]
    text, report = run_cli(*args), run_cli(*args, "--json")
    assert text.exit_code == 0 and report.exit_code == 0, text.output + report.output
    clip = json.loads(report.output)["awq"]["clip"]
    layers = json.loads(report.output)["quantized"]
    assert clip == layers and {c.rsplit(".", 1)[1] for c in clip} >= {"q_proj", "k_proj", "down_proj"}
    assert f"clip search (--awq-clip) on {len(clip)} layer(s): {clip[0]}" in text.output


def test_a_packed_qkv_is_clipped_and_generates(builder_model, tmp_path):
    """The builder's packed qkv_proj (before GroupQueryAttention) is clipped in its q, k and v rows
    alike; the folder still generates in onnxruntime-genai's loop."""
    from tests.genai_models import STEPS, generate

    folder, calib = builder_model
    flags = ["--data", calib, "--scheme", "W4A16", "--group-size", "32", "--algorithm", "awq", "--target", "qdq",
             "-q"]
    plain, clipped = tmp_path / "plain", tmp_path / "clipped"
    assert run_cli("run", folder / "model.onnx", *flags, "-o", plain).exit_code == 0
    result = run_cli("run", folder / "model.onnx", *flags, "--awq-clip", "-o", clipped)
    assert result.exit_code == 0, result.output
    a, b = _dequantized(plain), _dequantized(clipped)
    qkv = [k for k in a if "qkv_proj" in k]
    assert qkv
    for k in qkv:  # [in, out]: of its 128 outputs, q the first 64 (4 heads x 16), k 32, v the last 32
        assert a[k].shape[1] == 128
        for part in (slice(0, 64), slice(64, 96), slice(96, 128)):
            assert not np.array_equal(a[k][:, part], b[k][:, part])
    assert any(c["layer"].endswith("qkv_proj") for c in _record(clipped)["clip"])
    tokens, _ = generate(clipped)
    assert len(tokens) == STEPS
