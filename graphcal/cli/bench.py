"""graphcal bench: a quantized model's speed, size, memory and kernels in onnxruntime against its fp32 reference."""

from __future__ import annotations

import json
from pathlib import Path

import click

from graphcal.cli.guard import guarded
from graphcal.cli.options import DEBUG_OPTION, OneLineCommand


@click.command(name="bench", cls=OneLineCommand)
@click.argument("reference", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("quantized", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--data", "-d", required=True, type=click.Path(path_type=Path),
              help="Inputs, as for run: an .npz keyed by input names, or a folder of them. Its first batch is timed.")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Samples in the timed batch (default: the model's fixed batch, else 8).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where onnxruntime runs both models; auto picks CUDA when a GPU is usable.")
@click.option("--rounds", type=click.IntRange(min=1), default=20, show_default=True,
              help="Timed rounds per shape; each runs both models, the order flipped every round.")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True,
              help="Untimed runs of each model per shape before timing (onnxruntime-genai's loop: one untimed "
                   "generation, none at 0).")
@click.option("--no-decode", is_flag=True, help="Skip the decode shape (batch 1, one token; over a past on a "
                                                 "KV-cache model).")
@click.option("--past", type=click.IntRange(min=1), default=None,
              help="KV-cache models: the past length P of the decode step (default: the first sample's length "
                   "minus 1).")
@click.option("--genai-tokens", type=click.IntRange(min=0), default=32, show_default=True,
              help="onnxruntime-genai folders: tokens its generate loop makes per round after a prompt of the "
                   "first P tokens (0: skip the loop).")
@click.option("--genai-rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed generations of each model in onnxruntime-genai's loop, the order flipped every round.")
@click.option("--allow-custom-ops", "allow_custom_ops", type=click.Path(dir_okay=False, path_type=Path), default=None,
              metavar="LIBRARY",
              help="onnxruntime-genai's loop: load this custom ops library, which the folders' genai_config.json "
                   "must name as custom_ops_library. Without it, no library a model folder names is loaded.")
@click.option("--no-memory", is_flag=True, help="Skip the peak-memory measurement (a fresh process per model).")
@click.option("--layers", "-v", "layers", is_flag=True, help="Also list the kernel of every layer in the text output.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (sorted keys) instead of the table.")
@DEBUG_OPTION
def bench_command(reference, quantized, data, batch_size, device, rounds, warmup, no_decode, past, genai_tokens,
                  genai_rounds, allow_custom_ops, no_memory, layers, as_json, debug):
    """Time QUANTIZED against its fp32 REFERENCE in onnxruntime at its default settings
    (ORT_ENABLE_ALL), and show which kernel onnxruntime really runs for every weight MatMul/Gemm.

    Reports, for both models: time per batch and throughput on the first batch of --data
    (prefill) and on one token of one sample (decode-like, for models with a free sequence
    axis), with the ratio quantized/reference; file sizes; peak host memory of a fresh process
    that opens the model and runs one batch; and the kernel behind every weight MatMul/Gemm
    (MatMulNBits, an integer kernel, or float) with the execution provider it ran on.

    On a model with a KV cache (past_key_values.N.key/value inputs) the decode shape is one new
    token over a real past of P tokens (--past; default the first sample's length minus 1), the
    past made by each model's own prefill; time per step and tokens/s. Where both folders are
    onnxruntime-genai folders (genai_config.json) and onnxruntime-genai is installed, its own
    greedy generate loop is timed too: time to first token and decode tokens/s. onnxruntime-genai is
    handed graphcal's copy of each genai_config.json, without what would load code or write files
    (a custom_ops_library, provider options naming libraries, ...; a note names it) unless
    --allow-custom-ops names the library.

    \b
    Example:
      graphcal bench models/tiny-llama/model.onnx out/model.onnx --data models/tiny-llama/heldout.npz
    """
    from graphcal.bench import bench, format_text  # lazy: loads torch, onnx and onnxruntime

    report = guarded(lambda: bench(reference, quantized, data, batch_size=batch_size, device=device, warmup=warmup,
                                   rounds=rounds, decode=not no_decode, memory=not no_memory, past=past,
                                   genai_tokens=genai_tokens, genai_rounds=genai_rounds,
                                   allow_custom_ops=allow_custom_ops), debug)
    click.echo(json.dumps(report.as_dict(), sort_keys=True) if as_json else format_text(report, layers=layers))
