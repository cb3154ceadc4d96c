"""graphcal bench: how fast a quantized model runs in onnxruntime against its fp32 reference.

Both models run in onnxruntime at its default settings (ORT_ENABLE_ALL, default threads, no
session config keys; only the log level is raised), as a deployment would open them, on the
chosen device. Reported side by side:

- time per batch at two shapes: the data's first batch (prefill) and, for models whose inputs
  have a free axis 1, one token of one sample (decode-like). Rounds are interleaved, the order
  flipped every round, so that drift (clocks, other load) hits both models alike;
- the size of each model (its .onnx file plus the external data files it reads);
- the peak host memory of a fresh process that opens the model and runs one batch (and, on CUDA,
  the GPU memory nvidia-smi attributes to it);
- the kernel onnxruntime really runs for every weight MatMul/Gemm: read from the optimized graph
  onnxruntime writes (``optimized_model_filepath``) and, for the execution provider, from its
  profile of one run.

Models are checked by graphcal's loader first (regular file, well-formed graph, every external
data reference inside the model's folder); onnxruntime then opens the file itself.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from graphcal.data import InputSpec, graph_inputs, load_data
from graphcal.errors import GraphcalError, UsageError, first_line
from graphcal.graph.io import load_model_info, model_files
from graphcal.graph.targets import find_targets
from graphcal.limits import format_size

log = logging.getLogger("graphcal")

_CUDA, _CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
OPTIMIZATION = "ORT_ENABLE_ALL"
MIN_SAMPLE_S = 0.02  # a timed sample averages as many calls as make it last this long
MAX_CALLS = 1000  # ... but never more calls than this per sample
MODELS = ("reference", "quantized")

# Kernels that compute in integers (the activations quantized, by a node or inside the kernel).
INTEGER_KERNELS = frozenset({"MatMulIntegerToFloat", "QLinearMatMul", "DynamicQuantizeMatMul", "QGemm", "MatMulInteger"})
FLOAT_KERNELS = frozenset({"MatMul", "FusedMatMul", "Gemm", "FusedGemm"})
# Ops that may sit between a weight and the B input of a float MatMul in the optimized graph.
_WEIGHT_PATH = frozenset({"DequantizeLinear", "Cast", "Mul", "Div", "Transpose", "Reshape", "Identity", "Unsqueeze",
                          "Squeeze", "Flatten"})
_DEQUANTIZING = frozenset({"DequantizeLinear", "Cast", "Mul", "Div"})  # the weight is stored in another type
DEQUANTIZED = "float (dequantized at run time)"
FOLDED = "float (weight folded to fp32 at load)"


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------

@dataclass
class Timing:
    """Seconds per batch of one model at one shape, over the timed rounds."""

    samples: list[float]  # one per round: seconds per call, averaged over ``calls``
    calls: int  # calls per timed sample
    batch: int
    tokens: int | None  # batch * seq, None when no input has an axis 1

    def as_dict(self) -> dict:
        s = np.asarray(self.samples, dtype=np.float64)
        median = float(np.median(s))
        return {"median_s": median, "min_s": float(s.min()), "max_s": float(s.max()),
                "p10_s": float(np.percentile(s, 10)), "p90_s": float(np.percentile(s, 90)),
                "rounds": len(self.samples), "calls_per_sample": self.calls,
                "samples_per_s": self.batch / median,
                "tokens_per_s": self.tokens / median if self.tokens is not None else None}

    @property
    def median(self) -> float:
        return float(np.median(self.samples))


@dataclass
class Shape:
    """One input shape: its timings, or why it was not measured."""

    name: str  # "prefill" or "decode"
    inputs: dict[str, list[int]]
    batch: int
    seq: int | None
    reference: Timing | None = None
    quantized: Timing | None = None
    skipped: str | None = None

    @property
    def ratio(self) -> float | None:
        if self.reference is None or self.quantized is None:
            return None
        return self.quantized.median / self.reference.median

    def as_dict(self) -> dict:
        out = {"name": self.name, "inputs": self.inputs, "batch": self.batch, "seq": self.seq,
               "measured": self.skipped is None, "skipped": self.skipped, "ratio": self.ratio}
        for label in MODELS:
            timing = getattr(self, label)
            out[label] = timing.as_dict() if timing is not None else None
        return out


@dataclass
class Layer:
    """The kernel onnxruntime runs for one weight MatMul/Gemm of the source graph."""

    module: str
    node: str  # in the source graph
    kind: str  # matmulnbits | integer | dequantized | float | other | missing
    kernel: str  # the summary label, e.g. "MatMulNBits 4-bit acc4"
    op_type: str | None = None
    domain: str | None = None
    optimized_node: str | None = None  # the node in onnxruntime's optimized graph
    provider: str | None = None  # from the profile; None when the node did not show there
    attributes: dict = field(default_factory=dict)  # bits, block_size, accuracy_level of MatMulNBits
    weight_from: str | None = None  # float kernels: "initializer", or the ops the weight passes at run time

    def as_dict(self) -> dict:
        return {"module": self.module, "node": self.node, "kind": self.kind, "kernel": self.kernel,
                "op_type": self.op_type, "domain": self.domain, "optimized_node": self.optimized_node,
                "provider": self.provider, "weight_from": self.weight_from, **self.attributes}


def summarize(layers: list[Layer], provider: str) -> dict[str, int]:
    """Counts per kernel label, in first-seen order; a layer that ran on another provider than
    the session's own is counted apart ("MatMulIntegerToFloat [CPUExecutionProvider]")."""
    counts: Counter[str] = Counter()
    for layer in layers:
        label = layer.kernel
        if layer.provider is not None and layer.provider != provider:
            label += f" [{layer.provider}]"
        counts[label] += 1
    return dict(counts)


