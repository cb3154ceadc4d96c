"""Histogram observers (graphcal's, not llm-compressor's): percentile, entropy and a histogram MSE.

Each keeps one histogram per activation (per-tensor qparams only), merged batch by batch, so its
memory stays flat however many samples pass, and the range comes from the whole calibration set at
the end, not from an average of per-batch searches:

- ``percentile``: the range that holds ``percentile`` % of the values (onnxruntime's
  PercentileCalibrater rule: |x| for symmetric args, both tails for asymmetric ones);
- ``entropy``: the range whose int8 histogram is closest to the data's in KL divergence
  (onnxruntime's EntropyCalibrater rule, TensorRT's calibration);
- ``histogram_mse``: llm-compressor's MSE search (the same candidates, norm, patience and qparams as
  ``mse``), with each candidate scored on the histogram's bin centres instead of every value: the
  range that minimises the error over the whole calibration set, at close to min/max cost.

The histogram: ``2 * bins`` equal bins over ``[-R, R]``, ``R = bins * width`` with ``width`` a
power of two, so that a value's bin is exact (``floor(x / width)``) and two histograms of different
widths merge exactly (the finer one's bins are summed in pairs until the widths agree). A batch
beyond the range doubles the width the same way. Merging is how batches, and torchrun ranks, meet.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from compressed_tensors.quantization import QuantizationStrategy

from graphcal.observers.base import Observer, check_int, check_real
from graphcal.observers.mse import Scores, shrink_search, validate_search_kwargs

__all__ = [
    "add_to_histogram",
    "bin_counts",
    "merge_histograms",
    "percentile_edge",
    "percentile_range",
    "entropy_window",
    "entropy_range",
    "PercentileObserver",
    "EntropyObserver",
    "HistogramMSEObserver",
]

#: the width a histogram of all-zero values starts at (any later value widens it exactly)
_ZERO_WIDTH = 2.0 ** -64


#: the narrowest width: 1 / width stays a finite float32 (subnormal-sized ranges share its first bins)
_MIN_WIDTH_EXPONENT = -100


def _width_for(absmax: float, bins: int) -> float:
    """The smallest power of two ``w`` (at least 2**-100) with ``bins * w >= absmax``."""
    if absmax <= 0:
        return _ZERO_WIDTH
    return 2.0 ** max(math.ceil(math.log2(absmax / bins)), _MIN_WIDTH_EXPONENT)


def _coarsen(counts: torch.Tensor) -> torch.Tensor:
    """The same values at twice the width: pairs summed, the range doubled (zeros outside)."""
    half = counts.numel() // 2
    out = torch.zeros_like(counts)
    out[half // 2:half // 2 + half] = counts.view(half, 2).sum(1)
    return out


#: values binned per step: the scratch (a float and an int32 buffer of this size) is allocated once and stays
#: in cache; fresh tap-sized temporaries cost more in page faults than the binning itself
CHUNK_ELEMENTS = 1 << 18
#: values counted per bincount (their int32 bin indices are kept, 16 MB): each count fills and adds a
#: ``2 * bins`` array, which per step would cost histogram_mse's 65,536 bins a quarter of the binning
COUNT_ELEMENTS = 1 << 22
_SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def add_to_histogram(counts: torch.Tensor | None, width: float, x: torch.Tensor, absmax: float,
                     bins: int) -> tuple[torch.Tensor, float]:
    """``(counts, width)`` with the values of ``x`` (whose largest |value| is ``absmax``) added;
    ``counts`` None starts a histogram of ``2 * bins`` bins (float64 counts)."""
    if counts is None:
        counts, width = torch.zeros(2 * bins, dtype=torch.float64, device=x.device), _width_for(absmax, bins)
    while absmax > bins * width:
        counts, width = _coarsen(counts), width * 2
    flat = x.reshape(-1)
    chunk = CHUNK_ELEMENTS if x.device.type == "cpu" else COUNT_ELEMENTS  # a GPU has no cache to stay in
    if x.device not in _SCRATCH or _SCRATCH[x.device][1].numel() < min(flat.numel(), COUNT_ELEMENTS):
        _SCRATCH[x.device] = (torch.empty(chunk, device=x.device),
                              torch.empty(max(chunk, min(flat.numel(), COUNT_ELEMENTS)),
                                          dtype=torch.int32, device=x.device))
    scratch, index = _SCRATCH[x.device]
    total = None
    for values in flat.split(COUNT_ELEMENTS):
        done = 0
        for part in values.split(chunk):
            n = part.numel()
            # floor(x / width) + bins, exact (width is a power of two); int32: bincount reads it 4x faster than int64
            torch.mul(part, 1.0 / width, out=scratch[:n]).floor_().add_(bins).clamp_(0, 2 * bins - 1)
            index[done:done + n].copy_(scratch[:n])
            done += n
        found = bin_counts(index[:done], 2 * bins)
        total = found if total is None else total.add_(found)
    counts += total.to(counts)
    return counts, width


def bin_counts(index: torch.Tensor, size: int, add: bool | None = None) -> torch.Tensor:
    """How many of ``index`` (int32, each in ``[0, size)``) fall on each of ``size`` bins (int64).
    ``torch.bincount`` on the CPU; on a GPU (``add``: either way) an ``index_add_`` of ones, the
    same counts without bincount's read of the largest index back to the host on every call."""
    if not (index.device.type != "cpu" if add is None else add):
        return torch.bincount(index, minlength=size)
    ones = torch.ones(1, dtype=torch.int64, device=index.device).expand(index.numel())
    return torch.zeros(size, dtype=torch.int64, device=index.device).index_add_(0, index, ones)


