"""llm-compressor recipes: a QuantizationModifier, optionally after a SmoothQuantModifier, to a RunConfig.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

from graphcal.config import RunConfig, pydantic_message, resolve_kv_cache_args, with_observers
from graphcal.errors import UsageError, first_line

MODIFIER = "QuantizationModifier"
NO_EFFECT = {"index", "group", "start", "end", "update"}  # llm-compressor Modifier bookkeeping

# A name or a list of names, as llm-compressor's fields take them.
Names = Annotated[list[str], BeforeValidator(lambda v: [v] if isinstance(v, str) else v)]


class ModifierFields(BaseModel):
    """The QuantizationModifier fields graphcal reads, with their types (llm-compressor's
    QuantizationMixin); anything else is refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    config_groups: dict[str, dict[str, Any]] | None = None
    targets: Names = ["Linear"]
    ignore: Names = []
    scheme: str | dict[str, Names] | None = None
    kv_cache_scheme: dict[str, Any] | None = None
    weight_observer: str | None = None
    input_observer: str | None = None
    output_observer: str | None = None
    observer: dict[Literal["weights", "input", "output"], str] | None = None
    bypass_divisibility_checks: bool = False


FIELDS = set(ModifierFields.model_fields)
STAGE_KEYS = {"run_type"}  # stage-level settings that do not change a one-shot calibration
SMOOTHQUANT = "SmoothQuantModifier"
GPTQ = "GPTQModifier"
AWQ = "AWQModifier"
KNOWN = (MODIFIER, GPTQ, SMOOTHQUANT, AWQ)


class GPTQFields(BaseModel):
    """GPTQModifier's own fields (llm-compressor 0.14); its quantization fields are ModifierFields'."""

    model_config = ConfigDict(extra="forbid")

    block_size: int = 128
    dampening_frac: float = 0.01
    actorder: Literal["static", "weight", "group", "dynamic"] | None = "default"  # type: ignore[assignment]
    batched_quantization: Any = "auto"  # how llm-compressor stacks layers on a GPU; same numbers
    requires_calibration_data: bool | None = None


class AWQMappingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    smooth_layer: str
    balance_layers: Names
    activation_hook_target: str | None = None


class AWQFields(BaseModel):
    """AWQModifier's fields (llm-compressor 0.14); anything else is refused."""

    model_config = ConfigDict(extra="forbid")

    mappings: list[AWQMappingFields] | None = None
    duo_scaling: bool | Literal["both"] = True
    n_grid: int = 20
    offload_device: Any = None  # where llm-compressor keeps cached inputs; graphcal bounds its own
    requires_calibration_data: bool | None = None
    index: int | None = None
    group: str | None = None
    start: float | None = None
    end: float | None = None
    update: Any = None


class SmoothQuantFields(BaseModel):
    """SmoothQuantModifier's fields (llm-compressor 0.14); anything else is refused."""

    model_config = ConfigDict(extra="forbid")

    smoothing_strength: float = 0.5
    mappings: list | None = None
    ignore: Names = []
    algorithm: Literal["smoothquant", "log_equalization"] = "smoothquant"
    num_calibration_steps: int | None = None  # declared and unused in llm-compressor 0.14
    calibration_function: Any = None  # likewise
    requires_calibration_data: bool | None = None  # llm-compressor writes it when it saves a recipe
    index: int | None = None
    group: str | None = None
    start: float | None = None
    end: float | None = None
    update: Any = None


@dataclass(frozen=True)
class Recipe:
    """A recipe's quantization fields (its QuantizationModifier's or GPTQModifier's) and, where it
    has them, its SmoothQuantModifier's, GPTQModifier's own and AWQModifier's fields."""

    quantization: dict[str, Any]
    smoothquant: dict[str, Any] | None = None
    gptq: dict[str, Any] | None = None
    awq: dict[str, Any] | None = None


def load_recipe(path: str | Path) -> Recipe:
    """The modifiers' fields from a recipe file (validated keys, raw values)."""
    from graphcal.limits import read_regular

    path = Path(path)
    raw = read_regular(path, "recipe file", MAX_RECIPE_BYTES, error=UsageError)  # regular files only, 1 MB at most
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"cannot read recipe {path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    return parse_recipe(text, str(path))


MAX_RECIPE_BYTES = 1 << 20
MAX_RECIPE_DEPTH = 32  # a recipe nests about 6 deep
MAX_RECIPE_NODES = 100_000  # after aliases are expanded: a real recipe has a few hundred


