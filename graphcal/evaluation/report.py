"""What eval found: the agreement of every output and layer, and the advice drawn from it (flags, JSON)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from graphcal.config import DEFAULT_IGNORE
from graphcal.evaluation.agreement import Agreement, finite
from graphcal.evaluation.kinds import kind_pattern, layer_kind
from graphcal.evaluation.mixing import Mix
from graphcal.evaluation.next_token import NextTokenLoss
from graphcal.evaluation.sensitivity import Sensitivity
from graphcal.graph.scaling import SCOPES


@dataclass(frozen=True)
class EvalReport:
    outputs: list[Agreement]
    layers: list[Agreement]  # named by torch module, in graph order
    samples: int
    batches: int
    runner: str  # "onnxruntime" or "onnx.reference"
    skipped_layers: list[str] = field(default_factory=list)
    level: str = "basic"  # onnxruntime's optimization level for both models
    ignored: list[str] | None = None  # the quantized model's ignore list (its quantization_config.json), if known
    isolated: list[Agreement] | None = None  # each layer's own error, on the reference's inputs (eval --isolated)
    smoothable: dict[str, str] = field(default_factory=dict)  # layer -> SmoothQuant scope that reaches its input, if unsmoothed
    sensitivity: Sensitivity | None = None  # eval --sensitivity
    mix: Mix | None = None  # eval --size-budget / --target-db
    warnings: list[str] = field(default_factory=list)  # what the CLI shows on stderr (inputs filled for the data)
    provider: str | None = None  # the onnxruntime provider every session ran on (None: onnx.reference)
    next_token: NextTokenLoss | None = None  # the logits output's next-token KL (and token loss), where there is one

    @property
    def ranked(self) -> list[Agreement]:
        """The per-layer agreements advice follows: each layer's own error when measured, else the cumulative one."""
        return self.isolated if self.isolated is not None else self.layers

    def worst(self, count: int = 3) -> list[Agreement]:
        return sorted(self.ranked, key=lambda a: a.sqnr_db)[:count]

    def suggested_ignore(self, margin_db: float = 6.0) -> list[str]:
        """Layers more than ``margin_db`` under the median layer SQNR (else none)."""
        quantized = [a for a in self.ranked if math.isfinite(a.sqnr_db)]  # "exact": a layer left in float
        if len(quantized) < 2:
            return []
        median = float(np.median([a.sqnr_db for a in quantized]))
        return [a.name for a in sorted(quantized, key=lambda a: a.sqnr_db) if a.sqnr_db < median - margin_db]

    def suggested_flags(self) -> list[str]:
        """The --ignore flags that keep the suggested layers in float, pasteable into `graphcal run`:
        the ignores the quantized model was written with first (--ignore replaces the default), then
        a ``re:`` pattern for each kind of layer flagged in every block, then single names."""
        flagged = self.suggested_ignore()
        if not flagged:
            return []
        kinds: dict[str, list[str]] = {}
        for a in self.layers:
            kinds.setdefault(layer_kind(a.name), []).append(a.name)
        patterns, covered = [], set()
        for kind, members in kinds.items():
            if len(members) > 1 and all(m in flagged for m in members):
                patterns.append(kind_pattern(kind))
                covered.update(members)
        names = [n for n in flagged if n not in covered]
        keep = self.ignored if self.ignored is not None else list(DEFAULT_IGNORE)
        flags = []
        for value in [*keep, *patterns, *names]:
            flags += ["--ignore", value]
        return flags

    def suggested_smoothquant(self) -> list[str]:
        """``--smoothquant [SCOPE]`` when SmoothQuant (not used for these layers) can smooth the input of
        a flagged layer exactly: the scope that reaches all of them (norms < all < mul), else []."""
        scopes = [self.smoothable[n] for n in self.suggested_ignore() if n in self.smoothable]
        if not scopes:
            return []
        scope = max(scopes, key=SCOPES.index)  # norms < all < mul
        return ["--smoothquant"] + ([scope] if scope != "norms" else [])

    def as_dict(self) -> dict:
        return {"samples": self.samples, "batches": self.batches, "runner": self.runner, "provider": self.provider,
                "level": self.level,
                "outputs": [a.as_dict() for a in self.outputs],
                "layers": [{**a.as_dict(), **({"isolated_sqnr_db": finite(b.sqnr_db)} if b is not None else {})}
                           for a, b in zip(self.layers, self.isolated or [None] * len(self.layers))],
                "ranked_by": "isolated" if self.isolated is not None else "cumulative",
                # the advice once, as flags to paste (the model's own ignores kept): the layer names alone,
                # pasted as --ignore values, would drop the default lm_head ignore
                "worst_layers": [a.name for a in self.worst()], "suggested_flags": self.suggested_flags(), "suggested_smoothquant": self.suggested_smoothquant(),
                "skipped_layers": self.skipped_layers, "warnings": self.warnings,
                **({"next_token": self.next_token.as_dict()} if self.next_token is not None else {}),
                **({"sensitivity": self._sensitivity_dict()} if self.sensitivity is not None else {}),
                **({"mix": self.mix.as_dict()} if self.mix is not None else {})}

    def _sensitivity_dict(self) -> dict:
        sens = self.sensitivity
        advice = sens.advice(self.outputs[0].sqnr_db)

        def option(o):
            return {"kinds": o.kinds, "layers": o.layers, "expected_outputs": [a.as_dict() for a in o.outputs],
                    "flags": sens.flags(o)}

        return {"alone": [{"name": k, "layers": sens.kinds.get(k, [k]), "outputs": [a.as_dict() for a in sens.alone[k]]}
                          for k in sens.ranked()],
                "options": [option(o) for o in sens.options],
                "advice": option(advice) if advice is not None else None}
