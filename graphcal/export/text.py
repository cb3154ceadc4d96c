"""graphcal export's calibration text: lines to token rows, bounded before the tokenizer sees them.

``--seq`` is checked against the model's context before anything heavy is loaded
(:func:`check_seq`); a line is cut to what its first ``--seq`` tokens can span (:func:`cut_line`),
or with ``--pack`` tokenized in pieces (:func:`split_line`), so one 32 MB line costs the tokenizer
what the same text in lines does. :func:`tokenize_text` reads the --text file (bounded, regular files
only) and tokenizes its lines. Imports nothing heavy at module level.
"""

from __future__ import annotations

import logging
import os
import re

from graphcal.errors import GraphcalError, UsageError
from graphcal.limits import check_fits, read_regular

log = logging.getLogger("graphcal")

#: --seq's bound when the model's config names no context length: 131,072 tokens, the longest
#: context of common open models (Llama 3.1's 128K). Otherwise the config's own length bounds it
#: (max_position_embeddings or its older names): positions past it are ones the model never learned.
MAX_SEQ = 1 << 17
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
MAX_TEXT_BYTES = 1 << 30  # --text: a calibration text file is read whole
MAX_TOKEN_CHARS = 1024  # a line is cut at --seq x the vocabulary's longest token, counted at most this long


def pack_windows(token_lists: list[list[int]], seq: int, separator: int | None) -> tuple[list[list[int]], int]:
    """Token lists joined into one stream (``separator`` after each list that does not already end
    with it) and cut into full windows of ``seq`` tokens; returns (windows, tokens dropped from
    the last, partial window). A stream shorter than ``seq`` gives no window."""
    stream: list[int] = []
    for ids in token_lists:
        stream.extend(ids)
        if separator is not None and (not ids or ids[-1] != separator):
            stream.append(separator)
    count = len(stream) // seq
    return [stream[i * seq:(i + 1) * seq] for i in range(count)], len(stream) - count * seq


def context_length(config) -> tuple[str, int] | None:
    """(the field, the longest sequence) ``config`` (a transformers config) says the model takes, if it says."""
    for c in (config, getattr(config, "text_config", None)):
        for key in CONTEXT_KEYS:
            value = getattr(c, key, None) if c is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return key, value
    return None


def check_seq(seq: int, config, *, context: tuple[str, int] | None = None) -> None:
    """Refuse a ``--seq`` past the model's context (its config's max_position_embeddings, or
    ``context`` when given, or :data:`MAX_SEQ` when the config names none): before the model or
    any text is loaded."""
    if seq < 1:
        raise UsageError(f"--seq must be at least 1, got {seq:,}")
    context = context if context is not None else context_length(config)
    if context is not None and seq > context[1]:
        raise UsageError(f"--seq {seq:,} is past the model's context of {context[1]:,} tokens (its config's "
                         f"{context[0]}); calibrate on sequences it can take")
    if context is None and seq > MAX_SEQ:
        raise UsageError(f"--seq {seq:,} is past {MAX_SEQ:,} tokens, the longest context graphcal export accepts "
                         "when the model's config names none (max_position_embeddings)")


def line_budget(tokenizer, seq: int) -> int:
    """Characters ``seq`` tokens can span: ``seq`` x the vocabulary's longest token (at most
    :data:`MAX_TOKEN_CHARS`), plus one more token's worth."""
    try:
        longest = max(map(len, tokenizer.get_vocab()), default=1)
    except (AttributeError, NotImplementedError, TypeError):
        longest = MAX_TOKEN_CHARS
    return (seq + 1) * max(1, min(longest, MAX_TOKEN_CHARS))


_SPACE = re.compile(r"\s")
_WORD_START = re.compile(r"\s(?=\S)")  # the space before a word, which tokenizers read with the word
TOKEN_BYTES = 120  # host memory per padded position while the tokenizer builds its rows (Python lists, ~3 fields)


def cut_line(line: str, budget: int) -> str:
    """``line`` cut to what its first tokens need (``budget`` characters, :func:`line_budget`), at
    the next whitespace when one is within ``budget`` more characters (a word is not cut in two),
    so a 32 MB line costs the tokenizer what its first --seq tokens do."""
    if len(line) <= budget:
        return line
    space = _SPACE.search(line, budget, 2 * budget)
    return line[:space.start() if space is not None else budget]


