"""The tiny reference models shipped in ``models/`` and the benchmark decoder, as torch modules.

Random-initialised transformers configs with fixed seeds, used by ``tools/make_models.py`` (which
exports them with :func:`graphcal.export.export_torch`), ``tools/bench.py`` and the tests. They are
test and benchmark fixtures, not part of the ``graphcal`` package. torch and transformers are
imported inside the functions.

Each builder returns ``(model, example_inputs, output_names, dynamic_axes)``.
"""

from __future__ import annotations

from graphcal.export import BATCH_SEQ_AXES, example_ids

TINY_SEQ = 32


def _build_llama(seed: int, batch: int, seq: int, **config_fields):
    """A random-initialised eval-mode ``LlamaForCausalLM`` with eager attention (exports to plain
    MatMul/Softmax, independent of the sdpa backend), example ``[batch, seq]`` inputs, ``["logits"]``
    and batch/seq dynamic axes: ``(model, example_inputs, output_names, dynamic_axes)``."""
    import torch  # lazy: only when a model is built
    from transformers import LlamaConfig, LlamaForCausalLM  # lazy: only when a model is built

    config = LlamaConfig(use_cache=False, **config_fields)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    ids = example_ids(config.vocab_size, batch, seq, seed)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    dynamic_axes = {name: dict(BATCH_SEQ_AXES) for name in ("input_ids", "attention_mask", "logits")}
    return model, inputs, ["logits"], dynamic_axes


def build_tiny_llama(seed: int = 0):
    """A 2-layer random-initialised ``LlamaForCausalLM`` (vocab 256, hidden 128, GQA 4/2 heads).

    Returns ``(model, example_inputs, output_names, dynamic_axes)``: the eval-mode model, a dict
    ``{"input_ids", "attention_mask"}`` of int64 ``[batch, seq]`` tensors, ``["logits"]`` and
    batch/seq dynamic axes for the legacy exporter.
    """
    return _build_llama(seed, 2, TINY_SEQ, vocab_size=256, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def build_bench_decoder(seed: int = 0, seq: int = 512):
    """A random-initialised ``LlamaForCausalLM`` sized for benchmarks, not shipped: hidden 1024,
    8 layers, intermediate 2816, GQA 16/4 heads, vocab 1024 (about 95M parameters, 380 MB fp32).

    Returns ``(model, example_inputs, output_names, dynamic_axes)`` like :func:`build_tiny_llama`.
    """
    return _build_llama(seed, 1, seq, vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=max(seq, 512))


def build_large_decoder(seed: int = 0, seq: int = 256):
    """A random-initialised ``LlamaForCausalLM`` of about 1.5B parameters for memory and time at real
    sizes, not shipped: hidden 2048, 30 layers, intermediate 5632, GQA 32/4 heads, vocab 32000
    (TinyLlama-1.1B's widths with 8 more layers; about 5.8 GB fp32, so it is written with external data).

    Returns ``(model, example_inputs, output_names, dynamic_axes)`` like :func:`build_tiny_llama`.
    """
    return _build_llama(seed, 1, seq, vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                        num_hidden_layers=30, num_attention_heads=32, num_key_value_heads=4,
                        max_position_embeddings=max(seq, 2048))


def build_tiny_bert(seed: int = 0):
    """A 2-layer random-initialised ``BertModel`` (vocab 256, hidden 128, 4 heads, with pooler).

    Returns ``(model, example_inputs, output_names, dynamic_axes)``: the eval-mode model, a dict
    ``{"input_ids", "attention_mask", "token_type_ids"}`` of int64 ``[batch, seq]`` tensors,
    ``["last_hidden_state", "pooler_output"]`` and batch/seq dynamic axes. The pooler's Linear
    exports as a ``Gemm`` (transB=1) in the legacy exporter.
    """
    import torch  # lazy: only when a model is built
    from transformers import BertConfig, BertModel  # lazy: only when a model is built

    config = BertConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = BertModel(config).eval()
    ids = example_ids(config.vocab_size, 2, TINY_SEQ, seed)
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "token_type_ids": torch.zeros_like(ids),
    }
    output_names = ["last_hidden_state", "pooler_output"]
    dynamic_axes = {
        "input_ids": dict(BATCH_SEQ_AXES),
        "attention_mask": dict(BATCH_SEQ_AXES),
        "token_type_ids": dict(BATCH_SEQ_AXES),
        "last_hidden_state": dict(BATCH_SEQ_AXES),
        "pooler_output": {0: "batch"},
    }
    return model, inputs, output_names, dynamic_axes
