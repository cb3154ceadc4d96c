"""Layer sensitivity by brute force: the quantized model with some of its layers back in float.

``graphcal eval --sensitivity`` answers "which layers should stay in float" by measuring it. For
each kind of layer (``mlp.down_proj`` across all blocks, ...), and with ``per_layer`` for each
layer, it runs the quantized model with only those layers quantized and every other layer back in
float, and compares the model's outputs with fp32: the end-to-end loss that kind causes on its
own. Kinds are ranked by it, and the advice is then measured as well. Taking the worst kind, then
the worst two, ... back to float, each option's model is run, so the "expected result" printed
with the flags is what those flags give. The quantized layers keep their own qparams, which do
not depend on the other layers: observers see the fp32 model.

:func:`measure_sensitivity` runs those passes (eval's own comparison is graphcal.evaluation.compare's).
:func:`float_except` builds their models from the quantized one. A layer goes back to float
when its output tensor comes from a copy of the fp32 model's own node (and weight path) on the
same input. The quantized nodes that fed it are dropped, and Q/DQ that other layers share stays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import onnx

from graphcal.evaluation.agreement import Agreement
from graphcal.evaluation.kinds import kind_pattern, layer_kind
from graphcal.graph.io import load_model
from graphcal.graph.qdq.cleanup import drop_dead_weight_paths

FLOAT_PREFIX = "graphcal-float/"
MAX_OPTIONS = 3  # advice: the worst kind, the worst two, the worst three


def quantized_layers(candidate: onnx.ModelProto, reference: onnx.ModelProto, targets) -> list:
    """The targets the candidate quantized: those whose output it computes otherwise than fp32 does."""
    ref_nodes = {n.name: n for n in reference.graph.node}
    producer = {o: n for n in candidate.graph.node for o in n.output}
    out = []
    for t in targets:
        ref = ref_nodes[t.node]
        node = producer.get(ref.output[0])
        if node is None:
            continue  # not in the candidate: eval lists it as not compared
        if node.op_type == ref.op_type and list(node.input) == list(ref.input) and node.name == ref.name:
            continue  # the fp32 node itself: left in float
        out.append(t)
    return out


def float_except(candidate: onnx.ModelProto, reference: onnx.ModelProto, layers, keep: set[str]) -> onnx.ModelProto:
    """A copy of ``candidate`` in which every layer of ``layers`` (quantized targets) not named in
    ``keep`` computes in float, as ``reference`` does."""
    model = onnx.ModelProto()
    model.CopyFrom(candidate)
    graph = model.graph
    ref_graph = reference.graph
    ref_inits = {t.name: t for t in ref_graph.initializer}
    ref_producer = {o: n for n in ref_graph.node for o in n.output}
    ref_nodes = {n.name: n for n in ref_graph.node}
    copied: dict[str, str] = {}
    detached: set[str] = set()
    before: dict[int, list[onnx.NodeProto]] = {}  # id(candidate node) -> float nodes to insert in front of it

    def copy_value(name: str, into: list[onnx.NodeProto]) -> str:
        """The reference's constant ``name`` (an initializer, or a weight path over one) in the copy."""
        if not name:
            return name
        if name in copied:
            return copied[name]
        new = FLOAT_PREFIX + name
        if name in ref_inits:
            init = onnx.TensorProto()
            init.CopyFrom(ref_inits[name])
            init.name = new
            graph.initializer.append(init)
        elif name in ref_producer:
            node = ref_producer[name]
            inputs = [copy_value(i, into) for i in node.input]
            into.append(onnx.helper.make_node(node.op_type, inputs, [FLOAT_PREFIX + o for o in node.output],
                                              name=FLOAT_PREFIX + node.name, domain=node.domain))
            into[-1].attribute.extend(node.attribute)
        else:
            return name  # an activation: the same tensor in both models
        copied[name] = new
        return new

    producer = {o: n for n in graph.node for o in n.output}
    for t in layers:
        if t.name in keep:
            continue
        ref = ref_nodes[t.node]
        out = ref.output[0]
        node = producer[out]
        dead = out + "/graphcal-quantized"
        node.output[list(node.output).index(out)] = dead
        detached.add(dead)
        nodes: list[onnx.NodeProto] = []
        inputs = [ref.input[0]] + [copy_value(i, nodes) for i in ref.input[1:]]
        float_node = onnx.helper.make_node(ref.op_type, inputs, [out], name=FLOAT_PREFIX + ref.name, domain=ref.domain)
        float_node.attribute.extend(ref.attribute)
        before.setdefault(id(node), []).extend([*nodes, float_node])
    order = []
    for n in graph.node:
        order.extend(before.get(id(n), []))
        order.append(n)
    del graph.node[:]
    graph.node.extend(order)
    drop_dead_weight_paths(graph, detached)
    return model


