"""graphcal eval: a quantized model's error against its fp32 reference, layer by layer, with the --ignore advice."""

from __future__ import annotations

import json
from pathlib import Path

import click

from graphcal.cli.guard import guarded
from graphcal.cli.options import DEBUG_OPTION


@click.command(name="eval")
@click.argument("reference", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("quantized", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--data", "-d", required=True, type=click.Path(path_type=Path),
              help="Evaluation data, as for run: an .npz keyed by input names, or a folder of them.")
@click.option("--batch-size", type=click.IntRange(min=1), default=None, help="Samples per run (default: as run).")
@click.option("--num-samples", type=click.IntRange(min=1), default=None, help="Use at most this many samples.")
@click.option("--level", type=click.Choice(["basic", "all"]), default="basic", show_default=True,
              help="onnxruntime's optimization level for both models: basic runs the Q/DQ graph as the ONNX spec "
                   "computes it; all is onnxruntime's default (its fused integer kernels: what a deployment runs).")
@click.option("--isolated", is_flag=True,
              help="Also measure each layer's own error (its input taken from the fp32 run: a third model run per "
                   "batch) and rank layers and advice by it instead of the cumulative error.")
@click.option("--sensitivity", is_flag=True,
              help="Also run the quantized model with only one kind of layer quantized (mlp.down_proj across all "
                   "blocks, ...; the rest back in float), rank kinds by the output error each causes alone, and "
                   "measure the advice (the worst kinds back in float) the same way: one run of the model over the "
                   "data per kind and per option, and two in fp32, all in one session.")
@click.option("--per-layer", is_flag=True, help="With --sensitivity: each layer alone too (one run per layer).")
@click.option("--time-limit", type=click.FloatRange(min=0), default=60, show_default=True, metavar="MINUTES",
              help="Refuse --sensitivity when its runs, estimated from the comparison's first batches, would take "
                   "longer than this (0: no limit). The number of runs is printed before any pass.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write an HTML page with the tables and a per-layer SQNR chart.")
@DEBUG_OPTION
def eval_command(reference, quantized, data, batch_size, num_samples, level, isolated, sensitivity, per_layer,
                 time_limit, as_json, html_path, debug):
    """Compare QUANTIZED with its fp32 REFERENCE on --data: SQNR, cosine and max error of every
    output, SQNR of every weight MatMul/Gemm output, the layers that hurt most, and the --ignore
    that would keep them in float.

    \b
    Example:
      graphcal eval models/tiny-llama/model.onnx out/model.onnx --data models/tiny-llama/heldout.npz
    """
    from graphcal.evaluation import evaluate, format_html, format_text  # lazy: loads torch, onnx and onnxruntime
    from graphcal.output.file import replace_file  # lazy: with the evaluation above

    def call():
        report = evaluate(reference, quantized, data, batch_size=batch_size, num_samples=num_samples, level=level,
                          isolated=isolated, sensitivity=sensitivity, per_layer=per_layer,
                          time_limit_s=time_limit * 60 if time_limit else None,
                          writes=[("--html", html_path)] if html_path is not None else [])  # refused before any pass
        if html_path is not None:  # replaced whole (a temporary file renamed over it), never an input
            replace_file(html_path, format_html(report, f"{quantized} vs {reference}").encode("utf-8"))
        return report

    report = guarded(call, debug)
    for w in report.warnings:
        click.echo(f"warning: {w}", err=True)
    click.echo(json.dumps(report.as_dict(), sort_keys=True) if as_json else format_text(report))
