"""The activation pass: the tapped graph runs once per batch and feeds the observers.

The tapped graph (:func:`graphcal.graph.taps.build_tapped`) is a weightless copy of the model
whose outputs are the taps, pruned to the nodes they need; the session reads the model's own
initializers beside it. Each batch's taps reach torch by DLPack (on the GPU under CUDA), each
goes to its consumers (:class:`graphcal.calibration.observe.Consumer`), and the batch is dropped. Where a
batch's whole taps would pass ``--tap-limit-mb``, the data runs once per share of them
(:func:`tap_shares`). Under torchrun each rank runs its share of the batches and the ranks then
exchange their statistics once.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from graphcal.calibration.decisions import Loaded, RunPlan
from graphcal.calibration.distributed import gather_statistics
from graphcal.calibration.observe import Consumers, Feed
from graphcal.data import MASK_INPUT, Calibration, batch_samples
from graphcal.errors import GraphcalError
from graphcal.graph.blocks import needed_initializers
from graphcal.graph.taps import Reduction, TapRequest, build_tapped, gram, itemsize, tap_bytes
from graphcal.limits import check_fits, format_size
from graphcal.observers.helpers import extrema
from graphcal.progress import Progress
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

    def count(self, batch: dict, count: bool = True) -> Kept | None:
        """Count ``batch``'s padding (unless ``count`` is false: a later pass over the same data);
        returns its kept positions when padding is excluded. Counted in numpy, on the host."""
        mask = batch.get(MASK_INPUT)
        if mask is None or mask.ndim != 2:
            return None
        keep = mask != 0
        if count:
            self.padded += int(keep.size - np.count_nonzero(keep))
            self.positions += keep.size
        return Kept(torch.from_numpy(keep)) if self.exclude else None


class Kept:
    """A batch's unpadded positions: its keep mask [batch, seq] and, found once on the host, the
    flat index of its kept rows, copied once to each device a tap lies on. ``x[mask]`` on a GPU
    would find the rows again, with a host sync, for every tap."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask
        self.shape = tuple(mask.shape)
        self._index = {mask.device: mask.reshape(-1).nonzero().reshape(-1)}

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x[mask]`` (``x`` [batch, seq, ...]): its kept rows [N, ...], in the mask's order."""
        index = self._index.get(x.device)
        if index is None:
            index = self._index[x.device] = self._index[self.mask.device].to(x.device)
        return x.flatten(0, 1).index_select(0, index)


@dataclass(frozen=True)
class PassResult:
    """What the pass did: the provider that ran (None: no pass was needed) and the batches this rank ran;
    ``padding``: the attention_mask's padding over every rank's batches (None: no attention_mask)."""

    provider: str | None
    batches: int
    padding: Padding | None = None
    passes: int = 1  # passes over the data, each fetching a share of the whole taps (tap_shares)
    whole_bytes: int = 0  # the whole taps of the first batch, in bytes
    tap_limit: int = 0  # the bytes of whole taps one pass may fetch per batch
    seconds: float = 0.0  # the pass's wall time (calibration.passes)

    def warnings(self) -> list[str]:
        """A line for the run's summary when the data ran more than once to bound the taps' memory."""
        if self.passes <= 1:
            return []
        return [f"the {format_size(self.whole_bytes)} of whole activations tapped per batch exceed --tap-limit-mb "
                f"{self.tap_limit / 1e6:g}: the data ran {self.passes} times, each pass fetching a share "
                "(a higher limit, or a smaller --batch-size where the observers allow it, runs fewer)"]


#: the whole taps one onnxruntime pass may fetch per batch, in MB (``--tap-limit-mb``)
TAP_LIMIT_MB = 1024


