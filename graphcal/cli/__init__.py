"""graphcal's command line: the click group and its entry point. Each verb is the module of its name (run, inspect,
export, eval, bench); options and error reporting they share are in options and guard. Parse, call, report: no
logic lives here."""

from __future__ import annotations

import click

from graphcal.cli.bench import bench_command
from graphcal.cli.eval import eval_command
from graphcal.cli.export import export_command
from graphcal.cli.inspect import inspect_command
from graphcal.cli.options import OneLineGroup
from graphcal.cli.run import run

EXAMPLE = "graphcal run models/tiny-llama/model.onnx --data models/tiny-llama/calib.npz --scheme W8A8 -o out/"


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
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
        import logging  # lazy: only --verbose logs

        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("graphcal: %(message)s"))
        logger = logging.getLogger("graphcal")
        logger.handlers = [handler]  # one handler, however many times the group runs in a process
        logger.setLevel(logging.INFO)


for command in (run, inspect_command, export_command, eval_command, bench_command):
    cli.add_command(command)


def main() -> None:
    cli()
