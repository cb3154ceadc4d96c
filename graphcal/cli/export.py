"""graphcal export: a local transformers model folder to ONNX, with calib.npz tokenized from a text file (or
calib.npz alone for an onnxruntime-genai model folder)."""

from __future__ import annotations

from pathlib import Path

import click

from graphcal.cli.guard import guarded
from graphcal.cli.options import DEBUG_OPTION, OneLineCommand


@click.command(name="export", cls=OneLineCommand)
@click.argument("model_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Folder for model.onnx (and calib.npz with --text); for an onnxruntime-genai folder, calib.npz only.")
@click.option("--dynamo", is_flag=True, help="Use torch's dynamo exporter (opset >= 18) instead of the legacy one.")
@click.option("--opset", type=click.IntRange(min=13), default=None, help="ONNX opset (default: 17 legacy, 18 dynamo).")
@click.option("--text", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="A text file, one calibration sample per line, tokenized into calib.npz.")
@click.option("--seq", type=click.IntRange(min=1), default=128, show_default=True,
              help="Tokens per sample in calib.npz (padded or truncated).")
@click.option("--num-samples", type=click.IntRange(min=1), default=None,
              help="Use at most this many lines of --text (with --pack: this many windows).")
@click.option("--pack", is_flag=True,
              help="Join the lines of --text (the tokenizer's end-of-sequence token between them) and cut them into "
                   "full --seq windows: no padding in calib.npz (one padded row per line otherwise).")
@click.option("--genai", "genai", type=click.Choice(["fp32", "fp16"]), default=None,
              help="Hand the transformers folder to onnxruntime-genai's model builder instead (offline): a folder "
                   "onnxruntime-genai generates with (KV cache, GroupQueryAttention, genai_config.json, the tokenizer) "
                   "at this precision, for graphcal run to quantize. Needs graphcal[genai].")
@click.option("--genai-provider", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="With --genai: the execution provider the builder builds for.")
@DEBUG_OPTION
def export_command(model_dir, output, dynamo, opset, text, seq, num_samples, pack, genai, genai_provider, debug):
    """Export a local transformers model folder to ONNX, ready for graphcal run (nothing is downloaded).

    MODEL_DIR may also be an onnxruntime-genai model folder (genai_config.json and tokenizer.json,
    no config.json): its model is built already, so only --text is tokenized, into calib.npz with
    input_ids and attention_mask; run fills the KV cache's past tensors (docs/data.md).

    With --genai, onnxruntime-genai's model builder writes the model (its graph, which its generate
    loop runs fastest; graphcal quantizes it after: docs/genai.md).

    \b
    Example:
      graphcal export ./my-llama -o exported/ --text calib.txt --seq 256
      graphcal run exported/model.onnx --data exported/calib.npz --scheme W8A8 -o out/
      graphcal export ./genai-model -o genai-data/ --text calib.txt --seq 256 --pack
      graphcal run ./genai-model/model.onnx --data genai-data/calib.npz --scheme W8A8 -o out/
      graphcal export ./my-llama --genai fp32 -o llm/ --text calib.txt --seq 256 --pack
      graphcal run llm/model.onnx --data llm/calib.npz --scheme W4A16 --algorithm gptq -o llm-gptq/
    """
    from graphcal.export import build_genai, export_pretrained  # lazy: the other verbs need none of it (nor tempfile, inspect)

    def call():
        if genai is None:
            return export_pretrained(model_dir, output, dynamo=dynamo, opset=opset, text=text, seq=seq,
                                     num_samples=num_samples, pack=pack)
        if dynamo or opset is not None:
            from graphcal.errors import UsageError  # lazy: as above

            raise UsageError("--genai: onnxruntime-genai's builder writes the model, so --dynamo and --opset do not apply")
        return build_genai(model_dir, output, precision=genai, provider=genai_provider, text=text, seq=seq,
                           num_samples=num_samples, pack=pack)

    exported = guarded(call, debug)
    click.echo("wrote:")
    for f in exported.files:
        click.echo(f"  {f}")
    if exported.padding is not None:
        click.echo(f"calib.npz: {exported.samples} samples x {seq} tokens, {exported.padding:.1%} of them padding"
                   + ("" if pack or exported.padding == 0 else " (--pack fills whole windows)"))
