"""Load and save ONNX models: external data, IR/opset versions, atomic writes.

What a stored tensor holds and where its bytes are (``element_bits``, ``expected_bytes``, the checked
external references) is :mod:`graphcal.graph.external`'s; this module builds on it, never the reverse.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError, EncodeError

from graphcal.errors import GraphcalError, first_line
from graphcal.graph import identity
from graphcal.graph.check import check_graph, subgraphs
from graphcal.graph.edit import name_nodes
from graphcal.graph.external import (
    all_tensors,
    check_external_data,
    copy_tensor,
    element_bits,
    expected_bytes,
    external_stub,
    inline,
    is_external,
    read_tensor_buffer,
)
from graphcal.graph.spill import DataSpill
from graphcal.graph.stored import check_tensors
from graphcal.graph.wire import strip_inline_weights
from graphcal.limits import check_fits, confinement, leads_inside, open_regular

# The highest IR version written models get (graph.qdq.opset.ir_for_opset caps onnx's IR for the opset here):
# onnxruntime 1.31 loads IR up to 13 and refuses 14 ("max supported IR version: 13"); onnx pairs IR 14 with opset 28.
MAX_ORT_IR = 13
PROTOBUF_LIMIT = 2**31 - 1
MAX_MODEL_FILE = 2**31  # protobuf parses no larger message: past it, a model must keep weights in external data
SIZE_MARGIN = 64 << 20  # an estimated size this close to PROTOBUF_LIMIT is checked exactly
LAZY_MIN_BYTES = 1 << 20  # external tensors under 1 MB are loaded at once; larger ones when read


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Load an ONNX model with its external data; raise GraphcalError for anything unreadable."""
    return load_model_info(path)[0]


def load_model_info(path: str | os.PathLike, lazy: bool = False) -> tuple[onnx.ModelProto, tuple[str, ...]]:
    """(model, the external data files it reads: empty when it keeps every weight inline).

    The model comes from strangers: the file must be a regular file, the graph well formed
    (:mod:`graphcal.graph.check`), every tensor's values what its type and dims need
    (:mod:`graphcal.graph.stored`) and every external-data reference inside the model's folder
    (:mod:`graphcal.graph.external`), all checked before any tensor is read. External data is
    loaded into the model unless ``lazy``: then the tensors keep their references, and readers
    pass the model's folder as ``base_dir`` (each weight is read when needed, once). A lazy
    inline model gets the same: its large weights become references into the model file itself
    (graph.wire), which the returned data files never list. The model file and each data file are
    recorded as first opened (graph.identity): every later read refuses a file changed since. Every node
    of the returned model has a name of its own (graph.edit.name_nodes).
    """
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise GraphcalError(f"model file not found: {path}")
    if path.is_dir():
        raise GraphcalError(f"model path is a folder, not an .onnx file: {path}")
    with open_regular(path, "model file") as f:
        identity.record(f.fileno(), path)  # lazy weights are read from this file later: it must stay this file
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise GraphcalError(f"model file is empty: {path}")
        if size > MAX_MODEL_FILE:
            raise GraphcalError(f"{path} is not a readable ONNX model ({size:,} bytes: past protobuf's 2 GB; "
                                "a model this large keeps its weights in external data)")
        # Lazy: an inline model's large weights stay in its file, referenced where they lie (graph.wire)
        try:
            stripped = strip_inline_weights(f.fileno(), path.name, LAZY_MIN_BYTES) if lazy and _plain_name(path) else None
        except GraphcalError as e:  # a large tensor that does not parse, named
            raise GraphcalError(f"{path}: {e}") from None
        check_fits(size if stripped is None else len(stripped[0]), f"model file {path}", share=0.9)
        try:
            model = onnx.load_model_from_string(f.read() if stripped is None else stripped[0])
        except (DecodeError, RuntimeError, ValueError, OSError) as e:
            raise GraphcalError(f"{path} is not a readable ONNX model ({first_line(e)})") from e
    if not model.graph.node:
        raise GraphcalError(f"{path} is not a readable ONNX model (its graph has no nodes)")
    check_graph(model, str(path))
    check_tensors(model, str(path))  # every tensor's values agree with its type and dims, before any pass
    name_nodes(model.graph)  # graphcal finds nodes by name; ONNX's names are optional and need not be unique
    base_dir = path.parent
    external = check_external_data(model, base_dir, path)
    model_file = os.path.realpath(path)
    for name in external:  # each data file as it is now: every later read must find it so (graph.identity)
        if os.path.realpath(base_dir / name) != model_file:  # the model file was recorded as it was parsed
            with open_regular(base_dir / name, "external data file") as data:
                identity.record(data.fileno(), base_dir / name)
    # Lazy: weights stay on disk and are read once when needed; small constants (shapes, norms),
    # and tensors outside the initializer list (Constant attributes, subgraphs), come inline.
    wanted = [t for t in model.graph.initializer if is_external(t) and not (lazy and expected_bytes(t) >= LAZY_MIN_BYTES)]
    wanted += [t for t in all_tensors(model, initializers=False) if is_external(t)]
    for t in wanted:
        try:
            inline(t, base_dir)
        except GraphcalError as e:
            raise GraphcalError(f"{path}: {e}") from None
    if stripped is not None:  # the model file itself is no data file of its own
        external = tuple(f for f in external if f != path.name)
    return model, external


