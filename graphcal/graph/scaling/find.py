"""Where channel scales fold: each activation read by weight MatMuls, its producer classified, and
the mappings resolved by structure or by llm-compressor's names."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper

from graphcal.graph.index import SHAPE_OPS
from graphcal.graph.names import NameMatcher
from graphcal.graph.scaling.records import SCOPE_OF_KIND, SCOPES, Candidate, Mapping, Param, Resolution
from graphcal.graph.targets import scoped_module
from graphcal.graph.values import ValueIndex
from graphcal.types import NamedMapping, Target

SHAPE_ONLY = SHAPE_OPS  # readers that see an activation's shape, not its values
_NORMS = {  # op type -> (domain, input indices of the per-channel scale and bias)
    "LayerNormalization": ("", (1, 2)),
    "RMSNormalization": ("", (1,)),
    "SimplifiedLayerNormalization": (None, (1,)),  # onnxruntime registers it in both domains
    "SkipLayerNormalization": ("com.microsoft", (2, 3)),
    "SkipSimplifiedLayerNormalization": ("com.microsoft", (2,)),
}

def candidates(model: onnx.ModelProto, found: list[Target], base_dir: str | None = None) -> list[Candidate]:
    """Every activation read by weight MatMul/Gemm targets, classified (graph order)."""
    index = ValueIndex(model, base_dir)
    by_activation: dict[str, list[Target]] = {}
    for t in found:
        by_activation.setdefault(t.activation, []).append(t)
    by_output = _target_outputs(index, found)
    return [_classify(index, x, readers, by_output) for x, readers in by_activation.items()]


def resolve(cands: list[Candidate], chosen: list[Target], scope: str,
            named: Sequence[NamedMapping] | None = None, ignore: tuple[str, ...] = (),
            what: str = "SmoothQuant") -> Resolution:
    """The mappings to apply.

    ``named`` None: found by structure, for every candidate with a quantized balance target
    (``scope``: "norms" folds into norms and constant scales, "all" also into linear layers,
    "mul" also smooths what has no fold through an explicit Mul). ``named``: llm-compressor's
    mappings (types.NamedMapping: smooth and balance names or regexes) matched by module name, each match checked for
    exactness; ``ignore`` skips a match whose smooth layer and every balance layer it lists.
    """
    out = Resolution()
    chosen_names = {t.name for t in chosen}
    if named is None:
        kinds = {k for k, least in SCOPE_OF_KIND.items() if SCOPES.index(least) <= SCOPES.index(scope)}
        for c in cands:
            if not chosen_names.intersection(c.balance):
                continue
            if c.reason:
                out.notes.append(f"{_listed(c.balance)}: not smoothed ({c.reason})")
            elif c.kind in kinds:
                out.mappings.append(Mapping(c, explicit=c.kind == "mul"))
            elif c.kind == "linear":
                out.notes.append(f"{_listed(c.balance)}: not smoothed (its fold is into the linear layer {c.smooth}; "
                                 "--smoothquant all folds it)")
            elif what != "SmoothQuant":
                out.notes.append(f"{_listed(c.balance)}: not scaled (no exact fold: {c.blocked}; {what} folds into "
                                 "norms and linear layers only, adding no node)")
            else:
                out.notes.append(f"{_listed(c.balance)}: not smoothed (no exact fold: {c.blocked}; "
                                 "--smoothquant mul smooths it through an explicit Mul)")
        return out
    taken: dict[str, str] = {}  # activation -> the mapping that smooths it (llm-compressor smooths a layer once)
    match = NameMatcher(f"{what} mappings")  # compressed-tensors' match_name, bounded (graph.names)
    for named_mapping in named:
        balance_patterns, smooth_pattern = named_mapping.balance, named_mapping.smooth
        label = f"[{', '.join(balance_patterns)}] <- {smooth_pattern}"
        hits = [c for c in cands if match(c.smooth, smooth_pattern)
                and any(match(b, p) for b in c.balance for p in balance_patterns)]
        if not hits:
            out.notes.append(f"{what} mapping {label} matches nothing in this model (or nothing it can scale exactly)"
                             if what != "SmoothQuant" else f"{what} mapping {label} matches nothing in this model")
            continue
        for c in hits:
            listed = [b for b in c.balance if any(match(b, p) for p in balance_patterns)]
            if ignore and _ignored(c.smooth, ignore, match) and all(_ignored(b, ignore, match) for b in listed):
                continue
            if c.activation in taken:
                out.notes.append(f"{label}: {c.smooth} is smoothed once, by the earlier mapping {taken[c.activation]}")
                continue
            missing = [b for b in c.balance if b not in listed]
            if c.reason:
                out.notes.append(f"{label}: {c.smooth} not smoothed ({c.reason})")
            elif missing:
                out.notes.append(f"{label}: {c.smooth} not smoothed: {_listed(missing)} also read its output and "
                                 "are not balance layers of the mapping (smoothing would change the model)")
            elif c.kind == "mul" and scope != "mul":
                out.notes.append(f"{label}: {c.smooth} not smoothed (no exact fold: {c.blocked}; "
                                 "--smoothquant mul smooths through an explicit Mul)")
            else:
                out.mappings.append(Mapping(c, explicit=c.kind == "mul"))
                taken[c.activation] = label
    return out


def _ignored(name: str, ignore: tuple[str, ...], match: NameMatcher) -> bool:
    return any(match(name, p) for p in ignore)


def _listed(names, limit: int = 3) -> str:
    names = list(names)
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _target_outputs(index: ValueIndex, found: list[Target]) -> dict[str, tuple[Target, Param | None]]:
    """A linear layer's output (after its bias Add, if any) -> (target, its bias as a Param)."""
    by_node = {t.node: t for t in found}
    out: dict[str, tuple[Target, Param | None]] = {}
    for node in index.graph.node:
        t = by_node.get(node.name) if node.name else None
        if t is None:
            continue
        y = node.output[0]
        if node.op_type == "Gemm":
            bias = Param(y, 2, node.input[2]) if len(node.input) > 2 and node.input[2] else None
            out[y] = (t, bias)
            continue
        out[y] = (t, None)
        readers = index.value_readers(y)
        value_readers = [r for r in readers if r.op_type not in SHAPE_ONLY]
        if len(value_readers) == 1 and value_readers[0].op_type == "Add" and y not in index.graph_output_set:
            add = value_readers[0]
            other = 1 - list(add.input).index(y)
            value = index.const(add.input[other])
            if value is not None and value.ndim >= 1 and value.shape[-1] == t.out_features and value.size == t.out_features:
                out[add.output[0]] = (t, Param(add.output[0], other, add.input[other]))
    return out


