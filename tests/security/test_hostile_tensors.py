"""Hostile tensors and doubly defined values: refused when the model is loaded, in one line naming
the tensor, by run, inspect and eval alike (never an unexpected error, never an output).

References: onnx's checker and onnxruntime's reading of the same fields (a tensor's values in one
field, as many as its dims need; one definition per value), never graphcal's own output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from google.protobuf.internal.encoder import _VarintBytes
from onnx import TensorProto, helper, numpy_helper

from graphcal.errors import GraphcalError
from graphcal.graph import io as graph_io
from tests.security.test_hostile_models import _run, assert_refused

K, N = 512, 1024  # a [512, 1024] fp32 weight: 2 MB, past the 1 MB threshold of the lazy (graph.wire) read


def _model(weight: onnx.TensorProto, k: int = K, extra_inits=(), extra_inputs=(), sparse=()) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, None])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "proj.weight"], ["y"], name="/proj/MatMul")], "g",
                              [x, *extra_inputs], [y], [weight, *extra_inits])
    graph.sparse_initializer.extend(sparse)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _weight(k: int = K, n: int = N, seed: int = 0) -> onnx.TensorProto:
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
    return numpy_helper.from_array(w, "proj.weight")


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field."""
    return _VarintBytes(number << 3 | 2) + _VarintBytes(len(payload)) + payload


def _with_raw_initializer(tensor_bytes: bytes) -> bytes:
    """A model's bytes whose only initializer is ``tensor_bytes`` as they are (maybe not a valid TensorProto)."""
    model = _model(onnx.TensorProto(name="placeholder"))
    del model.graph.initializer[:]
    graph = model.graph.SerializeToString() + _field(5, tensor_bytes)  # GraphProto.initializer
    model.ClearField("graph")
    return model.SerializeToString() + _field(7, graph)  # ModelProto.graph


def _write(tmp_path: Path, model: onnx.ModelProto | bytes, k: int = K) -> tuple[Path, Path]:
    folder = tmp_path / "model"
    folder.mkdir()
    path = folder / "model.onnx"
    path.write_bytes(model if isinstance(model, bytes) else model.SerializeToString())
    np.savez(folder / "calib.npz", x=np.random.default_rng(1).standard_normal((2, 4, k)).astype(np.float32))
    return path, folder / "calib.npz"


def _every_command(path: Path, data: Path, out: Path):
    yield _run("inspect", path)
    yield _run("run", path, "--data", data, "-o", out, "-q")
    yield _run("eval", path, path, "--data", data)


def _refused_everywhere(tmp_path, model, fragment, k=K):
    path, data = _write(tmp_path, model, k)
    out = tmp_path / "out"
    for code, output in _every_command(path, data, out):
        assert_refused(code, output, fragment)
    assert not out.exists()
    for lazy in (False, True):  # at load, before any pass: both ways graphcal reads a model
        with pytest.raises(GraphcalError, match=fragment.replace("(", r"\(").replace("[", r"\[")):
            graph_io.load_model_info(path, lazy=lazy)


def _resized(t: onnx.TensorProto, dims) -> onnx.TensorProto:
    t.dims[:] = dims
    return t


def _typed(t: onnx.TensorProto, data_type: int) -> onnx.TensorProto:
    t.data_type = data_type
    return t


def _no_values_in_int64_data() -> onnx.TensorProto:
    t = onnx.TensorProto(name="proj.weight", dims=[8, 22], data_type=TensorProto.FLOAT)
    t.int64_data.extend(range(8 * 22))
    return t


