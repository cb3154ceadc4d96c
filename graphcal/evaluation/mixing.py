"""Mixed precision chosen by measurement: which layers of a low-precision model take a higher form.

``graphcal eval FP32 LOW --size-budget MB`` (or ``--target-kl NATS``, ``--target-db DB``), optionally ``--fallback HIGH``:
LOW is the model quantized at the low precision (int4, say), HIGH the same fp32 model quantized
at a higher one (int8; without it, float). The layers LOW quantized are grouped into units: each
kind of layer across the blocks (``mlp.down_proj``), or with ``per_layer`` each layer; a lookup
and the lm_head it is tied to are one unit, since they are stored once.

Measured, not guessed (graph.switch: one session over the fp32 model with each layer behind a
switch per quantized form):

1. every unit in LOW's form: the loss LOW has against fp32. The measure: for a model with a logits
   output (graphcal.evaluation.next_token), the mean next-token KL divergence from fp32's
   distributions, or, where the data holds ``labels`` (under a budget), the token loss's increase
   over fp32's; for any other model (an encoder), and for ``--target-db``, the first output's noise
   power relative to its own (10^(-SQNR/10));
2. for each unit, that model with only this unit in HIGH's form: the loss it removes in place,
   with every other layer still low (so interactions with the rest count);
3. units are taken by loss removed per byte added, the most first (none that removes under
   :data:`MIN_GAIN` of the low model's loss): under a budget, while the written size stays
   within it; for a target, until the predicted KL (or SQNR) reaches it;
4. the chosen mix is run and its KL and output SQNR reported (with a target, more units are added and
   measured again, up to :data:`MAX_TRIES` mixes, while it falls short).

The size of a mix is LOW's size on disk, less the initializers only a promoted unit's layers read
in LOW, plus those its layers read in HIGH (or the fp32 weights, for float) and :data:`LAYER_OVERHEAD` per
layer for the protobuf around them: initializers several units share stay counted, so the written
model is no larger than predicted. The choice is given as
flags for the command that wrote LOW: ``--scheme-for`` for each promoted kind (or ``re:`` alternation
of its layers) with HIGH's scheme, read from the quantization_config.json graphcal writes beside
it, or ``--ignore`` for float.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import onnx

from graphcal.errors import GraphcalError, UsageError
from graphcal.evaluation.agreement import Agreement, finite
from graphcal.evaluation.candidate import written_config
from graphcal.evaluation.kinds import layer_kind
from graphcal.evaluation.mix_flags import layer_patterns, scheme_value
from graphcal.evaluation.models import EvalModels
from graphcal.evaluation.next_token import NextTokenLoss
from graphcal.evaluation.sensitivity import measure_variants, quantized_layers
from graphcal.evaluation.switched import SwitchSession
from graphcal.graph.external import expected_bytes
from graphcal.graph.switch import fp32_computed, layer_reads
from graphcal.graph.targets import find_lookups, find_targets
from graphcal.graph.ties import find_ties
from graphcal.progress import Progress

LAYER_OVERHEAD = 256  # bytes per promoted layer for its changed nodes and initializer headers in the protobuf
MIN_GAIN = 0.005  # a unit removing less than this share of the low model's loss (KL, or noise) is not worth its bytes
MAX_TRIES = 3  # mixes measured for a target: the predicted one, then more units while it falls short
FLOAT = "float"
KL, TOKEN_LOSS, SQNR = "kl", "token loss", "sqnr"  # what a mix ranks units by (Mix.measure)


@dataclass(frozen=True)
class Unit:
    """Layers promoted together: a kind, a layer, or a lookup with its tied lm_head."""

    name: str
    layers: list[str]
    saved: int  # bytes of initializers only these layers read in the low model
    added: int  # bytes their higher form stores

    @property
    def cost(self) -> int:
        return self.added - self.saved

    def value(self, gain: float) -> float:
        """Loss removed per byte added, for the ``gain`` measured (free promotions first)."""
        if self.cost <= 0:
            return math.inf
        return max(gain, 0.0) / self.cost


@dataclass(frozen=True)
class MixPlan:
    """What --size-budget / --target-kl / --target-db will run, known from the models before any pass."""

    units: list[Unit]
    base_bytes: int  # the low model on disk
    budget_bytes: int | None
    target_db: float | None
    high: str  # the fallback model's path, or "float"
    high_schemes: dict[str, str]  # layer -> the --scheme-for value of its higher form (none for float)
    ignored: list[str]  # the low model's ignore list
    fp32_layers: dict[str, str]  # layer -> the fp32 node computing it
    target_kl: float | None = None
    logits: str | None = None  # the logits output the mix is measured by (None: none, ranked by SQNR)

    @property
    def flag(self) -> str:
        """The goal's flag."""
        return ("--size-budget" if self.budget_bytes is not None else
                "--target-kl" if self.target_kl is not None else "--target-db")

    @property
    def by_kl(self) -> bool:
        """Measured by the logits' next-token KL (or token loss), not the first output's SQNR: a model with
        logits, under a budget or a KL target (--target-db keeps SQNR)."""
        return self.logits is not None and self.target_db is None

    @cached_property
    def by_name(self) -> dict[str, Unit]:
        return {u.name: u for u in self.units}

    @property
    def mixes(self) -> int:
        return 1 if self.budget_bytes is not None else MAX_TRIES

    @property
    def runs(self) -> int:
        """Model runs over the data: fp32, the low model and each unit promoted in place, then fp32
        and the mix for each mix measured (one under a budget, up to MAX_TRIES for a target)."""
        return 2 + len(self.units) + 2 * self.mixes

    def describe(self) -> str:
        return (f"{self.runs} runs of the model over the data ({len(self.units)} units promoted one at a time, "
                f"up to {self.mixes} mixes, the low model, and fp32 with each)")