def _classify(index: ValueIndex, x: str, readers: list[Target], by_output) -> Candidate:
    channels = readers[0].in_features
    balance = tuple(t.name for t in readers)
    reader_nodes = {t.node for t in readers}

    def only_balance(value: str) -> str:
        """"" if only the balance targets (and shape readers) read ``value``; else what else does."""
        if value in index.graph_output_set:
            return f"{value} is a graph output"
        others = [n for n in index.value_readers(value) if n.name not in reader_nodes and n.op_type not in SHAPE_ONLY]
        return "" if not others else f"{value} is also read by {others[0].op_type} {others[0].name or '(unnamed)'}"

    def mul_candidate(reason: str, blocked: str = "") -> Candidate:
        producer = index.producer_node(x)
        name = node_module(producer) if producer is not None else x
        return Candidate(x, balance, "mul", name or x, x, channels, reason=reason,
                         blocked=blocked or "no op before it scales each channel by constants")

    if len({t.in_features for t in readers}) > 1:
        return mul_candidate(f"its readers take {sorted({t.in_features for t in readers})} features")
    extra = only_balance(x)
    if any(t.node == "" for t in readers):
        return mul_candidate("an unnamed MatMul reads it")
    if extra:  # no fold can be exact; an explicit Mul in front of the balance targets is
        return mul_candidate("", extra)
    linear = by_output.get(x)
    if linear is not None:
        t, bias = linear
        return _linear(index, x, balance, t, bias, x, channels)
    producer = index.producer_node(x)
    if producer is None:
        return mul_candidate("")
    norm = _norm_params(index, producer, x, channels)
    if norm is not None:
        return Candidate(x, balance, "norm", node_module(producer, norm), x, channels, params=norm)
    if producer.op_type == "Mul" and len(producer.input) == 2 and producer.domain in ("", "ai.onnx"):
        for k in (0, 1):  # a gated MLP: x = act(gate(h)) * up(h); smoothing folds into up's output rows
            y = producer.input[k]
            if y in by_output and index.const(producer.input[1 - k]) is None:
                if only_single_reader(index, y, producer):
                    t, bias = by_output[y]
                    if t.out_features == channels:
                        return _linear(index, x, balance, t, bias, y, channels)
    value = _attention_value(index, producer, by_output)
    if value is not None:  # o_proj <- attention <- v_proj: smoothing folds into v_proj's output rows
        t, bias, y = value
        if t.out_features == channels:
            return _linear(index, x, balance, t, bias, y, channels)
    return mul_candidate("")


