"""What every transform unit is: one algorithm (rotation, SmoothQuant, AWQ, GPTQ) in one class.

A unit is found through graphcal.calibration.transforms.REGISTRY by the type of its settings record
(graphcal.config: RotationSettings, Smoothing, AWQSettings, GPTQSettings), and owns, for its algorithm:

- ``rewrite`` (units that change weights: ``rewrites_weights``): the model before the plan, returned
  with a record of what it did; the plan is made on the rewritten model;
- ``resolve``: its decision at plan time (which mappings, which layers), ``notes`` the plan's
  warnings about it, ``scaled`` the layers whose weights it rescales, ``keep_float`` the nodes it
  adds that stay in float;
- ``check``: its pre-flight refusals (what ``run`` and ``inspect`` refuse before any pass);
- its data passes: ``for_plan`` gives the pipeline's pre-transform (graphcal.calibration.seams.PreTransform)
  or the weight pass's rounding (seams.Rounding), which run on the model the pipeline owns;
- ``record``: its typed, frozen result record; ``result_lines`` / ``result_json`` what ``run``
  prints for it; ``inspect_lines`` / ``inspect_json`` what ``inspect`` prints for it.

The per-block interface: a unit that takes the data layer block by layer block (AWQ, GPTQ's
sequential order) does its work in ``observe_block(frame, k, inputs)`` on ONE block's subgraph
(graphcal.calibration.blockwise.Blockwise: a read-only frame of the graph and of the weights as they
were before the weight pass) with that block's cached inputs (``inputs``: tensor name -> one array
per batch); where the pipeline still hands a unit the whole graph, the whole graph is its one block.
docs/architecture.md describes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from graphcal.errors import UsageError

if TYPE_CHECKING:  # typing only: the plan and the stages import the units
    import onnx

    from graphcal.calibration.distributed import Dist
    from graphcal.calibration.seams import PassSettings
    from graphcal.config import RunConfig
    from graphcal.data import Calibration
    from graphcal.types import Target


@dataclass(frozen=True)
class PlanScope:
    """What a unit's plan-time resolution reads: the model (read only), its targets and schemes."""

    model: onnx.ModelProto
    found: list[Target]
    chosen: list[Target]
    tied: Mapping[str, str]  # lookup -> the chosen lm_head it is tied to (graph.ties)
    schemes: Mapping[str, object]
    config: RunConfig
    base_dir: str
    shares: Callable[[str, str], bool]  # shares(lookup, head): the lookup may read head's stored weight


class Transform:
    """One algorithm as a unit (see the module's docstring); every method has a do-nothing default."""

    settings_type: ClassVar[type]
    key: ClassVar[str]  # its name in run's and inspect's JSON
    rewrites_weights: ClassVar[bool] = False  # runs before the plan, returning a new model and a record
    reads_blocks: ClassVar[bool] = False  # may read the data once per layer block (see reads_data_per_block)

    # -- before the plan ---------------------------------------------------------------------

    @classmethod
    def rewrite(cls, model: onnx.ModelProto, settings, base_dir: str, sink) -> tuple[onnx.ModelProto, object]:
        """``sink``: where each weight it changes goes, one at a time (calibration.own_data.OwnData)."""
        raise NotImplementedError

    # -- the plan ----------------------------------------------------------------------------

    @classmethod
    def resolve(cls, scope: PlanScope, settings) -> object | None:
        """Its decision (None: nothing decided at plan time)."""
        return None

    @classmethod
    def notes(cls, decision, settings) -> list[str]:
        """The plan's warnings about ``decision``."""
        return []

    @classmethod
    def scaled(cls, decision) -> set[str]:
        """The chosen layers whose weights it rescales before quantizing."""
        return set()

    @classmethod
    def keep_float(cls, decision) -> set[str]:
        """Nodes it added that stay in float (never targets)."""
        return set()

    @classmethod
    def hessians_in_pass(cls, settings) -> bool:
        """Whether its rounding takes each chosen layer's input Hessian from the activation pass."""
        return False

    @classmethod
    def reads_data_per_block(cls, run, decision) -> bool:
        """Whether its passes read the data once per layer block (a CalibrationDataReader cannot)."""
        return False

    # -- pre-flight ----------------------------------------------------------------------------

    @classmethod
    def check(cls, run, calib: Calibration | None, dist: Dist | None, settings: PassSettings) -> None:
        """Refuse, before any pass, what its passes would fail on."""

    # -- the passes (on the model the pipeline owns) --------------------------------------------

    @classmethod
    def verify(cls, model_path, run, loaded, decision, batch, device: str, device_id: int) -> None:
        """A rewrite's check against the model as given, on the first batch, before any pass (``run``: the
        plan, ``loaded``: the rewritten model, calibration.decisions)."""

    @classmethod
    def for_plan(cls, run, loaded):
        """Its pre-transform (seams.PreTransform) for this plan, or None; ``loaded``: the working
        model (calibration.decisions.Loaded), to read: the pre-transform never edits it."""
        return None

    @classmethod
    def rounding(cls, run, loaded, observers, calib: Calibration, settings: PassSettings, scales):
        """Its rounding for the weight pass (seams.Rounding), or None; ``loaded``: the working model,
        to read (its blocks run on a read-only frame of it: calibration.blockwise)."""
        return None

    @classmethod
    def follow(cls, run, loaded, observers, calib: Calibration, settings: PassSettings) -> None:
        """Under torchrun, a rank other than 0's share of a rounding that every rank takes part in
        (rank 0's :meth:`rounding` leads it; GPTQ's sequential order); nothing by default."""

    @classmethod
    def metadata(cls, decision) -> dict | None:
        """What quantization_config.json records of it (compressed-tensors' transform_config), or None."""
        return None

    # -- reports -------------------------------------------------------------------------------

    @classmethod
    def record(cls, run, done) -> object | None:
        """Its typed result record from what its passes did (``done``), None when it did nothing."""
        return None

    @classmethod
    def result_lines(cls, record) -> list[str]:
        return []

    @classmethod
    def result_json(cls, record):
        return None

    @classmethod
    def inspect_lines(cls, run, decision, settings) -> list[str]:
        return []

    @classmethod
    def inspect_json(cls, run, decision, settings):
        return None


BLOCKWISE_READER = ("GPTQ's sequential order and AWQ read the data once per layer block, and a "
                    "CalibrationDataReader can be read once: pass the arrays (an .npz, a folder or a mapping), "
                    "or use --gptq-order one-pass without AWQ")


def refuse_reader(calib: Calibration | None, reads_blocks: bool) -> None:
    """The data rule of every unit that reads the data block by block, said once for all of them."""
    if calib is not None and not calib.rereadable and reads_blocks:
        raise UsageError(BLOCKWISE_READER)
