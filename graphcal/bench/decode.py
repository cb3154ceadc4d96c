"""The decode step a deployment runs on a KV-cache decoder: batch 1, one new token over a past of P tokens.

A decoder with a KV cache (onnxruntime-genai's model builder, Optimum's text-generation-with-past)
takes ``past_key_values.N.key/value`` and returns ``present.N.key/value``. Its decode step is
measured as a deployment meets it: each model first runs its own prefill over the first P tokens
of the data's first sample from an empty cache, and its ``present.*`` outputs become the
``past_key_values.*`` inputs of the step, whose ``input_ids`` is token P of the sample, with an
``attention_mask`` of ones [1, P + 1] and ``position_ids`` [[P]] where the model takes them. Both
feeds are made as graphcal.data.fill makes them (an empty cache for the prefill; for the step,
the past given and the rest filled after it).

Past inputs are matched with present outputs by layer index and key/value: through the
``model.decoder.inputs.past_key_names`` / ``past_value_names`` and
``model.decoder.outputs.present_key_names`` / ``present_value_names`` patterns of the model
folder's genai_config.json where it gives them, else ``past_key_values.%d.key`` <->
``present.%d.key`` (and ``.value``).

The first sample is the first row of the data's first batch, its padding (``attention_mask`` 0)
dropped; P is its length minus 1 unless asked (``--past``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphcal.data import MASK_INPUT, InputSpec
from graphcal.data.fill import PAST, TOKEN_INPUTS, Filler, genai_section, read_genai_config
from graphcal.data.inputs import check_arrays
from graphcal.data.source import Source
from graphcal.errors import GraphcalError, UsageError, first_line, shown

PAST_NAMES = {"key": "past_key_values.%d.key", "value": "past_key_values.%d.value"}  # the default patterns
PRESENT_NAMES = {"key": "present.%d.key", "value": "present.%d.value"}
_CONFIG_KEYS = {  # kind -> (genai_config's decoder.inputs key, decoder.outputs key)
    "key": ("past_key_names", "present_key_names"), "value": ("past_value_names", "present_value_names")}


def takes_kv_cache(inputs: list[InputSpec]) -> bool:
    """Whether the model takes past tensors (``past_key_values.N.key/value``)."""
    return any(PAST.fullmatch(s.name) for s in inputs)


def token_input(feeds: dict[str, np.ndarray]) -> str | None:
    """The input whose axes 0 and 1 are the batch and the sequence (input_ids, else inputs_embeds)."""
    return next((n for n in TOKEN_INPUTS if n in feeds), None)


def first_sample(feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The first row of the batch ``feeds``' token input, [1, length, ...], its padding dropped
    (the positions where the batch's ``attention_mask`` is 0, when it has one of the same length)."""
    tokens = feeds[token_input(feeds)][:1]
    mask = feeds.get(MASK_INPUT)
    if mask is not None and mask.ndim == 2 and mask.shape[1] == tokens.shape[1]:
        tokens = tokens[:, np.asarray(mask[0]) != 0]
    return np.ascontiguousarray(tokens)


def past_length(length: int, past: int | None) -> int:
    """P for a sample of ``length`` tokens: ``past`` when given, else ``length - 1``. Raises
    GraphcalError when the sample is too short for a step over a past (a UsageError for ``past``)."""
    if past is None:
        if length < 2:
            raise GraphcalError(f"the data's first sample holds {length} token(s); a decode step over a past needs at "
                             "least 2 (a past of 1 and the new token)")
        return length - 1
    if past + 1 > length:
        raise UsageError(f"--past {past}: the data's first sample holds {length} tokens; a step over a past of "
                         f"{past} needs {past + 1}")
    return past


@dataclass(frozen=True)
class DecodePlan:
    """What the decode step runs on: the first sample's tokens and the past length."""

    token_name: str  # input_ids (or inputs_embeds)
    tokens: np.ndarray  # [1, length, ...]: the first sample, padding dropped
    past: int  # P: the step's input is token P, over a past of tokens 0..P-1


