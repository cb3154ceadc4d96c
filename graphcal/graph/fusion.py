"""Fused groups, graph side: which modules share one global scale, found by name, checked by structure.

vLLM and TensorRT run q/k/v (and gate/up, ...) as one fused matrix, so their tensor_group
global scales must be one. Groups are found by module name as llm-compressor does (plus
BERT's query/key/value) and returned as :class:`graphcal.types.FusedGroup`, the only group
type the rest of graphcal handles; members should also read the same activation, and a
warning says where name and structure disagree.

The observer side is :func:`graphcal.observers.share_global_scale`, which the pipeline calls
with the weight observers of each group's members. This module knows nothing of observers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from graphcal.types import FusedGroup, Target

FUSED_LAYER_NAMES: tuple[tuple[str, ...], ...] = (
    ("gate_proj", "up_proj"),
    ("q_proj", "k_proj", "v_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
    ("w1", "w3"),
    ("query", "key", "value"),
)


def find_fused_groups(targets: list[Target]) -> tuple[list[FusedGroup], list[str]]:
    """Groups among ``targets`` (by parent module and leaf names) and warnings where structure disagrees.

    A group is formed when one parent module holds every name of an entry of
    ``FUSED_LAYER_NAMES``; its members are listed in that entry's order.
    """
    by_parent: dict[str, dict[str, Target]] = defaultdict(dict)
    for t in targets:
        parent, _, leaf = t.name.rpartition(".")
        by_parent[parent][leaf] = t
    groups: list[FusedGroup] = []
    warnings: list[str] = []
    grouped: set[str] = set()
    for parent, children in by_parent.items():
        for names in FUSED_LAYER_NAMES:
            if all(n in children for n in names):
                members = tuple(children[n] for n in names)
                groups.append(FusedGroup(parent, tuple(m.name for m in members)))
                grouped.update(m.name for m in members)
                if len({m.activation for m in members}) > 1:
                    warnings.append(
                        f"fused group {', '.join(m.name for m in members)}: named as one group but its members "
                        "read different activations"
                    )
    by_activation: dict[str, list[str]] = defaultdict(list)
    for t in targets:
        by_activation[t.activation].append(t.name)
    for names in by_activation.values():
        loose = [n for n in names if n not in grouped]
        if len(names) > 1 and loose:
            warnings.append(
                f"{', '.join(names)} read the same activation, but {', '.join(loose)} "
                "is in no named fused group; their global scales stay separate"
            )
    return groups, warnings


def fused_units(targets: Sequence[Target], groups: Sequence[FusedGroup]) -> list[list[Target]]:
    """``targets`` in order as units: a fused group all of whose members are among them is one
    unit (in the group's order, at its first member's place), every other target a unit of its own.
    The weight pass reads a unit together, and sequential GPTQ's blocks never split one
    (graph.blocks)."""
    index = {t.name: t for t in targets}
    unit_of: dict[str, list[Target]] = {}
    for g in groups:
        if all(m in index for m in g.members):
            unit = [index[m] for m in g.members]
            for m in g.members:
                unit_of[m] = unit
    units, seen = [], set()
    for t in targets:
        unit = unit_of.get(t.name, [t])
        if id(unit) not in seen:
            seen.add(id(unit))
            units.append(unit)
    return units
