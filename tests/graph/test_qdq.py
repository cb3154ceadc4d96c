"""The Q/DQ writer on small graphs built in code, checked against compressed-tensors' fake_quantize.

qparams here come from compressed-tensors' calculate_qparams on plain min/max, not from graphcal's
observers, so the writer is checked on its own.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams, compute_dynamic_scales_and_zp
from onnx import TensorProto, helper, numpy_helper

from graphcal.errors import GraphcalError
from graphcal.graph.qdq import QDQWriter, TargetRuntime, ir_for_opset, items_opset
from graphcal.graph.targets import find_targets, torch_weight
from graphcal.runtime import run_model
from graphcal.types import QParams, QuantizedTarget
from tests.helpers import write_qdq

W_CHANNEL = QuantizationArgs(num_bits=8, strategy="channel", symmetric=True)
A_STATIC = QuantizationArgs(num_bits=8, strategy="tensor", symmetric=True, dynamic=False)
A_TOKEN = QuantizationArgs(num_bits=8, strategy="token", symmetric=True, dynamic=True)


def _model(nodes, inits, x_shape, opset=17):
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * len(x_shape))], initializer=inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _items(model, x, wargs=W_CHANNEL, aargs=None):
    items = []
    for t in find_targets(model)[0]:
        w = torch.from_numpy(torch_weight(model, t))
        if wargs.strategy == "channel":
            scale, zp = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), wargs)
        else:
            scale, zp = calculate_qparams(w.amin().reshape(1), w.amax().reshape(1), wargs)
        qp = {"weight": QParams(scale, zp)}
        if aargs is not None and not aargs.dynamic:
            s, z = calculate_qparams(x.amin().reshape(1), x.amax().reshape(1), aargs)
            qp["input"] = QParams(s, z)
        scheme = QuantizationScheme(targets=["Linear"], weights=wargs, input_activations=aargs)
        items.append(QuantizedTarget(t, scheme, qp))
    return items


def _fq_input(x, item):
    a = item.scheme.input_activations
    if a is None:
        return x
    if a.dynamic:
        s, z = compute_dynamic_scales_and_zp(x, a, None)
        return fake_quantize(x, s, z, a)
    return fake_quantize(x, item.qparams["input"].scale, item.qparams["input"].zero_point, a)


def _fq_weight(model, item):
    w = torch.from_numpy(torch_weight(model, item.target))
    qp = item.qparams["weight"]
    return fake_quantize(w, qp.scale, qp.zero_point, item.scheme.weights)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_gemm_trans_b_0_with_static_input(rng):
    x = rng.standard_normal((5, 8)).astype(np.float32)
    w = rng.standard_normal((8, 6)).astype(np.float32)  # [in, out]
    model = _model([helper.make_node("Gemm", ["x", "w"], ["y"], name="/fc/Gemm")], [numpy_helper.from_array(w, "w")], x.shape)
    items = _items(model, torch.from_numpy(x), aargs=A_STATIC)
    out = write_qdq(model, items)
    onnx.checker.check_model(out, full_check=True)
    got = run_model(out, {"x": x})["y"]
    ref = _fq_input(torch.from_numpy(x), items[0]) @ _fq_weight(model, items[0]).T
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-6, atol=1e-6)
    assert not np.allclose(got, x @ w, atol=1e-4)  # quantization really happened


@pytest.mark.parametrize("opset", [17, 18])
def test_fp16_weight_behind_cast_and_transpose_with_dynamic_tokens(rng, opset):
    x = (rng.standard_normal((2, 5, 8)) * np.linspace(0.1, 3, 5)[None, :, None]).astype(np.float32)
    w16 = rng.standard_normal((6, 8)).astype(np.float16)  # torch [out, in]
    nodes = [
        helper.make_node("Cast", ["w"], ["wf"], name="/p/Cast", to=TensorProto.FLOAT),
        helper.make_node("Transpose", ["wf"], ["wt"], name="/p/Transpose", perm=[1, 0]),
        helper.make_node("MatMul", ["x", "wt"], ["y"], name="/p/MatMul"),
    ]
    model = _model(nodes, [numpy_helper.from_array(w16, "w")], x.shape, opset)
    items = _items(model, torch.from_numpy(x), aargs=A_TOKEN)
    out = write_qdq(model, items)
    onnx.checker.check_model(out, full_check=True)
    assert not {"/p/Cast", "/p/Transpose"} & {n.name for n in out.graph.node}  # the weight path is folded away
    assert "w" not in {i.name for i in out.graph.initializer}
    got = run_model(out, {"x": x})["y"]
    xq = _fq_input(torch.from_numpy(x), items[0])
    # per-token: every token row has its own scale
    assert len({float(v) for v in compute_dynamic_scales_and_zp(torch.from_numpy(x), A_TOKEN, None)[0].flatten()}) == 10
    ref = xq @ _fq_weight(model, items[0]).T
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-6, atol=1e-6)


def test_shared_activation_gets_one_qdq_pair_and_tied_weight_stays(rng):
    x = rng.standard_normal((3, 4)).astype(np.float32)
    wa, wb = (rng.standard_normal((4, 4)).astype(np.float32) for _ in range(2))
    nodes = [
        helper.make_node("MatMul", ["x", "wa"], ["a"], name="/q/MatMul"),
        helper.make_node("MatMul", ["x", "wb"], ["b"], name="/k/MatMul"),
        helper.make_node("Gather", ["wa", "idx"], ["g"], name="/emb/Gather"),  # a second user of wa
        helper.make_node("Add", ["a", "b"], ["s"], name="add"),
        helper.make_node("ReduceSum", ["g"], ["gs"], name="rs", keepdims=0),
        helper.make_node("Add", ["s", "gs"], ["y"], name="add2"),
    ]
    inits = [numpy_helper.from_array(wa, "wa"), numpy_helper.from_array(wb, "wb"),
             numpy_helper.from_array(np.array([0], np.int64), "idx")]
    model = _model(nodes, inits, x.shape)
    items = _items(model, torch.from_numpy(x), aargs=A_STATIC)
    out = write_qdq(model, items)
    ops = [n.op_type for n in out.graph.node]
    assert ops.count("QuantizeLinear") == 1 and ops.count("DequantizeLinear") == 3
    assert "wa" in {i.name for i in out.graph.initializer} and "wb" not in {i.name for i in out.graph.initializer}
    got = run_model(out, {"x": x})["y"]
    xq = _fq_input(torch.from_numpy(x), items[0])
    ref = xq @ _fq_weight(model, items[0]).T + xq @ _fq_weight(model, items[1]).T + wa[0].sum()
    np.testing.assert_allclose(got, ref.numpy(), rtol=1e-5, atol=1e-5)


def _ct_qparams(w: torch.Tensor, args: QuantizationArgs) -> QParams:
    """compressed-tensors' calculate_qparams on plain min/max over each quantization unit of W [out, in]."""
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    gs = None
    if args.strategy == "tensor_group":
        gs = generate_gparam(w.amin(), w.amax())
    if args.strategy in ("group", "tensor_group"):
        g = w.unflatten(-1, (-1, args.group_size))
        lo, hi = g.amin(-1), g.amax(-1)
    elif args.strategy == "block":
        bh, bw = args.block_structure
        rows, cols = -(-w.shape[0] // bh) * bh, -(-w.shape[1] // bw) * bw
        padded = torch.nn.functional.pad(w, (0, cols - w.shape[1], 0, rows - w.shape[0]))
        blocks = padded.reshape(rows // bh, bh, cols // bw, bw).transpose(1, 2).flatten(2)
        lo, hi = blocks.amin(-1), blocks.amax(-1)
    else:
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    scale, zp = calculate_qparams(lo, hi, args, global_scale=gs)
    return QParams(scale, zp, gs)


WEIGHT_FORMS = {
    "int4 group asym": QuantizationArgs(num_bits=4, strategy="group", group_size=16, symmetric=False),
    "int8 group": QuantizationArgs(num_bits=8, strategy="group", group_size=16),
    "int4 channel": QuantizationArgs(num_bits=4, strategy="channel"),
    "int8 channel asym": QuantizationArgs(num_bits=8, strategy="channel", symmetric=False),
    "fp8 block padded": QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=[4, 16]),
    "nvfp4": QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16,
                              scale_dtype=torch.float8_e4m3fn),
    "int4 tensor_group": QuantizationArgs(num_bits=4, strategy="tensor_group", group_size=16),
    "mxfp4": QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32, scale_dtype=torch.uint8),
}


