"""Find the MatMul/Gemm nodes whose B input is a weight, and name them by torch module.

Forms handled (each seen from torch's exporters):

- legacy exporter, constant folding: ``MatMul(x, onnx::MatMul_702[in, out])`` named
  ``/model/layers.0/self_attn/q_proj/MatMul`` -> ``model.layers.0.self_attn.q_proj``, layout in_out;
- legacy exporter without folding: ``MatMul(x, Transpose(model...q_proj.weight[out, in]))``;
- dynamo exporter: ``node_linear_3``, module path only in the node's
  ``pkg.torch.onnx.name_scopes`` metadata;
- ``Gemm(x, W, b, transB=1)`` (2-D inputs, e.g. BERT's pooler), layout out_in;
- weights behind Cast (fp16 storage) or Reshape.

A MatMul whose B input comes from activations (attention scores) is not a target.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

import numpy as np
import onnx

from graphcal.errors import GraphcalError
from graphcal.graph.index import GraphIndex
from graphcal.graph.names import NameMatcher, check_pattern
from graphcal.graph.weight_path import consumed_shape, trace_weight, weight_as_consumed
from graphcal.types import Target

__all__ = ["EMBEDDING", "NAME_SCOPES_KEY", "Skipped", "find_lookups", "find_targets", "matches", "module_from_scopes", "module_name", "scoped_module",
           "select", "torch_weight", "weight_as_consumed", "weight_tensor"]

NAME_SCOPES_KEY = "pkg.torch.onnx.name_scopes"
# Node names from the legacy exporter end in the op, e.g. ".../q_proj/MatMul_1".
_LEGACY_OP_SUFFIX = re.compile(r"^(MatMul|Gemm)(_\d+)?$")
_LEGACY_GATHER_SUFFIX = re.compile(r"^(Gather)(_\d+)?$")
#: llm-compressor's class target for embedding tables (torch.nn.Embedding): every lookup
EMBEDDING = "Embedding"
_FLOAT_TABLES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


@dataclass(frozen=True)
class Skipped:
    """A MatMul/Gemm that is not a weight target, and why (for `inspect` and logs)."""

    node: str
    reason: str


def find_targets(model: onnx.ModelProto) -> tuple[list[Target], list[Skipped]]:
    """All weight MatMul/Gemm nodes of ``model``'s main graph, in graph order."""
    graph = model.graph
    values = GraphIndex(graph, keep_unnamed=True)
    inits = values.initializers
    targets: list[Target] = []
    skipped: list[Skipped] = []
    for index, node in enumerate(graph.node):
        if node.op_type not in ("MatMul", "Gemm") or node.domain not in ("", "ai.onnx"):
            continue
        label = node.name or f"{node.op_type}#{index}"
        source = trace_weight(values, node.input[1])
        if source is None:
            skipped.append(Skipped(label, "B input is an activation, not a weight"))
            continue
        init_name, path_nodes = source
        if inits[init_name].data_type == onnx.TensorProto.STRING:
            skipped.append(Skipped(label, f"weight {init_name!r} holds strings, not numbers"))
            continue
        path = [n.name for n in path_nodes]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Gemm" and attrs.get("transA", 0):
            skipped.append(Skipped(label, "Gemm with transA=1 is not supported"))
            continue
        shape = consumed_shape(inits[init_name], path_nodes, inits)
        if len(shape) != 2:
            skipped.append(Skipped(label, f"weight has rank {len(shape)}, expected 2"))
            continue
        layout = "out_in" if node.op_type == "Gemm" and attrs.get("transB", 0) else "in_out"
        out_f, in_f = (shape[1], shape[0]) if layout == "in_out" else shape
        targets.append(
            Target(
                name=module_name(node, init_name, index),
                node=node.name,
                op_type=node.op_type,
                activation=node.input[0],
                weight=init_name,
                weight_path=tuple(path),
                layout=layout,
                out_features=int(out_f),
                in_features=int(in_f),
            )
        )
    _check_unique_names(targets)
    return targets, skipped


