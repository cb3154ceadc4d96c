"""eval's comparison: both models over the same data, every output and weight MatMul/Gemm output compared.

On onnxruntime the two models run as one graph that reduces each pair to float64 sums itself
(graph.compare), so no activation leaves it; otherwise the tensors are fetched and compared
here. With ``isolated``, a third model, the quantized one fed the reference's layer inputs,
gives each layer's own error. It reads the models eval loaded once (graphcal.evaluation.models)
and returns a frozen :class:`Comparison`; sensitivity and mixing are their own steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import onnx

from graphcal.data import Calibration, batch_samples, graph_inputs, load_data
from graphcal.errors import GraphcalError
from graphcal.evaluation.agreement import Agreement
from graphcal.evaluation.models import EvalModels
from graphcal.evaluation.next_token import MASK, NextTokenLoss, logits_output, split_labels
from graphcal.evaluation.options import EvalOptions
from graphcal.graph.compare import OUTPUT, SUMS, paired_model
from graphcal.graph.compare import PREFIX as PAIRED_PREFIX
from graphcal.graph.taps import add_taps
from graphcal.graph.targets import find_targets
from graphcal.progress import Progress

log = logging.getLogger("graphcal")


@dataclass(frozen=True)
class Layout:
    """What the comparison fetches, known from the models' structure before any pass."""

    inputs: list  # the reference's graph inputs (what the data feeds)
    outputs: list[str]  # the model outputs, compared whole
    layers: list[tuple[str, str]]  # (layer, its output tensor) compared in both models, in graph order
    skipped: list[str]  # layers the quantized model does not compute under their fp32 output name
    targets: list  # the reference's weight MatMul/Gemm targets
    logits: str | None = None  # the output holding next-token logits (None: none, an encoder)

    @property
    def fetch(self) -> list[str]:
        return self.outputs + [tensor for _, tensor in self.layers]


def layout_of(models: EvalModels) -> Layout:
    """The outputs and layers both models compute; refused in one line where the quantized model takes
    other inputs or lacks an output of the reference."""
    ref_model, cand_model = models.reference.model, models.candidate.model
    reference, candidate = models.reference.path, models.candidate.path
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
    return Layout(inputs, outputs, layers, skipped, targets, logits_output(ref_model, targets))


@dataclass(frozen=True)
class Comparison:
    """Every output and layer of the quantized model against the reference's, over the data."""

    outputs: list[Agreement]
    layers: list[Agreement]  # cumulative: each layer with the error of every layer before it
    isolated: list[Agreement] | None  # each layer's own error (--isolated)
    batches: int
    runner: str  # "onnxruntime" or "onnx.reference"
    calib: Calibration  # the data, as the later measures read it again
    provider: str | None = None  # the onnxruntime provider that ran the models (None: onnx.reference)
    next_token: NextTokenLoss | None = None  # the logits output's next-token KL (and token loss), where there is one