def tap_shares(plan: RunPlan, loaded: Loaded, requests: list[TapRequest], calib: Calibration, prelude: tuple[list, list], limit: int, *,
               device: str, device_id: int = 0) -> tuple[list[list[TapRequest]], int]:
    """The requests each pass over the data fetches, and the bytes of a batch's whole taps.

    onnxruntime keeps every output of a graph alive until a run ends, so a batch's whole taps (every
    observed activation of every layer, for ``mse``, ``imatrix_mse`` or ``--exclude-padding``) are
    held at once. Where they add up past ``limit`` bytes the data is run once per share of them, in
    graph order, each pass on a graph whose outputs are that share (the reductions come with the
    last), pruned to the nodes it needs. Sizes are those of the first batch: from shape inference
    with its dims, else measured by a run that fetches the taps' shapes only. A
    CalibrationDataReader is read once: one pass, whatever the size."""
    whole = [r for r in requests if r.reduction is Reduction.WHOLE]
    if not whole or not calib.rereadable:
        return [requests], 0
    first = next(iter(calib.batches()), None)
    if first is None:
        return [requests], 0
    tensors = list(dict.fromkeys(r.tensor for r in whole))
    sizes = tap_bytes(loaded.model, tensors, {k: v.shape for k, v in first.items()}, prelude[0])
    unknown = [t for t, n in sizes.items() if n is None]
    if unknown:  # measured: a run that fetches their shapes (the tensors themselves are not kept)
        probe = build_tapped(loaded.model, [], dict(loaded.types), prelude, shapes=unknown, keep_outputs=False)
        runtime = open_runtime(probe.model, list(probe.shapes.values()), device, device_id=device_id,
                               external_folder=plan.base_dir, weights=needed_initializers(probe.model, loaded.model),
                               priority_order=True)
        try:
            values = runtime.run({k: v for k, v in first.items() if k in runtime.inputs})
        finally:
            runtime.close()
        source = {n.output[0]: n.input[0] for n in prelude[0]}  # x * (1/s) is typed like x
        for t in unknown:
            known = loaded.types.get(source.get(t, t))
            sizes[t] = itemsize(known.elem_type if known else 0) * math.prod(
                int(d) for d in values[probe.shapes[t]].tolist())
    total = sum(sizes.values())
    position = {o: i for i, n in enumerate(loaded.model.graph.node) for o in n.output}
    for n in prelude[0]:  # x * (1/s) comes right after x
        position[n.output[0]] = position.get(n.input[0], -1)
    slices = _slices(sorted(tensors, key=lambda t: position.get(t, -1)), sizes, limit)
    if len(slices) == 1:
        return [requests], total
    shares = [[r for r in whole if r.tensor in set(names)] for names in slices]
    shares[-1] += [r for r in requests if r.reduction is not Reduction.WHOLE]
    log.info("the whole taps of a batch (%d tensors, %s) pass --tap-limit-mb %g: the data runs %d times, "
             "each fetching a share", len(tensors), format_size(total), limit / 1e6, len(shares))
    return shares, total


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


def check_state(observers: Consumers, world: int = 1) -> None:
    """Refuse, before the pass, statistics that every observer holds at once (histograms: ``bins``
    of them per tap) when they would take more than half the memory available. Under torchrun every
    rank receives every rank's copy at the exchange, and rank 0 makes one more of each to merge."""

    nbytes = sum(o.state_bytes() for o in observers.activation_observers() if hasattr(o, "state_bytes"))
    copies = 1 if world <= 1 else 2 * world
    if nbytes:
        check_fits(copies * nbytes, "the observers' statistics"
                   + (f" ({copies} copies across the exchange of {world} ranks)" if copies > 1 else ""),
                   hint="lower the histogram observers' bins (observer_kwargs) or observe fewer layers")


