"""graphcal bench's measurement: both models opened as a deployment would, timed, sized, their kernels and memory read.

The shapes timed are the data's first batch (prefill) and, for models whose inputs have a free
axis 1, one token of one sample (decode-like).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort

from graphcal.bench.kernels import kernels
from graphcal.bench.memory import measure_memory, probe_model
from graphcal.bench.report import MODELS, BenchReport, ModelFacts, Shape, Timing
from graphcal.bench.session import CPU, CUDA, open_session, options, runner
from graphcal.bench.timing import RunFailed, time_interleaved
from graphcal.data import InputSpec, graph_inputs, load_data
from graphcal.errors import GraphcalError, UsageError
from graphcal.graph.io import load_model_info, model_files
from graphcal.graph.targets import find_targets
from graphcal.output.process import on_abort
from graphcal.runtime import INT8_SATURATION_NOTE, check_device, cuda_usable, int8_gemm_saturates

log = logging.getLogger("graphcal")


def bench(reference: str | os.PathLike, quantized: str | os.PathLike, data, *, batch_size: int | None = None,
          device: str = "auto", warmup: int = 3, rounds: int = 20, decode: bool = True,
          memory: bool = True) -> BenchReport:
    """Time ``quantized`` against ``reference`` on ``data``'s first batch (and one token), and
    report sizes, peak memory and the kernel behind every weight MatMul/Gemm. See graphcal.bench's doc."""
    if rounds < 1 or warmup < 0:
        raise UsageError(f"rounds must be at least 1 and warmup at least 0 (got {rounds} and {warmup})")
    check_device(device)
    providers = [CUDA, CPU] if device == "cuda" or (device == "auto" and cuda_usable()) else [CPU]
    if providers[0] == CUDA and hasattr(ort, "preload_dlls"):
        try:
            ort.preload_dlls()  # CUDA/cuDNN from the nvidia-* pip packages, as graphcal's runtime does
        except Exception:  # noqa: BLE001 -- the session below says whether CUDA works
            pass

    paths = {"reference": Path(reference), "quantized": Path(quantized)}
    log.info("loading %s and %s", paths["reference"], paths["quantized"])
    ref_model, ref_files = load_model_info(paths["reference"], lazy=True)
    quant_model, quant_files = load_model_info(paths["quantized"], lazy=True)
    facts = {"reference": ModelFacts(str(paths["reference"]), model_files(paths["reference"], ref_files)),
             "quantized": ModelFacts(str(paths["quantized"]), model_files(paths["quantized"], quant_files))}
    inputs = graph_inputs(ref_model)
    _same_inputs(inputs, graph_inputs(quant_model), paths)
    targets = find_targets(ref_model)[0]
    ref_outputs = {n.name: n.output[0] for n in ref_model.graph.node}
    del ref_model, quant_model

    calib = load_data(data, inputs, batch_size=batch_size, model_dir=Path(reference).parent)
    prefill_feeds = next(iter(calib.batches()), None)
    if prefill_feeds is None:  # a fixed batch larger than the data
        raise GraphcalError(f"{data}: {calib.num_samples} samples, fewer than the model's fixed batch of {calib.batch_size}")
    shapes = [_shape("prefill", prefill_feeds)]
    feeds = {"prefill": prefill_feeds}
    if not decode:
        shapes.append(_skipped_shape("decode", "--no-decode"))
    else:
        reason = _no_decode_reason(inputs)
        if reason is None:
            feeds["decode"] = {k: np.ascontiguousarray(v[:1, :1]) for k, v in prefill_feeds.items()}
            shapes.append(_shape("decode", feeds["decode"]))
        else:
            shapes.append(_skipped_shape("decode", reason))

    with tempfile.TemporaryDirectory(prefix="graphcal-bench-") as tmp, on_abort(
            lambda: shutil.rmtree(tmp, ignore_errors=True)):  # removed too when a signal stops bench mid-call
        tmp = Path(tmp)
        runners: dict = {}
        sessions = {label: open_session(paths[label], options(), providers) for label in MODELS}
        fell_back = [label for label in MODELS if sessions[label].get_providers()[0] != providers[0]]
        if fell_back:  # onnxruntime-gpu falls back to CPU silently when CUDA cannot start
            if device == "cuda":
                raise GraphcalError(f"--device cuda: onnxruntime could not start its CUDA provider for "
                                    f"{paths[fell_back[0]]}; run with --device cpu or fix the CUDA install")
            providers = [CPU]  # auto: both models on the CPU rather than one on each device
            sessions = {label: open_session(paths[label], options(), providers) for label in MODELS}
        active = providers[0]
        for shape in shapes:
            if shape.skipped is not None:
                continue
            log.info("timing the %s shape %s", shape.name, shape.inputs)
            runners = {label: runner(sessions[label], feeds[shape.name], active) for label in MODELS}
            try:
                samples, calls = time_interleaved([runners[label] for label in MODELS], warmup, rounds)
            except RunFailed as e:
                if shape.name == "prefill":
                    raise GraphcalError(f"{paths[MODELS[e.index]]}: onnxruntime failed on the prefill batch: "
                                        f"{e.detail}") from None
                shape.skipped = f"onnxruntime failed on the one-token batch ({MODELS[e.index]}: {e.detail})"
                continue
            tokens = shape.batch * shape.seq if shape.seq is not None else None
            shape.reference = Timing(samples[0], calls[0], shape.batch, tokens)
            shape.quantized = Timing(samples[1], calls[1], shape.batch, tokens)
        del sessions, runners

        for label in MODELS:
            log.info("reading the kernels onnxruntime runs for %s", paths[label])
            facts[label].layers = kernels(paths[label], targets, ref_outputs, providers, prefill_feeds, tmp, label)

        memory_skipped = None
        if memory:
            batch_file = tmp / "batch.npz"
            np.savez(batch_file, **prefill_feeds)
            probe = probe_model(tmp) if providers[0] == CUDA else None
            for label in MODELS:
                log.info("measuring the peak memory of %s in a fresh process", paths[label])
                facts[label].memory = measure_memory(paths[label], batch_file, providers, probe)
        else:
            memory_skipped = "--no-memory"

    notes = list(calib.notes)  # the inputs filled for the data (a KV-cache model's past tensors, ...)
    if active != CUDA and any(layer.kind == "integer" and "MatMulNBits" not in layer.kernel
                               for layer in facts["quantized"].layers):
        notes += [INT8_SATURATION_NOTE] if int8_gemm_saturates() else []
    return BenchReport(
        onnxruntime=ort.__version__, device="cuda" if active == CUDA else "cpu", provider=active,
        cpu_count=os.cpu_count(), usable_cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        warmup=warmup, rounds=rounds, reference=facts["reference"], quantized=facts["quantized"], shapes=shapes,
        memory_skipped=memory_skipped, notes=notes,
    )