def compare(models: EvalModels, layout: Layout, data, options: EvalOptions, optimization,
            paced: Callable[[float, int, int | None], None]) -> Comparison:
    """Run both models over ``data`` and compare ``layout``'s tensors; ``paced(seconds, batches,
    num_batches)`` is told the first batches' time (eval estimates the later runs from it)."""
    from graphcal.runtime import open_model_runner, open_runtime, runtime_runner  # lazy: it imports onnxruntime

    outputs, layers, fetch, isolated = layout.outputs, layout.layers, layout.fetch, options.isolated
    on = dict(device=options.device, device_id=options.device_id)  # every session: CPU, or the GPU and its tensors
    paired = ref_run = cand_run = None
    if options.in_graph and not isolated and models.in_onnxruntime:
        # both models in one onnxruntime graph, compared there: only six numbers per tensor leave it
        # the model's outputs come back whole and are compared here a slice at a time (Agreement.add)
        model, weights, sums = paired_model(models.reference.model, models.candidate.model,
                                            [t for t in fetch if t not in outputs], fetched=outputs)
        names = [OUTPUT, *outputs, *(PAIRED_PREFIX + o for o in outputs)]
        runtime = open_runtime(model, names, optimization=optimization, renamed_weights=weights,
                               external_folder=models.folder, priority_order=False, **on)
        paired = runtime_runner(runtime, shared=True)
        del model, weights
        runner_kind, provider = paired.kind, paired.provider
    forced, forced_run, ref_fetch = {}, None, fetch
    if paired is None:  # each model run as a whole protobuf, its weights read in
        ref_model, cand_model = models.whole(models.reference), models.whole(models.candidate)
        if isolated:  # the reference run also hands over every layer's float input
            forced, forced_model = _forced_inputs(cand_model, layout.targets)
            ref_fetch = fetch + [a for a in forced if a not in fetch]
            layer_tensors = [tensor for _, tensor in layers]
            forced_run = open_model_runner(add_taps(forced_model, layer_tensors)[0], layer_tensors,
                                           optimization=optimization, **on)
            del forced_model
        ref_run = open_model_runner(add_taps(ref_model, ref_fetch)[0], ref_fetch, optimization=optimization,
                                    **on)  # or onnx.reference
        cand_run = open_model_runner(add_taps(cand_model, fetch)[0], fetch, optimization=optimization, **on)
        runner_kind, provider = cand_run.kind, cand_run.provider
        del ref_model, cand_model
    out_agree = [Agreement(o) for o in outputs]
    layer_agree = [Agreement(name) for name, _ in layers]
    alone = [Agreement(name) for name, _ in layers] if isolated else None
    loss = NextTokenLoss(layout.logits) if layout.logits is not None else None
    calib = load_data(data, layout.inputs, batch_size=options.batch_size, num_samples=options.num_samples,
                      model_dir=models.reference.path.parent, labels=loss is not None)
    batches, clock = 0, time.monotonic()
    log.info("evaluating on %s samples in batches of %s", calib.num_samples, calib.batch_size)
    bar = Progress("evaluating", getattr(calib, "num_samples", None) or None, "sample")
    compared = [*zip(out_agree, outputs), *zip(layer_agree, (tensor for _, tensor in layers))]
    for batch in calib.batches():
        batch, labels = split_labels(batch)
        if paired is not None:
            values = paired.run(batch)  # numpy, or torch tensors on the GPU: compared where they lie
            for agreement, tensor in zip(out_agree, outputs):
                agreement.add(values[tensor], values[PAIRED_PREFIX + tensor])
            if loss is not None:  # on the logits fetched whole for the output's agreement
                loss.add(values[loss.name], values[PAIRED_PREFIX + loss.name], batch.get(MASK), labels)
            reduced = values[OUTPUT].tolist()  # the layers' sums: the one small vector that comes to the host
            for agreement, (_, tensor) in zip(layer_agree, layers):
                if tensor in sums:  # else an output: it takes that output's sums below
                    agreement.add_sums(*reduced[sums[tensor]:sums[tensor] + len(SUMS)])
            del values
        else:
            ref_values, cand_values = ref_run.run(batch), cand_run.run(batch)
            for agreement, tensor in compared:
                agreement.add(ref_values[tensor], cand_values[tensor])
            if loss is not None:
                loss.add(ref_values[loss.name], cand_values[loss.name], batch.get(MASK), labels)
            if forced_run is not None:
                feeds = {**batch, **{name: ref_values[act] for act, name in forced.items()}}
                forced_values = forced_run.run(feeds)
                for agreement, (_, tensor) in zip(alone, layers):
                    agreement.add(ref_values[tensor], forced_values[tensor])
        batches += 1
        bar.update(batch_samples(batch))
        if batches == min(2, calib.num_batches or 1):
            paced(time.monotonic() - clock, batches, calib.num_batches)
    bar.close()
    if paired is not None:  # a layer whose output is a model output (lm_head's logits) agrees as that output does
        by_output = dict(zip(outputs, out_agree))
        for agreement, (_, tensor) in zip(layer_agree, layers):
            if tensor in by_output:
                agreement.add_sums(*(getattr(by_output[tensor], key) for key in SUMS))
    return Comparison(out_agree, layer_agree, alone, batches, runner_kind, calib, provider, loss)


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
