"""The ``graphcal export`` verb's code (its command line is graphcal.cli.export).

- torch_export.py: torch modules to ONNX keeping the module names (:func:`export_torch`; also
  tools/make_models.py's and the tests' exporter).
- pretrained.py: a transformers model folder to model.onnx, and calib.npz from --text
  (:func:`export_pretrained`); an onnxruntime-genai folder gets calib.npz only.
- genai.py: --genai, onnxruntime-genai's model builder run offline (:func:`build_genai`).
- text.py: --text to token rows, --seq and lines bounded (:func:`tokenize_text`).
"""

from graphcal.export.genai import build_genai
from graphcal.export.pretrained import Exported, export_pretrained, tokenize_genai
from graphcal.export.text import check_seq, pack_windows, tokenize_lines, tokenize_text
from graphcal.export.torch_export import BATCH_SEQ_AXES, example_ids, export_torch

__all__ = ["BATCH_SEQ_AXES", "Exported", "build_genai", "check_seq", "example_ids", "export_pretrained", "export_torch",
           "pack_windows", "tokenize_genai", "tokenize_lines", "tokenize_text"]
