"""onnxruntime session: the provider really used is read back, never assumed."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from graphcal.devices import cuda_usable
from graphcal.errors import GraphcalError, UsageError
from graphcal.graph.taps import add_taps
from graphcal.graph.targets import find_targets
from graphcal.runtime import open_runtime


def _plain_ort(model: onnx.ModelProto, feeds: dict, outputs: list[str] | None = None) -> dict[str, np.ndarray]:
    """The reference for open_runtime itself: a plain CPU session at ORT_ENABLE_BASIC (``session.run``,
    the model serialized whole), not graphcal.runtime.run_model, which opens its session with open_runtime."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = outputs or [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


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
    reference = _plain_ort(tapped, feeds, fetch)  # plain onnxruntime at ORT_ENABLE_BASIC
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
    from graphcal.devices import observer_device

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
    cpu = _plain_ort(model, feeds)["logits"]
    logits = rt.run(feeds)["logits"]
    assert logits.device.type == "cuda"  # handed over through DLPack, no host round trip
    # onnxruntime's CUDA matmuls run in TF32 on Ampere and later (10 mantissa bits): ~1e-3 relative
    np.testing.assert_allclose(logits.cpu().numpy(), cpu, atol=2e-3 * np.abs(cpu).max())


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
    np.testing.assert_array_equal(got, _plain_ort(model, feeds)["y"])


def test_run_model_is_onnxruntime_or_onnx_reference(llama_dir):
    """graphcal.runtime.run_model: onnxruntime on CPU where it runs the model (a path or a proto;
    a plain session's numbers), onnx.reference's for a model with fp4 weights."""
    from onnx import TensorProto, helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    from graphcal.runtime import open_model_runner, run_model

    feeds = {k: v[:2] for k, v in np.load(llama_dir / "heldout.npz").items()}
    runner = open_model_runner(llama_dir / "model.onnx")
    assert runner.kind == "onnxruntime" and runner.outputs == ["logits"]
    np.testing.assert_array_equal(runner.run(feeds)["logits"], _plain_ort(onnx.load(llama_dir / "model.onnx"), feeds)["logits"])

    w = helper.make_tensor("w", TensorProto.FLOAT4E2M1, [2, 3], [0.5, 1.0, -6.0, 3.0, 0.0, -1.5])
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["w", "s"], ["wf"]), helper.make_node("MatMul", ["x", "wf"], ["y"])],
        "fp4", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
        initializer=[w, numpy_helper.from_array(np.float32(0.25), "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=11)
    x = {"x": np.array([[1.0, 2.0]], np.float32)}
    assert open_model_runner(model).kind == "onnx.reference"
    got = run_model(model, x)["y"]
    np.testing.assert_array_equal(got, ReferenceEvaluator(model).run(None, x)[0])
    np.testing.assert_array_equal(got, np.array([[0.5 * 0.25 + 3.0 * 0.5, 1.0 * 0.25 + 0.0, -6.0 * 0.25 - 1.5 * 0.5]],
                                                np.float32))

