"""AWQ's scale search: llm-compressor 0.14's AWQModifier as torch math, the parent network abstracted.

    per mapping (smooth layer -> balance layers, run together by a parent sub-network):
      AbsMean: per input channel of the balance layers, mean |x| over every token of every batch
      weight_mean: per input column, the mean over rows of |W| / (max |W| of its quantization chunk)
      grid(duo_scaling, n_grid): the (ratio, duo) points, in llm-compressor's order
      search: for each point s = candidate_scales(x_mean, w_mean, ratio, duo); each balance weight
              W <- Q(W * s) / s (memoryless min-max qparams of W * s, whatever observer the scheme names);
              loss = MSE of the parent's output against its output with the original weights;
              the first strictly smallest loss wins
      apply / divide: balance weights W * s (input columns), the smooth layer's output over s
              (a norm's weight and bias, or a linear layer's last len(s) output rows)

The parent is the caller's business: ``search`` takes a callable that runs it on every cached
calibration batch with the balance weights replaced and yields each batch's output (on the ONNX
side, a sub-graph under onnxruntime; in the tests, a torch block), wrapped as :class:`ParentLoss`;
or, for a parent that is one linear layer, ``gram.LayerLoss``, the same MSE from the input's Gram
matrix with no run at all. Nothing here knows about graphs.

Source: ``shared/reference/algorithms.md`` §4 (statistics §4.3, grid search and application §4.4) and
the bit-exactness notes of §7, checked against its ``awq`` test vectors (tests/algorithms/test_awq.py): sums of
|x| and the loss in fp32, w_mean and duo-scaled scales in fp64, every weight change computed in fp64
and rounded once to the weight's dtype (identical to torch's type promotion for one * or /).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize

from graphcal.algorithms.awq.gram import LayerLoss
from graphcal.observers import Observer, share_global_scale
from graphcal.types import enum_value

log = logging.getLogger("graphcal")

MINIMUM_SCALE = 1e-4  # the clamp of a candidate scale, and the epsilon added to w_mean^(1-ratio)
CHUNK_EPSILON = 1e-6  # added to each quantization chunk's max |W| in weight_mean
SEARCH_OBSERVER = "memoryless_minmax"  # forced during the search, whatever the scheme's observer
#: dtypes where one * or / of two values is bit for bit the fp64 result rounded once (fp64's 53 bits are at
#: least twice theirs plus 2, so the double rounding is innocuous): computed there, sparing two conversions
ONE_ROUNDING = (torch.float32, torch.float16, torch.bfloat16)


def _one_rounding(*dtypes: torch.dtype) -> bool:
    """All of ``dtypes`` one dtype of ONE_ROUNDING: one * or / there is the fp64 result rounded once."""
    return len(set(dtypes)) == 1 and dtypes[0] in ONE_ROUNDING

#: what ``parent`` takes and yields: balance name -> torch [out, in] weight; one output per cached batch
Parent = Callable[[dict[str, torch.Tensor]], Iterable[torch.Tensor]]


class AbsMean:
    """Per input channel mean of |x| over tokens, as llm-compressor's activation hook accumulates it.

    ``update(x)`` takes a batch ``(..., channels)``: |x| in the input's dtype, flattened to
    ``(tokens, channels)``, summed over tokens in fp32. ``add_sums`` folds in sums reduced elsewhere
    (inside onnxruntime). ``value()`` is ``sum / count`` (fp32).
    """

    def __init__(self) -> None:
        self.sum: torch.Tensor | None = None
        self.count = 0

    def update(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Fold in one batch; ``mask`` (shaped like ``x`` without its last dim): only tokens where it
        is nonzero count (llm-compressor's optional ``loss_mask``)."""
        flat = x.abs().reshape(-1, x.shape[-1])
        if mask is not None:
            flat = flat[mask.reshape(-1).to(flat.device) != 0]
        self.add_sums(flat.float().sum(dim=0), flat.shape[0])

    def add_sums(self, abs_sum: torch.Tensor, count: int) -> None:
        """Fold in ``abs_sum`` (per channel, summed over ``count`` tokens)."""
        abs_sum = abs_sum.float().reshape(-1)
        if self.sum is not None and self.sum.shape != abs_sum.shape:
            raise ValueError(f"AbsMean: {abs_sum.numel()} channels after {self.sum.numel()}")
        self.sum = abs_sum.clone() if self.sum is None else self.sum + abs_sum.to(self.sum.device)
        self.count += int(count)

    def value(self) -> torch.Tensor:
        if self.sum is None or self.count == 0:
            raise ValueError("AbsMean: no tokens were seen")
        return self.sum / self.count


