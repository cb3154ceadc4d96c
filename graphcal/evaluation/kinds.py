"""Kinds of layer: a module name after its block index, and the --ignore pattern for a kind in every block."""

from __future__ import annotations

import re


def layer_kind(name: str) -> str:
    """A layer's kind: its module name after the block index ("mlp.down_proj" of
    "model.layers.3.mlp.down_proj"), or the whole name when it has no index."""
    match = re.search(r"\.\d+\.(.+)$", name)
    return match.group(1) if match else name


def kind_pattern(kind: str) -> str:
    """The ``re:`` target pattern for one kind of layer in every block: ``re:.*\\.mlp\\.down_proj$``."""
    return "re:.*" + re.escape("." + kind) + "$"
