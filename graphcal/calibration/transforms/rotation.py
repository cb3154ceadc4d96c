"""Rotation as a transform unit (--rotate, SpinQuant's R1/R2 folded into the weights): :class:`Rotate`.

It changes weights, so it runs before the plan (graphcal.calibration.plan.load): it takes the model
as loaded and returns it rotated (algorithms.rotation.fold) with the fold's record; the plan is made
on the rotated model. Its one data pass is the check below, before any calibration pass.

The rotated float model checked against the model as given, before anything is calibrated or written.

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

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from graphcal.calibration.transforms.base import Transform
from graphcal.config import RotationSettings
from graphcal.data.inputs import fixed_batch, graph_inputs, slice_rows
from graphcal.errors import GraphcalError
from graphcal.graph.io import load_model_info
from graphcal.runtime import open_runtime

if TYPE_CHECKING:
    from graphcal.algorithms.rotation.fold import Rotation

log = logging.getLogger("graphcal")

#: the least SQNR (dB) a rotated model's outputs keep against the model as given, by the narrowest
#: float type of its initializers: float error is far below it (fp32 models measure over 100 dB),
#: a rotation that misses a weight or bias far above it (the bugs this guards against gave 3 dB)
MIN_SQNR_DB = {onnx.TensorProto.FLOAT: 60.0, onnx.TensorProto.FLOAT16: 30.0, onnx.TensorProto.BFLOAT16: 20.0}
SAMPLES = 1  # the calibration samples run through both models


def check_rotation(model_path: str | Path, rotated: onnx.ModelProto, report: Rotation, batch: dict[str, np.ndarray],
                   device: str = "cpu", device_id: int = 0, streamed: tuple | None = None) -> dict[str, float]:
    """Run the model at ``model_path`` and ``rotated`` (its weights left on disk read from the
    model's folder) on the first sample of ``batch``; a one-line GraphcalError where a float output
    drifts beyond float error. Returns each float output's SQNR in dB. ``streamed``: (the run's plan,
    its Loaded: ``rotated``'s) to run both models one layer block at a time
    (calibration.block_outputs), None: each model whole-graph in one session."""
    model_path = Path(model_path)
    folder = str(model_path.parent)
    feeds = batch if fixed_batch(graph_inputs(rotated)) else {k: slice_rows(v, 0, SAMPLES) for k, v in batch.items()}
    outputs = [o.name for o in rotated.graph.output]
    original, files = load_model_info(model_path, lazy=True)
    if streamed is None:
        want = _run(original, outputs, feeds, device, device_id, folder)
        del original
        got = _run(rotated, outputs, feeds, device, device_id, folder)
    else:
        from graphcal.calibration.block_outputs import as_given, graph_outputs  # lazy: blockwise loads with its users

        run, loaded = streamed
        want = graph_outputs(*as_given(run, original, files, model_path), feeds, device, device_id)
        del original
        got = graph_outputs(run, loaded, feeds, device, device_id)
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


def streams_check(run, loaded) -> bool:
    """Whether the check runs block by block: the plan's targets form two or more layer blocks
    (calibration.streamed.layer_blocks, as the streamed pass finds them), whatever pass the run takes."""
    from graphcal.calibration.streamed import layer_blocks  # lazy: the passes' module imports the transforms'

    return bool(layer_blocks(loaded, run))


def _run(model: onnx.ModelProto, outputs: list[str], feeds: dict, device: str, device_id: int,
         folder: str) -> dict[str, np.ndarray]:
    runtime = open_runtime(model, outputs, device=device, device_id=device_id, external_folder=folder)
    try:
        return runtime.run_numpy(feeds)
    finally:
        runtime.close()


def _turned_back(value: np.ndarray, head_dim: int, report: Rotation) -> np.ndarray:
    """A value output R2 turned per head (its last axis, head_dim wide, took H): ``v H Hᵀ = v``."""
    from graphcal.algorithms.rotation.hadamard import orthogonal  # lazy: the rotation's math loads with --rotate only

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
    from graphcal.evaluation.agreement import Agreement  # lazy: eval's package loads with --rotate only, not with every run

    agreement = Agreement(name)
    agreement.add(ref[finite], cand[finite])
    if agreement.ref_sq == 0:
        return math.inf if agreement.err_sq == 0 else -math.inf
    return agreement.sqnr_db


@dataclass(frozen=True)
class RotationRecord:
    """What a run's rotation folded (algorithms.rotation.fold.Rotation.as_dict), as run reports it."""

    folded: dict
    read_data = False  # its check runs one sample, not the calibration data

    def as_dict(self) -> dict:
        return dict(self.folded)


class Rotate(Transform):
    """--rotate as one unit: the fold before the plan, its notes, its check, its record and summaries."""

    settings_type = RotationSettings
    key = "rotation"
    rewrites_weights = True

    @classmethod
    def rewrite(cls, model: onnx.ModelProto, settings: RotationSettings, base_dir: str,
                sink) -> tuple[onnx.ModelProto, Rotation]:
        """The model with the residual stream rotated (the loaded model, edited: nothing else holds it
        yet) and what the fold did; the record is written into the model's metadata too. Each rotated
        weight is read, rotated and handed to ``sink`` (the run's own data file, calibration.own_data) one
        at a time: the fold holds one weight, whatever the model's size (calibration.footprint counts it)."""
        from graphcal.algorithms.rotation.fold import rotate, write_record  # lazy: the rotation's math loads with --rotate only

        rotation = rotate(model, base_dir, heads="R2" in settings.rotations, kind=settings.kind, sink=sink)
        write_record(model, rotation)
        log.info("rotated the residual stream (%s): %d weights, %d norm scales folded", rotation.matrix,
                 len(rotation.rotated), rotation.norms)
        if rotation.kept_tied:
            log.info("rotation kept %s tied to lm_head; its norm scale moved into a %dx%d MatMul before lm_head, "
                     "left in float", ", ".join(rotation.kept_tied), rotation.hidden, rotation.hidden)
        return model, rotation

    @classmethod
    def keep_float(cls, decision: Rotation | None) -> set[str]:
        return set(decision.scale_nodes) if decision is not None else set()  # the small MatMuls before lm_head

    @classmethod
    def notes(cls, decision: Rotation | None, settings) -> list[str]:
        notes = []
        if decision is not None and decision.untied:
            notes.append(f"--rotate: {', '.join(decision.untied)} is read by several nodes that take different "
                         "rotations (a table tied to lm_head, or a weight shared otherwise), so each node has its own "
                         f"rotated copy now (+{(decision.bytes_after - decision.bytes_before) / 1e6:.1f} MB in float "
                         "before quantization)")
        if decision is not None and "R2" in decision.rotations and not decision.heads:
            notes.append("--rotate R2: no attention's value and output projections were recognised (onnxruntime's "
                         "GroupQueryAttention over a packed qkv_proj, or a torch export's attention in plain ops), "
                         "so only R1 was folded")
        return notes

    @classmethod
    def verify(cls, model_path, run, loaded, decision: Rotation, batch, device: str, device_id: int) -> None:
        """Before any pass: a rotation that drifts from the model as given goes no further (:func:`check_rotation`;
        block by block where the targets form layer blocks: :func:`streams_check`)."""
        streamed = (run, loaded) if streams_check(run, loaded) else None
        sqnr = check_rotation(model_path, loaded.model, decision, batch, device, device_id, streamed)
        log.info("--rotate: the rotated model agrees with the model as given on the first sample%s (%s)",
                 " (block by block)" if streamed else "", ", ".join(f"{name} {db:.0f} dB" for name, db in sqnr.items()))

    @classmethod
    def metadata(cls, decision: Rotation) -> dict:
        """compressed-tensors' transform_config for quantization_config.json."""
        from graphcal.algorithms.rotation.fold import transform_config  # lazy: the rotation's math loads with --rotate only

        return transform_config(decision)

    @classmethod
    def record(cls, run, done) -> RotationRecord | None:
        decision = run.decision(RotationSettings)
        return RotationRecord(decision.as_dict()) if decision is not None else None

    @classmethod
    def result_lines(cls, record: RotationRecord | None) -> list[str]:
        if record is None:
            return []
        from graphcal.algorithms.rotation.fold import summary  # lazy: the rotation's math loads with --rotate only

        return [f"rotated the residual stream first ({summary(record.folded)}"]

    @classmethod
    def result_json(cls, record: RotationRecord | None):
        return record.as_dict() if record is not None else None

    @classmethod
    def inspect_lines(cls, run, decision: Rotation | None, settings, blocks) -> list[str]:
        if decision is None:
            return []
        from graphcal.algorithms.rotation.fold import summary  # lazy: the rotation's math loads with --rotate only

        return [f"rotation ({summary(decision.as_dict())}"]

    @classmethod
    def inspect_json(cls, run, decision: Rotation | None, settings, blocks):
        return decision.as_dict() if decision is not None else None