def _safe_yaml(text: str, where: str):
    """YAML from a stranger: PyYAML's safe loader, plus a nesting cap (the composer recurses) and a
    cap on the document's size with every alias expanded (a 1 KB "billion laughs" recipe of
    nested aliases is refused before anything walks it)."""
    import yaml

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):
            self.depth += 1
            try:
                if self.depth > MAX_RECIPE_DEPTH:
                    raise UsageError(f"{where}: the YAML nests deeper than {MAX_RECIPE_DEPTH} levels")
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    loader = Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        expanded: dict[int, int] = {}

        def size(n) -> int:  # nodes with every alias expanded, each shared node counted once per use
            if id(n) not in expanded:
                expanded[id(n)] = 0  # a recursive alias counts as empty here; the cap still bounds its uses
                children = n.value if isinstance(n.value, list) else []
                total = 1
                for child in children:
                    for c in child if isinstance(child, tuple) else (child,):
                        total += size(c)
                        if total > MAX_RECIPE_NODES:
                            break
                    if total > MAX_RECIPE_NODES:
                        break
                expanded[id(n)] = total
            return expanded[id(n)]

        if size(node) > MAX_RECIPE_NODES:
            raise UsageError(f"{where}: the YAML expands to more than {MAX_RECIPE_NODES:,} values "
                             "(aliases nested on aliases); a recipe needs a few hundred")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def parse_recipe(text: str, where: str = "recipe") -> Recipe:
    """Find the one QuantizationModifier (and a SmoothQuantModifier before it) in a recipe's text
    and check their keys."""
    import yaml

    if len(text) > MAX_RECIPE_BYTES:
        raise UsageError(f"{where}: {len(text):,} characters; a recipe is read up to {MAX_RECIPE_BYTES:,}")
    try:
        data = _safe_yaml(text, where)
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
    for transform in (SMOOTHQUANT, AWQ):
        if transform in by_name and names.index(transform) > min(names.index(q) for q in quantizers):
            raise UsageError(f"{where}: {by_name[transform][2]} comes after the modifier that quantizes; graphcal "
                             "rescales before it quantizes, as llm-compressor recipes put it")
    gptq = None
    if GPTQ in by_name:  # its own fields here (actorder checked with the others, config.check_gptq)
        args = _mapping(by_name[GPTQ][1], f"{where}: {by_name[GPTQ][2]}")
        gptq = _fields(GPTQFields, {k: v for k, v in args.items() if k not in FIELDS | NO_EFFECT},
                       f"{where}: {by_name[GPTQ][2]}")
    sources = []
    for q in quantizers:
        args = _mapping(by_name[q][1], f"{where}: {by_name[q][2]}")
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
    _typed(fields, f"{where}: {by_name[sources[0][0]][2]}")
    smoothquant = None
    if SMOOTHQUANT in by_name:
        smoothquant = _smoothquant_fields(by_name[SMOOTHQUANT][1], f"{where}: {by_name[SMOOTHQUANT][2]}")
    awq = None
    if AWQ in by_name:
        awq = _awq_fields(by_name[AWQ][1], f"{where}: {by_name[AWQ][2]}")
    return Recipe(fields, smoothquant, gptq, awq)


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


def _mapping(args, where: str) -> dict:
    """A modifier's body: a mapping of its fields (nothing given: none)."""
    if args is None:
        return {}
    if not isinstance(args, dict):
        raise UsageError(f"{where} must be a mapping of its fields")
    return args


def _fields(model, args, where: str, one_shot: str = "") -> dict[str, Any]:
    """A modifier's fields validated by ``model`` (pydantic); with ``one_shot`` (the algorithm's
    name), its ``start``/``end`` must be unset or -1, as llm-compressor's one-shot modifiers require."""
    try:
        fields = model.model_validate(_mapping(args, where)).model_dump()
    except ValidationError as e:
        raise UsageError(f"{where}.{pydantic_message(e)}") from None
    for bound in ("start", "end") if one_shot else ():
        if fields[bound] is not None and fields[bound] != -1:
            raise UsageError(f"{where}: {bound}: {fields[bound]} is not supported ({one_shot} is one-shot only)")
    return fields


def _awq_fields(args, where: str) -> dict[str, Any]:
    """An AWQModifier's fields, checked as llm-compressor checks them."""
    fields = _fields(AWQFields, args, where, one_shot="AWQ")
    for m in fields["mappings"] or ():
        if m["activation_hook_target"] is not None:
            raise UsageError(f"{where}: activation_hook_target is not supported (graphcal reads the balance layers' "
                             "shared input)")
        for p in (m["smooth_layer"], *m["balance_layers"]):
            _check_regex(p, where)
    return {k: fields[k] for k in ("mappings", "duo_scaling", "n_grid")}


