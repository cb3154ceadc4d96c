"""eval's one switchable session: the fp32 reference with each quantized layer behind a switch per
quantized form (graph.switch: the quantized model's, then the fallback's), built once and opened
once for every measure that swaps layers (--sensitivity, then the --size-budget/--target-db mix)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from graphcal.evaluation.models import EvalModels
from graphcal.graph.io import value_types
from graphcal.graph.switch import switchable_model


@dataclass(frozen=True)
class SwitchSession:
    run: Callable[[dict], dict]  # feeds (the batch and every switch) -> the model's outputs
    switches: dict[str, list[str | None]]  # layer -> its switch per form (quantized, fallback), None: as fp32

    @property
    def off(self) -> dict[str, np.ndarray]:
        """Every switch off: the fp32 model."""
        return {s: np.array(False) for names in self.switches.values() for s in names if s is not None}


def open_switch_session(models: EvalModels, layers: dict[str, str], outputs: list[str], optimization,
                        device: str = "cpu", device_id: int = 0) -> SwitchSession:
    """``layers`` (layer -> the fp32 node computing it) switchable between fp32, the quantized model's
    form and the fallback's (where there is one), as one onnxruntime session fetching ``outputs``
    (onnx.reference where onnxruntime cannot run the forms: every weight read in), on ``device`` (as
    run's --device; on a GPU the outputs stay there as torch tensors, compared there by Agreement)."""
    forms = [models.candidate, *([models.fallback] if models.fallback is not None else [])]
    if models.in_onnxruntime:  # weights stay on disk, read by onnxruntime from the one folder
        ref, cands, folder = models.reference.model, [m.model for m in forms], models.folder
    else:
        ref, cands, folder = models.whole(models.reference), [models.whole(m) for m in forms], None
    types = {name: t.elem_type for name, t in value_types(ref).items()}
    model, switches = switchable_model(ref, cands, layers, types)
    del ref, cands
    from graphcal.runtime import open_model_runner  # lazy: it imports onnxruntime, loaded when a comparison runs

    run = open_model_runner(model, outputs, optimization=optimization, external_folder=folder, shared=True,
                            device=device, device_id=device_id).run
    return SwitchSession(run, switches)
