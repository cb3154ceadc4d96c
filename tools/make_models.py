#!/usr/bin/env python
"""Regenerate the shipped test models in ``models/``, byte for byte.

    python tools/make_models.py            # write models/tiny-llama/*, models/tiny-bert/*
    python tools/make_models.py --check    # regenerate into a temp dir; exit 1 if any byte differs

Each model directory holds:

* ``model.onnx``   -- legacy (TorchScript) exporter, opset 17, constant folding on: the usual
  deployed form (Linear weights as ``[in, out]`` initializers named ``onnx::MatMul_NNN``, nodes
  named like ``/model/layers.0/self_attn/q_proj/MatMul``), dynamic batch/seq axes.
* ``calib.npz``    -- 64 samples x seq 32, keyed by the model's input names; the leading sample
  dimension is the model's batch dimension.
* ``heldout.npz``  -- 16 samples x seq 32, same layout, different seed.

The token ids are synthetic: uniform random ids from a seeded ``numpy.random.Generator``;
``attention_mask`` is all ones and ``token_type_ids`` (BERT) all zeros.

The models come from random-initialised transformers configs with fixed seeds
(:func:`tools.builders.build_tiny_llama`, :func:`tools.builders.build_tiny_bert`). The output is
deterministic for a given torch / transformers / onnx version; ``.npz`` files are written with a
fixed zip timestamp (``numpy.savez`` stamps the current time).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python tools/make_models.py`: `tools` (and graphcal) import from the repo root
    sys.path.insert(0, str(REPO))

from tools.lib.synthetic import OPSET, make_bench_decoder, make_data, make_large_decoder, save_npz  # noqa: E402

MODELS_DIR = REPO / "models"
SEQ = 32
#: file name -> (number of samples, numpy seed offset)
DATASETS = {"calib.npz": (64, 0), "heldout.npz": (16, 1)}
#: model directory name -> (builder function name in tools.builders, base data seed)
MODELS = {
    "tiny-llama": ("build_tiny_llama", 1000),
    "tiny-bert": ("build_tiny_bert", 2000),
}
FILES = ("model.onnx", *DATASETS)
__all__ = ["compare", "make_all", "make_model", "save_npz"]  # save_npz: tests/export/test_exporter.py reads it from here


def make_model(name: str, out_dir: str | Path) -> list[Path]:
    """Write ``model.onnx``, ``calib.npz`` and ``heldout.npz`` of model ``name`` into ``out_dir``."""
    from graphcal.export import export_torch  # lazy: torch, kept out of --help
    from tools import builders  # lazy: torch and transformers, kept out of --help

    builder_name, data_seed = MODELS[name]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, inputs, output_names, dynamic_axes = getattr(builders, builder_name)(seed=0)
    written = [
        export_torch(
            model,
            inputs,
            out_dir / "model.onnx",
            output_names=output_names,
            dynamic_axes=dynamic_axes,
            dynamo=False,
            constant_folding=True,
            opset=OPSET,
        )
    ]
    vocab = model.config.vocab_size
    for fname, (n, offset) in DATASETS.items():
        arrays = make_data(list(inputs), vocab, n, SEQ, data_seed + offset)
        written.append(save_npz(out_dir / fname, arrays))
    return written


def make_all(root: str | Path, names=None) -> list[Path]:
    written = []
    for name in names or MODELS:
        written += make_model(name, Path(root) / name)
    return written


def compare(generated_root: str | Path, reference_root: str | Path, names=None) -> list[str]:
    """Relative paths whose bytes differ (or are missing) between the two trees."""
    bad = []
    for name in names or MODELS:
        for fname in FILES:
            rel = f"{name}/{fname}"
            a, b = Path(generated_root) / rel, Path(reference_root) / rel
            if not b.exists():
                bad.append(f"{rel} (missing in {reference_root})")
            elif a.read_bytes() != b.read_bytes():
                bad.append(f"{rel} (differs)")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="regenerate into a temp dir and exit 1 if any byte differs from models/")
    ap.add_argument("--out", type=Path, default=MODELS_DIR, help="output root (default: models/)")
    ap.add_argument("--bench-decoder", type=Path, metavar="DIR",
                    help="write the (not shipped) benchmark decoder's model.onnx into DIR and exit")
    ap.add_argument("--large-decoder", type=Path, metavar="DIR",
                    help="write the (not shipped) 1.5B-parameter decoder's model.onnx (+ .data) into DIR and exit")
    ap.add_argument("names", nargs="*", metavar="NAME",
                    help=f"models to build (default: all of {', '.join(MODELS)})")
    args = ap.parse_args(argv)
    # Known, harmless exporter chatter (HF mask code under the tracer, aten::index).
    warnings.filterwarnings("ignore", message="Converting a tensor to a Python boolean")
    warnings.filterwarnings("ignore", message="Exporting aten::index operator")
    if args.bench_decoder is not None:
        path = make_bench_decoder(args.bench_decoder)
        print(f"wrote {path} ({path.stat().st_size} bytes)")
        return 0
    if args.large_decoder is not None:
        path = make_large_decoder(args.large_decoder)
        print(f"wrote {path} and its external data")
        return 0
    names = args.names or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")

    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            make_all(tmp, names)
            bad = compare(tmp, args.out, names)
        if bad:
            for b in bad:
                print(f"MISMATCH {b}")
            print(f"{len(bad)} file(s) differ from {args.out}; run tools/make_models.py to regenerate")
            return 1
        print(f"OK: {len(names) * len(FILES)} files in {args.out} are byte-identical")
        return 0

    for p in make_all(args.out, names):
        print(f"wrote {p} ({p.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
