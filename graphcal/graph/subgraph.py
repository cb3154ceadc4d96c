"""Weightless subgraphs on a cut, and the tensors a weight can change.

Pure graph analysis over names (no weight is read, no session opened), shared by the sequential
blocks (:mod:`graphcal.graph.blocks`) and AWQ's parents (:mod:`graphcal.graph.parents`):

- :func:`subgraph`: a *hollow* model (like :mod:`graphcal.graph.taps`: nodes, inputs and
  outputs, no initializer) computing some tensors from the ``cut`` tensors and the graph inputs;
  the initializers it still reads are handed to :func:`graphcal.runtime.open_runtime` as
  ``weights=needed_initializers(sub, model)`` (only those: onnxruntime refuses an injected
  initializer that its graph does not read);
- :func:`weight_dependent`: the tensors a quantized or rescaled weight can change: everything
  downstream of a target node's output, taken strictly through the graph (a ``Shape`` of such a
  tensor counts, although its value cannot change). Everything else (attention masks, rotary
  tables, embeddings of the input ids, Identity copies of initializers) is never cached: each
  subgraph recomputes it from the graph inputs;
- :func:`target_nodes`: the node of each target in a :class:`graphcal.graph.index.GraphIndex`.

Only the main graph is split (an If/Loop/Scan node is one unit that reads what its bodies read).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import onnx

from graphcal.errors import GraphcalError
from graphcal.graph.check import node_reads
from graphcal.graph.index import GraphIndex
from graphcal.graph.io import hollow_copy, value_types
from graphcal.graph.targets import find_targets, scoped_module
from graphcal.types import Target


def weight_dependent(model: onnx.ModelProto, targets: Iterable[Target]) -> set[str]:
    """Every tensor that depends transitively on the output of any target node (the outputs
    themselves included): the tensors a quantized or rescaled weight can change."""
    index = indexed(model)
    outs = [index.output_of(i) for i in target_nodes(index, targets).values()]
    return index.descendants(outs)


def subgraph(model: onnx.ModelProto, outputs: Sequence[str], cut: Sequence[str], weight_inputs: Sequence[str] = (),
             *, dependent: set[str] | None = None, types: dict | None = None) -> onnx.ModelProto:
    """A hollow model computing ``outputs`` from the ``cut`` tensors and the graph inputs it needs.

    Walks back from ``outputs``, stopping at ``cut`` tensors, graph inputs and initializers; the
    nodes met keep their topological order. Graph inputs: the original graph inputs it reads
    (only those, as declared), then the ``cut`` tensors it reads (only those; typed and shaped
    from ``types`` = :func:`graphcal.graph.io.value_types` of ``model``, computed when not given,
    unknown dims made symbolic), then ``weight_inputs``: initializers fed per run instead
    (candidate weights; their element type and dims kept). No initializer is copied (external
    data is never touched): the session gets the ones it reads from
    :func:`needed_initializers`. Opsets, functions and metadata are kept.

    ``dependent`` is the set of weight-dependent tensors (:func:`weight_dependent`; default: of
    every target :func:`graphcal.graph.targets.find_targets` finds). Raises GraphcalError when an
    output cannot be computed from the cut and the graph inputs without recomputing a
    weight-dependent tensor from before the cut (one a cut tensor is computed from): the cut does
    not separate the outputs from the earlier weights.
    """
    index = indexed(model)
    outputs, cut, weight_inputs = (list(dict.fromkeys(x)) for x in (outputs, cut, weight_inputs))
    if not outputs:
        raise GraphcalError("a subgraph needs at least one output")
    inits = {t.name: t for t in model.graph.initializer}
    for name in weight_inputs:
        if name not in inits:
            raise GraphcalError(f"weight input {name!r} is not an initializer of the model")
    for name in [*outputs, *cut]:
        if not index.knows(name):
            raise GraphcalError(f"no tensor {name!r} in the graph")
    nodes, reached_inputs, reached_inits, stops = index.walk(outputs, set(cut) | set(weight_inputs))
    unread = [w for w in weight_inputs if w not in stops]
    if unread:
        raise GraphcalError(f"weight input {unread[0]!r} is not read by the nodes computing {outputs[0]!r}")

    if dependent is None:
        dependent = weight_dependent(model, find_targets(model)[0])
    upstream = index.ancestors([c for c in cut if c in dependent], set())
    bad = [i for i in nodes if i in upstream and any(o in dependent for o in index.nodes[i].output)]
    if bad:
        last = max(bad, key=index.position.__getitem__)
        tensor = next(o for o in index.nodes[last].output if o in dependent)
        raise GraphcalError(
            f"cannot compute {outputs[0]!r} from the cut {cut}: it needs the weight-dependent tensor {tensor!r}, "
            "which the cut tensors are themselves computed from (it is not in the cut)")

    sub = hollow_copy(model)
    g = sub.graph
    del g.node[:], g.input[:], g.output[:], g.value_info[:], g.sparse_initializer[:]
    g.node.extend(index.nodes[i] for i in index.order if i in nodes)
    g.input.extend(v for v in model.graph.input if v.name in reached_inputs and v.name not in inits)
    fed = [c for c in cut if c in stops]
    if types is None and fed:
        types = value_types(model)
    for name in fed:
        if any(v.name == name for v in g.input):
            continue  # a cut tensor that is a graph input anyway
        g.input.append(_typed_input(name, types.get(name)))
    for name in weight_inputs:
        g.input.append(onnx.helper.make_tensor_value_info(name, inits[name].data_type, list(inits[name].dims)))
    for name in outputs:
        value = onnx.ValueInfoProto(name=name)
        known = types.get(name) if types else None
        if known is not None and known.elem_type:
            value.type.tensor_type.elem_type = known.elem_type
        g.output.append(value)
    produced = {o for i in nodes for o in index.nodes[i].output}
    g.value_info.extend(v for v in model.graph.value_info if v.name in produced and v.name not in outputs)
    g.sparse_initializer.extend(s for s in model.graph.sparse_initializer if s.values.name in reached_inits)
    return sub


def needed_initializers(sub: onnx.ModelProto, model: onnx.ModelProto) -> list[onnx.TensorProto]:
    """The initializers of ``model`` that the hollow ``sub`` reads (not those it takes as graph
    inputs): ``open_runtime(sub, ..., weights=needed_initializers(sub, model))``. The tensors
    themselves, not copies; external ones stay external (pass the model's folder as
    ``external_folder``)."""
    g = sub.graph
    own = {v.name for v in g.input} | {t.name for t in g.initializer} | {s.values.name for s in g.sparse_initializer}
    read: set[str] = set()
    for node in g.node:
        read.update(node_reads(node))
    read.update(o.name for o in g.output)  # an initializer fetched as it is
    return [t for t in model.graph.initializer if t.name in read and t.name not in own]


def indexed(model: onnx.ModelProto) -> GraphIndex:
    """The model's main graph indexed, its topological order made up front (GraphcalError for a
    cycle, before any walk)."""
    index = GraphIndex(model.graph)
    index.order  # noqa: B018 -- computed for its check
    return index


def node_scopes(index: GraphIndex) -> list[str | None]:
    """Each node's module scope (:func:`graphcal.graph.targets.scoped_module`), by node index."""
    return [scoped_module(n) for n in index.nodes]


