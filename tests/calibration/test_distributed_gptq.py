"""Sequential GPTQ under torchrun (calibration.transforms.gptq_ranks): 2 gloo ranks on this machine
against one process, the owners' bin-packing, and failures on one rank ending every rank."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from safetensors.torch import load_file

from graphcal.calibration.transforms.gptq_ranks import EXACT_ENV, exact_limit, owners
from graphcal.errors import GraphcalError
from tests.calibration.test_distributed import _torchrun
from tests.helpers import run_cli_process

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # what torchrun gives each rank: one process compared at the same threads


def _single(*args, env=None):
    return run_cli_process("run", *args, "--device", "cpu", "-q", timeout=240, env=env)


def test_owners_pack_the_largest_units_first_onto_the_least_loaded_rank():
    assert owners([5, 9, 1, 9, 4], 2) == [0, 0, 1, 1, 1]  # 9 -> 0, 9 -> 1, 5 -> 0 (a tie: the lower), 4 and 1 -> 1
    assert owners([3, 3, 3], 1) == [0, 0, 0]
    assert owners([], 4) == []
    assert owners([1, 1], 4) == [0, 1]  # more ranks than units: the others own nothing this block


def test_the_exact_limit_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(EXACT_ENV, "0.5")
    assert exact_limit() == 2**19
    monkeypatch.setenv(EXACT_ENV, "-1")
    with pytest.raises(GraphcalError, match="GRAPHCAL_GPTQ_EXACT_MB must be a finite number >= 0"):
        exact_limit()


SCHEMES = {"W4A16": ["--scheme", "W4A16", "--group-size", "32", "--target", "qdq"],  # INT4 codes to compare
           "W8A8_STATIC": ["--scheme", "W8A8_STATIC"]}


@pytest.fixture(scope="module")
def one_process(llama_dir, tmp_path_factory):
    """The files one process writes (at one thread, as each torchrun rank runs), by scheme: made once."""
    made = {}

    def get(scheme):
        if scheme not in made:
            out = tmp_path_factory.mktemp("one") / scheme
            one = _single(*_common(llama_dir, scheme), "-o", out, env=ONE_THREAD)
            assert one.returncode == 0, one.stderr
            made[scheme] = out
        return made[scheme]
    return get


def _common(llama_dir, scheme):
    return [llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", *SCHEMES[scheme], "--algorithm", "gptq"]


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_two_ranks_round_what_one_process_rounds(llama_dir, tmp_path, one_process, scheme):
    """Each rank's batches through each block, each unit's grams summed on its owner in one process's
    batch order, rounded there, broadcast: the same files as one process, byte for byte."""
    two = _torchrun(2, *_common(llama_dir, scheme), "-o", tmp_path / "two")
    assert two.returncode == 0, two.stderr[-2000:]
    assert "GPTQ (layer block by layer block): 14 weights rounded" in two.stdout
    assert two.stdout.count("wrote:") == 1  # rank 0 alone reports and writes
    one = one_process(scheme)
    for name in ("model.onnx", "qparams.safetensors", "quantization_config.json"):
        assert (tmp_path / "two" / name).read_bytes() == (one / name).read_bytes(), name


def test_partial_sums_past_the_exact_limit_round_nearly_what_one_process_rounds(llama_dir, tmp_path, one_process):
    """Past GRAPHCAL_GPTQ_EXACT_MB each rank sends one partial sum per input, added in rank order: the
    Hessian up to fp32 rounding, so the grid is the same and a rare code may flip."""
    two = _torchrun(2, *_common(llama_dir, "W4A16"), "-o", tmp_path / "two", env={EXACT_ENV: "0"})
    assert two.returncode == 0, two.stderr[-2000:]
    dirs = {"two": tmp_path / "two", "one": one_process("W4A16")}
    a, b = (load_file(str(d / "qparams.safetensors")) for d in dirs.values())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the grid: the weights' own
    ints = {}
    for key, d in dirs.items():
        model = onnx.load(d / "model.onnx")
        ints[key] = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == TensorProto.INT4}
    assert ints["two"].keys() == ints["one"].keys() and ints["one"]
    same = np.mean([np.mean(ints["two"][k] == ints["one"][k]) for k in ints["one"]])
    assert same > 0.999, same


def _log_model(path, w: np.ndarray):
    """y = log(x) @ W (one GPTQ target, its own block): finite for positive inputs, NaN for negative ones."""
    graph = helper.make_graph(
        [helper.make_node("Log", ["x"], ["lx"], name="/log/Log"),
         helper.make_node("MatMul", ["lx", "w"], ["y"], name="/fc/MatMul")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])], [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)


@pytest.mark.parametrize("where", ["data of rank 1", "weight"])
def test_a_failure_on_one_rank_ends_every_rank_with_an_error(tmp_path, where):
    """rank 1's batch makes NaN in the block's input (its Hessian run fails), or the weight holds NaN
    (rank 0's grid fails): the other rank hears of it at the next check-in, and both end with error:."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 16)).astype(np.float32)
    x = rng.uniform(0.5, 2.0, (16, 32)).astype(np.float32)
    if where == "weight":
        w[3, 5] = np.nan
    else:
        x[4:8] *= -1  # batch 1 (of 4 samples): rank 1's
    _log_model(tmp_path / "m.onnx", w)
    np.savez(tmp_path / "d.npz", x=x)
    result = _torchrun(2, tmp_path / "m.onnx", "--data", tmp_path / "d.npz", "--scheme", "W4A16", "--group-size", "32",
                       "--algorithm", "gptq", "--batch-size", "4", "-o", tmp_path / "o",
                       env={"GRAPHCAL_DIST_TIMEOUT": "60"}, timeout=120)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    failing, own = (1, "holds NaN or Inf in block") if where != "weight" else (0, "holds 1 NaN or Inf value(s)")
    assert any(own in e and "failed" not in e for e in errors), result.stderr[-2000:]  # the failing rank's own
    assert any(e.startswith(f"error: rank {failing} failed:") for e in errors), result.stderr[-2000:]  # the other's
    assert "Traceback" not in "\n".join(errors) and not (tmp_path / "o").exists()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one GPU per rank: 2 GPUs")
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_two_gpu_ranks_round_what_one_gpu_rounds(llama_dir, tmp_path, backend):
    """On CUDA (each rank on cuda:LOCAL_RANK, GPTQ on the owner's GPU, the rounded weights sent through
    the host): the files one process writes on one GPU."""
    common = [*_common(llama_dir, "W4A16"), "--device", "cuda"]
    env = {"GRAPHCAL_DIST_BACKEND": backend}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "graphcal", "run", *map(str, common), "-o", str(tmp_path / "two")],
                         capture_output=True, text=True, timeout=240, env={**os.environ, **env})
    assert two.returncode == 0, two.stderr[-2000:]
    one = run_cli_process("run", *common, "-q", "-o", tmp_path / "one", timeout=240, env=ONE_THREAD)
    assert one.returncode == 0, one.stderr[-2000:]
    for name in ("model.onnx", "qparams.safetensors", "quantization_config.json"):
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
