"""One source of calibration arrays, as its headers describe it before anything is read.

A :class:`Source` is an .npz file, a mapping of arrays or one batch of a CalibrationDataReader:
its label (for messages), each array's shape and dtype, and where the rows come from (the arrays
in memory, or the file's :class:`Member` entries, streamed by graphcal.data.npz).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Member:
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
class Source:
    label: str  # file path or "<arrays>" for in-memory data
    headers: dict[str, tuple[tuple[int, ...], np.dtype]]  # name -> (shape, dtype)
    arrays: Mapping[str, np.ndarray] | None = None  # in-memory data; None means read the file
    members: Mapping[str, Member] | None = None  # the file's arrays (name -> member), when read from a file

    @property
    def num_samples(self) -> int:
        return next(shape[0] for shape, _ in self.headers.values() if shape)
