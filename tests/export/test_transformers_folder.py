"""graphcal export: a local transformers folder (random weights, a tokenizer built here) to ONNX + calib.npz."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from graphcal.graph.targets import find_targets
from graphcal.runtime import run_model
from tests.helpers import run_cli


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """build_tiny_llama's model saved with save_pretrained, plus a word-level tokenizer (no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tools.builders import build_tiny_llama

    path = tmp_path_factory.mktemp("llama")
    model = build_tiny_llama()[0]
    model.save_pretrained(path)
    words = ["<unk>", "<pad>"] + [f"w{i}" for i in range(254)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                            model_input_names=["input_ids", "attention_mask"]).save_pretrained(path)
    text = path / "calib.txt"
    rng = np.random.default_rng(0)
    text.write_text("\n".join(" ".join(f"w{i}" for i in rng.integers(0, 254, 20)) for _ in range(12)) + "\n")
    return path, model


@pytest.mark.parametrize("dynamo", [False, True], ids=["legacy", "dynamo"])
def test_export_then_run(folder, tmp_path, dynamo):
    path, model = folder
    out = tmp_path / "exported"
    args = ["export", str(path), "-o", str(out), "--text", str(path / "calib.txt"), "--seq", "24"]
    result = run_cli(*(args + (["--dynamo"] if dynamo else [])))
    assert result.exit_code == 0, result.output
    exported = onnx.load(out / "model.onnx")
    onnx.checker.check_model(exported, full_check=True)
    data = dict(np.load(out / "calib.npz"))
    assert sorted(data) == ["attention_mask", "input_ids"] and data["input_ids"].shape == (12, 24)
    assert (data["input_ids"][:, 20:] == 1).all() and (data["attention_mask"][:, :20] == 1).all()  # padded to 24
    feeds = {k: v[:2] for k, v in data.items()}
    with torch.no_grad():
        ref = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits.numpy()
    np.testing.assert_allclose(run_model(exported, feeds)["logits"], ref, rtol=1e-4, atol=1e-4)
    names = {t.name for t in find_targets(exported)[0]}
    assert "model.layers.0.self_attn.q_proj" in names and "lm_head" in names  # module names survive
    run = run_cli("run", str(out / "model.onnx"), "--data", str(out / "calib.npz"),
                  "--scheme", "W8A8_STATIC", "--batch-size", "4", "-o", str(tmp_path / "q"), "-q")
    assert run.exit_code == 0, run.output


def test_export_errors(tmp_path, folder):
    result = run_cli("export", str(tmp_path), "-o", str(tmp_path / "o"))
    assert result.exit_code == 2 and "not a transformers model folder (no config.json)" in result.output
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    result = run_cli("export", str(folder[0]), "-o", str(tmp_path / "o2"), "--text", str(empty))
    assert result.exit_code == 1 and "holds no non-empty lines" in result.output


