"""Which activation pass a run uses: the plan's (calibration.streamed.choose_pass decided it).

    RunPlan.streamed_blocks > 0 --> calibration.streamed.run_streamed_pass: one layer block at a time
    else                        --> calibration.activations.run_activation_pass: the whole graph at once

Every stage that passes over the data for its statistics (the observers' pass, SmoothQuant's ranges, AWQ's
pass over the scaled activations) calls :func:`run_activation_pass` here, with the whole-graph pass's arguments.
"""

from __future__ import annotations

import dataclasses
import time

from graphcal.calibration import activations, streamed
from graphcal.calibration.activations import PassResult
from graphcal.calibration.decisions import Loaded, RunPlan
from graphcal.data import Calibration


def run_activation_pass(plan: RunPlan, loaded: Loaded, observers, calib: Calibration, *, tap_limit_mb: float | None = None,
                        cache_mb: float | None = None, cache_folder=None, **kwargs) -> PassResult:
    """The plan's pass over ``calib`` feeding ``observers`` (arguments: activations.run_activation_pass's;
    ``cache_mb`` and ``cache_folder``: the streamed pass's block cache, calibration.block_cache)."""
    start = time.perf_counter()
    if plan.streamed_blocks and observers.consumers:
        result = streamed.run_streamed_pass(plan, loaded, observers, calib, cache_mb=cache_mb, cache_folder=cache_folder,
                                            **kwargs)
    else:
        result = activations.run_activation_pass(plan, loaded, observers, calib, tap_limit_mb=tap_limit_mb, **kwargs)
    return dataclasses.replace(result, seconds=time.perf_counter() - start)
