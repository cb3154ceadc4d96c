"""Inputs the data lacks, filled as a prefill from an empty KV cache has them.

A decoder exported with a KV cache (onnxruntime-genai's model builder, Optimum's
text-generation-with-past) takes, beside ``input_ids`` [batch, sequence], a past tensor per layer
for keys and one for values, ``past_key_values.N.key`` / ``.value`` [batch, kv_heads,
past_sequence, head_size], an ``attention_mask`` [batch, past_sequence + sequence] and (Optimum)
``position_ids`` [batch, sequence]. Token data is enough to calibrate it: for a model that takes
past tensors, :meth:`Filler.check` decides from the model's inputs and the data's headers what
it fills for the inputs the data lacks, and :meth:`Fill.complete` makes them for each batch:

- past tensors of length 0 in the model's dtype, their head count and head size the model's
  fixed dims or, where the model leaves them symbolic (the builder's ``kv_cache_dim``), the
  ``model.decoder.num_key_value_heads`` / ``head_size`` of the ``genai_config.json`` in the
  model's folder (read bounded: :func:`read_genai_config`);
- an ``attention_mask`` of ones [batch, past + sequence] (past is 0 when filled);
- ``position_ids``: ``past + arange(sequence)`` on every row or, where the data holds an
  ``attention_mask``, the mask's cumulative sum minus 1 with 0 at padding, its last ``sequence``
  columns (transformers 5.23's ``GenerationMixin._prepare_position_ids_for_generation``).

The batch dimension of each filled tensor is its batch's ``input_ids``'. Data that holds every
input is checked and used as it is; past tensors the data holds are used as given. An input that
cannot be filled is refused by name, in one line, before anything runs. What was filled is said
in one line (:attr:`Fill.describe`), which the verbs show among their warnings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphcal.config.untrusted import MAX_JSON_BYTES, load_json
from graphcal.data.inputs import InputSpec, format_shape, validate
from graphcal.data.padding import MASK_INPUT
from graphcal.data.source import Source
from graphcal.errors import GraphcalError, first_line, shown
from graphcal.limits import inside_folder, read_regular

PAST = re.compile(r"past_key_values\.\d+\.(key|value)")  # the builder's and Optimum's names
TOKEN_INPUTS = ("input_ids", "inputs_embeds")  # the input whose axes 0 and 1 give the batch and the sequence
POSITIONS = "position_ids"
GENAI_CONFIG = "genai_config.json"
MAX_GENAI_BYTES = MAX_JSON_BYTES  # 1 MB; the builder writes about 1.5 kB
MAX_DIM = 1 << 20  # a head count or head size past this is not a model's
GENAI_KEYS = {1: ("num_key_value_heads", "head count"), 3: ("head_size", "head size")}  # past axis -> config key
_UNREAD = object()


def read_genai_config(folder: Path) -> dict | None:
    """``folder/genai_config.json`` as a dict (None when there is none), read as a stranger's file:
    a regular file inside ``folder`` only (a symlink that leads out of it, a FIFO or a device is
    refused), at most 1 MB, nested at most 32 deep, no key twice in one object. Every refusal is
    one GraphcalError line."""
    raw = read_genai_config_bytes(folder)
    return None if raw is None else parse_genai_config(raw, folder / GENAI_CONFIG)


def read_genai_config_bytes(folder: Path) -> bytes | None:
    """The bytes of ``folder/genai_config.json`` (None when there is none), with :func:`read_genai_config`'s
    file checks: inside ``folder``, a regular file, at most 1 MB."""
    real = inside_folder(folder, GENAI_CONFIG, f"reads a {GENAI_CONFIG} only inside it")
    return None if real is None else read_regular(real, GENAI_CONFIG, MAX_GENAI_BYTES)  # regular, bounded first


def parse_genai_config(raw: bytes, path: Path) -> dict:
    """A genai_config.json's bytes as a dict, with :func:`read_genai_config`'s JSON checks (``path`` for messages)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GraphcalError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from e
    try:
        config = load_json(text, str(path), error=GraphcalError, needs=f"a {GENAI_CONFIG} nests 4")
    except ValueError as e:  # json's own errors (JSONDecodeError; an integer too long to read)
        raise GraphcalError(f"{path} is not valid JSON ({first_line(e)})") from e
    if not isinstance(config, dict):
        raise GraphcalError(f"{path} is not a JSON object")
    return config


def genai_section(config, *keys: str) -> dict:
    """``config[keys[0]][keys[1]]...`` of a parsed genai_config.json, each a JSON object; ``{}`` where
    one is missing or is not an object (e.g. ``genai_section(config, "model", "decoder")``)."""
    for key in keys:
        config = config.get(key) if isinstance(config, dict) else None
    return config if isinstance(config, dict) else {}


def genai_context(config) -> tuple[str, int] | None:
    """(the field, the longest sequence) of a parsed genai_config.json: its ``model.context_length``,
    if it gives one."""
    value = genai_section(config, "model").get("context_length")
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return "model.context_length", value
    return None


