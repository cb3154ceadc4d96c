"""MSE observers: shrink the observed range to minimise the quantization error.

The search follows llm-compressor's eager (CPU) path: candidate ranges ``(min0*p, max0*p)``
with ``p = 1 - i/grid``, qparams from ``calculate_qparams`` without a global scale (and
without rounding the scale to ``scale_dtype`` for tensor_group), fake quantization with
plain broadcasting, error ``sum |q - x|^norm`` per qparam in the observed dtype, strict
``<`` improvements, and one global patience counter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
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
    "Scores",
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
    *,
    norm: float,
    patience: int | None,
    expand: float = 1.0,
    importance: torch.Tensor | None = None,
    error_dtype: torch.dtype | None = None,
    extrema: tuple[torch.Tensor, torch.Tensor] | None = None,
    scores: Scores | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Best ``(min, max)`` per qparam over candidate ranges ``(min0*p, max0*p)``.

    ``observed``: flattened ``(num_obs, *qparam_shape, group_size)``; returns two
    ``qparam_shape`` tensors in ``observed.dtype``. A candidate's error per qparam is
    ``sum(importance * |fake_quantize(x) - x|^norm)`` over dims (0, -1) (``importance`` shaped
    like ``observed``, None: uniform), in ``error_dtype`` (default: the observed dtype), with
    compressed-tensors' fake quantization under :func:`search_args`. ``patience`` counts
    consecutive steps in which no qparam improved (``None``: search every factor). ``extrema``: the
    starting ``(min0, max0)`` when they are not ``observed``'s own (times ``expand``); ``scores``: the
    errors when they are not ``observed``'s (graphcal.observers.histogram scores bin centres).

    The rules are llm-compressor's, step for step: strict ``<`` per qparam, one global patience
    counter. The work is not: candidates are scored a few at a time (:class:`Scores`), which
    changes how the errors are computed (see there) but not which candidate each qparam keeps.
    """
    candidate_args = search_args(args)
    if extrema is None:
        extrema = (torch.amin(observed, dim=REDUCE_DIMS) * expand, torch.amax(observed, dim=REDUCE_DIMS) * expand)
    min0, max0 = extrema
    scores = scores or Scores(observed, norm, importance, error_dtype or observed.dtype)
    best_err = torch.full(min0.shape, torch.finfo(scores.dtype).max, dtype=scores.dtype, device=min0.device)
    best_min, best_max = min0.clone(), max0.clone()
    factors = list(shrink_factors)
    stalled, start = 0, 0
    while start < len(factors):
        # as many candidates as can run before the patience could stop the search: none is wasted
        width = MAX_CANDIDATES if patience is None else min(MAX_CANDIDATES, patience - stalled + (start == 0))
        batch = factors[start:start + max(1, width)]
        start += len(batch)
        cand_min = torch.stack([min0 * p for p in batch])  # each p as llm-compressor scales it
        cand_max = torch.stack([max0 * p for p in batch])
        scale, zero_point = calculate_qparams(cand_min, cand_max, candidate_args)  # elementwise
        errors = scores(scale, zero_point, candidate_args)
        before = (best_err, best_min, best_max)
        best_err, best_min, best_max, improved = _keep_best(errors, cand_min, cand_max, *before, len(batch))
        for i, better in enumerate(improved.tolist()):  # the one host read of the batch's candidates
            if better:
                stalled = 0
                continue
            stalled += 1
            if patience is not None and stalled >= patience:
                if i < len(batch) - 1:  # stopped before the batch's last candidate: the best up to candidate i
                    best_err, best_min, best_max, _ = _keep_best(errors, cand_min, cand_max, *before, i + 1)
                return best_min, best_max
    return best_min, best_max


def _keep_best(errors, cand_min, cand_max, best_err, best_min, best_max, count: int):
    """The best ``(error, min, max)`` per qparam after the first ``count`` candidates (strict ``<``, in
    order), and whether each improved any qparam (a bool tensor, left on the device). A candidate
    that improves none leaves every value as it was, so the updates need not wait for the host."""
    improved = []
    for i in range(count):
        better = errors[i] < best_err
        improved.append(better.any())
        best_err = torch.where(better, errors[i], best_err)
        best_min = torch.where(better, cand_min[i], best_min)
        best_max = torch.where(better, cand_max[i], best_max)
    return best_err, best_min, best_max, torch.stack(improved)


