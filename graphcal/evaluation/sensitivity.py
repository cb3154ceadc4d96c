"""Layer sensitivity by brute force: the fp32 model with some of its layers quantized.

``graphcal eval --sensitivity`` answers "which layers should stay in float" by measuring it. For
each kind of layer (``mlp.down_proj`` across all blocks, ...), and with ``per_layer`` for each
layer, it runs the model with only those layers quantized and every other layer in float, and
compares the model's outputs with fp32: the end-to-end loss that kind causes on its own. Kinds are
ranked by it, and the advice is then measured as well. Taking the worst kind, then the worst two,
... back to float, each option is run, so the "expected result" printed with the flags is what
those flags give. The quantized layers keep their own qparams, which do not depend on the other
layers: observers see the fp32 model.

Every run is one session over one model, built once and shared with the mix (graphcal.evaluation.switched
over graph.switch): the fp32 model with each quantized layer behind a switch, fed per run. The fp32 outputs are that model with every switch
off, so each batch runs once in fp32 and once per variant: :class:`SensitivityPlan` counts those
runs before any pass (eval announces them, estimates their time from its own pass, and refuses a
run past its time limit), and :func:`measure_sensitivity` makes them, the batches outermost so
one batch's fp32 outputs serve every variant. Memory is the fp32 model's plus the quantized
layers' weights.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import onnx

from graphcal.algorithms.rotation.fold import rotation_record
from graphcal.data import batch_samples
from graphcal.errors import UsageError
from graphcal.evaluation.agreement import Agreement
from graphcal.evaluation.kinds import kind_pattern, layer_kind
from graphcal.evaluation.next_token import MASK, NextTokenLoss, split_labels
from graphcal.evaluation.rotated import rotation_key
from graphcal.evaluation.switched import SwitchSession
from graphcal.progress import Progress

log = logging.getLogger("graphcal")

MAX_OPTIONS = 3  # advice: the worst kind, the worst two, the worst three


def quantized_layers(candidate: onnx.ModelProto, reference: onnx.ModelProto, targets) -> list:
    """The targets the candidate quantized: those whose output it computes otherwise than fp32 does.
    Refused in one line where the two models' residual streams were rotated differently (--rotate):
    a layer swapped in from the other model would then read and write another basis."""
    records = [rotation_record(m) for m in (candidate, reference)]
    if rotation_key(records[0]) != rotation_key(records[1]):
        said = [f"rotated ({_rotation(r)})" if r else "not rotated" for r in records]
        raise UsageError(f"the quantized model was {said[0]} and the reference {said[1]}: layer-by-layer measures "
                         "(--sensitivity, --fallback) swap layers between them, which needs one rotation; plain eval "
                         "(outputs against fp32) measures a rotated model")
    ref_nodes = {n.name: n for n in reference.graph.node}
    producer = {o: n for n in candidate.graph.node for o in n.output}
    out = []
    for t in targets:
        ref = ref_nodes[t.node]
        node = producer.get(ref.output[0])
        if node is None:
            continue  # not in the candidate: eval lists it as not compared
        if node.op_type == ref.op_type and list(node.input) == list(ref.input) and node.name == ref.name:
            continue  # the fp32 node itself: left in float
        out.append(t)
    return out


def _rotation(record: dict) -> str:
    """A rotation record in words: its matrix, and R2."""
    return f"{record.get('matrix', 'unknown matrix')}{', R2' if record.get('heads') else ''}"


@dataclass(frozen=True)
class SensitivityPlan:
    """What --sensitivity will run, known from the models' structure before any pass."""

    layers: list  # the quantized targets
    per_layer: bool

    @cached_property
    def kinds(self) -> dict[str, list[str]]:
        """Kind -> its quantized layers, in graph order."""
        kinds: dict[str, list[str]] = {}
        for t in self.layers:
            kinds.setdefault(layer_kind(t.name), []).append(t.name)
        return kinds

    @property
    def fp32_layers(self) -> dict[str, str]:
        """Layer -> the fp32 node computing it: what the switchable session swaps."""
        return {t.name: t.node for t in self.layers}

    @property
    def alone(self) -> dict[str, list[str]]:
        """Each variant measured alone: every kind, and with ``per_layer`` each layer of a kind of several."""
        variants = dict(self.kinds)
        if self.per_layer:
            variants.update({t.name: [t.name] for t in self.layers if len(self.kinds[layer_kind(t.name)]) > 1})
        return variants

    @property
    def options(self) -> int:
        return max(min(MAX_OPTIONS, len(self.kinds) - 1), 0)  # never every kind: that is the fp32 model

    @property
    def runs(self) -> int:
        """Model runs over the data: fp32 and each variant alone, then fp32 and each option."""
        return (1 + len(self.alone) if self.alone else 0) + (1 + self.options if self.options else 0)

    def describe(self) -> str:
        per = f", {len(self.alone) - len(self.kinds)} single layers" if self.per_layer else ""
        return (f"{self.runs} runs of the model over the data ({len(self.kinds)} kinds{per}, up to "
                f"{self.options} options, and fp32 twice)")


