"""Held-out perplexity of a causal LM in ONNX: plain onnxruntime on the CPU at its default settings.

:func:`perplexity` runs the model over an ``.npz`` of ``input_ids`` (and ``attention_mask``) and scores each
position's logits against the next token: ``exp`` of the mean next-token cross-entropy over the positions
where the mask holds both the token and the next one. A model with a KV cache (onnxruntime-genai's model
builder: ``past_key_values.N.key`` / ``.value`` inputs) is fed an empty past, filled by graphcal's own data
path (graphcal.data.fill, as ``graphcal run`` fills it), so one pass is a prefill.
graphcal eval compares a quantized model with its reference output by output (SQNR, cosine); it has no
perplexity, hence this.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np


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

    from graphcal.data import graph_inputs, load_data
    from graphcal.graph.io import load_model_info

    start = time.perf_counter()
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])  # default options
    # graphcal's own data path: a KV-cache model's empty past (and mask, positions) filled as run fills it
    inputs = graph_inputs(load_model_info(model, lazy=True)[0])  # the graph only: weights stay on disk
    calib = load_data(data, inputs, batch_size=batch, num_samples=num_samples, model_dir=Path(model).parent)
    total, count = 0.0, 0
    for feeds in calib.batches():
        (logits,) = session.run(["logits"], feeds)
        ids = feeds["input_ids"]
        nll, n = next_token_nll(logits, ids, feeds.get("attention_mask", np.ones_like(ids)))
        total, count = total + nll, count + n
    return {"model": str(model), "data": str(data), "perplexity": math.exp(total / count), "nll": total / count,
            "tokens": count, "samples": calib.num_samples, "batch": batch, "seconds": time.perf_counter() - start,
            "onnxruntime": ort.__version__}
