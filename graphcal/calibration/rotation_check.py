"""The rotated float model checked against the model as given, before anything is calibrated or written.

A rotation folded into the weights must leave the model's outputs as they were, to float rounding
(:mod:`graphcal.algorithms.rotation.fold` rotates only the graph shapes it handles exactly and
refuses the rest). This is the net under that claim: onnxruntime (ORT_ENABLE_BASIC, on the run's
device) runs the model file as given and the rotated model on the first calibration sample, one
after the other (the first session is dropped before the second opens; weights left on disk are
read from the model's folder by onnxruntime, never copied by graphcal), and each float output of
the two must agree within float error: an SQNR of at least :data:`MIN_SQNR_DB` for the narrowest
float type among the model's initializers. Outputs R2 turns per head (onnxruntime's
GroupQueryAttention's present values, which the rotated model reads back turned) are turned back
first. Otherwise the run stops with one line naming the worst output and its SQNR.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx

from graphcal.algorithms.rotation.fold import Rotation
from graphcal.algorithms.rotation.hadamard import orthogonal
from graphcal.data.inputs import fixed_batch, graph_inputs, slice_rows
from graphcal.errors import GraphcalError
from graphcal.evaluation.agreement import Agreement
from graphcal.graph.io import load_model_info
from graphcal.runtime import open_runtime

#: the least SQNR (dB) a rotated model's outputs keep against the model as given, by the narrowest
#: float type of its initializers: float error is far below it (fp32 models measure over 100 dB),
#: a rotation that misses a weight or bias far above it (the bugs this guards against gave 3 dB)
MIN_SQNR_DB = {onnx.TensorProto.FLOAT: 60.0, onnx.TensorProto.FLOAT16: 30.0, onnx.TensorProto.BFLOAT16: 20.0}
SAMPLES = 1  # the calibration samples run through both models


def check_rotation(model_path: str | Path, rotated: onnx.ModelProto, report: Rotation, batch: dict[str, np.ndarray],
                   device: str = "cpu", device_id: int = 0) -> dict[str, float]:
    """Run the model at ``model_path`` and ``rotated`` (its weights left on disk read from the
    model's folder) on the first sample of ``batch``; a one-line GraphcalError where a float output
    drifts beyond float error. Returns each float output's SQNR in dB."""
    model_path = Path(model_path)
    folder = str(model_path.parent)
    feeds = batch if fixed_batch(graph_inputs(rotated)) else {k: slice_rows(v, 0, SAMPLES) for k, v in batch.items()}
    outputs = [o.name for o in rotated.graph.output]
    original = load_model_info(model_path, lazy=True)[0]
    want = _run(original, outputs, feeds, device, device_id, folder)
    del original
    got = _run(rotated, outputs, feeds, device, device_id, folder)
    kinds = {t.data_type for t in rotated.graph.initializer} & MIN_SQNR_DB.keys()
    floor = min((MIN_SQNR_DB[k] for k in kinds), default=MIN_SQNR_DB[onnx.TensorProto.FLOAT])
    sqnr = {}
    for name in outputs:
        ref, cand = want.pop(name), got.pop(name)
        if not (isinstance(ref, np.ndarray) and ref.dtype.kind == "f"):
            continue  # token ids and other non-float outputs: float error may flip them, nothing to measure
        if name in report.turned_outputs:
            cand = _turned_back(cand, report.turned_outputs[name], report)
        sqnr[name] = _sqnr(name, ref, cand)
    worst = min(sqnr, key=sqnr.get, default=None)
    if worst is not None and sqnr[worst] < floor:
        shown = "-inf" if sqnr[worst] == -math.inf else f"{sqnr[worst]:.1f}"
        raise GraphcalError(
            f"--rotate: the rotated model drifts from the model as given on the first calibration sample: output "
            f"{worst!r} at {shown} dB SQNR (float error keeps it over {floor:.0f} dB); a rotation this far off is "
            "not exact for this graph, so nothing is written (run without --rotate)")
    return sqnr


def _run(model: onnx.ModelProto, outputs: list[str], feeds: dict, device: str, device_id: int,
         folder: str) -> dict[str, np.ndarray]:
    runtime = open_runtime(model, outputs, device=device, device_id=device_id, external_folder=folder)
    try:
        return runtime.run_numpy(feeds)
    finally:
        runtime.close()


def _turned_back(value: np.ndarray, head_dim: int, report: Rotation) -> np.ndarray:
    """A value output R2 turned per head (its last axis, head_dim wide, took H): ``v H Hᵀ = v``."""
    h, _ = orthogonal(head_dim, report.seed, report.kind)
    return (value.astype(np.float64) @ h.T).astype(value.dtype)


def _sqnr(name: str, ref: np.ndarray, cand: np.ndarray) -> float:
    """SQNR in dB of ``cand`` against ``ref`` over the positions finite in both; -inf where one is
    finite and the other not."""
    finite = np.isfinite(ref)
    if ref.shape != cand.shape or not np.array_equal(finite, np.isfinite(cand)):
        return -math.inf
    if not finite.any():
        return math.inf
    agreement = Agreement(name)
    agreement.add(ref[finite], cand[finite])
    if agreement.ref_sq == 0:
        return math.inf if agreement.err_sq == 0 else -math.inf
    return agreement.sqnr_db
