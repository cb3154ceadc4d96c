"""graphcal eval: agreement numbers checked against onnxruntime runs made here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest

from graphcal.graph.taps import add_taps
from graphcal.graph.targets import find_targets
from graphcal.runtime import run_model
from tests.helpers import MODELS, run_cli, sqnr_db


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, llama_dir):
    out = tmp_path_factory.mktemp("q")
    result = run_cli("run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                     "--scheme", "W8A8", "-o", str(out), "-q")
    assert result.exit_code == 0, result.output
    return out / "model.onnx"


def _eval(*args):
    return run_cli("eval", *map(str, args))


def test_numbers_match_onnxruntime_runs(llama_dir, quantized):
    result = _eval(llama_dir / "model.onnx", quantized, "--data", llama_dir / "heldout.npz", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    feeds = dict(np.load(llama_dir / "heldout.npz"))
    original = onnx.load(llama_dir / "model.onnx")
    targets = find_targets(original)[0]
    nodes = {n.name: n for n in original.graph.node}
    tensors = ["logits"] + [nodes[t.node].output[0] for t in targets]
    ref = run_model(add_taps(original, tensors)[0], feeds, tensors)
    got = run_model(add_taps(onnx.load(quantized), tensors)[0], feeds, tensors)
    out = report["outputs"][0]
    assert out["name"] == "logits" and report["samples"] == 16
    assert out["sqnr_db"] == pytest.approx(sqnr_db(ref["logits"], got["logits"]), abs=1e-9)
    assert out["max_abs_error"] == pytest.approx(float(np.abs(got["logits"] - ref["logits"]).max()), rel=1e-6)
    layers = {layer["name"]: layer for layer in report["layers"]}
    assert list(layers) == [t.name for t in targets]
    for t, tensor in zip(targets, tensors[1:]):
        assert layers[t.name]["sqnr_db"] == pytest.approx(sqnr_db(ref[tensor], got[tensor]), abs=1e-9), t.name
    by_sqnr = sorted(report["layers"], key=lambda layer: layer["sqnr_db"])
    assert report["worst_layers"] == [layer["name"] for layer in by_sqnr[:3]]
    median = float(np.median([layer["sqnr_db"] for layer in report["layers"]]))
    flagged = [layer["name"] for layer in by_sqnr if layer["sqnr_db"] < median - 6]
    assert "suggested_ignore" not in report  # one key to paste: suggested_flags, which keeps lm_head ignored
    flags = report["suggested_flags"]
    assert flags[::2] == ["--ignore"] * (len(flags) // 2)
    values = flags[1::2]
    assert values[:1] == (["lm_head"] if flagged else [])
    patterns = [re.compile(v[3:]) for v in values if v.startswith("re:")]
    assert all(n in values or any(p.fullmatch(n) for p in patterns) for n in flagged)


def test_text_and_html(llama_dir, quantized, tmp_path):
    page = tmp_path / "report.html"
    result = _eval(llama_dir / "model.onnx", quantized, "--data", llama_dir / "heldout.npz", "--html", page)
    assert result.exit_code == 0, result.output
    assert "worst layers (cumulative; " in result.output and "model.layers.0.self_attn.q_proj" in result.output
    text = page.read_text()
    assert "<svg" in text and text.count("<rect") == 15 and "model.layers.1.mlp.down_proj" in text


def test_fp4_models_run_in_onnx_reference(llama_dir, tmp_path):
    out = tmp_path / "nv"
    assert run_cli("run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                   "--scheme", "NVFP4A16", "--target", "qdq", "-o", str(out), "-q").exit_code == 0
    result = _eval(llama_dir / "model.onnx", out / "model.onnx", "--data", llama_dir / "heldout.npz",
                   "--num-samples", "2", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["runner"] == "onnx.reference" and report["samples"] == 2
    assert 5 < report["outputs"][0]["sqnr_db"] < 40


def test_models_that_do_not_pair_fail_in_one_line(llama_dir, bert_dir, tmp_path):
    result = _eval(llama_dir / "model.onnx", bert_dir / "model.onnx", "--data", llama_dir / "heldout.npz")
    assert result.exit_code == 1 and "takes other inputs" in result.output and "Traceback" not in result.output
    result = _eval(llama_dir / "model.onnx", tmp_path / "missing.onnx", "--data", llama_dir / "heldout.npz")
    assert result.exit_code == 1 and "model file not found" in result.output


def test_level_all_compares_what_onnxruntime_runs_by_default(llama_dir, tmp_path):
    """--level all: both models as onnxruntime opens them by default (ORT_ENABLE_ALL), checked
    against plain sessions with default options; for W8A16 the MatMulNBits kernel's int8 inputs
    make it further from fp32 than the Q/DQ graph at ORT_ENABLE_BASIC."""
    import onnxruntime as ort

    out = tmp_path / "w8a16"
    assert run_cli("run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                   "--scheme", "W8A16", "-o", str(out), "-q").exit_code == 0
    reports = {}
    for level in ("basic", "all"):
        result = _eval(llama_dir / "model.onnx", out / "model.onnx", "--data", llama_dir / "heldout.npz",
                       "--level", level, "--json")
        assert result.exit_code == 0, result.output
        reports[level] = json.loads(result.output)
    assert reports["all"]["level"] == "all"
    feeds = dict(np.load(llama_dir / "heldout.npz"))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3

    def default_session(path):
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        return np.concatenate([session.run(["logits"], {k: v[i:i + 8] for k, v in feeds.items()})[0]
                               for i in range(0, 16, 8)])

    expected = sqnr_db(default_session(llama_dir / "model.onnx"), default_session(out / "model.onnx"))
    assert reports["all"]["outputs"][0]["sqnr_db"] == pytest.approx(expected, abs=1e-3)
    assert reports["all"]["outputs"][0]["sqnr_db"] < reports["basic"]["outputs"][0]["sqnr_db"] - 0.5


def _agreement(name: str, sqnr: float):
    from graphcal.evaluation import Agreement

    return Agreement(name, ref_sq=10 ** (sqnr / 10), err_sq=1.0)


def test_suggested_flags_keep_the_written_ignores_and_name_whole_kinds_by_pattern(llama_dir, tmp_path):
    """Flagged in every block: one re: pattern for the kind; flagged in one block: its name; the
    ignores the model was written with come first (--ignore replaces the default). Pasted into run,
    exactly those layers stay in float."""
    from graphcal.evaluation import EvalReport

    sqnr = {"self_attn.q_proj": 40, "self_attn.k_proj": 40, "self_attn.v_proj": 41, "self_attn.o_proj": 39,
            "mlp.gate_proj": 40, "mlp.up_proj": 40, "mlp.down_proj": 25}
    layers = [_agreement(f"model.layers.{i}.{kind}", value - (12 if (i, kind) == (1, "self_attn.o_proj") else 0))
              for i in (0, 1) for kind, value in sqnr.items()]
    report = EvalReport([], layers, 16, 2, "onnxruntime", ignored=["lm_head"])
    flags = report.suggested_flags()
    assert flags == ["--ignore", "lm_head", "--ignore", r"re:.*\.mlp\.down_proj$",
                     "--ignore", "model.layers.1.self_attn.o_proj"]
    assert report.as_dict()["suggested_flags"] == flags
    result = run_cli("run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                     "--scheme", "W8A8_STATIC", "-o", str(tmp_path / "o"), "--json", *flags)
    assert result.exit_code == 0, result.output
    assert sorted(json.loads(result.stdout)["ignored"]) == sorted(
        ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj", "model.layers.1.self_attn.o_proj"])


def test_eval_reads_the_ignores_the_quantized_model_was_written_with(llama_dir, tmp_path):
    out = tmp_path / "o"
    assert run_cli("run", str(llama_dir / "model.onnx"), "--data", str(llama_dir / "calib.npz"),
                   "--scheme", "W8A8_STATIC", "--ignore", "lm_head", "--ignore",
                   "model.layers.0.mlp.up_proj", "-o", str(out), "-q").exit_code == 0
    from graphcal.evaluation import evaluate

    report = evaluate(llama_dir / "model.onnx", out / "model.onnx", llama_dir / "heldout.npz", num_samples=2)
    assert report.ignored == ["lm_head", "model.layers.0.mlp.up_proj"]


def test_isolated_error_is_the_error_of_the_layer_quantized_alone(llama_dir, tmp_path):
    """--isolated: each layer's own error equals, by brute force, the error at that layer of a
    model where only that layer is quantized (same qparams: activations are observed on the fp32
    model either way), for layers deep in the model where the cumulative error differs."""
    from graphcal.calibration.pipeline import calibrate
    from graphcal.evaluation import evaluate

    full = calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / "full", scheme="W8A8_STATIC",
                     device="cpu")
    report = evaluate(llama_dir / "model.onnx", tmp_path / "full" / "model.onnx", llama_dir / "heldout.npz",
                      isolated=True)
    alone = {a.name: a.sqnr_db for a in report.isolated}
    cumulative = {a.name: a.sqnr_db for a in report.layers}
    assert report.as_dict()["ranked_by"] == "isolated" and alone["lm_head"] == float("inf")  # left in float
    for name in ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.down_proj"):
        calibrate(llama_dir / "model.onnx", llama_dir / "calib.npz", tmp_path / name, scheme="W8A8_STATIC",
                  targets=[name], device="cpu")
        only = evaluate(llama_dir / "model.onnx", tmp_path / name / "model.onnx", llama_dir / "heldout.npz")
        brute = next(a.sqnr_db for a in only.layers if a.name == name)
        assert alone[name] == pytest.approx(brute, abs=0.05), name
        assert cumulative[name] < alone[name] - 1  # the cumulative number carries earlier layers' error
    assert {i.target.name for i in full.targets} == set(alone) - {"lm_head"}


@pytest.mark.parametrize("model, scheme, level", [("tiny-bert", "W8A8_STATIC", "all"), ("tiny-llama", "W4A16", "basic")])
def test_in_graph_comparison_gives_the_numbers_of_fetched_tensors(model, scheme, level, tmp_path):
    """eval compares the two models inside one onnxruntime graph (six float64 sums per tensor); the
    numbers equal those from fetching every tensor of both models and comparing them in numpy."""
    from graphcal.calibration.pipeline import calibrate
    from graphcal.evaluation import evaluate
    from graphcal.graph.compare import OUTPUT, SUMS, paired_model

    folder = MODELS / model
    calibrate(folder / "model.onnx", folder / "calib.npz", tmp_path / "q", scheme=scheme)
    candidate = tmp_path / "q" / "model.onnx"
    fast = evaluate(folder / "model.onnx", candidate, folder / "heldout.npz", level=level)
    slow = evaluate(folder / "model.onnx", candidate, folder / "heldout.npz", level=level, in_graph=False)
    assert [a.name for a in fast.outputs] == [a.name for a in slow.outputs] and len(fast.layers) == len(slow.layers)
    for a, b in zip(fast.outputs + fast.layers, slow.outputs + slow.layers):
        for key in ("ref_sq", "cand_sq", "dot", "err_sq"):
            assert getattr(a, key) == pytest.approx(getattr(b, key), rel=1e-9), (a.name, key)
        assert a.max_abs_err == pytest.approx(b.max_abs_err, rel=1e-12) and a.max_abs_ref == b.max_abs_ref
    # only scalars leave onnxruntime: six per compared tensor
    merged, weights, sums = paired_model(onnx.load(folder / "model.onnx"), onnx.load(candidate),
                                         ["logits" if model == "tiny-llama" else "last_hidden_state"])
    # the weights stay in the models, handed over by reference: the graph holds only the comparison's shapes
    assert [t.name for t in merged.graph.initializer] == [f"graphcal-compare/{k}" for k in ("row", "column", "scalar", "one")]
    assert weights
    assert [o.name for o in merged.graph.output] == [OUTPUT] and sums == {next(iter(sums)): 0}
    assert [d.dim_value for d in merged.graph.output[0].type.tensor_type.shape.dim] == [len(SUMS)]


def test_external_data_models_in_two_folders_are_compared_in_one_graph(llama_dir, tmp_path, monkeypatch):
    """Two models whose weights lie in external data files of different folders (the fp32 one and
    graphcal's output beside it): onnxruntime reads both from their files (their common folder),
    the pairs run in order, and the numbers equal those of the same models inline and fetched."""
    from graphcal.calibration.pipeline import calibrate
    from graphcal.evaluation import evaluate
    from graphcal.graph.io import save_with_external_data

    (tmp_path / "fp32").mkdir()
    save_with_external_data(onnx.load(llama_dir / "model.onnx"), tmp_path / "fp32" / "model.onnx")
    calibrate(tmp_path / "fp32" / "model.onnx", llama_dir / "calib.npz", tmp_path / "deep" / "q", scheme="W8A8_STATIC")
    candidate = tmp_path / "deep" / "q" / "model.onnx"
    assert (candidate.parent / "model.onnx.data").exists()  # graphcal keeps the input's external form
    import graphcal.evaluation.models as evaluate_module
    import graphcal.graph.io as graph_io

    monkeypatch.setattr(graph_io, "LAZY_MIN_BYTES", 1)  # tiny-llama's weights are all under 1 MB: keep them on disk
    roots = []
    real_root = evaluate_module.common_root
    monkeypatch.setattr(evaluate_module, "common_root", lambda models: roots.append(real_root(models)) or roots[-1])
    fast = evaluate(tmp_path / "fp32" / "model.onnx", candidate, llama_dir / "heldout.npz")
    assert roots == [tmp_path.resolve()]  # onnxruntime read both data files from the folder holding both
    slow = evaluate(tmp_path / "fp32" / "model.onnx", candidate, llama_dir / "heldout.npz", in_graph=False)
    assert fast.runner == "onnxruntime" and len(fast.layers) == len(slow.layers) > 10
    for a, b in zip(fast.outputs + fast.layers, slow.outputs + slow.layers):
        assert a.name == b.name
        for key in ("ref_sq", "cand_sq", "dot", "err_sq", "max_abs_err", "max_abs_ref"):
            assert getattr(a, key) == pytest.approx(getattr(b, key), rel=1e-9), (a.name, key)
    # the models on disk are untouched by eval's rebased references
    stored = onnx.load(candidate, load_external_data=False)
    assert {e.value for t in stored.graph.initializer for e in t.external_data if e.key == "location"} == {
        "model.onnx.data"}


def test_pairs_run_in_order_under_onnxruntimes_default_order(llama_dir, quantized):
    """graph.compare's one output is built so that onnxruntime's default order (depth first from the
    output, the highest-indexed input first) computes the pairs in order: simulated here on the
    paired graph, no pair's sums may come before an earlier pair's."""
    from graphcal.graph.compare import paired_model

    reference, candidate = onnx.load(llama_dir / "model.onnx"), onnx.load(quantized)
    nodes = {n.name: n for n in reference.graph.node}
    layers = [nodes[t.node].output[0] for t in find_targets(reference)[0]]
    merged, _, sums = paired_model(reference, candidate, ["logits", *layers])
    producer = {o: i for i, n in enumerate(merged.graph.node) for o in n.output}
    visited, order = set(), []

    def visit(index):  # ReverseDFSFrom with NodeCompare: inputs sorted by index, the highest popped first
        stack = [(index, False)]
        while stack:
            i, leave = stack.pop()
            if leave:
                order.append(i)
                continue
            if i in visited:
                continue
            visited.add(i)
            stack.append((i, True))
            inputs = sorted({producer[x] for x in merged.graph.node[i].input if x in producer})
            stack.extend((j, False) for j in inputs)

    visit(producer[merged.graph.output[0].name])
    done = [merged.graph.node[i].name for i in order if merged.graph.node[i].name.endswith("/sums")]
    assert done == [f"graphcal-compare/{k}/sums" for k in range(len(sums))]


def test_a_large_constant_beside_a_layer_is_read_from_the_models_folder(tmp_path):
    """eval loads models lazily: a constant of 1 MB or more (here an Add after a layer, which the
    SmoothQuant advice looks at) stays in external data and is read from the model's own folder."""
    from onnx import TensorProto, helper, numpy_helper

    from graphcal.evaluation import evaluate
    from graphcal.graph.io import save_with_external_data

    n = c = 512
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((c, c)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal((1, n, c)).astype(np.float32), "pos"),
             numpy_helper.from_array(rng.standard_normal((c, c)).astype(np.float32), "w2")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="/proj/MatMul"),
             helper.make_node("Add", ["h", "pos"], ["hp"], name="/add/Add"),
             helper.make_node("MatMul", ["hp", "w2"], ["y"], name="/out/MatMul")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n, c])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n, c])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    save_with_external_data(model, tmp_path / "model.onnx")
    np.savez(tmp_path / "data.npz", x=rng.standard_normal((2, n, c)).astype(np.float32))
    report = evaluate(tmp_path / "model.onnx", tmp_path / "model.onnx", tmp_path / "data.npz", batch_size=1)
    assert report.outputs[0].err_sq == 0 and report.outputs[0].ref_sq > 0


