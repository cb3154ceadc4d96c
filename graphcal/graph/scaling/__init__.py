"""SmoothQuant in an ONNX graph: which tensors can be smoothed exactly, and the edits that do it.

Smoothing divides each input channel j of a MatMul's activation by ``s_j`` and multiplies the
matching weight rows (torch's columns) by ``s_j``: the product is unchanged. The division must
come from somewhere. It is *folded* (no node added) into the op that produces the activation
when that op scales each channel by constants: a norm's scale and bias (LayerNormalization,
RMSNormalization, SimplifiedLayerNormalization, the Skip* forms, or the decomposed ``Mul(gamma)``
[``Add(beta)``] exporters write), a ``Mul`` by a constant (GELU's final ``* 0.5``), or a linear
layer's output rows and bias (``up_proj`` before ``down_proj``, also through the elementwise
``Mul`` of a gated MLP). A fold is exact only if nothing but the balance MatMuls reads the
activation (shape-only readers aside): a post-LN encoder's LayerNorm output is also the residual,
so it has no fold; there an explicit ``Mul(x, 1/s)`` in front of the MatMuls is exact instead,
at the cost of one elementwise Mul per smoothed tensor at inference.

This module only reads graphs and writes the edits it is told to; the statistics and scales are
:mod:`graphcal.calibration.transforms.smoothquant`'s. Mappings are found by structure (every activation read by weight
MatMuls, its producer classified) or resolved from llm-compressor's ``[[balance regexes], smooth
regex]`` mappings by module name and then checked against the same structure.

The package, by job: ``records`` (what a fold divides, a candidate activation, a mapping, a
resolution), ``find`` (each activation's producer classified, and the mappings resolved, by
structure or by name), ``edits`` (the folds and explicit Muls written into a model).
"""

from graphcal.graph.scaling.edits import divide_params, explicit_mul, replace_weight, tap_nodes
from graphcal.graph.scaling.find import candidates, node_module, only_single_reader, resolve
from graphcal.graph.scaling.records import SCOPE_OF_KIND, SCOPES, TAP_PREFIX, Candidate, Mapping, Param, Resolution

__all__ = ["SCOPES", "SCOPE_OF_KIND", "TAP_PREFIX", "Candidate", "Mapping", "Param", "Resolution", "candidates",
           "divide_params", "explicit_mul", "node_module", "only_single_reader", "replace_weight", "resolve", "tap_nodes"]
