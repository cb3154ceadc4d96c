"""onnxruntime's u8 x s8 integer kernels on CPUs without AVX-VNNI saturate (MLAS's AVX2 kernel adds
products in pairs in int16): graphcal finds out from onnxruntime itself and warns where its output
runs on them, in run, inspect and bench."""

from __future__ import annotations

import numpy as np
import pytest

import graphcal.devices
from graphcal.devices import INT8_SATURATION_NOTE, int8_gemm_saturates
from tests.helpers import INT8_SATURATES, run_cli


def test_the_probe_agrees_with_exact_integer_arithmetic(monkeypatch):
    """graphcal's one extreme case and tests.helpers' random full-range GEMM against numpy's exact
    int32 matmul say the same of this CPU."""
    monkeypatch.setattr(graphcal.devices, "_SATURATES", None)  # ask onnxruntime, not the tests' default
    assert int8_gemm_saturates() is INT8_SATURATES


@pytest.mark.parametrize("saturates", [True, False])
def test_inspect_and_run_warn_only_where_the_kernels_saturate(monkeypatch, llama_dir, tmp_path, saturates):
    monkeypatch.setattr(graphcal.devices, "_SATURATES", saturates)
    model = str(llama_dir / "model.onnx")
    for scheme in ("W8A8", "W8A8_STATIC"):  # u8 x s8 kernels: DynamicQuantizeMatMul, MatMulIntegerToFloat
        result = run_cli("inspect", model, "--scheme", scheme)
        assert result.exit_code == 0, result.output
        assert (INT8_SATURATION_NOTE in result.output) is saturates
    # weight-only int4 (MatMulNBits) and fp8 run no u8 x s8 kernel: no warning whatever the CPU
    for extra in (["--scheme", "W4A16", "--group-size", "32"], ["--scheme", "FP8"]):
        result = run_cli("inspect", model, *extra)
        assert result.exit_code == 0, result.output
        assert INT8_SATURATION_NOTE not in result.output
    # and --target tensorrt / qdq write for other runtimes: no onnxruntime kernel to warn about
    result = run_cli("inspect", model, "--scheme", "W8A8_STATIC", "--target", "tensorrt")
    assert result.exit_code == 0 and INT8_SATURATION_NOTE not in result.output
    out = tmp_path / "out"
    result = run_cli("run", model, "--data", str(llama_dir / "calib.npz"), "--scheme", "W8A8",
                     "-o", str(out), "--json")
    assert result.exit_code == 0, result.output
    import json

    summary = json.loads(result.stdout)
    assert (INT8_SATURATION_NOTE in summary["warnings"]) is saturates


@pytest.mark.skipif(not INT8_SATURATES, reason="this CPU's onnxruntime u8 x s8 kernels are exact")
def test_where_they_saturate_the_fast_form_really_loses_accuracy(llama_dir, tmp_path):
    """What the warning says, measured: on this CPU the W8A8 model at onnxruntime's default level is
    further from the Q/DQ spec than the spec is from fp32."""
    import onnxruntime as ort

    from graphcal.calibration.pipeline import calibrate
    from graphcal.runtime import run_model
    from tests.helpers import sqnr_db

    calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "out", scheme="W8A8")
    feeds = {k: v[:8] for k, v in np.load(llama_dir / "heldout.npz").items()}
    session = ort.InferenceSession(str(tmp_path / "out" / "model.onnx"), providers=["CPUExecutionProvider"])
    fast = session.run(None, feeds)[0]
    spec = next(iter(run_model(tmp_path / "out" / "model.onnx", feeds).values()))
    fp32 = next(iter(run_model(llama_dir / "model.onnx", feeds).values()))
    assert sqnr_db(spec, fast) < sqnr_db(fp32, spec)
