"""External data from strangers: every reference is resolved and checked before a byte is read.

An ONNX tensor kept in external data names a file (``location``), an ``offset`` and a
``length``. A hostile model can name ``../secret``, an absolute path, ``/proc/self/environ``,
a device or FIFO, a symlink out of its folder, or a range past the end of its file (the class
of bug onnx fixed as CVE-2024-27318). Every such reference, in initializers, sparse
initializers, node attributes (``Constant``) and subgraphs alike, must:

- be a relative path without ``..`` that stays inside the model's folder once symlinks are
  followed (the folder's own real path is the root; in a Hugging Face cache snapshot, a link into
  its repository's ``blobs`` folder is inside too: graphcal.limits.confinement);
- name a regular file (never a device, FIFO, socket or folder);
- hold exactly the bytes its ``dims`` and type need (``length``, when given, must say so too),
  at an ``offset`` within the file.

:func:`check_external_data` checks a whole model before anything is read or handed to
onnxruntime; :func:`read_tensor_bytes` checks again as it reads (the file could change in
between) and reads with ``pread`` from a descriptor opened on a regular file only, which must be
the file the load recorded, unchanged (graph.identity).

One exception, for graphcal's own files only: a tensor a run wrote itself into a data file of its own
(graph.own_data: the rotated weights, in the run's temporary folder) names that file by its absolute
path, and :func:`resolve` takes it where the file and the tensor's exact range were registered by the
writer (:func:`register_own`). A model read from disk never gets that exemption
(:func:`check_external_data` refuses every absolute path, registered or not).
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import onnx
from onnx.helper import tensor_dtype_to_np_dtype

from graphcal.errors import GraphcalError
from graphcal.graph import identity
from graphcal.limits import check_fits, confinement, file_kind, leads_inside, open_regular


@dataclass(frozen=True)
class ExternalRef:
    """Where one tensor's bytes are: a checked regular file inside the model's folder."""

    path: str  # real path, inside the model's folder
    offset: int
    length: int
    named: str = ""  # the path as the model names it (its folder joined with the location), for messages


def all_tensors(model: onnx.ModelProto, initializers: bool = True) -> Iterator[onnx.TensorProto]:
    """Every TensorProto that may carry data: initializers, sparse initializers, tensor
    attributes, in the main graph, every subgraph and every local function (without the main
    graph's initializers when ``initializers`` is false)."""
    yield from _graph_tensors(model.graph, initializers)
    for function in model.functions:
        for node in function.node:
            yield from _node_tensors(node)


def _graph_tensors(graph: onnx.GraphProto, initializers: bool = True) -> Iterator[onnx.TensorProto]:
    if initializers:
        yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node: onnx.NodeProto) -> Iterator[onnx.TensorProto]:
    for attr in node.attribute:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        if attr.HasField("sparse_tensor"):
            yield attr.sparse_tensor.values
            yield attr.sparse_tensor.indices
        for sparse in attr.sparse_tensors:
            yield sparse.values
            yield sparse.indices
        if attr.HasField("g"):
            yield from _graph_tensors(attr.g)
        for g in attr.graphs:
            yield from _graph_tensors(g)


def is_external(t: onnx.TensorProto) -> bool:
    return t.data_location == onnx.TensorProto.EXTERNAL


