"""graphcal export --genai: a transformers folder handed to onnxruntime-genai's model builder.

For LLMs on onnxruntime, deploying means onnxruntime-genai, and its model builder writes the
graph its generate loop runs fastest: a KV cache in its layout, GroupQueryAttention, fused
(Skip)SimplifiedLayerNormalization, rotary embeddings, q/k/v packed into one MatMul. graphcal
quantizes that graph afterwards (builder models calibrate and write: the KV cache filled from
token data, genai_config.json and the tokenizer carried into -o). Writing the same graph from a
torch export would copy the builder, so graphcal runs the builder itself: offline (nothing is
downloaded), at fp32 or fp16, for the CPU or CUDA provider, in a child process whose output
lands in -o whole or not at all. With ``--text``, calib.npz is tokenized from the folder's
tokenizer under the decoder's input names (input_ids, attention_mask).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from graphcal.errors import GraphcalError, UsageError
from graphcal.export.pretrained import Exported
from graphcal.export.text import check_seq, tokenize_text
from graphcal.output import check_output_dir, releases_outputs, reserve_output
from graphcal.output.process import on_abort

PRECISIONS = ("fp32", "fp16")
PROVIDERS = ("cpu", "cuda")
BUILDER = "onnxruntime_genai.models.builder"


@releases_outputs  # the -o reservation is released however the build ends
def build_genai(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *, precision: str = "fp32",
                provider: str = "cpu", text: str | os.PathLike | None = None, seq: int = 128,
                num_samples: int | None = None, pack: bool = False) -> Exported:
    """``out_dir``: onnxruntime-genai's builder model of ``model_dir`` (model.onnx, its data,
    genai_config.json, the tokenizer), and with ``text`` calib.npz. Returns what it wrote (:class:`Exported`)."""
    import numpy as np  # lazy: kept off the CLI's start-up path

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if precision not in PRECISIONS or provider not in PROVIDERS:
        raise UsageError(f"--genai builds {'/'.join(PRECISIONS)} models for {'/'.join(PROVIDERS)}; got {precision} "
                         f"for {provider}")
    if importlib.util.find_spec("onnxruntime_genai") is None:
        raise GraphcalError("graphcal export --genai runs onnxruntime-genai's model builder: pip install "
                            "'graphcal[genai]' (onnxruntime-genai-cuda; never the plain onnxruntime-genai wheel, "
                            "which pulls plain onnxruntime beside onnxruntime-gpu)")
    if not (model_dir / "config.json").is_file():
        raise UsageError(f"{model_dir} is not a transformers model folder (no config.json)")
    sources = [model_dir, *([text] if text is not None else [])]
    check_output_dir(out_dir, sources)  # reads only: -o refused before anything is built
    tokenizer = arrays = None
    if text is not None:
        import transformers  # lazy: optional dependency (the export extra), seconds to import

        try:
            config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
            tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise GraphcalError(f"--text needs the model folder's config and tokenizer: {str(e).splitlines()[0]}") from e
        check_seq(seq, config)
        arrays = tokenize_text(tokenizer, text, ["input_ids", "attention_mask"], seq, num_samples, pack)
    slot = reserve_output(out_dir, sources, main=True)

    def write(tmp: Path) -> list[Path]:
        before = set(os.listdir(tmp))
        with tempfile.TemporaryDirectory(prefix="graphcal-genai-cache-") as cache:
            _run_builder(model_dir, tmp, precision, provider, Path(cache))
        if arrays is not None:
            np.savez(tmp / "calib.npz", **arrays)
        return sorted(tmp / name for name in set(os.listdir(tmp)) - before)

    files = slot.write(write)
    if arrays is None:
        return Exported(files)
    return Exported(files, len(arrays["input_ids"]), float(1 - arrays["attention_mask"].mean()))


def builder_command(model_dir: str | os.PathLike, out: str | os.PathLike, precision: str, provider: str,
                    cache: str | os.PathLike, extra: tuple[str, ...] | list[str] = ()) -> list[str]:
    """onnxruntime-genai's model builder as a command line: the transformers folder ``model_dir`` to
    ``out`` at ``precision`` (its -p: fp32, fp16, int4) for ``provider`` (its -e), its download cache
    ``cache`` (its -c), then ``extra``. Run it with :func:`builder_env` (offline). graphcal runs it at
    fp32/fp16; tools/ also at int4."""
    return [sys.executable, "-m", BUILDER, "-i", str(model_dir), "-o", str(out), "-p", precision, "-e", provider,
            "-c", str(cache), *extra]


def builder_env() -> dict[str, str]:
    """The environment the builder runs in: this one, offline (nothing is downloaded)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _run_builder(model_dir: Path, out: Path, precision: str, provider: str, cache: Path) -> None:
    """The builder in a child process, offline; its last error line becomes graphcal's one line."""
    with tempfile.TemporaryFile() as log:
        child = subprocess.Popen(builder_command(model_dir, out, precision, provider, cache), stdout=log,
                                 stderr=subprocess.STDOUT, env=builder_env())
        with on_abort(child.kill):  # a signal stopping graphcal stops the builder too
            code = child.wait()
        if code != 0:
            log.seek(0)
            lines = [ln.strip() for ln in log.read().decode("utf-8", "replace").splitlines() if ln.strip()]
            raise GraphcalError(f"onnxruntime-genai's model builder failed on {model_dir} (exit {code}): "
                                f"{lines[-1][:300] if lines else 'no output'}")
