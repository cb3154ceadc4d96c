#!/usr/bin/env python
"""GPTQ's quantize_weight alone, this checkout against an older one, side by side in one script run.

    python tools/gptq_sweep_speed.py                        # CPU: 2816x1024 and 1024x1024, W4 group 128
    python tools/gptq_sweep_speed.py --device cuda          # also the eager CUDA loop against the captured one
    python tools/gptq_sweep_speed.py --baseline 7cb8953 --repeat 5 --shapes 2816x1024

The baseline is ``graphcal/algorithms/gptq/math.py`` as it is at the git revision ``--baseline`` (default:
the commit before the sweep was reworked), loaded from ``git show`` into a module of its own; this
checkout's is imported. Each shape (``ROWSxCOLS``: a weight ``[out, in]``) gets a seeded random weight,
a Hessian of random activations (8 x in tokens), the memoryless min-max grid of ``--scheme`` (W4 group
128 symmetric by default); every variant runs on the same inputs, interleaved ``--repeat`` times, and the
best time of each (CPU time of the process on the CPU, wall time on CUDA) is printed with its ratio to the baseline, and whether its weight and loss equal the
baseline's bit for bit. On CUDA the variants are the baseline, this checkout's eager loop
(``capture=False``) and its default (each full block's column loop replayed from one CUDA graph).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BEFORE = "7cb89538569b5f9b6dfdab36825900a06353d50b"  # quantize_weight before the sweep was reworked (issue 49)
SCHEMES = {
    "w4-g128-sym": {"num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": True},
    "w4-g128-asym": {"num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": False},
    "w8-channel": {"num_bits": 8, "strategy": "channel", "symmetric": True},
    "nvfp4": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
}


def load_baseline(rev: str):
    """``graphcal/algorithms/gptq/math.py`` at ``rev`` (a git revision, or a file: a copy taken where there is no
    git history, e.g. on a lent GPU machine) as a module of its own."""
    if Path(rev).is_file():
        source = Path(rev).read_text()
    else:
        source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:graphcal/algorithms/gptq/math.py"],
                                check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="gptq-baseline-")) / "gptq_math_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("gptq_math_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def inputs(rows: int, cols: int, scheme: str, device: str):
    import torch
    from compressed_tensors.quantization import QuantizationArgs

    from graphcal.observers import Observer

    gen = torch.Generator().manual_seed(rows * 7919 + cols)
    weight = torch.randn(rows, cols, generator=gen) * 0.05
    x = torch.randn(8 * cols, cols, generator=gen)
    hessian = 2 * x.T @ x / x.shape[0]
    args = QuantizationArgs(**SCHEMES[scheme])
    observer = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)
    observer(weight)
    qp = observer.get_qparams()
    scale, zp, gs = (None if t is None else t.to(device) for t in (qp["scale"], qp["zero_point"], qp["global_scale"]))
    return weight.to(device), hessian.to(device), scale, zp, gs, args


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default=BEFORE, help="git revision of the baseline math.py, or a copy of it (default: %(default).12s)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shapes", nargs="+", default=["2816x1024", "1024x1024"], help="ROWSxCOLS weights")
    ap.add_argument("--scheme", default="w4-g128-sym", choices=sorted(SCHEMES))
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = ap.parse_args(argv)

    import torch

    from graphcal.algorithms.gptq import math as current

    if a.threads:
        torch.set_num_threads(a.threads)
    baseline = load_baseline(a.baseline)
    variants = {f"baseline {a.baseline[:12]}": lambda *x, **k: baseline.quantize_weight(*x, **k)}
    if a.device == "cuda":
        variants["this checkout, eager"] = lambda *x, **k: current.quantize_weight(*x, capture=False, **k)
        variants["this checkout, captured"] = lambda *x, **k: current.quantize_weight(*x, capture=True, **k)
    else:
        variants["this checkout"] = current.quantize_weight

    def sync():
        if a.device == "cuda":
            torch.cuda.synchronize()

    clock = time.perf_counter if a.device == "cuda" else time.process_time  # CPU: the process's CPU time

    print(f"quantize_weight, {a.scheme}, block_size {a.block_size}, {a.device}"
          + (f" ({torch.cuda.get_device_name()})" if a.device == "cuda" else f", {torch.get_num_threads()} torch threads")
          + f", best of {a.repeat} ({'wall' if a.device == 'cuda' else 'CPU'} time)")
    print(f"| weight | {' | '.join(variants)} | bit for bit |")
    print("|---|" + "---|" * (len(variants) + 1))
    for shape in a.shapes:
        rows, cols = (int(n) for n in shape.lower().split("x"))
        args = inputs(rows, cols, a.scheme, a.device)
        best = {name: float("inf") for name in variants}
        results = {}
        for _ in range(a.repeat):
            for name, fn in variants.items():  # interleaved: the machine's noise falls on every variant alike
                sync()
                t0 = clock()
                results[name] = fn(*args, block_size=a.block_size)
                sync()
                best[name] = min(best[name], clock() - t0)
        ref = results[next(iter(variants))]
        same = all(torch.equal(r.weight, ref.weight) and r.loss == ref.loss for r in results.values())
        base = best[next(iter(variants))]
        cells = [f"{best[n]:.3f} s" + ("" if n == next(iter(variants)) else f" ({base / best[n]:.2f}x)") for n in variants]
        print(f"| {rows}x{cols} | {' | '.join(cells)} | {'yes' if same else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
