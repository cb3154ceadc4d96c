"""Hostile models, recipes and options: nothing is read from outside the model's folder, nothing
hangs or exhausts the machine, and every refusal is one line with a non-zero exit.

Each case goes through the CLI (run, inspect, eval) as a user would, on small models built here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from graphcal.errors import GraphcalError
from graphcal.graph import io as graph_io
from tests.helpers import run_cli, run_cli_process, time_box

SECRET = b"TOP-SECRET-" * 64  # 704 bytes: exactly a [8, 22] float32 weight


def _graph(weight: onnx.TensorProto, extra_nodes=(), extra_inits=()):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, None])
    nodes = [helper.make_node("MatMul", ["x", weight.name], ["y"], name="/proj/MatMul"), *extra_nodes]
    graph = helper.make_graph(nodes, "g", [x], [y], initializer=[weight, *extra_inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _external(name: str, dims, location: str, offset: int | None = None, length: int | None = None):
    t = onnx.TensorProto(name=name, dims=dims, data_type=TensorProto.FLOAT, data_location=TensorProto.EXTERNAL)
    entries = [("location", location)]
    if offset is not None:
        entries.append(("offset", str(offset)))
    if length is not None:
        entries.append(("length", str(length)))
    for key, value in entries:
        t.external_data.add(key=key, value=value)
    return t


@pytest.fixture
def folder(tmp_path):
    """A model folder with a valid external weight (w.bin) and calibration data, and a secret beside it."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 22)).astype(np.float32)
    (model_dir / "w.bin").write_bytes(w.tobytes())
    (tmp_path / "secret.bin").write_bytes(SECRET)
    np.savez(model_dir / "calib.npz", x=rng.standard_normal((8, 4, 8)).astype(np.float32))
    return model_dir


def _save(folder: Path, weight, name="model.onnx", **kw) -> Path:
    path = folder / name
    path.write_bytes(_graph(weight, **kw).SerializeToString())
    return path


def _run(*args):
    result = run_cli(*args)
    return result.exit_code, result.output


def assert_refused(code, output, fragment):
    assert code != 0, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and fragment in errors[0], output
    assert "Traceback" not in output and "unexpected" not in output, output


def _every_command(model: Path, data: Path, out: Path):
    """run, inspect and eval on ``model``: each must refuse it."""
    yield _run("run", model, "--data", data, "-o", out, "-q")
    yield _run("inspect", model)
    yield _run("eval", model, model, "--data", data)


def test_a_valid_external_weight_calibrates(folder, tmp_path):
    model = _save(folder, _external("proj.weight", [8, 22], "w.bin"))
    code, output = _run("run", model, "--data", folder / "calib.npz", "-o", tmp_path / "out", "-q")
    assert code == 0, output
    assert (tmp_path / "out" / "model.onnx").is_file()


@pytest.mark.parametrize("location, fragment", [
    ("../secret.bin", "leaves the model's folder"),
    ("sub/../../secret.bin", "leaves the model's folder"),
    ("/proc/self/environ", "absolute path"),
    ("ABSOLUTE", "absolute path"),
    ("link.bin", "outside the model's folder"),
    ("dirlink/secret.bin", "outside the model's folder"),
    ("missing.bin", "is missing"),
    ("", "names no file"),
    ("sub", "a folder, not a regular file"),
    ("fifo.bin", "a FIFO, not a regular file"),
])
def test_external_data_outside_the_folder_is_refused_everywhere(folder, tmp_path, location, fragment):
    (folder / "link.bin").symlink_to(tmp_path / "secret.bin")
    (folder / "dirlink").symlink_to(tmp_path)
    (folder / "sub").mkdir()
    os.mkfifo(folder / "fifo.bin")
    if location == "ABSOLUTE":
        location = str(tmp_path / "secret.bin")
    model = _save(folder, _external("proj.weight", [8, 22], location))
    out = tmp_path / "out"
    for code, output in _every_command(model, folder / "calib.npz", out):
        assert_refused(code, output, fragment)
    assert not out.exists()
    secret = os.path.realpath(tmp_path / "secret.bin")
    others = [p for p in tmp_path.rglob("*") if p.is_file() and os.path.realpath(p) != secret]
    assert not any(SECRET[:11] in p.read_bytes() for p in others)


