"""Held-out perplexity of a causal LM in ONNX: plain onnxruntime on the CPU at its default settings.

:func:`perplexity` runs the model over an ``.npz`` of ``input_ids`` (and ``attention_mask``) and scores each
position's logits against the next token: ``exp`` of the mean next-token cross-entropy over the positions
where the mask holds both the token and the next one. A model with a KV cache (onnxruntime-genai's model
builder: ``past_key_values.N.key`` / ``.value`` inputs) is fed an empty past, so one pass is a prefill.
graphcal eval compares a quantized model with its reference output by output (SQNR, cosine); it has no
perplexity, hence this.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np


def _empty_past(inp, batch: int, head_size: int | None) -> np.ndarray:
    """A zero-length past for a KV-cache input: batch, 0 past positions, the head size where the dim is symbolic."""
    dims = []
    for dim in inp.shape:
        if isinstance(dim, int):
            dims.append(dim)
        elif "batch" in dim:
            dims.append(batch)
        elif "past" in dim:
            dims.append(0)
        elif head_size is not None:
            dims.append(head_size)  # the builder's kv_cache_dim: head_size for an unquantized cache
        else:
            raise SystemExit(f"input {inp.name}: no rule for its dim {dim!r} (and no genai_config.json head_size)")
    dtype = {"tensor(float)": np.float32, "tensor(float16)": np.float16}[inp.type]
    return np.zeros(dims, dtype=dtype)


def _head_size(model: Path) -> int | None:
    config = model.parent / "genai_config.json"
    return json.loads(config.read_text())["model"]["decoder"].get("head_size") if config.is_file() else None


def next_token_nll(logits: np.ndarray, ids: np.ndarray, mask: np.ndarray) -> tuple[float, int]:
    """Summed cross-entropy (nats) of ``logits[:, t]`` against ``ids[:, t+1]`` where ``mask`` holds both, and the count."""
    logits = logits[:, :-1].astype(np.float32, copy=False)
    target = ids[:, 1:]
    keep = (mask[:, :-1] * mask[:, 1:]).astype(bool)
    top = logits.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(axis=-1)) + top[..., 0]
    picked = np.take_along_axis(logits, target[..., None], axis=-1)[..., 0]
    return float((lse - picked)[keep].astype(np.float64).sum()), int(keep.sum())


def perplexity(model: Path, data: Path, batch: int = 8, num_samples: int | None = None) -> dict:
    """Perplexity of ``model`` (its ``logits`` output) over ``data``; with the tokens scored and the seconds taken."""
    import onnxruntime as ort  # lazy: only where a model is run

    start = time.perf_counter()
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])  # default options
    arrays = dict(np.load(data))
    ids = arrays["input_ids"][:num_samples]
    mask = arrays.get("attention_mask", np.ones_like(arrays["input_ids"]))[:num_samples]
    names = [i.name for i in session.get_inputs()]
    past = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    missing = [n for n in names if n not in arrays and n not in {p.name for p in past}]
    if missing:
        raise SystemExit(f"{data} has no {', '.join(missing)} for {model}")
    head_size = _head_size(Path(model))
    total, count = 0.0, 0
    for i in range(0, len(ids), batch):
        feeds = {n: arrays[n][:num_samples][i:i + batch] for n in names if n in arrays}
        rows = len(feeds["input_ids"])
        feeds.update({p.name: _empty_past(p, rows, head_size) for p in past})
        (logits,) = session.run(["logits"], feeds)
        nll, n = next_token_nll(logits, ids[i:i + batch], mask[i:i + batch])
        total, count = total + nll, count + n
    return {"model": str(model), "data": str(data), "perplexity": math.exp(total / count), "nll": total / count,
            "tokens": count, "samples": len(ids), "batch": batch, "seconds": time.perf_counter() - start,
            "onnxruntime": ort.__version__}
