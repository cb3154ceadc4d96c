"""The weight quantizer's fast route against compressed-tensors' own ``quantize``, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import quantize

import graphcal.graph.qdq.quantize as Q
from graphcal.calibration.observe import to_qparams
from graphcal.graph.qdq.policy import qtype_of
from graphcal.observers import Observer

CASES = {
    "int8-channel": dict(num_bits=8, strategy="channel", symmetric=True),
    "int8-channel-asym": dict(num_bits=8, strategy="channel", symmetric=False),
    "int8-tensor": dict(num_bits=8, strategy="tensor", symmetric=True),
    "int4-group": dict(num_bits=4, strategy="group", group_size=32, symmetric=True),
    "int4-group-asym": dict(num_bits=4, strategy="group", group_size=32, symmetric=False),
    "fp8-channel": dict(num_bits=8, type="float", strategy="channel"),
    "nvfp4": dict(num_bits=4, type="float", strategy="tensor_group", group_size=16, scale_dtype=torch.float8_e4m3fn),
    "fp4-group": dict(num_bits=4, type="float", strategy="group", group_size=16, scale_dtype=torch.float8_e4m3fn),
}


def _weight(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(96, 256, generator=g) * 0.05
    # signed zeros, tiny values, and values on fp4's ties once scaled (x / s lands on 0.25, 0.75, ... exactly)
    w[0, :8] = torch.tensor([0.0, -0.0, 1e-9, -1e-9, 0.2, -0.2, 3.0, -3.0])
    w[1, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * torch.tensor([1.0] * 8 + [-1.0] * 8)
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_route_is_compressed_tensors_byte_for_byte(case, dtype, monkeypatch):
    args = QuantizationArgs(**CASES[case])
    w = _weight(dtype)
    obs = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)
    obs(w)
    qp = to_qparams(obs.get_qparams())
    qtype = qtype_of(args, "x", "weights")
    want = qtype.array(quantize(w, qp.scale.to(w.dtype), qp.zero_point, args, global_scale=qp.global_scale))
    assert Q._fast_route(args, qtype, w) is not None  # the route under test, not the fallback
    for chunk in (1 << 18, 512):  # one chunk, and many (rows, or whole groups of columns)
        monkeypatch.setattr(Q, "CHUNK_ELEMENTS", chunk)
        for weight in (w, w.t().contiguous().t()):  # [out, in], and a view of [in, out] as a MatMul stores it
            got = Q.quantized_array(args, qp, weight, qtype)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert np.array_equal(np.ascontiguousarray(got).view(np.uint8), want.view(np.uint8)), (chunk, weight.stride())


def test_fp4_codes_on_every_tie_and_step():
    """Every e2m1 code, the ties between them and their neighbours, against compressed-tensors' rounding."""
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    grid = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0])
    near = torch.cat([grid, torch.nextafter(grid, torch.tensor(10.0)), torch.nextafter(grid, torch.tensor(-10.0))])
    x = torch.cat([near, -near]).clamp(-6, 6)
    codes = Q._fp4_codes(x.clone())
    want = torch.from_numpy(np.asarray(cast_to_fp4(x.clone()).numpy().astype(Q.ml_dtypes.float4_e2m1fn)).view(np.uint8))
    assert torch.equal(codes, want)


def test_block_and_mx_take_compressed_tensors_route():
    w = _weight(torch.float32)
    block = QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=[32, 32])
    assert Q._fast_route(block, qtype_of(block, "x", "weights"), w) is None


def test_min_max_of_a_transposed_view_is_the_contiguous_ones():
    from graphcal.observers.base import reduce_min_max
    from graphcal.observers.helpers import flatten_for_calibration

    w = _weight(torch.float32)
    w[3, 5] = float("nan")
    for args in (QuantizationArgs(**CASES["int8-channel"]), QuantizationArgs(**CASES["int4-group"]),
                 QuantizationArgs(**CASES["int8-tensor"])):
        view = flatten_for_calibration(w.t().contiguous().t(), "weight", args)
        dense = flatten_for_calibration(w, "weight", args)
        for got, want in zip(reduce_min_max(view), (torch.amin(dense, dim=(0, -1)), torch.amax(dense, dim=(0, -1)))):
            assert got.shape == want.shape and torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
            assert torch.equal(got.isnan(), want.isnan())


@pytest.mark.parametrize("external", [False, True])
def test_weight_tensor_is_torch_weight_without_the_copies(llama_dir, tmp_path, external):
    """The weight pass's reader gives the values torch_weight gives, inline and from external data."""
    import onnx

    from graphcal.graph.targets import find_targets, torch_weight, weight_tensor

    model = onnx.load(str(llama_dir / "model.onnx"))
    base = str(llama_dir)
    if external:
        onnx.save_model(model, str(tmp_path / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                        location="model.onnx.data", size_threshold=0)
        model, base = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False), str(tmp_path)
    targets = find_targets(model)[0]
    assert any(t.layout == "in_out" for t in targets)
    for t in targets:
        got = weight_tensor(model, t, base)
        assert got.shape == (t.out_features, t.in_features)
        assert torch.equal(got, torch.from_numpy(torch_weight(model, t, base)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_single_group_divides_in_compressed_tensors_dtype(dtype):
    """One NVFP4 group: its fp32 effective scale (scale / global scale) must promote the division as
    compressed-tensors' [1, 1, 1] scale does, not be a 0-dim tensor that leaves it in bf16."""
    args = QuantizationArgs(**CASES["nvfp4"])
    qtype = qtype_of(args, "x", "weights")
    for seed in range(200):
        w = (torch.randn(1, 16, generator=torch.Generator().manual_seed(seed)) * 0.3).to(dtype)
        obs = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)
        obs(w)
        qp = to_qparams(obs.get_qparams())
        qp = type(qp)(scale=qp.scale * 1.0137, zero_point=qp.zero_point, global_scale=qp.global_scale)
        want = qtype.array(quantize(w, qp.scale.to(w.dtype), qp.zero_point, args, global_scale=qp.global_scale))
        got = Q.quantized_array(args, qp, w, qtype)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), seed
