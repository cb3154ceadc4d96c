"""What eval reads of the models besides their outputs: the ignore list written beside the
quantized model, its SmoothQuant (or AWQ) record, and the layers SmoothQuant could still smooth."""

from __future__ import annotations

import json
from pathlib import Path

import onnx

from graphcal.calibration.transforms.channel_scales import AWQ_METADATA_KEY, METADATA_KEY
from graphcal.config.records import RunConfig
from graphcal.config.untrusted import MAX_JSON_BYTES, load_json
from graphcal.errors import GraphcalError, UsageError, first_line
from graphcal.graph.scaling import SCOPE_OF_KIND, candidates
from graphcal.limits import inside_folder, read_regular
from graphcal.output.metadata import CONFIG_FILE


def _written_record(candidate: Path) -> dict | None:
    """The quantization_config.json graphcal wrote beside ``candidate`` as a JSON object (None when
    there is none), read as a stranger's file: inside the model's folder, regular, at most 1 MB,
    bounded in depth; anything else is refused (GraphcalError)."""
    real = inside_folder(candidate.parent, CONFIG_FILE, "reads a quantization config only inside it")
    if real is None:
        return None
    raw = read_regular(real, "quantization config", MAX_JSON_BYTES)
    try:
        record = load_json(raw.decode("utf-8"), real, error=GraphcalError, needs="a quantization config nests 5")
    except ValueError as e:  # json's own errors, and bytes that are not UTF-8
        raise GraphcalError(f"{real} is not valid JSON ({first_line(e)})") from e
    if not isinstance(record, dict):
        raise GraphcalError(f"{real} is not a JSON object")
    return record


def written_ignore(candidate: Path) -> list[str] | None:
    """The ignore list graphcal wrote beside ``candidate`` (quantization_config.json), if there is one
    it can read (eval's advice then keeps it; otherwise it falls back to the default)."""
    try:
        record = _written_record(candidate)
    except GraphcalError:
        return None
    ignore = record.get("ignore") if record is not None else None
    return [str(x) for x in ignore] if isinstance(ignore, list) else None


def written_config(candidate: Path):
    """The config groups and ignore list graphcal wrote beside ``candidate`` (quantization_config.json)
    as a :class:`RunConfig`, or None when there is no such file; a file that is not one is refused."""
    from compressed_tensors.quantization import QuantizationScheme  # lazy: compressed-tensors, only for a fallback
    from pydantic import ValidationError

    try:
        record = _written_record(candidate)
        if record is None:
            return None
        groups = {str(k): QuantizationScheme.model_validate(v) for k, v in record["config_groups"].items()}
        return RunConfig(groups=groups, ignore=[str(x) for x in record.get("ignore") or []])
    except (GraphcalError, ValueError, KeyError, TypeError, AttributeError, ValidationError) as e:
        raise UsageError(f"{candidate.parent / CONFIG_FILE} is not a quantization config graphcal can read: "
                         f"{first_line(e)}") from e


def smoothquant_record(model: onnx.ModelProto) -> dict:
    """What graphcal recorded of a SmoothQuant (or AWQ) run in the model's metadata ({} when none)."""
    for prop in model.metadata_props:
        if prop.key in (METADATA_KEY, AWQ_METADATA_KEY):
            try:
                record = json.loads(prop.value)
            except ValueError:
                return {}
            return record if isinstance(record, dict) else {}
    return {}


def smoothable_layers(model: onnx.ModelProto, targets, record: dict, base_dir: Path | None = None) -> dict[str, str]:
    """Layer -> the --smoothquant scope that smooths its input exactly, for layers the candidate left unsmoothed."""
    done = {b for m in record.get("mappings", []) if isinstance(m, dict) for b in m.get("balance", [])}
    out = {}
    for c in candidates(model, list(targets), None if base_dir is None else str(base_dir)):  # lazy: read from its folder
        if c.reason or any(b in done for b in c.balance):
            continue
        for b in c.balance:
            out[b] = SCOPE_OF_KIND[c.kind]
    return out
