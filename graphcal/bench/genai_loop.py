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
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from graphcal.bench.report import MODELS, GenaiLoop, LoopTiming
from graphcal.bench.session import CUDA
from graphcal.bench.timing import round_order
from graphcal.data.fill import GENAI_CONFIG, genai_context, genai_section, read_genai_config
from graphcal.errors import GraphcalError, first_line, shown


class _Skip(Exception):
    """Why the loop is not measured (one line)."""


def genai_loop(paths: dict[str, Path], prompt: np.ndarray, new_tokens: int, rounds: int, warmup: int,
               provider: str) -> GenaiLoop:
    """Both models of ``paths`` (label -> model file) in onnxruntime-genai's loop, ``new_tokens``
    generated after ``prompt`` (token ids, [1, length]) on ``provider``; ``skipped`` says why not."""
    loop = GenaiLoop(int(prompt.shape[1]), new_tokens, rounds, provider="cuda" if provider == CUDA else "cpu")
    try:
        og = _import()
        loop.version = getattr(og, "__version__", None)
        context = min(_check_folder(paths[label]) for label in MODELS)
        if prompt.shape[1] + new_tokens > context:
            keep = context - new_tokens
            if keep < 1:
                raise _Skip(f"--genai-tokens {new_tokens} leaves no room for a prompt in the context of {context} "
                            "tokens (genai_config.json's model.context_length)")
            prompt = prompt[:, :keep]
            loop.prompt_tokens = keep
        prompt = np.ascontiguousarray(prompt, dtype=np.int32)
        models = {label: _load(og, paths[label], provider) for label in MODELS}
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


def _check_folder(path: Path) -> int | float:
    """``path``'s folder is a genai folder that runs ``path``: its context length (inf when unsaid)."""
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
    context = genai_context(config)
    return float("inf") if context is None else context[1]


def _load(og, path: Path, provider: str):
    try:
        config = og.Config(str(path.parent))
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
