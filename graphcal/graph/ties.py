"""Tied weights: an embedding table that is also a MatMul's weight (a tied lm_head).

A tied LLM's lm_head computes ``x @ E^T`` with its embedding table ``E`` ``[vocab, hidden]``: torch's
``[out, in]`` weight of lm_head *is* the table. onnxruntime-genai's builder keeps one initializer
(lm_head's ``[hidden, vocab]``, read by the Gather through a Transpose); torch's exporter folds
the transpose into a second copy. :func:`find_ties` finds both: the same initializer reached
through transposes only, or two initializers holding the same values. No weight is read for the
first; the second compares the two tensors once, and only where shapes and types already agree.
"""

from __future__ import annotations

import numpy as np
import onnx

from graphcal.graph.index import GraphIndex
from graphcal.graph.weight_path import weight_as_consumed
from graphcal.types import Target

__all__ = ["find_ties"]

_SHAPE_ONLY = frozenset({"Transpose", "Identity"})  # path ops that keep the values as they are


def find_ties(model: onnx.ModelProto, lookups: list[Target], targets: list[Target],
              base_dir: str | None = None, *, compare_values: bool = True) -> dict[str, str]:
    """Lookup name -> the name of the MatMul/Gemm target whose torch ``[out, in]`` weight equals the
    lookup's table ``[vocab, hidden]`` (the first such target, in graph order). Without
    ``compare_values`` only one initializer read by both is a tie (nothing is read)."""
    index = GraphIndex(model.graph)
    inits = index.initializers
    nodes = {n.name: n for n in model.graph.node if n.name}
    ties: dict[str, str] = {}
    for lookup in lookups:
        for t in targets:
            if (t.out_features, t.in_features) != (lookup.out_features, lookup.in_features):
                continue
            if _same_values(lookup, t, inits, nodes, base_dir, compare_values):
                ties[lookup.name] = t.name
                break
    return ties


def _same_values(lookup: Target, t: Target, inits, nodes, base_dir: str | None, compare_values: bool) -> bool:
    a, b = inits[lookup.weight], inits[t.weight]
    if a.data_type != b.data_type:
        return False
    paths = [[nodes[n] for n in x.weight_path] for x in (lookup, t)]
    square = lookup.out_features == lookup.in_features
    if lookup.weight == t.weight and all(n.op_type in _SHAPE_ONLY for p in paths for n in p) and not square:
        return True  # one tensor, only transposed on the way: the shapes say which way round
    if not compare_values:
        return False
    table = weight_as_consumed(a, paths[0], inits, base_dir)
    weight = weight_as_consumed(b, paths[1], inits, base_dir)
    weight = weight.T if t.layout == "in_out" else weight
    return table.shape == weight.shape and bool(np.array_equal(table, weight))
