"""Decode speed in onnxruntime-genai's loop, graphcal's int4 against the builder's int4, on one provider.

    python -m tools.genai_speed [--provider cuda] [--work DIR] [--markdown OUT] [--json OUT] [--layers N]

Speed depends on a model's shape and formats, not on its weights, and the real LLM's weights do not
travel to a lent GPU machine (a call carries 64 MiB). So the model here has SmolLM2-135M-Instruct's
shape (tools/real_llm.py's model: hidden 576, 30 layers, 9 query and 3 key/value heads, MLP 1536,
vocabulary 49,152, tied embedding) with random weights. Into ``--work`` (default a temporary folder):

1. ``hf/``: that Llama, random, with a word-level tokenizer, made by transformers;
2. ``base/``: onnxruntime-genai's model builder for ``--provider``, offline: fp16 for CUDA, fp32 for
   the CPU (the builder's fp16 CPU model does not run in onnxruntime-genai 0.18's loop);
3. ``builder_int4/``: the builder's ``-p int4`` for that provider at its defaults (block 32,
   symmetric, lm_head and the tied embedding quantized too);
4. graphcal's whole-model int4 from ``base/`` (``--lm-head --scheme-for Embedding=S --matmulnbits``,
   round to nearest: GPTQ and AWQ write the same formats, so they decode at the same speed), on
   ``--provider``'s device: W4A16 g32 (the builder's format), W4A16_ASYM g64 and g32 (zero points);
5. ``graphcal bench REFERENCE MODEL --device PROVIDER --batch-size 1``: onnxruntime-genai's greedy loop
   (a prompt of 127 random tokens, 64 new), with the builder's int4 as the reference of every
   graphcal model, and the base model as the builder int4's.

Prints a markdown table (decode tokens/s, time per decoded token against the builder's int4, time to
first token, model files' size) and writes it to ``--markdown``, the bench reports to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tools.lib.report import log
from tools.real_llm import genai_build

VARIANTS = [  # (folder, label, run flags)
    ("graphcal_w4a16_g32", "graphcal W4A16 g32 (symmetric, the builder's format)",
     ["--scheme", "W4A16", "--group-size", "32", "--scheme-for", "Embedding=W4A16"]),
    ("graphcal_w4a16_asym_g64", "graphcal W4A16_ASYM g64 (zero points)",
     ["--scheme", "W4A16_ASYM", "--group-size", "64", "--scheme-for", "Embedding=W4A16_ASYM"]),
    ("graphcal_w4a16_asym_g32", "graphcal W4A16_ASYM g32 (zero points)",
     ["--scheme", "W4A16_ASYM", "--group-size", "32", "--scheme-for", "Embedding=W4A16_ASYM"]),
]


def make_hf(dest: Path, layers: int) -> None:
    """A random-weight Llama in SmolLM2-135M-Instruct's shape, with a word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab_size = 49152
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(dest)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(dest)


def graphcal(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "graphcal", *args]
    log("graphcal " + " ".join(args))
    return subprocess.run(command, capture_output=True, text=True)


def model_mb(folder: Path) -> float:
    """The model's size in MB (model.onnx and its external data), not the tokenizer's."""
    from graphcal.graph.io import model_bytes  # lazy: onnx, kept out of --help

    return model_bytes(folder / "model.onnx") / 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--provider", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--work", type=Path, default=None, help="folder for the models (default: a temporary one)")
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (30: SmolLM2-135M's)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per round after the prompt")
    ap.add_argument("--rounds", type=int, default=5, help="timed generations of each model")
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="genai_speed_"))
    work.mkdir(parents=True, exist_ok=True)
    start = time.time()
    if not (work / "hf" / "config.json").is_file():
        make_hf(work / "hf", args.layers)
    precision = "fp16" if args.provider == "cuda" else "fp32"
    for name, prec in (("base", precision), ("builder_int4", "int4")):
        if not (work / name / "model.onnx").is_file():
            log(f"builder: -p {prec} -e {args.provider} -> {name}/")
            why = genai_build(work / "hf", work / name, prec, args.provider)
            if why is not None:
                log(why)
                return 1
    rng = np.random.default_rng(0)
    np.savez(work / "tokens.npz", input_ids=rng.integers(3, 49152, (4, 128)).astype(np.int64))
    device = "cuda" if args.provider == "cuda" else "cpu"
    rows, reports = [], {}
    benches = [("builder_int4", "builder -p int4 (block 32, symmetric)", "base")]
    for folder, label, flags in VARIANTS:
        if not (work / folder / "model.onnx").is_file():
            done = graphcal("run", str(work / "base" / "model.onnx"), "--data", str(work / "tokens.npz"), "-o",
                            str(work / folder), "--device", device, "-q", "--lm-head", "--matmulnbits", *flags)
            if done.returncode != 0:
                log(f"{folder}: graphcal run failed: {done.stdout.strip()[-400:]} {done.stderr.strip()[-400:]}")
                continue
        benches.append((folder, label, "builder_int4"))
    for folder, label, reference in benches:
        done = graphcal("bench", str(work / reference / "model.onnx"), str(work / folder / "model.onnx"), "--data",
                        str(work / "tokens.npz"), "--device", device, "--batch-size", "1", "--rounds", "10",
                        "--warmup", "2", "--no-memory", "--genai-tokens", str(args.tokens), "--genai-rounds",
                        str(args.rounds), "--json")
        if done.returncode != 0:
            log(f"{folder}: graphcal bench failed: {done.stdout.strip()[-400:]} {done.stderr.strip()[-400:]}")
            continue
        report = json.loads(done.stdout.strip().splitlines()[-1])
        reports[folder] = report
        loop = report["genai_loop"] or {}
        if not loop.get("measured"):
            log(f"{folder}: the genai loop was not measured: {loop.get('skipped')}")
            continue
        rows.append((label, reference, loop, model_mb(work / folder)))
    gpu = ""
    if args.provider == "cuda":
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU seen by torch"
    lines = [f"Machine: {platform.processor() or platform.machine()}, GPU: {gpu or 'none (CPU)'}; provider "
             f"{args.provider}; onnxruntime-genai {rows[0][2]['onnxruntime_genai'] if rows else '?'}; "
             f"{args.layers} layers; a prompt of 127 tokens, {args.tokens} new, {args.rounds} rounds; "
             f"{time.time() - start:.0f} s in all.", "",
             "| model | reference | decode tokens/s | time per decoded token vs reference | reference tokens/s | "
             "time to first token (ms) | model files (MB) |", "|---|---|---|---|---|---|---|"]
    for label, reference, loop, mb in rows:
        q, r = loop["quantized"], loop["reference"]
        lines.append(f"| {label} | {reference} | {q['decode_tokens_per_s']:.0f} | {loop['decode_ratio']:.3f}x | "
                     f"{r['decode_tokens_per_s']:.0f} | {1000 * q['ttft_median_s']:.1f} | {mb:.1f} |")
    text = "\n".join(lines)
    print(text, flush=True)
    if args.markdown is not None:
        args.markdown.write_text(text + "\n")
    if args.json is not None:
        args.json.write_text(json.dumps(reports, indent=1, sort_keys=True))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
