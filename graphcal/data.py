"""Calibration data: .npz files (or a folder of them, or a CalibrationDataReader) -> validated batches.

An .npz holds one array per model input, keyed by input name, whose first dimension is the
sample dimension and doubles as the model's batch dimension: ``input_ids`` of shape
``(num_samples, seq)`` for a model input ``[batch, seq]``. A folder holds several such files
(one or more batches each, e.g. different sequence lengths); batches never span files.

Everything is checked against the graph's inputs before anything runs, from the array headers
alone (nothing is loaded for the checks): names, dtypes, ranks, fixed dimensions, and that
inputs of one file agree on the batch and on shared symbolic dimensions.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from graphcal.errors import GraphcalError, UsageError

DEFAULT_BATCH_SIZE = 8


@dataclass(frozen=True)
class InputSpec:
    """A graph input: name, numpy dtype and shape (ints for fixed dims, str/None for free ones)."""

    name: str
    dtype: np.dtype
    shape: tuple[int | str | None, ...]


@dataclass(frozen=True)
class _Source:
    label: str  # file path or "<arrays>" for in-memory data
    headers: dict[str, tuple[tuple[int, ...], np.dtype]]  # name -> (shape, dtype)
    arrays: Mapping[str, np.ndarray] | None = None  # in-memory data; None means read the file

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
        left = self.num_samples
        for source in self._sources:
            if left <= 0:
                return
            arrays = source.arrays if source.arrays is not None else _read_npz(source.label)
            n = min(left, source.num_samples)
            for start in range(0, n, self.batch_size):
                stop = min(start + self.batch_size, n)
                if self._drop_last and stop - start < self.batch_size:
                    break
                batch = {
                    spec.name: np.ascontiguousarray(_slice(arrays[spec.name], start, stop))
                    for spec in self._inputs
                }
                _check_finite(batch, source.label, start)
                yield batch
            left -= n


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
        sources = [_Source(str(p), _npz_shapes(p)) for p in _npz_files(Path(data))]
    for s in sources:
        _validate(s, inputs, fixed_batch)
    if sum(s.num_samples for s in sources) == 0:
        raise GraphcalError(f"calibration data {data if not isinstance(data, Mapping) else '<arrays>'} holds zero samples")
    return CalibrationData(sources, inputs, batch_size, num_samples)


def _npz_files(path: Path) -> list[Path]:
    if not path.exists():
        raise GraphcalError(f"calibration data not found: {path}")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".npz")
        if not files:
            raise GraphcalError(f"calibration folder {path} holds no .npz files")
        return files
    return [path]


def _npz_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shapes and dtypes from the .npy headers inside the zip, without loading the arrays."""
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise GraphcalError(f"{path} is not an .npz file ({e})") from e
    shapes: dict[str, tuple[int, ...]] = {}
    with zf:
        for name in zf.namelist():
            key = name[:-4] if name.endswith(".npy") else name
            try:
                with zf.open(name) as f:
                    shape, dtype = _read_npy_header(f)
            except Exception as e:  # a damaged or non-numpy member
                raise GraphcalError(f"{path}: entry {key!r} is not a numpy array ({e})") from e
            if dtype.hasobject:
                raise GraphcalError(
                    f"{path}: array {key!r} holds Python objects (pickled); graphcal reads numeric arrays only"
                )
            shapes[key] = (shape, dtype)
    if not shapes:
        raise GraphcalError(f"{path} holds no arrays")
    return shapes


def _read_npy_header(f) -> tuple[tuple[int, ...], np.dtype]:
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, _, dtype = np.lib.format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, _, dtype = np.lib.format.read_array_header_2_0(f)
    else:  # 3.0 only differs in the header's text encoding; load the array to be safe
        f.seek(0)
        array = np.load(f, allow_pickle=False)
        shape, dtype = array.shape, array.dtype
    return shape, dtype


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


def _read_npz(path: str) -> Mapping[str, np.ndarray]:
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise GraphcalError(f"{path}: could not read arrays ({e})") from e


def _slice(array: np.ndarray, start: int, stop: int) -> np.ndarray:
    return array if array.ndim == 0 else array[start:stop]


def _check_finite(batch: dict[str, np.ndarray], where: str, start: int) -> None:
    for name, value in batch.items():
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            bad = int(np.argwhere(~np.isfinite(value))[0][0]) + start if value.ndim else start
            raise GraphcalError(f"{where}: input {name!r} holds NaN or Inf (sample {bad}); clean the data first")


def _fmt(shape) -> str:
    return "[" + ", ".join(str(d) if d not in (None, "") else "?" for d in shape) + "]"
