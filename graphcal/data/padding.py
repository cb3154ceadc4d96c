"""Padding: --exclude-padding reads the ``attention_mask`` input to know which positions are padding."""

from __future__ import annotations

from graphcal.errors import UsageError

MASK_INPUT = "attention_mask"  # positions where it is 0 are padding


def check_padding_input(label: str, input_names) -> None:
    """--exclude-padding needs an attention_mask among the model's inputs (so in the data)."""
    if MASK_INPUT not in input_names:
        raise UsageError(f"--exclude-padding: {label} has no {MASK_INPUT} (the model's inputs: "
                         f"{', '.join(input_names)}); without it no position is known to be padding")

