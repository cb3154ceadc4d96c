#!/usr/bin/env python
"""Write a random-weight Llama-style decoder of a real shape as ONNX, without torch (numpy and onnx only).

    python tools/make_decoder.py --preset 1.5b --out /tmp/graphcal-large-decoder
    python tools/make_decoder.py --preset llama3-8b --dtype float16 --out /tmp/llama3-8b
    python tools/make_decoder.py --hidden 64 --layers 2 --intermediate 128 --heads 4 --kv-heads 2 --vocab 128 --out DIR

Writes ``DIR/model.onnx`` (the graph, external-data references only) and ``DIR/model.onnx.data`` (every
weight, each at a 4 KB-aligned offset): the graph torch's legacy exporter writes for a transformers
``LlamaForCausalLM`` (tools/lib/decoder.py says where it differs), found by graphcal as an export is.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python tools/make_decoder.py`: `tools` imports from the repo root
    sys.path.insert(0, str(REPO))

from tools.lib.decoder import CHUNK, DTYPES, PRESETS, DecoderShape, make_decoder, parameters  # noqa: E402

WIDTHS = ("hidden", "layers", "intermediate", "heads", "kv_heads", "vocab")
EPILOG = (f"Memory: every weight is drawn and written in chunks of at most {CHUNK:,} elements "
          f"({CHUNK * 4 // 2**20} MB in float32; a tied lm_head is written as the embedding's chunks go by), "
          "so the peak stays a chunk or two above the interpreter's (measured: 93 MB at 1.5b in float32, 120 MB at 3b "
          "in float16), "
          "whatever the model's size; the data file is written in place, the page cache holds the rest. "
          "Reproducible: each chunk draws from a seed of its own, from --seed, the tensor's name and the chunk's "
          "index (the same --seed gives the same bytes). Presets: "
          + "; ".join(f"{k}: hidden {s.hidden}, {s.layers} layers, intermediate {s.intermediate}, {s.heads}/{s.kv_heads} "
                      f"heads, vocab {s.vocab}{', tied' if s.tie else ''}" for k, s in PRESETS.items()) + ".")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EPILOG)
    ap.add_argument("--preset", choices=list(PRESETS), help="a shape (the widths given below replace its own)")
    for width in WIDTHS:
        ap.add_argument(f"--{width.replace('_', '-')}", type=int, dest=width)
    ap.add_argument("--tie", action="store_true", default=None, help="lm_head is the embedding transposed")
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="the folder to write model.onnx and model.onnx.data into")
    ap.add_argument("--force", action="store_true", help="replace a model.onnx already in --out")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    base = PRESETS.get(args.preset)
    given = {w: getattr(args, w) for w in WIDTHS if getattr(args, w) is not None}
    if base is None and len(given) < len(WIDTHS):
        missing = ", ".join(f"--{w.replace('_', '-')}" for w in WIDTHS if w not in given)
        print(f"error: give --preset or every width (missing {missing})", file=sys.stderr)
        return 2
    fields = {**(base.__dict__ if base else {}), **given}
    if args.tie is not None:
        fields["tie"] = True
    start = time.perf_counter()
    try:
        shape = DecoderShape(**fields)
        shape.check()
        path = make_decoder(args.out, shape, dtype=args.dtype, seed=args.seed, force=args.force)
    except (ValueError, FileExistsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    data = path.with_name(path.name + ".data")
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(f"wrote {path} ({parameters(shape) / 1e6:,.1f}M parameters, {data.stat().st_size / 2**30:.2f} GiB of "
          f"{args.dtype} in {data.name}) in {time.perf_counter() - start:.1f} s, peak RSS {peak_mb:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
