"""onnxruntime-genai's own generate loop, timed for both models: time to first token and decode tokens/s.

For a KV-cache model whose folder is an onnxruntime-genai folder (a ``genai_config.json`` whose
decoder is the model file benched), each model is loaded by ``og.Model`` on the provider the rest
of bench runs on, and generates greedily from the same prompt: ``max_length`` and ``min_length``
both set to prompt + N, so that the end-of-sequence token cannot stop it early (the tokens
generated are counted all the same). Per round and model, timed with ``time.perf_counter``:

- time to first token: ``append_tokens(prompt)`` (the prompt's forward pass) and the first
  ``generate_next_token()`` (which picks the token from the logits it left);
- decode: the remaining ``generate_next_token()`` calls until ``is_done()``, each a forward pass
  of one token over the cache; reported per token (their time / their count) and as tokens/s.

The generator is made before the clock starts (its KV buffers are allocated there). One untimed
generation of each model first (none with ``--warmup 0``); then the rounds, the order of the two
models flipped every round (graphcal.bench.timing.round_order). Where onnxruntime-genai is not
installed, a folder is not a genai folder, or a model does not load or run in it, the loop is
skipped with the reason in one line.

onnxruntime-genai never opens the model's folder itself: it opens a folder graphcal makes (:func:`stage`)
holding graphcal's copy of genai_config.json, without what would make onnxruntime-genai load code or
write files (graphcal.data.genai_native: a ``custom_ops_library``, provider options naming libraries,
session config entries, ...; a note names what was dropped), and a link to each regular file inside
the model's folder. ``--allow-custom-ops PATH`` keeps a ``custom_ops_library`` that is the file PATH
names (checked before anything is timed: :func:`check_allowed_library`); it is copied into that
folder, where onnxruntime-genai looks for it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from graphcal.bench.report import MODELS, GenaiLoop, LoopTiming
from graphcal.bench.session import CUDA
from graphcal.bench.timing import round_order
from graphcal.data.fill import GENAI_CONFIG, genai_context, genai_section, read_genai_config
from graphcal.data.genai_native import strip_native
from graphcal.errors import GraphcalError, UsageError, first_line, shown
from graphcal.limits import confinement, leads_inside, open_regular


class _Skip(Exception):
    """Why the loop is not measured (one line)."""


def genai_loop(paths: dict[str, Path], prompt: np.ndarray, new_tokens: int, rounds: int, warmup: int,
               provider: str, workdir: Path, library: Path | None = None) -> GenaiLoop:
    """Both models of ``paths`` (label -> model file) in onnxruntime-genai's loop, ``new_tokens``
    generated after ``prompt`` (token ids, [1, length]) on ``provider``; ``skipped`` says why not.
    Each model's folder is staged in ``workdir`` (:func:`stage`; ``library``: --allow-custom-ops)."""
    loop = GenaiLoop(int(prompt.shape[1]), new_tokens, rounds, provider="cuda" if provider == CUDA else "cpu")
    try:
        og = _import()
        loop.version = getattr(og, "__version__", None)
        configs = {label: _check_folder(paths[label]) for label in MODELS}
        context = min(_context(config) for config in configs.values())
        if prompt.shape[1] + new_tokens > context:
            keep = context - new_tokens
            if keep < 1:
                raise _Skip(f"--genai-tokens {new_tokens} leaves no room for a prompt in the context of {context} "
                            "tokens (genai_config.json's model.context_length)")
            prompt = prompt[:, :keep]
            loop.prompt_tokens = keep
        prompt = np.ascontiguousarray(prompt, dtype=np.int32)
        staged = {}
        for label in MODELS:
            try:
                staged[label], note = stage(paths[label], configs[label], workdir / f"genai-{label}", library)
            except OSError as e:
                raise _Skip(f"could not stage {paths[label].parent} for onnxruntime-genai: {e.strerror or e}") from None
            loop.notes += [note] if note else []
        models = {label: _load(og, staged[label], paths[label], provider) for label in MODELS}
        timings = {label: LoopTiming([], [], []) for label in MODELS}
        for _ in range(min(warmup, 1)):
            for label in MODELS:
                _generate(og, models[label], prompt, new_tokens, paths[label])
        for order in round_order(len(MODELS), rounds):
            for i in order:
                label = MODELS[i]
                ttft, per_token, generated = _generate(og, models[label], prompt, new_tokens, paths[label])
                timings[label].ttft.append(ttft)
                if per_token is not None:
                    timings[label].per_token.append(per_token)
                timings[label].generated.append(generated)
    except _Skip as e:
        loop.skipped = str(e)
        return loop
    loop.reference, loop.quantized = timings["reference"], timings["quantized"]
    return loop


def _import():
    try:
        import onnxruntime_genai as og  # lazy: optional (graphcal[genai]), and only KV-cache models need it
    except ImportError as e:
        raise _Skip(f"onnxruntime-genai is not installed (pip install 'graphcal[genai]'; {first_line(e)})") from None
    return og


