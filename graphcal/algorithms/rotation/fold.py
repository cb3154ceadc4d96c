"""A rotation of the residual stream folded into the weights (QuaRot's, SpinQuant's R1): the fp32
model computes the same outputs, and every weight reading or writing the stream is rotated.

With Q orthogonal (``orthogonal(hidden)``: a normalized Hadamard matrix where one is built), and
the stream found by :func:`graphcal.graph.residual.residual_stream`:

- each embedding table E becomes ``E Q`` (the stream starts rotated);
- each weight writing into the stream (o_proj, down_proj) takes Q on its output side, as does
  its bias (a Gemm's C, or a constant added after a MatMul): ``b Q``;
- each RMS norm's scale g is folded into the weights reading its output and set to ones: the norm
  then commutes with Q (``rms(x Q) = rms(x)``);
- each weight reading the stream (q/k/v, gate/up, lm_head) takes ``Q^T diag(g)`` on its input side;
- a weight both reading the stream and writing into it (``x + x W``) takes both: ``Q^T diag(g) W Q``.

Rotated, a weight's outlier input channels are spread over all channels, which is what makes
int4 and int8 grids fit it better.

A table tied to lm_head takes two transforms: ``E Q`` for the lookup, ``Qᵀ diag(g) Eᵀ`` for lm_head.
Where lm_head reads the shared initializer directly and the lookup reads it through a layout path
(the builder's Transpose), the tie is kept: the one table becomes ``E Q`` as both read it, and
lm_head's ``diag(g)``, conjugated into the rotated basis, moves into a small MatMul of its own
before it: ``x M`` with ``M = Qᵀ diag(g) Q`` (hidden x hidden, kept in float: ``scale_nodes``),
since ``x_rot M (E Q)ᵀ = x diag(g) Eᵀ``. Otherwise (another layout, more readers) the table is
stored twice, and the report says what that costs.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphcal.algorithms.rotation.hadamard import KINDS, orthogonal
from graphcal.errors import GraphcalError, shown
from graphcal.graph.edit import Names, add_initializer, drop_dead_paths, replace_input
from graphcal.graph.external import expected_bytes
from graphcal.graph.heads import head_pairs
from graphcal.graph.residual import residual_stream
from graphcal.graph.values import ValueIndex
from graphcal.graph.weight_path import weight_as_consumed

METADATA_KEY = "graphcal.rotation"


@dataclass
class Rotation:
    """What :func:`rotate` did."""

    hidden: int
    matrix: str  # how Q was made ("Hadamard 576", "random orthogonal 100 (seed 0)")
    writes: list[str] = field(default_factory=list)  # Q on their output side: embedding tables, o_proj, down_proj
    reads: list[str] = field(default_factory=list)  # Q^T on their input side: q/k/v (qkv_proj), gate/up, lm_head
    norms: int = 0  # norm scales folded into the weights after them
    untied: list[str] = field(default_factory=list)  # initializers that had several readers, now one copy each
    kept_tied: list[str] = field(default_factory=list)  # tables still shared by a lookup and lm_head
    scale_nodes: list[str] = field(default_factory=list)  # MatMul nodes added before such an lm_head (stay float)
    bytes_before: int = 0
    bytes_after: int = 0
    heads: int = 0  # attention blocks whose value and output heads were turned too (R2)
    head_matrix: str = ""  # how R2's matrix was made
    head_writes: list[str] = field(default_factory=list)  # R2 on their output side: v_proj of their own
    head_reads: list[str] = field(default_factory=list)  # R2's inverse on their input side: the o_proj after them
    head_dim: int = 0  # R2's block: the attention head size
    kind: str = "hadamard"  # SpinQuant's transform type the matrices were made by
    seed: int = 0
    rotations: list[str] = field(default_factory=lambda: ["R1"])  # what was asked: R1, or R1 and R2
    turned_outputs: dict[str, int] = field(default_factory=dict)  # graph outputs R2 turns per head -> head_dim

    @property
    def rotated(self) -> list[str]:
        """Module names of every weight rotated."""
        return self.writes + self.reads

    def as_dict(self) -> dict:
        """The model's ``graphcal.rotation`` metadata."""
        return {"hidden": self.hidden, "matrix": self.matrix, "weights": len(self.rotated), "norms": self.norms,
                "untied": self.untied, "kept_tied": self.kept_tied, "scale_nodes": self.scale_nodes,
                "heads": self.heads, "head_matrix": self.head_matrix, "kind": self.kind, "seed": self.seed,
                "rotations": self.rotations}