def find_lookups(model: onnx.ModelProto) -> list[Target]:
    """Every embedding lookup of ``model``'s main graph, in graph order: a Gather on axis 0 whose
    data is a float weight of rank 2 (directly, or through Transpose/Cast/Reshape, as onnxruntime-genai's
    builder reads a tied table: Transpose of lm_head's weight). Each is a :class:`Target` of
    op_type "Gather" laid out as torch's Embedding weight: ``[num_embeddings, embedding_dim]``, read
    as ``[out, in]`` (``out_features`` = the vocabulary, ``in_features`` = the hidden size), so
    compressed-tensors' channel strategy gives one scale per row and its groups run along the hidden
    dimension, as llm-compressor quantizes an Embedding. ``activation`` is the indices input."""
    graph = model.graph
    values = GraphIndex(graph, keep_unnamed=True)
    inits = values.initializers
    found: list[Target] = []
    for node in graph.node:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        if any(a.name == "axis" and onnx.helper.get_attribute_value(a) != 0 for a in node.attribute):
            continue
        source = trace_weight(values, node.input[0])
        if source is None:
            continue
        init_name, path_nodes = source
        if inits[init_name].data_type not in _FLOAT_TABLES or not node.name:
            continue
        shape = consumed_shape(inits[init_name], path_nodes, inits)
        if len(shape) != 2 or node.input[1] in inits:  # a constant index: a slice of a weight, not a lookup
            continue
        name = scoped_module(node, _LEGACY_GATHER_SUFFIX) or node.name
        found.append(Target(name=name, node=node.name, op_type="Gather", activation=node.input[1], weight=init_name,
                            weight_path=tuple(n.name for n in path_nodes), layout="out_in",
                            out_features=int(shape[0]), in_features=int(shape[1])))
    _check_unique_names(found)
    return found


def torch_weight(model: onnx.ModelProto, target: Target, base_dir: str | None = None) -> np.ndarray:
    """The target's weight in torch's [out, in] layout, as the node computes with it.

    A weight the model keeps in external data is read from its file under ``base_dir`` (the
    model's folder), this one tensor only.
    """
    b = _consumed(model, target, base_dir)
    return np.array(b.T if target.layout == "in_out" else b, order="C", copy=True)


def weight_tensor(model: onnx.ModelProto, target: Target, base_dir: str | None = None):
    """The target's weight as torch [out, in], like :func:`torch_weight` but without its copies: for
    a node that stores [in, out] (MatMul) a transposed view of the array as stored, and read-only
    where the bytes are the model's own (nothing writes into a weight: GPTQ, the smoothing and the
    quantizer make new tensors). What reads it whole (observers, the quantizer) reads it in memory
    order."""
    import warnings  # lazy: stdlib, needed on this rare path only

    from graphcal.arrays import to_torch  # lazy: torch keeps graphcal --help slow

    b = np.ascontiguousarray(_consumed(model, target, base_dir))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        w = to_torch(b)
    return w.t() if target.layout == "in_out" else w


def _consumed(model: onnx.ModelProto, target: Target, base_dir: str | None) -> np.ndarray:
    """The target's weight as its node consumes it (its initializer through the weight path)."""
    inits = GraphIndex(model.graph).initializers
    path_nodes = [_node_named(model.graph, p) for p in target.weight_path]
    return weight_as_consumed(inits[target.weight], path_nodes, inits, base_dir)


def module_name(node: onnx.NodeProto, weight_name: str, index: int) -> str:
    """Torch module path for a node: name_scopes metadata, else the legacy node name."""
    name = scoped_module(node, _LEGACY_OP_SUFFIX)
    if name:
        return name
    if weight_name.endswith(".weight") and not weight_name.startswith("onnx::"):
        return weight_name[: -len(".weight")]
    return node.name or f"{node.op_type.lower()}_{index}"


