#!/usr/bin/env python
"""Startup: the seconds from a process's start to its first batch handed to onnxruntime, side by side.

    python tools/startup.py                          # models/tiny-llama, best of 3, on the CPU
    python tools/startup.py --device cuda --repeats 3 --markdown startup.md

Each row is a fresh child process, timed from just before it is spawned to the moment it is about to hand
its first batch to onnxruntime (graphcal's ``GRAPHCAL_STARTUP_PROBE``, graphcal/runtime.py: the child
writes the time and its loaded modules there and ends), best of ``--repeats``:

- ``import onnxruntime, numpy``: the floor's startup (what plain inference imports before its first run);
- ``import torch``;
- ``graphcal run`` with W8A8_STATIC (min/max), W4A16 by GPTQ and by AWQ (the first batch: AWQ's first block run);
- ``graphcal eval`` of the fp32 model against a W8A8_STATIC output (made first, once);
- ``graphcal inspect`` (it runs no batch: the whole command, to its end).

The table also names the heavy modules each child had loaded by then (transformers, torch.distributed.tensor,
sympy, ...): what a command should import only when it uses them (torch loads torch.distributed itself).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools.lib.report import cpu_name, emit, log  # noqa: E402

PROBE = "GRAPHCAL_STARTUP_PROBE"  # graphcal.runtime.STARTUP_PROBE (not imported: the parent stays light)

#: the child's last words: the time and its modules into the probe's file (for the rows that run no batch)
STAMP = ("import json, os, sys, time; open(os.environ['{p}'], 'w').write("
         "json.dumps({{'time': time.time(), 'modules': sorted(sys.modules)}}))").format(p=PROBE)
#: inspect through the CLI, then the stamp (inspect runs no batch: its startup is the whole command)
INSPECT = ("import sys\nfrom graphcal.cli import cli\ntry:\n    cli.main(sys.argv[1:], standalone_mode=False)\n"
           "finally:\n    " + STAMP.replace("; ", "\n    "))

#: modules a command should load only when it uses them, by the name shown in the table
WATCHED = {
    "transformers": "transformers",
    "torch.distributed.tensor": "torch.distributed.tensor",
    "torch._dynamo": "torch._dynamo",
    "sympy": "sympy",
    "scipy": "scipy",
    "onnx.reference": "onnx.reference",
    "compressed_tensors.offload": "compressed_tensors.offload",
    "graphcal.evaluation": "graphcal.evaluation",
    "graphcal.export": "graphcal.export",
    "graphcal.bench": "graphcal.bench",
    "gptq": "graphcal.algorithms.gptq.math",
    "awq": "graphcal.algorithms.awq.math",
}


def rows(model: Path, data: Path, heldout: Path, quantized: Path, out: Path, device: str) -> dict[str, list[str]]:
    """Each row's child command line (after ``python``)."""
    run = ["-m", "graphcal", "run", str(model), "--data", str(data), "-o", str(out), "--device", device, "-q"]
    return {
        "import onnxruntime, numpy (the floor)": ["-c", "import onnxruntime, numpy; " + STAMP],
        "import torch": ["-c", "import torch; " + STAMP],
        "graphcal run W8A8_STATIC (min/max)": [*run, "--scheme", "W8A8_STATIC"],
        "graphcal run W4A16 GPTQ": [*run, "--scheme", "W4A16", "--algorithm", "gptq"],
        "graphcal run W4A16 AWQ": [*run, "--scheme", "W4A16", "--algorithm", "awq"],
        "graphcal eval": ["-m", "graphcal", "eval", str(model), str(quantized), "--data", str(heldout)],
        "graphcal inspect (whole command)": ["-c", INSPECT, "inspect", str(model), "--data", str(data),
                                             "--scheme", "W8A8_STATIC", "--device", device],
    }


def once(argv: list[str], work: Path) -> tuple[float, list[str]]:
    """One child: (seconds from spawn to its probe, its modules then)."""
    probe = work / "probe.json"
    probe.unlink(missing_ok=True)
    out = work / "out"
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    env = {**os.environ, PROBE: str(probe), "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t0 = time.time()
    done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=600)
    if not probe.exists():
        raise SystemExit(f"no probe from {' '.join(argv)} (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    stamp = json.loads(probe.read_text())
    return stamp["time"] - t0, stamp["modules"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "tiny-llama" / "model.onnx")
    ap.add_argument("--data", type=Path, default=None, help="calibration data (default: calib.npz beside the model)")
    ap.add_argument("--heldout", type=Path, default=None, help="eval's data (default: heldout.npz beside the model, "
                                                                "else --data)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="run's and inspect's --device")
    ap.add_argument("--repeats", type=int, default=3, help="children per row; the best is reported")
    ap.add_argument("--markdown", type=Path, help="also write the table here")
    ap.add_argument("--json", type=Path, help="also write every measurement here")
    args = ap.parse_args(argv)
    data = args.data or args.model.parent / "calib.npz"
    heldout = args.heldout or (args.model.parent / "heldout.npz" if (args.model.parent / "heldout.npz").exists() else data)
    with tempfile.TemporaryDirectory(prefix="graphcal-startup-") as tmp:
        work = Path(tmp)
        quantized = work / "quantized"
        log("writing the W8A8_STATIC model eval compares")
        subprocess.run([sys.executable, "-m", "graphcal", "run", str(args.model), "--data", str(data), "-o", str(quantized),
                        "--scheme", "W8A8_STATIC", "--device", args.device, "-q"], check=True,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
        commands = rows(args.model, data, heldout, quantized / "model.onnx", work / "out", args.device)
        results = []
        for _ in range(args.repeats):  # interleaved: each round runs every row once
            for name, child in commands.items():
                seconds, modules = once(child, work)
                log(f"{name}: {seconds:.2f} s")
                results.append({"row": name, "seconds": seconds, "modules": len(modules),
                                "loaded": [k for k, m in WATCHED.items() if m in set(modules)]})
    best = {}
    for r in results:
        if r["row"] not in best or r["seconds"] < best[r["row"]]["seconds"]:
            best[r["row"]] = r
    floor = best[next(iter(commands))]["seconds"]
    lines = [f"Startup on {cpu_name()} ({os.cpu_count()} cores), {args.model.parent.name}, --device {args.device}, "
             f"best of {args.repeats}: seconds from spawning the child to its first batch handed to onnxruntime.", "",
             "| child | startup (s) | x floor | modules | heavy modules loaded |", "|---|---|---|---|---|"]
    for name, r in best.items():
        lines.append(f"| {name} | {r['seconds']:.2f} | {r['seconds'] / floor:.2f} | {r['modules']} | "
                     f"{', '.join(r['loaded']) or '-'} |")
    emit("\n".join(lines), results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