@dataclass
class ModelFacts:
    path: str
    files: dict[str, int]  # every file the model reads -> bytes
    layers: list[Layer] = field(default_factory=list)
    memory: dict | None = None

    @property
    def size(self) -> int:
        return sum(self.files.values())


@dataclass
class BenchReport:
    onnxruntime: str
    device: str  # "cpu" or "cuda": what the sessions run on
    provider: str
    cpu_count: int | None
    usable_cpus: int | None
    warmup: int
    rounds: int
    reference: ModelFacts
    quantized: ModelFacts
    shapes: list[Shape]
    memory_skipped: str | None = None
    notes: list[str] = field(default_factory=list)  # what the numbers mean on this machine

    def as_dict(self) -> dict:
        models = {}
        for label in MODELS:
            facts: ModelFacts = getattr(self, label)
            models[label] = {
                "path": facts.path, "size_bytes": facts.size, "files": facts.files, "memory": facts.memory,
                "kernels": {"summary": summarize(facts.layers, self.provider),
                            "layers": [layer.as_dict() for layer in facts.layers]},
            }
        return {
            "onnxruntime": self.onnxruntime, "device": self.device, "provider": self.provider,
            "optimization": OPTIMIZATION, "cpu_count": self.cpu_count, "usable_cpus": self.usable_cpus,
            "warmup": self.warmup, "rounds": self.rounds,
            "shapes": {s.name: s.as_dict() for s in self.shapes},
            "ratios": {s.name: s.ratio for s in self.shapes},
            "size_ratio": self.quantized.size / self.reference.size,
            "memory_skipped": self.memory_skipped, "notes": self.notes,
            **models,
        }


# ---------------------------------------------------------------------------------------------
# The measurement
# ---------------------------------------------------------------------------------------------

