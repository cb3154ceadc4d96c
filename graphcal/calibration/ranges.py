"""Per-channel ranges and row samples a pass over the data takes (SmoothQuant's statistics):
:class:`RangeSet`, consumers fed like observers (graphcal.calibration.observe.Consumers)."""

from __future__ import annotations

import torch
from compressed_tensors.quantization import QuantizationArgs

from graphcal.calibration.observe import Consumer, Consumers, Feed
from graphcal.graph.taps import Reduction, TapRequest
from graphcal.observers import Observer

SEARCH_ROWS = 256  # rows of each smoothed activation the search scores candidates on


class RangeSet(Consumers):
    """A running per-channel min/max observer on each tensor of ``tensors`` (name -> channels):
    the mappings' smooth-layer outputs, and in the single pass the activations they smooth."""

    def __init__(self, tensors: dict[str, int], others: list[Consumer] = (), sampled: list[str] = (),
                 batches: int | None = None, tolerate: bool = False):
        self.consumers = list(others)
        # --skip-nonfinite-weights: a range holding NaN or Inf (downstream of such a weight) is recorded
        # in nonfinite by the pass, not refused, and its mapping left out; the other observers' taps are not
        self.tolerant = frozenset(tensors) - {c.tensor for c in others} if tolerate else frozenset()
        self.nonfinite: set[str] = set()
        self.samples = {x: RowSample(SEARCH_ROWS, batches) for x in sampled}  # the strength search's rows
        self.consumers += [Consumer(x, Feed.INPUT, sample, None) for x, sample in self.samples.items()]
        self.ranges: dict[str, object] = {}  # tensor -> observer
        for tensor, channels in tensors.items():
            # group size 1: one min/max per channel, over every other dimension
            args = QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="group", group_size=1,
                                    dynamic=False, observer="static_minmax")
            obs = Observer.load_from_registry("static_minmax", base_name="input", args=args)
            self.ranges[tensor] = obs
            self.consumers.append(Consumer(tensor, Feed.INPUT, obs,
                                           TapRequest(tensor, Reduction.CHANNEL, channels)))

    def extrema(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {t: (o.min_vals.cpu(), o.max_vals.cpu()) for t, o in self.ranges.items() if o.has_statistics}

    def rows(self) -> dict[str, torch.Tensor]:
        """The sampled rows of each activation that got any."""
        return {x: sample.value() for x, sample in self.samples.items() if sample.kept}


class RowSample:
    """Up to ``rows`` rows of an activation, spread over the batches (SmoothQuant's strength search)."""

    takes_extrema = False
    observer_name = "smoothing strength search"

    def __init__(self, rows: int, batches: int | None):
        self.rows, self.per_batch = rows, max(1, -(-rows // batches)) if batches else rows
        self.kept: list[torch.Tensor] = []
        self.count = 0

    def __call__(self, x: torch.Tensor, extrema=None) -> None:  # extrema: as observers take them, unused
        if self.count >= self.rows:
            return
        flat = x.reshape(-1, x.shape[-1])
        take = min(self.per_batch, self.rows - self.count, flat.shape[0])
        index = torch.linspace(0, flat.shape[0] - 1, take, device=flat.device).round().long()
        self.kept.append(flat[index].float().cpu())
        self.count += take

    def value(self) -> torch.Tensor:
        return torch.cat(self.kept)

    # under torchrun nothing is exchanged: rank 0 scores its own sample (graphcal.calibration.distributed)
    sync_ops: dict = {}

    def state_dict_stats(self) -> dict:
        return {}
