"""The activation pass: the tapped graph runs once per batch and feeds the observers.

The tapped graph (:func:`graphcal.graph.taps.build_tapped`) is a weightless copy of the model
plus the taps; the session reads the model's own initializers beside it. Each batch's taps
reach torch by DLPack (on the GPU under CUDA), each goes to its consumers
(:class:`graphcal.observe.Consumer`), and the batch is dropped. Under torchrun each rank runs
its share of the batches and the ranks then exchange their statistics once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import onnx
import torch

from graphcal.data import MASK_INPUT, CalibrationData, batch_samples
from graphcal.distributed import gather_statistics
from graphcal.errors import GraphcalError
from graphcal.graph.taps import Reduction, build_tapped, gram
from graphcal.limits import format_size
from graphcal.observe import Consumers, Feed
from graphcal.observers.helpers import memory_order
from graphcal.plan import RunPlan
from graphcal.runtime import open_runtime

log = logging.getLogger("graphcal")

# reduced extrema -> the observers' qparam shapes (flatten_for_calibration's reduce over dims 0, -1)
_QPARAM_SHAPE = {Reduction.ALL: lambda v: (1,), Reduction.GROUP: lambda v: (v.numel(),),
                 Reduction.CHANNEL: lambda v: (v.numel(),),
                 Reduction.HEAD: lambda v: (v.numel(), 1, 1)}


@dataclass
class Padding:
    """Padding seen in the data's ``attention_mask`` and, with ``exclude``, left out of the statistics."""

    exclude: bool = False
    padded: int = 0  # positions with attention_mask == 0
    positions: int = 0  # all positions of the mask
    unmasked: dict[str, tuple[int, ...]] = field(default_factory=dict)  # taps not shaped [batch, seq, ...]

    @property
    def share(self) -> float | None:
        return self.padded / self.positions if self.positions else None

    def count(self, batch: dict) -> torch.Tensor | None:
        """Count ``batch``'s padding; returns its keep mask [batch, seq] (bool) when padding is excluded."""
        mask = batch.get(MASK_INPUT)
        if mask is None or mask.ndim != 2:
            return None
        keep = torch.from_numpy(mask != 0)
        self.padded += int(keep.numel() - keep.sum())
        self.positions += keep.numel()
        return keep if self.exclude else None


@dataclass(frozen=True)
class PassResult:
    """What the pass did: the provider that ran (None: no pass was needed) and the batches this rank ran;
    ``padding``: the attention_mask's padding over every rank's batches (None: no attention_mask)."""

    provider: str | None
    batches: int
    padding: Padding | None = None
    runs_per_batch: int = 1  # the most onnxruntime runs one batch took (TapRuns)
    whole_bytes: int = 0  # the whole taps of the largest batch, in bytes
    tap_limit: int = 0  # the bytes of whole taps one run may fetch

    def warnings(self) -> list[str]:
        """A line for the run's summary when batches ran more than once to bound the taps' memory."""
        if self.runs_per_batch <= 1:
            return []
        return [f"the {format_size(self.whole_bytes)} of whole activations tapped per batch exceed --tap-limit-mb "
                f"{self.tap_limit / 1e6:g}: each batch ran {self.runs_per_batch} times, each run fetching a share "
                "(a higher limit, or a smaller --batch-size where the observers allow it, runs fewer)"]


#: the whole taps one onnxruntime run may fetch, in MB (``--tap-limit-mb``)
TAP_LIMIT_MB = 1024


