"""graphcal bench's measurement: both models opened as a deployment would, timed, sized, their kernels and memory read.

The shapes timed are the data's first batch (prefill) and a decode shape: for a model with a KV
cache, one new token over a real past of P tokens that each model's own prefill made
(graphcal.bench.decode), and onnxruntime-genai's generate loop where the folders are genai folders
(graphcal.bench.genai_loop); for other models whose inputs have a free axis 1, one token of one
sample without a past (decode-like).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort

from graphcal.bench.decode import first_sample, plan, step_feeds, takes_kv_cache
from graphcal.bench.genai_loop import check_allowed_library, genai_loop
from graphcal.bench.kernels import kernels
from graphcal.bench.memory import measure_memory, probe_model
from graphcal.bench.report import MODELS, BenchReport, GenaiLoop, ModelFacts, Shape, Timing
from graphcal.bench.session import CPU, CUDA, open_session, options, runner
from graphcal.bench.timing import RunFailed, time_interleaved
from graphcal.data import InputSpec, graph_inputs, load_data
from graphcal.devices import INT8_SATURATION_NOTE, check_device, int8_gemm_saturates, wants_cuda
from graphcal.errors import GraphcalError, UsageError
from graphcal.graph.io import load_model_info, model_files
from graphcal.graph.targets import find_targets
from graphcal.output.process import on_abort

log = logging.getLogger("graphcal")


def bench(reference: str | os.PathLike, quantized: str | os.PathLike, data, *, batch_size: int | None = None,
          device: str = "auto", warmup: int = 3, rounds: int = 20, decode: bool = True,
          memory: bool = True, past: int | None = None, genai_tokens: int = 32, genai_rounds: int = 3,
          allow_custom_ops: str | os.PathLike | None = None) -> BenchReport:
    """Time ``quantized`` against ``reference`` on ``data``'s first batch and a decode shape, and
    report sizes, peak memory and the kernel behind every weight MatMul/Gemm. See graphcal.bench's doc.

    For a KV-cache model, ``past`` is the decode step's past length (default: the first sample's
    length minus 1) and ``genai_tokens`` the tokens onnxruntime-genai's loop generates in each of
    ``genai_rounds`` rounds (0: the loop is not run). onnxruntime-genai loads no library a genai_config.json
    names but ``allow_custom_ops``, where the config names that file (graphcal.bench.genai_loop)."""
    if rounds < 1 or warmup < 0:
        raise UsageError(f"rounds must be at least 1 and warmup at least 0 (got {rounds} and {warmup})")
    if (past is not None and past < 1) or genai_tokens < 0 or genai_rounds < 1:
        raise UsageError(f"past must be at least 1, genai_tokens at least 0 and genai_rounds at least 1 (got {past}, "
                         f"{genai_tokens} and {genai_rounds})")
    check_device(device)
    providers = [CUDA, CPU] if wants_cuda(device) else [CPU]
    if providers[0] == CUDA and hasattr(ort, "preload_dlls"):
        try:
            ort.preload_dlls()  # CUDA/cuDNN from the nvidia-* pip packages, as graphcal's runtime does
        except Exception:  # noqa: BLE001 -- the session below says whether CUDA works
            pass

    paths = {"reference": Path(reference), "quantized": Path(quantized)}
    library = Path(allow_custom_ops) if allow_custom_ops is not None else None
    if library is not None:
        check_allowed_library(paths, library)  # before anything is loaded or timed
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
    feeds = {"prefill": dict.fromkeys(MODELS, prefill_feeds)}  # shape -> model -> its feeds
    kv_cache = takes_kv_cache(inputs)
    decode_plan, plan_error = None, None
    if kv_cache:  # one token over a real past, the past made by each model's own prefill
        try:
            decode_plan = plan(prefill_feeds, past)
        except UsageError:  # --past longer than the first sample
            raise
        except GraphcalError as e:
            plan_error = str(e)
    elif past is not None:
        raise UsageError(f"--past {past}: {paths['reference']} takes no past tensors (no KV cache); its decode shape "
                         "is one token without a past")
    if not decode:
        shapes.append(_skipped_shape("decode", "--no-decode"))
    elif kv_cache:
        shapes.append(_skipped_shape("decode", plan_error) if decode_plan is None
                      else Shape("decode", {}, 1, 1, past=decode_plan.past))
    else:
        reason = _no_decode_reason(inputs)
        if reason is None:
            feeds["decode"] = dict.fromkeys(MODELS, {k: np.ascontiguousarray(v[:1, :1]) for k, v in prefill_feeds.items()})
            shapes.append(_shape("decode", feeds["decode"]["reference"]))
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
            if shape.past is not None and shape.skipped is None:
                _decode_feeds(shape, feeds, sessions, decode_plan, inputs, Path(reference).parent)
            if shape.skipped is not None:
                continue
            log.info("timing the %s shape %s", shape.title, shape.inputs)
            runners = {label: runner(sessions[label], feeds[shape.name][label], active) for label in MODELS}
            try:
                samples, calls = time_interleaved([runners[label] for label in MODELS], warmup, rounds)
            except RunFailed as e:
                if shape.name == "prefill":
                    raise GraphcalError(f"{paths[MODELS[e.index]]}: onnxruntime failed on the prefill batch: "
                                        f"{e.detail}") from None
                what = "decode step" if shape.past is not None else "one-token batch"
                shape.skipped = f"onnxruntime failed on the {what} ({MODELS[e.index]}: {e.detail})"
                continue
            tokens = shape.batch * shape.seq if shape.seq is not None else None
            shape.reference = Timing(samples[0], calls[0], shape.batch, tokens)
            shape.quantized = Timing(samples[1], calls[1], shape.batch, tokens)
        del sessions, runners, feeds

        loop = None
        if kv_cache:
            loop = _genai_loop(paths, prefill_feeds, decode_plan, genai_tokens, genai_rounds, warmup, active, tmp,
                               library)

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
    notes += loop.notes if loop is not None else []  # what onnxruntime-genai was not handed
    if active != CUDA and any(layer.kind == "integer" and "MatMulNBits" not in layer.kernel
                               for layer in facts["quantized"].layers):
        notes += [INT8_SATURATION_NOTE] if int8_gemm_saturates() else []
    return BenchReport(
        onnxruntime=ort.__version__, device="cuda" if active == CUDA else "cpu", provider=active,
        cpu_count=os.cpu_count(), usable_cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        warmup=warmup, rounds=rounds, reference=facts["reference"], quantized=facts["quantized"], shapes=shapes,
        memory_skipped=memory_skipped, notes=notes, genai_loop=loop,
    )


def _decode_feeds(shape: Shape, feeds: dict, sessions: dict, decode_plan, inputs: list[InputSpec],
                  model_dir: Path) -> None:
    """Each model's feeds for the decode step over a real past (its own prefill run first) into
    ``feeds["decode"]``, the shape's inputs set from them; or the shape skipped, saying why. The
    reference's folder gives the past tensors' dims and names (both models take the same inputs)."""
    feeds["decode"] = {}
    for label in MODELS:
        log.info("running the %s model's prefill of %d tokens for its decode step", label, decode_plan.past)
        try:
            feeds["decode"][label] = step_feeds(sessions[label], decode_plan, inputs, model_dir)
        except GraphcalError as e:
            shape.skipped = f"{label}: {e}"
            return
    shape.inputs = {k: list(v.shape) for k, v in feeds["decode"]["reference"].items()}


def _genai_loop(paths: dict[str, Path], prefill_feeds: dict[str, np.ndarray], decode_plan, tokens: int, rounds: int,
                warmup: int, provider: str, workdir: Path, library: Path | None) -> GenaiLoop:
    """onnxruntime-genai's loop on both models, prompted with the decode step's past (the first
    sample's first P tokens; the whole sample when no step can be planned), each folder staged in ``workdir``."""
    if decode_plan is not None:
        prompt = decode_plan.tokens[:, :decode_plan.past]
    elif "input_ids" in prefill_feeds:
        prompt = first_sample(prefill_feeds)
    else:
        prompt = np.zeros((1, 0), np.int64)
    if tokens == 0:
        return GenaiLoop(int(prompt.shape[1]), 0, rounds, skipped="--genai-tokens 0")
    if "input_ids" not in prefill_feeds or prompt.shape[1] == 0:
        return GenaiLoop(int(prompt.shape[1]), tokens, rounds,
                         skipped="the data holds no input_ids (onnxruntime-genai's loop is prompted with token ids)")
    log.info("timing onnxruntime-genai's generate loop: %d prompt tokens, %d new", prompt.shape[1], tokens)
    return genai_loop(paths, prompt, tokens, rounds, warmup, provider, workdir, library)


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
