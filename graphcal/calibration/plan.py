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
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

from graphcal.calibration.decisions import Loaded, RunPlan
from graphcal.calibration.own_data import OwnData
from graphcal.calibration.sizing import size_parts
from graphcal.calibration.transforms import REGISTRY, configured
from graphcal.calibration.transforms.base import PlanScope
from graphcal.config import DEFAULT_IGNORE, RunConfig, observer_name
from graphcal.data.fill import genai_section, parse_genai_config
from graphcal.devices import INT8_SATURATION_NOTE, int8_gemm_saturates
from graphcal.errors import GraphcalError
from graphcal.graph.attention import find_kv_states
from graphcal.graph.fusion import find_fused_groups
from graphcal.graph.index import GraphIndex
from graphcal.graph.io import default_opset, load_model_info, unchecked_ops
from graphcal.graph.qdq import TargetRuntime, form_notes, items_opset, required_kv_opset, runtime_notes
from graphcal.graph.qdq.opset import float_type_opset
from graphcal.graph.qdq.policy import PreferredLevel, WeightForm, choose_form
from graphcal.graph.targets import find_lookups, find_targets, select
from graphcal.graph.ties import find_ties
from graphcal.observers import make_observer
from graphcal.output import MODEL_FILE
from graphcal.output.companions import Companions, find_companions
from graphcal.types import KVState, QuantizedTarget, Target, enum_value

log = logging.getLogger("graphcal")


def load(model_path: str | Path, config: RunConfig, own_folder: Callable[[], Path] | None = None) -> Loaded:
    """Load ``model_path`` and run the transforms that change weights (--rotate) on it, in order:
    each takes the model and returns the model and its record (graphcal.calibration.transforms).
    The weights they change are written one at a time into the run's own data file (OwnData), in a
    folder made inside ``own_folder()`` (the output's temporary folder; None: the system's), which
    the model then refers to: ``Loaded.close`` removes it."""
    model_path = Path(model_path)
    model, data_files = load_model_info(model_path, lazy=True)
    log.info("loaded %s (opset %d, %d nodes, %d initializers)", model_path, default_opset(model),
             len(model.graph.node), len(model.graph.initializer))
    records, own = {}, None
    try:
        for unit, settings in configured(config):
            if unit.rewrites_weights:  # before anything is found: every later stage sees the rewritten model
                own = own or OwnData(own_folder, prefix="graphcal-rotated-")
                model, records[unit.settings_type] = unit.rewrite(model, settings, str(model_path.parent), own)
        if own is not None:
            own.finish()
    except BaseException:
        if own is not None:
            own.close()
        raise
    return Loaded(model, tuple(data_files), MappingProxyType(records), own)


