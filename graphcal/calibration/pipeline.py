"""calibrate(): the stages of a run, in order; data flows one way.

    options/recipe --config.resolve--> RunConfig
    -o --output.reserve_output--> the folder checked and locked
    model --plan.load-->        the model read; the transforms that change weights (--rotate) rewrite it
                                first, each returning the model and its record
    model + config + data --prepare--> Prepared: the RunPlan (decisions only: each transform unit's by
                                its settings type), the working model beside it (Loaded: the pipeline owns
                                it and passes it to each stage below; all but the weight pass only read it),
                                the data, every pre-flight refusal (each unit's check: what `inspect` checks too)
    unit.verify                 --rotate: the rotated float model against the model as given, on the first sample
    PreTransform                the first unit's for_plan (SmoothQuant's or AWQ's channel scales; Plain: none)
        .before_pass            AWQ: its scales searched layer block by layer block
        ObserverSet             every observer, and the taps it needs (scaled activations: x * (1/s))
        .activation_pass        the one pass over the data feeding the observers (SmoothQuant takes its
                                ranges in it; torchrun ranks gathered)
        .scales()               ChannelScales, or None
    unit.rounding               GPTQ: one-pass (the pass's Hessians), or sequential: the weight pass block by block
    the weight pass             the working model edited in place into the output: scales folded, each
                                weight read once, observed (one grid), rounded, quantized into the QDQ
                                writer; then input and k/v Q/DQ
    output.OutputSlot.write     model.onnx, quantization_config.json, qparams.safetensors (all or none)
    unit.record                 each unit's frozen result record (CalibrationResult.transforms)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from graphcal.calibration.activations import PassResult
from graphcal.calibration.decisions import Loaded, RunPlan
from graphcal.calibration.footprint import check_memory
from graphcal.calibration.observe import ObserverSet
from graphcal.calibration.passes import run_activation_pass
from graphcal.calibration.prepare import Prepared, prepare
from graphcal.calibration.result import CalibrationResult, scheme_label
from graphcal.calibration.seams import PassSettings, Rounding
from graphcal.calibration.sizing import float_weight_bytes
from graphcal.calibration.transforms import configured
from graphcal.calibration.transforms.channel_scales import ChannelScales
from graphcal.calibration.weights import WeightResult, quantize_weights
from graphcal.config import Options, RunConfig, resolve
from graphcal.config.options import with_keywords
from graphcal.data import Calibration, data_paths
from graphcal.devices import observer_device, wants_cuda
from graphcal.graph import identity
from graphcal.graph.io import runs_in_onnxruntime, save_model
from graphcal.graph.names import one_budget
from graphcal.graph.qdq import QDQWriter
from graphcal.graph.spill import DataSpill, streams
from graphcal.output import MODEL_FILE, releases_outputs, reserve_output
from graphcal.output.companions import copy_companions
from graphcal.output.metadata import CONFIG_FILE, QPARAMS_FILE, build_quantization_config, config_json, qparam_tensors
from graphcal.runtime import check_loads
from graphcal.types import QuantizedKV, QuantizedTarget

log = logging.getLogger("graphcal")


class Plain:
    """No pre-transform: the activation pass on the model as it is."""

    reads_blocks = False

    def __init__(self, run: RunPlan, loaded: Loaded):
        self.run, self.loaded = run, loaded

    def before_pass(self, calib: Calibration, settings: PassSettings) -> None:
        pass

    def taps(self) -> dict[str, str]:
        return {}

    def activation_pass(self, observers: ObserverSet, calib: Calibration, settings: PassSettings) -> PassResult:
        return run_activation_pass(self.run, self.loaded, observers, calib, **settings.kwargs())

    def scales(self) -> None:
        return None


@releases_outputs  # the -o reservation below is released however calibrate ends
@one_budget()  # every module-name pattern of the run on one matching budget (graph.names)
def calibrate(model: str | Path, data, output_dir: str | Path, options: Options | None = None, *,
              config: RunConfig | None = None, **keywords) -> CalibrationResult:
    """Calibrate ``model`` on ``data`` (an .npz, a folder of them, a mapping of arrays, or an
    onnxruntime CalibrationDataReader) and write the QDQ model and its metadata to ``output_dir``.

    ``options`` (graphcal.Options) holds every `graphcal run` flag, which the CLI builds from its
    flags; ``keywords`` are its fields by name, over it (``calibrate(model, data, out,
    scheme="W8A8_STATIC")``). The config fields are resolved as run resolves them
    (graphcal.config.resolve: a flag given beats the ``recipe``); ``config`` (a resolved RunConfig)
    replaces them all. docs/usage.md describes every setting; ``graphcal run --help`` too.
    """
    start = time.perf_counter()
    options = with_keywords(options, keywords)
    label = scheme_label(options.scheme, options.recipe, config.scheme_name if config is not None else None)
    config = config or resolve(options)  # before -o: a flag refused before anything is checked or read
    slot = reserve_output(Path(output_dir), [Path(model), *data_paths(data)])  # checks -o, locks it (rank 0)
    ready = prepare(model, config, target=options.target, matmulnbits=options.matmulnbits, data=data,
                    batch_size=options.batch_size, num_samples=options.num_samples, exclude_padding=options.exclude_padding,
                    device=options.device, join=True, reduce_in_graph=options.reduce_in_graph, pass_mode=options.pass_mode,
                    own_folder=slot.early_folder if slot.main else None)  # --rotate's weights beside the output's
    try:
        return _calibrate(ready, options, slot, label, start, model, output_dir)
    finally:
        ready.loaded.close()  # the rotated weights' file (removed before the write's swap already)


def _calibrate(ready: Prepared, options: Options, slot, label: str, start: float, model, output_dir) -> CalibrationResult:
    device, progress, exclude_padding = options.device, options.progress, options.exclude_padding
    run, loaded, calib = ready.plan, ready.loaded, ready.calib  # the plan decides; the pipeline owns the model
    _preflight(ready, options)  # before any weight is read: a run that cannot fit is refused, not killed
    settings = PassSettings(device, ready.dist.local_rank if ready.dist else 0, ready.dist, progress,
                            options.reduce_in_graph, exclude_padding, ready.inputs, options.tap_limit_mb,
                            options.skip_nonfinite_weights, options.cache_mb,
                            slot.early_folder if slot.main else None)  # the block cache's files go beside the output's
    units = [unit for unit, _ in configured(run.config)]
    for unit in units:  # before any pass: a rewrite (--rotate) that drifts from the model as given goes no further
        if unit.rewrites_weights:
            unit.verify(model, run, loaded, run.decision(unit.settings_type), calib.first_batch(), device,
                        settings.device_id)
    # the pre-transform: the first unit that has one for this plan (a run configures at most one), else Plain
    transform = next((t for unit in units if (t := unit.for_plan(run, loaded)) is not None), Plain(run, loaded))
    transform.before_pass(calib, settings)
    observers = ObserverSet(run, transform.taps())
    activations = transform.activation_pass(observers, calib, settings)
    if not settings.main:
        if isinstance(transform, Plain):  # a weight-parallel rounding (sequential GPTQ): this rank's share
            for unit in units:
                unit.follow(run, loaded, observers, calib, settings)
        return _result(ready, settings, activations, start, Path(output_dir))
    scales = transform.scales()
    torch_device = observer_device(activations.provider, device, settings.device_id)
    rounding = rounding_for(units, run, loaded, observers, calib, settings, scales)
    spill = _spill(run, slot)
    weights, kv_items, qdq_model = _weight_pass(run, loaded, observers, scales, rounding, torch_device,
                                                options.skip_nonfinite_weights, progress, spill)
    ignored = run.ignored + weights.left_in_float
    files = slot.write(_outputs(run, qdq_model, weights.items + weights.lookups, ignored, kv_items, spill,
                                loaded))  # all or none
    log.info("wrote %s", ", ".join(str(f) for f in files))
    result = _result(ready, settings, activations, start, Path(output_dir), scales, rounding, weights, files,
                     slot.warnings, transform.reads_blocks)
    result.scheme = label
    result.float_bytes = float_weight_bytes(qdq_model)
    result.model_bytes = sum(f.stat().st_size for f in files if f.name.startswith(MODEL_FILE))
    return result


def _preflight(ready: Prepared, options: Options) -> None:
    """Say which activation pass the run takes, and refuse in one line a run whose estimated peak memory
    cannot fit (on the CPU: on a GPU the weights and activations sit in GPU memory, which the estimate does
    not model yet, so a host estimate would refuse wrongly)."""
    log.info("activation pass: %s", ready.plan.pass_note)
    if not options.ignore_memory_check and not wants_cuda(options.device):
        log.info("%s", check_memory(ready, options.tap_limit_mb, options.exclude_padding, options.cache_mb).line(None))


def rounding_for(units, run: RunPlan, loaded: Loaded, observers: ObserverSet, calib: Calibration, settings: PassSettings,
                 scales: ChannelScales | None) -> Rounding | None:
    """The weight pass's rounding: the first of ``units`` that has one (GPTQ's), else None (to nearest)."""
    return next((r for unit in units if (r := unit.rounding(run, loaded, observers, calib, settings, scales)) is not None), None)


def _spill(run: RunPlan, slot) -> DataSpill | None:
    """The output's data file, written as the weight pass makes each tensor, for a large model whose output
    keeps external data (graph.spill.streams), in the output's temporary folder (removed unless swapped in)."""
    if not streams(run.data_bytes):
        return None
    log.info("writing the output's weights tensor by tensor into its external data")
    return DataSpill(slot.early_folder() / f"{MODEL_FILE}.data")


