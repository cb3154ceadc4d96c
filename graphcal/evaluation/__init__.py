"""graphcal eval: how far a quantized model is from its fp32 original, output by output and layer by layer.

Both models run over the same data, one batch at a time, and every weight MatMul/Gemm output of
the fp32 model is compared in both (graphcal's writer keeps those nodes and their output names).
On onnxruntime the two models run as one graph that reduces each pair to float64 sums itself
(graph.compare), so no activation leaves it; otherwise the tensors are fetched and compared
here. Statistics stream in float64 (sums of squares, products and the max error), so memory
stays flat whatever the data size. Models with fp4 / e8m0 types, which onnxruntime 1.31 cannot run,
go through onnx.reference.
"""

from __future__ import annotations

import html
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from graphcal.config import DEFAULT_IGNORE
from graphcal.data import batch_samples, graph_inputs, load_data
from graphcal.errors import GraphcalError, UsageError
from graphcal.graph.external import is_external, rebase
from graphcal.graph.io import load_model, load_model_info
from graphcal.graph.scaling import SCOPE_OF_KIND, SCOPES
from graphcal.graph.taps import add_taps
from graphcal.graph.targets import find_targets


@dataclass
class Agreement:
    """Streaming agreement between a reference tensor and a candidate one."""

    name: str
    ref_sq: float = 0.0
    cand_sq: float = 0.0
    dot: float = 0.0
    err_sq: float = 0.0
    max_abs_err: float = 0.0
    max_abs_ref: float = 0.0

    def add(self, ref: np.ndarray, cand: np.ndarray) -> None:
        ref, cand = np.asarray(ref, np.float64), np.asarray(cand, np.float64)
        if ref.shape != cand.shape:
            raise GraphcalError(f"{self.name}: shapes differ between the models ({ref.shape} vs {cand.shape})")
        err = cand - ref
        self.ref_sq += float((ref * ref).sum())
        self.cand_sq += float((cand * cand).sum())
        self.dot += float((ref * cand).sum())
        self.err_sq += float((err * err).sum())
        if err.size:
            self.max_abs_err = max(self.max_abs_err, float(np.abs(err).max()))
            self.max_abs_ref = max(self.max_abs_ref, float(np.abs(ref).max()))

    def add_sums(self, ref_sq: float, cand_sq: float, dot: float, err_sq: float, max_abs_err: float,
                 max_abs_ref: float) -> None:
        """Fold in one batch's sums as graph.compare reduces them in the graph (float64)."""
        self.ref_sq += ref_sq
        self.cand_sq += cand_sq
        self.dot += dot
        self.err_sq += err_sq
        self.max_abs_err = max(self.max_abs_err, max_abs_err)
        self.max_abs_ref = max(self.max_abs_ref, max_abs_ref)

    @property
    def sqnr_db(self) -> float:
        if self.err_sq == 0:
            return math.inf
        return 10 * math.log10(self.ref_sq / self.err_sq) if self.ref_sq > 0 else -math.inf

    @property
    def cosine(self) -> float:
        denom = math.sqrt(self.ref_sq * self.cand_sq)
        return self.dot / denom if denom > 0 else 1.0

    def as_dict(self) -> dict:
        return {"name": self.name, "sqnr_db": _finite(self.sqnr_db), "cosine": self.cosine,
                "max_abs_error": self.max_abs_err, "max_abs_reference": self.max_abs_ref}


LEVELS = {"basic": "ORT_ENABLE_BASIC", "all": "ORT_ENABLE_ALL"}


