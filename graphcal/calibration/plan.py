"""plan(): what a run will do to a model, decided before any data is read or any observer runs.

``run`` and ``inspect`` both call :func:`plan`, so they agree by construction: the targets and
their module names, which are chosen and which left in float, the scheme each one gets, the
fused groups, the key/value states a kv-cache scheme quantizes, the opset the output needs,
the warnings, and the expected size of the written model. Everything that can fail before
calibrating (an unreadable or hostile model, nothing to quantize, a scheme with no ONNX form
for the target runtime) fails here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import MappingProxyType

import onnx

from graphcal.algorithms.awq.clip import clip_layers
from graphcal.algorithms.rotation.fold import Rotation
from graphcal.algorithms.rotation.fold import rotate as rotate_stream
from graphcal.algorithms.rotation.fold import write_record as write_rotation_record
from graphcal.calibration.sizing import size_parts
from graphcal.config import DEFAULT_IGNORE, RunConfig, observer_name
from graphcal.errors import GraphcalError
from graphcal.graph.attention import find_kv_states
from graphcal.graph.fusion import find_fused_groups
from graphcal.graph.io import default_opset, load_model_info, unchecked_ops, value_types
from graphcal.graph.qdq import TargetRuntime, form_notes, items_opset, required_kv_opset, runtime_notes
from graphcal.graph.qdq.policy import WeightForm, choose_form
from graphcal.graph.scaling import Resolution, candidates, resolve
from graphcal.graph.targets import Skipped, find_lookups, find_targets, select
from graphcal.graph.ties import find_ties
from graphcal.observers import make_observer
from graphcal.output import MODEL_FILE
from graphcal.output.companions import Companions, find_companions
from graphcal.runtime import INT8_SATURATION_NOTE, int8_gemm_saturates
from graphcal.types import FusedGroup, KVState, QuantizedTarget, Target, enum_value

log = logging.getLogger("graphcal")


class _Held:
    """The loaded model, until the pipeline takes it over for the output."""

    def __init__(self, model: onnx.ModelProto):
        self.model: onnx.ModelProto | None = model


@dataclass(frozen=True)
class RunPlan:
    """What a run does to one model (frozen: later stages read it and never change it).

    :attr:`model` is the model as loaded (external weights stay on disk and are read once, when
    needed), for reading; stages that edit a graph work on their own copies, and the pipeline
    takes it over for the output (:meth:`take_model`), after which the plan has none.
    """

    model_path: Path
    held: _Held
    data_files: tuple[str, ...]  # external data files the model reads (empty: every weight inline)
    config: RunConfig
    target_runtime: TargetRuntime
    found: tuple[Target, ...]  # every weight MatMul/Gemm, in graph order
    not_targets: tuple[Skipped, ...]  # MatMul/Gemm nodes that take no weight
    chosen: tuple[Target, ...]  # the ones to quantize
    unmatched: tuple[str, ...]  # target/ignore patterns that match nothing (the default ignore left out)
    schemes: Mapping[str, object]  # target name -> compressed-tensors QuantizationScheme
    groups: tuple[FusedGroup, ...]
    fusion_warnings: tuple[str, ...]
    kv_states: tuple[KVState, ...]
    model_opset: int
    opset: int  # what the schemes (and kv states) need
    size: Mapping[str, int]  # terms of the expected size (graphcal.calibration.sizing)
    warnings: tuple[str, ...]
    matmulnbits: int | None = None  # accuracy level of com.microsoft.MatMulNBits written for int weights
    forms: tuple[str, ...] = ()  # what onnxruntime runs for the targets (--target onnxruntime)
    smoothing: Resolution | None = None  # SmoothQuant's mappings (None: no smoothing asked for)
    awq: Resolution | None = None  # AWQ's mappings (None: no AWQ asked for)
    unchecked: frozenset[str] = frozenset()  # default-domain ops onnx has no schema for (graph.io.unchecked_ops)
    companions: Companions = Companions()  # the input folder's files -o receives too (output.companions)
    lookups: tuple[Target, ...] = ()  # embedding lookups to quantize (graph.targets.find_lookups; weight-only)
    found_lookups: tuple[Target, ...] = ()  # every embedding lookup, in graph order
    ties: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # lookup -> the chosen lm_head whose stored weight it reads
    rotation: Rotation | None = None  # --rotate: what the rotation folded (the model is the rotated one)
    awq_clip: tuple[str, ...] = ()  # --awq-clip: the layers AWQ's clip search takes

    @property
    def model(self) -> onnx.ModelProto:
        """The model as loaded, to read (the pipeline edits it only after :meth:`take_model`)."""
        if self.held.model is None:
            raise RuntimeError("the plan's model was taken over for the output; read the written model instead")
        return self.held.model

    def take_model(self) -> onnx.ModelProto:
        """Hand the loaded model over to the caller, which edits it into the output (nothing is
        copied: a big model is held once); the plan keeps its types (read first) and no model."""
        model = self.model
        self.held.model = None
        return model

    @cached_property
    def types(self) -> Mapping[str, onnx.TypeProto.Tensor]:
        """Element types and shapes of graph values (shape inference, once; only run needs them)."""
        return MappingProxyType(value_types(self.model))

    @property
    def base_dir(self) -> str:
        """The folder weights left on disk are read from: the model's (its data files', or the model
        file's own, where an inline model's weights stay in it: graph.io.load_model_info)."""
        return str(self.model_path.parent)

    @property
    def ignored(self) -> list[str]:
        return [t.name for t in self.found if t not in self.chosen]

    @property
    def output_opset(self) -> int:
        return max(self.model_opset, self.opset)

    @property
    def input_size(self) -> int:
        return self.size["input"]

    @property
    def expected_size(self) -> int:
        return sum(self.size.values())

    def items(self) -> list[QuantizedTarget]:
        """The chosen targets with their schemes (no qparams yet)."""
        return [QuantizedTarget(t, self.schemes[t.name]) for t in self.chosen]


def plan(model_path: str | Path, config: RunConfig, target_runtime: str | TargetRuntime = TargetRuntime.ONNXRUNTIME,
         matmulnbits: int | None = None) -> RunPlan:
    """Load ``model_path`` (checked: see graphcal.graph.io) and decide what a run with ``config``
    writes for ``target_runtime`` (``matmulnbits``: write integer weights as com.microsoft.MatMulNBits with
    this accuracy level); raises GraphcalError for everything that would fail before calibrating."""
    model_path, target_runtime = Path(model_path), TargetRuntime(target_runtime)
    model, data_files = load_model_info(model_path, lazy=True)
    log.info("loaded %s (opset %d, %d nodes, %d initializers)", model_path, default_opset(model),
             len(model.graph.node), len(model.graph.initializer))
    rotation = None
    if config.rotate:  # before anything is found: every later stage sees the rotated model
        rotation = rotate_stream(model, str(model_path.parent), heads="R2" in config.rotate, kind=config.rotation_type)
        write_rotation_record(model, rotation)
        log.info("rotated the residual stream (%s): %d weights, %d norm scales folded", rotation.matrix,
                 len(rotation.rotated), rotation.norms)
        if rotation.kept_tied:
            log.info("rotation kept %s tied to lm_head; its norm scale moved into a %dx%d MatMul before lm_head, "
                     "left in float", ", ".join(rotation.kept_tied), rotation.hidden, rotation.hidden)
    found, skipped = find_targets(model)
    if not found:
        raise GraphcalError(f"{model_path}: no MatMul/Gemm node takes a weight; nothing to quantize")
    found_lookups = find_lookups(model)
    every = found + found_lookups
    selected, unmatched = select(every, config.patterns, config.ignore)
    keep_float = set(rotation.scale_nodes) if rotation is not None else set()  # rotation's small MatMuls
    chosen = [t for t in selected if t.op_type != "Gather" and t.node not in keep_float]
    lookups = [t for t in selected if t.op_type == "Gather"]
    unmatched = [p for p in unmatched if p not in DEFAULT_IGNORE]  # a default that fits no model is no news
    warnings = [f"target or ignore pattern {p!r} matches no MatMul/Gemm or embedding lookup" for p in unmatched]
    if not chosen:
        raise GraphcalError(f"{model_path}: no target left to quantize (targets {config.patterns}, ignore {config.ignore}); "
                            "graphcal quantizes embedding lookups beside MatMul/Gemm layers, not alone")
    log.info("%d weight MatMul/Gemm found, %d to quantize, %d left in float%s", len(found), len(chosen),
             len(found) - len(chosen), f"; {len(lookups)} embedding lookup(s) to quantize" if lookups else "")
    schemes = {t.name: config.scheme_for(t) for t in selected}
    _check_divisible(selected, schemes, config)  # before any pass: a group that does not divide fails here
    items = [QuantizedTarget(t, schemes[t.name]) for t in chosen]
    lookup_items = [QuantizedTarget(t, schemes[t.name]) for t in lookups]
    opset = items_opset(items + lookup_items, target_runtime=target_runtime)  # raises where there is no ONNX form
    _check_lookup_observers(lookup_items)
    warnings += runtime_notes(items, target_runtime)
    forms = form_notes(items + lookup_items, target_runtime, matmulnbits)  # raises for a target with no form
    if any("u8 x s8" in f for f in forms):

        if int8_gemm_saturates():
            warnings.append(INT8_SATURATION_NOTE)
    kv_states: list[KVState] = []
    if config.kv_cache is not None:
        kv_opset = required_kv_opset(config.kv_cache, target_runtime)
        kv_states, problems = find_kv_states(model)
        if kv_states:
            opset = max(opset, kv_opset)
        warnings += [f"kv-cache scheme: {p}" for p in problems]
        if not kv_states:
            warnings.append("kv-cache scheme: no attention module (named like compressed-tensors' kv-cache targets "
                            "'re:.*(self_attn|attention)$') with recognisable key/value states; no k/v quantized")
    smoothing = _smoothing(model, found, chosen, config, str(model_path.parent))
    if smoothing is not None:
        warnings += smoothing.notes if config.smoothing.mappings is not None else []
        if not smoothing.mappings:
            warnings.append("SmoothQuant: nothing to smooth" + (
                f" with --smoothquant {config.smoothing.scope}; graphcal inspect --smoothquant mul lists what each "
                "scope would smooth" if config.smoothing.mappings is None and config.smoothing.scope != "mul" else ""))
    tied = find_ties(model, lookups, chosen, str(model_path.parent)) if lookups else {}  # lookup -> chosen lm_head
    awq = _awq(model, found, chosen, tied, schemes, target_runtime, matmulnbits, config, str(model_path.parent))
    if awq is not None:
        warnings += awq.notes if config.awq.mappings is not None else []
        if not awq.mappings:
            warnings.append("AWQ: no activation of the quantized layers can be scaled with an exact fold into a norm "
                            "or linear layer; nothing to search (graphcal inspect lists why)")
    groups, fusion_warnings = find_fused_groups(chosen)
    if any(enum_value(s.weights.strategy) == "tensor_group" for s in schemes.values() if s.weights is not None):
        warnings += fusion_warnings  # fused groups matter only where they share a global scale
    ties, tie_notes = _ties(model, found, chosen, lookups, tied, schemes, target_runtime, matmulnbits, smoothing, awq,
                            str(model_path.parent))
    warnings += tie_notes
    if rotation is not None and rotation.untied:
        warnings.append(f"--rotate: {', '.join(rotation.untied)} is read by several nodes that take different "
                        "rotations (a table tied to lm_head, or a weight shared otherwise), so each node has its own "
                        f"rotated copy now (+{(rotation.bytes_after - rotation.bytes_before) / 1e6:.1f} MB in float "
                        "before quantization)")
    if rotation is not None and "R2" in rotation.rotations and not rotation.heads:
        warnings.append("--rotate R2: no attention's value and output projections were recognised (onnxruntime's "
                        "GroupQueryAttention over a packed qkv_proj, or a torch export's attention in plain ops), "
                        "so only R1 was folded")
    companions = find_companions(model_path, MODEL_FILE)
    warnings += companions.notes  # what -o's genai_config.json leaves out (code to load, files to touch)
    return RunPlan(
        model_path=model_path, held=_Held(model), data_files=data_files, config=config, target_runtime=target_runtime,
        found=tuple(found), not_targets=tuple(skipped), chosen=tuple(chosen), unmatched=tuple(unmatched),
        schemes=MappingProxyType(schemes), groups=tuple(groups), fusion_warnings=tuple(fusion_warnings),
        kv_states=tuple(kv_states), model_opset=default_opset(model), opset=opset,
        size=MappingProxyType(size_parts(model, model_path, items, data_files, lookup_items, ties)),
        warnings=tuple(warnings), matmulnbits=matmulnbits, forms=tuple(forms), smoothing=smoothing, awq=awq,
        unchecked=unchecked_ops(model), companions=companions,
        lookups=tuple(lookups), found_lookups=tuple(found_lookups), ties=MappingProxyType(ties), rotation=rotation,
        awq_clip=clip_layers(chosen, schemes) if awq is not None and config.awq.clip else (),
    )


def _ties(model, found: list[Target], chosen: list[Target], lookups: list[Target], tied: dict[str, str], schemes,
          target_runtime, matmulnbits, smoothing, awq, base_dir: str) -> tuple[dict[str, str], list[str]]:
    """Which chosen lookups read the quantized weight of the lm_head they are tied to (``tied``:
    graph.ties over the chosen targets), and a note for each tie that is stored twice, and why."""
    if not lookups:
        return {}, []
    notes = []
    unchosen = [t for t in found if t not in chosen]
    for lookup, head in find_ties(model, lookups, unchosen, base_dir, compare_values=False).items():
        notes.append(f"{lookup} is tied to {head}, which stays in float: the table is stored twice (float for {head}, "
                     f"quantized for the lookup); --lm-head quantizes {head} and stores one table for both")
    scaled = set()
    for resolution in (smoothing, awq):
        for m in resolution.mappings if resolution is not None else ():
            scaled.update(m.balance)
            if m.candidate.linear:
                scaled.add(m.candidate.linear)
    ties = {}
    by_name = {t.name: t for t in chosen}
    for lookup, head in tied.items():
        problem = _share_problem(schemes[lookup], schemes[head], by_name[head], target_runtime, matmulnbits, scaled)
        if problem:
            notes.append(f"{lookup} is tied to {head}, but {problem}: both tables are stored")
        else:
            ties[lookup] = head
            log.info("%s reads %s's quantized weight (tied: one table stored)", lookup, head)
    return ties, notes


def _share_problem(lookup_scheme, head_scheme, head: Target, target_runtime, matmulnbits, scaled: set[str]) -> str:
    """Why a lookup cannot read its tied lm_head's stored weight ("" when it can)."""
    if head.name in scaled:
        return f"{head.name}'s weight is rescaled by SmoothQuant/AWQ first, so it no longer equals the table"
    fields = ("num_bits", "type", "symmetric", "strategy", "group_size", "block_structure", "scale_dtype", "zp_dtype")
    a, b = (s.weights.model_dump(include=set(fields)) for s in (lookup_scheme, head_scheme))
    if a != b:
        return "their schemes give them different formats"
    form = choose_form(QuantizedTarget(head, head_scheme), target_runtime, matmulnbits).weight
    if TargetRuntime(target_runtime) is TargetRuntime.ONNXRUNTIME and form is not WeightForm.MATMULNBITS:
        return (f"{head.name} is written as {form.value}, and onnxruntime's GatherBlockQuantized shares only a "
                "MatMulNBits weight: add --matmulnbits")
    if form is not WeightForm.DQ and TargetRuntime(target_runtime) is not TargetRuntime.ONNXRUNTIME:
        return f"{head.name} is written as {form.value}"
    return ""


