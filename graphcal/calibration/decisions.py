"""RunPlan: what a run will do to one model, as :func:`graphcal.calibration.plan.plan` decided it.

A record only (the stages and the transform units read it); plan.py makes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import MappingProxyType

import onnx

from graphcal.config import RunConfig
from graphcal.graph.io import value_types
from graphcal.graph.qdq import TargetRuntime
from graphcal.graph.targets import Skipped
from graphcal.output.companions import Companions
from graphcal.types import FusedGroup, KVState, QuantizedTarget, Target


class Held:
    """The loaded model, until the pipeline takes it over for the output."""

    def __init__(self, model: onnx.ModelProto):
        self.model: onnx.ModelProto | None = model


@dataclass(frozen=True)
class RunPlan:
    """What a run does to one model (frozen: later stages read it and never change it).

    :attr:`model` is the model as loaded (external weights stay on disk and are read once, when
    needed), for reading; stages that edit a graph work on their own copies, and the pipeline
    takes it over for the output (:meth:`take_model`), after which the plan has none.
    """

    model_path: Path
    held: Held
    data_files: tuple[str, ...]  # external data files the model reads (empty: every weight inline)
    config: RunConfig
    target_runtime: TargetRuntime
    found: tuple[Target, ...]  # every weight MatMul/Gemm, in graph order
    not_targets: tuple[Skipped, ...]  # MatMul/Gemm nodes that take no weight
    chosen: tuple[Target, ...]  # the ones to quantize
    unmatched: tuple[str, ...]  # target/ignore patterns that match nothing (the default ignore left out)
    schemes: Mapping[str, object]  # target name -> compressed-tensors QuantizationScheme
    groups: tuple[FusedGroup, ...]
    fusion_warnings: tuple[str, ...]
    kv_states: tuple[KVState, ...]
    model_opset: int
    opset: int  # what the schemes (and kv states) need
    size: Mapping[str, int]  # terms of the expected size (graphcal.calibration.sizing)
    warnings: tuple[str, ...]
    matmulnbits: int | None = None  # accuracy level of com.microsoft.MatMulNBits written for int weights
    forms: tuple[str, ...] = ()  # what onnxruntime runs for the targets (--target onnxruntime)
    unchecked: frozenset[str] = frozenset()  # default-domain ops onnx has no schema for (graph.io.unchecked_ops)
    companions: Companions = Companions()  # the input folder's files -o receives too (output.companions)
    lookups: tuple[Target, ...] = ()  # embedding lookups to quantize (graph.targets.find_lookups; weight-only)
    found_lookups: tuple[Target, ...] = ()  # every embedding lookup, in graph order
    ties: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # lookup -> the chosen lm_head whose stored weight it reads
    # each transform unit's decision, keyed by its settings type (graphcal.calibration.transforms): what it
    # will do (a unit that rewrote the model before the plan: what it did; the model is the rewritten one)
    decisions: Mapping[type, object] = field(default_factory=lambda: MappingProxyType({}))
    pass_hessians: bool = False  # the activation pass takes each chosen layer's input Hessian (a unit's rounding uses it)

    def decision(self, settings_type: type):
        """The decision of the transform whose settings are of ``settings_type`` (None: not asked for)."""
        return self.decisions.get(settings_type)

    @property
    def model(self) -> onnx.ModelProto:
        """The model as loaded, to read (the pipeline edits it only after :meth:`take_model`)."""
        if self.held.model is None:
            raise RuntimeError("the plan's model was taken over for the output; read the written model instead")
        return self.held.model

    def take_model(self) -> onnx.ModelProto:
        """Hand the loaded model over to the caller, which edits it into the output (nothing is
        copied: a big model is held once); the plan keeps its types (read first) and no model."""
        model = self.model
        self.held.model = None
        return model

    @cached_property
    def types(self) -> Mapping[str, onnx.TypeProto.Tensor]:
        """Element types and shapes of graph values (shape inference, once; only run needs them)."""
        return MappingProxyType(value_types(self.model))

    @property
    def base_dir(self) -> str:
        """The folder weights left on disk are read from: the model's (its data files', or the model
        file's own, where an inline model's weights stay in it: graph.io.load_model_info)."""
        return str(self.model_path.parent)

    @property
    def ignored(self) -> list[str]:
        return [t.name for t in self.found if t not in self.chosen]

    @property
    def output_opset(self) -> int:
        return max(self.model_opset, self.opset)

    @property
    def input_size(self) -> int:
        return self.size["input"]

    @property
    def expected_size(self) -> int:
        return sum(self.size.values())

    def items(self) -> list[QuantizedTarget]:
        """The chosen targets with their schemes (no qparams yet)."""
        return [QuantizedTarget(t, self.schemes[t.name]) for t in self.chosen]
