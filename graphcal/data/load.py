"""Calibration data opened, checked against the model's inputs and served as batches.

:func:`load_data` takes an .npz file, a folder of them, a mapping of arrays or a
CalibrationDataReader (graphcal.data.reader). It checks everything against the graph's inputs
before anything runs, from the array headers alone (graphcal.data.inputs; nothing is loaded for
the checks), and refuses a batch that would not fit in memory (graphcal.data.npz). For a model
with a KV cache, the inputs token data lacks (past tensors, attention_mask, position_ids) are
filled as a prefill from an empty cache has them (graphcal.data.fill).
:class:`CalibrationData` then streams the run's batches, one at a time, each checked for NaN and Inf.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from graphcal.data.calibration import Calibration
from graphcal.data.fill import Fill, Filler, describe
from graphcal.data.inputs import InputSpec, check_arrays, check_finite, fixed_batch
from graphcal.data.npz import check_memory, npz_files, npz_source, rows
from graphcal.data.reader import ReaderData
from graphcal.data.source import Source
from graphcal.errors import GraphcalError, UsageError

DEFAULT_BATCH_SIZE = 8
#: an array eval takes beside the inputs (``labels=True``): each position's token, shaped as ``input_ids``
LABELS = "labels"
TOKENS = "input_ids"


class CalibrationData:
    """Validated calibration data; iterate :meth:`batches` to stream it one batch at a time."""

    rereadable = True  # arrays stream as often as a run needs (graphcal.data.calibration.Calibration)

    def __init__(self, sources: list[Source], inputs: list[InputSpec], batch_size: int, num_samples: int | None,
                 fills: list[Fill | None] | None = None, labels: bool = False):
        self._sources = sources
        self._labels = labels  # each batch carries the data's ``labels`` array too (eval), where a source has one
        self._inputs = inputs
        self._fills = fills or [None] * len(sources)  # per source: the inputs filled for it (graphcal.data.fill)
        self.notes = describe(self._fills)  # what was filled, one line (empty: nothing)
        self.batch_size = batch_size
        # A model with a fixed batch dimension cannot take a short last batch.
        self._drop_last = fixed_batch(inputs) is not None
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
        for source, fill in zip(self._sources, self._fills):
            if left <= 0:
                return
            n = min(left, source.num_samples)
            left -= n
            if n == 0:
                continue
            names = [spec.name for spec in self._inputs if spec.name in source.headers]
            extra = [LABELS] if self._labels and LABELS in source.headers and LABELS not in names else []
            with rows(source, names + extra) as take:
                for start in range(0, n, self.batch_size):
                    stop = min(start + self.batch_size, n)
                    if self._drop_last and stop - start < self.batch_size:
                        break
                    batch = take(start, stop)
                    check_finite(batch, source.label, start)
                    if fill is not None:
                        batch = {**fill.complete(batch), **{k: batch[k] for k in extra}}
                    yield batch

    def first_batch(self) -> dict[str, np.ndarray]:
        """The first batch :meth:`batches` gives (its file closed after it)."""
        stream = self.batches()
        try:
            return next(stream)
        finally:
            stream.close()

    def check_values(self) -> int:
        """Stream every batch the run would use once and refuse NaN or Inf, as :meth:`batches`
        does (same error, naming the sample); one batch is held at a time. For runs that make
        no activation pass (dynamic activations only), so that bad data is still refused.
        Returns the number of batches checked."""
        count = 0
        for _ in self.batches():
            count += 1
        return count



def load_data(
    data: str | Path | Mapping[str, np.ndarray],
    inputs: list[InputSpec],
    *,
    batch_size: int | None = None,
    num_samples: int | None = None,
    model_dir: str | Path | None = None,
    labels: bool = False,
) -> Calibration:
    """Open and validate calibration data for a model with ``inputs``.

    ``data`` is an .npz path, a folder of .npz files, a mapping of arrays, or an onnxruntime
    CalibrationDataReader (streamed; see :class:`ReaderData`). ``batch_size`` defaults to the
    model's fixed batch dimension, else 8. For a model with a KV cache, the inputs the data lacks
    are filled for a prefill from an empty cache (graphcal.data.fill; ``model_dir``, the model's
    folder, may hold a genai_config.json giving symbolic past dims); ``.notes`` says what was.
    With ``labels`` (eval), an array ``labels`` beside the inputs (shaped as ``input_ids``, integer; not a
    model input) is taken too and each batch carries it under that name: the caller feeds the rest.
    """
    if batch_size is not None and batch_size <= 0:
        raise UsageError(f"--batch-size must be positive, got {batch_size}")
    if num_samples is not None and num_samples <= 0:
        raise UsageError(f"--num-samples must be positive, got {num_samples}")
    filler = Filler(inputs, Path(model_dir) if model_dir is not None else None)
    if hasattr(data, "get_next"):  # an onnxruntime CalibrationDataReader
        if batch_size is not None:
            raise UsageError("batch_size does not apply to a CalibrationDataReader: its batches are used as they come")
        return ReaderData(data, inputs, num_samples, filler)
    fixed = fixed_batch(inputs)
    if batch_size is None:
        batch_size = fixed or DEFAULT_BATCH_SIZE
    elif fixed and batch_size != fixed:
        raise UsageError(f"the model's batch dimension is fixed at {fixed}; use --batch-size {fixed}")

    if isinstance(data, Mapping):
        sources = [Source("<arrays>", check_arrays(data), arrays=data)]
    else:
        sources = [npz_source(p) for p in npz_files(Path(data))]
    labelled = labels and not any(spec.name == LABELS for spec in inputs)
    # validated (without the labels, checked on their own); the inputs a KV-cache model lacks filled
    fills = [filler.check(_checked_labels(s) if labelled else s, fixed) for s in sources]
    if sum(s.num_samples for s in sources) == 0:
        raise GraphcalError(f"calibration data {data if not isinstance(data, Mapping) else '<arrays>'} holds zero samples")
    calib = CalibrationData(sources, inputs, batch_size, num_samples, fills, labels=labelled)
    check_memory(sources, batch_size, calib.num_samples)
    return calib


def _checked_labels(source: Source) -> Source:
    """``source`` without its ``labels`` array, which is checked here: integer, shaped as ``input_ids``."""
    if LABELS not in source.headers:
        return source
    shape, dtype = source.headers[LABELS]
    tokens = source.headers.get(TOKENS)
    if tokens is None:
        raise GraphcalError(f"{source.label}: {LABELS!r} needs the {TOKENS!r} it labels")
    if dtype.kind not in "iu" or tuple(shape) != tuple(tokens[0]):
        raise GraphcalError(f"{source.label}: {LABELS!r} must be integer token ids shaped as {TOKENS!r} "
                            f"{tuple(tokens[0])}, got {dtype} {tuple(shape)}")
    headers = {k: v for k, v in source.headers.items() if k != LABELS}
    members = {k: v for k, v in source.members.items() if k != LABELS} if source.members is not None else None
    arrays = {k: v for k, v in source.arrays.items() if k != LABELS} if source.arrays is not None else None
    return Source(source.label, headers, arrays, members)


def data_label(data) -> str:
    if isinstance(data, Mapping):
        return "the data <arrays>"
    return "the CalibrationDataReader" if hasattr(data, "get_next") else f"the data {data}"


def data_paths(data) -> list[Path]:
    """The file or folder ``data`` names (none for arrays or a CalibrationDataReader): an input that
    an output folder must not hold."""
    return [] if isinstance(data, Mapping) or hasattr(data, "get_next") else [Path(data)]
