"""A single output file (eval's ``--html``): never an input, and replaced whole.

:func:`check_output_file` refuses a path that is one of the command's inputs, or lies inside an
input folder, however it is given (the same path, a relative or absolute variant, a symbolic link
to it, a hard link): the same rule as ``-o``'s (:func:`graphcal.output.check_output_dir`).
:func:`replace_file` writes a temporary file beside the path, flushes it and renames it over
the path, so the file is the old one or the new one, never half written; an interrupted write
removes its temporary file.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from graphcal.errors import GraphcalError, UsageError
from graphcal.output.process import register_abort, unregister_abort


def check_output_file(path: str | os.PathLike, inputs: Iterable[str | os.PathLike], option: str) -> Path:
    """Refuse ``path`` (a UsageError naming ``option`` and the input) when writing it would touch an
    input: the same file, or a file inside an input folder; or when it is a folder or its folder
    does not exist (known before any work). Reads only; returns ``path`` as a Path."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        raise UsageError(f"{option} {path} is a folder; give a file name")
    if not path.absolute().parent.is_dir():
        raise UsageError(f"{option} {path}: the folder {path.absolute().parent} does not exist")
    target = path.resolve()  # a link is followed: writing through it would reach its target
    for p in inputs:
        p = Path(p)
        source = p.resolve()
        same = target == source or (path.exists() and p.exists() and _samefile(path, p))
        if same or (source.is_dir() and source in target.parents):
            raise UsageError(f"{option} {path} would overwrite the input {p}; choose another file")
    return path


def _samefile(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)  # hard links, and any other spelling of the same file
    except OSError:
        return False


def replace_file(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` whole: a temporary file beside it, flushed, then renamed over it
    (a link at ``path`` is replaced, not followed). On any failure or interruption the temporary
    file is removed and ``path`` is as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    abort = register_abort(lambda: os.unlink(tmp))  # stopped from another thread (graphcal.cli.guard)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise GraphcalError(f"cannot write {path}: {e.strerror or e}") from e
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        unregister_abort(abort)
