"""onnxruntime session: the provider really used is read back, never assumed."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from graphcal.errors import GraphcalError, UsageError
from graphcal.graph.targets import find_targets
from graphcal.graph.taps import add_taps
from graphcal.runtime import cuda_usable, open_runtime
from tests.helpers import ort_run


def test_taps_come_back_as_torch_tensors_in_one_pass(llama_dir):
    model = onnx.load(llama_dir / "model.onnx")
    acts = [t.activation for t in find_targets(model)[0]]
    tapped, fetch = add_taps(model, acts + acts[:2])
    assert fetch == list(dict.fromkeys(acts))  # deduplicated, in order
    assert len(model.graph.output) == 1  # the input model is untouched
    feeds = {k: v[:2] for k, v in np.load(llama_dir / "calib.npz").items()}
    rt = open_runtime(tapped, fetch, device="cpu")
    assert rt.provider == "CPUExecutionProvider"
    values = rt.run(feeds)
    reference = ort_run(tapped, feeds, fetch)  # plain onnxruntime at ORT_ENABLE_BASIC
    for name in fetch:
        np.testing.assert_array_equal(values[name].numpy(), reference[name])


def test_cuda_without_a_usable_gpu_is_a_clear_error(llama_dir):
    if cuda_usable():
        pytest.skip("a GPU is usable here")
    model = onnx.load(llama_dir / "model.onnx")
    with pytest.raises(GraphcalError, match="--device cuda"):
        open_runtime(model, ["logits"], device="cuda")
    assert open_runtime(model, ["logits"], device="auto").provider == "CPUExecutionProvider"


def test_observers_work_on_the_host_without_a_cuda_session():
    from graphcal.runtime import observer_device

    assert observer_device("CPUExecutionProvider", "auto") == torch.device("cpu")
    assert observer_device(None, "cpu") == torch.device("cpu")
    if not torch.cuda.is_available():  # a CPU-only torch observes on the host whatever onnxruntime runs on
        assert observer_device("CUDAExecutionProvider", "cuda") == torch.device("cpu")


def test_unknown_device():
    with pytest.raises(UsageError, match="--device must be one of"):
        open_runtime(onnx.ModelProto(), [], device="tpu")


@pytest.mark.gpu
def test_cuda_provider_runs_on_a_gpu(llama_dir):
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime without the CUDA provider")
    model = onnx.load(llama_dir / "model.onnx")
    rt = open_runtime(model, ["logits"], device="cuda")
    assert rt.provider == "CUDAExecutionProvider"
    feeds = {k: v[:2] for k, v in np.load(llama_dir / "calib.npz").items()}
    cpu = ort_run(model, feeds)["logits"]
    logits = rt.run(feeds)["logits"]
    assert logits.device.type == "cuda"  # handed over through DLPack, no host round trip
    np.testing.assert_allclose(logits.cpu().numpy(), cpu, atol=1e-4)
