"""Editing a graph in place: new names, new nodes where they belong, and what is left unread.

The code that changes a graph (the Q/DQ writer, SmoothQuant's folds and explicit Mul, the tapped
copies) uses these, so that every new name is allocated one way and every new node is placed
one way:

- :class:`Names`: the names taken, and a free one for a base (``base``, ``base_1``, ...);
- :func:`name_nodes`: a name of its own for every node (ONNX's names are optional, graphcal looks
  nodes up by name), given when a model is loaded;
- :func:`add_initializer`: a constant under a free name;
- :func:`place_around`: new nodes in front of / after the node they were built for;
- :func:`place_after_producers`: new nodes right after the producer of the tensor they read;
- :func:`replace_input`: a node's input pointed at another value;
- :func:`dead_paths` / :func:`drop_dead_paths`: the nodes and initializers nothing reads once
  some values lost a reader (a weight path left behind by a replaced weight).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import onnx
from onnx import numpy_helper

from graphcal.graph.check import subgraphs


class Names:
    """The names taken in a graph (which ones: the caller's choice), and new ones that are not:
    ``base`` when it is free, else the first free of ``base_1``, ``base_2``, ...; each name handed
    out is taken from then on."""

    def __init__(self, taken: Iterable[str] = ()):
        self.taken = set(taken)

    def unique(self, base: str) -> str:
        candidate, i = base, 1
        while candidate in self.taken:
            candidate, i = f"{base}_{i}", i + 1
        self.taken.add(candidate)
        return candidate


def name_nodes(graph: onnx.GraphProto) -> int:
    """Give every node of ``graph``, and of the subgraphs its nodes hold, a name no other node there
    has: an unnamed node ``{op_type}_{index}`` in lower case (``matmul_30``: the module name graphcal
    always gave an unnamed weight MatMul), a later node reusing a name that name with ``_1``, ``_2``,
    ... (a legacy exporter's ``.../MatMul`` stays ``.../MatMul_N``, the same module). Nodes already
    named once keep their names. Returns how many nodes were named. Loading does this to its own
    copy of a model (graph.io.load_model_info), never to the file."""
    nodes = list(graph.node)
    names = Names(n.name for n in nodes if n.name)
    seen: set[str] = set()
    renamed = 0
    for index, node in enumerate(nodes):
        if node.name and node.name not in seen:
            seen.add(node.name)
        else:
            node.name = names.unique(node.name or f"{node.op_type.lower()}_{index}")
            seen.add(node.name)
            renamed += 1
        for body in subgraphs(node):
            renamed += name_nodes(body)
    return renamed


def add_initializer(initializers, names: Names, base: str, array: np.ndarray) -> str:
    """Append ``array`` to ``initializers`` (a graph's, or a list placed later) under a free name
    from ``base``; returns the name. The array is stored as given (its shape kept: a caller that
    wants it contiguous passes it so)."""
    name = names.unique(base)
    initializers.append(numpy_helper.from_array(array, name))
    return name


def replace_input(node: onnx.NodeProto, old: str, new: str) -> None:
    """Point every input of ``node`` that reads ``old`` at ``new``."""
    for i, name in enumerate(node.input):
        if name == old:
            node.input[i] = new


def place_around(graph: onnx.GraphProto, before: dict[str, list[onnx.NodeProto]],
                 after: dict[str, list[onnx.NodeProto]]) -> None:
    """Put ``before[name]`` in front of, and ``after[name]`` right after, each node called ``name``."""
    new_nodes = []
    for node in graph.node:
        new_nodes.extend(before.get(node.name, []))
        new_nodes.append(node)
        new_nodes.extend(after.get(node.name, []))
    del graph.node[:]
    graph.node.extend(new_nodes)


def place_after_producers(graph: onnx.GraphProto, added: dict[str, list[onnx.NodeProto]]) -> None:
    """Insert ``added[tensor]`` (nodes) right after the node producing ``tensor`` (graph inputs: first)."""
    added = dict(added)
    order = []
    for n in graph.node:
        order.append(n)
        for produced in n.output:
            order.extend(added.pop(produced, []))
    for nodes in added.values():  # graph inputs: at the front
        order[:0] = nodes
    del graph.node[:]
    graph.node.extend(order)


def dead_paths(graph: onnx.GraphProto, detached: set[str],
               inputs_of: Callable[[onnx.NodeProto], list[str]] | None = None) -> tuple[list, list[str]]:
    """(nodes, initializer names) nothing reads any more once ``detached`` values lost a reader.

    A node is dead when none of its outputs is read and one of them was detached; its inputs are
    then detached in turn. ``inputs_of(node)`` gives a node's inputs (default: as in the graph),
    so a caller can ask what a rewiring would leave dead without making it.
    """
    inputs_of = inputs_of or (lambda n: list(n.input))
    detached = set(detached)
    nodes = list(graph.node)
    dead_nodes: list = []
    outputs = {o.name for o in graph.output}
    while True:
        used = {i for n in nodes for i in inputs_of(n)} | outputs
        dead = [n for n in nodes if all(o not in used for o in n.output) and set(n.output) & detached]
        if not dead:
            break
        for n in dead:
            detached.update(i for i in n.input if i)
            nodes.remove(n)
        dead_nodes += dead
    used |= {i.name for i in graph.input}
    inits = [t.name for t in graph.initializer if t.name in detached and t.name not in used]
    return dead_nodes, inits


def drop_dead_paths(graph: onnx.GraphProto, detached: set[str]) -> None:
    """Remove the nodes and initializers that nothing reads any more (:func:`dead_paths`)."""
    dead_nodes, dead_inits = dead_paths(graph, detached)
    for n in dead_nodes:
        graph.node.remove(n)
    if dead_inits:  # deleted where they stand: re-adding the others would copy every weight held in memory
        drop = set(dead_inits)
        for i in reversed(range(len(graph.initializer))):
            if graph.initializer[i].name in drop:
                del graph.initializer[i]