class TapRuns:
    """Which outputs each onnxruntime run of a batch fetches, so that the whole taps a run holds stay
    under ``limit`` bytes.

    onnxruntime runs the whole graph on every run (whatever is fetched; ``only_execute_path_to_fetches``
    changes nothing on its CPU provider) and keeps each fetched output alive until the run ends. A
    batch whose whole taps (every observed activation of every layer, for ``mse`` or
    ``--exclude-padding``) add up past the limit therefore runs more than once, each run fetching a
    slice of them in graph order, and each slice dropped before the next run. Sizes come from a first
    run per batch shape that fetches the in-graph reductions and only the whole taps' shapes. Under
    the limit every later batch of that shape runs once, fetching everything.
    """

    def __init__(self, tapped, limit: int, types: dict):
        self.tapped, self.limit = tapped, limit
        position = {o: i for i, n in enumerate(tapped.model.graph.node) for o in n.output}
        self.whole = sorted(tapped.shapes, key=lambda n: position.get(n, -1))  # in graph order
        self.reduced = [n for n in tapped.fetch if n not in tapped.shapes]
        self.itemsize = {n: _itemsize(types.get(n)) for n in self.whole}
        self.plans: dict[tuple, list[list[str]]] = {}  # batch shape -> the outputs of each run
        self.most = 1  # the most runs one batch took
        self.largest = 0  # the whole taps of one batch, the most seen, in bytes

    def values(self, runtime, batch: dict) -> Iterator[dict[str, torch.Tensor]]:
        """The outputs of each run of ``batch``: every output, in one run or more."""
        if not self.whole:
            yield runtime.run(batch)
            return
        key = tuple(sorted((name, tuple(getattr(a, "shape", ()))) for name, a in batch.items()))
        plan = self.plans.get(key)
        if plan is None:  # the first batch of this shape: the reductions, and the sizes of the rest
            probe = runtime.run(batch, self.reduced + [self.tapped.shapes[n] for n in self.whole])
            sizes = {n: self.itemsize[n] * math.prod(int(d) for d in probe[self.tapped.shapes[n]].tolist())
                     for n in self.whole}
            slices = _slices(self.whole, sizes, self.limit)
            plan = self.plans[key] = [self.reduced + slices[0], *slices[1:]]
            self.most, self.largest = max(self.most, len(plan)), max(self.largest, sum(sizes.values()))
            if len(plan) > 1:
                log.warning("the %d whole taps of a batch shaped %s take %s, over --tap-limit-mb %g: each "
                            "batch runs %d times", len(self.whole), ", ".join(f"{n} {list(s)}" for n, s in key),
                            format_size(sum(sizes.values())), self.limit / 1e6, len(plan))
            yield {n: probe[n] for n in self.reduced}
            del probe
            for outputs in slices:
                yield runtime.run(batch, outputs)
            return
        for outputs in plan:
            yield runtime.run(batch, outputs)


def _slices(names: list[str], sizes: dict[str, int], limit: int) -> list[list[str]]:
    """``names`` cut, in order, into runs whose sizes add up to at most ``limit`` (a tap larger than
    that runs alone)."""
    out: list[list[str]] = [[]]
    total = 0
    for n in names:
        if out[-1] and total + sizes[n] > limit:
            out.append([])
            total = 0
        out[-1].append(n)
        total += sizes[n]
    return out


def _itemsize(t) -> int:
    """Bytes per element of a value typed ``t`` (onnx TypeProto.Tensor; fp32's 4 where unknown)."""
    elem = getattr(t, "elem_type", 0)
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(elem).itemsize if elem else 4
    except (KeyError, TypeError, ValueError):
        return 4


def check_state(observers: Consumers, world: int = 1) -> None:
    """Refuse, before the pass, statistics that every observer holds at once (histograms: ``bins``
    of them per tap) when they would take more than half the memory available. Under torchrun every
    rank receives every rank's copy at the exchange, and rank 0 makes one more of each to merge."""
    from graphcal.limits import check_fits

    nbytes = sum(o.state_bytes() for o in observers.activation_observers() if hasattr(o, "state_bytes"))
    copies = 1 if world <= 1 else 2 * world
    if nbytes:
        check_fits(copies * nbytes, "the observers' statistics"
                   + (f" ({copies} copies across the exchange of {world} ranks)" if copies > 1 else ""),
                   hint="lower the histogram observers' bins (observer_kwargs) or observe fewer layers")


