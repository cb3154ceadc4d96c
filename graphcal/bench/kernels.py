"""The kernel onnxruntime really runs for every weight MatMul/Gemm: read from the optimized graph it writes
(``optimized_model_filepath``) and, for the execution provider, from its profile of one run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from graphcal.bench.report import Layer
from graphcal.bench.session import options
from graphcal.errors import GraphcalError, first_line

# Kernels that compute in integers (the activations quantized, by a node or inside the kernel).
INTEGER_KERNELS = frozenset({"MatMulIntegerToFloat", "QLinearMatMul", "DynamicQuantizeMatMul", "QGemm", "MatMulInteger"})
FLOAT_KERNELS = frozenset({"MatMul", "FusedMatMul", "Gemm", "FusedGemm"})
# Ops that may sit between a weight and the B input of a float MatMul in the optimized graph.
_WEIGHT_PATH = frozenset({"DequantizeLinear", "Cast", "Mul", "Div", "Transpose", "Reshape", "Identity", "Unsqueeze",
                          "Squeeze", "Flatten"})
_DEQUANTIZING = frozenset({"DequantizeLinear", "Cast", "Mul", "Div"})  # the weight is stored in another type
DEQUANTIZED = "float (dequantized at run time)"
FOLDED = "float (weight folded to fp32 at load)"


def kernels(path: Path, targets, source_outputs: dict[str, str], providers: list[str], feeds: dict[str, np.ndarray],
            tmp: Path, label: str) -> list[Layer]:
    """The kernel behind every target in ``path`` as onnxruntime optimizes it (ORT_ENABLE_ALL on
    ``providers``), with the execution provider each ran on in one profiled run of ``feeds``.

    ``targets`` and ``source_outputs`` (node name -> first output) come from the reference graph;
    graphcal's quantizer keeps node names, so the same names are looked up in ``path``."""
    optimized = tmp / f"{label}.optimized.onnx"
    opts = options(optimized_model_filepath=str(optimized), enable_profiling=True,
                   profile_file_prefix=str(tmp / f"{label}-profile"))
    # the optimized copy keeps its weights in a file of its own (a graph over 2 GB could not be written)
    opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", optimized.name + ".data")
    try:
        session = ort.InferenceSession(str(path), opts, providers=providers)
    except Exception as e:  # noqa: BLE001 -- it loaded for timing: writing the optimized graph failed
        raise GraphcalError(f"{path}: onnxruntime could not write its optimized graph ({first_line(e)})") from None
    try:
        session.run(None, feeds)
    except Exception as e:  # noqa: BLE001
        raise GraphcalError(f"{path}: onnxruntime failed on the prefill batch: {first_line(e)}") from None
    profile = Path(session.end_profiling())
    del session
    try:
        events = json.loads(profile.read_text())
    finally:
        profile.unlink(missing_ok=True)
    ran_on = {}
    for event in events:
        name = event.get("name", "")
        if event.get("cat") == "Node" and name.endswith("_kernel_time"):
            ran_on[name[: -len("_kernel_time")]] = event.get("args", {}).get("provider")
    graph = onnx.load(str(optimized), load_external_data=False).graph
    return classify_layers(graph, targets, source_outputs, ran_on)


def classify_layers(graph: onnx.GraphProto, targets, source_outputs: dict[str, str],
                    ran_on: dict[str, str]) -> list[Layer]:
    """One Layer per target, found in the optimized ``graph`` by node name (or the names
    onnxruntime gives a node it rewrites: ``<name>_quant`` from quantize_dynamic, ``fused <name>``
    from a Gemm + activation fusion), else as the producer of the source node's output, else as a
    node onnxruntime named after it ("<name>/...Fusion/")."""
    by_name = {n.name: n for n in graph.node}
    producers = {out: n for n in graph.node for out in n.output}
    inits = {t.name for t in graph.initializer}
    layers = []
    for t in targets:
        node = next((by_name[n] for n in (t.node, f"{t.node}_quant", f"fused {t.node}") if n in by_name), None)
        node = node or producers.get(source_outputs.get(t.node, ""))
        if node is None:
            node = next((n for n in graph.node if t.node and n.name.startswith(t.node + "/")), None)
        if node is None:
            layers.append(Layer(t.name, t.node, "missing", "not found in the optimized graph"))
            continue
        layer = _classify(node, producers, inits)
        layer.module, layer.node = t.name, t.node
        layer.provider = ran_on.get(node.name)
        layers.append(layer)
    return layers


def _classify(node: onnx.NodeProto, producers: dict[str, onnx.NodeProto], inits: set[str]) -> Layer:
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    base = {"module": "", "node": "", "op_type": node.op_type, "domain": node.domain or "ai.onnx",
            "optimized_node": node.name}
    if node.op_type == "MatMulNBits":
        found = {k: int(attrs.get(k, 0)) for k in ("bits", "block_size", "accuracy_level")}
        return Layer(kind="matmulnbits", kernel=f"MatMulNBits {found['bits']}-bit acc{found['accuracy_level']}",
                     attributes=found, **base)
    if node.op_type in INTEGER_KERNELS:
        return Layer(kind="integer", kernel=node.op_type, **base)
    if node.op_type in FLOAT_KERNELS and len(node.input) > 1:
        weight = node.input[1]
        if weight in inits:
            return Layer(kind="float", kernel=FOLDED, weight_from="initializer", **base)
        ops, from_activation = _weight_path(weight, producers, inits)
        if from_activation:
            return Layer(kind="other", kernel=f"{node.op_type} (weight input is an activation)", **base)
        if _DEQUANTIZING & set(ops):
            return Layer(kind="dequantized", kernel=DEQUANTIZED, weight_from=" <- ".join(ops), **base)
        return Layer(kind="float", kernel=f"float (weight prepared at run time: {' <- '.join(ops)})",
                     weight_from=" <- ".join(ops), **base)
    return Layer(kind="other", kernel=node.op_type, **base)


def _weight_path(name: str, producers: dict[str, onnx.NodeProto], inits: set[str]) -> tuple[list[str], bool]:
    """The ops between initializers and ``name`` (nearest first), and whether anything else
    (a graph input, another op) feeds it: then it is not a weight computed from constants."""
    ops: list[str] = []
    stack, seen = [name], set()
    while stack:
        tensor = stack.pop()
        if tensor in seen or tensor in inits or tensor == "":
            continue
        seen.add(tensor)
        node = producers.get(tensor)
        if node is None or node.op_type not in _WEIGHT_PATH or len(ops) > 16:
            return ops, True
        ops.append(node.op_type)
        if node.op_type == "DequantizeLinear":
            continue  # its inputs are the stored weight and its scales
        stack.extend(node.input[:1] if node.op_type in ("Reshape", "Unsqueeze", "Squeeze") else node.input)
    return ops, False
