"""Pre-flight memory (issue 47, criterion 5): the memory a cgroup leaves, the estimated peak of a run
from the graph alone, and run's refusal before any weight is read."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphcal.limits
from graphcal.calibration import footprint
from graphcal.calibration.prepare import prepare
from graphcal.config import Options, resolve
from tests.helpers import run_cli

# --- available memory: cgroup v1 and v2 -------------------------------------------------------------

def _meminfo(tmp_path, kb=20_000_000):
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal: 30000000 kB\nMemAvailable: {kb} kB\n")
    return str(p)


def _cgroup_v2(tmp_path, limit, current, path="user.slice/run-1.scope", parent_limit=None):
    root = tmp_path / "cg"
    leaf = root / path
    leaf.mkdir(parents=True)
    (leaf / "memory.max").write_text(f"{limit}\n")
    (leaf / "memory.current").write_text(f"{current}\n")
    if parent_limit is not None:
        (leaf.parent / "memory.max").write_text(f"{parent_limit}\n")
        (leaf.parent / "memory.current").write_text(f"{current}\n")
    proc = tmp_path / "cgroup"
    proc.write_text(f"0::/{path}\n")
    return str(proc), str(root)


def test_cgroup_v2_limit_minus_usage(tmp_path):
    proc, root = _cgroup_v2(tmp_path, 14 * 2**30, 2 * 2**30)
    assert graphcal.limits.cgroup_memory_left(proc, root) == 12 * 2**30
    assert graphcal.limits.available_memory(_meminfo(tmp_path), proc, root) == 12 * 2**30  # below MemAvailable


def test_cgroup_v2_max_is_unlimited(tmp_path):
    proc, root = _cgroup_v2(tmp_path, "max", 10**9)
    assert graphcal.limits.cgroup_memory_left(proc, root) is None
    assert graphcal.limits.available_memory(_meminfo(tmp_path, 5_000_000), proc, root) == 5_000_000 * 1024


def test_cgroup_v2_parent_limit_binds(tmp_path):
    proc, root = _cgroup_v2(tmp_path, "max", 10**9, parent_limit=3 * 10**9)
    assert graphcal.limits.cgroup_memory_left(proc, root) == 2 * 10**9


def test_cgroup_v1_limit_and_unlimited(tmp_path):
    mem = tmp_path / "cg" / "memory" / "docker" / "abc"
    mem.mkdir(parents=True)
    (mem / "memory.limit_in_bytes").write_text("6000000000\n")
    (mem / "memory.usage_in_bytes").write_text("1000000000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    assert graphcal.limits.cgroup_memory_left(str(proc), str(tmp_path / "cg")) == 5 * 10**9
    (mem / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert graphcal.limits.cgroup_memory_left(str(proc), str(tmp_path / "cg")) is None


def test_no_cgroup_file_falls_back_to_meminfo(tmp_path):
    assert graphcal.limits.available_memory(_meminfo(tmp_path, 7), str(tmp_path / "none"), str(tmp_path)) == 7 * 1024


# --- the estimate's parts, by hand ------------------------------------------------------------------

def _two_layer(folder, external=False):
    """x [b, s, 16] -> fc1 (16 -> 32) -> Relu -> fc2 (32 -> 16)."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32), "fc1.weight")
    w2 = numpy_helper.from_array(rng.standard_normal((32, 16)).astype(np.float32), "fc2.weight")
    nodes = [helper.make_node("MatMul", ["x", "fc1.weight"], ["h"], name="/fc1/MatMul"),
             helper.make_node("Relu", ["h"], ["r"], name="/act/Relu"),
             helper.make_node("MatMul", ["r", "fc2.weight"], ["y"], name="/fc2/MatMul")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", 16])], [w1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    folder.mkdir(exist_ok=True)
    path = folder / "model.onnx"
    if external:
        onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="model.onnx.data",
                        size_threshold=0)
    else:
        onnx.save_model(model, path)
    data = folder / "calib.npz"
    np.savez(data, x=np.random.default_rng(1).standard_normal((4, 3, 16)).astype(np.float32))
    return path, data


def _estimate(path, data, **options):
    ready = prepare(path, resolve(Options(**options)), data=data, batch_size=4)
    return ready, footprint.for_run(ready)


def test_parts_of_a_static_run_by_hand(tmp_path):
    path, data = _two_layer(tmp_path)
    _, fp = _estimate(path, data, scheme="W8A8_STATIC")
    assert fp.pass_kind == "whole-graph" and (fp.batch, fp.seq) == (4, 3)
    assert fp.parts["imports"] == footprint.IMPORTS
    assert fp.parts["weights in onnxruntime"] == 2 * 16 * 32 * 4  # both weights, fp32, held once
    assert fp.parts["activations"] == int(footprint.ARENA * 4 * 3 * 32 * 4)  # the largest value: h or r [4, 3, 32]
    assert fp.total == sum(fp.parts.values())


def test_parts_of_a_weight_only_run_by_hand(tmp_path):
    path, data = _two_layer(tmp_path)
    ready, fp = _estimate(path, data, scheme="W8A8")
    assert fp.pass_kind == "none" and set(fp.parts) == {"imports", "weight phase"}
    want = int(footprint.OUTPUT_HELD * ready.plan.expected_size + footprint.WEIGHT_COPIES * 16 * 32 * 4)
    assert fp.parts["weight phase"] == want


