"""eval's comparison runs: both models over the same data, every output and weight MatMul/Gemm output compared.

On onnxruntime the two models run as one graph that reduces each pair to float64 sums itself
(graph.compare), so no activation leaves it; otherwise the tensors are fetched and compared
here. With ``isolated``, a third model, the quantized one fed the reference's layer inputs,
gives each layer's own error. Sensitivity passes are graphcal.evaluation.sensitivity's.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import onnx

from graphcal.config import DEFAULT_IGNORE
from graphcal.data import batch_samples, graph_inputs, load_data
from graphcal.errors import GraphcalError, UsageError
from graphcal.evaluation.agreement import Agreement
from graphcal.evaluation.candidate import smoothable_layers, smoothquant_record, written_ignore
from graphcal.evaluation.mixing import measure_mix, plan_mix
from graphcal.evaluation.report import EvalReport
from graphcal.evaluation.rotated import rotated_as
from graphcal.evaluation.sensitivity import SensitivityPlan, measure_sensitivity, quantized_layers
from graphcal.graph import identity
from graphcal.graph.compare import OUTPUT, SUMS, paired_model
from graphcal.graph.compare import PREFIX as PAIRED_PREFIX
from graphcal.graph.external import common_root, is_external
from graphcal.graph.io import load_model, load_model_info, runs_in_onnxruntime
from graphcal.graph.taps import add_taps
from graphcal.graph.targets import find_targets
from graphcal.output.file import check_output_file
from graphcal.progress import Progress, duration

log = logging.getLogger("graphcal")

LEVELS = {"basic": "ORT_ENABLE_BASIC", "all": "ORT_ENABLE_ALL"}
DEFAULT_TIME_LIMIT_S = 3600.0  # eval --time-limit's default: a sensitivity estimated past an hour is refused


def evaluate(reference: str | Path, candidate: str | Path, data, *, batch_size: int | None = None,
             num_samples: int | None = None, level: str = "basic", isolated: bool = False,
             sensitivity: bool = False, per_layer: bool = False, in_graph: bool = True,
             writes: Sequence[tuple[str, str | Path]] = (), time_limit_s: float | None = DEFAULT_TIME_LIMIT_S,
             fallback: str | Path | None = None, size_budget_bytes: int | None = None,
             target_db: float | None = None) -> EvalReport:
    """Run both models over ``data`` and compare every output and every weight MatMul/Gemm output.

    ``level`` is onnxruntime's optimization level for both: "basic" (ORT_ENABLE_BASIC: the Q/DQ
    graph as the ONNX spec computes it) or "all" (ORT_ENABLE_ALL, onnxruntime's default: its
    fused integer kernels, what a deployment runs; MatMulNBits then quantizes its input on CPU).

    A layer's SQNR is cumulative: the quantized model's own output at that layer, with the error
    of every layer before it. With ``isolated``, a third run gives each layer's own error: a copy
    of the quantized model in which every layer's input activation is the reference's (fed from
    the reference run), so each quantized layer sees float input; worst layers and advice then
    follow that error.

    With ``sensitivity``, the model's outputs are also compared with only one kind of layer
    quantized (``mlp.down_proj`` across all blocks; with ``per_layer`` also one layer), the rest
    in float, and the advice is measured the same way (graphcal.evaluation.sensitivity): one model
    run over the data per kind, layer and advice option, and two in fp32. Their number is logged
    before any pass; their time is estimated from this comparison's first batches, and a run whose
    estimate passes ``time_limit_s`` (None: no limit) is refused then, before the sensitivity passes.

    With ``in_graph`` (the default, onnxruntime models without ``isolated``), both models run as one
    graph that reduces each compared pair to six float64 sums (graph.compare), so no activation
    leaves onnxruntime; otherwise every compared tensor of both models is fetched and compared here.

    With ``size_budget_bytes`` or ``target_db``, the layers ``candidate`` quantized are mixed with
    their form in ``fallback`` (the same fp32 model quantized at a higher precision; None: float),
    kind by kind (``per_layer``: layer by layer), by measurement (graphcal.evaluation.mixing): the
    mix that removes the most output error within the written size, or the smallest that reaches
    the output SQNR, with the flags that write it. Its runs are counted and timed as sensitivity's.

    ``writes``: (option, path) of each file the caller will write with the report (the CLI's
    ``--html``); one that is an input (a model, its external data, the data) is refused before
    any pass."""
    if level not in LEVELS:
        raise UsageError(f"level must be one of {', '.join(LEVELS)}, got {level!r}")
    mixing = size_budget_bytes is not None or target_db is not None
    if fallback is not None and not mixing:
        raise UsageError("--fallback is the higher form for --size-budget or --target-db; give one of them")
    if per_layer and not (sensitivity or mixing):
        raise UsageError("--per-layer measures each layer with --sensitivity, or mixes layer by layer with "
                         "--size-budget or --target-db; give one of them")
    for option, path in writes:
        check_output_file(path, [reference, candidate, *([data] if isinstance(data, (str, os.PathLike)) else [])],
                          option)
    # Weights stay on disk (lazy) for the paired graph, where onnxruntime reads them; the other
    # paths run each model as a whole protobuf and load them whole below.
    (ref_model, ref_files), (cand_model, cand_files) = load_model_info(reference, lazy=True), load_model_info(
        candidate, lazy=True)
    ref_model = rotated_as(ref_model, str(Path(reference).parent), cand_model)  # --rotate: layers in one basis
    for option, path in writes:  # the models' external data files are inputs too
        check_output_file(path, [Path(m).parent / f for m, files in ((reference, ref_files), (candidate, cand_files))
                                 for f in files], option)
    smoothed = smoothquant_record(cand_model)
    if fallback is not None and not any(m.get("kind") != "mul" for m in smoothed.get("mappings", [])):
        smoothed = smoothquant_record(load_model_info(fallback, lazy=True)[0])
    if (isolated or sensitivity or mixing) and any(m.get("kind") != "mul" for m in smoothed.get("mappings", [])):
        # a folded smoothing: the balance layers read x/s, which the fp32 model never computes
        why = ("--isolated cannot feed them fp32 inputs; compare without --isolated" if isolated else
               "its layers cannot be put back in float one by one; measure sensitivity or mixes")
        raise UsageError(f"{candidate} was smoothed by SmoothQuant (folded into its norms and layers: its balance "
                         f"layers read x/s, which the fp32 model does not compute), so {why}, or a model made "
                         "without --smoothquant")
    inputs = graph_inputs(ref_model)
    if {s.name for s in graph_inputs(cand_model)} != {s.name for s in inputs}:
        raise GraphcalError(f"{candidate} takes other inputs than {reference}; compare a model with its own quantized form")
    outputs = [o.name for o in ref_model.graph.output]
    missing = [o for o in outputs if o not in {x.name for x in cand_model.graph.output}]
    if missing:
        raise GraphcalError(f"{candidate} lacks output(s) {', '.join(missing)} of {reference}")
    ref_nodes = {n.name: n for n in ref_model.graph.node}
    # a layer's output keeps its tensor name in graphcal's output (the onnxruntime form may compute
    # it in a node after the MatMul: the row-normalized int8 scale, a Gemm's bias)
    cand_values = {o for n in cand_model.graph.node for o in n.output}
    targets = find_targets(ref_model)[0]
    layers, skipped = [], []
    for t in targets:
        tensor = ref_nodes[t.node].output[0]
        if tensor not in cand_values:
            skipped.append(t.name)
            continue
        layers.append((t.name, tensor))
    fetch = outputs + [tensor for _, tensor in layers]
    plan = SensitivityPlan(quantized_layers(cand_model, ref_model, targets), per_layer) if sensitivity else None
    if plan is not None:
        log.warning("eval --sensitivity: %s after the comparison; progress and time left are shown as they run",
                    plan.describe())
    ignored = written_ignore(Path(candidate))
    mix_plan = None
    if mixing:
        mix_plan = plan_mix(Path(reference), Path(candidate), None if fallback is None else Path(fallback),
                            per_layer=per_layer, budget_bytes=size_budget_bytes,
                            target_db=target_db, ignored=ignored if ignored is not None else list(DEFAULT_IGNORE))
        log.warning("eval %s: %s after the comparison", _MIX_FLAG[size_budget_bytes is None], mix_plan.describe())
    smoothable = smoothable_layers(ref_model, targets, smoothed, Path(reference).parent)
    import onnxruntime as ort  # lazy: onnxruntime loads when a comparison runs, not with this package

    from graphcal.runtime import ModelRunner, open_model_runner, open_runtime, trim_heap  # lazy: it imports onnxruntime

    optimization = getattr(ort.GraphOptimizationLevel, LEVELS[level])
    paired = runtime = ref_run = cand_run = None
    if in_graph and not isolated and runs_in_onnxruntime(ref_model) and runs_in_onnxruntime(cand_model):
        # both models in one onnxruntime graph, compared there: only six numbers per tensor leave it
        folder = common_root([(ref_model, reference), (cand_model, candidate)])
        # the model's outputs come back whole and are compared here a slice at a time (Agreement.add)
        model, weights, sums = paired_model(ref_model, cand_model, [t for t in fetch if t not in outputs],
                                            fetched=outputs)
        names = [OUTPUT, *outputs, *(PAIRED_PREFIX + o for o in outputs)]
        runtime = open_runtime(model, names, device="cpu", optimization=optimization,
                               renamed_weights=weights, external_folder=folder, priority_order=False)
        paired = ModelRunner(names, "onnxruntime", runtime.run_shared)
        del model, weights
        runner_kind = paired.kind
    else:
        if any(map(is_external, ref_model.graph.initializer)):  # weights left on disk (data files, or inline ones)
            ref_model = rotated_as(load_model(reference), str(Path(reference).parent), cand_model)
        if any(map(is_external, cand_model.graph.initializer)):
            cand_model = load_model(candidate)
    forced, forced_run, ref_fetch = {}, None, fetch
    if isolated:  # the reference run also hands over every layer's float input
        forced, forced_model = _forced_inputs(cand_model, targets)
        ref_fetch = fetch + [a for a in forced if a not in fetch]
        layer_tensors = [tensor for _, tensor in layers]
        forced_run = open_model_runner(add_taps(forced_model, layer_tensors)[0], layer_tensors,
                                       optimization=optimization)
        del forced_model
    if paired is None:
        ref_run = open_model_runner(add_taps(ref_model, ref_fetch)[0], ref_fetch, optimization=optimization)  # or onnx.reference
        cand_run = open_model_runner(add_taps(cand_model, fetch)[0], fetch, optimization=optimization)
        runner_kind = cand_run.kind
    del ref_model, cand_model
    out_agree = [Agreement(o) for o in outputs]
    layer_agree = [Agreement(name) for name, _ in layers]
    alone = [Agreement(name) for name, _ in layers] if isolated else None
    calib = load_data(data, inputs, batch_size=batch_size, num_samples=num_samples, model_dir=Path(reference).parent)
    batches, clock = 0, time.monotonic()
    log.info("evaluating on %s samples in batches of %s", calib.num_samples, calib.batch_size)
    bar = Progress("evaluating", getattr(calib, "num_samples", None) or None, "sample")
    compared = [*zip(out_agree, outputs), *zip(layer_agree, (tensor for _, tensor in layers))]
    for batch in calib.batches():
        if paired is not None:
            values = paired.run(batch)
            for agreement, tensor in zip(out_agree, outputs):
                agreement.add(values[tensor], values[PAIRED_PREFIX + tensor])
            for agreement, (_, tensor) in zip(layer_agree, layers):
                if tensor in sums:  # else an output: it takes that output's sums below
                    agreement.add_sums(*map(float, values[OUTPUT][sums[tensor]:sums[tensor] + len(SUMS)]))
            del values
        else:
            ref_values, cand_values = ref_run.run(batch), cand_run.run(batch)
            for agreement, tensor in compared:
                agreement.add(ref_values[tensor], cand_values[tensor])
            if forced_run is not None:
                feeds = {**batch, **{name: ref_values[act] for act, name in forced.items()}}
                forced_values = forced_run.run(feeds)
                for agreement, (_, tensor) in zip(alone, layers):
                    agreement.add(ref_values[tensor], forced_values[tensor])
        batches += 1
        bar.update(batch_samples(batch))
        if batches == min(2, calib.num_batches or 1):
            _check_time([p for p in (plan, mix_plan) if p is not None], time.monotonic() - clock, batches,
                        calib.num_batches, time_limit_s, per_layer)
    bar.close()
    if paired is not None:  # a layer whose output is a model output (lm_head's logits) agrees as that output does
        by_output = dict(zip(outputs, out_agree))
        for agreement, (_, tensor) in zip(layer_agree, layers):
            if tensor in by_output:
                agreement.add_sums(*(getattr(by_output[tensor], key) for key in SUMS))
    if sensitivity or mixing:  # the comparison's sessions go before sensitivity opens its own
        paired = ref_run = cand_run = forced_run = runtime = None  # noqa: F841
        trim_heap()
    sens = mix = None
    if sensitivity:
        sens = measure_sensitivity(plan, reference, candidate, outputs, calib, optimization,
                                   ignored if ignored is not None else list(DEFAULT_IGNORE))
        trim_heap()
    if mix_plan is not None:
        mix = measure_mix(mix_plan, reference, candidate, fallback, outputs, calib, optimization)
    # onnxruntime read the weights by path: the numbers hold only if the files are still those the loads checked
    identity.check_unchanged([Path(m).parent / f for m, files in ((reference, ref_files), (candidate, cand_files))
                              for f in (Path(m).name, *files)])
    return EvalReport(out_agree, layer_agree, calib.num_samples, batches,
                      runner_kind, skipped, level=level, ignored=ignored, isolated=alone,
                      smoothable=smoothable, sensitivity=sens, mix=mix, warnings=list(calib.notes))


_MIX_FLAG = {False: "--size-budget", True: "--target-db"}


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
    what = " and ".join("--sensitivity" if isinstance(p, SensitivityPlan) else _MIX_FLAG[p.budget_bytes is None]
                        for p in plans)
    if limit_s is None or estimate <= limit_s:
        log.warning("eval %s: about %s after this comparison (%d runs of about %s)", what, duration(estimate),
                    runs, duration(per_run))
        return
    raise UsageError(f"{what} would take about {duration(estimate)} ({'; '.join(p.describe() for p in plans)}, "
                     f"about {duration(per_run)} each), past the time limit of {duration(limit_s)}; use fewer "
                     f"--num-samples{', drop --per-layer' if per_layer else ''} or raise --time-limit (0: none)")


FORCED = "graphcal-float-input/"  # graph inputs of the isolated copy: the reference's activations


def _forced_inputs(model: onnx.ModelProto, targets) -> tuple[dict[str, str], onnx.ModelProto]:
    """A copy of ``model`` whose every reader of a target's input activation reads a new graph input
    instead ({activation: input name}), to be fed the reference's value of that activation."""
    graph_inputs_ = {i.name for i in model.graph.input}
    acts = [t.activation for t in targets if t.activation not in graph_inputs_]
    forced = {a: FORCED + a for a in dict.fromkeys(acts)}
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    types = {}
    for vi in [*copy.graph.value_info, *copy.graph.output]:
        types[vi.name] = vi.type.tensor_type.elem_type
    for node in copy.graph.node:
        for i, name in enumerate(node.input):
            if name in forced:
                node.input[i] = forced[name]
    for act, name in forced.items():
        copy.graph.input.append(onnx.helper.make_tensor_value_info(name, types.get(act) or onnx.TensorProto.FLOAT, None))
    return forced, copy
