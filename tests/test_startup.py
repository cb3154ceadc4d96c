"""What a command imports before its first batch: only what it uses (issue 49, startup).

A fresh child runs the CLI on models/tiny-llama with ``GRAPHCAL_STARTUP_PROBE`` set (graphcal/runtime.py): at the
first batch handed to onnxruntime it writes its ``sys.modules`` and ends. The modules a command does not use must be
absent then: another verb's package, the math of a transform not asked for, onnx's reference evaluator. The imports
are pinned, not the time (tools/startup.py measures that)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import MODELS, REPO, run_cli_process

LLAMA = MODELS / "tiny-llama"

#: never needed before a run's first batch
NOT_A_RUN = ("graphcal.evaluation", "graphcal.evaluation.agreement", "graphcal.export", "graphcal.bench",
             "graphcal.graph.switch", "graphcal.graph.compare", "onnx.reference")
GPTQ_MATH = ("graphcal.algorithms.gptq.math", "graphcal.algorithms.gptq.hessian")
AWQ_MATH = ("graphcal.algorithms.awq.math", "graphcal.algorithms.awq.clip", "graphcal.algorithms.awq.gram")
ROTATION_MATH = ("graphcal.algorithms.rotation.fold", "graphcal.algorithms.rotation.hadamard", "graphcal.graph.residual")


def _probe(tmp_path, *args) -> set[str]:
    """The modules of a child running ``graphcal ARGS`` when its first batch is about to run."""
    probe = tmp_path / "probe.json"
    done = run_cli_process(*args, env={"GRAPHCAL_STARTUP_PROBE": str(probe)})
    assert done.returncode == 0 and probe.exists(), done.stderr
    modules = set(json.loads(probe.read_text())["modules"])
    # the probe fired at a real run's first batch: the pass and onnxruntime are loaded
    assert {"onnxruntime", "graphcal.runtime", "graphcal.calibration.activations"} <= modules
    return modules


@pytest.mark.parametrize("flags, absent", [
    (("--scheme", "W8A8_STATIC"), NOT_A_RUN + GPTQ_MATH + AWQ_MATH + ROTATION_MATH),
    (("--scheme", "W4A16", "--algorithm", "gptq"), NOT_A_RUN + AWQ_MATH + ROTATION_MATH),
], ids=["minmax", "gptq"])
def test_a_run_reaches_its_first_batch_without_what_it_does_not_use(tmp_path, flags, absent):
    modules = _probe(tmp_path, "run", LLAMA / "model.onnx", "--data", LLAMA / "calib.npz", "-o", tmp_path / "out",
                     "--device", "cpu", "-q", *flags)
    assert sorted(m for m in absent if m in modules) == []
    if "gptq" in flags:
        assert "graphcal.algorithms.gptq.math" in modules  # what it does use is there by its first batch


def test_inspect_loads_no_transform_math_nor_another_verb(tmp_path):
    """inspect runs no batch: its modules at its end (the CLI through click's main, then sys.modules)."""
    code = ("import json, sys\nfrom graphcal.cli import cli\ncli.main(sys.argv[1:], standalone_mode=False)\n"
            "print(json.dumps(sorted(sys.modules)))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", code, "inspect", str(LLAMA / "model.onnx"), "--data",
                           str(LLAMA / "calib.npz"), "--scheme", "W8A8_STATIC", "--device", "cpu"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    modules = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert "graphcal.calibration.prepare" in modules
    assert sorted(m for m in NOT_A_RUN + GPTQ_MATH + AWQ_MATH + ROTATION_MATH if m in modules) == []
