"""graphcal eval: how far a quantized model is from its fp32 original, output by output and layer by layer.

Both models run over the same data, one batch at a time, and every weight MatMul/Gemm output of
the fp32 model is compared in both (graphcal's writer keeps those nodes and their output names).
On onnxruntime the two models run as one graph that reduces each pair to float64 sums itself
(graph.compare), so no activation leaves it; otherwise the tensors are fetched and compared
here. Statistics stream in float64 (sums of squares, products and the max error), so memory
stays flat whatever the data size. Models with fp4 / e8m0 types, which onnxruntime 1.31 cannot run,
go through onnx.reference.

The package, by job:

- ``pipeline``: :func:`evaluate`, which only sequences the steps below, each returning a frozen record;
- ``options``: :class:`EvalOptions`, what one eval is asked to do (the CLI builds it);
- ``models``: the reference, the quantized model and the fallback, each loaded (and the reference
  rotated, ``rotated``) once per eval;
- ``compare``: the comparison runs (paired in one graph, apart, or isolated);
- ``agreement``: :class:`Agreement`, the streaming statistics of one compared tensor;
- ``switched``: the one switchable session (graph.switch) that sensitivity and mixing share;
- ``sensitivity``: ``--sensitivity``, the quantized model with some layers back in float;
- ``mixing``: ``--size-budget`` / ``--target-db``, the fallback's form for some layers;
- ``report``: :class:`EvalReport`, what was found and the advice (flags, JSON);
- ``formats``: the text and HTML reports;
- ``candidate``: what eval reads of the models besides their outputs (written ignores, SmoothQuant record);
- ``kinds``: kinds of layer and their --ignore patterns.

This module re-exports the names the CLI and tools import.
"""

from graphcal.evaluation.agreement import Agreement
from graphcal.evaluation.candidate import smoothable_layers
from graphcal.evaluation.formats import format_html, format_text
from graphcal.evaluation.kinds import kind_pattern
from graphcal.evaluation.options import LEVELS, EvalOptions
from graphcal.evaluation.pipeline import evaluate
from graphcal.evaluation.report import EvalReport

__all__ = ["LEVELS", "Agreement", "EvalOptions", "EvalReport", "evaluate", "format_html", "format_text",
           "kind_pattern", "smoothable_layers"]
