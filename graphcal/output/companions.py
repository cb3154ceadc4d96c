"""The files that make an output folder a drop-in for the input's: genai_config.json, the tokenizer, ...

onnxruntime-genai loads a folder, not a model file: ``onnxruntime_genai.Model(folder)`` reads its
``genai_config.json``, the model file it names and the tokenizer files beside it. So ``-o`` receives
the input folder's companions, by name from a fixed list (never unrelated or large files), each a
regular file inside the input's folder of at most 64 MB. They are found before any pass
(:func:`find_companions`: a bad one is refused then, and each file's device, inode and size are
recorded; genai_config.json is read and parsed then, with graphcal.data.fill's checks, and -o
receives those bytes) and copied as the output is written (:func:`copy_companions`): each file is
opened once (a regular file: graphcal.limits.open_regular), must still be the file recorded (the
same device and inode, so a file swapped for a link out of the folder, or for another file, since
the run began is refused, and nothing of it reaches -o) of the same size, and what is written is
read from that open file. genai_config.json changes only where
graphcal's model requires it, the decoder's ``filename`` naming graphcal's model file, and where it
would make onnxruntime-genai load code or write files (graphcal.data.genai_native: a
``custom_ops_library``, provider options naming libraries or paths, session config entries, ...):
that is dropped, never copied, and a note names it.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from graphcal.data.fill import GENAI_CONFIG, genai_section, parse_genai_config, read_genai_config_bytes
from graphcal.data.genai_native import strip_native
from graphcal.errors import GraphcalError, shown
from graphcal.limits import file_kind, inside_folder, open_regular

# onnxruntime-genai's config, the tokenizer files transformers and onnxruntime-genai read, chat
# templates, and the processor configs of multimodal builds
COMPANIONS = (GENAI_CONFIG, "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
              "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
              "generation_config.json", "preprocessor_config.json", "processor_config.json")
MAX_COMPANION_BYTES = 64 << 20  # a large vocabulary's tokenizer.json is tens of MB


@dataclass(frozen=True)
class Companion:
    """A companion file as it was found: copied only while it is still that file."""

    path: Path
    device: int
    inode: int
    size: int


@dataclass(frozen=True)
class Companions:
    """What -o receives beside graphcal's files, found and checked before any pass."""

    files: tuple[Companion, ...] = ()  # copied as they are when the output is written (read again, checked again)
    genai_config: bytes | None = None  # genai_config.json as -o receives it, read and parsed already
    notes: tuple[str, ...] = ()  # what was left out of -o's genai_config.json, and why (the run's warnings)


def find_companions(model_path: str | os.PathLike, model_file: str) -> Companions:
    """The companions beside ``model_path``, checked (regular, inside its folder, bounded).
    genai_config.json is read and parsed now (graphcal.data.fill's checks), so a bad one is refused
    before any pass, and pointed at ``model_file``; the others are only looked at."""
    folder = Path(model_path).parent
    found = []
    for name in COMPANIONS:
        path = folder / name
        if name == GENAI_CONFIG or inside_folder(folder, name, "copies only files inside the model's folder into "
                                                               "-o") is None:
            continue
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise GraphcalError(f"{path} is {file_kind(st.st_mode)}, not a regular file; graphcal copies only regular "
                                "files into -o")
        if st.st_size > MAX_COMPANION_BYTES:
            raise GraphcalError(f"{path} is {st.st_size:,} bytes; graphcal copies companion files of at most "
                                f"{MAX_COMPANION_BYTES:,} into -o")
        found.append(Companion(path, st.st_dev, st.st_ino, st.st_size))
    raw = read_genai_config_bytes(folder)
    config, notes = (None, ()) if raw is None else _genai_config(raw, folder / GENAI_CONFIG, model_file)
    return Companions(tuple(found), config, notes)


def copy_companions(companions: Companions, into: Path) -> list[Path]:
    """Write ``companions`` (from :func:`find_companions`) into ``into``."""
    written = []
    if companions.genai_config is not None:
        (into / GENAI_CONFIG).write_bytes(companions.genai_config)
        written.append(into / GENAI_CONFIG)
    for companion in companions.files:
        (into / companion.path.name).write_bytes(_read_as_found(companion))
        written.append(into / companion.path.name)
    return written


def _read_as_found(companion: Companion) -> bytes:
    """The bytes of ``companion``, read from one open file that is still the one :func:`find_companions`
    checked (device, inode, size); else a one-line error, and nothing of it is read."""
    path = companion.path
    with open_regular(path, "companion file") as f:  # a regular file, opened without blocking
        st = os.fstat(f.fileno())
        if (st.st_dev, st.st_ino) != (companion.device, companion.inode):
            raise GraphcalError(f"{path} was replaced since the run began (now {_now(path)}); graphcal copies into -o "
                                "only the companion files it checked before the pass; -o is left as it was")
        if st.st_size != companion.size:
            raise GraphcalError(f"{path} changed size since the run began ({companion.size:,} bytes, now "
                                f"{st.st_size:,}); -o is left as it was")
        data = f.read(companion.size + 1)
    if len(data) != companion.size:
        raise GraphcalError(f"{path} changed size while it was read ({companion.size:,} bytes, read {len(data):,}); "
                            "-o is left as it was")
    return data


def _now(path: Path) -> str:
    """What ``path`` is now, for a message: a link and where it leads, or another file."""
    if path.is_symlink():
        return f"a link to {shown(os.path.realpath(path), 120)}"
    return "another file"


def _genai_config(raw: bytes, path: Path, model_file: str) -> tuple[bytes, tuple[str, ...]]:
    """(the config as it was, or with the decoder's filename set to ``model_file`` where it named another
    and without what would load code or write files; a note naming what was dropped, if anything)."""
    stripped = strip_native(parse_genai_config(raw, path))  # keeps no custom_ops_library
    config = stripped.config
    decoder = genai_section(config, "model", "decoder")  # the stripped config's own dict: set in place below
    notes = () if not stripped.dropped else (
        f"{path}: left out of -o's {GENAI_CONFIG}, as it would make onnxruntime-genai load code or touch files "
        f"graphcal did not check: {stripped.describe()}",)
    renamed = decoder.get("filename", model_file) != model_file
    if not renamed and not stripped.dropped:
        return raw, notes
    if renamed:
        decoder["filename"] = model_file
    return (json.dumps(config, indent=4) + "\n").encode("utf-8"), notes
