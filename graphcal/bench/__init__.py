"""graphcal bench: how fast a quantized model runs in onnxruntime against its fp32 reference.

Both models run in onnxruntime at its default settings (ORT_ENABLE_ALL, default threads, no
session config keys; only the log level is raised), as a deployment would open them, on the
chosen device. Reported side by side:

- time per batch at two shapes: the data's first batch (prefill) and a decode shape. For a
  model with a KV cache (``past_key_values.N.key/value`` inputs) that is one new token over a real
  past of P tokens, the past made by each model's own prefill of the first sample; for other
  models whose inputs have a free axis 1, one token of one sample (decode-like). Rounds are
  interleaved, the order flipped every round, so that drift (clocks, other load) hits both models
  alike;
- for a KV-cache model in an onnxruntime-genai folder: onnxruntime-genai's own greedy generate
  loop, time to first token and decode tokens/s;
- the size of each model (its .onnx file plus the external data files it reads);
- the peak host memory of a fresh process that opens the model and runs one batch (and, on CUDA,
  the GPU memory nvidia-smi attributes to it);
- the kernel onnxruntime really runs for every weight MatMul/Gemm: read from the optimized graph
  onnxruntime writes (``optimized_model_filepath``) and, for the execution provider, from its
  profile of one run.

Models are checked by graphcal's loader first (regular file, well-formed graph, every external
data reference inside the model's folder); onnxruntime then opens the file itself.

The package, by job:

- ``measure``: :func:`bench`, the measurement that runs the rest;
- ``session``: sessions opened as a deployment opens them, and one call to time;
- ``timing``: interleaved rounds;
- ``decode``: a KV-cache model's decode step, its past made by the model's own prefill;
- ``genai_loop``: onnxruntime-genai's generate loop, timed;
- ``kernels``: the kernel behind every weight MatMul/Gemm;
- ``memory`` and ``child``: peak memory, measured in a fresh process (``python -P -m graphcal.bench.child``);
- ``report`` (records, JSON) and ``text`` (the text report).

The names below are imported on first use (PEP 562), not here: the memory child runs as a module
of this package, so this file must not load onnx, torch or graphcal's graph code into the process
whose memory it measures.
"""

from __future__ import annotations

import importlib

_HOME = {  # name -> the module that holds it
    **dict.fromkeys(("DEQUANTIZED", "FLOAT_KERNELS", "FOLDED", "INTEGER_KERNELS", "classify_layers", "kernels"),
                    "graphcal.bench.kernels"),
    "bench": "graphcal.bench.measure",
    "measure_memory": "graphcal.bench.memory",
    **dict.fromkeys(("MODELS", "OPTIMIZATION", "BenchReport", "GenaiLoop", "Layer", "LoopTiming", "ModelFacts", "Shape",
                     "Timing", "summarize"), "graphcal.bench.report"),
    "format_text": "graphcal.bench.text",
    **dict.fromkeys(("MAX_CALLS", "MIN_SAMPLE_S"), "graphcal.bench.timing"),
}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
