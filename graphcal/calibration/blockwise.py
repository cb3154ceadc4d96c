"""The model run block by block on cached inputs: the engine of sequential GPTQ and of AWQ.

    graph.blocks.blocks: the targets in layer blocks, and the tensors that cross between blocks
    for each block, in order:
      its subgraph (graph.blocks.subgraph, weightless; the session reads the model's initializers)
      runs on every batch, fed the batch's graph inputs and the cached tensors earlier blocks made
      --> what the caller taps in the block (Hessians, AWQ's parent inputs)
      --> the block's outputs, cached for the blocks after it (each dropped after its last reader)

Where the session runs on CUDA, what a block run hands back (its outputs, the caller's taps) stays
on the GPU as torch tensors, and is fed back from there (runtime.Runtime.run binds torch tensors
where they lie): no block tensor makes a host round trip. A block's tensors for all the data that
would take more than CACHE_SHARE of the GPU's free memory are kept on the host instead.

The cached tensors (calibration.block_cache.BlockCache) are held in memory up to a budget
(``cache_mb``, --cache-mb; default: half the memory available when the walk starts) and written to
disk beyond it, in a folder inside the output's temporary folder (``cache_folder``), read back when a
block runs; :meth:`Blockwise.close` (callers: in a ``finally``) deletes them.

Nothing runs the whole graph once per block: each block's nodes run once per pass, plus what
depends on no weight (masks, rotary tables, embeddings), which every subgraph recomputes from the
graph inputs. The cache holds the boundary tensors (the residual stream) of every batch, in memory
up to its budget and on disk beyond it; a run whose spill the disk cannot take is refused with an
error that says what to lower. What a caller taps besides (AWQ's parent inputs) is held in memory,
counted and refused likewise when it would not fit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import onnx
import torch

from graphcal.calibration.block_cache import CACHE_SHARE, BlockCache, host_bytes
from graphcal.calibration.decisions import Loaded, RunPlan
from graphcal.data import Calibration
from graphcal.devices import ONNX_TYPE
from graphcal.errors import GraphcalError
from graphcal.graph.blocks import Block, blocks, needed_initializers, subgraph, weight_dependent
from graphcal.graph.io import skeleton, value_types
from graphcal.graph.taps import build_tapped
from graphcal.limits import check_fits, format_size
from graphcal.runtime import open_runtime
from graphcal.types import Target

log = logging.getLogger("graphcal")

# CACHE_SHARE (block_cache's): of the available memory (host, or the GPU's free memory) a block's tensors may take
TORCH_DTYPE = {elem: dtype for dtype, elem in ONNX_TYPE.items()}  # the torch dtype of an ONNX element type
Value = torch.Tensor | np.ndarray  # a cached tensor: torch where the session ran, numpy where torch has no such type


class Blockwise:
    """A plan's chosen targets in blocks, and the cached tensors between them (``cache_mb``: the MB of
    them held in memory, None: the default budget; ``cache_folder``: where the folder for the rest is
    made, None: the system's temporary folder). A context manager: :meth:`close` deletes the cache."""

    def __init__(self, run: RunPlan, loaded: Loaded, calib: Calibration, *, device: str, device_id: int = 0,
                 replaced: set[str] | frozenset[str] = frozenset(), cache_mb: float | None = None,
                 cache_folder: Callable[[], Path] | None = None, rank=None):
        model = loaded.model  # the working model (calibration.decisions.Loaded), read here and not kept
        self.run, self.calib, self.device, self.device_id = run, calib, device, device_id
        self.rank = rank  # torchrun (calibration.distributed.Dist): this rank runs every world-th batch (None: all)
        # a read-only frame, made here, before any weight pass: the subgraphs are cut from the graph as
        # loaded (``frame``, a skeleton without weights) and read the weights as they are now
        # (``originals``). The weight pass may edit the model meanwhile; it adds nodes and initializers
        # and drops those nothing reads any more, never changing one in place, so each initializer is
        # held as it stands, and those an edit to come replaces (``replaced``: the channel scales'
        # fold, ChannelScales.replaced_initializers) are copied. No reference to the model is kept.
        self.frame = skeleton(model)
        self.originals: dict[str, onnx.TensorProto] = {}
        for t in model.graph.initializer:
            if t.name in replaced:
                copy = self.originals[t.name] = onnx.TensorProto()
                copy.CopyFrom(t)
            else:
                self.originals[t.name] = t
        self.targets = list(run.chosen)
        self.blocks: list[Block] = blocks(model, self.targets, run.groups)  # fused units kept whole
        self.dependent = weight_dependent(model, self.targets)
        self.types = dict(loaded.types)
        self.cache = BlockCache.for_run(cache_mb, cache_folder)  # name -> its values per batch
        self._place: torch.device | None = None  # where the running block keeps its values (run_cached)
        # where each target's node reads its weight (the initializer, or the end of its Transpose/Cast
        # path), and the dtype a fed weight takes there: looked up once, fed many times (AWQ's grid)
        nodes = {t.node for t in run.found}
        b_input = {n.name: n.input[1] for n in model.graph.node if n.name in nodes and len(n.input) > 1}
        init_types = {i.name: i.data_type for i in model.graph.initializer}
        self._fed: dict[str, tuple[str, int]] = {}  # (the tensor fed, its ONNX element type)
        for t in run.found:
            if t.node not in b_input:
                raise GraphcalError(f"{t.name}: node {t.node!r} not found")
            name = b_input[t.node]
            known = self.types.get(name)
            elem = init_types.get(name) or (known.elem_type if known is not None else 0)
            self._fed[t.name] = (name, elem or onnx.TensorProto.FLOAT)
        self._inits = set(init_types)
        self._last_reader: dict[str, int] = {}
        for k, b in enumerate(self.blocks):
            for name in b.inputs:
                self._last_reader[name] = k
        log.info("%d layer blocks: %s", len(self.blocks), ", ".join(b.name for b in self.blocks[:4])
                 + (" ..." if len(self.blocks) > 4 else ""))

    # -- sessions ------------------------------------------------------------------------------

    def session(self, outputs: Sequence[str], cut: Sequence[str], weights: Sequence[Target] = (), requests=(),
                prelude: tuple[list, list] = ((), ()), priority_order: bool = False):
        """A runtime over the subgraph computing ``outputs`` and the taps of ``requests``
        (graph.taps.TapRequest: whole tensors or in-graph reductions; ``prelude``: nodes making
        tensors to tap that the model lacks, as graph.taps.build_tapped takes them) from ``cut``;
        ``weights``: targets whose weights are fed per run (:meth:`feed_weight`). Only ``outputs``
        and the taps are graph outputs (a reduced tap's whole tensor is not kept to the run's end).
        Returns (runtime, tapped graph or None)."""

        fed = [self._fed[t.name][0] for t in weights]
        made = {n.output[0]: n.input[0] for n in prelude[0]}  # x * (1/s) is computed from x
        wanted = list(dict.fromkeys([*outputs, *(made.get(r.tensor, r.tensor) for r in requests)]))
        # a weight behind a Transpose/Cast path is fed where the node reads it (a cut tensor)
        sub = subgraph(self.frame, wanted, [*cut, *(n for n in fed if n not in self._inits)],
                       [n for n in fed if n in self._inits], dependent=self.dependent, types=self.types)
        tapped, fetch = None, list(outputs)
        if requests:
            kept = [o for o in sub.graph.output if o.name in set(outputs)]
            del sub.graph.output[:]
            sub.graph.output.extend(kept)
            tapped = build_tapped(sub, list(requests), value_types_of(sub, self.types), prelude)
            sub, fetch = tapped.model, [*outputs, *tapped.fetch]
        runtime = open_runtime(sub, fetch, self.device, device_id=self.device_id, external_folder=self.run.base_dir,
                               weights=self._initializers(sub), priority_order=priority_order)
        return runtime, tapped

    def _initializers(self, sub: onnx.ModelProto) -> list[onnx.TensorProto]:
        """The initializers ``sub`` reads, as they were when the frame was made."""
        return [self.originals[t.name] for t in needed_initializers(sub, self.frame)]

    def feed_weight(self, t: Target, w: torch.Tensor) -> tuple[str, Value]:
        """The feed that stands ``w`` (torch [out, in]) in for ``t``'s weight, as the node reads it: a
        torch tensor where ``w`` lies (on the GPU, fed from there), or a numpy array for an element
        type torch has not."""
        name, elem = self._fed[t.name]
        consumed = (w.T if t.layout == "in_out" else w).detach()
        dtype = TORCH_DTYPE.get(elem)
        if dtype is not None:
            return name, consumed.to(dtype).contiguous()
        return name, np.ascontiguousarray(consumed.cpu().numpy().astype(onnx.helper.tensor_dtype_to_np_dtype(elem),
                                                                          copy=False))

    # -- passes ----------------------------------------------------------------------------------

    def batches(self, k: int) -> Iterator[tuple[int, dict]]:
        """Block ``k``'s feeds for every batch: the graph inputs it needs and the cached tensors it reads."""
        for i, _, feeds in self.batch_feeds(k):
            yield i, feeds

    def batch_feeds(self, k: int) -> Iterator[tuple[int, dict, dict]]:
        """(index, the batch, block ``k``'s feeds) for every batch this process runs (under torchrun
        every world-th): the graph inputs the block needs and the cached tensors it reads."""
        block, j = self.blocks[k], 0
        for i, batch in enumerate(self.calib.batches()):
            if self.rank is not None and i % self.rank.world != self.rank.rank:
                continue
            feeds = {n: batch[n] for n in block.graph_inputs if n in batch}
            for name in block.inputs:
                feeds[name] = self.cache[name][j]
            j += 1
            yield i, batch, feeds

    def run_cached(self, runtime, feeds: dict, out: dict[str, Sequence[Value]], k: int, what: str = "") -> dict:
        """One batch of block ``k``'s ``runtime`` (from :meth:`session`; ``feeds``: what the block may read,
        those the session takes are fed): its values as the runtime gives them (torch tensors, numpy for
        an element type torch has not), and each name of ``out`` (:meth:`holders`) appended a copy of
        its value to keep past the run, out of onnxruntime's memory, which the session's end would
        otherwise pin (on the device the first batch's :meth:`placement` chose; in memory or on disk
        as the cache's budget says). After a holder's first batch, what all the batches will hold is
        checked (:meth:`check_cache`; ``what`` names it in the error)."""
        feeds = {n: v for n, v in feeds.items() if n in runtime.inputs}
        first = bool(out) and len(next(iter(out.values()))) == 0
        if not runtime.torch_outputs:
            values = runtime.run_numpy(feeds)
            copies = {n: values[n] for n in out}
        else:
            values = runtime.run(feeds)
            if first:
                self._place = self.placement(k, {n: values[n] for n in out})
            copies = {n: values[n].to(self._place, copy=True) for n in out}
        if first:
            self.check_cache(k, copies, what)
        for n, value in copies.items():
            out[n].append(value)
        return values

    def holders(self, k: int, names: Sequence[str]) -> dict[str, Sequence[Value]]:
        """Where block ``k``'s values of ``names`` go batch by batch: a spool of the cache's for those a
        later block reads (:meth:`needed`: into the cache's budget as they come, in memory or on disk
        past it; :meth:`keep` takes it as it is), a list for the others (a caller's taps)."""
        kept = set(self.needed(k))
        return {n: self.cache.spool() if n in kept else [] for n in names}

    def run_block(self, k: int, names: Sequence[str], weights: dict[str, torch.Tensor] | None = None,
                  what: str = "", fed: dict[str, tuple[str, Value]] | None = None) -> dict[str, Sequence[Value]]:
        """Block ``k``'s subgraph computing ``names`` from the block's inputs, run on every batch:
        each name's value per batch, a torch tensor where the session ran (on the GPU under CUDA;
        on the host where it would not fit there, :meth:`placement`), or a numpy array for an
        element type torch has not. ``weights`` (target name -> torch [out, in] weight) are fed in
        place of the model's; ``fed`` (target name -> :meth:`feed_weight`'s feed) are such weights in the
        form fed already (sequential GPTQ keeps its rounded weights so: no second copy). The names a later block reads (:meth:`needed`) are spooled into the
        cache's budget as they come (in memory, or on disk past it: a Spool, which :meth:`keep` takes
        as it is); the others are lists. After the first batch, what all the batches will hold is
        checked (:meth:`check_cache`; ``what`` names it in the error)."""
        weights, ready = weights or {}, fed or {}
        by_name = {t.name: t for t in self.run.found}
        runtime, _ = self.session(list(names), list(self.blocks[k].inputs), [by_name[n] for n in [*weights, *ready]])
        fed = dict(self.feed_weight(by_name[n], w) for n, w in weights.items())
        fed.update(ready.values())
        out = self.holders(k, names)
        try:
            for _, feeds in self.batches(k):
                self.run_cached(runtime, {**feeds, **fed}, out, k, what)
        finally:
            runtime.close()
        return out

    def placement(self, k: int, first: dict[str, torch.Tensor]) -> torch.device:
        """Where block ``k``'s tensors for all the data are kept (``first``: their first batch's): where
        the session made them, or the host where they would take more than CACHE_SHARE of the GPU's
        free memory."""
        device = next(iter(first.values())).device
        if device.type != "cuda":
            return device
        nbytes = sum(_nbytes(a) for a in first.values()) * (self.calib.num_batches or 1)
        free, _ = torch.cuda.mem_get_info(device)
        if nbytes <= CACHE_SHARE * free:
            return device
        log.info("block %s: its %s of cached tensors are kept on the host (the GPU has %s free)",
                 self.blocks[k].name, format_size(nbytes), format_size(free))
        return torch.device("cpu")

    def needed(self, k: int) -> list[str]:
        """Block ``k``'s outputs that a later block reads (graph outputs such as logits are not kept)."""
        return [n for n in self.blocks[k].outputs if self._last_reader.get(n, -1) > k]

    def keep(self, k: int, outputs: dict[str, Sequence[Value]]) -> None:
        """Cache block ``k``'s outputs (a :meth:`run_block` spool as it is, a list value by value) and
        drop what no later block reads (its files deleted)."""
        for name, values in outputs.items():
            if self._last_reader.get(name, -1) > k:
                self.cache.put(name, values)
        for name in [n for n in self.cache.names() if self._last_reader.get(n, -1) <= k]:
            self.cache.drop(name)

    def check_cache(self, k: int, first: dict[str, Value], what: str = "") -> None:
        """Refuse to go on when block ``k``'s tensors for all the data (``first``: their first batch's,
        times the batches) cannot be held: those later blocks read go to the cache, which refuses when
        the disk cannot take what would spill past its budget; the others (a caller's taps) are held
        in memory and refused past CACHE_SHARE of it (what lies on the GPU is :meth:`placement`'s business)."""

        batches = self.calib.num_batches or 1
        label = f"{what or f'the tensors between layer blocks ({self.blocks[k].name})'} for {self.calib.num_samples} samples"
        hint = "calibrate on fewer samples (--num-samples) or shorter sequences"
        kept = set(self.needed(k))
        self.cache.check_disk(sum(host_bytes(a) for n, a in first.items() if n in kept) * batches, label)
        taps = sum(host_bytes(a) for n, a in first.items() if n not in kept) * batches
        if taps:
            check_fits(taps, label, CACHE_SHARE, hint=hint)

    def close(self) -> None:
        """Delete the cached tensors (their files and folder). Callers close the walk in a ``finally``."""
        self.cache.close()

    def __enter__(self) -> Blockwise:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _nbytes(value: Value) -> int:
    """The bytes ``value`` holds, wherever it lies."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return value.nbytes


def value_types_of(sub: onnx.ModelProto, types: dict) -> dict:
    """Types for a subgraph: the model's, plus shape inference where the subgraph has new names."""

    known = {v.name for v in sub.graph.input} | {o for n in sub.graph.node for o in n.output}
    if all(n in types for n in known if n):
        return types
    merged = dict(value_types(sub))
    merged.update({k: v for k, v in types.items() if k in known})
    return merged