def grid(duo_scaling: bool | str = True, n_grid: int = 20) -> list[tuple[float, bool]]:
    """The search's ``(ratio, duo)`` points in llm-compressor's order.

    True: ``(0, False)`` (the identity), then ``(k / (n_grid - 2), True)`` for k = 0 ... n_grid - 2;
    False: ``(k / (n_grid - 1), False)`` for k = 0 ... n_grid - 1; "both": with m = n_grid // 2,
    ``(k / (m - 1), False), (k / (m - 1), True)`` for k = 0 ... m - 1.

    Where llm-compressor divides by zero or searches an empty grid (True with n_grid 2, False with
    n_grid < 2, "both" with n_grid < 4) this raises ValueError; True with n_grid < 2 (only the
    identity would be tried) is refused as well.
    """
    if isinstance(n_grid, bool) or not isinstance(n_grid, int):
        raise ValueError(f"AWQ n_grid must be an integer, got {n_grid!r}")
    if duo_scaling is True:
        if n_grid < 3:
            raise ValueError(f"AWQ n_grid must be at least 3 with duo_scaling true, got {n_grid}")
        return [(0.0, False)] + [(k / (n_grid - 2), True) for k in range(n_grid - 1)]
    if duo_scaling is False:
        if n_grid < 2:
            raise ValueError(f"AWQ n_grid must be at least 2 with duo_scaling false, got {n_grid}")
        return [(k / (n_grid - 1), False) for k in range(n_grid)]
    if duo_scaling == "both":
        if n_grid < 4:
            raise ValueError(f"AWQ n_grid must be at least 4 with duo_scaling 'both', got {n_grid}")
        m = n_grid // 2
        return [(k / (m - 1), duo) for k in range(m) for duo in (False, True)]
    raise ValueError(f"AWQ duo_scaling must be true, false or 'both', got {duo_scaling!r}")


