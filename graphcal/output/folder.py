"""Is ``-o`` a folder graphcal may replace, and what may graphcal remove: checks that read only.

- graphcal replaces a folder only if it is empty or holds its own output, recognised by content:
  every entry must be a regular file the folder's manifest vouches for
  (:mod:`graphcal.output.manifest`). A folder, a link, an edited or an unlisted file, or no
  manifest (a user's folder): the run is refused before calibrating.
- ``-o`` may not be a symbolic link (graphcal says where it points), a mount point (the folder is
  replaced whole, which a mount point cannot be) or a folder holding an input, whether the input
  is given through a link or not.
- A temporary folder graphcal made holds its marker (``.graphcal-tmp``) until its manifest is
  written; such a folder, or an output set aside, is what :func:`remove_ours` removes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

from graphcal.errors import GraphcalError
from graphcal.output.manifest import MANIFEST, read_manifest

TMP_MARKER = ".graphcal-tmp"  # first file in a temporary folder: graphcal made it (holds the pid)


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
        refuse_foreign(dest, out_dir)
    parent = missing_parents(dest)[0]
    if not os.access(parent, os.W_OK):
        raise GraphcalError(f"cannot write to {parent}: permission denied")
    return dest


def _place(p: str | os.PathLike) -> Path:
    """``p`` made absolute with its folder resolved, but not its last component (a link stays one)."""
    a = Path(os.path.abspath(p))
    return a.parent.resolve() / a.name if a.name else a


def _inside(p: Path, folder: Path) -> bool:
    return p == folder or folder in p.parents


def missing_parents(path: Path) -> tuple[Path, list[Path]]:
    """(the nearest existing ancestor of ``path``, the ancestors below it that do not exist yet, nearest first)."""
    parent, missing = path.parent, []
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    return parent, missing


def _foreign(folder: Path) -> tuple[list[str], bool]:
    """The entries of ``folder`` graphcal cannot vouch for (described), and whether it has a manifest.

    An empty folder has none. Without a valid manifest every entry is foreign.
    """
    with os.scandir(folder) as it:
        entries = sorted(it, key=lambda e: e.name)
    manifest = read_manifest(folder)
    foreign = []
    for e in entries:
        if manifest is not None and (e.name == MANIFEST or manifest.vouches(e)):
            continue
        if e.is_symlink():
            foreign.append(f"{e.name} (a link)")
        elif e.is_dir(follow_symlinks=False):
            foreign.append(f"{e.name}/ (a folder)")
        elif manifest is not None and e.name in manifest.files:
            foreign.append(f"{e.name} (changed since graphcal wrote it)")
        else:
            foreign.append(e.name)
    return foreign, manifest is not None


def refuse_foreign(folder: Path, label) -> None:
    """Refuse ``folder`` (a GraphcalError naming what is in the way) unless graphcal vouches for all of it."""
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


def left_by_graphcal(folder: Path) -> bool:
    """A temporary folder graphcal made (its marker), or an output of graphcal's set aside."""
    if _has_marker(folder):
        return True
    try:
        return not _foreign(folder)[0]
    except OSError:
        return False


def _has_marker(folder: Path) -> bool:
    try:
        return stat.S_ISREG((folder / TMP_MARKER).lstat().st_mode)
    except OSError:
        return False


def remove_ours(folder: Path) -> bool:
    """Remove ``folder``, a temporary folder graphcal made (marker: all of it) or an output of
    graphcal's set aside (the files its manifest vouches for, the manifest, then the folder if
    empty). Returns whether it is gone."""
    with contextlib.suppress(OSError):
        mode = stat.S_IMODE(folder.stat().st_mode)
        if mode & 0o700 != 0o700:
            os.chmod(folder, mode | 0o700)  # a read-only output of ours: make its files removable
    try:
        if _has_marker(folder):
            shutil.rmtree(folder, ignore_errors=True)
        else:
            manifest = read_manifest(folder)
            with os.scandir(folder) as it:
                mine = [e.path for e in it if e.name != MANIFEST and manifest is not None and manifest.vouches(e)]
            for p in mine:
                os.unlink(p)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(folder / MANIFEST)
            folder.rmdir()
    except OSError:
        pass
    return not os.path.lexists(folder)
