"""Reading .npz calibration files, bounded: the data comes from strangers.

An .npz holds one array per model input, keyed by input name, whose first dimension is the
sample dimension and doubles as the model's batch dimension. A folder holds several such files
(sorted; batches never span files). Reading them is bounded:

- only regular files are opened (a FIFO, ``/dev/zero``, a socket or a device named as data, or
  as ``x.npz`` inside a data folder, is refused: the open cannot block and nothing is read);
- every array's .npy header must agree with its zip entry's uncompressed size (a lying header
  is refused), and one batch of every input must fit in half the available memory
  (:func:`check_memory`), both checked from the headers before anything is read;
- batches are streamed (:func:`rows`): each array is opened once per pass and read forward,
  ``batch_size`` rows at a time, and only the rows the run uses are decompressed. A
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from graphcal.data.inputs import slice_rows
from graphcal.data.source import Member, Source
from graphcal.errors import GraphcalError
from graphcal.limits import available_memory as _available_memory  # a module name tests can patch
from graphcal.limits import format_size, open_regular

# numpy's own limit on an .npy header's text (np.load refuses longer headers without allow_pickle)
_MAX_HEADER_SIZE = getattr(np.lib.format, "_MAX_HEADER_SIZE", 10000)
_READ_CHUNK = 1 << 22  # bytes per read() while streaming rows
# What reading a damaged zip member can raise: a bad CRC or local header, a broken deflate, bz2 or
# lzma stream, a truncated file, an unsupported compression method or an encrypted entry.
_DAMAGED = (zipfile.BadZipFile, zlib.error, lzma.LZMAError)
_READ_ERRORS = (*_DAMAGED, EOFError, OSError, ValueError, struct.error, NotImplementedError, RuntimeError, MemoryError)


def npz_files(path: Path) -> list[Path]:
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


def npz_source(path: Path) -> Source:
    """An .npz's arrays from their .npy headers and the zip's central directory, read before any
    data: shapes and dtypes, each entry's sizes checked against the file's, and each header's
    declared bytes against its entry's uncompressed size (a lying header is refused)."""
    members: dict[str, Member] = {}
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
                    version, shape, fortran_order, dtype, offset = read_npy_header(f)
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
            member = Member(info.filename, shape, dtype, fortran_order, offset, info.file_size)
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
    return Source(str(path), headers, members=members)


def read_npy_header(f) -> tuple[tuple[int, int], tuple[int, ...], bool, np.dtype, int]:
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
def rows(source: Source, names: list[str]) -> Iterator[Callable[[int, int], dict[str, np.ndarray]]]:
    """``take(start, stop)``: the rows ``start:stop`` of every array in ``names``, C-contiguous.
    Files are streamed, so ``take`` must be called with consecutive ranges from 0."""
    if source.members is None:  # in memory: fetch each array once (a lazy mapping is read once too)
        arrays = {name: np.asarray(source.arrays[name]) for name in names}
        yield lambda start, stop: {name: np.ascontiguousarray(slice_rows(a, start, stop)) for name, a in arrays.items()}
        return
    with _open_npz(source.label) as zf, contextlib.ExitStack() as streams:
        readers = {name: _member_reader(zf, streams, source.label, name, source.members[name]) for name in names}

        def take(start: int, stop: int) -> dict[str, np.ndarray]:
            return {name: read(start, stop) for name, read in readers.items()}

        yield take


def _member_reader(zf: zipfile.ZipFile, streams: contextlib.ExitStack, path: str, name: str,
                   member: Member) -> Callable[[int, int], np.ndarray]:
    """Open one array's zip entry (once) and return ``read(start, stop)`` for consecutive rows."""

    def failed(e: BaseException) -> GraphcalError:
        return GraphcalError(f"{path}: array {name!r} could not be read; the file is damaged ({_one_line(e)})")

    try:
        info = zf.getinfo(member.entry)
        stream = streams.enter_context(zf.open(info))
        *_, shape, fortran_order, dtype, offset = read_npy_header(stream)
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
        return lambda start, stop: np.array(slice_rows(whole, start, stop), order="C", copy=True)

    position = [0]

    def read(start: int, stop: int) -> np.ndarray:
        if start != position[0]:
            raise RuntimeError(f"rows are streamed in order: asked for {start}, at {position[0]}")
        position[0] = stop
        return fill(np.empty((stop - start, *member.shape[1:]), member.dtype))

    return read


def check_memory(sources: list[Source], batch_size: int, num_samples: int) -> None:
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