@dataclass
class EvalReport:
    outputs: list[Agreement]
    layers: list[Agreement]  # named by torch module, in graph order
    samples: int
    batches: int
    runner: str  # "onnxruntime" or "onnx.reference"
    skipped_layers: list[str] = field(default_factory=list)
    level: str = "basic"  # onnxruntime's optimization level for both models
    ignored: list[str] | None = None  # the quantized model's ignore list (its quantization_config.json), if known
    isolated: list[Agreement] | None = None  # each layer's own error, on the reference's inputs (eval --isolated)
    smoothable: dict[str, str] = field(default_factory=dict)  # layer -> SmoothQuant scope that reaches its input, if unsmoothed
    sensitivity: object | None = None  # sensitivity.Sensitivity (eval --sensitivity)

    @property
    def ranked(self) -> list[Agreement]:
        """The per-layer agreements advice follows: each layer's own error when measured, else the cumulative one."""
        return self.isolated if self.isolated is not None else self.layers

    def worst(self, count: int = 3) -> list[Agreement]:
        return sorted(self.ranked, key=lambda a: a.sqnr_db)[:count]

    def suggested_ignore(self, margin_db: float = 6.0) -> list[str]:
        """Layers more than ``margin_db`` under the median layer SQNR (else none)."""
        quantized = [a for a in self.ranked if math.isfinite(a.sqnr_db)]  # "exact": a layer left in float
        if len(quantized) < 2:
            return []
        median = float(np.median([a.sqnr_db for a in quantized]))
        return [a.name for a in sorted(quantized, key=lambda a: a.sqnr_db) if a.sqnr_db < median - margin_db]

    def suggested_flags(self) -> list[str]:
        """The --ignore flags that keep the suggested layers in float, pasteable into `graphcal run`:
        the ignores the quantized model was written with first (--ignore replaces the default), then
        a ``re:`` pattern for each kind of layer flagged in every block, then single names."""
        flagged = self.suggested_ignore()
        if not flagged:
            return []
        kinds: dict[str, list[str]] = {}
        for a in self.layers:
            kinds.setdefault(_kind(a.name), []).append(a.name)
        patterns, covered = [], set()
        for kind, members in kinds.items():
            if len(members) > 1 and all(m in flagged for m in members):
                patterns.append(kind_pattern(kind))
                covered.update(members)
        names = [n for n in flagged if n not in covered]
        keep = self.ignored if self.ignored is not None else list(DEFAULT_IGNORE)
        flags = []
        for value in [*keep, *patterns, *names]:
            flags += ["--ignore", value]
        return flags

    def suggested_smoothquant(self) -> list[str]:
        """``--smoothquant [SCOPE]`` when SmoothQuant (not used for these layers) can smooth the input of
        a flagged layer exactly: the scope that reaches all of them (norms < all < mul), else []."""
        scopes = [self.smoothable[n] for n in self.suggested_ignore() if n in self.smoothable]
        if not scopes:
            return []
        scope = max(scopes, key=SCOPES.index)  # norms < all < mul
        return ["--smoothquant"] + ([scope] if scope != "norms" else [])

    def as_dict(self) -> dict:
        return {"samples": self.samples, "batches": self.batches, "runner": self.runner, "level": self.level,
                "outputs": [a.as_dict() for a in self.outputs],
                "layers": [{**a.as_dict(), **({"isolated_sqnr_db": _finite(b.sqnr_db)} if b is not None else {})}
                           for a, b in zip(self.layers, self.isolated or [None] * len(self.layers))],
                "ranked_by": "isolated" if self.isolated is not None else "cumulative",
                "worst_layers": [a.name for a in self.worst()], "suggested_ignore": self.suggested_ignore(),
                "suggested_flags": self.suggested_flags(), "suggested_smoothquant": self.suggested_smoothquant(),
                "skipped_layers": self.skipped_layers,
                **({"sensitivity": self._sensitivity_dict()} if self.sensitivity is not None else {})}

    def _sensitivity_dict(self) -> dict:
        sens = self.sensitivity
        advice = sens.advice(self.outputs[0].sqnr_db)

        def option(o):
            return {"kinds": o.kinds, "layers": o.layers, "expected_outputs": [a.as_dict() for a in o.outputs],
                    "flags": sens.flags(o)}

        return {"alone": [{"name": k, "layers": sens.kinds.get(k, [k]), "outputs": [a.as_dict() for a in sens.alone[k]]}
                          for k in sens.ranked()],
                "options": [option(o) for o in sens.options],
                "advice": option(advice) if advice is not None else None}


