"""Write a run's outputs safely: all files appear together, the previous output stays otherwise,
and nothing graphcal did not write is ever deleted.

The rules for an output folder (``-o``):

- graphcal replaces a folder only if it is empty or holds its own output, recognised by content:
  the manifest (``.graphcal-manifest.json``) written into every output lists each file with its
  size and mtime, and every entry of the folder must be a regular file the manifest lists,
  unchanged. A folder, a link, an edited or an unlisted file, or no manifest (an older output, a
  user's folder): the run is refused before calibrating.
- ``-o`` may not be a symbolic link (graphcal says where it points), a mount point (the folder is
  replaced whole, which a mount point cannot be) or a folder holding an input, whether the input
  is given through a link or not.
- :func:`reserve_output` takes a lock beside ``-o`` (``.NAME.graphcal-lock``, ``flock``) at the
  start of a run, so a second run on the same ``-o`` fails at once instead of racing; holding it,
  it removes the temporary folders (``.NAME.tmp-*``, ``.NAME.old-*``) that killed runs left
  beside ``-o``, recognised by their marker file or manifest; others are named in a warning.
- Files are written into a temporary folder beside ``-o`` (its marker written first), then swapped
  in with two renames; a failed swap puts the previous output back. A killed run leaves the old
  output or the new one, never a mix. The replaced folder's mode and its files' modes are kept; a
  new output gets the umask's modes.
- SIGTERM during the write phase is turned into an interruption (:class:`Terminated`, a
  ``KeyboardInterrupt``) so the temporary folder is removed, as Ctrl-C does; the CLI does so for
  the whole run (:func:`sigterm_as_interrupt`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import os
import re
import secrets
import shutil
import signal
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; concurrent runs on one -o are not detected there
    fcntl = None

from graphcal.errors import GraphcalError

MODEL_FILE = "model.onnx"
MANIFEST = ".graphcal-manifest.json"  # in every output folder: the files graphcal wrote there
TMP_MARKER = ".graphcal-tmp"  # first file in a temporary folder: graphcal made it (holds the pid)
_FORMAT = 1
_LOCK_TEXT = re.compile(rb"(?:graphcal (\d+)\n)?")  # what a lock file holds: empty, or the pid


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C so the same clean-up runs (the CLI exits 143)."""


def torchrun_rank() -> int | None:
    """This process's rank under torchrun (WORLD_SIZE > 1), else None."""
    try:
        if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
            return None
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return None  # malformed: graphcal.calibration.distributed.from_env reports it


