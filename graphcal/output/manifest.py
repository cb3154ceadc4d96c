"""The manifest (``.graphcal-manifest.json``) in every output folder: each file graphcal wrote
there, by size and sha256.

It records content and nothing else: no time, no folder name. Two identical runs, to the same
``-o`` or to different ones, give byte-identical folders, the manifest included. A file is
*vouched for* (graphcal may replace or remove it) while it is a regular file whose size and
sha256 are the manifest's.

Format 2 is written. Format 1 (graphcal before the content manifest) recorded each file's size
and mtime; it is still read, and its files are vouched for by size and mtime as it was written,
so an upgraded graphcal replaces an older graphcal's untouched output as before. Any other
format, or a manifest that is not valid JSON, is no manifest: the folder is refused.

Digests are computed once per file and process: a file hashed before is not hashed again while
its device, inode, size, mtime and ctime are unchanged, so the checks a run repeats (before
calibrating, after locking, before the swap, when removing the replaced output) read a multi-GB
model once. A write sets the ctime to the clock's time and no call can set it back; a digest is
kept only for a file whose ctime was at least :data:`SETTLED_NS` old when hashing began, so any
later write gives it a new ctime, however coarse the file system's clock.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from graphcal.limits import json_depth

MANIFEST = ".graphcal-manifest.json"  # in every output folder: the files graphcal wrote there
FORMAT = 2  # {"graphcal": 2, "files": {name: {"sha256": hex, "size": bytes}}, "about": ...}
OLD_FORMAT = 1  # {"graphcal": 1, "files": {name: {"mtime_ns": ns, "size": bytes}}, "about": ...}: read, never written
MAX_MANIFEST_BYTES = 1 << 22
MAX_MANIFEST_DEPTH = 8  # a manifest nests 3 deep; the cap keeps json's recursion far from Python's limit
ABOUT = ("graphcal wrote this folder; a later run replaces it only while these files are unchanged "
         "(size and sha256) and nothing else is in it")
_CHUNK = 1 << 20
_DIGESTS: dict[tuple[int, ...], str] = {}  # (dev, ino, size, mtime_ns, ctime_ns) -> sha256 of a file hashed before
_MAX_CACHED = 4096
SETTLED_NS = 2_000_000_000  # a digest is kept only for a file unchanged for this long before it was hashed


@dataclass(frozen=True)
class Manifest:
    """A folder's manifest as read: its format and ``files`` (name -> the record written)."""

    format: int
    files: dict

    def vouches(self, entry: os.DirEntry) -> bool:
        """``entry`` is a regular file the manifest lists, unchanged (size and sha256; format 1: size and mtime)."""
        record = self.files.get(entry.name)
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            return False
        if not (isinstance(record, dict) and stat.S_ISREG(st.st_mode) and record.get("size") == st.st_size):
            return False
        if self.format == OLD_FORMAT:
            return record.get("mtime_ns") == st.st_mtime_ns
        want = record.get("sha256")
        return isinstance(want, str) and sha256_of(entry.path, st) == want


def read_manifest(folder: Path) -> Manifest | None:
    """``folder``'s manifest, or None when there is no valid one (missing, not a regular file,
    over 4 MB, nested more than 8 levels deep, not JSON, or of a format this graphcal does not know)."""
    path = folder / MANIFEST
    try:
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
            return None
        text = path.read_text(encoding="utf-8")
        if json_depth(text, MAX_MANIFEST_DEPTH) > MAX_MANIFEST_DEPTH:
            return None  # a stranger's file: json would recurse once per level (RecursionError)
        data = json.loads(text)
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("graphcal") not in (FORMAT, OLD_FORMAT):
        return None
    if isinstance(data["graphcal"], bool):  # JSON true == 1 in Python: not a format number
        return None
    files = data.get("files")
    return Manifest(data["graphcal"], files) if isinstance(files, dict) else None


def write_manifest(folder: Path, names: list[str]) -> None:
    """Flush each of ``names`` (files in ``folder``) to disk, hashing it on the way, then write and
    flush the manifest listing them. The bytes depend only on the files' contents."""
    records = {n: sync_and_record(folder / n) for n in sorted(names)}
    manifest = {"graphcal": FORMAT, "files": records, "about": ABOUT}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    sync_and_record(folder / MANIFEST)


def sync_and_record(path: Path) -> dict:
    """``path``'s manifest record ({"sha256", "size"}), read in one pass that also ``fsync``s it
    (a file graphcal just wrote is still in the page cache: the read costs little)."""
    fd = os.open(path, os.O_RDWR if os.name == "nt" else os.O_RDONLY)  # Windows flushes writable handles only
    try:
        st = os.fstat(fd)
        digest = _hash_fd(fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"sha256": digest, "size": st.st_size}


def sha256_of(path: str | os.PathLike, st: os.stat_result) -> str | None:
    """The sha256 of the regular file at ``path`` (``st``: its ``lstat``), or None when it cannot
    be read or is no longer the file ``st`` describes."""
    known = _DIGESTS.get(_key(st))
    if known is not None:
        return known
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_BINARY", 0))
    except OSError:
        return None
    started = time.time_ns()
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or _key(now) != _key(st):
            return None  # replaced or changed since it was listed: not the file the caller checked
        digest = _hash_fd(fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    if now.st_ctime_ns < started - SETTLED_NS:
        _remember(now, digest)
    return digest


def _hash_fd(fd: int) -> str:
    """The sha256 of what ``fd`` (just opened: at offset 0) reads to its end."""
    h = hashlib.sha256()
    view = memoryview(bytearray(_CHUNK))
    with open(fd, "rb", buffering=0, closefd=False) as f:
        while got := f.readinto(view):
            h.update(view[:got])
    return h.hexdigest()


def _key(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _remember(st: os.stat_result, digest: str) -> None:
    if len(_DIGESTS) >= _MAX_CACHED:
        _DIGESTS.clear()
    _DIGESTS[_key(st)] = digest