def run_activation_pass(plan: RunPlan, observers: Consumers, calib, *, device: str, device_id: int = 0,
                        dist=None, progress: bool = False, reduce_in_graph: bool = True,
                        exclude_padding: bool = False, inputs: tuple[str, ...] = (),
                        prelude: tuple[list, list] = ((), ()), label: str = "calibrating",
                        tap_limit_mb: float | None = None) -> PassResult:
    """Stream ``calib`` through the tapped model and feed every activation observer.

    With ``reduce_in_graph``, observers that take extrema get them from ReduceMin/ReduceMax in
    the graph, so whole activations leave onnxruntime only for observers that need them. Without
    any activation observer the data is still read once, cheaply, so NaN/Inf in it is refused.
    With ``exclude_padding``, every tap is fetched whole and, where it is shaped [batch, seq, ...]
    like the attention_mask, only its unpadded rows reach the observers (key/value states and other
    taps are observed whole and listed in ``padding.unmasked``). ``inputs``: the model's input
    names; with an attention_mask among them the pass counts the padding it sees. ``prelude``:
    nodes that make tensors to tap which the model lacks (see :func:`graphcal.graph.taps.build_tapped`);
    ``label`` names the pass on the progress bar and in the log. ``tap_limit_mb`` (default
    :data:`TAP_LIMIT_MB`) bounds the whole taps one onnxruntime run fetches (:class:`TapRuns`).
    """
    padding = Padding(exclude_padding) if MASK_INPUT in inputs else None
    if not observers.consumers:
        if padding is not None and isinstance(calib, CalibrationData):
            for batch in calib.batches():  # what check_values does, counting the padding
                padding.count(batch)
        else:
            calib.check_values()
        return PassResult(None, 0, padding if padding is not None and padding.positions else None)
    if exclude_padding:
        reduce_in_graph = False  # rows are selected in torch, so the taps leave onnxruntime whole
    check_state(observers, dist.world if dist is not None else 1)
    requests = observers.requests(reduce_in_graph)
    tapped = build_tapped(plan.model, requests, dict(plan.types), prelude,
                          shapes=any(r.reduction is Reduction.WHOLE for r in requests))
    limit = TAP_LIMIT_MB if tap_limit_mb is None else tap_limit_mb
    runs = TapRuns(tapped, int(limit * 1e6), plan.types)
    provider, batches, error = None, 0, None
    try:
        # onnxruntime's default order walks back from the graph's outputs, so a tap's reduction (an
        # output of its own) would run after the whole model, every tapped activation alive until
        # then: +2.9 GB a batch on a 1.5B decoder. Priority order (Kahn's, ties by node order) runs
        # each reduction where graph.taps placed it, right after its producer; 15% faster there.
        runtime = open_runtime(tapped.model, tapped.fetch, device, device_id=device_id,
                               external_folder=plan.base_dir, weights=plan.model.graph.initializer,
                               priority_order=True)
        provider = runtime.provider
        whole = sum(r.reduction is Reduction.WHOLE for r in tapped.outputs)
        log.info("%s pass on onnxruntime %s (taps to torch on %s): %d whole tensors and %d "
                 "reductions fetched per batch", label, provider, runtime.device, whole, len(tapped.outputs) - whole)
        try:
            batches = _feed_batches(runtime, calib, observers, runs, reduce_in_graph,
                                    progress and (dist is None or dist.is_main), dist, padding, label)
        finally:
            runtime.close()
    except Exception as e:  # noqa: BLE001 -- under torchrun every rank must hear of it
        if dist is None:
            raise
        error = e
    if dist is not None:
        counts = (padding.padded, padding.positions) if padding is not None else None
        counts = gather_statistics(dist, observers.activation_observers(), error, counts)
        if padding is not None:
            padding.padded, padding.positions = counts
    return PassResult(provider, batches, padding, runs.most, runs.largest, runs.limit)


def _unpadded(x: torch.Tensor, keep: torch.Tensor, consumers, padding: Padding, tensor: str) -> torch.Tensor | None:
    """``x``'s unpadded rows [N, ...] when ``x`` is [batch, seq, ...] like the mask (else None, and
    ``tensor`` is listed as observed with its padding); key/value states are never masked."""
    if all(c.feed is Feed.KV for c in consumers) or x.ndim < 3 or tuple(x.shape[:2]) != tuple(keep.shape):
        padding.unmasked.setdefault(tensor, tuple(x.shape))
        return None
    return x[keep.to(x.device)]


