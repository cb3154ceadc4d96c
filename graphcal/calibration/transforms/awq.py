"""AWQ as a stage: llm-compressor's AWQModifier on the ONNX graph, before the weights are quantized.

    plan.awq (graph.smooth, scope "all": activations whose scales fold exactly into the norm or
    linear layer before them, so the written model gets no extra node)
    for each layer block (graphcal.calibration.blockwise), on the cached tensors the blocks before it made:
      the block's subgraph runs once over the data --> each mapping's parent inputs (the balance
      layers' shared activation x, and anything else the parent reads), cached for the search
      for each mapping (graph order):
        mean |x| per channel, the balance weights' normalised means (graphcal.algorithms.awq.math)
        the parent sub-network (graph.parents.parent_output: q/k/v or a packed qkv_proj -> the
        attention's output, gate/up -> down_proj's output) run 1 + n_grid times on the cached
        inputs of every batch (or of --awq-samples' batches, spread evenly), the balance weights fed
        as Q(W * s) / s for each candidate s; a parent that is the layer itself (down_proj, o_proj)
        is not run: its output's MSE is tr(dW G dW^T) from the input's Gram matrix G (gram.LayerLoss)
        --> the s whose parent output is nearest the float one (graphcal.algorithms.awq.math.search)
    --> ChannelScales (graphcal.calibration.transforms.channel_scales): the weight pass multiplies each balance weight's columns by s
        (a linear smooth layer's rows are divided), and fold() divides the norm's scale and bias.

The statistics come from the float model: AWQ changes no function (only the rounding to come),
so layer i+1 sees what it would after layer i was smoothed, up to rounding (algorithms.md §5.2).
The weights a mapping searches with are the current ones (a layer smoothed by an earlier mapping
of the same block enters the later one smoothed, as in llm-compressor); the other layers inside a
parent run in float. Memory: one block's parent inputs for all the data, plus the residual stream
between blocks; both are counted and refused with an error when they would not fit. Cost: one run
of each block, plus 1 + n_grid runs of the attention and MLP parents on the samples they are scored
on (docs/gptq_awq.md "What AWQ costs").

Where the tensors live: the search computes where the block's cached inputs lie (Blockwise keeps
them where the session ran: on the GPU under CUDA). The statistics, the Gram matrices, the trial
weights Q(W * s) / s, the parents' runs (inputs and candidate weights bound from torch's memory,
outputs handed back by DLPack), the losses and the clip search all stay there; the host reads the
grid's losses once per mapping (to pick the best) and keeps the chosen scales and clip bounds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import onnx
import torch

from graphcal.arrays import to_numpy, to_torch
from graphcal.calibration.activations import PassResult
from graphcal.calibration.blockwise import Blockwise
from graphcal.calibration.decisions import Loaded, RunPlan
from graphcal.calibration.observe import ObserverSet
from graphcal.calibration.passes import run_activation_pass
from graphcal.calibration.seams import PassSettings
from graphcal.calibration.transforms.base import PlanScope, Transform
from graphcal.calibration.transforms.channel_scales import ChannelScales, ScaleMethod, scaled_layers
from graphcal.config import AWQSettings
from graphcal.data import Calibration
from graphcal.errors import GraphcalError
from graphcal.graph.blocks import parent_inputs, parent_output
from graphcal.graph.parents import layer_output
from graphcal.graph.scaling import Mapping, Resolution, candidates, resolve
from graphcal.graph.targets import torch_weight
from graphcal.progress import Progress
from graphcal.types import Target

if TYPE_CHECKING:
    from graphcal.algorithms.awq.gram import Gram

log = logging.getLogger("graphcal")


@dataclass(frozen=True)
class _Search:
    """One mapping's search: the block it runs in, its balance layers, and its parent sub-network
    (the tensor it compares, and what it reads)."""

    block: int
    mapping: Mapping
    balance: list[Target]
    output: str | None  # None: the parent is the layer itself, scored from its input's Gram matrix
    reads: list[str]


def awq_smoothing(run: RunPlan, loaded: Loaded, calib: Calibration, *, device: str, device_id: int = 0, progress: bool = False,
                  cache_mb: float | None = None, cache_folder=None) -> ChannelScales:
    """AWQ's scales for every mapping of the plan's AWQ decision (ChannelScales of ScaleMethod.AWQ): the
    graph walked layer block by layer block (Blockwise), each block's search on its cached inputs
    (:meth:`BlockSearch.observe_block`); ``loaded``: the working model, read only. ``cache_mb`` and
    ``cache_folder``: the walk's cache (Blockwise), deleted when the walk ends."""
    walk = Blockwise(run, loaded, calib, device=device, device_id=device_id, cache_mb=cache_mb, cache_folder=cache_folder)
    search = BlockSearch(run, loaded.model, walk, calib)
    bar = Progress("AWQ", len(search.plans), "mapping", bar=progress)
    with walk, bar, torch.no_grad():
        for k, block in enumerate(walk.blocks):
            taps = search.reads(k)
            outputs = walk.needed(k)  # what later blocks read (not the graph's logits)
            if not search.has_work(k) and not outputs:
                continue
            values = walk.run_block(k, list(dict.fromkeys([*taps, *outputs])),
                                    what=f"AWQ's cached inputs of {block.name}")
            walk.keep(k, {n: values[n] for n in outputs})
            inputs = {n: values[n] for n in taps}
            del values
            search.observe_block(walk, k, inputs, bar.update)
            del inputs
    return search.result()


