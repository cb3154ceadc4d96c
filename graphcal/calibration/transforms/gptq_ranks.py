"""Sequential GPTQ under torchrun: the block runs data-parallel, the rounding weight-parallel (llm-compressor's DDP GPTQ).

Every rank walks the layer blocks with its own share of the batches (calibration.blockwise.Blockwise
with ``rank=``: batches ``rank, rank + N, ...``, and only those cached). For block ``k``, on every rank:

1. its batches through the block's subgraph: each layer input's ``x^T x`` per batch (gptq.block_grams);
   rank 0 also takes each weight's grid (the weight pass's observer, on a copy: observe_unit), as the
   weight pass will take it;
2. check-in (distributed.exchange): every rank's error, if any, and rank 0's grids;
3. the block's fused units (Sequential's units: q/k/v, gate/up, the others alone) go to owner ranks by a
   greedy bin-packing of in_features^2 * out_features (:func:`owners`, the same on every rank); each
   owner is sent the Hessian contributions of its units' inputs (distributed.gather_to, rank order);
4. each owner sums them and runs GPTQ on its units (gptq.gptq_weights, as one process does) on the
   grids rank 0 took and the weights in its own copy of the model; it broadcasts the rounded weights
   (or its error) to every rank (distributed.broadcast_from);
5. rank 0's weight pass writes the block's units with them (:meth:`WeightParallel.__call__`), and
   every rank runs the block again with them on its own batches for the next block's inputs.

The Hessians: a rank sends the grams of each of its batches, and the owner adds them in the batch
order one process uses, so the Hessian, and the output, are one process's bit for bit; where the
grams of one block over all the batches would pass ``GRAPHCAL_GPTQ_EXACT_MB`` (default 1024 MB), each
rank sends its partial sum instead (one Hessian per input), which the owner adds in rank order: the same Hessian up
to fp32 rounding (~1e-7 relative), which can flip a rare code. docs/distributed.md says more.

A failure on any rank reaches every rank at the next step they take together, so every rank ends
with an ``error:`` line: rank 0's weight pass calls :meth:`WeightParallel.abort` when it fails between two.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from collections.abc import Iterator

import torch

from graphcal.calibration.blockwise import Blockwise
from graphcal.calibration.decisions import Loaded, RunPlan
from graphcal.calibration.distributed import broadcast_from, exchange, gather_to, raise_first
from graphcal.calibration.observe import ObserverSet
from graphcal.calibration.seams import Member, PassSettings
from graphcal.calibration.transforms.gptq_rounding import GPTQLog, block_grams, by_input, gptq_weights, walk_units
from graphcal.data import Calibration
from graphcal.devices import observer_device
from graphcal.errors import GraphcalError
from graphcal.graph.fusion import fused_units
from graphcal.graph.targets import weight_tensor
from graphcal.progress import Progress
from graphcal.types import QuantizedTarget, Target

log = logging.getLogger("graphcal")

EXACT_ENV = "GRAPHCAL_GPTQ_EXACT_MB"
EXACT_MB = 1024  # one block's grams over all the batches sent per batch up to this; partial sums beyond


def unit_cost(unit: list[Target]) -> int:
    """GPTQ's work on one fused unit, for the bin-packing: in_features^2 * the unit's rows."""
    return unit[0].in_features ** 2 * sum(t.out_features for t in unit)


def owners(costs: list[int], world: int) -> list[int]:
    """Each unit's owner rank: largest cost first (ties: the earlier unit), to the least loaded rank
    (ties: the lower rank). Deterministic: every rank computes the same."""
    load, owner = [0] * world, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + costs[i]
    return owner


def exact_limit() -> int:
    """``GRAPHCAL_GPTQ_EXACT_MB`` in bytes (the same on every rank: torchrun passes one environment)."""
    value = os.environ.get(EXACT_ENV, str(EXACT_MB))
    try:
        mb = float(value)
    except ValueError:
        raise GraphcalError(f"{EXACT_ENV} must be a number of MB, got {value!r}") from None
    if not math.isfinite(mb) or mb < 0:
        raise GraphcalError(f"{EXACT_ENV} must be a finite number >= 0, got {value!r}")
    return int(mb * 2**20)


class WeightParallel:
    """Sequential GPTQ's rounding (seams.Rounding) on every rank of a torchrun job: rank 0's weight
    pass iterates :meth:`units` and calls it per unit; the other ranks run :meth:`follow`."""

    def __init__(self, run: RunPlan, loaded: Loaded, observers: ObserverSet, calib: Calibration,
                 settings: PassSettings):
        self.run, self.loaded, self.observers, self.calib = run, loaded, observers, calib
        self.settings, self.gptq, self.dist, self.log = settings, run.config.gptq, settings.dist, GPTQLog()
        self.limit = exact_limit()
        self.walk = Blockwise(run, loaded, calib, device=settings.device, device_id=settings.device_id,
                              rank=self.dist, cache_mb=settings.cache_mb, cache_folder=settings.cache_folder)
        self._by_name = {t.name: t for t in run.chosen}
        self._rounded: dict[str, torch.Tensor] = {}  # this block's rounded weights (host), every rank
        self._grids: dict[str, object] = {}  # rank 0: the grids the owners rounded on (QParams by name)
        self._device: torch.device | None = None  # where GPTQ runs: where the block sessions ran
        self._error: BaseException | None = None  # a failure since the last check-in: told at the next one
        self._pending = False  # the other ranks wait at a check-in while rank 0's weight pass writes

    # -- the walk ----------------------------------------------------------------------------------

    def follow(self) -> None:
        """A rank other than 0: every block's share, nothing written."""
        for _ in self.units(fused_units(self.run.chosen, self.run.groups)):
            pass

    def units(self, all_units: list[list]) -> Iterator[list]:
        """``all_units`` block by block, each block's units rounded (by their owners) before they are
        yielded, and the block run again with them after them; one last check-in at the end."""
        bar = Progress("GPTQ blocks", len(self.walk.blocks), "block", bar=False)  # the log's progress lines
        log.info("GPTQ's sequential order across %d ranks: each rank runs its batches, each fused unit is rounded on "
                 "one owner rank (Hessians up to %s MB a block sent per batch, in batch order; partial sums "
                 "beyond), the rounded weights broadcast", self.dist.world, f"{self.limit / 2**20:g}")
        with self.walk, bar, torch.no_grad():
            for k, mine in walk_units(self.walk, self.run.chosen, all_units):  # the same plan: every rank stops alike
                self._round_block(k, mine)
                yield from mine
                try:
                    needed = self.walk.needed(k)
                    if needed:
                        self.walk.keep(k, self.walk.run_block(k, needed, self._rounded))
                except Exception as e:  # noqa: BLE001 -- told to every rank at the next check-in
                    self._error = e
                self._rounded, self._grids = {}, {}
                bar.update(1)
            self._check_in(None)  # every rank's last propagation and rank 0's writes done

    def _check_in(self, payload):
        """The step every rank takes together: this rank's failure since the last one (raised on every
        rank), and every rank's ``payload``."""
        error, self._error, self._pending = self._error, None, False
        return exchange(self.dist, error, payload)

    def _round_block(self, k: int, units: list[list[Target]]) -> None:
        """Block ``k``'s units rounded by their owners; every rank gets every rounded weight."""
        d, block = self.dist, self.walk.blocks[k]
        contrib, grids = {}, None
        if self._error is None:
            try:
                contrib = self._contributions(k)
                if d.is_main:
                    grids = self._block_grids(units)
            except Exception as e:  # noqa: BLE001 -- told to every rank at the check-in
                self._error = e
        grids = self._check_in(grids)[0]
        owner = owners([unit_cost(u) for u in units], d.world)
        received = None
        for o in range(d.world):  # each owner gets the contributions to its units' inputs
            inputs = {t.activation for u, w in zip(units, owner) if w == o for t in u}
            got = gather_to(d, {x: contrib[x] for x in inputs}, o)
            if o == d.rank:
                received = got
        error, result, local = None, {}, GPTQLog()
        try:
            hessians = self._hessians(received, {t.activation: t.in_features for t in block.targets})
            for i, (unit, w) in enumerate(zip(units, owner)):
                if w == d.rank and grids[i]:
                    members = self._members(grids[i])
                    for reading in by_input(members, lambda t: t.activation):
                        x = reading[0].target.activation
                        if x not in hessians:
                            raise GraphcalError(f"{reading[0].target.name}: no activation reached its GPTQ Hessian")
                        h = hessians[x].value().to(reading[0].weight.device)
                        result.update({n: q.cpu() for n, q in gptq_weights(reading, h, self.gptq, local).items()})
        except Exception as e:  # noqa: BLE001 -- told to every rank with the rounded weights
            error = e
        mine = {"error": None if error is None else f"{type(error).__name__}: {error}",
                "weights": {} if error else result, "losses": local.losses, "fallback": local.rtn_fallback}
        answers = [broadcast_from(d, mine if o == d.rank else None, o) for o in range(d.world)]
        raise_first(d, error, [a["error"] for a in answers])
        losses, fallback = {}, set()
        for a in answers:
            self._rounded.update(a["weights"])
            losses.update(a["losses"])
            fallback.update(a["fallback"])
        for unit in units:  # the log in the weight pass's order, as one process writes it
            for t in unit:
                if t.name in losses:
                    self.log.losses[t.name] = losses[t.name]
                if t.name in fallback:
                    self.log.rtn_fallback.append(t.name)
        self._pending = True

    # -- one block's pieces ------------------------------------------------------------------------

    def _contributions(self, k: int) -> dict:
        """This rank's share of block ``k``'s Hessians, by layer input: each batch's (index, gram,
        sequences), or, past the exact limit, ("sum", the rank's sum, its sequences)."""
        from graphcal.algorithms.gptq.hessian import HessianObserver  # lazy: GPTQ's math loads with GPTQ only

        columns = {t.activation: t.in_features for t in self.walk.blocks[k].targets}
        batches = self.calib.num_batches  # all the batches' grams: what an owner may receive for one block
        if batches and batches * sum(4 * n * n for n in columns.values()) <= self.limit:
            grams: dict[str, list] = {x: [] for x in columns}
            provider = block_grams(self.walk, k, columns, lambda x, i, g, s: grams[x].append(
                (i, g.detach().to("cpu", copy=True), s)))
            out = grams
        else:
            sums = {x: HessianObserver(n) for x, n in columns.items()}
            provider = block_grams(self.walk, k, columns, lambda x, i, g, s: sums[x].add_gram(g, s))
            out = {x: ("sum", h.hessian.sum, h.hessian.count) for x, h in sums.items()}
        if self._device is None:
            self._device = observer_device(provider, self.settings.device, self.settings.device_id)
        return out

    def _hessians(self, received: list[dict], columns: dict[str, int]) -> dict:
        """The Hessians of the inputs this rank owns, from every rank's contributions: the batches' grams
        added in batch order (one process's sums), or the ranks' partial sums in rank order."""
        from graphcal.algorithms.gptq.hessian import HessianObserver  # lazy: GPTQ's math loads with GPTQ only
        from graphcal.algorithms.gptq.math import Hessian

        hessians = {}
        for x in dict.fromkeys(x for part in received for x in part):
            h = hessians[x] = HessianObserver(columns[x])
            parts = [part[x] for part in received if x in part]
            if any(isinstance(p, tuple) for p in parts):
                for _, total, count in parts:
                    other = Hessian()
                    other.sum, other.count = total, count
                    h.hessian.merge(other)
            else:
                for _, g, s in sorted((item for p in parts for item in p), key=lambda item: item[0]):
                    h.add_gram(g, s)
            if not h.has_statistics:
                del hessians[x]
        return hessians

    def _block_grids(self, units: list[list[Target]]) -> list[list]:
        """Rank 0: each unit's members as the weight pass will hand them over: [(name, grid)], those
        left in float absent. The weight pass's own steps (its NaN check, observe_unit) on copies of
        the weight observers, so the weight pass observes afresh."""
        from graphcal.calibration.weights import WeightResult, left_in_float, observe_unit  # lazy: the weight pass's

        out = []
        for unit in units:
            weights = {}
            for t in unit:
                w = weight_tensor(self.loaded.model, t, self.run.base_dir)
                if not left_in_float(t, w, "weight", self.settings.skip_nonfinite, WeightResult([])):
                    weights[t.name] = w
            scratch = copy.copy(self.observers)
            scratch.weight_observers = {t.name: copy.deepcopy(self.observers.weight_observers[t.name]) for t in unit}
            scratch.input_observers, scratch._input_qparams = {}, {}
            members = observe_unit(self.run, scratch, unit, weights, self._device)
            grid = [(m.target.name, m.item.qparams["weight"]) for m in members]
            self._grids.update(grid)
            out.append(grid)
        return out

    def _members(self, grid: list) -> list[Member]:
        """An owner's members of one unit: its copy of each weight, on the grid rank 0 took."""
        members = []
        for name, qp in grid:
            t = self._by_name[name]
            w = weight_tensor(self.loaded.model, t, self.run.base_dir).to(self._device)
            members.append(Member(t, w, QuantizedTarget(t, self.run.schemes[name], {"weight": qp})))
        return members

    # -- rank 0's weight pass ----------------------------------------------------------------------

    def __call__(self, members: list[Member]) -> dict[str, torch.Tensor]:
        out = {}
        for m in members:
            name, qp = m.target.name, m.item.qparams["weight"]
            q, grid = self._rounded.get(name), self._grids.get(name)
            if q is None or grid is None or not _same_grid(grid, qp):
                raise GraphcalError(f"{name}: GPTQ across ranks rounded on another grid than the weight pass's; "
                                    "this is a graphcal bug: please report it")
            out[name] = q.to(m.weight.device)
        return out

    def abort(self, error: BaseException) -> None:
        """Rank 0's weight pass failed while the other ranks wait at a check-in: tell them."""
        if not self._pending:
            return
        self._error = error
        try:
            self._check_in(None)
        except BaseException:  # noqa: BLE001 -- ``error`` itself, now marked as heard; the caller raises it
            pass


def _same_grid(a, b) -> bool:
    def same(x, y):
        return (x is None) == (y is None) and (x is None or torch.equal(x.cpu(), y.cpu()))

    return same(a.scale, b.scale) and same(a.zero_point, b.zero_point) and same(a.global_scale, b.global_scale)
