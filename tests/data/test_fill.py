"""KV-cache decoders calibrate from token data: graphcal fills what a prefill from an empty cache needs.

The models are small hand-made decoders with past inputs, shaped like onnxruntime-genai's builder
models and Optimum's text-generation-with-past exports (input_ids, attention_mask, position_ids,
past_key_values.N.key/value [batch, kv_heads, past_sequence, head_size]). References, never the
code under test: the same run on an .npz holding the arrays a prefill from an empty cache has,
made here with numpy (zeros of past length 0, a mask of ones, arange positions), and the position
ids transformers computes from an attention mask (GenerationMixin._prepare_position_ids_for_generation).
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphcal.data import InputSpec, load_data
from graphcal.errors import GraphcalError
from tests.helpers import run_cli

HEADS, SIZE, VOCAB, HIDDEN, LAYERS = 2, 4, 32, 8, 2
NOTICE = "filled for an empty KV cache: 4 past tensors (past_key_values.*.key/value, length 0, 2 heads x 4"


def _decoder(path, heads=HEADS, size=SIZE, positions=True, past_axis="past_sequence_length", extra=None):
    """A decoder with a KV cache: embeddings (+ position embeddings) scaled by the mask's sum, then
    per layer k/v projections concatenated onto the past, and an output projection. ``heads`` /
    ``size``: the past inputs' dims as written (an int, or a symbolic name). ``extra``: one more
    int64 [batch, sequence] input, added into the ids."""
    rng = np.random.default_rng(0)
    dims = {"batch": "batch_size", "seq": "sequence_length"}
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [dims["batch"], dims["seq"]]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [dims["batch"], "total_sequence_length"])]
    if positions:
        inputs.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, [dims["batch"], dims["seq"]]))
    if extra:
        inputs.append(helper.make_tensor_value_info(extra, TensorProto.INT64, [dims["batch"], dims["seq"]]))
    for kind in ("key", "value"):
        for layer in range(LAYERS):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{layer}.{kind}", TensorProto.FLOAT,
                                                        ["batch_size", heads, past_axis, size]))

    def init(name, array):
        return numpy_helper.from_array(np.asarray(array), name)

    inits = [init("embed.weight", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)),
             init("pos.weight", rng.standard_normal((64, HIDDEN)).astype(np.float32)),
             init("axis1", np.array([1], np.int64)), init("axis2", np.array([2], np.int64)),
             init("quarter", np.array(0.25, np.float32)),
             init("heads_shape", np.array([0, 0, HEADS, SIZE], np.int64)),
             init("o_proj.weight", rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32))]
    ids = "input_ids"
    nodes = []
    if extra:
        nodes.append(helper.make_node("Add", ["input_ids", extra], ["ids_plus"]))
        ids = "ids_plus"
    nodes += [helper.make_node("Gather", ["embed.weight", ids], ["embeds"]),
              helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
              helper.make_node("ReduceSum", ["mask_f", "axis1"], ["mask_sum"], keepdims=1),
              helper.make_node("Unsqueeze", ["mask_sum", "axis2"], ["mask_sum3"]),
              helper.make_node("Mul", ["mask_sum3", "quarter"], ["mask_scale"])]
    hidden = "embeds"
    if positions:
        nodes += [helper.make_node("Gather", ["pos.weight", "position_ids"], ["pos_embeds"]),
                  helper.make_node("Add", ["embeds", "pos_embeds"], ["with_pos"])]
        hidden = "with_pos"
    nodes.append(helper.make_node("Mul", [hidden, "mask_scale"], ["x"]))
    outputs = []
    for layer in range(LAYERS):
        for kind, short in (("key", "k"), ("value", "v")):
            w = f"model.layers.{layer}.self_attn.{short}_proj.weight"
            inits.append(init(w, rng.standard_normal((HIDDEN, HEADS * SIZE)).astype(np.float32)))
            base = f"/model/layers.{layer}/self_attn/{short}_proj"
            nodes += [helper.make_node("MatMul", ["x", w], [f"{base}/out"], name=f"{base}/MatMul"),
                      helper.make_node("Reshape", [f"{base}/out", "heads_shape"], [f"{base}/heads"]),
                      helper.make_node("Transpose", [f"{base}/heads"], [f"{base}/bhsd"], perm=[0, 2, 1, 3]),
                      helper.make_node("Concat", [f"past_key_values.{layer}.{kind}", f"{base}/bhsd"],
                                       [f"present.{layer}.{kind}"], axis=2)]
            outputs.append(helper.make_tensor_value_info(f"present.{layer}.{kind}", TensorProto.FLOAT,
                                                         ["batch_size", HEADS, "total_sequence_length", SIZE]))
    nodes.append(helper.make_node("MatMul", ["x", "o_proj.weight"], ["logits"], name="/model/o_proj/MatMul"))
    outputs.insert(0, helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                                    ["batch_size", "sequence_length", HIDDEN]))
    graph = helper.make_graph(nodes, "decoder", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path / "model.onnx")
    return path / "model.onnx"


def _ids(n=6, seq=5, seed=1):
    return np.random.default_rng(seed).integers(0, VOCAB, (n, seq)).astype(np.int64)


def _empty_cache_arrays(ids, positions=True):
    """What a prefill from an empty cache feeds, made by hand: the reference."""
    n, seq = ids.shape
    arrays = {"input_ids": ids, "attention_mask": np.ones((n, seq), np.int64)}
    if positions:
        arrays["position_ids"] = np.tile(np.arange(seq, dtype=np.int64), (n, 1))
    for kind in ("key", "value"):
        for layer in range(LAYERS):
            arrays[f"past_key_values.{layer}.{kind}"] = np.zeros((n, HEADS, 0, SIZE), np.float32)
    return arrays



def _scales(out):
    from safetensors.numpy import load_file

    return {k: v for k, v in load_file(str(out / "qparams.safetensors")).items() if k.endswith("input_scale")}


def _error_line(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output  # one line, no traceback
    assert lines[0].startswith("error: ")
    return lines[0]


# --- run through the CLI: the fill against a hand-made empty cache -----------------------------


@pytest.mark.parametrize("positions", [True, False], ids=["optimum", "builder"])
def test_run_on_token_ids_alone_equals_a_run_on_the_hand_made_empty_cache(tmp_path, positions):
    model = _decoder(tmp_path / "m", positions=positions)
    ids = _ids(n=7)
    np.savez(tmp_path / "ids.npz", input_ids=ids)
    np.savez(tmp_path / "full.npz", **_empty_cache_arrays(ids, positions))
    filled = run_cli("run", model, "--data", tmp_path / "ids.npz", "--scheme", "W8A8_STATIC", "--batch-size", 3,
                     "-o", tmp_path / "filled")
    assert filled.exit_code == 0, filled.output
    notices = [line for line in filled.output.splitlines() if "filled for an empty KV cache" in line]
    want = NOTICE + "), attention_mask (ones)" + (", position_ids (0, 1, ... per row)" if positions else "")
    assert notices == [f"warning: {want}"]
    full = run_cli("run", model, "--data", tmp_path / "full.npz", "--scheme", "W8A8_STATIC", "--batch-size", 3,
                   "-o", tmp_path / "full")
    assert full.exit_code == 0, full.output
    assert "filled" not in full.output  # the data holds every input: nothing filled, nothing said
    got, want_scales = _scales(tmp_path / "filled"), _scales(tmp_path / "full")
    assert sorted(got) == sorted(want_scales) and len(got) == 2 * LAYERS + 1
    for name in want_scales:
        np.testing.assert_array_equal(got[name], want_scales[name], err_msg=name)


def test_positions_follow_a_padded_mask_as_transformers_computes_them(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    model = _decoder(tmp_path / "m")
    ids = _ids(n=3, seq=6)
    mask = np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], np.int64)  # left, right, none
    calib = load_data({"input_ids": ids, "attention_mask": mask}, _specs(model), model_dir=model.parent)
    (batch,) = list(calib.batches())
    want = transformers.GenerationMixin._prepare_position_ids_for_generation(
        None, torch.from_numpy(ids), {"attention_mask": torch.from_numpy(mask)}).numpy()
    np.testing.assert_array_equal(batch["position_ids"], want)
    np.testing.assert_array_equal(want, [[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 0, 0], [0, 1, 2, 3, 4, 5]])
    assert batch["position_ids"].dtype == np.int64
    np.testing.assert_array_equal(batch["attention_mask"], mask)  # the data's own mask, as given
    assert calib.notes == [NOTICE + "), position_ids (from the attention_mask: cumsum - 1, 0 at padding)"]


def _specs(model):
    from graphcal.data import graph_inputs

    return graph_inputs(onnx.load(model))


def test_filled_batches_follow_each_batch_and_keep_the_data_as_given(tmp_path):
    model = _decoder(tmp_path / "m")
    ids = _ids(n=7, seq=5)
    calib = load_data({"input_ids": ids}, _specs(model), batch_size=3, model_dir=model.parent)
    batches = list(calib.batches())
    assert [b["input_ids"].shape[0] for b in batches] == [3, 3, 1]
    for start, batch in zip((0, 3, 6), batches):
        want = _empty_cache_arrays(ids[start:start + 3])
        assert list(batch) == [s.name for s in _specs(model)]  # the model's input order
        for name, array in want.items():
            assert batch[name].shape == array.shape and batch[name].dtype == array.dtype, name
            np.testing.assert_array_equal(batch[name], array, err_msg=name)


def test_data_holding_every_input_is_used_exactly_as_before(tmp_path):
    model = _decoder(tmp_path / "m")
    arrays = _empty_cache_arrays(_ids(n=4))
    calib = load_data(arrays, _specs(model), batch_size=4, model_dir=model.parent)
    (batch,) = list(calib.batches())
    assert calib.notes == [] and set(batch) == set(arrays)
    for name, array in arrays.items():
        np.testing.assert_array_equal(batch[name], array)


def test_a_past_the_data_holds_is_used_and_the_mask_and_positions_cover_it(tmp_path):
    model = _decoder(tmp_path / "m")
    ids = _ids(n=2, seq=3)
    past = {f"past_key_values.{layer}.{kind}": np.full((2, HEADS, 4, SIZE), 0.5, np.float32)
            for kind in ("key", "value") for layer in range(LAYERS)}
    calib = load_data({"input_ids": ids, **past}, _specs(model), model_dir=model.parent)
    (batch,) = list(calib.batches())
    for name, array in past.items():
        np.testing.assert_array_equal(batch[name], array)
    np.testing.assert_array_equal(batch["attention_mask"], np.ones((2, 7), np.int64))
    np.testing.assert_array_equal(batch["position_ids"], [[4, 5, 6], [4, 5, 6]])
    assert calib.notes == ["filled the inputs the data lacks: attention_mask (ones), position_ids (4, 5, ... per row)"]


def test_a_calibration_data_reader_is_filled_batch_by_batch(tmp_path):
    model = _decoder(tmp_path / "m")
    ids = _ids(n=5)

    class Reader:
        def __init__(self):
            self.rows = iter([ids[:2], ids[2:]])

        def get_next(self):
            rows = next(self.rows, None)
            return None if rows is None else {"input_ids": rows}

    calib = load_data(Reader(), _specs(model), model_dir=model.parent)
    assert calib.notes == []  # nothing streamed yet
    batches = list(calib.batches())
    assert [b["past_key_values.1.value"].shape for b in batches] == [(2, HEADS, 0, SIZE), (3, HEADS, 0, SIZE)]
    np.testing.assert_array_equal(batches[1]["position_ids"], _empty_cache_arrays(ids[2:])["position_ids"])
    assert calib.notes == [NOTICE + "), attention_mask (ones), position_ids (0, 1, ... per row)"]


def test_eval_and_inspect_show_the_notice(tmp_path):
    model = _decoder(tmp_path / "m")
    np.savez(tmp_path / "ids.npz", input_ids=_ids(n=4))
    inspect = run_cli("inspect", model, "--data", tmp_path / "ids.npz", "--scheme", "W8A8_STATIC")
    assert inspect.exit_code == 0, inspect.output
    assert f"warning: {NOTICE}" in inspect.output
    run = run_cli("run", model, "--data", tmp_path / "ids.npz", "--scheme", "W8A8_STATIC", "-o", tmp_path / "q", "-q")
    assert run.exit_code == 0, run.output
    evaluated = run_cli("eval", model, tmp_path / "q" / "model.onnx", "--data", tmp_path / "ids.npz", "--json")
    assert evaluated.exit_code == 0, evaluated.output
    assert f"warning: {NOTICE}" in evaluated.stderr
    assert json.loads(evaluated.stdout)["warnings"][0].startswith(NOTICE)


# --- symbolic head dims from genai_config.json --------------------------------------------------


def _genai(folder, **decoder):
    config = {"model": {"context_length": 64, "decoder": {"head_size": SIZE, "num_key_value_heads": HEADS, **decoder}}}
    (folder / "genai_config.json").write_text(json.dumps(config))


def test_symbolic_head_dims_come_from_genai_config(tmp_path):
    model = _decoder(tmp_path / "m", heads="num_kv_heads", size="kv_cache_dim", positions=False)
    _genai(model.parent)
    ids = _ids(n=4)
    np.savez(tmp_path / "ids.npz", input_ids=ids)
    np.savez(tmp_path / "full.npz", **_empty_cache_arrays(ids, positions=False))
    filled = run_cli("run", model, "--data", tmp_path / "ids.npz", "--scheme", "W8A8_STATIC", "-o", tmp_path / "a")
    assert filled.exit_code == 0, filled.output
    assert ("warning: filled for an empty KV cache: 4 past tensors (past_key_values.*.key/value, length 0, 2 heads x "
            "4; model.decoder.num_key_value_heads, model.decoder.head_size from genai_config.json), attention_mask "
            "(ones)") in filled.output
    full = run_cli("run", model, "--data", tmp_path / "full.npz", "--scheme", "W8A8_STATIC", "-o", tmp_path / "b")
    assert full.exit_code == 0, full.output
    got, want = _scales(tmp_path / "a"), _scales(tmp_path / "b")
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_a_fixed_dim_is_the_models_and_only_a_symbolic_one_is_read(tmp_path):
    model = _decoder(tmp_path / "m", size="kv_cache_dim")
    _genai(model.parent, num_key_value_heads=99)  # the model fixes the heads at 2: the config's 99 is not read
    calib = load_data({"input_ids": _ids(n=2)}, _specs(model), model_dir=model.parent)
    assert next(iter(calib.batches()))["past_key_values.0.key"].shape == (2, HEADS, 0, SIZE)
    assert "model.decoder.head_size from genai_config.json" in calib.notes[0]
    assert "num_key_value_heads" not in calib.notes[0]


@pytest.mark.parametrize("case, message", [
    ("none", r"cannot fill model input 'past_key_values\.0\.key' \(nor past_key_values\.1\.key, "
             r"past_key_values\.0\.value, past_key_values\.1\.value\) for a prefill from an empty KV cache: its head size \(axis 3, "
             r"'kv_cache_dim'\) is symbolic and there is no genai_config\.json in .* to give it \(model\.decoder\.head_size\)"),
    ("no key", r"its head size \(axis 3, 'kv_cache_dim'\) is symbolic and .*genai_config\.json gives no "
               r"model\.decoder\.head_size"),
    ("bad value", r"genai_config\.json: model\.decoder\.head_size is '4', not a whole number from 1 to 1,048,576"),
    ("too big", r"genai_config\.json .* is 1,048,6\d\d bytes; graphcal reads at most 1,048,576"),
    ("duplicate", r"genai_config\.json JSON gives the key 'head_size' twice in one object"),
    ("deep", r"genai_config\.json JSON nests deeper than 32 levels"),
    ("not json", r"genai_config\.json is not valid JSON"),
    ("fifo", r"genai_config\.json is a FIFO, not a regular file"),
    ("symlink out", r"genai_config\.json leads out of the model's folder .*: copy the file in"),
])
def test_a_missing_or_hostile_genai_config_is_refused_in_one_line(tmp_path, case, message):
    model = _decoder(tmp_path / "m", size="kv_cache_dim")
    config = model.parent / "genai_config.json"
    good = '{"model": {"decoder": {"head_size": 4, "num_key_value_heads": 2}}}'
    if case == "no key":
        config.write_text('{"model": {"decoder": {}}}')
    elif case == "bad value":
        config.write_text('{"model": {"decoder": {"head_size": "4"}}}')
    elif case == "too big":
        config.write_text(good + " " * (1 << 20))
    elif case == "duplicate":
        config.write_text('{"model": {"decoder": {"head_size": 4, "head_size": 64}}}')
    elif case == "deep":
        config.write_text('{"model": {"decoder": {"head_size": 4}}, "x": ' + "[" * 40 + "]" * 40 + "}")
    elif case == "not json":
        config.write_text('{"model": ')
    elif case == "fifo":
        os.mkfifo(config)
    elif case == "symlink out":
        (tmp_path / "elsewhere.json").write_text(good)
        config.symlink_to(tmp_path / "elsewhere.json")
    np.savez(tmp_path / "ids.npz", input_ids=_ids(n=2))
    result = run_cli("run", model, "--data", tmp_path / "ids.npz", "--scheme", "W8A8_STATIC", "-o", tmp_path / "out")
    assert result.exit_code == 1
    assert re.search(message, _error_line(result)), result.output
    assert not (tmp_path / "out").exists()


def test_a_hostile_genai_config_is_not_read_when_nothing_needs_it(tmp_path):
    model = _decoder(tmp_path / "m", size="kv_cache_dim")
    os.mkfifo(model.parent / "genai_config.json")
    arrays = _empty_cache_arrays(_ids(n=2))
    calib = load_data(arrays, _specs(model), model_dir=model.parent)  # the fill never opens it
    assert not calib.notes and next(iter(calib.batches())).keys() == arrays.keys()
    # run (and inspect, which says what run would do) refuses it all the same: -o would receive the
    # folder's genai_config.json (graphcal.output.companions), and a FIFO cannot be copied
    np.savez(tmp_path / "full.npz", **arrays)
    result = run_cli("inspect", model, "--data", tmp_path / "full.npz")
    assert result.exit_code == 1 and "genai_config.json is a FIFO, not a regular file" in result.output


def test_a_symlink_inside_the_folder_is_read(tmp_path):
    model = _decoder(tmp_path / "m", size="kv_cache_dim")
    _genai(model.parent)
    os.rename(model.parent / "genai_config.json", model.parent / "real.json")
    (model.parent / "genai_config.json").symlink_to("real.json")
    calib = load_data({"input_ids": _ids(n=2)}, _specs(model), model_dir=model.parent)
    assert next(iter(calib.batches()))["past_key_values.0.value"].shape == (2, HEADS, 0, SIZE)


# --- inputs that cannot be filled, refused by name before any pass ------------------------------


@pytest.mark.parametrize("case, message", [
    ("other input", r"cannot fill model input 'token_type_ids' for a prefill from an empty KV cache: graphcal fills only "
                    r"past_key_values\.N\.key/value, attention_mask and position_ids; give it in the data"),
    ("no ids", r"cannot fill model input 'input_ids' for a prefill from an empty KV cache: graphcal fills the other "
               r"inputs from it, so the data must hold it"),
    ("static cache", r"cannot fill model input 'past_key_values\.0\.key' .*: its past-sequence axis \(2\) is fixed at "
                     r"16 \(a static cache\)"),
    ("some past", r"cannot fill model input 'past_key_values\.0\.value' \(nor past_key_values\.1\.value\) .*: the data "
                  r"holds the past tensor 'past_key_values\.0\.key' but not this one; give every past tensor or none"),
    ("long mask", r"attention_mask has shape \(2, 6\) and input_ids 5 positions; with an empty KV cache the mask covers "
                  r"5 \(past \+ sequence\)"),
])
def test_an_input_that_cannot_be_filled_is_refused_by_name_before_any_pass(tmp_path, monkeypatch, case, message):
    import graphcal.calibration.pipeline

    def no_pass(*args, **kwargs):
        raise AssertionError("a pass ran")

    monkeypatch.setattr(graphcal.calibration.pipeline, "run_activation_pass", no_pass)
    model = _decoder(tmp_path / "m", extra="token_type_ids" if case == "other input" else None,
                     past_axis=16 if case == "static cache" else "past_sequence_length")
    ids = _ids(n=2)
    data = {"input_ids": ids}
    if case == "no ids":
        data = {"attention_mask": np.ones_like(ids)}
    elif case == "some past":
        data["past_key_values.0.key"] = np.zeros((2, HEADS, 0, SIZE), np.float32)
        data["past_key_values.1.key"] = np.zeros((2, HEADS, 0, SIZE), np.float32)
    elif case == "long mask":
        data["attention_mask"] = np.ones((2, 6), np.int64)
    np.savez(tmp_path / "d.npz", **data)
    for verb in ("inspect", "run"):
        result = run_cli(verb, model, "--data", tmp_path / "d.npz", "--scheme", "W8A8_STATIC",
                         *(["-o", tmp_path / "out"] if verb == "run" else []))
        assert result.exit_code == 1, result.output
        assert re.search(message, _error_line(result)), result.output
    assert not (tmp_path / "out").exists()


def test_a_model_without_a_kv_cache_is_refused_as_before(tmp_path):
    specs = [InputSpec("input_ids", np.dtype(np.int64), ("batch", "seq")),
             InputSpec("attention_mask", np.dtype(np.int64), ("batch", "seq"))]
    with pytest.raises(GraphcalError, match=r"<arrays>: no array for model input\(s\) attention_mask \(the model "
                                            r"takes: attention_mask, input_ids\)"):
        load_data({"input_ids": _ids(n=2)}, specs)


# --- graphcal export: calib.npz for an onnxruntime-genai folder ---------------------------------


@pytest.fixture
def genai_folder(tmp_path):
    """An onnxruntime-genai model folder as the builder writes it, minus the weights: genai_config.json,
    a word-level tokenizer (tokenizer.json, tokenizer_config.json), no config.json, and the model."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "genai"
    model = _decoder(folder, size="kv_cache_dim", positions=False)
    _genai(folder, inputs={"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"})
    words = ["<unk>", "<pad>", "<eos>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>",
                            model_input_names=["input_ids", "attention_mask"]).save_pretrained(folder)
    assert not (folder / "config.json").exists()
    return folder, model


