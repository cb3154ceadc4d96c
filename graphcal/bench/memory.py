"""Peak memory: a fresh process per model (graphcal.bench.child) opens it and runs one batch.

Host memory is the process's own high-water mark; on CUDA, the GPU memory nvidia-smi attributes to
it, over the CUDA context a one-node probe session makes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from graphcal.errors import GraphcalError

# The child runs with -P (no script or current folder on sys.path: a numpy.py or onnxruntime/ there
# cannot shadow the real ones); -m still finds graphcal where it is installed, or on PYTHONPATH.
CHILD = [sys.executable, "-P", "-m", "graphcal.bench.child"]


def measure_memory(path: Path, batch_file: Path, providers: list[str], probe: Path | None) -> dict:
    """Peak resident host memory of a fresh process that opens ``path`` and runs one batch, and
    its increase over the process right after its imports (numpy, onnxruntime). On CUDA, the GPU
    memory nvidia-smi attributes to the process after the batch, and its increase over the CUDA
    context a one-node ``probe`` session made (when nvidia-smi lists the process)."""
    spec = {"model": str(path), "batch": str(batch_file), "providers": providers,
            "probe": str(probe) if probe is not None else None}
    done = subprocess.run([*CHILD, json.dumps(spec)], capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise GraphcalError(f"{path}: the memory measurement's process failed "
                            f"({lines[-1].strip() if lines else f'exit code {done.returncode}'})")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    out = {"peak_rss_bytes": got["peak_rss_bytes"], "rss_after_imports_bytes": got["rss_after_imports_bytes"],
           "increase_bytes": got["peak_rss_bytes"] - got["rss_after_imports_bytes"], "provider": got["provider"],
           "device_bytes": None, "device_increase_bytes": None, "device": "not measured"}
    if probe is None:
        out["device"] = "not measured (runs on CPU)"
    elif got.get("device_bytes") is None:
        why = "no nvidia-smi" if shutil.which("nvidia-smi") is None else "nvidia-smi does not list the process"
        out["device"] = f"not measured ({why})"
    else:
        out["device_bytes"] = got["device_bytes"]
        if got.get("device_context_bytes") is not None:
            out["device_increase_bytes"] = got["device_bytes"] - got["device_context_bytes"]
        out["device"] = "nvidia-smi"
    return out


def probe_model(tmp: Path) -> Path:
    """A one-node model whose CUDA session gives the baseline (the CUDA context) of GPU memory."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    path = tmp / "probe.onnx"
    onnx.save(model, str(path))
    return path