def _plain_name(path: Path) -> bool:
    """Whether the model file's name can be an external-data location (graph.external.resolve's rules):
    a plain name, and the file (maybe a link: a Hugging Face snapshot's) inside its folder's confinement."""
    return (":" not in path.name[:2] and not path.name.startswith("\\")
            and leads_inside(confinement(path.parent), os.path.realpath(path)))


def model_files(path: str | os.PathLike, data_files: tuple[str, ...] = ()) -> dict[str, int]:
    """Bytes on disk of the model file and of each external data file it reads (``data_files``
    from :func:`load_model_info`, which checked them), keyed by path."""
    path = Path(path)
    return {str(p): p.stat().st_size for p in [path, *(path.parent / name for name in data_files)]}


def model_bytes(path: str | os.PathLike) -> int:
    """Bytes on disk of the model file at ``path`` and of the external data files it reads (its graph
    read and checked by :func:`load_model_info`, the weights left on disk): a model's size, not its folder's."""
    return sum(model_files(path, load_model_info(path, lazy=True)[1]).values())


def value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto.Tensor]:
    """Element type and shape of every graph value, by name, from onnx shape inference.

    Inference runs on a hollow copy whose initializers carry dims and types but no data, so a
    big model is neither serialized nor copied. Best effort: values it cannot type are absent.
    """
    hollow = hollow_copy(model)
    for t in model.graph.initializer:
        hollow.graph.initializer.append(onnx.TensorProto(name=t.name, dims=t.dims, data_type=t.data_type))
    values = list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)
    try:
        values += list(onnx.shape_inference.infer_shapes(hollow).graph.value_info)
    except Exception:  # noqa: BLE001 -- inference is best effort; onnxruntime types outputs itself
        pass
    for t in model.graph.initializer:
        values.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return {v.name: v.type.tensor_type for v in values if v.type.HasField("tensor_type")}


# Element types onnxruntime 1.31's CPU provider has no Q/DQ kernels for (reference/onnx_qdq.md).
NOT_IN_ONNXRUNTIME = frozenset({onnx.TensorProto.FLOAT4E2M1, onnx.TensorProto.FLOAT8E8M0})


def runs_in_onnxruntime(model: onnx.ModelProto) -> bool:
    """False for models holding fp4 / e8m0 tensors, which need onnx.reference (or TensorRT) instead."""
    return not any(t.data_type in NOT_IN_ONNXRUNTIME for t in model.graph.initializer)


def default_opset(model: onnx.ModelProto) -> int:
    """The opset of the default ONNX domain (0 if the model declares none)."""
    for op in model.opset_import:
        if op.domain in ("", "ai.onnx"):
            return op.version
    return 0


