"""The Q/DQ writer: the one entry point that writes a scheme's forms into a model."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import helper

from graphcal.graph.edit import drop_dead_paths, replace_input
from graphcal.graph.io import default_opset, value_types
from graphcal.graph.qdq.activations import input_dq, input_key
from graphcal.graph.qdq.edits import Edits
from graphcal.graph.qdq.kv import state_dq
from graphcal.graph.qdq.lookups import lookup_gather_block, share_dq, share_gather_block
from graphcal.graph.qdq.opset import upgrade_opset
from graphcal.graph.qdq.policy import Form, InputForm, TargetRuntime, WeightForm, choose_form
from graphcal.graph.qdq.weights import weight_cast_mul, weight_dq, weight_matmulnbits
from graphcal.graph.spill import DataSpill
from graphcal.types import QuantizedKV, QuantizedTarget


class QDQWriter:
    """Writes Q/DQ into ``model`` in place, in the forms ``target_runtime`` builds (policy.choose_form):
    weights one at a time (so a caller can read each weight once, observe it, quantize it and let
    it go), then activations and key/value states, then ``finish()``. A model below ``opset``
    (from ``items_opset``) is converted first (``self.model`` is then the converted copy).
    ``matmulnbits``: the accuracy level of com.microsoft.MatMulNBits written for integer weights
    (onnxruntime only; None writes DequantizeLinear). ``spill`` (graph.spill.DataSpill): each tensor
    the writer makes goes to the output's data file once its weight is written, the model keeping only
    its reference; without it they stay in memory until the model is saved."""

    def __init__(self, model: onnx.ModelProto, opset: int, target_runtime: TargetRuntime | str = TargetRuntime.ONNXRUNTIME,
                 types: dict | None = None, matmulnbits: int | None = None, spill: DataSpill | None = None):
        types = value_types(model) if types is None else types  # activation dtypes and ranks
        if default_opset(model) < opset:
            model = upgrade_opset(model, opset)
        self.model = model
        self.target_runtime = TargetRuntime(target_runtime)
        self.matmulnbits = matmulnbits
        self.graph = model.graph
        self.edits = Edits(self.graph, types, default_opset(model))
        self.shared: dict[tuple, tuple[str, str | None]] = {}  # (form, *input_key) -> (input, output scale)
        self.detached: set[str] = set()  # weight-path node outputs / initializers that may be dead now
        self.node_by_name = {n.name: n for n in self.graph.node}
        self.spill = spill
        self._kept = 0  # how many of edits.inits the spill has seen

    def _spill(self) -> None:
        """The tensors made since the last call to the data file (with a spill)."""
        if self.spill is not None:
            self.edits.inits[self._kept:] = self.spill.take(self.edits.inits[self._kept:])  # the written ones freed
            self._kept = len(self.edits.inits)

    def quantize_weight(self, item: QuantizedTarget, weight: torch.Tensor) -> None:
        """Store the item's weight quantized behind DequantizeLinear; ``weight`` is its torch
        [out, in] value, read once by the caller (graphcal.calibration.weights), which observed it too."""
        t, args, qp = item.target, item.scheme.weights, item.qparams["weight"]
        form = self.form(item)
        node = self.node_by_name[t.node]
        self.detached.update((node.input[1], t.weight))
        if form.weight is WeightForm.MATMULNBITS:
            weight_matmulnbits(self.edits, t, args, qp, weight, self.matmulnbits, node)
        elif form.weight is WeightForm.CAST_MUL:
            node.input[1] = weight_cast_mul(self.edits, t, args, qp, weight)
        else:
            self._weight_dq(item, form, node, weight)
        self._spill()

    def _weight_dq(self, item: QuantizedTarget, form: Form, node: onnx.NodeProto, weight: torch.Tensor) -> None:
        t, args, qp = item.target, item.scheme.weights, item.qparams["weight"]
        stored = None
        if self.target_runtime is TargetRuntime.ONNXRUNTIME and t.layout == "out_in":
            # onnxruntime fuses DQ -> Gemm into MatMulNBits only for a weight stored [in, out] (transB=0)
            stored = "in_out"
            _set_attr(node, "transB", 0)
        gemm_kernel = t.op_type == "Gemm" and form.input in (InputForm.UINT8, InputForm.ROWNORM)
        node.input[1] = weight_dq(self.edits, t, args, qp, weight, self.target_runtime, stored, zero_point=gemm_kernel)

    def quantize_lookup(self, item: QuantizedTarget, weight: torch.Tensor) -> None:
        """Store an embedding lookup's table quantized (``weight``: the table ``[vocab, hidden]``,
        read once by the caller): GatherBlockQuantized for onnxruntime, else DequantizeLinear -> Gather."""
        t, args, qp = item.target, item.scheme.weights, item.qparams["weight"]
        node = self.node_by_name[t.node]
        self.detached.update((node.input[0], t.weight))
        if self.target_runtime is TargetRuntime.ONNXRUNTIME:
            lookup_gather_block(self.edits, t, args, qp, weight, node)
        else:  # the table, an [out, in] weight, behind DequantizeLinear
            node.input[0] = weight_dq(self.edits, t, args, qp, weight, self.target_runtime)
        self._spill()

    def share_lookup(self, item: QuantizedTarget, partner: QuantizedTarget) -> None:
        """An embedding lookup reads the quantized weight of the lm_head it is tied to (graph.ties;
        ``partner`` written already, in a form the plan found shareable: calibration.plan)."""
        t = item.target
        node = self.node_by_name[t.node]
        self.detached.update((node.input[0], t.weight))
        head = self.node_by_name[partner.target.node]
        if head.op_type == "MatMulNBits":
            share_gather_block(self.edits, t, node, head)
            return
        # lm_head reads its dequantized weight as B in its own layout (shared only off onnxruntime, where
        # the writer keeps it); its DequantizeLinear, the only node added before lm_head so far (inputs
        # are quantized after the lookups), must come before both readers
        order = [n.name for n in self.graph.node]  # as loaded: the edits are placed only by finish()
        if order.index(t.node) < order.index(head.name):
            self.edits.move(head.name, t.node)
        share_dq(self.edits, t, node, head.input[1], partner.target.layout)

    def form(self, item: QuantizedTarget) -> Form:
        return choose_form(item, self.target_runtime, self.matmulnbits)

    def quantize_input(self, item: QuantizedTarget) -> None:
        """Q/DQ the item's input activation; targets reading one activation with the same args and
        qparams share a single Q/DQ."""
        args = item.scheme.input_activations
        if args is None:
            return
        form = self.form(item).input
        if form is InputForm.KERNEL:  # MatMulNBits quantizes its input itself
            return
        t, qp = item.target, item.qparams.get("input")
        key = (form, *input_key(t, args, qp))
        if key not in self.shared:
            self.shared[key] = input_dq(self.edits, t, args, qp, self.target_runtime, form)
        replacement, scale = self.shared[key]
        node = self.node_by_name[t.node]
        node.input[0] = replacement
        has_bias = node.op_type == "Gemm" and len(node.input) > 2 and bool(node.input[2])
        if scale is not None or (has_bias and form is InputForm.UINT8):
            self._rescale_output(node, scale, t.name)

    def _rescale_output(self, node: onnx.NodeProto, scale: str | None, name: str) -> None:
        """node's output times ``scale`` (the row-normalized form), under the output's own name;
        a Gemm's bias moves after the product (onnxruntime fuses a Gemm into QGemm only with an
        int32 bias, and the scale must come before the bias)."""
        out = node.output[0]
        product = self.edits.unique(f"{out}_{'normalized' if scale else 'product'}")
        node.output[0] = product
        bias = None
        if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
            bias = node.input[2]
            beta = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "beta"), 1.0)
            del node.input[2]
            if beta != 1.0:
                beta_name = self.edits.const(f"{name}.bias_beta", np.array(beta, dtype=self.edits.dtype_of(out)))
                bias = self.edits.op_after(node.name, "Mul", [bias, beta_name], f"{name}/bias/Mul")
        if bias is None:
            self.edits.add_after(node.name, helper.make_node("Mul", [product, scale], [out],
                                                             name=self.edits.unique(f"{name}/output/Mul")))
            return
        scaled = product if scale is None else self.edits.op_after(node.name, "Mul", [product, scale],
                                                                   f"{name}/output/Mul")
        self.edits.add_after(node.name, helper.make_node("Add", [scaled, bias], [out],
                                                         name=self.edits.unique(f"{name}/output/Add")))

    def quantize_kv(self, kv: QuantizedKV) -> None:
        """Static Q/DQ on the key and value states, read by every node that read the state."""
        for base, tensor in (("k", kv.state.key), ("v", kv.state.value)):
            readers = [n for n in self.graph.node if tensor in n.input]
            if not readers:
                continue
            dq = state_dq(self.edits, kv, base, tensor, readers[0].name, self.target_runtime)
            for node in readers:
                replace_input(node, tensor, dq)

    def finish(self) -> onnx.ModelProto:
        """Place the new nodes, drop what nothing reads any more; returns the model."""
        self._spill()
        self.edits.place(self.graph)
        drop_dead_paths(self.graph, self.detached)
        have = {o.domain for o in self.model.opset_import}
        for domain in sorted(self.edits.domains - have):
            self.model.opset_import.append(helper.make_opsetid(domain, 1))
        return self.model


def _set_attr(node: onnx.NodeProto, name: str, value) -> None:
    for i, a in enumerate(node.attribute):
        if a.name == name:
            del node.attribute[i]
            break
    node.attribute.append(helper.make_attribute(name, value))