@pytest.mark.parametrize("target_runtime", ["onnxruntime", "qdq"])
@pytest.mark.parametrize("op", ["MatMul", "Gemm"])
@pytest.mark.parametrize("form", sorted(WEIGHT_FORMS))
def test_weight_forms_match_compressed_tensors(rng, form, op, target_runtime):
    """Every weight form on both layouts: [in, out] MatMul and [out, in] Gemm transB=1, with
    out = 6 rows (a partial block of 4) and in = 64 (whole groups of 16 and 32), as written for
    onnxruntime (fp4 excepted: it has no fp4 kernels) and as literal Q/DQ."""
    args = WEIGHT_FORMS[form]
    if target_runtime == "onnxruntime" and form in ("nvfp4", "mxfp4"):
        pytest.skip("fp4 is written for --target qdq or tensorrt only (onnxruntime 1.31 has no fp4 kernels)")
    x = rng.standard_normal((3, 64)).astype(np.float32)
    w = (rng.standard_normal((6, 64)) * np.linspace(0.2, 2, 64)).astype(np.float32)  # torch [out, in]
    if op == "MatMul":
        model = _model([helper.make_node("MatMul", ["x", "w"], ["y"], name="/fc/MatMul")],
                       [numpy_helper.from_array(w.T.copy(), "w")], x.shape)
    else:
        model = _model([helper.make_node("Gemm", ["x", "w"], ["y"], name="/fc/Gemm", transB=1)],
                       [numpy_helper.from_array(w, "w")], x.shape)
    t = find_targets(model)[0][0]
    qp = _ct_qparams(torch.from_numpy(w), args)
    out = write_qdq(model, [QuantizedTarget(t, QuantizationScheme(targets=["Linear"], weights=args), {"weight": qp})],
                    target_runtime)
    onnx.checker.check_model(out, full_check=True)
    got = run_model(out, {"x": x})["y"]
    wq = fake_quantize(torch.from_numpy(w), qp.scale, qp.zero_point, args, global_scale=qp.global_scale)
    ref = x @ wq.numpy().T
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-5)
    assert not np.allclose(got, x @ w.T, atol=1e-3)  # quantization really happened
    kinds = {i.name: i.data_type for i in out.graph.initializer}
    assert ("fc.weight_zero_point" in kinds) == (not args.symmetric)


