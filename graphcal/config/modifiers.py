"""llm-compressor's modifiers as graphcal reads them: each modifier's fields with their types
(pydantic; any other key is refused), the :class:`Recipe` record that holds a recipe's
modifiers, and the SmoothQuant, AWQ and GPTQ modifiers turned into graphcal's settings records.

Where a recipe's modifiers are found, and how its quantization fields become schemes, is
:mod:`graphcal.config.recipe`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

from graphcal.config.records import (
    DEFAULT_SMOOTHING_STRENGTH,
    LLMCOMPRESSOR_AWQ_MAPPINGS,
    LLMCOMPRESSOR_SMOOTHQUANT_MAPPINGS,
    ROTATIONS,
    AWQSettings,
    GPTQSettings,
    Smoothing,
    check_awq,
    check_gptq,
    check_strength,
)
from graphcal.config.untrusted import pydantic_message
from graphcal.errors import UsageError
from graphcal.graph.names import check_pattern
from graphcal.types import NamedMapping

MODIFIER = "QuantizationModifier"
SMOOTHQUANT = "SmoothQuantModifier"
GPTQ = "GPTQModifier"
AWQ = "AWQModifier"
SPINQUANT = "SpinQuantModifier"
KNOWN = (MODIFIER, GPTQ, SMOOTHQUANT, AWQ, SPINQUANT)
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


class SpinQuantFields(BaseModel):
    """SpinQuantModifier's fields (llm-compressor's transform modifier); anything else is refused."""

    model_config = ConfigDict(extra="forbid")

    rotations: list[str] = ["R1", "R2"]
    transform_type: Literal["hadamard", "random-hadamard", "random-matrix"] = "hadamard"
    randomize: bool = False
    learnable: bool = False
    precision: Any = None  # graphcal folds in float64, llm-compressor's default
    transform_block_size: int | None = None
    mappings: Any = None
    norm_mappings: Any = None
    transform_config: Any = None
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
    spinquant: dict[str, Any] | None = None


# --- checking a modifier's fields ---------------------------------------------------------------


def mapping(args, where: str) -> dict:
    """A modifier's body: a mapping of its fields (nothing given: none)."""
    if args is None:
        return {}
    if not isinstance(args, dict):
        raise UsageError(f"{where} must be a mapping of its fields")
    return args


def validated(model, args, where: str, one_shot: str = "") -> dict[str, Any]:
    """A modifier's fields validated by ``model`` (pydantic); with ``one_shot`` (the algorithm's
    name), its ``start``/``end`` must be unset or -1, as llm-compressor's one-shot modifiers require."""
    try:
        fields = model.model_validate(mapping(args, where)).model_dump()
    except ValidationError as e:
        raise UsageError(f"{where}.{pydantic_message(e)}") from None
    for bound in ("start", "end") if one_shot else ():
        if fields[bound] is not None and fields[bound] != -1:
            raise UsageError(f"{where}: {bound}: {fields[bound]} is not supported ({one_shot} is one-shot only)")
    return fields


def typed(fields: dict[str, Any], where: str = "recipe") -> ModifierFields:
    """The quantization fields with their types checked (pydantic); a wrong type is a one-line usage error."""
    try:
        return ModifierFields.model_validate(fields)
    except ValidationError as e:
        raise UsageError(f"{where}.{pydantic_message(e)}") from None


def awq_fields(args, where: str) -> dict[str, Any]:
    """An AWQModifier's fields, checked as llm-compressor checks them."""
    fields = validated(AWQFields, args, where, one_shot="AWQ")
    for m in fields["mappings"] or ():
        if m["activation_hook_target"] is not None:
            raise UsageError(f"{where}: activation_hook_target is not supported (graphcal reads the balance layers' "
                             "shared input)")
        for p in (m["smooth_layer"], *m["balance_layers"]):
            check_pattern(p, where)
    return {k: fields[k] for k in ("mappings", "duo_scaling", "n_grid")}


