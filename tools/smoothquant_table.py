#!/usr/bin/env python
"""Static int8 with and without SmoothQuant, against dynamic int8 and fp32, in one table.

    python tools/smoothquant_table.py                       # tiny-llama, tiny-bert, bench-decoder, minilm
    python tools/smoothquant_table.py --models minilm --strengths 0.5 0.8 --markdown /tmp/sq.md

For each model it calibrates W8A8 (dynamic per-token int8), W8A8_STATIC, and W8A8_STATIC after
SmoothQuant (``--smoothquant norms``, ``all`` and ``mul``, at each of ``--strengths``: llm-compressor's
default 0.5 and graphcal's searched ``auto`` unless given) with
``graphcal.calibration.pipeline.calibrate`` (``--target onnxruntime``), and measures in this one process:

- accuracy of the first output on held-out data at onnxruntime's default settings (ORT_ENABLE_ALL,
  what a deployment runs): cosine and SQNR against fp32; for all-MiniLM-L6-v2 also the sentence
  embedding (mean over the attention mask, as sentence-transformers pools it): mean cosine to fp32's;
- "left of the static loss": (dynamic - this) / (dynamic - static) of the headline metric (sentence
  cosine for MiniLM, output cosine otherwise): 1 is plain static int8, 0 is as good as dynamic int8;
- calibration time against plain W8A8_STATIC's (same data, same process, each run once);
- speed at the prefill shape against fp32 (graphcal.bench.bench, interleaved rounds, ORT_ENABLE_ALL):
  what the explicit Muls of ``--smoothquant mul`` cost.

Models and data as tools/speed_table.py prepares them (cached in ``--work``, default
/tmp/graphcal-speed), except MiniLM's calibration text, packed into full windows here
(``graphcal export --pack``: no padding) and 64 held-out samples instead of 8
(:func:`tools.lib.models.prepare_packed`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools.lib.models import MODELS, prepare_packed  # noqa: E402
from tools.lib.outputs import first_output, metrics  # noqa: E402
from tools.lib.report import log  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--strengths", nargs="+", default=["0.5", "auto"],
                    help="SmoothQuant strengths to try: numbers, or auto (searched per mapping)")
    ap.add_argument("--scopes", nargs="+", default=["norms", "all", "mul"])
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds per model for the speed column")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "graphcal-speed")
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from graphcal.bench import bench  # lazy: torch, kept out of --help
    from graphcal.calibration.pipeline import calibrate  # lazy: torch, kept out of --help

    rows = []
    with tempfile.TemporaryDirectory() as tmp:  # imports and first-call costs, paid before anything is timed
        tiny = REPO / "models" / "tiny-llama"
        calibrate(tiny / "model.onnx", tiny / "calib.npz", Path(tmp) / "warm", scheme="W8A8_STATIC",
                  smoothquant="mul", smoothing_strength="auto", device="cpu")
    for name in args.models:
        data = prepare_packed(name, args.work)
        feeds = dict(np.load(data.heldout))
        batch = data.batch_size or 8
        ref = first_output(data.model, feeds, batch)
        mask = feeds.get("attention_mask") if name == "minilm" else None
        runs = [("W8A8", "W8A8", None, None), ("W8A8_STATIC", "W8A8_STATIC", None, None)]
        runs += [(f"W8A8_STATIC --smoothquant {scope}" + (f" --smoothing-strength {a}" if a != "0.5" else ""),
                  "W8A8_STATIC", scope, a) for a in args.strengths for scope in args.scopes]
        results = {}
        with tempfile.TemporaryDirectory() as tmp:
            for label, scheme, scope, strength in runs:
                out = Path(tmp) / f"out{len(results)}"
                start = time.perf_counter()
                calibrate(data.model, data.calib, out, scheme=scheme, smoothquant=scope, smoothing_strength=strength,
                          device="cpu", batch_size=data.batch_size)
                seconds = time.perf_counter() - start
                got = first_output(out / "model.onnx", feeds, batch)
                speed = bench(data.model, out / "model.onnx", data.heldout, batch_size=data.batch_size, device="cpu",
                              rounds=args.rounds, decode=False, memory=False).shapes[0].ratio
                results[label] = {"calibration_s": seconds, "speed_vs_fp32": speed, **metrics(ref, got, mask)}
                log(f"{name} {label}: {results[label]}")
        key = "sentence_cosine" if mask is not None else "cosine"
        dynamic, static = results["W8A8"][key], results["W8A8_STATIC"][key]
        base_time = results["W8A8_STATIC"]["calibration_s"]
        for label, r in results.items():
            r["left_of_static_loss"] = (dynamic - r[key]) / (dynamic - static) if dynamic != static else None
            r["calibration_vs_static"] = r["calibration_s"] / base_time
            rows.append({"model": name, "run": label, "metric": key, **r})
    table = _table(rows)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def _table(rows) -> str:
    lines = ["| model | run (`graphcal run` flags) | cosine to fp32 | SQNR (dB) | sentence cosine | left of the static "
             "loss | calibration time vs W8A8_STATIC | prefill time vs fp32 |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        left = "-" if r["left_of_static_loss"] is None else f"{r['left_of_static_loss']:.2f}"
        sentence = f"{r['sentence_cosine']:.5f}" if "sentence_cosine" in r else "-"
        speed = f"{r['speed_vs_fp32']:.2f}" if r["speed_vs_fp32"] else "-"
        lines.append(f"| {r['model']} | {r['run']} | {r['cosine']:.5f} | {r['sqnr']:.1f} | {sentence} | {left} | "
                     f"{r['calibration_vs_static']:.2f}x | {speed} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
