"""Load and save ONNX models: external data, IR/opset versions, atomic writes."""

from __future__ import annotations

import os
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from graphcal.errors import GraphcalError

# onnxruntime 1.31 refuses IR > 13; onnx.helper picks IR from the opset with this table.
MAX_ORT_IR = 13
PROTOBUF_LIMIT = 2**31 - 1


def load_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Load an ONNX model with its external data; raise GraphcalError for anything unreadable."""
    path = Path(path)
    if not path.exists():
        raise GraphcalError(f"model file not found: {path}")
    if path.is_dir():
        raise GraphcalError(f"model path is a folder, not an .onnx file: {path}")
    if path.stat().st_size == 0:
        raise GraphcalError(f"model file is empty: {path}")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError) as e:
        raise GraphcalError(f"{path} is not a readable ONNX model ({_first_line(e)})") from e
    if not model.graph.node:
        raise GraphcalError(f"{path} is not a readable ONNX model (its graph has no nodes)")
    if any(_uses_external_data(t) for t in model.graph.initializer):
        try:
            onnx.load_external_data_for_model(model, str(path.parent))
        except (OSError, ValueError, RuntimeError, onnx.checker.ValidationError) as e:
            raise GraphcalError(
                f"{path}: external data could not be read ({_first_line(e)}); "
                "keep the data files next to the model"
            ) from e
    return model


def default_opset(model: onnx.ModelProto) -> int:
    """The opset of the default ONNX domain (0 if the model declares none)."""
    for op in model.opset_import:
        if op.domain in ("", "ai.onnx"):
            return op.version
    return 0


def has_external_data(path: str | os.PathLike) -> bool:
    """Whether the model file keeps any initializer in external data (reads the graph, not the data)."""
    model = onnx.load(str(path), load_external_data=False)
    return any(_uses_external_data(t) for t in model.graph.initializer)


def save_model(model: onnx.ModelProto, path: Path, external: bool = False) -> list[Path]:
    """Write ``model`` to ``path``; with ``external``, and always over 2 GB, the weights go to
    ``<name>.data`` beside it (one file, tensors over 1 KB).

    Returns the files written.
    """
    if not external and model.ByteSize() < PROTOBUF_LIMIT:
        onnx.save_model(model, str(path))
        return [path]
    data_name = path.name + ".data"
    onnx.save_model(
        model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
        location=data_name, size_threshold=1024,
    )
    return [path, path.parent / data_name]


def _uses_external_data(t: onnx.TensorProto) -> bool:
    return t.data_location == onnx.TensorProto.EXTERNAL


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
