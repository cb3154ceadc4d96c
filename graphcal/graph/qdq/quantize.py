"""A weight quantized into its ONNX storage type: compressed-tensors' ``quantize``, by a faster route.

``quantized_array(args, qp, w, qtype)`` is ``qtype.array(quantize(w, scale, zero_point, args,
global_scale))`` element for element and bit for bit (signed zeros included), for the strategies
and types every preset uses (tensor, channel, group and tensor_group; int4/int8, fp8 e4m3, fp4
e2m1 with fp8 or float scales). It runs compressed-tensors' steps in the same order and dtypes
(divide by the scale -- over the global scale for tensor_group --, add the zero point, clamp,
round or cast), a few hundred thousand elements at a time so that every step reads from cache,
and writes the storage codes directly: int8 for ints, the float8 byte, and for fp4 the e2m1 code
of compressed-tensors' rounding (ties at 0.25, 1.25, 2.5 and 5 go down, at 0.75, 1.75 and 3.5
up: round half to even on the e2m1 grid), by three roundings instead of its eight masked writes. ``w`` may be a transposed view (the weight as a MatMul stores it, [in, out]): each step
keeps its memory order, so the array comes back laid out like ``w`` and storing it [in, out]
needs no transposing copy. Block and MX strategies take compressed-tensors' own route.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from graphcal.graph.qdq.policy import is_mx
from graphcal.types import QParams
from graphcal.types import enum_value as _name

__all__ = ["quantized_array", "CHUNK_ELEMENTS"]

#: elements quantized per step: a few scratch buffers of this size stay in the core's cache
CHUNK_ELEMENTS = 1 << 18


def quantized_array(args, qp: QParams, w: torch.Tensor, qtype) -> np.ndarray:
    """``w`` (torch [out, in], any strides) on the grid of ``qp``, as ``qtype``'s numpy storage array."""
    fast = _fast_route(args, qtype, w)
    if fast is None:
        # lazy: compressed-tensors takes seconds to import; only this path needs it
        from compressed_tensors.quantization.lifecycle.forward import quantize

        return qtype.array(quantize(w, qp.scale.to(w.dtype), qp.zero_point, args, global_scale=qp.global_scale))
    kind, group = fast
    scale = qp.scale.to(w.dtype)
    if qp.global_scale is not None:
        scale = scale / qp.global_scale
    zero_point = None if qp.zero_point is None else qp.zero_point
    out_dtype = {"int": torch.int8, "fp8": torch.float8_e4m3fn, "fp4": torch.uint8}[kind]
    out = torch.empty_strided(w.shape, w.stride(), dtype=out_dtype)
    q_min, q_max = _range(args)
    for rows, cols in _chunks(w, group):
        x = w[rows, cols]
        s = _param(scale, rows, cols, group, w.shape)
        z = None if zero_point is None else _param(zero_point, rows, cols, group, w.shape)
        if group:
            x = x.unflatten(-1, (-1, group))
        scaled = torch.div(x, s)
        if z is not None:
            scaled += z.to(x.dtype)
        scaled.clamp_(q_min, q_max)
        if kind == "int":
            codes = scaled.round_().to(torch.int8)
        elif kind == "fp8":
            codes = scaled.to(torch.float8_e4m3fn)
        else:
            codes = _fp4_codes(scaled)
        out[rows, cols].copy_(codes.flatten(-2) if group else codes)
    array = out.view(torch.int8).numpy() if kind == "int" else out.view(torch.uint8).numpy()
    return array.view(qtype.np_dtype) if kind != "int" else array.astype(qtype.np_dtype, copy=False)


def _fast_route(args, qtype, w: torch.Tensor) -> tuple[str, int | None] | None:
    """("int" | "fp8" | "fp4", group size or None) when the fast route computes this, else None."""
    strategy = _name(args.strategy)
    if strategy not in ("tensor", "channel", "group", "tensor_group") or is_mx(args) or w.ndim != 2:
        return None
    if not w.is_floating_point() or w.device.type != "cpu":
        return None
    np_dtype = qtype.np_dtype
    if _name(args.type) == "int" and args.num_bits in (4, 8):
        kind = "int"
    elif np_dtype == np.dtype(ml_dtypes.float8_e4m3fn):
        kind = "fp8"
    elif np_dtype == np.dtype(ml_dtypes.float4_e2m1fn):
        kind = "fp4"
    else:
        return None
    group = args.group_size if strategy in ("group", "tensor_group") else None
    if group and w.shape[1] % group:
        return None  # compressed-tensors raises its own error for this
    return kind, group


def _range(args) -> tuple[float, float]:
    # lazy: compressed-tensors takes seconds to import; only this path needs it
    from compressed_tensors.quantization.utils import calculate_range

    q_min, q_max = calculate_range(args, torch.device("cpu"))
    return float(q_min), float(q_max)


def _chunks(w: torch.Tensor, group: int | None):
    """Row or column slices of ``w`` of about CHUNK_ELEMENTS each, along its memory-major axis
    (columns in whole groups)."""
    out_f, in_f = w.shape
    if w.stride(0) >= w.stride(1):  # [out, in] in memory: whole rows
        step = max(1, CHUNK_ELEMENTS // max(in_f, 1))
        for r in range(0, out_f, step):
            yield slice(r, r + step), slice(None)
    else:  # a transposed view of [in, out]: whole columns, in whole groups
        unit = group or 1
        step = max(1, CHUNK_ELEMENTS // max(out_f * unit, 1)) * unit
        for c in range(0, in_f, step):
            yield slice(None), slice(c, c + step)


def _param(value: torch.Tensor, rows: slice, cols: slice, group: int | None, shape) -> torch.Tensor:
    """A scale or zero point in compressed-tensors' shape, cut to the chunk and shaped to broadcast."""
    if value.numel() == 1:  # kept a dimension: a 0-dim scale would not take part in dtype promotion
        return value.reshape((1, 1, 1) if group else (1, 1))
    if group:  # [out, in / group] -> [rows, groups, 1]
        value = value.reshape(shape[0], -1)
        g = slice(None) if cols == slice(None) else slice(cols.start // group, -(-min(cols.stop, shape[1]) // group))
        return value[rows, g].unsqueeze(-1)
    return value.reshape(-1, 1)[rows]  # channel: [out, 1]


def _fp4_codes(scaled: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8, sign in bit 3) of compressed-tensors' fp4 rounding of ``scaled`` (already
    clamped to [-6, 6]). The code of |x| is the sum of three roundings, one per step size of the
    grid: 0.5 on [0, 2], 1 on [2, 4], 2 on [4, 6]; round half to even makes the same choices at the
    ties as compressed-tensors' thresholds. Its result ``rounded(|x|) * sign(x)`` is negative, or
    -0.0, exactly where ``sign(x)`` is: that is bit 3. Float steps only (torch compares slowly)."""
    magnitude = scaled.abs()
    code = magnitude.clamp(0.0, 2.0).mul_(2.0).round_()
    code += magnitude.clamp(2.0, 4.0).round_()
    code += magnitude.clamp_(4.0, 6.0).mul_(0.5).round_()
    sign = torch.sign(scaled)
    code += torch.copysign(torch.full_like(sign, 4.0), sign).sub_(4.0).abs_()  # 8 where sign(x) is negative
    return code.sub_(4.0).to(torch.uint8)
