"""calibrate(): the one module that wires the stages together.

One batch flows one way: ``data`` yields ``{input: array}`` -> ``runtime`` runs the tapped graph
once -> each tap goes to its observers -> the batch is dropped. After the loop: weights are
observed once from the initializers -> observers give qparams (fused groups share global
scales) -> ``graph.qdq`` writes Q/DQ into a copy of the model -> ``metadata`` -> files.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from graphcal.config import DEFAULT_IGNORE, DEFAULT_TARGETS, RunConfig, build_config, observer_name
from graphcal.data import graph_inputs, load_data
from graphcal.distributed import from_env, gather_statistics
from graphcal.errors import GraphcalError, UsageError
from graphcal.fusion import find_fused_groups
from graphcal.graph.attention import find_kv_states
from graphcal.graph.io import default_opset, load_model_info, save_model, value_types
from graphcal.graph.qdq import QDQWriter, items_opset, required_kv_opset, runtime_notes
from graphcal.graph.targets import find_targets, select, torch_weight
from graphcal.graph.taps import add_reductions, add_taps, mark, restore
from graphcal.metadata import CONFIG_FILE, QPARAMS_FILE, build_quantization_config, config_json, qparam_tensors
from graphcal.output import MODEL_FILE, releases_outputs, reserve_output
from graphcal.runtime import check_device, observer_device, open_runtime
from graphcal.types import KVState, QParams, QuantizedKV, QuantizedTarget, Target, enum_value

log = logging.getLogger("graphcal")


@dataclass
class CalibrationResult:
    """What a run did and wrote."""

    output_dir: Path
    files: list[Path]
    targets: list[QuantizedTarget]
    ignored: list[str]
    provider: str | None  # None when no activation pass was needed
    num_samples: int
    num_batches: int
    seconds: float
    warnings: list[str] = field(default_factory=list)
    rank: int = 0  # under torchrun: this process's rank (only rank 0 writes)
    world: int = 1

    @property
    def qparams(self) -> dict[str, torch.Tensor]:
        return qparam_tensors(self.targets)


@releases_outputs  # the -o reservation below is released however calibrate ends
def calibrate(
    model: str | Path,
    data,  # .npz path, folder of .npz, mapping of arrays, or an onnxruntime CalibrationDataReader
    output_dir: str | Path,
    *,
    scheme: str = "W8A8",
    config: RunConfig | None = None,
    targets: tuple[str, ...] | list[str] = DEFAULT_TARGETS,
    ignore: tuple[str, ...] | list[str] = DEFAULT_IGNORE,
    observer: str | None = None,
    kv_cache: str | None = None,
    recipe: str | Path | None = None,
    device: str = "auto",
    target: str = "onnxruntime",
    batch_size: int | None = None,
    num_samples: int | None = None,
    progress: bool = False,
    reduce_in_graph: bool = True,
    skip_nonfinite_weights: bool = False,
) -> CalibrationResult:
    """Calibrate ``model`` on ``data`` and write the QDQ model and metadata to ``output_dir``.

    ``scheme`` is a compressed-tensors preset name, ``W8A8_STATIC``, or JSON scheme fields;
    ``config`` (a RunConfig) replaces scheme/targets/ignore/observer/kv_cache when given;
    ``recipe`` (an llm-compressor recipe file) does the same (see graphcal.recipe for overrides).
    ``kv_cache`` (FP8, INT8 or JSON QuantizationArgs) quantizes the key/value states entering
    attention, as a kv_cache_scheme does (k_scale / v_scale per attention module). ``target`` is
    the runtime the QDQ model is written for: "onnxruntime" (standard ONNX) or "tensorrt"
    (only what TensorRT builds; other schemes fail before calibrating). With ``reduce_in_graph``
    (the default), min/max observers get their batch extrema from ReduceMin/ReduceMax in the
    tapped graph, so whole activations leave onnxruntime only for observers that need them.
    A weight holding NaN or Inf is an error naming it; with ``skip_nonfinite_weights`` its layer
    is left in float (listed as ignored) with a warning.
    """
    start = time.perf_counter()
    model_path, out_dir = Path(model), Path(output_dir)
    data_paths = [] if isinstance(data, Mapping) or hasattr(data, "get_next") else [Path(data)]
    slot = reserve_output(out_dir, [model_path, *data_paths])  # checks -o, locks it (rank 0), clears leftovers
    if config is None and recipe is not None:  # the recipe with nothing on top, as `run --recipe` without flags
        from graphcal.recipe import load_recipe, recipe_config

        config = recipe_config(load_recipe(recipe))
    config = config or build_config(scheme, list(targets), list(ignore), observer, kv_cache)
    check_device(device)  # --device cuda without a usable GPU fails here, whatever the scheme
    warnings: list[str] = []

    # External data stays on disk: onnxruntime reads it from the model's folder, weights are read one at a time.
    onnx_model, external = load_model_info(model_path, lazy=True)  # the output keeps external data too
    base_dir = str(model_path.parent) if external else None
    log.info("loaded %s (opset %d, %d nodes, %d initializers)", model_path, default_opset(onnx_model),
             len(onnx_model.graph.node), len(onnx_model.graph.initializer))
    found, _skipped = find_targets(onnx_model)
    if not found:
        raise GraphcalError(f"{model_path}: no MatMul/Gemm node takes a weight; nothing to quantize")
    chosen, unmatched = select(found, config.patterns, config.ignore)
    warnings += [f"target or ignore pattern {p!r} matches no MatMul/Gemm" for p in unmatched if p not in DEFAULT_IGNORE]
    if not chosen:
        raise GraphcalError(f"{model_path}: no target left to quantize (targets {config.patterns}, ignore {config.ignore})")
    ignored = [t.name for t in found if t not in chosen]
    log.info("%d weight MatMul/Gemm found, %d to quantize, %d left in float", len(found), len(chosen), len(ignored))
    schemes = {t.name: config.scheme_for(t) for t in chosen}
    unfilled = [QuantizedTarget(t, schemes[t.name]) for t in chosen]
    need = items_opset(unfilled, runtime=target)  # fails before calibrating if a scheme has no ONNX form here
    warnings += runtime_notes(unfilled, target)
    kv_states: list[KVState] = []
    if config.kv_cache is not None:
        kv_opset = required_kv_opset(config.kv_cache, target)
        kv_states, problems = find_kv_states(onnx_model)
        if kv_states:
            need = max(need, kv_opset)
        warnings += [f"kv-cache scheme: {p}" for p in problems]
        if not kv_states:
            warnings.append("kv-cache scheme: no attention module (named like compressed-tensors' kv-cache targets "
                            "'re:.*(self_attn|attention)$') with recognisable key/value states; no k/v quantized")
    calib = load_data(data, graph_inputs(onnx_model), batch_size=batch_size, num_samples=num_samples)

    plan = _ObserverPlan(chosen, schemes, kv_states, config.kv_cache)
    types = value_types(onnx_model)  # once: element types and shapes for taps and the writer
    groups, fusion_warnings = find_fused_groups(chosen)
    if plan.uses_tensor_group:
        warnings += fusion_warnings
    dist = from_env()  # torchrun: this rank's share of the batches, statistics gathered after the loop
    device_id = dist.local_rank if dist else 0  # under torchrun each rank has its own GPU
    provider, batches = None, 0
    if plan.taps:
        full, reduced = plan.fetches(reduce_in_graph)
        before = mark(onnx_model)  # taps and reductions go in place and come out once the session exists
        tapped, fetch = add_taps(onnx_model, full, types, in_place=True)
        plan.reduction_outputs = add_reductions(tapped, reduced, types)
        fetch += [name for names in plan.reduction_outputs.values() for name in names]
        error = None
        try:
            try:
                runtime = open_runtime(tapped, fetch, device, device_id=device_id,
                                       external_folder=base_dir)
            finally:
                restore(onnx_model, before)
            provider = runtime.provider
            log.info("calibration pass on onnxruntime %s (taps to torch on %s): %d whole tensors and %d "
                     "reductions fetched per batch", provider, runtime.device, len(full), len(reduced))
            try:
                batches = _run_activations(runtime, calib, plan, progress and (dist is None or dist.is_main), dist)
            finally:
                runtime.close()
        except Exception as e:  # noqa: BLE001 -- under torchrun every rank must hear of it
            if dist is None:
                raise
            error = e
        if dist is not None:
            gather_statistics(dist, plan.activation_observers(), error)
    else:  # no activation pass: the data is still read once, cheaply, so NaN/Inf in it is refused
        calib.check_values()
    if dist is not None and not dist.is_main:
        return CalibrationResult(
            output_dir=out_dir, files=[], targets=[], ignored=ignored, provider=provider,
            num_samples=0, num_batches=batches, seconds=time.perf_counter() - start, warnings=warnings,
            rank=dist.rank, world=dist.world,
        )
    # Weights: read each once, observe it (with its fused peers), quantize it into the output, let it go.
    # They are observed where the activations were (the GPU on CUDA) and quantized on the host.
    obs_device = observer_device(provider, device, device_id)
    writer = QDQWriter(onnx_model, need, target, types, base_dir)
    del onnx_model  # the writer edits it in place (or holds the opset-converted copy)
    by_name: dict[str, QuantizedTarget] = {}
    from tqdm import tqdm

    log.info("observing and quantizing %d weights", len(chosen))
    weight_bar = tqdm(total=len(chosen), desc="weights", unit="weight", leave=False,
                      disable=None if progress and (dist is None or dist.is_main) else True)
    for unit in _weight_units(chosen, groups):
        weights = {}
        for t in unit:
            weights[t.name] = torch.from_numpy(torch_weight(writer.model, t, base_dir))
            bad = _nonfinite_count(weights[t.name])
            if bad:
                if not skip_nonfinite_weights:
                    raise GraphcalError(f"{t.name}: weight {t.weight!r} holds {bad} NaN or Inf value(s); fix the model, "
                                        "or pass --skip-nonfinite-weights to leave such layers in float")
                warnings.append(f"{t.name}: weight {t.weight!r} holds {bad} NaN or Inf value(s); left in float")
                del weights[t.name]
                weight_bar.update(1)
                continue
            try:
                plan.weight_observers[t.name](weights[t.name].to(obs_device))
            except ValueError as e:  # e.g. a group size that does not divide in_features
                raise GraphcalError(f"{t.name} weight [{t.out_features}, {t.in_features}]: {e}") from e
        unit = [t for t in unit if t.name in weights]  # members left in float share no global scale
        plan.fuse(g for g in groups if set(g.members) == {t.name for t in unit})
        for t in unit:
            item = plan.qparams(t, schemes[t.name])
            writer.quantize_weight(item, weights.pop(t.name))
            by_name[t.name] = item
            weight_bar.update(1)
    weight_bar.close()
    items = [by_name[t.name] for t in chosen if t.name in by_name]
    ignored += [t.name for t in chosen if t.name not in by_name]  # non-finite weights left in float
    kv_items = plan.kv_qparams()
    for item in items:
        writer.quantize_input(item)
    for kv in kv_items:
        writer.quantize_kv(kv)
    qdq_model = writer.finish()
    qc_data = build_quantization_config(config, items, ignored, kv_items)[1]
    tensors = qparam_tensors(items, kv_items)

    def write(tmp: Path) -> list[Path]:
        from safetensors.torch import save_file

        files = save_model(qdq_model, tmp / MODEL_FILE, external=external, base_dir=base_dir)
        (tmp / CONFIG_FILE).write_text(config_json(qc_data))
        save_file(tensors, str(tmp / QPARAMS_FILE), metadata={"format": "pt"})  # one key: safetensors writes metadata in hash order
        return files + [tmp / CONFIG_FILE, tmp / QPARAMS_FILE]

    files = slot.write(write)  # a temporary folder beside -o, swapped in; unlocks
    warnings += slot.warnings
    log.info("wrote %s", ", ".join(str(f) for f in files))
    return CalibrationResult(
        output_dir=out_dir, files=files, targets=items, ignored=ignored, provider=provider,
        num_samples=calib.num_samples if plan.taps else 0, num_batches=calib.num_batches if plan.taps else 0,
        seconds=time.perf_counter() - start, warnings=warnings,
        rank=0, world=dist.world if dist else 1,
    )


class _ObserverPlan:
    """Observers for every target, and which tap feeds which observer.

    Targets that read the same activation with the same activation args (q/k/v) share one
    input observer, so each tap is reduced once per batch.
    """

    def __init__(self, targets: list[Target], schemes: dict, kv_states: list[KVState] = (), kv_args=None):
        self.weight_observers = {}
        self.kv_args = kv_args
        self.kv_observers: dict[tuple[KVState, str], object] = {}  # (attention, "k" | "v") -> observer
        self.input_observers: dict[str, object] = {}  # target name -> observer (possibly shared)
        # tensor -> [(kind, observer, reduction mode or None)]; kinds: observe, attention, importance
        self.taps: dict[str, list[tuple[str, object, tuple | None]]] = {}
        self.reduction_outputs: dict[tuple, tuple[str, ...]] = {}
        self._input_qparams: dict[int, QParams] = {}
        shared: dict[tuple, object] = {}
        self.uses_tensor_group = False
        for t in targets:
            scheme = schemes[t.name]
            wargs = scheme.weights.model_copy(deep=True)
            self.uses_tensor_group |= wargs.strategy == "tensor_group"
            wobs = _make_observer(observer_name(wargs, "weight"), "weight", wargs)
            self.weight_observers[t.name] = wobs
            if getattr(wobs, "needs_activations", False):
                self.taps.setdefault(t.activation, []).append(("importance", wobs, None))
            iargs = scheme.input_activations
            name = observer_name(iargs, "input")
            if name is None:
                continue
            key = (t.activation, name, iargs.model_dump_json())
            if key not in shared:
                shared[key] = _make_observer(name, "input", iargs.model_copy(deep=True))
                self.taps.setdefault(t.activation, []).append(("observe", shared[key], _input_mode(iargs, t)))
            self.input_observers[t.name] = shared[key]
        for state in kv_states:  # attention states, observed as (batch, kv_heads, seq, head_dim)
            for base, tensor in (("k", state.key), ("v", state.value)):
                obs = _make_observer(observer_name(kv_args, base), base, kv_args.model_copy(deep=True))
                self.kv_observers[state, base] = obs
                mode = ("head",) if enum_value(kv_args.strategy) == "attn_head" else ("all",)
                self.taps.setdefault(tensor, []).append(("attention", obs, mode))

    def fuse(self, groups) -> None:
        from graphcal.observers import fuse_observers

        for group in groups:
            members = [self.weight_observers[n] for n in group.members]
            if all(m.args.strategy == "tensor_group" for m in members):
                fuse_observers(members)

    def qparams(self, t: Target, scheme) -> QuantizedTarget:
        """The target's weight qparams (its weight observed) and its input's (shared ones computed once)."""
        qp = {"weight": _to_qparams(self.weight_observers[t.name].get_qparams())}
        obs = self.input_observers.get(t.name)
        if obs is not None:
            if id(obs) not in self._input_qparams:
                if not obs.has_statistics:
                    raise GraphcalError(f"{t.name}: no activation reached its input observer")
                self._input_qparams[id(obs)] = _to_qparams(obs.get_qparams())
            qp["input"] = self._input_qparams[id(obs)]
        return QuantizedTarget(t, scheme, qp)

    def fetches(self, in_graph: bool) -> tuple[list[str], list[tuple[str, tuple]]]:
        """(tensors to fetch whole, (tensor, mode) extrema to reduce in the graph)."""
        full, reduced = [], []
        for tensor, consumers in self.taps.items():
            for _kind, obs, mode in consumers:
                if in_graph and mode is not None and obs.takes_extrema:
                    reduced.append((tensor, mode))
                elif tensor not in full:
                    full.append(tensor)
        return full, reduced

    def activation_observers(self) -> list:
        """Every observer a tap feeds, once each, in the same order on every rank."""
        seen, out = set(), []
        for consumers in self.taps.values():
            for _kind, obs, _mode in consumers:
                if id(obs) not in seen:
                    seen.add(id(obs))
                    out.append(obs)
        return out

    def kv_qparams(self) -> list[QuantizedKV]:
        out: dict[KVState, QuantizedKV] = {}
        for (state, base), obs in self.kv_observers.items():
            if not obs.has_statistics:
                raise GraphcalError(f"{state.name}: no {base} states reached the kv-cache observer")
            out.setdefault(state, QuantizedKV(state, self.kv_args)).qparams[base] = _to_qparams(obs.get_qparams())
        return list(out.values())


def _make_observer(name: str, base_name: str, args):
    """An observer from the registry; unknown names and bad kwargs become one-line usage errors."""
    from compressed_tensors.registry import registered_names

    from graphcal.observers import Observer

    try:
        return Observer.load_from_registry(name, base_name=base_name, args=args)
    except KeyError:
        known = ", ".join(n.replace("-", "_") for n in registered_names(Observer))
        raise UsageError(f"unknown observer {name!r}; choose one of: {known}") from None
    except (ValueError, TypeError) as e:
        raise UsageError(f"{e} (for the {base_name} observer)") from e


def _run_activations(runtime, calib, plan: _ObserverPlan, progress: bool, dist=None) -> int:
    """Run every batch (under torchrun: every world-th, from this rank) and feed the observers."""
    from tqdm import tqdm

    count = 0
    known = calib.num_batches if calib.num_batches else None  # a reader's count is known only afterwards
    total = known if dist is None or known is None else len(range(dist.rank, known, dist.world))
    # disable=None: a bar only on a terminal, so logs and pipes stay clean
    bar = tqdm(total=total, desc="calibrating", unit="batch", disable=None if progress else True, leave=False)
    with torch.no_grad(), bar:
        for index, batch in enumerate(calib.batches()):
            if dist is not None and index % dist.world != dist.rank:
                continue
            values = runtime.run(batch)
            for tensor, consumers in plan.taps.items():
                x = values.get(tensor)
                probe = plan.reduction_outputs.get((tensor, "finite"))
                finite = (_all_finite(x) if x is not None and x.is_floating_point()
                          else probe is None or torch.isfinite(values[probe[0]]).all())
                if not finite:
                    raise GraphcalError(
                        f"tap {tensor!r} holds NaN or Inf in batch {index} (observer "
                        f"{consumers[0][1].observer_name}); the model or the data produce non-finite activations"
                    )
                for kind, obs, mode in consumers:
                    try:
                        extrema = plan.reduction_outputs.get((tensor, mode)) if mode is not None else None
                        if extrema is not None and obs.takes_extrema:
                            lo, hi = (values[name] for name in extrema)
                            shape = _QPARAM_SHAPE[mode[0]](lo)
                            obs.observe_extrema(lo.reshape(shape), hi.reshape(shape))
                        elif kind == "importance":
                            obs.accumulate_importance(x)
                        elif kind == "attention":
                            obs(x)
                        else:
                            obs(_as_bsh(x))
                    except ValueError as e:  # e.g. a group size that does not divide the hidden size
                        raise GraphcalError(f"tap {tensor!r} {tuple(x.shape)}: {e}") from e
            count += 1
            bar.update(1)
    return count


def _nonfinite_count(w: torch.Tensor) -> int:
    """How many NaN/Inf values ``w`` holds (0 for integer weights); one cheap check first."""
    if not w.is_floating_point() or w.numel() == 0 or _all_finite(w):
        return 0
    return int((~torch.isfinite(w)).sum())


def _all_finite(x: torch.Tensor) -> bool:
    """No NaN or Inf in ``x``: its min and max (which carry NaN along) are finite. One read of
    ``x`` and no mask of its size (``isfinite(x).all()`` cost 30x more on a big tap)."""
    if x.numel() == 0:
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(x))).all())


def _weight_units(targets: list[Target], groups) -> list[list[Target]]:
    """Targets in order, fused groups (all members chosen) kept together so they share a global scale."""
    index = {t.name: t for t in targets}
    unit_of: dict[str, list[Target]] = {}
    for g in groups:
        if all(m in index for m in g.members):
            unit = [index[m] for m in g.members]
            for m in g.members:
                unit_of[m] = unit
    units, seen = [], set()
    for t in targets:
        unit = unit_of.get(t.name, [t])
        if id(unit) not in seen:
            seen.add(id(unit))
            units.append(unit)
    return units


# reduced extrema -> the observers' qparam shapes (flatten_for_calibration's reduce over dims 0, -1)
_QPARAM_SHAPE = {"all": lambda v: (1,), "group": lambda v: (v.numel(),), "head": lambda v: (v.numel(), 1, 1)}


def _input_mode(args, t: Target) -> tuple | None:
    """How an input observer's batch extrema can be reduced in the graph (None: whole tensor)."""
    strategy = enum_value(args.strategy)
    if strategy == "tensor":
        return ("all",)
    if strategy in ("group", "tensor_group") and args.group_size and t.in_features % args.group_size == 0:
        return ("group", t.in_features // args.group_size, args.group_size)
    return None


def _as_bsh(x: torch.Tensor) -> torch.Tensor:
    """Activations as (batch, seq, hidden), the layout llm-compressor's observers see."""
    if x.ndim == 2:
        return x.unsqueeze(0)
    if x.ndim > 3:
        return x.reshape(-1, x.shape[-2], x.shape[-1])
    return x


def _to_qparams(d: dict) -> QParams:
    """An observer's qparams, on the host (the writer and the metadata work there)."""
    def host(v):
        return None if v is None else v.cpu()

    return QParams(scale=host(d["scale"]), zero_point=host(d["zero_point"]), global_scale=host(d.get("global_scale")))