def _check_folder(path: Path) -> dict:
    """``path``'s folder is a genai folder that runs ``path``: its parsed genai_config.json."""
    folder = path.parent
    try:
        config = read_genai_config(folder)
    except GraphcalError as e:
        raise _Skip(str(e)) from None
    if config is None:
        raise _Skip(f"{folder} holds no {GENAI_CONFIG} (not an onnxruntime-genai folder)")
    filename = genai_section(config, "model", "decoder").get("filename")
    if filename != path.name:
        raise _Skip(f"{folder / GENAI_CONFIG} runs {shown(repr(filename))}, not {path.name}")
    return config


def _context(config: dict) -> int | float:
    """A genai_config's context length (inf when unsaid)."""
    context = genai_context(config)
    return float("inf") if context is None else context[1]


def check_allowed_library(paths: dict[str, Path], library: Path) -> None:
    """``--allow-custom-ops library``: a regular file, and the one every ``custom_ops_library`` of the
    models' genai_config.json names (at least one must); else a one-line usage error, before anything runs."""
    with open_regular(library, "--allow-custom-ops library", UsageError):
        pass
    named = 0
    for label in MODELS:
        folder = paths[label].parent
        try:
            config = read_genai_config(folder)
        except GraphcalError:
            continue  # the loop says why it cannot run this folder
        for where, value in strip_native(config or {}).libraries:
            named += 1
            if not _same_file(folder, value, library):
                raise UsageError(f"--allow-custom-ops {library}: {folder / GENAI_CONFIG}'s {where} names "
                                 f"{shown(repr(value))}, another library; graphcal loads only the one the flag names")
    if not named:
        raise UsageError(f"--allow-custom-ops {library}: neither model's {GENAI_CONFIG} names a custom_ops_library")


def _same_file(folder: Path, value: str, library: Path) -> bool:
    """Whether a config's ``custom_ops_library`` value (relative: to the model's folder) is the file ``library``."""
    try:
        return os.path.samefile(folder / value, library)  # an absolute value replaces the folder
    except (OSError, ValueError):
        return False


def stage(path: Path, config: dict, into: Path, library: Path | None) -> tuple[Path, str | None]:
    """The folder onnxruntime-genai opens for the model file ``path``: ``into``, holding graphcal's copy of
    ``config`` (the folder's parsed genai_config.json) without what would load code or write files, and a
    link to each regular file inside ``path``'s folder (none leads out of it). A ``custom_ops_library``
    that is the file ``library`` names is kept, the library copied in. Returns (``into / path.name``, a
    note naming what was dropped, or None)."""
    folder = path.parent
    into.mkdir()
    copied: list[str] = []

    def keep(value: str) -> str | None:
        if library is None or not _same_file(folder, value, library):
            return None
        if not copied:
            with open_regular(library, "--allow-custom-ops library", UsageError) as src, \
                    open(into / library.name, "xb") as dst:
                shutil.copyfileobj(src, dst)
            copied.append(library.name)
        return copied[0]  # relative: onnxruntime-genai finds it in the folder it opens

    stripped = strip_native(config, keep)
    (into / GENAI_CONFIG).write_text(json.dumps(stripped.config, indent=4))
    roots = confinement(folder)  # the folder's own rule: a Hugging Face snapshot's links into its blobs count
    with os.scandir(folder) as entries:
        names = sorted(e.name for e in entries if e.name != GENAI_CONFIG and e.name not in copied)
    for name in names:
        real = os.path.realpath(folder / name)
        if leads_inside(roots, real) and real not in roots and os.path.isfile(real):
            os.symlink(real, into / name)
    note = None if not stripped.dropped else (
        f"onnxruntime-genai's loop: not handed what {folder / GENAI_CONFIG} sets to make onnxruntime-genai load code "
        f"or touch files: {stripped.describe()}"
        + (" (--allow-custom-ops PATH loads a custom_ops_library it names)" if stripped.libraries and library is None
           else ""))
    return into / path.name, note


def _load(og, staged: Path, path: Path, provider: str):
    try:
        config = og.Config(str(staged.parent))
        config.clear_providers()  # onnxruntime-genai's CPU provider, unless bench runs on CUDA
        if provider == CUDA:
            config.append_provider("cuda")
        return og.Model(config)
    except Exception as e:  # noqa: BLE001 -- onnxruntime-genai raises its own types
        raise _Skip(f"onnxruntime-genai could not load {path.parent}: {first_line(e)}") from None


def _generate(og, model, prompt: np.ndarray, new_tokens: int, path: Path) -> tuple[float, float | None, int]:
    """One greedy generation: (seconds to the first token, seconds per token after it or None, tokens generated)."""
    try:
        params = og.GeneratorParams(model)
        total = int(prompt.shape[1]) + new_tokens
        params.set_search_options(do_sample=False, max_length=total, min_length=total)
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(prompt)
        generator.generate_next_token()
        first = time.perf_counter()
        after = 0
        while not generator.is_done():
            generator.generate_next_token()
            after += 1
        end = time.perf_counter()
        generated = len(generator.get_sequence(0)) - int(prompt.shape[1])
    except Exception as e:  # noqa: BLE001 -- onnxruntime-genai raises its own types
        raise _Skip(f"onnxruntime-genai failed to generate with {path.parent}: {first_line(e)}") from None
    return first - start, (end - first) / after if after else None, generated
