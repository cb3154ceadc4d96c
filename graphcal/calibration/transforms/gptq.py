"""GPTQ as a stage: Hessians from the calibration data, then each weight rounded by graphcal.algorithms.gptq.math.

Two orders, as llm-compressor has them:

* **one-pass** (graphcal's; llm-compressor's ``pipeline="basic"``): the calibration pass reduces
  every quantized layer's input to ``x^T x`` inside onnxruntime (:class:`HessianObserver`, a
  GRAM tap), so no activation leaves the session; the weight pass then quantizes each weight with
  its Hessian. One pass over the data; every Hessian is held until the weight pass.
* **sequential** (llm-compressor's default): :class:`Sequential` is the weight pass's order. It
  takes the graph layer block by layer block (graph.blocks). Each block's subgraph runs on the
  cached outputs of the blocks before it, which were computed with their weights already
  quantized, so every Hessian sees the error of the layers before it; the weight pass quantizes
  and writes the block's weights, and the block runs again with them to give the next block its
  inputs. Two runs of each block in all (two passes over the
  data, as llm-compressor's calibration and propagation passes); one block's Hessians and the
  blocks' boundary tensors (the residual stream) are held at a time.

Either way the grid is the scheme's observer on the weight before GPTQ (llm-compressor fixes it
there), taken once, and the weight pass writes GPTQ's on-grid weight with those qparams. Under SmoothQuant
or AWQ the weights are the smoothed ones and the Hessians those of the smoothed inputs x/s
(tapped as x * (1/s) in the one-pass order; diag(1/s) H diag(1/s) in the sequential one).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from graphcal.calibration.blockwise import Blockwise
from graphcal.calibration.decisions import Loaded, RunPlan
from graphcal.calibration.observe import ObserverSet
from graphcal.calibration.seams import Member, PassSettings
from graphcal.calibration.transforms.base import Transform
from graphcal.calibration.transforms.channel_scales import ChannelScales
from graphcal.calibration.transforms.gptq_rounding import GPTQLog, block_grams, by_input, gptq_weights, walk_units
from graphcal.config import GPTQSettings
from graphcal.data import Calibration
from graphcal.errors import GraphcalError
from graphcal.limits import check_fits
from graphcal.progress import Progress

if TYPE_CHECKING:
    from graphcal.algorithms.gptq.hessian import HessianObserver

log = logging.getLogger("graphcal")


class OnePass:
    """The weight pass's rounding for the one-pass order: each weight with the Hessian of the
    activation it reads (from the calibration pass), which goes once its last reader is done."""

    def __init__(self, hessians: dict[str, HessianObserver], settings):
        self.hessians, self.settings, self.log = hessians, settings, GPTQLog()
        self._left: dict[int, int] = {}
        for obs in hessians.values():
            self._left[id(obs)] = self._left.get(id(obs), 0) + 1

    def units(self, all_units: list[list]) -> list[list]:
        """The weight pass's units in its own order: every Hessian is there already."""
        return all_units

    def __call__(self, members: list[Member]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for reading in by_input(members, lambda t: id(self.hessians[t.name])):
            obs = self.hessians[reading[0].target.name]
            if not obs.has_statistics:
                raise GraphcalError(f"{reading[0].target.name}: no activation reached its GPTQ Hessian")
            out.update(gptq_weights(reading, obs.value(), self.settings, self.log))
            self._left[id(obs)] -= len(reading)
            if not self._left[id(obs)]:
                obs.release()
        return out


def hessian_bytes(targets) -> int:
    """The fp32 Hessians of the distinct activations ``targets`` read, in bytes (held at once in the
    one-pass order)."""
    seen = {t.activation: t.in_features for t in targets}
    return sum(4 * n * n for n in seen.values())


def check_one_pass(run, world: int = 1) -> None:
    """Refuse the one-pass order when its Hessians (every distinct layer input's, fp32, held at once)
    would take more than half the memory available. Under torchrun (``world`` ranks) the exchange
    hands rank 0 every rank's copy and merges through one more: world + 1 copies there."""
    copies = 1 if world <= 1 else world + 1
    check_fits(copies * hessian_bytes(list(run.chosen)), "GPTQ's one-pass Hessians"
               + (f" ({copies} copies across the exchange of {world} ranks)" if copies > 1 else ""),
               hint="--gptq-order sequential holds one layer block's Hessians at a time")


def rounding_for(run: RunPlan, loaded: Loaded, observers: ObserverSet, calib: Calibration, settings: PassSettings,
                 scales: ChannelScales | None):
    """The weight pass's rounding the plan asks for: None (to nearest), GPTQ's one-pass order on the
    Hessians of the activation pass, or its sequential order, which the weight pass runs block by block."""
    gptq = run.config.gptq
    if gptq is None:
        return None
    if gptq.order == "one-pass":
        return OnePass(observers.hessians, gptq)
    if settings.dist is not None and scales is None:  # every rank's share: calibration.transforms.gptq_ranks
        from graphcal.calibration.transforms.gptq_ranks import WeightParallel  # lazy: torchrun's ranks only

        return WeightParallel(run, loaded, observers, calib, settings)
    if settings.dist is not None:
        log.info("GPTQ's sequential order after SmoothQuant or AWQ runs on rank 0 over all the data")
    return Sequential(run, loaded, calib, settings, scales)


class Sequential:
    """GPTQ layer block by layer block (llm-compressor's sequential pipeline with propagate_error),
    as the weight pass's order and rounding.

    The weight pass takes its fused units in the order :meth:`units` gives: block by block, and
    before each block's units, the Hessians of the block's inputs as the quantized blocks before it
    made them. It observes each weight (the run's one grid) and hands the unit here
    (:meth:`__call__`): GPTQ on that grid, and the weight pass writes the result at once. After a
    block's units, the block runs again with its rounded weights for the next block's inputs. No
    rounded weight is held past its block. The blocks run on the model as loaded (Blockwise's
    read-only frame and the original weights, made here before the weight pass starts), whatever
    the weight pass writes into the model meanwhile."""

    def __init__(self, run: RunPlan, loaded: Loaded, calib: Calibration, settings: PassSettings,
                 scales: ChannelScales | None):
        self.run, self.scales, self.settings, self.log = run, scales, run.config.gptq, GPTQLog()
        replaced = scales.replaced_initializers(loaded.model, run, {t.name for t in run.chosen}) if scales is not None else ()
        self.walk = Blockwise(run, loaded, calib, device=settings.device, device_id=settings.device_id,
                              replaced=frozenset(replaced),  # the frame and its weights made before the weight pass
                              cache_mb=settings.cache_mb, cache_folder=settings.cache_folder)
        self._hessians: dict[str, HessianObserver] = {}
        self._readers: dict[str, int] = {}  # the block's layers left to round with each Hessian
        self._effective: dict[str, torch.Tensor] = {}
        self._by_name = {t.name: t for t in run.chosen}

    def units(self, all_units: list[list]) -> Iterator[list]:
        """``all_units`` (the weight pass's) block by block, each block's Hessians taken before its
        units and the block run again with their rounded weights after them. The walk's cache is
        deleted when the blocks are done, or when the weight pass stops early."""
        bar = Progress("GPTQ blocks", len(self.walk.blocks), "block", bar=False)  # the log's progress lines
        with self.walk, bar, torch.no_grad():
            for k, units in walk_units(self.walk, self.run.chosen, all_units):
                self.observe_block(self.walk, k)
                yield from units
                self._hessians, self._readers = {}, {}
                needed = self.walk.needed(k)
                if needed:
                    # each rounded weight handed over in the form fed, its own copy let go as it is made
                    fed = {n: self.walk.feed_weight(self._by_name[n], self._effective.pop(n)) for n in list(self._effective)}
                    self.walk.keep(k, self.walk.run_block(k, needed, fed=fed))
                    del fed
                self._effective = {}
                bar.update(1)

    def observe_block(self, frame: Blockwise, k: int) -> None:
        """ONE block's statistics: the Hessians of block ``k``'s layer inputs, from its subgraph on
        ``frame`` run on the block's cached inputs (what the quantized blocks before it made)."""
        self._hessians = _block_hessians(frame, k)
        self._readers = {}
        for t in frame.blocks[k].targets:
            self._readers[t.activation] = self._readers.get(t.activation, 0) + 1

    def __call__(self, members: list[Member]) -> dict[str, torch.Tensor]:
        smoothed, out = self.scales, {}

        def key(t):  # one Hessian: the same input, smoothed by the same scales
            s = smoothed.column_scale(t) if smoothed is not None else None
            return t.activation, None if s is None else tuple(s.tolist())

        for reading in by_input(members, key):
            t0 = reading[0].target
            h = self._hessians[t0.activation].take().to(reading[0].weight.device)
            if smoothed is not None:
                h = smoothed.smooth_hessian(t0, h)
            rounded = gptq_weights(reading, h, self.settings, self.log)
            del h
            self._readers[t0.activation] -= len(reading)
            if not self._readers[t0.activation]:  # its last layer rounded: the Hessian goes now, not at the block's end
                self._hessians.pop(t0.activation).release()
            for name, q in rounded.items():
                out[name] = q
                q = q.cpu()
                self._effective[name] = smoothed.unsmooth(self._by_name[name], q) if smoothed is not None else q
        return out


def _block_hessians(walk: Blockwise, k: int) -> dict[str, HessianObserver]:
    """The Hessians of block ``k``'s inputs, from what the (quantized) blocks before it made."""
    from graphcal.algorithms.gptq.hessian import HessianObserver  # lazy: GPTQ's math loads with GPTQ only

    hessians: dict[str, HessianObserver] = {}
    for t in walk.blocks[k].targets:
        hessians.setdefault(t.activation, HessianObserver(t.in_features))
    block_grams(walk, k, {x: h.columns for x, h in hessians.items()},
                lambda x, i, g, sequences: hessians[x].add_gram(g, sequences))
    return hessians


@dataclass(frozen=True)
class GPTQRecord:
    """GPTQ's result: its order, how many layers it rounded, those rounded to nearest instead."""

    order: str
    layers: int
    rtn_fallback: tuple[str, ...] = ()
    read_data = True  # its Hessians: from the activation pass, or block by block

    def as_dict(self) -> dict:
        return {"order": self.order, "layers": self.layers, "rtn_fallback": list(self.rtn_fallback)}


class GPTQ(Transform):
    """GPTQ as one unit, the weight pass's rounding strategy (graphcal.calibration.seams.Rounding):
    its refusals, its rounding (:class:`OnePass` or :class:`Sequential`), its record and summaries."""

    settings_type = GPTQSettings
    key = "gptq"
    reads_blocks = True

    @classmethod
    def hessians_in_pass(cls, settings: GPTQSettings) -> bool:
        return settings.order == "one-pass"  # OnePass rounds with the activation pass's Hessians

    @classmethod
    def reads_data_per_block(cls, run: RunPlan, decision) -> bool:
        return run.config.gptq.order == "sequential"

    @classmethod
    def check(cls, run: RunPlan, calib: Calibration | None, dist, settings: PassSettings) -> None:
        if run.config.gptq.order == "one-pass":
            check_one_pass(run, dist.world if dist else 1)  # every Hessian is held until the weight pass

    @classmethod
    def rounding(cls, run: RunPlan, loaded: Loaded, observers: ObserverSet, calib: Calibration, settings: PassSettings,
                 scales: ChannelScales | None):
        return rounding_for(run, loaded, observers, calib, settings, scales)

    @classmethod
    def follow(cls, run: RunPlan, loaded: Loaded, observers: ObserverSet, calib: Calibration,
               settings: PassSettings) -> None:
        """Under torchrun, a rank other than 0's share of the sequential order (rank 0's rounding leads:
        :func:`rounding_for`): its batches through every block, the units it owns rounded."""
        gptq = run.config.gptq
        if gptq is None or gptq.order != "sequential" or settings.dist is None:
            return
        from graphcal.calibration.transforms.gptq_ranks import WeightParallel  # lazy: torchrun's ranks only

        WeightParallel(run, loaded, observers, calib, settings).follow()

    @classmethod
    def record(cls, run: RunPlan, done) -> GPTQRecord | None:
        rounding = done.rounding
        if rounding is None:
            return None
        return GPTQRecord(run.config.gptq.order, len(rounding.log.losses), tuple(rounding.log.rtn_fallback))

    @classmethod
    def result_lines(cls, record: GPTQRecord | None) -> list[str]:
        if record is None:
            return []
        order = "layer block by layer block" if record.order == "sequential" else "Hessians from one pass"
        return [f"GPTQ ({order}): {record.layers} weights rounded"
                + (f"; {len(record.rtn_fallback)} to nearest (Hessian not positive definite)"
                   if record.rtn_fallback else "")]

    @classmethod
    def result_json(cls, record: GPTQRecord | None):
        return record.as_dict() if record is not None else None

    @classmethod
    def inspect_lines(cls, run: RunPlan, decision, settings: GPTQSettings | None, blocks: list[str]) -> list[str]:
        if settings is None:
            return []
        g = settings
        return [f"gptq     {g.order}, block_size {g.block_size}, dampening_frac {g.dampening_frac:g}, actorder "
                f"{'static' if g.actorder == 'default' else g.actorder}"
                + (f"; {len(blocks)} layer blocks: {', '.join(blocks[:3])}"
                   + (" ..." if len(blocks) > 3 else "") if blocks else "")]

    @classmethod
    def inspect_json(cls, run: RunPlan, decision, settings: GPTQSettings | None, blocks: list[str]):
        return None if settings is None else {**asdict(settings), "blocks": blocks}