def _weight_pass(run: RunPlan, loaded: Loaded, observers: ObserverSet, scales: ChannelScales | None,
                 rounding: Rounding | None, device: torch.device, skip_nonfinite: bool, progress: bool,
                 spill: DataSpill | None = None):
    """The channel scales folded, every weight quantized into the QDQ writer, then the input and
    k/v Q/DQ: (WeightResult, the k/v qparams, the written model). The writer edits the working model
    (``loaded.model``) in place (a big model is never copied): the last stage that reads it. With
    ``spill``, each tensor the writer makes goes to the output's data file as it is made."""
    types = dict(loaded.types)  # read before the model is edited
    model = loaded.model
    if scales is not None:
        scales.fold(model, run, {t.name for t in run.chosen}, types)
    writer = QDQWriter(model, run.opset, run.target_runtime, types, matmulnbits=run.matmulnbits, spill=spill)
    try:
        weights = quantize_weights(run, observers, writer, device, skip_nonfinite=skip_nonfinite, progress=progress,
                                   smoothed=scales, rounding=rounding)
    except Exception as e:  # noqa: BLE001 -- under torchrun the ranks sharing the rounding must hear of it
        if (abort := getattr(rounding, "abort", None)) is not None:
            abort(e)
        raise
    kv_items = observers.kv_qparams()
    for item in weights.items:
        writer.quantize_input(item)
    for kv in kv_items:
        writer.quantize_kv(kv)
    return weights, kv_items, writer.finish()


