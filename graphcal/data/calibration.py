"""The one type the stages see for calibration data, whatever it came from."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Calibration(Protocol):
    """Calibration data as the stages read it: :meth:`batches` streams the run's batches in order,
    one held at a time, each checked; :meth:`check_values` reads them all once to refuse NaN/Inf.
    ``rereadable``: the batches can be streamed again (arrays: yes; a CalibrationDataReader: no, so
    nothing that needs two passes, or a pass per layer block, runs on it). ``num_samples`` and
    ``num_batches`` are known ahead for arrays, and counted while streaming for a reader.
    ``notes``: what was filled for inputs the data lacks (graphcal.data.fill), one line, for the
    verbs' warnings (empty when nothing was; a reader's grows as its batches stream).
    :meth:`first_batch`: the first batch :meth:`batches` gives, checked, without using the data up
    (a reader's is held back for :meth:`batches`), for a look before the passes."""

    rereadable: bool
    num_samples: int
    notes: list[str]

    @property
    def num_batches(self) -> int: ...

    def batches(self) -> Iterator[dict[str, np.ndarray]]: ...

    def check_values(self) -> int: ...

    def first_batch(self) -> dict[str, np.ndarray]: ...
