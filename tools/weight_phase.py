#!/usr/bin/env python
"""The weight phase alone: seconds per billion weight parameters to read, observe, quantize and store them.

    python tools/weight_phase.py /tmp/graphcal-bench-decoder/model.onnx
    python tools/weight_phase.py MODEL --schemes W8A8 NVFP4A16 --repeat 3

For each scheme it plans the run as ``graphcal run`` does (W8A8 and W4A16 for onnxruntime, NVFP4A16
for ``--target qdq``: onnxruntime has no fp4), then times ``graphcal.calibration.weights.quantize_weights`` -- every
chosen weight read from the model, checked for NaN/Inf, observed (the scheme's weight observer:
memoryless_minmax), quantized by compressed-tensors' rules and stored into the QDQ writer -- the best of
``--repeat`` runs, and reports it per billion parameters. It uses only functions older graphcal
versions have too, so the same script times an older checkout side by side
(``PYTHONPATH=/path/to/old/checkout python tools/weight_phase.py MODEL``). tools/bench.py runs it
for the bench decoder.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # after PYTHONPATH: an older checkout given there wins

TARGETS = {"NVFP4A16": "qdq", "NVFP4": "qdq", "MXFP4A16": "qdq"}


def measure(model: str, scheme: str, repeat: int = 3) -> dict:
    """{"seconds": best of ``repeat``, "parameters": weight parameters, "per_billion": s / 1e9 params}."""
    import torch  # lazy: keeps --help fast

    import graphcal  # lazy: keeps --help fast
    from graphcal.calibration.observe import ObserverSet  # lazy: keeps --help fast
    from graphcal.calibration.plan import load, plan  # lazy: keeps --help fast
    from graphcal.calibration.weights import quantize_weights  # lazy: keeps --help fast
    from graphcal.config import Options, resolve  # lazy: keeps --help fast
    from graphcal.graph.qdq.writer import QDQWriter  # lazy: keeps --help fast

    best = None
    for _ in range(repeat):
        config = resolve(Options(scheme=scheme))
        loaded = load(Path(model), config)  # the model beside the plan: the plan holds decisions only
        run = plan(Path(model), config, TARGETS.get(scheme, "onnxruntime"), None, loaded)
        observers = ObserverSet(run)
        writer = QDQWriter(loaded.model, run.opset, run.target_runtime, dict(loaded.types), matmulnbits=run.matmulnbits)
        start = time.perf_counter()
        quantize_weights(run, observers, writer, torch.device("cpu"))
        seconds = time.perf_counter() - start
        best = seconds if best is None else min(best, seconds)
    parameters = sum(t.out_features * t.in_features for t in run.chosen)
    return {"seconds": best, "parameters": parameters, "per_billion": best / parameters * 1e9,
            "graphcal": str(Path(graphcal.__file__).parent)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--schemes", nargs="+", default=["W8A8", "NVFP4A16", "W4A16"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON object per scheme instead of a table row")
    args = ap.parse_args(argv)
    for scheme in args.schemes:
        r = measure(args.model, scheme, args.repeat)
        if args.json:
            print(json.dumps({"scheme": scheme, **r}), flush=True)
        else:
            print(f"| {scheme} | {r['parameters'] / 1e6:.1f} M | {r['seconds']:.2f} s | {r['per_billion']:.1f} s |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
