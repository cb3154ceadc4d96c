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


def test_inline_weights_reach_onnxruntime_as_buffers_of_every_type():
    """Weights of 1 KB and more are handed over as buffers (stubs in the graph), bf16 and fp16
    included; int4 and small ones stay in the graph. Reference: onnxruntime on the intact model."""
    import ml_dtypes
    from onnx import TensorProto, helper, numpy_helper

    from graphcal.runtime import _inline_weights_apart

    rng = np.random.default_rng(0)
    w16 = numpy_helper.from_array(rng.standard_normal((32, 16)).astype(np.float16), "w16")
    wbf = helper.make_tensor("wbf", TensorProto.BFLOAT16, [16, 64],
                             rng.standard_normal((16, 64)).astype(ml_dtypes.bfloat16).view(np.uint16).tobytes(), raw=True)
    w4 = helper.make_tensor("w4", TensorProto.INT4, [8, 600], rng.integers(-8, 8, 4800).tolist())
    small = numpy_helper.from_array(np.ones(4, np.float32), "small")
    nodes = [
        helper.make_node("MatMul", ["x", "w16"], ["h"]),
        helper.make_node("Cast", ["h"], ["hf"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["wbf"], ["wf"], to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["hf", "wf"], ["y0"]),
        helper.make_node("DequantizeLinear", ["w4", "one"], ["w4f"]),
        helper.make_node("ReduceSum", ["w4f"], ["s"], keepdims=0),
        helper.make_node("Mul", ["y0", "s"], ["y1"]),
        helper.make_node("Slice", ["y1", "zero", "four", "one_axis"], ["y2"]),
        helper.make_node("Add", ["y2", "small"], ["y"]),
    ]
    consts = [numpy_helper.from_array(np.float32(1.0), "one"), numpy_helper.from_array(np.array([0]), "zero"),
              numpy_helper.from_array(np.array([4]), "four"), numpy_helper.from_array(np.array([1]), "one_axis")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                              initializer=[w16, wbf, w4, small, *consts])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    stubbed, names, _ = _inline_weights_apart(model)
    assert sorted(names) == ["w16", "wbf"]  # not w4 (packed int4), nor the constants under 1 KB
    assert all(i.data_location == TensorProto.EXTERNAL for i in stubbed.graph.initializer if i.name in names)
    assert {i.name for i in stubbed.graph.initializer} == {i.name for i in model.graph.initializer}
    feeds = {"x": rng.standard_normal((2, 32)).astype(np.float16)}
    got = open_runtime(model, ["y"], device="cpu").run(feeds)["y"].numpy()
    np.testing.assert_array_equal(got, ort_run(model, feeds)["y"])
