"""Time and peak memory of graphcal's commands against plain onnxruntime inference over the same data.

    python -m tools.memory_table MODEL.onnx --calib CALIB.npz --eval EVAL.npz [--scheme W8A8_STATIC]
        [--batch 8] [--work DIR] [--json OUT.json]

Each command runs in a child of its own (tools/lib/children.py: its peak RSS is its own), one after
the other, so the ratios compare runs on the same machine minutes apart:

- plain inference (tools/infer_baseline.py: one onnxruntime session at its defaults, batches of
  ``--batch``) over the calibration data and over the evaluation data: the baselines;
- ``graphcal run MODEL --data CALIB --scheme SCHEME`` (min/max observers), against plain inference
  over CALIB;
- ``graphcal eval MODEL OUT --data EVAL``, ``eval --sensitivity`` and ``graphcal bench MODEL OUT
  --data EVAL``, against plain inference over EVAL (bench times its own rounds on the first batch).

The real LLM (tools/real_llm.py) and the 1.5B decoder (tools/make_models.py --large-decoder) are the
models docs/benchmarks.md reports this for. Prints a markdown table; ``--json`` keeps the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from tools.lib.children import child, infer_command, shown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--calib", type=Path, required=True)
    parser.add_argument("--eval", dest="eval_data", type=Path, required=True)
    parser.add_argument("--scheme", default="W8A8_STATIC")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--work", type=Path, default=None, help="Where the quantized model goes (default: a temporary folder).")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--skip", nargs="*", default=[], help="Rows to leave out: run eval sensitivity bench.")
    args = parser.parse_args(argv)
    import numpy as np

    counts = {label: len(next(iter(np.load(path).values()))) for label, path in (("calib", args.calib),
                                                                                   ("eval", args.eval_data))}
    work = Path(tempfile.mkdtemp(prefix="graphcal-memory-")) if args.work is None else args.work
    out = work / "quantized"
    rows = []

    def measure(label: str, command: list[str], baseline: str | None) -> dict:
        result = child(command)
        if result["rc"] != 0:
            raise SystemExit(f"{label} failed ({result['rc']}): {result['stderr'][-2000:]}")
        row = {"label": label, "command": " ".join(shown(command)), "wall_s": result["wall_s"],
               "peak_rss_mb": result["peak_rss_mb"], "baseline": baseline}
        rows.append(row)
        print(f"{label}: {row['wall_s']:.1f} s, {row['peak_rss_mb']:.0f} MB", file=sys.stderr)
        return row

    graphcal = [sys.executable, "-m", "graphcal"]
    for data, path in (("calib", args.calib), ("eval", args.eval_data)):
        measure(f"plain inference over {data} ({counts[data]} samples)",
                infer_command(args.model, path, args.batch, counts[data]), None)
    if "run" not in args.skip or not (out / "model.onnx").exists():
        shutil.rmtree(out, ignore_errors=True)
        measure(f"run --scheme {args.scheme}", [*graphcal, "run", str(args.model), "--data", str(args.calib),
                                                "--scheme", args.scheme, "--batch-size", str(args.batch), "-o", str(out),
                                                "-q"], "calib")
    compared = [str(args.model), str(out / "model.onnx"), "--data", str(args.eval_data), "--batch-size", str(args.batch)]
    if "eval" not in args.skip:
        measure("eval", [*graphcal, "eval", *compared], "eval")
    if "sensitivity" not in args.skip:
        measure("eval --sensitivity", [*graphcal, "eval", *compared, "--sensitivity", "--time-limit", "0"], "eval")
    if "bench" not in args.skip:
        measure("bench", [*graphcal, "bench", *compared[:4], "--batch-size", str(args.batch), "--rounds", "3",
                          "--warmup", "1"], "eval")
    plain = {r["label"].split()[3]: r for r in rows if r["baseline"] is None}
    print("| command | wall time | peak RSS | time vs plain | memory vs plain |")
    print("|---|---|---|---|---|")
    for r in rows:
        base = plain.get(r["baseline"]) if r["baseline"] else None
        ratio = (f"{r['wall_s'] / base['wall_s']:.2f}x | {r['peak_rss_mb'] / base['peak_rss_mb']:.2f}x" if base
                 else "1 | 1")
        print(f"| `{r['command'].replace(str(work), 'WORK')}` | {r['wall_s']:.1f} s | {r['peak_rss_mb'] / 1024:.2f} GB | "
              f"{ratio} |")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
