"""The lock beside ``-o``: an exclusive ``flock`` on ``.NAME.graphcal-lock``, so a second run on the
same folder fails at once instead of racing. Without ``fcntl`` (Windows) there is no lock:
:data:`AVAILABLE` is false.

The lock file says who holds it, as one JSON line (at most 4 kB): the pid, the time the run took the
lock, the host, the boot id and the process's start time in clock ticks after boot (Linux:
``/proc/PID/stat``; with the boot id they tell a reused pid from the run), and the command line. A
run that ends releases the lock and removes the file; one that is killed (SIGKILL, the kernel's
out-of-memory killer) leaves the file but not the ``flock``. The next run takes the lock, and where
the file names a process that is gone, :attr:`Lock.stale` says so in one line, with the likely
cause. A file an older graphcal wrote (``graphcal PID``) is read too.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; concurrent runs on one -o are not detected there
    fcntl = None

from graphcal.errors import GraphcalError, shown

AVAILABLE = fcntl is not None
MAX_LOCK_BYTES = 4096
_OLD_TEXT = re.compile(rb"(?:graphcal (\d+)\n)?")  # an older graphcal's lock file: empty, or the pid


@dataclass(frozen=True)
class Holder:
    """Who wrote a lock file (None where it does not say)."""

    pid: int | None = None
    started: float | None = None  # time.time() when the run took the lock
    host: str | None = None
    boot: str | None = None  # /proc/sys/kernel/random/boot_id
    ticks: int | None = None  # the process's start time, clock ticks after boot (/proc/PID/stat)
    command: str | None = None


class Lock:
    """An exclusive ``flock`` on ``.NAME.graphcal-lock`` beside ``-o``; the file goes with the lock."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd
        self.stale: str | None = None  # one line: the run that left this lock file ended without finishing

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
                pid = _holder_of(fd).pid
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
            left = _parse(os.pread(fd, MAX_LOCK_BYTES + 1, 0)) if stat.S_ISREG(held.st_mode) else None
            if left is None:
                raise GraphcalError(f"{path} is in the way of graphcal's lock file for -o {label}; remove it")
            os.ftruncate(fd, 0)
            os.pwrite(fd, _record(), 0)
        except BaseException:
            os.close(fd)
            raise
        lock = cls(path, fd)
        lock.stale = _ended(left, label)  # a holder named and the flock free: that run did not release it
        return lock

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


def _holder_of(fd: int) -> Holder:
    try:
        return _parse(os.pread(fd, MAX_LOCK_BYTES + 1, 0)) or Holder()
    except OSError:
        return Holder()


def _parse(data: bytes) -> Holder | None:
    """What a lock file says of its holder (``Holder()`` for an empty file), or None where it is no lock file."""
    old = _OLD_TEXT.fullmatch(data)
    if old:
        return Holder(pid=int(old.group(1)) if old.group(1) else None)
    if len(data) > MAX_LOCK_BYTES or not data.startswith(b"{"):
        return None
    try:
        record = json.loads(data)  # one flat object: no nesting for json to recurse into
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or type(record.get("graphcal")) is not int or record["graphcal"] < 1:
        return None

    def field(key, kind):
        value = record.get(key)
        return value if isinstance(value, kind) and not isinstance(value, bool) else None

    return Holder(pid=record["graphcal"], started=field("started", (int, float)), host=field("host", str),
                  boot=field("boot", str), ticks=field("ticks", int), command=field("command", str))


def _record() -> bytes:
    """This process as a lock file's holder: one JSON line, well under :data:`MAX_LOCK_BYTES`."""
    pid = os.getpid()
    record = {"graphcal": pid, "started": round(time.time(), 3), "host": shown(socket.gethostname(), 200),
              "boot": _boot_id(), "ticks": _start_ticks(pid), "command": shown(shlex.join(sys.argv), 2000)}
    return (json.dumps(record) + "\n").encode("ascii")


def _ended(holder: Holder, label) -> str | None:
    """One line where ``holder`` (read from a lock file whose ``flock`` was free) is a run that ended
    without finishing: its process is gone, or its pid is another process's now (another start time
    or boot). None for an empty file, and where that process may still be running."""
    if not holder.pid:  # an empty file (or pid 0): nothing to say
        return None
    here = holder.host is None or holder.host == socket.gethostname()
    if here and (holder.boot is None or holder.boot == _boot_id()) and _alive(holder.pid):
        ticks = _start_ticks(holder.pid)
        if holder.ticks is None or ticks is None or ticks == holder.ticks:
            return None  # the same process, or one that cannot be told from it
    try:
        when = time.strftime(", started %Y-%m-%d %H:%M:%S", time.localtime(holder.started)) if holder.started else ""
    except (OverflowError, ValueError, OSError):  # a time no clock shows (the file is a stranger's, too)
        when = ""
    where = "" if here else f" on {shown(holder.host, 60)}"
    what = f": {shown(holder.command, 200)}" if holder.command else ""
    return (f"the previous graphcal run on -o {label} (pid {holder.pid}{where}{when}{what}) ended without finishing "
            "and left its lock: it was killed, most likely by the kernel's out-of-memory killer, else by a signal "
            "(SIGKILL); `graphcal inspect` with the same model and options estimates the memory a run needs")


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists here (or may: another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process, or a pid this system cannot hold: not known to be gone
    return True


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read(64).decode("ascii", "replace").strip() or None
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (field 22 of /proc/PID/stat), None where unknown."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            text = f.read(4096)
        return int(text[text.rindex(b")") + 2:].split()[19])  # after the command name, which may hold spaces
    except (OSError, ValueError, IndexError):
        return None
