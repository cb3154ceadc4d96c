"""RunPlan: what a run will do to one model, as :func:`graphcal.calibration.plan.plan` decided it;
Loaded: the model it decided on, beside it (never in it).

Records only (the stages and the transform units read them); plan.py makes them.
"""

from __future__ import annotations

import os
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


@dataclass(frozen=True)
class Loaded:
    """The model read (checked: graphcal.graph.io) and rewritten by the transforms that change weights,
    before the plan: the model, its external data files, and each rewrite's record by settings type.

    The run's working model: the pipeline owns it and passes it to each stage that reads it (the
    plan holds only decisions); the stages before the weight pass read it and build their own
    copies, and the weight pass edits it in place into the output (a big model is never copied)."""

    model: onnx.ModelProto
    data_files: tuple[str, ...]
    records: Mapping[type, object]
    # the run's own data file the rewrites wrote the weights they changed into (calibration.own_data.OwnData:
    # the model refers to it), None without a rewrite; removed by :meth:`close`
    own: object | None = None

    def close(self) -> None:
        """Remove the run's own data file (the model's rewritten weights cannot be read after this)."""
        if self.own is not None:
            self.own.close()

    @cached_property
    def types(self) -> Mapping[str, onnx.TypeProto.Tensor]:
        """Element types and shapes of graph values (shape inference, once, on first use: before the
        weight pass edits the model; only run needs them)."""
        return MappingProxyType(value_types(self.model))


@dataclass(frozen=True)
class RunPlan:
    """What a run does to one model (frozen: later stages read it and never change it).

    Decisions only: the model is not here. The pipeline owns it (:class:`Loaded`,
    which prepare() returns beside the plan) and hands it to each stage that reads it.
    """

    model_path: Path
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
    # the activation pass (calibration.streamed.choose_pass): the layer blocks it streams (0: the whole graph at once)
    streamed_blocks: int = 0
    pass_note: str = "whole-graph"  # which pass, and why, for the log and the summary

    def decision(self, settings_type: type):
        """The decision of the transform whose settings are of ``settings_type`` (None: not asked for)."""
        return self.decisions.get(settings_type)

    @property
    def base_dir(self) -> str:
        """The folder weights left on disk are read from: the model's (its data files', or the model
        file's own, where an inline model's weights stay in it: graph.io.load_model_info)."""
        return str(self.model_path.parent)

    @property
    def data_bytes(self) -> int:
        """Bytes of the external data files the model reads, on disk now (0: every weight inline)."""
        return sum(os.path.getsize(os.path.join(self.base_dir, name)) for name in self.data_files)

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
