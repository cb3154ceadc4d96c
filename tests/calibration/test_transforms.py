"""The transform units (graphcal.calibration.transforms): one class per algorithm, found by the type of
its settings record; the pipeline, prepare/inspect and the summaries walk the registry; a weight
rewrite (--rotate) runs before the plan and hands the plan a model and a record."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper

from graphcal.calibration import transforms
from graphcal.calibration.plan import load, plan
from graphcal.calibration.transforms.base import Transform
from graphcal.cli import cli
from graphcal.cli.options import resolve_options
from graphcal.config import AWQSettings, GPTQSettings, Options, RotationSettings, RunConfig, Smoothing, resolve
from graphcal.errors import UsageError
from graphcal.graph.io import load_model


def test_every_settings_record_finds_its_unit_and_the_units_run_in_order():
    config = resolve(Options(scheme="W4A16", algorithm="awq+gptq"))
    config.rotate = ("R1",)
    assert [type(s) for s in config.transform_settings()] == [RotationSettings, AWQSettings, GPTQSettings]
    assert [unit.key for unit, _ in transforms.configured(config)] == ["rotation", "awq", "gptq"]
    assert {kind: unit.settings_type for kind, unit in transforms.REGISTRY.items()} == {
        kind: kind for kind in (RotationSettings, Smoothing, AWQSettings, GPTQSettings)}
    assert transforms.configured(resolve(Options(scheme="W8A8"))) == []


def _weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


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
    assert run.decision(RotationSettings) is record and run.model is loaded.model
    after = _weights(run.model)
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
        def with_probe(*args, **kwargs):
            config = resolve_options(*args, **kwargs)
            config.probe = _Probe(refuse)
            return config
        monkeypatch.setattr("graphcal.cli.inspect.resolve_options", with_probe)
    return options


def test_a_unit_added_to_the_registry_is_planned_checked_and_shown_by_inspect(probe, llama_dir):
    probe(refuse=False)
    result = CliRunner().invoke(cli, ["inspect", str(llama_dir / "model.onnx"), "--scheme", "W8A8"])
    assert result.exit_code == 0, result.output
    assert "probe    14 chosen" in result.output  # its plan-time decision and its inspect line
    assert "warning: probe: 14 chosen" in result.output  # its note among the plan's warnings
    probe(refuse=True)
    result = CliRunner().invoke(cli, ["inspect", str(llama_dir / "model.onnx"), "--scheme", "W8A8"])
    assert result.exit_code != 0 and "error: probe refuses this run" in result.output  # its pre-flight refusal
    assert "Traceback" not in result.output
