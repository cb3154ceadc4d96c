#!/usr/bin/env python
"""Calibration cost against plain inference, side by side in one script run.

    python tools/bench.py                                   # shipped tiny-llama and the bench decoder
    python tools/bench.py --models tiny-llama --samples 64 512 --device cpu
    python tools/bench.py --markdown results.md     # also write the results table to a file of its own

For each model and sample count it runs, each in a fresh child process (so each peak is its own):

- ``onnxruntime`` inference over the same batches: the floor (ORT_ENABLE_BASIC, as graphcal's pass);
- ``graphcal run`` with W8A8_STATIC and static_minmax (in-graph min/max reductions), the same with
  whole tensors fetched (``reduce_in_graph=False``), with SmoothQuant (``--smoothquant``, ``--smoothquant
  all``, and the latter with ``--smoothing-strength auto``; in the same pass), with ``mse`` observers (at the
  default ``--tap-limit-mb`` and with every whole tap fetched in one run a batch) and
  graphcal's histogram observers (``histogram_mse``, ``percentile``, ``entropy``), with ``imatrix_mse``
  weights (W4A16), and W4A16 rounded to nearest, by GPTQ (sequential and one-pass) and by AWQ, and W8A8 by
  SmoothQuant + GPTQ;
- onnxruntime's ``quantize_static`` (QDQ, int8 symmetric, per-channel weights, MatMul/Gemm) with
  MinMax, Percentile and Entropy calibration;
- ``graphcal eval`` of the fp32 model against the W8A8_STATIC output (on ``--device``), and its floor: both
  models run over the same batches, each in a plain onnxruntime session in one process (on the same device);

and reports wall time (the work: session, pass, observers, writing; imports are reported apart as
startup), peak host memory, and both as ratios to the floor (eval's to its own floor)
(the child's maximum resident set); with ``--device cuda``, peak GPU memory from nvidia-smi. A child
whose memory passes ``--mem-limit-gb`` is stopped and reported as such. Data: seeded random token
ids (models/tiny-llama: seq 32; bench decoder: seq 512, made by
``tools/make_models.py --bench-decoder``; the 1.5B-parameter large decoder, ``--models large-decoder``,
seq 256, made by ``tools/make_models.py --large-decoder``), batch 8. A ``model.onnx`` already in
``--decoder-dir`` / ``--large-dir`` is used as it is: ``tools/make_decoder.py --preset bench`` / ``--preset 1.5b
--out DIR`` writes one of the same shape without torch, in a minute and under 100 MB of memory at 1.5B (its
weights are random draws of its own, so its numbers are not the torch-made model's).

Then, per model, the weight phase alone (``--weight-schemes``, default W8A8 and NVFP4A16: int8 per
channel and NVFP4): every weight read, checked, observed, quantized and stored, timed by
tools/weight_phase.py in a child (``python -m tools.weight_phase``, best of 3), as seconds per billion
weight parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools.lib.report import cpu_name  # noqa: E402
from tools.lib.synthetic import make_data as synth  # noqa: E402
from tools.lib.synthetic import save_npz  # noqa: E402

IMATRIX = '{"weights": {"num_bits": 4, "strategy": "group", "group_size": 128, "observer": "imatrix_mse"}}'
CONFIGS = {
    "onnxruntime inference (floor)": {"kind": "floor"},
    "graphcal minmax": {"kind": "graphcal", "scheme": "W8A8_STATIC"},
    "graphcal minmax, whole tensors": {"kind": "graphcal", "scheme": "W8A8_STATIC", "reduce_in_graph": False},
    "graphcal minmax + SmoothQuant": {"kind": "graphcal", "scheme": "W8A8_STATIC", "smoothquant": "norms"},
    "graphcal minmax + SmoothQuant all": {"kind": "graphcal", "scheme": "W8A8_STATIC", "smoothquant": "all"},
    "graphcal minmax + SmoothQuant all, strength auto": {"kind": "graphcal", "scheme": "W8A8_STATIC",
                                                          "smoothquant": "all", "smoothing_strength": "auto"},
    "graphcal mse": {"kind": "graphcal", "scheme": "W8A8_STATIC", "observer": "mse"},
    "graphcal mse, one run a batch": {"kind": "graphcal", "scheme": "W8A8_STATIC", "observer": "mse",
                                      "tap_limit_mb": 1e9},  # every whole tap fetched at once, however large
    "graphcal histogram_mse": {"kind": "graphcal", "scheme": "W8A8_STATIC", "observer": "histogram_mse"},
    "graphcal percentile": {"kind": "graphcal", "scheme": "W8A8_STATIC", "observer": "percentile"},
    "graphcal entropy": {"kind": "graphcal", "scheme": "W8A8_STATIC", "observer": "entropy"},
    "graphcal imatrix_mse (W4A16)": {"kind": "graphcal", "scheme": IMATRIX},
    "graphcal RTN (W4A16)": {"kind": "graphcal", "scheme": "W4A16"},
    "graphcal NVFP4A16": {"kind": "graphcal", "scheme": "NVFP4A16", "target": "qdq"},  # onnxruntime runs no fp4
    "graphcal GPTQ (W4A16)": {"kind": "graphcal", "scheme": "W4A16", "algorithm": "gptq"},
    "graphcal GPTQ one-pass (W4A16)": {"kind": "graphcal", "scheme": "W4A16", "algorithm": "gptq",
                                       "gptq_order": "one-pass"},
    "graphcal AWQ (W4A16)": {"kind": "graphcal", "scheme": "W4A16", "algorithm": "awq"},
    "graphcal SmoothQuant + GPTQ (W8A8)": {"kind": "graphcal", "scheme": "W8A8", "smoothquant": "norms",
                                           "algorithm": "gptq"},
    "onnxruntime inference of both models (eval floor)": {"kind": "floor2"},
    "graphcal eval (W8A8_STATIC output)": {"kind": "eval"},
    "quantize_static MinMax": {"kind": "ort", "method": "MinMax"},
    "quantize_static Percentile": {"kind": "ort", "method": "Percentile"},
    "quantize_static Entropy": {"kind": "ort", "method": "Entropy"},
}
MODELS = {"tiny-llama": (REPO / "models" / "tiny-llama" / "model.onnx", 256, 32),
          "bench-decoder": (None, 1024, 512),  # path filled from --decoder-dir
          "large-decoder": (None, 32000, 256)}  # 1.5B parameters; path filled from --large-dir
DEFAULT_MODELS = ["tiny-llama", "bench-decoder"]  # the large decoder takes about an hour for every config
EVAL_KINDS = ("floor2", "eval")  # compared against the eval floor, on the output of "graphcal minmax"
BATCH = 8
GROUP_SIZE = {"tiny-llama": 32}  # W4A16's group of 128 does not divide tiny-llama's 64 features


# -- child: one configuration ------------------------------------------------------------------

def child(spec: dict) -> dict:
    import resource  # in the child (Unix only)

    t0 = time.perf_counter()
    import numpy as np  # in the child: timed as its startup
    import onnxruntime as ort  # in the child: timed as its startup
    import torch  # noqa: F401 -- every child pays the same imports

    kind = spec["kind"]
    if kind == "graphcal":  # its imports (compressed-tensors pulls in transformers: ~2 s) are not the pass
        import compressed_tensors.quantization.lifecycle.forward  # noqa: F401

        import graphcal.observers  # noqa: F401
        from graphcal.calibration.pipeline import calibrate  # in the child: timed as its startup
    elif kind == "ort":
        import onnxruntime.quantization  # noqa: F401
    elif kind == "eval":
        from graphcal.evaluation import evaluate  # in the child: timed as its startup
    startup = time.perf_counter() - t0
    data = dict(np.load(spec["data"]))
    out = Path(spec["out"])
    start = time.perf_counter()
    if kind == "eval":
        report = evaluate(spec["model"], spec["candidate"], spec["data"], batch_size=BATCH, device=spec["device"])
        if spec["device"] == "cuda" and report.provider != "CUDAExecutionProvider":
            raise SystemExit(f"eval ran on {report.provider}, not CUDAExecutionProvider")
    elif kind == "floor2":  # the two models eval compares, each in its own plain session on the device
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if spec["device"] == "cuda" else ["CPUExecutionProvider"]
        if spec["device"] == "cuda" and hasattr(ort, "preload_dlls"):
            ort.preload_dlls()  # as graphcal's runtime does
        sessions = [ort.InferenceSession(path, opts, providers=providers) for path in (spec["model"], spec["candidate"])]
        if any(s.get_providers()[0] != providers[0] for s in sessions):  # onnxruntime falls back to CPU silently
            raise SystemExit(f"the eval floor does not run on {providers[0]}")
        n = len(next(iter(data.values())))
        for i in range(0, n, BATCH):
            for session in sessions:
                session.run(None, {k: v[i:i + BATCH] for k, v in data.items()})
    elif kind == "floor":
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if spec["device"] == "cuda" else ["CPUExecutionProvider"]
        if spec["device"] == "cuda" and hasattr(ort, "preload_dlls"):
            ort.preload_dlls()  # as graphcal's runtime does: CUDA/cuDNN from the nvidia-* packages
        session = ort.InferenceSession(spec["model"], opts, providers=providers)
        if session.get_providers()[0] != providers[0]:  # onnxruntime falls back to CPU silently
            raise SystemExit(f"the floor runs on {session.get_providers()[0]}, not {providers[0]}")
        n = len(next(iter(data.values())))
        for i in range(0, n, BATCH):
            session.run(None, {k: v[i:i + BATCH] for k, v in data.items()})
    elif kind == "graphcal":
        from graphcal.config import Options, resolve  # loaded at startup with the pipeline

        config = resolve(Options(scheme=spec["scheme"], observer=spec.get("observer"), smoothquant=spec.get("smoothquant"),
                                 smoothing_strength=spec.get("smoothing_strength"), algorithm=spec.get("algorithm"),
                                 gptq_order=spec.get("gptq_order"), group_size=spec.get("group_size")))
        calibrate(spec["model"], spec["data"], out, config=config, device=spec["device"], batch_size=BATCH,
                  reduce_in_graph=spec.get("reduce_in_graph", True), target=spec.get("target", "onnxruntime"),
                  tap_limit_mb=spec.get("tap_limit_mb"))
    elif kind == "ort":
        from onnxruntime.quantization import (  # loaded at startup above
            CalibrationDataReader,
            CalibrationMethod,
            QuantFormat,
            QuantType,
            quantize_static,
        )

        class Reader(CalibrationDataReader):
            def __init__(self):
                n = len(next(iter(data.values())))
                self.batches = iter([{k: v[i:i + BATCH] for k, v in data.items()} for i in range(0, n, BATCH)])

            def get_next(self):
                return next(self.batches, None)

        out.mkdir(parents=True, exist_ok=True)
        quantize_static(
            spec["model"], out / "model.onnx", Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul", "Gemm"],
            calibrate_method=getattr(CalibrationMethod, spec["method"]),
            calibration_providers=["CUDAExecutionProvider"] if spec["device"] == "cuda" else None,
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
        )
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "startup": startup,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


# -- parent ------------------------------------------------------------------------------------

def run_child(spec: dict, mem_limit_mb: float, device: str) -> dict:
    """Run one configuration in a child process; stop it if its memory passes the limit."""
    if spec["kind"] == "weights":  # tools/weight_phase.py, run from the repository root (a script of its own)
        command = [sys.executable, "-m", "tools.weight_phase", str(Path(spec["model"]).resolve()), "--schemes",
                   spec["scheme"], "--json"]
    else:
        command = [sys.executable, __file__, "--child", json.dumps(spec)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO if spec["kind"] == "weights" else None)
    peak_gpu, killed = 0.0, False
    while proc.poll() is None:
        rss = _rss_mb(proc.pid)
        if rss > mem_limit_mb:
            proc.kill()
            killed = True
            break
        if device == "cuda":
            peak_gpu = max(peak_gpu, _gpu_used_mb())
        time.sleep(0.2)
    stdout, stderr = proc.communicate()
    if killed:
        return {"error": f"stopped: host memory passed {mem_limit_mb / 1024:.0f} GB"}
    if proc.returncode != 0:
        return {"error": (stderr.strip().splitlines() or ["failed"])[-1][:200]}
    result = json.loads(stdout.strip().splitlines()[-1])
    if device == "cuda":
        result["peak_gpu_mb"] = peak_gpu
    return result


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _gpu_used_mb() -> float:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5).stdout
        return max(float(v) for v in out.split())
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0.0


def make_data(path: Path, vocab: int, n: int, seq: int) -> None:
    save_npz(path, synth(["input_ids", "attention_mask"], vocab, n, seq, seed=4242))


def machine() -> str:
    cpu = cpu_name()
    import onnxruntime  # lazy: keeps --help fast
    import torch  # lazy: keeps --help fast

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB; Python {platform.python_version()}, "
            f"onnxruntime {onnxruntime.__version__}, torch {torch.__version__}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS))
    ap.add_argument("--samples", nargs="+", type=int, default=None,
                    help="sample counts (default: 64 512)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), metavar="CONFIG")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--decoder-dir", type=Path, default=Path(tempfile.gettempdir()) / "graphcal-bench-decoder",
                    help="where the bench decoder is (made there by tools/make_models.py if missing; "
                         "tools/make_decoder.py --preset bench makes one without torch)")
    ap.add_argument("--large-dir", type=Path, default=Path(tempfile.gettempdir()) / "graphcal-large-decoder",
                    help="where the 1.5B decoder is (made there by tools/make_models.py if missing: 6 GB, minutes, 12 GB "
                         "of memory; tools/make_decoder.py --preset 1.5b makes one without torch)")
    ap.add_argument("--mem-limit-gb", type=float, default=20.0)
    ap.add_argument("--weight-schemes", nargs="*", default=["W8A8", "NVFP4A16"],
                    help="schemes whose weight phase is timed alone, per model (none: skip it)")
    ap.add_argument("--markdown", type=Path,
                    help="also write the results table to this file (a file of its own: a hand-written page such as "
                         "docs/benchmarks.md is refused, so it is never overwritten)")
    args = ap.parse_args(argv)
    if args.markdown and args.markdown.exists() and not args.markdown.read_text().startswith("Machine: "):
        raise SystemExit(f"{args.markdown} is not a file bench.py wrote; give a new file and paste the table")
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0

    rows, weight_rows = [], []
    with tempfile.TemporaryDirectory(prefix="graphcal-bench-") as tmp:
        for name in args.models:
            path, vocab, seq = MODELS[name]
            if path is None:
                folder, flag = ((args.large_dir, "--large-decoder") if name == "large-decoder"
                                else (args.decoder_dir, "--bench-decoder"))
                path = folder / "model.onnx"
                if not path.exists():
                    subprocess.run([sys.executable, str(REPO / "tools" / "make_models.py"), flag, str(folder)],
                                   check=True)
            for n in args.samples or [64, 512]:
                data = Path(tmp) / f"{name}-{n}.npz"
                make_data(data, vocab, n, seq)
                floors, candidate = {}, None
                for label in args.configs:
                    spec = {**CONFIGS[label], "model": str(path), "data": str(data), "device": args.device,
                            "out": str(Path(tmp) / f"out-{len(rows)}")}
                    if spec.get("scheme") == "W4A16":
                        spec["group_size"] = GROUP_SIZE.get(name)
                    if spec["kind"] in EVAL_KINDS:
                        if candidate is None:  # graphcal minmax was not asked for: its output made untimed
                            made = run_child({**CONFIGS["graphcal minmax"], **{k: spec[k] for k in ("model", "data", "device", "out")}},
                                             args.mem_limit_gb * 1024, args.device)
                            candidate = str(Path(spec["out"]) / "model.onnx") if "error" not in made else None
                        spec["candidate"] = candidate
                    result = (run_child(spec, args.mem_limit_gb * 1024, args.device) if spec.get("candidate", True)
                              else {"error": "no W8A8_STATIC output to evaluate"})
                    group = "eval" if spec["kind"] in EVAL_KINDS else "run"
                    if spec["kind"] in ("floor", "floor2") and "seconds" in result:
                        floors[group] = result
                    if label == "graphcal minmax" and "error" not in result:
                        candidate = str(Path(spec["out"]) / "model.onnx")
                    rows.append((name, n, label, result, floors.get(group)))
                    print(_row(rows[-1]), flush=True)
            for scheme in args.weight_schemes if args.device == "cpu" else []:
                result = run_child({"kind": "weights", "model": str(path), "scheme": scheme}, args.mem_limit_gb * 1024,
                                   args.device)
                weight_rows.append((name, scheme, result))
                print(_weight_row(weight_rows[-1]), flush=True)
    table = _table(rows, args.device)
    if weight_rows:
        table += "\n\n" + "\n".join(["| model | weight phase | parameters | seconds | seconds per billion parameters |",
                                      "|---|---|---|---|---|"] + [_weight_row(r) for r in weight_rows])
    print()
    print(table)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(f"Machine: {machine()}\n\n{table}\n")
    return 0


def _row(row) -> str:
    name, n, label, r, floor = row
    if "error" in r:
        return f"| {name} | {n} | {label} | {r['error']} | | | | |" + (" |" if "peak_gpu_mb" in r else "")
    ratio = f"{r['seconds'] / floor['seconds']:.2f}x" if floor else "-"
    memory = f"{r['peak_rss_mb'] / floor['peak_rss_mb']:.2f}x" if floor else "-"
    gpu = f" {r['peak_gpu_mb']:.0f} |" if "peak_gpu_mb" in r else ""
    return (f"| {name} | {n} | {label} | {r['seconds']:.2f} | {ratio} | {r['peak_rss_mb']:.0f} | {memory} "
            f"| {r['startup']:.1f} |{gpu}")


def _weight_row(row) -> str:
    name, scheme, r = row
    if "error" in r:
        return f"| {name} | {scheme} | {r['error']} | | |"
    return f"| {name} | {scheme} | {r['parameters'] / 1e6:.1f} M | {r['seconds']:.2f} | {r['per_billion']:.1f} |"


def _table(rows, device: str) -> str:
    head = ("| model | samples | run | wall time (s) | vs floor | peak host memory (MB) | memory vs floor "
            "| startup (s) |")
    rule = "|---|---|---|---|---|---|---|---|"
    if device == "cuda":
        head += " peak GPU memory (MB) |"
        rule += "---|"
    return "\n".join([head, rule] + [_row(r) for r in rows])


if __name__ == "__main__":
    sys.exit(main())
