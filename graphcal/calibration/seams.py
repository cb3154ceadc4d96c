"""The typed seams between the calibration stages: what each stage may ask of the next.

- :class:`graphcal.calibration.observe.Observed`: what the activation pass feeds (llm-compressor's
  observers, GPTQ's Hessians, SmoothQuant's row samples); every Consumer holds one.
- :class:`PreTransform`: a change of the model chosen from the data before the weight pass
  (SmoothQuant's and AWQ's channel scales). The pipeline runs whichever one the plan asks for
  through this one interface: a transform unit's ``for_plan`` gives it (graphcal.calibration.transforms).
- :class:`Rounding`: how the weight pass puts each weight on its grid other than to nearest (GPTQ).
- :class:`PassSettings`: how the passes over the data run (device, torchrun, taps' limits).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from graphcal.calibration.block_cache import check_cache_mb

if TYPE_CHECKING:  # typing only: these modules import this one
    from graphcal.calibration.activations import PassResult
    from graphcal.calibration.decisions import RunPlan
    from graphcal.calibration.distributed import Dist
    from graphcal.calibration.observe import ObserverSet
    from graphcal.calibration.transforms.channel_scales import ChannelScales
    from graphcal.data import Calibration
    from graphcal.types import QuantizedTarget, Target


@dataclass(frozen=True)
class PassSettings:
    """How every pass over the calibration data runs (the activation pass, SmoothQuant's ranges)."""

    device: str = "auto"
    device_id: int = 0  # under torchrun each rank has its own GPU
    dist: Dist | None = None  # torchrun: this rank's share of the batches, statistics gathered after
    progress: bool = False
    reduce_in_graph: bool = True
    exclude_padding: bool = False
    inputs: tuple[str, ...] = ()  # the model's input names (an attention_mask among them: padding counted)
    tap_limit_mb: float | None = None
    skip_nonfinite: bool = False  # --skip-nonfinite-weights: such weights in float, the mappings scaling them left out
    # the block walks' cache (calibration.block_cache): --cache-mb (None: half the memory available), and the
    # folder its files go in, made when first asked (the output's temporary folder; None: the system's)
    cache_mb: float | None = None
    cache_folder: Callable[[], Path] | None = None

    def __post_init__(self):
        check_cache_mb(self.cache_mb)  # a bad value from the API refused in one line before any pass

    @property
    def main(self) -> bool:
        """This process writes (rank 0, or no torchrun)."""
        return self.dist is None or self.dist.is_main

    def kwargs(self) -> dict:
        """The settings as graphcal.calibration.passes.run_activation_pass takes them."""
        return dict(device=self.device, device_id=self.device_id, dist=self.dist, progress=self.progress and self.main,
                    reduce_in_graph=self.reduce_in_graph, exclude_padding=self.exclude_padding, inputs=self.inputs,
                    tap_limit_mb=self.tap_limit_mb, cache_mb=self.cache_mb, cache_folder=self.cache_folder)


class PreTransform(Protocol):
    """Channel scales chosen from the data before the weight pass.

    ``for_plan`` gives one where the plan asks for it (else None). ``before_pass`` does what needs
    the data before the activation pass (AWQ's block-by-block search); ``taps`` then says what the
    observers of a scaled activation tap (x * (1/s)); ``activation_pass`` runs the pass feeding
    ``observers`` (SmoothQuant takes its ranges in it); ``scales`` is the result."""

    @classmethod
    def for_plan(cls, run: RunPlan) -> PreTransform | None: ...

    def before_pass(self, calib: Calibration, settings: PassSettings) -> None: ...

    def taps(self) -> dict[str, str]: ...

    def activation_pass(self, observers: ObserverSet, calib: Calibration, settings: PassSettings) -> PassResult: ...

    def scales(self) -> ChannelScales: ...


@dataclass(frozen=True)
class Member:
    """One weight of a fused unit on its way through the weight pass: the target, its torch
    [out, in] weight (smoothed where channel scales apply) and its grid (the observed qparams)."""

    target: Target
    weight: torch.Tensor
    item: QuantizedTarget


class Rounding(Protocol):
    """Puts the members of one fused unit on their grids (GPTQ); gives target name -> rounded weight.
    ``units`` gives the weight pass's units in the order it needs them (and may run the data between
    them: sequential GPTQ's blocks). ``log`` records what it did (losses, fallbacks) and
    ``log.warnings()`` what to tell the user."""

    log: object

    def units(self, all_units: list[list[Target]]) -> Iterable[list[Target]]: ...

    def __call__(self, members: list[Member]) -> dict[str, torch.Tensor]: ...
