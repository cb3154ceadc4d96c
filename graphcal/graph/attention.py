"""Find the key and value states that enter each attention, for a kv_cache_scheme.

llm-compressor observes (and compressed-tensors fake-quantizes) the key and value states as
they go into the KV cache: after RoPE, before ``repeat_kv`` expands the kv heads for grouped-
query attention, shaped ``[batch, kv_heads, seq, head_dim]``. In an exported graph they are
found from the two activation x activation MatMuls of each attention module:

- scores = MatMul(q, K) where K = Transpose(perm swaps the last two axes)(repeat_kv(key_states));
- context = MatMul(probs, repeat_kv(value_states));

with ``repeat_kv`` = Reshape(Expand(Unsqueeze(states))) when present (grouped-query attention).
Attention modules are those compressed-tensors' kv-cache targets match
(``re:.*(self_attn|attention)$``); an attention whose pattern is not recognised is reported,
never guessed.
"""

from __future__ import annotations

import re

import onnx

from graphcal.graph.index import GraphIndex
from graphcal.graph.targets import module_name
from graphcal.graph.weight_path import trace_weight
from graphcal.types import KVState

# compressed-tensors' KV_CACHE_TARGETS, as a regex
KV_MODULE = re.compile(r".*(self_attn|attention)$")


def find_kv_states(model: onnx.ModelProto) -> tuple[list[KVState], list[str]]:
    """(the key/value states of every recognised attention, problems with the others)."""
    graph = model.graph
    values = GraphIndex(graph, keep_unnamed=True)
    by_module: dict[str, list[onnx.NodeProto]] = {}
    for index, node in enumerate(graph.node):
        if node.op_type != "MatMul" or len(node.input) != 2:
            continue
        if any(trace_weight(values, name, addressable=False, max_nodes=9) is not None for name in node.input):
            continue  # a weight MatMul
        module = module_name(node, "", index)
        if KV_MODULE.match(module):
            by_module.setdefault(module, []).append(node)
    states, problems = [], []
    for module, nodes in by_module.items():
        if len(nodes) != 2:
            problems.append(f"{module}: expected 2 activation MatMuls (scores, context), found {len(nodes)}")
            continue
        scores, context = nodes
        key = _skip_repeat_kv(_skip_key_transpose(scores.input[1], values), values)
        value = _skip_repeat_kv(context.input[1], values)
        if key is None:
            problems.append(f"{module}: the scores MatMul's B input is not Transpose(key states)")
            continue
        states.append(KVState(name=module, key=key, value=value, scores_node=scores.name, context_node=context.name))
    return states, problems


def _skip_key_transpose(name: str, values: GraphIndex) -> str | None:
    node = values.producer_node(name)
    if node is None or node.op_type != "Transpose":
        return None
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
    if perm is None or len(perm) < 2 or perm[-2:] != [len(perm) - 1, len(perm) - 2] or perm[:-2] != list(range(len(perm) - 2)):
        return None
    return node.input[0]


def _skip_repeat_kv(name: str, values: GraphIndex) -> str:
    """Reshape(Expand(Unsqueeze(x))) -> x; anything else is left as is."""
    current = name
    for op in ("Reshape", "Expand", "Unsqueeze"):
        node = values.producer_node(current)
        if node is None or node.op_type != op:
            return name
        current = node.input[0]
    return current
