"""Pieces of the graph that run on their own: sequential blocks (GPTQ) and AWQ parents.

Pure graph analysis over names (no weight is read, no session opened), for two algorithms that
run parts of the model on cached inputs instead of the whole graph:

- **Sequential GPTQ** (llm-compressor's default pipeline): :func:`blocks` partitions the targets,
  in topological order, into one :class:`Block` per decoder layer; each block's
  :func:`block_subgraph` computes its targets' activations and its outputs from the outputs of
  the blocks before it (computed with the already-quantized weights), so the whole graph is
  never run once per layer.
- **AWQ**: :func:`parent_output` is where the parent sub-network of a group of balance layers
  ends (q/k/v -> the attention module's output, gate/up -> down_proj's output, one layer ->
  itself); :func:`parent_inputs` what it reads; :func:`subgraph` with ``weight_inputs`` is that
  sub-network with the balance weights fed per run (the candidate scales).

Subgraphs are *hollow* (like :mod:`graphcal.graph.taps`): nodes, inputs and outputs, no
initializer. The initializers a subgraph still reads are handed to
:func:`graphcal.runtime.open_runtime` as ``weights=needed_initializers(sub, model)`` (only
those: onnxruntime refuses an injected initializer that its graph does not read).

*Weight-dependent* tensors (:func:`weight_dependent`) are the ones a quantized or rescaled weight
can change: everything downstream of a target node's output, taken strictly through the graph
(a ``Shape`` of such a tensor counts, although its value cannot change). Everything else
(attention masks, rotary tables, embeddings of the input ids, Identity copies of
initializers) is never cached: each subgraph recomputes it from the graph inputs.

Limitations: only the main graph is split (an If/Loop/Scan node is one unit that reads what its
bodies read); nodes must be named by module scope (legacy exporter's ``/model/layers.0/...``
paths or the dynamo exporter's name_scopes metadata) for blocks to end on the residual stream
and for parents to be found by scope; without scopes blocks end at their last target's
output and parents fall back to the structural post-dominator.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import onnx

from graphcal.errors import GraphcalError
from graphcal.graph.check import node_reads
from graphcal.graph.index import SHAPE_OPS, GraphIndex
from graphcal.graph.io import hollow_copy, value_types
from graphcal.graph.targets import find_targets, scoped_module
from graphcal.types import Target

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


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def weight_dependent(model: onnx.ModelProto, targets: Iterable[Target]) -> set[str]:
    """Every tensor that depends transitively on the output of any target node (the outputs
    themselves included): the tensors a quantized or rescaled weight can change."""
    index = _index(model)
    outs = [index.output_of(i) for i in _target_nodes(index, targets).values()]
    return index.descendants(outs)


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
    index = _index(model)
    nodes_of = _target_nodes(index, targets)
    dep = index.descendants([index.output_of(i) for i in nodes_of.values()])
    ordered = sorted(targets, key=lambda t: index.position[nodes_of[_key(t)]])
    groups = _contiguous_groups(ordered) or [(t.name, [t]) for t in ordered]

    scoped = _nodes_by_scope_prefix(index)
    owner: dict[int, int] = {}  # node -> the block it belongs to (len(groups): after the last block)
    done: set[int] = set()
    for k, (name, members) in enumerate(groups):
        new = index.ancestors([index.output_of(nodes_of[_key(t)]) for t in members], done)
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
            wanted += [t.activation, index.output_of(nodes_of[_key(t)])]
        _, reached, _, _ = index.walk(wanted, set(inputs[k]))
        graph_inputs = tuple(n for n in index.graph_inputs if n in reached)
        result.append(Block(tuple(members), tuple(inputs[k]), tuple(outputs[k]), graph_inputs, name))
    return result


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
    index = _index(model)
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


def block_subgraph(model: onnx.ModelProto, block: Block, taps: Sequence[str], weight_inputs: Sequence[str] = (),
                   *, dependent: set[str] | None = None, types: dict | None = None) -> onnx.ModelProto:
    """The :func:`subgraph` computing ``taps`` (e.g. the block targets' activations) and
    ``block.outputs`` from ``block.inputs`` (and the graph inputs it needs). Its outputs are
    the taps, then the block outputs (deduplicated); a tap that is a block input comes out as
    fed. ``dependent`` should be :func:`weight_dependent` of the targets :func:`blocks` was given."""
    return subgraph(model, [*taps, *block.outputs], list(block.inputs), weight_inputs, dependent=dependent, types=types)


def parent_output(model: onnx.ModelProto, targets: Sequence[Target]) -> str:
    """The tensor at which the AWQ parent sub-network of these balance targets ends.

    One target: its node's output (the MatMul/Gemm output, before any bias ``Add``). Several:
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
    index = _index(model)
    outs = [index.output_of(i) for i in _target_nodes(index, targets).values()]
    if len(outs) == 1:
        return outs[0]
    found = _scoped_output(index, targets, outs)
    return found if found is not None else _common_post_dominator(index, outs, [t.name for t in targets])


def parent_inputs(model: onnx.ModelProto, targets: Sequence[Target], output: str,
                  *, dependent: set[str] | None = None) -> list[str]:
    """What the parent sub-network from the balance ``targets`` to ``output`` reads and a caller
    caches: the targets' activations (always, weight-dependent or not; normally one, shared),
    then any other weight-dependent tensor it reads that the targets do not change and that is
    not computed from the activations (a residual added inside the parent). Everything
    else it reads (masks, rotary tables) is recomputed from graph inputs by
    :func:`subgraph`, so ``subgraph(model, [output], parent_inputs(...), [t.weight for t in
    targets])`` is the parent with its balance weights fed per run. ``dependent``: as for
    :func:`subgraph`. In topological order of their producers (graph inputs first)."""
    index = _index(model)
    outs = [index.output_of(i) for i in _target_nodes(index, targets).values()]
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


def _index(model: onnx.ModelProto) -> GraphIndex:
    """The model's main graph indexed, its topological order made up front (GraphcalError for a
    cycle, before any walk)."""
    index = GraphIndex(model.graph)
    index.order  # noqa: B018 -- computed for its check
    return index


def _scopes(index: GraphIndex) -> list[str | None]:
    """Each node's module scope (:func:`graphcal.graph.targets.scoped_module`), by node index."""
    return [scoped_module(n) for n in index.nodes]


def _nodes_by_scope_prefix(index: GraphIndex) -> dict[str, list[int]]:
    """{module prefix: the nodes scoped at it or inside it, in topological order}."""
    found: dict[str, list[int]] = {}
    scopes = _scopes(index)
    for i in index.order:
        if not scopes[i]:
            continue
        parts = scopes[i].split(".")
        for k in range(1, len(parts) + 1):
            found.setdefault(".".join(parts[:k]), []).append(i)
    return found


def _key(target: Target) -> str:
    return target.name


def _target_nodes(index: GraphIndex, targets: Iterable[Target]) -> dict[str, int]:
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
        found[_key(t)] = match[0]
    return found


def _b_source(index: GraphIndex, b: str, target: Target):
    """What feeds a B input in the terms of ``target``: the initializer's name, or a one-tuple of
    its last weight-path node's name."""
    if not target.weight_path:
        return b
    p = index.producer.get(b)
    return (index.nodes[p].name,) if p is not None else None


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


# --------------------------------------------------------------------------------------------
# AWQ parents
# --------------------------------------------------------------------------------------------


def _common_prefix(names: list[str]) -> str:
    split = [n.split(".") for n in names]
    common = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def _scoped_output(index: GraphIndex, targets: Sequence[Target], outs: list[str]) -> str | None:
    """The single value tensor the targets' common module scope hands out; None if not exactly one."""
    scope = _common_prefix([t.name for t in targets])
    if not scope:
        return None
    scopes = _scopes(index)

    def inside(i: int) -> bool:
        s = scopes[i]
        return bool(s) and (s == scope or s.startswith(scope + "."))

    values = index.descendants(outs, through_shapes=False)
    graph_outputs = set(index.graph_outputs)
    found = []
    for i in index.order:
        if not inside(i):
            continue
        for t in index.nodes[i].output:
            if t and t in values and (t in graph_outputs or any(not inside(c) for c in index.consumers.get(t, ()))):
                found.append(t)
    return found[0] if len(found) == 1 else None


def _common_post_dominator(index: GraphIndex, outs: list[str], names: list[str]) -> str:
    """The immediate common post-dominator of ``outs`` in the graph of value tensors (edges into
    Shape/Size dropped), with every graph output leading to one exit (Cooper, Harvey and
    Kennedy's intersection on the reversed DAG; each tensor after all its successors)."""
    values = index.descendants(outs, through_shapes=False)
    exit_ = ""  # no tensor is named "" (an absent optional input)
    ipdom: dict[str, str] = {exit_: exit_}
    number = {exit_: 0}
    graph_outputs = set(index.graph_outputs)

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
