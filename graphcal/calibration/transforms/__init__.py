"""The transform units: one class per algorithm that changes the model or its rounding, found by the
type of its settings record (graphcal.config). Adding a transform is adding a class
(graphcal.calibration.transforms.base.Transform) and an entry here; nothing else names one.

    RotationSettings -> rotation.Rotate       the residual stream rotated, before the plan
    Smoothing        -> smoothquant.SmoothQuant  channel scales from the activation pass
    AWQSettings      -> awq.AWQ               channel scales searched layer block by layer block
    GPTQSettings     -> gptq.GPTQ             the weight pass's rounding

The order is the order they run in (and are reported in).
"""

from __future__ import annotations

from graphcal.calibration.transforms.awq import AWQ
from graphcal.calibration.transforms.base import Transform
from graphcal.calibration.transforms.gptq import GPTQ
from graphcal.calibration.transforms.rotation import Rotate
from graphcal.calibration.transforms.smoothquant import SmoothQuant

#: settings type -> its unit, in the order the units run
REGISTRY: dict[type, type[Transform]] = {unit.settings_type: unit for unit in (Rotate, SmoothQuant, AWQ, GPTQ)}


def configured(config) -> list[tuple[type[Transform], object]]:
    """The units a RunConfig asks for, each with its settings, in the order they run."""
    asked = {type(s): s for s in config.transform_settings()}
    return [(unit, asked[kind]) for kind, unit in REGISTRY.items() if kind in asked]


__all__ = ["REGISTRY", "Transform", "configured"]
