"""Calibration data: .npz files (or a folder of them, or a CalibrationDataReader) -> validated batches.

An .npz holds one array per model input, keyed by input name, whose first dimension is the
sample dimension and doubles as the model's batch dimension: ``input_ids`` of shape
``(num_samples, seq)`` for a model input ``[batch, seq]``. A folder holds several such files
(one or more batches each, e.g. different sequence lengths); batches never span files.

Everything is checked against the graph's inputs before anything runs, from the array headers
alone (nothing is loaded for the checks): names, dtypes, ranks, fixed dimensions, and that
inputs of one file agree on the batch and on shared symbolic dimensions.

The data comes from strangers, so reading it is bounded:

- only regular files are opened (a FIFO, ``/dev/zero``, a socket or a device named as data, or
  as ``x.npz`` inside a data folder, is refused: the open cannot block and nothing is read);
- every array's .npy header must agree with its zip entry's uncompressed size (a lying header
  is refused), and one batch of every input must fit in half the available memory, both
  checked from the headers before anything is read;
- batches are streamed: each array is opened once per pass and read forward, ``batch_size``
  rows at a time, and only the rows the run uses (``num_samples``) are decompressed. A
  Fortran-ordered array cannot be read by rows and is read whole, once (after the memory check).
"""

from __future__ import annotations

import ast
import contextlib
import lzma
import math
import os
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx

from graphcal.errors import GraphcalError, UsageError
from graphcal.limits import available_memory as _available_memory  # a module name tests can patch
from graphcal.limits import format_size, open_regular

DEFAULT_BATCH_SIZE = 8
# numpy's own limit on an .npy header's text (np.load refuses longer headers without allow_pickle)
_MAX_HEADER_SIZE = getattr(np.lib.format, "_MAX_HEADER_SIZE", 10000)
_READ_CHUNK = 1 << 22  # bytes per read() while streaming rows
# What reading a damaged zip member can raise: a bad CRC or local header, a broken deflate, bz2 or
# lzma stream, a truncated file, an unsupported compression method or an encrypted entry.
_DAMAGED = (zipfile.BadZipFile, zlib.error, lzma.LZMAError)
_READ_ERRORS = (*_DAMAGED, EOFError, OSError, ValueError, struct.error, NotImplementedError, RuntimeError, MemoryError)


@dataclass(frozen=True)
class InputSpec:
    """A graph input: name, numpy dtype and shape (ints for fixed dims, str/None for free ones)."""

    name: str
    dtype: np.dtype
    shape: tuple[int | str | None, ...]


@dataclass(frozen=True)
class _Member:
    """An array inside an .npz, as its .npy header and the zip's central directory describe it."""

    entry: str  # the zip entry's name ("input_ids.npy")
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool
    offset: int  # bytes of .npy magic + header before the data
    file_size: int  # the zip entry's uncompressed size (== offset + nbytes, checked)

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize if self.shape else self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def whole(self) -> bool:
        """Read whole, not by rows: a scalar, or a Fortran-ordered array (its rows are not contiguous)."""
        return not self.shape or (self.fortran_order and len(self.shape) > 1)


@dataclass(frozen=True)
class _Source:
    label: str  # file path or "<arrays>" for in-memory data
    headers: dict[str, tuple[tuple[int, ...], np.dtype]]  # name -> (shape, dtype)
    arrays: Mapping[str, np.ndarray] | None = None  # in-memory data; None means read the file
    members: Mapping[str, _Member] | None = None  # the file's arrays (name -> member), when read from a file

    @property
    def num_samples(self) -> int:
        return next(shape[0] for shape, _ in self.headers.values() if shape)


def graph_inputs(model: onnx.ModelProto) -> list[InputSpec]:
    """The inputs a caller must feed (graph inputs that are not initializers)."""
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for value in model.graph.input:
        if value.name in inits:
            continue
        tt = value.type.tensor_type
        if not value.type.HasField("tensor_type"):
            raise GraphcalError(f"model input {value.name!r} is not a tensor; graphcal feeds tensors only")
        dims = tuple(
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim
        )
        specs.append(InputSpec(value.name, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)), dims))
    return specs