def bench(reference: str | os.PathLike, quantized: str | os.PathLike, data, *, batch_size: int | None = None,
          device: str = "auto", warmup: int = 3, rounds: int = 20, decode: bool = True,
          memory: bool = True) -> BenchReport:
    """Time ``quantized`` against ``reference`` on ``data``'s first batch (and one token), and
    report sizes, peak memory and the kernel behind every weight MatMul/Gemm. See the module doc."""
    import onnxruntime as ort

    from graphcal.runtime import check_device, cuda_usable

    if rounds < 1 or warmup < 0:
        raise UsageError(f"rounds must be at least 1 and warmup at least 0 (got {rounds} and {warmup})")
    check_device(device)
    providers = [_CUDA, _CPU] if device == "cuda" or (device == "auto" and cuda_usable()) else [_CPU]
    if providers[0] == _CUDA and hasattr(ort, "preload_dlls"):
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

    calib = load_data(data, inputs, batch_size=batch_size)
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

    with tempfile.TemporaryDirectory(prefix="graphcal-bench-") as tmp:
        tmp = Path(tmp)
        runners: dict = {}
        sessions = {label: _open(paths[label], _options(ort), providers) for label in MODELS}
        fell_back = [label for label in MODELS if sessions[label].get_providers()[0] != providers[0]]
        if fell_back:  # onnxruntime-gpu falls back to CPU silently when CUDA cannot start
            if device == "cuda":
                raise GraphcalError(f"--device cuda: onnxruntime could not start its CUDA provider for "
                                    f"{paths[fell_back[0]]}; run with --device cpu or fix the CUDA install")
            providers = [_CPU]  # auto: both models on the CPU rather than one on each device
            sessions = {label: _open(paths[label], _options(ort), providers) for label in MODELS}
        active = providers[0]
        for shape in shapes:
            if shape.skipped is not None:
                continue
            log.info("timing the %s shape %s", shape.name, shape.inputs)
            runners = {label: _runner(sessions[label], feeds[shape.name], active) for label in MODELS}
            try:
                samples, calls = _time_interleaved([runners[label] for label in MODELS], warmup, rounds)
            except _RunFailed as e:
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
            probe = _probe_model(tmp) if providers[0] == _CUDA else None
            for label in MODELS:
                log.info("measuring the peak memory of %s in a fresh process", paths[label])
                facts[label].memory = measure_memory(paths[label], batch_file, providers, probe)
        else:
            memory_skipped = "--no-memory"

    notes = []
    if active != _CUDA and any(layer.kind == "integer" and "MatMulNBits" not in layer.kernel
                               for layer in facts["quantized"].layers):
        from graphcal.runtime import INT8_SATURATION_NOTE, int8_gemm_saturates

        notes += [INT8_SATURATION_NOTE] if int8_gemm_saturates() else []
    return BenchReport(
        onnxruntime=ort.__version__, device="cuda" if active == _CUDA else "cpu", provider=active,
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


def _options(ort, **extra):
    """onnxruntime's default session options, quiet: only the log level is set."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    for key, value in extra.items():
        setattr(opts, key, value)
    return opts


def _open(path: Path, opts, providers: list[str]):
    """A session on ``path``; a model onnxruntime refuses at ORT_ENABLE_ALL is a one-line error
    (saying whether it loads at ORT_ENABLE_BASIC, where fusions are off)."""
    import onnxruntime as ort

    try:
        return ort.InferenceSession(str(path), opts, providers=providers)
    except Exception as e:  # noqa: BLE001 -- onnxruntime raises its own exception types
        detail = first_line(e)
        basic = _options(ort, graph_optimization_level=ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)
        try:
            ort.InferenceSession(str(path), basic, providers=providers)
            hint = " (it loads at ORT_ENABLE_BASIC: one of onnxruntime's fusions breaks it)"
        except Exception:  # noqa: BLE001
            hint = ""
        raise GraphcalError(f"{path} does not load in onnxruntime at {OPTIMIZATION}: {detail}{hint}") from None


class _RunFailed(Exception):
    def __init__(self, index: int, detail: str):
        super().__init__(detail)
        self.index, self.detail = index, detail


def _runner(session, feeds: dict[str, np.ndarray], provider: str):
    """A zero-argument call that runs ``session`` once on ``feeds``. On CUDA the inputs are
    copied to the GPU once and the outputs stay there (IOBinding), so the time is the model's,
    not the host transfers'; on CPU it is ``session.run`` as a caller makes it."""
    if provider != _CUDA:
        return lambda: session.run(None, feeds)
    import onnxruntime as ort

    binding = session.io_binding()
    on_gpu = {name: ort.OrtValue.ortvalue_from_numpy(array, "cuda", 0) for name, array in feeds.items()}
    for name, value in on_gpu.items():
        binding.bind_ortvalue_input(name, value)
    for out in session.get_outputs():
        binding.bind_output(out.name, "cuda", 0)

    def run(_inputs=tuple(on_gpu.values())) -> None:  # the default keeps the GPU inputs alive with the call
        session.run_with_iobinding(binding)  # returns once the GPU has finished

    return run


def _time_interleaved(runs, warmup: int, rounds: int) -> tuple[list[list[float]], list[int]]:
    """Per run: ``rounds`` samples of seconds per call, and the calls averaged in each sample.

    ``warmup`` untimed calls of each first; then one call of each, timed, picks how many calls
    make a sample of at least MIN_SAMPLE_S. Each round times every run once, the order reversed
    every other round."""
    def call(i: int) -> None:
        try:
            runs[i]()
        except Exception as e:  # noqa: BLE001 -- onnxruntime raises its own types from a kernel
            raise _RunFailed(i, first_line(e).removeprefix("Error in execution: ")) from None

    for _ in range(warmup):
        for i in range(len(runs)):
            call(i)
    calls = []
    for i in range(len(runs)):
        start = time.perf_counter()
        call(i)
        once = max(time.perf_counter() - start, 1e-9)
        calls.append(int(min(MAX_CALLS, max(1, math.ceil(MIN_SAMPLE_S / once)))))
    samples: list[list[float]] = [[] for _ in runs]
    order = list(range(len(runs)))
    for r in range(rounds):
        for i in (order if r % 2 == 0 else order[::-1]):
            start = time.perf_counter()
            for _ in range(calls[i]):
                call(i)
            samples[i].append((time.perf_counter() - start) / calls[i])
    return samples, calls


# ---------------------------------------------------------------------------------------------
# Kernels: what onnxruntime made of each weight MatMul/Gemm
# ---------------------------------------------------------------------------------------------

def kernels(path: Path, targets, source_outputs: dict[str, str], providers: list[str], feeds: dict[str, np.ndarray],
            tmp: Path, label: str) -> list[Layer]:
    """The kernel behind every target in ``path`` as onnxruntime optimizes it (ORT_ENABLE_ALL on
    ``providers``), with the execution provider each ran on in one profiled run of ``feeds``.

    ``targets`` and ``source_outputs`` (node name -> first output) come from the reference graph;
    graphcal's quantizer keeps node names, so the same names are looked up in ``path``."""
    import onnxruntime as ort

    optimized = tmp / f"{label}.optimized.onnx"
    opts = _options(ort, optimized_model_filepath=str(optimized), enable_profiling=True,
                    profile_file_prefix=str(tmp / f"{label}-profile"))
    # the optimized copy keeps its weights in a file of its own (a graph over 2 GB could not be written)
    opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", optimized.name + ".data")
    try:
        session = ort.InferenceSession(str(path), opts, providers=providers)
    except Exception as e:  # noqa: BLE001 -- it loaded for timing: writing the optimized graph failed
        raise GraphcalError(f"{path}: onnxruntime could not write its optimized graph ({first_line(e)})") from None
    try:
        session.run(None, feeds)
    except Exception as e:  # noqa: BLE001
        raise GraphcalError(f"{path}: onnxruntime failed on the prefill batch: {first_line(e)}") from None
    profile = Path(session.end_profiling())
    del session
    try:
        events = json.loads(profile.read_text())
    finally:
        profile.unlink(missing_ok=True)
    ran_on = {}
    for event in events:
        name = event.get("name", "")
        if event.get("cat") == "Node" and name.endswith("_kernel_time"):
            ran_on[name[: -len("_kernel_time")]] = event.get("args", {}).get("provider")
    graph = onnx.load(str(optimized), load_external_data=False).graph
    return classify_layers(graph, targets, source_outputs, ran_on)


def classify_layers(graph: onnx.GraphProto, targets, source_outputs: dict[str, str],
                    ran_on: dict[str, str]) -> list[Layer]:
    """One Layer per target, found in the optimized ``graph`` by node name (or the names
    onnxruntime gives a node it rewrites: ``<name>_quant`` from quantize_dynamic, ``fused <name>``
    from a Gemm + activation fusion), else as the producer of the source node's output, else as a
    node onnxruntime named after it ("<name>/...Fusion/")."""
    by_name = {n.name: n for n in graph.node}
    producers = {out: n for n in graph.node for out in n.output}
    inits = {t.name for t in graph.initializer}
    layers = []
    for t in targets:
        node = next((by_name[n] for n in (t.node, f"{t.node}_quant", f"fused {t.node}") if n in by_name), None)
        node = node or producers.get(source_outputs.get(t.node, ""))
        if node is None:
            node = next((n for n in graph.node if t.node and n.name.startswith(t.node + "/")), None)
        if node is None:
            layers.append(Layer(t.name, t.node, "missing", "not found in the optimized graph"))
            continue
        layer = _classify(node, producers, inits)
        layer.module, layer.node = t.name, t.node
        layer.provider = ran_on.get(node.name)
        layers.append(layer)
    return layers


def _classify(node: onnx.NodeProto, producers: dict[str, onnx.NodeProto], inits: set[str]) -> Layer:
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    base = {"module": "", "node": "", "op_type": node.op_type, "domain": node.domain or "ai.onnx",
            "optimized_node": node.name}
    if node.op_type == "MatMulNBits":
        found = {k: int(attrs.get(k, 0)) for k in ("bits", "block_size", "accuracy_level")}
        return Layer(kind="matmulnbits", kernel=f"MatMulNBits {found['bits']}-bit acc{found['accuracy_level']}",
                     attributes=found, **base)
    if node.op_type in INTEGER_KERNELS:
        return Layer(kind="integer", kernel=node.op_type, **base)
    if node.op_type in FLOAT_KERNELS and len(node.input) > 1:
        weight = node.input[1]
        if weight in inits:
            return Layer(kind="float", kernel=FOLDED, weight_from="initializer", **base)
        ops, from_activation = _weight_path(weight, producers, inits)
        if from_activation:
            return Layer(kind="other", kernel=f"{node.op_type} (weight input is an activation)", **base)
        if _DEQUANTIZING & set(ops):
            return Layer(kind="dequantized", kernel=DEQUANTIZED, weight_from=" <- ".join(ops), **base)
        return Layer(kind="float", kernel=f"float (weight prepared at run time: {' <- '.join(ops)})",
                     weight_from=" <- ".join(ops), **base)
    return Layer(kind="other", kernel=node.op_type, **base)


def _weight_path(name: str, producers: dict[str, onnx.NodeProto], inits: set[str]) -> tuple[list[str], bool]:
    """The ops between initializers and ``name`` (nearest first), and whether anything else
    (a graph input, another op) feeds it: then it is not a weight computed from constants."""
    ops: list[str] = []
    stack, seen = [name], set()
    while stack:
        tensor = stack.pop()
        if tensor in seen or tensor in inits or tensor == "":
            continue
        seen.add(tensor)
        node = producers.get(tensor)
        if node is None or node.op_type not in _WEIGHT_PATH or len(ops) > 16:
            return ops, True
        ops.append(node.op_type)
        if node.op_type == "DequantizeLinear":
            continue  # its inputs are the stored weight and its scales
        stack.extend(node.input[:1] if node.op_type in ("Reshape", "Unsqueeze", "Squeeze") else node.input)
    return ops, False


# ---------------------------------------------------------------------------------------------
# Memory: a fresh process per model
# ---------------------------------------------------------------------------------------------

_CHILD = r"""
import json, os, resource, subprocess, sys
import numpy as np
import onnxruntime as ort

def status(key):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None

def peak():
    # VmHWM: this process image's own high-water mark. ru_maxrss is not: Linux carries the parent's
    # peak over fork and exec into it, so a child of a 300 MB parent starts with ru_maxrss = 300 MB.
    hwm = status("VmHWM")
    if hwm is not None:
        return hwm
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value if sys.platform == "darwin" else value * 1024

def rss():
    current = status("VmRSS")
    return current if current is not None else peak()

def gpu_used():
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    used = [int(f[1]) for f in (line.split(",") for line in out.splitlines())
            if len(f) == 2 and f[0].strip() == str(os.getpid()) and f[1].strip().isdigit()]
    return sum(used) * 2**20 if used else None

spec = json.loads(sys.argv[1])
after_imports = rss()
opts = ort.SessionOptions()
opts.log_severity_level = 3
result = {}
if spec["probe"] is not None:
    if hasattr(ort, "preload_dlls"):
        try:
            ort.preload_dlls()
        except Exception:
            pass
    probe = ort.InferenceSession(spec["probe"], opts, providers=spec["providers"])
    probe.run(None, {"x": np.zeros(1, np.float32)})
    result["device_context_bytes"] = gpu_used()
session = ort.InferenceSession(spec["model"], opts, providers=spec["providers"])
with np.load(spec["batch"], allow_pickle=False) as data:
    feeds = {k: data[k] for k in data.files}
session.run(None, feeds)
result.update(rss_after_imports_bytes=after_imports, peak_rss_bytes=peak(), provider=session.get_providers()[0])
if spec["probe"] is not None:
    result["device_bytes"] = gpu_used()
print(json.dumps(result))
"""


def measure_memory(path: Path, batch_file: Path, providers: list[str], probe: Path | None) -> dict:
    """Peak resident host memory of a fresh process that opens ``path`` and runs one batch, and
    its increase over the process right after its imports (numpy, onnxruntime). On CUDA, the GPU
    memory nvidia-smi attributes to the process after the batch, and its increase over the CUDA
    context a one-node ``probe`` session made (when nvidia-smi lists the process)."""
    spec = {"model": str(path), "batch": str(batch_file), "providers": providers,
            "probe": str(probe) if probe is not None else None}
    done = subprocess.run([sys.executable, "-P", "-c", _CHILD, json.dumps(spec)], capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise GraphcalError(f"{path}: the memory measurement's process failed "
                            f"({lines[-1].strip() if lines else f'exit code {done.returncode}'})")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    out = {"peak_rss_bytes": got["peak_rss_bytes"], "rss_after_imports_bytes": got["rss_after_imports_bytes"],
           "increase_bytes": got["peak_rss_bytes"] - got["rss_after_imports_bytes"], "provider": got["provider"],
           "device_bytes": None, "device_increase_bytes": None, "device": "not measured"}
    if probe is None:
        out["device"] = "not measured (runs on CPU)"
    elif got.get("device_bytes") is None:
        why = "no nvidia-smi" if shutil.which("nvidia-smi") is None else "nvidia-smi does not list the process"
        out["device"] = f"not measured ({why})"
    else:
        out["device_bytes"] = got["device_bytes"]
        if got.get("device_context_bytes") is not None:
            out["device_increase_bytes"] = got["device_bytes"] - got["device_context_bytes"]
        out["device"] = "nvidia-smi"
    return out


def _probe_model(tmp: Path) -> Path:
    """A one-node model whose CUDA session gives the baseline (the CUDA context) of GPU memory."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    path = tmp / "probe.onnx"
    onnx.save(model, str(path))
    return path


# ---------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------

def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 10 else f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def format_text(report: BenchReport, layers: bool = False) -> str:
    cpus = f"{report.cpu_count} CPUs" + (f" ({report.usable_cpus} usable)" if report.usable_cpus not in
                                          (None, report.cpu_count) else "")
    lines = [f"onnxruntime {report.onnxruntime} on {report.provider}, {cpus}; default session options "
             f"({OPTIMIZATION}); {report.warmup} warm-up runs, {report.rounds} interleaved rounds",
             f"reference: {report.reference.path}", f"quantized: {report.quantized.path}", ""]
    head = f"{'shape':<16} {'model':<10} {'median ms':>10} {'p10-p90 ms':>19} {'min-max ms':>19} {'samples/s':>11} {'tokens/s':>11}"
    lines.append(head)
    for shape in report.shapes:
        title = shape.name if shape.skipped is not None else f"{shape.name} {shape.batch}x{shape.seq or '-'}"
        if shape.skipped is not None:
            lines.append(f"{title:<16} skipped: {shape.skipped}")
            continue
        for i, label in enumerate(MODELS):
            t = getattr(shape, label).as_dict()
            lines.append(f"{title if i == 0 else '':<16} {label:<10} {_ms(t['median_s']):>10} "
                         f"{_ms(t['p10_s']) + '-' + _ms(t['p90_s']):>19} {_ms(t['min_s']) + '-' + _ms(t['max_s']):>19} "
                         f"{_rate(t['samples_per_s']):>11} {_rate(t['tokens_per_s']):>11}")
        lines.append(f"{'':<16} {'ratio':<10} {shape.ratio:>9.2f}x  (quantized / reference median; below 1 = faster)")
    lines.append("")
    ref, quant = report.reference, report.quantized
    lines.append(f"{'size':<16} reference {format_size(ref.size)}, quantized {format_size(quant.size)} "
                 f"({quant.size / ref.size:.2f}x)")
    if report.memory_skipped is not None:
        lines.append(f"{'peak host memory':<16} not measured ({report.memory_skipped})")
    else:
        lines.append(f"{'peak host memory':<16} " + ", ".join(
            f"{label} {format_size(m['peak_rss_bytes'])} (+{format_size(m['increase_bytes'])} over imports)"
            for label, m in (("reference", ref.memory), ("quantized", quant.memory))))
        if ref.memory["device_bytes"] is not None and quant.memory["device_bytes"] is not None:
            lines.append(f"{'GPU memory':<16} " + ", ".join(
                f"{label} {format_size(m['device_bytes'])}"
                + (f" (+{format_size(m['device_increase_bytes'])} over the CUDA context)"
                   if m["device_increase_bytes"] is not None else "")
                for label, m in (("reference", ref.memory), ("quantized", quant.memory))))
        elif report.device == "cuda":
            lines.append(f"{'GPU memory':<16} {quant.memory['device']}")
    for i, label in enumerate(MODELS):
        summary = summarize(getattr(report, label).layers, report.provider)
        text = ", ".join(f"{k}: {v}" for k, v in summary.items()) or "no weight MatMul/Gemm"
        lines.append(f"{'kernels' if i == 0 else '':<16} {label}: {text}")
    every = ref.layers + quant.layers
    if any(layer.attributes.get("accuracy_level") == 4 for layer in every):
        lines.append(f"{'':<16} acc4: MatMulNBits accuracy_level 4: on CPU the kernel quantizes activations to int8 "
                     "per block (onnxruntime's CUDA kernel ignores the level: float activations)")
    lines += [f"{'note':<16} {note}" for note in report.notes]
    if layers and ref.layers:
        width = max(len(layer.module) for layer in ref.layers)
        lines += ["", f"{'layer':<{width}}  {'reference kernel':<38}  {'quantized kernel':<46}  provider"]
        for r, q in zip(ref.layers, quant.layers):
            detail = q.kernel + (f" block {q.attributes['block_size']}" if q.kind == "matmulnbits" else "")
            lines.append(f"{r.module:<{width}}  {r.kernel:<38}  {detail:<46}  {q.provider or '-'}")
    return "\n".join(lines)