def _check_lookup_observers(items: list[QuantizedTarget]) -> None:
    """A lookup's table is observed alone: an observer that weighs a weight by its layer's inputs has none."""
    for item in items:
        args = item.scheme.weights.model_copy(deep=True)
        name = observer_name(args, "weight")
        if make_observer(name, "weight", args).needs_activations:
            raise GraphcalError(f"{item.target.name}: observer {name} weighs a weight by its layer's input "
                                "activations, and an embedding lookup has none (its input is token ids); give the "
                                "lookups a scheme with another observer (--scheme-for Embedding=...)")


def _smoothing(model, found: list[Target], chosen: list[Target], config: RunConfig, base_dir: str | None):
    """SmoothQuant's mappings in this graph (graph.smooth), or None when the run asks for none."""

    settings = config.smoothing
    if settings is None:
        return None
    resolution = resolve(candidates(model, found, base_dir), chosen, settings.scope, settings.mappings, settings.ignore)
    log.info("SmoothQuant: %d mappings to smooth", len(resolution.mappings))
    return resolution


def _awq(model, found: list[Target], chosen: list[Target], tied: dict[str, str], schemes, target_runtime, matmulnbits,
         config: RunConfig, base_dir: str | None):
    """AWQ's mappings in this graph: activations whose scales fold exactly into the norm or linear
    layer before them (no node added), by structure or by llm-compressor's names; None without AWQ.
    Found by structure, a mapping into an lm_head that a quantized lookup reads as its table is
    left out (llm-compressor's mappings never scale lm_head): scaled, the table would be stored twice."""

    settings = config.awq
    if settings is None:
        return None
    resolution = resolve(candidates(model, found, base_dir), chosen, "all", settings.mappings, what="AWQ")
    if settings.mappings is None and tied:
        by_name = {t.name: t for t in chosen}
        shared = {head for lookup, head in tied.items()
                  if not _share_problem(schemes[lookup], schemes[head], by_name[head], target_runtime, matmulnbits, set())}
        for m in [m for m in resolution.mappings if shared & set(m.balance)]:
            resolution.mappings.remove(m)
            log.info("AWQ: %s left out: %s is tied to a quantized lookup, which reads its weight (one table stored)",
                     m.describe(), ", ".join(sorted(shared & set(m.balance))))
    log.info("AWQ: %d mappings to search", len(resolution.mappings))
    return resolution


