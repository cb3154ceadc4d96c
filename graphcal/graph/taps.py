"""A tapped copy of the model: chosen intermediate tensors become extra graph outputs.

One forward pass per batch then yields every tap at once (onnxruntime runs the whole graph on
every ``run``, whatever is fetched). The input model is never modified.
"""

from __future__ import annotations

import onnx

from graphcal.errors import GraphcalError


def add_taps(model: onnx.ModelProto, tensors: list[str]) -> tuple[onnx.ModelProto, list[str]]:
    """Return (tapped copy, output names to fetch); ``tensors`` are names of graph values."""
    tapped = onnx.ModelProto()
    tapped.CopyFrom(model)
    graph = tapped.graph
    existing = {o.name for o in graph.output}
    known = {o for n in graph.node for o in n.output} | {i.name for i in graph.input} | {
        t.name for t in graph.initializer
    }
    types = _elem_types(model)
    fetch: list[str] = []
    for name in dict.fromkeys(tensors):  # dedupe, keep order
        if name not in known:
            raise GraphcalError(f"cannot tap {name!r}: no such tensor in the graph")
        if name not in existing:
            elem = types.get(name, onnx.TensorProto.FLOAT)
            graph.output.append(onnx.helper.make_tensor_value_info(name, elem, None))
            existing.add(name)
        fetch.append(name)
    return tapped, fetch


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element types of graph values, from shape inference where the model lacks value_info."""
    values = list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)
    if not model.graph.value_info and model.ByteSize() < 2**31 - 1:
        try:
            inferred = onnx.shape_inference.infer_shapes(model)
            values += list(inferred.graph.value_info)
        except Exception:  # inference is best effort; onnxruntime infers output types itself
            pass
    return {v.name: v.type.tensor_type.elem_type for v in values if v.type.tensor_type.elem_type}
