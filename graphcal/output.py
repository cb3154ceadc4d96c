"""Write a run's outputs atomically: all files appear together, or the previous output stays.

Files go to a temporary folder beside the destination, then replace it with renames; a run
killed at any moment leaves the old output or none, never a half-written one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from graphcal.errors import GraphcalError

MODEL_FILE = "model.onnx"
# Everything graphcal may write into an output folder; a folder holding anything else is not ours.
OUR_FILES = {MODEL_FILE, MODEL_FILE + ".data", "quantization_config.json", "qparams.safetensors"}


def check_output_dir(out_dir: Path, inputs: list[Path]) -> None:
    """Refuse an output folder that is a file, holds foreign files, or would overwrite an input."""
    if out_dir.exists() and not out_dir.is_dir():
        raise GraphcalError(f"output path {out_dir} is a file; give a folder for -o")
    resolved = out_dir.resolve()
    for p in inputs:
        if p.resolve().parent == resolved and p.name in OUR_FILES:
            raise GraphcalError(f"-o {out_dir} would overwrite the input {p}; choose another folder")
    if out_dir.is_dir():
        foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in OUR_FILES)
        if foreign:
            raise GraphcalError(
                f"output folder {out_dir} holds files graphcal did not write ({', '.join(foreign[:3])}); "
                "choose a new or empty folder"
            )
    parent = resolved.parent
    if not os.access(parent if parent.exists() else Path.cwd(), os.W_OK):
        raise GraphcalError(f"cannot write to {parent}: permission denied")


def write_atomically(out_dir: Path, write: Callable[[Path], list[Path]]) -> list[Path]:
    """Call ``write(tmp_dir)`` and move its files into ``out_dir`` as one step; return final paths."""
    out_dir = out_dir.resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        written = write(tmp)
        for f in written:
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise GraphcalError(f"could not write outputs to {out_dir.parent}: {e.strerror or e}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return [out_dir / f.name for f in written]
