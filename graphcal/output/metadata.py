"""compressed-tensors metadata: ``quantization_config.json`` and ``qparams.safetensors``.

The config is built and validated with compressed-tensors' own pydantic models, its format
inferred by compressed-tensors' own rules; parameters use its names (``weight_scale``,
``weight_zero_point``, ``weight_global_scale``, ``input_scale``, ...) keyed by module name, in
torch's [out, in] layout. Symmetric zero points are dropped, as compressed-tensors does.
"""

from __future__ import annotations

import json

import torch

from graphcal.config import RunConfig
from graphcal.types import QuantizedKV, QuantizedTarget

CONFIG_FILE = "quantization_config.json"
QPARAMS_FILE = "qparams.safetensors"


def build_quantization_config(config: RunConfig, items: list[QuantizedTarget], ignored: list[str],
                              kv_items: list[QuantizedKV] = (), transform: dict | None = None):
    """A compressed-tensors QuantizationConfig for what was quantized (status "frozen"); the
    kv_cache_scheme is recorded when key/value states were quantized, and ``transform`` (a
    TransformConfig's JSON, ``{}`` for none, as compressed-tensors writes it) as its transform_config."""
    import compressed_tensors  # lazy: compressed-tensors takes seconds to import; only this path needs it
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    used = {id(item.scheme) for item in items}
    groups, formats = {}, set()
    for name, scheme in config.groups.items():
        if id(scheme) not in used:
            continue
        fmt = scheme.format or infer_module_format(torch.nn.Linear, scheme).value
        groups[name] = scheme.model_copy(update={"format": fmt})
        formats.add(fmt)
    fmt = "dense" if not formats else (formats.pop() if len(formats) == 1 else "mixed-precision")
    qc = QuantizationConfig(
        config_groups=groups,
        format=fmt,
        quantization_status=QuantizationStatus.FROZEN,
        ignore=sorted(ignored),
        kv_cache_scheme=config.kv_cache if kv_items else None,
    )
    data = qc.model_dump(mode="json")
    data["version"] = compressed_tensors.__version__
    data["transform_config"] = transform or {}
    return qc, data


def config_json(data: dict) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def qparam_tensors(items: list[QuantizedTarget], kv_items: list[QuantizedKV] = ()) -> dict[str, torch.Tensor]:
    """``{module}.{base}_{scale|zero_point|global_scale}`` tensors, contiguous, as compressed-tensors names them;
    ``{attention}.k_scale`` / ``v_scale`` for key/value states."""
    out: dict[str, torch.Tensor] = {}
    for kv in kv_items:
        for base, qp in sorted(kv.qparams.items()):
            out[f"{kv.state.name}.{base}_scale"] = qp.scale.detach().clone().contiguous()
            if not kv.args.symmetric:
                out[f"{kv.state.name}.{base}_zero_point"] = qp.zero_point.detach().clone().contiguous()
    for item in items:
        for base, qp in sorted(item.qparams.items()):
            args = getattr(item.scheme, _SCHEME_PART[base])
            prefix = f"{item.target.name}.{base}"
            local = args.dynamic == "local"  # scales computed at run time; only the global scale is stored
            if not local:
                out[f"{prefix}_scale"] = qp.scale.detach().clone().contiguous()
            if not args.symmetric and not local:
                out[f"{prefix}_zero_point"] = qp.zero_point.detach().clone().contiguous()
            if qp.global_scale is not None:
                out[f"{prefix}_global_scale"] = qp.global_scale.detach().to(torch.float32).reshape(1).clone().contiguous()
    return out


_SCHEME_PART = {"weight": "weights", "input": "input_activations", "output": "output_activations"}