def summary(record: dict) -> str:
    """One line on what a rotation folded (its ``as_dict`` record), as run and inspect print it."""
    return (f"{record['matrix']}; {','.join(record['rotations'])}): {record['weights']} weights and "
            f"{record['norms']} norm scales folded"
            + (f"; R2 on {record['heads']} attention(s) ({record['head_matrix']})" if record["heads"] else "")
            + (f"; {len(record['kept_tied'])} table kept tied to lm_head" if record["kept_tied"] else "")
            + (f" (a {record['hidden']}x{record['hidden']} float MatMul before lm_head takes the final norm's scale)"
               if record["scale_nodes"] else "")
            + (f"; untied: {', '.join(record['untied'])}" if record["untied"] else ""))


def rotation_record(model: onnx.ModelProto) -> dict | None:
    """The ``graphcal.rotation`` metadata graphcal wrote into ``model``, None without one."""
    text = next((p.value for p in model.metadata_props if p.key == METADATA_KEY), None)
    if text is None:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        raise GraphcalError(f"the model's {METADATA_KEY} metadata is not a JSON object")
    return record


def transform_config(report: Rotation) -> dict:
    """compressed-tensors' ``transform_config`` for what :func:`rotate` folded, as llm-compressor's
    SpinQuantModifier writes it: group ``R1``, the matrix on the output side (``weight_output``) of
    the weights writing the stream and, inverted, on the input side (``weight_input``) of those
    reading it, over the whole hidden width; group ``R2``, a head_dim block on each v_proj's output
    side and, inverted, on its o_proj's input side. All are weight locations, which
    compressed-tensors applies offline and loaders never apply again. R2 on a packed qkv_proj turns
    its value columns only, which a transform on a module's whole output cannot say:
    ``graphcal.rotation`` alone records it."""
    from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme  # lazy: seconds to import

    groups = {"R1": TransformScheme(type=report.kind, precision="float64", apply=[
        TransformArgs(targets=report.writes, location="weight_output"),
        TransformArgs(targets=report.reads, location="weight_input", inverse=True)])}
    if report.head_writes:
        groups["R2"] = TransformScheme(type=report.kind, precision="float64", head_dim=report.head_dim, apply=[
            TransformArgs(targets=report.head_writes, location="weight_output"),
            TransformArgs(targets=report.head_reads, location="weight_input", inverse=True)])
    return TransformConfig(config_groups=groups).model_dump(mode="json")


def rotate_like(model: onnx.ModelProto, base_dir: str | None, record: dict) -> Rotation:
    """Rotate ``model`` as the model whose ``record`` this is was rotated (same matrices), in place."""
    kind, seed, rotations = record.get("kind"), record.get("seed"), record.get("rotations")
    if kind is None or seed is None or rotations is None:
        raise GraphcalError(f"the {METADATA_KEY} record names no transform type, seed and rotations (written by an "
                            "older graphcal): rewrite the model to compare it layer by layer")
    if (kind not in KINDS or type(seed) is not int or not 0 <= seed < 2**63 or not isinstance(rotations, list)
            or rotations not in (["R1"], ["R1", "R2"])):
        raise GraphcalError(f"the {METADATA_KEY} record's transform type, seed or rotations are not graphcal's "
                            f"({shown(repr(kind))}, {shown(repr(seed))}, {shown(repr(rotations))})")
    heads = "R2" in rotations and record.get("heads") != 0  # a model whose heads went unturned (older graphcal)
    report = rotate(model, base_dir, seed=seed, heads=heads, kind=kind)
    write_record(model, report)
    return report


