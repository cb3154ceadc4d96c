"""--rotate is never silently wrong: every graph shape around the residual stream is rotated exactly
or refused in one line, and a rotated model that drifts from fp32 on the calibration data is never
written.

References: onnxruntime (ORT_ENABLE_BASIC) running the model before and after the rotation (fp32).
The models are one-layer toy decoders built here with onnx.helper: an embedding, an RMS norm (the
decomposed form torch writes, with a random scale), up_proj -> Relu -> down_proj added into the
stream, the final norm and lm_head, over a 1-D sequence of token ids (Gemm takes 2-D inputs only).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphcal.algorithms.rotation.fold import rotate
from graphcal.errors import GraphcalError
from graphcal.runtime import run_model
from tests.helpers import run_cli

HIDDEN, FFN, VOCAB = 16, 32, 50
DOWN = "model.layers.0.mlp.down_proj"



def _toy(folder, down: str = "matmul", bias: tuple | None = None, self_residual: bool = False, seed: int = 0):
    """A toy decoder in ``folder`` (model.onnx and calib.npz of 16 token ids): down_proj as a MatMul
    (``down="matmul"``, its bias added after it) or a Gemm (``"gemm"``: transB=0, ``"gemm_t"``:
    transB=1, its bias as C); ``bias``: the bias's shape (None: no bias); ``self_residual``: a MatMul
    reading the stream and added back into it after the MLP (``x + x W``)."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def init(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    def node(op, ins, name, **attrs):
        nodes.append(helper.make_node(op, ins, [name + "_output"], name=name, **attrs))
        return name + "_output"

    def rms(x, tag):
        sq = node("Pow", [x, init(f"{tag}.two", 2.0)], f"/{tag}/Pow")
        mean = node("ReduceMean", [sq], f"/{tag}/ReduceMean", axes=[-1], keepdims=1)
        root = node("Sqrt", [node("Add", [mean, init(f"{tag}.eps", 1e-6)], f"/{tag}/Add")], f"/{tag}/Sqrt")
        normed = node("Mul", [x, node("Reciprocal", [root], f"/{tag}/Reciprocal")], f"/{tag}/Mul")
        return node("Mul", [normed, init(f"{tag}.weight", rng.uniform(0.5, 2.0, HIDDEN))], f"/{tag}/Mul_1")

    def weight(*shape):
        return rng.standard_normal(shape) * 0.5

    x = node("Gather", [init("model.embed_tokens.weight", weight(VOCAB, HIDDEN)), "ids"], "/model/embed_tokens/Gather")
    h = rms(x, "model.layers.0.post_attention_layernorm")
    up = node("MatMul", [h, init("model.layers.0.mlp.up_proj.weight", weight(HIDDEN, FFN))],
              "/model/layers.0/mlp/up_proj/MatMul")
    act = node("Relu", [up], "/model/layers.0/mlp/act/Relu")
    b = [init(f"{DOWN}.bias", 2.0 * weight(*bias))] if bias is not None else []
    if down == "matmul":
        y = node("MatMul", [act, init(f"{DOWN}.weight", weight(FFN, HIDDEN))], f"/{DOWN.replace('.', '/')}/MatMul")
        y = node("Add", [*b, y], f"/{DOWN.replace('.', '/')}/Add") if b else y  # torch's bias: Add(bias, x W)
    else:
        transposed = down == "gemm_t"
        w = init(f"{DOWN}.weight", weight(HIDDEN, FFN) if transposed else weight(FFN, HIDDEN))
        y = node("Gemm", [act, w, *b], f"/{DOWN.replace('.', '/')}/Gemm", transB=int(transposed))
    x = node("Add", [x, y], "/model/layers.0/Add")
    if self_residual:
        mixed = node("MatMul", [x, init("model.layers.0.mixer.weight", weight(HIDDEN, HIDDEN))],
                     "/model/layers.0/mixer/MatMul")
        x = node("Add", [x, mixed], "/model/layers.0/Add_1")
    h = rms(x, "model.norm")
    nodes.append(helper.make_node("MatMul", [h, init("lm_head.weight", weight(HIDDEN, VOCAB))], ["logits"],
                                  name="/lm_head/MatMul"))
    graph = helper.make_graph(nodes, "toy", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", VOCAB])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "model.onnx")
    np.savez(folder / "calib.npz", ids=rng.integers(0, VOCAB, 16).astype(np.int64))
    return folder / "model.onnx", folder / "calib.npz"


def _rotated_logits(path):
    """(the fp32 model's logits, the rotated model's) on 16 token ids, by onnxruntime."""
    model = onnx.load(path)
    report = rotate(model, str(path.parent), heads=False)
    feeds = {"ids": np.arange(16, dtype=np.int64) * 3 % VOCAB}
    return run_model(path, feeds)["logits"], run_model(model, feeds)["logits"], report


def _assert_float_error(want, got):
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("down, bias", [("gemm_t", (HIDDEN,)), ("gemm", (HIDDEN,)), ("gemm_t", (1, HIDDEN)),
                                        ("matmul", (HIDDEN,)), ("matmul", (1, HIDDEN))])
def test_a_bias_written_into_the_stream_is_rotated_with_its_weight(tmp_path, down, bias):
    """down_proj as a Gemm with a bias C (transB 1 and 0), or a MatMul with a constant added after
    it: the bias takes Q with the weight (b Q), and the logits stay fp32's to float error."""
    path, _ = _toy(tmp_path, down, bias)
    want, got, report = _rotated_logits(path)
    _assert_float_error(want, got)
    assert DOWN in report.writes


def test_a_run_with_a_gemm_o_proj_and_its_bias_rotated_writes_a_model_close_to_fp32(tmp_path):
    """Through the CLI: exit 0, no warning, and the written W8A16 model stays near fp32."""
    path, calib = _toy(tmp_path, "gemm_t", (HIDDEN,))
    out = tmp_path / "out"
    result = run_cli("run", path, "--data", calib, "--scheme", "W8A16", "--group-size", "16", "--rotate", "R1", "-o", out)
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output
    feeds = {"ids": np.arange(16, dtype=np.int64) * 3 % VOCAB}
    want, got = run_model(path, feeds)["logits"], run_model(out / "model.onnx", feeds)["logits"]
    assert 10 * np.log10((want ** 2).sum() / ((want - got) ** 2).sum()) > 30  # int8 weights: far from 3 dB


@pytest.mark.parametrize("bias", [(), (4, HIDDEN)])
def test_a_gemm_writer_whose_bias_is_not_a_row_is_refused_in_one_line(tmp_path, bias):
    """A scalar C (broadcast over the hidden width) cannot take Q exactly; a C of several rows is
    not a constant row either: refused, naming the node, before any edit; nothing written."""
    path, calib = _toy(tmp_path, "gemm_t", bias)
    with pytest.raises(GraphcalError, match=f"Gemm /{DOWN.replace('.', '/')}/Gemm writes into the residual stream "
                                            "with a bias that is not a constant row"):
        rotate(onnx.load(path), str(tmp_path))
    result = run_cli("run", path, "--data", calib, "--scheme", "W8A16", "--group-size", "16", "--rotate", "R1", "-o", tmp_path / "out")
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert result.output.strip().splitlines()[-1].startswith(f"error: Gemm /{DOWN.replace('.', '/')}/Gemm")
    assert not (tmp_path / "out").exists()


def test_a_weight_reading_the_stream_and_writing_into_it_takes_both_sides(tmp_path):
    """``x + x W``: W reads the stream (Qᵀ on its input side) and writes into it (Q on its output
    side): it becomes Qᵀ W Q, one copy, and no warning speaks of a tied table."""
    path, calib = _toy(tmp_path, "matmul", self_residual=True)
    want, got, report = _rotated_logits(path)
    _assert_float_error(want, got)
    assert "model.layers.0.mixer" in report.writes and "model.layers.0.mixer" in report.reads
    assert report.untied == []
    result = run_cli("run", path, "--data", calib, "--scheme", "W8A16", "--group-size", "16", "--rotate", "R1", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output and "tied" not in result.output


@pytest.mark.parametrize("value", ["", " ", ","])
def test_an_empty_rotate_is_a_usage_error_not_a_run_without_a_rotation(llama_dir, tmp_path, value):
    """``--rotate ''`` names no rotation: one usage line and exit 2, from run (nothing written) and inspect."""
    out = tmp_path / "out"
    result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--rotate", value, "-o", out)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output.strip().splitlines() == [f"error: --rotate takes R1 or R1,R2 (SpinQuant's names; R3 and R4 "
                                                  f"need online Hadamards, which graphcal does not write), got {value!r}"]
    assert not out.exists()
    result = run_cli("inspect", llama_dir / "model.onnx", f"--rotate={value}")
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output


@pytest.mark.parametrize("rotations, message", [
    ("[]", "rotations must be [R1] or [R1, R2]"), ("['']", "rotations must be [R1] or [R1, R2]"),
    ("[R1, 'R1 ']", "rotations must be [R1] or [R1, R2]"), ("null", "rotations: Input should be a valid list"),
    ("R1", "rotations: Input should be a valid list"), ("[1]", "rotations.0: Input should be a valid string"),
])
def test_a_spinquant_recipe_with_empty_or_odd_rotations_is_refused_in_one_line(llama_dir, tmp_path, rotations, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"quant_stage:\n  quant_modifiers:\n    SpinQuantModifier: {{rotations: {rotations}}}\n"
                      "    QuantizationModifier: {targets: [Linear], ignore: [lm_head], scheme: W8A16}\n")
    result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--recipe", recipe,
                     "-o", tmp_path / "out")
    assert result.exit_code == 2 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def _corrupting(monkeypatch, edit):
    """Make the rotation unit's fold, then ``edit(model)`` the rotated model: a rotation that drifts (the unit
    imports the fold when it runs, so the fold's module is where it is replaced)."""
    import graphcal.algorithms.rotation.fold as fold

    real = fold.rotate

    def drifting(model, *args, **kwargs):
        report = real(model, *args, **kwargs)
        edit(model)
        return report

    monkeypatch.setattr(fold, "rotate", drifting)


def _scale_initializer(prefix: str, factor: float):
    def edit(model):
        from graphcal.graph.weight_path import weight_as_consumed  # reads the fold's own data file too

        t = next(t for t in model.graph.initializer if t.name.startswith(prefix))
        t.CopyFrom(numpy_helper.from_array(weight_as_consumed(t, [], {}, ".") * np.float32(factor), t.name))
    return edit


@pytest.mark.parametrize("edit", [_scale_initializer(f"{DOWN}.rotated", 1.5),  # a weight folded wrong
                                  _scale_initializer(f"/{DOWN.replace('.', '/')}/Gemm.rotated_bias", -1.0)])
def test_a_rotation_that_drifts_from_fp32_is_refused_before_any_pass_and_nothing_is_written(tmp_path, monkeypatch,
                                                                                            edit):
    """The fold made to miss (a weight scaled, a bias's sign flipped after it rotated them): run runs
    the model as given and the rotated one on the first sample, finds the logits far from each other,
    and stops in one line naming the output and its SQNR; the -o folder is never created."""
    path, calib = _toy(tmp_path, "gemm_t", (HIDDEN,))
    before = path.read_bytes()
    _corrupting(monkeypatch, edit)
    out = tmp_path / "out"
    result = run_cli("run", path, "--data", calib, "--scheme", "W8A16", "--group-size", "16", "--rotate", "R1", "-o", out)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --rotate: the rotated model drifts from the model as given "
                                                   "on the first calibration sample: output 'logits' at "), lines
    assert "dB SQNR (float error keeps it over 60 dB)" in lines[0]
    assert not out.exists() and path.read_bytes() == before


