"""Export torch modules to ONNX.

It serves ``graphcal export`` (:func:`export_pretrained`) and ``tools/make_models.py`` (the tiny
reference models in ``models/``, built by ``tools/builders.py``, outside the package).
torch and transformers are imported lazily inside the functions, so importing this module is cheap
and does not need either package.

Node and initializer names keep the torch module paths (``model.layers.0.self_attn.q_proj``):
the module being exported is never wrapped in another ``nn.Module`` (that would prefix every name
with the wrapper's attribute). Instead :func:`export_torch` temporarily sets an instance-level
``forward`` that calls the original one with keyword arguments and returns only the named outputs.
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphcal.data.fill import GENAI_CONFIG, genai_context, genai_section, read_genai_config
from graphcal.errors import GraphcalError, UsageError, first_line
from graphcal.export_text import check_seq, pack_windows, tokenize_lines  # noqa: F401 -- pack_windows: its old home
from graphcal.graph import io as graph_io
from graphcal.limits import read_regular
from graphcal.output import check_output_dir, releases_outputs, reserve_output
from graphcal.output.process import on_abort

log = logging.getLogger("graphcal")

MAX_TEXT_BYTES = 1 << 30  # --text: a calibration text file is read whole

#: Dynamic axes of the tiny models' [batch, seq] inputs and outputs (legacy exporter).
BATCH_SEQ_AXES = {0: "batch", 1: "seq"}


def example_ids(vocab_size: int, batch: int, seq: int, seed: int):
    """Seeded random int64 ``[batch, seq]`` token ids in ``[0, vocab_size)``: the example inputs
    exports are traced with (here and in ``tools/builders.py``)."""
    import torch  # lazy: torch takes seconds to import; graphcal --help does without

    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, vocab_size, (batch, seq), generator=g, dtype=torch.int64)


def _select_outputs(result: Any, output_names: list[str]) -> tuple:
    """Pick the tensors named by ``output_names`` out of a forward's return value."""
    out = []
    for name in output_names:
        if isinstance(result, dict) or hasattr(result, "keys"):
            value = result[name]
        elif hasattr(result, name):
            value = getattr(result, name)
        else:
            raise KeyError(f"forward's result has no output {name!r}")
        if value is None:
            raise KeyError(f"forward's output {name!r} is None")
        out.append(value)
    return tuple(out)


def export_torch(
    module,
    example_inputs: dict,
    path: str | os.PathLike,
    *,
    output_names: list[str] | tuple[str, ...],
    dynamic_axes: dict | None = None,
    dynamo: bool = False,
    constant_folding: bool = True,
    opset: int = 17,
) -> Path:
    """Export ``module`` to the ONNX file ``path`` and return its path.

    ``module``'s forward is called with ``example_inputs``' keys as keyword arguments; the graph's
    inputs are named (and ordered) like the dict. The graph's outputs are the tensors of the
    forward's result named by ``output_names`` (attributes of a HF ``ModelOutput``, or dict keys).

    ``dynamo=False`` uses the legacy TorchScript exporter (``do_constant_folding``, ``dynamic_axes``
    apply): with constant folding, Linear weights become pre-transposed ``[in, out]`` initializers
    named ``onnx::MatMul_NNN`` and nodes are named ``/model/layers.0/self_attn/q_proj/MatMul``;
    without it, the ``[out, in]`` weight keeps its torch name and feeds a ``Transpose``.

    ``dynamo=True`` uses the torch.export-based exporter at opset >= 18. Nodes are named
    ``node_linear_N`` (bias-free Linear) / ``node_MatMul_N`` and carry the module path in their
    ``pkg.torch.onnx.name_scopes`` metadata. ``constant_folding`` maps to the exporter's
    ``optimize`` (on: Transpose(weight) folded into an initializer named ``val_N``; off: the
    torch-named weight feeds a Transpose). Shapes are static unless ``dynamic_axes`` is given
    (torch translates it to ``dynamic_shapes`` and names the graph's dims after it).

    The file is written in one piece (weights inside the protobuf, no external data) and is
    byte-for-byte deterministic for a given torch version when the module's weights are.
    """
    import onnx  # lazy: kept off the CLI's start-up path
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    output_names = list(output_names)
    input_names = list(example_inputs)
    if not input_names:
        raise ValueError("example_inputs is empty")

    original_forward = module.forward  # bound method of the class' forward
    had_instance_forward = "forward" in vars(module)

    def forward(*args, **kwargs):
        # The exporters pass the example inputs positionally (legacy) or by keyword (dynamo).
        kw = dict(zip(input_names, args))
        kw.update(kwargs)
        return _select_outputs(original_forward(**kw), output_names)

    # The legacy exporter traces through inspect.signature(module.forward); give the instance
    # forward the input names so keyword / positional mapping and input naming line up.
    forward.__signature__ = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in input_names]
    )

    was_training = module.training
    module.eval()
    module.forward = forward
    try:
        args = tuple(example_inputs[n] for n in input_names)
        with torch.no_grad(), tempfile.TemporaryDirectory() as tmp, on_abort(
                lambda: shutil.rmtree(tmp, ignore_errors=True)):  # removed too when a signal stops the export
            tmp_path = Path(tmp) / "model.onnx"
            if dynamo:
                if opset < 18:
                    raise ValueError("the dynamo exporter needs opset >= 18")
                program = torch.onnx.export(
                    module,
                    (),
                    kwargs=dict(example_inputs),
                    dynamo=True,
                    opset_version=opset,
                    input_names=input_names,
                    output_names=output_names,
                    dynamic_axes=dynamic_axes,  # translated to dynamic_shapes by torch
                    optimize=constant_folding,
                    verify=False,
                    verbose=False,
                    external_data=False,
                )
                model = program.model_proto
            else:
                torch.onnx.export(
                    module,
                    args,
                    str(tmp_path),
                    dynamo=False,
                    export_params=True,
                    do_constant_folding=constant_folding,
                    opset_version=opset,
                    input_names=input_names,
                    output_names=output_names,
                    dynamic_axes=dynamic_axes,
                )
                model = onnx.load(str(tmp_path))
    finally:
        if had_instance_forward:
            module.forward = original_forward
        else:
            del module.forward
        module.train(was_training)

    _normalise(model)

    if graph_io.past_protobuf_limit(model):  # past protobuf's 2 GB: weights in <name>.data beside the graph
        graph_io.save_with_external_data(model, path)
        return path
    data = model.SerializeToString(deterministic=True)
    path.write_bytes(data)
    return path