def write_record(model: onnx.ModelProto, report: Rotation) -> None:
    """Record in ``model``'s metadata what :func:`rotate` folded into it (``graphcal.rotation``)."""
    model.metadata_props.add(key=METADATA_KEY, value=json.dumps(report.as_dict(), sort_keys=True))


def rotate(model: onnx.ModelProto, base_dir: str | None = None, seed: int = 0, heads: bool = True,
           kind: str = "hadamard", sink=None) -> Rotation:
    """Rotate ``model``'s residual stream in place (its weights read under ``base_dir``), and with
    ``heads`` each value head with o_proj's rows for it (R2), by matrices of SpinQuant's ``kind``
    (:func:`orthogonal`); a model whose stream cannot be rotated exactly is refused
    (:func:`residual_stream`) before any edit.

    The weights are rotated one at a time, each read when its turn comes and handed to ``sink``
    (``sink.put(array)`` -> a piece whose ``tensor(name)`` is the initializer the model keeps: the run's
    own data file, calibration.own_data.OwnData) before the next is read; without a ``sink`` each rotated
    weight becomes an inline initializer. Norm scales, biases and the kept tie's small MatMul stay inline."""
    sink = sink or InMemory()
    stream = residual_stream(model, base_dir)
    q, how = orthogonal(stream.hidden, seed, kind)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    nodes = {n.name: n for n in graph.node}
    names = Names(set(inits) | {o for n in graph.node for o in n.output})
    report = Rotation(stream.hidden, how, bytes_before=_bytes(graph), kind=kind, seed=seed,
                      rotations=["R1", "R2"] if heads else ["R1"])
    readers_of: dict[str, int] = {}  # initializer -> how many nodes read it (a node both reading and writing: once)
    for w in {(t.weight, t.node) for t in [*stream.lookups, *stream.writers, *(r.target for r in stream.readers)]}:
        readers_of[w[0]] = readers_of.get(w[0], 0) + 1
    # (node, input) -> [node, input, base name, its new value, whether it is a weight]: a weight's value is a
    # function that reads and rotates it when the edits are made (one weight in hand at a time), a small
    # tensor's (a bias, a norm scale: read before any edit changes what its node reads) the array itself
    edits: dict[tuple[str, int], list] = {}
    values = ValueIndex(model, base_dir)

    def put(node: onnx.NodeProto, k: int, base: str, value) -> None:
        edits[(node.name, k)] = [node, k, base, value, callable(value)]

    def weight(t) -> np.ndarray:
        path = [nodes[n] for n in t.weight_path]
        return weight_as_consumed(inits[t.weight], path, inits, base_dir)

    def const(node: onnx.NodeProto, k: int) -> np.ndarray:
        return values.const(node.input[k])  # through Identity (residual_stream checked it is a constant)

    def scale(r) -> np.ndarray:
        if r.scale is None:
            return np.ones(stream.hidden)
        return const(nodes[r.scale[0]], r.scale[1]).astype(np.float64).reshape(-1)

    def looked_up(t) -> np.ndarray:  # [vocab, hidden] -> E Q
        e = weight(t)
        return _cast(e.astype(np.float64) @ q, e)

    def turned_out(t, w: np.ndarray) -> np.ndarray:  # y = x W: the output side is W's columns (in_out) or rows (out_in)
        w64 = w.astype(np.float64)
        return w64 @ q if t.layout == "in_out" else q.T @ w64

    def written(t) -> np.ndarray:
        w = weight(t)
        return _cast(turned_out(t, w), w)

    def read(t, g: np.ndarray, writer) -> np.ndarray:  # Q^T diag(g) on the input side (after the output side's turn)
        w = weight(t)
        w64 = turned_out(writer, weight(writer)) if writer is not None else w.astype(np.float64)
        rotated = q.T @ (g[:, None] * w64) if t.layout == "in_out" else (w64 * g[None, :]) @ q
        return _cast(rotated, w)

    kept = _kept_ties(stream, readers_of, q, weight, inits, nodes, base_dir, sink)  # weight -> (its table, dtype)
    report.untied = sorted(w for w, n in readers_of.items() if n > 1 and w not in kept)
    for t in stream.lookups:
        if t.weight in kept:
            continue
        put(nodes[t.node], 0, f"{t.name}.rotated", functools.partial(looked_up, t))
    both = {}  # a weight reading the stream and writing into it (x + x W): its output side, for the input side's turn
    reading = {r.target.node for r in stream.readers}
    for t in stream.writers:
        if t.node in reading:
            both[t.node] = t  # rounded once, after its input side's turn: Q^T diag(g) W Q
            continue
        put(nodes[t.node], 1, f"{t.name}.rotated", functools.partial(written, t))
    for node_name, k in stream.biases:
        node = nodes[node_name]
        b = const(node, k)
        put(node, k, f"{node_name}.rotated_bias", _cast(b.astype(np.float64) @ q, b))
    kept_scales = {}  # a kept tie's lm_head -> its norm scale, read before the scales are set to ones
    for r in stream.readers:
        t = r.target
        if t.weight in kept:
            kept_scales[t.weight] = scale(r)
            continue
        put(nodes[t.node], 1, f"{t.name}.rotated", functools.partial(read, t, scale(r), both.pop(t.node, None)))
    for node_name, k in stream.scales:
        node = nodes[node_name]
        g = const(node, k)
        put(node, k, f"{node_name}.unit_scale", np.ones_like(g))
    for pair in head_pairs(model) if heads else []:  # R2: each value head's columns and o_proj's rows for it, by one H
        h, how_heads = orthogonal(pair.head_dim, seed, kind)
        value, out = (edits.get((t.node, 1)) or [nodes[t.node], 1, f"{t.name}.rotated", functools.partial(weight, t), True]
                      for t in (pair.value, pair.out))
        value[3] = functools.partial(_turn_values, value[3], pair, h)
        out[3] = functools.partial(_turn_out, out[3], pair, h)
        edits[(pair.value.node, 1)], edits[(pair.out.node, 1)] = value, out
        report.heads += 1
        report.head_matrix = how_heads
        report.turned_outputs.update(dict.fromkeys(pair.turned, pair.head_dim))
        if not pair.packed:
            report.head_writes.append(pair.value.name)
            report.head_reads.append(pair.out.name)
            report.head_dim = pair.head_dim
    old = set()
    for node, k, base, value, is_weight in edits.values():  # each weight read, rotated and handed to the sink in turn
        old.add(node.input[k])
        if not is_weight:
            node.input[k] = add_initializer(graph.initializer, names, base, np.ascontiguousarray(value))
            continue
        piece = sink.put(value())
        node.input[k] = names.unique(base)
        graph.initializer.append(piece.tensor(node.input[k]))
        del piece
    for r in stream.readers:  # a kept tie: the one table rotated, lm_head's norm scale in a MatMul before it
        t = r.target
        if t.weight in kept:
            old.add(t.weight)
            report.kept_tied.append(t.weight)
            report.scale_nodes += _keep_tie(graph, names, nodes[t.node], t, kept[t.weight], kept_scales[t.weight], q)
    drop_dead_paths(graph, old)
    report.writes = [t.name for t in [*stream.lookups, *stream.writers]]
    report.reads = [r.target.name for r in stream.readers]
    report.norms = len(stream.scales)
    report.bytes_after = _bytes(graph)
    return report


