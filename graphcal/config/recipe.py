"""llm-compressor recipes to a RunConfig: the file read, its modifiers found, their quantization fields made schemes.

Each modifier's fields and types are :mod:`graphcal.config.modifiers`'; the bounded YAML reader
is :mod:`graphcal.config.untrusted`'s; flags are applied over the result by
:func:`graphcal.config.options.resolve`.

Accepted layouts (YAML or JSON)::

    quant_stage:                      # any stage name
      quant_modifiers:                # any "*_modifiers" group
        SmoothQuantModifier: {...}    # optional, before the QuantizationModifier
        QuantizationModifier: {...}

    QuantizationModifier: {...}       # a bare modifier

The modifier's fields are llm-compressor's QuantizationMixin fields: ``scheme`` (a preset name,
or ``{preset: targets}``), ``config_groups``, ``targets``, ``ignore``, ``kv_cache_scheme``,
``weight_observer`` / ``input_observer`` / ``output_observer``, ``observer`` (``{weights,
input, output}``) and ``bypass_divisibility_checks``; the Modifier bookkeeping fields
(``index``, ``group``, ``start``, ``end``, ``update``) are accepted and have no effect on a
one-shot calibration. Resolution follows llm-compressor: ``scheme`` and ``config_groups`` are
exclusive, a preset ``scheme`` takes the modifier's ``targets``, and observer fields override
what the schemes say. Anything else is refused with a one-line error naming it.

A SmoothQuantModifier takes llm-compressor's fields: ``smoothing_strength`` (0.5), ``mappings``
(``[[balance regexes], smooth regex]``; none given: llm-compressor's default Llama mappings,
matched by module name), ``ignore`` and ``algorithm`` (``smoothquant`` or ``log_equalization``);
``num_calibration_steps`` and ``calibration_function`` are accepted and unused, as in
llm-compressor 0.14; ``start``/``end`` other than None or -1 are refused (one-shot only).

A SpinQuantModifier (before the modifier that quantizes) folds its mergeable rotations in first,
as ``--rotate`` does: ``rotations`` [R1] or [R1, R2] and ``transform_type`` (``hadamard``,
``random-hadamard``, ``random-matrix``); R3/R4 (online), ``randomize``/``learnable`` (not
implemented by llm-compressor either), ``transform_block_size``, ``mappings``, ``norm_mappings``
and ``transform_config`` are refused in one line (graphcal finds the stream by graph structure).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from graphcal.config.modifiers import (
    AWQ,
    FIELDS,
    GPTQ,
    KNOWN,
    MODIFIER,
    NO_EFFECT,
    SMOOTHQUANT,
    SPINQUANT,
    GPTQFields,
    ModifierFields,
    Recipe,
    awq_fields,
    awq_from,
    gptq_from,
    mapping,
    smoothing_from,
    smoothquant_fields,
    spinquant_fields,
    typed,
    validated,
)
from graphcal.config.records import RunConfig
from graphcal.config.schemes import GRAPHCAL_PRESETS, resolve_kv_cache, resolve_kv_cache_args, resolve_scheme, with_observers
from graphcal.config.untrusted import MAX_RECIPE_BYTES, load_yaml, pydantic_message
from graphcal.errors import UsageError, first_line
from graphcal.limits import read_regular

STAGE_KEYS = {"run_type"}  # stage-level settings that do not change a one-shot calibration


def load_recipe(path: str | Path) -> Recipe:
    """The modifiers' fields from a recipe file (validated keys, raw values)."""
    path = Path(path)
    raw = read_regular(path, "recipe file", MAX_RECIPE_BYTES, error=UsageError)  # regular files only, 1 MB at most
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"cannot read recipe {path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    return parse_recipe(text, str(path))


