"""Sequential blocks (GPTQ): the targets in layer blocks, and the tensors that cross between them.

llm-compressor's default pipeline runs sequential GPTQ layer by layer: :func:`blocks` partitions
the targets, in topological order, into one :class:`Block` per decoder layer; each block's
:func:`block_subgraph` computes its targets' activations and its outputs from the outputs of the
blocks before it (computed with the already-quantized weights), so the whole graph is never run
once per layer. Pure graph analysis over names (no weight is read, no session opened).

The hollow subgraphs and weight-dependent tensors are :mod:`graphcal.graph.subgraph`'s, AWQ's
parents :mod:`graphcal.graph.parents`'; both are also importable from here, where they lived.

Limitations: nodes must be named by module scope (legacy exporter's ``/model/layers.0/...``
paths or the dynamo exporter's name_scopes metadata) for blocks to end on the residual stream;
without scopes blocks end at their last target's output.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import onnx

from graphcal.graph.index import GraphIndex
from graphcal.graph.parents import parent_inputs, parent_output
from graphcal.graph.subgraph import indexed, needed_initializers, node_scopes, subgraph, target_nodes, weight_dependent
from graphcal.types import Target

__all__ = ["Block", "block_subgraph", "blocks", "layer_prefix", "needed_initializers", "parent_inputs", "parent_output",
           "subgraph", "weight_dependent"]

_NUMERIC = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class Block:
    """Consecutive targets run together, on the tensors earlier blocks made.

    ``inputs``: weight-dependent tensors made by earlier blocks that this block's nodes read (what
    its subgraph is fed, besides ``graph_inputs``); ``outputs``: weight-dependent tensors this
    block makes that later blocks (or the rest of the graph after the last block, or the graph's
    outputs) read; ``graph_inputs``: the model's graph inputs its subgraph needs to recompute
    what depends on no weight (masks, rotary tables); ``name``: the decoder-layer prefix of the
    targets' module names (``"model.layers.0"``), or the one target's name.

    A tensor in ``outputs`` may be read by several later blocks (a skip connection): a caller
    keeps it cached until the last block listing it in ``inputs``.
    """

    targets: tuple[Target, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    graph_inputs: tuple[str, ...] = ()
    name: str = ""


def layer_prefix(name: str) -> str | None:
    """The decoder-layer prefix of a module name: up to and including its first purely numeric
    component (``"model.layers.3.mlp.up_proj"`` -> ``"model.layers.3"``, ``"encoder.layer.0...."``
    -> ``"encoder.layer.0"``); None when it has none (``"lm_head"``)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if _NUMERIC.fullmatch(part):
            return ".".join(parts[: i + 1])
    return None


