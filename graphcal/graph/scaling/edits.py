"""The edits channel scaling writes into a model: constants divided, explicit Muls, float weights
replaced, and the tap-side Muls of the calibration pass."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphcal.graph.edit import Names, add_initializer, drop_dead_paths, place_after_producers
from graphcal.graph.scaling.find import node_module
from graphcal.graph.scaling.records import TAP_PREFIX, Mapping, Param
from graphcal.graph.values import ValueIndex
from graphcal.types import Target


def divide_params(model: onnx.ModelProto, params: list[Param], scales: dict[Param, np.ndarray],
                  base_dir: str | None = None) -> None:
    """Point each param's node at a new initializer holding its constant divided by the scales
    (``scales[param]``, one per channel); the old constant stays for its other readers."""
    index = ValueIndex(model, base_dir)
    names = Names({t.name for t in model.graph.initializer} | {o for n in model.graph.node for o in n.output})
    old = set()
    for p in params:
        node = index.nodes[index.producer[p.node]]
        value = index.const(node.input[p.index])
        s = scales[p]
        wide = np.result_type(value.dtype, s.dtype)  # as torch divides: in the wider type, stored in the constant's
        divided = (value.astype(wide) / s.astype(wide)).astype(value.dtype)  # a scalar becomes one per channel
        if value.size > 1:
            divided = divided.reshape(value.shape)
        name = add_initializer(model.graph.initializer, names, f"{node_module(node)}.smoothed_{p.index}",
                               np.ascontiguousarray(divided))
        old.add(node.input[p.index])
        node.input[p.index] = name
    drop_dead_paths(model.graph, old)  # a constant nothing else reads goes


def explicit_mul(model: onnx.ModelProto, mapping: Mapping, inverse: np.ndarray, target_nodes: set[str]) -> None:
    """Put ``Mul(x, inverse)`` in front of the mapping's balance targets (their input 0 rewired)."""
    x = mapping.candidate.activation
    names = Names({t.name for t in model.graph.initializer} | {n.name for n in model.graph.node})
    const = add_initializer(model.graph.initializer, names, f"{TAP_PREFIX}{x}/inverse_scale", np.ascontiguousarray(inverse))
    mul = helper.make_node("Mul", [x, const], [mapping.tapped], name=names.unique(f"{TAP_PREFIX}{x}/Mul"))
    for n in model.graph.node:
        if n.name in target_nodes and n.input[0] == x:
            n.input[0] = mapping.tapped
    place_after_producers(model.graph, {x: [mul]})  # right after x's producer


def replace_weight(model: onnx.ModelProto, target: Target, weight: np.ndarray, base_dir: str | None = None) -> None:
    """Point ``target``'s B input at a new initializer holding ``weight`` (torch [out, in]) as the
    node consumes it; its old weight path stays for other readers (a tied embedding) or goes."""
    graph = model.graph
    node = next(n for n in graph.node if n.name == target.node)
    consumed = weight.T if target.layout == "in_out" else weight
    names = Names({t.name for t in graph.initializer} | {o for n in graph.node for o in n.output})
    name = add_initializer(graph.initializer, names, f"{target.name}.weight.smoothed", np.ascontiguousarray(consumed))
    old = node.input[1]
    node.input[1] = name
    drop_dead_paths(graph, {old, target.weight})


def tap_nodes(mappings: list[Mapping], inverses: dict[str, np.ndarray]) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """For a tapped copy of the unsmoothed model: ``Mul(x, 1/s)`` per mapping, named as the
    smoothed activation, so observers see what the smoothed model's balance targets read."""
    nodes, inits = [], []
    for m in mappings:
        x = m.candidate.activation
        const = f"{TAP_PREFIX}{x}/inverse_scale"
        inits.append(numpy_helper.from_array(np.ascontiguousarray(inverses[x]), const))
        nodes.append(helper.make_node("Mul", [x, const], [m.tapped], name=f"{TAP_PREFIX}{x}/Mul"))
    return nodes, inits


