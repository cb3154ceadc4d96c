"""The lock beside ``-o``: an exclusive ``flock`` on ``.NAME.graphcal-lock``, so a second run on the
same folder fails at once instead of racing. The lock file holds the holder's pid and goes with
the lock. Without ``fcntl`` (Windows) there is no lock: :data:`AVAILABLE` is false.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; concurrent runs on one -o are not detected there
    fcntl = None

from graphcal.errors import GraphcalError

AVAILABLE = fcntl is not None
_LOCK_TEXT = re.compile(rb"(?:graphcal (\d+)\n)?")  # what a lock file holds: empty, or the pid


class Lock:
    """An exclusive ``flock`` on ``.NAME.graphcal-lock`` beside ``-o``; the file goes with the lock."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def take(cls, path: Path, label) -> Lock:
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
