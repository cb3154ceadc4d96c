"""The files that make an output folder a drop-in for the input's: genai_config.json, the tokenizer, ...

onnxruntime-genai loads a folder, not a model file: ``onnxruntime_genai.Model(folder)`` reads its
``genai_config.json``, the model file it names and the tokenizer files beside it. So ``-o`` receives
the input folder's companions, by name from a fixed list (never unrelated or large files), each a
regular file inside the input's folder of at most 64 MB. They are found before any pass
(:func:`find_companions`: a bad one is refused then) and copied as the output is written
(:func:`copy_companions`, read again with the same checks). genai_config.json changes only where
graphcal's model requires it: the decoder's ``filename`` names graphcal's model file.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from graphcal.errors import GraphcalError
from graphcal.limits import file_kind, json_depth, read_regular

GENAI_CONFIG = "genai_config.json"
# onnxruntime-genai's config, the tokenizer files transformers and onnxruntime-genai read, chat
# templates, and the processor configs of multimodal builds
COMPANIONS = (GENAI_CONFIG, "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
              "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
              "generation_config.json", "preprocessor_config.json", "processor_config.json")
MAX_COMPANION_BYTES = 64 << 20  # a large vocabulary's tokenizer.json is tens of MB
MAX_CONFIG_DEPTH = 32


def find_companions(model_path: str | os.PathLike) -> tuple[Path, ...]:
    """The companions beside ``model_path``, checked (regular, inside its folder, bounded); none is read."""
    folder = Path(model_path).parent
    root = os.path.realpath(folder)
    found = []
    for name in COMPANIONS:
        path = folder / name
        if not os.path.lexists(path):
            continue
        real = os.path.realpath(path)
        if os.path.commonpath([root, real]) != root:
            raise GraphcalError(f"{path} leads out of the model's folder (a link to {real}): copy the file in; "
                                "graphcal copies only files inside the model's folder into -o")
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise GraphcalError(f"{path} is {file_kind(mode)}, not a regular file; graphcal copies only regular "
                                "files into -o")
        size = path.stat().st_size
        if size > MAX_COMPANION_BYTES:
            raise GraphcalError(f"{path} is {size:,} bytes; graphcal copies companion files of at most "
                                f"{MAX_COMPANION_BYTES:,} into -o")
        found.append(path)
    return tuple(found)


def copy_companions(files: tuple[Path, ...], into: Path, model_file: str) -> list[Path]:
    """Copy ``files`` (from :func:`find_companions`) into ``into``; genai_config.json names ``model_file``."""
    written = []
    for path in files:
        data = read_regular(path, "companion file", MAX_COMPANION_BYTES)
        if path.name == GENAI_CONFIG:
            data = _genai_config(data, path, model_file)
        (into / path.name).write_bytes(data)
        written.append(into / path.name)
    return written


def _genai_config(data: bytes, path: Path, model_file: str) -> bytes:
    """The config as it was, or with the decoder's filename set to ``model_file`` where it named another."""
    try:
        text = data.decode("utf-8")
        if json_depth(text, MAX_CONFIG_DEPTH) > MAX_CONFIG_DEPTH:
            raise ValueError(f"it nests deeper than {MAX_CONFIG_DEPTH} levels")
        config = json.loads(text)
    except (UnicodeDecodeError, ValueError) as e:
        raise GraphcalError(f"{path} is not readable JSON ({str(e).splitlines()[0][:120]})") from None
    model = config.get("model") if isinstance(config, dict) else None
    decoder = model.get("decoder") if isinstance(model, dict) else None
    if not isinstance(decoder, dict) or decoder.get("filename", model_file) == model_file:
        return data
    decoder["filename"] = model_file
    return (json.dumps(config, indent=4) + "\n").encode("utf-8")
