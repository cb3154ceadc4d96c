"""The last calibration samples set aside: what `run --size-budget` ranks and measures its mix on.

:func:`hold_out` splits data into the samples the run calibrates on (the first ones: ``--num-samples``
takes them) and the last ``count`` samples, read into memory as arrays (every array of the file,
``labels`` too), so that the mix is chosen on samples no observer, Hessian or search has seen. The
held-out samples come from the last .npz file (of a folder, the last by name) and are read by rows,
within the memory check every batch passes (graphcal.data.npz).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphcal.data.npz import check_memory, npz_files, npz_source, rows
from graphcal.data.source import Source
from graphcal.errors import UsageError

SKIP_ROWS = 64  # rows read (and dropped) at a time on the way to the held-out ones: a stream reads forward only


@dataclass(frozen=True)
class HeldOut:
    calibrate_on: int  # the first samples, which the run calibrates on
    arrays: dict[str, np.ndarray]  # the last samples, every array

    @property
    def count(self) -> int:
        return next(len(a) for a in self.arrays.values() if a.ndim)


def hold_out(data, count: int, num_samples: int | None = None) -> HeldOut:
    """The last ``count`` samples of ``data`` (an .npz, a folder of them, or a mapping of arrays) within
    its first ``num_samples`` (None: all), and how many come before them; refused in one line where
    fewer than ``count`` + 1 samples are given, or the data is a CalibrationDataReader (read once)."""
    calibrate_on, source, start, stop = held_out_split(data, count, num_samples)
    check_memory([source], stop - start, stop - start)
    with rows(source, [k for k, (shape, _) in source.headers.items() if shape]) as take:
        for skip in range(0, start, SKIP_ROWS):
            take(skip, min(skip + SKIP_ROWS, start))
        arrays = take(start, stop)
    return HeldOut(calibrate_on, arrays)


def held_out_split(data, count: int, num_samples: int | None = None) -> tuple[int, Source, int, int]:
    """(the samples before the held-out ones, the source holding them, their rows in it: start, stop), from the
    headers alone (no sample is read); refused as :func:`hold_out` refuses."""
    if hasattr(data, "get_next"):
        raise UsageError("--size-budget holds out the last calibration samples to choose its mix on; give .npz data "
                         "or arrays, not a CalibrationDataReader (it can be read only once)")
    if isinstance(data, Mapping):
        sources = [Source("<arrays>", {k: (np.shape(v), np.asarray(v).dtype) for k, v in data.items()}, arrays=data)]
    else:
        sources = [npz_source(p) for p in npz_files(Path(data))]
    total = sum(s.num_samples for s in sources)
    total = total if num_samples is None else min(num_samples, total)
    if total <= count:
        raise UsageError(f"--size-budget holds out the last {count} calibration sample{'s' if count != 1 else ''} "
                         f"(--mix-samples) to choose its mix on, and the data gives {total}: give more samples "
                         "or a smaller --mix-samples")
    before = 0  # the source holding sample ``total - 1``, and the samples before it
    for source in sources:
        if before + source.num_samples >= total:
            break
        before += source.num_samples
    stop = total - before
    start = max(stop - count, 0)
    return before + start, source, start, stop
