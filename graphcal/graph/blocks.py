"""Sequential blocks (GPTQ): the targets in layer blocks, and the tensors that cross between them.

llm-compressor's default pipeline runs sequential GPTQ layer by layer: :func:`blocks` partitions
the targets, in topological order, into one :class:`Block` per decoder layer; each block's
:func:`block_subgraph` computes its targets' activations and its outputs from the outputs of the
blocks before it (computed with the already-quantized weights), so the whole graph is never run
once per layer. Pure graph analysis over names (no weight is read, no session opened).

The hollow subgraphs and weight-dependent tensors are :mod:`graphcal.graph.subgraph`'s, AWQ's
parents :mod:`graphcal.graph.parents`'; both are also importable from here, where they lived.

A block always holds whole fused units (q/k/v, gate/up): sequential GPTQ rounds a unit at once.
Module names without a layer number, or interleaving between layers, give a block per unit.

Limitations: nodes must be named by module scope (legacy exporter's ``/model/layers.0/...``
paths or the dynamo exporter's name_scopes metadata) for blocks to end on the residual stream;
without scopes blocks end at their last target's output.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import onnx

from graphcal.graph.fusion import fused_units
from graphcal.graph.index import GraphIndex
from graphcal.graph.parents import parent_inputs, parent_output
from graphcal.graph.subgraph import indexed, needed_initializers, node_scopes, subgraph, target_nodes, weight_dependent
from graphcal.types import FusedGroup, Target

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


@dataclass
class _Group:
    """Targets on their way to a block: its name, the module scopes whose closing nodes it takes."""

    name: str
    scopes: tuple[str, ...]
    members: list[Target]


def blocks(model: onnx.ModelProto, targets: Sequence[Target], groups: Sequence[FusedGroup] = ()) -> list[Block]:
    """The targets partitioned, in topological order, into sequential blocks.

    Targets go in units: a fused group of ``groups`` (q/k/v, gate/up; graph.fusion.fused_units)
    is one unit, every other target a unit of its own, and a block holds whole units (sequential
    GPTQ rounds a unit at once and runs its block with all of its rounded weights). Units are
    grouped by :func:`layer_prefix` of their members' module names; a unit without one prefix
    shared by its members (``lm_head``, or names carrying no layer number such as
    ``encoder.self_attn.q_proj``) is a block of its own, at its place in order. When the groups
    are not contiguous in topological order (names that interleave between layers), every unit
    is a block of its own. Blocks that would need a later block's target (a unit whose members
    read different inputs) are merged.

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

    def position(t: Target) -> int:
        return index.position[nodes_of[t.name]]

    units = sorted((sorted(u, key=position) for u in fused_units(targets, groups)), key=lambda u: position(u[0]))
    parts = _contiguous_groups(units) or [_Group(u[0].name, tuple(t.name for t in u), list(u)) for u in units]
    scoped = _nodes_by_scope_prefix(index)
    owner = None
    while owner is None:
        owner, parts = _owners(index, parts, nodes_of, dep, scoped)

    graph_outputs = set(index.graph_outputs)
    inputs: list[dict[str, None]] = [{} for _ in parts]
    outputs: list[dict[str, None]] = [{} for _ in parts]
    for i in index.order:  # producers in topological order: inputs and outputs come out in that order
        k = owner.get(i)
        if k is None or k == len(parts):
            continue
        for t in index.nodes[i].output:
            if not t or t not in dep:
                continue
            readers = {owner[c] for c in index.consumers.get(t, ()) if c in owner and owner[c] != k}
            if readers or t in graph_outputs:
                outputs[k][t] = None
            for j in readers:
                if j < len(parts):
                    inputs[j][t] = None

    result = []
    for k, part in enumerate(parts):
        wanted = [*outputs[k]]
        for t in part.members:
            wanted += [t.activation, index.output_of(nodes_of[t.name])]
        _, reached, _, _ = index.walk(wanted, set(inputs[k]))
        graph_inputs = tuple(n for n in index.graph_inputs if n in reached)
        result.append(Block(tuple(part.members), tuple(inputs[k]), tuple(outputs[k]), graph_inputs, part.name))
    return result


def _owners(index: GraphIndex, parts: list[_Group], nodes_of: dict[str, int], dep: set[str],
            scoped: dict[str, list[int]]) -> tuple[dict[int, int] | None, list[_Group]]:
    """({node: the block it belongs to (len(parts): after the last block)}, parts); (None, the
    parts with two merged) when a block's nodes take in a target of a later block."""
    later = {nodes_of[t.name]: k for k, part in enumerate(parts) for t in part.members}
    owner: dict[int, int] = {}
    done: set[int] = set()  # the nodes of the blocks so far (index.ancestors adds to it)
    for k, part in enumerate(parts):
        new = index.ancestors([index.output_of(nodes_of[t.name]) for t in part.members], done)
        for scope in part.scopes:
            for i in scoped.get(scope, ()):  # in topological order: a chain is absorbed in one pass
                if i in done:
                    continue
                if all(t not in dep or index.producer.get(t) in done for t in index.reads[i]):
                    new |= index.ancestors([o for o in index.nodes[i].output if o], done)
        ahead = max((later[i] for i in new if later.get(i, k) > k), default=k)
        if ahead > k:  # needs a target of block ``ahead``: one block from k to there
            merged = parts[k:ahead + 1]
            joined = _Group(f"{merged[0].name} .. {merged[-1].name}", tuple(s for p in merged for s in p.scopes),
                            [t for p in merged for t in p.members])
            return None, [*parts[:k], joined, *parts[ahead + 1:]]
        owner.update(dict.fromkeys(new, k))
    tail = index.ancestors(index.graph_outputs, done)  # computes the graph outputs after the last block
    owner.update(dict.fromkeys(tail, len(parts)))
    return owner, parts


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


def _contiguous_groups(units: list[list[Target]]) -> list[_Group] | None:
    """The units grouped by decoder-layer prefix, in order (a unit whose members share none: a
    group of its own); None when a group comes back after another one started."""
    groups: list[_Group] = []
    seen: set[str] = set()
    for unit in units:
        prefixes = {layer_prefix(t.name) for t in unit}
        key = prefixes.pop() if len(prefixes) == 1 else None
        if key is None:
            groups.append(_Group(unit[0].name, tuple(t.name for t in unit), list(unit)))
        elif groups and groups[-1].name == key:
            groups[-1].members.extend(unit)
        elif key in seen:
            return None
        else:
            seen.add(key)
            groups.append(_Group(key, (key,), list(unit)))
    return groups