def _turn_values(value, pair, h: np.ndarray) -> np.ndarray:
    """R2 on a value projection: each kv head's columns times ``h`` (``value()``: the weight as R1 left it)."""
    v = value()
    w = v.astype(np.float64)
    for j in range(pair.kv_heads):
        cols = slice(pair.first + j * pair.head_dim, pair.first + (j + 1) * pair.head_dim)
        w[:, cols] = w[:, cols] @ h
    return _cast(w, v)


def _turn_out(value, pair, h: np.ndarray) -> np.ndarray:
    """R2's inverse on o_proj: each head's rows by ``hᵀ`` (``value()``: the weight as R1 left it)."""
    v = value()
    w = v.astype(np.float64)
    for i in range(pair.num_heads):
        rows = slice(i * pair.head_dim, (i + 1) * pair.head_dim)
        w[rows, :] = h.T @ w[rows, :]
    return _cast(w, v)


class InMemory:
    """The fold's sink without a file: each rotated weight an inline initializer (numpy_helper.from_array's)."""

    def put(self, array: np.ndarray) -> _Inline:
        return _Inline(numpy_helper.from_array(np.ascontiguousarray(array)))


@dataclass
class _Inline:
    proto: onnx.TensorProto

    def tensor(self, name: str) -> onnx.TensorProto:
        self.proto.name = name
        return self.proto


