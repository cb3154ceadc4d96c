"""Test helpers: onnxruntime at ORT_ENABLE_BASIC, compressed-tensors references, error metrics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from graphcal.graph.io import runs_in_onnxruntime  # picks the runner; the numbers come from the runners


def ort_run(model: onnx.ModelProto | str | Path, feeds: dict, outputs: list[str] | None = None) -> dict[str, np.ndarray]:
    """Run at ORT_ENABLE_BASIC (no QDQ fusions, so Q/DQ numerics are the ONNX spec's)."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    sess = ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
    names = outputs or [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def sqnr_db(ref: np.ndarray, got: np.ndarray) -> float:
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    return float(10 * np.log10((ref**2).sum() / max(((ref - got) ** 2).sum(), 1e-300)))


def load_written(out_dir: Path):
    """(QuantizationConfig, qparams dict) from a graphcal output folder, via compressed-tensors."""
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    config = QuantizationConfig.model_validate(json.loads((out_dir / "quantization_config.json").read_text()))
    return config, load_file(str(out_dir / "qparams.safetensors"))


def ct_torch_reference(builder, out_dir: Path, feeds: dict) -> np.ndarray:
    """The torch model with graphcal's written config and qparams applied by compressed-tensors.

    compressed-tensors' own apply_quantization_config wraps every targeted Linear with its
    fake quantization (weights and inputs, dynamic or static); the qparams are loaded from
    qparams.safetensors. Returns the first output.
    """
    from compressed_tensors.quantization import apply_quantization_config

    model, _, output_names, _ = builder()
    config, params = load_written(out_dir)
    apply_quantization_config(model, config, show_progress=False)
    named = dict(model.named_parameters())
    for key, value in params.items():
        assert key in named, f"{key} is not a compressed-tensors parameter of the torch model"
        named[key].data = value.to(named[key].dtype).reshape(named[key].shape)
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v) for k, v in feeds.items()})
    first = getattr(out, output_names[0]) if hasattr(out, output_names[0]) else out[0]
    return first.numpy()


def ct_layer_reference(x: torch.Tensor, w: torch.Tensor, scheme, params: dict, name: str) -> torch.Tensor:
    """fake_quantize(x) @ fake_quantize(W).T with compressed-tensors' functions and the written qparams.

    Dynamic scales come from compressed-tensors' compute_dynamic_scales_and_zp; tensor_group
    schemes pass the written global scales, as compressed-tensors' forward does.
    """
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    def zp(base, scale):
        return params.get(f"{name}.{base}_zero_point", torch.zeros_like(scale).to(torch.int8))

    ws = params[f"{name}.weight_scale"]
    wq = fake_quantize(w, ws, zp("weight", ws), scheme.weights, global_scale=params.get(f"{name}.weight_global_scale"))
    a = scheme.input_activations
    gs = params.get(f"{name}.input_global_scale")
    if a is None:
        xq = x
    elif a.dynamic:
        s, z = compute_dynamic_scales_and_zp(x, a, None, global_scale=gs)
        xq = fake_quantize(x, s, z, a, global_scale=gs)
    else:
        s = params[f"{name}.input_scale"]
        xq = fake_quantize(x, s, zp("input", s), a, global_scale=gs)
    return xq @ wq.T


def run_model(model: onnx.ModelProto, feeds: dict, outputs: list[str] | None = None) -> dict[str, np.ndarray]:
    """onnxruntime at ORT_ENABLE_BASIC, or onnx.reference's ReferenceEvaluator for fp4 / e8m0 models."""
    if runs_in_onnxruntime(model):
        return ort_run(model, feeds, outputs)
    from onnx.reference import ReferenceEvaluator

    names = outputs or [o.name for o in model.graph.output]
    return dict(zip(names, ReferenceEvaluator(model).run(names, feeds)))


def write_qdq(model: onnx.ModelProto, items: list, runtime: str = "onnxruntime") -> onnx.ModelProto:
    """The Q/DQ model for ``items``, written as graphcal.pipeline writes it: a QDQWriter at the opset
    ``items_opset`` gives, each weight read and quantized, then each input, then ``finish()``. It
    writes into a copy (the pipeline writes into a model it loaded itself), so ``model`` stays
    usable for references."""
    from graphcal.graph.qdq import QDQWriter, items_opset
    from graphcal.graph.targets import torch_weight

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    writer = QDQWriter(copy, items_opset(items, runtime=runtime), runtime)
    for item in items:
        writer.quantize_weight(item, torch.from_numpy(torch_weight(writer.model, item.target)))
    for item in items:
        writer.quantize_input(item)
    return writer.finish()
