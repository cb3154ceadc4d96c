"""A tapped copy of the model: chosen intermediate tensors become extra graph outputs.

One forward pass per batch then yields every tap at once (onnxruntime runs the whole graph on
every ``run``, whatever is fetched). The input model is never modified.

The calibration pass asks for taps with typed :class:`TapRequest` records: a tensor fetched
whole, or only its batch extrema, reduced in the graph over what a :class:`Reduction` says.
:func:`build_tapped` builds the tapped graph on a weightless copy of the model (its nodes,
inputs and outputs; no initializer is copied): the session gets the weights from the model
itself (:func:`graphcal.runtime.open_runtime`'s ``weights``).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from graphcal.errors import GraphcalError
from graphcal.graph.check import node_reads
from graphcal.graph.edit import Names, add_initializer, place_after_producers
from graphcal.graph.io import hollow_copy, value_types


class Reduction(enum.Enum):
    """What leaves onnxruntime for a tapped tensor."""

    WHOLE = "whole"  # the tensor itself
    ALL = "all"  # min / max over every element                      (tensor strategy)
    GROUP = "group"  # x as [-1, groups, group_size], over dims 0, 2 -> groups   (group / tensor_group)
    HEAD = "head"  # x [batch, heads, seq, dim], over dims 0, 2, 3 -> heads   (attn_head)
    CHANNEL = "channel"  # x as [-1, channels], over dim 0 -> channels   (SmoothQuant's ranges; 7x faster
    #                      in onnxruntime than GROUP with groups of 1)
    GRAM = "gram"  # x as [-1, channels] -> x^T x [channels, channels], and x's shape   (GPTQ's Hessians)


@dataclass(frozen=True)
class TapRequest:
    """One tapped tensor and its reduction (``groups``/``group_size`` for GROUP; ``groups``: the
    channels for CHANNEL)."""

    tensor: str
    reduction: Reduction = Reduction.WHOLE
    groups: int = 0
    group_size: int = 0

    @property
    def label(self) -> str:
        return "_".join(map(str, (self.reduction.value, self.groups, self.group_size) if self.groups else
                            (self.reduction.value,)))


@dataclass(frozen=True)
class TappedGraph:
    """A weightless tapped graph and where each request's values come out.

    ``outputs[request]`` is ``(tensor,)`` for WHOLE, ``(*gram blocks, shape)`` for GRAM (:func:`gram`
    puts them together) and ``(min, max)`` otherwise; ``finite[tensor]``
    is the finiteness probe of a reduced tensor (0, or NaN if any element is NaN or infinite);
    ``shapes[tensor]`` is the shape output of a tensor ``build_tapped``'s ``shapes`` names, an
    output that ``fetch`` leaves out: a run fetches it to learn a tap's size without the tap.
    """

    model: onnx.ModelProto
    fetch: list[str]
    outputs: dict[TapRequest, tuple[str, ...]]
    finite: dict[str, str]
    shapes: dict[str, str] = field(default_factory=dict)


def build_tapped(model: onnx.ModelProto, requests: list[TapRequest], types: dict | None = None,
                 prelude: tuple[list, list] = ((), ()), shapes: Sequence[str] = (),
                 keep_outputs: bool = True) -> TappedGraph:
    """The tapped graph for ``requests`` on a weightless copy of ``model`` (``model`` is untouched).

    The copy keeps only the constants the reductions add; every name in ``model`` stays reserved,
    so its initializers can be handed to the session beside the copy. ``prelude`` (nodes, their
    constants) adds tensors that are not in ``model`` to tap, each node right after the producer of
    its first input and typed like it (SmoothQuant's smoothed activations ``x * (1/s)``). ``shapes``:
    tensors whose shape alone comes out (``TappedGraph.shapes``), the tensors themselves not.

    Without ``keep_outputs`` the copy's outputs are the taps alone. Either way it keeps only the
    nodes its outputs need: onnxruntime runs every node of a graph whatever a run fetches, and
    keeps every graph output alive until the run ends, fetched or not (the model's logits, say).
    """
    types = value_types(model) if types is None else types
    hollow = hollow_copy(model)  # nodes, inputs, outputs: no initializer is copied
    reserved = {t.name for t in model.graph.initializer}
    if not keep_outputs:
        del hollow.graph.output[:]  # the taps are the outputs
        # weights some exporters also list as graph inputs (keep_initializers_as_inputs) are handed
        # over with the model's other weights, not fed
        inputs = [i for i in hollow.graph.input if i.name not in reserved]
        del hollow.graph.input[:]
        hollow.graph.input.extend(inputs)
    nodes, inits = prelude
    if nodes:
        hollow.graph.initializer.extend(inits)
        types = dict(types)
        for n in nodes:
            if n.input[0] in types:
                types[n.output[0]] = types[n.input[0]]
        place_after_producers(hollow.graph, {n.input[0]: [n] for n in nodes})
    whole = [r.tensor for r in requests if r.reduction is Reduction.WHOLE]
    reduced = [r for r in requests if r.reduction is not Reduction.WHOLE]
    _, fetch = _add_outputs(hollow, whole, types, reserved)
    found = _reduce(hollow, reduced, types, reserved)
    outputs = {r: (r.tensor,) for r in requests if r.reduction is Reduction.WHOLE}
    outputs.update({r: found[r] for r in reduced})
    finite = {key[0]: probe for key, probe in found.items() if isinstance(key, tuple)}
    fetch += [name for r in reduced for name in found[r]] + list(finite.values())
    probes = _shape_probes(hollow, list(shapes), reserved)
    _prune(hollow.graph)
    return TappedGraph(hollow, list(dict.fromkeys(fetch)), outputs, finite, probes)


def _prune(graph: onnx.GraphProto) -> None:
    """Drop (in place) the nodes no graph output needs, walking back from the outputs."""
    needed = {o.name for o in graph.output}
    kept = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(node_reads(node))
    if len(kept) != len(graph.node):
        del graph.node[:]
        graph.node.extend(reversed(kept))


def _shape_probes(model: onnx.ModelProto, tensors: list[str], reserved: set[str]) -> dict[str, str]:
    """A Shape output for each of ``tensors`` (in place: the weightless tapped copy), placed right
    after the tensor's producer so that it keeps no activation alive longer; {tensor: shape output}."""
    graph = model.graph
    names = Names({n.name for n in graph.node} | {o for n in graph.node for o in n.output} | {
        i.name for i in graph.input} | {t.name for t in graph.initializer} | reserved)
    probes, added = {}, {}
    for tensor in dict.fromkeys(tensors):
        name = names.unique(f"{TAP_PREFIX}{tensor}/shape")
        added[tensor] = [onnx.helper.make_node("Shape", [tensor], [name], name=name)]
        graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.INT64, None))
        probes[tensor] = name
    place_after_producers(graph, added)
    return probes


