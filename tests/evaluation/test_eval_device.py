"""eval --device auto|cpu|cuda (as run's): parsing and up-front refusals through the CLI, the CPU's numbers
against onnxruntime runs made here, the device-generic comparison (torch tensors, as a GPU session hands them
over) against the numpy one on the CPU, and, on a GPU (gpu-marked), eval, --isolated, --sensitivity and a
--fallback mix on CUDA against the same eval on the CPU."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import graphcal.evaluation.agreement as agreement_module
from graphcal.devices import check_device
from graphcal.errors import UsageError
from graphcal.evaluation import Agreement, evaluate
from graphcal.runtime import open_model_runner, open_runtime
from tests.helpers import run_cli, sqnr_db

CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"
# CUDA against the CPU: onnxruntime's CUDA kernels (TF32 matmuls where the GPU has them, another summation
# order, a Q/DQ rounding tie broken the other way now and then) move a 20-75 dB SQNR by far less than this
SQNR_TOL_DB = 0.1
COSINE_TOL = 1e-4


def _run(llama_dir, out, *flags):
    result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", out, "-q",
                     "--device", "cpu", *flags)
    assert result.exit_code == 0, result.output
    return out / "model.onnx"


@pytest.fixture(scope="module")
def static_llama(llama_dir, tmp_path_factory):
    """tiny-llama as W8A8_STATIC (activation Q/DQ: the form eval's issue measured)."""
    return _run(llama_dir, tmp_path_factory.mktemp("static") / "out", "--scheme", "W8A8_STATIC")


def _eval(llama_dir, candidate, *flags):
    return run_cli("eval", llama_dir / "model.onnx", candidate, "--data", llama_dir / "heldout.npz", *flags)


def _eval_json(llama_dir, candidate, *flags) -> dict:
    result = _eval(llama_dir, candidate, "--json", *flags)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _one_line_error(result) -> str:
    assert result.exit_code != 0, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output and "compared on" not in result.output
    return lines[0]


# -- parsing and refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize("flag, value", [("--device", "tpu"), ("--device", "gpu"), ("--device-id", "-1"),
                                         ("--device-id", "one")])
def test_an_unknown_device_is_refused_at_parse_time(llama_dir, flag, value):
    result = _eval(llama_dir, llama_dir / "model.onnx", flag, value)
    assert result.exit_code == 2
    assert _one_line_error(result).startswith(f"error: Invalid value for '{flag}'")


@pytest.mark.parametrize("settings", [{"device": "tpu"}, {"device": "CUDA"}, {"device_id": -1}, {"device_id": 0.5},
                                      {"device_id": True}])
def test_the_api_refuses_an_unknown_device_before_reading_a_model(tmp_path, settings):
    missing = tmp_path / "absent.onnx"  # never read: the refusal comes first
    with pytest.raises(UsageError, match="--device"):
        evaluate(missing, missing, tmp_path / "absent.npz", **settings)


def _cuda_runs_here() -> bool:
    try:
        check_device("cuda")
    except Exception:  # noqa: BLE001 -- any refusal: no usable CUDA provider here
        return False
    return True


def test_device_cuda_without_a_usable_gpu_is_one_line_before_any_work(llama_dir, tmp_path, monkeypatch):
    """Here onnxruntime-gpu has its CUDA provider but no GPU: devices.check_device's probe session refuses it
    up front, as run's does, before any model is read (a load would fail the test) and no --html is written."""
    if _cuda_runs_here():
        pytest.skip("onnxruntime starts its CUDA provider here")
    import graphcal.evaluation.pipeline as pipeline

    def no_load(*args, **kwargs):
        raise AssertionError("a model was read before --device cuda was refused")

    monkeypatch.setattr(pipeline, "load_models", no_load)
    page = tmp_path / "report.html"
    line = _one_line_error(_eval(llama_dir, llama_dir / "model.onnx", "--device", "cuda", "--html", page))
    assert line.startswith("error: --device cuda: onnxruntime could not start its CUDA provider"), line
    assert not page.exists()
    with pytest.raises(Exception, match="--device cuda"):  # the same from Python
        evaluate(llama_dir / "model.onnx", llama_dir / "model.onnx", llama_dir / "heldout.npz", device="cuda")


# -- the CPU: today's numbers --------------------------------------------------------------------------------

