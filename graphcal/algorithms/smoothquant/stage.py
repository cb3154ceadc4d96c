"""SmoothQuant as a stage: llm-compressor's SmoothQuantModifier on the ONNX graph.

    plan.smoothing (graph.smooth: which activations, folded where)
      --ReduceMin/ReduceMax per channel in the graph--> each smooth layer's output range
      --smoothing_scales: llm-compressor's formula--> s per mapping
      --> Smoothed: what the later stages apply
            observers of a smoothed activation see x * (1/s) (the smoothed model computes the same
            function, so nothing else changes), the weight pass multiplies each balance weight's input
            columns by s (and divides a linear smooth layer's output rows), and fold() writes the rest
            into the output graph: the norm's scale and bias divided by s, a linear layer's bias, or an
            explicit Mul.

:func:`smooth_and_calibrate` runs it with the calibration pass. When every observer of a smoothed
activation keeps running per-tensor or per-group extrema (static_minmax, in-graph reductions), that
is one pass: the per-channel extrema of x are all it needs, since min(x * c) = min(x) * c for c > 0
in floating point too (rounding is monotonic), so they are replayed through 1/s once s is known.
Otherwise (moving averages, MSE, whole tensors, --exclude-padding, torchrun) a first pass takes the
ranges and the calibration pass taps x * (1/s) beside the unsmoothed model: one extra pass.

The statistics are llm-compressor's: per channel, max - min of the smooth layer's output over
every position of every batch (padding included, as llm-compressor counts it). The scales:
``s = range^a / (2 * max|W_col|)^(1-a)`` pooled over the balance layers (``range`` where every
balance column is zero), or ``range / log2(2 + range)`` for log_equalization, clamped at 1e-5.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from graphcal.calibration.observe import Consumer, Consumers, Feed
from graphcal.calibration.plan import RunPlan
from graphcal.graph.scaling import Mapping, divide_params, explicit_mul, replace_weight, tap_nodes
from graphcal.graph.taps import Reduction, TapRequest
from graphcal.graph.targets import torch_weight
from graphcal.types import Target

log = logging.getLogger("graphcal")

MINIMUM_SMOOTHING_SCALE = 1e-5  # llm-compressor's clamp
SEARCH_GRID = tuple(round(0.1 * i, 1) for i in range(1, 11))  # --smoothing-strength auto: 0.1 ... 1.0
SEARCH_ROWS = 256  # rows of each smoothed activation the search scores candidates on
METADATA_KEY = "graphcal.smoothquant"  # the output model's record of what was smoothed (metadata_props)
AWQ_METADATA_KEY = "graphcal.awq"  # likewise for AWQ's scales (graphcal.algorithms.awq.stage)


def smoothing_scales(min_vals: torch.Tensor, max_vals: torch.Tensor, weights: list[torch.Tensor], strength: float,
                     algorithm: str = "smoothquant") -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, unclamped scales) of one mapping, as llm-compressor's SmoothQuantModifier computes
    them: ``weights`` are the balance layers' torch [out, in] weights."""
    activation = max_vals - min_vals
    if algorithm == "log_equalization":
        scales = activation / torch.log2(2 + activation)
    else:
        weight_max = torch.cat([w.abs() for w in weights], dim=0).amax(dim=0)
        weight_scale = 2 * weight_max
        scales = activation.pow(strength) / weight_scale.pow(1 - strength)
        scales = torch.where(weight_scale > 0.0, scales, activation)
    clamped = torch.maximum(scales, torch.tensor([MINIMUM_SMOOTHING_SCALE], device=scales.device))
    return clamped, scales