# --------------------------------------------------------------------------------------------
# graphcal export: a transformers model folder -> model.onnx (+ calib.npz from a text file).
# --------------------------------------------------------------------------------------------


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
        arrays = _tokenize_text(tokenizer, text, names, seq, num_samples, pack)

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


def _tokenize_text(tokenizer, text, names: list[str], seq: int, num_samples: int | None, pack: bool) -> dict:
    """``text``'s non-empty lines tokenized into the int64 arrays ``names`` (graphcal.export_text.tokenize_lines);
    the file is read as a bounded regular file."""
    raw = read_regular(text, "--text file", MAX_TEXT_BYTES, error=UsageError)  # regular files only, bounded
    try:
        lines = [line.strip() for line in raw.decode("utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError as e:
        raise UsageError(f"--text {text} is not UTF-8 text ({e.reason} at byte {e.start})") from e
    if num_samples is not None and not pack:
        lines = lines[:num_samples]
    if not lines:
        raise GraphcalError(f"{text} holds no non-empty lines")
    log.info("tokenizing %s lines of %s", f"{len(lines):,}", text)
    return tokenize_lines(tokenizer, lines, names, seq, pack=pack, num_samples=num_samples, source=str(text))


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
    arrays = _tokenize_text(tokenizer, text, list(names), seq, num_samples, pack)
    arrays = {names[key]: value for key, value in arrays.items()}  # the decoder's own input names

    def write(tmp: Path) -> list[Path]:
        np.savez(tmp / "calib.npz", **arrays)
        return [tmp / "calib.npz"]

    files = slot.write(write)
    mask = arrays.get(names.get("attention_mask", ""))
    return Exported(files, len(arrays[names["input_ids"]]), float(1 - mask.mean()) if mask is not None else None)


def _normalise(model) -> None:
    """Make an exported ModelProto loadable by onnxruntime and free of run-dependent fields."""
    from graphcal.graph.io import MAX_ORT_IR  # the one IR cap: what onnxruntime loads

    model.ir_version = min(model.ir_version, MAX_ORT_IR)
    # producer_version is the torch version: deterministic for a given torch, keep it.
    # The dynamo exporter may leave doc strings holding stack traces (file paths); drop them.
    model.doc_string = ""
    model.graph.doc_string = ""
    for node in model.graph.node:
        node.doc_string = ""
    for fn in model.functions:
        fn.doc_string = ""
        for node in fn.node:
            node.doc_string = ""
