"""Channel scaling's records: what a fold divides, a candidate activation, a mapping, a resolution."""

from __future__ import annotations

from dataclasses import dataclass, field

SCOPES = ("norms", "all", "mul")  # what --smoothquant smooths (cumulative; see Candidate.kind)
SCOPE_OF_KIND = {"norm": "norms", "linear": "all", "mul": "mul"}  # the least scope that smooths a kind
TAP_PREFIX = "graphcal_smooth/"




@dataclass(frozen=True)
class Param:
    """A constant input of a node that a fold divides by s: ``node`` is named by its first output."""

    node: str
    index: int
    value: str  # the constant's name as the node reads it now


@dataclass(frozen=True)
class Candidate:
    """One activation read by weight MatMuls, and how it can be smoothed.

    ``kind``: "norm" (a norm or a per-channel constant scale produces it), "linear" (a linear
    layer produces it, directly or through a gated MLP's Mul), "mul" (no fold: only an explicit
    Mul is exact) and, with ``reason``, why not even that ("" when it can be smoothed).
    """

    activation: str  # what the balance targets read
    balance: tuple[str, ...]  # every weight MatMul/Gemm reading it (target names, graph order)
    kind: str
    smooth: str  # the smooth layer's module name (the activation for "mul")
    tensor: str  # the smooth layer's output: where llm-compressor's statistics are taken
    channels: int
    params: tuple[Param, ...] = ()  # constants divided by s (norm scale/bias, linear bias, a Mul's constant)
    linear: str | None = None  # "linear": the target whose output rows are divided by s
    reason: str = ""  # why it cannot be smoothed exactly ("" when it can)
    blocked: str = ""  # "mul": why no fold is exact (what else reads the activation)


@dataclass(frozen=True)
class Mapping:
    """One smoothing to do: a candidate, and whether it is folded or needs an explicit Mul."""

    candidate: Candidate
    explicit: bool = False  # True: Mul(x, 1/s) in front of the balance targets (post-LN encoders)

    @property
    def smooth(self) -> str:
        return self.candidate.smooth

    @property
    def balance(self) -> tuple[str, ...]:
        return self.candidate.balance

    @property
    def tapped(self) -> str:
        """The name of the smoothed activation ``x / s`` (a tap, or the explicit Mul's output)."""
        return TAP_PREFIX + self.candidate.activation

    def describe(self) -> str:
        kind = self.candidate.kind
        how = ("explicit Mul (one elementwise Mul at inference)" if self.explicit else
               f"folded into {'the scale of ' if kind == 'norm' else 'linear '}{self.smooth}")
        return f"{', '.join(self.balance)} <- {how}"


@dataclass
class Resolution:
    """The mappings a run applies, and notes on what was left unsmoothed and why."""

    mappings: list[Mapping] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