def run_activation_pass(plan: RunPlan, loaded: Loaded, observers: Consumers, calib: Calibration, *, device: str, device_id: int = 0,
                        dist=None, progress: bool = False, reduce_in_graph: bool = True,
                        exclude_padding: bool = False, inputs: tuple[str, ...] = (),
                        prelude: tuple[list, list] = ((), ()), label: str = "calibrating",
                        tap_limit_mb: float | None = None) -> PassResult:
    """Stream ``calib`` through the tapped model (a copy of ``loaded.model``, the working model, which
    is only read) and feed every activation observer.

    With ``reduce_in_graph``, observers that take extrema get them from ReduceMin/ReduceMax in
    the graph, so whole activations leave onnxruntime only for observers that need them. Without
    any activation observer the data is still read once, cheaply, so NaN/Inf in it is refused.
    With ``exclude_padding``, every tap is fetched whole and, where it is shaped [batch, seq, ...]
    like the attention_mask, only its unpadded rows reach the observers (key/value states and other
    taps are observed whole and listed in ``padding.unmasked``). ``inputs``: the model's input
    names; with an attention_mask among them the pass counts the padding it sees. ``prelude``:
    nodes that make tensors to tap which the model lacks (see :func:`graphcal.graph.taps.build_tapped`);
    ``label`` names the pass on the progress bar and in the log. ``tap_limit_mb`` (default
    :data:`TAP_LIMIT_MB`) bounds the whole taps a batch holds (:func:`tap_shares`: past it, one
    pass over the data per share of them). Each pass's tapped graph outputs its taps alone.
    """
    padding = Padding(exclude_padding) if MASK_INPUT in inputs else None
    if not observers.consumers:
        if padding is not None and calib.rereadable:
            for batch in calib.batches():  # what check_values does, counting the padding
                padding.count(batch)
        else:
            calib.check_values()
        return PassResult(None, 0, padding if padding is not None and padding.positions else None)
    if exclude_padding:
        reduce_in_graph = False  # rows are selected in torch, so the taps leave onnxruntime whole
    requests = observers.requests(reduce_in_graph)
    limit = int((TAP_LIMIT_MB if tap_limit_mb is None else tap_limit_mb) * 1e6)
    provider, batches, error, shares, whole_bytes = None, 0, None, [requests], 0
    try:
        check_state(observers, dist.world if dist is not None else 1)
        shares, whole_bytes = tap_shares(plan, loaded, requests, calib, prelude, limit, device=device, device_id=device_id)
        for k, share in enumerate(shares):
            tapped = build_tapped(loaded.model, share, dict(loaded.types), prelude, keep_outputs=False)
            # onnxruntime's default order walks back from the graph's outputs, so a tap's reduction (an
            # output of its own) would run after the whole model, every tapped activation alive until
            # then: +2.9 GB a batch on a 1.5B decoder. Priority order (Kahn's, ties by node order) runs
            # each reduction where graph.taps placed it, right after its producer; 15% faster there.
            runtime = open_runtime(tapped.model, tapped.fetch, device, device_id=device_id,
                                   external_folder=plan.base_dir,
                                   weights=needed_initializers(tapped.model, loaded.model), priority_order=True)
            provider = runtime.provider
            whole = sum(r.reduction is Reduction.WHOLE for r in tapped.outputs)
            name = label if len(shares) == 1 else f"{label} ({k + 1}/{len(shares)})"
            log.info("%s pass on onnxruntime %s (taps to torch on %s): %d whole tensors and %d "
                     "reductions fetched per batch", name, provider, runtime.device, whole, len(tapped.outputs) - whole)
            try:
                done = _feed_batches(runtime, calib, observers, tapped, reduce_in_graph,
                                     progress and (dist is None or dist.is_main), dist, padding, name, count=k == 0)
                batches = batches if k else done
            finally:
                runtime.close()
    except Exception as e:  # noqa: BLE001 -- under torchrun every rank must hear of it
        if dist is None:
            raise
        error = e
    exchange(dist, observers, error, padding)
    return PassResult(provider, batches, padding, len(shares), whole_bytes, limit)


def exchange(dist, observers: Consumers, error: BaseException | None, padding: Padding | None) -> None:
    """Under torchrun (``dist``), every rank's statistics and padding counts gathered once after its pass, and
    ``error`` (this rank's, or None) told to every rank; nothing without torchrun."""
    if dist is None:
        return
    counts = (padding.padded, padding.positions) if padding is not None else None
    counts = gather_statistics(dist, observers.activation_observers(), error, counts)
    if padding is not None:
        padding.padded, padding.positions = counts


