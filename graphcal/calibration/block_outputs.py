"""A decoder's graph outputs on one sample, computed one layer block at a time (--rotate's check, issue 47).

    for each layer block k (calibration.blockwise.Blockwise over the plan's targets):
      its subgraph, opened with the weights it reads and no others, runs on the sample and the cached
      outputs of the blocks before it
      --> its outputs a later block reads are cached for it (each dropped after its last reader);
          the graph outputs it makes (a layer's present key/value) and what the tail reads are kept
    the tail: the nodes after the last block (the final norm, lm_head, whatever makes the logits) in one
    session over what they read

One block's weights are in onnxruntime at a time (or the tail's), never the model's: the memory a
whole-graph session of the model would take is never needed. Every session runs through
``Runtime.run_numpy`` on the run's device, as the whole-graph check does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx

from graphcal.calibration.blockwise import Blockwise
from graphcal.calibration.decisions import Loaded, RunPlan
from graphcal.graph.index import GraphIndex
from graphcal.graph.targets import find_targets


class OneSample:
    """One batch of feeds as a Calibration (graphcal.data.Calibration) for a Blockwise walk."""

    rereadable = True
    num_samples = 1
    notes: list[str] = []

    def __init__(self, feeds: dict[str, np.ndarray]):
        self._feeds = feeds

    @property
    def num_batches(self) -> int:
        return 1

    def batches(self) -> Iterator[dict[str, np.ndarray]]:
        yield self._feeds

    def first_batch(self) -> dict[str, np.ndarray]:
        return self._feeds

    def check_values(self) -> int:
        return 0


def graph_outputs(run: RunPlan, loaded: Loaded, feeds: dict[str, np.ndarray], device: str = "cpu",
                  device_id: int = 0) -> dict[str, np.ndarray]:
    """Every graph output of ``loaded``'s model on ``feeds`` (one batch), its layer blocks (``run``'s
    targets, graph.blocks) run one at a time, then the tail."""
    wanted = [o.name for o in loaded.model.graph.output]
    with Blockwise(run, loaded, OneSample(feeds), device=device, device_id=device_id) as walk:
        made = {o for b in walk.blocks for o in b.outputs}
        rest = [n for n in wanted if n not in made]
        tail_reads: set[str] = set()
        if rest:
            _, _, _, tail_reads = GraphIndex(walk.frame.graph).walk(rest, made)
        keep = set(wanted) | tail_reads
        found: dict[str, np.ndarray] = {}
        for k, block in enumerate(walk.blocks):
            runtime, _ = walk.session(list(block.outputs), list(block.inputs))
            try:
                (_, _, block_feeds), = walk.batch_feeds(k)
                values = runtime.run_numpy({n: v for n, v in block_feeds.items() if n in runtime.inputs})
            finally:
                runtime.close()
            found.update({n: v for n, v in values.items() if n in keep})
            walk.keep(k, {n: [v] for n, v in values.items()})
            del values
        if rest:
            runtime, _ = walk.session(rest, sorted(tail_reads))
            try:
                tail_feeds = {**feeds, **{n: found[n] for n in tail_reads}}
                found.update(runtime.run_numpy({n: v for n, v in tail_feeds.items() if n in runtime.inputs}))
            finally:
                runtime.close()
    return {n: found[n] for n in wanted}


def as_given(run: RunPlan, model: onnx.ModelProto, data_files: tuple[str, ...], model_path) -> tuple[RunPlan, Loaded]:
    """The plan and Loaded for a walk of the model as given (``model``: read lazily from ``model_path``),
    where ``run`` is the plan made on its rewritten form: its own targets (graph.targets), those of the
    run's chosen names it still has, read from the model's folder."""
    chosen = {t.name for t in run.chosen}
    found = tuple(find_targets(model)[0])
    mine = tuple(t for t in found if t.name in chosen)
    names = {t.name for t in mine}
    groups = tuple(g for g in run.groups if all(m in names for m in g.members))
    plan = dataclasses.replace(run, model_path=Path(model_path), data_files=tuple(data_files), found=found,
                               chosen=mine, groups=groups)
    return plan, Loaded(model, tuple(data_files), {})
