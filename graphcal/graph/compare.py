"""Two models in one graph, compared in the graph: what graphcal eval runs on onnxruntime.

The fp32 model and its quantized form share the graph's inputs; for each pair of tensors to
compare (an output, a layer's output) the graph reduces their agreement to six float64 scalars:
sum of ref², sum of cand², sum of ref·cand, sum of (cand − ref)², max |cand − ref| and max |ref|.
So no layer's activation leaves onnxruntime, and memory stays what running the two models takes,
whatever the number of layers (a 30-layer decoder's every MatMul output, fetched for both models,
took 14 GB).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.compose import add_prefix

from graphcal.graph.index import GraphIndex
from graphcal.graph.io import default_opset, hollow_copy

PREFIX = "graphcal-quantized/"
SUMS = ("ref_sq", "cand_sq", "dot", "err_sq", "max_abs_err", "max_abs_ref")
OUTPUT = "graphcal-compare/all"  # the graph's one output: SUMS of every pair, one after the other


def paired_model(reference: onnx.ModelProto, candidate: onnx.ModelProto, pairs: list[str], fetched: list[str] = ()
                 ) -> tuple[onnx.ModelProto, list[tuple[str, onnx.TensorProto]], dict[str, int]]:
    """One weightless graph running both models (their inputs shared) whose one output, ``OUTPUT``,
    holds the agreement sums of each tensor of ``pairs`` (its name in both models), six in SUMS
    order per tensor; the weights it reads, as (name in the graph, the models' own initializer),
    for ``runtime.open_runtime``'s ``renamed_weights``; and {tensor: where its six sums start}.
    ``fetched``: model outputs returned as they are instead, the reference's under its name and the
    candidate's under ``PREFIX + name`` (a large vocabulary's logits: six float64 sums in the graph
    would take three float64 copies of them). ``reference`` is raised to the candidate's opset in
    place if below it; no weight is copied."""
    opset = max(default_opset(reference), default_opset(candidate))
    if default_opset(reference) < opset:
        from graphcal.graph.qdq.opset import upgrade_opset  # lazy: the graph.qdq package loads torch

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
    ref_at = GraphIndex(reference.graph, keep_unnamed=True).producer  # {output: index of its node}
    cand_at = GraphIndex(cand.graph, keep_unnamed=True).producer
    order: list[onnx.NodeProto] = [helper.make_node("Identity", [i.name], [PREFIX + i.name],
                                                    name=f"{PREFIX}input/{i.name}") for i in graph.input]
    done = {"ref": 0, "cand": 0}

    def advance(nodes: list, key: str, upto: int) -> None:
        """Emit ``nodes`` (one model's, in its own order) up to index ``upto``."""
        if upto >= done[key]:
            order.extend(nodes[done[key]:upto + 1])
            done[key] = upto + 1

    out: dict[str, int] = {}
    accumulated, chain = None, []
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

        # Three temporaries of the tensor's size (float64 ref, cand, and their difference): the squares
        # are summed by ReduceSumSquare, the dot product is a [1, n] x [n, 1] MatMul and max |x| comes
        # from the max and min, so no other copy of a layer's output is made (each would be one more
        # arena block per pair)
        ref = op("Cast", [name], "ref", to=TensorProto.DOUBLE)
        cand_value = op("Cast", [PREFIX + name], "cand", to=TensorProto.DOUBLE)
        err = op("Sub", [cand_value, ref], "err")
        row = op("Reshape", [ref, "graphcal-compare/row"], "ref_row")
        column = op("Reshape", [cand_value, "graphcal-compare/column"], "cand_column")
        sums = (op("ReduceSumSquare", [ref], "ref_sq", keepdims=0),
                op("ReduceSumSquare", [cand_value], "cand_sq", keepdims=0),
                op("Reshape", [op("MatMul", [row, column], "refcand"), "graphcal-compare/scalar"], "dot"),
                op("ReduceSumSquare", [err], "err_sq", keepdims=0),
                _max_abs(op, err, "err"), _max_abs(op, ref, "ref"))
        vector = op("Concat", [op("Reshape", [x, "graphcal-compare/one"], f"{label}_1") for x, label in zip(sums, SUMS)],
                    "sums", axis=0)
        # placed at the end, below (see there)
        # (the first a one-input Concat: onnxruntime removes an Identity, which put pair 1 before pair 0)
        chain.append(helper.make_node("Concat", [vector] if accumulated is None else [vector, accumulated],
                                      [f"{base}/so_far"], name=f"{base}/so_far", axis=0))
        accumulated = f"{base}/so_far"
        out[name] = i
    advance(ref_nodes, "ref", len(ref_nodes) - 1)
    advance(cand_nodes, "cand", len(cand_nodes) - 1)
    out = {name: len(SUMS) * (len(out) - 1 - i) for name, i in out.items()}  # the last pair comes first
    # The order onnxruntime runs this graph in (its default: depth first back from the one output,
    # a node's inputs visited highest node index first) follows the accumulating Concats: placed
    # after every pair's nodes, each one's sums so far outrank its own pair's sums, so onnxruntime
    # runs the pairs in order: both models up to pair k, its sums, then on. With an output per
    # pair it ran a whole model first, every compared output alive until its pair (17.9 GB on a
    # 1.5B decoder against 8.4 GB for the two models' plain sessions); in priority order it
    # dequantized every weight up front.
    order.extend(chain)
    if accumulated is None:  # nothing compared in the graph (every pair fetched): no sums
        accumulated = "graphcal-compare/none"
        graph.initializer.append(numpy_helper.from_array(np.zeros(0, np.float64), accumulated))
    order.append(helper.make_node("Identity", [accumulated], [OUTPUT], name=OUTPUT))
    graph.output.append(helper.make_tensor_value_info(OUTPUT, TensorProto.DOUBLE, [len(SUMS) * len(out)]))
    ref_outputs = {o.name: o for o in reference.graph.output}
    for name in fetched:
        for prefix in ("", PREFIX):
            value = graph.output.add()
            value.CopyFrom(ref_outputs[name])
            value.name = prefix + name
    graph.node.extend(order)
    for label, shape in (("row", [1, -1]), ("column", [-1, 1]), ("scalar", []), ("one", [1])):
        graph.initializer.append(numpy_helper.from_array(np.array(shape, dtype=np.int64), f"graphcal-compare/{label}"))
    return model, weights, out


def _max_abs(op, x: str, label: str) -> str:
    """max |x| as max(max x, -min x): two reductions, no |x| tensor."""
    high = op("ReduceMax", [x], f"max_{label}", keepdims=0)
    low = op("Neg", [op("ReduceMin", [x], f"min_{label}", keepdims=0)], f"neg_min_{label}")
    return op("Max", [high, low], f"max_abs_{label}")
