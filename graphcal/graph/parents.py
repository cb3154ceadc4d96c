"""AWQ's parents: where the sub-network of a group of balance layers ends, and what it reads.

:func:`parent_output` is where the parent sub-network of a group of balance layers ends
(q/k/v, or onnxruntime-genai's packed qkv_proj, -> the attention module's output, gate/up ->
down_proj's output, any other single layer -> itself);
:func:`parent_inputs` what it reads; :func:`graphcal.graph.subgraph.subgraph` with
``weight_inputs`` is that sub-network with the balance weights fed per run (the candidate
scales). Parents are found by module scope (legacy exporter's ``/model/layers.0/...`` paths or
the dynamo exporter's name_scopes metadata); without scopes by the structural post-dominator.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import onnx

from graphcal.errors import GraphcalError
from graphcal.graph.index import SHAPE_OPS, GraphIndex
from graphcal.graph.subgraph import indexed, node_scopes, target_nodes, weight_dependent
from graphcal.graph.targets import find_targets
from graphcal.types import Target


def parent_output(model: onnx.ModelProto, targets: Sequence[Target]) -> str:
    """The tensor at which the AWQ parent sub-network of these balance targets ends.

    One target: its node's output (the MatMul/Gemm output, before any bias ``Add``), except a
    packed q/k/v projection that feeds an attention op (onnxruntime-genai's ``qkv_proj``), whose
    parent is its attention module's output, as separate q/k/v's is. Several:
    when their nodes carry module scopes, the parent module is the longest common module prefix
    of their names (q/k/v -> ``model.layers.0.self_attn``, gate/up -> ``model.layers.0.mlp``,
    BERT's query/key/value -> ``encoder.layer.0.attention.self``, llm-compressor's lowest
    common ancestor) and the output is the single tensor made inside that scope, read outside it
    (or a graph output) whose values depend on the targets (shape-only and constant tensors
    skipped): the o_proj output, the down_proj output, BERT's self-attention context that feeds
    ``attention.output.dense``. Otherwise (no scopes, or not exactly one such tensor) the
    structural fallback: the immediate common post-dominator of the targets' outputs, the nearest
    tensor every value path from each of them to a graph output passes through (paths through
    ``Shape``/``Size`` ignored). GraphcalError when there is none before the graph outputs.
    """
    if not targets:
        raise GraphcalError("parent_output needs at least one target")
    index = indexed(model)
    nodes = target_nodes(index, targets)
    outs = [index.output_of(i) for i in nodes.values()]
    if len(outs) == 1:
        packed = _packed_attention_scope(index, targets[0], nodes[targets[0].name])
        found = None if packed is None else _scoped_output(index, targets, outs, scope=packed)
        return found if found is not None else outs[0]
    found = _scoped_output(index, targets, outs)
    return found if found is not None else _common_post_dominator(index, outs, [t.name for t in targets])


def layer_output(model: onnx.ModelProto, target: Target) -> str:
    """The target's own MatMul/Gemm output: where a parent that is the layer itself ends."""
    index = indexed(model)
    return index.output_of(target_nodes(index, [target])[target.name])


def parent_inputs(model: onnx.ModelProto, targets: Sequence[Target], output: str,
                  *, dependent: set[str] | None = None) -> list[str]:
    """What the parent sub-network from the balance ``targets`` to ``output`` reads and a caller
    caches: the targets' activations (always, weight-dependent or not; normally one, shared),
    then any other weight-dependent tensor it reads that the targets do not change and that is
    not computed from the activations (a residual added inside the parent). Everything
    else it reads (masks, rotary tables) is recomputed from graph inputs by
    :func:`graphcal.graph.subgraph.subgraph`, so ``subgraph(model, [output], parent_inputs(...), [t.weight for t in
    targets])`` is the parent with its balance weights fed per run. ``dependent``: as for
    :func:`graphcal.graph.subgraph.subgraph`. In topological order of their producers (graph inputs first)."""
    index = indexed(model)
    outs = [index.output_of(i) for i in target_nodes(index, targets).values()]
    changed = index.descendants(outs)
    if output not in changed:
        raise GraphcalError(f"{output!r} does not depend on the outputs of {[t.name for t in targets]}")
    if dependent is None:
        dependent = weight_dependent(model, find_targets(model)[0])
    activations = {t.activation for t in targets}
    stop = {t for t in activations if t not in changed}
    # other weight-dependent tensors the targets do not change are inputs too, unless computed from
    # the activations alone (the shapes of a layer-1 activation, which are weight-dependent as well)
    derived = index.descendants(stop)
    stop |= {t for t in dependent if t not in changed and t not in derived}
    _, reached, _, stops = index.walk([output], stop)
    found = set(stops) | {t for t in reached if t in activations}
    rank = {n: -1 for n in index.graph_inputs}
    return sorted(found, key=lambda t: (rank.get(t, index.position.get(index.producer.get(t), -1)), t))


def _common_prefix(names: list[str]) -> str:
    split = [n.split(".") for n in names]
    common = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


ATTENTION_OPS = {"GroupQueryAttention", "MultiHeadAttention", "Attention", "PackedMultiHeadAttention"}
PASS_THROUGH = {"Add", "Split", "Slice", "Reshape", "Transpose", "Identity", "Cast", "Squeeze", "Unsqueeze"}


def _packed_attention_scope(index: GraphIndex, target: Target, node: int) -> str | None:
    """The module a packed q/k/v projection (onnxruntime-genai's ``qkv_proj``, one MatMul whose
    output reaches an attention op only through a bias, splits and reshapes) belongs to: its
    parent is that module's output, as separate q/k/v's is (llm-compressor's self_attn), not the
    projection itself. None for any other single layer."""
    frontier, seen = [index.output_of(node)], set()
    reached = False
    while frontier:
        tensor = frontier.pop()
        if tensor in seen:
            continue
        seen.add(tensor)
        for c in index.consumers.get(tensor, ()):
            op = index.nodes[c].op_type
            if op in ATTENTION_OPS:
                reached = True
            elif op in PASS_THROUGH:
                frontier.extend(o for o in index.nodes[c].output if o)
            elif op not in SHAPE_OPS:
                return None  # the projection's values meet something that is not attention
    scope = target.name.rpartition(".")[0]
    return scope if reached and scope else None


def _scoped_output(index: GraphIndex, targets: Sequence[Target], outs: list[str], scope: str | None = None) -> str | None:
    """The single value tensor the targets' common module scope (or ``scope``) hands out; None if
    not exactly one."""
    scope = scope or _common_prefix([t.name for t in targets])
    if not scope:
        return None
    scopes = node_scopes(index)

    def inside(i: int) -> bool:
        s = scopes[i]
        return bool(s) and (s == scope or s.startswith(scope + "."))

    values = index.descendants(outs, through_shapes=False)
    graph_outputs = _model_outputs(index)
    found = []
    for i in index.order:
        if not inside(i):
            continue
        for t in index.nodes[i].output:
            if t and t in values and (t in graph_outputs or any(not inside(c) for c in index.consumers.get(t, ()))):
                found.append(t)
    return found[0] if len(found) == 1 else None


CACHE_OUTPUT = re.compile(r"(^|[./_])present([./_]|$)")  # present.N.key, present_key_values.N: KV-cache states


def _model_outputs(index: GraphIndex) -> set[str]:
    """The graph outputs a parent's output leads to: all but a KV-cache decoder's present states
    (Optimum's and onnxruntime-genai's ``present.N.key/value``), which k_proj and v_proj feed
    directly. llm-compressor takes AWQ's loss on the attention module's output, not on its cache."""
    return {o for o in index.graph_outputs if not CACHE_OUTPUT.search(o)}


def _common_post_dominator(index: GraphIndex, outs: list[str], names: list[str]) -> str:
    """The immediate common post-dominator of ``outs`` in the graph of value tensors (edges into
    Shape/Size dropped), with every graph output leading to one exit (Cooper, Harvey and
    Kennedy's intersection on the reversed DAG; each tensor after all its successors)."""
    values = index.descendants(outs, through_shapes=False)
    exit_ = ""  # no tensor is named "" (an absent optional input)
    ipdom: dict[str, str] = {exit_: exit_}
    number = {exit_: 0}
    graph_outputs = _model_outputs(index)

    def intersect(a: str, b: str) -> str:
        while a != b:
            while number[a] > number[b]:
                a = ipdom[a]
            while number[b] > number[a]:
                b = ipdom[b]
        return a

    for i in reversed(index.order):
        for t in reversed(index.nodes[i].output):
            if not t or t not in values:
                continue
            succ = [exit_] if t in graph_outputs else []
            for c in index.consumers.get(t, ()):
                node = index.nodes[c]
                if node.op_type in SHAPE_OPS and node.domain in ("", "ai.onnx"):
                    continue
                succ += [o for o in node.output if o in ipdom]  # those that reach a graph output
            if not succ:
                continue  # reaches no graph output: dominates nothing, dominated by nothing
            p = succ[0]
            for s in succ[1:]:
                p = intersect(p, s)
            ipdom[t] = p
            number[t] = len(number)
    reaching = [o for o in outs if o in ipdom]
    if not reaching:
        raise GraphcalError(f"the outputs of {names} reach no graph output")
    p = reaching[0]
    for o in reaching[1:]:
        p = intersect(p, o)
    if p == exit_:
        raise GraphcalError(f"no single tensor lies on every path from {names} to the graph outputs, "
                            "so they have no common parent sub-network")
    return p
