"""The peak memory of a run, estimated before it reads any weight: from the graph, the initializers'
dims and types, the plan and the shape of one batch of data (no weight is read).

    peak = imports + max(the activation pass, the weight phase (+ the blockwise passes of sequential GPTQ/AWQ))

Each term is a rule times a constant fitted to peaks measured with tools/peak_rss.py (docs/benchmarks.md,
"Pre-flight: the estimated peak against the measured one"):

- ``imports``: torch, onnxruntime, onnx and compressed-tensors themselves (:data:`IMPORTS`);
- ``weights in onnxruntime``: the float initializers the session holds (onnxruntime reads external data
  from the model's files, inline weights are handed over in place: held once): the whole-graph pass's
  every weight, the streamed pass's one block's (:func:`block_weight_bytes`);
- ``activations``: :data:`ARENA` x the largest intermediate one batch makes (onnx shape inference on the
  skeleton with the batch's shapes; the logits of a pruned lm_head not counted), per session;
- ``taps``: whole taps a batch holds (mse/imatrix observers, --exclude-padding), at most --tap-limit-mb;
- ``hessians``: GPTQ's fp32 input Hessians (one-pass: all; sequential: one block's, and a Gram or the
  working copies of the largest: :func:`blockwise_parts`);
- ``rounded weights``: sequential GPTQ's rounding of a block: its rounded weights and the sweep's copies;
- ``block cache``: the streamed and blockwise passes' cached block inputs (every sample's, one block at a
  time, at most --cache-mb of them in memory);
- ``weight phase``: :func:`weight_phase_bytes` (one weight in hand, and the output where the writer holds it);
- with --rotate, its phase before the passes (:func:`rotation_parts`): the fold's one weight in hand
  (``rotation fold``: :data:`FOLD_COPIES` x the largest rotated weight) and the check's sessions (one at a
  time, one sample's activations): on a decoder one layer block's weights (:func:`block_weight_bytes`, or
  the tail's largest weight), else every weight (whole-graph).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx

from graphcal import limits  # limits.available_memory looked up at each call (tests patch it)
from graphcal.calibration.activations import TAP_LIMIT_MB
from graphcal.calibration.block_cache import budget_bytes
from graphcal.calibration.observe import ObserverSet
from graphcal.calibration.transforms.awq import AWQSettings
from graphcal.calibration.transforms.rotation import streams_check
from graphcal.calibration.transforms.smoothquant import Smoothing
from graphcal.config import RotationSettings
from graphcal.errors import GraphcalError
from graphcal.graph.blocks import layer_prefix
from graphcal.graph.io import skeleton
from graphcal.graph.spill import streams
from graphcal.graph.taps import Reduction
from graphcal.limits import format_size

IMPORTS = 400_000_000  # torch + onnxruntime + onnx + compressed-tensors, measured: 0.40-0.42 GB on tiny-llama
ARENA = 6.0  # onnxruntime's CPU arena over the largest intermediate (several alive, rounded up to powers of two)
OUTPUT_HELD = 0.9  # the writer holds every written tensor (an input under graph.spill.STREAM_MIN_BYTES of external data)
WEIGHT_COPIES = 2.0  # one weight in hand: its float read and the fp32 torch copy
GRAM_COPIES = 1.5  # sequential GPTQ's block session: a batch's Gram of the widest input (onnxruntime's blocks, assembled)
HESSIAN_COPIES = 2.0  # its rounding: the working copies of the largest Hessian beside it (H, its factor, H^-1: two at a time)
SWEEP_COPIES = 4.0  # its rounding: the largest weight in the sweep (transposed copy, grid, result, unpermuted result)
FOLD_COPIES = 6.0  # the fold's one weight: read, in float64 and rotated in float64 (two each), cast and its bytes
MARGIN = 1.15  # run refuses past available / MARGIN: the estimate is fitted within +-25%, the rest is page cache

PASSES = ("whole-graph", "streamed", "blockwise", "none")


@dataclass(frozen=True)
class Footprint:
    """The estimate: ``parts`` (bytes, by name, those of the phase that peaks) and the pass it assumes."""

    parts: Mapping[str, int]
    pass_kind: str
    batch: int
    seq: int
    phases: Mapping[str, int] = field(default_factory=dict)  # each phase's own total, imports included

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def dominant(self) -> str:
        return max(self.parts, key=lambda k: self.parts[k])

    def line(self, available: int | None) -> str:
        shown = ", ".join(f"{k} {format_size(v)}" for k, v in self.parts.items() if v)
        of = f" of {format_size(available)} available" if available is not None else ""
        return f"peak memory ~{format_size(self.total)} ({shown}){of}"

    def as_dict(self, available: int | None = None) -> dict:
        return {"peak_bytes": self.total, "parts": dict(self.parts), "pass": self.pass_kind, "batch": self.batch,
                "seq": self.seq, "available_bytes": available}

    def fits(self, available: int | None, resident: int = 0) -> bool:
        """Whether the peak, less what the process already holds (``resident``: the imports, the graph),
        fits the memory available with :data:`MARGIN`."""
        return available is None or max(0, self.total - resident) * MARGIN <= available

    def refusal(self, available: int) -> str:
        """One line: what dominates and what would fix it (run's refusal)."""
        top = self.dominant()
        fixes = {"weights in onnxruntime": ("--pass blocks (a decoder's pass one layer block at a time), or "
                                            if self.pass_kind == "whole-graph" else "")
                 + "a weight-only scheme with no data pass (W4A16, NVFP4A16)",
                 "activations": "a smaller --batch-size",
                 "taps": "a smaller --tap-limit-mb",
                 "hessians": "--gptq-order sequential" if self.pass_kind == "whole-graph" else "a smaller --batch-size",
                 "block cache": "a smaller --cache-mb (the rest of the cache on disk)"}
        fix = fixes[top] + " or a machine with more memory" if top in fixes else "a machine with more memory"
        return (f"this run needs about {format_size(self.total)} of memory at its peak, more than the "
                f"{format_size(available)} available ({top} {format_size(self.parts[top])} dominate); try {fix}, "
                "or --ignore-memory-check to run anyway")


def estimate(model: onnx.ModelProto, plan, input_shapes: Mapping[str, tuple[int, ...]], *, pass_kind: str,
             num_samples: int = 1, gptq: str | None = None, whole_tap_bytes: int = 0,
             cache_budget: int | None = None, rotation: bool = False, rotation_streamed: bool = False) -> Footprint:
    """The peak memory of ``plan``'s run on ``model`` (dims and types only) with batches shaped
    ``input_shapes``. ``pass_kind``: "whole-graph" (one onnxruntime session over the tapped graph),
    "blockwise" (block subgraphs over cached inputs: sequential GPTQ, AWQ) or "none" (weight-only round
    to nearest: no data pass); ``gptq``: None, "one-pass" or "sequential" (its blockwise passes run in
    the weight phase); ``whole_tap_bytes``: whole taps a batch holds (at most --tap-limit-mb);
    ``cache_budget``: the bytes of cached block tensors held in memory (--cache-mb; the rest goes to disk);
    ``rotation``: --rotate's fold and check ran first (:func:`rotation_parts`; ``rotation_streamed``: its check
    block by block)."""
    if pass_kind not in PASSES:
        raise ValueError(pass_kind)
    shapes = dict(input_shapes)
    batch = next((s[0] for s in shapes.values() if len(s) >= 1), 1)
    seq = next((s[1] for s in shapes.values() if len(s) >= 2), 1)
    chosen = list(plan.chosen)
    act = int(ARENA * largest_intermediate(model, shapes, {t.node for t in chosen}))
    weight = weight_phase_bytes(plan, model)
    phases, parts = {}, {}
    if pass_kind in ("whole-graph", "streamed"):
        streamed = pass_kind == "streamed"
        pass_parts = {"weights in onnxruntime": block_weight_bytes(model, plan) if streamed else float_initializer_bytes(model),
                      "activations": act, "taps": whole_tap_bytes,
                      "hessians": hessian_bytes(chosen) if gptq == "one-pass" else 0}
        if streamed:
            pass_parts["block cache"] = _within(cache_bytes(plan, seq, num_samples), cache_budget)
        phases["pass"] = sum(pass_parts.values())
        parts = pass_parts
    weight_parts = {"weight phase": weight}
    if gptq == "sequential" or pass_kind == "blockwise":
        weight_parts.update(blockwise_parts(model, plan, batch, seq, num_samples, act, rounding=gptq == "sequential"))
        weight_parts["block cache"] = _within(weight_parts["block cache"], cache_budget)
    phases["weights"] = sum(weight_parts.values())
    if phases["weights"] >= phases.get("pass", 0):
        parts = weight_parts
    if rotation:
        rotation_phase = rotation_parts(model, act // max(batch, 1), plan if rotation_streamed else None)
        phases["rotation"] = sum(rotation_phase.values())
        if phases["rotation"] > max(phases["weights"], phases.get("pass", 0)):
            parts = rotation_phase
    return Footprint({"imports": IMPORTS, **parts}, pass_kind, batch, seq,
                     {k: IMPORTS + v for k, v in phases.items()})


def rotation_parts(model: onnx.ModelProto, act: int, plan=None) -> dict[str, int]:
    """--rotate's phase (the rotated ``model``): the fold holds one weight at a time, each written to the run's
    own data file before the next is read (:data:`FOLD_COPIES` x the largest, in float32), and its check runs
    the model as given, then the rotated one, on one sample (``act``: one sample's activations): whole-graph,
    every weight in onnxruntime, or with ``plan`` (its targets in layer blocks) block by block
    (calibration.block_outputs): one block's weights (:func:`block_weight_bytes`) or the tail's (lm_head: at
    most the largest weight). The fold and the check do not overlap: the larger counts."""
    largest = max((4 * math.prod(t.dims) for t in model.graph.initializer), default=0)
    held = float_initializer_bytes(model) if plan is None else max(block_weight_bytes(model, plan),
                                                                     max(map(_init_bytes, model.graph.initializer), default=0))
    check = {"weights in onnxruntime": held, "activations": act}
    fold = {"rotation fold": int(FOLD_COPIES * largest)}
    return fold if fold["rotation fold"] >= sum(check.values()) else check


def weight_phase_bytes(plan, model: onnx.ModelProto) -> int:
    """The weight phase's own peak: one float weight in hand (:data:`WEIGHT_COPIES` x the largest chosen
    one, embedding lookups included) plus the output as the writer holds it: every written tensor until the
    model is saved (:data:`OUTPUT_HELD` x the expected output), or nothing where the writer streams each
    tensor to the output's data file as it is made (graph.spill.streams: an input with 256 MB or more of
    external data; the float tensors kept are copied a chunk at a time)."""
    inits = {t.name: t for t in model.graph.initializer}
    largest = max((_init_bytes(inits[t.weight]) for t in (*plan.chosen, *plan.lookups) if t.weight in inits), default=0)
    held = 0 if streams(plan.data_bytes) else OUTPUT_HELD * max(plan.expected_size, 0)
    return int(held + WEIGHT_COPIES * largest)


def blockwise_parts(model: onnx.ModelProto, plan, batch: int, seq: int, num_samples: int, act: int,
                    rounding: bool = True) -> dict[str, int]:
    """Sequential GPTQ's and AWQ's block passes: the parts of the phase of a block that peaks
    (:func:`blockwise_phases`; the two do not overlap: the session is closed before the rounding)."""
    phases = blockwise_phases(model, plan, batch, seq, num_samples, act, rounding)
    return max(phases, key=lambda parts: sum(parts.values()))


def blockwise_phases(model: onnx.ModelProto, plan, batch: int, seq: int, num_samples: int, act: int,
                     rounding: bool = True) -> list[dict[str, int]]:
    """The parts of each phase of a block (a list: the session's, then with ``rounding`` GPTQ's rounding's):

    - a block's session: one block's weights (each block's session reads its own from the model's
      files and lets them go when it closes: :func:`block_weight_bytes`), one block's Hessians, and for
      GPTQ (``rounding``) a batch's Gram of the widest input as onnxruntime hands it and assembled
      (:data:`GRAM_COPIES` x the largest Hessian), every sample's cached block inputs and outputs at the
      hidden width, and one batch's activations;
    - GPTQ's rounding of the block (no session open): the block's Hessians (each let go once its last
      layer is rounded) plus :data:`HESSIAN_COPIES` working copies of the largest, the block's rounded
      weights kept for its propagation run, :data:`SWEEP_COPIES` x the largest weight (the sweep's), and
      the cache."""
    inits = {t.name: t for t in model.graph.initializer}
    heaviest = max(_blocks(plan).values(), key=lambda ts: _weights_of(ts, inits))
    hidden = min((t.in_features for t in heaviest), default=1)  # q/k/v's input: the residual stream's width
    hessians = hessian_bytes(heaviest)
    widest = max((4 * t.in_features ** 2 for t in heaviest), default=0)
    cache = _cache_bytes(num_samples, seq, hidden)
    session = {"weights in onnxruntime": block_weight_bytes(model, plan),
               "hessians": hessians + (int(GRAM_COPIES * widest) if rounding else 0),
               "block cache": cache, "activations": act}
    if not rounding:
        return [session]
    largest = max((4 * t.in_features * t.out_features for t in heaviest), default=0)
    return [session, {"hessians": hessians + int(HESSIAN_COPIES * widest),
                      "rounded weights": _weights_of(heaviest, inits) + int(SWEEP_COPIES * largest), "block cache": cache}]


def block_weight_bytes(model: onnx.ModelProto, plan) -> int:
    """The weights one block's session of the streamed pass holds, at most: the heaviest layer block's
    targets, or the first block's with the largest initializer no target reads (the embedding table,
    which the first block's subgraph reads to compute its input)."""
    inits = {t.name: t for t in model.graph.initializer}
    per_block = [_weights_of(ts, inits) for ts in _blocks(plan).values()]  # in graph order: the first block first
    targets = {t.weight for t in plan.found}
    other = max((_init_bytes(t) for t in model.graph.initializer if t.name not in targets), default=0)
    return max(max(per_block, default=0), (per_block[0] if per_block else 0) + other)


def _blocks(plan) -> dict[str, list]:
    """The chosen targets by layer block (their module names' layer prefix, graph.blocks.layer_prefix;
    a target outside the layers a block of its own), in graph order."""
    out: dict[str, list] = {}
    for t in plan.chosen:
        out.setdefault(layer_prefix(t.name) or t.name, []).append(t)
    return out


def _weights_of(targets, inits: Mapping[str, onnx.TensorProto]) -> int:
    """Bytes of ``targets``' weights (dims x element size: nothing is read)."""
    return sum(_init_bytes(inits[t.weight]) for t in targets if t.weight in inits)


def _within(nbytes: int, budget: int | None) -> int:
    """What of ``nbytes`` of cached tensors stays in memory under the cache's ``budget`` (None: all)."""
    return nbytes if budget is None else min(nbytes, budget)


def cache_bytes(plan, seq: int, num_samples: int) -> int:
    """The streamed pass's cache: every sample's boundary tensors (the residual stream) at the hidden
    width in fp32, a block's inputs and its outputs at once."""
    return _cache_bytes(num_samples, seq, min((t.in_features for t in plan.chosen), default=1))


def _cache_bytes(num_samples: int, seq: int, hidden: int) -> int:
    """Every sample's boundary tensors at ``hidden`` wide in fp32: a block's inputs and its outputs at once."""
    return 2 * 4 * num_samples * seq * hidden


def hessian_bytes(targets) -> int:
    """fp32 Hessians of the distinct activations ``targets`` read."""
    seen = {t.activation: t.in_features for t in targets}
    return sum(4 * n * n for n in seen.values())


def float_initializer_bytes(model: onnx.ModelProto) -> int:
    """Bytes of every initializer of the main graph (dims x element size: nothing is read)."""
    return sum(_init_bytes(t) for t in model.graph.initializer)


def largest_intermediate(model: onnx.ModelProto, input_shapes: Mapping[str, tuple[int, ...]],
                         until: set[str]) -> int:
    """Bytes of the largest value one batch makes before the last of the nodes ``until`` (the chosen
    targets: what the tapped pass computes; a pruned lm_head's logits are not), by onnx shape inference
    on the graph's skeleton with the inputs' dims set to ``input_shapes``; 0 where nothing is inferred."""
    frame = _frame(model, input_shapes)
    try:
        inferred = onnx.shape_inference.infer_shapes(frame, data_prop=True)
    except Exception:  # noqa: BLE001 -- onnx raises its own types; no estimate of activations then
        return 0
    last = max((k for k, n in enumerate(frame.graph.node) if n.name in until), default=len(frame.graph.node) - 1)
    computed = {o for n in frame.graph.node[:last + 1] for o in n.output}
    best = 0
    for v in inferred.graph.value_info:
        if v.name not in computed or not v.type.HasField("tensor_type"):
            continue
        tt = v.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in tt.shape.dim]
        if not dims or not all(dims):
            continue
        try:
            size = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).itemsize
        except (KeyError, TypeError, ValueError):
            size = 4
        best = max(best, math.prod(dims) * size)
    return best


