#!/usr/bin/env python
"""Every activation observer's calibration time against plain inference, and its accuracy, in one table.

    python tools/observers_table.py                                  # minilm and bench-decoder, 3 repeats
    python tools/observers_table.py --models minilm --repeat 1 --markdown /tmp/obs.md --json /tmp/obs.json

W8A8_STATIC (int8 per-channel weights, int8 per-tensor static activations) calibrated with each
activation observer of ``CONFIGS`` -- llm-compressor's static_minmax (the preset's) and mse, and
graphcal's histogram observers histogram_mse, percentile and entropy -- and, as the peers users know,
onnxruntime's ``quantize_static`` at its defaults for x86 (QDQ, uint8 asymmetric activations, int8 per-channel
weights: its docs advise against int8 activations on x86, which its kernels may saturate) with its
MinMax, Percentile and Entropy calibrators, on the same layers (the MatMul/Gemm nodes with a weight; by
default it would also quantize the attention's activation-by-activation MatMuls). Every run is a child
process (its peak RSS its own, through tools/peak_rss.py; onnxruntime's runs are tools/ort_static.py); the
configurations run round-robin ``--repeat`` times (a slow spell of the shared machine hits them alike) and
each keeps its median time. Time: graphcal's ``seconds`` (model and data loading included, imports not) or
quantize_static's call; the baseline is plain onnxruntime over the same calibration batches (session
creation included: tools/infer_baseline.py).

Accuracy of the first output on held-out data at onnxruntime's default settings (ORT_ENABLE_ALL, what a
deployment runs): cosine and SQNR against fp32, and for all-MiniLM-L6-v2 the mean cosine of the sentence
embeddings (mean over the attention mask) to fp32's. Models and data as tools/smoothquant_table.py
prepares them (:func:`tools.lib.models.prepare_packed`): MiniLM calibrated on Python's docstrings in
128-token windows and evaluated on the licence texts; the bench decoder on its random-token data.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools.lib.children import child, infer_command, shown  # noqa: E402
from tools.lib.models import prepare_packed  # noqa: E402
from tools.lib.outputs import first_output, metrics  # noqa: E402
from tools.lib.report import emit, fmt, log  # noqa: E402

MODELS = ("minilm", "bench-decoder")
SCHEME = "W8A8_STATIC"
CONFIGS = {  # key: (label, kind, observer or calibration method)
    "fp32": ("fp32 (onnxruntime over the calibration batches)", "infer", None),
    "static_minmax": ("graphcal static_minmax (the preset's)", "graphcal", None),
    "mse": ("graphcal mse (llm-compressor's search)", "graphcal", "mse"),
    "histogram_mse": ("graphcal histogram_mse", "graphcal", "histogram_mse"),
    "percentile": ("graphcal percentile (99.999)", "graphcal", "percentile"),
    "entropy": ("graphcal entropy", "graphcal", "entropy"),
    "ort-minmax": ("onnxruntime quantize_static MinMax", "ort", "MinMax"),
    "ort-percentile": ("onnxruntime quantize_static Percentile", "ort", "Percentile"),
    "ort-entropy": ("onnxruntime quantize_static Entropy", "ort", "Entropy"),
}

def command_for(key: str, data, out: Path, batch: int, samples: int) -> list[str]:
    _, kind, what = CONFIGS[key]
    if kind == "infer":
        return infer_command(data.model, data.calib, batch, samples)
    if kind == "ort":
        out.mkdir(parents=True, exist_ok=True)
        return [sys.executable, "-m", "tools.ort_static", str(data.model), str(data.calib), str(out / "model.onnx"), str(batch),
                str(samples), what]
    return [sys.executable, "-m", "graphcal", "run", str(data.model), "--data", str(data.calib), "-o", str(out),
            "--scheme", SCHEME, "--batch-size", str(batch), "--num-samples", str(samples), "--device", "cpu", "--json",
            *(["--observer", what] if what else [])]


def run_model(name: str, args) -> dict:
    data = prepare_packed(name, args.work)
    batch = data.batch_size or 8
    calib_count = len(next(iter(np.load(data.calib).values())))
    # whole batches only: onnxruntime's histogram calibrators stack the batches and fail on a short last one
    samples = min(args.num_samples or calib_count, calib_count) // batch * batch
    feeds = dict(np.load(data.heldout))
    mask = feeds.get("attention_mask") if name == "minilm" else None
    ref = first_output(data.model, feeds, batch, "ORT_ENABLE_ALL")
    rows = {key: {"model": name, "config": key, "run": CONFIGS[key][0], "times": [], "peaks": []} for key in args.configs}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):  # round-robin: a slow spell of the machine hits every configuration alike
            for key in args.configs:
                row, kind = rows[key], CONFIGS[key][1]
                if "error" in row:
                    continue
                out = Path(tmp) / f"{key}-{i}"
                command = command_for(key, data, out, batch, samples)
                typed = shown(command) if kind in ("infer", "ort") else ["graphcal", *command[3:]]
                row["command"] = " ".join(shlex.quote(c) for c in typed)
                result = child(command)
                if result["rc"] != 0:
                    lines = [line for line in result["stderr"].splitlines() if line.strip()]
                    row["error"] = lines[-1] if lines else f"exit code {result['rc']}"
                    log(f"{name} {key}: FAILED: {row['error']}")
                    continue
                row["times"].append(json.loads(result["stdout"].strip().splitlines()[-1])["seconds"])
                row["peaks"].append(result["peak_rss_mb"])
                if i == 0:  # accuracy once: the runs write the same files
                    if kind == "infer":
                        row.update(cosine=1.0, sqnr=None)
                        if mask is not None:
                            row["sentence_cosine"] = 1.0
                    else:
                        row.update(metrics(ref, first_output(out / "model.onnx", feeds, batch, "ORT_ENABLE_ALL"), mask))
                log(f"{name} {key} round {i + 1}: {row['times'][-1]:.2f} s")
    rows = list(rows.values())
    for row in rows:
        if "error" not in row:
            row["seconds"], row["peak_rss_mb"] = statistics.median(row["times"]), max(row["peaks"])
            log(f"{name} {row['config']}: {row['seconds']:.2f} s (of {', '.join(f'{t:.2f}' for t in row['times'])}), "
                f"cosine {row['cosine']:.6f}, {row['peak_rss_mb']:.0f} MB")
    base = next((r for r in rows if r["config"] == "fp32" and "error" not in r), None)
    minmax = next((r for r in rows if r["config"] == "static_minmax" and "error" not in r), None)
    for r in rows:
        if "error" not in r:
            r["vs_inference"] = r["seconds"] / base["seconds"] if base else None
            r["vs_minmax"] = r["seconds"] / minmax["seconds"] if minmax else None
            r["memory_vs_inference"] = r["peak_rss_mb"] / base["peak_rss_mb"] if base else None
    return {"model": name, "description": data.description, "samples": samples, "batch": batch,
            "heldout": len(next(iter(feeds.values()))), "rows": rows}


def table(results: list[dict]) -> str:
    lines = ["| model | calibration | time (s, median) | vs inference | vs static_minmax | peak RSS (MB) | "
             "memory vs inference | cosine to fp32 | SQNR (dB) | sentence cosine |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        for r in result["rows"]:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['run']} | failed: `{r['error'].replace('|', '/')[:120]}` | | | | | | | |")
                continue
            lines.append(f"| {r['model']} | {r['run']} | {r['seconds']:.2f} | {fmt(r['vs_inference'], '.2f', 'x')} | "
                         f"{fmt(r['vs_minmax'], '.2f', 'x')} | {r['peak_rss_mb']:.0f} | "
                         f"{fmt(r['memory_vs_inference'], '.2f', 'x')} | {r['cosine']:.6f} | "
                         f"{fmt(r['sqnr'], '.2f') if r['sqnr'] is not None else 'inf'} | "
                         f"{fmt(r.get('sentence_cosine'), '.6f')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--num-samples", type=int, help="calibration samples (default: all of calib.npz)")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "graphcal-speed")
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.configs = [k for k in CONFIGS if k in args.configs]
    command = "python tools/observers_table.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    results = [run_model(name, args) for name in args.models]
    notes = [f"Generated by `{command.strip()}`."] + [
        f"- **{r['model']}**: {r['description']}; {r['samples']} calibration samples in batches of {r['batch']}, "
        f"{r['heldout']} held-out samples." for r in results]
    emit("\n".join([table(results), "", *notes]), results, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