def _feed_batches(runtime, calib, observers: Consumers, runs: TapRuns, in_graph: bool, progress: bool, dist=None,
                  padding: Padding | None = None, label: str = "calibrating") -> int:
    """Run every batch (under torchrun: every world-th, from this rank) and feed the observers."""
    from graphcal.progress import Progress

    routes = observers.by_tensor()
    tapped = runs.tapped
    count = 0
    known = calib.num_batches if calib.num_batches else None  # a reader's count is known only afterwards
    if dist is None:  # samples/s and the time left over the whole data
        bar = Progress(label, getattr(calib, "num_samples", None) or None, "sample", bar=progress)
    else:  # this rank's share, in batches
        bar = Progress(label, None if known is None else len(range(dist.rank, known, dist.world)), "batch",
                       bar=progress)
    with torch.no_grad(), bar:
        for index, batch in enumerate(calib.batches()):
            if dist is not None and index % dist.world != dist.rank:
                continue
            keep = padding.count(batch) if padding is not None else None
            for values in runs.values(runtime, batch):
                _feed(values, routes, tapped, in_graph, keep, padding, index)
                del values  # this run's taps go before the next run fetches its own
            count += 1
            bar.update(batch_samples(batch) if dist is None else 1)
    return count


def _feed(values: dict, routes: dict, tapped, in_graph: bool, keep, padding: Padding | None, index: int) -> None:
    """Feed the consumers whose taps are all in ``values`` (one run's outputs) for batch ``index``."""
    for tensor, consumers in routes.items():
        consumers = [c for c in consumers if all(n in values for n in tapped.outputs[c.request(in_graph)])]
        if not consumers:
            continue
        x = values.get(tensor)
        probe = tapped.finite.get(tensor)
        finite = (all_finite(x) if x is not None and x.is_floating_point()
                  else probe not in values or bool(torch.isfinite(values[probe]).all()))
        if not finite:
            raise GraphcalError(
                f"tap {tensor!r} holds NaN or Inf in batch {index} (observer "
                f"{consumers[0].observer.observer_name}); the model or the data produce non-finite activations"
            )
        rows = _unpadded(x, keep, consumers, padding, tensor) if keep is not None else None
        for c in consumers:
            seen = x
            if rows is not None and c.feed is not Feed.KV:
                if rows.shape[0] == 0:
                    continue  # all padding in this batch: nothing to observe
                seen = rows
            request = c.request(in_graph)
            try:
                if request.reduction is Reduction.GRAM:
                    c.observer.add_gram(*gram([values[n] for n in tapped.outputs[request]], request.groups))
                elif request.reduction is not Reduction.WHOLE:
                    lo, hi = (values[name] for name in tapped.outputs[request])
                    shape = _QPARAM_SHAPE[request.reduction](lo)
                    c.observer.observe_extrema(lo.reshape(shape), hi.reshape(shape))
                elif c.feed is Feed.IMPORTANCE:
                    c.observer.accumulate_importance(seen)
                elif c.feed is Feed.HESSIAN:
                    c.observer.add_activations(seen)
                elif c.feed is Feed.KV:
                    c.observer(seen)
                else:
                    c.observer(_as_bsh(seen))
            except ValueError as e:  # e.g. a group size that does not divide the hidden size
                raise GraphcalError(f"tap {tensor!r} {tuple(x.shape) if x is not None else ''}: {e}") from e


def all_finite(x: torch.Tensor) -> bool:
    """No NaN or Inf in ``x``: its min and max (which carry NaN along) are finite. One read of
    ``x`` and no mask of its size (``isfinite(x).all()`` cost 30x more on a big tap)."""
    if x.numel() == 0:
        return True
    if not x.is_contiguous():  # e.g. a weight seen through a transpose: read it as it lies
        x = x.permute(memory_order(x))
    return bool(torch.isfinite(torch.stack(torch.aminmax(x))).all())



def _as_bsh(x: torch.Tensor) -> torch.Tensor:
    """Activations as (batch, seq, hidden), the layout llm-compressor's observers see."""
    if x.ndim == 2:
        return x.unsqueeze(0)
    if x.ndim > 3:
        return x.reshape(-1, x.shape[-2], x.shape[-1])
    return x