def save_with_external_data(model: onnx.ModelProto, path: Path, threshold: int = 1024,
                            base_dir: str | os.PathLike | None = None, spill: DataSpill | None = None) -> list[Path]:
    """Write ``model`` to ``path`` with tensors over ``threshold`` bytes in ``<name>.data``,
    without modifying ``model`` or copying it whole (onnx's own saver rewrites the tensors in place).

    Tensors are written one at a time; the graph file holds a hollow copy that references them.
    Tensors kept in typed fields instead of raw bytes (rare, and small) stay in the graph file.
    Tensors still in the source model's external data (``base_dir``) are copied over one by one, a chunk at a time.
    ``spill``: the data file the weight phase wrote already (graph.spill, at ``<name>.data``): its
    tensors keep their references, the others are appended after them.
    """
    data_path = path.with_name(path.name + ".data")
    hollow = hollow_copy(model)
    g = hollow.graph
    offset = 0
    if spill is not None:
        if spill.path != data_path:
            raise ValueError(f"the streamed data file {spill.path} is not {data_path}")
        spill.close()
        offset = spill.offset
    with open(data_path, "ab" if spill is not None else "wb") as data:
        for t in model.graph.initializer:
            if spill is not None and t.name in spill.names and is_external(t):
                g.initializer.append(t)  # written already, as it was made
                continue
            if is_external(t) and base_dir is not None:
                if expected_bytes(t) < threshold:  # small: inline, no longer pointing at the source's file
                    g.initializer.append(onnx.TensorProto(name=t.name, dims=t.dims, data_type=t.data_type,
                                                          raw_data=bytes(read_tensor_buffer(t, base_dir))))
                    continue
                g.initializer.append(external_stub(t, data_path.name, offset, expected_bytes(t)))
                offset += copy_tensor(t, base_dir, data)  # a chunk at a time: never the whole tensor in memory
                continue
            raw = t.raw_data if t.HasField("raw_data") else None
            if raw is None or len(raw) < threshold:
                g.initializer.append(t)
                continue
            g.initializer.append(external_stub(t, data_path.name, offset, len(raw)))
            data.write(raw)
            offset += len(raw)
    with open(path, "wb") as f:
        f.write(hollow.SerializeToString())
    return [path, data_path]


