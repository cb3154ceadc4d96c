"""The nodes and initializers the Q/DQ forms add to a graph, before they are placed.

The form modules (:mod:`.weights`, :mod:`.activations`, :mod:`.kv`) build into an
:class:`Edits`; only the writer changes the graph, and :meth:`Edits.place` puts each new node in
front of the node it was built for (names and placement: :mod:`graphcal.graph.edit`).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from graphcal.graph.edit import Names, add_initializer, place_around


class Edits:
    """New nodes, each kept with the name of the node it goes in front of (its anchor), and new
    initializers; every name is unique in the graph."""

    def __init__(self, graph: onnx.GraphProto, types: dict, opset: int):
        self.types = types  # value name -> element type and shape, as graph.io.value_types gives them
        self.opset = opset  # of the graph written into
        self.names = Names({n.name for n in graph.node} | {t.name for t in graph.initializer})
        self.nodes_before: dict[str, list[onnx.NodeProto]] = {}  # anchor node name -> nodes to insert before it
        self.nodes_after: dict[str, list[onnx.NodeProto]] = {}  # anchor node name -> nodes to insert after it
        self.inits: list[onnx.TensorProto] = []
        self.domains: set[str] = set()  # custom op domains the new nodes use

    def unique(self, name: str) -> str:
        return self.names.unique(name)

    def const(self, name: str, array: np.ndarray) -> str:
        """An initializer; ml_dtypes arrays (int4, fp4, fp8, e8m0) are packed by onnx.numpy_helper. A 0-d
        array is stored with shape [1] (np.ascontiguousarray's rule; the written models rely on it)."""
        return add_initializer(self.inits, self.names, name, np.ascontiguousarray(array))

    def add(self, anchor: str, node: onnx.NodeProto) -> None:
        self.nodes_before.setdefault(anchor, []).append(node)

    def move(self, anchor: str, to: str) -> None:
        """The nodes added in front of ``anchor`` go in front of ``to`` instead (ahead of its own)."""
        moved = self.nodes_before.pop(anchor, [])
        self.nodes_before[to] = moved + self.nodes_before.get(to, [])

    def add_after(self, anchor: str, node: onnx.NodeProto) -> None:
        self.nodes_after.setdefault(anchor, []).append(node)

    def op_after(self, anchor: str, op: str, inputs: list[str], name: str, **attrs) -> str:
        """One node ``op`` after ``anchor`` (after those added before it); returns its output's name."""
        out = self.unique(name + "_output")
        self.add_after(anchor, helper.make_node(op, inputs, [out], name=self.unique(name), **attrs))
        return out

    def op(self, anchor: str, op: str, inputs: list[str], name: str, **attrs) -> str:
        """One node ``op`` before ``anchor``; returns its output's name."""
        out = self.unique(name + "_output")
        self.add(anchor, helper.make_node(op, inputs, [out], name=self.unique(name), **attrs))
        return out

    def qdq(self, anchor: str, x: str, s: str, z: str, label: str, **attrs) -> str:
        """QuantizeLinear -> DequantizeLinear of ``x`` with constant scale/zero point, placed before
        node ``anchor``; returns the dequantized tensor's name."""
        q = self.unique(f"{x}_quantized")
        dq = self.unique(f"{x}_dequantized")
        self.nodes_before.setdefault(anchor, []).extend([
            helper.make_node("QuantizeLinear", [x, s, z], [q], name=self.unique(f"{label}/QuantizeLinear"), **attrs),
            helper.make_node("DequantizeLinear", [q, s, z], [dq], name=self.unique(f"{label}/DequantizeLinear"), **attrs),
        ])
        return dq

    def dtype_of(self, tensor: str) -> np.dtype:
        """The element type of a value in the graph (float32 when unknown)."""
        tt = self.types.get(tensor)
        if tt is not None and tt.elem_type:
            return np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        return np.dtype(np.float32)

    def rank_of(self, tensor: str) -> int | None:
        tt = self.types.get(tensor)
        if tt is not None and tt.HasField("shape"):
            return len(tt.shape.dim)
        return None

    def place(self, graph: onnx.GraphProto) -> None:
        """Put the new nodes in front of (or after) their anchors and the new initializers in the graph."""
        place_around(graph, self.nodes_before, self.nodes_after)
        graph.initializer.extend(self.inits)