def _group_width(args) -> int | None:
    """The width a weight's or input's groups (or blocks) split its input features into."""
    if args is None:
        return None
    strategy = enum_value(args.strategy)
    if strategy in ("group", "tensor_group"):
        return args.group_size
    if strategy == "block" and args.block_structure:
        return args.block_structure[1]
    return None


def _check_divisible(chosen: list[Target], schemes: Mapping[str, object], config: RunConfig) -> None:
    """Every group or block width divides its target's input features (compressed-tensors' observers
    and the ONNX forms take whole groups); otherwise one error that lists the targets and says what
    to do: a width that divides them all, or the --ignore that leaves them in float."""
    bad: dict[int, list[Target]] = {}
    for t in chosen:
        scheme = schemes[t.name]
        for args in (scheme.weights, scheme.input_activations):
            width = _group_width(args)
            if width and t.in_features % width:
                bad.setdefault(width, []).append(t)
                break
    if not bad:
        return
    width = next(iter(bad))  # the first width named (a scheme rarely has two that fail)
    targets = [t for group in bad.values() for t in group]
    shown = ", ".join(f"{t.name} (in {t.in_features})" for t in targets[:3])
    more = f" and {len(targets) - 3} more" if len(targets) > 3 else ""
    fits = _dividing_width(width, [t.in_features for t in targets])
    kinds = sorted({t.name.rpartition(".")[2] for t in targets})
    pattern = "re:.*\\.(" + "|".join(kinds) + ")$" if all(kinds) else None
    advice = []
    weights = schemes[targets[0].name].weights
    if fits and weights is not None and enum_value(weights.strategy) in ("group", "tensor_group") \
            and weights.group_size == width:
        advice.append(f"a group size of {fits} divides them all: --group-size {fits}")
    elif fits:
        advice.append(f"a group size of {fits} divides them all: --scheme '{_with_width(schemes[targets[0].name], width, fits)}'")
    if pattern and len(targets) < len(chosen):  # leaving every target in float is no advice
        flags = " ".join(f"--ignore '{p}'" for p in [*config.ignore, pattern])
        advice.append(("or leave" if advice else "leave") + f" them in float: {flags}")
    if not advice:
        advice.append("choose a group size that divides the input features")
    raise GraphcalError(
        f"group size {width} does not divide the input features of {len(targets)} of {len(chosen)} targets: "
        f"{shown}{more}; graphcal quantizes whole groups only (a recipe's bypass_divisibility_checks does not "
        f"change that); " + " ".join(advice))


def _dividing_width(width: int, features: list[int]) -> int | None:
    """The largest power of two below ``width`` (at least 16) that divides every width in ``features``."""
    candidate = 1 << ((width - 1).bit_length() - 1)  # the largest power of two below width
    while candidate >= 16:
        if all(f % candidate == 0 for f in features):
            return candidate
        candidate //= 2
    return None


def _with_width(scheme, width: int, new: int) -> str:
    """The scheme as --scheme JSON, its groups (or blocks) of ``width`` made ``new`` wide."""
    import json  # lazy: stdlib, needed on this rare path only

    fields = {}
    for key in ("weights", "input_activations"):
        args = getattr(scheme, key)
        if args is None:
            continue
        data = {k: v for k, v in args.model_dump(mode="json", exclude_none=True).items()
                if k in ("num_bits", "type", "symmetric", "strategy", "group_size", "block_structure", "dynamic",
                         "observer", "scale_dtype", "zp_dtype")}
        if data.get("group_size") == width:
            data["group_size"] = new
        if data.get("block_structure") and data["block_structure"][1] == width:
            data["block_structure"] = [data["block_structure"][0], new]
        fields[key] = data
    return json.dumps(fields, separators=(",", ":"))
