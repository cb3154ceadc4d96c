"""graphcal run: calibrate a model on data and write the quantized model, then print what was done."""

from __future__ import annotations

import json
from pathlib import Path

import click

from graphcal.cli.guard import guarded
from graphcal.cli.options import CONFIG_OPTIONS, DEBUG_OPTION, PASS_OPTIONS, data_option, options, output_option, resolve_options


@click.command()
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@data_option(required=True)
@output_option(required=True)
@options(*CONFIG_OPTIONS, *PASS_OPTIONS)
@click.option("--json", "as_json", is_flag=True,
              help="Print the summary as one JSON object on stdout (for scripts); no progress bar.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary.")
@DEBUG_OPTION
def run(model, data, output, scheme, targets, ignore, observer, kv_cache, recipe, target_runtime, smoothquant,
        smoothing_strength, matmulnbits, batch_size, num_samples, device, skip_nonfinite_weights, exclude_padding,
        tap_limit_mb, as_json, quiet, debug, **algorithm):
    """Calibrate MODEL on --data and write a QDQ model and compressed-tensors metadata to -o.

    \b
    Example:
      graphcal run models/tiny-llama/model.onnx --data models/tiny-llama/calib.npz --scheme W8A8 -o out/
    """
    from graphcal.calibration.pipeline import calibrate  # lazy: loads torch, onnxruntime and compressed-tensors

    def call():
        return calibrate(
            model, data, output, config=resolve_options(scheme, targets, ignore, observer, kv_cache, recipe,
                                                        smoothquant, smoothing_strength, **algorithm),
            device=device, target=target_runtime, matmulnbits=matmulnbits, batch_size=batch_size, num_samples=num_samples,
            progress=not (quiet or as_json), skip_nonfinite_weights=skip_nonfinite_weights,
            exclude_padding=exclude_padding, tap_limit_mb=tap_limit_mb,
        )

    result = guarded(call, debug)
    if result.rank != 0:
        return  # under torchrun, rank 0 reports
    for w in result.warnings:
        click.echo(f"warning: {w}", err=True)
    if as_json:
        click.echo(json.dumps({
            "quantized": [i.target.name for i in result.targets], "ignored": result.ignored,
            "provider": result.provider, "samples": result.num_samples, "batches": result.num_batches,
            "ranks": result.world, "seconds": round(result.seconds, 3), "files": [str(f) for f in result.files],
            "warnings": result.warnings, "onnxruntime_kernels": result.forms,
            "padding_share": result.padding_share, "exclude_padding": result.exclude_padding,
            "model_bytes": result.model_bytes, "float_bytes": result.float_bytes, **result.transform_json(),
        }, sort_keys=True))
        return
    if quiet:
        return
    lookups = sum(1 for i in result.targets if i.target.op_type == "Gather")
    n = len(result.targets) - lookups
    label = f"recipe {recipe.name}" if recipe is not None and scheme is None else scheme_label(scheme or "W8A8")
    click.echo(f"quantized {n} MatMul/Gemm target{'s' if n != 1 else ''}"
               + (f" and {lookups} embedding lookup{'s' if lookups != 1 else ''}" if lookups else "")
               + f" with {label}" + (f"; left in float: {', '.join(result.ignored)}" if result.ignored else ""))
    if result.model_bytes:
        click.echo(f"written model: {result.model_bytes / 1e6:.1f} MB, of which {result.float_bytes / 1e6:.1f} MB "
                   f"({result.float_bytes / result.model_bytes:.0%}) is still float (weights left unquantized, "
                   "norms, biases, scales)")
    for line in result.transform_lines():  # each transform's own words (graphcal.calibration.transforms)
        click.echo(line)
    if result.provider is None and result.read_data_blockwise:
        click.echo(f"calibrated on {result.num_samples} samples in {result.num_batches} batches (GPTQ / AWQ; the "
                   "scheme has no static activations to observe)")
    elif result.provider is None:
        click.echo("calibration pass: not needed (the scheme has no static activations to observe)")
    else:
        ranks = f" across {result.world} ranks" if result.world > 1 else ""
        click.echo(f"calibrated on {result.num_samples} samples in {result.num_batches} batches{ranks} "
                   f"with onnxruntime {result.provider}")
    if result.padding_share is not None:
        if result.provider is None and result.read_data_blockwise:
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


def scheme_label(scheme: str) -> str:
    return "a custom scheme" if scheme.lstrip().startswith("{") else scheme.upper()
