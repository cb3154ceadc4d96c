"""SmoothQuant's math: llm-compressor's SmoothQuantModifier scales, and graphcal's strength search.

The scales: ``s = range^a / (2 * max|W_col|)^(1-a)`` pooled over the balance layers (``range`` where
every balance column is zero), or ``range / log2(2 + range)`` for log_equalization, clamped at 1e-5.
The strength search (``--smoothing-strength auto``) scores each strength of SEARCH_GRID by the squared
error of the balance layers' outputs on sampled rows once weights and inputs are fake-quantized with
the run's schemes. Pure torch: nothing here knows about graphs.
"""

from __future__ import annotations

import torch
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams

from graphcal.config import observer_name
from graphcal.observers import make_observer
from graphcal.types import enum_value

MINIMUM_SMOOTHING_SCALE = 1e-5  # llm-compressor's clamp
SEARCH_GRID = tuple(round(0.1 * i, 1) for i in range(1, 11))  # --smoothing-strength auto: 0.1 ... 1.0


def smoothing_scales(min_vals: torch.Tensor, max_vals: torch.Tensor, weights: list[torch.Tensor], strength: float,
                     algorithm: str = "smoothquant") -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, unclamped scales) of one mapping, as llm-compressor's SmoothQuantModifier computes
    them: ``weights`` are the balance layers' torch [out, in] weights."""
    activation = max_vals - min_vals
    if algorithm == "log_equalization":
        scales = activation / torch.log2(2 + activation)
    else:
        weight_max = torch.cat([w.abs() for w in weights], dim=0).amax(dim=0)
        weight_scale = 2 * weight_max
        scales = activation.pow(strength) / weight_scale.pow(1 - strength)
        scales = torch.where(weight_scale > 0.0, scales, activation)
    clamped = torch.maximum(scales, torch.tensor([MINIMUM_SMOOTHING_SCALE], device=scales.device))
    return clamped, scales


def per_group(lo: torch.Tensor, hi: torch.Tensor, group_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel extrema as per-group ones (``group_size`` None: one group, the whole tensor)."""
    if group_size is None:
        return lo.amin().reshape(1), hi.amax().reshape(1)
    return lo.reshape(-1, group_size).amin(dim=1), hi.reshape(-1, group_size).amax(dim=1)


def search_strength(schemes: list, lo, hi, weights: list[torch.Tensor], rows: torch.Tensor, act_range,
                    algorithm: str) -> float:
    """The strength of SEARCH_GRID whose smoothing gives the balance layers' outputs on ``rows`` the
    smallest squared error once weights and inputs are fake-quantized as their ``schemes`` say (one per
    balance weight; None: left in float), the inputs' static range the whole data's (``act_range``,
    x's per-channel extrema)."""
    best = None
    for strength in SEARCH_GRID:
        s, _ = smoothing_scales(lo, hi, weights, strength, algorithm)
        error = _error(schemes, s, weights, rows, act_range)
        if best is None or error < best[0]:
            best = (error, strength)
    return best[1]


def _error(schemes: list, s: torch.Tensor, weights: list[torch.Tensor], rows: torch.Tensor, act_range) -> float:
    inverse = 1.0 / s.float()
    smoothed = rows * inverse
    lo, hi = (v.float() * inverse for v in act_range)
    total = 0.0
    for scheme, w in zip(schemes, weights):
        if scheme is None:  # balanced but left in float: smoothing changes nothing in its output
            continue
        w = w.float()
        wq = _fake_weight(w * s.float()[None, :], scheme.weights)
        xq = _fake_input(smoothed, scheme.input_activations, lo, hi)
        total += float(((rows @ w.T - xq @ wq.T) ** 2).sum())
    return total


def _as_rows_args(args):
    """Activation args as weight args over [rows, channels] (token -> channel), so compressed-tensors'
    weight path quantizes them."""
    strategy = enum_value(args.strategy)
    return args.model_copy(update={"strategy": "channel" if strategy == "token" else strategy, "dynamic": False,
                                   "observer": None})


def _fake_weight(w: torch.Tensor, args) -> torch.Tensor:
    if args is None:
        return w
    obs = make_observer(observer_name(args, "weight"), "weight", args.model_copy(deep=True))
    obs(w)
    qp = obs.get_qparams()
    return fake_quantize(w, qp["scale"], qp["zero_point"], args, global_scale=qp["global_scale"])


def _fake_input(x: torch.Tensor, args, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``x`` [rows, channels] fake-quantized as the input args say: static scales from the whole
    data's extrema (``lo``/``hi`` per channel), dynamic ones from the rows themselves."""
    if args is None:
        return x
    rows_args = _as_rows_args(args)
    strategy = enum_value(args.strategy)
    if args.dynamic is False and strategy in ("tensor", "group"):
        lo, hi = per_group(lo, hi, args.group_size if strategy == "group" else None)
        scale, zero_point = calculate_qparams(lo, hi, args)
        if strategy == "group":
            scale, zero_point = scale.expand(x.shape[0], -1), zero_point.expand(x.shape[0], -1)
        return fake_quantize(x, scale, zero_point, rows_args)
    obs = make_observer("memoryless_minmax", "weight", rows_args)
    obs(x)
    qp = obs.get_qparams()
    return fake_quantize(x, qp["scale"], qp["zero_point"], rows_args, global_scale=qp["global_scale"])
