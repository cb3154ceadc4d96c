"""One owner of the working model: the plan (RunPlan) is a frozen record of decisions and holds no
model; prepare() returns the model beside it (decisions.Loaded), and the pipeline hands that model to
each stage, the weight pass editing it into the output."""

from __future__ import annotations

import dataclasses
import typing
from types import MappingProxyType

import numpy as np
import onnx
import pytest

from graphcal.calibration import pipeline
from graphcal.calibration.decisions import Loaded, RunPlan
from graphcal.calibration.prepare import prepare
from graphcal.config import Options, resolve
from graphcal.runtime import run_model
from tests.helpers import sqnr_db


def test_the_plan_is_a_frozen_record_of_decisions_without_a_model(llama_dir):
    hints = typing.get_type_hints(RunPlan)
    assert not any("ModelProto" in str(hints[f.name]) for f in dataclasses.fields(RunPlan))
    assert not any(hasattr(RunPlan, name) for name in ("model", "take_model", "held", "types"))
    path = llama_dir / "model.onnx"
    ready = prepare(path, resolve(Options(scheme="W8A8_STATIC", smoothquant="mul", algorithm="gptq")),
                    data=llama_dir / "calib.npz", num_samples=4)
    run = ready.plan
    for f in dataclasses.fields(run):  # nothing in it is a model, or a box one could be put in
        value = getattr(run, f.name)
        assert not isinstance(value, onnx.ModelProto | list | dict | set), f.name
        if isinstance(value, typing.Mapping):
            assert isinstance(value, MappingProxyType), f.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.chosen = ()
    assert isinstance(ready.loaded, Loaded) and isinstance(ready.loaded.model, onnx.ModelProto)
    assert ready.inputs == tuple(i.name for i in ready.loaded.model.graph.input)


def test_the_weight_pass_edits_the_model_prepare_returned_into_the_output(llama_dir, tmp_path, monkeypatch):
    """SmoothQuant, GPTQ's sequential blocks and the weight pass all get the one model prepare() read
    (no second load): the weight pass writes its Q/DQ into that object. The output is still right:
    its logits at ORT_ENABLE_BASIC near the fp32 model's, and the input file is untouched."""
    path = llama_dir / "model.onnx"
    before = path.read_bytes()
    seen = []

    def spy(*args, **kwargs):
        seen.append(ready := prepare(*args, **kwargs))
        return ready

    monkeypatch.setattr(pipeline, "prepare", spy)
    pipeline.calibrate(path, llama_dir / "calib.npz", tmp_path / "out", scheme="W8A8_STATIC", smoothquant="mul",
                       algorithm="gptq", num_samples=8)
    (ready,) = seen
    ops = {n.op_type for n in ready.loaded.model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops  # the owned model, edited in place into the output
    assert path.read_bytes() == before
    with np.load(llama_dir / "heldout.npz") as data:
        feeds = {k: v[:4] for k, v in data.items()}
    fp32 = run_model(path, feeds)["logits"]
    got = run_model(tmp_path / "out" / "model.onnx", feeds)["logits"]
    assert sqnr_db(fp32, got) > 15
