"""models/tiny-llama-optimum/: the shipped tiny Llama exported by Hugging Face Optimum with its KV cache.

    python tools/make_optimum_model.py [--out models/tiny-llama-optimum]

Run it in a virtual environment of its own: ``pip install torch==2.13.0 "optimum-onnx[onnxruntime]"
"transformers<4.58"``. Optimum pulls plain onnxruntime, which must never sit beside graphcal's
onnxruntime-gpu, so it is not among graphcal's dependencies and this file imports nothing of graphcal.

The model is models/tiny-llama's (tools/builders.py ``build_tiny_llama``: the same LlamaConfig and
torch seed 0, transformers' default initialisation), saved with transformers and exported by
``optimum.exporters.onnx.main_export(task="text-generation-with-past")``: inputs ``input_ids``,
``attention_mask``, ``position_ids`` and ``past_key_values.N.key/value``; outputs ``logits`` and
``present.N.key/value``. ``calib.npz`` holds token ids alone (16 x 32, seed 1), which graphcal's
KV-cache fill completes; ``heldout.npz`` another 8 x 32 (seed 2).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("models/tiny-llama-optimum"))
    args = ap.parse_args()
    import torch
    from optimum.exporters.onnx import main_export
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        export = Path(tmp) / "onnx"
        main_export(tmp, export, task="text-generation-with-past", opset=17, no_post_process=True)
        args.out.mkdir(parents=True, exist_ok=True)
        shutil.copy(export / "model.onnx", args.out / "model.onnx")
    for name, seed, rows in (("calib.npz", 1, 16), ("heldout.npz", 2, 8)):
        rng = np.random.default_rng(seed)
        np.savez(args.out / name, input_ids=rng.integers(0, 256, (rows, 32)).astype(np.int64))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
