"""The activation pass streamed one layer block at a time: its memory is one block's, not the model's.

    choose_pass: a decoder (the plan's targets in two or more layer blocks, graph.blocks) whose data can be
    read again streams; any other graph, or --pass whole-graph, keeps the whole-graph pass (activations.py)
    run_streamed_pass, for each layer block k in order (calibration.blockwise.Blockwise):
      its subgraph, tapped for the taps its nodes make (its targets' activations or their scaled x * (1/s),
      its key/value states), opened with the weights it reads and no others (external data is read when
      the session opens and let go when it closes)
      runs on every batch: the batch's graph inputs and the cached outputs of the blocks before it
      --> the taps feed the observers, as the whole-graph pass feeds them (activations.feed_taps)
      --> the block's outputs are cached for the blocks after it (each dropped after its last reader)

Float outputs propagate: each block reads what the float blocks before it made, so every observer sees
the tensors the whole-graph pass shows it, and the scales come out the same bit for bit (llm-compressor's
sequential pipeline with quantization-aware calibration off). GPTQ's sequential order, which propagates
the rounded blocks' outputs (llm-compressor's default for it), is the weight pass's
(calibration.transforms.gptq.Sequential). docs/streaming.md says which stage propagates what.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from graphcal.calibration.activations import (
    Padding,
    PassResult,
    check_state,
    exchange,
    feed_taps,
    routes_of,
)
from graphcal.calibration.blockwise import Blockwise
from graphcal.calibration.decisions import Loaded, RunPlan
from graphcal.calibration.observe import ObserverSet
from graphcal.config import Smoothing
from graphcal.data import MASK_INPUT, Calibration
from graphcal.errors import GraphcalError
from graphcal.graph.blocks import Block, blocks, layer_prefix
from graphcal.graph.subgraph import indexed
from graphcal.graph.taps import Reduction, TapRequest
from graphcal.graph.targets import scoped_module
from graphcal.progress import Progress

log = logging.getLogger("graphcal")

PASSES = ("auto", "blocks", "whole-graph")  # --pass


def layer_blocks(loaded: Loaded, run: RunPlan) -> list[Block]:
    """The plan's chosen targets in blocks (graph.blocks), or [] where they do not form two or more
    decoder layers (blocks named by a layer number: ``model.layers.3``)."""
    try:
        found = blocks(loaded.model, list(run.chosen), run.groups)
    except GraphcalError:
        return []
    layers = sum(layer_prefix(b.name) == b.name for b in found)
    return found if layers >= 2 else []


def choose_pass(run: RunPlan, loaded: Loaded, calib: Calibration | None, mode: str = "auto") -> RunPlan:
    """The plan with the activation pass it will use (``RunPlan.streamed_blocks``, ``pass_note``):
    block by block where the targets form layer blocks and the data can be read once per block,
    else the whole graph; ``mode`` (--pass) forces one (``blocks`` refused in one line where it
    cannot stream)."""
    if mode not in PASSES:
        raise GraphcalError(f"--pass {mode!r}: choose one of {', '.join(PASSES)}")
    if mode == "whole-graph":
        return dataclasses.replace(run, streamed_blocks=0, pass_note="whole-graph (--pass whole-graph)")
    if not ObserverSet(run, {}).consumers and run.decision(Smoothing) is None:
        return dataclasses.replace(run, streamed_blocks=0, pass_note="none (no activation statistics to take)")
    found = layer_blocks(loaded, run)
    why = None
    if not found:
        why = "the targets form no two layer blocks (module names with a layer number, ending on a residual stream)"
    elif calib is not None and not calib.rereadable:
        why = "a CalibrationDataReader is read once, and a streamed pass reads the data once per block"
    if why is not None:
        if mode == "blocks":
            raise GraphcalError(f"--pass blocks: {why}; use --pass auto or whole-graph")
        return dataclasses.replace(run, streamed_blocks=0, pass_note=f"whole-graph ({why})")
    return dataclasses.replace(run, streamed_blocks=len(found),
                               pass_note=f"streamed block by block ({len(found)} blocks)")


def run_streamed_pass(plan: RunPlan, loaded: Loaded, observers, calib: Calibration, *, device: str, device_id: int = 0,
                      dist=None, progress: bool = False, reduce_in_graph: bool = True, exclude_padding: bool = False,
                      inputs: tuple[str, ...] = (), prelude: tuple[list, list] = ((), ()),
                      label: str = "calibrating", cache_mb: float | None = None, cache_folder=None) -> PassResult:
    """:func:`graphcal.calibration.activations.run_activation_pass`, one layer block at a time (same
    arguments and result; the taps of one block never pass --tap-limit-mb's concern, so the data
    runs once per block, never once per share of the taps). ``cache_mb``, ``cache_folder``: the
    block cache's budget and where its files go past it (calibration.block_cache)."""
    padding = Padding(exclude_padding) if MASK_INPUT in inputs else None
    if exclude_padding:
        reduce_in_graph = False  # rows are selected in torch, so the taps leave onnxruntime whole
    error, provider, done = None, None, 0
    try:
        check_state(observers, dist.world if dist is not None else 1)
        with Blockwise(plan, loaded, calib, device=device, device_id=device_id, rank=dist, cache_mb=cache_mb,
                       cache_folder=cache_folder) as walk:  # the cache's files deleted however the pass ends
            provider, done = _walk(walk, loaded, observers, prelude, padding, reduce_in_graph, progress, label)
    except Exception as e:  # noqa: BLE001 -- under torchrun every rank must hear of it
        if dist is None:
            raise
        error = e
    exchange(dist, observers, error, padding)
    return PassResult(provider, done, padding)


