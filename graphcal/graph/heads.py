"""The attention heads a per-head rotation (SpinQuant's R2) can turn exactly: each value head's
columns of the value projection by one head_dim matrix H, and the output projection's rows for each
query head by Hᵀ. Attention mixes a value head's rows (positions), never its columns, so the output
projection undoes it; under grouped-query attention every query head sharing a value head meets
the same H. A pair is found only where the path between the two projections is known to keep
head_dim as the last axis; anything else is left unturned.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper

from graphcal.graph.attention import find_kv_states
from graphcal.graph.index import SHAPE_OPS, GraphIndex
from graphcal.graph.targets import find_targets
from graphcal.graph.values import ValueIndex
from graphcal.types import Target


@dataclass
class HeadPair:
    """A projection writing value heads and the output projection reading the attention's result:
    the value heads' columns of ``value`` (from column ``first``) and the matching rows of ``out``
    can turn by one per-head rotation (SpinQuant's R2), since attention only mixes a value head's
    rows (positions), never its columns. ``value`` is onnxruntime's packed qkv_proj before its
    GroupQueryAttention (``first`` after the query and key columns) or a torch export's own v_proj
    (``first`` 0)."""

    value: Target
    out: Target
    num_heads: int
    kv_heads: int
    head_dim: int
    first: int = 0
    turned: tuple[str, ...] = ()  # graph outputs holding the value heads as turned (GroupQueryAttention's present values)

    @property
    def packed(self) -> bool:
        """The value heads share their projection with the queries and keys."""
        return self.first > 0


def head_pairs(model: onnx.ModelProto) -> list[HeadPair]:
    """Every (value projection, o_proj) pair whose heads can turn exactly: around onnxruntime's
    GroupQueryAttention reading a packed qkv_proj alone, and in torch exports (attention in plain
    ops, :func:`graphcal.graph.attention.find_kv_states`) where the value path is the one the
    exporter writes; others are left."""
    values = ValueIndex(model)  # one index of the graph for both forms (and the constants of the exporter's shapes)
    by_node = {t.node: t for t in find_targets(model)[0]}
    return _packed_pairs(model, values, by_node) + _export_pairs(model, values, by_node)


def _packed_pairs(model: onnx.ModelProto, index: GraphIndex, by_node: dict[str, Target]) -> list[HeadPair]:
    pairs = []
    for node in model.graph.node:
        if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if any(len(node.input) > k and node.input[k] for k in (1, 2)):
            continue  # separate key and value inputs: not the packed form
        producer = index.producer_node(node.input[0])
        qkv = by_node.get(producer.name) if producer is not None and producer.output[0] == node.input[0] else None
        readers = [n for n in index.value_readers(node.output[0]) if n.op_type not in SHAPE_OPS]
        if qkv is None or len(index.value_readers(node.input[0])) != 1 or len(readers) != 1:
            continue
        out = by_node.get(readers[0].name)
        if out is None or readers[0].input[0] != node.output[0] or qkv.layout != "in_out" or out.layout != "in_out":
            continue
        heads, kv_heads = int(attrs.get("num_heads", 0)), int(attrs.get("kv_num_heads", 0))
        if heads <= 0 or kv_heads <= 0 or qkv.out_features % (heads + 2 * kv_heads):
            continue
        head_dim = qkv.out_features // (heads + 2 * kv_heads)
        if out.in_features != heads * head_dim:
            continue
        present = [node.output[2]] if len(node.output) > 2 and node.output[2] in index.graph_output_set else []
        pairs.append(HeadPair(qkv, out, heads, kv_heads, head_dim, first=(heads + kv_heads) * head_dim,
                              turned=tuple(present)))
    return pairs


_HEADS_FIRST = [0, 2, 1, 3]  # [batch, seq, heads, head_dim] <-> [batch, heads, seq, head_dim]


def _export_pairs(model: onnx.ModelProto, values: ValueIndex, by_node: dict[str, Target]) -> list[HeadPair]:
    """The torch exporter's attention: ``v_proj -> Reshape [.., .., -1, head_dim] -> Transpose ->``
    the value states ``-> repeat_kv -> MatMul(probs, .) -> Transpose -> Reshape -> o_proj``. Each
    step keeps head_dim as the last axis (repeat_kv's Reshape keeps the states' own last dimension),
    so a head_dim rotation of v_proj's columns comes out of the context MatMul and reaches o_proj's
    rows for every query head; the value states and the context are read by nothing else."""
    pairs = []
    for state in find_kv_states(model)[0]:
        pair = _export_pair(values, by_node, state)
        if pair is not None:
            pairs.append(pair)
    return pairs


def _export_pair(values: ValueIndex, by_node: dict[str, Target], state) -> HeadPair | None:
    def only_reader(name: str) -> onnx.NodeProto | None:
        readers = [n for n in values.value_readers(name) if n.op_type not in SHAPE_OPS]
        return readers[0] if len(readers) == 1 and name not in values.graph_output_set else None

    def transposes_heads(node) -> bool:
        return (node is not None and node.op_type == "Transpose"
                and next((list(a.ints) for a in node.attribute if a.name == "perm"), None) == _HEADS_FIRST)

    to_heads = values.producer_node(state.value)
    split = values.producer_node(to_heads.input[0]) if transposes_heads(to_heads) else None
    if split is None or split.op_type != "Reshape":
        return None
    head_dim = _last_shape_constant(values, split.input[1])
    v_node = values.producer_node(split.input[0])
    v = by_node.get(v_node.name) if v_node is not None else None
    if (v is None or head_dim is None or head_dim <= 0 or v.layout != "in_out" or v_node.output[0] != split.input[0]
            or v.out_features % head_dim or only_reader(split.input[0]) is not split):
        return None
    chain = [state.value]  # the value states through repeat_kv (grouped-query attention) to the context MatMul
    for op in ("Unsqueeze", "Expand", "Reshape"):
        node = only_reader(chain[-1])
        if node is None or node.op_type != op or node.input[0] != chain[-1]:
            break
        chain.append(node.output[0])
    context = only_reader(chain[-1])
    if (context is None or context.name != state.context_node or context.input[1] != chain[-1]
            or len(chain) not in (1, 4)):
        return None
    if len(chain) == 4 and not _keeps_last_axis(values, values.producer_node(chain[-1]).input[1], chain, head_dim):
        return None
    back = only_reader(context.output[0])  # [batch, heads, seq, head_dim] -> [batch, seq, heads * head_dim]
    merge = only_reader(back.output[0]) if transposes_heads(back) else None
    o_node = only_reader(merge.output[0]) if merge is not None and merge.op_type == "Reshape" else None
    out = by_node.get(o_node.name) if o_node is not None and o_node.input[0] == merge.output[0] else None
    if out is None or out.layout != "in_out" or out.in_features % head_dim:
        return None
    return HeadPair(v, out, out.in_features // head_dim, v.out_features // head_dim, head_dim)


def _last_shape_constant(values: ValueIndex, shape: str) -> int | None:
    """The last entry of a Reshape's shape when it is a constant: the shape itself, or the last
    input of the Concat the exporter builds it with."""
    const = values.const(shape, max_elements=8)
    if const is None:
        node = values.producer_node(shape)
        if node is None or node.op_type != "Concat" or not node.input:
            return None
        const = values.const(node.input[-1], max_elements=1)
    return int(const.reshape(-1)[-1]) if const is not None and const.size else None


def _keeps_last_axis(values: ValueIndex, shape: str, chain: list[str], head_dim: int) -> bool:
    """repeat_kv's Reshape keeps the last axis: its shape ends in head_dim, or in the value states'
    own last dimension (``Unsqueeze(Gather(Shape(states), last axis))``, as the exporter writes it)."""
    if _last_shape_constant(values, shape) == head_dim:
        return True
    concat = values.producer_node(shape)
    if concat is None or concat.op_type != "Concat" or not concat.input:
        return False
    unsqueeze = values.producer_node(concat.input[-1])
    gather = values.producer_node(unsqueeze.input[0]) if unsqueeze is not None and unsqueeze.op_type == "Unsqueeze" \
        else None
    if gather is None or gather.op_type != "Gather":
        return False
    source = values.producer_node(gather.input[0])
    index = values.const(gather.input[1], max_elements=1)
    if source is None or source.op_type != "Shape" or index is None or source.input[0] not in chain[:3]:
        return False
    rank = 4 if source.input[0] == chain[0] else 5  # the states, or unsqueezed for the repeat
    start = next((a.i for a in source.attribute if a.name == "start"), 0)
    return start == 0 and int(index.reshape(-1)[0]) in (-1, rank - 1)
