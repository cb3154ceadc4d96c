"""MSE observers: shrink the observed range to minimise the quantization error.

The search follows llm-compressor's eager (CPU) path: candidate ranges ``(min0*p, max0*p)``
with ``p = 1 - i/grid``, qparams from ``calculate_qparams`` without a global scale (and
without rounding the scale to ``scale_dtype`` for tensor_group), fake quantization with
plain broadcasting, error ``sum |q - x|^norm`` per qparam in the observed dtype, strict
``<`` improvements, and one global patience counter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams, calculate_range

from graphcal.observers.base import Observer, check_int, check_real
from graphcal.observers.helpers import REDUCE_DIMS
from graphcal.observers.min_max import (
    DEFAULT_AVERAGING_CONSTANT,
    EMACombineMixin,
    validate_averaging_constant,
)
from graphcal.types import enum_value

__all__ = [
    "search_args",
    "shrink_search",
    "grid_search_mse",
    "MemorylessMSEObserver",
    "MovingAverageMSEObserver",
    "NVFP4ExpandedMSEObserver",
    "NVFP4_EXPAND",
    "NVFP4_MAXSHRINK",
]

#: expanded-range NVFP4 search: start at 1.8x the observed range, stop near 0.8x
NVFP4_EXPAND = 1.8
NVFP4_MAXSHRINK = 1 - 0.8 / 1.8

ErrorFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
CandidateErrorFn = Callable[[torch.Tensor, torch.Tensor, QuantizationArgs], "torch.Tensor | None"]


def search_args(args: QuantizationArgs) -> QuantizationArgs:
    """Args used to score candidates: tensor_group drops ``scale_dtype``; strategy -> token."""
    update: dict[str, Any] = {"strategy": QuantizationStrategy.TOKEN.value}
    if QuantizationStrategy(args.strategy) == QuantizationStrategy.TENSOR_GROUP:
        update["scale_dtype"] = None
    return args.model_copy(update=update)


def shrink_search(
    observed: torch.Tensor,
    args: QuantizationArgs,
    shrink_factors: Iterable[float],
    error_fn: ErrorFn,
    *,
    patience: int | None,
    expand: float = 1.0,
    error_dtype: torch.dtype | None = None,
    candidate_error: CandidateErrorFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Best ``(min, max)`` per qparam over candidate ranges ``(min0*p, max0*p)``.

    ``observed``: flattened ``(num_obs, *qparam_shape, group_size)``; returns two
    ``qparam_shape`` tensors in ``observed.dtype``. ``error_fn(q, observed)`` gives the
    per-qparam error of compressed-tensors' fake quantization ``q``; ``candidate_error(scale,
    zero_point, candidate_args)``, when given and not None for a candidate, gives that same error
    by a cheaper route. ``patience`` counts consecutive steps in which no qparam improved
    (``None``: search every factor).
    """
    candidate_args = search_args(args)
    min0 = torch.amin(observed, dim=REDUCE_DIMS) * expand
    max0 = torch.amax(observed, dim=REDUCE_DIMS) * expand
    dtype = error_dtype or observed.dtype
    best_err = torch.full(min0.shape, torch.finfo(dtype).max, dtype=dtype, device=min0.device)
    best_min, best_max = min0.clone(), max0.clone()
    stalled = 0
    for p in shrink_factors:
        cand_min, cand_max = min0 * p, max0 * p
        scale, zero_point = calculate_qparams(cand_min, cand_max, candidate_args)
        err = None if candidate_error is None else candidate_error(scale, zero_point, candidate_args)
        if err is None:
            q = fake_quantize(
                observed, scale.unsqueeze(-1), zero_point.unsqueeze(-1), candidate_args
            ).to(observed.dtype)
            err = error_fn(q, observed)
        improved = err < best_err
        if bool(improved.any()):
            best_err = torch.where(improved, err, best_err)
            best_min = torch.where(improved, cand_min, best_min)
            best_max = torch.where(improved, cand_max, best_max)
            stalled = 0
        else:
            stalled += 1
            if patience is not None and stalled >= patience:
                break
    return best_min, best_max


