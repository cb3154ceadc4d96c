"""The Q/DQ writer: the one entry point that writes a scheme's forms into a model."""

from __future__ import annotations

import onnx
import torch
from onnx import helper

from graphcal.graph.io import default_opset, value_types
from graphcal.graph.qdq.activations import input_dq, input_key
from graphcal.graph.qdq.cleanup import drop_dead_weight_paths
from graphcal.graph.qdq.edits import Edits
from graphcal.graph.qdq.kv import state_dq
from graphcal.graph.qdq.opset import upgrade_opset
from graphcal.graph.qdq.policy import Runtime
from graphcal.graph.qdq.weights import weight_dq
from graphcal.types import QuantizedKV, QuantizedTarget


class QDQWriter:
    """Writes Q/DQ into ``model`` in place, in the forms ``runtime`` builds: weights one at a time
    (so a caller can read each weight once, observe it, quantize it and let it go), then
    activations and key/value states, then ``finish()``. A model below ``opset`` (from
    ``items_opset``) is converted first (``self.model`` is then the converted copy)."""

    def __init__(self, model: onnx.ModelProto, opset: int, runtime: Runtime | str = Runtime.ONNXRUNTIME,
                 types: dict | None = None):
        types = value_types(model) if types is None else types  # activation dtypes and ranks
        if default_opset(model) < opset:
            model = upgrade_opset(model, opset)
        self.model = model
        self.runtime = Runtime(runtime)
        self.graph = model.graph
        self.edits = Edits(self.graph, types, default_opset(model))
        self.shared: dict[tuple, str] = {}  # input_key -> dequantized tensor name
        self.detached: set[str] = set()  # weight-path node outputs / initializers that may be dead now
        self.node_by_name = {n.name: n for n in self.graph.node}

    def quantize_weight(self, item: QuantizedTarget, weight: torch.Tensor) -> None:
        """Store the item's weight quantized behind DequantizeLinear; ``weight`` is its torch
        [out, in] value, read once by the caller (graphcal.weights), which observed it too."""
        t = item.target
        dq = weight_dq(self.edits, t, item.scheme.weights, item.qparams["weight"], weight, self.runtime)
        node = self.node_by_name[t.node]
        self.detached.update((node.input[1], t.weight))
        node.input[1] = dq

    def quantize_input(self, item: QuantizedTarget) -> None:
        """Q/DQ the item's input activation; targets reading one activation with the same args and
        qparams share a single Q/DQ."""
        args = item.scheme.input_activations
        if args is None:
            return
        t, qp = item.target, item.qparams.get("input")
        key = input_key(t, args, qp)
        if key not in self.shared:
            self.shared[key] = input_dq(self.edits, t, args, qp, self.runtime)
        self.node_by_name[t.node].input[0] = self.shared[key]

    def quantize_kv(self, kv: QuantizedKV) -> None:
        """Static Q/DQ on the key and value states, read by every node that read the state."""
        for base, tensor in (("k", kv.state.key), ("v", kv.state.value)):
            readers = [n for n in self.graph.node if tensor in n.input]
            if not readers:
                continue
            dq = state_dq(self.edits, kv, base, tensor, readers[0].name)
            for node in readers:
                for i, name in enumerate(node.input):
                    if name == tensor:
                        node.input[i] = dq

    def finish(self) -> onnx.ModelProto:
        """Place the new nodes, drop what nothing reads any more; returns the model."""
        self.edits.place(self.graph)
        drop_dead_weight_paths(self.graph, self.detached)
        have = {o.domain for o in self.model.opset_import}
        for domain in sorted(self.edits.domains - have):
            self.model.opset_import.append(helper.make_opsetid(domain, 1))
        return self.model