def _kind(name: str) -> str:
    """A layer's kind: its module name after the block index ("mlp.down_proj" of
    "model.layers.3.mlp.down_proj"), or the whole name when it has no index."""
    match = re.search(r"\.\d+\.(.+)$", name)
    return match.group(1) if match else name


def kind_pattern(kind: str) -> str:
    """The ``re:`` target pattern for one kind of layer in every block: ``re:.*\\.mlp\\.down_proj$``."""
    return "re:.*" + re.escape("." + kind) + "$"


def _written_ignore(candidate: Path) -> list[str] | None:
    """The ignore list graphcal wrote beside ``candidate`` (quantization_config.json), if there is one."""
    import json

    from graphcal.limits import read_regular
    from graphcal.output.metadata import CONFIG_FILE

    path = candidate.parent / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        ignore = json.loads(read_regular(path, "quantization config", 1 << 20)).get("ignore")
    except (GraphcalError, ValueError, AttributeError):
        return None
    return [str(x) for x in ignore] if isinstance(ignore, list) else None


def evaluate(reference: str | Path, candidate: str | Path, data, *, batch_size: int | None = None,
             num_samples: int | None = None, level: str = "basic", isolated: bool = False,
             sensitivity: bool = False, per_layer: bool = False, in_graph: bool = True) -> EvalReport:
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
    back in float, and the advice is measured the same way (graphcal.evaluation.sensitivity): one pass over
    the data per kind, layer and advice option, each running both models.

    With ``in_graph`` (the default, onnxruntime models without ``isolated``), both models run as one
    graph that reduces each compared pair to six float64 sums (graph.compare), so no activation
    leaves onnxruntime; otherwise every compared tensor of both models is fetched and compared here."""
    if level not in LEVELS:
        raise UsageError(f"level must be one of {', '.join(LEVELS)}, got {level!r}")
    # Weights stay on disk (lazy) for the paired graph, where onnxruntime reads them; the other
    # paths run each model as a whole protobuf and load them whole below.
    (ref_model, ref_files), (cand_model, cand_files) = load_model_info(reference, lazy=True), load_model_info(
        candidate, lazy=True)
    smoothed = _smoothquant_record(cand_model)
    if (isolated or sensitivity) and any(m.get("kind") != "mul" for m in smoothed.get("mappings", [])):
        # a folded smoothing: the balance layers read x/s, which the fp32 model never computes
        why = ("--isolated cannot feed them fp32 inputs; compare without --isolated" if isolated else
               "its layers cannot be put back in float one by one; measure sensitivity")
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
    smoothable = _smoothable(ref_model, targets, smoothed, Path(reference).parent)
    import onnxruntime as ort

    from graphcal.runtime import open_model_runner  # onnxruntime (and torch): imported when a comparison runs

    optimization = getattr(ort.GraphOptimizationLevel, LEVELS[level])
    from graphcal.graph.io import runs_in_onnxruntime

    paired = None
    if in_graph and not isolated and runs_in_onnxruntime(ref_model) and runs_in_onnxruntime(cand_model):
        # both models in one onnxruntime graph, compared there: only six numbers per tensor leave it
        from graphcal.graph.compare import OUTPUT, SUMS, paired_model
        from graphcal.runtime import ModelRunner, open_runtime

        folder = _data_root([(ref_model, reference), (cand_model, candidate)])
        model, weights, sums = paired_model(ref_model, cand_model, fetch)
        names = [OUTPUT]
        runtime = open_runtime(model, names, device="cpu", optimization=optimization,
                               renamed_weights=weights, external_folder=folder, priority_order=False)
        paired = ModelRunner(names, "onnxruntime", runtime.run_numpy)
        del model, weights
        runner_kind = paired.kind
    else:
        if ref_files:
            ref_model = load_model(reference)
        if cand_files:
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
    calib = load_data(data, inputs, batch_size=batch_size, num_samples=num_samples)
    from graphcal.progress import Progress

    batches = 0
    bar = Progress("evaluating", getattr(calib, "num_samples", None) or None, "sample")
    compared = [*zip(out_agree, outputs), *zip(layer_agree, (tensor for _, tensor in layers))]
    for batch in calib.batches():
        if paired is not None:
            values = paired.run(batch)[OUTPUT]
            for agreement, tensor in compared:
                agreement.add_sums(*map(float, values[sums[tensor]:sums[tensor] + len(SUMS)]))
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
    bar.close()
    ignored = _written_ignore(Path(candidate))
    sens = None
    if sensitivity:
        sens = _sensitivity(reference, candidate, targets, outputs, calib, optimization, per_layer,
                            ignored if ignored is not None else list(DEFAULT_IGNORE))
    return EvalReport(out_agree, layer_agree, calib.num_samples, batches,
                      runner_kind, skipped, level=level, ignored=ignored, isolated=alone,
                      smoothable=smoothable, sensitivity=sens)


def _data_root(models: list[tuple[onnx.ModelProto, str | Path]]) -> Path | None:
    """The folder onnxruntime reads the models' external data from when they run as one session
    (it takes one folder and refuses paths out of it): the deepest folder holding every model's
    folder, the models' (lazy) external references rewritten relative to it. None when no weight
    is external. Each reference is checked against its own model's folder first."""
    import os

    holding = [(model, Path(path).parent) for model, path in models if any(map(is_external, model.graph.initializer))]
    if not holding:
        return None
    try:
        root = Path(os.path.commonpath([os.path.realpath(folder) for _, folder in holding]))
    except ValueError:  # folders on different drives (Windows)
        raise GraphcalError("the two models' weights are on different drives; put both models on one drive "
                            "to compare them") from None
    for model, folder in holding:
        for t in model.graph.initializer:
            if is_external(t):
                rebase(t, folder, root)
    return root


