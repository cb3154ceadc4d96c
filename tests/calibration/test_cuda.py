"""The CUDA path: taps stay on the GPU from onnxruntime to the observers, weights are observed there.

References: plain onnxruntime on CUDA (``session.run`` into numpy) for the activations, and
compressed-tensors' ``calculate_qparams`` on them for the written scales. The CPU run is a
loose second check only: onnxruntime's CUDA kernels (TF32 matmuls on Ampere and later) round
differently from its CPU ones. Skipped without a GPU and onnxruntime-gpu's CUDA provider.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from graphcal.devices import observer_device
from graphcal.graph.taps import add_taps
from graphcal.graph.targets import find_targets, torch_weight
from graphcal.runtime import open_runtime
from tests.graph.test_ort_forms import EXPECTED
from tests.helpers import load_written, run_cli, run_layers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or "CUDAExecutionProvider" not in ort.get_available_providers(),
        reason="needs a CUDA GPU, a CUDA torch and onnxruntime-gpu",
    ),
]


def _cuda_session_run(model: onnx.ModelProto, feeds: dict, outputs: list[str]) -> dict[str, np.ndarray]:
    """The reference: onnxruntime on CUDA through its ordinary API, results copied into numpy."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CUDAExecutionProvider"])
    return dict(zip(outputs, sess.run(outputs, feeds)))


def test_taps_come_back_on_the_gpu_as_onnxruntime_computes_them(llama_dir):
    model = onnx.load(llama_dir / "model.onnx")
    acts = list(dict.fromkeys(t.activation for t in find_targets(model)[0]))
    tapped, fetch = add_taps(model, acts)
    feeds = {k: v[:4] for k, v in np.load(llama_dir / "calib.npz").items()}
    rt = open_runtime(tapped, fetch, device="cuda")
    assert rt.provider == "CUDAExecutionProvider" and rt.device == torch.device("cuda", 0)
    values = rt.run(feeds)
    reference = _cuda_session_run(tapped, feeds, fetch)
    for name in fetch:
        assert values[name].device.type == "cuda", f"{name} made a host round trip"
        np.testing.assert_allclose(values[name].cpu().numpy(), reference[name], rtol=1e-5, atol=1e-6)


def test_observers_see_gpu_tensors_and_scales_follow_compressed_tensors(llama_dir, tmp_path, monkeypatch):
    """W8A8_STATIC in one batch: each input scale is calculate_qparams of the CUDA activations' range."""
    from compressed_tensors.quantization.utils import calculate_qparams

    from graphcal.calibration.pipeline import calibrate
    from graphcal.config import build_config
    from graphcal.observers import Observer

    seen = []
    real_call, real_extrema = Observer.__call__, Observer.observe_extrema

    def spy_call(self, x):
        seen.append((self.base_name, x.device.type))
        return real_call(self, x)

    def spy_extrema(self, lo, hi):
        seen.append((self.base_name, lo.device.type))
        return real_extrema(self, lo, hi)

    monkeypatch.setattr(Observer, "__call__", spy_call)
    monkeypatch.setattr(Observer, "observe_extrema", spy_extrema)
    data = dict(np.load(llama_dir / "calib.npz"))
    n = len(next(iter(data.values())))
    result = calibrate(llama_dir / "model.onnx", data, tmp_path / "gpu", scheme="W8A8_STATIC", device="cuda",
                       batch_size=n)
    assert result.provider == "CUDAExecutionProvider"
    assert {kind for kind, _ in seen} == {"weight", "input"}
    assert {device for _, device in seen} == {"cuda"}, "an observer ran on the host"

    model = onnx.load(llama_dir / "model.onnx")
    targets = {t.name: t for t in find_targets(model)[0]}
    chosen = [targets[item.target.name] for item in result.targets]
    acts = list(dict.fromkeys(t.activation for t in chosen))
    tapped, fetch = add_taps(model, acts)
    taps = _cuda_session_run(tapped, data, fetch)
    _, written = load_written(tmp_path / "gpu")
    args = build_config("W8A8_STATIC", ["Linear"], ["lm_head"], None, None).scheme_for(chosen[0]).input_activations
    for t in chosen:
        x = torch.from_numpy(taps[t.activation])
        scale, _ = calculate_qparams(x.min().reshape(1), x.max().reshape(1), args)
        torch.testing.assert_close(written[f"{t.name}.input_scale"].reshape(1), scale, rtol=0, atol=0)
        weight = torch.from_numpy(torch_weight(model, t))
        w_scale, _ = calculate_qparams(weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True),
                                       build_config("W8A8_STATIC", ["Linear"], [], None, None)
                                       .scheme_for(t).weights)
        torch.testing.assert_close(written[f"{t.name}.weight_scale"], w_scale, rtol=0, atol=0)

    cpu = calibrate(llama_dir / "model.onnx", data, tmp_path / "cpu", scheme="W8A8_STATIC", device="cpu",
                    batch_size=n)
    on_cpu = cpu.qparams
    for key, value in result.qparams.items():  # same weights; activations within the kernels' rounding
        torch.testing.assert_close(value, on_cpu[key], rtol=2e-2, atol=0)