def plan(feeds: dict[str, np.ndarray], past: int | None) -> DecodePlan:
    """The decode plan for the data's first batch ``feeds`` (see :func:`past_length` for P)."""
    if token_input(feeds) is None:
        raise GraphcalError(f"the data holds no {' or '.join(TOKEN_INPUTS)} to take the step's tokens from")
    tokens = first_sample(feeds)
    return DecodePlan(token_input(feeds), tokens, past_length(int(tokens.shape[1]), past))


def cache_names(past_names: list[str], model_dir: Path | None) -> dict[str, str]:
    """Past input -> the present output that holds it after a run, matched by layer index and
    key/value (genai_config.json's patterns where the folder has them, else the defaults). A
    GraphcalError names a past input no pattern matches."""
    config = read_genai_config(model_dir) if model_dir is not None else None
    decoder = genai_section(config, "model", "decoder")
    found = {}
    for kind, (past_key, present_key) in _CONFIG_KEYS.items():
        found[kind] = (_pattern(decoder, "inputs", past_key, PAST_NAMES[kind]),
                       _pattern(decoder, "outputs", present_key, PRESENT_NAMES[kind]))
    out = {}
    for name in past_names:
        for past_pattern, present_pattern in found.values():
            match = re.fullmatch(re.escape(past_pattern).replace("%d", r"(\d+)"), name)
            if match:
                out[name] = present_pattern.replace("%d", match.group(1))
                break
        else:
            raise GraphcalError(f"past input {name!r} matches none of the past names "
                                f"({', '.join(p for p, _ in found.values())}); its present output is unknown")
    return out


def _pattern(decoder, section: str, key: str, default: str) -> str:
    """A ``%d`` name pattern from genai_config's ``model.decoder.<section>.<key>`` (the default when absent)."""
    value = genai_section(decoder, section).get(key)
    if value is None:
        return default
    if not isinstance(value, str) or value.count("%d") != 1 or "%" in value.replace("%d", "") or len(value) > 256:
        raise GraphcalError(f"genai_config.json: model.decoder.{section}.{key} is {shown(repr(value))}, not a name "
                            "with one %d for the layer index")
    return value


def complete(arrays: dict[str, np.ndarray], inputs: list[InputSpec], model_dir: Path | None) -> dict[str, np.ndarray]:
    """``arrays`` with the inputs they lack filled, as graphcal.data.fill fills a batch (past tensors
    of length 0 when none is given; the attention_mask and position_ids after the given past)."""
    fill = Filler(inputs, model_dir).check(Source("the decode step's feeds", check_arrays(arrays), arrays=arrays), None)
    return dict(arrays) if fill is None else fill.complete(arrays)


def step_feeds(session, decode: DecodePlan, inputs: list[InputSpec], model_dir: Path | None) -> dict[str, np.ndarray]:
    """The feeds of one decode step of ``session``'s model over a past of ``decode.past`` tokens: its
    own prefill over the first P tokens (empty cache), its present outputs as the past. A
    GraphcalError says why it cannot be made (onnxruntime's failure, a present missing or of
    another length)."""
    past_names = [s.name for s in inputs if PAST.fullmatch(s.name)]
    present = cache_names(past_names, model_dir)
    outputs = {o.name for o in session.get_outputs()}
    missing = [(name, out) for name, out in present.items() if out not in outputs]
    if missing:
        raise GraphcalError(f"the model has no output {missing[0][1]!r} to take its past input {missing[0][0]!r} "
                            "from")
    p = decode.past
    prefill = complete({decode.token_name: decode.tokens[:, :p]}, inputs, model_dir)
    wanted = list(present.values())
    try:
        values = session.run(wanted, prefill)
    except Exception as e:  # noqa: BLE001 -- onnxruntime raises its own types from a kernel
        raise GraphcalError(f"onnxruntime failed on the prefill of {p} tokens before the step: "
                            f"{first_line(e).removeprefix('Error in execution: ')}") from None
    past = {}
    for (name, out), value in zip(present.items(), values):
        if value.ndim != 4 or value.shape[2] != p:
            raise GraphcalError(f"{out} has shape {tuple(value.shape)} after a prefill of {p} tokens from an empty "
                                f"cache, not [1, heads, {p}, head_size]")
        past[name] = value
    return complete({decode.token_name: decode.tokens[:, p:p + 1], **past}, inputs, model_dir)
