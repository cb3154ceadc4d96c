"""Weight paths nothing reads once their targets read the dequantized weight.

A weight behind Transpose/Cast/Reshape/Identity is stored quantized with that path folded in;
the old path, and the float initializer at its start, go unless something else (a tied
embedding's Gather, a graph output) still reads them.
"""

from __future__ import annotations

import onnx


def dead_weight_paths(graph: onnx.GraphProto, detached: set[str], inputs_of=None) -> tuple[list, list[str]]:
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


def drop_dead_weight_paths(graph: onnx.GraphProto, detached: set[str]) -> None:
    """Remove weight-path nodes and initializers that nothing reads any more."""
    dead_nodes, dead_inits = dead_weight_paths(graph, detached)
    for n in dead_nodes:
        graph.node.remove(n)
    if dead_inits:
        drop = set(dead_inits)
        keep = [t for t in graph.initializer if t.name not in drop]
        del graph.initializer[:]
        graph.initializer.extend(keep)
