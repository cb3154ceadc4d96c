"""The expected size on disk of the model `run` writes, from the weights' shapes and types alone.

No weight is read: every term is a shape times an element size (the rule is in
:func:`expected_model_size`'s docstring).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import onnx

from graphcal.errors import GraphcalError
from graphcal.graph.io import model_files
from graphcal.graph.qdq import dead_weight_paths
from graphcal.types import QuantizedTarget, Target

# Scale dtypes stored as one byte per scale (NVFP4's fp8 scales, MX's uint8 exponents).
_ONE_BYTE_SCALES = {"float8_e4m3fn", "uint8"}


def expected_model_size(model: onnx.ModelProto, model_path: str | os.PathLike, items: list[QuantizedTarget],
                        data_files: tuple[str, ...] = ()) -> int:
    """Expected bytes on disk of the model.onnx (plus its .data file, if any) `run` writes for ``items``.

    The rule, per quantized target (torch weight ``[out, in]``, weight args ``w``):

    - minus the float weight: elements x the element size of the initializer's data type
      (an initializer is counted once, and only when no other node still reads it);
    - plus the quantized weight: ``ceil(w.num_bits * out * in / 8)`` bytes (int4/fp4 pack two
      per byte);
    - plus the scales: one per tensor (``tensor``), per output channel (``channel``), per group
      of ``group_size`` along ``in`` (``group``, ``tensor_group``: ``out * ceil(in / group_size)``),
      or per ``[rows, cols]`` block (``block``: the writer expands MatMul block scales per row,
      ``out * ceil(in / cols)``; a Gemm with transB=1 keeps ``ceil(out / rows) * ceil(in / cols)``).
      A scale is 4 bytes (fp32), or 1 byte when ``w.scale_dtype`` is float8_e4m3fn or uint8 (MX);
      ``tensor_group`` also stores one fp32 global scale;
    - plus zero points when ``w.symmetric`` is false: as many as scales, at the weight's bit width.

    Graph records (the new Q/DQ nodes, initializer headers, value_info the version converter
    adds) are not counted: a few KB per layer, up to ~10% of the shipped tiny models' output and
    noise on real ones.

    The input size is the model file plus its external data files.
    """
    return sum(size_parts(model, model_path, items, data_files).values())


def size_parts(model: onnx.ModelProto, model_path: str | os.PathLike, items: list[QuantizedTarget],
               data_files: tuple[str, ...] = (), lookups: list[QuantizedTarget] = (),
               ties: dict[str, str] | None = None) -> dict[str, int]:
    """The terms of :func:`expected_model_size`, in bytes (the removed weights are negative).

    ``model`` is the model as loaded from ``model_path`` (dims and types only are used) and
    ``data_files`` the external data files it reads (``graph.io.load_model_info``), checked there.
    ``lookups`` (embedding tables) count as weights do, except those in ``ties``, which read their
    lm_head's stored weight and add nothing."""
    ties = ties or {}
    model_path = Path(model_path)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    parts = {"input": sum(model_files(model_path, data_files).values()), "float_weights": 0, "quantized_weights": 0,
             "scales": 0, "zero_points": 0}
    for name in _removed_by_writer(graph, [item.target for item in [*items, *lookups]]):
        init = inits[name]
        parts["float_weights"] -= math.prod(init.dims) * _element_size(init.data_type)
    for item in [*items, *(i for i in lookups if i.target.name not in ties)]:
        t, w = item.target, item.scheme.weights
        n_scales = _scale_count(t, w)
        parts["quantized_weights"] += _packed(w.num_bits, t.out_features * t.in_features)
        parts["scales"] += n_scales * _scale_size(w) + (4 if w.strategy == "tensor_group" else 0)
        if not w.symmetric:
            parts["zero_points"] += _packed(w.num_bits, n_scales)
    return parts


def _element_size(data_type: int) -> int:
    return onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize


def _packed(num_bits: int, count: int) -> int:
    return math.ceil(num_bits * count / 8)


def _scale_count(t: Target, w) -> int:
    out, inp = t.out_features, t.in_features
    if w.strategy == "tensor":
        return 1
    if w.strategy == "channel":
        return out
    if w.strategy in ("group", "tensor_group"):
        return out * math.ceil(inp / w.group_size)
    if w.strategy == "block":
        rows, cols = w.block_structure
        if t.layout == "in_out":  # MatMul: block scales expanded per row
            return out * math.ceil(inp / cols)
        return math.ceil(out / rows) * math.ceil(inp / cols)
    raise GraphcalError(f"{t.name}: weight strategy {w.strategy} has no known size")


def _scale_size(w) -> int:
    dtype = getattr(w, "scale_dtype", None)
    return 1 if dtype is not None and str(dtype).removeprefix("torch.") in _ONE_BYTE_SCALES else 4


def _removed_by_writer(graph: onnx.GraphProto, targets: list[Target]) -> list[str]:
    """Initializers nothing reads once every target reads its dequantized weight (tied weights stay)."""

    slot = {t.node: t.weight_input for t in targets}  # the input that reads the weight: B, or a Gather's data
    detached = {n.input[slot[n.name]] for n in graph.node if n.name in slot} | {t.weight for t in targets}

    def rewired(node):  # as the writer leaves it: a target's weight input reads the dequantized weight instead
        return [i for k, i in enumerate(node.input) if not (node.name in slot and k == slot[node.name])]

    return sorted(dead_weight_paths(graph, detached, rewired)[1])


_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)


def float_weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the float initializers of ``model``'s main graph (from dims and types: nothing is read),
    the part of a written model that is still float: weights left unquantized (lm_head, embeddings,
    layers ignored), norms, biases and scales."""
    return sum(math.prod(t.dims) * _element_size(t.data_type) for t in model.graph.initializer if t.data_type in _FLOATS)
