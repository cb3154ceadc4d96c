"""The tensors a block-by-block walk caches between layer blocks (calibration.blockwise): in memory up to a
budget, on disk beyond it.

    BlockCache: name -> Spool (one value per batch, in order)
      a value on the host is held in memory while the host bytes held stay within the budget
      (``--cache-mb``; default: CACHE_SHARE of the memory available when the cache is made; 0: every
      host value on disk), else written to a file of its own (its raw bytes; dtype and shape kept here)
      and read back, as a fresh host tensor with the same bytes, each time it is asked for;
      a value on the GPU stays where it lies (Blockwise.placement decides) and is not counted.

The files go into a folder made on the first spill: a subfolder of the output's temporary folder
(OutputSlot.early_folder, handed in as ``folder``), or of the system's temporary folder without one.
A name's files are deleted when the name is dropped; :meth:`BlockCache.close` deletes the folder,
and so does an abort from another thread (graphcal.output.process) or the output slot's release
(the folder lies inside its temporary folder). Before a block's outputs are cached,
:meth:`BlockCache.check_disk` refuses in one line when the disk cannot take what would spill.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from graphcal.errors import GraphcalError, UsageError
from graphcal.limits import available_memory, format_size
from graphcal.output.process import register_abort, unregister_abort

log = logging.getLogger("graphcal")

CACHE_SHARE = 0.5  # of the available memory the cache holds in memory by default
Value = torch.Tensor | np.ndarray


def check_cache_mb(cache_mb) -> float | None:
    """``--cache-mb`` as a number of MB (None: the default budget), refused in one line otherwise."""
    if cache_mb is None:
        return None
    try:
        mb = float(cache_mb)
    except (TypeError, ValueError):
        raise UsageError(f"cache_mb must be a number of MB, got {cache_mb!r}") from None
    if isinstance(cache_mb, bool) or not math.isfinite(mb) or mb < 0:
        raise UsageError(f"cache_mb must be a finite number of MB >= 0, got {cache_mb!r}")
    return mb


def budget_bytes(cache_mb: float | None) -> int | None:
    """The host bytes the cache may hold in memory: ``cache_mb`` MB, or CACHE_SHARE of the memory
    available now (None: unknown, no limit)."""
    mb = check_cache_mb(cache_mb)
    if mb is not None:
        return int(mb * 1e6)
    free = available_memory()
    return None if free is None else int(CACHE_SHARE * free)


def host_bytes(value: Value) -> int:
    """The host memory ``value`` holds (0 for a tensor on a GPU)."""
    if isinstance(value, torch.Tensor):
        return 0 if value.device.type != "cpu" else value.numel() * value.element_size()
    return value.nbytes


def _spillable(value: Value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == "cpu" and not value.is_sparse
    return isinstance(value, np.ndarray) and not value.dtype.hasobject


@dataclass(frozen=True)
class _OnDisk:
    """A value written to ``path``: its raw bytes; the rest kept here."""

    path: Path
    torch_dtype: torch.dtype | None  # a torch tensor's, else None (a numpy array)
    np_dtype: np.dtype | None
    shape: tuple[int, ...]
    nbytes: int

    def read(self) -> Value:
        raw = np.fromfile(self.path, dtype=np.uint8)
        if raw.size != self.nbytes:
            raise GraphcalError(f"the cached tensor {self.path} holds {raw.size} bytes, {self.nbytes} were written; "
                                "was the folder changed during the run?")
        if self.torch_dtype is not None:
            return torch.from_numpy(raw).view(self.torch_dtype).reshape(self.shape)
        return raw.view(self.np_dtype).reshape(self.shape)


class Spool(Sequence):
    """One cached tensor's values, one per batch, in order: each in memory or on disk (read back on
    every access). Made by :meth:`BlockCache.spool`; its files are deleted by :meth:`clear`."""

    def __init__(self, cache: BlockCache):
        self._cache = cache
        self._key = next(cache._keys)
        self._items: list[Value | _OnDisk] = []

    def append(self, value: Value) -> None:
        self._items.append(self._cache._place(value, self._key, len(self._items)))

    def extend(self, values: Iterable[Value]) -> None:
        for v in values:
            self.append(v)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        item = self._items[i]
        return item.read() if isinstance(item, _OnDisk) else item

    def __iter__(self) -> Iterator[Value]:
        for i in range(len(self._items)):
            yield self[i]

    @property
    def on_disk(self) -> int:
        """How many of the values are on disk."""
        return sum(isinstance(item, _OnDisk) for item in self._items)

    def clear(self) -> None:
        """Drop every value: those in memory uncounted, the files deleted."""
        items, self._items = self._items, []
        for item in items:
            self._cache._forget(item)

    def __del__(self):
        with contextlib.suppress(Exception):
            self.clear()


class BlockCache:
    """Values per (tensor name, batch): in memory up to ``budget`` host bytes (None: no limit), on
    disk beyond it, in a folder made on the first spill inside ``folder()`` (None: the system's
    temporary folder). A context manager; :meth:`close` deletes whatever it still holds."""

    def __init__(self, budget: int | None, folder: Callable[[], Path] | None = None):
        self.budget = budget
        self.held = 0  # host bytes held in memory
        self.on_disk = 0  # bytes in files now
        self.files_written = 0  # files written in all (for the log and tests)
        self._parent = folder
        self._folder: Path | None = None
        self._abort: int | None = None
        self._names: dict[str, Spool] = {}
        self._keys = itertools.count()
        self._closed = False

    @classmethod
    def for_run(cls, cache_mb: float | None, folder: Callable[[], Path] | None = None) -> BlockCache:
        """A cache with ``--cache-mb``'s budget (:func:`budget_bytes`), reading the available memory now."""
        return cls(budget_bytes(cache_mb), folder)

    # -- names ------------------------------------------------------------------------------------

    def spool(self) -> Spool:
        """An empty spool on this cache's budget, under no name yet (:meth:`put` names it)."""
        return Spool(self)

    def put(self, name: str, values: Sequence[Value]) -> None:
        """Cache ``values`` (one per batch) as ``name``: a spool of this cache is taken as it is, other
        values are placed one by one."""
        if isinstance(values, Spool) and values._cache is self:
            spool = values
        else:
            spool = self.spool()
            spool.extend(values)
        old = self._names.get(name)
        self._names[name] = spool
        if old is not None and old is not spool:
            old.clear()

    def __getitem__(self, name: str) -> Spool:
        return self._names[name]

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def names(self) -> list[str]:
        return list(self._names)

    def drop(self, name: str) -> None:
        """Forget ``name``: its values uncounted, its files deleted."""
        spool = self._names.pop(name, None)
        if spool is not None:
            spool.clear()

    # -- the budget and the disk ------------------------------------------------------------------

    def spill_bytes(self, more: int) -> int:
        """Of ``more`` host bytes still to come, those that would go to disk (held ones stay)."""
        if self.budget is None:
            return 0
        return max(0, min(more, self.held + more - self.budget))

    def check_disk(self, more: int, what: str) -> None:
        """Refuse (one line) when the disk cannot take what of ``more`` host bytes would spill."""
        spill = self.spill_bytes(more)
        if spill <= 0:
            return
        folder = self.folder()
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            return  # unknown: the write itself says it if the disk fills
        if spill > free:
            raise GraphcalError(f"{what} need {format_size(spill)} on disk beyond the {format_size(self.budget)} held "
                                f"in memory (--cache-mb), and {folder.parent} has {format_size(free)} free; free disk "
                                "space there, raise --cache-mb, or calibrate on fewer samples (--num-samples) or "
                                "shorter sequences")

    def folder(self) -> Path:
        """The folder the cache writes to, made on the first call."""
        if self._folder is None:
            if self._closed:
                raise RuntimeError("the block cache is closed")
            parent = self._parent() if self._parent is not None else None
            try:
                self._folder = Path(tempfile.mkdtemp(prefix="graphcal-block-cache-", dir=parent))
            except OSError as e:
                raise GraphcalError(f"could not make the block cache's folder in {parent or tempfile.gettempdir()}: "
                                    f"{e.strerror or e}") from e
            made = self._folder
            self._abort = register_abort(lambda: shutil.rmtree(made, ignore_errors=True))
            log.info("the tensors between layer blocks past %s in memory go to %s",
                     format_size(self.budget or 0), made)
        return self._folder

    def _place(self, value: Value, key: int, index: int) -> Value | _OnDisk:
        nbytes = host_bytes(value)
        if (self.budget is not None and nbytes and self.held + nbytes > self.budget and _spillable(value)):
            return self._write(value, self.folder() / f"{key}-{index}.bin")
        self.held += nbytes
        return value

    def _write(self, value: Value, path: Path) -> _OnDisk:
        if isinstance(value, torch.Tensor):
            raw = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            item = _OnDisk(path, value.dtype, None, tuple(value.shape), raw.size)
        else:
            raw = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
            item = _OnDisk(path, None, value.dtype, tuple(value.shape), raw.size)
        try:
            with open(path, "xb") as f:
                f.write(memoryview(raw))
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise GraphcalError(f"could not write the block cache to {path.parent}: {e.strerror or e}; free disk "
                                "space there or raise --cache-mb") from e
        self.on_disk += item.nbytes
        self.files_written += 1
        return item

    def _forget(self, item: Value | _OnDisk) -> None:
        if isinstance(item, _OnDisk):
            self.on_disk -= item.nbytes
            with contextlib.suppress(OSError):
                os.unlink(item.path)
        else:
            self.held -= host_bytes(item)

    # -- the end ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Drop every name and delete the folder (the cache cannot spill after this)."""
        self._closed = True
        for name in list(self._names):
            self.drop(name)
        unregister_abort(self._abort)
        self._abort = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def __enter__(self) -> BlockCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
