"""THE way the tools get a model's outputs over data, and how they score a quantized output against fp32's.

:func:`first_output` runs a model in a plain onnxruntime session (what a deployment runs: default
settings unless ``level`` says otherwise), batch by batch, and returns its first output as float64.
:func:`metrics` is SQNR and cosine against the fp32 output (graphcal eval's own measures,
graphcal.evaluation.agreement) and, given an attention mask, the mean cosine of the sentence
embeddings, pooled as sentence-transformers pools them (the tools' own).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def first_output(model: Path, feeds: dict[str, np.ndarray], batch: int, level: str = "ORT_ENABLE_ALL",
                 device: str = "cpu") -> np.ndarray:
    """The model's first output over ``feeds`` (only the inputs it takes), ``batch`` samples a run,
    onnxruntime at optimization ``level`` (ORT_ENABLE_ALL: its default, what a deployment runs), as float64.
    The session is graphcal bench's (graphcal.bench.session: default options, quiet)."""
    import onnxruntime as ort  # lazy: keeps the tools' --help fast

    from graphcal.bench.session import CPU, CUDA, open_session, options  # lazy: onnxruntime, as above

    opts = options(graph_optimization_level=getattr(ort.GraphOptimizationLevel, level))
    session = open_session(Path(model), opts, [CUDA, CPU] if device == "cuda" else [CPU])
    names = {i.name for i in session.get_inputs()}
    feeds = {k: v for k, v in feeds.items() if k in names}
    n = len(next(iter(feeds.values())))
    parts = [session.run(None, {k: v[i:i + batch] for k, v in feeds.items()})[0] for i in range(0, n, batch)]
    del session
    return np.concatenate(parts).astype(np.float64)


def metrics(ref: np.ndarray, got: np.ndarray, mask: np.ndarray | None) -> dict:
    """SQNR (dB) and cosine of ``got`` against ``ref``; with an attention ``mask``, the mean cosine of the
    masked-mean sentence embeddings too."""
    from graphcal.evaluation.agreement import Agreement  # graphcal eval's measures, streamed in float64

    agreement = Agreement("output")
    agreement.add(ref, got)
    out = {"sqnr": agreement.sqnr_db, "cosine": agreement.cosine}
    if mask is not None and ref.ndim == 3:
        m = mask[..., None].astype(np.float64)
        a, b = (ref * m).sum(1) / m.sum(1), (got * m).sum(1) / m.sum(1)
        cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        out["sentence_cosine"] = float(cos.mean())
    return out