def add_taps(model: onnx.ModelProto, tensors: list[str], types: dict | None = None) -> tuple[onnx.ModelProto, list[str]]:
    """Return (a tapped copy of ``model``, output names to fetch); ``tensors`` are names of graph
    values. ``types`` is :func:`graphcal.graph.io.value_types` of the model when the caller has it."""
    tapped = onnx.ModelProto()
    tapped.CopyFrom(model)
    return _add_outputs(tapped, tensors, types, set())


def _add_outputs(tapped: onnx.ModelProto, tensors: list[str], types: dict | None,
                 extra_known: set[str]) -> tuple[onnx.ModelProto, list[str]]:
    graph = tapped.graph
    existing = {o.name for o in graph.output}
    known = {o for n in graph.node for o in n.output} | {i.name for i in graph.input} | {
        t.name for t in graph.initializer} | extra_known
    types = _elem_types(tapped, types)
    fetch: list[str] = []
    for name in dict.fromkeys(tensors):  # dedupe, keep order
        if name not in known:
            raise GraphcalError(f"cannot tap {name!r}: no such tensor in the graph")
        if name not in existing:
            elem = types.get(name, onnx.TensorProto.FLOAT)
            graph.output.append(onnx.helper.make_tensor_value_info(name, elem, None))
            existing.add(name)
        fetch.append(name)
    return tapped, fetch


def _elem_types(model: onnx.ModelProto, types: dict | None = None) -> dict[str, int]:
    """Element types of graph values (shape inference on a hollow copy where not given)."""
    types = value_types(model) if types is None else types
    return {name: t.elem_type for name, t in types.items() if t.elem_type}


TAP_PREFIX = "graphcal_tap/"  # names of the reduction nodes and their constants
GRAM_CHUNK = 128  # x^T x of more columns than this is computed in blocks, the upper triangle only
GRAM_CHUNKS = 8  # at most: (k + 1) / 2k of the work (9/16 for 8)


