"""The fp32 model with each quantized layer behind a switch: eval --sensitivity's one model.

For every quantized layer, the fp32 node computing its output becomes an ``If`` on a boolean graph
input of its own (``SWITCH + layer``): its ``then`` branch holds the quantized model's nodes for
that layer (its weight's dequantization, its input's Q/DQ, MatMulNBits, ...; whatever the quantized
model computes the layer's output with, from values the fp32 model also computes), its ``else``
branch the fp32 node itself. With every switch off the model is the fp32 model; with some on,
it is the quantized model with only those layers quantized. One model, one onnxruntime session,
any choice of layers per run: sensitivity never builds or loads a model per kind.

A value both layers read through one shared node in the quantized model (q/k/v's input Q/DQ) is
computed in each branch; a quantized model's nodes outside every layer (a kv-cache Q/DQ) are not
part of any layer and stay out. The branches read the two models' weights from the outer graph:
the quantized model's under ``QUANTIZED + name``.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from graphcal.errors import GraphcalError
from graphcal.graph.io import default_opset, hollow_copy

SWITCH = "graphcal-quantize/"
QUANTIZED = "graphcal-quantized/"


def switchable_model(reference: onnx.ModelProto, candidate: onnx.ModelProto, layers: dict[str, str],
                     elem_types: dict[str, int]) -> tuple[onnx.ModelProto, dict[str, str]]:
    """(the model, {layer: its switch input}). ``layers`` maps each quantized layer's name to the
    fp32 node computing it; ``elem_types`` gives values' element types (float where it has none). The model holds
    ``reference``'s initializers (copied as they are: stubs of lazy weights stay stubs) and those of
    ``candidate`` the branches read, renamed; ``reference`` is raised to the candidate's opset where
    below it (in place, weights untouched)."""
    opset = max(default_opset(reference), default_opset(candidate))
    if default_opset(reference) < opset:
        from graphcal.graph.qdq.opset import upgrade_opset  # lazy: the graph.qdq package loads torch

        reference = upgrade_opset(reference, opset)
    model = hollow_copy(reference)
    domains = {o.domain: o.version for o in reference.opset_import}
    for o in candidate.opset_import:
        domains[o.domain] = max(domains.get(o.domain, 0), o.version)
    del model.opset_import[:]
    model.opset_import.extend(helper.make_opsetid(d, v) for d, v in domains.items())
    model.ir_version = max(reference.ir_version, candidate.ir_version)
    model.graph.initializer.extend(reference.graph.initializer)

    fp32_values = {i.name for i in reference.graph.input} | {t.name for t in reference.graph.initializer}
    fp32_values |= {o for n in reference.graph.node for o in n.output}
    producer = {o: n for n in candidate.graph.node for o in n.output}
    cand_inits = {t.name: t for t in candidate.graph.initializer}
    taken: set[str] = set()
    switches: dict[str, str] = {}
    replaced: dict[str, onnx.NodeProto] = {}  # fp32 node name -> its If
    fp32_nodes = {n.name: n for n in reference.graph.node}
    for layer, node_name in layers.items():
        fp32 = fp32_nodes[node_name]
        out = fp32.output[0]
        inner = f"graphcal-q/{layer}/"
        nodes, reads = _layer_nodes(out, producer, cand_inits, fp32_values)
        for name in reads:
            if name not in taken:
                taken.add(name)
                init = model.graph.initializer.add()
                init.CopyFrom(cand_inits[name])
                init.name = QUANTIZED + name
        local = {o for n in nodes for o in n.output}

        def rename(name: str, local=local, inner=inner) -> str:
            if not name:
                return name
            if name in local:
                return inner + name
            return QUANTIZED + name if name in cand_inits else name

        then_nodes = []
        for n in nodes:
            copy = onnx.NodeProto()
            copy.CopyFrom(n)
            copy.name = inner + n.name
            copy.input[:] = [rename(i) for i in n.input]
            copy.output[:] = [rename(o) for o in n.output]
            then_nodes.append(copy)
        elem = elem_types.get(out, TensorProto.FLOAT)
        then_branch = helper.make_graph(then_nodes, f"{inner}quantized", [],
                                        [helper.make_tensor_value_info(inner + out, elem, None)])
        float_node = onnx.NodeProto()
        float_node.CopyFrom(fp32)
        float_node.name = f"graphcal-f/{layer}/{fp32.name}"
        float_node.output[:] = [f"graphcal-f/{layer}/{out}"]
        else_branch = helper.make_graph([float_node], f"graphcal-f/{layer}/float", [],
                                        [helper.make_tensor_value_info(float_node.output[0], elem, None)])
        switch = SWITCH + layer
        switches[layer] = switch
        model.graph.input.append(helper.make_tensor_value_info(switch, TensorProto.BOOL, []))
        replaced[fp32.name] = helper.make_node("If", [switch], [out], name=f"graphcal-switch/{layer}",
                                               then_branch=then_branch, else_branch=else_branch)
    del model.graph.node[:]
    model.graph.node.extend(replaced.get(n.name, n) for n in reference.graph.node)
    return model, switches


def _layer_nodes(out: str, producer: dict[str, onnx.NodeProto], inits: dict[str, onnx.TensorProto],
                 fp32_values: set[str]) -> tuple[list[onnx.NodeProto], list[str]]:
    """The candidate's nodes computing ``out`` from values the fp32 model computes too (in order),
    and the candidate initializers they read."""
    nodes: list[onnx.NodeProto] = []
    reads: list[str] = []
    seen: set[str] = set()
    stack: list[tuple[str, bool]] = [(out, False)]
    while stack:  # depth first, each node emitted after its inputs
        name, expanded = stack.pop()
        if expanded:
            nodes.append(producer[name])
            continue
        if not name or name in seen:
            continue
        seen.add(name)
        if name in inits:
            reads.append(name)
            continue
        if name != out and name in fp32_values:
            continue  # a value of the outer (fp32) graph
        node = producer.get(name)
        if node is None:
            raise GraphcalError(f"the quantized model computes {out!r} from {name!r}, which neither model defines")
        for o in node.output:
            seen.add(o)
        stack.append((node.output[0], True))
        stack.extend((i, False) for i in reversed(node.input))
    return nodes, reads