@pytest.mark.parametrize("make, k, fragment", [
    # raw_data of another size than the dims need (a large tensor: the lazy read leaves it inline)
    (lambda: _resized(_weight(), [K, N // 2]), K, "tensor 'proj.weight' holds 2,097,152 bytes in raw_data, "
                                                  "but its dims [512, 512] and type FLOAT need 1,048,576"),
    (lambda: _resized(_weight(8, 22), [8, 11]), 8, "tensor 'proj.weight' holds 704 bytes in raw_data"),
    (lambda: _typed(_weight(), 999), K, "tensor 'proj.weight' has data type 999, which ONNX does not define"),
    (lambda: _typed(_weight(), TensorProto.STRING), K, "tensor 'proj.weight' is a STRING tensor with raw_data"),
    (lambda: onnx.TensorProto(name="proj.weight", dims=[8, 22], data_type=TensorProto.FLOAT, float_data=[1.0] * 175), 8,
     "tensor 'proj.weight' holds 175 values in float_data, but its dims [8, 22] and type FLOAT need 176"),
    (_no_values_in_int64_data, 8, "tensor 'proj.weight' keeps its FLOAT values in int64_data"),
])
def test_a_tensor_whose_values_disagree_with_its_type_or_dims_is_refused_naming_it(tmp_path, make, k, fragment):
    _refused_everywhere(tmp_path, _model(make(), k), fragment, k)


def test_raw_data_with_the_wrong_wire_type_is_refused_naming_the_tensor(tmp_path):
    """raw_data (field 9) written as a varint: protobuf keeps it as an unknown field, and the tensor holds nothing."""
    tensor = onnx.TensorProto(name="proj.weight", dims=[K, N], data_type=TensorProto.FLOAT).SerializeToString()
    _refused_everywhere(tmp_path, _with_raw_initializer(tensor + bytes([9 << 3 | 0, 5])),
                        "tensor 'proj.weight' holds no values, but its dims [512, 1024] need 524,288")


def test_a_corrupt_field_inside_a_large_tensor_is_refused_naming_it(tmp_path):
    """A large tensor's other fields are parsed apart from its raw_data by the lazy read (graph.wire)."""
    tensor = _weight().SerializeToString() + _field(3, b"\xff\xff\xff")  # TensorProto.segment: not a message
    path, data = _write(tmp_path, _with_raw_initializer(tensor))
    for code, output in _every_command(path, data, tmp_path / "out"):
        assert_refused(code, output, "initializer 'proj.weight' is not a readable ONNX tensor")
    assert not (tmp_path / "out").exists()
    with pytest.raises(GraphcalError, match="not a readable ONNX"):
        graph_io.load_model_info(path)  # whole: the model does not parse


@pytest.mark.parametrize("k, n", [(K, N), (8, 22)])
def test_a_tensor_with_raw_data_and_float_data_is_refused_at_load(tmp_path, k, n):
    """onnxruntime reads raw_data and ignores float_data; onnx's checker refuses the tensor."""
    weight = _weight(k, n)
    weight.float_data.extend([1.0] * (k * n))
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_tensor(weight)
    _refused_everywhere(tmp_path, _model(weight, k), "tensor 'proj.weight' keeps its values twice "
                                                     "(raw_data and float_data", k)


def _sparse(name: str) -> onnx.SparseTensorProto:
    values = numpy_helper.from_array(np.array([3.0], np.float32), name)
    return helper.make_sparse_tensor(values, numpy_helper.from_array(np.array([0], np.int64), name + ".i"), [8, 22])


@pytest.mark.parametrize("extra, sparse, fragment", [
    ([_weight(8, 22, seed=5)], [], "value 'proj.weight' is defined twice (initializer and initializer"),
    ([], [_sparse("proj.weight")], "value 'proj.weight' is defined twice (initializer and sparse initializer"),
])
def test_two_initializers_of_one_name_are_refused(tmp_path, extra, sparse, fragment):
    """onnxruntime runs one of the two (the last, with a warning) where graphcal would quantize the other."""
    _refused_everywhere(tmp_path, _model(_weight(8, 22), 8, extra_inits=extra, sparse=sparse), fragment, 8)


def test_two_initializers_of_one_name_in_a_subgraph_are_refused(tmp_path):
    inner = [numpy_helper.from_array(np.ones((1,), np.float32), "c"), numpy_helper.from_array(np.zeros((1,), np.float32), "c")]
    then = helper.make_graph([helper.make_node("Add", ["y", "c"], ["t"], name="t_add")], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)], inner)
    other = helper.make_graph([helper.make_node("Neg", ["y"], ["e"], name="e_neg")], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    model = _model(_weight(8, 22), 8, extra_inits=[numpy_helper.from_array(np.array(True), "cond")])
    model.graph.node.append(helper.make_node("If", ["cond"], ["z"], name="branch", then_branch=then, else_branch=other))
    path, _ = _write(tmp_path, model, 8)
    code, output = _run("inspect", path)
    assert_refused(code, output, "graph > If 'branch': value 'c' is defined twice")


def test_an_initializer_that_is_also_a_graph_input_is_still_calibrated(tmp_path):
    """The legacy form (every weight listed as a graph input too) is an overridable default, which
    onnxruntime runs unless it is fed; graphcal never feeds it: the written model, run unfed, is the
    input model's function quantized, and its error against fp32 (onnxruntime) is small."""
    weight = _weight(8, 22)
    listed = helper.make_tensor_value_info("proj.weight", TensorProto.FLOAT, [8, 22])
    path, data = _write(tmp_path, _model(weight, 8, extra_inputs=[listed]), 8)
    code, output = _run("run", path, "--data", data, "-o", tmp_path / "out", "-q")
    assert code == 0, output
    x = np.load(data)["x"]
    want, got = (_basic(p).run(None, {"x": x})[0] for p in (path, tmp_path / "out" / "model.onnx"))
    np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max())


def _basic(path: Path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def test_a_graph_input_declared_twice_is_refused(tmp_path):
    again = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 8])
    path, _ = _write(tmp_path, _model(_weight(8, 22), 8, extra_inputs=[again]), 8)
    code, output = _run("inspect", path)
    assert_refused(code, output, "graph input 'x' is declared twice")


def test_a_weight_of_strings_is_no_target(tmp_path):
    """A STRING tensor (its strings in string_data, as ONNX keeps them) read by a MatMul: not a weight to quantize
    (onnxruntime's MatMul takes numbers only), said in one line instead of failing in the weight pass."""
    weight = onnx.TensorProto(name="proj.weight", dims=[8, 22], data_type=TensorProto.STRING,
                              string_data=[b"w"] * (8 * 22))
    path, data = _write(tmp_path, _model(weight, 8), 8)
    inspect, run, evaluate = _every_command(path, data, tmp_path / "out")
    for code, output in (inspect, run):
        assert_refused(code, output, "no MatMul/Gemm node takes a weight")
    assert_refused(*evaluate, "Type 'tensor(string)' of input parameter (proj.weight)")  # onnxruntime's refusal
    assert not (tmp_path / "out").exists()
    from graphcal.graph.targets import find_targets

    found, skipped = find_targets(graph_io.load_model(path))
    assert not found and "holds strings, not numbers" in skipped[0].reason