def spinquant_fields(args, where: str) -> dict[str, Any]:
    """A SpinQuantModifier's fields: the rotations graphcal folds into the weights (R1, with R2), by
    the transform type asked; what it cannot do as llm-compressor does is refused in one line."""
    fields = validated(SpinQuantFields, args, where, one_shot="SpinQuant")
    for name in ("randomize", "learnable"):
        if fields[name]:
            raise UsageError(f"{where}: {name}: true is not supported (llm-compressor does not implement it either)")
    for name, why in (("mappings", "graphcal finds the residual stream and the heads by graph structure"),
                      ("norm_mappings", "graphcal folds every norm on the residual stream"),
                      ("transform_config", "graphcal builds R1 and R2 from rotations and transform_type"),
                      ("transform_block_size", "graphcal rotates the whole hidden width and whole heads")):
        if fields[name] is not None:
            raise UsageError(f"{where}: {name} is not supported ({why})")
    rotations = tuple(dict.fromkeys(str(r).upper() for r in fields["rotations"]))
    online = [r for r in rotations if r in ("R3", "R4")]
    if online:
        raise UsageError(f"{where}: rotations {', '.join(online)} are online (a Hadamard computed at inference); "
                         "graphcal folds R1 and R2 into the weights and writes no extra node")
    if [r for r in rotations if r not in ROTATIONS] or "R1" not in rotations:
        raise UsageError(f"{where}: rotations must be [R1] or [R1, R2] (R2 turns the heads inside R1's rotation), "
                         f"got {list(fields['rotations'])!r}")
    return {"rotations": rotations, "transform_type": fields["transform_type"]}


def smoothquant_fields(args, where: str) -> dict[str, Any]:
    """A SmoothQuantModifier's fields, checked as llm-compressor checks them."""
    fields = validated(SmoothQuantFields, args, where, one_shot="SmoothQuant")
    fields["smoothing_strength"] = check_strength(fields["smoothing_strength"], f"{where}: smoothing_strength")
    return {k: fields[k] for k in ("smoothing_strength", "mappings", "ignore", "algorithm")}


# --- modifiers to graphcal's settings -------------------------------------------------------------


def awq_from(fields: dict[str, Any]) -> AWQSettings:
    """graphcal's AWQSettings from an AWQModifier's fields (no mappings: llm-compressor's default
    Llama mappings, matched by module name)."""
    mappings = LLMCOMPRESSOR_AWQ_MAPPINGS
    if fields.get("mappings") is not None:
        mappings = tuple(NamedMapping(m["smooth_layer"], tuple(m["balance_layers"])) for m in fields["mappings"])
    return check_awq(AWQSettings(mappings=mappings, duo_scaling=fields["duo_scaling"], n_grid=fields["n_grid"]))


def gptq_from(fields: dict[str, Any]) -> GPTQSettings:
    """graphcal's GPTQSettings from a GPTQModifier's own fields (llm-compressor's sequential order)."""
    return check_gptq(GPTQSettings(block_size=fields["block_size"], dampening_frac=fields["dampening_frac"],
                                   actorder=fields["actorder"]))


def smoothing_from(fields: dict[str, Any], where: str = "recipe: SmoothQuantModifier") -> Smoothing:
    """graphcal's Smoothing from a SmoothQuantModifier's fields (mappings flattened as llm-compressor
    reads them: the last leaf is the smooth layer, every other leaf a balance layer)."""
    mappings = LLMCOMPRESSOR_SMOOTHQUANT_MAPPINGS
    if fields.get("mappings") is not None:
        mappings = []
        for i, entry in enumerate(fields["mappings"]):
            leaves = _leaves(entry)
            if len(leaves) < 2 or not all(isinstance(v, str) for v in leaves):
                raise UsageError(f"{where}: mappings[{i}] must be [[balance layers...], smooth layer] of names")
            mappings.append(NamedMapping(leaves[-1], tuple(leaves[:-1])))
        mappings = tuple(mappings)
    for m in mappings:
        for p in (*m.balance, m.smooth):
            check_pattern(p, where)
    for p in fields.get("ignore") or ():
        check_pattern(p, where)  # a name that is no string is left to the schema's own check
    # the strength was checked as the recipe was read (smoothquant_fields)
    return Smoothing(strength=fields.get("smoothing_strength", DEFAULT_SMOOTHING_STRENGTH), mappings=mappings,
                     ignore=tuple(fields.get("ignore") or ()),
                     algorithm=fields.get("algorithm", "smoothquant"))


def _leaves(entry, depth: int = 0) -> list:
    if isinstance(entry, (list, tuple)):
        if depth > 8:
            return []
        return [leaf for item in entry for leaf in _leaves(item, depth + 1)]
    return [entry]