@dataclass(frozen=True)
class Mix:
    """The measured units and the chosen mix."""

    plan: MixPlan
    low: list[Agreement]  # every unit low: the low model's outputs against fp32
    gains: dict[str, float]  # unit -> the measure (KL, token loss or noise) removed by promoting it in place
    chosen: list[str]  # unit names, in the order taken
    outputs: list[Agreement] = field(default_factory=list)  # the chosen mix's outputs against fp32
    reached: bool = True  # the target met (always, under a budget)
    measure: str = SQNR  # what gains are in: KL, TOKEN_LOSS or SQNR (the first output's relative noise power)
    noise_removed: dict[str, float] = field(default_factory=dict)  # unit -> the first output's noise removed
    low_loss: NextTokenLoss | None = None  # the low model's next-token KL (and token loss), with logits
    promoted: dict[str, NextTokenLoss] = field(default_factory=dict)  # unit -> the same with it promoted
    loss: NextTokenLoss | None = None  # the chosen mix's

    def value(self, unit: Unit) -> float:
        """``unit``'s loss removed per byte added, as measured."""
        return unit.value(self.gains[unit.name])

    @property
    def kl(self) -> float | None:
        """The chosen mix's mean next-token KL against fp32 (None without logits)."""
        return (self.loss or self.low_loss).kl if self.low_loss is not None else None

    @property
    def bytes(self) -> int:
        return self.plan.base_bytes + sum(self.plan.by_name[n].cost for n in self.chosen)

    @property
    def sqnr_db(self) -> float:
        return self.outputs[0].sqnr_db if self.outputs else self.low[0].sqnr_db

    def flags(self) -> list[str]:
        """Flags to add to the command that wrote the low model: one --scheme-for per promoted kind
        (or alternation of its layers) and scheme; with float, the --ignore list."""
        layers = [name for n in self.chosen for name in self.plan.by_name[n].layers]
        if self.plan.high == FLOAT:
            flags = []
            for value in [*self.plan.ignored, *layer_patterns(layers, self.plan.fp32_layers)]:
                flags += ["--ignore", value]
            return flags
        by_scheme: dict[str, list[str]] = {}
        for name in layers:
            by_scheme.setdefault(self.plan.high_schemes[name], []).append(name)
        flags = []
        for scheme, names in by_scheme.items():
            for pattern in layer_patterns(names, self.plan.fp32_layers):
                flags += ["--scheme-for", f"{pattern}={scheme}"]
        return flags

    def as_dict(self) -> dict:
        out = {"high": self.plan.high, "budget_bytes": self.plan.budget_bytes, "target_db": self.plan.target_db,
               "target_kl": self.plan.target_kl, "measure": self.measure, "logits": self.plan.logits,
               "low_bytes": self.plan.base_bytes, "low_sqnr_db": finite(self.low[0].sqnr_db),
               "units": [self.unit_dict(u) for u in self.plan.units],
               "chosen": self.chosen, "bytes": self.bytes, "reached": self.reached,
               "sqnr_db": finite(self.sqnr_db), "expected_outputs": [a.as_dict() for a in self.outputs],
               "flags": self.flags()}
        if self.low_loss is not None:
            mixed = self.loss or self.low_loss
            out.update(low_kl=self.low_loss.kl, kl=mixed.kl)
            if self.low_loss.labelled:
                out.update(low_loss=self.low_loss.loss, loss=mixed.loss, reference_loss=self.low_loss.ref_loss)
        return out

    def unit_dict(self, u: Unit) -> dict:
        out = {"name": u.name, "layers": u.layers, "bytes_added": u.cost, "gain": self.gains[u.name],
               "noise_removed": self.noise_removed.get(u.name, self.gains[u.name]), "chosen": u.name in self.chosen}
        if u.name in self.promoted:
            out["kl_removed"] = self.low_loss.kl - self.promoted[u.name].kl
            if self.low_loss.labelled:
                out["loss_removed"] = self.low_loss.loss - self.promoted[u.name].loss
        return out


