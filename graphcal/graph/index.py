"""One graph's structure by value name: producers, readers, initializers, a topological order.

Every module of :mod:`graphcal.graph` that looks a value up (who makes it, who reads it, is it a
weight) asks a :class:`GraphIndex` rather than building its own map. Each view is built on first
use only, so a caller that needs producers alone pays for producers alone.

Two kinds of reader, on purpose:

- :attr:`GraphIndex.readers`: the nodes naming a value among their own inputs, once per input
  slot (``Mul(x, x)`` reads ``x`` twice), subgraph bodies not looked into (SmoothQuant's folds
  care about the node that takes the value);
- :attr:`GraphIndex.consumers`: the nodes whose computation reads a value, once per node,
  what an If/Loop/Scan body reads from outside counted as its node's read
  (:func:`graphcal.graph.check.node_reads`; the blocks' dependence walks).

Only the main graph is indexed; a producer is the *last* node making a value (an ONNX graph
makes each once: :func:`graphcal.graph.check.check_graph`). A view describes the graph as it
was when that view was first asked for: an index is for reading, and code that edits the graph
(:mod:`graphcal.graph.edit`) asks its questions before it edits, or builds a new index.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from functools import cached_property

import onnx

from graphcal.errors import GraphcalError
from graphcal.graph.check import node_reads

SHAPE_OPS = frozenset({"Shape", "Size"})  # ops whose output tells a tensor's shape, never its values


class GraphIndex:
    """The main graph of a model by value name.

    ``keep_unnamed``: :attr:`producer` maps the empty name too (to the last node that leaves an
    optional output out), as the target search and the attention search have always looked it up.
    """

    def __init__(self, graph: onnx.GraphProto, *, keep_unnamed: bool = False):
        self.graph = graph
        self.nodes = list(graph.node)
        self._keep_unnamed = keep_unnamed

    # -- values ---------------------------------------------------------------------------------

    @cached_property
    def initializers(self) -> dict[str, onnx.TensorProto]:
        """The (dense) initializers by name."""
        return {t.name: t for t in self.graph.initializer}

    @cached_property
    def constants(self) -> set[str]:
        """Names of every initializer, sparse ones included."""
        return set(self.initializers) | {s.values.name for s in self.graph.sparse_initializer}

    @cached_property
    def graph_inputs(self) -> list[str]:
        """The graph inputs that are not initializers (some exporters list weights as inputs too)."""
        return [v.name for v in self.graph.input if v.name not in self.constants]

    @cached_property
    def graph_input_set(self) -> set[str]:
        return set(self.graph_inputs)

    @cached_property
    def graph_outputs(self) -> list[str]:
        return [o.name for o in self.graph.output]

    @cached_property
    def graph_output_set(self) -> set[str]:
        return set(self.graph_outputs)

    def knows(self, name: str) -> bool:
        """Whether ``name`` is a value of the graph (made by a node, a graph input or an initializer)."""
        return name in self.producer or name in self.graph_input_set or name in self.constants

    # -- producers ------------------------------------------------------------------------------

    @cached_property
    def producer(self) -> dict[str, int]:
        """{value: the index of the last node making it}; the empty name only with ``keep_unnamed``."""
        keep = self._keep_unnamed
        return {out: i for i, node in enumerate(self.nodes) for out in node.output if out or keep}

    def producer_node(self, name: str) -> onnx.NodeProto | None:
        """The node making ``name``, or None (a graph input, an initializer, nothing)."""
        i = self.producer.get(name)
        return None if i is None else self.nodes[i]

    def output_of(self, i: int) -> str:
        return self.nodes[i].output[0]

    # -- readers --------------------------------------------------------------------------------

    @cached_property
    def readers(self) -> dict[str, list[onnx.NodeProto]]:
        """{value: the nodes taking it as an input, once per input slot}; bodies not looked into."""
        readers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.nodes:
            for name in node.input:
                if name:
                    readers.setdefault(name, []).append(node)
        return readers

    def value_readers(self, name: str) -> list[onnx.NodeProto]:
        return self.readers.get(name, [])

    @cached_property
    def reads(self) -> list[list[str]]:
        """What each node reads, once each, its subgraph bodies' outer reads included."""
        return [node_reads(node) for node in self.nodes]

    @cached_property
    def consumers(self) -> dict[str, list[int]]:
        """{value: the indices of the nodes that read it (:attr:`reads`)}."""
        consumers: dict[str, list[int]] = {}
        for i, names in enumerate(self.reads):
            for name in names:
                consumers.setdefault(name, []).append(i)
        return consumers

    # -- order and walks ------------------------------------------------------------------------

    @cached_property
    def order(self) -> list[int]:
        """The nodes in a stable topological order (Kahn's algorithm, lowest index first: the graph's
        own order when it is already topological). GraphcalError for a cycle."""
        pending = [0] * len(self.nodes)
        users: list[list[int]] = [[] for _ in self.nodes]
        producer = self.producer
        for i, names in enumerate(self.reads):
            deps = {producer[n] for n in names if n in producer}
            pending[i] = len(deps)
            for d in deps:
                users[d].append(i)
        ready = [i for i, n in enumerate(pending) if n == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for u in users[i]:
                pending[u] -= 1
                if pending[u] == 0:
                    heapq.heappush(ready, u)
        if len(order) != len(self.nodes):
            raise GraphcalError("the graph has a cycle; an ONNX graph must be acyclic")
        return order

    @cached_property
    def position(self) -> dict[int, int]:
        """{node index: its place in :attr:`order`}."""
        return {i: p for p, i in enumerate(self.order)}

    def descendants(self, tensors: Iterable[str], through_shapes: bool = True) -> set[str]:
        """``tensors`` and every tensor computed from them (without ``through_shapes``, a
        ``Shape``/``Size`` node does not pass dependence on)."""
        found = set(tensors)
        stack = list(found)
        while stack:
            for c in self.consumers.get(stack.pop(), ()):
                node = self.nodes[c]
                if not through_shapes and node.op_type in SHAPE_OPS and node.domain in ("", "ai.onnx"):
                    continue
                for out in node.output:
                    if out and out not in found:
                        found.add(out)
                        stack.append(out)
        return found

    def ancestors(self, tensors: Iterable[str], done: set[int]) -> set[int]:
        """The nodes not in ``done`` that ``tensors`` are computed from (their producers
        included); added to ``done`` and returned."""
        new: set[int] = set()
        stack = list(tensors)
        while stack:
            p = self.producer.get(stack.pop())
            if p is None or p in done:
                continue
            done.add(p)
            new.add(p)
            stack.extend(self.reads[p])
        return new

    def walk(self, wanted: Iterable[str], stop: set[str]) -> tuple[set[int], set[str], set[str], set[str]]:
        """Back from ``wanted`` to ``stop`` tensors, graph inputs and initializers: (nodes met,
        graph inputs reached, initializers reached, stop tensors reached)."""
        nodes: set[int] = set()
        inputs: set[str] = set()
        inits: set[str] = set()
        stops: set[str] = set()
        seen: set[str] = set()
        stack = list(wanted)
        while stack:
            t = stack.pop()
            if t in seen:
                continue
            seen.add(t)
            if t in stop:
                stops.add(t)
            elif t in self.graph_input_set:
                inputs.add(t)
            elif t in self.producer:
                p = self.producer[t]
                if p not in nodes:
                    nodes.add(p)
                    stack.extend(self.reads[p])
            elif t in self.constants:
                inits.add(t)
            else:
                raise GraphcalError(f"no tensor {t!r} in the graph")
        return nodes, inputs, inits, stops