class CalibrationData:
    """Validated calibration data; iterate :meth:`batches` to stream it one batch at a time."""

    def __init__(self, sources: list[_Source], inputs: list[InputSpec], batch_size: int, num_samples: int | None):
        self._sources = sources
        self._inputs = inputs
        self.batch_size = batch_size
        # A model with a fixed batch dimension cannot take a short last batch.
        self._drop_last = _fixed_batch(inputs) is not None
        available = sum(s.num_samples for s in sources)
        self.num_samples = available if num_samples is None else min(num_samples, available)

    @property
    def num_batches(self) -> int:
        left, count = self.num_samples, 0
        for s in self._sources:
            take = min(left, s.num_samples)
            count += take // self.batch_size if self._drop_last else -(-take // self.batch_size)
            left -= take
            if left == 0:
                break
        return count

    def batches(self) -> Iterator[dict[str, np.ndarray]]:
        """The run's batches in order, each checked for NaN/Inf; one batch is held at a time.

        Each file is opened once per call and each of its arrays read forward once, only as far
        as ``num_samples`` reaches."""
        left = self.num_samples
        names = [spec.name for spec in self._inputs]
        for source in self._sources:
            if left <= 0:
                return
            n = min(left, source.num_samples)
            left -= n
            if n == 0:
                continue
            with _rows(source, names) as take:
                for start in range(0, n, self.batch_size):
                    stop = min(start + self.batch_size, n)
                    if self._drop_last and stop - start < self.batch_size:
                        break
                    batch = take(start, stop)
                    _check_finite(batch, source.label, start)
                    yield batch

    def check_values(self) -> int:
        """Stream every batch the run would use once and refuse NaN or Inf, as :meth:`batches`
        does (same error, naming the sample); one batch is held at a time. For runs that make
        no activation pass (dynamic activations only), so that bad data is still refused.
        Returns the number of batches checked."""
        count = 0
        for _ in self.batches():
            count += 1
        return count


class ReaderData:
    """Batches from an onnxruntime ``CalibrationDataReader`` (anything with ``get_next()``), as
    quantize_static users have them: streamed once, each batch checked like an .npz file before
    it runs. The reader's batches are used as they come; ``num_samples`` caps the total."""

    def __init__(self, reader, inputs: list[InputSpec], num_samples: int | None):
        self._reader = reader
        self._inputs = inputs
        self._cap = num_samples
        self._fixed_batch = _fixed_batch(inputs)
        self.num_samples = 0  # counted while streaming
        self.num_batches = 0
        self._used = False

    def batches(self) -> Iterator[dict[str, np.ndarray]]:
        if self._used:
            raise GraphcalError("a CalibrationDataReader can be read once; make a new one for another run")
        self._used = True
        while self._cap is None or self.num_samples < self._cap:
            try:
                batch = self._reader.get_next()
            except Exception as e:  # noqa: BLE001 -- the user's reader: report it as one line
                raise GraphcalError(f"the CalibrationDataReader failed on batch {self.num_batches}: "
                                    f"{type(e).__name__}: {e}") from e
            if batch is None:
                break
            if not isinstance(batch, Mapping):
                raise GraphcalError(f"the CalibrationDataReader's batch {self.num_batches} is a "
                                    f"{type(batch).__name__}, not a mapping of input names to arrays")
            arrays = {k: np.asarray(v) for k, v in batch.items()}
            source = _Source(f"CalibrationDataReader batch {self.num_batches}", _check_arrays(arrays), arrays=arrays)
            _validate(source, self._inputs, self._fixed_batch)
            n = source.num_samples
            if self._cap is not None and self.num_samples + n > self._cap:
                n = self._cap - self.num_samples
                arrays = {k: _slice(v, 0, n) for k, v in arrays.items()}
            _check_finite(arrays, source.label, 0)
            self.num_samples += n
            self.num_batches += 1
            yield {spec.name: np.ascontiguousarray(arrays[spec.name]) for spec in self._inputs}
        if self.num_batches == 0:
            raise GraphcalError("the CalibrationDataReader gave no batches (get_next() returned None at once)")

    def check_values(self) -> int:
        """Nothing to do ahead: a reader's batches are checked (NaN/Inf included) as they stream,
        and a reader can be read only once. Returns 0."""
        return 0


