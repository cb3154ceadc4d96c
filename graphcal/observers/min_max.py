"""Min/max observers: memoryless, static (running extrema) and moving average."""

from __future__ import annotations

from typing import Any

import torch

from graphcal.observers.base import Observer, check_real, ema

__all__ = ["MemorylessMinMaxObserver", "StaticMinMaxObserver", "MinMaxObserver"]

#: llm-compressor's default EMA constant
DEFAULT_AVERAGING_CONSTANT = 0.01


def validate_averaging_constant(kwargs: dict[str, Any]) -> dict[str, Any]:
    check_real("averaging_constant", kwargs["averaging_constant"], low=0.0, high=1.0)
    return kwargs


class _MinMaxFamily(Observer):
    # ``averaging_constant`` is accepted by every min/max observer (llm-compressor swaps
    # ``minmax`` for ``memoryless_minmax`` on weights and keeps the kwargs); only the
    # moving-average observer uses it.
    default_kwargs = {"averaging_constant": DEFAULT_AVERAGING_CONSTANT}

    def _validate_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return validate_averaging_constant(kwargs)

    @property
    def takes_extrema(self) -> bool:
        return not self.is_weight


@Observer.register_observer("memoryless_minmax")
class MemorylessMinMaxObserver(_MinMaxFamily):
    """min/max of the latest batch only."""


@Observer.register_observer("static_minmax")
class StaticMinMaxObserver(_MinMaxFamily):
    """Running elementwise min of minima and max of maxima over all batches."""

    _act_sync = {"min_vals": "min", "max_vals": "max"}

    def _combine(self, min_vals: torch.Tensor, max_vals: torch.Tensor) -> None:
        if self.min_vals is None:
            self.min_vals, self.max_vals = min_vals, max_vals
        else:
            self.min_vals = torch.minimum(self.min_vals, min_vals)
            self.max_vals = torch.maximum(self.max_vals, max_vals)


class EMACombineMixin:
    """First batch sets the statistics; later ones are folded in with ``ema``."""

    min_vals: torch.Tensor | None
    max_vals: torch.Tensor | None
    kwargs: dict[str, Any]

    def _combine(self, min_vals: torch.Tensor, max_vals: torch.Tensor) -> None:
        if self.min_vals is None or self.max_vals is None:
            self.min_vals, self.max_vals = min_vals, max_vals
        else:
            constant = self.kwargs["averaging_constant"]
            self.min_vals = ema(self.min_vals, min_vals, constant)
            self.max_vals = ema(self.max_vals, max_vals, constant)


@Observer.register_observer("minmax")
class MinMaxObserver(EMACombineMixin, _MinMaxFamily):
    """Exponential moving average of batch min/max (``averaging_constant``, default 0.01)."""

    _act_sync = {"min_vals": "avg", "max_vals": "avg"}