def plan_mix(models: EvalModels, *, per_layer: bool, budget_bytes: int | None, target_db: float | None,
             ignored: list[str], target_kl: float | None = None, logits: str | None = None) -> MixPlan:
    """Units, their sizes and the fallback's schemes, from the models' structure (weights stay on disk);
    ``logits``: the reference's logits output (graphcal.evaluation.next_token.logits_output), if any."""
    if sum(goal is not None for goal in (budget_bytes, target_db, target_kl)) != 1:
        raise UsageError("give one of --size-budget, --target-db and --target-kl")
    if target_kl is not None and logits is None:
        raise UsageError(f"--target-kl measures the next-token distributions of a logits output, and "
                         f"{models.reference.path} has none (outputs: "
                         f"{', '.join(o.name for o in models.reference.model.graph.output)}); use --target-db")
    if not models.in_onnxruntime:
        raise GraphcalError("--size-budget, --target-db and --target-kl run in onnxruntime; these models need "
                            "onnx.reference")
    reference, low, high = models.reference.path, models.candidate.path, None
    ref, low_model, high_model = models.reference.model, models.candidate.model, None
    if models.fallback is not None:
        high, high_model = models.fallback.path, models.fallback.model
    base_bytes = sum(p.stat().st_size for p in models.candidate.on_disk)
    targets, lookups = find_targets(ref)[0], find_lookups(ref)
    layers = quantized_layers(low_model, ref, [*targets, *lookups])
    if not layers:
        raise UsageError(f"{low} quantizes no layer of {reference}: there is nothing to mix")
    fp32_nodes = {n.name: n for n in ref.graph.node}
    values = fp32_computed(ref)
    ref_inits = {t.name: t for t in ref.graph.initializer}
    high_config = None
    if high is not None:
        high_config = written_config(Path(high))
        if high_config is None:
            raise UsageError(f"--fallback {high} has no quantization_config.json beside it (graphcal writes one): "
                             "its schemes cannot be given to run")
    layer_nodes = [fp32_nodes[t.node] for t in layers]
    low_by_node = layer_reads(low_model, layer_nodes, values)
    low_reads = {t.name: low_by_node[t.node] or [] for t in layers}
    high_by_node = layer_reads(high_model, layer_nodes, values) if high_model is not None else {}
    high_schemes: dict[str, str] = {}
    high_reads: dict[str, list[str]] = {}
    high_inits = {t.name: t for t in high_model.graph.initializer} if high_model is not None else {}
    for t in layers:
        reads = high_by_node.get(t.node)
        if reads is None:  # float in the fallback: its fp32 weight
            if high_model is not None:
                raise UsageError(f"--fallback {high} leaves {t.name} in float, which {low} quantizes; give a "
                                 "fallback that quantizes every layer it does, or none (float)")
            high_reads[t.name] = [t.weight]
        else:
            high_reads[t.name] = reads
            high_schemes[t.name] = scheme_value(high_config, t)
    groups = _units(layers, lookups, targets, ref, Path(reference).parent, per_layer)
    low_inits = {t.name: t for t in low_model.graph.initializer}
    source = high_inits if high_model is not None else ref_inits
    units = []
    for name, members in groups.items():
        inside = set(members)
        elsewhere = {r for t in layers if t.name not in inside for r in low_reads[t.name]}
        saved = sum(expected_bytes(low_inits[r]) for r in {r for m in members for r in low_reads[m]} - elsewhere)
        added = sum(expected_bytes(source[r]) for r in {r for m in members for r in high_reads[m]})
        added += LAYER_OVERHEAD * len(members)
        units.append(Unit(name, members, saved, added))
    if budget_bytes is not None and budget_bytes < base_bytes:
        raise UsageError(f"{low} is already {base_bytes / 1e6:.1f} MB, over the --size-budget of "
                         f"{budget_bytes / 1e6:.1f} MB; quantize it further first")
    return MixPlan(units, base_bytes, budget_bytes, target_db, str(high) if high is not None else FLOAT,
                   high_schemes, ignored, {t.name: t.node for t in layers}, target_kl, logits)


def _units(layers, lookups, targets, ref: onnx.ModelProto, base_dir: Path, per_layer: bool) -> dict[str, list[str]]:
    """Unit name -> its layers: each kind (or layer), a lookup's joined with its tied lm_head's."""
    names = {t.name for t in layers}
    units: dict[str, list[str]] = {}
    for t in layers:
        units.setdefault(t.name if per_layer else layer_kind(t.name), []).append(t.name)
    ties = find_ties(ref, [x for x in lookups if x.name in names], [t for t in targets if t.name in names],
                     str(base_dir))
    for lookup, head in ties.items():
        a = next(u for u, m in units.items() if lookup in m)
        b = next(u for u, m in units.items() if head in m)
        if a != b:
            units[f"{b}+{a}"] = units.pop(b) + units.pop(a)
    return units