def test_one_pass_gptq_holds_every_hessian(tmp_path):
    path, data = _two_layer(tmp_path)
    _, fp = _estimate(path, data, scheme="W8A8", algorithm="gptq", gptq_order="one-pass")
    assert footprint.hessian_bytes(fp_targets(path)) == 4 * 16 * 16 + 4 * 32 * 32
    assert fp.phases["weights"] >= footprint.IMPORTS


def fp_targets(path):
    ready = prepare(path, resolve(Options(scheme="W8A8")))
    return list(ready.plan.chosen)


def test_the_shipped_model_fits():
    from tests.helpers import MODELS

    for scheme in ("W8A8_STATIC", "W4A16"):
        _, fp = _estimate(MODELS / "tiny-llama" / "model.onnx", MODELS / "tiny-llama" / "calib.npz", scheme=scheme)
        assert fp.total < 0.6e9 and fp.fits(graphcal.limits.available_memory())


# --- through the CLI --------------------------------------------------------------------------------

def _garbage_data(tmp_path):
    """A model whose external data is garbage of the right size: any weight read fails (NaN)."""
    path, data = _two_layer(tmp_path / "m", external=True)
    blob = path.parent / "model.onnx.data"
    blob.write_bytes(b"\xff" * blob.stat().st_size)
    return path, data


def test_run_refused_in_one_line_before_any_weight_is_read(tmp_path, monkeypatch):
    path, data = _garbage_data(tmp_path)
    monkeypatch.setattr(graphcal.limits, "available_memory", lambda *a, **k: 100_000_000)
    monkeypatch.setattr(graphcal.limits, "resident_memory", lambda: 0)  # as a fresh process would hold nearly
    out = tmp_path / "out"
    result = run_cli("run", path, "--data", data, "--scheme", "W8A8_STATIC", "-o", out, "-q")
    assert result.exit_code != 0
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "needs about" in errors[0] and "--ignore-memory-check" in errors[0], result.output
    assert "imports" in errors[0] and "Traceback" not in result.output
    assert not out.exists()
    # the same run past the check reads the weights, and fails on them: the refusal came first
    anyway = run_cli("run", path, "--data", data, "--scheme", "W8A8_STATIC", "-o", out, "-q", "--ignore-memory-check")
    assert anyway.exit_code != 0 and "needs about" not in anyway.output


def test_ignore_memory_check_runs(tmp_path, monkeypatch):
    path, data = _two_layer(tmp_path / "m")
    monkeypatch.setattr(graphcal.limits, "available_memory", lambda *a, **k: 100_000_000)
    monkeypatch.setattr(graphcal.limits, "resident_memory", lambda: 0)
    out = tmp_path / "out"
    assert run_cli("run", path, "--data", data, "--scheme", "W8A8_STATIC", "-o", out, "-q").exit_code != 0
    result = run_cli("run", path, "--data", data, "--scheme", "W8A8_STATIC", "-o", out, "-q", "--ignore-memory-check")
    assert result.exit_code == 0, result.output
    assert (out / "model.onnx").exists()


def test_inspect_shows_the_estimate(tmp_path, monkeypatch):
    path, data = _two_layer(tmp_path / "m")
    monkeypatch.setattr(graphcal.limits, "available_memory", lambda *a, **k: 2 * 10**9)
    text = run_cli("inspect", path, "--data", data, "--scheme", "W8A8_STATIC")
    assert text.exit_code == 0, text.output
    line = next(x for x in text.output.splitlines() if x.startswith("memory"))
    assert "peak memory ~" in line and "weights in onnxruntime" in line and "of 2.0 GB available" in line
    got = json.loads(run_cli("inspect", path, "--data", data, "--scheme", "W8A8_STATIC", "--json").output)["memory"]
    assert got["pass"] == "whole-graph" and got["available_bytes"] == 2 * 10**9
    assert got["peak_bytes"] == sum(got["parts"].values())


@pytest.mark.parametrize("margin_over", [False, True])
def test_margin(tmp_path, monkeypatch, margin_over):
    """Refused past available / MARGIN, never below the estimate itself."""
    path, data = _two_layer(tmp_path / "m")
    _, fp = _estimate(path, data, scheme="W8A8_STATIC")
    free = int(fp.total * footprint.MARGIN) + (-1 if margin_over else 1)
    assert fp.fits(free) is not margin_over


def test_memory_already_held_is_not_asked_again(tmp_path):
    """The check runs with the libraries already loaded: what the process holds is not asked of the
    available memory a second time (MemAvailable already excludes it)."""
    path, data = _two_layer(tmp_path / "m")
    _, fp = _estimate(path, data, scheme="W8A8_STATIC")
    half = fp.total // 2
    assert not fp.fits(half)  # nothing held yet: the whole peak is asked for
    assert fp.fits(half, resident=fp.total - half // 2)  # the libraries held: only the rest is
    assert 0 < graphcal.limits.resident_memory() < 1 << 40