def test_export_text_for_a_genai_folder_writes_token_data_that_runs(genai_folder, tmp_path):
    folder, model = genai_folder
    lines = [[f"w{i}" for i in np.random.default_rng(n).integers(0, VOCAB - 3, 7)] for n in range(5)]
    (tmp_path / "calib.txt").write_text("\n".join(" ".join(line) for line in lines) + "\n")
    result = run_cli("export", folder, "-o", tmp_path / "data", "--text", tmp_path / "calib.txt", "--seq", 8, "--pack")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "data").iterdir() if not p.name.startswith(".")) == ["calib.npz"]
    arrays = dict(np.load(tmp_path / "data" / "calib.npz"))
    assert sorted(arrays) == ["attention_mask", "input_ids"]
    stream = [x for line in lines for x in [*(int(w[1:]) + 3 for w in line), 2]]  # word ids, then <eos> (2)
    want = np.array(stream[:len(stream) // 8 * 8], np.int64).reshape(-1, 8)
    np.testing.assert_array_equal(arrays["input_ids"], want)
    np.testing.assert_array_equal(arrays["attention_mask"], np.ones_like(want))
    run = run_cli("run", model, "--data", tmp_path / "data" / "calib.npz", "--scheme", "W8A8_STATIC", "-o", tmp_path / "q")
    assert run.exit_code == 0, run.output
    assert "filled for an empty KV cache" in run.output


def test_export_for_a_genai_folder_needs_text_and_bounds_seq_by_its_context(genai_folder, tmp_path):
    folder, _ = genai_folder
    (tmp_path / "t.txt").write_text("w1 w2\n")
    no_text = run_cli("export", folder, "-o", tmp_path / "a")
    assert no_text.exit_code == 2 and "give --text to write calib.npz for it" in no_text.output
    too_long = run_cli("export", folder, "-o", tmp_path / "b", "--text", tmp_path / "t.txt", "--seq", 65)
    assert too_long.exit_code == 2
    assert "--seq 65 is past the model's context of 64 tokens (its config's model.context_length)" in too_long.output
    dynamo = run_cli("export", folder, "-o", tmp_path / "c", "--text", tmp_path / "t.txt", "--dynamo")
    assert dynamo.exit_code == 2 and "--dynamo and --opset do not apply" in dynamo.output
    assert not any((tmp_path / d).exists() for d in "abc")
