"""A tiny onnxruntime-genai builder model, shared by the tests that need one (tests/export/test_genai.py,
tests/bench/test_decode.py, tests/export/test_genai_cuda.py): a random-weight Llama made with transformers, built
offline by onnxruntime-genai's own model builder through ``graphcal export --genai fp32``; and the
reference they generate by, onnxruntime-genai's own greedy loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.helpers import run_cli

PROMPT = [1, 5, 9, 33, 70, 12]
STEPS = 4


def generate(folder: Path, provider: str | None = None) -> tuple[list[int], np.ndarray]:
    """Greedy tokens after PROMPT and the first step's logits, by onnxruntime-genai's own loop, on the
    provider genai_config.json names or, with ``provider`` ("cpu", "cuda"), on that one."""
    import onnxruntime_genai as og  # test extra: the callers skip without it

    if provider == "cuda":
        import onnxruntime

        onnxruntime.preload_dlls()  # CUDA and cuDNN from the nvidia-* pip packages, as graphcal's runtime does
    config = og.Config(str(folder))
    if provider is not None:
        config.clear_providers()  # onnxruntime-genai's CPU provider
        if provider != "cpu":
            config.append_provider(provider)
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(PROMPT) + STEPS)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([PROMPT], np.int32))
    logits = np.array(generator.get_output("logits"))[0, -1].astype(np.float64)
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens, logits


def sqnr(ref: np.ndarray, got: np.ndarray) -> float:
    return float(10 * np.log10((ref * ref).sum() / ((got - ref) ** 2).sum()))


def assert_one_table(path: Path) -> None:
    """The written tiny tied model stores one table: its GatherBlockQuantized reads lm_head's MatMulNBits
    bytes (a Reshape of its weight, its scales), and no float [256, 64] table is left."""
    import onnx

    model = onnx.load(path)
    gather = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    head = next(n for n in model.graph.node if n.name == "/lm_head/MatMul")
    reshape = next(n for n in model.graph.node if n.output[0] == gather.input[0])
    assert head.op_type == "MatMulNBits" and reshape.input[0] == head.input[1] and gather.input[2] == head.input[2]
    assert not [i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT
                and np.prod(i.dims) == 256 * 64]  # no float table left


def build_tiny_genai(root: Path, tied: bool = False) -> tuple[Path, Path]:
    """(the builder's fp32 folder ``root/fp32``, token-only calibration data ``root/calib.npz``:
    16 x 24 token ids). ``tied``: lm_head shares the embedding table (the builder then keeps one
    initializer, read by lm_head's MatMul and, through a Transpose, by the embedding's Gather)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(root / "hf")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 256)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(root / "hf")
    rng = np.random.default_rng(0)
    (root / "calib.txt").write_text("\n".join(" ".join(f"w{i}" for i in rng.integers(3, 256, 30)) for _ in range(20)))
    # graphcal export --genai: the builder, offline, and the text tokenized for its decoder
    result = run_cli("export", str(root / "hf"), "--genai", "fp32", "-o", str(root / "fp32"),
                     "--text", str(root / "calib.txt"), "--seq", "24", "--pack")
    assert result.exit_code == 0, result.output
    data = np.load(root / "fp32" / "calib.npz")
    assert set(data) == {"input_ids", "attention_mask"} and data["input_ids"].shape == (25, 24)
    np.savez(root / "calib.npz", input_ids=data["input_ids"][:16])  # token ids alone: run fills the rest
    return root / "fp32", root / "calib.npz"