@dataclass(frozen=True)
class Past:
    """A past tensor to fill: [batch, heads, 0, size]."""

    name: str
    dtype: np.dtype
    heads: int
    size: int


@dataclass(frozen=True)
class Fill:
    """What is filled for one source of data (a file, a mapping, a reader's batch)."""

    token: str  # the data's input that sizes the filled ones (axis 0: batch, axis 1: sequence)
    order: tuple[str, ...]  # every model input, in the model's order
    past: tuple[Past, ...]  # filled past tensors (empty when the data holds them)
    past_length: int  # 0 when filled, else the length of the past the data holds
    mask: InputSpec | None  # a filled attention_mask
    positions: InputSpec | None  # filled position_ids
    mask_in_data: bool = False  # the data holds the attention_mask (filled position_ids follow it)
    from_config: tuple[str, ...] = ()  # the genai_config.json keys the past tensors' dims came from

    @property
    def names(self) -> frozenset[str]:
        return frozenset([p.name for p in self.past] + [s.name for s in (self.mask, self.positions) if s is not None])

    def complete(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``batch`` (the data's arrays) with the filled inputs added, in the model's input order."""
        tokens = batch[self.token]
        rows, seq = int(tokens.shape[0]), int(tokens.shape[1])
        total = self.past_length + seq
        filled = {p.name: np.zeros((rows, p.heads, 0, p.size), p.dtype) for p in self.past}
        if self.mask is not None:
            filled[self.mask.name] = np.ones((rows, total), self.mask.dtype)
        if self.positions is not None:
            if self.mask_in_data:  # transformers: cumsum(mask) - 1, 0 where the mask is 0
                kept = np.asarray(batch[MASK_INPUT]) != 0
                positions = np.where(kept, np.cumsum(kept, axis=1, dtype=np.int64) - 1, 0)[:, total - seq:]
            else:
                positions = np.broadcast_to(np.arange(self.past_length, total, dtype=np.int64), (rows, seq))
            filled[self.positions.name] = np.ascontiguousarray(positions, dtype=self.positions.dtype)
        return {name: batch[name] if name in batch else filled[name] for name in self.order}

    def describe(self) -> str:
        """What is filled, in one line."""
        parts = []
        if self.past:
            dims = {(p.heads, p.size) for p in self.past}
            shape = (f"{next(iter(dims))[0]} heads x {next(iter(dims))[1]}" if len(dims) == 1
                     else "heads x head size as each layer's input says")
            where = f"; {', '.join(self.from_config)} from {GENAI_CONFIG}" if self.from_config else ""
            parts.append(f"{len(self.past)} past tensors (past_key_values.*.key/value, length 0, {shape}{where})")
        if self.mask is not None:
            parts.append(f"{self.mask.name} (ones)")
        if self.positions is not None:
            parts.append(f"{self.positions.name} (" + ("from the attention_mask: cumsum - 1, 0 at padding" if self.mask_in_data
                                                       else f"{self.past_length}, {self.past_length + 1}, ... per row")
                         + ")")
        head = "filled for an empty KV cache" if self.past else "filled the inputs the data lacks"
        return f"{head}: {', '.join(parts)}"


class Filler:
    """Decides, per source of data, what to fill for a model with ``inputs`` whose folder is
    ``model_dir`` (where a genai_config.json may give symbolic past dims; None: no folder)."""

    def __init__(self, inputs: list[InputSpec], model_dir: Path | None = None):
        self.inputs = inputs
        self.model_dir = model_dir
        self._pasts = [s for s in inputs if PAST.fullmatch(s.name)]
        self._genai = _UNREAD  # read when a symbolic past dim first needs it

    def check(self, source: Source, fixed_batch: int | None) -> Fill | None:
        """Check ``source`` against the model's inputs (graphcal.data.inputs.validate), the ones it
        lacks filled where a prefill from an empty cache has them. Returns the Fill, or None when
        nothing is filled (the source holds every input, or the model takes no past tensor: then
        it is checked exactly as validate checks it). Raises GraphcalError, naming the input, for
        one that cannot be filled."""
        lacking = [s for s in self.inputs if s.name not in source.headers]
        if not lacking or not self._pasts:
            validate(source, self.inputs, fixed_batch)
            return None
        specs = {s.name: s for s in self.inputs}
        token = next((specs[n] for n in TOKEN_INPUTS if n in specs), None)
        given = [s for s in self._pasts if s.name in source.headers]
        past, keys, problems = [], set(), []
        for spec in lacking:
            why = self._why_not(spec, token, given)
            if why is None and PAST.fullmatch(spec.name):
                found = self._past(spec)
                if isinstance(found, str):
                    why = found
                else:
                    past.append(found[0])
                    keys.update(found[1])
            if why is not None:
                problems.append((spec.name, why))
        if problems:
            name, why = problems[0]
            others = [n for n, _ in problems[1:]]
            also = ""
            if others:
                shown_names = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
                also = f" (nor {shown_names})"
            raise GraphcalError(f"{source.label}: cannot fill model input {name!r}{also} for a prefill from an empty "
                                f"KV cache: {why}")
        validate(source, [s for s in self.inputs if s.name in source.headers], fixed_batch)
        past_length = 0
        if given:
            shape = source.headers[given[0].name][0]
            if len(shape) != 4:
                raise GraphcalError(f"{source.label}: past tensor {given[0].name!r} has shape {tuple(shape)}, not "
                                    "[batch, heads, past_sequence, head_size]: its past length is unknown")
            past_length = int(shape[2])
        seq = int(source.headers[token.name][0][1])
        if MASK_INPUT in source.headers:
            columns = source.headers[MASK_INPUT][0][1] if len(source.headers[MASK_INPUT][0]) == 2 else None
            if columns != past_length + seq:
                cache = "an empty KV cache" if not given else f"a past of {past_length}"
                raise GraphcalError(f"{source.label}: {MASK_INPUT} has shape {tuple(source.headers[MASK_INPUT][0])} "
                                    f"and {token.name} {seq} positions; with {cache} the mask covers "
                                    f"{past_length + seq} (past + sequence)")
        filled = {s.name for s in lacking}
        return Fill(token.name, tuple(s.name for s in self.inputs), tuple(past), past_length,
                    specs[MASK_INPUT] if MASK_INPUT in filled else None,
                    specs[POSITIONS] if POSITIONS in filled else None, MASK_INPUT in source.headers,
                    tuple(k for k in ("model.decoder.num_key_value_heads", "model.decoder.head_size") if k in keys))

    def _why_not(self, spec: InputSpec, token: InputSpec | None, given: list[InputSpec]) -> str | None:
        """Why ``spec``, which the data lacks, cannot be filled (None: it can, as far as its name tells)."""
        if token is None:
            return "the model takes no input_ids (nor inputs_embeds) to size it by"
        if spec is token:
            return "graphcal fills the other inputs from it, so the data must hold it"
        if len(token.shape) < 2:
            return f"the model's {token.name} is {format_shape(token.shape)}, not [batch, sequence]"
        if PAST.fullmatch(spec.name):
            if given:
                return (f"the data holds the past tensor {given[0].name!r} but not this one; give every past tensor "
                        "or none (none: an empty cache is filled)")
            return None
        if spec.name in (MASK_INPUT, POSITIONS):
            if len(spec.shape) != 2:
                return f"its shape {format_shape(spec.shape)} is not [batch, sequence]"
            if spec.dtype.kind not in "iubf":
                return f"it is {spec.dtype}, not a number"
            return None
        return (f"graphcal fills only past_key_values.N.key/value, {MASK_INPUT} and {POSITIONS}; give it in the "
                f"data")

    def _past(self, spec: InputSpec) -> tuple[Past, set[str]] | str:
        """The past tensor to fill for ``spec`` and the config keys its dims came from, or why not."""
        shape = spec.shape
        if len(shape) != 4:
            return f"its shape {format_shape(shape)} is not [batch, heads, past_sequence, head_size]"
        if isinstance(shape[2], int) and shape[2] > 0:
            return (f"its past-sequence axis (2) is fixed at {shape[2]} (a static cache); graphcal fills only an "
                    "empty cache, of length 0")
        dims, keys = [], set()
        for axis, (key, what) in GENAI_KEYS.items():
            if isinstance(shape[axis], int) and shape[axis] > 0:
                dims.append(shape[axis])
                continue
            value, missing = self._genai_value(key)
            if value is None:
                label = f"{shape[axis]!r}" if shape[axis] else "unnamed"
                return (f"its {what} (axis {axis}, {label}) is symbolic and {missing}; give the past tensors in the "
                        "data")
            dims.append(value)
            keys.add(f"model.decoder.{key}")
        return Past(spec.name, spec.dtype, dims[0], dims[1]), keys

    def _genai_value(self, key: str) -> tuple[int | None, str]:
        """``model.decoder.<key>`` of the model folder's genai_config.json (None and why when it has none)."""
        if self.model_dir is None:
            return None, f"no model folder is known to read a {GENAI_CONFIG} from"
        if self._genai is _UNREAD:
            self._genai = read_genai_config(self.model_dir)
        path = self.model_dir / GENAI_CONFIG
        if self._genai is None:
            return None, f"there is no {GENAI_CONFIG} in {self.model_dir} to give it (model.decoder.{key})"
        value = genai_section(self._genai, "model", "decoder").get(key)
        if value is None:
            return None, f"{path} gives no model.decoder.{key}"
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_DIM:
            raise GraphcalError(f"{path}: model.decoder.{key} is {shown(repr(value))}, not a whole number from 1 to "
                                f"{MAX_DIM:,}")
        return value, ""


def describe(fills) -> list[str]:
    """What was filled across sources (Fills, None where nothing was), as one line in a list
    (empty when nothing was filled): the verbs show it among their warnings."""
    lines = list(dict.fromkeys(f.describe() for f in fills if f is not None))
    return ["; ".join(lines)] if lines else []
