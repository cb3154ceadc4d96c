"""--rotate streamed: the fold writes each rotated weight into the run's own data file (calibration.own_data)
as it is made, and every later stage reads it from there lazily (issue 47).

The reference is the fold's in-memory form (algorithms.rotation.fold.InMemory: every rotated weight an
inline initializer, what --rotate did before): the written bytes must be the same. Memory is checked in a
child process: the fold's peak does not grow with the model's depth."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

import graphcal.limits
from graphcal.algorithms.rotation.fold import InMemory
from graphcal.calibration import footprint
from graphcal.calibration import plan as plan_module
from graphcal.calibration.own_data import OwnData
from graphcal.calibration.prepare import prepare
from graphcal.config import Options
from graphcal.config import resolve as resolve_options
from graphcal.errors import GraphcalError
from graphcal.graph.external import resolve
from tests.helpers import MODELS, REPO, run_cli
from tools.lib.decoder import DecoderShape, make_decoder
from tools.lib.synthetic import save_npz

LLAMA = MODELS / "tiny-llama"


class MemorySink(InMemory):
    """OwnData's stand-in with the fold's in-memory form: the reference."""

    def __init__(self, folder=None, prefix=""):
        pass

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


def folder_state(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def written(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != ".graphcal-manifest.json"}


def both(tmp_path, monkeypatch, model, data, *args):
    """What a streamed-fold run and an in-memory-fold run write; the streamed one's pieces written counted."""
    puts = []
    real_put = OwnData.put

    def counting(self, array):
        puts.append(array.nbytes)
        return real_put(self, array)

    before = folder_state(model.parent)
    with monkeypatch.context() as m:
        m.setattr(OwnData, "put", counting)
        streamed = run_cli("run", model, "--data", data, *args, "-o", tmp_path / "streamed", "--json")
    assert streamed.exit_code == 0, streamed.output
    with monkeypatch.context() as m:
        m.setattr(plan_module, "OwnData", MemorySink)
        memory = run_cli("run", model, "--data", data, *args, "-o", tmp_path / "memory", "--json")
    assert memory.exit_code == 0, memory.output
    assert folder_state(model.parent) == before  # the model folder as given, never modified
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory", "streamed"]  # nothing left beside -o
    return puts, written(tmp_path / "streamed"), written(tmp_path / "memory")


@pytest.mark.parametrize("args", [
    ("--scheme", "W4A16", "--rotate", "R1"),
    ("--scheme", "W8A8_STATIC", "--rotate", "R1,R2"),
    ("--scheme", "W4A16", "--algorithm", "gptq", "--rotate", "R1,R2"),
], ids=["rtn-r1", "static-r2", "gptq-r2"])
def test_a_streamed_fold_writes_the_in_memory_folds_bytes(tmp_path, monkeypatch, args):
    puts, a, b = both(tmp_path, monkeypatch, LLAMA / "model.onnx", LLAMA / "calib.npz", *args)
    assert puts  # the rotated weights went through the run's own file
    assert a == b