@contextlib.contextmanager
def sigterm_as_interrupt(enabled: bool = True, only_if_default: bool = False) -> Iterator[None]:
    """Inside, SIGTERM raises :class:`Terminated` in the main thread; the previous handler is put
    back on the way out. Does nothing outside the main thread, when not ``enabled``, or, with
    ``only_if_default``, when SIGTERM already has a handler other than the default one."""
    if (not enabled or threading.current_thread() is not threading.main_thread()
            or not hasattr(signal, "SIGTERM")):
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is None or (only_if_default and previous is not signal.SIG_DFL):
        yield  # None: a handler set outside Python, which could not be put back
        return

    def interrupt(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------------------------------------
# Checks: is -o a folder graphcal may replace?
# ---------------------------------------------------------------------------------------------


def _place(p: str | os.PathLike) -> Path:
    """``p`` made absolute with its folder resolved, but not its last component (a link stays one)."""
    a = Path(os.path.abspath(p))
    return a.parent.resolve() / a.name if a.name else a


def _inside(p: Path, folder: Path) -> bool:
    return p == folder or folder in p.parents


def check_output_dir(out_dir: str | os.PathLike, inputs: Iterable[str | os.PathLike] = ()) -> Path:
    """Refuse an ``-o`` graphcal must not replace (see the module's rules); return its absolute path.

    Reads only: nothing is created, locked or removed.
    """
    dest = _place(out_dir)
    if dest.is_symlink():
        raise GraphcalError(f"-o {out_dir} is a symbolic link to {os.readlink(dest)}; give the real folder")
    if dest.exists() and not dest.is_dir():
        raise GraphcalError(f"output path {out_dir} is a file; give a folder for -o")
    for p in inputs:
        if _inside(_place(p), dest) or _inside(Path(p).resolve(), dest):
            raise GraphcalError(f"-o {out_dir} would overwrite the input {p} (graphcal replaces the whole folder); "
                                "choose another folder")
    if dest.is_dir() and os.path.ismount(dest):
        raise GraphcalError(f"-o {out_dir} is a mount point; graphcal replaces the folder whole: give a folder inside it")
    if dest.is_dir():
        _refuse_foreign(dest, out_dir)
    parent = _missing_parents(dest)[0]
    if not os.access(parent, os.W_OK):
        raise GraphcalError(f"cannot write to {parent}: permission denied")
    return dest


def _missing_parents(path: Path) -> tuple[Path, list[Path]]:
    """(the nearest existing ancestor of ``path``, the ancestors below it that do not exist yet, nearest first)."""
    parent, missing = path.parent, []
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    return parent, missing


def _read_manifest(folder: Path) -> dict | None:
    """The ``files`` of ``folder``'s manifest, or None when there is no valid one."""
    path = folder / MANIFEST
    try:
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_size > 1 << 22:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    files = data.get("files") if isinstance(data, dict) and data.get("graphcal") == _FORMAT else None
    return files if isinstance(files, dict) else None


def _unchanged(entry: os.DirEntry, record) -> bool:
    """``entry`` is a regular file with the size and mtime ``record`` (a manifest entry) gives."""
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    return (isinstance(record, dict) and stat.S_ISREG(st.st_mode)
            and record.get("size") == st.st_size and record.get("mtime_ns") == st.st_mtime_ns)


def _foreign(folder: Path) -> tuple[list[str], bool]:
    """The entries of ``folder`` graphcal cannot vouch for (described), and whether it has a manifest.

    An empty folder has none. Without a valid manifest every entry is foreign.
    """
    with os.scandir(folder) as it:
        entries = sorted(it, key=lambda e: e.name)
    manifest = _read_manifest(folder)
    foreign = []
    for e in entries:
        if manifest is not None and (e.name == MANIFEST or _unchanged(e, manifest.get(e.name))):
            continue
        if e.is_symlink():
            foreign.append(f"{e.name} (a link)")
        elif e.is_dir(follow_symlinks=False):
            foreign.append(f"{e.name}/ (a folder)")
        elif manifest is not None and e.name in manifest:
            foreign.append(f"{e.name} (changed since graphcal wrote it)")
        else:
            foreign.append(e.name)
    return foreign, manifest is not None


def _refuse_foreign(folder: Path, label) -> None:
    try:
        foreign, has_manifest = _foreign(folder)
    except OSError as e:
        raise GraphcalError(f"cannot read the output folder {label}: {e.strerror or e}") from e
    if not foreign:
        return
    names = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
    why = "" if has_manifest else f"; it has no graphcal manifest ({MANIFEST})"
    raise GraphcalError(f"output folder {label} holds files graphcal did not write ({names}){why}; "
                        "choose a new or empty folder for -o, or remove them")


def _left_by_graphcal(folder: Path) -> bool:
    """A temporary folder graphcal made (its marker), or an output of graphcal's set aside."""
    if _has_marker(folder):
        return True
    try:
        return not _foreign(folder)[0]
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# The lock beside -o
# ---------------------------------------------------------------------------------------------


class _Lock:
    """An exclusive ``flock`` on ``.NAME.graphcal-lock`` beside ``-o``; the file goes with the lock."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def take(cls, path: Path, label) -> _Lock:
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        while True:
            try:
                fd = os.open(path, flags, 0o666)
            except OSError as e:
                what = "is a symbolic link; remove it" if path.is_symlink() else f"cannot be opened: {e.strerror or e}"
                raise GraphcalError(f"graphcal's lock file {path} {what}") from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = _lock_pid(fd)
                os.close(fd)
                raise GraphcalError(f"another graphcal run is writing to -o {label}"
                                    f"{f' (pid {pid})' if pid else ''}; wait for it to end or choose another folder"
                                    ) from None
            except BaseException:
                os.close(fd)
                raise
            try:  # the holder before us may have removed the file: lock the one the path names
                held = os.fstat(fd)
                same = os.path.samestat(held, os.stat(path, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            if not stat.S_ISREG(held.st_mode) or held.st_size > 64 or not _LOCK_TEXT.fullmatch(os.pread(fd, 64, 0)):
                raise GraphcalError(f"{path} is in the way of graphcal's lock file for -o {label}; remove it")
            text = f"graphcal {os.getpid()}\n".encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, text, 0)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    def release(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:  # unlink while holding the lock; a waiter then finds the path gone and retries
            if os.path.samestat(os.fstat(fd), os.stat(self.path, follow_symlinks=False)):
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(fd)


def _lock_pid(fd: int) -> int | None:
    try:
        m = _LOCK_TEXT.fullmatch(os.pread(fd, 64, 0))
    except OSError:
        return None
    return int(m.group(1)) if m and m.group(1) else None


# ---------------------------------------------------------------------------------------------
# Reservation and writing
# ---------------------------------------------------------------------------------------------

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
        self._lock: _Lock | None = None
        self._created: list[Path] = []  # parent folders made for the lock, removed unless written
        self._written = False
        self._released = False

    def __enter__(self) -> OutputSlot:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.release()

    def _claim(self) -> None:
        for folder in reversed(_missing_parents(self.path)[1]):
            try:
                folder.mkdir()
            except FileExistsError:
                continue
            except OSError as e:
                raise GraphcalError(f"cannot create {folder}: {e.strerror or e}") from e
            self._created.append(folder)
        if fcntl is not None:
            try:
                self._lock = _Lock.take(self.path.parent / f".{self.path.name}.graphcal-lock", self.label)
            except OSError as e:  # e.g. ENOLCK on a network file system without locks
                self.warnings.append(f"could not lock -o {self.label} ({e.strerror or e}): "
                                     "a concurrent run on it would not be noticed")
        if self._lock is not None and self.path.is_dir():
            _refuse_foreign(self.path, self.label)  # again: a run that held the lock may just have written
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
                    and _left_by_graphcal(folder)):
                self.warnings.append(f"left alone {folder}: named like graphcal's temporary folders but not "
                                     "marked as one; remove it if it is not yours")
            elif self._lock is None:
                self.warnings.append(f"{folder} is left from an interrupted graphcal run; remove it once no "
                                     "run is writing to -o (no lock here to tell)")
            elif not _remove_ours(folder):
                self.warnings.append(f"could not remove {folder}, left by an interrupted graphcal run")

    def write(self, write: Callable[[Path], list[Path]]) -> list[Path]:
        """Call ``write(tmp_dir)``, then swap ``tmp_dir`` in as ``-o``; return the final paths of
        the files ``write`` returned. Releases the reservation."""
        if self._released or not self.main:
            raise RuntimeError("write() needs a reservation held by the writing process")
        try:
            with sigterm_as_interrupt(only_if_default=True):
                tmp, files = self._write_tmp(write)
                self._swap(tmp)
                self._written = True
        finally:
            self.release()
        return [self.path / f.name for f in files]

    def release(self) -> None:
        """Unlock -o (and remove parent folders made for the lock when nothing was written)."""
        if self._released:
            return
        self._released = True
        if self._lock is not None:
            self._lock.release()
        if not self._written:
            for folder in reversed(self._created):
                with contextlib.suppress(OSError):
                    folder.rmdir()

    def _aside(self, kind: str) -> Path:
        return self.path.parent / f".{self.path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"

    def _write_tmp(self, write) -> tuple[Path, list[Path]]:
        tmp = self._aside("tmp")
        try:
            os.mkdir(tmp, 0o777)  # the umask applies: a new output gets the user's usual mode
        except OSError as e:
            raise GraphcalError(f"could not write outputs to {self.path.parent}: {e.strerror or e}") from e
        try:
            fd = os.open(tmp / TMP_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                os.write(fd, f"graphcal {os.getpid()}\n".encode())
            finally:
                os.close(fd)
            umask_mode = stat.S_IMODE((tmp / TMP_MARKER).stat().st_mode)  # 0o666 & ~umask, read without os.umask
            files = [Path(f) for f in write(tmp)]
            names = sorted(e.name for e in os.scandir(tmp) if e.is_file(follow_symlinks=False) and e.name != TMP_MARKER)
            for n in names:
                _fsync(tmp / n)
            records = {}
            for n in names:
                st = os.stat(tmp / n)
                records[n] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
            manifest = {"graphcal": _FORMAT, "files": records,
                        "about": "graphcal wrote this folder; a later run replaces it only while these files "
                                 "are unchanged and nothing else is in it"}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            _fsync(tmp / MANIFEST)
            self._keep_modes(tmp, [*names, MANIFEST], umask_mode)
            os.unlink(tmp / TMP_MARKER)  # from here the manifest marks it
            with contextlib.suppress(OSError):
                folder_mode = stat.S_IMODE(self.path.stat().st_mode) if self.path.is_dir() else None
                if folder_mode is not None:
                    os.chmod(tmp, folder_mode)
            _fsync(tmp)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise GraphcalError(f"could not write outputs to {self.path.parent}: {e.strerror or e}") from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
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
                _refuse_foreign(self.path, self.label)  # again: a user may have put files there meanwhile
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
        if old is not None and not _remove_ours(old):
            self.warnings.append(f"could not remove {old}, the previous output set aside; remove it")


def _has_marker(folder: Path) -> bool:
    try:
        return stat.S_ISREG((folder / TMP_MARKER).lstat().st_mode)
    except OSError:
        return False


def _fsync(path: Path) -> None:
    if os.name == "nt" and path.is_dir():
        return  # Windows cannot open folders for fsync
    fd = os.open(path, os.O_RDWR if os.name == "nt" else os.O_RDONLY)  # Windows flushes writable handles only
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_ours(folder: Path) -> bool:
    """Remove ``folder``, a temporary folder graphcal made (marker: all of it) or an output of
    graphcal's set aside (its manifest's unchanged files, the manifest, then the folder if empty).
    Returns whether it is gone."""
    with contextlib.suppress(OSError):
        mode = stat.S_IMODE(folder.stat().st_mode)
        if mode & 0o700 != 0o700:
            os.chmod(folder, mode | 0o700)  # a read-only output of ours: make its files removable
    try:
        if _has_marker(folder):
            shutil.rmtree(folder, ignore_errors=True)
        else:
            manifest = _read_manifest(folder) or {}
            with os.scandir(folder) as it:
                mine = [e.path for e in it if e.name != MANIFEST and _unchanged(e, manifest.get(e.name))]
            for p in mine:
                os.unlink(p)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(folder / MANIFEST)
            folder.rmdir()
    except OSError:
        pass
    return not os.path.lexists(folder)


def write_atomically(out_dir: str | os.PathLike, write: Callable[[Path], list[Path]]) -> list[Path]:
    """Reserve ``out_dir`` (no inputs to protect), call ``write(tmp_dir)`` and swap the files in."""
    with reserve_output(out_dir, (), main=True) as slot:
        return slot.write(write)
