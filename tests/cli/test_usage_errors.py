"""click's own refusals (unknown flags and verbs, missing arguments, bad choices and counts) are graphcal errors:
one ``error:`` line and exit 2, for every verb, never click's three usage lines."""

import pytest

from tests.helpers import run_cli

LLAMA = "models/tiny-llama/model.onnx"


@pytest.mark.parametrize("args, fragment", [
    (["run", LLAMA, "--device", "gpu"], "Invalid value for '--device'"),
    (["run", LLAMA, "--nope"], "No such option '--nope'"),
    (["run"], "Missing argument 'MODEL'"),
    (["run", LLAMA, "--batch-size", "0"], "Invalid value for '--batch-size'"),
    (["run", LLAMA, "--algorithm", "rtn"], "Invalid value for '--algorithm'"),
    (["inspect", LLAMA, "--scheme"], "Option '--scheme' requires an argument"),
    (["eval", LLAMA], "Missing argument"),
    (["bench", LLAMA, LLAMA], "Missing option '--data'"),
    (["bench", LLAMA, LLAMA, "--data", "d.npz", "--device", "tpu"], "Invalid value for '--device'"),
    (["export"], "Missing argument 'MODEL_DIR'"),
    (["export", "m", "-o", "o", "--genai", "int3"], "Invalid value for '--genai'"),
    (["frobnicate"], "No such command 'frobnicate'"),
    (["--nope"], "No such option '--nope'"),
])
def test_usage_errors_are_one_line(args, fragment):
    result = run_cli(*args)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.output
    assert "Usage:" not in result.output and "Traceback" not in result.output