def _keep_tie(graph: onnx.GraphProto, names: Names, reader: onnx.NodeProto, t, table: tuple, g: np.ndarray,
              q: np.ndarray) -> list[str]:
    """Point every reader of ``t.weight`` at the rotated ``table`` (the sink's piece, its dtype), and where
    ``g`` (lm_head's norm scale) is not ones, feed ``reader`` through ``x M``, ``M = Q^T diag(g) Q``; the
    nodes added."""
    piece, dtype = table
    rotated = names.unique(f"{t.weight}.rotated")
    graph.initializer.append(piece.tensor(rotated))
    for node in graph.node:
        replace_input(node, t.weight, rotated)
    if np.array_equal(g, np.ones_like(g)):
        return []
    m = add_initializer(graph.initializer, names, f"{t.name}.rotation_scale", (q.T @ (g[:, None] * q)).astype(dtype))
    name, out = names.unique(f"{reader.name}/rotation_scale"), names.unique(f"{reader.name}/rotation_scale_output")
    scaled = helper.make_node("MatMul", [reader.input[0], m], [out], name=name)
    reader.input[0] = out
    graph.node.insert(next(i for i, n in enumerate(graph.node) if n.name == reader.name), scaled)
    return [name]


def _kept_ties(stream, readers_of: dict[str, int], q: np.ndarray, weight, inits, nodes,
               base_dir: str | None, sink) -> dict[str, tuple]:
    """The tables that stay tied (initializer -> its rotated value as stored, handed to ``sink``, and
    its dtype): read by exactly one lookup and one reader, lm_head reading the initializer as stored,
    and the lookup's path giving ``E Q`` from the rotated value (checked on the numbers)."""
    kept = {}
    for w, n in readers_of.items():
        lookups = [t for t in stream.lookups if t.weight == w]
        readers = [r for r in stream.readers if r.target.weight == w]
        if (n != 2 or len(lookups) != 1 or len(readers) != 1 or readers[0].target.weight_path
                or any(t.node == readers[0].target.node for t in stream.writers)):
            continue
        t = readers[0].target
        stored = weight(t)  # read once: lm_head's table is the model's largest weight
        wide = stored.astype(np.float64)
        rotated = _cast(q.T @ wide if t.layout == "in_out" else wide @ q, stored)
        e = weight(lookups[0])
        want = e.astype(np.float64) @ q
        path = [nodes[name] for name in lookups[0].weight_path]
        got = weight_as_consumed(numpy_helper.from_array(rotated, w), path, inits, base_dir).astype(np.float64)
        ulp = np.finfo(e.dtype).eps if np.issubdtype(e.dtype, np.floating) else 0.0  # the casts' rounding
        if got.shape == want.shape and np.allclose(got, want, rtol=0, atol=4 * ulp * np.abs(want).max()):
            del got, want, e, wide
            kept[w] = sink.put(rotated), rotated.dtype
    return kept


def _cast(value: np.ndarray, like: np.ndarray) -> np.ndarray:
    return value.astype(like.dtype)


def _bytes(graph: onnx.GraphProto) -> int:
    return sum(expected_bytes(t) for t in graph.initializer)