def test_static_asymmetric_and_dynamic_group_activations(rng):
    x = (rng.standard_normal((2, 5, 32)) + 0.7).astype(np.float32)
    w = rng.standard_normal((32, 4)).astype(np.float32)
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"], name="/fc/MatMul")],
                   [numpy_helper.from_array(w, "w")], x.shape)
    for aargs in (QuantizationArgs(num_bits=8, strategy="tensor", symmetric=False),
                  QuantizationArgs(num_bits=8, strategy="group", group_size=8, dynamic=True),
                  QuantizationArgs(num_bits=8, type="float", strategy="group", group_size=16, dynamic=True)):
        items = _items(model, torch.from_numpy(x), aargs=aargs)
        out = write_qdq(model, items)
        onnx.checker.check_model(out, full_check=True)
        got = run_model(out, {"x": x})["y"]
        ref = _fq_input(torch.from_numpy(x), items[0]) @ _fq_weight(model, items[0]).T
        np.testing.assert_allclose(got, ref.numpy(), rtol=1e-6, atol=1e-6, err_msg=str(aargs))
        assert not np.allclose(_fq_input(torch.from_numpy(x), items[0]).numpy(), x, atol=1e-4)


@pytest.mark.parametrize("weights, inputs, message", [
    (QuantizationArgs(num_bits=2), None, "int2 has no ONNX Q/DQ form"),
    (QuantizationArgs(num_bits=8, type="float", symmetric=False), None, "asymmetric float"),
    (QuantizationArgs(num_bits=8), QuantizationArgs(num_bits=8, strategy="group", group_size=16), "static input activations"),
    (QuantizationArgs(num_bits=8), QuantizationArgs(num_bits=8, strategy="token", dynamic=True, symmetric=False),
     "dynamic asymmetric"),
    (QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32, scale_dtype=torch.uint8),
     QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32, dynamic=True, scale_dtype=torch.uint8),
     "dynamic MX activations"),
])
def test_schemes_without_an_onnx_form_fail_clearly(rng, weights, inputs, message):
    x = rng.standard_normal((2, 128)).astype(np.float32)
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"], name="/f/MatMul")],
                   [numpy_helper.from_array(rng.standard_normal((128, 4)).astype(np.float32), "w")], x.shape)
    t = find_targets(model)[0][0]
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
    with pytest.raises(GraphcalError, match=message):
        write_qdq(model, [QuantizedTarget(t, scheme, {})])