class BlockSearch:
    """AWQ's search, one layer block at a time: :meth:`observe_block` takes ONE block's subgraph
    (the Blockwise frame, read only) and that block's cached inputs, and searches the scales of
    the mappings whose balance layers are in it (and --awq-clip's bounds of its layers)."""

    def __init__(self, run: RunPlan, model: onnx.ModelProto, walk: Blockwise, calib: Calibration):
        self.run, self.settings = run, run.config.awq
        self.model = model  # the working model, read only: the balance layers' weights as loaded
        decision = run.decision(AWQSettings)
        self.mappings = list(decision.mappings)
        by_name = {t.name: t for t in run.found}
        block_of = {t.name: k for k, b in enumerate(walk.blocks) for t in b.targets}
        self.plans: list[_Search] = []
        for m in self.mappings:
            balance = [by_name[b] for b in m.balance]
            chosen = [t for t in balance if t.name in block_of]
            if not chosen:
                continue
            output = parent_output(model, balance)
            if output is not None and len(balance) == 1 and output == layer_output(model, balance[0]):
                output = None  # the parent is the layer: its output's MSE comes exactly from the input's Gram matrix
            if output is None:
                reads = [m.candidate.activation]
            else:
                reads = parent_inputs(model, balance, output, dependent=walk.dependent)
            self.plans.append(_Search(min(block_of[t.name] for t in chosen), m, balance, output, reads))
        self.used = search_batches(calib, self.settings.search_samples)  # the batches every multi-layer parent is scored on
        self.clipping = set(decision.clip)  # the layers AWQ's clip search takes (empty: no --awq-clip)
        self.blocks = walk.blocks
        self.clips: dict[str, torch.Tensor] = {}
        self.clipped: list[dict] = []
        self.scales: dict[str, torch.Tensor] = {}
        self.done = ChannelScales([], {}, method=ScaleMethod.AWQ)
        self.records: list[dict] = []

    def _work(self, k: int) -> tuple[list[_Search], list[Target]]:
        """Block ``k``'s searches (its mappings' balance layers are in it) and the layers it clips."""
        return [p for p in self.plans if p.block == k], [t for t in self.blocks[k].targets if t.name in self.clipping]

    def has_work(self, k: int) -> bool:
        return any(self._work(k))

    def reads(self, k: int) -> list[str]:
        """The tensors block ``k``'s search reads (its mappings' parent inputs, its clipped layers' inputs)."""
        here, clip_here = self._work(k)
        return list(dict.fromkeys([*(x for p in here for x in p.reads), *(t.activation for t in clip_here)]))

    def observe_block(self, frame: Blockwise, k: int, inputs: dict[str, list], advance=lambda n: None) -> None:
        """Search block ``k``'s mappings (graph order) and clip its layers, on ``inputs`` (tensor name
        -> one array per batch: what :meth:`reads` names), running parents on ``frame``'s subgraphs."""
        from graphcal.algorithms.awq.gram import Gram, LayerLoss  # lazy: AWQ's math loads with AWQ only
        from graphcal.algorithms.awq.math import AbsMean, ParentLoss, search

        run, settings = self.run, self.settings
        here, clip_here = self._work(k)
        inputs = {n: [_tensor(v) for v in values] for n, values in inputs.items()}
        grams: dict[str, Gram] = {}  # an input's Gram matrix, computed once for its mappings and clips
        for p in here:
            m, balance, output, reads = p.mapping, p.balance, p.output, p.reads
            x = m.candidate.activation
            stats, gram = AbsMean(), Gram() if p.output is None else None
            for value in inputs[x]:
                stats.update(value)
                if gram is not None:
                    gram.update(value)
            if gram is not None:
                grams[x] = gram
            device = inputs[x][0].device if inputs[x] else torch.device("cpu")  # where the search computes
            done = self.done
            weights = {t.name: done.weight(t, to_torch(torch_weight(self.model, t, run.base_dir))).to(device)
                       for t in balance}
            args = {t.name: run.schemes[t.name].weights for t in balance
                    if t.name in run.schemes and run.schemes[t.name].weights is not None}
            if not args:
                continue
            fused = [list(g.members) for g in run.groups if set(g.members) <= set(args)]
            parent = None if output is None else _Parent(frame, balance, output, reads, inputs, weights, self.used)
            objective = LayerLoss(gram) if parent is None else ParentLoss(parent)
            try:
                result = search(stats.value(), weights, args, objective, duo_scaling=settings.duo_scaling,
                                n_grid=settings.n_grid, fused_global_scale=fused)
            except ValueError as e:
                raise GraphcalError(f"AWQ {m.describe()}: {e}") from e
            finally:
                if parent is not None:
                    parent.close()
            advance(1)
            if result is None:
                continue
            self.scales[x] = result.scales.cpu()  # the result, kept on the host as the weight pass reads it
            self.done = ChannelScales([*done.mappings, m], dict(self.scales), method=ScaleMethod.AWQ)
            self.records.append({"smooth": m.smooth, "kind": m.candidate.kind, "balance": list(m.balance),
                                 "initial_error": result.initial_error, "best_error": result.best_error,
                                 "ratio": result.grid[result.best_index][0]})
            log.info("AWQ %s: error %.4g -> %.4g (ratio %g)", m.describe(), result.initial_error,
                     result.best_error, result.grid[result.best_index][0])
        for t in clip_here:  # after every scale of the block: each layer clipped as the weight pass will see it
            found = _clip(run, self.model, self.done, t, grams, inputs)
            if found is not None:
                self.clips[t.name], entry = found
                self.clipped.append(entry)

    def result(self) -> ChannelScales:
        """The scales of every block searched, with the record the output's metadata keeps."""
        settings = self.settings
        record = {"duo_scaling": settings.duo_scaling, "n_grid": settings.n_grid,
                  "search_samples": settings.search_samples, "mappings": self.records}
        if settings.clip:
            record["clip"] = self.clipped
        smoothed = ChannelScales(self.done.mappings, self.scales, method=ScaleMethod.AWQ, record=record,
                                 clips=self.clips)  # its metadata_key records it
        log.info("AWQ: %d of %d mappings scaled%s", len(self.records), len(self.mappings),
                 f", {len(self.clips)} layer(s) clipped" if settings.clip else "")
        return smoothed


