"""How close graphcal's QDQ models are to fp32 on held-out data, for the shipped models.

    python tools/accuracy.py [--schemes W8A8 W8A8_STATIC FP8 FP8_DYNAMIC]

Calibrates each shipped model on models/*/calib.npz, runs the fp32 and the QDQ model in
onnxruntime (CPU, ORT_ENABLE_BASIC) on models/*/heldout.npz, and prints a markdown table of
SQNR, cosine similarity and max abs error of the first output.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort

from graphcal.pipeline import calibrate

ROOT = Path(__file__).resolve().parents[1]


def run(model: Path, feeds: dict) -> tuple[str, np.ndarray]:
    """(name, value) of the model's first output, at ORT_ENABLE_BASIC on CPU."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
    return sess.get_outputs()[0].name, sess.run(None, feeds)[0].astype(np.float64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", nargs="+", default=["W8A8", "W8A8_STATIC", "FP8", "FP8_DYNAMIC"])
    args = ap.parse_args()
    print("| model | scheme | output | SQNR vs fp32 (dB) | cosine | max abs error | max abs fp32 output |")
    print("|---|---|---|---|---|---|---|")
    for folder in sorted((ROOT / "models").iterdir()):
        if not (folder / "model.onnx").exists():
            continue
        feeds = dict(np.load(folder / "heldout.npz"))
        output, ref = run(folder / "model.onnx", feeds)
        for scheme in args.schemes:
            with tempfile.TemporaryDirectory() as tmp:
                calibrate(folder / "model.onnx", folder / "calib.npz", Path(tmp) / "out", scheme=scheme, device="cpu")
                got = run(Path(tmp) / "out" / "model.onnx", feeds)[1]
            err = got - ref
            sqnr = 10 * np.log10((ref**2).sum() / (err**2).sum())
            cos = (ref * got).sum() / np.linalg.norm(ref) / np.linalg.norm(got)
            print(f"| {folder.name} | {scheme} | {output} | {sqnr:.1f} | {cos:.6f} | {np.abs(err).max():.2e} | {np.abs(ref).max():.2f} |")


if __name__ == "__main__":
    main()
