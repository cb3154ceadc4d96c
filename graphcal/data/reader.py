"""An onnxruntime ``CalibrationDataReader`` as calibration data: its batches streamed once, each checked as it comes."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from graphcal.data.fill import Filler, describe
from graphcal.data.inputs import InputSpec, check_arrays, check_finite, fixed_batch, slice_rows
from graphcal.data.source import Source
from graphcal.errors import GraphcalError


class ReaderData:
    """Batches from an onnxruntime ``CalibrationDataReader`` (anything with ``get_next()``), as
    quantize_static users have them: streamed once, each batch checked like an .npz file before
    it runs. The reader's batches are used as they come; ``num_samples`` caps the total."""

    rereadable = False  # a reader streams once (graphcal.data.calibration.Calibration)

    def __init__(self, reader, inputs: list[InputSpec], num_samples: int | None, filler: Filler | None = None):
        self._reader = reader
        self._inputs = inputs
        self._filler = filler or Filler(inputs)  # the inputs a KV-cache model's batches lack (graphcal.data.fill)
        self._fills: dict = {}  # the distinct fills of the batches so far (graphcal.data.fill.Fill), in order
        self._cap = num_samples
        self._fixed_batch = fixed_batch(inputs)
        self.num_samples = 0  # counted while streaming
        self.num_batches = 0
        self._used = False
        self._held: list = []  # the first batch, read ahead by first_batch() for batches() to start with

    def first_batch(self) -> dict[str, np.ndarray]:
        """The reader's first batch, checked as :meth:`batches` checks it and held back: :meth:`batches`
        starts with it, so the reader is still read once."""
        if self._used:
            raise GraphcalError("a CalibrationDataReader can be read once; make a new one for another run")
        if not self._held:
            self._held.append(self._next(0))
        if self._held[0] is None:
            raise GraphcalError("the CalibrationDataReader gave no batches (get_next() returned None at once)")
        return self._checked(self._held[0], 0, 0)[0]

    def batches(self) -> Iterator[dict[str, np.ndarray]]:
        if self._used:
            raise GraphcalError("a CalibrationDataReader can be read once; make a new one for another run")
        self._used = True
        while self._cap is None or self.num_samples < self._cap:
            batch = self._held.pop() if self._held else self._next(self.num_batches)
            if batch is None:
                break
            arrays, n = self._checked(batch, self.num_batches, self.num_samples)
            self.num_samples += n
            self.num_batches += 1
            yield arrays
        if self.num_batches == 0:
            raise GraphcalError("the CalibrationDataReader gave no batches (get_next() returned None at once)")

    def _next(self, index: int):
        try:
            return self._reader.get_next()
        except Exception as e:  # noqa: BLE001 -- the user's reader: report it as one line
            raise GraphcalError(f"the CalibrationDataReader failed on batch {index}: "
                                f"{type(e).__name__}: {e}") from e

    def _checked(self, batch, index: int, seen: int) -> tuple[dict[str, np.ndarray], int]:
        """Batch ``index`` of the reader (after ``seen`` samples) checked, cut to the cap and filled:
        (the model's inputs, its sample count)."""
        if not isinstance(batch, Mapping):
            raise GraphcalError(f"the CalibrationDataReader's batch {index} is a "
                                f"{type(batch).__name__}, not a mapping of input names to arrays")
        arrays = {k: np.asarray(v) for k, v in batch.items()}
        source = Source(f"CalibrationDataReader batch {index}", check_arrays(arrays), arrays=arrays)
        fill = self._filler.check(source, self._fixed_batch)  # validated, and what is filled
        if fill is not None:
            self._fills.setdefault(fill)
        n = source.num_samples
        if self._cap is not None and seen + n > self._cap:
            n = self._cap - seen
            arrays = {k: slice_rows(v, 0, n) for k, v in arrays.items()}
        check_finite(arrays, source.label, 0)
        arrays = arrays if fill is None else fill.complete(arrays)
        return {spec.name: np.ascontiguousarray(arrays[spec.name]) for spec in self._inputs}, n

    @property
    def notes(self) -> list[str]:
        """What was filled for the batches streamed so far, one line (empty: nothing)."""
        return describe(self._fills)

    def check_values(self) -> int:
        """Nothing to do ahead: a reader's batches are checked (NaN/Inf included) as they stream,
        and a reader can be read only once. Returns 0."""
        return 0