def load_data(
    data: str | Path | Mapping[str, np.ndarray],
    inputs: list[InputSpec],
    *,
    batch_size: int | None = None,
    num_samples: int | None = None,
) -> CalibrationData:
    """Open and validate calibration data for a model with ``inputs``.

    ``data`` is an .npz path, a folder of .npz files, a mapping of arrays, or an onnxruntime
    CalibrationDataReader (streamed; see :class:`ReaderData`). ``batch_size`` defaults to the
    model's fixed batch dimension, else 8.
    """
    if batch_size is not None and batch_size <= 0:
        raise UsageError(f"--batch-size must be positive, got {batch_size}")
    if num_samples is not None and num_samples <= 0:
        raise UsageError(f"--num-samples must be positive, got {num_samples}")
    if hasattr(data, "get_next"):  # an onnxruntime CalibrationDataReader
        if batch_size is not None:
            raise UsageError("batch_size does not apply to a CalibrationDataReader: its batches are used as they come")
        return ReaderData(data, inputs, num_samples)
    fixed_batch = _fixed_batch(inputs)
    if batch_size is None:
        batch_size = fixed_batch or DEFAULT_BATCH_SIZE
    elif fixed_batch and batch_size != fixed_batch:
        raise UsageError(f"the model's batch dimension is fixed at {fixed_batch}; use --batch-size {fixed_batch}")

    if isinstance(data, Mapping):
        sources = [_Source("<arrays>", _check_arrays(data), arrays=data)]
    else:
        sources = [_npz_source(p) for p in _npz_files(Path(data))]
    for s in sources:
        _validate(s, inputs, fixed_batch)
    if sum(s.num_samples for s in sources) == 0:
        raise GraphcalError(f"calibration data {data if not isinstance(data, Mapping) else '<arrays>'} holds zero samples")
    calib = CalibrationData(sources, inputs, batch_size, num_samples)
    _check_memory(sources, batch_size, calib.num_samples)
    return calib


def _npz_files(path: Path) -> list[Path]:
    """The .npz files to read: ``path`` itself, or a folder's ``*.npz`` entries (sorted; other
    entries and subfolders are ignored, but a ``*.npz`` entry that is not a regular file is an
    error when it is opened)."""
    if not path.exists() and not path.is_symlink():
        raise GraphcalError(f"calibration data not found: {path}")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".npz")
        if not files:
            raise GraphcalError(f"calibration folder {path} holds no .npz files")
        return files
    return [path]


def _open_regular(path: str | os.PathLike) -> BinaryIO:
    """``path`` opened for reading, refused unless it is a regular file (graphcal.limits)."""
    return open_regular(path, "calibration data", noun=".npz file")



@contextlib.contextmanager
def _open_npz(path: str | os.PathLike) -> Iterator[zipfile.ZipFile]:
    f = _open_regular(path)
    with f:
        try:
            zf = zipfile.ZipFile(f)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error, NotImplementedError) as e:
            raise GraphcalError(f"{path} is not an .npz file ({_one_line(e)})") from e
        with zf:
            yield zf


def _npz_source(path: Path) -> _Source:
    """An .npz's arrays from their .npy headers and the zip's central directory, read before any
    data: shapes and dtypes, each entry's sizes checked against the file's, and each header's
    declared bytes against its entry's uncompressed size (a lying header is refused)."""
    members: dict[str, _Member] = {}
    with _open_npz(path) as zf:
        archive_size = os.fstat(zf.fp.fileno()).st_size
        for info in zf.infolist():
            key = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
            if key in members:
                raise GraphcalError(f"{path} holds two entries for array {key!r}")
            if info.compress_size > archive_size:
                raise GraphcalError(
                    f"{path}: array {key!r}'s zip entry declares {info.compress_size:,} compressed bytes, "
                    f"more than the whole file ({archive_size:,} bytes)"
                )
            if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
                raise GraphcalError(
                    f"{path}: array {key!r} is stored uncompressed, but its zip entry declares "
                    f"{info.compress_size:,} stored bytes for {info.file_size:,} bytes of data"
                )
            try:
                with zf.open(info) as f:
                    version, shape, fortran_order, dtype, offset = _read_npy_header(f)
            except GraphcalError:
                raise
            except _DAMAGED as e:
                raise GraphcalError(f"{path}: array {key!r} could not be read; the file is damaged "
                                    f"({_one_line(e)})") from e
            except Exception as e:  # noqa: BLE001 -- a non-numpy member, whatever numpy or ast raise
                raise GraphcalError(f"{path}: entry {key!r} is not a numpy array ({_one_line(e)})") from e
            if dtype.hasobject:
                raise GraphcalError(
                    f"{path}: array {key!r} holds Python objects (pickled); graphcal reads numeric arrays only"
                )
            if math.prod(d for d in shape if d) * max(dtype.itemsize, 1) > np.iinfo(np.intp).max:
                raise GraphcalError(f"{path}: array {key!r} declares shape {_short(shape)}, too big for any array")
            member = _Member(info.filename, shape, dtype, fortran_order, offset, info.file_size)
            if offset + member.nbytes != info.file_size:
                raise GraphcalError(
                    f"{path}: array {key!r} has a lying header: shape {_short(shape)} of {_short(str(dtype))} declares "
                    f"{offset + member.nbytes:,} bytes (data and header), but the zip entry's uncompressed "
                    f"size is {info.file_size:,} bytes"
                )
            members[key] = member
    if not members:
        raise GraphcalError(f"{path} holds no arrays")
    headers = {k: (m.shape, m.dtype) for k, m in members.items()}
    return _Source(str(path), headers, members=members)