def _refused_as_input(result, fragment):
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1 and fragment in errors[0], result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("spelling", ["same", "relative", "dotted", "link", "hardlink"])
def test_an_input_is_never_the_html_output(llama_dir, quantized, tmp_path, monkeypatch, spelling):
    """`eval REF QUANT --html REF` (however REF is spelled) is refused before any pass; REF is untouched."""
    import os
    import shutil

    import graphcal.evaluation.compare as compare

    folder = tmp_path / "m"
    folder.mkdir()
    ref = folder / "model.onnx"
    shutil.copy(llama_dir / "model.onnx", ref)
    before = ref.read_bytes()
    monkeypatch.chdir(tmp_path)
    if spelling == "link":
        (tmp_path / "page.html").symlink_to(ref)
    if spelling == "hardlink":
        os.link(ref, tmp_path / "page.html")
    html = {"same": ref, "relative": Path("m/model.onnx"), "dotted": Path("m/../m/./model.onnx"),
            "link": Path("page.html"), "hardlink": tmp_path / "page.html"}[spelling]
    monkeypatch.setattr(compare, "load_data", lambda *a, **k: pytest.fail("a pass began"))
    _refused_as_input(_eval(ref, quantized, "--data", llama_dir / "heldout.npz", "--html", html),
                      f"--html {html} would overwrite the input")
    _refused_as_input(_eval(Path("m/model.onnx"), quantized, "--data", llama_dir / "heldout.npz", "--html", quantized),
                      "would overwrite the input")
    _refused_as_input(_eval(ref, quantized, "--data", llama_dir / "heldout.npz", "--html", llama_dir / "heldout.npz"),
                      "would overwrite the input")
    assert ref.read_bytes() == before and sorted(p.name for p in folder.iterdir()) == ["model.onnx"]


