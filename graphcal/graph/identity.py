"""The files a model is read from stay the files graphcal checked, or the read is refused.

A lazy model (graph.io.load_model_info) keeps its large weights on disk: in its data files, or
where they lie in the model file itself (graph.wire). They are read later, each from a fresh
open, by graphcal and by onnxruntime. A file overwritten in place (same inode, other bytes) or
replaced by a rename between the load and those reads would give an output mixed from two
models. So each such file's identity is recorded when the load first opens it: device and inode
(which file), size, modification and change times in nanoseconds (an overwrite in place keeps the
inode but moves the times). Every later open compares the open file with the record
(:func:`check_open`), and a command checks every file again before its output is written
(:func:`check_unchanged`); a difference is refused in one line: "PATH changed while graphcal was
reading it: ...".

Records are keyed by real path and live as long as the process; a new load of the same file
records it afresh (:func:`forget`, then :func:`record`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from graphcal.errors import GraphcalError


@dataclass(frozen=True)
class Identity:
    """Which file, how long, when last written: what a read must find again."""

    device: int
    inode: int
    size: int
    modified_ns: int
    changed_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> Identity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def change_from(self, old: Identity) -> str | None:
        """What differs from ``old``, in words; None when nothing does."""
        if (self.device, self.inode) != (old.device, old.inode):
            return "another file has taken its name (it was replaced or renamed over)"
        if self.size != old.size:
            return f"its size went from {old.size:,} to {self.size:,} bytes"
        if (self.modified_ns, self.changed_ns) != (old.modified_ns, old.changed_ns):
            return "it was written to (its modification time moved)"
        return None


_records: dict[str, tuple[Identity, str]] = {}  # real path -> (identity, the path as the load named it)
_lock = threading.Lock()


def _key(path: str | os.PathLike) -> str:
    return os.path.realpath(path)


def forget(paths: Iterable[str | os.PathLike]) -> None:
    """Drop the records of ``paths`` (a load about to record them afresh)."""
    with _lock:
        for path in paths:
            _records.pop(_key(path), None)


def record(fd: int, path: str | os.PathLike, shown_as: str | os.PathLike | None = None) -> None:
    """Record the identity of the open file ``fd``, opened at ``path`` (named in messages as ``shown_as``)."""
    identity = Identity.of(os.fstat(fd))
    with _lock:
        _records[_key(path)] = (identity, str(shown_as if shown_as is not None else path))


def check_open(fd: int, path: str | os.PathLike, shown_as: str | os.PathLike | None = None) -> None:
    """The open file ``fd`` (opened at ``path``) is the one recorded for ``path``, unchanged; a file
    without a record is recorded now (its first open)."""
    key = _key(path)
    with _lock:
        known = _records.get(key)
    if known is None:
        record(fd, path, shown_as)
        return
    change = Identity.of(os.fstat(fd)).change_from(known[0])
    if change is not None:
        raise changed(known[1], change)


def check_unchanged(paths: Iterable[str | os.PathLike]) -> None:
    """Each of ``paths`` that has a record is still the recorded file, unchanged (before an output is
    written: onnxruntime read them by path meanwhile)."""
    for path in paths:
        with _lock:
            known = _records.get(_key(path))
        if known is None:
            continue
        try:
            now = Identity.of(os.stat(path))
        except FileNotFoundError:
            raise changed(known[1], "it is gone") from None
        except OSError as e:
            raise changed(known[1], f"it cannot be read any more ({e.strerror or e})") from e
        change = now.change_from(known[0])
        if change is not None:
            raise changed(known[1], change)


def changed(shown_as: str, change: str) -> GraphcalError:
    return GraphcalError(f"{shown_as} changed while graphcal was reading it: {change}; run graphcal again once "
                         "nothing writes to it")
