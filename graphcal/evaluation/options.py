"""What one ``graphcal eval`` is asked to do: one frozen record, built by the CLI (or a caller of
:func:`graphcal.evaluation.evaluate`), checked before any model is read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from graphcal.errors import UsageError

LEVELS = {"basic": "ORT_ENABLE_BASIC", "all": "ORT_ENABLE_ALL"}
DEVICES = ("auto", "cpu", "cuda")  # as run's --device (graphcal.devices.DEVICES)
DEFAULT_TIME_LIMIT_S = 3600.0  # eval --time-limit's default: a sensitivity estimated past an hour is refused


@dataclass(frozen=True)
class EvalOptions:
    """eval's settings (see :func:`graphcal.evaluation.evaluate` for what each does)."""

    batch_size: int | None = None
    num_samples: int | None = None
    level: str = "basic"  # onnxruntime's optimization level for every session: "basic" or "all"
    isolated: bool = False  # also each layer's own error, on the reference's inputs
    sensitivity: bool = False  # each kind (``per_layer``: layer) quantized alone, and the advice measured
    per_layer: bool = False
    in_graph: bool = True  # both models as one graph reducing each pair in onnxruntime (onnxruntime models)
    writes: tuple[tuple[str, str | Path], ...] = ()  # (option, path) of each file the caller writes (--html)
    time_limit_s: float | None = DEFAULT_TIME_LIMIT_S  # sensitivity and mixing estimated past it are refused
    fallback: str | Path | None = None  # the higher form of the mix (None: float)
    size_budget_bytes: int | None = None
    target_db: float | None = None
    target_kl: float | None = None  # the mix's mean next-token KL against fp32, in nats (models with logits)
    device: str = "auto"  # where every session runs, as run's --device: "auto" (CUDA when usable), "cpu", "cuda"
    device_id: int = 0  # the GPU, with CUDA

    def __post_init__(self):
        object.__setattr__(self, "writes", tuple(tuple(w) for w in self.writes))

    @property
    def mixing(self) -> bool:
        return any(goal is not None for goal in (self.size_budget_bytes, self.target_db, self.target_kl))

    def check(self) -> None:
        """Refuse, in one line, settings that need another or take no value given."""
        if self.level not in LEVELS:
            raise UsageError(f"level must be one of {', '.join(LEVELS)}, got {self.level!r}")
        if self.device not in DEVICES:
            raise UsageError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if isinstance(self.device_id, bool) or not isinstance(self.device_id, int) or self.device_id < 0:
            raise UsageError(f"--device-id must be a GPU index (0 or more), got {self.device_id!r}")
        if sum(goal is not None for goal in (self.size_budget_bytes, self.target_db, self.target_kl)) > 1:
            raise UsageError("give one of --size-budget, --target-db and --target-kl")
        if self.target_kl is not None and not self.target_kl >= 0:
            raise UsageError(f"--target-kl is a mean KL divergence in nats (0 or more), got {self.target_kl!r}")
        if self.fallback is not None and not self.mixing:
            raise UsageError("--fallback is the higher form for --size-budget, --target-db or --target-kl; give one of them")
        if self.per_layer and not (self.sensitivity or self.mixing):
            raise UsageError("--per-layer measures each layer with --sensitivity, or mixes layer by layer with "
                             "--size-budget, --target-db or --target-kl; give one of them")
