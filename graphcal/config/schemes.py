"""Strings to compressed-tensors schemes: the only place a scheme name or JSON becomes a scheme.

A run is a list of compressed-tensors ``QuantizationScheme`` groups (each with its ``targets``)
plus an ``ignore`` list. Presets come from compressed-tensors by name (``W8A8``, ``FP8``, ...);
graphcal adds the static int8 scheme TensorRT users deploy. A scheme may also be given as
JSON with QuantizationScheme fields. Here too: the key/value-cache arguments, observer
overrides and llm-compressor's observer defaults, and the group size and GPTQ activation
ordering written into a scheme's weights.

compressed-tensors (and pydantic) are imported inside the functions that need them, so that
``import graphcal.config`` stays light for the CLI.
"""

from __future__ import annotations

import json

from graphcal.config.records import ACTORDER_DEFAULT, DEFAULT_IGNORE, DEFAULT_TARGETS, RunConfig
from graphcal.config.untrusted import load_json, pydantic_message
from graphcal.errors import UsageError, first_line, shown
from graphcal.graph.names import check_pattern
from graphcal.types import enum_value

# graphcal's own presets: name -> QuantizationScheme fields (without targets).
_INT8_STATIC = {
    # int8 per-channel weights, int8 per-tensor static activations, symmetric: what TensorRT
    # builds as explicit INT8 and what onnxruntime's QDQ int8 kernels run.
    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
    "input_activations": {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor",
        "dynamic": False, "observer": "static_minmax",
    },
}
GRAPHCAL_PRESETS = {"W8A8_STATIC": _INT8_STATIC, "INT8_STATIC": _INT8_STATIC}

# kv_cache_scheme shorthands: static, symmetric, per tensor (llm-compressor's usual recipes)
KV_CACHE_PRESETS = {
    "FP8": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False},
    "INT8": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False},
}

# llm-compressor's observer defaults and weight-side substitutions (initialize_observer).
DEFAULT_WEIGHT_OBSERVER = "memoryless_minmax"
DEFAULT_ACTIVATION_OBSERVER = "minmax"
_WEIGHT_OBSERVER_SUBSTITUTES = {"static_minmax": "memoryless_minmax", "minmax": "memoryless_minmax", "mse": "memoryless_mse",
                                # graphcal's histogram observers are for activations; weights take min/max
                                # (as onnxruntime's and ModelOpt's calibrators do) or the exact MSE
                                "percentile": "memoryless_minmax", "entropy": "memoryless_minmax",
                                "histogram_mse": "memoryless_mse"}


def build_config(
    scheme: str,
    targets: list[str] | tuple[str, ...] = DEFAULT_TARGETS,
    ignore: list[str] | tuple[str, ...] = DEFAULT_IGNORE,
    observer: str | None = None,
    kv_cache: str | None = None,
) -> RunConfig:
    """A one-group config from a preset name or a JSON scheme, with an optional observer override
    (:func:`with_observers`) and an optional kv_cache_scheme (see :func:`resolve_kv_cache`)."""
    parsed = resolve_scheme(scheme, list(targets))
    if observer is not None:
        parsed = with_observers(parsed, weight=observer, input=observer, output=observer)
    name = scheme.upper() if not scheme.lstrip().startswith("{") else "custom"
    kv = resolve_kv_cache(kv_cache) if kv_cache is not None else None
    if kv is not None and observer is not None:
        kv = kv.model_copy(update={"observer": observer})
    return RunConfig(groups={"group_0": parsed}, ignore=list(ignore), scheme_name=name, kv_cache=kv)


def scheme_group(entry: str, observer: str | None = None):
    """One config group from ``--scheme-for TARGET=SCHEME`` (a preset or JSON for the modules TARGET
    matches: a name, a 're:' regex, Linear or Embedding), with the run's observer override, and
    whether SCHEME is a preset name (not JSON)."""
    at = entry.find("={")  # a JSON scheme starts at its brace; a preset name after the last "="
    target, sep, scheme = (entry[:at], "=", entry[at + 1:]) if at >= 0 else entry.rpartition("=")
    target, scheme = target.strip(), scheme.strip()
    if not sep or not target or not scheme:
        raise UsageError(f"--scheme-for takes TARGET=SCHEME (e.g. 're:.*down_proj$=W8A16'), got {shown(entry)!r}")
    check_pattern(target, "--scheme-for")
    parsed = resolve_scheme(scheme, [target])
    if observer is not None:
        parsed = with_observers(parsed, weight=observer, input=observer, output=observer)
    return parsed, not scheme.startswith("{")


def resolve_scheme(scheme: str, targets: list[str]):
    """A compressed-tensors QuantizationScheme from a preset name or JSON fields."""
    from compressed_tensors.quantization import QuantizationScheme  # lazy: keeps import graphcal.config light
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES, preset_name_to_scheme
    from pydantic import ValidationError

    text = scheme.strip()
    try:
        if text.startswith("{"):
            fields = load_json(text, "--scheme")
            if not isinstance(fields, dict):
                raise UsageError("--scheme JSON must be an object of QuantizationScheme fields")
            fields.setdefault("targets", targets)
            return QuantizationScheme.model_validate(fields)
        upper = text.upper()
        if upper in GRAPHCAL_PRESETS:
            return QuantizationScheme.model_validate({"targets": targets, **GRAPHCAL_PRESETS[upper]})
        if upper in PRESET_SCHEMES:
            return preset_name_to_scheme(upper, targets)
    except json.JSONDecodeError as e:
        raise UsageError(f"--scheme is neither a preset name nor valid JSON: {e}") from e
    except ValidationError as e:
        raise UsageError(f"invalid scheme: {pydantic_message(e)}") from e
    except NotImplementedError as e:  # compressed-tensors refuses some valid-looking schemes this way
        raise UsageError(f"unsupported scheme: {first_line(e)}") from e
    raise UsageError(f"unknown scheme {shown(scheme)!r}; choose one of: {', '.join(scheme_names())}")


