"""Importance-weighted MSE observers (imatrix).

The caller feeds the activations entering the weight's layer with
``accumulate_importance(x)``; the per-input-channel mean of ``x**2`` weights the search
error ``sum(imp * |q - w|^norm)`` (fp32). The search itself runs when qparams are requested,
so importance may be accumulated (and all-reduced) before or after the weight is observed.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from compressed_tensors.quantization import QuantizationStrategy

from graphcal.observers.base import Observer
from graphcal.observers.helpers import REDUCE_DIMS, flatten_for_calibration
from graphcal.observers.mse import (
    NVFP4_EXPAND,
    NVFP4_MAXSHRINK,
    shrink_search,
    validate_search_kwargs,
)

__all__ = [
    "imatrix_grid_search",
    "IMatrixFallbackWarning",
    "IMatrixMSEObserver",
    "NVFP4ExpandedIMatrixObserver",
]

_S = QuantizationStrategy
_TINY = torch.finfo(torch.float32).tiny


class IMatrixFallbackWarning(UserWarning):
    """The imatrix search fell back to uniform (unweighted) MSE."""


def imatrix_grid_search(
    observed: torch.Tensor,
    args,
    importance: torch.Tensor | None,
    *,
    maxshrink: float = 0.95,
    patience: int = 5,
    grid: float = 20,
    norm: float = 3.0,
    expand: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance-weighted search over ``p = 1 - i/grid``, ``i = 0..max(1, int(maxshrink*grid))``.

    ``observed``: flattened weight ``(1, *qparam_shape, group_size)``; ``importance``: same
    shape, fp32 (``None`` = uniform). Error is fp32; ``patience=0`` disables early stopping.
    """

    steps = max(1, int(maxshrink * grid))
    factors = [1 - i / grid for i in range(steps + 1)]
    return shrink_search(
        observed,
        args,
        factors,
        norm=norm,
        patience=patience if patience > 0 else None,
        expand=expand,
        importance=importance,
        error_dtype=torch.float32,
    )


