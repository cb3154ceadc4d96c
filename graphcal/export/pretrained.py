"""``graphcal export``: a local transformers model folder to ``model.onnx`` (:func:`export_pretrained`),
and ``calib.npz`` from a text file; an onnxruntime-genai model folder (built already) gets
``calib.npz`` only (:func:`tokenize_genai`). The torch export is graphcal.export.torch_export's,
the text's tokenizing graphcal.export.text's. torch and transformers are imported lazily inside
the functions.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from pathlib import Path

from graphcal.data.fill import GENAI_CONFIG, genai_context, genai_section, read_genai_config
from graphcal.errors import GraphcalError, UsageError, first_line
from graphcal.export.text import check_seq, tokenize_text
from graphcal.export.torch_export import BATCH_SEQ_AXES, example_ids, export_torch
from graphcal.graph import io as graph_io
from graphcal.output import check_output_dir, releases_outputs, reserve_output


@dataclass
class Exported:
    """What graphcal export wrote, and the calibration data's padding share (None without --text)."""

    files: list[Path]
    samples: int | None = None
    padding: float | None = None  # padded positions / all positions in calib.npz


@releases_outputs  # the -o reservation is released however the export ends
def export_pretrained(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dynamo: bool = False,
                      opset: int | None = None, text: str | os.PathLike | None = None, seq: int = 128,
                      num_samples: int | None = None, pack: bool = False) -> Exported:
    """Export a local transformers model folder to ``out_dir/model.onnx``, ready to calibrate.

    Reads the folder only (``local_files_only``: nothing is downloaded). A causal LM exports its
    ``logits``, any other model its first output (``last_hidden_state``), with eager attention
    (plain MatMul/Softmax, which graphcal's kv-cache finder recognises) and dynamic batch and
    sequence axes. ``text`` (one sample per non-empty line) becomes ``out_dir/calib.npz``
    through the folder's tokenizer, padded or truncated to ``seq`` tokens, or with ``pack`` joined
    (the end-of-sequence token between lines) and cut into full windows of ``seq`` tokens, with no
    padding (``num_samples`` then counts windows). Models past 2 GB are
    written with external data. ``out_dir`` follows graphcal run's rules (graphcal.output): checked
    and locked first, written in a temporary folder beside it and swapped in. Returns the files
    written and the share of padding in calib.npz.

    An onnxruntime-genai model folder (genai_config.json, no config.json) has its model built
    already: only ``text`` is tokenized, into calib.npz (:func:`tokenize_genai`).
    """
    import numpy as np  # lazy: kept off the CLI's start-up path
    import torch

    try:
        import transformers  # lazy: optional dependency (the export extra), seconds to import
    except ImportError:
        raise GraphcalError("graphcal export needs transformers: pip install 'graphcal[export]'") from None
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not (model_dir / "config.json").is_file() and (model_dir / GENAI_CONFIG).is_file():
        if dynamo or opset is not None:
            raise UsageError(f"{model_dir} is an onnxruntime-genai model folder ({GENAI_CONFIG}, no config.json): its "
                             "model is built already, so --dynamo and --opset do not apply; give --text alone")
        return tokenize_genai(model_dir, out_dir, text, seq=seq, num_samples=num_samples, pack=pack)
    if not (model_dir / "config.json").is_file():
        raise UsageError(f"{model_dir} is not a transformers model folder (no config.json) nor an onnxruntime-genai "
                         f"one ({GENAI_CONFIG})")
    opset = opset or (18 if dynamo else 17)
    sources = [model_dir, *([text] if text is not None else [])]
    check_output_dir(out_dir, sources)  # reads only: -o refused before the config is read
    try:
        config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise GraphcalError(f"cannot load the model in {model_dir}: {first_line(e)}") from e
    check_seq(seq, config)  # before -o is locked or anything heavy is loaded
    slot = reserve_output(out_dir, sources, main=True)
    try:
        causal = any(a.endswith("ForCausalLM") for a in (config.architectures or []))
        auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
        model = auto.from_pretrained(model_dir, local_files_only=True, attn_implementation="eager").eval()
    except (OSError, ValueError, KeyError) as e:
        raise GraphcalError(f"cannot load the model in {model_dir}: {first_line(e)}") from e
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    tokenizer = None
    if text is not None:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError) as e:
            raise GraphcalError(f"--text needs the model folder's tokenizer: {first_line(e)}") from e
    names = list(tokenizer.model_input_names) if tokenizer is not None else ["input_ids", "attention_mask"]
    accepted = inspect.signature(model.forward).parameters
    names = [n for n in names if n in accepted]
    vocab = getattr(config, "vocab_size", 256)
    ids = example_ids(vocab, 2, min(seq, 16), 0)
    examples = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    inputs = {n: examples[n] for n in names}
    output = "logits" if causal else "last_hidden_state"
    axes = {n: dict(BATCH_SEQ_AXES) for n in [*names, output]}
    arrays = None
    if text is not None:
        arrays = tokenize_text(tokenizer, text, names, seq, num_samples, pack)

    def write(tmp: Path) -> list[Path]:
        path = export_torch(model, inputs, tmp / "model.onnx", output_names=[output], dynamic_axes=axes,
                            dynamo=dynamo, constant_folding=True, opset=opset)

        graph_io.check_written(path)  # onnx's checker, before the files are moved into place
        data = path.with_name(path.name + ".data")
        written = [path] + ([data] if data.exists() else [])
        if arrays is not None:
            np.savez(tmp / "calib.npz", **arrays)
            written.append(tmp / "calib.npz")
        return written

    files = slot.write(write)
    if arrays is None:
        return Exported(files)
    mask = arrays.get("attention_mask")
    padding = float(1 - mask.mean()) if mask is not None else None
    return Exported(files, len(arrays["input_ids"]), padding)