def merge_histograms(parts: list[tuple[torch.Tensor, float]]) -> tuple[torch.Tensor, float]:
    """One histogram from several of the same bin count: each brought to the widest width, summed."""
    width = max(w for _, w in parts)
    total = None
    for counts, w in parts:
        while w < width:
            counts, w = _coarsen(counts), w * 2
        total = counts.clone() if total is None else total + counts.to(total.device)
    return total, width


def _edges(bins: int, width: float) -> np.ndarray:
    """The 2 * bins + 1 bin edges, float32 (exact: small integers times a power of two)."""
    return ((np.arange(2 * bins + 1, dtype=np.float64) - bins) * width).astype(np.float32)


def percentile_edge(hist: np.ndarray, edges: np.ndarray, share: float) -> float:
    """onnxruntime's percentile rule on any histogram (``edges``: its ``hist.size + 1`` edges): the
    left edge of the bin where the cumulative share of the counts first reaches ``share``."""
    cdf = np.cumsum(hist / hist.sum())
    return float(edges[min(np.searchsorted(cdf, share), hist.size)])


def percentile_range(counts: torch.Tensor, width: float, lo: float, hi: float, percentile: float,
                     symmetric: bool) -> tuple[float, float]:
    """onnxruntime's percentile rule on a graphcal histogram: symmetric args take the edge where the
    cumulative share of |x| reaches ``percentile`` % (both signs folded), asymmetric ones cut
    ``(100 - percentile) / 2`` % from each tail of x; the result is kept within ``[lo, hi]``."""
    c = counts.detach().cpu().numpy()
    bins = c.size // 2
    if symmetric:
        folded = c[bins:] + c[:bins][::-1]  # |x| in [k w, (k+1) w)
        edges = (np.arange(bins + 1, dtype=np.float64) * width).astype(np.float32)
        right = percentile_edge(folded, edges, percentile / 100.0)
        low, high = -right, right
    else:
        edges = _edges(bins, width)
        cut = (100.0 - percentile) / 200.0
        low, high = percentile_edge(c, edges, cut), percentile_edge(c, edges, 1.0 - cut)
    return max(low, lo), min(high, hi)


def _smooth(p: np.ndarray, eps: float = 0.0001) -> np.ndarray | None:
    """Zeros replaced by ``eps``, the mass taken off the non-zero bins (float32); None if all zero."""
    zeros = (p == 0).astype(np.float32)
    n_zeros = zeros.sum()
    n_nonzeros = p.size - n_zeros
    if not n_nonzeros:
        return None
    eps1 = eps * float(n_zeros) / float(n_nonzeros)
    out = p.astype(np.float32)
    out += eps * zeros + (-eps1) * (p != 0).astype(np.float32)
    return out if eps1 < 1.0 and not (out <= 0).any() else None


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    """KL(p || q) of two unnormalised float32 distributions, in float32 (inf where q is 0 and p not)."""
    pk = p / np.sum(p)
    qk = q / np.sum(q)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = pk * np.log(pk / qk)
    terms[(pk == 0) & (qk >= 0)] = 0
    terms[~((pk > 0) & (qk > 0))] = np.inf
    return float(np.sum(terms))


