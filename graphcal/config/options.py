"""What the user asked for (:class:`Options`, from flags or the Python API) resolved into the run's
:class:`~graphcal.config.records.RunConfig`: the one place where flags and a recipe meet.

The one override rule: a flag given overrides what the recipe says, and a recipe fills what no
flag gives; without a recipe, what is not given takes graphcal's defaults (W8A8, targets Linear,
ignore lm_head).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

from graphcal.config.records import (
    ALGORITHMS,
    DEFAULT_IGNORE,
    DEFAULT_SCHEME,
    DEFAULT_TARGETS,
    ROTATION_TYPES,
    ROTATIONS,
    AWQSettings,
    GPTQSettings,
    RunConfig,
    Smoothing,
    check_awq,
    check_gptq,
    check_scope,
    check_strength,
)
from graphcal.config.schemes import build_config, scheme_group, with_actorder, with_group_size
from graphcal.errors import UsageError, shown
from graphcal.types import enum_value


@dataclass(frozen=True)
class Options:
    """Every option of `graphcal run`, from its flags or the Python API (``calibrate(model, data,
    output_dir, options)``): the one record both build, so the API reaches every flag.

    The config fields (scheme ... rotation_type): None means "not given". :func:`resolve` turns
    them into the run's :class:`RunConfig`: the one place where flags and a recipe meet, with one
    rule: a flag given overrides what the recipe says, and a recipe fills what no flag gives;
    without a recipe, what is not given takes graphcal's defaults (W8A8, targets Linear, ignore
    lm_head). The pass fields (device ... tap_limit_mb) say how the run goes; they have defaults.
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
    awq_samples: int | None = None  # AWQ: the samples each parent is scored on (None: all)
    awq_clip: bool | None = None  # AWQ: the original AWQ's clip search per layer and group (graphcal's extension)
    group_size: int | None = None  # every group/tensor_group weight scheme's group size
    scheme_for: tuple[str, ...] | None = None  # "TARGET=SCHEME": one more config group each
    lm_head: bool | None = None  # quantize lm_head: "lm_head" leaves the ignore list
    rotate: str | None = None  # --rotate: "R1", or "R1,R2" (SpinQuant's default), folded in before calibrating
    rotation_type: str | None = None  # a recipe's SpinQuant transform_type (no flag): "hadamard", "random-hadamard", ...
    # how the run goes (`graphcal run`'s pass flags)
    device: str = "auto"  # --device: "auto", "cpu" or "cuda"
    target: str = "onnxruntime"  # --target: the runtime the model is written for: "onnxruntime", "tensorrt", "qdq"
    matmulnbits: int | str | None = None  # --matmulnbits: MatMulNBits' accuracy_level, or "off" (None: DequantizeLinear
    # weights, but an onnxruntime-genai model's weight-only layers as its builder writes them: calibration.plan.weight_format)
    batch_size: int | None = None  # --batch-size (None: the model's fixed batch, else 8)
    num_samples: int | None = None  # --num-samples (None: every sample)
    progress: bool = False  # progress bars (run: unless --quiet or --json)
    reduce_in_graph: bool = True  # activation reductions inside onnxruntime's graph (no flag; False: in torch)
    skip_nonfinite_weights: bool = False  # --skip-nonfinite-weights
    exclude_padding: bool = False  # --exclude-padding
    tap_limit_mb: float | None = None  # --tap-limit-mb (None: 1024)
    cache_mb: float | None = None  # --cache-mb: block walks' cached tensors held in memory (None: half the memory available)
    ignore_memory_check: bool = False  # --ignore-memory-check: run even past the estimated peak memory
    pass_mode: str = "auto"  # --pass: "auto" (block by block for a decoder), "blocks" or "whole-graph"

    def __post_init__(self):  # a list given from Python kept as the tuple a frozen record holds
        for name in ("targets", "ignore", "scheme_for"):
            value = getattr(self, name)
            if isinstance(value, str):  # one pattern given bare ("Linear"), not its letters
                object.__setattr__(self, name, (value,))
            elif value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))