def parse_recipe(text: str, where: str = "recipe") -> Recipe:
    """Find the one QuantizationModifier (and a SmoothQuantModifier before it) in a recipe's text
    and check their keys."""
    if len(text) > MAX_RECIPE_BYTES:
        raise UsageError(f"{where}: {len(text):,} characters; a recipe is read up to {MAX_RECIPE_BYTES:,}")
    try:
        data = load_yaml(text, where)
    except RecursionError:
        raise UsageError(f"{where}: the YAML nests too deeply") from None
    except yaml.YAMLError as e:
        raise UsageError(f"{where}: not valid YAML ({first_line(e)})") from e
    if not isinstance(data, dict):
        raise UsageError(f"{where}: a recipe is a mapping of stages or a {MODIFIER}")
    found = _order(data, where)
    for name, _, at in found:
        if name not in KNOWN:
            raise UsageError(f"{where}: {at} is not supported (graphcal runs {', '.join(KNOWN)})")
    for name in KNOWN:
        if sum(f[0] == name for f in found) > 1:
            raise UsageError(f"{where}: expected at most one {name}, found {sum(f[0] == name for f in found)}")
    by_name = {f[0]: f for f in found}
    names = [f[0] for f in found]
    quantizers = [n for n in (MODIFIER, GPTQ) if n in by_name]
    if not quantizers:
        raise UsageError(f"{where}: expected a {MODIFIER} or a {GPTQ} (the modifier that quantizes)")
    for transform in (SPINQUANT, SMOOTHQUANT, AWQ):
        if transform in by_name and names.index(transform) > min(names.index(q) for q in quantizers):
            raise UsageError(f"{where}: {by_name[transform][2]} comes after the modifier that quantizes; graphcal "
                             "rescales before it quantizes, as llm-compressor recipes put it")
    gptq = None
    if GPTQ in by_name:  # its own fields here (actorder checked with the others, records.check_gptq)
        args = mapping(by_name[GPTQ][1], f"{where}: {by_name[GPTQ][2]}")
        gptq = validated(GPTQFields, {k: v for k, v in args.items() if k not in FIELDS | NO_EFFECT},
                         f"{where}: {by_name[GPTQ][2]}")
    sources = []
    for q in quantizers:
        args = mapping(by_name[q][1], f"{where}: {by_name[q][2]}")
        own = {k: v for k, v in args.items() if k in FIELDS}
        if q == MODIFIER:
            unknown = sorted(str(k) for k in args if k not in FIELDS | NO_EFFECT)
            if unknown:
                raise UsageError(f"{where}: unknown {MODIFIER} key(s) {', '.join(repr(k) for k in unknown)} at "
                                 f"{by_name[q][2]}; known: {', '.join(sorted(FIELDS))}")
        if q == MODIFIER or own.keys() & {"scheme", "config_groups"}:
            sources.append((q, own))
    if len(sources) > 1:
        raise UsageError(f"{where}: both the {MODIFIER} and the {GPTQ} give a scheme; give it in one of them")
    if not sources:
        raise UsageError(f"{where}: the {GPTQ} gives no scheme or config_groups and no {MODIFIER} gives one")
    fields = sources[0][1]
    typed(fields, f"{where}: {by_name[sources[0][0]][2]}")
    smoothquant = None
    if SMOOTHQUANT in by_name:
        smoothquant = smoothquant_fields(by_name[SMOOTHQUANT][1], f"{where}: {by_name[SMOOTHQUANT][2]}")
    awq = None
    if AWQ in by_name:
        awq = awq_fields(by_name[AWQ][1], f"{where}: {by_name[AWQ][2]}")
    spinquant = None
    if SPINQUANT in by_name:
        spinquant = spinquant_fields(by_name[SPINQUANT][1], f"{where}: {by_name[SPINQUANT][2]}")
    return Recipe(fields, smoothquant, gptq, awq, spinquant)


def _order(data: dict, where: str = "recipe") -> list[tuple]:
    """Every modifier of the recipe as (name, fields, where), in recipe order."""
    out = []
    for key, value in data.items():
        if key in KNOWN or (isinstance(key, str) and key.endswith("Modifier")):
            out.append((key, value, str(key)))
        elif isinstance(value, dict):
            for group, modifiers in value.items():
                if group in STAGE_KEYS:
                    continue
                if not (isinstance(group, str) and group.endswith("_modifiers")) or not isinstance(modifiers, dict):
                    raise UsageError(f"{where}: unknown key {key}.{group} (a stage holds '*_modifiers' groups)")
                out += [(name, args, f"{key}.{group}.{name}") for name, args in modifiers.items()]
        else:
            raise UsageError(f"{where}: unknown top-level key {key!r} (expected a stage or {MODIFIER})")
    return out


