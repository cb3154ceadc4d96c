"""``graphcal eval`` as steps: load the models once, lay out what is compared, plan the later
measures, compare, then measure sensitivity and the mix on one switchable session. Each step
returns a frozen record; :func:`evaluate` only sequences them into an :class:`EvalReport`."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from graphcal.config import DEFAULT_IGNORE
from graphcal.errors import UsageError
from graphcal.evaluation.candidate import smoothable_layers, smoothquant_record, written_ignore
from graphcal.evaluation.compare import compare, layout_of
from graphcal.evaluation.mixing import measure_mix, plan_mix
from graphcal.evaluation.models import EvalModels, load_models
from graphcal.evaluation.options import LEVELS, EvalOptions
from graphcal.evaluation.report import EvalReport
from graphcal.evaluation.sensitivity import SensitivityPlan, measure_sensitivity, quantized_layers
from graphcal.evaluation.switched import open_switch_session
from graphcal.output.file import check_output_file
from graphcal.progress import duration

log = logging.getLogger("graphcal")


def evaluate(reference: str | Path, candidate: str | Path, data, options: EvalOptions | None = None,
             **settings) -> EvalReport:
    """Run both models over ``data`` and compare every output and every weight MatMul/Gemm output;
    ``options`` (or its fields given as keywords) says what else to measure.

    ``level`` is onnxruntime's optimization level for every session: "basic" (ORT_ENABLE_BASIC: the
    Q/DQ graph as the ONNX spec computes it) or "all" (ORT_ENABLE_ALL, onnxruntime's default: its
    fused integer kernels, what a deployment runs; MatMulNBits then quantizes its input on CPU).

    A layer's SQNR is cumulative: the quantized model's own output at that layer, with the error
    of every layer before it. With ``isolated``, a third run gives each layer's own error: a copy
    of the quantized model in which every layer's input activation is the reference's (fed from
    the reference run); worst layers and advice then follow that error.

    With ``sensitivity``, the model's outputs are also compared with only one kind of layer
    quantized (``mlp.down_proj`` across all blocks; with ``per_layer`` also one layer), the rest
    in float, and the advice is measured the same way (graphcal.evaluation.sensitivity). With
    ``size_budget_bytes``, ``target_kl`` or ``target_db``, the layers ``candidate`` quantized are mixed with
    their form in ``fallback`` (None: float) by measurement (graphcal.evaluation.mixing): by the next-token
    KL (or token loss) of a logits output where the model has one (graphcal.evaluation.next_token). Both run on one
    switchable session (graphcal.evaluation.switched); their runs are counted and logged before any
    pass, their time estimated from the comparison's first batches, and refused then past
    ``time_limit_s`` (None: no limit).

    With ``in_graph`` (the default, onnxruntime models without ``isolated``), both models run as one
    graph that reduces each compared pair to six float64 sums (graph.compare).

    ``device`` ("auto" | "cpu" | "cuda", GPU ``device_id``) is run's --device, checked up front
    (devices.check_device): every session (the comparison, the isolated copy, the switchable session
    of sensitivity and mixing) runs there, and on a GPU the compared outputs stay there as torch
    tensors (DLPack), reduced there to their sums; only those come to the host. onnx.reference
    (fp4 / e8m0 models) runs on the CPU whatever it says.

    ``writes``: (option, path) of each file the caller will write with the report (the CLI's
    ``--html``); one that is an input (a model, its external data, the data) is refused before
    any pass. The models are read once (graphcal.evaluation.models)."""
    if options is None:
        options = EvalOptions(**settings)
    elif settings:
        raise TypeError("give the options as one EvalOptions or as keywords, not both")
    options.check()
    from graphcal.devices import check_device  # lazy: it imports onnxruntime

    check_device(options.device)  # --device cuda without a usable GPU: one line, before any model is read
    _check_device_id(options)
    inputs = [reference, candidate, *([data] if isinstance(data, (str, os.PathLike)) else [])]
    for option, path in options.writes:
        check_output_file(path, inputs, option)
    models = load_models(reference, candidate, options.fallback if options.mixing else None)
    for option, path in options.writes:  # the models' external data files are inputs too
        check_output_file(path, [p for m in (models.reference, models.candidate) for p in m.on_disk[1:]], option)
    _refuse_folded_smoothing(models, options)
    layout = layout_of(models)
    ignored = written_ignore(models.candidate.path)
    keep = ignored if ignored is not None else list(DEFAULT_IGNORE)
    sens_plan, mix_plan = _plans(models, layout, options, keep)
    smoothable = smoothable_layers(models.reference.model, layout.targets, _smoothed(models),
                                   models.reference.path.parent)
    import onnxruntime as ort  # lazy: onnxruntime loads when a comparison runs, not with this package

    from graphcal.runtime import trim_heap  # lazy: it imports onnxruntime

    optimization = getattr(ort.GraphOptimizationLevel, LEVELS[options.level])
    plans = [p for p in (sens_plan, mix_plan) if p is not None]
    comparison = compare(models, layout, data, options, optimization,
                         lambda seconds, batches, num_batches: _check_time(plans, seconds, batches, num_batches,
                                                                           options.time_limit_s, options.per_layer))
    sens = mix = None
    if plans:  # the comparison's sessions are gone: one switchable session for both measures
        trim_heap()
        session = open_switch_session(models, {k: v for p in plans for k, v in p.fp32_layers.items()}, layout.outputs,
                                      optimization, device=options.device, device_id=options.device_id)
        if sens_plan is not None:
            sens = measure_sensitivity(sens_plan, session, layout.outputs, comparison.calib, keep)
            trim_heap()
        if mix_plan is not None:
            mix = measure_mix(mix_plan, session, layout.outputs, comparison.calib)
        del session
    models.check_unchanged()
    return EvalReport(comparison.outputs, comparison.layers, comparison.calib.num_samples, comparison.batches,
                      comparison.runner, layout.skipped, level=options.level, ignored=ignored, provider=comparison.provider,
                      isolated=comparison.isolated, smoothable=smoothable, sensitivity=sens, mix=mix,
                      warnings=list(comparison.calib.notes), next_token=comparison.next_token)


def _check_device_id(options: EvalOptions) -> None:
    """A --device-id past the GPUs torch sees, where it sees any, refused before any model is read."""
    if options.device == "cpu" or options.device_id == 0:
        return
    import torch  # lazy: loaded with the runtime above

    if torch.cuda.is_available() and options.device_id >= torch.cuda.device_count():
        raise UsageError(f"--device-id {options.device_id}: this machine has {torch.cuda.device_count()} GPU(s), "
                         f"numbered from 0")


def _plans(models: EvalModels, layout, options: EvalOptions, keep: list[str]) -> tuple:
    """(the sensitivity plan, the mix plan), each None where not asked for, from the models' structure;
    each announced with its number of runs before any pass."""
    sens_plan = mix_plan = None
    if options.sensitivity:
        sens_plan = SensitivityPlan(quantized_layers(models.candidate.model, models.reference.model, layout.targets),
                                    options.per_layer)
        log.warning("eval --sensitivity: %s after the comparison; progress and time left are shown as they run",
                    sens_plan.describe())
    if options.mixing:
        mix_plan = plan_mix(models, per_layer=options.per_layer, budget_bytes=options.size_budget_bytes,
                            target_db=options.target_db, target_kl=options.target_kl, ignored=keep, logits=layout.logits)
        log.warning("eval %s: %s after the comparison", mix_plan.flag, mix_plan.describe())
    return sens_plan, mix_plan


def _smoothed(models: EvalModels) -> dict:
    """The SmoothQuant (or AWQ) record of the quantized model, else of the fallback."""
    smoothed = smoothquant_record(models.candidate.model)
    if models.fallback is not None and not any(m.get("kind") != "mul" for m in smoothed.get("mappings", [])):
        smoothed = smoothquant_record(models.fallback.model)
    return smoothed


def _refuse_folded_smoothing(models: EvalModels, options: EvalOptions) -> None:
    """A folded smoothing: the balance layers read x/s, which the fp32 model never computes."""
    if not (options.isolated or options.sensitivity or options.mixing):
        return
    if any(m.get("kind") != "mul" for m in _smoothed(models).get("mappings", [])):
        why = ("--isolated cannot feed them fp32 inputs; compare without --isolated" if options.isolated else
               "its layers cannot be put back in float one by one; measure sensitivity or mixes")
        raise UsageError(f"{models.candidate.path} was smoothed by SmoothQuant (folded into its norms and layers: its "
                         f"balance layers read x/s, which the fp32 model does not compute), so {why}, or a model made "
                         "without --smoothquant")


def _check_time(plans: list, seconds: float, batches: int, num_batches: int | None,
                limit_s: float | None, per_layer: bool) -> None:
    """Log what the sensitivity and mixing runs (``plans``) will take at the pace of this
    comparison's first ``batches`` (which ran two models each); refuse them when that is longer
    than ``limit_s`` (None: no limit)."""
    if not num_batches or not plans:
        return
    per_run = seconds / batches * num_batches / 2
    runs = sum(p.runs for p in plans)
    estimate = per_run * runs
    what = " and ".join("--sensitivity" if isinstance(p, SensitivityPlan) else p.flag for p in plans)
    if limit_s is None or estimate <= limit_s:
        log.warning("eval %s: about %s after this comparison (%d runs of about %s)", what, duration(estimate),
                    runs, duration(per_run))
        return
    raise UsageError(f"{what} would take about {duration(estimate)} ({'; '.join(p.describe() for p in plans)}, "
                     f"about {duration(per_run)} each), past the time limit of {duration(limit_s)}; use fewer "
                     f"--num-samples{', drop --per-layer' if per_layer else ''} or raise --time-limit (0: none)")
