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
    """--rotate's phase in the pre-flight: the fold's one weight in hand, or the check's sessions: on a decoder
    block by block (one block's weights, or the tail's largest), else whole-graph (every weight)."""
    ready = prepare(LLAMA / "model.onnx", resolve_options(Options(scheme="W8A8_STATIC", rotate="R1")),
                    data=LLAMA / "calib.npz", batch_size=4)
    try:
        fp = footprint.for_run(ready)
        model = ready.loaded.model
        largest = max(4 * int(np.prod(t.dims)) for t in model.graph.initializer)
        act = int(footprint.ARENA * footprint.largest_intermediate(model, {k: np.shape(v) for k, v in ready.calib.first_batch()
                                                                           .items()}, {t.node for t in ready.plan.chosen}))
        held = max(footprint.block_weight_bytes(model, ready.plan), max(footprint._init_bytes(t) for t in model.graph.initializer))
        assert held < footprint.float_initializer_bytes(model)
        check = held + act // fp.batch
        assert fp.phases["rotation"] == footprint.IMPORTS + max(int(footprint.FOLD_COPIES * largest), check)
        whole = footprint.rotation_parts(model, act // fp.batch)  # a graph without layer blocks
        assert sum(whole.values()) == max(int(footprint.FOLD_COPIES * largest),
                                          footprint.float_initializer_bytes(model) + act // fp.batch)
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


# -- the check streamed block by block -------------------------------------------------------------------------------


def check_both(model, rotate: str, device: str = "cpu", sessions: list | None = None, data=None):
    """The check's SQNRs whole-graph and block by block (``device``: the streamed one's), on a prepared run
    (``data``: the model's calib.npz unless given)."""
    import graphcal.calibration.blockwise as blockwise
    from graphcal.calibration.transforms import rotation
    from graphcal.config import RotationSettings

    ready = prepare(model, resolve_options(Options(scheme="W8A8_STATIC", rotate=rotate)),
                    data=data or model.parent / "calib.npz", batch_size=4)
    try:
        run, loaded = ready.plan, ready.loaded
        assert rotation.streams_check(run, loaded)
        decision, batch = run.decision(RotationSettings), ready.calib.first_batch()
        whole = rotation.check_rotation(model, loaded.model, decision, batch)
        real_open = blockwise.open_runtime

        def counted(sub, *args, weights=(), **kwargs):
            if sessions is not None:
                sessions.append(sum(footprint._init_bytes(t) for t in weights))
            return real_open(sub, *args, weights=weights, **kwargs)

        def no_whole_graph(*args, **kwargs):
            raise AssertionError("a whole-graph session in the streamed check")

        with pytest.MonkeyPatch.context() as m:
            m.setattr(rotation, "_run", no_whole_graph)
            m.setattr(blockwise, "open_runtime", counted)
            streamed = rotation.check_rotation(model, loaded.model, decision, batch, device, streamed=(run, loaded))
        return whole, streamed, footprint.float_initializer_bytes(loaded.model), decision
    finally:
        ready.loaded.close()


@pytest.mark.parametrize("rotate", ["R1", "R1,R2"])
@pytest.mark.parametrize("which", ["tiny-llama", "decoder", "decoder-tied"])
def test_the_streamed_check_measures_what_the_whole_graph_check_does(tmp_path, which, rotate):
    """Block by block (one block's weights in a session, then the tail's) the check measures the SQNRs the
    whole-graph sessions measure, each far over the floor; no session holds every weight."""
    model = LLAMA / "model.onnx" if which == "tiny-llama" else decoder(tmp_path / "m", tie=which.endswith("tied")) / "model.onnx"
    sessions = []
    whole, streamed, total, _ = check_both(model, rotate, sessions=sessions)
    assert list(streamed) == list(whole) == ["logits"]
    for name, db in whole.items():
        assert db > 100 and streamed[name] > 100 and abs(streamed[name] - db) < 1, (whole, streamed)
    assert len(sessions) >= 2 * 3 and max(sessions) < total  # both models: their blocks and tails


@pytest.mark.parametrize("fixture", ["builder_model", "tied_builder_model"])
def test_the_streamed_check_turns_r2s_present_values_back_as_the_whole_graph_check_does(request, fixture):
    """onnxruntime-genai's builder model (GroupQueryAttention): R2 turns its present values per head, which
    each block makes as a graph output; block by block they are turned back and measure as whole-graph."""
    folder, calib = request.getfixturevalue(fixture)
    whole, streamed, _, decision = check_both(folder / "model.onnx", "R1,R2", data=calib)
    assert list(streamed) == list(whole) and set(decision.turned_outputs) & set(whole)
    for name, db in whole.items():
        assert db > 100 and streamed[name] > 100 and abs(streamed[name] - db) < 1, (whole, streamed)


def test_a_drift_is_refused_by_the_streamed_check_before_any_pass_nothing_written(tmp_path, monkeypatch):
    """One rotated weight of the middle layer scaled after the fold: the block-by-block check finds the logits
    far off and stops the run in one line, before any calibration pass; -o never made, the model untouched."""
    refused(tmp_path, monkeypatch, "--device", "cpu")


def refused(tmp_path, monkeypatch, *args):
    import graphcal.calibration.streamed as streamed
    from graphcal.calibration.transforms import rotation
    from tests.algorithms.test_rotation_trust import _corrupting, _scale_initializer

    model = decoder(tmp_path / "m")
    before = folder_state(model)
    _corrupting(monkeypatch, _scale_initializer("model.layers.1.mlp.down_proj", 1.5))

    def no_pass(*args, **kwargs):
        raise AssertionError("a calibration pass ran")

    def no_whole_graph(*args, **kwargs):
        raise AssertionError("a whole-graph session in the streamed check")

    monkeypatch.setattr(streamed, "_walk", no_pass)
    monkeypatch.setattr(rotation, "_run", no_whole_graph)
    out = tmp_path / "out"
    result = run_cli("run", model / "model.onnx", "--data", model / "calib.npz", "--scheme", "W8A8_STATIC",
                     "--rotate", "R1", *args, "-o", out)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --rotate: the rotated model drifts from the model as given "
                                                   "on the first calibration sample: output 'logits' at "), lines
    assert not out.exists() and folder_state(model) == before


RUN_CHILD = """
import json, resource, sys
import graphcal.calibration.transforms.rotation as rotation
from graphcal import calibrate
from graphcal.config import Options, resolve
if sys.argv[4] == "whole-graph":
    rotation.streams_check = lambda run, loaded: False
calibrate(sys.argv[1], sys.argv[2], sys.argv[3], config=resolve(Options(scheme="W4A16", rotate="R1")))
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
"""


def run_peaks(tmp_path, check: str = "streamed") -> dict[int, int]:
    """Peak RSS of a --rotate R1 W4A16 run in a child process, on 2 and 8 layers of the same widths."""
    peaks = {}
    for layers in (2, 8):
        model = tmp_path / str(layers)
        if not model.exists():
            decoder(model, layers=layers, hidden=512, intermediate=2048, vocab=2048)
        out = tmp_path / f"out-{layers}-{check}"
        done = subprocess.run([sys.executable, "-c", RUN_CHILD, model / "model.onnx", model / "calib.npz", out, check],
                              capture_output=True, text=True, timeout=300, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stderr[-2000:]
        peaks[layers] = json.loads(done.stdout.strip().splitlines()[-1])
    return peaks


def test_a_rotated_runs_memory_does_not_grow_with_depth(tmp_path):
    """Peak RSS of a whole --rotate run (fold, check, pass, weights) on 2 and 8 layers stays within a few MB:
    the check holds one block's weights in onnxruntime (its whole-graph sessions grew 36 MB a layer here)."""
    peaks = run_peaks(tmp_path)
    assert peaks[8] - peaks[2] < 24 * 2**20, {k: v // 2**20 for k, v in peaks.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("rotate", ["R1", "R1,R2"])
def test_the_streamed_check_on_cuda_measures_what_the_cpu_check_does(tmp_path, rotate):
    """On CUDA, block by block: the SQNRs of the whole-graph check on the CPU, within float error; and a
    drift refused there too."""
    whole, streamed, _, _ = check_both(decoder(tmp_path / "m") / "model.onnx", rotate, device="cuda")
    assert list(streamed) == list(whole)
    for name, db in whole.items():
        assert db > 60 and streamed[name] > 60 and abs(streamed[name] - db) < 3, (whole, streamed)


@pytest.mark.gpu
def test_a_drift_is_refused_by_the_streamed_check_on_cuda(tmp_path, monkeypatch):
    refused(tmp_path, monkeypatch, "--device", "cuda")