def test_a_symlink_that_stays_inside_the_folder_is_followed(folder, tmp_path):
    (folder / "data").mkdir()
    os.replace(folder / "w.bin", folder / "data" / "w.bin")
    (folder / "alias.bin").symlink_to(Path("data") / "w.bin")
    model = _save(folder, _external("proj.weight", [8, 22], "alias.bin"))
    code, output = _run("run", model, "--data", folder / "calib.npz", "-o", tmp_path / "out", "-q")
    assert code == 0, output


@pytest.mark.parametrize("offset, length, dims, fragment", [
    (0, 10_000, [8, 22], "has length 10000"),            # length disagrees with dims
    (700, None, [8, 22], "lies past the end"),            # offset + size past the file
    (10**15, None, [8, 22], "lies past the end"),
    (-1, None, [8, 22], "negative offset"),
    (0, -1, [8, 22], "negative length"),
    (0, None, [10**6, 10**6], "lies past the end"),       # dims claim 10^12 elements
    (0, None, [8, -22], "negative dimension"),
])
def test_external_ranges_past_their_file_are_refused(folder, tmp_path, offset, length, dims, fragment):
    model = _save(folder, _external("proj.weight", dims, "w.bin", offset=offset, length=length))
    for code, output in _every_command(model, folder / "calib.npz", tmp_path / "out"):
        assert_refused(code, output, fragment)
    assert not (tmp_path / "out").exists()


def test_external_data_in_a_constant_attribute_is_checked_too(folder, tmp_path):
    inner = _external("c", [8, 22], "../secret.bin")
    const = helper.make_node("Constant", [], ["c_out"], name="const", value=inner)
    add = helper.make_node("Add", ["y", "c_out"], ["z"], name="add")
    model = _graph(numpy_helper.from_array(np.ones((8, 22), np.float32), "proj.weight"), extra_nodes=[const, add])
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    for code, output in _every_command(path, folder / "calib.npz", tmp_path / "out"):
        assert_refused(code, output, "leaves the model's folder")


def test_a_model_file_that_is_a_fifo_is_refused_without_hanging(folder, tmp_path):
    fifo = folder / "fifo.onnx"
    os.mkfifo(fifo)
    proc = run_cli_process("inspect", fifo, timeout=120)
    assert proc.returncode != 0
    assert "a FIFO, not a regular file" in proc.stderr and "Traceback" not in proc.stderr


def _weight():
    return numpy_helper.from_array(np.random.default_rng(1).standard_normal((8, 22)).astype(np.float32), "proj.weight")


def test_a_graph_with_a_cycle_is_refused_naming_a_node(folder, tmp_path):
    a = helper.make_node("Relu", ["b_out"], ["a_out"], name="relu_a")
    b = helper.make_node("Relu", ["a_out"], ["b_out"], name="relu_b")
    model = _save(folder, _weight(), extra_nodes=[a, b])
    for code, output in _every_command(model, folder / "calib.npz", tmp_path / "out"):
        assert_refused(code, output, "the graph has a cycle through node 'relu_")