def awq_from(fields: dict[str, Any]):
    """graphcal's AWQSettings from an AWQModifier's fields (no mappings: llm-compressor's default
    Llama mappings, matched by module name)."""
    from graphcal.config import LLMCOMPRESSOR_AWQ_MAPPINGS, AWQSettings, check_awq

    mappings = LLMCOMPRESSOR_AWQ_MAPPINGS
    if fields.get("mappings") is not None:
        mappings = tuple((m["smooth_layer"], tuple(m["balance_layers"])) for m in fields["mappings"])
    return check_awq(AWQSettings(mappings=mappings, duo_scaling=fields["duo_scaling"], n_grid=fields["n_grid"]))


def gptq_from(fields: dict[str, Any]):
    """graphcal's GPTQSettings from a GPTQModifier's own fields (llm-compressor's sequential order)."""
    from graphcal.config import GPTQSettings, check_gptq

    return check_gptq(GPTQSettings(block_size=fields["block_size"], dampening_frac=fields["dampening_frac"],
                                   actorder=fields["actorder"]))


def _smoothquant_fields(args, where: str) -> dict[str, Any]:
    """A SmoothQuantModifier's fields, checked as llm-compressor checks them."""
    fields = _fields(SmoothQuantFields, args, where, one_shot="SmoothQuant")
    return {k: fields[k] for k in ("smoothing_strength", "mappings", "ignore", "algorithm")}


def smoothing_from(fields: dict[str, Any], where: str = "recipe: SmoothQuantModifier"):
    """graphcal's Smoothing from a SmoothQuantModifier's fields (mappings flattened as llm-compressor
    reads them: the last leaf is the smooth layer, every other leaf a balance layer)."""
    from graphcal.config import LLMCOMPRESSOR_SMOOTHQUANT_MAPPINGS, Smoothing, check_strength

    mappings = LLMCOMPRESSOR_SMOOTHQUANT_MAPPINGS
    if fields.get("mappings") is not None:
        mappings = []
        for i, entry in enumerate(fields["mappings"]):
            leaves = _leaves(entry)
            if len(leaves) < 2 or not all(isinstance(v, str) for v in leaves):
                raise UsageError(f"{where}: mappings[{i}] must be [[balance layers...], smooth layer] of names")
            mappings.append((tuple(leaves[:-1]), leaves[-1]))
        mappings = tuple(mappings)
    for balance, smooth in mappings:
        for p in (*balance, smooth):
            _check_regex(p, where)
    return Smoothing(strength=check_strength(fields.get("smoothing_strength", 0.5)), mappings=mappings,
                     ignore=tuple(fields.get("ignore") or ()), algorithm=fields.get("algorithm", "smoothquant"))


def _leaves(entry, depth: int = 0) -> list:
    if isinstance(entry, (list, tuple)):
        if depth > 8:
            return []
        return [leaf for item in entry for leaf in _leaves(item, depth + 1)]
    return [entry]


def _check_regex(pattern: str, where: str) -> None:
    import re

    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as e:
            raise UsageError(f"{where}: invalid regex {pattern!r}: {e}") from None


def _typed(fields: dict[str, Any], where: str = "recipe") -> ModifierFields:
    """The fields with their types checked (pydantic); a wrong type is a one-line usage error."""
    try:
        return ModifierFields.model_validate(fields)
    except ValidationError as e:
        raise UsageError(f"{where}.{pydantic_message(e)}") from None


def recipe_config(recipe: Recipe, *, scheme: str | None = None, targets: list[str] | None = None,
                  ignore: list[str] | None = None, observer: str | None = None,
                  kv_cache: str | None = None) -> RunConfig:
    """A RunConfig from a recipe's modifiers; the keyword arguments (CLI flags) override them."""
    fields = recipe.quantization
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import is_preset_scheme, preset_name_to_scheme
    from pydantic import ValidationError

    from graphcal.config import GRAPHCAL_PRESETS, resolve_scheme

    m = _typed(fields)
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
        from graphcal.config import resolve_kv_cache

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
    #                                  in config.resolve, after the flags: the one place that resolves it)
    return RunConfig(groups=groups, ignore=list(m.ignore), scheme_name=name, kv_cache=kv_args, smoothing=smoothing,
                     awq=awq, gptq=gptq)


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
