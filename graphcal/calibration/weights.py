"""The weight pass: each weight is read once, observed, quantized into the output and let go.

Fused groups (q/k/v, gate/up, ...) are read together so their tensor_group observers share one
global scale. Weights are observed where the activations were (the GPU under CUDA) and
quantized on the host by the Q/DQ writer. A weight holding NaN or Inf is an error naming it,
or, when the caller allows it, its layer is left in float with a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from graphcal.calibration.decisions import RunPlan
from graphcal.calibration.observe import ObserverSet
from graphcal.calibration.seams import Member, Rounding
from graphcal.calibration.transforms.channel_scales import ChannelScales
from graphcal.errors import GraphcalError
from graphcal.graph.fusion import fused_units
from graphcal.graph.targets import weight_tensor
from graphcal.observers.helpers import all_finite
from graphcal.progress import Progress
from graphcal.types import QuantizedTarget, Target

log = logging.getLogger("graphcal")


@dataclass
class WeightResult:
    """The quantized targets in plan order, and the ones left in float for non-finite weights."""

    items: list[QuantizedTarget]
    left_in_float: list[str] = field(default_factory=list)
    lookups: list[QuantizedTarget] = field(default_factory=list)  # the embedding lookups quantized
    warnings: list[str] = field(default_factory=list)


def quantize_weights(plan: RunPlan, observers: ObserverSet, writer, device: torch.device, *,
                     skip_nonfinite: bool = False, progress: bool = False, smoothed: ChannelScales | None = None,
                     rounding: Rounding | None = None) -> WeightResult:
    """Observe and quantize every chosen target's weight into ``writer`` (a QDQWriter); with
    ``smoothed`` (graphcal.calibration.transforms.channel_scales.ChannelScales) each weight is smoothed before it
    is observed. ``rounding`` (GPTQ, graphcal.calibration.transforms.gptq) orders the units
    (``rounding.units``: sequential GPTQ takes them block by block) and gives each weight of a unit
    on the grid the observer took from it (``rounding(members)``; None: round to nearest)."""
    log.info("observing and quantizing %d weights", len(plan.chosen))
    by_name: dict[str, QuantizedTarget] = {}
    result = WeightResult([])
    bar = Progress("weights", len(plan.chosen), "weight", bar=progress)
    with bar:
        for unit in (rounding.units(units(plan)) if rounding is not None else units(plan)):
            weights = {}
            for t in unit:
                w = weight_tensor(writer.model, t, plan.base_dir)  # [out, in], a view of [in, out] for MatMul
                if left_in_float(t, w, "weight", skip_nonfinite, result):
                    if smoothed is not None:
                        smoothed.write_float(writer.model, t, plan.base_dir)
                    bar.update(1)
                    continue
                weights[t.name] = smoothed.weight(t, w) if smoothed is not None else w
            members = observe_unit(plan, observers, unit, weights, device, smoothed)
            rounded = rounding([Member(m.target, m.weight.to(device), m.item) for m in members]) \
                if rounding is not None else {}
            for m in members:
                name = m.target.name
                writer.quantize_weight(m.item, rounded.pop(name).cpu() if name in rounded else m.weight)
                by_name[name] = m.item
                bar.update(1)
    result.items = [by_name[t.name] for t in plan.chosen if t.name in by_name]
    result.lookups = quantize_lookups(plan, observers, writer, by_name, device, result, skip_nonfinite)
    return result


def quantize_lookups(plan: RunPlan, observers: ObserverSet, writer, written: dict[str, QuantizedTarget],
                     device: torch.device, result: WeightResult, skip_nonfinite: bool) -> list[QuantizedTarget]:
    """Quantize the chosen embedding lookups into ``writer``, after the targets (``written``): a
    lookup tied to a written lm_head (plan.ties) reads lm_head's stored weight and takes its
    qparams; any other has its table read once, observed and stored."""
    done = []
    for t in plan.lookups:
        scheme, head = plan.schemes[t.name], plan.ties.get(t.name)
        if head in written:
            item = QuantizedTarget(t, scheme, written[head].qparams)
            writer.share_lookup(item, written[head])
            done.append(item)
            continue
        w = weight_tensor(writer.model, t, plan.base_dir)  # [vocab, hidden] as the Gather reads it
        if left_in_float(t, w, "embedding table", skip_nonfinite, result):
            continue
        observers.weight_observers[t.name](w.to(device))
        item = observers.qparams(t, scheme)
        writer.quantize_lookup(item, w)
        done.append(item)
    return done


def left_in_float(t: Target, w: torch.Tensor, what: str, skip_nonfinite: bool, result: WeightResult) -> bool:
    """Whether ``t``'s weight ``w`` holds NaN or Inf: an error naming it, or with ``skip_nonfinite``
    a warning in ``result`` and the layer among those left in float (then True)."""
    bad = nonfinite_count(w)
    if not bad:
        return False
    if not skip_nonfinite:
        raise GraphcalError(f"{t.name}: {what} {t.weight!r} holds {bad} NaN or Inf value(s); fix the model, or pass "
                            "--skip-nonfinite-weights to leave such layers in float")
    result.warnings.append(f"{t.name}: {what} {t.weight!r} holds {bad} NaN or Inf value(s); left in float")
    result.left_in_float.append(t.name)
    return True


def observe_unit(plan: RunPlan, observers: ObserverSet, unit: list[Target], weights: dict[str, torch.Tensor],
                 device: torch.device, smoothed: ChannelScales | None = None) -> list[Member]:
    """Observe the weights of ``unit`` found in ``weights`` (torch [out, in], smoothed already; a
    member left in float is absent), let a fused group share its global scale when all of it is
    there, and give each member with its QuantizedTarget (the grid), in unit order: the run's one
    grid, whatever rounding follows (GPTQ's orders included)."""
    for t in unit:
        if t.name in weights:
            try:
                seen = smoothed.observed(t, weights[t.name]) if smoothed is not None else weights[t.name]
                observers.weight_observers[t.name](seen.to(device))
            except ValueError as e:  # e.g. a group size that does not divide in_features
                raise GraphcalError(f"{t.name} weight [{t.out_features}, {t.in_features}]: {e}") from e
    group = [g for g in plan.groups if set(g.members) == set(weights)]
    if group and len(unit) == len(weights):  # a member left in float: the others share no global scale
        observers.share_global_scales(list(group[0].members))
    return [Member(t, weights[t.name], observers.qparams(smoothed.target(t) if smoothed is not None else t,
                                                         plan.schemes[t.name])) for t in unit if t.name in weights]


def units(plan: RunPlan) -> list[list[Target]]:
    """Targets in order, fused groups (all members chosen) kept together so they share a global scale
    (graph.fusion.fused_units: the units sequential GPTQ's blocks keep whole)."""
    return fused_units(plan.chosen, plan.groups)


def nonfinite_count(w: torch.Tensor) -> int:
    """How many NaN/Inf values ``w`` holds (0 for integer weights); one cheap check first."""
    if not w.is_floating_point() or w.numel() == 0 or all_finite(w):
        return 0
    return int((~torch.isfinite(w)).sum())
