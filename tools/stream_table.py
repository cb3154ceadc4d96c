"""Peak memory and time of graphcal run, streamed block by block and over the whole graph, against plain inference.

    python -m tools.stream_table MODEL.onnx --data CALIB.npz [--batch 8] [--samples N]
        [--runs infer,W8A8_STATIC:blocks,W8A8_STATIC:whole-graph,W4A16,W4A16:gptq] [--work DIR] [--json OUT.json]

Each run is a child of its own (tools/lib/children.py: its peak RSS is its own), one after the other, so the
ratios compare runs on the same machine minutes apart. A run is ``infer`` (tools/infer_baseline.py: one
onnxruntime session over the data at its defaults: the baseline) or ``SCHEME[:PASS][:gptq]``: ``graphcal run
MODEL --data CALIB --scheme SCHEME`` with ``--pass PASS`` (default auto) and ``--algorithm gptq`` where asked.
A model plain inference cannot hold on the machine is measured without ``infer`` (leave it out of --runs).
Every written model is loaded and run once in onnxruntime on the first batch (``loads``), then deleted.
Prints a markdown table; ``--json`` keeps the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from tools.lib.children import child, infer_command, shown

DEFAULT_RUNS = "infer,W8A8_STATIC:blocks,W8A8_STATIC:whole-graph,W4A16,W4A16:gptq"


def run_command(model: Path, data: Path, out: Path, spec: str, batch: int, samples: int | None) -> list[str]:
    """``graphcal run`` for ``spec`` (SCHEME[:PASS][:gptq])."""
    scheme, *rest = spec.split(":")
    command = [sys.executable, "-m", "graphcal", "run", str(model), "--data", str(data), "--scheme", scheme,
               "--batch-size", str(batch), "-o", str(out), "-q", "--json"]
    for part in rest:
        command += ["--algorithm", "gptq"] if part == "gptq" else ["--pass", part]
    if samples is not None:
        command += ["--num-samples", str(samples)]
    return command


def loads(out: Path, data: Path, batch: int) -> bool:
    """The written model loads in onnxruntime (CPU, its defaults) and runs the first batch to finite outputs."""
    check = [sys.executable, "-c",
             "import sys, numpy as np, onnxruntime as ort\n"
             "s = ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])\n"
             "d = dict(np.load(sys.argv[2]))\n"
             "feeds = {i.name: d[i.name][:int(sys.argv[3])] for i in s.get_inputs()}\n"
             "outs = s.run(None, feeds)\n"
             "sys.exit(0 if all(np.isfinite(o).all() for o in outs if o.dtype.kind == 'f') else 3)\n",
             str(out / "model.onnx"), str(data), str(batch)]
    return child(check)["rc"] == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--runs", default=DEFAULT_RUNS)
    parser.add_argument("--work", type=Path, default=None, help="where outputs are written (default: a temporary folder)")
    parser.add_argument("--no-load-check", action="store_true", help="skip loading each output in onnxruntime")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="stream-table-", dir=args.work))
    rows = []
    try:
        for spec in args.runs.split(","):
            if spec == "infer":
                samples = args.samples or len(next(iter(dict(__import__("numpy").load(args.data)).values())))
                command = infer_command(args.model, args.data, args.batch, samples)
                got = child(command)
                row = {"run": "plain inference", "command": " ".join(shown(command))}
            else:
                out = work / spec.replace(":", "-")
                command = run_command(args.model, args.data, out, spec, args.batch, args.samples)
                got = child(command)
                row = {"run": spec, "command": " ".join(shown(command))}
                if got["rc"] == 0:
                    summary = json.loads(got["stdout"].strip().splitlines()[-1])
                    row["pass"] = summary.get("pass", "")
                    row["pass_s"] = summary.get("pass_seconds")
                    row["model_bytes"] = summary.get("model_bytes")
                    row["loads"] = None if args.no_load_check else loads(out, args.data, args.batch)
                shutil.rmtree(out, ignore_errors=True)
            row.update(rc=got["rc"], wall_s=round(got["wall_s"], 1), peak_rss_mb=got["peak_rss_mb"])
            if got["rc"] != 0:
                row["error"] = (got["stderr"].strip().splitlines() or [""])[-1]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = next((r for r in rows if r["run"] == "plain inference" and r["rc"] == 0), None)
    print("| run | pass | wall (s) | of it the activation pass (s) | peak RSS (MB) | vs inference: time | "
          "vs inference: peak | output loads |")
    print("|---|---|---|---|---|---|---|---|")
    def ratio(r: dict, key: str) -> str:
        return f"{r[key] / base[key]:.2f}x" if base and r.get(key) else "-"

    for r in rows:
        print(f"| {r['run']} | {r.get('pass', '') or r.get('error', '')} | {r['wall_s']} | {r.get('pass_s', '-')} | "
              f"{r['peak_rss_mb'] or 0:.0f} | {ratio(r, 'wall_s')} | {ratio(r, 'peak_rss_mb')} | {r.get('loads', '-')} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