def gram_chunks(columns: int) -> list[tuple[int, int]]:
    """The column ranges a GRAM reduction splits ``columns`` into (one range up to 2 * GRAM_CHUNK; at
    most GRAM_CHUNKS, each at least GRAM_CHUNK wide)."""
    k = 1 if columns < 2 * GRAM_CHUNK else min(GRAM_CHUNKS, columns // GRAM_CHUNK)
    edges = [round(i * columns / k) for i in range(k + 1)]
    return list(zip(edges[:-1], edges[1:]))


def gram(values: list, columns: int) -> tuple:
    """(x^T x, the number of sequences) from a GRAM request's outputs (``outputs[request]``'s values):
    the upper blocks placed, the lower ones mirrored; sequences: x's first dim, 1 for a 2-D x."""
    import torch  # lazy: keeps graphcal --help fast

    *blocks, dims = values
    bounds = gram_chunks(columns)
    sequences = int(dims[0]) if dims.numel() >= 3 else 1
    if len(bounds) == 1:
        return blocks[0], sequences
    full = torch.empty((columns, columns), dtype=blocks[0].dtype, device=blocks[0].device)
    it = iter(blocks)
    for i, (a, b) in enumerate(bounds):
        for c, d in bounds[i:]:
            block = next(it)
            full[a:b, c:d] = block
            if (c, d) != (a, b):
                full[c:d, a:b] = block.T
    return full, sequences


# -- in-graph reductions ------------------------------------------------------------------------
#
# For min/max observers only the batch extrema matter, so the tapped graph computes them and
# only a few numbers leave onnxruntime (see Reduction). Each reduced tensor also gets a
# finiteness probe, ReduceSum(x * 0): 0, or NaN if any element is NaN or infinite (ReduceMin/Max
# need not propagate NaN). The nodes are placed right after the tensor's producer, so
# onnxruntime frees each activation as early as it would anyway.


def _reduce(model: onnx.ModelProto, requests: list[TapRequest], types: dict,
            reserved: set[str]) -> dict:
    """Add ReduceMin/ReduceMax outputs to ``model`` (in place: the weightless tapped copy) for each
    request; returns {request: (min output, max output)} and, under (tensor, "finite"), the probe."""
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    known = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    types = _elem_types(model, types)
    names = Names({n.name for n in graph.node} | {o for n in graph.node for o in n.output} | {
        t.name for t in graph.initializer} | reserved)
    unique = names.unique
    out: dict = {}

    def const(base: str, array) -> str:
        return add_initializer(graph.initializer, names, base, np.asarray(array))

    added: dict[str, list] = {}  # tapped tensor -> its reduction nodes, placed after its producer
    current: list = []

    def node(op: str, inputs: list[str], base: str, **attrs) -> str:
        output = unique(base)
        current.append(helper.make_node(op, inputs, [output], name=unique(f"{base}/{op}"), **attrs))
        return output

    def reduce(op: str, x: str, axes: list[int] | None, base: str) -> str:
        if axes is None:
            return node(op, [x], base, keepdims=0)
        if opset >= 18 or op == "ReduceSum":
            return node(op, [x, const(f"{base}/axes", np.array(axes, dtype=np.int64))], base, keepdims=0)
        return node(op, [x], base, axes=axes, keepdims=0)

    def expose(name: str, elem: int) -> None:
        graph.output.append(helper.make_tensor_value_info(name, elem, None))

    for request in dict.fromkeys(requests):
        tensor = request.tensor
        if tensor not in known:
            raise GraphcalError(f"cannot tap {tensor!r}: no such tensor in the graph")
        elem = types.get(tensor, onnx.TensorProto.FLOAT)
        base = f"{TAP_PREFIX}{tensor}"
        current = added.setdefault(tensor, [])
        if (tensor, "finite") not in out:
            zero = const(f"{base}/zero", np.array(0, dtype=helper.tensor_dtype_to_np_dtype(elem)))
            probe = reduce("ReduceSum", node("Mul", [tensor, zero], f"{base}/times_zero"), None, f"{base}/finite")
            expose(probe, elem)
            out[tensor, "finite"] = probe
        x, axes = tensor, None
        if request.reduction is Reduction.GRAM:
            shape = np.array([-1, request.groups], dtype=np.int64)
            rows = node("Reshape", [tensor, const(f"{base}/rows", shape)], f"{base}/rows")
            if elem != onnx.TensorProto.FLOAT:  # the Hessian is summed in fp32, as llm-compressor sums it
                rows = node("Cast", [rows], f"{base}/rows_fp32", to=onnx.TensorProto.FLOAT)
            # x^T x is symmetric: with the columns in k chunks only the k(k+1)/2 blocks on and above
            # the diagonal are computed ((k + 1) / 2k of the work); gram() mirrors the rest
            bounds = gram_chunks(request.groups)
            chunks = [rows] if len(bounds) == 1 else [
                node("Slice", [rows, const(f"{base}/start{a}", np.array([a], dtype=np.int64)),
                               const(f"{base}/end{a}", np.array([b], dtype=np.int64)),
                               const(f"{base}/axis{a}", np.array([1], dtype=np.int64))], f"{base}/chunk{a}")
                for a, b in bounds]
            transposed = [node("Transpose", [c], f"{base}/columns", perm=[1, 0]) for c in chunks]
            blocks = []
            for i in range(len(chunks)):
                for j in range(i, len(chunks)):
                    blocks.append(node("MatMul", [transposed[i], chunks[j]], f"{base}/gram{i}_{j}"))
                    expose(blocks[-1], onnx.TensorProto.FLOAT)
            dims = node("Shape", [tensor], f"{base}/shape")
            expose(dims, onnx.TensorProto.INT64)
            out[request] = (*blocks, dims)
            continue
        if request.reduction is Reduction.GROUP:
            shape = np.array([-1, request.groups, request.group_size], dtype=np.int64)
            x = node("Reshape", [tensor, const(f"{base}/groups", shape)], f"{base}/grouped")
            axes = [0, 2]
        elif request.reduction is Reduction.CHANNEL:
            shape = np.array([-1, request.groups], dtype=np.int64)
            x = node("Reshape", [tensor, const(f"{base}/channels", shape)], f"{base}/channels")
            axes = [0]
        elif request.reduction is Reduction.HEAD:
            axes = [0, 2, 3]
        lo = reduce("ReduceMin", x, axes, f"{base}/min_{request.label}")
        hi = reduce("ReduceMax", x, axes, f"{base}/max_{request.label}")
        expose(lo, elem)
        expose(hi, elem)
        out[request] = (lo, hi)
    if added:
        place_after_producers(graph, added)
    return out


def tap_bytes(model: onnx.ModelProto, tensors: Sequence[str], input_shapes: dict[str, tuple[int, ...]],
              prelude_nodes: Sequence[onnx.NodeProto] = ()) -> dict[str, int | None]:
    """The bytes of each of ``tensors`` in a batch whose graph inputs have ``input_shapes``: onnx
    shape inference on a weightless copy with those dims fixed, propagating values through the
    Shape -> Gather -> Concat -> Reshape chains exporters write. None where it cannot tell. A
    ``prelude_nodes`` output (``x * (1/s)``) has its input's shape."""
    hollow = hollow_copy(model)
    del hollow.graph.value_info[:]  # inferred again from the fixed dims, not merged with symbolic ones
    for t in model.graph.initializer:
        hollow.graph.initializer.append(onnx.TensorProto(name=t.name, dims=t.dims, data_type=t.data_type))
    for value in hollow.graph.input:
        shape, dims = input_shapes.get(value.name), value.type.tensor_type.shape.dim
        if shape is not None and len(dims) == len(shape):
            for d, n in zip(dims, shape):
                d.ClearField("dim_param")
                d.dim_value = int(n)
    try:
        inferred = onnx.shape_inference.infer_shapes(hollow, data_prop=True).graph
        known = {v.name: v.type.tensor_type for v in (*inferred.value_info, *inferred.input, *inferred.output)}
    except Exception:  # noqa: BLE001 -- best effort: the caller measures what this cannot tell
        known = {}
    source = {n.output[0]: n.input[0] for n in prelude_nodes}
    out: dict[str, int | None] = {}
    for name in tensors:
        t = known.get(source.get(name, name))
        dims = list(t.shape.dim) if t is not None and t.HasField("shape") else None
        if dims is None or not t.elem_type or any(not d.HasField("dim_value") for d in dims):
            out[name] = None
            continue
        out[name] = math.prod(d.dim_value for d in dims) * itemsize(t.elem_type)
    return out


def itemsize(elem_type: int) -> int:
    """Bytes per element of an onnx element type as numpy holds it (fp32's 4 where it is unknown)."""
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(elem_type).itemsize if elem_type else 4
    except (KeyError, TypeError, ValueError):
        return 4