@dataclass
class Option:
    """Advice: these kinds (and their layers) back in float, and the output agreement that gives."""

    kinds: list[str]
    layers: list[str]
    outputs: list[Agreement] = field(default_factory=list)  # one per model output

    @property
    def sqnr_db(self) -> float:
        return self.outputs[0].sqnr_db if self.outputs else math.nan


@dataclass
class Sensitivity:
    """End-to-end loss of each kind (and layer) quantized alone, and the measured advice."""

    kinds: dict[str, list[str]]  # kind -> its quantized layers
    alone: dict[str, list[Agreement]]  # kind (or layer) -> output agreements with only it quantized
    options: list[Option]
    ignored: list[str]  # the ignore list the quantized model was written with

    def ranked(self) -> list[str]:
        """Kinds (and layers), the most harmful alone first."""
        return sorted(self.alone, key=lambda k: self.alone[k][0].sqnr_db)

    def advice(self, now_db: float) -> Option | None:
        """The option that recovers at least half of what the largest one does, with the fewest layers."""
        measured = [o for o in self.options if math.isfinite(o.sqnr_db) or o.sqnr_db == math.inf]
        if not measured:
            return None
        gain = max(o.sqnr_db for o in measured) - now_db
        if gain <= 0.5:  # nothing worth a layer in float
            return None
        return next(o for o in measured if o.sqnr_db - now_db >= gain / 2)

    def flags(self, option: Option) -> list[str]:
        """--ignore flags for ``option``: the model's own ignores first, then one pattern per kind."""
        flags = []
        for value in [*self.ignored, *(_pattern(k, self.kinds[k]) for k in option.kinds)]:
            flags += ["--ignore", value]
        return flags


def _pattern(kind: str, layers: list[str]) -> str:
    """A kind as an --ignore value: ``re:.*\\.mlp\\.down_proj$`` for a kind found in blocks, else the name."""
    if len(layers) == 1 and layers[0] == kind:
        return kind
    return kind_pattern(kind)


def measure_sensitivity(reference, candidate, targets, outputs, calib, optimization, per_layer: bool, ignored) -> Sensitivity:
    """Each kind (and layer) quantized alone, then the advice options, each compared with fp32 over the data."""
    ref_model, cand_model = load_model(reference), load_model(candidate)
    layers = quantized_layers(cand_model, ref_model, targets)
    kinds: dict[str, list[str]] = {}
    for t in layers:
        kinds.setdefault(layer_kind(t.name), []).append(t.name)

    from graphcal.runtime import open_model_runner  # lazy: it imports onnxruntime, loaded when a comparison runs

    ref_run = open_model_runner(ref_model, outputs, optimization=optimization)  # one fp32 session for every variant

    def compare(keep: set[str]) -> list[Agreement]:
        return _compare(ref_run, float_except(cand_model, ref_model, layers, keep), outputs, calib, optimization)

    alone = {kind: compare(set(names)) for kind, names in kinds.items()}
    if per_layer:
        alone.update({t.name: compare({t.name}) for t in layers if len(kinds[layer_kind(t.name)]) > 1})
    ranked = sorted(kinds, key=lambda k: alone[k][0].sqnr_db)
    options = []
    for n in range(1, min(MAX_OPTIONS, len(ranked) - 1) + 1):  # never every kind: that is the fp32 model
        floated = ranked[:n]
        names = [name for k in floated for name in kinds[k]]
        option = Option(floated, names)
        option.outputs = compare({t.name for t in layers} - set(names))
        options.append(option)
    return Sensitivity(kinds, alone, options, list(ignored))


def _compare(ref_run, model, outputs, calib, optimization) -> list[Agreement]:
    """The outputs of ``model`` against the fp32 runner's over the data (both run once per batch)."""
    from graphcal.runtime import open_model_runner  # lazy: as in measure_sensitivity

    run = open_model_runner(model, outputs, optimization=optimization)
    agree = [Agreement(o) for o in outputs]
    for batch in calib.batches():
        ref_values, values = ref_run.run(batch), run.run(batch)
        for a, name in zip(agree, outputs):
            a.add(ref_values[name], values[name])
    return agree
