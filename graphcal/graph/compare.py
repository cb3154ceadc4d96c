"""Two models in one graph, compared in the graph: what graphcal eval runs on onnxruntime.

The fp32 model and its quantized form share the graph's inputs; for each pair of tensors to
compare (an output, a layer's output) the graph reduces their agreement to six float64 scalars:
sum of ref², sum of cand², sum of ref·cand, sum of (cand − ref)², max |cand − ref| and max |ref|.
So no layer's activation leaves onnxruntime, and memory stays what running the two models takes,
whatever the number of layers (a 30-layer decoder's every MatMul output, fetched for both models,
took 14 GB).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from graphcal.graph.io import default_opset

PREFIX = "graphcal-quantized/"
SUMS = ("ref_sq", "cand_sq", "dot", "err_sq", "max_abs_err", "max_abs_ref")


def paired_model(reference: onnx.ModelProto, candidate: onnx.ModelProto, pairs: list[str]
                 ) -> tuple[onnx.ModelProto, list[tuple[str, onnx.TensorProto]], dict[str, tuple[str, ...]]]:
    """One weightless graph running both models (their inputs shared) whose outputs are the
    agreement sums of each tensor of ``pairs`` (its name in both models); the weights it reads, as
    (name in the graph, the models' own initializer), for ``runtime.open_runtime``'s
    ``renamed_weights``; and {tensor: six output names, in SUMS order}. ``reference`` is raised to
    the candidate's opset in place if below it; no weight is copied."""
    from onnx.compose import add_prefix

    from graphcal.graph.io import hollow_copy

    opset = max(default_opset(reference), default_opset(candidate))
    if default_opset(reference) < opset:
        from graphcal.graph.qdq.opset import upgrade_opset

        reference = upgrade_opset(reference, opset)
    cand = hollow_copy(candidate)  # its initializers as dims-only stubs, so add_prefix renames their readers
    cand.graph.initializer.extend(onnx.TensorProto(name=t.name, dims=t.dims, data_type=t.data_type)
                                  for t in candidate.graph.initializer)
    add_prefix(cand, PREFIX, inplace=True)
    weights = [(t.name, t) for t in reference.graph.initializer]
    weights += [(PREFIX + t.name, t) for t in candidate.graph.initializer]
    model = onnx.ModelProto()
    model.ir_version = max(reference.ir_version, candidate.ir_version)
    domains: dict[str, int] = {}
    for m in (reference, candidate):
        for o in m.opset_import:
            domains[o.domain] = max(domains.get(o.domain, 0), o.version)
    model.opset_import.extend(helper.make_opsetid(d, v) for d, v in domains.items())
    model.functions.extend(reference.functions)
    model.functions.extend(cand.functions)
    graph = model.graph
    graph.name = "graphcal-eval"
    weight_names = {t.name for t in reference.graph.initializer}  # an initializer may be listed as an input too
    graph.input.extend(i for i in reference.graph.input if i.name not in weight_names)
    ref_nodes, cand_nodes = list(reference.graph.node), list(cand.graph.node)
    ref_at = {o: i for i, n in enumerate(ref_nodes) for o in n.output}
    cand_at = {o: i for i, n in enumerate(cand_nodes) for o in n.output}
    order: list[onnx.NodeProto] = [helper.make_node("Identity", [i.name], [PREFIX + i.name],
                                                    name=f"{PREFIX}input/{i.name}") for i in graph.input]
    done = {"ref": 0, "cand": 0}

    def advance(nodes: list, key: str, upto: int) -> None:
        """Emit ``nodes`` (one model's, in its own order) up to index ``upto``."""
        if upto >= done[key]:
            order.extend(nodes[done[key]:upto + 1])
            done[key] = upto + 1

    out: dict[str, tuple[str, ...]] = {}
    # The two graphs interleaved, pair by pair: each model runs up to the pair's tensor, the pair is
    # reduced, and the fp32 value can go before the next pair (else every fp32 layer output would
    # wait, alive, for the quantized model to reach it).
    for i, name in enumerate(sorted(dict.fromkeys(pairs), key=lambda n: (ref_at.get(n, -1), cand_at.get(PREFIX + n, -1)))):
        advance(ref_nodes, "ref", ref_at.get(name, -1))
        advance(cand_nodes, "cand", cand_at.get(PREFIX + name, -1))
        base = f"graphcal-compare/{i}"

        def op(kind: str, inputs: list[str], label: str, **attrs) -> str:
            output = f"{base}/{label}"
            order.append(helper.make_node(kind, inputs, [output], name=output, **attrs))
            return output

        ref = op("Cast", [name], "ref", to=TensorProto.DOUBLE)
        cand_value = op("Cast", [PREFIX + name], "cand", to=TensorProto.DOUBLE)
        err = op("Sub", [cand_value, ref], "err")
        sums = (op("ReduceSum", [op("Mul", [ref, ref], "ref2")], "ref_sq", keepdims=0),
                op("ReduceSum", [op("Mul", [cand_value, cand_value], "cand2")], "cand_sq", keepdims=0),
                op("ReduceSum", [op("Mul", [ref, cand_value], "refcand")], "dot", keepdims=0),
                op("ReduceSum", [op("Mul", [err, err], "err2")], "err_sq", keepdims=0),
                op("ReduceMax", [op("Abs", [err], "abs_err")], "max_abs_err", keepdims=0),
                op("ReduceMax", [op("Abs", [ref], "abs_ref")], "max_abs_ref", keepdims=0))
        graph.output.extend(helper.make_tensor_value_info(s, TensorProto.DOUBLE, []) for s in sums)
        out[name] = sums
    advance(ref_nodes, "ref", len(ref_nodes) - 1)
    advance(cand_nodes, "cand", len(cand_nodes) - 1)
    graph.node.extend(order)
    return model, weights, out
