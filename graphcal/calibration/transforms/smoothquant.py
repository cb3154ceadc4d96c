"""SmoothQuant as a stage: llm-compressor's SmoothQuantModifier on the ONNX graph.

    plan.smoothing (graph.scaling: which activations, folded where)
      --ReduceMin/ReduceMax per channel in the graph--> each smooth layer's output range
      --smoothing_scales: llm-compressor's formula--> s per mapping
      --> ChannelScales: what the later stages apply
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
every position of every batch (padding included, as llm-compressor counts it); the scales are
graphcal.algorithms.smoothquant.math's. :class:`SmoothQuant` is the pipeline's pre-transform.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx
import torch

from graphcal.algorithms.smoothquant.math import per_group, search_strength, smoothing_scales
from graphcal.arrays import to_torch
from graphcal.calibration.activations import PassResult
from graphcal.calibration.decisions import Loaded, RunPlan
from graphcal.calibration.observe import Consumer, Consumers, Feed, ObserverSet
from graphcal.calibration.passes import run_activation_pass
from graphcal.calibration.ranges import RangeSet
from graphcal.calibration.seams import PassSettings
from graphcal.calibration.transforms.base import PlanScope, Transform
from graphcal.calibration.transforms.channel_scales import (
    ChannelScales,
    ScaleMethod,
    check_scales,
    scaled_layers,
    taps_of,
)
from graphcal.config import Smoothing
from graphcal.data import Calibration
from graphcal.errors import GraphcalError, UsageError
from graphcal.graph.scaling import TAP_PREFIX, Mapping, Resolution, candidates, resolve
from graphcal.graph.taps import Reduction
from graphcal.graph.targets import torch_weight

log = logging.getLogger("graphcal")

def statistics(mappings: list[Mapping], search: bool, batches: int | None, others=(), also: dict[str, int] = (),
               tolerate: bool = False) -> RangeSet:
    """The consumers SmoothQuant needs: each smooth layer's output range; with the strength
    ``search``, each smoothed activation's range and a sample of its rows; ``also``: more ranges;
    ``tolerate``: ranges holding NaN or Inf are recorded, not refused (:class:`RangeSet`)."""
    tensors = {m.candidate.tensor: m.candidate.channels for m in mappings}
    tensors.update(also)
    sampled = []
    if search:
        for m in mappings:
            tensors.setdefault(m.candidate.activation, m.candidate.channels)
        sampled = list(dict.fromkeys(m.candidate.activation for m in mappings))
    return RangeSet(tensors, others, sampled, batches, tolerate)


def smooth_and_calibrate(run: RunPlan, loaded: Loaded, observers, calib: Calibration, *, device: str, device_id: int = 0, dist=None,
                         progress: bool = False, reduce_in_graph: bool = True, exclude_padding: bool = False,
                         inputs: tuple[str, ...] = (), tap_limit_mb: float | None = None,
                         mappings: list[Mapping] | None = None, skip_nonfinite: bool = False,
                         cache_mb: float | None = None, cache_folder=None):
    """SmoothQuant's scales and the calibration pass over the smoothed activations (``observers``:
    an ObserverSet built with :func:`taps_of` the mappings) on ``loaded`` (the working model, read
    only): (ChannelScales, the pass's PassResult).
    ``mappings``: those to apply (default: the plan's); with ``skip_nonfinite``, one whose smooth
    layer's output holds NaN or Inf is left out with a warning (:func:`finite_ranges`)."""
    mappings = list(run.decision(Smoothing).mappings if mappings is None else mappings)
    search = run.config.smoothing.search
    kwargs = dict(device=device, device_id=device_id, dist=dist, progress=progress, exclude_padding=exclude_padding,
                  inputs=inputs, tap_limit_mb=tap_limit_mb, cache_mb=cache_mb, cache_folder=cache_folder)
    smoothed_of = {m.tapped: m for m in mappings}
    deferred = [c for c in observers.consumers if c.tensor in smoothed_of]
    why = second_pass(deferred, dist=dist, exclude_padding=exclude_padding, reduce_in_graph=reduce_in_graph)
    if why is None:
        log.info("SmoothQuant and calibration in one pass (%d observers of smoothed activations replayed)", len(deferred))
        also = {smoothed_of[c.tensor].candidate.activation: smoothed_of[c.tensor].candidate.channels for c in deferred}
        others = [c for c in observers.consumers if c.tensor not in smoothed_of]
        ranges = statistics(mappings, search, calib.num_batches, others, also, tolerate=skip_nonfinite)
        result = run_activation_pass(run, loaded, ranges, calib, reduce_in_graph=True, **kwargs)
        extrema = ranges.extrema()
        smoothed = scales_from(run, loaded.model, finite_ranges(mappings, ranges, observers), extrema, ranges.rows())
        types = loaded.types
        for c in deferred:
            m = smoothed_of[c.tensor]
            inverse = to_torch(smoothed._inverse(m, types))
            lo, hi = extrema[m.candidate.activation]
            _replay(c, lo.to(inverse.dtype) * inverse, hi.to(inverse.dtype) * inverse)
        return smoothed, result
    log.info("SmoothQuant's ranges in a pass of their own before the calibration pass: %s", why)
    smoothed = collect(run, loaded, calib, mappings=mappings, skip_nonfinite=skip_nonfinite, observers=observers, **kwargs)
    result = run_activation_pass(run, loaded, observers, calib, reduce_in_graph=reduce_in_graph,
                                 prelude=smoothed.prelude(loaded.types), **kwargs)
    return smoothed, result


def second_pass(deferred: list[Consumer], *, dist=None, exclude_padding: bool = False,
                reduce_in_graph: bool = True) -> str | None:
    """Why SmoothQuant needs a pass of its own before the calibration pass, given the consumers of
    the smoothed activations (``deferred``) and how the passes run; None: one pass does (its
    ranges taken in the calibration pass, the observers' extrema replayed through 1/s). The one
    rule: :func:`smooth_and_calibrate` follows it, and calibration.prepare refuses with it what
    cannot be read twice (:meth:`SmoothQuant.second_pass`)."""
    if dist is not None:
        return "under torchrun the ranges are gathered from every rank first"
    if exclude_padding:
        return "--exclude-padding masks the smoothed activations"
    if not reduce_in_graph:
        return "reduce_in_graph=False: the observers take whole tensors"
    for c in deferred:
        if not _replayable(c):
            what = {Feed.HESSIAN: "GPTQ's Hessian", Feed.IMPORTANCE: "the importance statistics"}.get(
                c.feed, f"the {c.observer.observer_name} observer")
            return f"{what} of {c.tensor.removeprefix(TAP_PREFIX)} (smoothed) needs more than per-tensor or per-group extrema"
    return None


def _replayable(c: Consumer) -> bool:
    """An observer whose statistics are running extrema over what an in-graph reduction gives."""
    return (c.feed is Feed.INPUT and c.reducible is not None and c.observer.observer_name == "static_minmax"
            and c.reducible.reduction in (Reduction.ALL, Reduction.GROUP))


def _replay(c: Consumer, lo: torch.Tensor, hi: torch.Tensor) -> None:
    """Feed per-channel extrema of the smoothed activation to ``c`` as its in-graph reduction would."""
    request = c.reducible
    c.observer.observe_extrema(*per_group(lo, hi, request.group_size if request.reduction is Reduction.GROUP else None))


def collect(run: RunPlan, loaded: Loaded, calib: Calibration, *, device: str, device_id: int = 0, dist=None, progress: bool = False,
            exclude_padding: bool = False, inputs: tuple[str, ...] = (), tap_limit_mb: float | None = None,
            mappings: list[Mapping] | None = None, skip_nonfinite: bool = False, observers=None,
            cache_mb: float | None = None, cache_folder=None) -> ChannelScales:
    """The smoothing pass over ``loaded`` (the working model, read only): each smooth layer's output
    range, then the scales (every rank gets them)."""
    mappings = list(run.decision(Smoothing).mappings if mappings is None else mappings)
    ranges = statistics(mappings, run.config.smoothing.search, calib.num_batches, tolerate=skip_nonfinite)
    run_activation_pass(run, loaded, ranges, calib, device=device, device_id=device_id, dist=dist, progress=progress,
                        exclude_padding=exclude_padding, inputs=inputs, label="smoothing", tap_limit_mb=tap_limit_mb,
                        cache_mb=cache_mb, cache_folder=cache_folder)
    smoothed = None
    if dist is None or dist.is_main:  # (under torchrun the search scores rank 0's sample)
        smoothed = scales_from(run, loaded.model, finite_ranges(mappings, ranges, observers), ranges.extrema(), ranges.rows())
    if dist is not None:
        import torch.distributed as tdist  # lazy: only under torchrun

        box = [smoothed]
        tdist.broadcast_object_list(box, src=0)
        smoothed = box[0]
    return smoothed


def finite_ranges(mappings: list[Mapping], ranges: RangeSet, observers=None) -> list[Mapping]:
    """The mappings whose ranges the pass saw finite; each other (its smooth layer's output, or the
    activation the search samples, held NaN or Inf: only under --skip-nonfinite-weights, downstream
    of such a weight) left out with a warning. When an observer taps its smoothed activation, that
    activation's NaN would reach the observer: refused as the pass refuses a non-finite tap."""
    kept = []
    tapped = {c.tensor for c in observers.consumers} if observers is not None else set()
    for m in mappings:
        bad = next((t for t in (m.candidate.tensor, m.candidate.activation) if t in ranges.nonfinite), None)
        if bad is None:
            kept.append(m)
        elif m.tapped in tapped:
            raise GraphcalError(f"tap {bad!r} holds NaN or Inf (SmoothQuant {m.describe()}); the model or the data "
                                "produce non-finite activations")
        else:
            log.warning("SmoothQuant %s: left out (%s holds NaN or Inf, downstream of a weight "
                        "--skip-nonfinite-weights leaves in float)", m.describe(), bad)
    return kept


def nonfinite_weights(run: RunPlan, model: onnx.ModelProto, mappings: list[Mapping]) -> list[Mapping]:
    """The mappings that scale no weight holding NaN or Inf (a balance layer's input columns, a linear
    smooth layer's output rows); each other left out with a warning (--skip-nonfinite-weights leaves
    that weight in float, unscaled, so no scale may be folded into it or balanced against it)."""
    by_name = {t.name: t for t in run.found}
    verdict: dict[str, bool] = {}

    def finite(name: str) -> bool:
        if name not in verdict:
            verdict[name] = bool(np.isfinite(torch_weight(model, by_name[name], run.base_dir)).all())
        return verdict[name]

    kept = []
    for m in mappings:
        scaled = [*m.balance, *([m.candidate.linear] if m.candidate.linear is not None else [])]
        bad = next((name for name in scaled if not finite(name)), None)
        if bad is None:
            kept.append(m)
        else:
            log.warning("SmoothQuant %s: left out (%s's weight holds NaN or Inf; --skip-nonfinite-weights leaves it "
                        "in float)", m.describe(), bad)
    return kept


def scales_from(run: RunPlan, model: onnx.ModelProto, mappings: list[Mapping], ranges: dict, samples: dict | None = None) -> ChannelScales:
    """Every mapping's scales from its smooth layer's output range and its balance weights; with the
    strength search, at the strength of SEARCH_GRID whose scales quantize the balance layers' outputs
    on the sampled rows best."""
    settings = run.config.smoothing
    by_name = {t.name: t for t in run.found}
    scales, unclamped, strengths = {}, {}, {}
    for m in mappings:
        lo, hi = ranges[m.candidate.tensor]
        weights = [] if settings.algorithm == "log_equalization" else [  # log_equalization reads no weight
            to_torch(torch_weight(model, by_name[b], run.base_dir)) for b in m.balance]
        x = m.candidate.activation
        if settings.search and weights and x in (samples or {}):  # log_equalization has no strength to search
            schemes = [run.schemes.get(b) for b in m.balance]
            strength = search_strength(schemes, lo, hi, weights, samples[x], ranges[x], settings.algorithm)
        else:
            strength = settings.strength
        s, raw = smoothing_scales(lo, hi, weights, strength, settings.algorithm)
        check_scales(m, s, why=_why_not_finite(m, lo, hi, strength, settings.algorithm))
        scales[x], unclamped[x], strengths[x] = s, raw, strength
        log.info("smoothing %s: strength %g, scales %.3g..%.3g", m.describe(), strength, float(s.min()), float(s.max()))
    return ChannelScales(mappings, scales, unclamped, dict(ranges), strengths=strengths)


def _why_not_finite(m: Mapping, lo: torch.Tensor, hi: torch.Tensor, strength: float, algorithm: str) -> str:
    """Why a mapping's scales may come out not finite: its smooth layer's range, or the formula.
    llm-compressor has no rule for it (it writes them); graphcal refuses them (ChannelScales)."""
    bad = ~torch.isfinite(hi - lo)
    if bool(bad.any()):
        return (f"the calibration data gives {m.candidate.tensor} no finite range on {int(bad.sum())} channel(s) "
                "(it overflows or is NaN there)")
    if algorithm == "log_equalization":
        return "range / log2(2 + range) overflows"
    return f"range^{strength:g} / (2 max|W|)^{1 - strength:g} overflows"


@dataclass(frozen=True)
class SmoothQuantRecord:
    """SmoothQuant's result: its mappings as applied (graph.scaling.Mapping.describe)."""

    mappings: tuple[str, ...]
    read_data = False  # its ranges come with the activation pass


class SmoothQuant(Transform):
    """SmoothQuant as one unit: its mappings at plan time, its refusals, and as the pipeline's
    pre-transform (graphcal.calibration.seams.PreTransform) its ranges taken in the activation pass
    (or in one pass before it), its scales after; its record and summaries."""

    settings_type = Smoothing
    key = "smoothquant"

    def __init__(self, run: RunPlan, loaded: Loaded | None):
        self.run, self.loaded, self._scales = run, loaded, None  # the working model, read only
        self.mappings = list(run.decision(Smoothing).mappings)  # those applied: --skip-nonfinite-weights may leave some out

    # -- the plan ------------------------------------------------------------------------------

    @classmethod
    def resolve(cls, scope: PlanScope, settings: Smoothing) -> Resolution:
        """SmoothQuant's mappings in this graph (graph.scaling)."""
        resolution = resolve(candidates(scope.model, scope.found, scope.base_dir), scope.chosen, settings.scope,
                             settings.mappings, settings.ignore)
        log.info("SmoothQuant: %d mappings to smooth", len(resolution.mappings))
        return resolution

    @classmethod
    def notes(cls, decision: Resolution, settings: Smoothing) -> list[str]:
        notes = list(decision.notes) if settings.mappings is not None else []
        if not decision.mappings:
            notes.append("SmoothQuant: nothing to smooth" + (
                f" with --smoothquant {settings.scope}; graphcal inspect --smoothquant mul lists what each "
                "scope would smooth" if settings.mappings is None and settings.scope != "mul" else ""))
        return notes

    @classmethod
    def scaled(cls, decision: Resolution | None) -> set[str]:
        return scaled_layers(decision.mappings if decision is not None else ())

    @classmethod
    def check(cls, run: RunPlan, calib: Calibration | None, dist, settings: PassSettings) -> None:
        """A CalibrationDataReader is read once: refused where SmoothQuant needs a pass of its own."""
        if calib is None or calib.rereadable or (smoothquant := cls.for_plan(run, None)) is None:  # no pass here: the model is not needed
            return
        why = smoothquant.second_pass(settings)
        if why is not None:  # the rule smooth_and_calibrate follows, asked before anything is read
            raise UsageError(f"SmoothQuant needs a pass over the data of its own here ({why}), and a "
                             "CalibrationDataReader can be read once: pass the arrays (an .npz, a folder or a mapping), "
                             "or use an observer SmoothQuant replays from the calibration pass (static_minmax per tensor "
                             "or per group, W8A8_STATIC's default)")

    # -- the passes ----------------------------------------------------------------------------

    @classmethod
    def for_plan(cls, run: RunPlan, loaded: Loaded | None) -> SmoothQuant | None:
        decision = run.decision(Smoothing)
        return cls(run, loaded) if decision is not None and decision.mappings else None

    def before_pass(self, calib: Calibration, settings: PassSettings) -> None:
        """The ranges come with the activation pass; with --skip-nonfinite-weights, the mappings that
        would scale a weight holding NaN or Inf are left out first (their layers observed unsmoothed)."""
        if settings.skip_nonfinite:
            self.mappings = nonfinite_weights(self.run, self.loaded.model, self.mappings)

    def taps(self) -> dict[str, str]:
        return taps_of(self.mappings)

    def second_pass(self, settings: PassSettings, observers: Consumers | None = None) -> str | None:
        """Why this run's SmoothQuant needs a pass over the data before the calibration pass (None:
        it runs in that pass; :func:`second_pass`). ``observers``: the run's (None: built from the
        plan, as the pipeline will build them), so calibration.prepare can ask before any pass."""
        if observers is None:
            observers = ObserverSet(self.run, self.taps())
        smoothed = {m.tapped for m in self.run.decision(Smoothing).mappings}
        return second_pass([c for c in observers.consumers if c.tensor in smoothed], dist=settings.dist,
                           exclude_padding=settings.exclude_padding, reduce_in_graph=settings.reduce_in_graph)

    def activation_pass(self, observers: ObserverSet, calib: Calibration, settings: PassSettings) -> PassResult:
        self._scales, result = smooth_and_calibrate(self.run, self.loaded, observers, calib, mappings=self.mappings,
                                                    skip_nonfinite=settings.skip_nonfinite, **settings.kwargs())
        return result

    def scales(self) -> ChannelScales:
        return self._scales

    # -- reports -------------------------------------------------------------------------------

    @classmethod
    def record(cls, run: RunPlan, done) -> SmoothQuantRecord | None:
        scales = done.scales
        if scales is None or scales.method is not ScaleMethod.SMOOTHQUANT:
            return None
        return SmoothQuantRecord(tuple(scales.describe()))

    @classmethod
    def result_lines(cls, record: SmoothQuantRecord | None) -> list[str]:
        if record is None or not record.mappings:
            return []
        return [f"smoothed {len(record.mappings)} activation(s) first (SmoothQuant; graphcal inspect lists them)"]

    @classmethod
    def result_json(cls, record: SmoothQuantRecord | None):
        return list(record.mappings) if record is not None else []

    @classmethod
    def inspect_lines(cls, run: RunPlan, decision: Resolution | None, settings: Smoothing | None, blocks) -> list[str]:
        if decision is None:
            return []
        strength = "auto (searched per mapping)" if settings.search else f"{settings.strength:g}"
        lines = [f"smoothquant {len(decision.mappings)} mapping(s), strength {strength}"
                 + (f", {settings.algorithm}" if settings.algorithm != "smoothquant" else "") + ":"]
        lines += [f"  {m.describe()}" for m in decision.mappings]
        lines += [f"  {n}" for n in decision.notes]
        return lines

    @classmethod
    def inspect_json(cls, run: RunPlan, decision: Resolution | None, settings: Smoothing | None, blocks):
        if decision is None:
            return None
        return {
            "strength": "auto" if settings.search else settings.strength,
            "algorithm": settings.algorithm,
            "scope": settings.scope,
            "mappings": [{"smooth": m.smooth, "kind": "mul" if m.explicit else m.candidate.kind,
                          "balance": list(m.balance), "activation": m.candidate.activation}
                         for m in decision.mappings],
            "not_smoothed": list(decision.notes),
        }
