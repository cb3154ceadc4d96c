"""A graph's structure, checked before anything walks it: no cycles, nothing read undefined.

onnx's checker would say the same, but it needs the weights in memory (or a file) and stops at
the first problem without naming the node in a way users can act on. This walks the graph's
names only (cheap for any size) and names the node. Subgraphs (If/Loop/Scan bodies) are
checked with the names of their enclosing scopes visible, and a node that holds a subgraph
depends on every outer value the subgraph reads.
"""

from __future__ import annotations

from collections import deque

import onnx

from graphcal.errors import GraphcalError


def check_graph(model: onnx.ModelProto, where: str) -> None:
    """Raise GraphcalError (prefixed with ``where``) for a cycle, a value read but never defined,
    a value defined twice, or a graph output nobody produces."""
    try:
        _check(model.graph, frozenset(), "graph")
    except GraphcalError as e:
        raise GraphcalError(f"{where}: {e}") from None


def _label(node: onnx.NodeProto, index: int) -> str:
    return repr(node.name) if node.name else f"#{index} ({node.op_type})"


def _defined(graph: onnx.GraphProto, scope: str) -> set[str]:
    """The names ``graph``'s inputs and initializers define, each refused when given twice: onnxruntime
    keeps the last of two initializers (dense or sparse) of one name where graphcal would quantize
    another, and the written model then computes another function. An initializer that is also a
    graph input is no conflict: it is the input's default (onnxruntime runs it unless fed; graphcal
    never feeds it and quantizes it as a weight)."""
    inputs: set[str] = set()
    for v in graph.input:
        if v.name in inputs:
            raise GraphcalError(f"{scope}: graph input {v.name!r} is declared twice; an ONNX graph defines each value once")
        inputs.add(v.name)
    kinds: dict[str, str] = {}
    tensors = [("initializer", t.name) for t in graph.initializer]
    tensors += [("sparse initializer", s.values.name) for s in graph.sparse_initializer]
    for kind, name in tensors:
        if name in kinds:
            raise GraphcalError(f"{scope}: value {name!r} is defined twice ({kinds[name]} and {kind} of one name: "
                                "onnxruntime would run one, graphcal quantize the other); an ONNX graph defines "
                                "each value once")
        kinds[name] = kind
    return inputs | kinds.keys()


def _check(graph: onnx.GraphProto, outer: frozenset[str], scope: str) -> None:
    defined = _defined(graph, scope)
    producer: dict[str, int] = {}
    for index, node in enumerate(graph.node):
        for out in node.output:
            if not out:
                continue
            if out in producer or out in defined:
                raise GraphcalError(f"{scope}: value {out!r} is defined twice (node {_label(node, index)}); "
                                    "an ONNX graph defines each value once")
            producer[out] = index
    visible = outer | defined | producer.keys()
    waits_on: list[set[int]] = []
    for index, node in enumerate(graph.node):
        for sub in subgraphs(node):
            _check(sub, frozenset(visible), f"{scope} > {node.op_type} {_label(node, index)}")
        needs = set(node_reads(node))
        deps = set()
        for name in needs:
            if name in producer:
                deps.add(producer[name])
            elif name not in defined and name not in outer:
                raise GraphcalError(f"{scope}: node {_label(node, index)} reads {name!r}, which no node, "
                                    "graph input or initializer defines")
        waits_on.append(deps)
    for out in graph.output:
        if out.name not in visible:
            raise GraphcalError(f"{scope}: graph output {out.name!r} is never produced")
    _check_acyclic(graph, waits_on, scope)


def _check_acyclic(graph: onnx.GraphProto, waits_on: list[set[int]], scope: str) -> None:
    """Kahn's algorithm over the nodes; whatever is left waits on a cycle."""
    users: list[list[int]] = [[] for _ in waits_on]
    pending = [len(deps) for deps in waits_on]
    for index, deps in enumerate(waits_on):
        for dep in deps:
            users[dep].append(index)
    ready = deque(i for i, n in enumerate(pending) if n == 0)
    done = 0
    while ready:
        i = ready.popleft()
        done += 1
        for user in users[i]:
            pending[user] -= 1
            if pending[user] == 0:
                ready.append(user)
    if done == len(waits_on):
        return
    stuck = [i for i, n in enumerate(pending) if n > 0]
    # Follow dependencies among the stuck nodes until one repeats: that node lies on a cycle.
    seen: dict[int, int] = {}
    i = stuck[0]
    while i not in seen:
        seen[i] = len(seen)
        i = next(d for d in waits_on[i] if pending[d] > 0)
    cycle = [n for n, _ in sorted(seen.items(), key=lambda kv: kv[1]) if seen[n] >= seen[i]]
    names = " -> ".join(_label(graph.node[n], n) for n in cycle[:6]) + (" -> ..." if len(cycle) > 6 else "")
    raise GraphcalError(f"{scope}: the graph has a cycle through node {_label(graph.node[i], i)} ({names}); "
                        "an ONNX graph must be acyclic")


def subgraphs(node: onnx.NodeProto):
    """The graphs a node holds in its attributes (If's branches, Loop's and Scan's bodies)."""
    for attr in node.attribute:
        if attr.HasField("g"):
            yield attr.g
        yield from attr.graphs


def node_reads(node: onnx.NodeProto) -> list[str]:
    """The names ``node`` reads, once each: its inputs in order, then (sorted) what each of its
    subgraphs (If/Loop/Scan bodies) reads from outside itself."""
    names = dict.fromkeys(n for n in node.input if n)
    for body in subgraphs(node):
        names.update(dict.fromkeys(sorted(_free_names(body))))
    return list(names)


def _free_names(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads from its enclosing scopes."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    defined |= {s.values.name for s in graph.sparse_initializer}
    for node in graph.node:
        defined.update(o for o in node.output if o)
    free = set()
    for node in graph.node:
        free.update(name for name in node_reads(node) if name not in defined)
    free.update(o.name for o in graph.output if o.name not in defined)
    return free
