"""The run's settings as records: :class:`RunConfig` and its SmoothQuant, AWQ and GPTQ parts, with
graphcal's and llm-compressor's defaults, and the checks each part's values must pass.

Flags (:mod:`graphcal.config.options`) and recipes (:mod:`graphcal.config.recipe`) both end
here; the stages read these records and nothing else of the user's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from graphcal.errors import UsageError, shown
from graphcal.graph.names import check_pattern
from graphcal.graph.scaling import SCOPES
from graphcal.graph.targets import EMBEDDING, matches
from graphcal.types import NamedMapping, Target

DEFAULT_SCHEME = "W8A8"
DEFAULT_TARGETS = ("Linear",)
DEFAULT_IGNORE = ("lm_head",)

# llm-compressor's SmoothQuant defaults (SmoothQuantModifier; its DEFAULT_SMOOTHQUANT_MAPPINGS, the Llama entry)
DEFAULT_SMOOTHING_STRENGTH = 0.5
LLMCOMPRESSOR_SMOOTHQUANT_MAPPINGS = (
    NamedMapping("re:.*input_layernorm", ("re:.*q_proj", "re:.*k_proj", "re:.*v_proj")),
    NamedMapping("re:.*post_attention_layernorm", ("re:.*gate_proj", "re:.*up_proj")),
)


@dataclass(frozen=True)
class Smoothing:
    """SmoothQuant settings (llm-compressor's SmoothQuantModifier fields, plus where graphcal may smooth).

    ``mappings`` None: every activation of the quantized layers whose producer allows an exact
    fold, found by graph structure; otherwise llm-compressor's mappings (smooth and balance names or
    regexes) matched by module name. ``scope`` (graphcal's): "norms" folds into norms and constant
    scales, "all" also into linear layers (up_proj -> down_proj), "mul" also smooths what has no
    fold through an explicit Mul.
    """

    strength: float = DEFAULT_SMOOTHING_STRENGTH
    mappings: tuple[NamedMapping, ...] | None = None
    ignore: tuple[str, ...] = ()
    algorithm: str = "smoothquant"  # or "log_equalization"
    scope: str = "norms"
    search: bool = False  # --smoothing-strength auto: each mapping's strength searched (graphcal's extension)


# llm-compressor's AWQ default mappings (its LlamaForCausalLM entry): (smooth layer, balance layers)
LLMCOMPRESSOR_AWQ_MAPPINGS = (
    NamedMapping("re:.*input_layernorm$", ("re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$")),
    NamedMapping("re:.*v_proj$", ("re:.*o_proj$",)),
    NamedMapping("re:.*post_attention_layernorm$", ("re:.*gate_proj$", "re:.*up_proj$")),
    NamedMapping("re:.*up_proj$", ("re:.*down_proj$",)),
)

# llm-compressor's GPTQModifier and AWQModifier defaults (0.14)
ALGORITHMS = ("gptq", "awq", "awq+gptq")
GPTQ_ORDERS = ("sequential", "one-pass")
MAX_N_GRID = 1000  # AWQ runs each parent once per grid point: a stranger's recipe cannot ask for a million
ACTORDER_DEFAULT = "default"  # GPTQModifier's sentinel: static unless the scheme says otherwise


@dataclass(frozen=True)
class GPTQSettings:
    """GPTQModifier's fields, plus the order graphcal takes the layers in.

    ``order`` "sequential" (llm-compressor's default pipeline): layer block by layer block, each
    block's Hessians from the outputs of the blocks before it with their weights already quantized;
    "one-pass" (graphcal's, like llm-compressor's ``pipeline="basic"``): every Hessian from the one
    calibration pass over the float model.
    """

    block_size: int = 128
    dampening_frac: float = 0.01
    actorder: str | None = ACTORDER_DEFAULT  # "static" | "weight" | None (explicit) | the sentinel
    order: str = "sequential"


@dataclass(frozen=True)
class AWQSettings:
    """AWQModifier's fields: ``mappings`` as (smooth layer, balance layers) names or regexes (None: the
    activations of the quantized layers whose producer allows an exact fold, found by graph structure)."""

    mappings: tuple[NamedMapping, ...] | None = None
    duo_scaling: bool | str = True  # True, False or "both"
    n_grid: int = 20
    search_samples: int | None = None  # run the parents on about this many samples (None: all, llm-compressor's)
    clip: bool = False  # the original AWQ's weight clip search after the scales (llm-compressor 0.14 has none)


ROTATIONS = ("R1", "R2")  # the rotations graphcal folds into the weights (SpinQuant's names; R3/R4 are online)
ROTATION_TYPES = ("hadamard", "random-hadamard", "random-matrix")  # SpinQuantModifier's transform_type


@dataclass(frozen=True)
class RotationSettings:
    """SpinQuantModifier's fields graphcal folds: ``rotations`` ("R1", "R2") and ``kind`` (its
    transform_type: hadamard, random-hadamard, random-matrix). :attr:`RunConfig.rotation` gives it."""

    rotations: tuple[str, ...] = ("R1",)
    kind: str = "hadamard"


@dataclass
class RunConfig:
    """Config groups (compressed-tensors schemes, each with targets) and what to ignore."""

    groups: dict[str, "object"]  # group name -> QuantizationScheme
    ignore: list[str] = field(default_factory=lambda: list(DEFAULT_IGNORE))
    scheme_name: str = "custom"
    kv_cache: "object | None" = None  # QuantizationArgs for the key/value states (kv_cache_scheme)
    smoothing: Smoothing | None = None  # SmoothQuant before quantizing (None: none)
    awq: AWQSettings | None = None  # AWQ's scale search before quantizing (None: none)
    gptq: GPTQSettings | None = None  # weights quantized by GPTQ instead of rounding to nearest (None: RTN)
    rotate: tuple[str, ...] = ()  # rotations folded in first ("R1", "R2"; algorithms.rotation), fp32 outputs unchanged
    rotation_type: str = "hadamard"  # SpinQuantModifier's transform_type: hadamard, random-hadamard, random-matrix

    def __post_init__(self):
        """A stranger's ``re:`` target or ignore refused here, before any model is read (the bounded
        matcher's own check, graph.names; plan's selection checks again)."""
        for scheme in self.groups.values():
            for p in getattr(scheme, "targets", None) or ():
                check_pattern(p, "targets")
        for p in self.ignore or ():
            check_pattern(p, "ignore")

    def scheme_for(self, target: Target):
        """The scheme of the most specific matching target string (exact > regex > class), or None."""
        best = None
        for scheme in self.groups.values():
            for pattern in scheme.targets:
                if matches(target, pattern):
                    rank = _specificity(pattern)
                    if best is None or rank < best[0]:
                        best = (rank, scheme)
        return None if best is None else best[1]

    @property
    def patterns(self) -> list[str]:
        return [p for s in self.groups.values() for p in s.targets]

    @property
    def rotation(self) -> RotationSettings | None:
        """--rotate's settings as one record (None: no rotation)."""
        return RotationSettings(tuple(self.rotate), self.rotation_type) if self.rotate else None

    def transform_settings(self) -> tuple:
        """The settings records of the transforms this run asks for (graphcal.calibration.transforms
        finds each one's unit by its type)."""
        return tuple(s for s in (self.rotation, self.smoothing, self.awq, self.gptq) if s is not None)


