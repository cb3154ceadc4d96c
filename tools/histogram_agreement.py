#!/usr/bin/env python
"""How close graphcal's histogram_mse comes to llm-compressor's exact MSE search, tap by tap.

    python tools/histogram_agreement.py                      # tiny-llama, tiny-bert, minilm
    python tools/histogram_agreement.py --models minilm --num-samples 64

For every activation a MatMul/Gemm reads (its input, the tap W8A8_STATIC observes), over the same
calibration batches: the scale of ``histogram_mse`` (one histogram over all batches, candidates scored on
bin centres) against the exact search it approximates -- ``memoryless_mse`` over every batch's values at
once (llm-compressor's search on the whole calibration set) -- and against ``mse`` (llm-compressor's
default: the search on each batch, moving-averaged). int8 symmetric per-tensor, llm-compressor's search
settings. Reports, per model, the relative scale differences (median and largest) and how many taps got
exactly the exact search's candidate.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools.lib.models import prepare_packed  # noqa: E402

ARGS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False}


def taps(model_path: Path, calib: Path, batch: int, samples: int) -> dict[str, list[np.ndarray]]:
    """Every MatMul/Gemm's activation input, batch by batch (onnxruntime at ORT_ENABLE_BASIC)."""
    import onnx  # lazy: keeps --help fast

    from graphcal.runtime import open_model_runner  # lazy: onnxruntime and torch, as above

    model = onnx.load(str(model_path))
    inits = {i.name for i in model.graph.initializer}
    names = list(dict.fromkeys(n.input[0] for n in model.graph.node
                               if n.op_type in ("MatMul", "Gemm") and n.input[1] in inits))
    model.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
    inputs = {i.name for i in model.graph.input} - inits
    runner = open_model_runner(model, names)  # onnxruntime at ORT_ENABLE_BASIC on CPU, the taps as outputs
    feeds = {k: v[:samples] for k, v in np.load(calib).items() if k in inputs}
    out: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for i in range(0, len(next(iter(feeds.values()))), batch):
        got = runner.run({k: v[i:i + batch] for k, v in feeds.items()})
        for name in names:
            out[name].append(got[name])
    return out


def scales(batches: list[np.ndarray]) -> dict[str, float]:
    import torch  # lazy: keeps --help fast
    from compressed_tensors.quantization import QuantizationArgs  # lazy: keeps --help fast

    from graphcal.observers import Observer  # lazy: keeps --help fast

    args = QuantizationArgs(**ARGS)
    result = {}
    for name in ("histogram_mse", "mse"):
        obs = Observer.load_from_registry(name, base_name="input", args=args)
        for b in batches:
            obs(torch.from_numpy(b))
        result[name] = obs.get_qparams()["scale"].item()
    exact = Observer.load_from_registry("memoryless_mse", base_name="input", args=args)
    exact(torch.from_numpy(np.concatenate([b.reshape(-1, b.shape[-1]) for b in batches]))[None])
    result["exact"] = exact.get_qparams()["scale"].item()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny-llama", "tiny-bert", "minilm"])
    ap.add_argument("--num-samples", type=int, default=None)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "graphcal-speed")
    args = ap.parse_args(argv)
    print("| model | taps | same candidate as the exact search | histogram_mse vs exact: median / largest relative "
          "scale difference | mse (per-batch EMA) vs exact: median / largest |")
    print("|---|---|---|---|---|")
    for name in args.models:
        data = prepare_packed(name, args.work)
        calib_count = len(next(iter(np.load(data.calib).values())))
        per_tap = taps(data.model, data.calib, data.batch_size or 8, min(args.num_samples or calib_count, calib_count))
        rows = [scales(b) for b in per_tap.values()]
        hist = np.array([abs(r["histogram_mse"] / r["exact"] - 1) for r in rows])
        ema = np.array([abs(r["mse"] / r["exact"] - 1) for r in rows])
        same = int((hist == 0).sum())
        print(f"| {name} | {len(rows)} | {same} of {len(rows)} | {np.median(hist):.2%} / {hist.max():.2%} | "
              f"{np.median(ema):.2%} / {ema.max():.2%} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
