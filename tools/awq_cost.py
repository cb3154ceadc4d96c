"""AWQ's cost and accuracy against plain inference over the same data, each run in its own child.

    python -m tools.awq_cost MODEL CALIB_NPZ --eval EVAL_NPZ [--eval EVAL2_NPZ] [--samples 64] [--batch 8]
        [--config NAME=FLAGS ...] [--out DIR]

First plain onnxruntime over the calibration data (tools/infer_baseline.py: the model's KV-cache
inputs filled as graphcal fills them), then ``graphcal run MODEL --data CALIB FLAGS`` for each
config, each through tools.peak_rss (wall time, peak host memory); with ``--eval`` (repeatable), the
perplexity of each written model over each held-out set (tools/lib/perplexity.py). Prints a markdown table and one JSON line.
The defaults are the real-LLM issue's: W4A16 groups of 64, AWQ without duo scaling, its parents
scored on every sample, on 16 and on 8, and with the clip search (``--awq-clip``) on 16 and on 8.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from tools.lib.children import child, infer_command
from tools.lib.perplexity import perplexity

BASE = "--scheme W4A16 --group-size 64"
CONFIGS = {
    "RTN": BASE,
    "AWQ, all samples": f"{BASE} --algorithm awq --duo-scaling false",
    "AWQ --awq-samples 16": f"{BASE} --algorithm awq --duo-scaling false --awq-samples 16",
    "AWQ --awq-samples 8": f"{BASE} --algorithm awq --duo-scaling false --awq-samples 8",
    "AWQ --awq-samples 16 --awq-clip": f"{BASE} --algorithm awq --duo-scaling false --awq-samples 16 --awq-clip",
    "AWQ --awq-samples 8 --awq-clip": f"{BASE} --algorithm awq --duo-scaling false --awq-samples 8 --awq-clip",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("calib", type=Path)
    p.add_argument("--eval", type=Path, action="append", default=[],
                   help="held-out token data: perplexity of each written model (repeatable)")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--config", action="append", default=None, metavar="NAME=FLAGS",
                   help="a run to time (repeatable; default: RTN and AWQ on all, 16 and 8 samples)")
    p.add_argument("--out", type=Path, default=Path("/tmp/graphcal-awq-cost"))
    args = p.parse_args(argv)
    configs = dict(c.split("=", 1) for c in args.config) if args.config else CONFIGS
    floor = child(infer_command(args.model, args.calib, args.batch, args.samples))
    if floor["rc"]:
        print(floor["stderr"][-2000:], file=sys.stderr)
        return 1
    rows = [{"run": "onnxruntime inference (floor)", "seconds": floor["wall_s"], "peak_mb": floor["peak_rss_mb"]}]
    for name, flags in configs.items():
        out = args.out / "".join(c if c.isalnum() else "_" for c in name)
        command = [sys.executable, "-m", "graphcal", "run", str(args.model), "--data", str(args.calib),
                   "--num-samples", str(args.samples), "--batch-size", str(args.batch), *flags.split(),
                   "-o", str(out), "-q"]
        shutil.rmtree(out, ignore_errors=True)
        run = child(command)
        if run["rc"]:
            print(f"{name}: {run['stderr'][-2000:]}", file=sys.stderr)
            return 1
        row = {"run": f"graphcal {flags}", "seconds": run["wall_s"], "peak_mb": run["peak_rss_mb"]}
        row["perplexity"] = {e.stem: perplexity(out / "model.onnx", e)["perplexity"] for e in args.eval}
        rows.append(row)
    names = [e.stem for e in args.eval]
    print("| run | wall time (s) | vs inference | peak host memory (MB) |" + "".join(f" perplexity ({n}) |" for n in names))
    print("|---|---|---|---|" + "---|" * len(names))
    for r in rows:
        ppl = "".join(f" {r['perplexity'][n]:.2f} |" if "perplexity" in r else " |" for n in names)
        print(f"| {r['run']} | {r['seconds']:.1f} | {r['seconds'] / rows[0]['seconds']:.2f}x | {r['peak_mb']:.0f} |{ppl}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
