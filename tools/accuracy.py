"""How close graphcal's QDQ models are to fp32 on held-out data, for the shipped models.

    python tools/accuracy.py [--schemes W8A8 W8A8_STATIC ...]

Calibrates each shipped model on models/*/calib.npz, runs the fp32 model (tools.lib.outputs.first_output)
and the QDQ model (graphcal.runtime's runner) on models/*/heldout.npz in onnxruntime (CPU,
ORT_ENABLE_BASIC) -- or, for fp4 / e8m0 models, which onnxruntime's CPU provider cannot run, in
onnx.reference's ReferenceEvaluator -- and prints a markdown table of SQNR, cosine similarity and max
abs error of the first output, and the size of the written model.onnx against the fp32 one.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python tools/accuracy.py`: graphcal (and tools) import from the repo root
    sys.path.insert(0, str(ROOT))

from graphcal.calibration.pipeline import calibrate  # noqa: E402
from graphcal.runtime import open_model_runner  # noqa: E402
from tools.lib.outputs import first_output, metrics  # noqa: E402

SCHEMES = ["W8A8", "W8A8_STATIC", "W8A16", "W4A16", "W4A16_ASYM", "W4A8", "FP8", "FP8_DYNAMIC", "FP8_BLOCK",
           "NVFP4A16", "NVFP4", "MXFP4A16"]


def run(model: Path, feeds: dict) -> tuple[np.ndarray, str]:
    """(value, evaluator) of the quantized model's first output, at ORT_ENABLE_BASIC on CPU."""
    runner = open_model_runner(model)  # onnxruntime at ORT_ENABLE_BASIC on CPU, or onnx.reference for fp4 / e8m0
    return runner.run(feeds)[runner.outputs[0]].astype(np.float64), runner.kind


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", nargs="+", default=SCHEMES)
    args = ap.parse_args()
    print("| model | scheme | output | SQNR vs fp32 (dB) | cosine | max abs error | max abs fp32 output | size vs fp32 | run by |")
    print("|---|---|---|---|---|---|---|---|---|")
    for folder in sorted((ROOT / "models").iterdir()):
        if not (folder / "model.onnx").exists():
            continue
        feeds = dict(np.load(folder / "heldout.npz"))
        output = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph.output[0].name
        ref = first_output(folder / "model.onnx", feeds, len(next(iter(feeds.values()))), "ORT_ENABLE_BASIC")
        size = (folder / "model.onnx").stat().st_size
        for scheme in args.schemes:
            with tempfile.TemporaryDirectory() as tmp:
                calibrate(folder / "model.onnx", folder / "calib.npz", Path(tmp) / "out", scheme=scheme, device="cpu",
                          target="qdq" if "FP4" in scheme else "onnxruntime")  # onnxruntime has no fp4
                got, how = run(Path(tmp) / "out" / "model.onnx", feeds)
                ratio = (Path(tmp) / "out" / "model.onnx").stat().st_size / size
            err, score = got - ref, metrics(ref, got, None)
            print(f"| {folder.name} | {scheme} | {output} | {score['sqnr']:.1f} | {score['cosine']:.6f} | {np.abs(err).max():.2e} | {np.abs(ref).max():.2f} | {ratio:.2f}x | {how} |")


if __name__ == "__main__":
    main()