def test_the_html_page_is_replaced_whole(llama_dir, quantized, tmp_path, monkeypatch):
    """The page is written beside and renamed over: interrupted before the rename, the old page stays and no
    temporary file is left."""
    import graphcal.output.file as file

    page = tmp_path / "report.html"
    page.write_text("old page")

    def fsync(fd):  # the page is in the temporary file: interrupted before the rename
        raise KeyboardInterrupt

    monkeypatch.setattr(file.os, "fsync", fsync)
    result = _eval(llama_dir / "model.onnx", quantized, "--data", llama_dir / "heldout.npz", "--html", page)
    assert result.exit_code == 130 and "interrupted" in result.output, result.output
    assert page.read_text() == "old page" and [p.name for p in tmp_path.iterdir()] == ["report.html"]
    monkeypatch.undo()
    assert _eval(llama_dir / "model.onnx", quantized, "--data", llama_dir / "heldout.npz", "--html", page).exit_code == 0
    assert "<svg" in page.read_text() and [p.name for p in tmp_path.iterdir()] == ["report.html"]


def test_a_layer_whose_output_is_the_models_output_agrees_as_fetched(tmp_path):
    """A MatMul whose output is the graph's output (lm_head's logits): eval fetches the output whole
    and compares it a slice at a time; the numbers are those of the path that fetches every tensor."""
    from onnx import TensorProto, helper, numpy_helper

    from graphcal.calibration.pipeline import calibrate
    from graphcal.evaluation import evaluate

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 8])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=rng.standard_normal((16, 16)).astype(np.float32))
    calibrate(tmp_path / "m.onnx", tmp_path / "d.npz", tmp_path / "q", scheme="W8A8_STATIC")
    fast = evaluate(tmp_path / "m.onnx", tmp_path / "q" / "model.onnx", tmp_path / "d.npz")
    slow = evaluate(tmp_path / "m.onnx", tmp_path / "q" / "model.onnx", tmp_path / "d.npz", in_graph=False)
    assert [a.name for a in fast.layers] == ["mm"]
    for a, b in zip(fast.outputs + fast.layers, slow.outputs + slow.layers):
        for key in ("ref_sq", "cand_sq", "dot", "err_sq", "max_abs_err", "max_abs_ref"):
            assert getattr(a, key) == pytest.approx(getattr(b, key), rel=1e-9), (a.name, key)
    assert 30 < fast.layers[0].sqnr_db < 60