def scoped_module(node: onnx.NodeProto, op_suffix: re.Pattern | None = None) -> str | None:
    """The torch module a node belongs to by its name: the dynamo exporter's name_scopes metadata,
    else the legacy exporter's node path (``/model/layers.0/input_layernorm/Mul_1`` ->
    ``model.layers.0.input_layernorm``; with ``op_suffix``, only when the last part matches it)."""
    for prop in node.metadata_props:
        if prop.key == NAME_SCOPES_KEY:
            name = module_from_scopes(prop.value)
            if name:
                return name
    if node.name.startswith("/"):
        parts = [p for p in node.name.split("/") if p]
        if len(parts) >= 2 and (op_suffix is None or op_suffix.match(parts[-1])):
            return ".".join(parts[:-1])
    return None


def select(targets: list[Target], patterns: list[str], ignore: list[str]) -> tuple[list[Target], list[str]]:
    """Targets matching any of ``patterns`` and none of ``ignore``.

    Patterns are exact module names or ``re:`` regexes (matched from the start, as
    compressed-tensors does, through graph.names' bounded matcher: a regex that nests repeats or
    backtracks past its time budget is a UsageError); "Linear" matches every MatMul/Gemm target,
    "Embedding" every lookup,
    "MatMul"/"Gemm" by op type. Returns the selection and the patterns that matched no target
    (worth a warning).
    """
    for p in patterns:
        check_pattern(p, "targets")
    for p in ignore:
        check_pattern(p, "ignore")
    match = NameMatcher("targets/ignore")
    unmatched = [p for p in list(patterns) + list(ignore) if not any(matches(t, p, match) for t in targets)]
    chosen = [
        t for t in targets
        if any(matches(t, p, match) for p in patterns) and not any(matches(t, p, match) for p in ignore)
    ]
    return chosen, unmatched


def matches(target: Target, pattern: str, match: NameMatcher | None = None) -> bool:
    """compressed-tensors' target matching (exact name, or ``re:`` regex matched from the start, as
    its ``match_name`` does, bounded by ``match`` or a matcher of its own: graph.names); the class
    name ``Linear`` matches every target, since every weight MatMul/Gemm is a torch Linear, and
    ``MatMul``/``Gemm`` match by op type; ``Embedding`` (llm-compressor's class target) matches
    every lookup (:func:`find_lookups`) and ``Linear`` none."""
    if pattern == "Linear":
        return target.op_type != "Gather"
    if pattern == EMBEDDING:
        return target.op_type == "Gather"
    if pattern in ("MatMul", "Gemm"):
        return target.op_type == pattern
    return (match or NameMatcher())(target.name, pattern)


def _node_named(graph: onnx.GraphProto, node_name: str) -> onnx.NodeProto:
    """The first node called ``node_name`` (a weight path's nodes are named: trace_weight)."""
    for node in graph.node:
        if node.name == node_name:
            return node
    raise KeyError(node_name)


def module_from_scopes(value: str) -> str:
    """The deepest module path in a name_scopes list like ['', 'model', 'model.layers.0', ..., 'linear_3']."""
    try:
        scopes = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        scopes = [s.strip(" '\"") for s in value.strip("[]").split(",")]
    current = ""
    for scope in scopes[:-1]:  # the last entry names the op, not a module
        if not scope:
            continue
        if current and not scope.startswith(current + "."):
            break
        current = scope
    return current


def _check_unique_names(targets: list[Target]) -> None:
    seen: dict[str, str] = {}
    for t in targets:
        if t.name in seen:
            what = "embedding lookups" if t.op_type == "Gather" else "weight MatMul/Gemm nodes"
            raise GraphcalError(
                f"two {what} map to module {t.name!r} ({seen[t.name]!r} and {t.node!r}); "
                "rename the nodes or export with module names"
            )
        seen[t.name] = t.node