def recipe_config(recipe: Recipe, *, scheme: str | None = None, targets: list[str] | None = None,
                  ignore: list[str] | None = None, observer: str | None = None,
                  kv_cache: str | None = None) -> RunConfig:
    """A RunConfig from a recipe's modifiers; the keyword arguments (CLI flags) override them."""
    fields = recipe.quantization
    from compressed_tensors.quantization import QuantizationScheme  # lazy: as in graphcal.config.schemes
    from compressed_tensors.quantization.quant_scheme import is_preset_scheme, preset_name_to_scheme

    m = typed(fields)
    if targets is not None:
        if m.config_groups and scheme is None:
            raise UsageError("--targets cannot override a recipe's config_groups (their targets are per group); "
                             "edit the recipe or give --scheme")
        m.targets = list(targets)
    if ignore is not None:
        m.ignore = list(ignore)
    mod_targets = m.targets
    if scheme is not None:  # a CLI scheme replaces the recipe's scheme / config_groups
        groups = {"group_0": resolve_scheme(scheme, mod_targets)}
        name = scheme.upper() if not scheme.lstrip().startswith("{") else "custom"
    elif m.scheme is not None and m.config_groups is not None:
        raise UsageError("recipe: give either scheme or config_groups, not both (as llm-compressor requires)")
    elif m.scheme is not None:
        presets = {m.scheme: mod_targets} if isinstance(m.scheme, str) else m.scheme
        if not presets:
            raise UsageError("recipe: scheme must be a preset name or a mapping of preset names to targets")
        groups = {}
        for i, (preset, preset_targets) in enumerate(presets.items()):
            key = str(preset).upper()
            if not (is_preset_scheme(key) or key in GRAPHCAL_PRESETS):
                raise UsageError(f"recipe: unknown preset scheme {preset!r}")
            groups[f"group_{i}"] = (preset_name_to_scheme(key, preset_targets) if is_preset_scheme(key)
                                    else resolve_scheme(key, preset_targets))
        name = "+".join(str(p).upper() for p in presets)
    elif m.config_groups:
        groups = {}
        for group, body in m.config_groups.items():
            try:
                groups[str(group)] = QuantizationScheme.model_validate({"targets": mod_targets, **body})
            except ValidationError as e:
                raise UsageError(f"recipe: config_groups.{group}: {pydantic_message(e)}") from e
            except NotImplementedError as e:  # compressed-tensors refuses e.g. channel activations this way
                raise UsageError(f"recipe: config_groups.{group}: unsupported ({first_line(e)})") from e
        name = "recipe"
    else:  # llm-compressor's default: QuantizationScheme(targets) with its default args (W8 per tensor)
        groups = {"group_0": QuantizationScheme(targets=mod_targets)}
        name = "recipe"
    groups = {g: _with_observers(s, m, observer) for g, s in groups.items()}
    if kv_cache is not None:
        kv_args = resolve_kv_cache(kv_cache)
    elif m.kv_cache_scheme is not None:
        kv_args = resolve_kv_cache_args(m.kv_cache_scheme)
    else:
        kv_args = None
    if kv_args is not None and observer is not None:
        kv_args = kv_args.model_copy(update={"observer": observer})
    smoothing = smoothing_from(recipe.smoothquant) if recipe.smoothquant is not None else None
    awq = awq_from(recipe.awq) if recipe.awq is not None else None
    gptq = gptq_from(recipe.gptq) if recipe.gptq is not None else None  # (its actorder enters the schemes
    #                                  in options.resolve, after the flags: the one place that resolves it)
    spin = recipe.spinquant or {}
    return RunConfig(groups=groups, ignore=list(m.ignore), scheme_name=name, kv_cache=kv_args, smoothing=smoothing,
                     awq=awq, gptq=gptq, rotate=spin.get("rotations", ()),
                     rotation_type=spin.get("transform_type", "hadamard"))


def _with_observers(scheme, m: ModifierFields, cli_observer: str | None):
    """llm-compressor's observer overrides: weight_/input_/output_observer, or the observer dict."""
    individual = {"weight": m.weight_observer, "input": m.input_observer, "output": m.output_observer}
    if m.observer is not None:
        if any(v is not None for v in individual.values()):
            raise UsageError("recipe: give either weight_/input_/output_observer or the observer mapping, not both")
        individual = {"weight": m.observer.get("weights"), "input": m.observer.get("input"),
                      "output": m.observer.get("output")}
    if cli_observer is not None:
        individual = {"weight": cli_observer, "input": cli_observer, "output": cli_observer}
    return with_observers(scheme, **individual)
