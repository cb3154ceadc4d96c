"""An output folder reserved, written and swapped in: all files appear together, the previous
output stays otherwise, and nothing graphcal did not write is ever deleted.

- :func:`reserve_output` checks ``-o`` (:mod:`graphcal.output.folder`), takes the lock beside it
  (:mod:`graphcal.output.lock`; where a killed run left its lock file, a warning says at once, on
  stderr, which run that was and the likely cause) and, holding it, removes the temporary folders
  (``.NAME.tmp-*``, ``.NAME.old-*``) that killed runs left beside ``-o``, recognised by their marker
  file or manifest; others are named in a warning.
- :meth:`OutputSlot.write` writes the files into a temporary folder beside ``-o`` (its marker
  written first), adds the manifest (:mod:`graphcal.output.manifest`), then swaps it in with two
  renames; a failed swap puts the previous output back. A killed run leaves the old output or the
  new one, never a mix. The replaced folder's mode and its files' modes are kept; a new output
  gets the umask's modes. SIGTERM during the write cleans up as Ctrl-C does
  (:mod:`graphcal.output.process`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import re
import secrets
import shutil
import stat
import sys
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path

from graphcal.errors import GraphcalError
from graphcal.output.folder import TMP_MARKER, check_output_dir, left_by_graphcal, missing_parents, refuse_foreign, remove_ours
from graphcal.output.lock import AVAILABLE as LOCKS
from graphcal.output.lock import Lock
from graphcal.output.manifest import MANIFEST, write_manifest
from graphcal.output.process import register_abort, sigterm_as_interrupt, torchrun_rank, unregister_abort

_SCOPE: contextvars.ContextVar[list | None] = contextvars.ContextVar("graphcal_output_scope", default=None)


def releases_outputs(fn):
    """Decorator: every :class:`OutputSlot` reserved during a call of ``fn`` is released when the
    call returns or raises (so a failed calibration never keeps ``-o`` locked)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        slots: list[OutputSlot] = []
        token = _SCOPE.set(slots)
        try:
            return fn(*args, **kwargs)
        finally:
            _SCOPE.reset(token)
            for slot in slots:
                slot.release()

    return wrapper


def reserve_output(out_dir: str | os.PathLike, inputs: Iterable[str | os.PathLike] = (), *,
                   main: bool | None = None) -> OutputSlot:
    """Check ``out_dir`` (:func:`check_output_dir`), lock it, clear what killed runs left beside it.

    ``main``: whether this process writes; by default all but torchrun's ranks other than 0.
    Other ranks only check. Returns an :class:`OutputSlot` (a context manager): ``.write(fn)``
    writes and swaps the files in, ``.warnings`` says what was left alone, ``.release()``
    unlocks (``write`` does, as does leaving ``with``, a :func:`releases_outputs` scope, or GC).
    """
    inputs = list(inputs)
    dest = check_output_dir(out_dir, inputs)
    if main is None:
        main = torchrun_rank() in (None, 0)
    slot = OutputSlot(out_dir, dest, main)
    scope = _SCOPE.get()
    if scope is not None:
        scope.append(slot)
    if main:
        try:
            slot._claim()
        except BaseException:
            slot.release()
            raise
    return slot


