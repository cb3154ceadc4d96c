"""The memory measurement's child program: open one model, run one batch, print its peak memory as JSON.

Run by graphcal.bench.memory as ``python -P -m graphcal.bench.child SPEC``, a fresh process per
model, where SPEC is JSON: ``{"model", "batch" (an .npz), "providers", "probe" (a one-node model
whose CUDA session gives the CUDA context's GPU memory, or null)}``. It imports only numpy and
onnxruntime (and the standard library), and graphcal.bench's package file imports nothing, so the
process it measures holds no more than a caller of onnxruntime would.
"""

import json
import os
import resource
import subprocess
import sys

import numpy as np
import onnxruntime as ort


def status(key):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak():
    # VmHWM: this process image's own high-water mark. ru_maxrss is not: Linux carries the parent's
    # peak over fork and exec into it, so a child of a 300 MB parent starts with ru_maxrss = 300 MB.
    hwm = status("VmHWM")
    if hwm is not None:
        return hwm
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value if sys.platform == "darwin" else value * 1024


def rss():
    current = status("VmRSS")
    return current if current is not None else peak()


def gpu_used():
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    used = [int(f[1]) for f in (line.split(",") for line in out.splitlines())
            if len(f) == 2 and f[0].strip() == str(os.getpid()) and f[1].strip().isdigit()]
    return sum(used) * 2**20 if used else None


def main(argv):
    spec = json.loads(argv[1])
    after_imports = rss()
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    result = {}
    if spec["probe"] is not None:
        if hasattr(ort, "preload_dlls"):
            try:
                ort.preload_dlls()
            except Exception:  # noqa: BLE001 -- the probe session below says whether CUDA works
                pass
        probe = ort.InferenceSession(spec["probe"], opts, providers=spec["providers"])
        probe.run(None, {"x": np.zeros(1, np.float32)})
        result["device_context_bytes"] = gpu_used()
    session = ort.InferenceSession(spec["model"], opts, providers=spec["providers"])
    with np.load(spec["batch"], allow_pickle=False) as data:
        feeds = {k: data[k] for k in data.files}
    session.run(None, feeds)
    result.update(rss_after_imports_bytes=after_imports, peak_rss_bytes=peak(), provider=session.get_providers()[0])
    if spec["probe"] is not None:
        result["device_bytes"] = gpu_used()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv)