def _read_npy_header(f) -> tuple[tuple[int, int], tuple[int, ...], bool, np.dtype, int]:
    """(version, shape, fortran_order, dtype, bytes before the data) of the .npy stream ``f``,
    reading only the header. The header's length is checked against numpy's limit before the
    header is read (numpy itself reads a declared 4 GiB header first and checks afterwards)."""
    magic = _read_exact(f, np.lib.format.MAGIC_LEN, "magic string")
    if magic[:-2] != np.lib.format.MAGIC_PREFIX:
        raise ValueError("the .npy magic string is missing")
    version = (magic[-2], magic[-1])
    if version not in ((1, 0), (2, 0), (3, 0)):
        raise ValueError(f"unsupported .npy format version {version[0]}.{version[1]}")
    length_format = "<H" if version == (1, 0) else "<I"
    length = struct.unpack(length_format, _read_exact(f, struct.calcsize(length_format), "header length"))[0]
    encoding = "utf8" if version == (3, 0) else "latin1"
    if length > _MAX_HEADER_SIZE * (4 if encoding == "utf8" else 1):
        raise ValueError(f"its header declares {length:,} bytes, more than numpy's limit of {_MAX_HEADER_SIZE:,}")
    text = _read_exact(f, length, "header").decode(encoding)
    if len(text) > _MAX_HEADER_SIZE:
        raise ValueError(f"its header holds {len(text):,} characters, more than numpy's limit of {_MAX_HEADER_SIZE:,}")
    # numpy's own reading (np.lib.format): a Python literal dict, parsed with ast.literal_eval
    try:
        d = ast.literal_eval(text)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as e:
        raise ValueError(f"cannot parse its header {text[:80]!r}") from e
    if not isinstance(d, dict) or set(d) != {"descr", "fortran_order", "shape"}:
        raise ValueError(f"its header is not an .npy header dict: {text[:80]!r}")
    shape = d["shape"]
    if (not isinstance(shape, tuple) or not all(type(x) is int and x >= 0 for x in shape)):
        raise ValueError(f"its header's shape is not valid: {shape!r}"[:200])
    if not isinstance(d["fortran_order"], bool):
        raise ValueError(f"its header's fortran_order is not a bool: {d['fortran_order']!r}"[:200])
    try:
        dtype = np.lib.format.descr_to_dtype(d["descr"])
    except Exception as e:  # noqa: BLE001 -- numpy raises TypeError, ValueError, ... for a bad descr
        raise ValueError(f"its header's descr is not a valid dtype: {d['descr']!r}"[:200]) from e
    offset = np.lib.format.MAGIC_LEN + struct.calcsize(length_format) + length
    return version, shape, d["fortran_order"], dtype, offset