def _specificity(pattern: str) -> int:
    if pattern in ("Linear", "MatMul", "Gemm", EMBEDDING):
        return 2
    return 1 if pattern.startswith("re:") else 0


def check_gptq(settings: GPTQSettings) -> GPTQSettings:
    """GPTQModifier's fields checked (where llm-compressor would fail later, graphcal says so first)."""
    from graphcal.algorithms.gptq.math import check_actorder  # lazy: GPTQ's math loads compressed-tensors

    if isinstance(settings.block_size, bool) or not isinstance(settings.block_size, int) or settings.block_size < 1:
        raise UsageError(f"GPTQ block_size must be a positive integer, got {settings.block_size!r}")
    damp = settings.dampening_frac
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not damp >= 0 or damp == float("inf"):
        raise UsageError(f"GPTQ dampening_frac must be a finite number >= 0, got {damp!r}")
    if settings.actorder != ACTORDER_DEFAULT:
        try:
            check_actorder(settings.actorder)
        except ValueError as e:
            raise UsageError(f"GPTQ actorder: {e}") from None
    if settings.order not in GPTQ_ORDERS:
        raise UsageError(f"--gptq-order takes one of {', '.join(GPTQ_ORDERS)}, got {shown(str(settings.order))!r}")
    return settings


def check_awq(settings: AWQSettings) -> AWQSettings:
    """AWQModifier's fields checked: a grid llm-compressor would fail on is a usage error here."""
    if settings.duo_scaling not in (True, False, "both"):
        raise UsageError(f"AWQ duo_scaling must be true, false or both, got {settings.duo_scaling!r}")
    n = settings.n_grid
    least = {True: 3, False: 2, "both": 4}[settings.duo_scaling]
    if isinstance(n, bool) or not isinstance(n, int) or n < least or n > MAX_N_GRID:
        raise UsageError(f"AWQ n_grid must be an integer >= {least} (with duo_scaling {settings.duo_scaling}) and <= "
                         f"{MAX_N_GRID}, got {n!r}")
    return settings


def check_scope(scope: str) -> str:
    if scope not in SCOPES:
        raise UsageError(f"--smoothquant takes one of {', '.join(SCOPES)}, got {shown(scope)!r}")
    return scope


STRENGTH_RANGE = (0.0, 1.0)  # llm-compressor's SmoothQuantModifier: "alpha, intensity of smoothing (0-1 range)"


def check_strength(value, what: str = "smoothing strength") -> float:
    """SmoothQuant's alpha: a number from 0 to 1, the range llm-compressor documents for
    smoothing_strength (0.5 by default). Outside it a^alpha / w^(1-alpha) overflows or divides by
    zero (50: inf and NaN scales; -1 on a constant channel: 1/0)."""
    low, high = STRENGTH_RANGE
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UsageError(f"{what} must be a finite number from {low:g} to {high:g}, got {shown(repr(value))}")
    if not low <= value <= high:
        raise UsageError(f"{what} must be from {low:g} to {high:g} (llm-compressor's range for SmoothQuant's alpha; "
                         f"50% is 0.5), got {value!r}")
    return float(value)
