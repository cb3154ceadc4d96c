"""AWQ's weight clipping: the original AWQ's clip search (llm-compressor 0.14's AWQModifier has none).

    per quantized layer (after its scales are chosen; q and k too, which the original leaves out,
    see docs/gptq_awq.md):
      for each shrink r in 1, 0.95, ..., 0.55 (``N_GRID`` 20, ``MAX_SHRINK`` 0.5):
        W_r = clamp(W, -r * max|W_g|, r * max|W_g|) per row and quantization group g
        error[row, g] = d_g G_gg d_gᵀ,  d = Q(W_r) - W  (Q: a memoryless min-max grid of W_r)
      --> per row and group, the bound with the least error (the first on ties; r = 1 changes nothing)
    on an asymmetric grid (range from the group's least value to its greatest, zero point) each end
    is shrunk on its own, graphcal's extension: the high end through the same r with the low end
    kept, then the low end with the chosen high end (a ±bound there would only ever cut the wider end)

The error is what the original AWQ computes on sampled tokens as the mean of
``(x_g · (Q(W_r)_g - W_g))²``, the group's share of the layer's output error, here exactly from
every token through the input's Gram matrix G (``sum over tokens of x xᵀ``, its diagonal blocks).
The bounds set the grid, not the weight: the weight pass's observer sees the clamped weight (so a
min-max grid ends at the bound) and the unclamped weight is rounded on it. Rounded to nearest, what
lies past the bound saturates exactly as the clamp would; GPTQ (``awq+gptq``) also carries that
part of the error into the columns it has not rounded yet, where clamping first would lose it.

Integer weights in channel or group strategy only (a float grid or a per-tensor one has no
per-group range to clip). :func:`clip_layers` picks the layers (the plan calls it); the rest is
torch math.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize

from graphcal.algorithms.awq.math import SEARCH_OBSERVER, search_args
from graphcal.observers import Observer
from graphcal.types import enum_value

N_GRID = 20
MAX_SHRINK = 0.5


def group_size(args: QuantizationArgs | None, columns: int) -> int | None:
    """The columns one clip bound covers (a group, or the whole row), or None where clipping does not apply."""
    if args is None or enum_value(args.type) != "int":
        return None
    strategy = enum_value(args.strategy)
    if strategy == "channel":
        return columns
    if strategy == "group" and args.group_size and columns % int(args.group_size) == 0:
        return int(args.group_size)
    return None


def clip_layers(targets, schemes) -> tuple[str, ...]:
    """Of ``targets`` (with their ``schemes``), the ones AWQ's clip search takes: every layer with
    integer channel or group weights, q and k (and a packed q/k/v) included."""
    return tuple(t.name for t in targets if t.name in schemes
                 and group_size(schemes[t.name].weights, t.in_features) is not None)


def _fake_quantize(w: torch.Tensor, args: QuantizationArgs) -> torch.Tensor:
    """``w`` rounded on a memoryless min-max grid of itself (AWQ's search grid), whatever the scheme's observer."""
    search = search_args(args)
    observer = Observer.load_from_registry(SEARCH_OBSERVER, base_name="weight", args=search)
    observer(w)
    q = observer.get_qparams()
    return fake_quantize(w, q["scale"], q["zero_point"], search, global_scale=q["global_scale"])


def _errors(d: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``d_g G_gg d_gᵀ`` per row and group; ``d`` [out, groups, size], ``blocks`` [groups, size, size]."""
    return (torch.einsum("ogi,gij->ogj", d, blocks) * d).sum(dim=-1, dtype=torch.float64)


def clip(w: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """``w`` [out, in] clamped per row and group to ``bound`` [out, groups, 2] (each group's low and
    high bound), in its dtype."""
    out, columns = w.shape
    groups = bound.shape[1]
    b = bound.to(w.device, torch.float32)
    grouped = w.float().reshape(out, groups, columns // groups)
    return torch.maximum(torch.minimum(grouped, b[:, :, 1:]), b[:, :, :1]).reshape(out, columns).to(w.dtype)


@dataclass(frozen=True)
class Clipped:
    """What :func:`search` found: the bounds, the summed output error before and after (over the
    Gram matrix's tokens, unnormalised), and the share of groups whose range it shrank."""

    bound: torch.Tensor  # [out, groups, 2]: each group's low and high bound
    before: float
    after: float
    shrunk: float


def search(w: torch.Tensor, args: QuantizationArgs, gram: torch.Tensor, n_grid: int = N_GRID,
           max_shrink: float = MAX_SHRINK) -> Clipped | None:
    """The clip bounds of each row and group of ``w`` [out, in] against the input's Gram matrix
    ``gram`` [in, in]. None where ``args`` leave nothing to clip.

    Symmetric grids: the bound ``±r * max|W_g|`` (the original AWQ's). Asymmetric grids, whose range
    runs from the group's least value to its greatest, shrink each end on its own: the high end first
    (the low one kept), then the low end with the high one chosen; each end through the same shrinks r.
    """
    out, columns = w.shape
    size = group_size(args, columns)
    if size is None:
        return None
    groups = columns // size
    g = gram.to(torch.float32)
    blocks = torch.stack([g[k * size:(k + 1) * size, k * size:(k + 1) * size] for k in range(groups)])
    wf = w.float()
    grouped = wf.reshape(out, groups, size)
    if args.symmetric is False:  # each end on its own: the high one (index 1), then the low one (0)
        low, high = grouped.amin(dim=-1).clamp(max=0), grouped.amax(dim=-1).clamp(min=0)
        ends = [(1, high), (0, low)]
    else:  # both ends together: ±r * peak
        high = grouped.abs().amax(dim=-1)
        low = -high
        ends = [(None, high)]
    full = torch.stack([low, high], dim=-1)

    def error(bound: torch.Tensor) -> torch.Tensor:
        trial = _fake_quantize(clip(wf, bound), args).float()
        return _errors((trial - wf).reshape(out, groups, size), blocks)

    best = full.clone()
    least = before = error(best)
    for side, end in ends:
        for step in range(1, int(max_shrink * n_grid)):
            r = end * (1 - step / n_grid)
            trial = best.clone()
            if side is None:
                trial[..., 0], trial[..., 1] = -r, r
            else:
                trial[..., side] = r
            err = error(trial)
            better = err < least
            least = torch.where(better, err, least)
            best = torch.where(better[..., None], trial, best)
    shrunk = float((best != full).any(dim=-1).float().mean())
    return Clipped(best, float(before.sum()), float(least.sum()), shrunk)