def _read_exact(f, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise EOFError(f"the {what} ends after {len(data)} of {n} bytes")
    return data


@contextlib.contextmanager
def _rows(source: _Source, names: list[str]) -> Iterator[Callable[[int, int], dict[str, np.ndarray]]]:
    """``take(start, stop)``: the rows ``start:stop`` of every array in ``names``, C-contiguous.
    Files are streamed, so ``take`` must be called with consecutive ranges from 0."""
    if source.members is None:  # in memory: fetch each array once (a lazy mapping is read once too)
        arrays = {name: np.asarray(source.arrays[name]) for name in names}
        yield lambda start, stop: {name: np.ascontiguousarray(_slice(a, start, stop)) for name, a in arrays.items()}
        return
    with _open_npz(source.label) as zf, contextlib.ExitStack() as streams:
        readers = {name: _member_reader(zf, streams, source.label, name, source.members[name]) for name in names}

        def take(start: int, stop: int) -> dict[str, np.ndarray]:
            return {name: read(start, stop) for name, read in readers.items()}

        yield take


def _member_reader(zf: zipfile.ZipFile, streams: contextlib.ExitStack, path: str, name: str,
                   member: _Member) -> Callable[[int, int], np.ndarray]:
    """Open one array's zip entry (once) and return ``read(start, stop)`` for consecutive rows."""

    def failed(e: BaseException) -> GraphcalError:
        return GraphcalError(f"{path}: array {name!r} could not be read; the file is damaged ({_one_line(e)})")

    try:
        info = zf.getinfo(member.entry)
        stream = streams.enter_context(zf.open(info))
        *_, shape, fortran_order, dtype, offset = _read_npy_header(stream)
    except GraphcalError:
        raise
    except (*_READ_ERRORS, KeyError) as e:
        raise failed(e) from e
    if (info.file_size, shape, fortran_order, dtype, offset) != (member.file_size, member.shape,
                                                                  member.fortran_order, member.dtype, member.offset):
        raise GraphcalError(f"{path}: array {name!r} changed after it was checked; run again")

    def fill(out: np.ndarray) -> np.ndarray:
        """Read ``out.nbytes`` bytes from the stream into ``out`` (C-contiguous), in chunks."""
        flat = out.reshape(-1).view(np.uint8)
        done = 0
        try:
            while done < flat.size:
                chunk = stream.read(min(flat.size - done, _READ_CHUNK))
                if not chunk:
                    raise EOFError(f"the data ends after {member.offset + done:,} of {member.file_size:,} bytes")
                flat[done:done + len(chunk)] = np.frombuffer(chunk, np.uint8)
                done += len(chunk)
        except _READ_ERRORS as e:
            raise failed(e) from e
        return out

    if member.whole:  # a scalar, or a Fortran-ordered array: read all of it, once
        if member.shape:
            whole = fill(np.empty(member.shape[::-1], member.dtype)).T
        else:
            whole = fill(np.empty((), member.dtype))
        # a copy per batch (C-ordered), so that a caller changing a batch cannot change the next
        return lambda start, stop: np.array(_slice(whole, start, stop), order="C", copy=True)

    position = [0]

    def read(start: int, stop: int) -> np.ndarray:
        if start != position[0]:
            raise RuntimeError(f"rows are streamed in order: asked for {start}, at {position[0]}")
        position[0] = stop
        return fill(np.empty((stop - start, *member.shape[1:]), member.dtype))

    return read


def _check_memory(sources: list[_Source], batch_size: int, num_samples: int) -> None:
    """Refuse, before anything is read, a run whose one batch (of every input of a file; a
    Fortran-ordered array whole) needs more than half the memory available."""
    available = _available_memory()
    if available is None:
        return
    left = num_samples
    for source in sources:
        if left <= 0:
            break
        n = min(left, source.num_samples)
        left -= n
        if source.members is None or n == 0:
            continue
        rows = min(batch_size, n)
        need = {name: m.nbytes if m.whole else rows * m.row_bytes for name, m in source.members.items()}
        total = sum(need.values())
        if total > available / 2:
            name = max(need, key=need.get)
            member = source.members[name]
            if member.whole:
                what = f"is Fortran-ordered and read whole: {format_size(need[name])}"
                hint = "save it C-ordered (np.ascontiguousarray) so that it is read a batch at a time"
            else:
                what, hint = f"needs {format_size(need[name])} per batch of {rows}", "use a smaller --batch-size"
            others = f"; one batch of all inputs needs {format_size(total)}" if len(need) > 1 else ""
            raise GraphcalError(
                f"{source.label}: array {name!r} {what}{others}, more than half the {format_size(available)} of memory "
                f"available; {hint}"
            )



def _short(value, limit: int = 120) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return (text[:300] + "...") if len(text) > 300 else text or type(e).__name__


def _check_arrays(arrays: Mapping[str, np.ndarray]) -> dict:
    out = {}
    for key, value in arrays.items():
        value = np.asarray(value)
        if value.dtype.hasobject:
            raise GraphcalError(f"array {key!r} holds Python objects; graphcal reads numeric arrays only")
        out[key] = (value.shape, value.dtype)
    return out


def _validate(source: _Source, inputs: list[InputSpec], fixed_batch: int | None) -> None:
    where = source.label
    found = source.headers
    names = {s.name for s in inputs}
    missing = [n for n in names if n not in found]
    unknown = [k for k in found if k not in names]
    expected = ", ".join(sorted(names))
    if missing:
        raise GraphcalError(f"{where}: no array for model input(s) {', '.join(sorted(missing))} (the model takes: {expected})")
    if unknown:
        raise GraphcalError(f"{where}: array(s) {', '.join(sorted(unknown))} are not model inputs (the model takes: {expected})")
    batch: int | None = None
    symbols: dict[str, tuple[int, str]] = {}
    for spec in inputs:
        shape, dtype = found[spec.name]
        if dtype != spec.dtype:
            raise GraphcalError(
                f"{where}: input {spec.name!r} is {dtype}, the model expects {spec.dtype} "
                f"(convert with .astype(np.{spec.dtype.name}))"
            )
        if len(shape) != len(spec.shape):
            raise GraphcalError(
                f"{where}: input {spec.name!r} has rank {len(shape)} {tuple(shape)}, the model expects rank "
                f"{len(spec.shape)} {_fmt(spec.shape)}; the first dimension is the sample (batch) dimension"
            )
        if not shape:
            continue
        if batch is None:
            batch = shape[0]
        elif shape[0] != batch:
            raise GraphcalError(
                f"{where}: inputs disagree on the number of samples ({spec.name!r} has {shape[0]}, others {batch})"
            )
        for axis, (have, want) in enumerate(zip(shape, spec.shape)):
            if axis == 0 and fixed_batch:
                continue
            if isinstance(want, int) and want > 0 and have != want:
                raise GraphcalError(
                    f"{where}: input {spec.name!r} has size {have} on axis {axis}, the model fixes it at {want}"
                )
            if isinstance(want, str) and axis > 0:
                seen = symbols.setdefault(want, (have, spec.name))
                if seen[0] != have:
                    raise GraphcalError(
                        f"{where}: inputs {seen[1]!r} and {spec.name!r} share dimension {want!r} "
                        f"but have sizes {seen[0]} and {have}"
                    )
    if not any(found[s.name][0] for s in inputs):
        raise GraphcalError(f"{where}: every input is a scalar; graphcal needs a sample dimension")


def _fixed_batch(inputs: list[InputSpec]) -> int | None:
    for spec in inputs:
        if spec.shape and isinstance(spec.shape[0], int) and spec.shape[0] > 0:
            return spec.shape[0]
    return None


def _slice(array: np.ndarray, start: int, stop: int) -> np.ndarray:
    return array if array.ndim == 0 else array[start:stop]


def _check_finite(batch: dict[str, np.ndarray], where: str, start: int) -> None:
    for name, value in batch.items():
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            bad = int(np.argwhere(~np.isfinite(value))[0][0]) + start if value.ndim else start
            raise GraphcalError(f"{where}: input {name!r} holds NaN or Inf (sample {bad}); clean the data first")


def _fmt(shape) -> str:
    return "[" + ", ".join(str(d) if d not in (None, "") else "?" for d in shape) + "]"


MASK_INPUT = "attention_mask"  # positions where it is 0 are padding


def batch_samples(batch: dict) -> int:
    """How many samples a batch holds (its inputs' leading dimension)."""
    first = next(iter(batch.values()), None)
    return int(first.shape[0]) if first is not None and getattr(first, "ndim", 0) else 1


def check_padding_input(label: str, input_names) -> None:
    """--exclude-padding needs an attention_mask among the model's inputs (so in the data)."""
    if MASK_INPUT not in input_names:
        raise UsageError(f"--exclude-padding: {label} has no {MASK_INPUT} (the model's inputs: "
                         f"{', '.join(input_names)}); without it no position is known to be padding")


def data_label(data) -> str:
    if isinstance(data, Mapping):
        return "the data <arrays>"
    return "the CalibrationDataReader" if hasattr(data, "get_next") else f"the data {data}"