def plan(model_path: str | Path, config: RunConfig, target_runtime: str | TargetRuntime = TargetRuntime.ONNXRUNTIME,
         matmulnbits: int | None = None, loaded: Loaded | None = None) -> RunPlan:
    """Decide what a run with ``config`` writes for ``target_runtime`` (``matmulnbits``: write integer
    weights as com.microsoft.MatMulNBits with this accuracy level) on ``loaded`` (:func:`load`: the
    model read and rewritten by the transforms that change weights; None: :func:`load` it here);
    raises GraphcalError for everything that would fail before calibrating."""
    model_path, target_runtime = Path(model_path), TargetRuntime(target_runtime)
    loaded = loaded or load(model_path, config)
    model, data_files, rewrites = loaded.model, loaded.data_files, loaded.records
    found, skipped = find_targets(model)
    if not found:
        raise GraphcalError(f"{model_path}: no MatMul/Gemm node takes a weight; nothing to quantize")
    found_lookups = find_lookups(model)
    every = found + found_lookups
    selected, unmatched = select(every, config.patterns, config.ignore)
    keep_float = {n for unit, record in rewrites.items() for n in REGISTRY[unit].keep_float(record)}  # nodes they added
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
    weights = GraphIndex(model.graph).initializers
    opset = max(opset, float_type_opset({weights[t.weight].data_type for t in chosen + lookups}))  # fp16/bf16 scales
    companions = find_companions(model_path, MODEL_FILE)
    matmulnbits = weight_format(matmulnbits, companions, target_runtime)
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
    tied = find_ties(model, lookups, chosen, str(model_path.parent)) if lookups else {}  # lookup -> chosen lm_head
    by_name = {t.name: t for t in chosen}
    scope = PlanScope(model, found, chosen, MappingProxyType(tied), MappingProxyType(schemes), config,
                      str(model_path.parent), lambda lookup, head: not _share_problem(
                          schemes[lookup], schemes[head], by_name[head], target_runtime, matmulnbits, set()))
    decisions = dict(rewrites)
    for unit, settings in configured(config):  # each transform's decision, in the order they run
        if not unit.rewrites_weights:
            decisions[unit.settings_type] = decision = unit.resolve(scope, settings)
            warnings += unit.notes(decision, settings)
    groups, fusion_warnings = find_fused_groups(chosen)
    if any(enum_value(s.weights.strategy) == "tensor_group" for s in schemes.values() if s.weights is not None):
        warnings += fusion_warnings  # fused groups matter only where they share a global scale
    scaled = {n for unit, settings in configured(config) for n in unit.scaled(decisions.get(unit.settings_type))}
    ties, tie_notes = _ties(model, found, chosen, lookups, tied, schemes, target_runtime, matmulnbits, scaled,
                            str(model_path.parent))
    warnings += tie_notes
    for unit, settings in configured(config):  # what the transforms that ran before the plan did, noted
        if unit.rewrites_weights:
            warnings += unit.notes(decisions[unit.settings_type], settings)
    warnings += companions.notes  # what -o's genai_config.json leaves out (code to load, files to touch)
    return RunPlan(
        model_path=model_path, data_files=data_files, config=config, target_runtime=target_runtime,
        found=tuple(found), not_targets=tuple(skipped), chosen=tuple(chosen), unmatched=tuple(unmatched),
        schemes=MappingProxyType(schemes), groups=tuple(groups), fusion_warnings=tuple(fusion_warnings),
        kv_states=tuple(kv_states), model_opset=default_opset(model), opset=opset,
        size=MappingProxyType(size_parts(model, model_path, items, data_files, lookup_items, ties)),
        warnings=tuple(warnings), matmulnbits=matmulnbits, forms=tuple(forms),
        unchecked=unchecked_ops(model), companions=companions,
        lookups=tuple(lookups), found_lookups=tuple(found_lookups), ties=MappingProxyType(ties), decisions=MappingProxyType(decisions),
        pass_hessians=any(unit.hessians_in_pass(settings) for unit, settings in configured(config)),
    )


MATMULNBITS_OFF = "off"  # --matmulnbits off: DequantizeLinear weights, an onnxruntime-genai model's included


def weight_format(asked: int | str | None, companions: Companions, target_runtime: TargetRuntime) -> int | None:
    """The MatMulNBits accuracy level integer weights are written with (None: DequantizeLinear), from
    ``--matmulnbits`` (``asked``: a level, ``"off"`` or None). Not given, an onnxruntime-genai model
    (a genai_config.json beside it) is written in its builder's format: MatMulNBits wherever a
    weight-only layer can take it, at the level the builder writes for the folder's provider (4 on the
    CPU, 0 on CUDA and the others: onnxruntime-genai's builder), as a :class:`PreferredLevel`."""
    if asked == MATMULNBITS_OFF:
        return None
    if asked is not None or companions.genai_config is None or target_runtime is not TargetRuntime.ONNXRUNTIME:
        return asked
    config = parse_genai_config(companions.genai_config, Path(MODEL_FILE))
    providers = genai_section(config, "model", "decoder", "session_options").get("provider_options")
    named = {key for entry in providers if isinstance(entry, dict) for key in entry} if isinstance(providers, list) else set()
    level = 4 if named <= {"cpu", "webgpu"} else 0
    log.info("an onnxruntime-genai model: weight-only integer layers are written as MatMulNBits (accuracy level %d), "
             "the builder's format (--matmulnbits off: DequantizeLinear)", level)
    return PreferredLevel(level)


def _ties(model, found: list[Target], chosen: list[Target], lookups: list[Target], tied: dict[str, str], schemes,
          target_runtime, matmulnbits, scaled: set[str], base_dir: str) -> tuple[dict[str, str], list[str]]:
    """Which chosen lookups read the quantized weight of the lm_head they are tied to (``tied``:
    graph.ties over the chosen targets), and a note for each tie that is stored twice, and why."""
    if not lookups:
        return {}, []
    notes = []
    unchosen = [t for t in found if t not in chosen]
    for lookup, head in find_ties(model, lookups, unchosen, base_dir, compare_values=False).items():
        notes.append(f"{lookup} is tied to {head}, which stays in float: the table is stored twice (float for {head}, "
                     f"quantized for the lookup); --lm-head quantizes {head} and stores one table for both")
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
