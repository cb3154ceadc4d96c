"""One model from two quantized forms of the same fp32 model: the low form with some layers as the high form computes them.

`run --size-budget` measures its mix on eval's switchable model (graph.switch: each layer an ``If``
over its forms) and writes it with :func:`splice`: the same nodes the switches' chosen branches
hold, at the top level. For each layer taken high, the low form's nodes computing that layer's output
(from values the fp32 model computes: its weight's dequantization, or its MatMulNBits) are removed
unless another layer still reads them, and the high form's nodes for it are put in their place,
renamed under :data:`HIGH` with the initializers they read (the same tensors, their references
unchanged: onnxruntime or the writer reads them where they are). Initializers no node reads any more
(the low form's weights of the layers taken high) are dropped. What was measured is what is written.
"""

from __future__ import annotations

import onnx

from graphcal.errors import GraphcalError
from graphcal.graph.check import node_reads
from graphcal.graph.io import hollow_copy
from graphcal.graph.switch import LayerForm, fp32_computed, join_opsets, renamed

HIGH = "graphcal-high/"  # the high form's initializers and nodes, renamed under it


def splice(low: onnx.ModelProto, high: onnx.ModelProto, reference: onnx.ModelProto,
           layers: dict[str, str]) -> onnx.ModelProto:
    """``low`` with each of ``layers`` (layer -> the fp32 node computing it in ``reference``) computed
    as ``high`` computes it; ``low`` and ``high`` are left as they are (weights stay where they are)."""
    values = fp32_computed(reference)
    fp32_nodes = {n.name: n for n in reference.graph.node}
    low_form, high_form = LayerForm(low, "", values), LayerForm(high, HIGH, values)
    model = hollow_copy(low)
    join_opsets(model, [high])
    model.graph.initializer.extend(low.graph.initializer)

    added: set[str] = set()  # the high form's initializers added to the model
    replacements: dict[str, list[onnx.NodeProto]] = {}  # a taken layer's output -> the high nodes computing it
    dropped: set[str] = set()  # the low nodes (by first output) computing a taken layer
    for layer, node_name in layers.items():
        fp32 = fp32_nodes[node_name]
        out = fp32.output[0]
        if low_form.same_as(fp32):
            raise GraphcalError(f"the low form computes {layer} as the fp32 model does: there is nothing to replace")
        if high_form.same_as(fp32):
            raise GraphcalError(f"the high form computes {layer} as the fp32 model does; the mix takes quantized forms")
        nodes = _renamed(*high_form.nodes(out), out, high_form, model, added)
        replacements[out] = nodes
        dropped |= {n.output[0] for n in low_form.nodes(out)[0]}
    kept = _still_read(low, dropped, set(replacements))
    spliced, made = [], set()  # a high node two taken layers share (their input's Q/DQ) goes in once, with the first
    for n in low.graph.node:
        if n.output[0] in replacements:
            for copy in replacements[n.output[0]]:
                if copy.output[0] not in made:
                    made.add(copy.output[0])
                    spliced.append(copy)
        elif n.output[0] not in dropped or n.output[0] in kept:
            spliced.append(n)
    del model.graph.node[:]
    model.graph.node.extend(spliced)
    read = {i for n in spliced for i in node_reads(n)}
    live = [t for t in model.graph.initializer if t.name in read]
    del model.graph.initializer[:]
    model.graph.initializer.extend(live)
    return model


def _renamed(nodes: list[onnx.NodeProto], reads: list[str], out: str, form: LayerForm, model: onnx.ModelProto,
             added: set[str]) -> list[onnx.NodeProto]:
    """Copies of the high form's ``nodes`` computing ``out``, their names, values and initializers under
    :data:`HIGH` (``out`` kept), each initializer they read added to ``model`` once."""
    for name in reads:
        if name not in added:
            added.add(name)
            init = model.graph.initializer.add()
            init.CopyFrom(form.inits[name])
            init.name = HIGH + name
    local = {o for n in nodes for o in n.output} - {out}

    def rename(name: str) -> str:
        return HIGH + name if name and (name in local or name in form.inits) else name

    return renamed(nodes, HIGH, rename)


def _still_read(low: onnx.ModelProto, dropped: set[str], taken: set[str]) -> set[str]:
    """The dropped nodes (by first output) some kept node, or the graph's outputs, still reads: a node two
    layers share, one of them still low (each kept node's producers kept in turn)."""
    producer = {o: n for n in low.graph.node for o in n.output}
    kept: set[str] = set()
    wanted = [i for n in low.graph.node if n.output[0] not in dropped for i in node_reads(n)]
    wanted += [o.name for o in low.graph.output]
    while wanted:
        name = wanted.pop()
        node = producer.get(name)
        if node is None or node.output[0] not in dropped or node.output[0] in kept or name in taken:
            continue
        kept.add(node.output[0])
        wanted.extend(node_reads(node))
    return kept