#: candidates scored together (one read of each chunk of the tensor serves them all)
MAX_CANDIDATES = 8
#: elements of one chunk of (candidates x tensor): its scratch (4 MB on the CPU) stays in the last-level
#: cache; smaller chunks, in a core's own cache, lost more to the per-step overhead than they gained
CHUNK_ELEMENTS = {"cpu": 1 << 20, "cuda": 1 << 26}
#: exponents torch's pow computes by multiplication (exactly and fast); others go through exp/log
_EXACT_POWERS = (1.0, 2.0, 3.0)


class Scores:
    """Candidate errors ``sum(importance * |q - x|^norm)`` per qparam, for several candidates at once.

    fp32 tensors (what onnxruntime hands over, and fp32 weights) are scored in chunks of about a
    million elements (candidates x values), every candidate of the batch against one chunk while it is
    in cache, a weight seen through a transpose in its stored order (qparams last),
    with the elementwise steps of compressed-tensors' fake quantization, in place for int types
    (scale, add the zero point, clamp, round, subtract it, multiply; a symmetric zero point is zero
    and skipped) and through ``fake_quantize`` itself for float types. Three things differ from
    llm-compressor's eager code, in the last bits only: the sum is taken chunk by chunk; ``|e|^norm``
    for a norm torch does not compute by multiplication (2.4) is ``exp2(norm / ln 2 * log|e|)``
    (within 2e-6 of ``pow``, 3x cheaper; exp2 costs less than exp); and int candidates multiply by
    ``1/scale`` instead of dividing (half the cost), which rounds a value the other way only when it
    lies within an ulp of a half step (a few in ten million), where both ways leave an error of half
    a step. None of them moves a search off its candidate unless two candidates' errors agree to
    about a millionth (the tests check the searches against llm-compressor's eager ones). Other
    dtypes (fp16, bf16 weights) are scored one candidate at a time over the whole tensor in the
    observed dtype, llm-compressor's own way.
    """

    def __init__(self, observed: torch.Tensor, norm: float, importance: torch.Tensor | None,
                 dtype: torch.dtype):
        self.observed, self.norm, self.importance, self.dtype = observed, float(norm), importance, dtype
        self.fast = observed.dtype == torch.float32 and dtype == torch.float32
        self.qshape = tuple(observed.shape[1:-1])
        n, g = observed.shape[0], observed.shape[-1]
        x = observed.reshape(n, -1, g)  # (N, Q, G): Q qparams, reduced over N and G
        imp = None if importance is None else importance.expand_as(observed).reshape(n, -1, g)
        # a weight seen through a transpose (a MatMul's [in, out] as [out, in]) is scored as it lies,
        # (N, G, Q): read across its rows, every step of every candidate ran 3x slower
        self._qlast = self.fast and x.shape[1] > 1 and x.stride(1) == 1 and x.stride(2) != 1
        if self._qlast:
            x = x.transpose(1, 2)
            imp = None if imp is None else imp.transpose(1, 2)
        size = CHUNK_ELEMENTS.get(x.device.type, CHUNK_ELEMENTS["cpu"]) // MAX_CANDIDATES
        self._chunks = list(_chunks(x, imp, size, self._qlast))
        self._q = x.shape[2] if self._qlast else x.shape[1]
        self._buf: torch.Tensor | None = None

    def __call__(self, scale: torch.Tensor, zero_point: torch.Tensor, args: QuantizationArgs) -> torch.Tensor:
        """``(candidates, *qparam_shape)`` errors for candidate qparams ``(candidates, *qparam_shape)``."""
        if not self.fast:
            return torch.stack([self._eager(scale[i], zero_point[i], args) for i in range(scale.shape[0])])
        k, q = scale.shape[0], self._q
        shape, dims = ((k, 1, 1, q), (1, 2)) if self._qlast else ((k, 1, q, 1), (1, 3))
        scale = scale.reshape(shape)
        zero_point = zero_point.reshape(shape)
        is_int = enum_value(args.type) == "int" and scale.dtype == torch.float32
        q_range = tuple(float(v) for v in calculate_range(args, "cpu")) if is_int else None  # no device read
        inverse = torch.reciprocal(scale) if is_int else None
        out = torch.zeros(k, q, dtype=torch.float32, device=scale.device)
        whole = slice(0, q)

        def part(t: torch.Tensor, qs: slice) -> torch.Tensor:  # the chunk's qparams
            return t if qs == whole else t[..., qs] if self._qlast else t[:, :, qs]

        for qs, x, imp in self._chunks:
            if is_int:
                e = self._int_error(x, part(scale, qs), part(inverse, qs), part(zero_point, qs),
                                    args.symmetric, q_range)
            else:
                e = self._float_error(x, part(scale, qs), part(zero_point, qs), args)
            if imp is not None:
                e.mul_(imp)
            out[:, qs] += e.sum(dim=dims)
        return out.reshape(k, *self.qshape)

    def _int_error(self, x, scale, inverse, zero_point, symmetric: bool, q_range: tuple[float, float]) -> torch.Tensor:
        """``|fake_quantize(x) - x|^norm`` for every candidate, in one scratch buffer (``inverse``: 1/scale)."""
        size = scale.shape[0] * x.numel()
        if self._buf is None or self._buf.numel() < size:
            self._buf = torch.empty(size, dtype=x.dtype, device=x.device)
        buf = self._buf[:size].view(scale.shape[0], *x.shape)
        torch.mul(x, inverse, out=buf)
        zp = None if symmetric else zero_point.to(x.dtype)
        if zp is not None:
            buf.add_(zp)
        buf.clamp_(*q_range).round_()
        if zp is not None:
            buf.sub_(zp)
        torch.addcmul(x, buf, scale, value=-1, out=buf)  # x - q*s: -(q*s - x) exactly, as compressed-tensors rounds it
        return self._power(buf.abs_())

    def _float_error(self, x, scale, zero_point, args) -> torch.Tensor:
        q = fake_quantize(x.unsqueeze(0), scale, zero_point, args).to(x.dtype)
        return self._power(q.sub_(x).abs_())

    def _power(self, e: torch.Tensor) -> torch.Tensor:
        if self.norm in _EXACT_POWERS:
            return e.pow_(self.norm)
        return e.log_().mul_(self.norm / math.log(2)).exp2_()

    def _eager(self, scale, zero_point, args) -> torch.Tensor:
        """llm-compressor's eager error of one candidate, in its own dtypes."""
        x = self.observed
        q = fake_quantize(x, scale.unsqueeze(-1), zero_point.unsqueeze(-1), args).to(x.dtype)
        diff = (q.to(self.dtype) - x.to(self.dtype)).abs().pow(self.norm)
        if self.importance is not None:
            diff = self.importance * diff
        return diff.sum(dim=REDUCE_DIMS)