def target_nodes(index: GraphIndex, targets: Iterable[Target]) -> dict[str, int]:
    """{target name: its node's index}, matched by node name, op type and activation."""
    by_name: dict[str, list[int]] = {}
    for i, node in enumerate(index.nodes):
        by_name.setdefault(node.name, []).append(i)
    found: dict[str, int] = {}
    for t in targets:
        match = [i for i in by_name.get(t.node, ()) if index.nodes[i].op_type == t.op_type
                 and len(index.nodes[i].input) > 1 and index.nodes[i].input[0] == t.activation]
        if len(match) > 1:  # unnamed nodes reading one activation (q/k/v): told apart by their weight
            match = [i for i in match if _b_source(index, index.nodes[i].input[1], t) == (t.weight_path[-1:] or t.weight)]
        if not match:
            raise GraphcalError(f"target {t.name!r}: no {t.op_type} node {t.node!r} reading {t.activation!r} in the graph")
        found[t.name] = match[0]
    return found


def _b_source(index: GraphIndex, b: str, target: Target):
    """What feeds a B input in the terms of ``target``: the initializer's name, or a one-tuple of
    its last weight-path node's name."""
    if not target.weight_path:
        return b
    p = index.producer.get(b)
    return (index.nodes[p].name,) if p is not None else None


def _typed_input(name: str, known: onnx.TypeProto.Tensor | None) -> onnx.ValueInfoProto:
    """A graph input for a cut tensor: its element type and shape where shape inference knows
    them, a symbolic name for each unknown dim."""
    if known is None or not known.elem_type:
        raise GraphcalError(f"cannot tell the element type of {name!r} (onnx shape inference does not type it), "
                            "so it cannot be a subgraph input")
    value = onnx.ValueInfoProto(name=name)
    value.type.tensor_type.CopyFrom(known)
    if value.type.tensor_type.HasField("shape"):
        for d, dim in enumerate(value.type.tensor_type.shape.dim):
            if not dim.HasField("dim_value") and not dim.dim_param:
                dim.dim_param = f"{name}_dim{d}"
    return value
