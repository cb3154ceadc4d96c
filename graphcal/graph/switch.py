"""The fp32 model with each quantized layer behind switches: eval's one model for --sensitivity and --size-budget.

For every quantized layer, the fp32 node computing its output becomes an ``If`` on a boolean graph
input of its own (``SWITCH + layer``): its ``then`` branch holds the quantized model's nodes for
that layer (its weight's dequantization, its input's Q/DQ, MatMulNBits, ...; whatever the quantized
model computes the layer's output with, from values the fp32 model also computes), its ``else``
branch the fp32 node itself. With every switch off the model is the fp32 model; with some on,
it is the quantized model with only those layers quantized. One model, one onnxruntime session,
any choice of layers per run: sensitivity never builds or loads a model per kind.

Given several quantized models of the same fp32 model (int4 and int8, say), each layer gets one
switch per model that quantized it, nested in the order given: the first switch on picks its
model's form of the layer, all off the fp32 node. Any mix of the models' forms, layer by layer, is
then one run of one session (``--size-budget`` measures mixes this way).

A value both layers read through one shared node in the quantized model (q/k/v's input Q/DQ) is
computed in each branch; a quantized model's nodes outside every layer (a kv-cache Q/DQ) are not
part of any layer and stay out. Each branch holds the quantized weights it reads (a copy in each branch
where two read one: a tied table), the first quantized model's under ``QUANTIZED + name``, the k-th's
(k >= 1) under ``QUANTIZED + "k/" + name``: onnxruntime prepacks a branch's own initializers as it does
the top level's, so a layer computes in its branch as in its model (an 8-bit MatMulNBits reading an outer
graph's value computes at accuracy level 0, whatever its attribute says; as the model's initializer, at its
level: :func:`graphcal.graph.splice.splice` writes what was measured). The fp32 nodes' weights stay in the
outer graph.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from graphcal.errors import GraphcalError
from graphcal.graph.io import default_opset, hollow_copy

SWITCH = "graphcal-quantize/"
QUANTIZED = "graphcal-quantized/"


def _prefix(k: int) -> str:
    return QUANTIZED if k == 0 else f"{QUANTIZED}{k}/"


def switchable_model(reference: onnx.ModelProto, candidates: list[onnx.ModelProto], layers: dict[str, str],
                     elem_types: dict[str, int]) -> tuple[onnx.ModelProto, dict[str, list[str | None]]]:
    """(the model, {layer: its switch input per candidate, None where that candidate computes the
    layer as fp32 does}). ``layers`` maps each quantized layer's name to the fp32 node computing it;
    ``elem_types`` gives values' element types (float where it has none). The model holds
    ``reference``'s initializers (copied as they are: stubs of lazy weights stay stubs) and those of
    the candidates the branches read, renamed; ``reference`` is raised to the candidates' opset where
    below it (in place, weights untouched)."""
    opset = max(default_opset(m) for m in [reference, *candidates])
    if default_opset(reference) < opset:
        from graphcal.graph.qdq.opset import upgrade_opset  # lazy: the graph.qdq package loads torch

        reference = upgrade_opset(reference, opset)
    model = hollow_copy(reference)
    join_opsets(model, candidates)
    model.graph.initializer.extend(reference.graph.initializer)

    fp32_values = fp32_computed(reference)
    forms = [LayerForm(c, _prefix(k), fp32_values) for k, c in enumerate(candidates)]
    switches: dict[str, list[str | None]] = {}
    replaced: dict[str, onnx.NodeProto] = {}  # fp32 node name -> its If
    fp32_nodes = {n.name: n for n in reference.graph.node}
    for layer, node_name in layers.items():
        fp32 = fp32_nodes[node_name]
        out = fp32.output[0]
        elem = elem_types.get(out, TensorProto.FLOAT)
        float_node = onnx.NodeProto()
        float_node.CopyFrom(fp32)
        float_node.name = f"graphcal-f/{layer}/{fp32.name}"
        float_node.output[:] = [f"graphcal-f/{layer}/{out}"]
        inner, inner_out = [float_node], float_node.output[0]
        names: list[str | None] = []
        for k in reversed(range(len(forms))):  # the first candidate's If outermost
            made = forms[k].branch(layer, out, fp32, k)
            if made is None:
                names.append(None)
                continue
            nodes, weights = made
            switch = SWITCH + layer if k == 0 else f"{SWITCH}{k}/{layer}"
            names.append(switch)
            model.graph.input.append(helper.make_tensor_value_info(switch, TensorProto.BOOL, []))
            then_branch = helper.make_graph(nodes, f"graphcal-q/{k}/{layer}/quantized", [],
                                            [helper.make_tensor_value_info(nodes[-1].output[0], elem, None)],
                                            initializer=weights)
            else_branch = helper.make_graph(inner, f"graphcal-f/{k}/{layer}/else", [],
                                            [helper.make_tensor_value_info(inner_out, elem, None)])
            inner_out = f"graphcal-s/{k}/{layer}/{out}"
            inner = [helper.make_node("If", [switch], [inner_out], name=f"graphcal-switch/{k}/{layer}",
                                      then_branch=then_branch, else_branch=else_branch)]
        switches[layer] = names[::-1]
        if inner[0] is float_node:
            continue  # no candidate quantized it: the fp32 node stays
        inner[0].output[:] = [out]
        inner[0].name = f"graphcal-switch/{layer}"
        replaced[fp32.name] = inner[0]
    del model.graph.node[:]
    model.graph.node.extend(replaced.get(n.name, n) for n in reference.graph.node)
    return model, switches


def join_opsets(model: onnx.ModelProto, others: list[onnx.ModelProto]) -> None:
    """``model``'s opset imports and IR version raised to the highest of its own and ``others``' (in place)."""
    domains = {o.domain: o.version for o in model.opset_import}
    for o in (o for m in others for o in m.opset_import):
        domains[o.domain] = max(domains.get(o.domain, 0), o.version)
    del model.opset_import[:]
    model.opset_import.extend(helper.make_opsetid(d, v) for d, v in domains.items())
    model.ir_version = max(m.ir_version for m in [model, *others])


def fp32_computed(reference: onnx.ModelProto) -> set[str]:
    """The values the fp32 model has: its inputs, initializers and node outputs."""
    values = {i.name for i in reference.graph.input} | {t.name for t in reference.graph.initializer}
    return values | {o for n in reference.graph.node for o in n.output}


def layer_reads(candidate: onnx.ModelProto, fp32_nodes: list[onnx.NodeProto],
                fp32_values: set[str]) -> dict[str, list[str] | None]:
    """For each fp32 node (by name), the candidate initializers read in computing its output (what
    that layer's form stores), or None where the candidate computes it with the fp32 node itself."""
    form = LayerForm(candidate, "", fp32_values)  # the candidate indexed once for every layer
    return {n.name: None if form.same_as(n) else form.nodes(n.output[0])[1] for n in fp32_nodes}


class LayerForm:
    """One candidate's way of computing layers, read from values the fp32 model also computes."""

    def __init__(self, candidate: onnx.ModelProto, prefix: str, fp32_values: set[str]):
        self.producer = {o: n for n in candidate.graph.node for o in n.output}
        self.inits = {t.name: t for t in candidate.graph.initializer}
        self.prefix, self.fp32_values = prefix, fp32_values

    def same_as(self, fp32: onnx.NodeProto) -> bool:
        node = self.producer.get(fp32.output[0])
        if node is None:
            raise GraphcalError(f"a quantized model does not compute {fp32.output[0]!r}, which the fp32 model's "
                                f"{fp32.name!r} does; compare forms of the same model")
        return node.op_type == fp32.op_type and list(node.input) == list(fp32.input) and node.name == fp32.name

    def nodes(self, out: str) -> tuple[list[onnx.NodeProto], list[str]]:
        return _layer_nodes(out, self.producer, self.inits, self.fp32_values)

    def branch(self, layer: str, out: str, fp32: onnx.NodeProto,
               k: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]] | None:
        """The candidate's nodes for ``layer``, renamed into a branch, and copies of the initializers they
        read, renamed, for the branch to hold (a copy in each branch that reads one: a tied table's two);
        None where it computes the layer as fp32 does."""
        if self.same_as(fp32):
            return None
        nodes, reads = self.nodes(out)
        weights = []
        for name in reads:
            init = onnx.TensorProto()
            init.CopyFrom(self.inits[name])
            init.name = self.prefix + name
            weights.append(init)
        local = {o for n in nodes for o in n.output}
        inner = f"graphcal-q/{k}/{layer}/"

        def rename(name: str) -> str:
            if not name:
                return name
            if name in local:
                return inner + name
            return self.prefix + name if name in self.inits else name

        return renamed(nodes, inner, rename), weights


def renamed(nodes: list[onnx.NodeProto], prefix: str, rename) -> list[onnx.NodeProto]:
    """Copies of ``nodes``, each named ``prefix`` + its name, its inputs and outputs passed through ``rename``."""
    copies = []
    for n in nodes:
        copy = onnx.NodeProto()
        copy.CopyFrom(n)
        copy.name = prefix + n.name
        copy.input[:] = [rename(i) for i in n.input]
        copy.output[:] = [rename(o) for o in n.output]
        copies.append(copy)
    return copies


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