def _unpadded(x: torch.Tensor, keep: Kept, consumers, padding: Padding, tensor: str) -> torch.Tensor | None:
    """``x``'s unpadded rows [N, ...] when ``x`` is [batch, seq, ...] like the mask (else None, and
    ``tensor`` is listed as observed with its padding); key/value states are never masked."""
    if all(c.feed is Feed.KV for c in consumers) or x.ndim < 3 or tuple(x.shape[:2]) != keep.shape:
        padding.unmasked.setdefault(tensor, tuple(x.shape))
        return None
    return keep.rows(x)


def _feed_batches(runtime, calib: Calibration, observers: Consumers, tapped, in_graph: bool, progress: bool, dist=None,
                  padding: Padding | None = None, label: str = "calibrating", count: bool = True) -> int:
    """Run every batch (under torchrun: every world-th, from this rank) and feed the consumers of
    ``tapped``'s taps; ``count``: count the padding (the first of several passes does)."""

    routes, finite = routes_of(observers, tapped, in_graph)
    takes = runtime.inputs
    done = 0
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
            keep = padding.count(batch, count) if padding is not None else None
            values = runtime.run({k: v for k, v in batch.items() if k in takes})
            feed_taps(values, routes, tapped, in_graph, keep, padding, index, observers, finite)
            del values
            done += 1
            bar.update(batch_samples(batch) if dist is None else 1)
        finite.check_deferred()
    return done


def routes_of(observers: Consumers, tapped, in_graph: bool) -> tuple[dict, Finiteness]:
    """The consumers of one tapped graph's taps by tensor (those whose taps it makes: a tensor's others are
    fed by another pass, or another block's), and the finiteness check its batches take (:class:`Finiteness`:
    deferred where every consumer takes a non-finite batch harmlessly and none tolerates one)."""
    fetched = tapped.outputs if tapped is not None else {}
    routes = {t: mine for t, cs in observers.by_tensor().items()
              if (mine := [c for c in cs if c.request(in_graph) in fetched])}
    tolerant = set(getattr(observers, "tolerant", ())) & set(routes)
    return routes, Finiteness(defer=not tolerant and all(_takes_nonfinite(c) for cs in routes.values() for c in cs))


#: batches whose taps' finiteness is kept on the device between two reads of it (deferred checks)
CHECK_EVERY = 64


def _takes_nonfinite(consumer) -> bool:
    """Whether ``consumer`` may be fed a batch before its finiteness is known: min/max observers of
    activations (statistics that are the batch extrema) only carry a NaN or Inf along, and the pass
    refuses it before they are read."""
    return consumer.feed in (Feed.INPUT, Feed.KV) and getattr(consumer.observer, "takes_extrema", False)


class Finiteness:
    """Whether the taps of a pass hold NaN or Inf, read from the device once per batch, or (``defer``)
    once every :data:`CHECK_EVERY` batches and at the end of the pass.

    A batch's probes (a reduced tap's finiteness probe from the graph, a whole tap's min and max:
    NaN and Inf carry through both) are stacked into one tensor. Checked now, the batch's flags come
    to the host in one read before any tap is fed. Deferred (every consumer of the pass takes a
    non-finite batch harmlessly, :func:`_takes_nonfinite`), the first batch each probe was non-finite
    in is kept on the device and read later; the error is the same: the first batch that held one,
    and in it the first tap in the pass's order."""

    NEVER = 2**62

    def __init__(self, defer: bool):
        self.defer = defer
        self.keys: list | None = None  # (tensor, its consumers) of each probe, the same every batch
        self.first: torch.Tensor | None = None  # per probe: the first batch it was non-finite in (NEVER)
        self.batches = 0

    def observe(self, probes: list, index: int, observers=None, tolerant=()) -> set[str]:
        """Check batch ``index``'s ``probes`` ([(tensor, consumers, 0-d tensor)], in the pass's order);
        returns the tensors not to feed (non-finite, ``tolerant``: added to ``observers.nonfinite``)."""
        if not probes:
            return set()
        finite = torch.isfinite(torch.stack([p for _, _, p in probes]))  # one stack, whatever the dtypes
        keys = [(t, cs) for t, cs, _ in probes]
        if self.defer and (self.keys is None or keys == self.keys):
            self.keys = keys
            bad = torch.where(finite, self.NEVER, index)
            self.first = bad if self.first is None else torch.minimum(self.first, bad)
            self.batches += 1
            if self.batches % CHECK_EVERY == 0:
                self.check_deferred()
            return set()
        self.check_deferred()  # a batch whose taps differ (not seen): what is kept is read first
        skip: set[str] = set()
        for (tensor, consumers), ok in zip(keys, finite.tolist()):  # the one read of this batch
            if ok or tensor in skip:
                continue
            if tensor not in tolerant:
                raise _nonfinite(tensor, index, consumers)
            observers.nonfinite.add(tensor)
            skip.add(tensor)
        return skip

    def check_deferred(self) -> None:
        """Refuse, from what is kept on the device (one read), the first non-finite tap seen so far."""
        if self.first is None:
            return
        first = self.first.tolist()
        batch = min(first)
        if batch != self.NEVER:
            tensor, consumers = self.keys[first.index(batch)]
            raise _nonfinite(tensor, batch, consumers)