class OutputSlot:
    """An output folder reserved for one run: checked, locked, ready for :meth:`write`."""

    def __init__(self, label, path: Path, main: bool):
        self.label, self.path, self.main = label, path, main
        self.warnings: list[str] = []
        self._lock: Lock | None = None
        self._created: list[Path] = []  # parent folders made for the lock, removed unless written
        self._written = False
        self._released = False
        self._abort_key: int | None = None  # release() registered for an abort from another thread
        self._tmp: Path | None = None  # the temporary folder, once made (early_folder or write)
        self._tmp_abort: int | None = None  # its removal, registered for an abort from another thread

    def __enter__(self) -> OutputSlot:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.release()

    def _claim(self) -> None:
        slot = weakref.ref(self)  # weak: a slot dropped unreleased is still released by __del__
        self._abort_key = register_abort(lambda: (s := slot()) is not None and s.release())  # the lock goes on an abort
        for folder in reversed(missing_parents(self.path)[1]):
            try:
                folder.mkdir()
            except FileExistsError:
                continue
            except OSError as e:
                raise GraphcalError(f"cannot create {folder}: {e.strerror or e}") from e
            self._created.append(folder)
        if LOCKS:
            try:
                self._lock = Lock.take(self.path.parent / f".{self.path.name}.graphcal-lock", self.label)
            except OSError as e:  # e.g. ENOLCK on a network file system without locks
                self.warnings.append(f"could not lock -o {self.label} ({e.strerror or e}): "
                                     "a concurrent run on it would not be noticed")
        if self._lock is not None and self._lock.stale:
            # said at once, not with the run's warnings at its end: this run may be killed for the same reason
            print(f"warning: {self._lock.stale}", file=sys.stderr, flush=True)
        if self._lock is not None and self.path.is_dir():
            refuse_foreign(self.path, self.label)  # again: a run that held the lock may just have written
        self._clear_leftovers()

    def _clear_leftovers(self) -> None:
        """Remove what killed runs left beside -o (safe: holding the lock, no run can be using it)."""
        name = self.path.name
        ours = re.compile(rf"\.{re.escape(name)}\.(tmp|old)-\d+-[0-9a-f]{{8}}")
        prefixes = (f".{name}.tmp-", f".{name}.old-")
        try:
            with os.scandir(self.path.parent) as it:
                names = sorted(e.name for e in it if e.name.startswith(prefixes))
        except OSError:
            return
        for entry in names:
            folder = self.path.parent / entry
            if not (ours.fullmatch(entry) and not folder.is_symlink() and folder.is_dir()
                    and left_by_graphcal(folder)):
                self.warnings.append(f"left alone {folder}: named like graphcal's temporary folders but not "
                                     "marked as one; remove it if it is not yours")
            elif self._lock is None:
                self.warnings.append(f"{folder} is left from an interrupted graphcal run; remove it once no "
                                     "run is writing to -o (no lock here to tell)")
            elif not remove_ours(folder):
                self.warnings.append(f"could not remove {folder}, left by an interrupted graphcal run")

    def early_folder(self) -> Path:
        """The temporary folder :meth:`write` will fill and swap in, made now (marker first), for a
        file written before the outputs are (the streamed weights' data file, graph.spill; the block
        cache's folder, calibration.block_cache, which its walk deletes before the write). Removed
        with what it holds when the slot is released unwritten (an error, Ctrl-C, SIGTERM) or on an abort."""
        if self._released or not self.main:
            raise RuntimeError("early_folder() needs a reservation held by the writing process")
        if self._tmp is None:
            self._make_tmp()
        return self._tmp

    def write(self, write: Callable[[Path], list[Path]]) -> list[Path]:
        """Call ``write(tmp_dir)``, then swap ``tmp_dir`` in as ``-o``; return the final paths of
        the files ``write`` returned. Releases the reservation."""
        if self._released or not self.main:
            raise RuntimeError("write() needs a reservation held by the writing process")
        try:
            with sigterm_as_interrupt(only_if_default=True):
                tmp, files = self._write_tmp(write)
                self._swap(tmp)
                self._tmp = None  # swapped in: -o now, no temporary folder to remove
                self._written = True
        finally:
            self.release()
        return [self.path / f.name for f in files]

    def release(self) -> None:
        """Unlock -o (and remove parent folders made for the lock when nothing was written)."""
        if self._released:
            return
        self._released = True
        unregister_abort(self._abort_key)
        self._drop_tmp()
        if self._lock is not None:
            self._lock.release()
        if not self._written:
            for folder in reversed(self._created):
                with contextlib.suppress(OSError):
                    folder.rmdir()

    def _aside(self, kind: str) -> Path:
        return self.path.parent / f".{self.path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"

    def _make_tmp(self) -> None:
        tmp = self._aside("tmp")
        try:
            os.mkdir(tmp, 0o777)  # the umask applies: a new output gets the user's usual mode
        except OSError as e:
            raise GraphcalError(f"could not write outputs to {self.path.parent}: {e.strerror or e}") from e
        self._tmp = tmp
        self._tmp_abort = register_abort(lambda: shutil.rmtree(tmp, ignore_errors=True))  # stopped from another thread
        with self._dropped_on_failure():
            fd = os.open(tmp / TMP_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                os.write(fd, f"graphcal {os.getpid()}\n".encode())
            finally:
                os.close(fd)

    @contextlib.contextmanager
    def _dropped_on_failure(self):
        """The temporary folder removed if the block fails; an OSError said in one line."""
        try:
            yield
        except OSError as e:
            self._drop_tmp()
            raise GraphcalError(f"could not write outputs to {self.path.parent}: {e.strerror or e}") from e
        except BaseException:
            self._drop_tmp()
            raise

    def _drop_tmp(self) -> None:
        """Remove the temporary folder (unless swapped in already) and its abort hook."""
        unregister_abort(self._tmp_abort)
        self._tmp_abort = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)  # gone already once swapped in as -o
            self._tmp = None

    def _write_tmp(self, write) -> tuple[Path, list[Path]]:
        if self._tmp is None:
            self._make_tmp()
        tmp = self._tmp
        with self._dropped_on_failure():
            umask_mode = stat.S_IMODE((tmp / TMP_MARKER).stat().st_mode)  # 0o666 & ~umask, read without os.umask
            files = [Path(f) for f in write(tmp)]
            names = sorted(e.name for e in os.scandir(tmp) if e.is_file(follow_symlinks=False) and e.name != TMP_MARKER)
            write_manifest(tmp, names)  # each file flushed and hashed in one read, then the manifest
            self._keep_modes(tmp, [*names, MANIFEST], umask_mode)
            os.unlink(tmp / TMP_MARKER)  # from here the manifest marks it
            with contextlib.suppress(OSError):
                folder_mode = stat.S_IMODE(self.path.stat().st_mode) if self.path.is_dir() else None
                if folder_mode is not None:
                    os.chmod(tmp, folder_mode)
            _fsync(tmp)
        return tmp, files

    def _keep_modes(self, tmp: Path, names: list[str], new_mode: int) -> None:
        """Files replacing same-named files of the old output get their modes, others ``new_mode``
        (writers such as safetensors' make their files private whatever the umask)."""
        for n in names:
            try:
                old = (self.path / n).lstat()
                mode = stat.S_IMODE(old.st_mode) if stat.S_ISREG(old.st_mode) else new_mode
            except OSError:
                mode = new_mode
            if stat.S_IMODE((tmp / n).stat().st_mode) != mode:
                os.chmod(tmp / n, mode)

    def _swap(self, tmp: Path) -> None:
        old = None
        try:
            if os.path.lexists(self.path):
                if self.path.is_symlink() or not self.path.is_dir():
                    raise GraphcalError(f"-o {self.label} was replaced by a file or link during the run; "
                                        "nothing was written")
                refuse_foreign(self.path, self.label)  # again: a user may have put files there meanwhile
                old = self._aside("old")
                os.rename(self.path, old)
            os.rename(tmp, self.path)
        except BaseException as e:
            if old is not None and not os.path.lexists(self.path):
                with contextlib.suppress(OSError):
                    os.rename(old, self.path)
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError):
                raise GraphcalError(f"could not move the outputs into {self.path}: {e.strerror or e}; "
                                    "the previous output is unchanged") from e
            raise
        with contextlib.suppress(OSError):
            _fsync(self.path.parent)
        if old is not None and not remove_ours(old):
            self.warnings.append(f"could not remove {old}, the previous output set aside; remove it")



def write_atomically(out_dir: str | os.PathLike, write: Callable[[Path], list[Path]]) -> list[Path]:
    """Reserve ``out_dir`` (no inputs to protect), call ``write(tmp_dir)`` and swap the files in."""
    with reserve_output(out_dir, (), main=True) as slot:
        return slot.write(write)



def _fsync(path: Path) -> None:
    if os.name == "nt" and path.is_dir():
        return  # Windows cannot open folders for fsync
    fd = os.open(path, os.O_RDWR if os.name == "nt" else os.O_RDONLY)  # Windows flushes writable handles only
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

