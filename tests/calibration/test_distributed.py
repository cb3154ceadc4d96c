"""graphcal under torchrun: 2 gloo ranks on this machine, against a single process."""

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

from graphcal.errors import GraphcalError
from tests.helpers import run_cli_process

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def _torchrun(nproc: int, *args, env=None, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
         "-m", "graphcal", "run", *map(str, args), "--device", "cpu"],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )


def _single(*args):
    return run_cli_process("run", *args, "--device", "cpu", "-q", timeout=240)


@pytest.mark.parametrize("scheme, flags", [
    ("W8A8_STATIC", []),  # static_minmax activations: MIN/MAX over ranks
    ('{"weights": {"num_bits": 4, "strategy": "group", "group_size": 128, "observer": "imatrix_mse"}}', []),  # SUM
    ("W8A8_STATIC", ["--observer", "histogram_mse"]),  # histograms merged exactly
], ids=["static_minmax", "imatrix", "histogram"])
def test_two_ranks_write_what_one_process_writes(llama_dir, tmp_path, scheme, flags):
    common = [llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--scheme", scheme, *flags]
    two = _torchrun(2, *common, "-o", tmp_path / "two")
    assert two.returncode == 0, two.stderr[-2000:]
    assert "calibrated on 64 samples in 8 batches across 2 ranks" in two.stdout
    assert two.stdout.count("wrote:") == 1  # rank 0 alone reports and writes
    if "W8A8_STATIC" in scheme:  # the activation pass streamed block by block on every rank (docs/streaming.md)
        assert "streamed block by block (2 blocks)" in two.stdout
    one = _single(*common, "-o", tmp_path / "one", "--pass", "whole-graph")
    assert one.returncode == 0, one.stderr
    for name in ("model.onnx", "qparams.safetensors", "quantization_config.json"):
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name


def test_two_ranks_smooth_as_one_process(llama_dir, tmp_path):
    """SmoothQuant under torchrun (the ranges gathered, the scales broadcast, then the calibration pass
    over x/s) writes what one process writes with the ranges and the calibration in one pass."""
    common = [llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--scheme", "W8A8_STATIC",
              "--smoothquant", "all"]
    two = _torchrun(2, *common, "-o", tmp_path / "two")
    assert two.returncode == 0, two.stderr[-2000:]
    assert "smoothed 6 activation(s) first" in two.stdout
    one = _single(*common, "-o", tmp_path / "one")
    assert one.returncode == 0, one.stderr
    for name in ("model.onnx", "qparams.safetensors", "quantization_config.json"):
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    auto = _torchrun(2, *common, "--smoothing-strength", "auto", "-o", tmp_path / "auto")
    assert auto.returncode == 0, auto.stderr[-2000:]  # rank 0 scores the strengths on its own sample
    assert (tmp_path / "auto" / "model.onnx").is_file()


@pytest.mark.parametrize("order", ["one-pass", "sequential"])
def test_two_ranks_gptq_as_one_process(llama_dir, tmp_path, order):
    """GPTQ under torchrun: one-pass sums the ranks' Hessians (the same numbers up to the order of the
    sums); the sequential order is weight-parallel (test_distributed_gptq: byte for byte at one thread)."""
    common = [llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--scheme", "W4A16", "--group-size", "32",
              "--algorithm", "gptq", "--gptq-order", order, "--target", "qdq"]
    two = _torchrun(2, *common, "-o", tmp_path / "two")
    assert two.returncode == 0, two.stderr[-2000:]
    assert "GPTQ" in two.stdout and two.stdout.count("wrote:") == 1
    one = _single(*common, "-o", tmp_path / "one")
    assert one.returncode == 0, one.stderr
    a, b = (load_file(str(tmp_path / d / "qparams.safetensors")) for d in ("two", "one"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the grid: the weights' own
    ints = {}
    for d in ("two", "one"):
        model = onnx.load(tmp_path / d / "model.onnx")
        ints[d] = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == TensorProto.INT4}
    assert ints["two"].keys() == ints["one"].keys() and ints["one"]
    # torchrun runs each rank on one thread (OMP_NUM_THREADS=1): sums in another order, a rare code flips
    same = np.mean([np.mean(ints["two"][k] == ints["one"][k]) for k in ints["one"]])
    assert same > 0.999, same


def test_two_ranks_run_awq(llama_dir, tmp_path):
    """AWQ under torchrun: every rank searches over all the data (no rank waits on another's search)."""
    two = _torchrun(2, llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--scheme", "W4A16",
                    "--algorithm", "awq", "--target", "qdq", "-o", tmp_path / "two")
    assert two.returncode == 0, two.stderr[-2000:]
    assert "AWQ: scaled 6 activation(s)" in two.stdout and two.stdout.count("wrote:") == 1


def _ema_input_scales(llama_dir, ranks: int) -> dict[str, torch.Tensor]:
    """``{module}.input_scale`` by llm-compressor's rule, from activations onnxruntime computes:
    each rank's minmax EMA (first batch sets, then ``old * 0.99 + new * 0.01``) over its batches
    (every ``ranks``-th of the 8 batches of 8 samples, from the rank's index), min/max averaged
    over ranks (AVG), then compressed-tensors' calculate_qparams with W8A8_STATIC's input args."""
    from compressed_tensors.quantization.utils import calculate_qparams

    from graphcal.config import resolve_scheme
    from graphcal.graph.taps import add_taps
    from graphcal.graph.targets import find_targets
    from graphcal.runtime import open_model_runner

    model = onnx.load(llama_dir / "model.onnx")
    targets = [t for t in find_targets(model)[0] if t.name != "lm_head"]  # ignored by default
    fetch = list(dict.fromkeys(t.activation for t in targets))
    runner = open_model_runner(add_taps(model, fetch)[0], fetch)
    data = dict(np.load(llama_dir / "calib.npz"))
    stats = [dict() for _ in range(ranks)]  # rank -> activation -> (min, max)
    for index in range(8):
        values = runner.run({k: v[index * 8:(index + 1) * 8] for k, v in data.items()})
        for name in fetch:
            x = torch.from_numpy(values[name])
            new = (x.amin().reshape(1), x.amax().reshape(1))
            old = stats[index % ranks].get(name)
            stats[index % ranks][name] = new if old is None else tuple(o * 0.99 + n * 0.01 for o, n in zip(old, new))
    args = resolve_scheme("W8A8_STATIC", ["Linear"]).input_activations
    scales = {}
    for t in targets:
        lo = sum(s[t.activation][0] for s in stats) / ranks
        hi = sum(s[t.activation][1] for s in stats) / ranks
        scales[f"{t.name}.input_scale"] = calculate_qparams(lo, hi, args)[0]
    return scales


def test_moving_average_observers_average_the_ranks(llama_dir, tmp_path):
    """minmax (EMA) statistics are averaged over ranks (llm-compressor's AVG): each rank's EMA
    covers its own batches, so the result is not the single-process EMA (README says so). Both
    outputs are checked against that rule computed here on onnxruntime's activations."""
    common = [llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--scheme", "W8A8_STATIC",
              "--observer", "minmax"]
    assert _torchrun(2, *common, "-o", tmp_path / "two").returncode == 0
    assert _single(*common, "-o", tmp_path / "one").returncode == 0
    two, one = load_file(tmp_path / "two" / "qparams.safetensors"), load_file(tmp_path / "one" / "qparams.safetensors")
    assert two.keys() == one.keys()
    weights = [k for k in one if k.endswith("weight_scale")]
    assert all(torch.equal(two[k], one[k]) for k in weights)  # weights are not synced: identical
    for written, expected in ((two, _ema_input_scales(llama_dir, 2)), (one, _ema_input_scales(llama_dir, 1))):
        assert sorted(k for k in written if k.endswith("input_scale")) == sorted(expected)
        for key, scale in expected.items():
            torch.testing.assert_close(written[key], scale, rtol=1e-6, atol=0, msg=key)
    assert any(not torch.equal(two[k], one[k]) for k in one if k.endswith("input_scale"))  # the README's point


def _log_model(path):
    """y = log(x) @ W: finite for positive inputs, NaN for negative ones."""
    w = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Log", ["x"], ["lx"], name="/log/Log"),
         helper.make_node("MatMul", ["lx", "w"], ["y"], name="/fc/MatMul")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)


def test_a_failure_on_one_rank_ends_every_rank_with_an_error(tmp_path):
    _log_model(tmp_path / "m.onnx")
    x = np.random.default_rng(1).uniform(0.5, 2.0, (16, 8)).astype(np.float32)
    x[4:8] *= -1  # batch 1 (of 4 samples) only: rank 1 sees NaN inside the graph, rank 0 does not
    np.savez(tmp_path / "d.npz", x=x)
    result = _torchrun(2, tmp_path / "m.onnx", "--data", tmp_path / "d.npz", "--scheme", "W8A8_STATIC",
                       "--batch-size", "4", "-o", tmp_path / "o", env={"GRAPHCAL_DIST_TIMEOUT": "60"}, timeout=120)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert any("holds NaN or Inf in batch 1" in e for e in errors), result.stderr[-2000:]  # rank 1's own error
    assert any(e.startswith("error: rank 1 failed:") for e in errors), result.stderr[-2000:]  # rank 0 hears of it
    assert "Traceback" not in "\n".join(errors) and not (tmp_path / "o").exists()


def _gather_worker(rank, world, init, results):
    import torch.distributed as dist
    from compressed_tensors.quantization import QuantizationArgs

    from graphcal.calibration.distributed import Dist, gather_statistics, settle
    from graphcal.observers import Observer

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    obs = Observer.load_from_registry("static_minmax", base_name="input", args=QuantizationArgs(num_bits=8))
    obs(torch.full((1, 2, 3), float(rank + 1)))
    try:
        gather_statistics(Dist(rank, world, rank), [obs], ValueError("boom") if rank == 2 else None)
        results[rank] = "ok"
    except (GraphcalError, ValueError) as e:
        assert e.graphcal_exchanged  # every rank heard of it: the CLI reports, then settles
        settle(e)  # a barrier all three reach, so none exits before the others have reported
        results[rank] = f"{type(e).__name__}: {e}"
    dist.destroy_process_group()


def test_gather_statistics_reports_the_failing_rank_everywhere(tmp_path):
    import torch.multiprocessing as mp

    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_gather_worker, args=(3, f"file://{tmp_path / 'rdzv'}", results), nprocs=3, join=True)
    assert results[2] == "ValueError: boom"
    assert results[0] == results[1] == "GraphcalError: rank 2 failed: ValueError: boom"


