"""The flags that write a mix: the target patterns naming a set of layers, and the --scheme-for value of a
layer's higher form (evaluation.mixing gives its choice as flags for the command that wrote the low model)."""

from __future__ import annotations

import json
import re

from graphcal.config.records import RunConfig
from graphcal.errors import UsageError
from graphcal.evaluation.kinds import layer_kind
from graphcal.graph.targets import matches
from graphcal.types import enum_value


def layer_patterns(layers: list[str], every: dict[str, str]) -> list[str]:
    """Target patterns naming exactly ``layers``: one ``re:`` alternation for the layers in blocks (a
    kind whole, or the block indices of some of its layers) and the names of the others (lm_head)."""
    kinds: dict[str, list[str]] = {}
    for name in every:
        kinds.setdefault(layer_kind(name), []).append(name)
    alternatives, names = [], []
    chosen = set(layers)
    for kind, members in kinds.items():
        picked = [m for m in members if m in chosen]
        if not picked:
            continue
        if len(members) == 1 and members[0] == kind:
            names.append(kind)
        elif len(picked) == len(members):
            alternatives.append(re.escape(kind))
        else:
            indices = [re.search(r"\.(\d+)\." + re.escape(kind) + "$", m).group(1) for m in picked]
            alternatives.append("(" + "|".join(indices) + ")" + re.escape("." + kind))
    regex = ["re:.*\\.(" + "|".join(alternatives) + ")$"] if alternatives else []
    return regex + names


def scheme_value(config: RunConfig, target) -> str:
    """The --scheme-for value giving ``target`` the fallback's scheme: a preset name where one equals
    it and takes no group size (a grouped preset would take the run's --group-size), else its JSON."""
    from graphcal.config.schemes import resolve_scheme, scheme_names  # lazy: loads compressed-tensors

    scheme = config.scheme_for(target) if not any(matches(target, p) for p in config.ignore) else None
    if scheme is None:
        raise UsageError(f"the fallback leaves {target.name} in float, though it quantizes the layer")
    fields = scheme_fields(scheme)
    grouped = scheme.weights is not None and enum_value(scheme.weights.strategy) in ("group", "tensor_group")
    if not grouped:
        for name in scheme_names():
            try:
                preset = resolve_scheme(name, ["Linear"])
            except UsageError:
                continue
            if scheme_fields(preset) == fields:
                return name
    return json.dumps(fields, separators=(",", ":"), sort_keys=True)


def scheme_fields(scheme) -> dict:
    """A scheme's quantization fields: no targets, format, nulls, or GPTQ's activation order (the run's
    --algorithm sets that)."""
    out = {}
    for key in ("weights", "input_activations", "output_activations"):
        args = getattr(scheme, key)
        if args is None:
            continue
        dumped = json.loads(args.model_dump_json(exclude_none=True))
        dumped.pop("actorder", None)
        out[key] = dumped
    return out
