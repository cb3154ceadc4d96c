"""The graph's index with what channel scaling and rotation also ask of it: the values of constants
(external ones read under the model's folder) and the types of values (shape inference, on first use)."""

from __future__ import annotations

from functools import cached_property

import numpy as np
import onnx
from onnx import numpy_helper

from graphcal.graph.index import GraphIndex
from graphcal.graph.io import value_types
from graphcal.graph.weight_path import weight_as_consumed


class ValueIndex(GraphIndex):
    """The graph's index (:class:`graphcal.graph.index.GraphIndex`), and what smoothing also asks
    of it: the values of constants (external ones read under ``base_dir``) and the types of values."""

    def __init__(self, model: onnx.ModelProto, base_dir: str | None = None):
        super().__init__(model.graph)
        self.base_dir = base_dir
        self._model = model

    @cached_property
    def types(self) -> dict:
        """Element types and shapes of the graph's values (shape inference, on first use only)."""
        return value_types(self._model)

    def const(self, name: str, max_elements: int | None = None) -> np.ndarray | None:
        """A constant's value (an initializer, maybe behind Identity, or a Constant node); None otherwise,
        and None for one of more than ``max_elements`` elements (then nothing is read)."""
        seen = 0
        while name not in self.initializers:
            node = self.producer_node(name)
            if node is None or seen > 16:
                return None
            if node.op_type == "Identity":
                name, seen = node.input[0], seen + 1
                continue
            if node.op_type == "Constant":
                for a in node.attribute:
                    if a.name == "value" and (max_elements is None or np.prod(a.t.dims) <= max_elements):
                        return numpy_helper.to_array(a.t)
            return None
        init = self.initializers[name]
        if max_elements is not None and np.prod(init.dims) > max_elements:
            return None
        return weight_as_consumed(init, [], self.initializers, self.base_dir)
