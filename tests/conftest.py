"""Shared fixtures: shipped models, exported variants, and a GPU skip."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _int8_kernels_exact(monkeypatch):
    """graphcal warns where onnxruntime's int8 kernels saturate on the CPU it runs on
    (graphcal.devices.int8_gemm_saturates); tests about other things see the same warnings on every
    CPU. tests/test_saturation.py asks the real CPU."""
    import graphcal.devices

    monkeypatch.setattr(graphcal.devices, "_SATURATES", False)


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test, as llm-compressor's vectors were made (LAPACK/BLAS results depend on
    the thread count); the count is restored after."""
    import torch  # lazy: collection of tests that never use it stays light

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def llama_dir() -> Path:
    return MODELS / "tiny-llama"


@pytest.fixture(scope="session")
def bert_dir() -> Path:
    return MODELS / "tiny-bert"


@pytest.fixture(scope="session")
def builder_model(tmp_path_factory):
    """(a tiny onnxruntime-genai builder model's fp32 folder, token-only calibration data), built once
    per session by the builder offline (tests/genai_models.py); skipped without onnxruntime-genai."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai-cuda is not installed (the test extra)")
    from tests.genai_models import build_tiny_genai

    return build_tiny_genai(tmp_path_factory.mktemp("genai"))


@pytest.fixture(scope="session")
def tied_builder_model(tmp_path_factory):
    """Like ``builder_model``, with lm_head tied to the embedding table (the builder keeps one
    initializer, read by the Gather through a Transpose)."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai-cuda is not installed (the test extra)")
    from tests.genai_models import build_tiny_genai

    return build_tiny_genai(tmp_path_factory.mktemp("genai_tied"), tied=True)


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """Export forms made at test time: ``exported("dynamo")`` / ``exported("nofold")`` -> model path."""
    cache: dict[str, Path] = {}

    def make(form: str) -> Path:
        if form not in cache:
            from graphcal.export import export_torch
            from tools.builders import build_tiny_llama

            model, inputs, output_names, dynamic_axes = build_tiny_llama()
            path = tmp_path_factory.mktemp(form) / "model.onnx"
            if form == "dynamo":
                export_torch(model, inputs, path, output_names=output_names, dynamo=True, opset=18)
            elif form == "nofold":
                export_torch(model, inputs, path, output_names=output_names, dynamic_axes=dynamic_axes,
                             constant_folding=False)
            else:
                raise ValueError(form)
            cache[form] = path
        return cache[form]

    return make



@pytest.fixture(scope="module")
def layers(tmp_path_factory):
    """A model with three independent weight layers (two MatMuls reading one 3-D activation, a Gemm
    with a bias), calibration data with uneven channels, and feeds: (folder, feeds)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from tests.helpers import LAYER_NODES

    rng = np.random.default_rng(0)
    folder = tmp_path_factory.mktemp("layers")
    weights = {"w1": (256, 256), "w3": (256, 128), "w2": (128, 256)}  # MatMul [in, out]; Gemm transB [out, in]
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.1).astype(np.float32), n) for n, s in weights.items()]
    inits.append(numpy_helper.from_array(rng.standard_normal(128).astype(np.float32), "b2"))
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["y1"], name=LAYER_NODES[0]),
             helper.make_node("MatMul", ["x", "w3"], ["y3"], name=LAYER_NODES[1]),
             helper.make_node("Gemm", ["x2", "w2", "b2"], ["y2"], name=LAYER_NODES[2], transB=1)]
    graph = helper.make_graph(
        nodes, "layers",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 256]),
         helper.make_tensor_value_info("x2", TensorProto.FLOAT, ["batch", 256])],
        [helper.make_tensor_value_info("y1", TensorProto.FLOAT, ["batch", "seq", 256]),
         helper.make_tensor_value_info("y3", TensorProto.FLOAT, ["batch", "seq", 128]),
         helper.make_tensor_value_info("y2", TensorProto.FLOAT, ["batch", 128])],
        initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, folder / "model.onnx")
    x = (rng.standard_normal((16, 8, 256)) * np.linspace(0.1, 3, 256)).astype(np.float32)
    np.savez(folder / "calib.npz", x=x, x2=x[:, 0, :].copy())
    feeds = {"x": x[:4], "x2": x[:4, 1, :].copy()}
    return folder, feeds
