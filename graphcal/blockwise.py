"""The model run block by block on cached inputs: the engine of sequential GPTQ and of AWQ.

    graph.blocks.blocks: the targets in layer blocks, and the tensors that cross between blocks
    for each block, in order:
      its subgraph (graph.blocks.subgraph, weightless; the session reads the model's initializers)
      runs on every batch, fed the batch's graph inputs and the cached tensors earlier blocks made
      --> what the caller taps in the block (Hessians, AWQ's parent inputs)
      --> the block's outputs, cached for the blocks after it (each dropped after its last reader)

Nothing runs the whole graph once per block: each block's nodes run once per pass, plus what
depends on no weight (masks, rotary tables, embeddings), which every subgraph recomputes from the
graph inputs. The cache holds the boundary tensors (the residual stream) of every batch; it is
counted and refused with an error that says what to lower when it would not fit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import numpy as np
import onnx
import torch

from graphcal.errors import GraphcalError
from graphcal.graph.blocks import Block, blocks, needed_initializers, subgraph, weight_dependent
from graphcal.plan import RunPlan
from graphcal.runtime import open_runtime
from graphcal.types import Target

log = logging.getLogger("graphcal")

CACHE_SHARE = 0.5  # of the available memory the cached tensors may take


class Blockwise:
    """A plan's chosen targets in blocks, and the cached tensors between them."""

    def __init__(self, run: RunPlan, calib, *, device: str, device_id: int = 0):
        self.run, self.calib, self.device, self.device_id = run, calib, device, device_id
        self.targets = list(run.chosen)
        self.blocks: list[Block] = blocks(run.model, self.targets)
        self.dependent = weight_dependent(run.model, self.targets)
        self.types = dict(run.types)
        self.cache: dict[str, list[np.ndarray]] = {}
        self._last_reader: dict[str, int] = {}
        for k, b in enumerate(self.blocks):
            for name in b.inputs:
                self._last_reader[name] = k
        log.info("%d layer blocks: %s", len(self.blocks), ", ".join(b.name for b in self.blocks[:4])
                 + (" ..." if len(self.blocks) > 4 else ""))

    # -- sessions ------------------------------------------------------------------------------

    def session(self, outputs: Sequence[str], cut: Sequence[str], weights: Sequence[Target] = (), requests=()):
        """A runtime over the subgraph computing ``outputs`` (plus the in-graph reductions of
        ``requests``, graph.taps.TapRequest) from ``cut``; ``weights``: targets whose weights
        are fed per run (:meth:`feed_weight`). Returns (runtime, tapped graph or None)."""
        from graphcal.graph.taps import build_tapped

        model = self.run.model
        inits = {t.name for t in model.graph.initializer}
        fed = [_weight_tensor(model, t) for t in weights]
        # a weight behind a Transpose/Cast path is fed where the node reads it (a cut tensor)
        sub = subgraph(model, list(outputs) or [r.tensor for r in requests], [*cut, *(n for n in fed if n not in inits)],
                       [n for n in fed if n in inits], dependent=self.dependent, types=self.types)
        tapped, fetch = None, list(outputs)
        if requests:
            tapped = build_tapped(sub, list(requests), value_types_of(sub, self.types))
            sub, fetch = tapped.model, [*outputs, *tapped.fetch]
        runtime = open_runtime(sub, fetch, self.device, device_id=self.device_id, external_folder=self.run.base_dir,
                               weights=needed_initializers(sub, model))
        return runtime, tapped

    def feed_weight(self, t: Target, w: torch.Tensor) -> tuple[str, np.ndarray]:
        """The feed that stands ``w`` (torch [out, in]) in for ``t``'s weight, as the node reads it."""
        name = _weight_tensor(self.run.model, t)
        consumed = w.T if t.layout == "in_out" else w
        elem = self.types.get(name)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(elem.elem_type) if elem is not None and elem.elem_type \
            else np.float32
        inits = {i.name: i for i in self.run.model.graph.initializer}
        if name in inits:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(inits[name].data_type)
        return name, np.ascontiguousarray(consumed.detach().cpu().numpy().astype(dtype, copy=False))

    # -- passes ----------------------------------------------------------------------------------

    def batches(self, k: int) -> Iterator[tuple[int, dict]]:
        """Block ``k``'s feeds for every batch: the graph inputs it needs and the cached tensors it reads."""
        block = self.blocks[k]
        for i, batch in enumerate(self.calib.batches()):
            feeds = {n: batch[n] for n in block.graph_inputs if n in batch}
            for name in block.inputs:
                feeds[name] = self.cache[name][i]
            yield i, feeds

    def needed(self, k: int) -> list[str]:
        """Block ``k``'s outputs that a later block reads (graph outputs such as logits are not kept)."""
        return [n for n in self.blocks[k].outputs if self._last_reader.get(n, -1) > k]

    def keep(self, k: int, outputs: dict[str, list[np.ndarray]]) -> None:
        """Cache block ``k``'s outputs and drop what no later block reads."""
        for name, values in outputs.items():
            if self._last_reader.get(name, -1) > k:
                self.cache[name] = values
        for name in [n for n in self.cache if self._last_reader.get(n, -1) <= k]:
            del self.cache[name]

    def check_cache(self, k: int, first: dict[str, np.ndarray]) -> None:
        """Refuse to go on when block ``k``'s outputs for all the data (``first``: its first batch's,
        times the batches), with what is cached already, would not fit."""
        from graphcal.limits import check_fits

        batches = self.calib.num_batches or 1
        nbytes = sum(a.nbytes for a in first.values()) * batches
        nbytes += sum(sum(a.nbytes for a in v) for n, v in self.cache.items() if n not in first)
        check_fits(nbytes, f"the tensors between layer blocks ({self.blocks[k].name}) for "
                   f"{self.calib.num_samples} samples", CACHE_SHARE,
                   hint="calibrate on fewer samples (--num-samples) or shorter sequences")


def value_types_of(sub: onnx.ModelProto, types: dict) -> dict:
    """Types for a subgraph: the model's, plus shape inference where the subgraph has new names."""
    from graphcal.graph.io import value_types

    known = {v.name for v in sub.graph.input} | {o for n in sub.graph.node for o in n.output}
    if all(n in types for n in known if n):
        return types
    merged = dict(value_types(sub))
    merged.update({k: v for k, v in types.items() if k in known})
    return merged


def _weight_tensor(model: onnx.ModelProto, t: Target) -> str:
    """The tensor ``t``'s node reads its weight from (B input: the initializer, or the end of its path)."""
    node = next((n for n in model.graph.node if n.name == t.node), None)
    if node is None:
        raise GraphcalError(f"{t.name}: node {t.node!r} not found")
    return node.input[1]