def _attention_value(index: ValueIndex, merge: onnx.NodeProto, by_output):
    """(v_proj, its bias, its output) when ``merge`` ends an attention that reads v_proj's output as V:

        y = v_proj(h) -> Reshape [b, s, heads, d] -> Transpose(0, 2, 1, 3) -> MatMul(probs, V)
          -> Transpose(0, 2, 1, 3) -> Reshape [b, s, heads * d] = x   (merge)

    Each attention output channel is a weighted sum of the same V channel over positions, and the
    reshapes split and merge the channels the same way (the transposes move the heads axis only),
    so scaling x's channels is scaling y's: v_proj's rows. Every tensor on the V path has one reader;
    grouped-query attention (V repeated over heads) does not match. None otherwise."""
    def single(value: str, node: onnx.NodeProto) -> bool:
        return only_single_reader(index, value, node)

    def perm(node: onnx.NodeProto) -> list[int] | None:
        for a in node.attribute:
            if a.name == "perm":
                return list(a.ints)
        return None

    def rank(name: str) -> int | None:
        t = index.types.get(name)
        return len(t.shape.dim) if t is not None and t.HasField("shape") else None

    if merge.op_type != "Reshape" or rank(merge.output[0]) != 3:
        return None
    back = index.producer_node(merge.input[0])
    if back is None or back.op_type != "Transpose" or perm(back) != [0, 2, 1, 3] or not single(back.output[0], merge):
        return None
    mm = index.producer_node(back.input[0])
    if mm is None or mm.op_type != "MatMul" or not single(mm.output[0], back):
        return None
    forward = index.producer_node(mm.input[1])
    if forward is None or forward.op_type != "Transpose" or perm(forward) != [0, 2, 1, 3] or not single(mm.input[1], mm):
        return None
    split = index.producer_node(forward.input[0])
    if split is None or split.op_type != "Reshape" or rank(split.output[0]) != 4 or not single(split.output[0], forward):
        return None
    y = split.input[0]
    if y not in by_output or not single(y, split):
        return None
    t, bias = by_output[y]
    return t, bias, y


def only_single_reader(index: ValueIndex, value: str, node: onnx.NodeProto) -> bool:
    if value in index.graph_output_set:
        return False
    readers = [n for n in index.value_readers(value) if n.op_type not in SHAPE_ONLY]
    return len(readers) == 1 and readers[0] is node


def _linear(index, x, balance, t: Target, bias: Param | None, tensor: str, channels: int) -> Candidate:
    if t.out_features != channels or (bias is not None and _const_shape(index, bias.value, channels) is None):
        return Candidate(x, balance, "mul", t.name, x, channels, blocked=f"{t.name}'s output does not map onto its channels")
    return Candidate(x, balance, "linear", t.name, tensor, channels, params=(bias,) if bias else (), linear=t.name)


def _const_shape(index: ValueIndex, name: str, channels: int) -> tuple[int, ...] | None:
    """The shape of a constant that scales or shifts each of ``channels`` channels (a scalar, [C]
    or [1, ..., C]); None when ``name`` is no such constant."""
    value = index.const(name)
    if value is None or not np.issubdtype(value.dtype, np.floating):
        return None
    if value.size == 1 or (value.shape[-1] == channels and value.size == channels):
        return value.shape
    return None


def _norm_params(index: ValueIndex, node: onnx.NodeProto, x: str, channels: int) -> tuple[Param, ...] | None:
    """The per-channel constants of the norm (or constant scale) producing ``x``, or None."""
    y = node.output[0]
    if y != x:
        return None
    if node.op_type in _NORMS:
        domain, indices = _NORMS[node.op_type]
        if domain is not None and node.domain not in (domain, "ai.onnx" if domain == "" else domain):
            return None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type in ("LayerNormalization", "RMSNormalization") and attrs.get("axis", -1) not in (-1,):
            return None  # normalised over more than the last axis: the scale is not per channel
        params = []
        for i in indices:
            if i < len(node.input) and node.input[i]:
                if _const_shape(index, node.input[i], channels) is None:
                    return None
                params.append(Param(y, i, node.input[i]))
        return tuple(params) if params else None
    if node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return None
    if node.op_type == "Mul":
        for k in (0, 1):
            if _const_shape(index, node.input[k], channels) is not None and index.const(node.input[1 - k]) is None:
                return (Param(y, k, node.input[k]),)
        return None
    if node.op_type == "Add":  # decomposed LayerNorm: x = Mul(gamma) + beta
        for k in (0, 1):
            if _const_shape(index, node.input[k], channels) is None:
                continue
            inner = index.producer_node(node.input[1 - k])
            if inner is None or inner.op_type != "Mul" or not only_single_reader(index, inner.output[0], node):
                return None
            scale = _norm_params(index, inner, inner.output[0], channels)
            if scale is None:
                return None
            return scale + (Param(y, k, node.input[k]),)
    return None


def node_module(node: onnx.NodeProto, params: tuple[Param, ...] = ()) -> str:
    """The torch module a non-MatMul node belongs to: name_scopes metadata, the legacy exporter's
    node path (``/model/layers.0/input_layernorm/Mul_1``), or its scale's initializer name."""
    name = scoped_module(node)
    if name:
        return name
    for p in params:
        if p.value.endswith(".weight") and not p.value.startswith("onnx::"):
            return p.value[: -len(".weight")]
    return node.name or node.output[0]


# -- the edits ------------------------------------------------------------------------------


