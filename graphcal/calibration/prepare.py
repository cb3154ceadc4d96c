"""prepare(): everything `run` checks before it reads a sample, shared with `inspect`.

    settings --check_device--> the device is there (--device cuda without a GPU fails here)
    model + config --plan--> RunPlan (targets, schemes, forms, sizes: graphcal.calibration.plan)
    --pass: the activation pass block by block or over the whole graph (graphcal.calibration.streamed)
    data --load_data--> the calibration data, checked against the model's inputs (headers only)
    --exclude-padding: an attention_mask among the inputs
    torchrun: this process joins the job (run only)
    each transform unit's refusals (graphcal.calibration.transforms): what its passes need of the
    data (a CalibrationDataReader is read once) and of memory

So `inspect` refuses what `run` would refuse, before either calibrates anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from graphcal.calibration.decisions import Loaded, RunPlan
from graphcal.calibration.distributed import Dist, from_env
from graphcal.calibration.plan import load, plan
from graphcal.calibration.seams import PassSettings
from graphcal.calibration.streamed import choose_pass
from graphcal.calibration.transforms import configured
from graphcal.calibration.transforms.base import refuse_reader
from graphcal.config import RunConfig
from graphcal.data import Calibration, check_padding_input, data_label, graph_inputs, load_data
from graphcal.devices import check_device


@dataclass(frozen=True)
class Prepared:
    """A run checked and ready: its plan (decisions only), the working model beside it (``loaded``:
    read and rewritten by --rotate; the pipeline owns it), its data (None: inspect without --data),
    the model's input names, and the torchrun job this process joined (None: one process)."""

    plan: RunPlan
    loaded: Loaded
    calib: Calibration | None
    inputs: tuple[str, ...]
    dist: Dist | None = None


def prepare(model: str | Path, config: RunConfig, *, target: str = "onnxruntime", matmulnbits: int | None = None,
            data=None, batch_size: int | None = None, num_samples: int | None = None, exclude_padding: bool = False,
            device: str = "auto", join: bool = False, reduce_in_graph: bool = True, pass_mode: str = "auto",
            own_folder=None) -> Prepared:
    """Check a run of ``config`` on ``model`` with ``data`` for ``target`` before any pass; ``join``
    (run only): join the torchrun job the environment describes; ``reduce_in_graph``: as the passes
    will run; ``pass_mode``: --pass (calibration.streamed.choose_pass); ``own_folder``: where the rewritten
    weights go (plan.load; the caller closes ``Prepared.loaded``). Raises GraphcalError or UsageError for
    everything that can be known before calibrating."""
    check_device(device)  # --device cuda without a usable GPU fails here, whatever the scheme
    loaded = load(model, config, own_folder)  # weight rewrites (--rotate) first
    try:
        return _checked(model, config, loaded, target, matmulnbits, data, batch_size, num_samples, exclude_padding, join,
                        reduce_in_graph, pass_mode)
    except BaseException:
        loaded.close()
        raise


def _checked(model, config: RunConfig, loaded: Loaded, target: str, matmulnbits: int | None, data, batch_size: int | None,
             num_samples: int | None, exclude_padding: bool, join: bool, reduce_in_graph: bool, pass_mode: str) -> Prepared:
    run = plan(Path(model), config, target, matmulnbits, loaded)
    inputs = graph_inputs(loaded.model)
    calib = load_data(data, inputs, batch_size=batch_size, num_samples=num_samples,
                      model_dir=Path(model).parent) if data is not None else None
    names = tuple(i.name for i in inputs)
    run = choose_pass(run, loaded, calib, pass_mode)  # block by block, or the whole graph
    if exclude_padding:
        check_padding_input(data_label(data) if data is not None else f"the model {model}", names)
    dist = from_env() if join else None  # torchrun: this rank's share of the batches
    settings = PassSettings(dist=dist, exclude_padding=exclude_padding, reduce_in_graph=reduce_in_graph)
    units = configured(run.config)
    refuse_reader(calib, any(unit.reads_data_per_block(run, run.decision(unit.settings_type)) for unit, _ in units))
    for unit, _ in units:  # each transform's own refusals, in the order they run
        unit.check(run, calib, dist, settings)
    return Prepared(run, loaded, calib, names, dist)