def _nonfinite(tensor: str, index: int, consumers) -> GraphcalError:
    return GraphcalError(f"tap {tensor!r} holds NaN or Inf in batch {index} (observer "
                         f"{consumers[0].observer.observer_name}); the model or the data produce non-finite activations")


def feed_taps(values: dict, routes: dict, tapped, in_graph: bool, keep: Kept | None, padding: Padding | None, index: int,
          observers: Consumers | None = None, finite: Finiteness | None = None) -> None:
    """Feed ``routes`` (tensor -> its consumers in this pass) from ``values``, the outputs of
    ``tapped`` (this pass's graph) for batch ``index``. A tap holding NaN or Inf is refused
    (:class:`Finiteness`: checked before the batch is fed, or, where every consumer takes it
    harmlessly, later in the pass), unless ``observers`` lists it in its ``tolerant`` tensors: then
    it is added to its ``nonfinite`` set and that batch's value is not observed (SmoothQuant's
    ranges under --skip-nonfinite-weights)."""
    finite = finite or Finiteness(defer=False)
    spans, probes = {}, []
    for tensor, consumers in routes.items():
        x = values.get(tensor)
        if x is not None and x.is_floating_point():  # its extrema, read once, also serve the observers
            span = spans[tensor] = extrema(x)
            if span is not None:
                probes += [(tensor, consumers, span[0]), (tensor, consumers, span[1])]
        elif (probe := tapped.finite.get(tensor)) in values:  # a reduced tap: the graph's probe
            probes.append((tensor, consumers, values[probe]))
    skip = finite.observe(probes, index, observers, getattr(observers, "tolerant", ()))
    for tensor, consumers in routes.items():
        if tensor in skip:
            continue
        x, span = values.get(tensor), spans.get(tensor)
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
                    # copies: an observer keeps its first batch's extrema, and a view of onnxruntime's output
                    # would keep the session's whole memory arena alive after the session closes
                    c.observer.observe_extrema(lo.reshape(shape).clone(), hi.reshape(shape).clone())
                elif c.feed is Feed.IMPORTANCE:
                    c.observer.accumulate_importance(seen)
                elif c.feed is Feed.HESSIAN:
                    c.observer.add_activations(seen)
                elif c.feed is Feed.KV:
                    c.observer(seen)
                elif seen is x and span is not None:  # the whole tap: its extrema are known already
                    c.observer(_as_bsh(seen), extrema=span)
                else:
                    c.observer(_as_bsh(seen))
            except ValueError as e:  # e.g. a group size that does not divide the hidden size
                raise GraphcalError(f"tap {tensor!r} {tuple(x.shape) if x is not None else ''}: {e}") from e


def _as_bsh(x: torch.Tensor) -> torch.Tensor:
    """Activations as (batch, seq, hidden), the layout llm-compressor's observers see."""
    if x.ndim == 2:
        return x.unsqueeze(0)
    if x.ndim > 3:
        return x.reshape(-1, x.shape[-2], x.shape[-1])
    return x