@releases_outputs  # the -o reservation is released however the tokenizing ends
def tokenize_genai(model_dir: Path, out_dir: Path, text: str | os.PathLike | None, *, seq: int = 128,
                   num_samples: int | None = None, pack: bool = False) -> Exported:
    """``out_dir/calib.npz`` for an onnxruntime-genai model folder (its model is built already):
    ``text`` tokenized with the folder's tokenizer (tokenizer.json, tokenizer_config.json) into the
    decoder's ``input_ids`` and ``attention_mask`` only, named as ``genai_config.json``'s
    ``model.decoder.inputs`` names them. ``--seq`` is bounded by its ``model.context_length``. graphcal
    fills the past tensors (and position_ids) when it calibrates (graphcal.data.fill)."""
    import numpy as np  # lazy: kept off the CLI's start-up path

    if text is None:
        raise UsageError(f"{model_dir} is an onnxruntime-genai model folder ({GENAI_CONFIG}, no config.json): its model "
                         "is built already; give --text to write calib.npz for it")
    check_output_dir(out_dir, [model_dir, text])  # reads only: -o refused before the config is read
    config = read_genai_config(model_dir) or {}
    check_seq(seq, None, context=genai_context(config))  # before -o is locked or the tokenizer is loaded
    inputs = genai_section(config, "model", "decoder", "inputs")
    names = {key: inputs.get(key, key) for key in ("input_ids", "attention_mask")
             if key == "input_ids" or key in inputs or not inputs}
    if not all(isinstance(v, str) for v in names.values()):
        raise GraphcalError(f"{model_dir / GENAI_CONFIG}: model.decoder.inputs does not name the inputs as strings")
    try:
        import transformers  # lazy: optional dependency (the export extra), seconds to import
    except ImportError:
        raise GraphcalError("graphcal export needs transformers: pip install 'graphcal[export]'") from None
    slot = reserve_output(out_dir, [model_dir, text], main=True)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise GraphcalError(f"--text needs the model folder's tokenizer (tokenizer.json): {first_line(e)}") from e
    arrays = tokenize_text(tokenizer, text, list(names), seq, num_samples, pack)
    arrays = {names[key]: value for key, value in arrays.items()}  # the decoder's own input names

    def write(tmp: Path) -> list[Path]:
        np.savez(tmp / "calib.npz", **arrays)
        return [tmp / "calib.npz"]

    files = slot.write(write)
    mask = arrays.get(names.get("attention_mask", ""))
    return Exported(files, len(arrays[names["input_ids"]]), float(1 - mask.mean()) if mask is not None else None)