def _clip(run: RunPlan, model: onnx.ModelProto, done: ChannelScales, t: Target, grams: dict[str, Gram],
          cached: dict) -> tuple[torch.Tensor, dict] | None:
    """AWQ's clip bounds of ``t`` (graphcal.algorithms.awq.clip.search) on its input as the block's
    scales leave it (``x / s``: the Gram matrix ``diag(1/s) G diag(1/s)``), and what the record keeps."""
    from graphcal.algorithms.awq.clip import search as clip_search  # lazy: AWQ's math loads with AWQ only
    from graphcal.algorithms.awq.gram import Gram

    gram = grams.get(t.activation)
    if gram is None:
        gram = grams[t.activation] = Gram()
        for value in cached[t.activation]:
            gram.update(value)
    if gram.sum is None or not torch.isfinite(gram.sum).all():
        return None
    g = done.smooth_hessian(t, gram.sum)
    w = done.weight(t, to_torch(torch_weight(model, t, run.base_dir))).to(g.device)  # searched where G lies
    found = clip_search(w, run.schemes[t.name].weights, g)
    if found is None:
        return None
    log.info("AWQ clip %s: error %.4g -> %.4g (%.0f%% of groups clipped)", t.name, found.before, found.after,
             100 * found.shrunk)
    return found.bound.cpu(), {"layer": t.name, "initial_error": found.before / gram.count,
                         "best_error": found.after / gram.count, "groups_clipped": found.shrunk}