def _chunk_normalised(w: torch.Tensor, args: QuantizationArgs) -> torch.Tensor:
    """|W| divided by the max |W| (+ 1e-6) of its quantization chunk, in the weight's dtype, [out, in]."""
    a = w.abs()
    rows, cols = a.shape
    strategy = enum_value(args.strategy)
    if strategy == "tensor":
        return a / (a.max() + CHUNK_EPSILON)
    if strategy == "channel":
        return a / (a.amax(dim=1, keepdim=True) + CHUNK_EPSILON)
    if strategy in ("group", "tensor_group"):
        g = args.group_size
        if not g or cols % g:
            raise ValueError(f"AWQ: {cols} input columns are not a multiple of the group size {g}")
        chunks = a.reshape(rows, cols // g, g)
        return (chunks / (chunks.amax(dim=-1, keepdim=True) + CHUNK_EPSILON)).reshape(rows, cols)
    if strategy == "block":
        bh, bw = args.block_structure
        br, bc = -(-rows // bh), -(-cols // bw)
        padded = torch.nn.functional.pad(a, (0, bc * bw - cols, 0, br * bh - rows))  # zeros do not change a max of |W|
        block_max = padded.reshape(br, bh, bc, bw).amax(dim=(1, 3))
        denominator = block_max.repeat_interleave(bh, 0).repeat_interleave(bw, 1)[:rows, :cols]
        return a / (denominator + CHUNK_EPSILON)
    raise ValueError(f"AWQ cannot search weights quantized with strategy {strategy!r}")


def weight_mean(weights: Sequence[torch.Tensor], args_list: Sequence[QuantizationArgs | None]) -> torch.Tensor:
    """Per input column, fp64: the chunk-normalised |W| summed over the rows of every balance layer
    that has a weight scheme, over the number of those rows (llm-compressor's ``_compute_layer_means``)."""
    total: torch.Tensor | None = None
    rows = 0
    for w, args in zip(weights, args_list, strict=True):
        if args is None:
            continue
        column_sums = _chunk_normalised(w, args).sum(dim=0, dtype=torch.float64)
        total = column_sums if total is None else total + column_sums
        rows += w.shape[0]
    if total is None:
        raise ValueError("AWQ weight_mean: no balance layer has a weight scheme")
    return total / rows


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor | None, ratio: float, duo: bool) -> torch.Tensor:
    """One grid point's s: ``x_mean^r / (w_mean^(1-r) + 1e-4)`` with duo scaling (fp64, as w_mean is),
    ``x_mean^r`` without (x_mean's dtype); clamped at 1e-4, divided by sqrt(max(s) * min(s)), inf and
    nan entries set to 1."""
    if duo:
        if w_mean is None:
            raise ValueError("AWQ: duo scaling needs the weight mean")
        s = x_mean.pow(ratio) / (w_mean.to(x_mean.device).pow(1 - ratio) + MINIMUM_SCALE)
    else:
        s = x_mean.pow(ratio)
    s = s.clamp(min=MINIMUM_SCALE)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


def apply(weight: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """A balance weight ``[out, in]`` with its input columns times s: fp64, rounded once to its dtype."""
    if weight.dim() != 2 or weight.shape[1] != s.numel():
        raise ValueError(f"AWQ apply: weight {tuple(weight.shape)} does not take {s.numel()} scales")
    if _one_rounding(weight.dtype, s.dtype):
        return weight * s.to(weight.device)[None, :]
    return (weight.double() * s.double().to(weight.device)[None, :]).to(weight.dtype)


def divide(param: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The smooth layer's parameter over s: a 1-D norm weight or bias, or a 2-D linear weight's last
    ``len(s)`` output rows (a 1-D linear bias: its last ``len(s)`` entries); fp64, rounded once."""
    n = s.numel()
    s = s.double().to(param.device)
    if param.dim() not in (1, 2) or param.shape[0] < n:
        raise ValueError(f"AWQ divide: parameter {tuple(param.shape)} cannot be divided by {n} scales")
    out = param.clone()
    if param.dim() == 1:
        out[-n:] = (param[-n:].double() / s).to(param.dtype)
    else:
        out[-n:] = (param[-n:].double() / s[:, None]).to(param.dtype)
    return out


def search_args(args: QuantizationArgs) -> QuantizationArgs:
    """The scheme's args with the search's observer (its own observer kwargs would not fit it)."""
    return args.model_copy(update={"observer": SEARCH_OBSERVER, "observer_kwargs": {}}, deep=True)


def quantize_scaled(weights: dict[str, torch.Tensor], args: dict[str, QuantizationArgs | None], s: torch.Tensor,
                    fused_global_scale: Iterable[Iterable[str]] = ()) -> dict[str, torch.Tensor]:
    """Every balance weight as one grid point evaluates it: ``Q(W * s) / s`` in the weight's dtype, with
    qparams from a memoryless min-max observer of ``W * s``; weights without args are returned as they are.

    ``fused_global_scale``: groups of balance names (a fused q/k/v or gate/up) whose TENSOR_GROUP
    observers share one global scale, from the joint absmax of their scaled weights.
    """
    scaled: dict[str, torch.Tensor] = {}
    observers: dict[str, Observer] = {}
    for name, w in weights.items():
        if args.get(name) is None:
            continue
        scaled[name] = apply(w, s)
        observers[name] = Observer.load_from_registry(SEARCH_OBSERVER, base_name="weight", args=search_args(args[name]))
    for group in fused_global_scale:
        members = [observers[n] for n in group if n in observers]
        if len(members) > 1 and all(enum_value(o.args.strategy) == "tensor_group" for o in members):
            share_global_scale(members)
    for name, obs in observers.items():
        obs(scaled[name])
    out = dict(weights)
    for name, obs in observers.items():
        q = obs.get_qparams()
        fq = fake_quantize(scaled[name], q["scale"], q["zero_point"], obs.args, global_scale=q["global_scale"])
        if _one_rounding(s.dtype, fq.dtype, weights[name].dtype):
            out[name] = fq / s.to(fq.device)[None, :]
        else:
            out[name] = (fq.double() / s.double().to(fq.device)[None, :]).to(weights[name].dtype)
    return out


def _first(y):
    """A parent's output (the first element where it yields tuples)."""
    return y[0] if isinstance(y, (tuple, list)) else y


def _outputs(parent: Parent, weights: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The parent's output per cached batch."""
    return [_first(y) for y in parent(dict(weights))]


def mean_squared_error(references: Sequence[torch.Tensor], outputs: Iterable[torch.Tensor]) -> torch.Tensor:
    """``sum over batches of sum (ref - out)^2, over the total element count``, accumulated in fp32 where
    the references lie (a 0-d tensor: nothing leaves the GPU). ``outputs`` may be a generator: each
    batch is scored as it comes and dropped."""
    total, count, seen = None, 0, 0
    for out in outputs:
        seen += 1
        if seen > len(references):
            continue  # refused below, with the count
        ref, out = references[seen - 1], _first(out)
        if ref.shape != out.shape:
            raise ValueError(f"AWQ: parent output {tuple(out.shape)} against reference {tuple(ref.shape)}")
        if total is None:
            total = torch.zeros((), dtype=torch.float32, device=ref.device)
        total = total + torch.nn.functional.mse_loss(ref.float(), out.float().to(ref.device), reduction="sum")
        count += ref.numel()
    if seen != len(references):
        raise ValueError(f"AWQ: the parent yielded {seen} batches, the reference {len(references)}")
    return (torch.zeros((), dtype=torch.float32) if total is None else total) / count


def loss(references: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> float:
    """:func:`mean_squared_error` as a Python float."""
    return mean_squared_error(references, outputs).item()


class ParentLoss:
    """llm-compressor's objective: the MSE of the parent sub-network's output against its output
    with the original weights, over every cached batch."""

    def __init__(self, parent: Parent):
        self.parent, self.references = parent, None

    def prepare(self, weights: dict[str, torch.Tensor]) -> str | None:
        """Run the reference; a reason to skip the mapping (no batch, a non-finite output), or None."""
        self.references = _outputs(self.parent, weights)
        if not self.references:
            return "yielded no batch"
        if not bool(torch.stack([torch.isfinite(r).all().to(self.references[0].device) for r in self.references]).all()):
            return "gives non-finite outputs"
        return None

    def score(self, trial: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss of ``trial`` as a 0-d tensor where the parent's outputs lie (no sync)."""
        return mean_squared_error(self.references, self.parent(dict(trial)))

    def __call__(self, trial: dict[str, torch.Tensor]) -> float:
        return self.score(trial).item()


def _as_floats(values: Sequence) -> list[float]:
    """The grid's losses as Python floats: 0-d tensors read in one go (one sync on the GPU), the
    value each would give alone (``.item()``)."""
    if values and all(isinstance(v, torch.Tensor) for v in values) and len({(v.dtype, v.device) for v in values}) == 1:
        return torch.stack([v.reshape(()) for v in values]).tolist()
    return [float(v) for v in values]


@dataclass(frozen=True)
class AWQResult:
    """One mapping's search: the best scales and everything llm-compressor records about it."""

    scales: torch.Tensor  # the best s (fp64 from a duo point, x_mean's dtype otherwise)
    grid: tuple[tuple[float, bool], ...]
    losses: tuple[float, ...]  # aligned with grid
    best_index: int
    x_mean: torch.Tensor
    w_mean: torch.Tensor | None  # None without duo scaling

    @property
    def initial_error(self) -> float:
        """The loss of the first grid point, the identity scale (plain round-to-nearest)."""
        return self.losses[0]

    @property
    def best_error(self) -> float:
        return self.losses[self.best_index]

    @property
    def reduction(self) -> float:
        """best_error / initial_error (1.0 where the initial error is 0)."""
        return self.best_error / self.initial_error if self.initial_error else 1.0

    def error_metrics(self, layer_name: str, parent_name: str) -> dict:
        """The record llm-compressor keeps per mapping (its ``_error_metrics`` entry)."""
        return {"layer_name": layer_name, "parent_name": parent_name, "initial_error": self.initial_error,
                "best_error": self.best_error, "reduction": self.reduction}


def search(x_mean: torch.Tensor, weights: dict[str, torch.Tensor], args: dict[str, QuantizationArgs | None],
           parent: Parent | ParentLoss | LayerLoss,
           *, duo_scaling: bool | str = True, n_grid: int = 20,
           fused_global_scale: Iterable[Iterable[str]] = ()) -> AWQResult | None:
    """The grid search of one mapping.

    ``x_mean``: :class:`AbsMean`'s value for the balance layers' input; ``weights``: balance name ->
    original torch [out, in] weight; ``args``: balance name -> its weight QuantizationArgs (missing or
    None: no scheme, the weight stays as it is during the search); ``parent``: runs the parent
    sub-network on every cached batch with the given balance weights, yielding each output (or a :class:`LayerLoss`);
    ``fused_global_scale``: see :func:`quantize_scaled`.

    Returns None (with a warning) where llm-compressor skips the mapping and changes nothing: the
    parent yields no batch, or its reference output is not finite. Raises ValueError for a TENSOR
    weight strategy with duo scaling, a bad grid, no balance weight with a scheme, or no finite loss.
    """
    points = grid(duo_scaling, n_grid)
    names = list(weights)
    schemes = {n: args.get(n) for n in names}
    unknown = set(args) - set(names)
    if unknown:
        raise ValueError(f"AWQ: args for layers that are not balance layers: {sorted(unknown)}")
    if all(a is None for a in schemes.values()):
        raise ValueError("AWQ: no balance layer has a weight scheme; there is nothing to search")
    fused = [list(g) for g in fused_global_scale]
    stray = {n for g in fused for n in g} - set(names)
    if stray:
        raise ValueError(f"AWQ: fused groups name layers that are not balance layers: {sorted(stray)}")
    for n, a in schemes.items():
        if a is None:
            continue
        if weights[n].dim() != 2 or weights[n].shape[1] != x_mean.numel():
            raise ValueError(f"AWQ: balance weight {n} {tuple(weights[n].shape)} does not read {x_mean.numel()} channels")
        if duo_scaling is not False and enum_value(a.strategy) == "tensor":
            raise ValueError(f"AWQ duo scaling cannot be used with the TENSOR weight strategy ({n}); set duo_scaling false")
    w_mean = None
    if duo_scaling is not False:
        w_mean = weight_mean([weights[n] for n in names], [schemes[n] for n in names])

    objective = parent if isinstance(parent, (ParentLoss, LayerLoss)) else ParentLoss(parent)
    skip = objective.prepare(weights)
    if skip is not None:
        log.warning("AWQ: the parent of %s %s; mapping skipped", ", ".join(names), skip)
        return None

    score = getattr(objective, "score", objective)  # a 0-d tensor where the objective computes: no sync per point
    values, candidates = [], []
    for ratio, duo in points:
        s = candidate_scales(x_mean, w_mean, ratio, duo)
        trial = quantize_scaled(weights, schemes, s, fused)
        values.append(score(trial))
        candidates.append(s)
    losses = _as_floats(values)  # the mapping's one host read
    best_index, best_loss, best_scales = -1, math.inf, None
    for i, value in enumerate(losses):
        if value < best_loss:  # strict: ties keep the first point; nan never wins
            best_index, best_loss, best_scales = i, value, candidates[i]
    if best_scales is None:
        raise ValueError(f"AWQ: no grid point gave a finite loss for {', '.join(names)} (losses {losses})")
    log.debug("AWQ %s: best point %s of %d, loss %.6g (identity %.6g)", ", ".join(names), points[best_index],
              len(points), best_loss, losses[0])
    return AWQResult(scales=best_scales, grid=tuple(points), losses=tuple(losses), best_index=best_index,
                     x_mean=x_mean, w_mean=w_mean)