def hollow_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model without its initializers (graph, opsets, metadata): cheap for any size."""
    hollow = onnx.ModelProto()
    for field in ("ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(hollow, field, getattr(model, field))
    hollow.opset_import.extend(model.opset_import)
    hollow.metadata_props.extend(model.metadata_props)
    hollow.functions.extend(model.functions)
    g = hollow.graph
    g.name, g.doc_string = model.graph.name, model.graph.doc_string
    for name in ("node", "input", "output", "value_info", "sparse_initializer"):
        getattr(g, name).extend(getattr(model.graph, name))
    return hollow


def skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """:func:`hollow_copy` plus each initializer's name, type and dims (no data): the graph's
    structure as it is now, for walks that must not see the edits made to ``model`` later."""
    frame = hollow_copy(model)
    for t in model.graph.initializer:
        frame.graph.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims)
    return frame


def past_protobuf_limit(model: onnx.ModelProto) -> bool:
    """Whether ``model`` cannot be one protobuf (2 GB); upb refuses to even size such a message.

    upb sizes a message by encoding it, which costs as much as writing the model out, so the
    size is first estimated from the graph without its weights plus each inline weight's
    ``dims`` x element size; only an estimate within 64 MB of the limit is checked exactly.
    """
    estimate = _estimated_size(model)
    if estimate is not None and estimate < PROTOBUF_LIMIT - SIZE_MARGIN:
        return False
    if estimate is not None and estimate > PROTOBUF_LIMIT + SIZE_MARGIN:
        return True
    try:
        return model.ByteSize() >= PROTOBUF_LIMIT
    except (EncodeError, ValueError):
        return True


def _estimated_size(model: onnx.ModelProto) -> int | None:
    """The model's serialized size within a few bytes per tensor, or None where it cannot be
    told without encoding (string tensors, large typed fields). Reads no weight bytes."""
    total = hollow_copy(model).ByteSize()
    for t in model.graph.initializer:
        total += len(t.name) + 16 * len(t.dims) + 32
        if t.data_location == onnx.TensorProto.EXTERNAL:
            total += sum(len(e.key) + len(e.value) + 8 for e in t.external_data)
            continue
        bits = element_bits(t.data_type)
        count = math.prod(t.dims)
        if bits is not None and t.HasField("raw_data"):
            total += -(-count * bits // 8)
        elif bits is not None and count <= 4096:  # a small typed field: up to 10 bytes an element (varints)
            total += 10 * count
        else:
            return None
    return total


def save_model(model: onnx.ModelProto, path: Path, external: bool = False,
               base_dir: str | os.PathLike | None = None, unchecked: frozenset[str] = frozenset(),
               spill: DataSpill | None = None) -> list[Path]:
    """Write ``model`` to ``path``; with ``external``, and always over 2 GB, the weights go to
    ``<name>.data`` beside it (one file, tensors over 1 KB). Without ``external``, weights still
    referenced in the input's file (a lazy inline model) are read into ``model`` first.

    The written file is checked with ``onnx.checker`` (from the file, so external data and
    models past 2 GB are checked too); a model it rejects is an error, never an output.
    ``unchecked``: default-domain op types onnx has no schema for, which the input held too
    (:func:`unchecked_ops`); the checker passes over them as it would over a custom domain's.
    ``spill``: the weights written already into ``<name>.data`` (graph.spill); the output keeps external data.
    Returns the files written.
    """
    external = external or spill is not None
    if not external:  # weights still referenced in the (inline) input file come into the model
        for t in model.graph.initializer:
            if is_external(t):
                if base_dir is None:
                    raise GraphcalError(f"weight {t.name!r} is in external data, but no model folder was given")
                inline(t, base_dir)
                t.ClearField("data_location")  # as the tensor was in the input file
    if not external and not past_protobuf_limit(model):
        onnx.save_model(model, str(path))
        files = [path]
    else:
        files = save_with_external_data(model, path, base_dir=base_dir, spill=spill)
    check_written(path, unchecked)
    return files


UNCHECKED_DOMAIN = "graphcal.unchecked"  # where the checker's view puts ops onnx has no schema for


def unchecked_ops(model: onnx.ModelProto) -> frozenset[str]:
    """Op types the model runs in the default ONNX domain that onnx has no schema for at its opset:
    onnxruntime's contrib ops as onnxruntime-genai's builder writes them (SimplifiedLayerNormalization,
    which onnxruntime registers in both domains), or an op newer than the model's opset. onnx's
    checker refuses such a model, input and output alike; onnxruntime runs it."""
    opset = default_opset(model)
    local = {(f.domain, f.name) for f in model.functions}
    found = set()
    for graph in _graphs(model.graph):
        for node in graph.node:
            if node.domain not in ("", "ai.onnx") or (node.domain, node.op_type) in local:
                continue
            try:
                onnx.defs.get_schema(node.op_type, opset, "")
            except onnx.defs.SchemaError:
                found.add(node.op_type)
    return frozenset(found)


def _graphs(graph: onnx.GraphProto):
    """``graph`` and every graph nested in its nodes."""
    yield graph
    for node in graph.node:
        for sub in subgraphs(node):
            yield from _graphs(sub)


def check_written(path: Path, unchecked: frozenset[str] = frozenset()) -> None:
    """``onnx.checker`` on a model file graphcal wrote; its complaint becomes a GraphcalError.
    With ``unchecked`` op types, the checker reads a view of the file in which those nodes are in a
    domain of their own (a small file beside it, sharing its external data, removed after)."""
    try:
        if not unchecked:
            onnx.checker.check_model(str(path))
        else:
            _check_view(path, unchecked)
    except (onnx.checker.ValidationError, ValueError, RuntimeError) as e:
        raise GraphcalError(f"the written model fails onnx's checker, so it was not kept ({first_line(e)}); "
                            "this is a graphcal bug or a model onnx cannot represent: please report it") from e


def set_domain(model: onnx.ModelProto, op_types: frozenset[str], old: str, new: str) -> None:
    """Move the nodes of ``op_types`` in domain ``old`` ("" covers "ai.onnx") to domain ``new``, subgraphs included."""
    olds = ("", "ai.onnx") if old in ("", "ai.onnx") else (old,)
    for graph in _graphs(model.graph):
        for node in graph.node:
            if node.domain in olds and node.op_type in op_types:
                node.domain = new


def _check_view(path: Path, unchecked: frozenset[str]) -> None:
    view = onnx.load(str(path), load_external_data=False)
    set_domain(view, unchecked, "", UNCHECKED_DOMAIN)
    view.opset_import.append(onnx.helper.make_opsetid(UNCHECKED_DOMAIN, 1))
    if not any(map(is_external, view.graph.initializer)):
        onnx.checker.check_model(view)
        return
    at = path.with_name(f".graphcal-check-{path.name}")  # beside the file, so its data references resolve
    try:
        onnx.save_model(view, str(at))
        del view
        onnx.checker.check_model(str(at))
    finally:
        at.unlink(missing_ok=True)
