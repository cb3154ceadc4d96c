"""Models written for --target onnxruntime run in onnxruntime at its default settings.

For every scheme with an onnxruntime form: the model loads at ORT_ENABLE_ALL (onnxruntime's
default), its weight MatMul/Gemm nodes become the kernel this file expects (read from the graph
onnxruntime itself optimized and saved), and its outputs agree with the same model at
ORT_ENABLE_BASIC, where the Q/DQ graph runs as the ONNX spec says (test_run checks those
numbers against compressed-tensors). The one intended difference: MatMulNBits at onnxruntime's
default accuracy level 4 quantizes its input to int8 per block, so weight-only int schemes agree
within that quantization, and within float tolerance at accuracy level 0.

The test model has three independent layers (no error carried from one into the next): two
MatMuls reading one 3-D activation (q/k/v-like: a shared input Q/DQ) and a Gemm with a bias.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper

from tests.helpers import INT8_SATURATES, LAYER_NODES, run_cli, run_layers

LAYERS = LAYER_NODES
INT8_GROUP_TOKEN = ('{"weights": {"num_bits": 8, "strategy": "group", "group_size": 128}, "input_activations": '
                    '{"num_bits": 8, "strategy": "token", "dynamic": true}}')
STATIC_ASYM = ('{"weights": {"num_bits": 8, "strategy": "channel"}, "input_activations": '
               '{"num_bits": 8, "strategy": "tensor", "symmetric": false, "dynamic": false}}')
FLOAT = "float"  # a MatMul/FusedMatMul/Gemm in float (the weight expanded at load, inputs Q/DQ'd)
# scheme -> the kernel onnxruntime 1.31 builds for the MatMuls and the Gemm (shared/reference/ort_fast_forms.md)
EXPECTED = {
    "W8A8": ("MatMulIntegerToFloat", "QGemm"),
    "INT8": ("MatMulIntegerToFloat", "QGemm"),
    "W8A8_STATIC": ("MatMulIntegerToFloat", "QGemm"),
    STATIC_ASYM: ("MatMulIntegerToFloat", "QGemm"),
    "W4A16": ("MatMulNBits", "MatMulNBits"),
    "W4A16_ASYM": ("MatMulNBits", "MatMulNBits"),
    "W8A16": ("MatMulNBits", "MatMulNBits"),
    "W4A8": (FLOAT, FLOAT),
    "W4AFP8": (FLOAT, FLOAT),
    "FP8": (FLOAT, FLOAT),
    "FP8_DYNAMIC": (FLOAT, FLOAT),
    "FP8_BLOCK": (FLOAT, FLOAT),
    INT8_GROUP_TOKEN: (FLOAT, FLOAT),
}
WEIGHT_ONLY_INT = ("W4A16", "W4A16_ASYM", "W8A16")
FLOAT_TOL = 2e-6  # relative to the output's largest magnitude: float summation order only
INT8_INPUT_TOL = 2e-2  # MatMulNBits accuracy 4: the input quantized to int8 per block (max/127)


def _session(path, level, tmp_path, **config):
    opts = ort.SessionOptions()
    opts.graph_optimization_level = level
    opts.log_severity_level = 3
    for key, value in config.items():
        opts.add_session_config_entry(key, value)
    saved = None
    if level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL:
        saved = tmp_path / f"optimized-{len(list(tmp_path.iterdir()))}.onnx"
        opts.optimized_model_filepath = str(saved)
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    return session, saved


def _outputs(path, feeds, level, tmp_path, **config):
    session, saved = _session(path, level, tmp_path, **config)
    return session.run(None, feeds), saved


def _kernels(saved) -> dict[str, str]:
    """Layer node name -> what onnxruntime made of it, read from the graph it optimized."""
    nodes = {n.name: n for n in onnx.load(str(saved)).graph.node}
    by_output = {o: n for n in nodes.values() for o in n.output}
    kinds = {}
    for name, tensor in zip(LAYERS, ("y1", "y3", "y2")):
        node = nodes.get(name) or by_output[tensor]
        while node.op_type in ("Mul", "Add"):  # the per-token scale and a moved bias come after the kernel
            node = next(by_output[i] for i in node.input if i in by_output)
        kinds[name] = FLOAT if node.op_type in ("MatMul", "FusedMatMul", "Gemm") else node.op_type
    return kinds


def _max_rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(a).max())


@pytest.mark.parametrize("scheme", list(EXPECTED), ids=lambda s: s if len(s) < 20 else "custom")
def test_every_scheme_loads_at_enable_all_and_runs_the_expected_kernel(layers, tmp_path, scheme):
    path, summary = run_layers(layers, tmp_path, scheme)
    feeds = layers[1]
    basic, _ = _outputs(path, feeds, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, tmp_path)
    fast, saved = _outputs(path, feeds, ort.GraphOptimizationLevel.ORT_ENABLE_ALL, tmp_path)
    matmuls, gemm = EXPECTED[scheme]
    assert _kernels(saved) == {LAYERS[0]: matmuls, LAYERS[1]: matmuls, LAYERS[2]: gemm}
    tol = INT8_INPUT_TOL if scheme in WEIGHT_ONLY_INT else FLOAT_TOL
    # where the u8 x s8 kernels saturate (x86 without AVX-VNNI) their numbers are not the spec's
    # (tests/test_saturation.py); the kernels chosen and run's summary are checked all the same
    exact = not (INT8_SATURATES and matmuls == "MatMulIntegerToFloat")
    for name, a, b in zip(("y1", "y3", "y2"), basic, fast):
        assert _max_rel(a, b) <= tol or not exact, name
    # what run says onnxruntime runs names the kernel
    assert summary["onnxruntime_kernels"] and all(k in " ".join(summary["onnxruntime_kernels"])
                                                  for k in {matmuls, gemm} - {FLOAT})
    if scheme in WEIGHT_ONLY_INT:  # with float inputs in the kernel: float tolerance
        exact, saved = _outputs(path, feeds, ort.GraphOptimizationLevel.ORT_ENABLE_ALL, tmp_path,
                                **{"session.qdq_matmulnbits_accuracy_level": "0"})
        assert set(_kernels(saved).values()) == {"MatMulNBits"}
        for name, a, b in zip(("y1", "y3", "y2"), basic, exact):
            assert _max_rel(a, b) <= FLOAT_TOL, name


@pytest.mark.parametrize("scheme", WEIGHT_ONLY_INT)
def test_matmulnbits_written_directly_computes_what_the_dq_form_does(layers, tmp_path, scheme):
    """--matmulnbits 0 equals the DequantizeLinear form at BASIC (float inputs); --matmulnbits
    (level 4) equals the DequantizeLinear form that onnxruntime fuses itself at its default level 4."""
    feeds = layers[1]
    dq_path, _ = run_layers(layers, tmp_path / "dq", scheme)
    dq_basic, _ = _outputs(dq_path, feeds, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, tmp_path)
    dq_all, _ = _outputs(dq_path, feeds, ort.GraphOptimizationLevel.ORT_ENABLE_ALL, tmp_path)
    for level, reference in (("0", dq_basic), ("4", dq_all)):
        path, summary = run_layers(layers, tmp_path / f"nbits{level}", scheme, "--matmulnbits", level)
        model = onnx.load(path)
        nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
        assert len(nbits) == 3 and all(n.domain == "com.microsoft" for n in nbits)
        assert {helper.get_attribute_value(a) for n in nbits for a in n.attribute if a.name == "accuracy_level"} == {int(level)}
        assert not [n for n in model.graph.node if n.op_type in ("DequantizeLinear", "MatMul", "Gemm")]
        assert f"accuracy level {level}" in " ".join(summary["onnxruntime_kernels"])
        for basic_level in (ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
            got, _ = _outputs(path, feeds, basic_level, tmp_path)  # the level is in the model: the same either way
            for name, a, b in zip(("y1", "y3", "y2"), reference, got):
                assert _max_rel(a, b) <= FLOAT_TOL, (level, name)


def test_matmulnbits_for_int8_inputs_lets_the_kernel_quantize_them(layers, tmp_path):
    """W8A8 --matmulnbits: the kernel's own per-block int8 inputs, close to compressed-tensors' per-token ones."""
    feeds = layers[1]
    exact, _ = _outputs(run_layers(layers, tmp_path / "a", "W8A8")[0], feeds, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                        tmp_path)
    path, summary = run_layers(layers, tmp_path / "b", "W8A8", "--matmulnbits")
    assert not [n for n in onnx.load(path).graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    assert "max/127" in " ".join(summary["onnxruntime_kernels"])
    got, _ = _outputs(path, feeds, ort.GraphOptimizationLevel.ORT_ENABLE_ALL, tmp_path)
    for a, b in zip(exact, got):
        assert 0 < _max_rel(a, b) <= INT8_INPUT_TOL


@pytest.mark.parametrize("scheme, extra, message", [
    ("W8A8", ["--matmulnbits", "0"], "keeps the input in float"),
    ("W8A8_STATIC", ["--matmulnbits"], "drop --matmulnbits"),
    ("W4A16", ["--matmulnbits", "--target", "tensorrt"], "use it with --target onnxruntime"),
    ('{"weights": {"num_bits": 4, "strategy": "group", "group_size": 8}}', ["--matmulnbits"], "power of two"),
])
def test_matmulnbits_refuses_what_it_cannot_write(layers, tmp_path, scheme, extra, message):
    folder, _ = layers
    result = run_cli("run", str(folder / "model.onnx"), "--data", str(folder / "calib.npz"),
                     "--scheme", scheme, "-o", str(tmp_path / "o"), *extra)
    lines = result.output.strip().splitlines()
    assert result.exit_code != 0 and len(lines) == 1 and message in lines[0], result.output
    assert not (tmp_path / "o").exists()


def test_per_token_integers_are_compressed_tensors_own(layers, tmp_path):
    """The row-normalized W8A8 form quantizes to exactly compressed-tensors' per-token integers
    (stored + 128 as uint8)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    from graphcal.graph.taps import add_taps

    path, _ = run_layers(layers, tmp_path, "W8A8")
    model = onnx.load(path)
    q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.name.startswith("fc1/"))
    tapped, names = add_taps(model, [q.output[0]])
    session = ort.InferenceSession(tapped.SerializeToString(), providers=["CPUExecutionProvider"])
    x = layers[1]["x"]
    got = session.run(names, layers[1])[0]
    args = QuantizationArgs(num_bits=8, strategy="token", dynamic=True, symmetric=True)
    xt = torch.from_numpy(x)
    amax = xt.abs().amax(dim=-1, keepdim=True)
    scale, zp = calculate_qparams(-amax, amax, args)
    expected = quantize(xt, scale, zp, args).to(torch.int16).numpy() + 128
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got.astype(np.int16), expected)