def scheme_names() -> list[str]:
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES  # lazy: keeps import graphcal.config light

    return sorted(set(PRESET_SCHEMES) | set(GRAPHCAL_PRESETS))


def resolve_kv_cache(text: str):
    """compressed-tensors QuantizationArgs for the key/value states: FP8, INT8, or JSON fields
    (e.g. ``{"num_bits": 8, "type": "float", "strategy": "attn_head"}``)."""
    stripped = text.strip()
    if stripped.upper() in KV_CACHE_PRESETS:
        return resolve_kv_cache_args(KV_CACHE_PRESETS[stripped.upper()])
    if not stripped.startswith("{"):
        raise UsageError(f"unknown kv-cache scheme {shown(text)!r}; choose FP8, INT8 or JSON QuantizationArgs fields")
    try:
        fields = load_json(stripped, "--kv-cache-scheme")
    except json.JSONDecodeError as e:
        raise UsageError(f"--kv-cache-scheme is neither FP8, INT8 nor valid JSON: {e}") from e
    if not isinstance(fields, dict):
        raise UsageError("--kv-cache-scheme JSON must be an object of QuantizationArgs fields")
    return resolve_kv_cache_args(fields)


def resolve_kv_cache_args(fields: dict):
    """QuantizationArgs for key/value states from their fields; static tensor or attn_head only."""
    from compressed_tensors.quantization import QuantizationArgs  # lazy: keeps import graphcal.config light
    from pydantic import ValidationError

    try:
        args = QuantizationArgs.model_validate(fields)
    except ValidationError as e:
        raise UsageError(f"invalid kv-cache scheme: {pydantic_message(e)}") from e
    if args.strategy not in ("tensor", "attn_head") or args.dynamic is not False:
        raise UsageError(f"kv-cache scheme: strategy {getattr(args.strategy, 'value', args.strategy)} "
                         f"dynamic={args.dynamic} is not supported; use static tensor or attn_head")
    return args


def with_observers(scheme, *, weight: str | None = None, input: str | None = None, output: str | None = None):
    """Copy of ``scheme`` with observer overrides, by llm-compressor's rule: every part that gets
    an observer (weights, and activations that are not fully dynamic: static ones and NVFP4's
    "local" ones, whose global scale is observed) takes the override; fully dynamic ones have none."""
    updates = {}
    for name, part in ((weight, "weights"), (input, "input_activations"), (output, "output_activations")):
        args = getattr(scheme, part)
        if args is not None and name is not None and args.dynamic is not True:
            updates[part] = args.model_copy(update={"observer": name})
    return scheme.model_copy(update=updates)


def observer_name(args, base_name: str) -> str | None:
    """The observer llm-compressor would attach for these args (None for dynamic activations)."""
    from compressed_tensors.quantization.quant_args import DynamicType  # lazy: keeps import graphcal.config light

    if args is None or args.dynamic is True:
        return None
    name = args.observer
    if base_name == "weight":
        if name is None:
            return DEFAULT_WEIGHT_OBSERVER
        return _WEIGHT_OBSERVER_SUBSTITUTES.get(name.replace("-", "_"), name)
    if args.dynamic == DynamicType.LOCAL:
        return name or DEFAULT_ACTIVATION_OBSERVER  # observes the global scale only
    return name or DEFAULT_ACTIVATION_OBSERVER


def with_group_size(scheme, size: int):
    """``scheme`` with the group size of its group / tensor_group weights set to ``size``."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise UsageError(f"--group-size must be a positive integer, got {size!r}")
    args = scheme.weights
    if args is None or enum_value(args.strategy) not in ("group", "tensor_group"):
        raise UsageError(f"--group-size applies to group and tensor_group weights; this scheme's weights are "
                         f"{enum_value(args.strategy) if args is not None else 'not quantized'}")
    return scheme.model_copy(update={"weights": args.model_copy(update={"group_size": size})})


def with_actorder(scheme, actorder: str | None):
    """llm-compressor 0.14's resolution of GPTQ's actorder into a scheme's weights (any strategy GPTQ
    quantizes, block included): the sentinel gives static unless the scheme sets one; an explicit value
    (None included) fills a scheme without one; an explicit value that is not the scheme's, as written,
    is an error (llm-compressor compares them as given: ``static`` against ``weight`` and None against
    either conflict, though static is weight's alias)."""
    args = scheme.weights
    if args is None or enum_value(args.strategy) not in ("group", "tensor_group", "channel", "tensor", "block"):
        return scheme
    have = None if args.actorder is None else enum_value(args.actorder)
    if actorder == ACTORDER_DEFAULT:
        value = have if have is not None else "static"
    elif have is None or actorder == have:
        value = actorder
    else:
        raise UsageError(f"Cannot resolve activation ordering: the scheme says {have}, GPTQ says {actorder} (give one "
                         "of them, or the same value in both)")
    return scheme.model_copy(update={"weights": args.model_copy(update={"actorder": value})})
