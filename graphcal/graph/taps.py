"""A tapped copy of the model: chosen intermediate tensors become extra graph outputs.

One forward pass per batch then yields every tap at once (onnxruntime runs the whole graph on
every ``run``, whatever is fetched). The input model is never modified.
"""

from __future__ import annotations

import onnx

from graphcal.errors import GraphcalError


def add_taps(model: onnx.ModelProto, tensors: list[str], types: dict | None = None,
             in_place: bool = False) -> tuple[onnx.ModelProto, list[str]]:
    """Return (tapped model, output names to fetch); ``tensors`` are names of graph values.

    A copy unless ``in_place`` (then undo with :func:`restore` after a :func:`mark`); ``types``
    is :func:`graphcal.graph.io.value_types` of the model when the caller has it.
    """
    if in_place:
        tapped = model
    else:
        tapped = onnx.ModelProto()
        tapped.CopyFrom(model)
    graph = tapped.graph
    existing = {o.name for o in graph.output}
    known = {o for n in graph.node for o in n.output} | {i.name for i in graph.input} | {
        t.name for t in graph.initializer
    }
    types = _elem_types(model, types)
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
    from graphcal.graph.io import value_types

    types = value_types(model) if types is None else types
    return {name: t.elem_type for name, t in types.items() if t.elem_type}


TAP_PREFIX = "graphcal_tap/"  # names of the reduction nodes and their constants


def mark(model: onnx.ModelProto) -> tuple[int, int]:
    """How many outputs and initializers the graph has now (see :func:`restore`)."""
    g = model.graph
    return len(g.output), len(g.initializer)


def restore(model: onnx.ModelProto, marks: tuple[int, int]) -> None:
    """Drop the outputs, initializers and reduction nodes added since :func:`mark`."""
    g = model.graph
    del g.output[marks[0]:]
    del g.initializer[marks[1]:]
    keep = [n for n in g.node if not n.name.startswith(TAP_PREFIX)]
    if len(keep) != len(g.node):
        del g.node[:]
        g.node.extend(keep)


# -- in-graph reductions ------------------------------------------------------------------------
#
# For min/max observers only the batch extrema matter, so the tapped graph computes them and
# only a few numbers leave onnxruntime. ``mode`` says over what:
#   ("all",)           every element -> one min / max                 (tensor strategy)
#   ("group", g, gs)   x viewed as [-1, g, gs], over dims 0 and 2 -> g   (group / tensor_group)
#   ("head",)          x [batch, heads, seq, dim], over dims 0, 2, 3 -> heads   (attn_head)
# Each reduced tensor also gets a finiteness probe, ReduceSum(x * 0): 0, or NaN if any
# element is NaN or infinite (ReduceMin/Max need not propagate NaN). The nodes are placed right
# after the tensor's producer, so onnxruntime frees each activation as early as it would anyway.


def add_reductions(model: onnx.ModelProto, requests: list[tuple[str, tuple]],
                   types: dict | None = None) -> dict[tuple, tuple[str, str]]:
    """Add ReduceMin/ReduceMax outputs to ``model`` (in place; pass the tapped copy) for each
    (tensor, mode); returns {(tensor, mode): (min output, max output)} and, under (tensor, "finite"),
    the probe."""
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    known = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    types = _elem_types(model, types)
    names: set[str] = {n.name for n in graph.node} | {o for n in graph.node for o in n.output} | {
        t.name for t in graph.initializer}
    out: dict[tuple, tuple[str, ...]] = {}

    def unique(base: str) -> str:
        candidate, i = base, 1
        while candidate in names:
            candidate, i = f"{base}_{i}", i + 1
        names.add(candidate)
        return candidate

    def const(base: str, array) -> str:
        name = unique(base)
        graph.initializer.append(numpy_helper.from_array(np.asarray(array), name))
        return name

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

    for tensor, mode in dict.fromkeys(requests):
        if tensor not in known:
            raise GraphcalError(f"cannot tap {tensor!r}: no such tensor in the graph")
        elem = types.get(tensor, onnx.TensorProto.FLOAT)
        base = f"{TAP_PREFIX}{tensor}"
        current = added.setdefault(tensor, [])
        if (tensor, "finite") not in out:
            zero = const(f"{base}/zero", np.array(0, dtype=helper.tensor_dtype_to_np_dtype(elem)))
            probe = reduce("ReduceSum", node("Mul", [tensor, zero], f"{base}/times_zero"), None, f"{base}/finite")
            expose(probe, elem)
            out[tensor, "finite"] = (probe,)
        x, axes = tensor, None
        if mode[0] == "group":
            x = node("Reshape", [tensor, const(f"{base}/groups", np.array([-1, mode[1], mode[2]], dtype=np.int64))],
                     f"{base}/grouped")
            axes = [0, 2]
        elif mode[0] == "head":
            axes = [0, 2, 3]
        label = "_".join(map(str, mode))
        lo = reduce("ReduceMin", x, axes, f"{base}/min_{label}")
        hi = reduce("ReduceMax", x, axes, f"{base}/max_{label}")
        expose(lo, elem)
        expose(hi, elem)
        out[tensor, mode] = (lo, hi)
    if added:
        order = []
        for n in graph.node:
            order.append(n)
            for produced in n.output:
                order.extend(added.pop(produced, []))
        for nodes in added.values():  # graph inputs: at the front
            order[:0] = nodes
        del graph.node[:]
        graph.node.extend(order)
    return out
