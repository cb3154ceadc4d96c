"""calibrate(): the one function that wires the stages together; data flows one way.

    options/recipe --config.resolve--> RunConfig
    model + config --plan.plan--> RunPlan                      (what run and inspect both see)
    (with AWQ: awq_stage.awq_smoothing, its scales searched layer block by layer block first)
    RunPlan --observe.ObserverSet--> observers and the taps they need (smoothed activations under SmoothQuant
                                     or AWQ; GPTQ's Hessians in its one-pass order)
    data --activations.run_activation_pass--> activation statistics (one pass; ranks gathered)
         (with --smoothquant: smoothing.smooth_and_calibrate, SmoothQuant's scales in the same pass,
          or in one pass before it when an observer of a smoothed activation needs more than extrema)
    (GPTQ in its sequential order: gptq_stage.sequential_gptq, two runs of each layer block)
    scales --smoothing.Smoothed.fold--> norms, biases, explicit Muls of the smoothing in the model
    weights --weights.quantize_weights--> qparams, weights quantized (or GPTQ's, on the same grid) into the
                                          QDQ writer
    writer.finish + metadata --output.OutputSlot.write--> model.onnx, quantization_config.json,
                                                         qparams.safetensors (all or none)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from graphcal.algorithms.smoothquant.stage import smooth_and_calibrate, taps_of
from graphcal.calibration.activations import run_activation_pass
from graphcal.calibration.distributed import from_env
from graphcal.calibration.observe import ObserverSet
from graphcal.calibration.plan import RunPlan, plan
from graphcal.calibration.weights import quantize_weights
from graphcal.config import Options, RunConfig, resolve
from graphcal.data import check_padding_input, data_label, graph_inputs, load_data
from graphcal.graph.io import save_model
from graphcal.graph.qdq import QDQWriter
from graphcal.output import MODEL_FILE, releases_outputs, reserve_output
from graphcal.output.metadata import CONFIG_FILE, QPARAMS_FILE, build_quantization_config, config_json, qparam_tensors
from graphcal.runtime import check_device, observer_device
from graphcal.types import QuantizedKV, QuantizedTarget

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
    forms: list[str] = field(default_factory=list)  # what onnxruntime runs (plan.RunPlan.forms)
    rank: int = 0  # under torchrun: this process's rank (only rank 0 writes)
    world: int = 1
    padding_share: float | None = None  # positions with attention_mask == 0 (None: no attention_mask)
    exclude_padding: bool = False  # padded positions were left out of the activation statistics
    smoothed: list[str] = field(default_factory=list)  # SmoothQuant's mappings as applied (graph.smooth.Mapping.describe)
    awq: list[str] = field(default_factory=list)  # AWQ's mappings as scaled (likewise)
    gptq: dict | None = None  # GPTQ: its order, the layers it rounded and their losses (None: round to nearest)

    @property
    def qparams(self) -> dict[str, torch.Tensor]:
        return qparam_tensors(self.targets)


@releases_outputs  # the -o reservation below is released however calibrate ends
def calibrate(
    model: str | Path,
    data,  # .npz path, folder of .npz, mapping of arrays, or an onnxruntime CalibrationDataReader
    output_dir: str | Path,
    *,
    scheme: str | None = None,
    config: RunConfig | None = None,
    targets: tuple[str, ...] | list[str] | None = None,
    ignore: tuple[str, ...] | list[str] | None = None,
    observer: str | None = None,
    kv_cache: str | None = None,
    recipe: str | Path | None = None,
    device: str = "auto",
    target: str = "onnxruntime",
    matmulnbits: int | None = None,
    batch_size: int | None = None,
    num_samples: int | None = None,
    progress: bool = False,
    reduce_in_graph: bool = True,
    skip_nonfinite_weights: bool = False,
    exclude_padding: bool = False,
    smoothquant: str | None = None,
    smoothing_strength: float | None = None,
    algorithm: str | None = None,
    group_size: int | None = None,
    gptq_order: str | None = None,
    tap_limit_mb: float | None = None,
) -> CalibrationResult:
    """Calibrate ``model`` on ``data`` and write the QDQ model and metadata to ``output_dir``.

    The settings are resolved as `graphcal run` resolves its flags (:func:`graphcal.config.resolve`):
    ``scheme`` (a compressed-tensors preset, ``W8A8_STATIC``, or JSON scheme fields; default
    W8A8), ``targets``, ``ignore``, ``observer`` and ``kv_cache`` (FP8, INT8 or JSON
    QuantizationArgs for the key/value states entering attention) override ``recipe`` (an
    llm-compressor recipe file) where both are given. ``config`` (a resolved RunConfig) replaces
    them all. ``target`` is the runtime the QDQ model is written for: "onnxruntime" (the forms
    its optimizer turns into fast kernels, loading at ORT_ENABLE_ALL), "tensorrt" (only what
    TensorRT builds; other schemes fail before calibrating) or "qdq" (standard Q/DQ written
    literally). ``matmulnbits`` (onnxruntime only): write integer weights as
    com.microsoft.MatMulNBits with this accuracy level (0: float input, 4: int8 input).
    With ``reduce_in_graph`` (the default), min/max observers get their batch extrema from
    ReduceMin/ReduceMax in the tapped graph. A weight holding NaN or Inf is an error naming it;
    with ``skip_nonfinite_weights`` its layer is left in float (listed as ignored) with a warning.
    With ``exclude_padding``, positions where the data's ``attention_mask`` is 0 are left out of
    the activation statistics (activations shaped [batch, seq, ...]; others are observed whole,
    with a warning); data without an attention_mask input is a usage error. ``smoothquant``
    ("norms", "all" or "mul") smooths the activations first, as llm-compressor's SmoothQuantModifier
    does, with ``smoothing_strength`` (default 0.5); a recipe's SmoothQuantModifier does the same.
    ``algorithm`` ("gptq", "awq" or "awq+gptq"; or a recipe's GPTQModifier / AWQModifier) rounds
    the weights with llm-compressor's algorithms instead of to nearest, GPTQ in ``gptq_order``
    ("sequential", the default, or "one-pass"); ``group_size`` sets the scheme's weight group size
    (their other knobs: ``config=resolve(Options(...))``). ``tap_limit_mb`` (default 1024) bounds
    the activations tapped whole that a batch holds: past it the data runs once per share of them
    (graphcal.calibration.activations.tap_shares).
    """
    start = time.perf_counter()
    model_path, out_dir = Path(model), Path(output_dir)
    data_paths = [] if isinstance(data, Mapping) or hasattr(data, "get_next") else [Path(data)]
    slot = reserve_output(out_dir, [model_path, *data_paths])  # checks -o, locks it (rank 0), clears leftovers
    config = config or resolve(Options(scheme=scheme, targets=_tuple(targets), ignore=_tuple(ignore),
                                       observer=observer, kv_cache=kv_cache, recipe=recipe,
                                       smoothquant=smoothquant, smoothing_strength=smoothing_strength,
                                       algorithm=algorithm, group_size=group_size, gptq_order=gptq_order))
    check_device(device)  # --device cuda without a usable GPU fails here, whatever the scheme
    run = plan(model_path, config, target, matmulnbits)
    inputs = graph_inputs(run.model)
    calib = load_data(data, inputs, batch_size=batch_size, num_samples=num_samples)
    input_names = tuple(i.name for i in inputs)
    if exclude_padding:
        check_padding_input(data_label(data), input_names)
    dist = from_env()  # torchrun: this rank's share of the batches, statistics gathered after the pass
    device_id = dist.local_rank if dist else 0  # under torchrun each rank has its own GPU
    main = dist is None or dist.is_main
    smoothed = None
    pass_options = dict(device=device, device_id=device_id, dist=dist, progress=progress and main,
                        reduce_in_graph=reduce_in_graph, exclude_padding=exclude_padding, inputs=input_names,
                        tap_limit_mb=tap_limit_mb)
    gptq = run.config.gptq
    if hasattr(data, "get_next") and ((gptq is not None and gptq.order == "sequential") or run.awq is not None):
        from graphcal.errors import UsageError

        raise UsageError("GPTQ's sequential order and AWQ read the data once per layer block, and a "
                         "CalibrationDataReader can be read once: pass the arrays (an .npz, a folder or a mapping), "
                         "or use --gptq-order one-pass without AWQ")
    if gptq is not None and gptq.order == "one-pass":
        from graphcal.algorithms.gptq.stage import check_one_pass

        check_one_pass(run, dist.world if dist else 1)  # every Hessian is held until the weight pass
    if run.awq is not None and run.awq.mappings:  # AWQ's scales first, then the pass over x * (1/s)
        from graphcal.algorithms.awq.stage import awq_smoothing

        # under torchrun every rank searches over all the data (the search is deterministic, so every
        # rank gets rank 0's scales, and no rank waits on another's search past the exchange's timeout)
        smoothed = awq_smoothing(run, calib, device=device, device_id=device_id, progress=progress and main)
        observers = ObserverSet(run, taps_of(smoothed.mappings))
        activations = run_activation_pass(run, observers, calib, prelude=smoothed.prelude(run.types), **pass_options)
    elif run.smoothing is not None and run.smoothing.mappings:
        observers = ObserverSet(run, taps_of(run.smoothing.mappings))
        smoothed, activations = smooth_and_calibrate(run, observers, calib, **pass_options)
    else:
        observers = ObserverSet(run)
        activations = run_activation_pass(run, observers, calib, **pass_options)
    warnings = list(run.warnings) + activations.warnings()
    padding = activations.padding
    if padding is not None and padding.unmasked:
        warnings.append("--exclude-padding: observed with their padding (not shaped [batch, seq, ...] like the "
                        "attention_mask): " + ", ".join(f"{t} {list(s)}" for t, s in padding.unmasked.items()))
    share = padding.share if padding is not None else None
    if not main:
        return CalibrationResult(
            output_dir=out_dir, files=[], targets=[], ignored=run.ignored, provider=activations.provider,
            num_samples=0, num_batches=activations.batches, seconds=time.perf_counter() - start,
            warnings=warnings, rank=dist.rank, world=dist.world, padding_share=share,
            exclude_padding=exclude_padding,
        )
    # The writer takes the loaded model over and edits it in place (a big model is never copied);
    # nothing reads the plan's model after this. The smoothing is folded in first (small edits).
    rounding = None
    torch_device = observer_device(activations.provider, device, device_id)
    if gptq is not None and gptq.order == "one-pass":
        from graphcal.algorithms.gptq.stage import OnePass

        rounding = OnePass(observers.hessians, gptq)
    elif gptq is not None:  # layer block by layer block, on the model as loaded (before the folds below)
        from graphcal.algorithms.gptq.stage import sequential_gptq

        if dist is not None:
            log.info("GPTQ's sequential order runs on rank 0 over all the data")
        rounding = sequential_gptq(run, observers, calib, device=device, device_id=device_id, progress=progress,
                                   smoothed=smoothed, torch_device=torch_device)
    types = dict(run.types)
    if smoothed is not None:
        smoothed.fold(run, {t.name for t in run.chosen}, types)
    writer = QDQWriter(run.model, run.opset, run.runtime, types, matmulnbits=run.matmulnbits)
    weights = quantize_weights(run, observers, writer, torch_device,
                               skip_nonfinite=skip_nonfinite_weights, progress=progress, smoothed=smoothed,
                               rounding=rounding)
    warnings += weights.warnings + (rounding.log.warnings() if rounding is not None else [])
    ignored = run.ignored + weights.left_in_float
    kv_items = observers.kv_qparams()
    for item in weights.items:
        writer.quantize_input(item)
    for kv in kv_items:
        writer.quantize_kv(kv)
    files = slot.write(_outputs(run, writer.finish(), weights.items, ignored, kv_items))  # all or none; unlocks
    warnings += slot.warnings
    log.info("wrote %s", ", ".join(str(f) for f in files))
    ran = activations.provider is not None or rounding is not None or (smoothed is not None and smoothed.method == "awq")
    return CalibrationResult(
        output_dir=out_dir, files=files, targets=weights.items, ignored=ignored, provider=activations.provider,
        num_samples=calib.num_samples if ran else 0, num_batches=calib.num_batches if ran else 0,
        seconds=time.perf_counter() - start, warnings=warnings, forms=list(run.forms), rank=0,
        world=dist.world if dist else 1, padding_share=share, exclude_padding=exclude_padding,
        smoothed=[m.describe() for m in smoothed.mappings] if smoothed is not None and smoothed.method != "awq" else [],
        awq=[m.describe() for m in smoothed.mappings] if smoothed is not None and smoothed.method == "awq" else [],
        gptq=None if rounding is None else {"order": gptq.order, "layers": len(rounding.log.losses),
                                            "rtn_fallback": list(rounding.log.rtn_fallback)},
    )


def _outputs(run: RunPlan, qdq_model, items: list[QuantizedTarget], ignored: list[str], kv_items: list[QuantizedKV]):
    """The function that writes a run's three files into a (temporary) folder."""
    qc_data = build_quantization_config(run.config, items, ignored, kv_items)[1]
    tensors = qparam_tensors(items, kv_items)

    def write(tmp: Path) -> list[Path]:
        from safetensors.torch import save_file

        files = save_model(qdq_model, tmp / MODEL_FILE, external=bool(run.data_files), base_dir=run.base_dir)
        (tmp / CONFIG_FILE).write_text(config_json(qc_data))
        save_file(tensors, str(tmp / QPARAMS_FILE), metadata={"format": "pt"})  # one key: safetensors writes metadata in hash order
        return files + [tmp / CONFIG_FILE, tmp / QPARAMS_FILE]

    return write


def _tuple(values) -> tuple[str, ...] | None:
    return None if values is None else tuple(values)
