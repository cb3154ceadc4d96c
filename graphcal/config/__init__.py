"""The run's quantization settings: flags and recipes resolved into one :class:`RunConfig`.

The package's modules, each importing only those listed before it:

- :mod:`~graphcal.config.untrusted`: option text from strangers (bounded JSON and YAML, values
  quoted cut short in messages);
- :mod:`~graphcal.config.records`: :class:`RunConfig` and its SmoothQuant / AWQ / GPTQ records,
  defaults and checks;
- :mod:`~graphcal.config.schemes`: preset names and JSON to compressed-tensors schemes, the
  kv-cache arguments, observer overrides and defaults;
- :mod:`~graphcal.config.modifiers`: llm-compressor modifiers' fields, and the Recipe record;
- :mod:`~graphcal.config.recipe`: a recipe file to a RunConfig (imported when a recipe is given:
  it loads pydantic and PyYAML);
- :mod:`~graphcal.config.options`: :class:`Options` and :func:`resolve`, where flags beat the recipe.

This package re-exports the names other packages use, so ``from graphcal.config import X``
keeps working; it does not load compressed-tensors, pydantic or PyYAML.
"""

from graphcal.config.options import Options, resolve
from graphcal.config.records import (
    ACTORDER_DEFAULT,
    ALGORITHMS,
    DEFAULT_IGNORE,
    DEFAULT_SCHEME,
    DEFAULT_SMOOTHING_STRENGTH,
    DEFAULT_TARGETS,
    GPTQ_ORDERS,
    LLMCOMPRESSOR_AWQ_MAPPINGS,
    LLMCOMPRESSOR_SMOOTHQUANT_MAPPINGS,
    MAX_N_GRID,
    AWQSettings,
    GPTQSettings,
    RotationSettings,
    RunConfig,
    Smoothing,
    check_awq,
    check_gptq,
    check_scope,
    check_strength,
)
from graphcal.config.schemes import (
    DEFAULT_ACTIVATION_OBSERVER,
    DEFAULT_WEIGHT_OBSERVER,
    GRAPHCAL_PRESETS,
    KV_CACHE_PRESETS,
    build_config,
    observer_name,
    resolve_kv_cache,
    resolve_kv_cache_args,
    resolve_scheme,
    scheme_names,
    with_actorder,
    with_group_size,
    with_observers,
)
from graphcal.config.untrusted import MAX_JSON_BYTES, MAX_JSON_DEPTH, load_json, pydantic_message

__all__ = [
    "ACTORDER_DEFAULT", "ALGORITHMS", "DEFAULT_ACTIVATION_OBSERVER", "DEFAULT_IGNORE", "DEFAULT_SCHEME",
    "DEFAULT_SMOOTHING_STRENGTH", "DEFAULT_TARGETS", "DEFAULT_WEIGHT_OBSERVER", "GPTQ_ORDERS", "GRAPHCAL_PRESETS",
    "KV_CACHE_PRESETS", "LLMCOMPRESSOR_AWQ_MAPPINGS", "LLMCOMPRESSOR_SMOOTHQUANT_MAPPINGS", "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH", "MAX_N_GRID", "AWQSettings", "GPTQSettings", "Options", "RotationSettings", "RunConfig", "Smoothing", "build_config",
    "check_awq", "check_gptq", "check_scope", "check_strength", "load_json", "observer_name", "pydantic_message",
    "resolve", "resolve_kv_cache", "resolve_kv_cache_args", "resolve_scheme", "scheme_names", "with_actorder",
    "with_group_size", "with_observers",
]