def split_line(line: str, budget: int) -> list[str]:
    """``line`` in pieces of about ``budget`` characters, each but the first starting at a
    whitespace that is followed by a non-space (a word keeps the space before it, as tokenizers
    read it); where there is no such place within ``2 * budget`` characters the piece is cut there."""
    pieces, start = [], 0
    while len(line) - start > budget:
        cut = start + budget
        found = _WORD_START.search(line, cut, cut + budget + 1)  # one past: the lookahead's character
        end = found.start() if found is not None else cut + budget
        pieces.append(line[start:end])
        start = end
    if start < len(line):
        pieces.append(line[start:])
    return pieces


def _line_specials(tokenizer) -> tuple[list[int], list[int]] | None:
    """The special tokens the tokenizer puts before and after a line's own (e.g. [bos], []), found
    by tokenizing a probe with and without them; None when they cannot be told apart."""
    probe = "graphcal probe"
    full = list(tokenizer(probe)["input_ids"])
    core = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    for i in range(len(full) - len(core) + 1):
        if core and full[i:i + len(core)] == core:
            return full[:i], full[i + len(core):]
    return None


def _packed_ids(tokenizer, lines: list[str], budget: int) -> list[list[int]]:
    """Every line's token ids, as ``tokenizer(lines)`` gives them, with a line longer than
    ``budget`` characters tokenized in pieces (:func:`split_line`) between its special tokens, so
    one long line costs the tokenizer no more than as many short ones."""
    long = [i for i, line in enumerate(lines) if len(line) > budget]
    specials = _line_specials(tokenizer) if long else None
    if specials is None:
        return list(tokenizer(lines)["input_ids"])
    ids = list(tokenizer([line if len(line) <= budget else "" for line in lines])["input_ids"])
    before, after = specials
    for i in long:
        joined = list(before)
        for piece in split_line(lines[i], budget):
            joined.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
        ids[i] = joined + list(after)
    return ids


def tokenize_lines(tokenizer, lines: list[str], names: list[str], seq: int, *, pack: bool = False,
                   num_samples: int | None = None, source: str = "the text") -> dict:
    """The model inputs ``names`` for ``lines`` as int64 arrays [samples, seq]: one row per line,
    padded or truncated to ``seq`` (pad: the tokenizer's, else its EOS or UNK), or with ``pack``
    full windows of the joined lines (:func:`pack_windows`, at most ``num_samples``).

    What one line costs is bounded before the tokenizer sees it: without ``pack`` a line is cut to
    the characters its first ``seq`` tokens can span (:func:`cut_line`); with ``pack`` a long line
    is tokenized in pieces (:func:`split_line`)."""
    import numpy as np  # lazy: kept off the CLI's start-up path

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    budget = line_budget(tokenizer, seq)
    if pack:
        windows, _ = pack_windows(_packed_ids(tokenizer, lines, max(budget, 1 << 16)), seq, tokenizer.eos_token_id)
        if not windows:
            raise GraphcalError(f"--pack: {source} holds fewer than --seq {seq} tokens; lower --seq or add text")
        ids = np.asarray(windows[:num_samples], dtype=np.int64)
        encoded = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    else:
        check_fits(len(lines) * seq * TOKEN_BYTES, f"tokenizing {len(lines):,} lines to --seq {seq:,} tokens",
                   hint="lower --seq or --num-samples")
        encoded = tokenizer([cut_line(line, budget) for line in lines], padding="max_length", truncation=True,
                            max_length=seq, return_tensors="np")
    arrays = {n: np.asarray(encoded[n], dtype=np.int64) for n in names if n in encoded}
    missing = [n for n in names if n not in arrays]
    if missing:
        raise GraphcalError(f"the tokenizer gives no {', '.join(missing)} for the model's inputs")
    return arrays


def tokenize_text(tokenizer, text: str | os.PathLike, names: list[str], seq: int, num_samples: int | None,
                  pack: bool) -> dict:
    """``text``'s non-empty lines tokenized into the int64 arrays ``names`` (:func:`tokenize_lines`);
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