def _sensitivity(reference, candidate, targets, outputs, calib, optimization, per_layer: bool, ignored):
    """Each kind (and layer) quantized alone, then the advice options, each compared with fp32 over the data."""
    from graphcal.evaluation.sensitivity import MAX_OPTIONS, Option, Sensitivity, float_except, quantized_layers

    ref_model, cand_model = load_model(reference), load_model(candidate)
    layers = quantized_layers(cand_model, ref_model, targets)
    kinds: dict[str, list[str]] = {}
    for t in layers:
        kinds.setdefault(_kind(t.name), []).append(t.name)

    from graphcal.runtime import open_model_runner

    ref_run = open_model_runner(ref_model, outputs, optimization=optimization)  # one fp32 session for every variant

    def compare(keep: set[str]) -> list[Agreement]:
        return _compare(ref_run, float_except(cand_model, ref_model, layers, keep), outputs, calib, optimization)

    alone = {kind: compare(set(names)) for kind, names in kinds.items()}
    if per_layer:
        alone.update({t.name: compare({t.name}) for t in layers if len(kinds[_kind(t.name)]) > 1})
    ranked = sorted(kinds, key=lambda k: alone[k][0].sqnr_db)
    options = []
    for n in range(1, min(MAX_OPTIONS, len(ranked) - 1) + 1):  # never every kind: that is the fp32 model
        floated = ranked[:n]
        names = [name for k in floated for name in kinds[k]]
        option = Option(floated, names)
        option.outputs = compare({t.name for t in layers} - set(names))
        options.append(option)
    return Sensitivity(kinds, alone, options, list(ignored))


