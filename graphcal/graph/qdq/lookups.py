"""Embedding lookups stored quantized.

A lookup (graph.targets.find_lookups) is ``Gather(E, ids)`` over a table ``E`` ``[vocab, hidden]``,
quantized as llm-compressor quantizes an Embedding's weight (channel: one scale per row; groups
along the hidden dimension). Forms:

- onnxruntime: ``com.microsoft.GatherBlockQuantized(Eq, ids, scales, zero_points?)`` with uint8
  data ``[vocab, blocks * block * bits / 8]`` in the n-bit layout MatMulNBits reads
  (weights.nbits_arrays: values + 2^(bits-1), low nibble first; the kernel's default zero point is
  2^(bits-1), so a symmetric scheme writes none), ``gather_axis=0``, ``quantize_axis=1``; where
  ``hidden`` is not a whole number of blocks a Slice trims the padded row. onnxruntime folds no
  DequantizeLinear into a Gather: that form would dequantize the whole table on every run.
- qdq / tensorrt: ``Gather(DequantizeLinear(Eq int [vocab, hidden], scale, zero_point?), ids)``,
  per channel on axis 0 or in blocks along axis 1 (weights.weight_dq, the table as an [out, in]
  weight).

A lookup tied to a quantized lm_head (graph.ties) reads lm_head's stored weight instead of a copy:
with MatMulNBits, a Reshape of its packed B ``[vocab, blocks, blob]`` to ``[vocab, blocks * blob]``,
its scales and its zero points (as onnxruntime-genai's builder shares them); with
DequantizeLinear, a Transpose of its dequantized ``[hidden, vocab]`` weight.
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import helper

from graphcal.graph.qdq.edits import Edits
from graphcal.graph.qdq.weights import MS_DOMAIN, nbits_arrays
from graphcal.types import QParams, Target


def lookup_gather_block(edits: Edits, t: Target, args, qp: QParams, w: torch.Tensor, node: onnx.NodeProto) -> None:
    """Turn the lookup's Gather into GatherBlockQuantized over its own quantized table."""
    packed = nbits_arrays(t, args, qp, w)
    data = edits.const(f"{t.name}.weight_packed", packed.data.reshape(t.out_features, -1))
    scale = edits.const(f"{t.name}.weight_scale", packed.scale)
    zp = None if packed.zero_point is None else edits.const(f"{t.name}.weight_zero_point", packed.zero_point)
    _gather_block(edits, t, node, data, scale, zp, packed.block, args.num_bits)


def share_gather_block(edits: Edits, t: Target, node: onnx.NodeProto, nbits: onnx.NodeProto) -> None:
    """Turn the lookup's Gather into GatherBlockQuantized over the tied lm_head's MatMulNBits weight
    (``nbits``, written already): its packed bytes, scales and zero points, reshaped, not copied."""
    attrs = {a.name: helper.get_attribute_value(a) for a in nbits.attribute}
    shape = edits.const(f"{t.name}.weight_shape", np.array([t.out_features, -1], np.int64))
    data = edits.op(t.node, "Reshape", [nbits.input[1], shape], f"{t.name}/weight/Reshape")
    zp = None
    if len(nbits.input) > 3 and nbits.input[3]:
        zp = edits.op(t.node, "Reshape", [nbits.input[3], shape], f"{t.name}/weight_zero_point/Reshape")
    _gather_block(edits, t, node, data, nbits.input[2], zp, attrs["block_size"], attrs["bits"])


def _gather_block(edits: Edits, t: Target, node: onnx.NodeProto, data: str, scale: str, zp: str | None, block: int,
                  bits: int) -> None:
    """``node`` (the Gather) made GatherBlockQuantized in place; a Slice after it where the rows are padded."""
    ids, out = node.input[1], node.output[0]
    del node.input[:]
    node.input.extend([data, ids, scale] + ([zp] if zp is not None else []))
    del node.attribute[:]
    node.attribute.extend([helper.make_attribute("gather_axis", 0), helper.make_attribute("quantize_axis", 1),
                           helper.make_attribute("block_size", block), helper.make_attribute("bits", bits)])
    node.op_type, node.domain = "GatherBlockQuantized", MS_DOMAIN
    edits.domains.add(MS_DOMAIN)
    if t.in_features % block:  # the last block's padding trimmed off the gathered rows
        node.output[0] = edits.unique(f"{out}_padded")
        starts = edits.const(f"{t.name}.slice_starts", np.array([0], np.int64))
        ends = edits.const(f"{t.name}.slice_ends", np.array([t.in_features], np.int64))
        axes = edits.const(f"{t.name}.slice_axes", np.array([-1], np.int64))
        edits.add_after(t.node, helper.make_node("Slice", [node.output[0], starts, ends, axes], [out],
                                                 name=edits.unique(f"{t.name}/Slice")))


def share_dq(edits: Edits, t: Target, node: onnx.NodeProto, dequantized: str, stored: str) -> None:
    """The lookup's Gather reads the tied lm_head's dequantized weight (``stored``: its layout as
    lm_head reads it; ``in_out`` is transposed back to the table's ``[vocab, hidden]``)."""
    node.input[0] = dequantized if stored == "out_in" else edits.op(
        t.node, "Transpose", [dequantized], f"{t.name}/weight/Transpose", perm=[1, 0])