@pytest.mark.parametrize("scheme, observer", [("W4A16", "mse"), ("W4A16", "imatrix_mse"), ("NVFP4", None)])
def test_weight_searches_on_the_gpu_match_the_cpu(llama_dir, tmp_path, scheme, observer):
    """Weight-side searches run where the activations were; the chosen scales match the CPU's."""
    from graphcal.calibration.pipeline import calibrate

    runs = {}
    for device in ("cuda", "cpu"):
        runs[device] = calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / device,
                                 scheme=scheme, observer=observer, device=device,
                                 target="qdq" if scheme == "NVFP4" else "onnxruntime").qparams
    for key, value in runs["cuda"].items():
        if key.endswith("weight_scale") or key.endswith("weight_global_scale"):
            same = (value.float() == runs["cpu"][key].float()).float().mean().item()
            assert same > 0.99, f"{key}: only {same:.1%} of the scales agree"


@pytest.mark.parametrize("scope, strength, observer", [("all", None, None), ("mul", "auto", None),
                                                      ("norms", None, "minmax")])
def test_smoothquant_on_the_gpu_matches_the_cpu(llama_dir, tmp_path, scope, strength, observer):
    """SmoothQuant on CUDA (ranges reduced there, replayed or tapped as x/s; minmax takes the two-pass
    path): the same mappings, and scales within the CUDA kernels' rounding of the CPU's."""
    import json

    import onnx

    from graphcal.calibration.pipeline import calibrate

    runs, records = {}, {}
    for device in ("cuda", "cpu"):
        result = calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / device, scheme="W8A8_STATIC",
                           smoothquant=scope, smoothing_strength=strength, observer=observer, device=device)
        assert device == "cpu" or result.provider == "CUDAExecutionProvider"
        runs[device] = result.qparams
        model = onnx.load(tmp_path / device / "model.onnx")
        records[device] = json.loads(next(p.value for p in model.metadata_props if p.key == "graphcal.smoothquant"))
    assert [m["balance"] for m in records["cuda"]["mappings"]] == [m["balance"] for m in records["cpu"]["mappings"]]
    for key, value in runs["cuda"].items():
        torch.testing.assert_close(value, runs["cpu"][key], rtol=2e-2, atol=0)


def test_observer_device_follows_the_session():
    assert observer_device("CUDAExecutionProvider", "auto", 0) == torch.device("cuda", 0)
    assert observer_device("CPUExecutionProvider", "cuda", 0) == torch.device("cpu")
    assert observer_device(None, "cuda", 0) == torch.device("cuda", 0)


@pytest.mark.parametrize("scheme", list(EXPECTED), ids=lambda s: s if len(s) < 20 else "custom")
def test_onnxruntime_forms_load_on_cuda_at_enable_all(layers, tmp_path, scheme):
    """Every model written for onnxruntime loads on its CUDA provider at the default ORT_ENABLE_ALL
    and computes what it computes on the CPU at ORT_ENABLE_BASIC (the Q/DQ spec), within the
    CUDA kernels' rounding (TF32 matmuls) and, for MatMulNBits, fp16-class weight-only GEMMs."""
    path, _ = run_layers(layers, tmp_path, scheme)
    feeds = layers[1]
    cpu = ort.InferenceSession(str(path), _basic(), providers=["CPUExecutionProvider"]).run(None, feeds)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(str(path), opts, providers=["CUDAExecutionProvider"])
    assert session.get_providers()[0] == "CUDAExecutionProvider"
    for a, b in zip(cpu, session.run(None, feeds)):
        assert float(np.abs(a - b).max() / np.abs(a).max()) <= 2e-2


def _basic():
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opts.log_severity_level = 3
    return opts


def test_awq_and_its_clip_search_on_the_gpu_match_the_cpu(llama_dir, tmp_path):
    """AWQ with --awq-clip on CUDA: the parents rerun there and the clip errors come from Gram
    matrices there. The same mappings and clipped layers as on the CPU, the errors each search
    reduces within the CUDA kernels' rounding, and a model as close to fp32 (eval, onnxruntime)."""
    import json

    import onnx


    records, sqnr = {}, {}
    for device in ("cuda", "cpu"):
        out = tmp_path / device
        result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--scheme", "W4A16",
                         "--group-size", "32", "--algorithm", "awq", "--awq-clip", "--device", device, "-o", out, "-q")
        assert result.exit_code == 0, result.output
        model = onnx.load(str(out / "model.onnx"))
        records[device] = json.loads(next(p.value for p in model.metadata_props if p.key == "graphcal.awq"))
        result = run_cli("eval", llama_dir / "model.onnx", out / "model.onnx", "--data", llama_dir / "heldout.npz", "--json")
        assert result.exit_code == 0, result.output
        sqnr[device] = json.loads(result.output)["outputs"][0]["sqnr_db"]
    cuda, cpu = records["cuda"], records["cpu"]
    assert [m["balance"] for m in cuda["mappings"]] == [m["balance"] for m in cpu["mappings"]]
    assert [c["layer"] for c in cuda["clip"]] == [c["layer"] for c in cpu["clip"]] and cpu["clip"]
    for got, want in zip(cuda["mappings"] + cuda["clip"], cpu["mappings"] + cpu["clip"]):
        assert got["initial_error"] == pytest.approx(want["initial_error"], rel=2e-2)
        assert got["best_error"] <= got["initial_error"]
    assert sqnr["cuda"] > sqnr["cpu"] - 1.0, sqnr