def _compare(ref_run, model, outputs, calib, optimization) -> list[Agreement]:
    """The outputs of ``model`` against the fp32 runner's over the data (both run once per batch)."""
    from graphcal.runtime import open_model_runner

    run = open_model_runner(model, outputs, optimization=optimization)
    agree = [Agreement(o) for o in outputs]
    for batch in calib.batches():
        ref_values, values = ref_run.run(batch), run.run(batch)
        for a, name in zip(agree, outputs):
            a.add(ref_values[name], values[name])
    return agree


def _smoothquant_record(model: onnx.ModelProto) -> dict:
    """What graphcal recorded of a SmoothQuant (or AWQ) run in the model's metadata ({} when none)."""
    import json

    from graphcal.algorithms.channel_scales import AWQ_METADATA_KEY, METADATA_KEY

    for prop in model.metadata_props:
        if prop.key in (METADATA_KEY, AWQ_METADATA_KEY):
            try:
                record = json.loads(prop.value)
            except ValueError:
                return {}
            return record if isinstance(record, dict) else {}
    return {}


def _smoothable(model: onnx.ModelProto, targets, record: dict, base_dir: Path | None = None) -> dict[str, str]:
    """Layer -> the --smoothquant scope that smooths its input exactly, for layers the candidate left unsmoothed."""
    from graphcal.graph.scaling import candidates

    done = {b for m in record.get("mappings", []) if isinstance(m, dict) for b in m.get("balance", [])}
    out = {}
    for c in candidates(model, list(targets), None if base_dir is None else str(base_dir)):  # lazy: read from its folder
        if c.reason or any(b in done for b in c.balance):
            continue
        for b in c.balance:
            out[b] = SCOPE_OF_KIND[c.kind]
    return out


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


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _fmt_db(value: float) -> str:
    return "exact" if value == math.inf else f"{value:.1f}"


def format_text(report: EvalReport) -> str:
    level = f", ORT_ENABLE_{report.level.upper()}" if report.runner == "onnxruntime" else ""
    lines = [f"compared on {report.samples} samples in {report.batches} batches ({report.runner}{level})", "",
             "output                SQNR (dB)  cosine     max abs error  max abs fp32"]
    for a in report.outputs:
        lines.append(f"{a.name:<21} {_fmt_db(a.sqnr_db):>9}  {a.cosine:.6f}   {a.max_abs_err:.3e}      {a.max_abs_ref:.3g}")
    alone = report.isolated
    width = max([len(a.name) for a in report.layers] + [50])
    lines += ["", f"{'layer (MatMul/Gemm output)':<{width}}  SQNR (dB)  max abs error"
              + ("  alone (dB)" if alone is not None else "")]
    for i, a in enumerate(report.layers):
        lines.append(f"{a.name:<{width}}  {_fmt_db(a.sqnr_db):>9}  {a.max_abs_err:.3e}"
                     + (f"  {_fmt_db(alone[i].sqnr_db):>10}" if alone is not None else ""))
    if alone is not None:
        lines.append("SQNR: the quantized model's own output at the layer (errors of earlier layers included); "
                     "alone: the layer's own error, its input taken from fp32")
    if report.layers:
        which = "on their own" if alone is not None else "cumulative; --isolated ranks by each layer's own error"
        lines += ["", f"worst layers ({which}): "
                  + ", ".join(f"{a.name} ({_fmt_db(a.sqnr_db)} dB)" for a in report.worst())]
        flags = report.suggested_flags()
        if flags:
            lines.append(f"{', '.join(report.suggested_ignore())}: more than 6 dB under the median layer; to keep "
                         "them in float, run with: " + " ".join(shlex.quote(f) for f in flags))
            smooth = report.suggested_smoothquant()
            if smooth:
                lines.append("or keep them quantized and smooth their inputs first (SmoothQuant, exact in float; "
                             "this model was made without it for them): run with " + " ".join(smooth))
        else:
            lines.append("no layer is more than 6 dB under the median layer")
    if report.sensitivity is not None:
        lines += _sensitivity_text(report)
    if report.skipped_layers:
        lines.append(f"not compared (node missing or renamed in the quantized model): {', '.join(report.skipped_layers)}")
    return "\n".join(lines)


