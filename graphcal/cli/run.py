"""graphcal run: calibrate a model on data and write the quantized model, then print what was done."""

from __future__ import annotations

import json
from pathlib import Path

import click

from graphcal.cli.guard import guarded
from graphcal.cli.options import (
    BUDGET_OPTIONS,
    CONFIG_OPTIONS,
    DEBUG_OPTION,
    PASS_OPTIONS,
    OneLineCommand,
    data_option,
    options,
    options_from_flags,
    output_option,
)


@click.command(cls=OneLineCommand)
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@data_option(required=True)
@output_option(required=True)
@options(*CONFIG_OPTIONS, *PASS_OPTIONS, *BUDGET_OPTIONS)
@click.option("--json", "as_json", is_flag=True,
              help="Print the summary as one JSON object on stdout (for scripts); no progress bar.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary.")
@DEBUG_OPTION
def run(model, data, output, size_budget, target_kl, mix_samples, as_json, quiet, debug, **flags):
    """Calibrate MODEL on --data and write a QDQ model and compressed-tensors metadata to -o.

    \b
    Example:
      graphcal run models/tiny-llama/model.onnx --data models/tiny-llama/calib.npz --scheme W8A8 -o out/
    """
    from graphcal.calibration.pipeline import calibrate  # lazy: loads torch, onnxruntime and compressed-tensors

    def call():
        options = options_from_flags(flags, progress=not (quiet or as_json))
        if size_budget is None and target_kl is None and mix_samples is None:
            return calibrate(model, data, output, options)
        from graphcal.budget import DEFAULT_MIX_SAMPLES, Goal, calibrate_within  # lazy: loads eval's modules too

        return calibrate_within(model, data, output, options, goal=Goal.from_flags(size_budget, target_kl),
                                mix_samples=mix_samples or DEFAULT_MIX_SAMPLES)

    result = guarded(call, debug)
    if result.rank != 0:
        return  # under torchrun, rank 0 reports
    for w in result.warnings:
        click.echo(f"warning: {w}", err=True)
    if as_json:
        click.echo(json.dumps(result.as_dict(), sort_keys=True))
    elif not quiet:
        for line in result.summary_lines():
            click.echo(line)
