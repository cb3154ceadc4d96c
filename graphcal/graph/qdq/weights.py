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

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
import torch
from onnx import helper

from graphcal.arrays import numpy_dtype, to_numpy
from graphcal.errors import GraphcalError
from graphcal.graph.qdq.edits import Edits
from graphcal.graph.qdq.policy import FP4, FP8, TargetRuntime, fp8_scales, is_mx, qtype_of
from graphcal.graph.qdq.quantize import quantized_array
from graphcal.types import QParams, Target
from graphcal.types import enum_value as _name


def weight_dq(edits: Edits, t: Target, args, qp: QParams, w: torch.Tensor, target_runtime: TargetRuntime,
              stored: str | None = None, zero_point: bool = False) -> str:
    """Build the target's quantized weight ``w`` (torch [out, in]) and its DequantizeLinear;
    returns the tensor that replaces the node's B input. ``stored`` overrides the layout the
    node reads (the writer stores a Gemm's weight [in, out] and clears transB, for onnxruntime);
    ``zero_point`` writes a symmetric scheme's zero point (0) too (onnxruntime's QGemm fusion
    needs it)."""
    qtype = qtype_of(args, t.name, "weights")
    strategy = _name(args.strategy)
    q = quantized_array(args, qp, w, qtype)
    # TensorRT's NVFP4 weights are blocked along the last axis of [out, in] (NVIDIA's exporter
    # form); a MatMul then reads them through a Transpose.
    transpose = target_runtime is TargetRuntime.TENSORRT and qtype is FP4 and t.layout == "in_out"
    layout = _WeightLayout(t, strategy, args, "out_in" if transpose else (stored or t.layout))
    stored = edits.const(f"{t.name}.weight_quantized", layout.weight(q))
    scale = _weight_scale(edits, t, args, qp, w.dtype, layout)
    inputs = [stored, scale]
    if not args.symmetric or zero_point:
        zp = qp.zero_point if not args.symmetric else torch.zeros_like(qp.scale)
        inputs.append(edits.const(f"{t.name}.weight_zero_point", layout.param(qtype.array(zp))))
    attrs = layout.attrs()
    if is_mx(args):
        attrs["output_dtype"] = helper.np_dtype_to_tensor_dtype(numpy_dtype(w.dtype))
    dq_out = edits.unique(f"{t.name}.weight_dequantized")
    edits.add(t.node, helper.make_node(
        "DequantizeLinear", inputs, [dq_out], name=edits.unique(f"{t.name}/weight/DequantizeLinear"), **attrs
    ))
    if transpose:
        dq_out = edits.op(t.node, "Transpose", [dq_out], f"{t.name}/weight/Transpose", perm=[1, 0])
    return dq_out


