"""Weights stored quantized behind DequantizeLinear.

The stored tensor is exactly what compressed-tensors' ``quantize`` computes; any
Transpose/Cast/Reshape path to the node is folded in (the writer drops it)::

    MatMul(x, W[in, out])  ->  MatMul(x, DequantizeLinear(Wq[in, out], scale, zero_point?, axis, block_size?))

- tensor: scalar scale; channel: scale [out], per-axis (opset 13);
- group / tensor_group: scale [in/G, out], blocked along ``in`` (opset 21);
- block [bh, bw]: the block scales expanded per output row, scale [in/bw, out], blocked along ``in``
  (ONNX blocks along one axis only; the expansion is exact and costs 1/bw of the weight in scales);
- tensor_group with fp8 scales (NVFP4): a two-level chain, as NVIDIA's exporter writes it::

      DequantizeLinear(Wq fp4, DequantizeLinear(scale fp8, 1/global_scale), axis, block_size=16)  (opset 23)

  for TensorRT stored ``[out, in]`` blocked on the last axis, read by MatMul through a Transpose;
- MX (fp4 with uint8 exponent scales, group 32): scales stored as float8e8m0 (opset 24).

Gemm with transB=1 keeps ``[out, in]`` (axis 0 per channel, axis 1 for blocks). int4 and fp4 are
packed two per byte; zero points are written only for asymmetric schemes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
from onnx import helper

from graphcal.graph.qdq.edits import Edits
from graphcal.graph.qdq.policy import FP4, FP8, Runtime, fp8_scales, is_mx, qtype_of
from graphcal.types import QParams, Target
from graphcal.types import enum_value as _name


def weight_dq(edits: Edits, t: Target, args, qp: QParams, w: torch.Tensor, runtime: Runtime) -> str:
    """Build the target's quantized weight ``w`` (torch [out, in]) and its DequantizeLinear;
    returns the tensor that replaces the node's B input."""
    from compressed_tensors.quantization.lifecycle.forward import quantize

    qtype = qtype_of(args, t.name, "weights")
    strategy = _name(args.strategy)
    q = quantize(w, qp.scale.to(w.dtype), qp.zero_point, args, global_scale=qp.global_scale)
    # TensorRT's NVFP4 weights are blocked along the last axis of [out, in] (NVIDIA's exporter
    # form); a MatMul then reads them through a Transpose.
    transpose = runtime is Runtime.TENSORRT and qtype is FP4 and t.layout == "in_out"
    layout = _WeightLayout(t, strategy, args, "out_in" if transpose else t.layout)
    stored = edits.const(f"{t.name}.weight_quantized", layout.weight(qtype.array(q)))
    scale = _weight_scale(edits, t, args, qp, w.dtype, layout)
    inputs = [stored, scale]
    if not args.symmetric:
        inputs.append(edits.const(f"{t.name}.weight_zero_point", layout.param(qtype.array(qp.zero_point))))
    attrs = layout.attrs()
    if is_mx(args):
        attrs["output_dtype"] = helper.np_dtype_to_tensor_dtype(_np_dtype(w.dtype))
    dq_out = edits.unique(f"{t.name}.weight_dequantized")
    edits.add(t.node, helper.make_node(
        "DequantizeLinear", inputs, [dq_out], name=edits.unique(f"{t.name}/weight/DequantizeLinear"), **attrs
    ))
    if transpose:
        dq_out = edits.op(t.node, "Transpose", [dq_out], f"{t.name}/weight/Transpose", perm=[1, 0])
    return dq_out


def _weight_scale(edits: Edits, t: Target, args, qp: QParams, dtype: torch.dtype, layout: _WeightLayout) -> str:
    """The DQ scale input: a constant, or for fp8-scaled tensor groups the DQ(fp8 scale, 1/global) chain."""
    scale = qp.scale.detach().to(torch.float32)
    if is_mx(args):  # powers of two, stored as e8m0 exponents
        return edits.const(f"{t.name}.weight_scale", layout.param(scale.numpy().astype(ml_dtypes.float8_e8m0fnu)))
    if qp.global_scale is not None and fp8_scales(args):
        fp8 = edits.const(f"{t.name}.weight_scale", layout.param(scale.numpy().astype(FP8.np_dtype)))
        inv = (1.0 / qp.global_scale.detach().to(torch.float64)).to(dtype).reshape(())
        inv_name = edits.const(f"{t.name}.weight_global_scale_inverse", inv.numpy())
        out = edits.unique(f"{t.name}.weight_scale_dequantized")
        edits.add(t.node, helper.make_node("DequantizeLinear", [fp8, inv_name], [out],
                                           name=edits.unique(f"{t.name}/weight_scale/DequantizeLinear")))
        return out
    if qp.global_scale is not None:  # effective scale as compressed-tensors computes it: scale / global_scale
        scale = scale / qp.global_scale.detach().to(torch.float32)
    return edits.const(f"{t.name}.weight_scale", layout.param(scale.to(dtype).numpy()))


class _WeightLayout:
    """Where a weight's per-tensor / per-channel / per-block parameters go in ONNX.

    compressed-tensors holds them in torch's [out, in] orientation: scalar (tensor), [out, 1]
    (channel), [out, in/G] (group, tensor_group) or [out/bh, in/bw] (block). ONNX blocks along
    one axis only, so block scales are expanded per output row to [out, in/bw]; the node's B
    input is [in, out] for MatMul, so everything but the scalar is transposed there.
    """

    def __init__(self, t: Target, strategy: str, args, stored: str):
        self.t, self.strategy, self.stored = t, strategy, stored
        self.block = None
        if strategy in ("group", "tensor_group"):
            self.block = args.group_size
        elif strategy == "block":
            self.rows, self.block = args.block_structure

    def weight(self, array: np.ndarray) -> np.ndarray:
        """The quantized weight, torch [out, in], as the node's B input takes it."""
        return array.T if self.stored == "in_out" else array

    def param(self, array: np.ndarray) -> np.ndarray:
        """A scale or zero point in compressed-tensors' shape, laid out for DequantizeLinear."""
        if self.strategy == "tensor":
            return array.reshape(())
        if self.strategy == "channel":
            return array.reshape(-1)
        array = array.reshape(array.shape[0], -1)
        if self.strategy == "block":
            array = np.repeat(array, self.rows, axis=0)[: self.t.out_features]
        return self.weight(array)

    def attrs(self) -> dict:
        if self.strategy == "tensor":
            return {}
        if self.strategy == "channel":
            return {"axis": 1 if self.stored == "in_out" else 0}
        return {"axis": 0 if self.stored == "in_out" else 1, "block_size": self.block}


def _np_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype
