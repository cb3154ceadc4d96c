"""Static Q/DQ on the key and value states, as compressed-tensors fake-quantizes them at the cache.

A state ``[batch, kv_heads, seq, head_dim]`` entering attention is read through one pair::

    DequantizeLinear(QuantizeLinear(k, k_scale, zp), k_scale, zp)     (per tensor, or axis=1 per kv head)

placed in front of the first node that reads it. For onnxruntime, fp8 states are written
without DequantizeLinear, ``Mul(Cast(Cast(Div(k, k_scale), fp8), float), k_scale)`` (the same
values): its Q/DQ propagation would move an fp8 DequantizeLinear past the Unsqueeze/Reshape of
``repeat_kv``, which have no fp8 kernel, and the model would not load at ORT_ENABLE_ALL.
"""

from __future__ import annotations

import torch

from graphcal.errors import GraphcalError
from graphcal.graph.qdq.activations import fp8_rounded
from graphcal.graph.qdq.edits import Edits
from graphcal.graph.qdq.policy import FP8, TargetRuntime, qtype_of
from graphcal.types import QuantizedKV
from graphcal.types import enum_value as _name


def state_dq(edits: Edits, kv: QuantizedKV, base: str, tensor: str, anchor: str,
             target_runtime: TargetRuntime = TargetRuntime.ONNXRUNTIME) -> str:
    """Build the Q/DQ of state ``tensor`` ("k" or "v" in ``base``) before node ``anchor``; returns
    the tensor its readers take instead."""
    per_head = _name(kv.args.strategy) == "attn_head"
    qtype = qtype_of(kv.args, kv.state.name, "key/value states")
    qp = kv.qparams[base]
    scale = qp.scale.detach().to(torch.float32).numpy().astype(edits.dtype_of(tensor))
    scale = scale.reshape(-1) if per_head else scale.reshape(())
    zp = qp.zero_point if not kv.args.symmetric else torch.zeros(scale.shape)
    if not anchor:
        raise GraphcalError(f"{kv.state.name}: the node reading {tensor!r} has no name; cannot place its Q/DQ")
    label = f"{kv.state.name}/{base}"
    if target_runtime is TargetRuntime.ONNXRUNTIME and qtype is FP8:
        # per kv head: [kv_heads, 1, 1] broadcasts over [batch, kv_heads, seq, head_dim]
        s = edits.const(f"{kv.state.name}.{base}_scale", scale.reshape(-1, 1, 1) if per_head else scale)
        return fp8_rounded(edits, anchor, tensor, s, scale.dtype, label)
    s = edits.const(f"{kv.state.name}.{base}_scale", scale)
    z = edits.const(f"{kv.state.name}.{base}_zero_point", qtype.array(zp).reshape(scale.shape))
    attrs = {"axis": 1} if per_head else {}
    return edits.qdq(anchor, tensor, s, z, label, **attrs)
