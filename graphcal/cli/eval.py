"""graphcal eval: a quantized model's error against its fp32 reference, layer by layer, with the --ignore advice."""

from __future__ import annotations

import json
from pathlib import Path

import click
from click.core import ParameterSource

from graphcal.cli.guard import guarded
from graphcal.cli.options import DEBUG_OPTION, MAX_MB, Index, Number, OneLineCommand, OneOf
from graphcal.errors import UsageError

MAX_DB = 1000.0  # an output SQNR target in dB, either way (fp32 itself is under 200 dB)
MAX_NATS = 1000.0  # a mean next-token KL target (a uniform guess over a 10^400-token vocabulary)
MAX_MINUTES = 1e6  # --time-limit: about two years


@click.command(name="eval", cls=OneLineCommand)
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
@click.option("--per-layer", is_flag=True, help="With --sensitivity: each layer alone too (one run per layer). With "
              "--size-budget/--target-kl/--target-db: mix layer by layer instead of kind by kind (one run per layer).")
@click.option("--size-budget", type=Number(0, MAX_MB, low_open=True), default=None, metavar="MB",
              help="Mixed precision by measurement: the largest written model (MB, as run's summary counts it). "
                   "Each kind of layer QUANTIZED quantized is put in --fallback's form (or float) in turn, the "
                   "loss it removes measured in place, and kinds are taken by loss removed per byte while the "
                   "size stays within the budget; the mix is measured and printed with the flags that write it. "
                   "The loss: the mean next-token KL divergence from fp32 of the 'logits' output (the token loss's "
                   "increase where --data holds 'labels'), else the first output's SQNR (an encoder).")
@click.option("--target-kl", type=Number(0, MAX_NATS), default=None, metavar="NATS",
              help="Mixed precision by measurement: the smallest mix whose mean next-token KL divergence from "
                   "fp32 is at most this (as --size-budget, measured; up to three mixes are run). Models with "
                   "logits only.")
@click.option("--target-db", type=Number(-MAX_DB, MAX_DB), default=None, metavar="DB",
              help="Mixed precision by measurement: the smallest mix whose first output reaches this SQNR "
                   "against fp32 (ranked by SQNR; up to three mixes are run).")
@click.option("--fallback", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --size-budget/--target-kl/--target-db: the same fp32 model quantized at a higher precision "
                   "by graphcal (int8, say), whose form promoted layers take (default: float).")
@click.option("--time-limit", type=Number(0, MAX_MINUTES), default=60, show_default=True, metavar="MINUTES",
              help="Refuse --sensitivity or mixing when their runs, estimated from the comparison's first batches, would take "
                   "longer than this (0: no limit). The number of runs is printed before any pass.")
@click.option("--device", type=OneOf(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where onnxruntime runs both models (and --isolated, --sensitivity and mixing), as for run: auto "
                   "picks CUDA when a GPU is usable; on a GPU the outputs are compared there.")
@click.option("--device-id", type=Index(), default=0, show_default=True, metavar="N",
              help="With CUDA: the GPU to run on (CUDA's numbering).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write an HTML page with the tables and a per-layer SQNR chart.")
@DEBUG_OPTION
def eval_command(reference, quantized, data, batch_size, num_samples, level, isolated, sensitivity, per_layer,
                 size_budget, target_kl, target_db, fallback, time_limit, device, device_id, as_json, html_path, debug):
    """Compare QUANTIZED with its fp32 REFERENCE on --data: SQNR, cosine and max error of every
    output (and, for a 'logits' output, the mean next-token KL divergence from fp32), SQNR of every weight
    MatMul/Gemm output, the layers that hurt most, and the --ignore that would keep them in float. With
    --size-budget, --target-kl or --target-db, it also chooses which kinds of layer take --fallback's higher
    precision, by measurement, and prints the flags that write that mix.

    \b
    Example:
      graphcal eval models/tiny-llama/model.onnx out/model.onnx --data models/tiny-llama/heldout.npz
      graphcal eval fp32.onnx int4/model.onnx --data heldout.npz --fallback int8/model.onnx --size-budget 86
    """
    from graphcal.evaluation import EvalOptions, evaluate, format_html, format_text  # lazy: loads torch, onnx and onnxruntime
    from graphcal.output.file import replace_file  # lazy: with the evaluation above

    limited = click.get_current_context().get_parameter_source("time_limit") is not ParameterSource.DEFAULT

    def call():
        if limited and not (sensitivity or any(g is not None for g in (size_budget, target_db, target_kl))):
            raise UsageError("--time-limit bounds the runs of --sensitivity, --size-budget, --target-kl or --target-db; "
                             "give one of them")  # evaluate refuses the other flags that need one (--per-layer, --fallback)
        options = EvalOptions(batch_size=batch_size, num_samples=num_samples, level=level, isolated=isolated,
                              sensitivity=sensitivity, per_layer=per_layer, fallback=fallback,
                              size_budget_bytes=round(size_budget * 1e6) if size_budget is not None else None,
                              target_db=target_db, target_kl=target_kl, time_limit_s=time_limit * 60 if time_limit else None,
                              device=device, device_id=device_id,
                              writes=(("--html", html_path),) if html_path is not None else ())  # refused before any pass
        report = evaluate(reference, quantized, data, options)
        if html_path is not None:  # replaced whole (a temporary file renamed over it), never an input
            replace_file(html_path, format_html(report, f"{quantized} vs {reference}").encode("utf-8"))
        return report

    report = guarded(call, debug)
    for w in report.warnings:
        click.echo(f"warning: {w}", err=True)
    click.echo(json.dumps(report.as_dict(), sort_keys=True) if as_json else format_text(report))