def _sensitivity_text(report: EvalReport) -> list[str]:
    sens = report.sensitivity
    first = report.outputs[0]
    width = max([len(k) for k in sens.alone] + [28])
    lines = ["", f"sensitivity: {first.name} with only these layers quantized (the rest in float), most harmful first",
             f"{'layers':<{width}}  count  SQNR (dB)  cosine"]
    for k in sens.ranked():
        a = sens.alone[k][0]
        lines.append(f"{k:<{width}}  {len(sens.kinds.get(k, [k])):>5}  {_fmt_db(a.sqnr_db):>9}  {a.cosine:.6f}")
    lines.append(f"now (as quantized): {_fmt_db(first.sqnr_db)} dB, cosine {first.cosine:.6f}; in float instead:")
    for o in sens.options:
        a = o.outputs[0]
        lines.append(f"  {' + '.join(o.kinds)} ({len(o.layers)} layers): {_fmt_db(a.sqnr_db)} dB, cosine {a.cosine:.6f}")
    advice = sens.advice(first.sqnr_db)
    if advice is None:
        lines.append("no kind of layer is worth keeping in float")
    else:
        a = advice.outputs[0]
        lines.append(f"advice: keep {' + '.join(advice.kinds)} in float ({len(advice.layers)} layers; expected "
                     f"{_fmt_db(a.sqnr_db)} dB, cosine {a.cosine:.6f}): run with "
                     + " ".join(shlex.quote(f) for f in sens.flags(advice)))
    return lines


def format_html(report: EvalReport, title: str) -> str:
    """A self-contained page: the tables and an SVG bar chart of per-layer SQNR."""
    finite = [a.sqnr_db for a in report.layers if math.isfinite(a.sqnr_db)]
    top = max(finite + [1.0])
    bar_h, label_w, chart_w = 16, 340, 420
    height = bar_h * len(report.layers) + 30
    bars = []
    for i, a in enumerate(report.layers):
        value = a.sqnr_db if math.isfinite(a.sqnr_db) else top
        width = max(value, 0) / top * chart_w
        y = 20 + i * bar_h
        bars.append(f'<text x="{label_w - 6}" y="{y + 12}" text-anchor="end" font-size="11">{html.escape(a.name)}</text>'
                    f'<rect x="{label_w}" y="{y + 2}" width="{width:.1f}" height="{bar_h - 4}" fill="#4a7ab5"/>'
                    f'<text x="{label_w + width + 4:.1f}" y="{y + 12}" font-size="11">{_fmt_db(a.sqnr_db)}</text>')
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + chart_w + 60}" height="{height}">'
           f'<text x="{label_w}" y="12" font-size="12">per-layer SQNR (dB), higher is closer to fp32</text>'
           + "".join(bars) + "</svg>")
    rows = "".join(f"<tr><td>{html.escape(a.name)}</td><td>{_fmt_db(a.sqnr_db)}</td><td>{a.cosine:.6f}</td>"
                   f"<td>{a.max_abs_err:.3e}</td></tr>" for a in report.outputs)
    ignore = report.suggested_ignore()
    advice = (" ".join(f"--ignore {html.escape(n)}" for n in ignore) if ignore
              else "no layer is more than 6 dB under the median layer")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head><body>"
            f"<h1>{html.escape(title)}</h1><p>{report.samples} samples, {report.runner}</p>"
            f"<h2>Outputs</h2><table border='1' cellpadding='4'><tr><th>output</th><th>SQNR (dB)</th><th>cosine</th>"
            f"<th>max abs error</th></tr>{rows}</table><h2>Layers</h2>{svg}"
            f"<p>Worst: {', '.join(html.escape(a.name) for a in report.worst())}</p><p>{advice}</p></body></html>")
