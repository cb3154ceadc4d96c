"""The residual stream of a pre-norm decoder, and everything that writes and reads it: where a
rotation of the hidden dimension can be folded into weights without changing the model.

Starting from the embedding lookups, a value is *in the stream* when rotating it (``x -> x Q``,
Q orthogonal) can be undone by the weights alone. What may read a stream value:

- a weight MatMul/Gemm (a *reader*: its weight takes ``Q^T`` on its input side);
- an Add of two stream values, or of one and a *writer's* output (a weight MatMul, with or without
  a constant bias, or another lookup): the writer's weight takes ``Q`` on its output side, and its
  bias (Gemm's C, or a constant row added after a MatMul) takes it too; a Gemm writer whose C is
  not a constant row of the hidden width is refused;
- a weight both reading the stream and writing into it (``x + x W``) takes both: ``Qᵀ W Q``;
- an RMS norm: ``SimplifiedLayerNormalization``, ``RMSNormalization``, onnxruntime's
  ``SkipSimplifiedLayerNormalization`` (its sum output stays in the stream), or the decomposed form
  ``x * 1/sqrt(mean(x^2) + eps) * g``: ``mean(x^2)`` over the hidden axis is the same for ``x Q``,
  so the norm commutes with Q once its scale ``g`` is folded into the readers after it (their
  weights take ``diag(g)``, and ``g`` becomes ones);
- a Mul or Div by a per-row value computed from such means (the decomposed norm), a Mul by a scalar
  constant, a Cast.

Anything else reading the stream (a LayerNorm's mean, an activation, a graph output) is refused by
name: rotating there would change what the model computes. Only the main graph is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from graphcal.errors import GraphcalError
from graphcal.graph.index import SHAPE_OPS
from graphcal.graph.targets import find_lookups, find_targets
from graphcal.graph.values import ValueIndex
from graphcal.types import Target

_RMS_NORMS = {  # op type -> (scale input, outputs in the stream, outputs that are per-row statistics)
    "SimplifiedLayerNormalization": (1, (0,), (1,)),
    "RMSNormalization": (1, (0,), ()),
    "SkipSimplifiedLayerNormalization": (2, (0, 3), (1, 2)),
}
_INVARIANT_OPS = {"Add", "Sub", "Mul", "Div", "Sqrt", "Reciprocal", "Cast", "Pow", "Max", "Clip"}


@dataclass
class Reader:
    target: Target
    scale: tuple[str, int] | None = None  # (node, input index) of the norm scale folded into its weight


@dataclass
class Stream:
    """The residual stream and its weights (names of nodes and values of ``model``)."""

    hidden: int
    values: set[str] = field(default_factory=set)
    lookups: list[Target] = field(default_factory=list)  # tables writing into it: E -> E Q
    writers: list[Target] = field(default_factory=list)  # weights writing into it: W -> W Q (output side)
    readers: list[Reader] = field(default_factory=list)  # weights reading it: W -> Q^T diag(g) W (input side)
    biases: list[tuple[str, int]] = field(default_factory=list)  # constants added into it: b -> b Q
    scales: list[tuple[str, int]] = field(default_factory=list)  # norm scales folded away (set to ones)


def residual_stream(model: onnx.ModelProto, base_dir: str | None = None) -> Stream:
    """The stream of ``model``, or a one-line :class:`GraphcalError` saying what stops a rotation."""
    return _Walk(model, base_dir).run()


class _Walk:
    def __init__(self, model: onnx.ModelProto, base_dir: str | None):
        self.model = model
        self.index = ValueIndex(model, base_dir)  # the graph's index, with constants' values and values' types
        self.by_node = {t.node: t for t in find_targets(model)[0]}
        self.lookups = find_lookups(model)
        self.nodes = {n.name: n for n in model.graph.node}
        if len(self.nodes) != len(model.graph.node) or "" in self.nodes:
            raise GraphcalError("the graph has unnamed or repeated node names; rotation needs each node named once")
        if not self.lookups:
            raise GraphcalError("no embedding lookup (a Gather over a weight table) starts a residual stream to rotate")
        widths = {t.in_features for t in self.lookups}
        if len(widths) != 1:
            raise GraphcalError(f"the embedding lookups have different widths {sorted(widths)}")
        self.stream = Stream(widths.pop())
        self.invariant: set[str] = set()  # per-row statistics of the stream: the same for x Q
        self.squares: set[str] = set()  # x^2 of a stream value (its mean over the hidden axis is invariant)
        self.folded: dict[str, tuple[str, int]] = {}  # a norm's scaled output -> its scale (node, input)
        self.waiting: dict[str, str] = {}  # node -> the stream value it reads, its other input not known yet
        self.readers: dict[str, Target] = {}

    # -- what a value is ----------------------------------------------------------------------

    def const(self, name: str) -> np.ndarray | None:
        """A small constant's value (at most one row of the stream, maybe behind Identity), else None."""
        return self.index.const(name, max_elements=self.stream.hidden)

    def scalar(self, name: str) -> bool:
        value = self.const(name)
        return value is not None and value.size == 1

    def per_channel(self, name: str) -> bool:
        value = self.const(name)
        return value is not None and value.ndim >= 1 and value.size == self.stream.hidden == value.shape[-1]

    def last_axis(self, node: onnx.NodeProto) -> bool:
        """``node`` (a Reduce*) reduces the last axis only."""
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        axes = attrs.get("axes")
        if axes is None and len(node.input) > 1 and node.input[1]:
            value = self.const(node.input[1])
            axes = None if value is None else [int(v) for v in value.reshape(-1)]
        if axes is None or len(axes) != 1:
            return False
        if axes[0] == -1:
            return True
        known = self.index.types.get(node.input[0])  # shape inference, on first use: only for a positive axis
        return known is not None and known.shape is not None and len(known.shape) == axes[0] + 1

    def writer(self, name: str) -> bool:
        """``name`` is a weight's output added into the stream: record the weight (and its bias)."""
        node = self.index.producer_node(name)
        if node is None:
            return False
        t = self.by_node.get(node.name)
        if t is not None and node.output[0] == name and t.out_features == self.stream.hidden:
            if t not in self.stream.writers:
                self.stream.writers.append(t)
                if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:  # Gemm's bias C: b -> b Q too
                    if not self.per_channel(node.input[2]):
                        raise GraphcalError(f"Gemm {node.name} writes into the residual stream with a bias that is not "
                                            "a constant row of the hidden width; rotating it would change the model")
                    self.stream.biases.append((node.name, 2))
            return True
        lookup = next((x for x in self.lookups if x.node == node.name), None)
        if lookup is not None:
            if lookup not in self.stream.lookups:
                self.stream.lookups.append(lookup)
            return True
        if node.op_type == "Add" and len(node.input) == 2 and len(self.index.value_readers(name)) == 1:
            for k in (0, 1):
                if self.per_channel(node.input[k]) and self.writer(node.input[1 - k]):
                    self.stream.biases.append((node.name, k))
                    return True
        return False

    # -- one reader of a stream value -----------------------------------------------------------

    def read(self, node: onnx.NodeProto, value: str) -> list[str] | None:
        """The outputs ``node`` puts in the stream, reading stream ``value``; None while it waits on
        its other input; a refusal where it cannot be rotated."""
        op = node.op_type
        if op in SHAPE_OPS:
            return []
        t = self.by_node.get(node.name)
        if t is not None and node.input[0] == value:
            self.readers[node.name] = t
            return []
        if node.domain not in ("", "ai.onnx", "com.microsoft"):
            raise self.refuse(node, value)
        if op in _RMS_NORMS and (node.domain == "com.microsoft" or op != "SkipSimplifiedLayerNormalization"):
            return self.norm(node, value)
        if node.domain == "com.microsoft":
            raise self.refuse(node, value)
        if op == "Cast":
            return [node.output[0]]
        if op == "Add" and len(node.input) == 2:
            other = node.input[1] if node.input[0] == value else node.input[0]
            if other in self.stream.values or self.writer(other):
                return [node.output[0]]
            if self.per_channel(other):
                self.stream.biases.append((node.name, list(node.input).index(other)))
                return [node.output[0]]
            return None
        if op == "Pow" and node.input[0] == value and self.const(node.input[1]) is not None and float(
                self.const(node.input[1]).reshape(-1)[0]) == 2.0:
            self.squares.add(node.output[0])
            return []
        if op == "Mul" and len(node.input) == 2:
            other = node.input[1] if node.input[0] == value else node.input[0]
            if other in self.invariant or self.scalar(other):
                return [node.output[0]]
            if self.per_channel(other):
                self.folded[node.output[0]] = (node.name, list(node.input).index(other))
                return [node.output[0]]
            return None
        if op == "Div" and node.input[0] == value and node.input[1] != value:
            if node.input[1] in self.invariant or self.scalar(node.input[1]):
                return [node.output[0]]
            return None
        raise self.refuse(node, value)

    def norm(self, node: onnx.NodeProto, value: str) -> list[str] | None:
        scale, streamed, statistics = _RMS_NORMS[node.op_type]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("axis", -1) != -1:
            raise self.refuse(node, value, "it normalizes more than the last axis")
        if node.op_type == "SkipSimplifiedLayerNormalization":
            if value not in node.input[:2]:
                raise self.refuse(node, value)
            other = node.input[1] if node.input[0] == value else node.input[0]
            if other not in self.stream.values and not self.writer(other):
                return None
            if len(node.input) > 3 and node.input[3]:
                if not self.per_channel(node.input[3]):
                    raise self.refuse(node, value, "its bias is not a constant row")
                self.stream.biases.append((node.name, 3))
        elif node.input[0] != value:
            raise self.refuse(node, value)
        if not self.per_channel(node.input[scale]):
            raise self.refuse(node, value, "its scale is not a constant row")
        outs = [node.output[i] for i in streamed if i < len(node.output) and node.output[i]]
        self.folded[node.output[0]] = (node.name, scale)
        self.invariant.update(node.output[i] for i in statistics if i < len(node.output) and node.output[i])
        return outs

    def refuse(self, node: onnx.NodeProto, value: str, why: str = "") -> GraphcalError:
        return GraphcalError(f"{node.op_type} {node.name} reads the residual stream ({value!r})"
                             f"{': ' + why if why else ''}; rotating it would change the model")

    # -- the walk ---------------------------------------------------------------------------------

    def run(self) -> Stream:
        stream = self.stream
        work = []
        for t in self.lookups:
            out = self.nodes[t.node].output[0]
            stream.values.add(out)
            work.append(out)
            if t not in stream.lookups:
                stream.lookups.append(t)
        while True:
            while work:
                value = work.pop()
                if value in self.index.graph_output_set:
                    raise GraphcalError(f"the residual stream value {value!r} is a graph output; rotating it would "
                                        "change it")
                for node in self.index.value_readers(value):
                    outs = self.read(node, value)
                    if outs is None:
                        self.waiting[node.name] = value
                    else:
                        work += self.add(outs)
            self.grow_invariant()
            for name, value in list(self.waiting.items()):
                outs = self.read(self.nodes[name], value)
                if outs is not None:
                    del self.waiting[name]
                    work += self.add(outs)
            if not work:
                break
        if self.waiting:
            name, value = next(iter(self.waiting.items()))
            node = self.nodes[name]
            raise GraphcalError(f"{node.op_type} {name} reads the residual stream ({value!r}) with a value that is "
                                "neither in it, a weight's output nor a per-row statistic; rotating it would change "
                                "the model")
        for out in self.folded:  # a norm's scaled output reaches weights only: they take the scale
            for node in self.index.value_readers(out):
                if node.op_type in SHAPE_OPS:
                    continue
                if node.name not in self.readers or node.input[0] != out:
                    raise GraphcalError(f"{node.op_type} {node.name} reads the scaled norm output {out!r}; only weight "
                                        "MatMuls may, for the norm's scale to fold into them")
        stream.readers = [Reader(t, self.folded.get(self.nodes[t.node].input[0])) for t in self.readers.values()]
        stream.scales = sorted(set(self.folded.values()))
        return stream

    def add(self, outs: list[str]) -> list[str]:
        new = [o for o in outs if o not in self.stream.values]
        self.stream.values.update(new)
        return new

    def grow_invariant(self) -> None:
        """Per-row statistics: a mean (or sum) of squares over the hidden axis, and what is computed
        from such statistics and scalars alone."""
        grown = True
        while grown:
            grown = False
            for node in self.model.graph.node:
                if not node.output or node.output[0] in self.invariant:
                    continue
                ins = [i for i in node.input if i]
                if node.op_type in ("ReduceMean", "ReduceSum") and ins and ins[0] in self.squares:
                    if not self.last_axis(node):
                        raise GraphcalError(f"{node.op_type} {node.name} reduces the squared residual stream over "
                                            "another axis than the hidden one; rotating it would change the model")
                elif not (node.op_type in _INVARIANT_OPS and ins and any(i in self.invariant for i in ins)
                          and all(i in self.invariant or self.scalar(i) for i in ins)):
                    continue
                self.invariant.update(o for o in node.output if o)
                grown = True
        for sq in self.squares:  # x^2 feeds the statistic only
            for node in self.index.value_readers(sq):
                if node.op_type not in ("ReduceMean", "ReduceSum") and node.op_type not in SHAPE_OPS:
                    raise GraphcalError(f"{node.op_type} {node.name} reads the squared residual stream {sq!r}; "
                                        "rotating it would change the model")