@pytest.mark.parametrize("opset", [19, 21, 23])
def test_opset_upgrade_in_place_equals_onnx_converting_the_whole_model(llama_dir, opset):
    """The writer converts a model below the scheme's opset in place: the converter runs on a
    weightless copy and its graph replaces the model's, weights untouched."""
    from onnx import version_converter

    full = version_converter.convert_version(onnx.load(llama_dir / "model.onnx"), opset)
    model = onnx.load(llama_dir / "model.onnx")
    weights = {t.name: t for t in model.graph.initializer}
    upgraded = QDQWriter(model, opset).model
    assert upgraded is model  # in place
    assert [n.SerializeToString() for n in upgraded.graph.node] == [n.SerializeToString() for n in full.graph.node]
    assert sorted(t.SerializeToString() for t in upgraded.graph.initializer) == \
        sorted(t.SerializeToString() for t in full.graph.initializer)
    assert [t.name for t in upgraded.graph.initializer][:len(weights)] == list(weights)  # weights kept, in order
    assert next(o.version for o in upgraded.opset_import if o.domain == "") == opset
    onnx.checker.check_model(upgraded, full_check=True)


def test_target_runtime_is_an_enum_and_an_unknown_one_fails_clearly(rng):
    assert TargetRuntime("tensorrt") is TargetRuntime.TENSORRT and TargetRuntime.ONNXRUNTIME == "onnxruntime"
    x = rng.standard_normal((2, 4)).astype(np.float32)
    model = _model([helper.make_node("MatMul", ["x", "w"], ["y"], name="/f/MatMul")],
                   [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w")], x.shape)
    items = _items(model, torch.from_numpy(x))
    for call in (lambda: items_opset(items, target_runtime="trt"), lambda: QDQWriter(model, 13, "trt")):
        with pytest.raises(GraphcalError, match=r"^unknown target runtime 'trt'; choose one of: onnxruntime, tensorrt, qdq$"):
            call()


def test_ir_version_is_the_lowest_for_the_opset_within_what_onnxruntime_loads(tmp_path):
    """MAX_ORT_IR is the highest IR the installed onnxruntime loads; the written IR never passes it."""
    import onnxruntime as ort

    from graphcal.graph.io import MAX_ORT_IR

    assert (ir_for_opset(13), ir_for_opset(21), ir_for_opset(23), ir_for_opset(24)) == (7, 10, 11, 12)
    assert ir_for_opset(28) == ir_for_opset(99) == MAX_ORT_IR  # onnx pairs opset 28 with IR 14
    for ir in (MAX_ORT_IR, MAX_ORT_IR + 1):
        model = _model([helper.make_node("Relu", ["x"], ["y"])], [], [2])
        model.ir_version = ir
        onnx.save(model, tmp_path / f"ir{ir}.onnx")
        if ir <= MAX_ORT_IR:
            ort.InferenceSession(str(tmp_path / f"ir{ir}.onnx"), providers=["CPUExecutionProvider"])
        else:
            with pytest.raises(Exception, match=f"Unsupported model IR version: {ir}"):
                ort.InferenceSession(str(tmp_path / f"ir{ir}.onnx"), providers=["CPUExecutionProvider"])