def test_backend_comes_from_the_environment(monkeypatch):
    from graphcal.calibration.distributed import BACKEND_ENV, backend

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert backend() == "gloo"
    monkeypatch.setenv(BACKEND_ENV, " NCCL ")
    assert backend() == "nccl"
    monkeypatch.setenv(BACKEND_ENV, "mpi")
    with pytest.raises(GraphcalError, match="GRAPHCAL_DIST_BACKEND must be one of gloo, nccl, got 'mpi'"):
        backend()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without a GPU gives")
def test_nccl_without_a_gpu_is_a_one_line_error(llama_dir, tmp_path):
    result = _torchrun(2, llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--scheme", "W8A8_STATIC",
                       "-o", tmp_path / "o", env={"GRAPHCAL_DIST_BACKEND": "nccl"}, timeout=120)
    assert result.returncode != 0
    # each rank fails at once; torchrun may stop the other before it prints, so one line or two
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors and {e.split(":")[1].strip() for e in errors} <= {"rank 0", "rank 1"}, result.stderr[-2000:]
    assert all("GRAPHCAL_DIST_BACKEND=nccl needs a CUDA GPU for LOCAL_RANK" in e for e in errors)
    assert not (tmp_path / "o").exists()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: 2 GPUs")
@pytest.mark.parametrize("scheme", ["W8A8_STATIC", '{"weights": {"num_bits": 4, "strategy": "group", '
                                    '"group_size": 128, "observer": "imatrix_mse"}}'])
def test_two_nccl_ranks_on_two_gpus_write_what_one_gpu_writes(llama_dir, tmp_path, scheme):
    common = [llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--scheme", scheme]
    env = {**os.environ, "GRAPHCAL_DIST_BACKEND": "nccl"}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "graphcal", "run", *map(str, common), "--device", "cuda", "-o", str(tmp_path / "two")],
                         capture_output=True, text=True, timeout=240, env=env)
    assert two.returncode == 0, two.stderr[-2000:]
    one = run_cli_process("run", *common, "--device", "cuda", "-q", "-o", tmp_path / "one", timeout=240)
    assert one.returncode == 0, one.stderr[-2000:]
    for name in ("qparams.safetensors", "quantization_config.json"):
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