@Observer.register_observer("imatrix_mse")
class IMatrixMSEObserver(Observer):
    """Weight observer whose MSE search is weighted by E[x^2] of the layer's input channels.

    ``accumulate_importance(x)``: ``x`` of any shape with last dim = in_features. Falls back
    to uniform MSE with an ``IMatrixFallbackWarning`` (``strict=True``: ``ValueError``) for
    non-weight observers, the tensor/block strategies, missing, non-finite, negative,
    all-zero or mis-sized importance.
    """

    default_kwargs = {
        "maxshrink": 0.95,
        "patience": 5,
        "grid": 20,
        "norm": 3.0,
        "strict": False,
        "expand": 1.0,
    }
    _stats_attrs = ("min_vals", "max_vals", "_imatrix_sum", "_imatrix_count")
    _act_sync = {"_imatrix_sum": "sum", "_imatrix_count": "sum"}

    def __init__(self, base_name, args, **observer_kwargs: Any):
        super().__init__(base_name, args, **observer_kwargs)
        self._pending: torch.Tensor | None = None  # flattened weight awaiting its search

    def _validate_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs = validate_search_kwargs(kwargs, shrunk_start=True)  # llm-compressor 0.14 searches from expand < 1 too
        if not isinstance(kwargs["strict"], bool):
            raise ValueError(f"observer kwarg 'strict' must be a bool, got {kwargs['strict']!r}")
        return kwargs

    # ------------------------------------------------------------------ statistics
    @property
    def has_statistics(self) -> bool:
        # importance is optional (missing importance -> uniform fallback)
        return self.min_vals is not None and self.max_vals is not None

    @property
    def needs_activations(self) -> bool:
        return self.is_weight

    @property
    def sync_ops(self) -> dict[str, str]:
        return dict(self._act_sync) if self.is_weight else {}

    def reset(self) -> None:
        super().reset()
        self._pending = None

    @torch.no_grad()
    def accumulate_importance(self, x: torch.Tensor) -> None:
        """Add ``sum(x**2)`` over all dims but the last (fp32) and ``prod(x.shape[:-1])``."""
        if not isinstance(x, torch.Tensor) or x.ndim == 0:
            raise TypeError("accumulate_importance takes a tensor with at least one dim")
        squares = x.detach().float().pow(2)
        if x.ndim > 1:
            squares = squares.sum(dim=tuple(range(x.ndim - 1)))
        count = math.prod(x.shape[:-1])
        if self._imatrix_sum is None:
            self._imatrix_sum = torch.zeros(x.shape[-1], dtype=torch.float32, device=x.device)
            self._imatrix_count = torch.zeros((), dtype=torch.int64, device=x.device)
        elif self._imatrix_sum.shape[-1] != x.shape[-1]:
            raise ValueError(
                f"importance size mismatch: accumulated {self._imatrix_sum.shape[-1]} channels, "
                f"got an activation with last dim {x.shape[-1]}"
            )
        self._imatrix_sum = self._imatrix_sum + squares.to(self._imatrix_sum.device)
        self._imatrix_count = self._imatrix_count + count

    # ------------------------------------------------------------------ search
    def _search_kwargs(self) -> dict[str, Any]:
        return {k: self.kwargs[k] for k in ("maxshrink", "patience", "grid", "norm", "expand")}

    def _fallback(self, reason: str) -> None:
        message = f"{self.observer_name} ({self.base_name!r}): {reason}"
        if self.kwargs["strict"]:
            raise ValueError(message)
        warnings.warn(f"{message}; falling back to uniform MSE", IMatrixFallbackWarning,
                      stacklevel=3)
        return None

    def _importance(self, observed: torch.Tensor) -> torch.Tensor | None:
        """Normalised importance shaped like ``observed``, or ``None`` (uniform fallback)."""
        strategy = self.strategy
        if strategy == _S.TENSOR:
            return self._fallback("imatrix does not support the TENSOR strategy")
        if strategy not in (_S.CHANNEL, _S.GROUP, _S.TENSOR_GROUP) or observed.ndim != 4:
            return self._fallback(f"imatrix does not support the {strategy.value!r} strategy")
        count = self._imatrix_count
        if self._imatrix_sum is None or count is None or int(count) == 0:
            return self._fallback("no importance data (accumulate_importance was never fed)")
        in_features = observed.shape[2] * observed.shape[3]
        if self._imatrix_sum.numel() != in_features:
            return self._fallback(
                f"importance size mismatch: {self._imatrix_sum.numel()} channels for a weight "
                f"with {in_features} input features"
            )
        imp = self._imatrix_sum.float() / count
        if not bool(torch.isfinite(imp).all()):
            return self._fallback("importance has non-finite values")
        if bool((imp < 0).any()):
            return self._fallback("importance has negative values")
        if bool((imp == 0).all()):
            return self._fallback("importance is all zeros")
        imp = imp / (imp.mean() + _TINY)
        weight_shaped = imp.to(observed.device).expand(observed.shape[1], in_features)
        return flatten_for_calibration(weight_shaped, "weight", self.args)

    def _update(self, observed: torch.Tensor) -> None:
        if self.is_weight:
            # raw range now, weighted search when qparams are requested
            self._pending = observed
            self.min_vals = torch.amin(observed, dim=REDUCE_DIMS)
            self.max_vals = torch.amax(observed, dim=REDUCE_DIMS)
            return
        self._fallback("imatrix only applies to weight observers")
        self.min_vals, self.max_vals = imatrix_grid_search(
            observed, self.args, None, **self._search_kwargs()
        )

    def _finalize(self) -> None:
        if self._pending is None:
            return
        observed = self._pending
        importance = self._importance(observed)
        self.min_vals, self.max_vals = imatrix_grid_search(
            observed, self.args, importance, **self._search_kwargs()
        )
        self._pending = None


@Observer.register_observer("nvfp4_expanded_imatrix")
class NVFP4ExpandedIMatrixObserver(IMatrixMSEObserver):
    """imatrix search over an expanded range (1.8x, grid 200, norm 2.4, patience 1000)."""

    default_kwargs = {
        **IMatrixMSEObserver.default_kwargs,
        "expand": NVFP4_EXPAND,
        "maxshrink": NVFP4_MAXSHRINK,
        "grid": 200,
        "norm": 2.4,
        "patience": 1000,
    }