def _chunks(x: torch.Tensor, imp: torch.Tensor | None, size: int, qlast: bool = False):
    """``(qparam slice, x chunk, importance chunk)`` covering ``x`` (N, Q, G) in pieces of about ``size``
    elements (whole rows of G where they fit, then rows of N, then qparams); with ``qlast``, ``x`` is
    (N, G, Q) and a piece is whole rows of Q where they fit, then rows of G, then of N."""
    if qlast:
        n, g, q = x.shape
        qs = max(1, min(q, size))
        gs = max(1, min(g, size // qs))
        ns = max(1, min(n, size // (gs * qs)))
    else:
        n, q, g = x.shape
        gs = max(1, min(g, size))
        ns = max(1, min(n, size // gs))
        qs = max(1, min(q, size // (gs * ns)))
    for q0 in range(0, q, qs):
        for n0 in range(0, n, ns):
            for g0 in range(0, g, gs):
                where = ((slice(n0, n0 + ns), slice(g0, g0 + gs), slice(q0, q0 + qs)) if qlast else
                         (slice(n0, n0 + ns), slice(q0, q0 + qs), slice(g0, g0 + gs)))
                yield slice(q0, q0 + qs), x[where], None if imp is None else imp[where]


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
    steps = int(maxshrink * grid)
    factors = [1 - i / grid for i in range(steps)]
    return shrink_search(observed, args, factors, norm=norm, patience=patience, expand=expand)


def validate_search_kwargs(kwargs: dict[str, Any], *, shrunk_start: bool = False) -> dict[str, Any]:
    """Shared validation of maxshrink/patience/grid/norm/expand (returns normalised kwargs).

    ``expand`` below 1 is refused, as llm-compressor 0.14's MSE observers refuse it; ``shrunk_start``
    (the imatrix observers, which llm-compressor does not check) takes any ``expand > 0``.
    """
    out = dict(kwargs)
    check_real("maxshrink", out["maxshrink"], low=0.0, high=1.0)
    out["patience"] = check_int("patience", out["patience"], low=0)
    check_real("grid", out["grid"], low=0.0, low_open=True)
    check_real("norm", out["norm"], low=0.0, low_open=True)
    if shrunk_start:
        check_real("expand", out["expand"], low=0.0, low_open=True)
    else:
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
