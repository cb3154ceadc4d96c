"""Weight paths nothing reads once their targets read the dequantized weight.

A weight behind Transpose/Cast/Reshape/Identity is stored quantized with that path folded in;
the old path, and the float initializer at its start, go unless something else (a tied
embedding's Gather, a graph output) still reads them. The sweep is the graph editor's
(:func:`graphcal.graph.edit.dead_paths`); these are its names on the Q/DQ side.
"""

from __future__ import annotations

from graphcal.graph.edit import dead_paths as dead_weight_paths
from graphcal.graph.edit import drop_dead_paths as drop_dead_weight_paths

__all__ = ["dead_weight_paths", "drop_dead_weight_paths"]
