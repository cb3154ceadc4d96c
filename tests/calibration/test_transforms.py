"""The transform units (graphcal.calibration.transforms): one class per algorithm, found by the type of
its settings record; the pipeline, prepare/inspect and the summaries walk the registry; a weight
rewrite (--rotate) runs before the plan and hands the plan a model and a record."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import pytest

from graphcal.calibration import transforms
from graphcal.calibration.plan import load, plan
from graphcal.calibration.transforms.base import Transform
from graphcal.config import AWQSettings, GPTQSettings, Options, RotationSettings, RunConfig, Smoothing, resolve
from graphcal.errors import UsageError
from graphcal.graph.io import load_model
from tests.helpers import run_cli


def test_every_settings_record_finds_its_unit_and_the_units_run_in_order():
    config = resolve(Options(scheme="W4A16", algorithm="awq+gptq"))
    config.rotate = ("R1",)
    assert [type(s) for s in config.transform_settings()] == [RotationSettings, AWQSettings, GPTQSettings]
    assert [unit.key for unit, _ in transforms.configured(config)] == ["rotation", "awq", "gptq"]
    assert {kind: unit.settings_type for kind, unit in transforms.REGISTRY.items()} == {
        kind: kind for kind in (RotationSettings, Smoothing, AWQSettings, GPTQSettings)}
    assert transforms.configured(resolve(Options(scheme="W8A8"))) == []


def _weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    from graphcal.graph.weight_path import weight_as_consumed  # the rotated weights lie in the run's own data file

    return {t.name: weight_as_consumed(t, [], {}, ".") for t in model.graph.initializer}


def test_the_rotation_runs_before_the_plan_and_the_plan_rotates_nothing(llama_dir):
    """load() returns the rotated model and the fold's record; plan() on it decides, and edits no
    weight: the rotated weights are those a fold of the model file gives (algorithms.rotation.fold)."""
    from graphcal.algorithms.rotation.fold import rotate

    path = llama_dir / "model.onnx"
    config = resolve(Options(scheme="W4A16"))
    config.rotate = ("R1",)
    loaded = load(path, config)
    record = loaded.records[RotationSettings]
    reference = load_model(path)
    rotate(reference, str(llama_dir), heads=False)  # the fold alone (R1), on the file as given
    want = _weights(reference)
    got = _weights(loaded.model)
    assert set(got) == set(want) and all(np.array_equal(got[n], want[n]) for n in want)
    run = plan(path, config, loaded=loaded)
    assert run.decision(RotationSettings) is record
    after = _weights(loaded.model)
    assert all(np.array_equal(after[n], want[n]) for n in want)  # the plan edited no weight


@dataclass(frozen=True)
class _Probe:
    """A settings record no unit of graphcal's has."""

    refuse: bool = False


class _ProbeUnit(Transform):
    settings_type = _Probe
    key = "probe"

    @classmethod
    def resolve(cls, scope, settings):
        return f"{len(scope.chosen)} chosen"

    @classmethod
    def notes(cls, decision, settings):
        return [f"probe: {decision}"]

    @classmethod
    def check(cls, run, calib, dist, settings):
        if run.config.probe.refuse:
            raise UsageError("probe refuses this run")

    @classmethod
    def inspect_lines(cls, run, decision, settings, blocks):
        return [f"probe    {decision}"]

    @classmethod
    def inspect_json(cls, run, decision, settings, blocks):
        return None if decision is None else {"decision": decision}


@pytest.fixture
def probe(monkeypatch):
    """A unit added as a class and a registry entry (and its settings in the RunConfig), nothing else."""
    monkeypatch.setitem(transforms.REGISTRY, _Probe, _ProbeUnit)
    monkeypatch.setattr(RunConfig, "probe", None, raising=False)
    monkeypatch.setattr(RunConfig, "transform_settings",
                        lambda self: tuple(s for s in (self.rotation, self.smoothing, self.awq, self.gptq, self.probe)
                                           if s is not None))

    def options(refuse: bool):
        import graphcal.config

        resolve = graphcal.config.resolve

        def with_probe(*args, **kwargs):
            config = resolve(*args, **kwargs)
            config.probe = _Probe(refuse)
            return config
        monkeypatch.setattr(graphcal.config, "resolve", with_probe)  # inspect resolves the flags' Options
    return options


def test_a_unit_added_to_the_registry_is_planned_checked_and_shown_by_inspect(probe, llama_dir):
    probe(refuse=False)
    result = run_cli("inspect", llama_dir / "model.onnx", "--scheme", "W8A8")
    assert result.exit_code == 0, result.output
    assert "probe    14 chosen" in result.output  # its plan-time decision and its inspect line
    assert "warning: probe: 14 chosen" in result.output  # its note among the plan's warnings
    probe(refuse=True)
    result = run_cli("inspect", llama_dir / "model.onnx", "--scheme", "W8A8")
    assert result.exit_code != 0 and "error: probe refuses this run" in result.output  # its pre-flight refusal
    assert "Traceback" not in result.output


def test_block_runs_read_the_weights_as_they_were_when_the_frame_was_made(llama_dir):
    """Blockwise's frame is made at construction: the weight pass may drop every initializer of the
    model meanwhile (as its dead-path clean-up does) and a block still computes what the model as
    loaded computes (onnxruntime at ORT_ENABLE_BASIC on the model file, the block's outputs exposed)."""
    from graphcal.calibration.blockwise import Blockwise
    from graphcal.data import graph_inputs, load_data
    from graphcal.runtime import run_model

    path = llama_dir / "model.onnx"
    config = resolve(Options(scheme="W4A16", algorithm="gptq"))
    loaded = load(path, config)
    run = plan(path, config, loaded=loaded)
    arrays = {k: v[:4] for k, v in np.load(llama_dir / "calib.npz").items()}
    calib = load_data(arrays, graph_inputs(loaded.model), batch_size=2)
    walk = Blockwise(run, loaded, calib, device="cpu")
    names = walk.needed(0)
    assert names
    del loaded.model.graph.initializer[:]  # what the weight pass may do to the model after the frame is made
    got = walk.run_block(0, names)
    reference = load_model(path)
    reference.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names)
    for i, batch in enumerate(calib.batches()):
        want = run_model(reference, {k: v for k, v in batch.items() if k in {x.name for x in reference.graph.input}},
                         names)
        for n in names:
            np.testing.assert_allclose(got[n][i], want[n], rtol=1e-5, atol=1e-5)
