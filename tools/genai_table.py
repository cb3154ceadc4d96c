"""Builder int4 against graphcal's int4 on the builder's own fp32 model: perplexity and size.

    python -m tools.genai_table [--work work/smollm] [--group-size 64] [--methods rtn gptq awq ...]
                                [--scheme W4A16] [--whole [--mix MB [--mix-fallback W8A16:64:rtn]]]
                                [--rotate R1] [--budget MB [--budget-samples N]] [--json OUT]

On the real LLM that tools/real_llm.py builds (SmolLM2-135M-Instruct; its Linear weights sit on a
4-bit grid in blocks of 32, so groups of 32 flatter int4: graphcal's rows use --group-size 64):

- fp32: the builder's fp32 model (``genai_fp32/``);
- the builder's int4 (``-p int4``, block 32, its default method) and ``k_quant_mixed`` (int8 lm_head
  and llama.cpp's "mixed layers"), built here offline into ``genai_int4/`` and ``genai_kq_mixed/``;
- graphcal ``--scheme`` (W4A16) with each of ``--methods`` (:data:`METHODS`: round-to-nearest, ``--algorithm
  gptq``, ``awq``, ``awq+gptq``, and AWQ with its clip search alone or before GPTQ), run on
  ``genai_fp32/model.onnx`` with calib.npz's token ids only (graphcal fills the KV cache), written as
  drop-in genai folders into ``graphcal_<method>_g<group>/``; with ``--whole`` the whole model as the
  builder's int4 quantizes it: lm_head too (``--lm-head``) and the tied embedding sharing its table
  (``--scheme-for Embedding=SCHEME``), written as MatMulNBits and GatherBlockQuantized
  (``--matmulnbits``), into ``graphcal_<scheme>_<method>_g<group>_whole/``;
- with ``--budget MB``, one ``graphcal run --size-budget MB`` and nothing else (its defaults: docs/budget.md),
  held out ``--budget-samples``, timed against plain onnxruntime over the samples it calibrates on,
  into ``graphcal_budget<MB>_s<N>/``;
- with ``--mix MB`` (and ``--whole``), mixed precision chosen by measurement for each method: the
  whole model in ``--mix-fallback`` (default W8A16, groups of 64, round to nearest) is the fallback, ``graphcal eval
  --fallback ... --size-budget MB --per-layer`` chooses which layers take it on calibration data
  (``--mix-samples`` of calib_ids.npz), and ``graphcal run`` writes that choice with the method into
  ``graphcal_<scheme>_<method>_g<group>_mix<MB>_<fallback>/`` (the eval report beside it as ``mix.json``).

With ``--rotate R1`` every graphcal model is written with that rotation (folders named ``..._r1``);
eval rotates the fp32 model as the low model was before it mixes. The 42.15 row of docs/genai.md:
``python -m tools.genai_table --whole --methods gptq --rotate R1 --mix 86.3 --mix-samples 2``.

Each is scored by tools/lib/perplexity.py over eval.npz (onnxruntime on the CPU, default settings);
size is the folder's model files. Every step is skipped when its folder exists.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from tools.lib import REPO
from tools.lib.perplexity import perplexity


def _builder(work: Path, out: str, extra: list[str]) -> Path:
    folder = work / out
    if not (folder / "model.onnx").exists():
        from graphcal.export.genai import builder_command, builder_env  # lazy: onnx, kept out of --help

        subprocess.run(builder_command(work / "hf", folder, "int4", "cpu", work / "genai_cache", extra), check=True,
                       env=builder_env(), capture_output=True)
    return folder


def _graphcal(work: Path, method: str, group: int, scheme: str = "W4A16",
              whole: bool = False, rotate: str | None = None) -> tuple[Path, float | None]:
    folder = work / (f"graphcal_{scheme.lower()}_{method}_g{group}_whole" if whole else f"graphcal_{method}_g{group}")
    folder = folder.with_name(folder.name + _suffix(rotate))
    seconds = None
    if not (folder / "model.onnx").exists():
        import numpy as np

        ids = work / "calib_ids.npz"
        if not ids.exists():
            np.savez(ids, input_ids=np.load(work / "calib.npz")["input_ids"])  # token ids alone
        command = [sys.executable, "-m", "graphcal", "run", str(work / "genai_fp32" / "model.onnx"), "--data", str(ids),
                   "--scheme", scheme, "--group-size", str(group), "-o", str(folder), "-q"]
        if whole:
            command += ["--lm-head", "--scheme-for", f"Embedding={scheme}", "--matmulnbits"]
        command += METHODS[method]
        command += ["--rotate", rotate] if rotate else []
        start = time.perf_counter()
        subprocess.run(command, check=True, cwd=REPO)
        seconds = time.perf_counter() - start
    return folder, seconds


#: --methods: each method's graphcal run flags (the -clip ones: AWQ without duo scaling, its parents scored on
#: 16 samples, and its clip search; docs/accuracy.md "AWQ on a real LLM")
METHODS = {
    "rtn": [],
    "gptq": ["--algorithm", "gptq"],
    "awq": ["--algorithm", "awq"],
    "awq+gptq": ["--algorithm", "awq+gptq"],
    "awq-clip": ["--algorithm", "awq", "--duo-scaling", "false", "--awq-samples", "16", "--awq-clip"],
    "awq+gptq-clip": ["--algorithm", "awq+gptq", "--duo-scaling", "false", "--awq-samples", "16", "--awq-clip"],
}


def _suffix(rotate: str | None) -> str:
    return "_" + rotate.lower().replace(",", "") if rotate else ""


def _mixed(work: Path, method: str, group: int, scheme: str, budget: float, samples: int,
           fallback: str, rotate: str | None = None) -> tuple[Path, float]:
    """The whole model with the layers eval chooses (within ``budget`` MB) in the ``fallback``
    (SCHEME:GROUP:METHOD) form, written with ``method``."""
    high_scheme, high_group, high_method = fallback.split(":")
    folder = work / (f"graphcal_{scheme.lower()}_{method}_g{group}_mix{budget:g}_"
                     f"{high_scheme.lower()}_g{high_group}_{high_method}{_suffix(rotate)}")
    low, _ = _graphcal(work, method, group, scheme, whole=True, rotate=rotate)
    high, _ = _graphcal(work, high_method, int(high_group), high_scheme, whole=True, rotate=rotate)
    start = time.perf_counter()
    if not (folder / "model.onnx").exists():
        report = subprocess.run([sys.executable, "-m", "graphcal", "eval", str(work / "genai_fp32" / "model.onnx"),
                                 str(low / "model.onnx"), "--data", str(work / "calib_ids.npz"), "--num-samples",
                                 str(samples), "--batch-size", "4", "--fallback", str(high / "model.onnx"),
                                 "--size-budget", str(budget), "--per-layer", "--time-limit", "0", "--json"],
                                check=True, cwd=REPO, capture_output=True, text=True).stdout
        flags = json.loads(report)["mix"]["flags"]
        command = [sys.executable, "-m", "graphcal", "run", str(work / "genai_fp32" / "model.onnx"), "--data",
                   str(work / "calib_ids.npz"), "--scheme", scheme, "--group-size", str(group), "-o", str(folder),
                   "-q", "--lm-head", "--scheme-for", f"Embedding={scheme}", "--matmulnbits", *flags]
        command += METHODS[method]
        command += ["--rotate", rotate] if rotate else []
        subprocess.run(command, check=True, cwd=REPO)
        (folder / "mix.json").write_text(report)
    return folder, time.perf_counter() - start


def _budget(work: Path, budget: float, samples: int) -> tuple[str, Path, float]:
    """``graphcal run --size-budget`` with nothing else, into ``graphcal_budget<MB>_s<samples>/``: (label, folder,
    seconds); its time is printed against plain onnxruntime over the samples it calibrates on, run just before."""
    import numpy as np

    folder = work / f"graphcal_budget{budget:g}_s{samples}"
    ids = work / "calib_ids.npz"
    if not ids.exists():
        np.savez(ids, input_ids=np.load(work / "calib.npz")["input_ids"])  # token ids alone
    seconds = None
    if not (folder / "model.onnx").exists():
        count = len(np.load(ids)["input_ids"]) - samples
        baseline = subprocess.run([sys.executable, "-m", "tools.infer_baseline", str(work / "genai_fp32" / "model.onnx"),
                                   str(ids), "8", str(count)], check=True, cwd=REPO, capture_output=True, text=True)
        plain = json.loads(baseline.stdout.strip().splitlines()[-1])["seconds"]
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "graphcal", "run", str(work / "genai_fp32" / "model.onnx"), "--data",
                        str(ids), "--size-budget", f"{budget:g}", "--mix-samples", str(samples), "-o", str(folder)],
                       check=True, cwd=REPO)
        seconds = time.perf_counter() - start
        print(f"run --size-budget {budget:g}: {seconds:.0f} s, {seconds / plain:.1f}x plain inference over "
              f"{count} samples ({plain:.1f} s)", flush=True)
    return f"graphcal run --size-budget {budget:g} (--mix-samples {samples})", folder, seconds


def _size(folder: Path) -> int:
    from graphcal.graph.io import model_bytes  # lazy: onnx, kept out of --help

    return model_bytes(folder / "model.onnx")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=REPO / "work" / "smollm")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--methods", nargs="*", default=["rtn", "gptq", "awq"], choices=list(METHODS))
    parser.add_argument("--scheme", default="W4A16")
    parser.add_argument("--whole", action="store_true", help="lm_head and the tied embedding quantized too")
    parser.add_argument("--mix", type=float, default=None, metavar="MB",
                        help="with --whole: also mixed precision within this size, chosen by graphcal eval")
    parser.add_argument("--mix-samples", type=int, default=8, help="calibration samples the mix is chosen on")
    parser.add_argument("--mix-fallback", default="W8A16:64:rtn", metavar="SCHEME:GROUP:METHOD",
                        help="the whole model's higher form the mix takes layers from")
    parser.add_argument("--rotate", default=None, metavar="R1|R1,R2", help="graphcal's models rotated (run --rotate)")
    parser.add_argument("--budget", type=float, default=None, metavar="MB",
                        help="also `graphcal run --size-budget MB` alone (its defaults, --mix-samples from "
                             "--budget-samples), timed against plain inference over the samples it calibrates on")
    parser.add_argument("--budget-samples", type=int, default=4, help="--mix-samples for --budget")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    work = args.work
    rows = [("fp32 (builder)", work / "genai_fp32", None),
            ("builder int4, block 32 (default method)", _builder(work, "genai_int4", []), None),
            ("builder int4 k_quant_mixed", _builder(work, "genai_kq_mixed",
                                                     ["--extra_options", "algo_config=k_quant_mixed"]), None)]
    for method in args.methods:
        folder, seconds = _graphcal(work, method, args.group_size, args.scheme, args.whole, args.rotate)
        rotated = f" --rotate {args.rotate}" if args.rotate else ""
        rows.append((f"graphcal {args.scheme} g{args.group_size} {method}{' whole model' if args.whole else ''}{rotated}",
                     folder, seconds))
        if args.mix is not None:
            if not args.whole:
                parser.error("--mix takes --whole")
            folder, seconds = _mixed(work, method, args.group_size, args.scheme, args.mix, args.mix_samples,
                                     args.mix_fallback, args.rotate)
            rows.append((f"graphcal {args.scheme} g{args.group_size} {method} whole model, {args.mix_fallback} where "
                         f"eval chose within {args.mix:g} MB{rotated}", folder, seconds))
    if args.budget is not None:
        rows.append(_budget(work, args.budget, args.budget_samples))
    results = []
    print("| model | held-out perplexity | size (MB) | graphcal run (s) |")
    print("|---|---|---|---|")
    for label, folder, seconds in rows:
        scored = perplexity(folder / "model.onnx", work / "eval.npz")
        results.append({"label": label, "folder": str(folder), "perplexity": scored["perplexity"],
                        "bytes": _size(folder), "run_s": seconds})
        print(f"| {label} | {scored['perplexity']:.2f} | {_size(folder) / 1e6:.0f} | "
              f"{'' if seconds is None else f'{seconds:.0f}'} |", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