def expected_bytes(t: onnx.TensorProto) -> int:
    """The bytes ``t``'s dims and type need in raw form (sub-byte types packed)."""
    bits = element_bits(t.data_type)
    if bits is None:
        raise GraphcalError(f"tensor {t.name!r} has type {t.data_type}, which cannot be kept in external data")
    if any(d < 0 for d in t.dims):
        raise GraphcalError(f"tensor {t.name!r} has a negative dimension {list(t.dims)}")
    return -(-math.prod(t.dims) * bits // 8)


def element_bits(data_type: int) -> int | None:
    """Bits per element of an ONNX tensor type as stored in ``raw_data`` (sub-byte types packed);
    None for strings and types onnx cannot map."""
    if data_type in _SUB_BYTE_BITS:
        return _SUB_BYTE_BITS[data_type]
    if data_type == onnx.TensorProto.STRING:
        return None
    try:
        return 8 * tensor_dtype_to_np_dtype(data_type).itemsize
    except (KeyError, ValueError, TypeError):
        return None


_SUB_BYTE_BITS = {onnx.TensorProto.INT4: 4, onnx.TensorProto.UINT4: 4, onnx.TensorProto.FLOAT4E2M1: 4}
_SUB_BYTE_BITS |= {getattr(onnx.TensorProto, n): 2 for n in ("INT2", "UINT2") if hasattr(onnx.TensorProto, n)}


_OWN: dict[str, set[tuple[int, int]]] = {}  # real path of a data file graphcal wrote -> (offset, length) of each tensor in it


def register_own(path: str | os.PathLike, offset: int, length: int) -> None:
    """Record that graphcal itself wrote a tensor's ``length`` bytes at ``offset`` in the file at ``path``."""
    _OWN.setdefault(os.path.realpath(path), set()).add((offset, length))


def forget_own(path: str | os.PathLike) -> None:
    """Drop every record of graphcal's own data file at ``path`` (removed, or about to be)."""
    _OWN.pop(os.path.realpath(path), None)


def own_ref(t: onnx.TensorProto) -> ExternalRef | None:
    """Where ``t``'s bytes are if graphcal wrote them itself (:func:`register_own`: that file, that exact
    range), checked as :func:`resolve` checks a model's references; None for any other tensor."""
    if not _OWN or not is_external(t):
        return None
    info = {e.key: e.value for e in t.external_data}
    location = info.get("location", "")
    if not os.path.isabs(location) or "\x00" in location:
        return None
    real = os.path.realpath(location)
    ranges = _OWN.get(real)
    try:
        offset, length = int(info.get("offset", "0")), int(info.get("length", "-1"))
    except ValueError:
        return None
    if ranges is None or (offset, length) not in ranges or length != expected_bytes(t):
        return None
    try:
        st = os.stat(real)
    except OSError as e:
        raise GraphcalError(f"graphcal's own data file {location} of {t.name!r} cannot be read "
                            f"({e.strerror or e}); was the run's temporary folder removed?") from None
    if not stat.S_ISREG(st.st_mode) or offset + length > st.st_size:
        raise GraphcalError(f"graphcal's own data file {location} of {t.name!r} was changed during the run")
    return ExternalRef(real, offset, length, location)


def own_path(t: onnx.TensorProto) -> str | None:
    """The real path of graphcal's own data file holding ``t`` (:func:`own_ref`), None for a model's tensor."""
    ref = own_ref(t)
    return ref.path if ref is not None else None


def resolve(t: onnx.TensorProto, base_dir: str | os.PathLike, own: bool = True) -> ExternalRef:
    """Check one external reference against ``base_dir`` (the model's folder); no data is read.
    ``own``: a tensor graphcal wrote into a file of its own is found there (:func:`own_ref`)."""
    name = t.name or "<unnamed>"
    info: dict[str, str] = {}
    for entry in t.external_data:
        if entry.key in info:
            raise GraphcalError(f"external data of {name!r} gives {entry.key!r} twice")
        info[entry.key] = entry.value
    location = info.get("location", "")
    if not location:
        raise GraphcalError(f"external data of {name!r} names no file (no 'location')")
    if own and (ref := own_ref(t)) is not None:
        return ref
    if "\x00" in location or os.path.isabs(location) or location.startswith(("/", "\\")) or ":" in location[:2]:
        raise GraphcalError(f"external data of {name!r} is at an absolute path {location!r}; "
                            "graphcal reads only files inside the model's folder")
    if ".." in Path(location.replace("\\", "/")).parts:
        raise GraphcalError(f"external data of {name!r} is at {location!r}, which leaves the model's folder")
    roots = confinement(base_dir)  # the folder's real path; in a Hugging Face snapshot, its repository's blobs too
    real = os.path.realpath(os.path.join(roots[0], location))
    if not leads_inside(roots, real):
        raise GraphcalError(f"external data of {name!r} ({location!r}) leads outside the model's folder "
                            f"(a symbolic link to {real}); graphcal reads only files inside it")
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise GraphcalError(f"external data file {location!r} of {name!r} is missing; "
                            "keep the data files next to the model") from None
    except OSError as e:
        raise GraphcalError(f"external data file {location!r} of {name!r} cannot be read ({e.strerror})") from e
    if not stat.S_ISREG(st.st_mode):
        raise GraphcalError(f"external data {location!r} of {name!r} is {file_kind(st.st_mode)}, not a regular file")
    offset = _non_negative(info.get("offset", "0"), "offset", name)
    need = expected_bytes(t)
    if "length" in info:
        length = _non_negative(info["length"], "length", name)
        if length != need:
            raise GraphcalError(f"external data of {name!r} has length {length}, but its dims {list(t.dims)} "
                                f"need {need} bytes")
    else:
        length = need
    if offset + length > st.st_size:
        raise GraphcalError(f"external data of {name!r} lies past the end of {location!r} "
                            f"(offset {offset} + {length} bytes > {st.st_size} bytes)")
    return ExternalRef(real, offset, length, os.path.join(base_dir, location))


def rebase(t: onnx.TensorProto, base_dir: str | os.PathLike, root: str | os.PathLike) -> None:
    """Point ``t``'s external reference (checked against ``base_dir``, its model's folder) at the
    same bytes as a path relative to ``root``, a folder holding the model's folder: for one onnxruntime
    session over two models' data (eval), which reads one folder and refuses paths out of it. The
    path is the location as the model names it, under the folder's real path (links in it are
    followed when the file is opened, as they were checked). A tensor in graphcal's own data file
    (:func:`own_ref`) keeps its absolute reference."""
    if resolve(t, base_dir).path == own_path(t):
        return
    real_root = os.path.realpath(root)
    for entry in t.external_data:
        if entry.key == "location":  # the name as the model gives it, not its link's target (a snapshot's blob)
            named = os.path.join(os.path.realpath(base_dir), entry.value)
            if os.path.commonpath([real_root, named]) != real_root:
                raise GraphcalError(f"external data of {t.name!r} is not inside {root}")
            entry.value = os.path.relpath(named, real_root)


def common_root(models: list[tuple[onnx.ModelProto, str | os.PathLike]]) -> Path | None:
    """The folder onnxruntime reads several models' external data from when they run as one session
    (it takes one folder and refuses paths out of it): the deepest folder holding the folder of every
    model (given with its path) that keeps weights on disk, and a Hugging Face snapshot's blobs
    (onnxruntime follows links and refuses targets out of its folder), their references rewritten relative to
    it (each checked against its own model's folder first). None when no weight is external."""
    holding = [(model, Path(path).parent) for model, path in models if any(map(is_external, model.graph.initializer))]
    if not holding:
        return None
    try:
        root = Path(os.path.commonpath([r for _, folder in holding for r in confinement(folder)]))  # a snapshot's blobs too
    except ValueError:  # folders on different drives (Windows)
        raise GraphcalError("the two models' weights are on different drives; put both models on one drive "
                            "to compare them") from None
    for model, folder in holding:
        for t in model.graph.initializer:
            if is_external(t):
                rebase(t, folder, root)
    return root


def check_external_data(model: onnx.ModelProto, base_dir: str | os.PathLike,
                        where: str | os.PathLike) -> tuple[str, ...]:
    """Check every external reference of ``model`` against ``base_dir``; return the data files
    they name (sorted; empty when every tensor is inline).

    Raises GraphcalError (prefixed with ``where``) for the first bad one, before anything is read.
    """
    files = set()
    for t in all_tensors(model):
        if is_external(t):
            try:
                resolve(t, base_dir, own=False)  # a model read from disk names no file of graphcal's
            except GraphcalError as e:
                raise GraphcalError(f"{where}: {e}") from None
            files.update(e.value for e in t.external_data if e.key == "location")
    return tuple(sorted(files))


def read_tensor_bytes(t: onnx.TensorProto, base_dir: str | os.PathLike) -> bytes:
    """The raw bytes of one external tensor, checked again as it is read."""
    return bytes(read_tensor_buffer(t, base_dir))


def read_tensor_buffer(t: onnx.TensorProto, base_dir: str | os.PathLike) -> bytearray:
    """The raw bytes of one external tensor in a buffer of its own (numpy can view it writable),
    read straight into it, checked again as it is read."""
    ref = _checked_ref(t, base_dir)
    check_fits(ref.length, f"tensor {t.name!r}", share=0.9)
    buffer = bytearray(ref.length)
    view = memoryview(buffer)
    with open_regular(ref.path, f"external data of {t.name!r}") as f:
        fd, done = f.fileno(), 0
        identity.check_open(fd, ref.path, ref.named)  # the file the load checked, unchanged since
        while done < ref.length:
            got = os.preadv(fd, [view[done:done + (1 << 30)]], ref.offset + done)
            if not got:
                raise GraphcalError(f"external data of {t.name!r} ended early (the file shrank while reading)")
            done += got
        identity.check_open(fd, ref.path, ref.named)  # and not written to while it was read
    return buffer


def external_stub(t: onnx.TensorProto, location: str, offset: int, length: int) -> onnx.TensorProto:
    """A new proto with ``t``'s name, dims and type, its bytes at ``offset`` in the data file ``location``."""
    stub = onnx.TensorProto(name=t.name, dims=t.dims, data_type=t.data_type, data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = stub.external_data.add()
        entry.key, entry.value = key, value
    return stub


COPY_CHUNK = 64 << 20  # bytes in hand while a tensor is copied from the input's data file to the output's


def copy_tensor(t: onnx.TensorProto, base_dir: str | os.PathLike, out: BinaryIO, chunk: int | None = None) -> int:
    """Append one external tensor's raw bytes to the open file ``out``, ``chunk`` bytes at a time (one
    buffer of that size in memory, not the tensor; None: :data:`COPY_CHUNK`), checked as
    :func:`read_tensor_buffer` checks them; returns the bytes copied."""
    ref = _checked_ref(t, base_dir)
    view = memoryview(bytearray(max(1, min(chunk or COPY_CHUNK, ref.length))))
    with open_regular(ref.path, f"external data of {t.name!r}") as f:
        fd, done = f.fileno(), 0
        identity.check_open(fd, ref.path, ref.named)  # the file the load checked, unchanged since
        while done < ref.length:
            got = os.preadv(fd, [view[:min(len(view), ref.length - done)]], ref.offset + done)
            if not got:
                raise GraphcalError(f"external data of {t.name!r} ended early (the file shrank while reading)")
            out.write(view[:got])
            done += got
        identity.check_open(fd, ref.path, ref.named)  # and not written to while it was read
    return ref.length


def _checked_ref(t: onnx.TensorProto, base_dir: str | os.PathLike) -> ExternalRef:
    try:
        return resolve(t, base_dir)
    except GraphcalError:  # a data file the load recorded and that changed since (shrank, went) says so first
        identity.check_unchanged(os.path.join(base_dir, e.value) for e in t.external_data if e.key == "location")
        raise


def inline(t: onnx.TensorProto, base_dir: str | os.PathLike) -> None:
    """Read ``t``'s external bytes into ``t`` itself (as onnx's loader does, with the checks)."""
    raw = read_tensor_bytes(t, base_dir)
    del t.external_data[:]
    t.data_location = onnx.TensorProto.DEFAULT
    t.raw_data = raw


def _non_negative(value: str, key: str, name: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise GraphcalError(f"external data of {name!r} has {key} {value!r}, not an integer") from None
    if number < 0:
        raise GraphcalError(f"external data of {name!r} has a negative {key} ({number})")
    return number