def decoder(folder, layers: int = 3, hidden: int = 64, intermediate: int = 128, vocab: int = 128, tie: bool = False):
    make_decoder(folder, DecoderShape(hidden=hidden, layers=layers, intermediate=intermediate, heads=4, kv_heads=2,
                                      vocab=vocab, tie=tie), seed=5)
    ids = np.random.default_rng(2).integers(0, vocab, (4, 16), dtype=np.int64)
    save_npz(folder / "calib.npz", {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    return folder


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("args", [
    ("--scheme", "W4A16", "--group-size", "32", "--rotate", "R1"),
    ("--scheme", "W8A8_STATIC", "--rotate", "R1,R2", "--batch-size", "2"),
], ids=["rtn-r1", "static-r2"])
def test_a_decoder_with_external_data_folds_streamed_to_the_same_bytes(tmp_path, monkeypatch, args, tie):
    model = decoder(tmp_path / "model", tie=tie)
    (tmp_path / "runs").mkdir()
    puts, a, b = both(tmp_path / "runs", monkeypatch, model / "model.onnx", model / "calib.npz", *args)
    assert len(puts) >= 3 * 7  # every layer's seven weights, one at a time
    assert a == b


def test_only_the_runs_own_tensors_are_read_outside_the_models_folder(tmp_path):
    """A tensor the run wrote is found by its absolute path; the same reference in a model, or any other
    range of the file, is refused as every reference out of the model's folder is."""
    own = OwnData(lambda: tmp_path)
    try:
        piece = own.put(np.arange(300, dtype=np.float32))
        own.finish()
        t = piece.tensor("w")
        assert resolve(t, tmp_path / "elsewhere").length == 1200
        with pytest.raises(GraphcalError, match="absolute path"):
            resolve(t, tmp_path / "elsewhere", own=False)  # a model read from disk: no exemption
        forged = onnx.TensorProto()
        forged.CopyFrom(t)
        forged.dims[:] = [100]
        for e in forged.external_data:
            if e.key == "length":
                e.value = "400"
        with pytest.raises(GraphcalError, match="absolute path"):
            resolve(forged, tmp_path / "elsewhere")
    finally:
        own.close()
    assert not any(tmp_path.iterdir())  # its folder removed
    with pytest.raises(GraphcalError, match="absolute path"):
        resolve(t, tmp_path / "elsewhere")  # and its registration dropped


CHILD = """
import json, resource, sys
from graphcal.calibration.plan import load
from graphcal.config import Options, resolve
config = resolve(Options(scheme="W4A16", rotate="R1"))
loaded = load(sys.argv[1], config)
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
loaded.close()
"""


def test_the_folds_memory_does_not_grow_with_depth(tmp_path):
    """Peak RSS of the fold on 2 and 8 layers of the same widths (each weight read lazily: 1 MB and more) stays
    within a few MB: one weight in hand at a time (the in-memory fold held 14 MB more a layer here)."""
    peaks = {}
    for layers in (2, 8):
        model = decoder(tmp_path / str(layers), layers=layers, hidden=512, intermediate=2048, vocab=2048)
        done = subprocess.run([sys.executable, "-c", CHILD, model / "model.onnx"], capture_output=True, text=True,
                              timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stderr[-2000:]
        peaks[layers] = json.loads(done.stdout.strip().splitlines()[-1])
    assert peaks[8] - peaks[2] < 24 * 2**20, {k: v // 2**20 for k, v in peaks.items()}


def test_the_estimate_counts_the_fold_and_the_check(tmp_path):
    """--rotate's phase in the pre-flight: the fold's one weight in hand, or the check's whole-graph sessions."""
    ready = prepare(LLAMA / "model.onnx", resolve_options(Options(scheme="W8A8_STATIC", rotate="R1")),
                    data=LLAMA / "calib.npz", batch_size=4)
    try:
        fp = footprint.for_run(ready)
        model = ready.loaded.model
        largest = max(4 * int(np.prod(t.dims)) for t in model.graph.initializer)
        act = int(footprint.ARENA * footprint.largest_intermediate(model, {k: np.shape(v) for k, v in ready.calib.first_batch()
                                                                           .items()}, {t.node for t in ready.plan.chosen}))
        check = footprint.float_initializer_bytes(model) + act // fp.batch
        assert fp.phases["rotation"] == footprint.IMPORTS + max(int(footprint.FOLD_COPIES * largest), check)
    finally:
        ready.loaded.close()


def test_a_rotated_run_past_the_memory_available_is_refused_in_one_line(tmp_path, monkeypatch):
    """The fold no longer needs the model in memory; the pre-flight refuses the run in one line, nothing left."""
    monkeypatch.setattr(graphcal.limits, "available_memory", lambda *a, **k: 2_000_000)  # the model file fits (1.5 MB)
    monkeypatch.setattr(graphcal.limits, "resident_memory", lambda: 0)  # as a fresh process would hold nearly
    result = run_cli("run", LLAMA / "model.onnx", "--data", LLAMA / "calib.npz", "--scheme", "W8A8_STATIC",
                     "--rotate", "R1", "-o", tmp_path / "out")
    assert result.exit_code != 0
    assert result.output.strip().splitlines()[-1].startswith("error: this run needs about")
    assert not any(tmp_path.iterdir())  # no output, no temporary folder with the rotated weights