def blocks(model: onnx.ModelProto, targets: Sequence[Target]) -> list[Block]:
    """The targets partitioned, in topological order, into sequential blocks.

    Targets are grouped by :func:`layer_prefix` of their module names; a target without a numeric
    component is a block of its own (``lm_head``, at its place in order). When the groups are
    not contiguous in topological order, every target is a block of its own.

    With A_k the nodes needed for the outputs of the targets of blocks <= k (their ancestors,
    target nodes included), grown by the nodes scoped inside block k's module prefix that can be
    computed from A_k alone (the residual ``Add`` that closes a decoder layer, BERT's bias
    ``Add`` and ``LayerNorm``: so that a block ends on the residual stream rather than on its
    last target's output plus the stream beside it), block k's nodes are A_k \\ A_(k-1). Its
    ``outputs`` are the weight-dependent tensors its nodes make that nodes of later blocks read
    (or the nodes after the last block that compute the graph's outputs, or the graph outputs
    themselves); its ``inputs`` the weight-dependent tensors made by earlier blocks that its
    nodes read. Tensors that depend on no target are never inputs or outputs.
    """
    index = indexed(model)
    nodes_of = target_nodes(index, targets)
    dep = index.descendants([index.output_of(i) for i in nodes_of.values()])
    ordered = sorted(targets, key=lambda t: index.position[nodes_of[t.name]])
    groups = _contiguous_groups(ordered) or [(t.name, [t]) for t in ordered]

    scoped = _nodes_by_scope_prefix(index)
    owner: dict[int, int] = {}  # node -> the block it belongs to (len(groups): after the last block)
    done: set[int] = set()
    for k, (name, members) in enumerate(groups):
        new = index.ancestors([index.output_of(nodes_of[t.name]) for t in members], done)
        for i in scoped.get(name, ()):  # in topological order: a chain is absorbed in one pass
            if i in done:
                continue
            if all(t not in dep or index.producer.get(t) in done for t in index.reads[i]):
                new |= index.ancestors([o for o in index.nodes[i].output if o], done)
        owner.update(dict.fromkeys(new, k))
    tail = index.ancestors(index.graph_outputs, done)  # computes the graph outputs after the last block
    owner.update(dict.fromkeys(tail, len(groups)))

    graph_outputs = set(index.graph_outputs)
    inputs: list[dict[str, None]] = [{} for _ in groups]
    outputs: list[dict[str, None]] = [{} for _ in groups]
    for i in index.order:  # producers in topological order: inputs and outputs come out in that order
        k = owner.get(i)
        if k is None or k == len(groups):
            continue
        for t in index.nodes[i].output:
            if not t or t not in dep:
                continue
            readers = {owner[c] for c in index.consumers.get(t, ()) if c in owner and owner[c] != k}
            if readers or t in graph_outputs:
                outputs[k][t] = None
            for j in readers:
                if j < len(groups):
                    inputs[j][t] = None

    result = []
    for k, (name, members) in enumerate(groups):
        wanted = [*outputs[k]]
        for t in members:
            wanted += [t.activation, index.output_of(nodes_of[t.name])]
        _, reached, _, _ = index.walk(wanted, set(inputs[k]))
        graph_inputs = tuple(n for n in index.graph_inputs if n in reached)
        result.append(Block(tuple(members), tuple(inputs[k]), tuple(outputs[k]), graph_inputs, name))
    return result


def block_subgraph(model: onnx.ModelProto, block: Block, taps: Sequence[str], weight_inputs: Sequence[str] = (),
                   *, dependent: set[str] | None = None, types: dict | None = None) -> onnx.ModelProto:
    """The :func:`subgraph` computing ``taps`` (e.g. the block targets' activations) and
    ``block.outputs`` from ``block.inputs`` (and the graph inputs it needs). Its outputs are
    the taps, then the block outputs (deduplicated); a tap that is a block input comes out as
    fed. ``dependent`` should be :func:`weight_dependent` of the targets :func:`blocks` was given."""
    return subgraph(model, [*taps, *block.outputs], list(block.inputs), weight_inputs, dependent=dependent, types=types)


def _nodes_by_scope_prefix(index: GraphIndex) -> dict[str, list[int]]:
    """{module prefix: the nodes scoped at it or inside it, in topological order}."""
    found: dict[str, list[int]] = {}
    scopes = node_scopes(index)
    for i in index.order:
        if not scopes[i]:
            continue
        parts = scopes[i].split(".")
        for k in range(1, len(parts) + 1):
            found.setdefault(".".join(parts[:k]), []).append(i)
    return found


def _contiguous_groups(ordered: list[Target]) -> list[tuple[str, list[Target]]] | None:
    """[(decoder-layer prefix or own name, targets)] in order; None when a group comes back
    after another one started."""
    groups: list[tuple[str, list[Target]]] = []
    seen: set[str] = set()
    for t in ordered:
        key = layer_prefix(t.name) or t.name
        if groups and groups[-1][0] == key:
            groups[-1][1].append(t)
        elif key in seen:
            return None
        else:
            seen.add(key)
            groups.append((key, [t]))
    return groups
