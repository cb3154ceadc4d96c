"""The run's quantization settings, as compressed-tensors models: the only place strings become schemes.

A run is a list of compressed-tensors ``QuantizationScheme`` groups (each with its ``targets``)
plus an ``ignore`` list. Presets come from compressed-tensors by name (``W8A8``, ``FP8``, ...);
graphcal adds the static int8 scheme TensorRT users deploy. A scheme may also be given as
JSON with QuantizationScheme fields.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from graphcal.errors import UsageError, first_line
from graphcal.graph.targets import matches
from graphcal.types import Target, enum_value

DEFAULT_SCHEME = "W8A8"
DEFAULT_TARGETS = ("Linear",)
DEFAULT_IGNORE = ("lm_head",)

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

# llm-compressor's observer defaults and weight-side substitutions (initialize_observer).
DEFAULT_WEIGHT_OBSERVER = "memoryless_minmax"
DEFAULT_ACTIVATION_OBSERVER = "minmax"
_WEIGHT_OBSERVER_SUBSTITUTES = {"static_minmax": "memoryless_minmax", "minmax": "memoryless_minmax", "mse": "memoryless_mse",
                                # graphcal's histogram observers are for activations; weights take min/max
                                # (as onnxruntime's and ModelOpt's calibrators do) or the exact MSE
                                "percentile": "memoryless_minmax", "entropy": "memoryless_minmax",
                                "histogram_mse": "memoryless_mse"}


# llm-compressor's SmoothQuant defaults (SmoothQuantModifier; its DEFAULT_SMOOTHQUANT_MAPPINGS, the Llama entry)
DEFAULT_SMOOTHING_STRENGTH = 0.5
LLMCOMPRESSOR_SMOOTHQUANT_MAPPINGS = (
    (("re:.*q_proj", "re:.*k_proj", "re:.*v_proj"), "re:.*input_layernorm"),
    (("re:.*gate_proj", "re:.*up_proj"), "re:.*post_attention_layernorm"),
)


@dataclass(frozen=True)
class Smoothing:
    """SmoothQuant settings (llm-compressor's SmoothQuantModifier fields, plus where graphcal may smooth).

    ``mappings`` None: every activation of the quantized layers whose producer allows an exact
    fold, found by graph structure; otherwise llm-compressor's ``(balance regexes, smooth regex)``
    pairs matched by module name. ``scope`` (graphcal's): "norms" folds into norms and constant
    scales, "all" also into linear layers (up_proj -> down_proj), "mul" also smooths what has no
    fold through an explicit Mul.
    """

    strength: float = DEFAULT_SMOOTHING_STRENGTH
    mappings: tuple[tuple[tuple[str, ...], str], ...] | None = None
    ignore: tuple[str, ...] = ()
    algorithm: str = "smoothquant"  # or "log_equalization"
    scope: str = "norms"
    search: bool = False  # --smoothing-strength auto: each mapping's strength searched (graphcal's extension)


# llm-compressor's AWQ default mappings (its LlamaForCausalLM entry): (smooth layer, balance layers)
LLMCOMPRESSOR_AWQ_MAPPINGS = (
    ("re:.*input_layernorm$", ("re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$")),
    ("re:.*v_proj$", ("re:.*o_proj$",)),
    ("re:.*post_attention_layernorm$", ("re:.*gate_proj$", "re:.*up_proj$")),
    ("re:.*up_proj$", ("re:.*down_proj$",)),
)

# llm-compressor's GPTQModifier and AWQModifier defaults (0.14)
ALGORITHMS = ("gptq", "awq", "awq+gptq")
GPTQ_ORDERS = ("sequential", "one-pass")
MAX_N_GRID = 1000  # AWQ runs each parent once per grid point: a stranger's recipe cannot ask for a million
ACTORDER_DEFAULT = "default"  # GPTQModifier's sentinel: static unless the scheme says otherwise


@dataclass(frozen=True)
class GPTQSettings:
    """GPTQModifier's fields, plus the order graphcal takes the layers in.

    ``order`` "sequential" (llm-compressor's default pipeline): layer block by layer block, each
    block's Hessians from the outputs of the blocks before it with their weights already quantized;
    "one-pass" (graphcal's, like llm-compressor's ``pipeline="basic"``): every Hessian from the one
    calibration pass over the float model.
    """

    block_size: int = 128
    dampening_frac: float = 0.01
    actorder: str | None = ACTORDER_DEFAULT  # "static" | "weight" | None (explicit) | the sentinel
    order: str = "sequential"


@dataclass(frozen=True)
class AWQSettings:
    """AWQModifier's fields: ``mappings`` as (smooth layer, balance layers) names or regexes (None: the
    activations of the quantized layers whose producer allows an exact fold, found by graph structure)."""

    mappings: tuple[tuple[str, tuple[str, ...]], ...] | None = None
    duo_scaling: bool | str = True  # True, False or "both"
    n_grid: int = 20


@dataclass
class RunConfig:
    """Config groups (compressed-tensors schemes, each with targets) and what to ignore."""

    groups: dict[str, "object"]  # group name -> QuantizationScheme
    ignore: list[str] = field(default_factory=lambda: list(DEFAULT_IGNORE))
    scheme_name: str = "custom"
    kv_cache: "object | None" = None  # QuantizationArgs for the key/value states (kv_cache_scheme)
    smoothing: Smoothing | None = None  # SmoothQuant before quantizing (None: none)
    awq: AWQSettings | None = None  # AWQ's scale search before quantizing (None: none)
    gptq: GPTQSettings | None = None  # weights quantized by GPTQ instead of rounding to nearest (None: RTN)

    def scheme_for(self, target: Target):
        """The scheme of the most specific matching target string (exact > regex > class), or None."""
        best = None
        for scheme in self.groups.values():
            for pattern in scheme.targets:
                if matches(target, pattern):
                    rank = _specificity(pattern)
                    if best is None or rank < best[0]:
                        best = (rank, scheme)
        return None if best is None else best[1]

    @property
    def patterns(self) -> list[str]:
        return [p for s in self.groups.values() for p in s.targets]


@dataclass(frozen=True)
class Options:
    """What the user asked for, from flags or the Python API; None means "not given".

    :func:`resolve` turns it into the run's :class:`RunConfig`: the one place where flags and a
    recipe meet, with one rule: a flag given overrides what the recipe says, and a recipe fills
    what no flag gives; without a recipe, what is not given takes graphcal's defaults
    (W8A8, targets Linear, ignore lm_head).
    """

    scheme: str | None = None
    targets: tuple[str, ...] | None = None
    ignore: tuple[str, ...] | None = None
    observer: str | None = None
    kv_cache: str | None = None
    recipe: str | os.PathLike | None = None
    smoothquant: str | None = None  # --smoothquant: "norms", "all" or "mul"
    smoothing_strength: float | str | None = None  # a number, or "auto" (searched per mapping)
    algorithm: str | None = None  # --algorithm: "gptq", "awq" or "awq+gptq"
    block_size: int | None = None  # GPTQ
    dampening_frac: float | None = None  # GPTQ
    actorder: str | None = None  # GPTQ: "static", "weight" or "none"
    gptq_order: str | None = None  # GPTQ: "sequential" or "one-pass"
    duo_scaling: str | None = None  # AWQ: "true", "false" or "both"
    n_grid: int | None = None  # AWQ
    group_size: int | None = None  # every group/tensor_group weight scheme's group size


def resolve(options: Options) -> RunConfig:
    """The run's config from flags and/or a recipe (see :class:`Options` for the override rule)."""
    from dataclasses import replace

    targets = list(options.targets) if options.targets is not None else None
    ignore = list(options.ignore) if options.ignore is not None else None
    if options.recipe is not None:
        from graphcal.config.recipe import load_recipe, recipe_config

        config = recipe_config(load_recipe(options.recipe), scheme=options.scheme, targets=targets, ignore=ignore,
                               observer=options.observer, kv_cache=options.kv_cache)
    else:
        config = build_config(options.scheme or DEFAULT_SCHEME, targets or list(DEFAULT_TARGETS),
                              list(DEFAULT_IGNORE) if ignore is None else ignore, options.observer, options.kv_cache)
    if options.smoothquant is not None or options.smoothing_strength is not None:
        smoothing = config.smoothing or Smoothing()
        if options.smoothquant is not None:
            smoothing = replace(smoothing, scope=check_scope(options.smoothquant))
        if options.smoothing_strength is not None:
            if str(options.smoothing_strength).strip().lower() == "auto":
                smoothing = replace(smoothing, search=True)
            else:
                smoothing = replace(smoothing, strength=check_strength(_number(options.smoothing_strength)),
                                    search=False)
        config.smoothing = smoothing
    if options.group_size is not None:
        config.groups = {name: with_group_size(scheme, options.group_size) for name, scheme in config.groups.items()}
    _algorithms(config, options)
    return config


def with_group_size(scheme, size: int):
    """``scheme`` with the group size of its group / tensor_group weights set to ``size``."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise UsageError(f"--group-size must be a positive integer, got {size!r}")
    args = scheme.weights
    if args is None or enum_value(args.strategy) not in ("group", "tensor_group"):
        raise UsageError(f"--group-size applies to group and tensor_group weights; this scheme's weights are "
                         f"{enum_value(args.strategy) if args is not None else 'not quantized'}")
    return scheme.model_copy(update={"weights": args.model_copy(update={"group_size": size})})


def _algorithms(config: RunConfig, options: Options) -> None:
    """GPTQ and AWQ settings from --algorithm and its knobs (they override a recipe's modifiers)."""
    from dataclasses import replace

    gptq_knobs = {"block_size": options.block_size, "dampening_frac": options.dampening_frac,
                  "actorder": options.actorder, "order": options.gptq_order}
    awq_knobs = {"duo_scaling": options.duo_scaling, "n_grid": options.n_grid}
    if options.algorithm is not None:
        if options.algorithm not in ALGORITHMS:
            raise UsageError(f"--algorithm takes one of {', '.join(ALGORITHMS)}, got {_shown(str(options.algorithm))!r}")
        if "gptq" in options.algorithm:
            config.gptq = config.gptq or GPTQSettings()
        if "awq" in options.algorithm:
            config.awq = config.awq or AWQSettings()
    for knobs, have, flag in ((gptq_knobs, config.gptq, "gptq"), (awq_knobs, config.awq, "awq")):
        given = [k for k, v in knobs.items() if v is not None]
        if given and have is None:
            names = ", ".join("--" + ("gptq-order" if k == "order" else k.replace("_", "-")) for k in given)
            raise UsageError(f"{names} {'needs' if len(given) == 1 else 'need'} --algorithm {flag} (or a recipe with "
                             f"its {'GPTQModifier' if flag == 'gptq' else 'AWQModifier'})")
    if config.gptq is not None:
        updates = {k: v for k, v in gptq_knobs.items() if v is not None}
        if "actorder" in updates:
            updates["actorder"] = None if str(updates["actorder"]).lower() == "none" else updates["actorder"]
        config.gptq = check_gptq(replace(config.gptq, **updates))
        config.groups = {name: with_actorder(scheme, config.gptq.actorder) for name, scheme in config.groups.items()}
    if config.awq is not None:
        updates = {k: v for k, v in awq_knobs.items() if v is not None}
        if "duo_scaling" in updates:
            updates["duo_scaling"] = _duo(updates["duo_scaling"])
        config.awq = check_awq(replace(config.awq, **updates))
    if config.awq is not None and config.smoothing is not None:
        raise UsageError("SmoothQuant and AWQ both rescale the activations of the same layers; use one of them")


def _duo(value) -> bool | str:
    text = str(value).strip().lower()
    choices = {"true": True, "false": False, "both": "both"}
    if text not in choices:
        raise UsageError(f"--duo-scaling takes true, false or both, got {_shown(str(value))!r}")
    return choices[text]


def check_gptq(settings: GPTQSettings) -> GPTQSettings:
    """GPTQModifier's fields checked (where llm-compressor would fail later, graphcal says so first)."""
    from graphcal.algorithms.gptq.math import check_actorder

    if isinstance(settings.block_size, bool) or not isinstance(settings.block_size, int) or settings.block_size < 1:
        raise UsageError(f"GPTQ block_size must be a positive integer, got {settings.block_size!r}")
    damp = settings.dampening_frac
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not damp >= 0 or damp == float("inf"):
        raise UsageError(f"GPTQ dampening_frac must be a finite number >= 0, got {damp!r}")
    if settings.actorder != ACTORDER_DEFAULT:
        try:
            check_actorder(settings.actorder)
        except ValueError as e:
            raise UsageError(f"GPTQ actorder: {e}") from None
    if settings.order not in GPTQ_ORDERS:
        raise UsageError(f"--gptq-order takes one of {', '.join(GPTQ_ORDERS)}, got {_shown(str(settings.order))!r}")
    return settings


def check_awq(settings: AWQSettings) -> AWQSettings:
    """AWQModifier's fields checked: a grid llm-compressor would fail on is a usage error here."""
    if settings.duo_scaling not in (True, False, "both"):
        raise UsageError(f"AWQ duo_scaling must be true, false or both, got {settings.duo_scaling!r}")
    n = settings.n_grid
    least = {True: 3, False: 2, "both": 4}[settings.duo_scaling]
    if isinstance(n, bool) or not isinstance(n, int) or n < least or n > MAX_N_GRID:
        raise UsageError(f"AWQ n_grid must be an integer >= {least} (with duo_scaling {settings.duo_scaling}) and <= "
                         f"{MAX_N_GRID}, got {n!r}")
    return settings


def with_actorder(scheme, actorder: str | None):
    """llm-compressor's resolution of GPTQ's actorder into a scheme's weights: the sentinel gives
    static unless the scheme sets one; an explicit value fills a scheme without one; two explicit
    values that differ are an error."""
    args = scheme.weights
    if args is None or enum_value(args.strategy) not in ("group", "tensor_group", "channel", "tensor", "block"):
        return scheme
    have = None if args.actorder is None else enum_value(args.actorder)
    if actorder == ACTORDER_DEFAULT:
        value = have if have is not None else "static"
    elif have is not None and actorder is not None and _same_order(have, actorder) is False:
        raise UsageError(f"Cannot resolve activation ordering: the scheme says {have}, GPTQ says {actorder}")
    else:
        value = actorder if actorder is not None else have
    return scheme.model_copy(update={"weights": args.model_copy(update={"actorder": value})})


def _same_order(a: str, b: str) -> bool:
    alias = {"static": "weight"}
    return alias.get(a, a) == alias.get(b, b)


def _number(value):
    """A strength given as text (the command line) as a float; other values as they are."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise UsageError(f"smoothing strength must be a number or auto, got {_shown(value)!r}") from None
    return value


def check_scope(scope: str) -> str:
    from graphcal.graph.scaling import SCOPES

    if scope not in SCOPES:
        raise UsageError(f"--smoothquant takes one of {', '.join(SCOPES)}, got {_shown(scope)!r}")
    return scope


def check_strength(value) -> float:
    """SmoothQuant's alpha: any finite number, as llm-compressor takes it (0.5 by default; 0 to 1 is usual)."""
    import math

    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UsageError(f"smoothing strength must be a finite number, got {value!r}")
    return float(value)


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


# kv_cache_scheme shorthands: static, symmetric, per tensor (llm-compressor's usual recipes)
KV_CACHE_PRESETS = {
    "FP8": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False},
    "INT8": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False},
}


MAX_JSON_BYTES = 1 << 20
MAX_JSON_DEPTH = 32  # a scheme nests 3 deep; the cap keeps json's recursion far from Python's limit


def load_json(text: str, what: str):
    """``json.loads`` for option values from strangers: at most 1 MB and 32 levels deep (a usage error otherwise)."""
    if len(text) > MAX_JSON_BYTES:
        raise UsageError(f"{what} JSON is {len(text):,} characters; at most {MAX_JSON_BYTES:,} are read")
    depth, deepest, in_string, escaped = 0, 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                raise UsageError(f"{what} JSON nests deeper than {MAX_JSON_DEPTH} levels; a scheme needs 3")
        elif ch in "]}":
            depth -= 1
    return json.loads(text)


def resolve_kv_cache(text: str):
    """compressed-tensors QuantizationArgs for the key/value states: FP8, INT8, or JSON fields
    (e.g. ``{"num_bits": 8, "type": "float", "strategy": "attn_head"}``)."""
    stripped = text.strip()
    if stripped.upper() in KV_CACHE_PRESETS:
        return resolve_kv_cache_args(KV_CACHE_PRESETS[stripped.upper()])
    if not stripped.startswith("{"):
        raise UsageError(f"unknown kv-cache scheme {_shown(text)!r}; choose FP8, INT8 or JSON QuantizationArgs fields")
    try:
        fields = load_json(stripped, "--kv-cache-scheme")
    except json.JSONDecodeError as e:
        raise UsageError(f"--kv-cache-scheme is neither FP8, INT8 nor valid JSON: {e}") from e
    if not isinstance(fields, dict):
        raise UsageError("--kv-cache-scheme JSON must be an object of QuantizationArgs fields")
    return resolve_kv_cache_args(fields)


def resolve_kv_cache_args(fields: dict):
    """QuantizationArgs for key/value states from their fields; static tensor or attn_head only."""
    from compressed_tensors.quantization import QuantizationArgs
    from pydantic import ValidationError

    try:
        args = QuantizationArgs.model_validate(fields)
    except ValidationError as e:
        raise UsageError(f"invalid kv-cache scheme: {pydantic_message(e)}") from e
    if args.strategy not in ("tensor", "attn_head") or args.dynamic is not False:
        raise UsageError(f"kv-cache scheme: strategy {getattr(args.strategy, 'value', args.strategy)} "
                         f"dynamic={args.dynamic} is not supported; use static tensor or attn_head")
    return args


def resolve_scheme(scheme: str, targets: list[str]):
    """A compressed-tensors QuantizationScheme from a preset name or JSON fields."""
    from compressed_tensors.quantization import QuantizationScheme
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
    raise UsageError(f"unknown scheme {_shown(scheme)!r}; choose one of: {', '.join(scheme_names())}")


def scheme_names() -> list[str]:
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    return sorted(set(PRESET_SCHEMES) | set(GRAPHCAL_PRESETS))


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
    from compressed_tensors.quantization.quant_args import DynamicType

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


def _specificity(pattern: str) -> int:
    if pattern in ("Linear", "MatMul", "Gemm"):
        return 2
    return 1 if pattern.startswith("re:") else 0


def _shown(text: str) -> str:
    """An option's value for a message, cut to 60 characters (a stranger's value may be huge)."""
    return text if len(text) <= 60 else text[:57] + "..."


def pydantic_message(e) -> str:
    """The first error of a pydantic ValidationError as one line: ``loc: message``."""
    err = e.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ()))
    msg = re.sub(r"\s+", " ", err.get("msg", str(e)))
    return f"{where}: {msg}" if where else msg