@dataclass(frozen=True)
class Option:
    """Advice: these kinds (and their layers) back in float, and the output agreement that gives."""

    kinds: list[str]
    layers: list[str]
    outputs: list[Agreement]  # one per model output

    @property
    def sqnr_db(self) -> float:
        return self.outputs[0].sqnr_db if self.outputs else math.nan


@dataclass(frozen=True)
class Sensitivity:
    """End-to-end loss of each kind (and layer) quantized alone, and the measured advice."""

    kinds: dict[str, list[str]]  # kind -> its quantized layers
    alone: dict[str, list[Agreement]]  # kind (or layer) -> output agreements with only it quantized
    options: list[Option]
    ignored: list[str]  # the ignore list the quantized model was written with

    def ranked(self) -> list[str]:
        """Kinds (and layers), the most harmful alone first."""
        return sorted(self.alone, key=lambda k: self.alone[k][0].sqnr_db)

    def advice(self, now_db: float) -> Option | None:
        """The option that recovers at least half of what the largest one does, with the fewest layers."""
        measured = [o for o in self.options if math.isfinite(o.sqnr_db) or o.sqnr_db == math.inf]
        if not measured:
            return None
        gain = max(o.sqnr_db for o in measured) - now_db
        if gain <= 0.5:  # nothing worth a layer in float
            return None
        return next(o for o in measured if o.sqnr_db - now_db >= gain / 2)

    def flags(self, option: Option) -> list[str]:
        """--ignore flags for ``option``: the model's own ignores first, then one pattern per kind."""
        flags = []
        for value in [*self.ignored, *(_pattern(k, self.kinds[k]) for k in option.kinds)]:
            flags += ["--ignore", value]
        return flags


def _pattern(kind: str, layers: list[str]) -> str:
    """A kind as an --ignore value: ``re:.*\\.mlp\\.down_proj$`` for a kind found in blocks, else the name."""
    if len(layers) == 1 and layers[0] == kind:
        return kind
    return kind_pattern(kind)


def measure_sensitivity(plan: SensitivityPlan, session: SwitchSession, outputs, calib, ignored) -> Sensitivity:
    """Each variant of ``plan`` alone, then the advice options, each compared with fp32 over the data,
    on eval's switchable session (its quantized form: each layer's first switch)."""
    switches = {layer: session.switches[layer][0] for layer in plan.fp32_layers}
    total = plan.runs * calib.num_samples if calib.num_samples else None
    with Progress("sensitivity", total, "sample") as bar:
        alone = _measure(session, switches, plan.alone, outputs, calib, bar)
        ranked = sorted(plan.kinds, key=lambda k: alone[k][0].sqnr_db)
        every = {t.name for t in plan.layers}
        chosen = [(ranked[:n], [name for k in ranked[:n] for name in plan.kinds[k]]) for n in range(1, plan.options + 1)]
        measured = _measure(session, switches, {str(i): sorted(every - set(layers)) for i, (_, layers) in enumerate(chosen)},
                            outputs, calib, bar)
    options = [Option(kinds, layers, measured[str(i)]) for i, (kinds, layers) in enumerate(chosen)]
    return Sensitivity(plan.kinds, alone, options, list(ignored))


def _measure(session: SwitchSession, switches: dict[str, str], variants: dict[str, list[str]], outputs, calib,
             bar) -> dict[str, list[Agreement]]:
    """Each variant (its layers quantized, the rest in float) against fp32."""
    off = session.off
    return measure_variants(session.run, off, {v: {**off, **{switches[name]: np.array(True) for name in layers}}
                                               for v, layers in variants.items()}, outputs, calib, bar)


def measure_variants(run, off: dict[str, np.ndarray], variants: dict[str, dict[str, np.ndarray]], outputs, calib,
                     bar, losses: dict[str, NextTokenLoss] | None = None) -> dict[str, list[Agreement]]:
    """Each variant (the switch inputs it feeds) against fp32 (``off``: every switch off), batch by
    batch: one fp32 run per batch serves every variant. ``losses`` (variant -> accumulator, where the
    model has logits) take each variant's next-token KL (and token loss) of their output too."""
    agree = {v: [Agreement(o) for o in outputs] for v in variants}
    if not variants:
        return agree
    losses = losses or {}
    for batch in calib.batches():
        batch, labels = split_labels(batch)
        n = batch_samples(batch)
        ref = run({**batch, **off})
        bar.update(n)
        for v, feeds in variants.items():
            values = run({**batch, **feeds})
            for a, name in zip(agree[v], outputs):
                a.add(ref[name], values[name])
            if v in losses:
                loss = losses[v]
                loss.add(ref[loss.name], values[loss.name], batch.get(MASK), labels)
            bar.update(n)
    return agree
