"""Limits for input from strangers: open regular files only, know the memory before reading.

Models, data and recipes come from elsewhere. A path may name a FIFO (opening it blocks until
a writer comes), a device (``/dev/zero`` never ends), a socket or a folder; a declared size may
exceed the machine. Every input file graphcal reads goes through :func:`open_regular`, and every
read whose size a file declares is checked against :func:`available_memory` first.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import BinaryIO

from graphcal.errors import GraphcalError, shown


def file_kind(mode: int) -> str:
    """What a stat mode describes, for messages: 'a FIFO', 'a character device', ..."""
    for test, label in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return label
    return "not a regular file"


def open_regular(path: str | os.PathLike, what: str = "file", error: type[GraphcalError] = GraphcalError,
                 noun: str = "file") -> BinaryIO:
    """``path`` opened for binary reading, refused (``error``, one line: "PATH is a FIFO, not a
    regular ``noun``") unless it is a regular file; symlinks to regular files are fine.

    The open itself cannot block: O_NONBLOCK makes a FIFO's open return at once, and the
    descriptor is checked with fstat (no race between a check and the open)."""
    try:
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(path, flags | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise error(f"{what} not found: {path}") from None
    except OSError as e:
        raise error(f"cannot open {what} {path}: {e.strerror or e}") from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{path} is {file_kind(mode)}, not a regular {noun}")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def confinement(folder: str | os.PathLike) -> tuple[str, ...]:
    """The real folders a file named in the model folder ``folder`` may lead into by symbolic links:
    the folder's own real path and, where it is a Hugging Face cache snapshot
    (``.../models--ORG--NAME/snapshots/REVISION/...``, each file a link to ``../../blobs/HASH``), that
    repository's ``blobs`` folder, which holds what the snapshot's links point at and nothing else."""
    real = Path(os.path.realpath(folder))
    for above in real.parents:
        if above.name == "snapshots" and above.parent.name.startswith("models--"):
            blobs = above.parent / "blobs"
            return (str(real), str(blobs)) if blobs.is_dir() and not blobs.is_symlink() else (str(real),)
    return (str(real),)


def leads_inside(roots: tuple[str, ...], real: str) -> bool:
    """Whether the real path ``real`` is one of ``roots`` (:func:`confinement`) or lies inside one."""
    return any(os.path.commonpath([root, real]) == root for root in roots)


def inside_folder(folder: str | os.PathLike, name: str, why: str) -> str | None:
    """The real path of ``folder/name`` (None when there is none), refused in one line where a link
    leads it out of ``folder`` (or onto the folder itself): "...: copy the file in; graphcal ``why``".
    In a Hugging Face cache snapshot a link into the repository's blobs is inside (:func:`confinement`)."""
    path = os.path.join(folder, name)
    if not os.path.lexists(path):
        return None
    roots, real = confinement(folder), os.path.realpath(path)
    if not leads_inside(roots, real) or real in roots:
        raise GraphcalError(f"{path} leads out of the model's folder (to {shown(real, 120)}): copy the file in; "
                            f"graphcal {why}")
    return real


def read_regular(path: str | os.PathLike, what: str, max_bytes: int,
                 error: type[GraphcalError] = GraphcalError) -> bytes:
    """The whole of a regular file of at most ``max_bytes`` (refused before reading otherwise)."""
    with open_regular(path, what, error) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise error(f"{what} {path} is {size:,} bytes; graphcal reads at most {max_bytes:,}")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise error(f"{what} {path} grew past {max_bytes:,} bytes while it was read")
    return data


def available_memory(meminfo: str = "/proc/meminfo", proc_cgroup: str = "/proc/self/cgroup",
                     cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes of memory this process can still take, or None if unknown: the smaller of the system's
    (Linux MemAvailable) and what the memory cgroup it runs in leaves (:func:`cgroup_memory_left`:
    ``systemd-run -p MemoryMax=14G``, a container's limit). The paths are arguments for tests."""
    system = _meminfo_available(meminfo)
    left = cgroup_memory_left(proc_cgroup, cgroup_root)
    known = [n for n in (system, left) if n is not None]
    return min(known) if known else None


def _meminfo_available(meminfo: str) -> int | None:
    try:
        with open(meminfo, "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        pages, page_size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def cgroup_memory_left(proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes the memory cgroups of this process still allow (limit minus usage, the least over the
    cgroup and every cgroup above it: a limit set on a parent binds its children), or None where no
    limit is set or none can be read. cgroup v2: ``memory.max`` ("max": none) and ``memory.current``
    under ``cgroup_root``/PATH for the ``0::PATH`` line; v1: ``memory.limit_in_bytes`` and
    ``memory.usage_in_bytes`` under ``cgroup_root``/memory/PATH for the ``memory`` controller's line."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            found += _left(Path(cgroup_root), parts[2], "memory.max", "memory.current")
        elif "memory" in parts[1].split(","):
            found += _left(Path(cgroup_root) / "memory", parts[2], "memory.limit_in_bytes", "memory.usage_in_bytes")
    return min(found) if found else None


def _left(root: Path, path: str, limit_file: str, usage_file: str) -> list[int]:
    """limit - usage for each cgroup from ``path`` up to ``root`` that has a limit (a container sees
    its own cgroup as ``root``: its files are read there when ``path`` is not under it)."""
    out = []
    here = root / path.strip("/")
    folders = [here, *here.relative_to(root).parents] if path.strip("/") else [root]
    for folder in folders:
        folder = root / folder if not folder.is_absolute() else folder
        limit, usage = _read_number(folder / limit_file), _read_number(folder / usage_file)
        if limit is not None and limit < _UNLIMITED:
            out.append(max(0, limit - (usage or 0)))
    return out


def _read_number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def resident_memory() -> int:
    """Bytes this process holds in memory now (its resident set, Linux /proc/self/statm), 0 if unknown:
    memory already held is not asked of :func:`available_memory` again."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def check_fits(nbytes: int, what: str, share: float = 0.5, hint: str = "") -> None:
    """Refuse to hold ``nbytes`` at once when that exceeds ``share`` of the available memory."""
    free = available_memory()
    if free is not None and nbytes > share * free:
        raise GraphcalError(f"{what} needs {format_size(nbytes)} at once, more than {share:.0%} of the {format_size(free)} of "
                            f"memory available{'; ' + hint if hint else ''}")


def format_size(n: float) -> str:
    """A byte count for messages: 8.2 kB, 3.1 MB, 2.1 GB (decimal units)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


# a JSON string, skipped whole (escapes included; an unterminated one runs to the end), or a bracket
_JSON_STRUCTURE = re.compile(r'"[^"\\]*(?:\\[\s\S][^"\\]*)*(?:"|$)|[\[\]{}]')


def json_depth(text: str, stop_above: int) -> int:
    """How deep ``text``'s JSON arrays and objects nest (brackets inside strings not counted),
    counted no further than ``stop_above + 1``: read before ``json`` recurses once per level into a
    stranger's text (and ends in RecursionError past Python's limit)."""
    depth = deepest = 0
    for m in _JSON_STRUCTURE.finditer(text):
        ch = m.group()
        if ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > stop_above:
                    break
        elif ch in "]}":
            depth -= 1
    return deepest
