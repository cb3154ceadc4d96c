"""The weight path: from a MatMul/Gemm's B input back to the initializer that holds the weight.

Exporters put Transpose, Cast (fp16 storage), Reshape or Identity between a weight and the node
that reads it. :func:`trace_weight` is the one walk back along them (the target search, the
attention search's "is this input constant"); :func:`weight_as_consumed` and
:func:`consumed_shape` apply a path to the initializer's value or its dims, as the graph would.
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
from onnx import numpy_helper

from graphcal.errors import GraphcalError
from graphcal.graph.external import read_tensor_buffer
from graphcal.graph.index import GraphIndex

# Ops that may sit between a weight initializer and the MatMul/Gemm B input.
WEIGHT_PATH_OPS = frozenset({"Transpose", "Cast", "Reshape", "Identity"})


def trace_weight(index: GraphIndex, name: str, *, addressable: bool = True,
                 max_nodes: int | None = None) -> tuple[str, list[onnx.NodeProto]] | None:
    """Walk ``name`` back through weight-path ops to an initializer: (initializer, path nodes in
    order from it), or None where the walk meets anything else (an activation).

    ``addressable``: the path must be one a :class:`graphcal.types.Target` can name and replay
    (every node named, each Reshape's shape an initializer); otherwise None. ``max_nodes``: None
    once the path would grow past this many nodes; without it a path that loops raises
    GraphcalError (load_model refuses cyclic graphs: this never walks forever).
    """
    inits = index.initializers
    path: list[onnx.NodeProto] = []
    while name not in inits:
        node = index.producer_node(name)
        if node is None or node.op_type not in WEIGHT_PATH_OPS:
            return None
        if max_nodes is not None:
            if len(path) >= max_nodes:
                return None
        elif len(path) > len(index.producer):
            raise GraphcalError(f"the weight path into {name!r} loops (node {node.name!r}); the graph has a cycle")
        if addressable:
            if node.op_type == "Reshape" and node.input[1] not in inits:
                return None
            if not node.name:
                return None  # unnamed path nodes cannot be addressed later
        path.append(node)
        name = node.input[0]
    return name, path[::-1]


#: element types whose raw bytes are the little-endian numpy array itself
_PLAIN_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)


def weight_as_consumed(
    init: onnx.TensorProto, path: list[onnx.NodeProto], inits: dict[str, onnx.TensorProto],
    base_dir: str | None = None,
) -> np.ndarray:
    """Apply the Transpose/Cast/Reshape path to the initializer, as the graph would."""
    external = init.data_location == onnx.TensorProto.EXTERNAL
    if external:  # checked against the model's folder as it is read
        if base_dir is None:
            raise GraphcalError(f"weight {init.name!r} is in external data, but no model folder was given to read it")
        raw = read_tensor_buffer(init, base_dir)
    else:
        raw = init.raw_data if init.HasField("raw_data") else None
    if raw is not None and init.data_type in _PLAIN_FLOATS and sys.byteorder == "little":  # the bytes are the array
        value = np.frombuffer(raw, dtype=onnx.helper.tensor_dtype_to_np_dtype(init.data_type)).reshape(tuple(init.dims))
    elif external:  # other element types: numpy_helper decodes them
        value = numpy_helper.to_array(onnx.TensorProto(name=init.name, dims=init.dims, data_type=init.data_type,
                                                       raw_data=bytes(raw)))
    else:
        value = numpy_helper.to_array(init)
    for node in path:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Transpose":
            value = np.transpose(value, attrs.get("perm"))
        elif node.op_type == "Cast":
            value = value.astype(onnx.helper.tensor_dtype_to_np_dtype(attrs["to"]))
        elif node.op_type == "Reshape":
            shape = numpy_helper.to_array(inits[node.input[1]]).tolist()
            value = value.reshape([value.shape[i] if s == 0 else s for i, s in enumerate(shape)])
    return value


def consumed_shape(init: onnx.TensorProto, path: list[onnx.NodeProto], inits) -> list[int]:
    """The shape reaching the node's B input, from dims and the path ops alone (no weight is read)."""
    shape = list(init.dims)
    for node in path:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Transpose":
            perm = attrs.get("perm") or list(range(len(shape)))[::-1]
            shape = [shape[p] for p in perm]
        elif node.op_type == "Reshape":
            target = [int(v) for v in numpy_helper.to_array(inits[node.input[1]]).tolist()]
            target = [shape[i] if v == 0 else v for i, v in enumerate(target)]
            if -1 in target:
                known = int(np.prod([v for v in target if v != -1]))
                target[target.index(-1)] = int(np.prod(shape)) // max(known, 1)
            shape = target
    return shape