def test_the_check_measures_the_rotated_model_against_fp32_to_float_error(tmp_path):
    """check_rotation's measure on an exact rotation: over 100 dB (float error), far above the floor."""
    from graphcal.calibration.transforms.rotation import check_rotation

    path, calib = _toy(tmp_path, "gemm_t", (HIDDEN,), self_residual=True)
    model = onnx.load(path)
    report = rotate(model, str(tmp_path), heads=False)
    sqnr = check_rotation(path, model, report, {"ids": np.load(calib)["ids"][:4]})
    assert list(sqnr) == ["logits"] and sqnr["logits"] > 100


class _Reader:
    """An onnxruntime CalibrationDataReader over 4 batches of 4 token ids."""

    def __init__(self, ids):
        self.batches = iter([{"ids": ids[i:i + 4]} for i in range(0, 16, 4)])

    def get_next(self):
        return next(self.batches, None)


def test_a_calibration_data_reader_is_checked_on_its_first_batch_and_still_calibrates_on_all(tmp_path, monkeypatch):
    """The check reads a reader's first batch ahead and hands it back: the run still sees 16 samples
    in 4 batches; and a drifting rotation is refused on a reader too."""
    from graphcal import calibrate
    from graphcal.config import Options, resolve

    path, calib = _toy(tmp_path, "gemm_t", (HIDDEN,))
    ids = np.load(calib)["ids"]
    config = resolve(Options(scheme="W8A8_STATIC", rotate="R1"))  # static: a pass over the data
    result = calibrate(path, _Reader(ids), tmp_path / "out", config=config)
    assert result.num_samples == 16 and result.num_batches == 4 and "rotation" in result.transforms
    _corrupting(monkeypatch, _scale_initializer(f"{DOWN}.rotated", 1.5))
    with pytest.raises(GraphcalError, match="the rotated model drifts"):
        calibrate(path, _Reader(ids), tmp_path / "out2", config=config)
    assert not (tmp_path / "out2").exists()
