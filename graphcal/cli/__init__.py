"""graphcal's command line: parse, call the pipeline, report. No logic lives here."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from graphcal.calibration.distributed import settle
from graphcal.errors import GraphcalError, first_line
from graphcal.output import Terminated, sigterm_as_interrupt, torchrun_rank

EXAMPLE = "graphcal run models/tiny-llama/model.onnx --data models/tiny-llama/calib.npz --scheme W8A8 -o out/"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="graphcal")
@click.option("--verbose", "-v", is_flag=True,
              help="Log each stage (loading, targets, pass, weights, writing) to stderr, and every 30 s of a long "
                   "stage its progress: samples/s (weights/s), and the time left.")
def cli(verbose: bool) -> None:
    """Calibrate ONNX models for quantization with llm-compressor's observers and write
    QDQ ONNX plus compressed-tensors metadata.

    \b
    Start with:
      graphcal run model.onnx --data calib.npz --scheme W8A8 -o out/
    """
    if verbose:
        import logging

        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("graphcal: %(message)s"))
        logger = logging.getLogger("graphcal")
        logger.handlers = [handler]  # one handler, however many times the group runs in a process
        logger.setLevel(logging.INFO)


def _options(*options):
    """Apply click options in the order listed (a shared list, so commands cannot drift apart)."""
    def apply(command):
        for option in reversed(options):
            command = option(command)
        return command

    return apply


def _data_option(required: bool):
    return click.option("--data", "-d", required=required, type=click.Path(path_type=Path),
                        help="Calibration data: an .npz keyed by the model's input names (first dim = samples), "
                             "or a folder of .npz files." + ("" if required else " inspect checks its headers "
                                                             "against the model's inputs, reading no samples."))


def _output_option(required: bool):
    return click.option("--output", "-o", required=required, type=click.Path(file_okay=False, path_type=Path),
                        help="Folder for model.onnx, quantization_config.json and qparams.safetensors."
                             + ("" if required else " inspect checks that run could write there."))


# The options that say what a run does: run and inspect take exactly these.
CONFIG_OPTIONS = (
    click.option("--scheme", "-s", default=None,
                 help="compressed-tensors preset: W8A8 (the default: int8 per-channel weights + dynamic per-token "
                      "int8 activations), W8A16, W4A16, W4A16_ASYM, W4A8, FP8, FP8_DYNAMIC, FP8_BLOCK, NVFP4A16, "
                      "NVFP4, MXFP4A16; graphcal's W8A8_STATIC (int8 static per-tensor activations, for TensorRT); "
                      "or JSON QuantizationScheme fields."),
    click.option("--targets", "targets", multiple=True,
                 help="What to quantize: module names, 're:' regexes, or Linear (every weight MatMul/Gemm; the "
                      "default). Repeatable."),
    click.option("--ignore", multiple=True,
                 help="Modules to leave in float: names or 're:' regexes (default: lm_head). Repeatable; giving it "
                      "replaces the default."),
    click.option("--observer", default=None,
                 help="Observer for weights and observed activations (memoryless_minmax, static_minmax, minmax, "
                      "mse, ...; graphcal's histogram observers for per-tensor activations: percentile, entropy, "
                      "histogram_mse, whose weights take min/max or the exact MSE); default: llm-compressor's "
                      "choice for the scheme."),
    click.option("--kv-cache-scheme", "kv_cache", default=None,
                 help="Quantize the key/value states entering attention (llm-compressor's kv_cache_scheme): FP8, "
                      "INT8 (static per tensor) or JSON QuantizationArgs fields, e.g. "
                      "'{\"num_bits\": 8, \"type\": \"float\", \"strategy\": \"attn_head\"}'."),
    click.option("--recipe", type=click.Path(dir_okay=False, path_type=Path), default=None,
                 help="llm-compressor recipe (YAML) holding a QuantizationModifier (scheme or config_groups, targets, "
                      "ignore, observer fields, kv_cache_scheme), optionally after a SmoothQuantModifier "
                      "(smoothing_strength, mappings, ignore, algorithm). --scheme, --targets, --ignore, --observer and "
                      "--kv-cache-scheme, --smoothquant and --smoothing-strength given on the command line override it."),
    click.option("--target", "runtime", type=click.Choice(["onnxruntime", "tensorrt", "qdq"]), default="onnxruntime",
                 show_default=True,
                 help="Runtime the model is for. onnxruntime: compressed-tensors' numbers in forms onnxruntime's "
                      "optimizer turns into integer kernels, loading at its default ORT_ENABLE_ALL (no fp4). "
                      "tensorrt: only what TensorRT builds (symmetric, static per-tensor int8/fp8 activations, int4 "
                      "blocks of 64/128, NVFP4 through trt::TRT_FP4DynamicQuantize). qdq: standard Q/DQ written "
                      "literally, for other runtimes and readers (fp4 included)."),
    click.option("--smoothquant", type=click.Choice(["norms", "all", "mul"]), is_flag=False, flag_value="norms",
                 default=None, metavar="[norms|all|mul]",
                 help="Smooth activation outliers into the weights first, as llm-compressor's SmoothQuantModifier "
                      "does (per input channel s = range(x)^a / (2 max|W|)^(1-a)). norms (the flag alone): fold s "
                      "into the norms and constant scales before the MatMuls (llm-compressor's q/k/v and gate/up "
                      "mappings; no node added); all: also into linear layers (up_proj -> down_proj); mul: also an "
                      "explicit Mul(x, 1/s) where no fold is exact (post-LN encoders such as BERT; one elementwise "
                      "Mul per smoothed tensor at inference). Costs one extra pass over the data."),
    click.option("--smoothing-strength", default=None, metavar="ALPHA|auto",
                 help="SmoothQuant's migration strength a (default 0.5, llm-compressor's); implies --smoothquant. "
                      "auto (graphcal's extension): for each smoothed activation, the strength of 0.1, 0.2, ..., 1.0 "
                      "whose smoothing quantizes its layers' outputs best on a sample of the calibration rows."),
    click.option("--algorithm", type=click.Choice(["gptq", "awq", "awq+gptq"]), default=None,
                 help="How weights are rounded (default: to nearest, with the scheme's observer). gptq: "
                      "llm-compressor's GPTQModifier (each layer's rounding error corrected with its inputs' "
                      "Hessian); awq: its AWQModifier (per input channel scales searched on the parent block's "
                      "output error, folded into the norm or linear layer before; no node added); awq+gptq: both."),
    click.option("--group-size", type=click.IntRange(min=1), default=None,
                 help="Group size of the scheme's group/tensor_group weights (e.g. 64 where 128 does not divide a "
                      "layer's input features)."),
    click.option("--block-size", type=click.IntRange(min=1), default=None,
                 help="GPTQ: columns per lazy-update block (default 128)."),
    click.option("--dampening-frac", type=click.FloatRange(min=0), default=None,
                 help="GPTQ: dampening added to the Hessian's diagonal, as a fraction of its mean (default 0.01)."),
    click.option("--actorder", type=click.Choice(["static", "weight", "none"]), default=None,
                 help="GPTQ: activation ordering (default static, llm-compressor's; group is not supported, as "
                      "in llm-compressor 0.14)."),
    click.option("--gptq-order", type=click.Choice(["sequential", "one-pass"]), default=None,
                 help="GPTQ: sequential (the default, llm-compressor's): layer block by layer block, each block's "
                      "Hessians from the already-quantized blocks before it (two passes over the data in all); "
                      "one-pass: every Hessian from the one calibration pass over the float model (faster; every "
                      "Hessian held at once)."),
    click.option("--duo-scaling", type=click.Choice(["true", "false", "both"]), default=None,
                 help="AWQ: search scales from activation and weight means (true, the default), activations only "
                      "(false), or both grids."),
    click.option("--n-grid", type=click.IntRange(min=1), default=None,
                 help="AWQ: grid points searched per mapping (default 20)."),
    click.option("--matmulnbits", type=click.IntRange(0, 4), is_flag=False, flag_value=4, default=None,
                 metavar="[LEVEL]",
                 help="--target onnxruntime: write integer weights as com.microsoft.MatMulNBits (as onnxruntime-genai "
                      "models have them) with this accuracy_level (default 4: the kernel quantizes the input to int8 "
                      "per block of K; 0: float input, the DequantizeLinear form's numbers)."),
)
PASS_OPTIONS = (
    click.option("--batch-size", type=click.IntRange(min=1), default=None,
                 help="Samples per onnxruntime run (default: the model's fixed batch, else 8)."),
    click.option("--num-samples", type=click.IntRange(min=1), default=None, help="Use at most this many samples."),
    click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
                 help="Where onnxruntime and the observers run; auto picks CUDA when a GPU is usable."),
    click.option("--skip-nonfinite-weights", is_flag=True,
                 help="Leave layers whose weight holds NaN or Inf in float (with a warning) instead of failing."),
    click.option("--exclude-padding", is_flag=True,
                 help="Leave positions where the data's attention_mask is 0 (padding, as graphcal export --text "
                      "writes it) out of the activation statistics; activations not shaped [batch, seq, ...] "
                      "(key/value states, 2-D inputs) are observed whole, with a warning. Needs an attention_mask "
                      "input; the taps then leave onnxruntime whole. run always prints the share of padding."),
    click.option("--tap-limit-mb", type=click.FloatRange(min=1), default=None, metavar="MB",
                 help="At most this many MB of activations tapped whole (mse and imatrix observers, "
                      "--exclude-padding) held per batch; past it the data runs once per share of them, each pass "
                      "computing only what its share needs (default 1024)."),
)
DEBUG_OPTION = click.option("--debug", is_flag=True, help="Show Python tracebacks on errors.")


def resolve_options(scheme, targets, ignore, observer, kv_cache, recipe, smoothquant=None, smoothing_strength=None,
                    **algorithm):
    """The run's config from the command line: flags given override the recipe (graphcal.config.resolve);
    ``algorithm``: --algorithm, --group-size and the GPTQ/AWQ knobs, by Options field name."""
    from graphcal.config import Options, resolve

    return resolve(Options(scheme=scheme, targets=tuple(targets) or None, ignore=tuple(ignore) or None,
                           observer=observer, kv_cache=kv_cache, recipe=recipe, smoothquant=smoothquant,
                           smoothing_strength=smoothing_strength, **algorithm))


@cli.command()
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@_data_option(required=True)
@_output_option(required=True)
@_options(*CONFIG_OPTIONS, *PASS_OPTIONS)
@click.option("--json", "as_json", is_flag=True,
              help="Print the summary as one JSON object on stdout (for scripts); no progress bar.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary.")
@DEBUG_OPTION
def run(model, data, output, scheme, targets, ignore, observer, kv_cache, recipe, runtime, smoothquant,
        smoothing_strength, matmulnbits, batch_size, num_samples, device, skip_nonfinite_weights, exclude_padding,
        tap_limit_mb, as_json, quiet, debug, **algorithm):
    """Calibrate MODEL on --data and write a QDQ model and compressed-tensors metadata to -o.

    \b
    Example:
      graphcal run models/tiny-llama/model.onnx --data models/tiny-llama/calib.npz --scheme W8A8 -o out/
    """
    from graphcal.calibration.pipeline import calibrate

    def call():
        return calibrate(
            model, data, output, config=resolve_options(scheme, targets, ignore, observer, kv_cache, recipe,
                                                        smoothquant, smoothing_strength, **algorithm),
            device=device, target=runtime, matmulnbits=matmulnbits, batch_size=batch_size, num_samples=num_samples,
            progress=not (quiet or as_json), skip_nonfinite_weights=skip_nonfinite_weights,
            exclude_padding=exclude_padding, tap_limit_mb=tap_limit_mb,
        )

    result = _guarded(call, debug)
    if result.rank != 0:
        return  # under torchrun, rank 0 reports
    for w in result.warnings:
        click.echo(f"warning: {w}", err=True)
    if as_json:
        import json

        click.echo(json.dumps({
            "quantized": [i.target.name for i in result.targets], "ignored": result.ignored,
            "provider": result.provider, "samples": result.num_samples, "batches": result.num_batches,
            "ranks": result.world, "seconds": round(result.seconds, 3), "files": [str(f) for f in result.files],
            "warnings": result.warnings, "onnxruntime_kernels": result.forms,
            "padding_share": result.padding_share, "exclude_padding": result.exclude_padding,
            "smoothquant": result.smoothed, "awq": result.awq, "gptq": result.gptq,
        }, sort_keys=True))
        return
    if quiet:
        return
    n = len(result.targets)
    label = f"recipe {recipe.name}" if recipe is not None and scheme is None else _scheme_label(scheme or "W8A8")
    click.echo(f"quantized {n} MatMul/Gemm target{'s' if n != 1 else ''} with {label}"
               + (f"; left in float: {', '.join(result.ignored)}" if result.ignored else ""))
    if result.smoothed:
        click.echo(f"smoothed {len(result.smoothed)} activation(s) first (SmoothQuant; graphcal inspect lists them)")
    if result.awq:
        click.echo(f"AWQ: scaled {len(result.awq)} activation(s) first, each folded into the norm or linear layer "
                   "before it (graphcal inspect lists them)")
    if result.gptq is not None:
        order = "layer block by layer block" if result.gptq["order"] == "sequential" else "Hessians from one pass"
        click.echo(f"GPTQ ({order}): {result.gptq['layers']} weights rounded"
                   + (f"; {len(result.gptq['rtn_fallback'])} to nearest (Hessian not positive definite)"
                      if result.gptq["rtn_fallback"] else ""))
    if result.provider is None and (result.awq or result.gptq is not None):
        click.echo(f"calibrated on {result.num_samples} samples in {result.num_batches} batches (GPTQ / AWQ; the "
                   "scheme has no static activations to observe)")
    elif result.provider is None:
        click.echo("calibration pass: not needed (the scheme has no static activations to observe)")
    else:
        ranks = f" across {result.world} ranks" if result.world > 1 else ""
        click.echo(f"calibrated on {result.num_samples} samples in {result.num_batches} batches{ranks} "
                   f"with onnxruntime {result.provider}")
    if result.padding_share is not None:
        if result.provider is None and (result.awq or result.gptq is not None):
            what = "GPTQ's Hessians and AWQ's means count them, as llm-compressor's do"
        elif result.provider is None:
            what = "no activation statistics are taken for this scheme"
        elif result.exclude_padding:
            what = "left out of the statistics"
        else:
            what = "--exclude-padding leaves them out of the statistics"
        click.echo(f"calibration data: {result.padding_share:.1%} of positions are padding (attention_mask == 0); "
                   + what)
    if result.forms:
        click.echo("in onnxruntime (CPU, default settings) the quantized layers run as:")
        for line in result.forms:
            click.echo(f"  {line}")
        click.echo("  measure it: graphcal bench MODEL OUTPUT/model.onnx --data HELDOUT.npz (docs/speed.md has "
                   "numbers)")
    click.echo(f"done in {result.seconds:.1f} s; wrote:")
    for f in result.files:
        click.echo(f"  {f}")


@cli.command(name="inspect")
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@_data_option(required=False)
@_output_option(required=False)
@_options(*CONFIG_OPTIONS, *PASS_OPTIONS)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (sorted keys) instead of the table.")
@DEBUG_OPTION
def inspect_command(model, data, output, scheme, targets, ignore, observer, kv_cache, recipe, runtime, smoothquant,
                    smoothing_strength, matmulnbits, batch_size, num_samples, device, skip_nonfinite_weights,
                    exclude_padding, tap_limit_mb, as_json, debug, **algorithm):
    """Show what `graphcal run` would do to MODEL, without calibrating or writing anything.

    Takes every option run takes, so it can stand in for run as a dry run. Lists every weight
    MatMul/Gemm (module, node, torch [out, in] shape, layout, quantized or ignored), the fused
    groups, the key/value states of a kv-cache scheme, the opset the output needs, and the
    expected size of the written model.onnx; --data and -o, when given, are checked as run
    checks them (no sample is read, nothing is written).

    \b
    Example:
      graphcal inspect models/tiny-llama/model.onnx --scheme FP8
    """
    import json

    from graphcal.calibration.report import format_text, from_plan, to_dict

    def call():
        from graphcal.calibration.plan import plan
        from graphcal.data import graph_inputs, load_data
        from graphcal.output import check_output_dir
        from graphcal.runtime import check_device

        if output is not None:
            check_output_dir(output, [model, *([data] if data is not None else [])])
        config = resolve_options(scheme, targets, ignore, observer, kv_cache, recipe, smoothquant, smoothing_strength,
                                 **algorithm)
        check_device(device)
        run_plan = plan(model, config, runtime, matmulnbits)
        inputs = graph_inputs(run_plan.model)
        if data is not None:
            load_data(data, inputs, batch_size=batch_size, num_samples=num_samples)
        if exclude_padding:
            from graphcal.data import check_padding_input

            check_padding_input(f"the data {data}" if data is not None else f"the model {model}",
                                [i.name for i in inputs])
        return from_plan(run_plan)

    report = _guarded(call, debug)
    for w in report.warnings:
        click.echo(f"warning: {w}", err=True)
    click.echo(json.dumps(to_dict(report), sort_keys=True, indent=2) if as_json else format_text(report))


@cli.command(name="export")
@click.argument("model_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Folder for model.onnx (and calib.npz with --text).")
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
@click.option("--debug", is_flag=True, help="Show Python tracebacks on errors.")
def export_command(model_dir, output, dynamo, opset, text, seq, num_samples, pack, debug):
    """Export a local transformers model folder to ONNX, ready for graphcal run (nothing is downloaded).

    \b
    Example:
      graphcal export ./my-llama -o exported/ --text calib.txt --seq 256
      graphcal run exported/model.onnx --data exported/calib.npz --scheme W8A8 -o out/
    """
    from graphcal.export import export_pretrained

    exported = _guarded(lambda: export_pretrained(model_dir, output, dynamo=dynamo, opset=opset, text=text, seq=seq,
                                                   num_samples=num_samples, pack=pack), debug)
    click.echo("wrote:")
    for f in exported.files:
        click.echo(f"  {f}")
    if exported.padding is not None:
        click.echo(f"calib.npz: {exported.samples} samples x {seq} tokens, {exported.padding:.1%} of them padding"
                   + ("" if pack or exported.padding == 0 else " (--pack fills whole windows)"))


@cli.command(name="eval")
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
                   "measure the advice (the worst kinds back in float) the same way: one pass over the data per kind "
                   "and per option.")
@click.option("--per-layer", is_flag=True, help="With --sensitivity: each layer alone too (one pass per layer).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write an HTML page with the tables and a per-layer SQNR chart.")
@click.option("--debug", is_flag=True, help="Show Python tracebacks on errors.")
def eval_command(reference, quantized, data, batch_size, num_samples, level, isolated, sensitivity, per_layer, as_json,
                 html_path, debug):
    """Compare QUANTIZED with its fp32 REFERENCE on --data: SQNR, cosine and max error of every
    output, SQNR of every weight MatMul/Gemm output, the layers that hurt most, and the --ignore
    that would keep them in float.

    \b
    Example:
      graphcal eval models/tiny-llama/model.onnx out/model.onnx --data models/tiny-llama/heldout.npz
    """
    import json

    from graphcal.evaluation import evaluate, format_html, format_text

    report = _guarded(lambda: evaluate(reference, quantized, data, batch_size=batch_size, num_samples=num_samples,
                                       level=level, isolated=isolated, sensitivity=sensitivity,
                                       per_layer=per_layer), debug)
    if html_path is not None:
        _guarded(lambda: html_path.write_text(format_html(report, f"{quantized} vs {reference}")), debug)
    click.echo(json.dumps(report.as_dict(), sort_keys=True) if as_json else format_text(report))


@cli.command(name="bench")
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
              help="Untimed runs of each model per shape before timing.")
@click.option("--no-decode", is_flag=True, help="Skip the decode-like shape (batch 1, one token).")
@click.option("--no-memory", is_flag=True, help="Skip the peak-memory measurement (a fresh process per model).")
@click.option("--layers", "-v", "layers", is_flag=True, help="Also list the kernel of every layer in the text output.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (sorted keys) instead of the table.")
@DEBUG_OPTION
def bench_command(reference, quantized, data, batch_size, device, rounds, warmup, no_decode, no_memory, layers,
                  as_json, debug):
    """Time QUANTIZED against its fp32 REFERENCE in onnxruntime at its default settings
    (ORT_ENABLE_ALL), and show which kernel onnxruntime really runs for every weight MatMul/Gemm.

    Reports, for both models: time per batch and throughput on the first batch of --data
    (prefill) and on one token of one sample (decode-like, for models with a free sequence
    axis), with the ratio quantized/reference; file sizes; peak host memory of a fresh process
    that opens the model and runs one batch; and the kernel behind every weight MatMul/Gemm
    (MatMulNBits, an integer kernel, or float) with the execution provider it ran on.

    \b
    Example:
      graphcal bench models/tiny-llama/model.onnx out/model.onnx --data models/tiny-llama/heldout.npz
    """
    import json

    from graphcal.bench import bench, format_text

    report = _guarded(lambda: bench(reference, quantized, data, batch_size=batch_size, device=device, warmup=warmup,
                                    rounds=rounds, decode=not no_decode, memory=not no_memory), debug)
    click.echo(json.dumps(report.as_dict(), sort_keys=True) if as_json else format_text(report, layers=layers))


def _guarded(call, debug: bool):
    """Run ``call``; turn graphcal's errors into one line and an exit code.

    SIGTERM is handled like Ctrl-C (temporary files removed), exiting 143 instead of 130. Not under
    torchrun, whose SIGTERM must stop a rank at once even while it waits in a collective; there the
    output's write phase alone does so (graphcal.output).
    """
    try:
        with sigterm_as_interrupt(enabled=torchrun_rank() is None):
            return call()
    except GraphcalError as e:
        if debug:
            raise
        click.echo(f"error: {e}", err=True)
        settle(e)
        sys.exit(e.exit_code)
    except KeyboardInterrupt as e:
        click.echo("interrupted; no output was written", err=True)
        sys.exit(143 if isinstance(e, Terminated) else 130)
    except Exception as e:  # a bug or an input graphcal did not foresee: still one line, no half output
        if debug:
            raise
        detail = first_line(e) if str(e).strip() else ""  # the type is named just before
        click.echo(f"error: unexpected {type(e).__name__}: {detail} (rerun with --debug for the traceback)", err=True)
        settle(e)
        sys.exit(1)


def _scheme_label(scheme: str) -> str:
    return "a custom scheme" if scheme.lstrip().startswith("{") else scheme.upper()


def main() -> None:
    cli()