def _result(ready: Prepared, settings: PassSettings, activations: PassResult, start: float, out_dir: Path,
            scales: ChannelScales | None = None, rounding: Rounding | None = None, weights: WeightResult | None = None,
            files: list[Path] = (), slot_warnings: list[str] = (), read_blocks: bool = False) -> CalibrationResult:
    """What the run did: on rank 0 (``weights`` given) what it wrote; on other ranks, their pass."""
    run, calib, dist = ready.plan, ready.calib, ready.dist
    warnings = list(run.warnings) + (list(calib.notes) if calib is not None else []) + activations.warnings()
    padding = activations.padding
    if padding is not None and padding.unmasked:
        warnings.append("--exclude-padding: observed with their padding (not shaped [batch, seq, ...] like the "
                        "attention_mask): " + ", ".join(f"{t} {list(s)}" for t, s in padding.unmasked.items()))
    common = dict(output_dir=out_dir, provider=activations.provider, seconds=time.perf_counter() - start,
                  pass_note=run.pass_note if activations.provider is not None else "",
                  pass_seconds=activations.seconds,
                  world=dist.world if dist else 1,
                  padding_share=padding.share if padding is not None else None,
                  exclude_padding=settings.exclude_padding)
    done = Done(scales, rounding)
    records = {unit.key: record for unit, _ in configured(run.config) if (record := unit.record(run, done)) is not None}
    if weights is None:
        return CalibrationResult(files=[], targets=[], ignored=run.ignored, num_samples=0,
                                 num_batches=activations.batches, warnings=warnings, rank=dist.rank,
                                 transforms=records, **common)
    warnings += weights.warnings + (rounding.log.warnings() if rounding is not None else []) + list(slot_warnings)
    ran = activations.provider is not None or rounding is not None or read_blocks
    return CalibrationResult(
        files=list(files), targets=weights.items + weights.lookups, ignored=run.ignored + weights.left_in_float,
        num_samples=calib.num_samples if ran else 0, num_batches=calib.num_batches if ran else 0,
        warnings=warnings, forms=list(run.forms), rank=0, transforms=records, **common)


def _outputs(run: RunPlan, qdq_model, items: list[QuantizedTarget], ignored: list[str], kv_items: list[QuantizedKV],
             spill: DataSpill | None = None, loaded: Loaded | None = None):
    """The function that writes a run's three files into a (temporary) folder; the run's own data file
    (``loaded``'s rotated weights, which the model's may still read from) is removed once the model is written."""
    transform = next((m for unit, _ in configured(run.config) if (d := run.decision(unit.settings_type)) is not None
                      and (m := unit.metadata(d)) is not None), None)  # compressed-tensors' transform_config
    qc_data = build_quantization_config(run.config, items, ignored, kv_items, transform)[1]
    tensors = qparam_tensors(items, kv_items)

    def write(tmp: Path) -> list[Path]:
        from safetensors.torch import save_file  # lazy: safetensors' torch half loads only when writing

        files = save_model(qdq_model, tmp / MODEL_FILE, external=bool(run.data_files), base_dir=run.base_dir,
                           unchecked=run.unchecked, spill=spill)
        if loaded is not None:
            loaded.close()  # in the folder swapped in as -o: gone before the manifest is made
        if run.unchecked and runs_in_onnxruntime(qdq_model):  # what the checker passed over, onnxruntime loads
            check_loads(tmp / MODEL_FILE)
        files += copy_companions(run.companions, tmp)  # genai_config.json, the tokenizer, ...
        (tmp / CONFIG_FILE).write_text(config_json(qc_data))
        save_file(tensors, str(tmp / QPARAMS_FILE), metadata={"format": "pt"})  # one key: safetensors writes metadata in hash order
        # onnxruntime read the weights by path meanwhile: the model's files must be those the load recorded
        identity.check_unchanged([run.model_path, *(run.model_path.parent / name for name in run.data_files)])
        return files + [tmp / CONFIG_FILE, tmp / QPARAMS_FILE]

    return write


@dataclass(frozen=True)
class Done:
    """What the passes made, from which each unit takes its result record."""

    scales: ChannelScales | None
    rounding: Rounding | None