def test_a_weight_path_that_loops_is_refused_not_walked_forever(folder, tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, None])
    nodes = [helper.make_node("Identity", ["w2"], ["w1"], name="id1"),
             helper.make_node("Identity", ["w1"], ["w2"], name="id2"),
             helper.make_node("MatMul", ["x", "w1"], ["y"], name="/proj/MatMul")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    proc = run_cli_process("run", path, "--data", folder / "calib.npz", "-o", tmp_path / "out", timeout=120)
    assert proc.returncode == 1 and "has a cycle" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("nodes, fragment", [
    ([helper.make_node("Add", ["y", "nowhere"], ["z"], name="adder")], "node 'adder' reads 'nowhere'"),
    ([helper.make_node("Relu", ["x"], ["y"], name="again")], "value 'y' is defined twice"),
])
def test_undefined_or_doubly_defined_values_are_refused(folder, tmp_path, nodes, fragment):
    model = _save(folder, _weight(), extra_nodes=nodes)
    for code, output in _every_command(model, folder / "calib.npz", tmp_path / "out"):
        assert_refused(code, output, fragment)


def test_the_check_accepts_subgraphs_reading_outer_values(folder):
    then = helper.make_graph([helper.make_node("Identity", ["y"], ["t"], name="t_id")], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Neg", ["y"], ["e"], name="e_neg")], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    cond = numpy_helper.from_array(np.array(True), "cond")
    branch = helper.make_node("If", ["cond"], ["z"], name="branch", then_branch=then, else_branch=other)
    model = _graph(_weight(), extra_nodes=[branch], extra_inits=[cond])
    from graphcal.graph.check import check_graph

    check_graph(model, "m")  # no error
    bad = helper.make_graph([helper.make_node("Identity", ["ghost"], ["t"], name="t_ghost")], "then", [],
                            [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    model.graph.node[1].attribute[0].g.CopyFrom(bad)
    with pytest.raises(GraphcalError, match="node 't_ghost' reads 'ghost'"):
        check_graph(model, "m")


def test_a_weight_holding_nan_is_an_error_naming_it_or_left_in_float_on_request(folder, tmp_path):
    w = np.random.default_rng(2).standard_normal((8, 22)).astype(np.float32)
    w[3, 5] = np.nan
    w[0, 0] = np.inf
    second = numpy_helper.from_array(np.ones((22, 6), np.float32), "fc.weight")
    extra = [helper.make_node("MatMul", ["y", "fc.weight"], ["z"], name="/fc/MatMul")]
    model = _graph(numpy_helper.from_array(w, "proj.weight"), extra_nodes=extra, extra_inits=[second])
    model.graph.output[0].name = "z"
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    code, output = _run("run", path, "--data", folder / "calib.npz", "-o", tmp_path / "out", "-q")
    assert_refused(code, output, "proj: weight 'proj.weight' holds 2 NaN or Inf value(s)")
    assert not (tmp_path / "out").exists()
    result = run_cli("run", str(path), "--data", str(folder / "calib.npz"), "-o",
                     str(tmp_path / "out"), "--json", "--skip-nonfinite-weights")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["quantized"] == ["fc"] and "proj" in summary["ignored"]
    assert any("proj.weight" in w and "left in float" in w for w in summary["warnings"])
    written = onnx.load(tmp_path / "out" / "model.onnx")
    assert "proj.weight" in {t.name for t in written.graph.initializer}  # still the float weight
    config = json.loads((tmp_path / "out" / "quantization_config.json").read_text())
    assert "proj" in config["ignore"]


def test_device_cuda_without_a_gpu_is_an_error_for_dynamic_schemes_too(llama_dir, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is usable here")
    code, output = _run("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", tmp_path / "out",
                        "--scheme", "W8A8", "--device", "cuda", "-q")
    assert_refused(code, output, "--device cuda")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("scheme, fragment", [
    ('{"weights": {"num_bits": 8, "strategy": "channel"}, "input_activations": {"num_bits": 8, '
     '"strategy": "channel", "dynamic": false}}', "unsupported scheme: Using channel strategy"),
    ('{"a":' * 20000 + "1" + "}" * 20000, "nests deeper than 32 levels"),
    ("[" * 20000 + "]" * 20000, "unknown scheme"),
])
def test_bad_schemes_are_usage_errors(llama_dir, tmp_path, scheme, fragment):
    code, output = _run("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", tmp_path / "out",
                        "--scheme", scheme, "-q")
    assert code == 2
    assert_refused(code, output, fragment)
    assert len(output) < 2000  # the option is not echoed whole


def test_a_deep_kv_cache_scheme_is_a_usage_error(llama_dir, tmp_path):
    code, output = _run("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", tmp_path / "out",
                        "--kv-cache-scheme", '{"a":' * 5000 + "1" + "}" * 5000, "-q")
    assert code == 2
    assert_refused(code, output, "--kv-cache-scheme JSON nests deeper")
    code, output = _run("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", tmp_path / "out",
                        "--kv-cache-scheme", "[" * 5000, "-q")
    assert_refused(code, output, "unknown kv-cache scheme")
    assert len(output) < 2000


def _billion_laughs() -> str:
    text = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
    previous = "a"
    for name in "bcdefghi":
        text += f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 9) + "]\n"
        previous = name
    return text + "QuantizationModifier: {scheme: W8A8, ignore: *i}\n"


@pytest.mark.parametrize("make, fragment", [
    (lambda p: p.write_text(_billion_laughs()), "expands to more than 100,000 values"),
    (lambda p: p.write_text("[" * 5000 + "]" * 5000), "nests deeper than 32 levels"),
    (lambda p: p.write_bytes(b"# " + b"x" * (2 << 20)), "graphcal reads at most"),
    (lambda p: os.mkfifo(p), "a FIFO, not a regular file"),
    (lambda p: p.write_bytes(b"\xff\xfe\x00bad"), "not UTF-8"),
])
def test_hostile_recipes_are_refused_quickly(llama_dir, tmp_path, make, fragment):
    recipe = tmp_path / "recipe.yaml"
    make(recipe)
    proc = run_cli_process("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", tmp_path / "out",
                           "--recipe", recipe, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert fragment in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_written_model_that_fails_onnx_checker_is_never_kept(llama_dir, tmp_path, monkeypatch):
    from graphcal.graph.qdq import QDQWriter

    finish = QDQWriter.finish

    def broken(self):
        model = finish(self)
        model.graph.node[0].input[0] = "no_such_value"
        return model

    monkeypatch.setattr(QDQWriter, "finish", broken)
    code, output = _run("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "-o", tmp_path / "out",
                        "-q")
    assert_refused(code, output, "fails onnx's checker")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


# --- fuzz: mutated external-data fields never read outside the folder, never hang, never crash ---

_LOCATIONS = st.sampled_from(["w.bin", "../secret.bin", "/etc/hostname", "link.bin", "fifo.bin", "sub", "sub/..",
                              "./w.bin", "w.bin\x00", "..", ".", "", "\\..\\secret.bin", "C:w.bin", "w.bin/"]) | st.text(
    max_size=12)
_NUMBERS = st.none() | st.integers(-2, 2000) | st.sampled_from([2**31, 2**63, 10**20]) | st.text(max_size=4)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(location=_LOCATIONS, offset=_NUMBERS, length=_NUMBERS,
       dims=st.lists(st.integers(-2, 40) | st.sampled_from([10**6, 2**40]), min_size=1, max_size=3))
def test_fuzzed_external_data_fields_give_a_one_line_error_or_the_right_bytes(folder, tmp_path, location, offset,
                                                                              length, dims):
    if not (folder / "link.bin").exists():
        (folder / "link.bin").symlink_to(tmp_path / "secret.bin")
        (folder / "sub").mkdir()
        os.mkfifo(folder / "fifo.bin")
    t = onnx.TensorProto(name="proj.weight", dims=dims, data_type=TensorProto.FLOAT,
                         data_location=TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        if value is not None:
            t.external_data.add(key=key, value=str(value))
    path = folder / "fuzz.onnx"
    path.write_bytes(_graph(t).SerializeToString())

    opened: list[str] = []
    real_open = os.open

    def spy(p, *a, **kw):
        opened.append(os.path.realpath(p))
        return real_open(p, *a, **kw)

    os.open = spy
    try:
        with time_box(20):  # never a hang (a FIFO, a device)
            model = graph_io.load_model(path)
    except GraphcalError as e:
        assert "\n" not in str(e)
        model = None
    finally:
        os.open = real_open
    root = os.path.realpath(folder)
    assert all(os.path.commonpath([root, p]) == root for p in opened), opened
    if model is not None:  # accepted: the tensor holds exactly the bytes of w.bin its fields name
        weight = model.graph.initializer[0]
        start = int(offset or 0)
        expected = (folder / "w.bin").read_bytes()[start:start + len(weight.raw_data)]
        assert weight.raw_data == expected and len(weight.raw_data) == 4 * int(np.prod(dims))


def test_nan_in_calibration_data_is_refused_even_without_an_activation_pass(folder, tmp_path):
    model = _save(folder, _weight())
    x = np.random.default_rng(3).standard_normal((8, 4, 8)).astype(np.float32)
    x[6, 1, 2] = np.nan
    np.savez(folder / "bad.npz", x=x)
    code, output = _run("run", model, "--data", folder / "bad.npz", "-o", tmp_path / "out", "-q")  # W8A8: dynamic
    assert_refused(code, output, "input 'x' holds NaN or Inf (sample 6)")
    assert not (tmp_path / "out").exists()