def _same_inputs(ref: list[InputSpec], quant: list[InputSpec], paths: dict[str, Path]) -> None:
    want = {s.name: (s.dtype, len(s.shape)) for s in ref}
    have = {s.name: (s.dtype, len(s.shape)) for s in quant}
    if want != have:
        def fmt(specs):
            return ", ".join(f"{n} ({d}, rank {r})" for n, (d, r) in sorted(specs.items()))

        raise GraphcalError(f"{paths['quantized']} takes other inputs than {paths['reference']} "
                            f"({fmt(have)} against {fmt(want)}); bench a model against its own quantized form")


def _shape(name: str, feeds: dict[str, np.ndarray]) -> Shape:
    batch, seq = _batch_and_seq(feeds)
    return Shape(name, {k: list(v.shape) for k, v in feeds.items()}, batch, seq)


def _skipped_shape(name: str, reason: str) -> Shape:
    return Shape(name, {}, 0, None, skipped=reason)


def _batch_and_seq(feeds: dict[str, np.ndarray]) -> tuple[int, int | None]:
    batch = next((v.shape[0] for v in feeds.values() if v.ndim >= 1), 1)
    seq = next((v.shape[1] for v in feeds.values() if v.ndim >= 2), None)
    return int(batch), (int(seq) if seq is not None else None)


def _no_decode_reason(inputs: list[InputSpec]) -> str | None:
    """Why the one-token shape cannot be fed (None when it can): every input needs rank >= 2, a
    free axis 1 (symbolic or unknown) and a batch axis that is free or 1."""
    for spec in inputs:
        if len(spec.shape) < 2:
            return f"input {spec.name!r} has rank {len(spec.shape)}; a one-token shape needs a sequence axis 1"
        if isinstance(spec.shape[1], int) and spec.shape[1] > 0:
            return f"input {spec.name!r} fixes axis 1 at {spec.shape[1]} (no one-token shape)"
        if isinstance(spec.shape[0], int) and spec.shape[0] > 1:
            return f"input {spec.name!r} fixes the batch at {spec.shape[0]} (no batch of 1)"
    return None