def with_keywords(options: Options | None, keywords: dict) -> Options:
    """``options`` (None: every default) with ``keywords`` by field name over it: the keyword form
    ``calibrate(model, data, out, scheme="W8A8")`` mapped onto the one record."""
    if options is None:
        options = Options()
    elif not isinstance(options, Options):
        raise TypeError(f"options must be a graphcal.Options, got {type(options).__name__}")
    unknown = sorted(set(keywords) - {f.name for f in fields(Options)})
    if unknown:
        raise TypeError(f"unexpected keyword argument{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                        "(graphcal.Options lists every option)")
    return replace(options, **keywords) if keywords else options


def resolve(options: Options) -> RunConfig:
    """The run's config from flags and/or a recipe (see :class:`Options` for the override rule)."""
    targets = list(options.targets) if options.targets is not None else None
    ignore = list(options.ignore) if options.ignore is not None else None
    if options.recipe is not None:
        from graphcal.config.recipe import load_recipe, recipe_config  # lazy: pydantic models, only for a recipe

        config = recipe_config(load_recipe(options.recipe), scheme=options.scheme, targets=targets, ignore=ignore,
                               observer=options.observer, kv_cache=options.kv_cache)
    else:
        config = build_config(options.scheme or DEFAULT_SCHEME, targets or list(DEFAULT_TARGETS),
                              list(DEFAULT_IGNORE) if ignore is None else ignore, options.observer, options.kv_cache)
    if options.lm_head:
        config.ignore = [p for p in config.ignore if p != "lm_head"]
    if options.rotate is not None:  # "" too: refused by check_rotations, never a run without a rotation
        config.rotate = check_rotations(options.rotate)
    if options.rotation_type is not None:
        config.rotation_type = check_rotation_type(options.rotation_type)
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
    for entry in options.scheme_for or ():  # a grouped preset takes --group-size too; JSON keeps what it says
        scheme, preset = scheme_group(entry, options.observer)
        grouped = scheme.weights is not None and enum_value(scheme.weights.strategy) in ("group", "tensor_group")
        if preset and grouped and options.group_size is not None:
            scheme = with_group_size(scheme, options.group_size)
        config.groups[f"group_{len(config.groups)}"] = scheme
    _algorithms(config, options)
    return config


def _algorithms(config: RunConfig, options: Options) -> None:
    """GPTQ and AWQ settings from --algorithm and its knobs (they override a recipe's modifiers)."""
    gptq_knobs = {"block_size": options.block_size, "dampening_frac": options.dampening_frac,
                  "actorder": options.actorder, "order": options.gptq_order}
    awq_knobs = {"duo_scaling": options.duo_scaling, "n_grid": options.n_grid, "search_samples": options.awq_samples,
                 "clip": options.awq_clip}
    if options.algorithm is not None:
        if options.algorithm not in ALGORITHMS:
            raise UsageError(f"--algorithm takes one of {', '.join(ALGORITHMS)}, got {shown(str(options.algorithm))!r}")
        if "gptq" in options.algorithm:
            config.gptq = config.gptq or GPTQSettings()
        if "awq" in options.algorithm:
            config.awq = config.awq or AWQSettings()
    for knobs, have, flag in ((gptq_knobs, config.gptq, "gptq"), (awq_knobs, config.awq, "awq")):
        given = [k for k, v in knobs.items() if v is not None]
        if given and have is None:
            flags = {"order": "gptq-order", "search_samples": "awq-samples", "clip": "awq-clip"}
            names = ", ".join("--" + flags.get(k, k.replace("_", "-")) for k in given)
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
        raise UsageError(f"--duo-scaling takes true, false or both, got {shown(str(value))!r}")
    return choices[text]


def check_rotations(text: str) -> tuple[str, ...]:
    """--rotate's value: rotations by SpinQuant's names, R1 always among them (R2 turns heads inside it)."""
    names = tuple(dict.fromkeys(p.strip().upper() for p in str(text).split(",") if p.strip()))
    unknown = [n for n in names if n not in ROTATIONS]
    if unknown or "R1" not in names:
        raise UsageError(f"--rotate takes R1 or R1,R2 (SpinQuant's names; R3 and R4 need online Hadamards, which "
                         f"graphcal does not write), got {shown(str(text))!r}")
    return names


def check_rotation_type(kind) -> str:
    """The rotation's matrix, by SpinQuantModifier's transform_type names."""
    if kind not in ROTATION_TYPES:
        raise UsageError(f"rotation_type takes one of {', '.join(ROTATION_TYPES)}, got {shown(str(kind))!r}")
    return kind


def _number(value):
    """A strength given as text (the command line) as a float; other values as they are."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise UsageError(f"smoothing strength must be a number or auto, got {shown(value)!r}") from None
    return value