def test_export_past_the_protobuf_limit_writes_external_data(folder, tmp_path, monkeypatch):
    import graphcal.graph.io

    monkeypatch.setattr(graphcal.graph.io, "PROTOBUF_LIMIT", 1)  # as if the model were over 2 GB
    out = tmp_path / "big"
    result = run_cli("export", str(folder[0]), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == [".graphcal-manifest.json", "model.onnx", "model.onnx.data"]
    assert "model.onnx.data" in result.output
    ids = np.arange(16, dtype=np.int64).reshape(2, 8)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    with torch.no_grad():
        ref = folder[1](**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits.numpy()
    np.testing.assert_allclose(run_model(out / "model.onnx", feeds)["logits"], ref, rtol=1e-4, atol=1e-4)


def test_pack_windows_joins_lines_with_the_separator_and_keeps_full_windows_only():
    from graphcal.export import pack_windows

    # the separator follows every line that does not already end with it
    assert pack_windows([[1, 2], [3, 9], [4]], 3, 9) == ([[1, 2, 9], [3, 9, 4]], 1)
    assert pack_windows([[1, 2], [3]], 2, None) == ([[1, 2]], 1)
    assert pack_windows([[1]], 4, 9) == ([], 2)


def test_export_pack_has_no_padding_and_says_how_much_padding_the_lines_had(folder, tmp_path):
    path, _ = folder
    words = [line.split() for line in (path / "calib.txt").read_text().splitlines() if line.strip()]
    stream = [int(w[1:]) + 2 for line in words for w in line]  # the word-level ids: w0 is 2 (the test tokenizer has no EOS)
    padded = run_cli("export", str(path), "-o", str(tmp_path / "a"), "--text", str(path / "calib.txt"),
                     "--seq", "24")
    assert padded.exit_code == 0, padded.output
    assert "12 samples x 24 tokens, 16.7% of them padding (--pack fills whole windows)" in padded.output  # 4 of 24
    packed = run_cli("export", str(path), "-o", str(tmp_path / "b"), "--text", str(path / "calib.txt"),
                     "--seq", "24", "--pack")
    assert packed.exit_code == 0, packed.output
    assert "10 samples x 24 tokens, 0.0% of them padding" in packed.output
    data = dict(np.load(tmp_path / "b" / "calib.npz"))
    np.testing.assert_array_equal(data["input_ids"], np.array(stream[:240]).reshape(10, 24))
    assert (data["attention_mask"] == 1).all()
    few = run_cli("export", str(path), "-o", str(tmp_path / "c"), "--text", str(path / "calib.txt"),
                  "--seq", "24", "--pack", "--num-samples", "3")
    assert few.exit_code == 0 and dict(np.load(tmp_path / "c" / "calib.npz"))["input_ids"].shape == (3, 24)


def test_a_seq_past_the_models_context_is_refused_before_anything_heavy(folder, tmp_path, monkeypatch):
    """--seq 1000000000 made the tokenizer allocate 4 GB and abort (no error line, the lock left):
    it is refused against the config's max_position_embeddings before the model loads or -o is locked."""
    import transformers

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    path, _ = folder
    work = tmp_path / "work"
    work.mkdir()
    result = run_cli("export", str(path), "-o", str(work / "o"), "--text", str(path / "calib.txt"),
                     "--seq", "1000000000")
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert "--seq 1,000,000,000 is past the model's context of 128 tokens (its config's max_position_embeddings)" \
        in errors[0]
    assert list(work.iterdir()) == []  # no -o, no lock file


def test_seq_is_bounded_when_the_config_names_no_context():
    from types import SimpleNamespace

    from graphcal.errors import UsageError
    from graphcal.export.text import MAX_SEQ, check_seq

    check_seq(MAX_SEQ, SimpleNamespace())
    with pytest.raises(UsageError, match=f"past {MAX_SEQ:,} tokens"):
        check_seq(MAX_SEQ + 1, SimpleNamespace())
    check_seq(4096, SimpleNamespace(text_config=SimpleNamespace(max_position_embeddings=4096)))
    with pytest.raises(UsageError, match="context of 1,024 tokens .its config's n_positions"):
        check_seq(1025, SimpleNamespace(n_positions=1024))


def test_one_long_line_costs_the_tokenizer_what_its_tokens_need(folder, tmp_path, monkeypatch):
    """One ~800 kB line (a 32 MB one peaked at 5.1 GB): the tokenizer sees it cut to what --seq tokens
    can span (padded rows), or in pieces (--pack); calib.npz is what tokenizing it whole gives."""
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    from graphcal.export import pack_windows

    path, _ = folder
    rng = np.random.default_rng(1)
    long = " ".join(f"w{i}" for i in rng.integers(0, 254, 200_000))
    text = tmp_path / "long.txt"
    text.write_text(long + "\nw1 w2 w3\n")
    seen = []
    real = PreTrainedTokenizerBase.__call__

    def spy(self, text=None, *args, **kwargs):
        seen.extend(len(t) for t in ([text] if isinstance(text, str) else text or []))
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", spy)
    for name, extra in (("rows", []), ("packed", ["--pack"])):
        result = run_cli("export", str(path), "-o", str(tmp_path / name), "--text", str(text),
                         "--seq", "32", *extra)
        assert result.exit_code == 0, result.output
    monkeypatch.undo()
    assert max(seen) <= 1 << 17 < len(long)
    whole = AutoTokenizer.from_pretrained(path)([long, "w1 w2 w3"])["input_ids"]
    rows = np.load(tmp_path / "rows" / "calib.npz")["input_ids"]
    assert rows[0].tolist() == whole[0][:32] and rows[1][:3].tolist() == whole[1]
    packed = np.load(tmp_path / "packed" / "calib.npz")["input_ids"]
    np.testing.assert_array_equal(packed, np.array(pack_windows(whole, 32, None)[0]))