def _walk(walk: Blockwise, loaded: Loaded, observers, prelude: tuple[list, list], padding: Padding | None,
          reduce_in_graph: bool, progress: bool, label: str) -> tuple[str | None, int]:
    """Every block of ``walk`` run on every batch, its taps fed to ``observers`` and its outputs cached
    for the blocks after it: (the provider that ran, the batches this process ran)."""
    placed = place_requests(walk, loaded, observers.requests(reduce_in_graph), prelude)
    provider, done = None, 0
    bar = Progress(f"{label} (blocks)", len(walk.blocks), "block", bar=progress)
    with torch.no_grad(), bar:
        for k, block in enumerate(walk.blocks):
            mine = placed[k]
            if not mine and not walk.needed(k):  # nothing to observe, nothing a later block reads
                walk.keep(k, {})
                bar.update(1)
                continue
            tapped_here = {r.tensor for r in mine}
            nodes = [n for n in prelude[0] if n.output[0] in tapped_here]
            constants = {i for n in nodes for i in n.input}
            runtime, tapped = walk.session(walk.needed(k), list(block.inputs), requests=mine,
                                           prelude=(nodes, [t for t in prelude[1] if t.name in constants]),
                                           priority_order=True)
            provider = runtime.provider
            routes, finite = routes_of(observers, tapped, reduce_in_graph)
            if k == 0:
                whole = sum(r.reduction is Reduction.WHOLE for share in placed for r in share)
                log.info("%s pass block by block on onnxruntime %s (taps to torch on %s), %d blocks: %d whole "
                         "tensors and %d reductions fetched per batch", label, provider, runtime.device,
                         len(walk.blocks), whole, sum(map(len, placed)) - whole)
            kept = walk.holders(k, walk.needed(k))
            try:
                done = 0
                for i, batch, feeds in walk.batch_feeds(k):
                    keep = padding.count(batch, k == 0) if padding is not None else None
                    values = walk.run_cached(runtime, feeds, kept, k, label)
                    if routes:
                        feed_taps(values, routes, tapped, reduce_in_graph, keep, padding, i, observers, finite)
                    del values
                    done += 1
                finite.check_deferred()
            finally:
                runtime.close()
            walk.keep(k, kept)
            bar.update(1)
    return provider, done


def place_requests(walk: Blockwise, loaded: Loaded, requests: list[TapRequest],
                   prelude: tuple[list, list]) -> list[list[TapRequest]]:
    """Each block's share of ``requests``: a tap goes to the block of a target reading its tensor
    (of the tensor ``x`` a prelude's ``x * (1/s)`` is made from), a key/value state's to the block of
    its attention's layer, any other (SmoothQuant's smooth-layer outputs) to the block of the layer
    whose module scope made it. A tap no block owns is a GraphcalError."""
    made = {n.output[0]: n.input[0] for n in prelude[0]}
    by_tensor: dict[str, int] = {}
    by_layer: dict[str, int] = {}
    for k, block in enumerate(walk.blocks):
        for t in block.targets:
            by_tensor.setdefault(t.activation, k)
        by_layer.setdefault(block.name, k)
    kv = {s.key: s.name for s in walk.run.kv_states} | {s.value: s.name for s in walk.run.kv_states}
    index = indexed(loaded.model)

    def layer_of(tensor: str) -> str:
        if tensor in kv:
            return layer_prefix(kv[tensor]) or ""
        p = index.producer.get(tensor)
        scope = scoped_module(index.nodes[p]) if p is not None else None
        return (layer_prefix(scope) if scope else None) or ""

    placed: list[list[TapRequest]] = [[] for _ in walk.blocks]
    for r in requests:
        source = made.get(r.tensor, r.tensor)
        k = by_tensor.get(source)
        if k is None:
            k = by_layer.get(layer_of(source))
        if k is None:
            raise GraphcalError(f"tap {r.tensor!r} belongs to no layer block")
        placed[k].append(r)
    return placed