def entropy_range(counts: torch.Tensor, width: float, lo: float, hi: float,
                  quantized_bins: int) -> tuple[float, float]:
    """:func:`entropy_window` on a graphcal histogram, kept within ``[lo, hi]``."""
    hist = counts.detach().cpu().numpy().astype(np.int64)
    low, high = entropy_window(hist, _edges(hist.size // 2, width), quantized_bins)
    return max(low, lo), min(high, hi)


def entropy_window(hist: np.ndarray, edges: np.ndarray, quantized_bins: int) -> tuple[float, float]:
    """onnxruntime's (TensorRT's) entropy rule on a signed histogram (int counts, ``hist.size + 1``
    edges): for each window around the zero bin, from ``quantized_bins`` bins wide to the whole
    histogram, the window's distribution (the bins outside folded into its end bins) against the
    window merged into ``quantized_bins`` levels and spread back over its non-empty bins; the
    window of least KL divergence (the first on a tie) gives its two edges."""
    size = hist.size
    zero = size // 2
    half_q = quantized_bins // 2
    below = np.concatenate(([0], np.cumsum(hist)))  # below[k] = hist[:k].sum()
    best, best_window = np.inf, None
    for i in range(half_q, zero + 1):
        start, end = zero - i, min(zero + i + 1, size)
        window = hist[start:end]
        p = window.copy()
        p[0] += below[start]
        p[-1] += below[size] - below[end]
        nonzero = (p != 0).astype(np.int64)
        merged = window.size // quantized_bins
        body = quantized_bins * merged
        levels = window[:body].reshape(quantized_bins, merged).sum(1)
        levels[-1] += window[body:].sum()
        norms = nonzero[:body].reshape(quantized_bins, merged).sum(1)
        share = np.zeros(quantized_bins, dtype=np.int64)
        filled = norms != 0
        share[filled] = (levels[filled] / norms[filled]).astype(np.int64)
        q = np.zeros(p.size, dtype=np.int64)
        q[:body] = np.repeat(share, merged)
        ps, qs = _smooth(p), _smooth(q)
        div = np.float32(np.inf) if ps is None or qs is None else np.float32(_kl(ps, qs))
        if div < best:
            best, best_window = div, (float(edges[start]), float(edges[end]))
    if best_window is None:  # every window's divergence is infinite: onnxruntime keeps the first
        best_window = (float(edges[zero - half_q]), float(edges[min(zero + half_q + 1, size)]))
    return best_window


class _HistogramObserver(Observer):
    """Accumulates a histogram of a per-tensor activation; the range is chosen from it at the end."""

    _stats_attrs = ("lo", "hi", "hist", "hist_width")
    _act_sync = {"lo": "min", "hi": "max", "hist": "histogram", "hist_width": "histogram"}
    default_bins = 4096

    def __init__(self, base_name: str, args, **observer_kwargs: Any):
        super().__init__(base_name, args, **observer_kwargs)
        if self.is_weight:
            raise ValueError(f"observer {self.observer_name!r} observes activations only; weights take "
                             "memoryless_minmax (or memoryless_mse for histogram_mse)")
        if self.strategy != QuantizationStrategy.TENSOR:
            raise ValueError(f"observer {self.observer_name!r} supports the 'tensor' strategy only "
                             f"(one histogram per tensor), not {self.strategy.value!r}")
        self.min_vals = self.max_vals = None

    def _validate_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs = dict(kwargs)
        kwargs["bins"] = check_int("bins", kwargs["bins"], low=2)
        if kwargs["bins"] % 2 or kwargs["bins"] > 1 << 20:
            raise ValueError(f"observer kwarg 'bins' must be even and at most {1 << 20}, got {kwargs['bins']!r}")
        return kwargs

    @torch.no_grad()
    def _update(self, observed: torch.Tensor) -> None:
        self._update_spanned(observed, *torch.aminmax(observed))

    @torch.no_grad()
    def _update_spanned(self, observed: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        low, high = torch.stack([lo, hi]).tolist()  # one read of the pair from the device (it sets the width)
        absmax = max(-low, high)
        self.hist, width = add_to_histogram(self.hist, self._width(), observed, absmax, self.kwargs["bins"])
        self.hist_width = torch.tensor(width, dtype=torch.float64)
        lo, hi = lo.reshape(1), hi.reshape(1)
        self.lo = lo if self.lo is None else torch.minimum(self.lo, lo)
        self.hi = hi if self.hi is None else torch.maximum(self.hi, hi)
        self.min_vals = self.max_vals = None  # chosen again when qparams are asked for

    def _width(self) -> float:
        return 0.0 if self.hist_width is None else float(self.hist_width)

    def state_bytes(self) -> int:
        """What the statistics hold from the first batch on: ``2 * bins`` float64 counts."""
        return 16 * self.kwargs["bins"]

    def merge(self, *others: Observer) -> Observer:
        self._check_peers(others)
        present = [o for o in (self, *others) if o.has_statistics]
        if not present:
            return self
        counts, width = merge_histograms([(o.hist, o._width()) for o in present])
        self.hist, self.hist_width = counts, torch.tensor(width, dtype=torch.float64)
        self.lo = torch.stack([o.lo.to(counts.device) for o in present]).amin(0)
        self.hi = torch.stack([o.hi.to(counts.device) for o in present]).amax(0)
        self.min_vals = self.max_vals = None
        return self

    def reset(self) -> None:
        super().reset()
        self.min_vals = self.max_vals = None

    def _finalize(self) -> None:
        if self.min_vals is not None or not self.has_statistics:
            return
        low, high = self._range(float(self.lo), float(self.hi))
        self.min_vals = torch.tensor([low], dtype=self.lo.dtype, device=self.lo.device)
        self.max_vals = torch.tensor([high], dtype=self.hi.dtype, device=self.hi.device)

    def _range(self, lo: float, hi: float) -> tuple[float, float]:
        raise NotImplementedError


@Observer.register_observer("percentile")
class PercentileObserver(_HistogramObserver):
    """The range holding ``percentile`` % of all calibration values (onnxruntime's Percentile)."""

    default_kwargs = {"percentile": 99.999, "bins": 4096}

    def _validate_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs = super()._validate_kwargs(kwargs)
        check_real("percentile", kwargs["percentile"], low=50.0, high=100.0)
        return kwargs

    def _range(self, lo: float, hi: float) -> tuple[float, float]:
        return percentile_range(self.hist, self._width(), lo, hi, self.kwargs["percentile"], self.args.symmetric)


@Observer.register_observer("entropy")
class EntropyObserver(_HistogramObserver):
    """The range of least KL divergence between the data and its quantized histogram (onnxruntime's Entropy)."""

    default_kwargs = {"bins": 1024, "quantized_bins": 128}

    def _validate_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs = super()._validate_kwargs(kwargs)
        kwargs["quantized_bins"] = check_int("quantized_bins", kwargs["quantized_bins"], low=2)
        if kwargs["quantized_bins"] > kwargs["bins"]:
            raise ValueError(f"observer kwarg 'quantized_bins' ({kwargs['quantized_bins']}) must be at most "
                             f"'bins' ({kwargs['bins']})")
        return kwargs

    def _range(self, lo: float, hi: float) -> tuple[float, float]:
        return entropy_range(self.hist, self._width(), lo, hi, self.kwargs["quantized_bins"])


@Observer.register_observer("histogram_mse")
class HistogramMSEObserver(_HistogramObserver):
    """llm-compressor's MSE search over the whole calibration set, scored on a fine histogram."""

    default_kwargs = {"bins": 32768, "maxshrink": 0.20, "patience": 5, "grid": 100.0, "norm": 2.4, "expand": 1.0}

    def _validate_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return validate_search_kwargs(super()._validate_kwargs(kwargs))

    def _range(self, lo: float, hi: float) -> tuple[float, float]:
        kw = self.kwargs
        bins, width = self.hist.numel() // 2, self._width()
        filled = torch.nonzero(self.hist).reshape(-1)
        centres = ((filled.to(torch.float64) - bins + 0.5) * width).to(torch.float32).view(1, 1, -1)
        counts = self.hist[filled].to(torch.float32).view(1, 1, -1)
        extrema = (self.lo.reshape(1) * kw["expand"], self.hi.reshape(1) * kw["expand"])
        steps = int(kw["maxshrink"] * kw["grid"])
        factors = [1 - i / kw["grid"] for i in range(steps)]
        low, high = shrink_search(centres, self.args, factors, norm=kw["norm"], patience=kw["patience"],
                                  extrema=extrema, scores=Scores(centres, kw["norm"], counts, torch.float32))
        return float(low), float(high)
