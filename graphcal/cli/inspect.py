"""graphcal inspect: what run would do to a model (targets, groups, opset, size), as a dry run of run's checks."""

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
from graphcal.output import check_output_dir


@click.command(name="inspect", cls=OneLineCommand)
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@data_option(required=False)
@output_option(required=False)
@options(*CONFIG_OPTIONS, *PASS_OPTIONS, *BUDGET_OPTIONS)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (sorted keys) instead of the table.")
@DEBUG_OPTION
def inspect_command(model, data, output, size_budget, target_kl, mix_samples, as_json, debug, **flags):
    """Show what `graphcal run` would do to MODEL, without calibrating or writing anything.

    Takes every option run takes, so it can stand in for run as a dry run. Lists every weight
    MatMul/Gemm (module, node, torch [out, in] shape, layout, quantized or ignored), the fused
    groups, the key/value states of a kv-cache scheme, the opset the output needs, and the
    expected size of the written model.onnx; --data and -o, when given, are checked as run
    checks them (no sample is read, nothing is written). With --size-budget or --target-kl, the
    plan is the low form's the budget run starts from, checked against the budget.

    \b
    Example:
      graphcal inspect models/tiny-llama/model.onnx --scheme FP8
    """
    from graphcal.calibration.report import format_text, from_plan, to_dict  # lazy: loads torch and onnx

    def call():
        from graphcal.calibration.footprint import for_run  # lazy: loads torch, onnx and onnxruntime
        from graphcal.calibration.prepare import prepare  # lazy: loads torch, onnx and onnxruntime; graphcal --help stays fast
        from graphcal.config import resolve  # lazy: loads torch and onnx
        from graphcal.limits import available_memory

        if output is not None:
            check_output_dir(output, [model, *([data] if data is not None else [])])
        options = options_from_flags(flags)
        budget = None
        if size_budget is not None or target_kl is not None or mix_samples is not None:
            from graphcal.budget import DEFAULT_MIX_SAMPLES, budget_plan  # lazy: the budget's checks load the config

            budget = budget_plan(options, size_budget, target_kl, mix_samples or DEFAULT_MIX_SAMPLES, data)
            options = budget.low
        ready = prepare(model, resolve(options), target=options.target, matmulnbits=options.matmulnbits, data=data,
                        batch_size=options.batch_size, num_samples=options.num_samples,
                        exclude_padding=options.exclude_padding, device=options.device, pass_mode=options.pass_mode)
        try:
            report = from_plan(ready.plan, ready.loaded.model)  # every refusal of run's before its passes, as run makes them
            report.warnings += ready.calib.notes if ready.calib is not None else []  # inputs filled for the data
            memory = for_run(ready, options.tap_limit_mb, options.exclude_padding, options.cache_mb)  # before any weight is read, as run
        finally:
            ready.loaded.close()  # --rotate's weights, in the system's temporary folder
        free = available_memory()
        report.memory = memory.as_dict(free)
        report.pass_note = ready.plan.pass_note
        report.memory_line = memory.line(free) + ("" if ready.calib is not None else " (no --data: activations not counted)")
        if budget is not None:
            report.transform_lines.append(budget.line(report.expected_size))  # a budget under it refused, as run does
        return report

    report = guarded(call, debug)
    for w in report.warnings:
        click.echo(f"warning: {w}", err=True)
    click.echo(json.dumps(to_dict(report), sort_keys=True, indent=2) if as_json else format_text(report))