def weight_cast_mul(edits: Edits, t: Target, args, qp: QParams, w: torch.Tensor) -> str:
    """The quantized weight as an initializer of its storage type, expanded by plain ops::

        Cast(Wq, float) [- zero_point] * scale     (blocks: Reshape -> * scale -> Reshape back)

    Same values as DequantizeLinear; onnxruntime folds the chain into a float weight at load, so
    no Q/DQ fusion sees a quantized weight (fp8 Q/DQ around a MatMul is mis-fused in 1.31)."""
    qtype = qtype_of(args, t.name, "weights")
    strategy = _name(args.strategy)
    layout = _WeightLayout(t, strategy, args, t.layout)
    q = layout.weight(quantized_array(args, qp, w, qtype))
    dtype = numpy_dtype(w.dtype)
    scale = layout.param(to_numpy(_effective_scale(qp).to(w.dtype)))
    zp = None if args.symmetric else layout.param(qp.zero_point.detach().to(torch.float32).numpy()).astype(dtype)
    base = f"{t.name}/weight"
    x = edits.op(t.node, "Cast", [edits.const(f"{t.name}.weight_quantized", q)], f"{base}/Cast",
                 to=helper.np_dtype_to_tensor_dtype(dtype))
    shape, blocked = q.shape, layout.block is not None
    if blocked:  # [in, out] blocked along axis 0 -> [in/B, B, out]; [out, in] along axis 1 -> [out, in/B, B]
        block = layout.block
        split = [shape[0] // block, block, shape[1]] if layout.stored == "in_out" else [shape[0], shape[1] // block, block]
        x = edits.op(t.node, "Reshape", [x, edits.const(f"{t.name}.weight_blocks_shape", np.array(split, np.int64))],
                     f"{base}/Reshape")
        pad = 1 if layout.stored == "in_out" else 2
        scale, zp = (None if a is None else np.expand_dims(a, pad) for a in (scale, zp))
    elif strategy == "channel" and layout.stored == "out_in":
        scale, zp = (None if a is None else a.reshape(-1, 1) for a in (scale, zp))
    if zp is not None:
        x = edits.op(t.node, "Sub", [x, edits.const(f"{t.name}.weight_zero_point", zp)], f"{base}/Sub")
    x = edits.op(t.node, "Mul", [x, edits.const(f"{t.name}.weight_scale", scale)], f"{base}/Mul")
    if blocked:
        x = edits.op(t.node, "Reshape", [x, edits.const(f"{t.name}.weight_shape", np.array(shape, np.int64))],
                     f"{base}/Restore")
    return x


def weight_matmulnbits(edits: Edits, t: Target, args, qp: QParams, w: torch.Tensor, level: int,
                       node: onnx.NodeProto) -> None:
    """Turn ``node`` (MatMul, or Gemm with transA=0, alpha=1, beta=1) into onnxruntime's
    ``com.microsoft.MatMulNBits`` with compressed-tensors' quantized weight packed as it reads it:

    B uint8 [out, ceil(in/bs), bs*bits/8] (values + 2^(bits-1), low nibble first), scales
    [out, ceil(in/bs)], zero points (asymmetric only; + 2^(bits-1), packed likewise) and the
    node's bias. Per-channel / per-tensor scales repeat over blocks of ``bs`` (exact); groups
    and blocks keep their size. ``level`` is the kernel's ``accuracy_level`` (4: it quantizes
    the input to int8 per block of ``bs``; 0: float input)."""
    packed = nbits_arrays(t, args, qp, w)
    inputs = [node.input[0], edits.const(f"{t.name}.weight_packed", packed.data),
              edits.const(f"{t.name}.weight_scale", packed.scale)]
    if packed.zero_point is not None:
        inputs.append(edits.const(f"{t.name}.weight_zero_point", packed.zero_point.reshape(-1)))
    bias = None
    if node.op_type == "Gemm":
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or (len(node.input) > 2 and node.input[2]
                                                                           and attrs.get("beta", 1.0) != 1.0):
            raise GraphcalError(f"{t.name}: --matmulnbits takes Gemm with transA=0, alpha=1 and beta=1 only")
        if len(node.input) > 2 and node.input[2]:
            bias = node.input[2]
    if bias is not None:
        inputs += [""] * (5 - len(inputs)) + [bias]
    del node.input[:]
    node.input.extend(inputs)
    del node.attribute[:]
    node.attribute.extend([helper.make_attribute("K", t.in_features), helper.make_attribute("N", t.out_features),
                           helper.make_attribute("bits", args.num_bits), helper.make_attribute("block_size", packed.block),
                           helper.make_attribute("accuracy_level", level)])
    node.op_type, node.domain = "MatMulNBits", MS_DOMAIN
    edits.domains.add(MS_DOMAIN)


MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class Packed:
    """A weight in onnxruntime's n-bit block layout (MatMulNBits' B, GatherBlockQuantized's data):
    ``data`` uint8 ``[out, blocks, block * bits / 8]``, ``scale`` ``[out, blocks]`` in the weight's
    float type, ``zero_point`` uint8 ``[out, ceil(blocks * bits / 8)]`` (asymmetric only; None: the
    kernels' default 2^(bits-1))."""

    data: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray | None
    block: int


def nbits_arrays(t: Target, args, qp: QParams, w: torch.Tensor) -> Packed:
    """compressed-tensors' quantized weight (torch ``[out, in]``) packed as onnxruntime's n-bit
    kernels read it: values + 2^(bits-1) along ``in``, low nibble first; ``in`` zero-padded to whole
    blocks; per-channel / per-tensor scales repeated over blocks of ``bs`` (exact: the largest power
    of two up to 128 that fits), groups and blocks at their own width."""
    qtype = qtype_of(args, t.name, "weights")
    bits = args.num_bits
    strategy = _name(args.strategy)
    n, k = t.out_features, t.in_features
    if strategy == "group":
        block = args.group_size
    elif strategy == "block":
        block = args.block_structure[1]
    else:
        block = 16
        while block * 2 <= min(k, 128):
            block *= 2
    blocks = -(-k // block)
    q = quantized_array(args, qp, w, qtype).astype(np.int16) + (1 << (bits - 1))  # unsigned [n, k]
    layout = _WeightLayout(t, strategy, args, "out_in")  # groups and blocks as [out, in / block]
    scale = _per_block(layout, _effective_scale(qp).numpy(), blocks).astype(numpy_dtype(w.dtype))
    padded = np.zeros((n, blocks * block), np.uint8)
    padded[:, :k] = q
    zero_point = None
    if not args.symmetric:
        zp = _per_block(layout, qp.zero_point.detach().to(torch.float32).numpy(), blocks)
        zp = (np.rint(zp).astype(np.int16) + (1 << (bits - 1))).astype(np.uint8)
        if bits == 4 and blocks % 2:
            zp = np.concatenate([zp, np.zeros((n, 1), np.uint8)], axis=1)
        zero_point = _pack(zp, bits)
    return Packed(_pack(padded, bits).reshape(n, blocks, -1), scale.reshape(n, blocks), zero_point, block)


def _per_block(layout: _WeightLayout, param: np.ndarray, blocks: int) -> np.ndarray:
    """A scale or zero point in compressed-tensors' shape as [out, blocks of the input]: per tensor
    and per channel repeated over the blocks, groups and blocks as the [out, in] layout has them."""
    if layout.strategy in ("tensor", "channel"):  # one value, or one per output row: the same for every block
        return np.broadcast_to(param.reshape(-1, 1), (layout.t.out_features, blocks)).copy()
    return layout.param(param)


def _effective_scale(qp: QParams) -> torch.Tensor:
    """The scale a weight is dequantized with, as compressed-tensors computes it: scale / global_scale."""
    scale = qp.scale.detach().to(torch.float32)
    if qp.global_scale is not None:
        scale = scale / qp.global_scale.detach().to(torch.float32)
    return scale


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned values along the last axis packed into bytes, low nibble first for 4 bits."""
    values = values.astype(np.uint8)
    if bits == 8:
        return values
    return (values[..., 0::2] & 0x0F) | (values[..., 1::2] << 4)


def _weight_scale(edits: Edits, t: Target, args, qp: QParams, dtype: torch.dtype, layout: _WeightLayout) -> str:
    """The DQ scale input: a constant, or for fp8-scaled tensor groups the DQ(fp8 scale, 1/global) chain."""
    scale = qp.scale.detach().to(torch.float32)
    if is_mx(args):  # powers of two, stored as e8m0 exponents
        return edits.const(f"{t.name}.weight_scale", layout.param(scale.numpy().astype(ml_dtypes.float8_e8m0fnu)))
    if qp.global_scale is not None and fp8_scales(args):
        fp8 = edits.const(f"{t.name}.weight_scale", layout.param(scale.numpy().astype(FP8.np_dtype)))
        inv = (1.0 / qp.global_scale.detach().to(torch.float64)).to(dtype).reshape(())
        inv_name = edits.const(f"{t.name}.weight_global_scale_inverse", to_numpy(inv))
        out = edits.unique(f"{t.name}.weight_scale_dequantized")
        edits.add(t.node, helper.make_node("DequantizeLinear", [fp8, inv_name], [out],
                                           name=edits.unique(f"{t.name}/weight_scale/DequantizeLinear")))
        return out
    return edits.const(f"{t.name}.weight_scale", layout.param(to_numpy(_effective_scale(qp).to(dtype))))


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

