"""bench's report: timings per shape, each model's files, kernels and memory, as records and as JSON."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

OPTIMIZATION = "ORT_ENABLE_ALL"  # the session options bench uses: onnxruntime's default
MODELS = ("reference", "quantized")


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
    past: int | None = None  # a KV-cache model's decode step: the length of the past it runs over

    @property
    def title(self) -> str:
        """How the text report names it: "prefill 8x32", "decode (past 23) 1x1", "decode"."""
        name = self.name if self.past is None else f"{self.name} (past {self.past})"
        return name if self.skipped is not None else f"{name} {self.batch}x{self.seq or '-'}"

    @property
    def ratio(self) -> float | None:
        if self.reference is None or self.quantized is None:
            return None
        return self.quantized.median / self.reference.median

    def as_dict(self) -> dict:
        out = {"name": self.name, "inputs": self.inputs, "batch": self.batch, "seq": self.seq, "past": self.past,
               "measured": self.skipped is None, "skipped": self.skipped, "ratio": self.ratio}
        for label in MODELS:
            timing = getattr(self, label)
            out[label] = timing.as_dict() if timing is not None else None
        return out


def _spread(samples: list[float], prefix: str) -> dict:
    s = np.asarray(samples, dtype=np.float64)
    return {f"{prefix}median_s": float(np.median(s)), f"{prefix}min_s": float(s.min()), f"{prefix}max_s": float(s.max()),
            f"{prefix}p10_s": float(np.percentile(s, 10)), f"{prefix}p90_s": float(np.percentile(s, 90))}


@dataclass
class LoopTiming:
    """One model in onnxruntime-genai's generate loop, per timed round."""

    ttft: list[float]  # seconds from the prompt's append_tokens to the first generated token
    per_token: list[float]  # seconds per generated token after the first (empty when only one was asked)
    generated: list[int]  # tokens generated in each round

    def as_dict(self) -> dict:
        out = {**_spread(self.ttft, "ttft_"), "rounds": len(self.ttft), "generated_tokens": min(self.generated)}
        if self.per_token:
            out.update(_spread(self.per_token, "decode_"), decode_tokens_per_s=1 / float(np.median(self.per_token)))
        else:
            out.update(dict.fromkeys(("decode_median_s", "decode_min_s", "decode_max_s", "decode_p10_s", "decode_p90_s",
                                      "decode_tokens_per_s")))
        return out


@dataclass
class GenaiLoop:
    """Both models in onnxruntime-genai's own generate loop (greedy), or why that was not measured."""

    prompt_tokens: int
    new_tokens: int
    rounds: int
    version: str | None = None  # onnxruntime-genai's
    provider: str | None = None  # "cpu" or "cuda": the provider the loop's models ran on
    reference: LoopTiming | None = None
    quantized: LoopTiming | None = None
    skipped: str | None = None
    notes: list[str] = field(default_factory=list)  # what the loop's models were not handed (bench's notes)

    def _ratio(self, attr: str) -> float | None:
        if self.reference is None or self.quantized is None:
            return None
        ref, quant = getattr(self.reference, attr), getattr(self.quantized, attr)
        return float(np.median(quant) / np.median(ref)) if ref and quant else None

    @property
    def ttft_ratio(self) -> float | None:
        return self._ratio("ttft")

    @property
    def decode_ratio(self) -> float | None:
        """Quantized / reference median time per decoded token (below 1 = faster)."""
        return self._ratio("per_token")

    def as_dict(self) -> dict:
        return {"measured": self.skipped is None, "skipped": self.skipped, "onnxruntime_genai": self.version,
                "provider": self.provider, "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "rounds": self.rounds, "ttft_ratio": self.ttft_ratio, "decode_ratio": self.decode_ratio,
                **{label: getattr(self, label).as_dict() if getattr(self, label) is not None else None
                   for label in MODELS}}


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
    genai_loop: GenaiLoop | None = None  # KV-cache models only: onnxruntime-genai's generate loop

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
            "genai_loop": self.genai_loop.as_dict() if self.genai_loop is not None else None,
            **models,
        }
