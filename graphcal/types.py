"""Small frozen records that the stages pass to one another.

The stages meet only here: ``graph.targets`` produces :class:`Target`, ``graph.attention``
:class:`KVState`, ``fusion`` :class:`FusedGroup`, observers turn statistics into
:class:`QParams`, and ``graph.qdq`` / ``metadata`` consume :class:`QuantizedTarget` and
:class:`QuantizedKV`. No stage imports another stage's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

Layout = Literal["in_out", "out_in"]


def enum_value(value) -> str:
    """A compressed-tensors enum field (QuantizationType, QuantizationStrategy, ...) as its plain value."""
    return str(getattr(value, "value", value))


@dataclass(frozen=True)
class Target:
    """One MatMul/Gemm whose B input is a weight.

    ``layout`` is how the tensor reaching the node's B input is laid out: ``"in_out"`` for
    MatMul (and Gemm with transB=0), where torch's ``[out, in]`` weight is its transpose;
    ``"out_in"`` for Gemm with transB=1, where it is torch's weight as is.
    """

    name: str  # torch module name, e.g. "model.layers.0.self_attn.q_proj"
    node: str  # ONNX node name
    op_type: str  # "MatMul" | "Gemm", or "Gather" for an embedding lookup (graph.targets.find_lookups)
    activation: str  # tensor feeding input A
    weight: str  # initializer holding the weight
    weight_path: tuple[str, ...]  # nodes between the initializer and input B (Transpose/Cast/Reshape)
    layout: Layout
    out_features: int
    in_features: int

    @property
    def weight_input(self) -> int:
        """The node input that reads the weight: B (1), or a lookup's data (0)."""
        return 0 if self.op_type == "Gather" else 1


@dataclass(frozen=True)
class NamedMapping:
    """llm-compressor's mapping of one smooth layer to the balance layers reading its output, by
    torch module name or ``re:`` regex: the one shape SmoothQuant's and AWQ's named mappings take
    (their recipes write them in opposite orders; config/modifiers.py reads both into this)."""

    smooth: str
    balance: tuple[str, ...]


@dataclass(frozen=True)
class FusedGroup:
    """Modules that share one global scale (q/k/v, gate/up, ...), found by name.

    The one fused-group type: :func:`graphcal.graph.fusion.find_fused_groups` makes them, and the
    pipeline hands the members' weight observers to
    :func:`graphcal.observers.share_global_scale`.
    """

    parent: str  # torch module holding the members, e.g. "model.layers.0.self_attn"
    members: tuple[str, ...]  # full torch module names, e.g. ("...q_proj", "...k_proj", "...v_proj")


@dataclass
class QParams:
    """Quantization parameters in compressed-tensors' conventions (torch [out, in] layout).

    ``scale`` is the stored compressed-tensors scale: for tensor_group strategies it already
    includes ``global_scale`` (effective multiplier = scale / global_scale).
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    global_scale: torch.Tensor | None = None


@dataclass
class QuantizedTarget:
    """What the writers need for one target: its scheme and the calibrated parameters.

    ``qparams`` is keyed by compressed-tensors base name ("weight", "input", "output");
    dynamic activations have no entry (their scales are computed at run time).
    """

    target: Target
    scheme: "object"  # compressed_tensors.quantization.QuantizationScheme (imported lazily)
    qparams: dict[str, QParams] = field(default_factory=dict)


@dataclass(frozen=True)
class KVState:
    """The key and value states entering one attention module (``[batch, kv_heads, seq, head_dim]``)."""

    name: str  # attention module, e.g. "model.layers.0.self_attn"
    key: str  # tensor names
    value: str
    scores_node: str
    context_node: str


@dataclass
class QuantizedKV:
    """A kv_cache_scheme applied to one attention: its args and the calibrated "k" / "v" qparams."""

    state: KVState
    args: "object"  # compressed_tensors.quantization.QuantizationArgs
    qparams: dict[str, QParams] = field(default_factory=dict)