class InPlaceIntError:
    """``sum |fake_quantize(x) - x|^norm`` per qparam for int candidates, in one scratch buffer.

    The same elementwise operations as compressed-tensors' ``_quantize_dequantize`` (divide, add
    the zero point, clamp, round, subtract it, multiply) and as the error (subtract, abs, pow),
    in the same order and dtype, done in place: the error is bit for bit the one the allocating
    path gives, without the ~10 temporaries of the observed size per candidate that made the
    search page-fault bound. A symmetric zero point is all zeros and is skipped: adding and
    subtracting it changes at most the sign of a zero, which the abs removes. Returns None
    (use the general path) for float types and for scales in another dtype than ``x``.
    """

    def __init__(self, observed: torch.Tensor, norm: float):
        self.observed, self.norm = observed, norm
        self._buf: torch.Tensor | None = None

    def __call__(self, scale: torch.Tensor, zero_point: torch.Tensor, args: QuantizationArgs):
        x = self.observed
        if enum_value(args.type) != "int" or scale.dtype != x.dtype or not x.is_floating_point():
            return None
        if self._buf is None:
            self._buf = torch.empty_like(x)
        q_min, q_max = calculate_range(args, x.device)
        buf, scale = self._buf, scale.unsqueeze(-1)
        torch.div(x, scale, out=buf)
        zp = None if args.symmetric else zero_point.unsqueeze(-1)
        if zp is not None:
            buf.add_(zp.to(x.dtype))
        buf.clamp_(float(q_min), float(q_max)).round_()
        if zp is not None:
            buf.sub_(zp.to(scale.dtype))
        buf.mul_(scale).sub_(x).abs_().pow_(self.norm)
        return buf.sum(dim=REDUCE_DIMS)


def grid_search_mse(
    observed: torch.Tensor,
    args: QuantizationArgs,
    *,
    maxshrink: float = 0.2,
    patience: int = 5,
    grid: float = 100.0,
    norm: float = 2.4,
    expand: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """llm-compressor's eager MSE search: ``int(maxshrink*grid)`` steps, error in observed dtype."""

    def error(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (q - x).abs().pow(norm).sum(dim=REDUCE_DIMS)

    steps = int(maxshrink * grid)
    factors = (1 - i / grid for i in range(steps))
    return shrink_search(observed, args, factors, error, patience=patience, expand=expand,
                         candidate_error=InPlaceIntError(observed, norm))


def validate_search_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Shared validation of maxshrink/patience/grid/norm/expand (returns normalised kwargs)."""
    out = dict(kwargs)
    check_real("maxshrink", out["maxshrink"], low=0.0, high=1.0)
    out["patience"] = check_int("patience", out["patience"], low=0)
    check_real("grid", out["grid"], low=0.0, low_open=True)
    check_real("norm", out["norm"], low=0.0, low_open=True)
    check_real("expand", out["expand"], low=1.0)
    return out


@Observer.register_observer("memoryless_mse")
class MemorylessMSEObserver(Observer):
    """Grid-searched min/max of the latest batch."""

    default_kwargs = {
        "maxshrink": 0.20,
        "patience": 5,
        "grid": 100.0,
        "norm": 2.4,
        "expand": 1.0,
        # accepted for compatibility; only the moving-average observer uses it
        "averaging_constant": DEFAULT_AVERAGING_CONSTANT,
        # knobs of llm-compressor's compiled/Triton paths; no effect on the eager search
        "chunk_size": None,
        "triton_error_buffer": None,
    }

    def _validate_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs = validate_averaging_constant(validate_search_kwargs(kwargs))
        if kwargs["chunk_size"] is not None:
            check_int("chunk_size", kwargs["chunk_size"], low=1)
        if kwargs["triton_error_buffer"] is not None:
            check_real("triton_error_buffer", kwargs["triton_error_buffer"], low=0.0)
        return kwargs

    def _batch_min_max(self, observed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kw = self.kwargs
        return grid_search_mse(
            observed,
            self.args,
            maxshrink=kw["maxshrink"],
            patience=kw["patience"],
            grid=kw["grid"],
            norm=kw["norm"],
            expand=kw["expand"],
        )


@Observer.register_observer("mse")
class MovingAverageMSEObserver(EMACombineMixin, MemorylessMSEObserver):
    """Grid search per batch, then an EMA of the searched min/max (``averaging_constant``)."""

    _act_sync = {"min_vals": "avg", "max_vals": "avg"}


@Observer.register_observer("nvfp4_expanded_mse", alias="fouroversix", warn_alias=True)
class NVFP4ExpandedMSEObserver(MemorylessMSEObserver):
    """Memoryless MSE over an expanded range: 1.8x down to ~0.81x in 111 steps of 1/200."""

    default_kwargs = {
        **MemorylessMSEObserver.default_kwargs,
        "expand": NVFP4_EXPAND,
        "maxshrink": NVFP4_MAXSHRINK,
        "grid": 200,
        "patience": 1000,
    }