@pytest.mark.parametrize("device", [["--device", "cpu"], []], ids=["cpu", "auto"])
def test_on_the_cpu_the_numbers_are_onnxruntimes_at_basic(llama_dir, static_llama, device):
    """--device cpu (and auto where no GPU is usable) gives the numbers of plain onnxruntime runs at
    ORT_ENABLE_BASIC made here, and says it ran on the CPU provider."""
    if not device and _cuda_runs_here():
        pytest.skip("auto picks CUDA here")
    report = _eval_json(llama_dir, static_llama, *device)
    assert report["provider"] == CPU and report["runner"] == "onnxruntime"
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    feeds = dict(np.load(llama_dir / "heldout.npz"))
    ref, got = (ort.InferenceSession(str(p), opts, providers=[CPU]).run(["logits"], feeds)[0]
                for p in (llama_dir / "model.onnx", static_llama))
    out = report["outputs"][0]
    assert out["sqnr_db"] == pytest.approx(sqnr_db(ref, got), abs=1e-9)
    assert out["max_abs_error"] == pytest.approx(float(np.abs(got - ref).max()), rel=1e-6)
    assert out["max_abs_reference"] == pytest.approx(float(np.abs(ref).max()), rel=1e-6)


def test_the_text_report_names_the_provider(llama_dir, static_llama):
    result = _eval(llama_dir, static_llama, "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == "compared on 16 samples in 2 batches (onnxruntime CPUExecutionProvider, ORT_ENABLE_BASIC)"


# -- the device-generic comparison, exercised on the CPU ------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_tensors_agree_as_numpy_arrays_do(monkeypatch, dtype):
    """Agreement.add on torch tensors (what a GPU session hands over; bfloat16 too, which numpy cannot
    view) gives the float64 sums of the numpy path on the same values, over several slices (CHUNK made
    small) and batches."""
    monkeypatch.setattr(agreement_module, "CHUNK", 1000)
    gen = torch.Generator().manual_seed(0)
    numpy_side, torch_side = Agreement("x"), Agreement("x")
    for shape in [(3, 7, 111), (2, 1250)]:
        ref = torch.randn(shape, generator=gen).to(dtype)
        cand = (ref.float() + 0.05 * torch.randn(shape, generator=gen)).to(dtype)
        numpy_side.add(ref.float().numpy(), cand.float().numpy())  # exact: each type widens to float32
        torch_side.add(ref, cand)
    for key in ("ref_sq", "cand_sq", "dot", "err_sq"):
        assert getattr(torch_side, key) == pytest.approx(getattr(numpy_side, key), rel=1e-12), key
    assert (torch_side.max_abs_err, torch_side.max_abs_ref) == (numpy_side.max_abs_err, numpy_side.max_abs_ref)
    with pytest.raises(Exception, match="shapes differ"):
        torch_side.add(torch.zeros(3), torch.zeros(4))


def _add_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4])
    graph = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["sq"]), helper.make_node("Add", ["sq", "x"], ["y"])],
                              "add", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def test_a_torch_feed_runs_as_its_numpy_array_and_the_cpu_runner_returns_numpy():
    """Runtime.run takes a torch tensor as a feed (on a GPU: bound where it lies; --isolated feeds the
    reference's activations so); a CPU runner's outputs stay numpy arrays, with its provider named."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4) - 5
    runtime = open_runtime(_add_model(), ["y"], device="cpu")
    from_torch = runtime.run({"x": torch.from_numpy(x)})["y"]
    from_numpy = runtime.run({"x": x})["y"]
    assert torch.equal(from_torch, from_numpy) and torch.equal(from_numpy, torch.from_numpy(x * x + x))
    runner = open_model_runner(_add_model(), ["y"], device="cpu", shared=True)
    assert runner.provider == CPU and runner.device.type == "cpu"
    assert isinstance(runner.run({"x": x})["y"], np.ndarray)


# -- CUDA against the CPU (gpu-marked: the lead runs them on a GPU) -------------------------------------------

@pytest.fixture
def on_the_gpu(monkeypatch):
    """Records where each compared tensor lay when Agreement reduced it: on CUDA they must be GPU tensors."""
    seen = []
    add = Agreement._add_torch

    def spy(self, ref, cand):
        seen.append((ref.device.type, cand.device.type))
        return add(self, ref, cand)

    monkeypatch.setattr(Agreement, "_add_torch", spy)
    return seen


def _close(got: dict, want: dict, where: str) -> None:
    """One agreement's numbers on CUDA (``got``) against the CPU's (``want``)."""
    assert got["name"] == want["name"], where
    if want["sqnr_db"] is None:  # exact (a layer left in float): within float error on the GPU too
        assert got["sqnr_db"] is None or got["sqnr_db"] > 60, (where, got)
    else:
        assert got["sqnr_db"] == pytest.approx(want["sqnr_db"], abs=SQNR_TOL_DB), (where, got, want)
    assert got["cosine"] == pytest.approx(want["cosine"], abs=COSINE_TOL), (where, got, want)
    assert got["max_abs_reference"] == pytest.approx(want["max_abs_reference"], rel=1e-2), (where, got, want)
    assert got["max_abs_error"] == pytest.approx(want["max_abs_error"], rel=0.5), (where, got, want)


def _both(llama_dir, candidate, *flags) -> tuple[dict, dict]:
    cpu = _eval_json(llama_dir, candidate, "--device", "cpu", *flags)
    cuda = _eval_json(llama_dir, candidate, "--device", "cuda", *flags)
    assert cpu["provider"] == CPU and cuda["provider"] == CUDA
    return cuda, cpu


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [[], ["--isolated"], ["--level", "all"]], ids=["paired", "isolated", "all"])
def test_eval_on_cuda_gives_the_cpus_numbers(llama_dir, static_llama, on_the_gpu, flags):
    cuda, cpu = _both(llama_dir, static_llama, *flags)
    assert on_the_gpu and all(devices == ("cuda", "cuda") for devices in on_the_gpu), on_the_gpu
    for got, want in zip(cuda["outputs"], cpu["outputs"], strict=True):
        _close(got, want, "output")
    for got, want in zip(cuda["layers"], cpu["layers"], strict=True):
        _close({k: v for k, v in got.items() if k != "isolated_sqnr_db"},
               {k: v for k, v in want.items() if k != "isolated_sqnr_db"}, "layer")
        if "isolated_sqnr_db" in want:
            assert got["isolated_sqnr_db"] == pytest.approx(want["isolated_sqnr_db"], abs=SQNR_TOL_DB), got["name"]
    assert cuda["samples"] == cpu["samples"] and cuda["batches"] == cpu["batches"]


@pytest.mark.gpu
def test_sensitivity_on_cuda_gives_the_cpus_numbers(llama_dir, static_llama, on_the_gpu):
    cuda, cpu = (r["sensitivity"] for r in _both(llama_dir, static_llama, "--sensitivity", "--per-layer"))
    assert on_the_gpu and all(devices == ("cuda", "cuda") for devices in on_the_gpu), on_the_gpu
    alone = {a["name"]: a for a in cpu["alone"]}
    assert sorted(alone) == sorted(a["name"] for a in cuda["alone"])
    for a in cuda["alone"]:
        _close(a["outputs"][0], alone[a["name"]]["outputs"][0], a["name"])
    # the options follow the ranking, where two kinds may lie closer than the tolerance: those named alike agree
    options = {tuple(o["kinds"]): o for o in cpu["options"]}
    assert len(cuda["options"]) == len(options)
    assert cuda["options"][0]["kinds"] == cpu["options"][0]["kinds"]  # o_proj: the worst by several dB
    for o in cuda["options"]:
        if tuple(o["kinds"]) in options:
            _close(o["expected_outputs"][0], options[tuple(o["kinds"])]["expected_outputs"][0], str(o["kinds"]))


@pytest.fixture(scope="module")
def int4_and_int8(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    return (_run(llama_dir, root / "W4A16", "--scheme", "W4A16", "--group-size", "32"),
            _run(llama_dir, root / "W8A16", "--scheme", "W8A16"))


@pytest.mark.gpu
def test_a_fallback_mix_on_cuda_gives_the_cpus_numbers(llama_dir, int4_and_int8, on_the_gpu):
    low, high = int4_and_int8
    cuda, cpu = (r["mix"] for r in _both(llama_dir, low, "--fallback", high, "--size-budget", "1.2"))
    assert on_the_gpu and all(devices == ("cuda", "cuda") for devices in on_the_gpu), on_the_gpu
    assert cuda["low_sqnr_db"] == pytest.approx(cpu["low_sqnr_db"], abs=SQNR_TOL_DB)
    base = 10 ** (-cpu["low_sqnr_db"] / 10)  # the low model's noise: what each unit's gain is a share of
    for got, want in zip(cuda["units"], cpu["units"], strict=True):
        assert (got["name"], got["bytes_added"]) == (want["name"], want["bytes_added"])
        assert got["noise_removed"] == pytest.approx(want["noise_removed"], abs=0.02 * base), got["name"]
    assert sorted(cuda["chosen"]) == sorted(cpu["chosen"]) and cuda["bytes"] == cpu["bytes"]
    _close(cuda["expected_outputs"][0], cpu["expected_outputs"][0], "mix")