class RangeSet(Consumers):
    """A running per-channel min/max observer on each tensor of ``tensors`` (name -> channels):
    the mappings' smooth-layer outputs, and in the single pass the activations they smooth."""

    def __init__(self, tensors: dict[str, int], others: list[Consumer] = (), sampled: list[str] = (),
                 batches: int | None = None):
        from compressed_tensors.quantization import QuantizationArgs

        from graphcal.observers import Observer

        self.consumers = list(others)
        self.samples = {x: RowSample(SEARCH_ROWS, batches) for x in sampled}  # the strength search's rows
        self.consumers += [Consumer(x, Feed.INPUT, sample, None) for x, sample in self.samples.items()]
        self.ranges: dict[str, object] = {}  # tensor -> observer
        for tensor, channels in tensors.items():
            # group size 1: one min/max per channel, over every other dimension
            args = QuantizationArgs(num_bits=8, type="int", symmetric=False, strategy="group", group_size=1,
                                    dynamic=False, observer="static_minmax")
            obs = Observer.load_from_registry("static_minmax", base_name="input", args=args)
            self.ranges[tensor] = obs
            self.consumers.append(Consumer(tensor, Feed.INPUT, obs,
                                           TapRequest(tensor, Reduction.CHANNEL, channels)))

    def extrema(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {t: (o.min_vals.cpu(), o.max_vals.cpu()) for t, o in self.ranges.items() if o.has_statistics}

    def rows(self) -> dict[str, torch.Tensor]:
        """The sampled rows of each activation that got any."""
        return {x: sample.value() for x, sample in self.samples.items() if sample.kept}


class RowSample:
    """Up to ``rows`` rows of an activation, spread over the batches (SmoothQuant's strength search)."""

    takes_extrema = False
    observer_name = "smoothing strength search"

    def __init__(self, rows: int, batches: int | None):
        self.rows, self.per_batch = rows, max(1, -(-rows // batches)) if batches else rows
        self.kept: list[torch.Tensor] = []
        self.count = 0

    def __call__(self, x: torch.Tensor, extrema=None) -> None:  # extrema: as observers take them, unused
        if self.count >= self.rows:
            return
        flat = x.reshape(-1, x.shape[-1])
        take = min(self.per_batch, self.rows - self.count, flat.shape[0])
        index = torch.linspace(0, flat.shape[0] - 1, take, device=flat.device).round().long()
        self.kept.append(flat[index].float().cpu())
        self.count += take

    def value(self) -> torch.Tensor:
        return torch.cat(self.kept)

    # under torchrun nothing is exchanged: rank 0 scores its own sample (graphcal.calibration.distributed)
    sync_ops: dict = {}

    def state_dict_stats(self) -> dict:
        return {}


def statistics(mappings: list[Mapping], search: bool, batches: int | None, others=(), also: dict[str, int] = ()) -> RangeSet:
    """The consumers SmoothQuant needs: each smooth layer's output range; with the strength
    ``search``, each smoothed activation's range and a sample of its rows; ``also``: more ranges."""
    tensors = {m.candidate.tensor: m.candidate.channels for m in mappings}
    tensors.update(also)
    sampled = []
    if search:
        for m in mappings:
            tensors.setdefault(m.candidate.activation, m.candidate.channels)
        sampled = list(dict.fromkeys(m.candidate.activation for m in mappings))
    return RangeSet(tensors, others, sampled, batches)


def taps_of(mappings: list[Mapping]) -> dict[str, str]:
    """Target name -> the smoothed activation its observers tap (graph.smooth.Mapping.tapped)."""
    return {b: m.tapped for m in mappings for b in m.balance}


@dataclass
class Smoothed:
    """The scales of every mapping, and how each later stage applies them."""

    mappings: list[Mapping]
    scales: dict[str, torch.Tensor]  # activation -> s (clamped)
    unclamped: dict[str, torch.Tensor] = field(default_factory=dict)
    ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # smooth output -> (min, max)
    strengths: dict[str, float] = field(default_factory=dict)  # activation -> the strength its scales were made with
    columns: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # balance target -> s to multiply columns by
    rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # linear smooth target -> s to divide rows by
    method: str = "smoothquant"  # or "awq": the metadata_props key graphcal.<method> records it
    record: dict | None = None  # what the metadata records (None: SmoothQuant's settings, from the run)

    def __post_init__(self):
        for m in self.mappings:
            s = self.scales[m.candidate.activation]
            for b in m.balance:
                self.columns.setdefault(b, []).append(s)
            if m.candidate.linear is not None:
                self.rows.setdefault(m.candidate.linear, []).append(s)

    def prelude(self, types) -> tuple[list, list]:
        """The tap-side ``Mul(x, 1/s)`` nodes for the calibration pass (graph.taps.build_tapped)."""
        return tap_nodes(self.mappings, {m.candidate.activation: self._inverse(m, types) for m in self.mappings})

    def _inverse(self, m: Mapping, types) -> np.ndarray:
        """1/s as the graph multiplies by it (in the activation's dtype)."""
        dtype = _np_dtype(types, m.candidate.activation)
        return (1.0 / self.scales[m.candidate.activation].double()).numpy().astype(dtype)

    def weight(self, t: Target, w: torch.Tensor) -> torch.Tensor:
        """A target's torch [out, in] weight, smoothed: input columns times s, output rows over s
        (in llm-compressor's order: each mapping in turn, the result cast back to the weight's dtype)."""
        if t.name not in self.columns and t.name not in self.rows:
            return w
        dtype = w.dtype
        for s in self.columns.get(t.name, []):
            w = (w * s[None, :]).to(dtype)
        for s in self.rows.get(t.name, []):
            w = (w / s[:, None]).to(dtype)
        return w

    def column_scale(self, t: Target) -> torch.Tensor | None:
        """What ``t``'s input columns are multiplied by (the product of its mappings' s; None: nothing)."""
        scales = self.columns.get(t.name)
        if not scales:
            return None
        out = scales[0].double()
        for s in scales[1:]:
            out = out * s.double()
        return out

    def smooth_hessian(self, t: Target, h: torch.Tensor) -> torch.Tensor:
        """The Hessian of ``t``'s smoothed input x/s from that of x: diag(1/s) H diag(1/s)."""
        s = self.column_scale(t)
        if s is None:
            return h
        inverse = (1.0 / s).to(h.device)
        return (h.double() * inverse[:, None] * inverse[None, :]).to(h.dtype)

    def unsmooth(self, t: Target, w: torch.Tensor) -> torch.Tensor:
        """The weight that computes in the unsmoothed graph what ``w`` (smoothed, as :meth:`weight`
        gives it) computes in the smoothed one: columns over s, rows times s."""
        dtype = w.dtype
        s = self.column_scale(t)
        out = w.double()
        if s is not None:
            out = out / s.to(w.device)[None, :]
        for r in self.rows.get(t.name, []):
            out = out * r.double().to(w.device)[:, None]
        return out.to(dtype)

    def target(self, t: Target) -> Target:
        """The target as the output graph has it: behind an explicit Mul it reads the Mul's output."""
        for m in self.mappings:
            if m.explicit and t.name in m.balance:
                return replace(t, activation=m.tapped)
        return t

    def fold(self, run: RunPlan, quantized: set[str], types: dict) -> None:
        """Write the smoothing into ``run.model`` where the weight pass does not: norm scales and
        biases, linear biases and constant scales divided by s, explicit Muls, and the float weights
        of balance or linear smooth layers that stay unquantized (``quantized``: those that do not);
        the model's metadata_props record the mappings (``graphcal.smoothquant``, JSON).
        ``types`` gains the explicit Muls' outputs."""
        import json

        model = run.model
        record = self.record
        if record is None:
            settings = run.config.smoothing
            record = {"strength": "auto" if settings.search else settings.strength, "algorithm": settings.algorithm,
                      "scope": settings.scope,
                      "mappings": [{"smooth": m.smooth, "kind": "mul" if m.explicit else m.candidate.kind,
                                    "balance": list(m.balance), "strength": self.strengths.get(m.candidate.activation)}
                                   for m in self.mappings]}
        model.metadata_props.add(key=f"graphcal.{self.method}", value=json.dumps(record, separators=(",", ":")))
        params, scales = [], {}
        for m in self.mappings:
            s = self.scales[m.candidate.activation].numpy()
            for p in m.candidate.params:
                params.append(p)
                scales[p] = s
        divide_params(model, params, scales, run.base_dir)
        for m in self.mappings:
            if m.explicit:
                x = m.candidate.activation
                nodes = {t.node for t in run.found if t.name in m.balance}
                explicit_mul(model, m, self._inverse(m, types), nodes)
                if x in types:
                    types[m.tapped] = types[x]
        by_name = {t.name: t for t in run.found}
        for name in dict.fromkeys([*self.columns, *self.rows]):
            if name not in quantized:
                self.write_float(model, by_name[name], run.base_dir)

    def write_float(self, model, t: Target, base_dir: str | None) -> None:
        """Store a target's smoothed weight in float in ``model`` (a layer left unquantized)."""
        w = torch.from_numpy(torch_weight(model, t, base_dir))
        replace_weight(model, t, self.weight(t, w).numpy(), base_dir)


def smooth_and_calibrate(run: RunPlan, observers, calib, *, device: str, device_id: int = 0, dist=None,
                         progress: bool = False, reduce_in_graph: bool = True, exclude_padding: bool = False,
                         inputs: tuple[str, ...] = (), tap_limit_mb: float | None = None):
    """SmoothQuant's scales and the calibration pass over the smoothed activations (``observers``:
    an ObserverSet built with :func:`taps_of` the mappings): (Smoothed, the pass's PassResult)."""
    from graphcal.calibration.activations import run_activation_pass

    mappings = list(run.smoothing.mappings)
    search = run.config.smoothing.search
    kwargs = dict(device=device, device_id=device_id, dist=dist, progress=progress, exclude_padding=exclude_padding,
                  inputs=inputs, tap_limit_mb=tap_limit_mb)
    smoothed_of = {m.tapped: m for m in mappings}
    deferred = [c for c in observers.consumers if c.tensor in smoothed_of]
    if dist is None and not exclude_padding and reduce_in_graph and all(_replayable(c) for c in deferred):
        log.info("SmoothQuant and calibration in one pass (%d observers of smoothed activations replayed)", len(deferred))
        also = {smoothed_of[c.tensor].candidate.activation: smoothed_of[c.tensor].candidate.channels for c in deferred}
        others = [c for c in observers.consumers if c.tensor not in smoothed_of]
        ranges = statistics(mappings, search, calib.num_batches, others, also)
        result = run_activation_pass(run, ranges, calib, reduce_in_graph=True, **kwargs)
        extrema = ranges.extrema()
        smoothed = scales_from(run, mappings, extrema, ranges.rows())
        types = run.types
        for c in deferred:
            m = smoothed_of[c.tensor]
            inverse = torch.from_numpy(smoothed._inverse(m, types))
            lo, hi = extrema[m.candidate.activation]
            _replay(c, lo.to(inverse.dtype) * inverse, hi.to(inverse.dtype) * inverse)
        return smoothed, result
    smoothed = collect(run, calib, **kwargs)
    result = run_activation_pass(run, observers, calib, reduce_in_graph=reduce_in_graph,
                                 prelude=smoothed.prelude(run.types), **kwargs)
    return smoothed, result


def _replayable(c: Consumer) -> bool:
    """An observer whose statistics are running extrema over what an in-graph reduction gives."""
    return (c.feed is Feed.INPUT and c.reducible is not None and c.observer.observer_name == "static_minmax"
            and c.reducible.reduction in (Reduction.ALL, Reduction.GROUP))


def _replay(c: Consumer, lo: torch.Tensor, hi: torch.Tensor) -> None:
    """Feed per-channel extrema of the smoothed activation to ``c`` as its in-graph reduction would."""
    request = c.reducible
    c.observer.observe_extrema(*_per_group(lo, hi, request.group_size if request.reduction is Reduction.GROUP else None))


def _per_group(lo: torch.Tensor, hi: torch.Tensor, group_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel extrema as per-group ones (``group_size`` None: one group, the whole tensor)."""
    if group_size is None:
        return lo.amin().reshape(1), hi.amax().reshape(1)
    return lo.reshape(-1, group_size).amin(dim=1), hi.reshape(-1, group_size).amax(dim=1)


def collect(run: RunPlan, calib, *, device: str, device_id: int = 0, dist=None, progress: bool = False,
            exclude_padding: bool = False, inputs: tuple[str, ...] = (), tap_limit_mb: float | None = None) -> Smoothed:
    """The smoothing pass: each smooth layer's output range, then the scales (every rank gets them)."""
    from graphcal.calibration.activations import run_activation_pass

    mappings = list(run.smoothing.mappings)
    ranges = statistics(mappings, run.config.smoothing.search, calib.num_batches)
    run_activation_pass(run, ranges, calib, device=device, device_id=device_id, dist=dist, progress=progress,
                        exclude_padding=exclude_padding, inputs=inputs, label="smoothing", tap_limit_mb=tap_limit_mb)
    smoothed = None
    if dist is None or dist.is_main:  # (under torchrun the search scores rank 0's sample)
        smoothed = scales_from(run, mappings, ranges.extrema(), ranges.rows())
    if dist is not None:
        import torch.distributed as tdist

        box = [smoothed]
        tdist.broadcast_object_list(box, src=0)
        smoothed = box[0]
    return smoothed


def scales_from(run: RunPlan, mappings: list[Mapping], ranges: dict, samples: dict | None = None) -> Smoothed:
    """Every mapping's scales from its smooth layer's output range and its balance weights; with the
    strength search, at the strength of SEARCH_GRID whose scales quantize the balance layers' outputs
    on the sampled rows best."""
    settings = run.config.smoothing
    by_name = {t.name: t for t in run.found}
    scales, unclamped, strengths = {}, {}, {}
    for m in mappings:
        lo, hi = ranges[m.candidate.tensor]
        weights = [] if settings.algorithm == "log_equalization" else [  # log_equalization reads no weight
            torch.from_numpy(torch_weight(run.model, by_name[b], run.base_dir)) for b in m.balance]
        x = m.candidate.activation
        if settings.search and weights and x in (samples or {}):  # log_equalization has no strength to search
            strength = _search(run, m, lo, hi, weights, samples[x], ranges[x], settings.algorithm)
        else:
            strength = settings.strength
        s, raw = smoothing_scales(lo, hi, weights, strength, settings.algorithm)
        scales[x], unclamped[x], strengths[x] = s, raw, strength
        log.info("smoothing %s: strength %g, scales %.3g..%.3g", m.describe(), strength, float(s.min()), float(s.max()))
    return Smoothed(mappings, scales, unclamped, dict(ranges), strengths=strengths)


def _search(run: RunPlan, m: Mapping, lo, hi, weights: list[torch.Tensor], rows: torch.Tensor, act_range,
            algorithm: str) -> float:
    """The strength of SEARCH_GRID whose smoothing gives the balance layers' outputs on ``rows`` the
    smallest squared error once weights and inputs are fake-quantized as the run's schemes say (the
    inputs' static range is the whole data's: ``act_range``, x's per-channel extrema)."""
    best = None
    for strength in SEARCH_GRID:
        s, _ = smoothing_scales(lo, hi, weights, strength, algorithm)
        error = _error(run, m, s, weights, rows, act_range)
        if best is None or error < best[0]:
            best = (error, strength)
    return best[1]


def _error(run: RunPlan, m: Mapping, s: torch.Tensor, weights: list[torch.Tensor], rows: torch.Tensor,
           act_range) -> float:
    inverse = 1.0 / s.float()
    smoothed = rows * inverse
    lo, hi = (v.float() * inverse for v in act_range)
    total = 0.0
    for name, w in zip(m.balance, weights):
        scheme = run.schemes.get(name)
        if scheme is None:  # balanced but left in float: smoothing changes nothing in its output
            continue
        w = w.float()
        wq = _fake_weight(w * s.float()[None, :], scheme.weights)
        xq = _fake_input(smoothed, scheme.input_activations, lo, hi)
        total += float(((rows @ w.T - xq @ wq.T) ** 2).sum())
    return total


def _as_rows_args(args):
    """Activation args as weight args over [rows, channels] (token -> channel), so compressed-tensors'
    weight path quantizes them."""
    from graphcal.types import enum_value

    strategy = enum_value(args.strategy)
    return args.model_copy(update={"strategy": "channel" if strategy == "token" else strategy, "dynamic": False,
                                   "observer": None})


def _fake_weight(w: torch.Tensor, args) -> torch.Tensor:
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    from graphcal.calibration.observe import make_observer
    from graphcal.config import observer_name

    if args is None:
        return w
    obs = make_observer(observer_name(args, "weight"), "weight", args.model_copy(deep=True))
    obs(w)
    qp = obs.get_qparams()
    return fake_quantize(w, qp["scale"], qp["zero_point"], args, global_scale=qp["global_scale"])


def _fake_input(x: torch.Tensor, args, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``x`` [rows, channels] fake-quantized as the input args say: static scales from the whole
    data's extrema (``lo``/``hi`` per channel), dynamic ones from the rows themselves."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    from graphcal.calibration.observe import make_observer
    from graphcal.types import enum_value

    if args is None:
        return x
    rows_args = _as_rows_args(args)
    strategy = enum_value(args.strategy)
    if args.dynamic is False and strategy in ("tensor", "group"):
        lo, hi = _per_group(lo, hi, args.group_size if strategy == "group" else None)
        scale, zero_point = calculate_qparams(lo, hi, args)
        if strategy == "group":
            scale, zero_point = scale.expand(x.shape[0], -1), zero_point.expand(x.shape[0], -1)
        return fake_quantize(x, scale, zero_point, rows_args)
    obs = make_observer("memoryless_minmax", "weight", rows_args)
    obs(x)
    qp = obs.get_qparams()
    return fake_quantize(x, qp["scale"], qp["zero_point"], rows_args, global_scale=qp["global_scale"])


def _np_dtype(types, tensor: str):
    import onnx

    t = types.get(tensor) if types is not None else None
    if t is None or not t.elem_type:
        return np.float32
    return onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