def search_batches(calib: Calibration, samples: int | None) -> list[int]:
    """The batches a parent is run on in the search: all of them (llm-compressor's), or about
    ``samples`` samples' worth, spread evenly over the data."""
    total = calib.num_batches or 1
    if samples is None:
        return list(range(total))
    per_batch = max(1, calib.num_samples // total)
    want = max(1, min(total, -(-samples // per_batch)))
    return sorted({round(k * total / want) for k in range(want)})


def _tensor(value) -> torch.Tensor:
    """A cached value as torch: a torch tensor as it is (on the GPU under CUDA), a numpy array viewed."""
    return value if isinstance(value, torch.Tensor) else to_torch(value)


class _Parent:
    """The parent sub-network of one mapping, run on the cached inputs with candidate balance weights.

    Every run goes through an IOBinding (runtime.Runtime.run): the cached inputs and the candidate
    weights are bound where they lie, the output comes back where the session ran (DLPack), so on
    CUDA nothing of a parent run reaches the host. Where the output's type is one torch has not,
    the run goes through ``session.run`` instead."""

    def __init__(self, walk, balance: list[Target], output: str, reads: list[str], cached: dict,
                 current: dict[str, torch.Tensor], used: list[int]):
        self.walk, self.balance, self.output, self.reads, self.cached = walk, balance, output, reads, cached
        self.current = current  # the balance weights a candidate leaves as they are
        self.runtime, _ = walk.session([output], reads, balance)
        self.inputs = {i.name for i in self.runtime.session.get_inputs()}
        self.in_torch = self.runtime.torch_outputs
        used = set(used)
        # each scored batch's graph inputs and cached tensors, gathered once for the 1 + n_grid runs
        self.feeds = []
        for i, batch in enumerate(walk.calib.batches()):
            if i not in used:
                continue
            feeds = {n: batch[n] for n in self.inputs if n in batch}
            feeds.update({n: cached[n][i] for n in reads if n in self.inputs})
            self.feeds.append(feeds)

    def __call__(self, weights: dict[str, torch.Tensor]):
        fed = dict(self.walk.feed_weight(t, weights.get(t.name, self.current[t.name])) for t in self.balance)
        fed = {n: v for n, v in fed.items() if n in self.inputs}
        for feeds in self.feeds:
            if self.in_torch:
                yield self.runtime.run({**feeds, **fed})[self.output]
            else:
                yield torch.from_numpy(self.runtime.run_numpy({n: _numpy(v) for n, v in {**feeds, **fed}.items()})
                                       [self.output])

    def close(self) -> None:
        self.runtime.close()


def _numpy(value):
    """A feed as numpy, for ``session.run`` (a torch tensor copied to the host)."""
    return to_numpy(value.detach().cpu()) if isinstance(value, torch.Tensor) else value


@dataclass(frozen=True)
class AWQDecision:
    """AWQ's plan: its mappings (graph.scaling.Resolution) and the layers --awq-clip searches."""

    resolution: Resolution
    clip: tuple[str, ...] = ()

    mappings = property(lambda self: self.resolution.mappings)
    notes = property(lambda self: self.resolution.notes)


@dataclass(frozen=True)
class AWQRecord:
    """AWQ's result: its mappings as scaled (graph.scaling.Mapping.describe)."""

    mappings: tuple[str, ...]
    read_data = property(lambda self: bool(self.mappings))  # it read the data block by block (a search ran)


class AWQ(Transform):
    """AWQ as one unit: its mappings at plan time, its refusals, and as the pipeline's pre-transform
    (graphcal.calibration.seams.PreTransform) its scales searched block by block before the
    activation pass, whose observers then see x * (1/s); its record and summaries."""

    settings_type = AWQSettings
    key = "awq"
    reads_blocks = True

    def __init__(self, run: RunPlan, loaded: Loaded):
        self.run, self.loaded, self._scales = run, loaded, None  # the working model, read only

    # -- the plan ------------------------------------------------------------------------------

    @classmethod
    def resolve(cls, scope: PlanScope, settings: AWQSettings) -> AWQDecision:
        """AWQ's mappings in this graph: activations whose scales fold exactly into the norm or
        linear layer before them (no node added), by structure or by llm-compressor's names.
        Found by structure, a mapping into an lm_head that a quantized lookup reads as its table is
        left out (llm-compressor's mappings never scale lm_head): scaled, the table would be stored twice."""
        from graphcal.algorithms.awq.clip import clip_layers  # lazy: AWQ's math loads with AWQ only

        resolution = resolve(candidates(scope.model, scope.found, scope.base_dir), scope.chosen, "all",
                             settings.mappings, what="AWQ")
        if settings.mappings is None and scope.tied:
            shared = {head for lookup, head in scope.tied.items() if scope.shares(lookup, head)}
            for m in [m for m in resolution.mappings if shared & set(m.balance)]:
                resolution.mappings.remove(m)
                log.info("AWQ: %s left out: %s is tied to a quantized lookup, which reads its weight (one table "
                         "stored)", m.describe(), ", ".join(sorted(shared & set(m.balance))))
        log.info("AWQ: %d mappings to search", len(resolution.mappings))
        return AWQDecision(resolution, clip_layers(scope.chosen, scope.schemes) if settings.clip else ())

    @classmethod
    def notes(cls, decision: AWQDecision, settings: AWQSettings) -> list[str]:
        notes = list(decision.notes) if settings.mappings is not None else []
        if not decision.mappings:
            notes.append("AWQ: no activation of the quantized layers can be scaled with an exact fold into a norm "
                         "or linear layer; nothing to search (graphcal inspect lists why)")
        return notes

    @classmethod
    def scaled(cls, decision: AWQDecision | None) -> set[str]:
        return scaled_layers(decision.mappings if decision is not None else ())

    @classmethod
    def reads_data_per_block(cls, run: RunPlan, decision: AWQDecision | None) -> bool:
        return decision is not None

    # -- the passes ----------------------------------------------------------------------------

    @classmethod
    def for_plan(cls, run: RunPlan, loaded: Loaded) -> AWQ | None:
        decision = run.decision(AWQSettings)
        return cls(run, loaded) if decision is not None and decision.mappings else None

    def before_pass(self, calib: Calibration, settings: PassSettings) -> None:
        # under torchrun every rank searches over all the data (the search is deterministic, so every
        # rank gets rank 0's scales, and no rank waits on another's search past the exchange's timeout)
        self._scales = awq_smoothing(self.run, self.loaded, calib, device=settings.device, device_id=settings.device_id,
                                     progress=settings.progress and settings.main, cache_mb=settings.cache_mb,
                                     cache_folder=settings.cache_folder)

    def taps(self) -> dict[str, str]:
        return self._scales.taps()

    def activation_pass(self, observers: ObserverSet, calib: Calibration, settings: PassSettings) -> PassResult:
        return run_activation_pass(self.run, self.loaded, observers, calib, prelude=self._scales.prelude(self.loaded.types),
                                   **settings.kwargs())

    def scales(self) -> ChannelScales:
        return self._scales

    # -- reports -------------------------------------------------------------------------------

    @classmethod
    def record(cls, run: RunPlan, done) -> AWQRecord | None:
        scales = done.scales
        if scales is None or scales.method is not ScaleMethod.AWQ:
            return None
        return AWQRecord(tuple(scales.describe()))

    @classmethod
    def result_lines(cls, record: AWQRecord | None) -> list[str]:
        if record is None or not record.mappings:
            return []
        return [f"AWQ: scaled {len(record.mappings)} activation(s) first, each folded into the norm or linear layer "
                "before it (graphcal inspect lists them)"]

    @classmethod
    def result_json(cls, record: AWQRecord | None):
        return list(record.mappings) if record is not None else []

    @classmethod
    def inspect_lines(cls, run: RunPlan, decision: AWQDecision | None, settings: AWQSettings | None,
                      blocks: list[str]) -> list[str]:
        if decision is None:
            return []
        lines = [f"awq      {len(decision.mappings)} mapping(s), duo_scaling {settings.duo_scaling}, "
                 f"n_grid {settings.n_grid}:"]
        lines += [f"  {m.describe()}" for m in decision.mappings]
        lines += [f"  {n}" for n in decision.notes]
        if decision.clip:
            lines.append(f"  clip search (--awq-clip) on {len(decision.clip)} layer(s): "
                         + ", ".join(list(decision.clip)[:3]) + (" ..." if len(decision.clip) > 3 else ""))
        return lines

    @classmethod
    def inspect_json(cls, run: RunPlan, decision: AWQDecision | None, settings: AWQSettings | None, blocks: list[str]):
        if decision is None:
            return None
        return {
            "duo_scaling": settings.duo_scaling, "n_grid": settings.n_grid,
            "mappings": [{"smooth": m.smooth, "kind": m.candidate.kind, "balance": list(m.balance),
                          "activation": m.candidate.activation} for m in decision.mappings],
            "not_scaled": list(decision.notes), "blocks": blocks, "clip": list(decision.clip),
        }