def measure_mix(plan: MixPlan, session: SwitchSession, outputs, calib) -> Mix:
    """The low model, each unit promoted in place, then the chosen mix(es), each against fp32, on eval's
    switchable session (each layer's first switch: the low form; its second: the fallback's)."""
    run, switches = session.run, {layer: session.switches[layer] for layer in plan.fp32_layers}
    off = session.off  # every switch of the session, its layers besides the plan's too
    every = list(off)
    units = plan.by_name

    def feeds(promoted: set[str]) -> dict[str, np.ndarray]:
        """Every layer in the low form, the promoted units' layers in the high one (or float)."""
        up = {name for n in promoted for name in units[n].layers}
        on = {}
        for layer, names in switches.items():
            low_switch = names[0]
            high_switch = names[1] if len(names) > 1 else None
            if layer in up:
                if high_switch is not None:
                    on[high_switch] = True
            elif low_switch is not None:
                on[low_switch] = True
        return {s: np.array(on.get(s, False)) for s in every}

    def losses(names) -> dict[str, NextTokenLoss] | None:
        """A next-token accumulator of the logits per variant, where the model has logits."""
        return {n: NextTokenLoss(plan.logits) for n in names} if plan.logits is not None else None

    def mix_of(chosen: list[str]) -> tuple[list[Agreement], NextTokenLoss | None]:
        taken = losses(["mix"])
        mixed = measure_variants(run, off, {"mix": feeds(set(chosen))}, outputs, calib, bar, taken)["mix"]
        return mixed, taken["mix"] if taken is not None else None

    total = plan.runs * calib.num_samples if calib.num_samples else None
    with Progress("mixing", total, "sample") as bar:
        variants = {"": feeds(set()), **{u.name: feeds({u.name}) for u in plan.units}}
        promoted = losses(variants)
        measured = measure_variants(run, off, variants, outputs, calib, bar, promoted)
        low_agree = measured.pop("")
        low_loss = promoted.pop("") if promoted is not None else None
        noise = {u.name: low_agree[0].noise - measured[u.name][0].noise for u in plan.units}
        if plan.by_kl:  # the token loss's increase over fp32 where the data has labels (under a budget), else KL
            measure = TOKEN_LOSS if low_loss.labelled and plan.target_kl is None else KL

            def score(loss: NextTokenLoss) -> float:
                return loss.loss_increase if measure == TOKEN_LOSS else loss.kl

            base = score(low_loss)
            gain = {u.name: base - score(promoted[u.name]) for u in plan.units}
        else:
            measure, base, gain = SQNR, low_agree[0].noise, noise
        known = dict(measure=measure, noise_removed=noise, low_loss=low_loss, promoted=promoted or {})
        order = sorted(plan.units, key=lambda u: (-u.value(gain[u.name]), u.name))
        worth = [u for u in order if gain[u.name] > MIN_GAIN * max(base, 0.0) or u.cost <= 0]
        if plan.budget_bytes is not None:
            chosen, room = [], plan.budget_bytes - plan.base_bytes
            for u in worth:
                if u.cost <= room:
                    chosen.append(u.name)
                    room -= u.cost
            mixed, loss = mix_of(chosen)
            return Mix(plan, low_agree, gain, chosen, mixed, loss=loss, **known)
        if plan.target_kl is not None:
            want = plan.target_kl

            def short(agreements, loss) -> float:
                return loss.kl - want
        else:
            want = 10 ** (-plan.target_db / 10)

            def short(agreements, loss) -> float:
                return agreements[0].noise - want
        gains = [max(gain[u.name], 0.0) for u in worth]
        count = 0 if base <= want else _enough(gains, 0, base - want)
        for _ in range(MAX_TRIES):
            chosen = [u.name for u in worth[:count]]
            mixed, loss = mix_of(chosen)
            reached = (loss.kl <= want if plan.target_kl is not None else mixed[0].sqnr_db >= plan.target_db)
            mix = Mix(plan, low_agree, gain, chosen, mixed, reached=reached, loss=loss, **known)
            if mix.reached or count >= len(worth):
                break
            count += max(_enough(gains, count, short(mixed, loss)), 1)  # the shortfall, at measured rates
        return mix


def _enough(gains: list[float], start: int, needed: float) -> int:
    """How many units from ``start`` remove ``needed`` noise by their measured gains (all that are left, if none do)."""
    total = 0.0
    for i, g in enumerate(gains[start:]):
        total += g
        if total >= needed:
            return i + 1
    return len(gains) - start