def _frame(model: onnx.ModelProto, input_shapes: Mapping[str, tuple[int, ...]]) -> onnx.ModelProto:
    frame = skeleton(model)
    for inp in frame.graph.input:
        shape = input_shapes.get(inp.name)
        if shape is None or not inp.type.HasField("tensor_type"):
            continue
        dims = inp.type.tensor_type.shape.dim
        if len(dims) != len(shape):
            continue
        for d, n in zip(dims, shape):
            d.Clear()
            d.dim_value = int(n)
    return frame


def _init_bytes(t: onnx.TensorProto) -> int:
    try:
        size = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        size = 1
    return math.prod(t.dims) * size


def for_run(ready, tap_limit_mb: float | None = None, exclude_padding: bool = False,
            cache_mb: float | None = None) -> Footprint:
    """The estimate for a prepared run (graphcal.calibration.prepare.Prepared, with its data): which
    pass the run takes from its plan, the batch's shapes from the data's first batch (data, not weights)."""
    run, calib = ready.plan, ready.calib
    first = calib.first_batch() if calib is not None else {}
    shapes = {k: tuple(np.shape(v)) for k, v in first.items()}
    observers = ObserverSet(run, {})
    gptq = run.config.gptq.order if run.config.gptq is not None else None
    if observers.consumers or run.decision(Smoothing) is not None:
        kind = "streamed" if run.streamed_blocks else "whole-graph"
    elif run.decision(AWQSettings) is not None or gptq == "sequential":
        kind = "blockwise"
    else:
        kind = "none"
    whole = 0
    rotation = run.decision(RotationSettings) is not None
    if observers.consumers:
        requests = observers.requests(not exclude_padding)
        n_whole = sum(getattr(r, "reduction", None) is Reduction.WHOLE for r in requests)
        batch = next((s[0] for s in shapes.values() if s), 1)
        seq = next((s[1] for s in shapes.values() if len(s) >= 2), 1)
        width = max((t.in_features for t in run.chosen), default=1)
        limit = int((TAP_LIMIT_MB if tap_limit_mb is None else tap_limit_mb) * 1e6)
        whole = min(limit, n_whole * batch * seq * width * 4)
    return estimate(ready.loaded.model, run, shapes, pass_kind=kind,
                    num_samples=calib.num_samples if calib is not None else 1, gptq=gptq, whole_tap_bytes=whole,
                    cache_budget=budget_bytes(cache_mb), rotation=rotation, rotation_streamed=rotation and streams_check(run, ready.loaded))


def check_memory(ready, tap_limit_mb: float | None = None, exclude_padding: bool = False,
                 cache_mb: float | None = None) -> Footprint:
    """Refuse (GraphcalError, one line) a run whose estimated peak, with :data:`MARGIN`, exceeds the
    memory available (graphcal.limits.available_memory: MemAvailable and the cgroup's limit)."""
    fp = for_run(ready, tap_limit_mb, exclude_padding, cache_mb)
    free = limits.available_memory()
    if not fp.fits(free, limits.resident_memory()):
        raise GraphcalError(fp.refusal(free))
    return fp
