"""What `graphcal run` would do to a model, found without calibrating and without writing anything.

`inspect` reports the :class:`graphcal.calibration.plan.RunPlan` that `run` itself calls :func:`graphcal.calibration.plan.plan`
for, from the same options resolved the same way, so the two agree by construction: targets,
selection, scheme groups, fused groups, key/value states, warnings, the opset and the expected
size of the written model (:mod:`graphcal.calibration.sizing`). No weight is read and no observer runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import onnx

from graphcal.calibration.decisions import RunPlan
from graphcal.calibration.plan import load, plan
from graphcal.calibration.transforms import REGISTRY, configured
from graphcal.config import RunConfig
from graphcal.graph.blocks import blocks
from graphcal.graph.targets import matches
from graphcal.types import FusedGroup, KVState, Target, enum_value


@dataclass
class TargetRow:
    """One weight MatMul/Gemm and what `run` would do with it."""

    target: Target
    quantized: bool
    group: str | None  # the scheme group that applies (None when left in float)
    reason: str  # why it is quantized or left in float


@dataclass
class Inspection:
    """Everything `graphcal inspect` reports."""

    model: Path
    scheme: str
    config: RunConfig
    rows: list[TargetRow]
    not_targets: list  # graph.targets.Skipped: MatMul/Gemm nodes that take no weight
    fused_groups: list[FusedGroup]
    fusion_warnings: list[str]
    unmatched: list[str]  # target/ignore patterns that match nothing (the default ignore left out, as run does)
    model_opset: int
    required_opset: int
    output_opset: int
    input_size: int
    expected_size: int
    size_parts: dict[str, int]
    warnings: list[str] = field(default_factory=list)
    kv_states: list[KVState] = field(default_factory=list)
    target_runtime: str = "onnxruntime"
    forms: list[str] = field(default_factory=list)  # what onnxruntime runs for the targets
    blocks: list[str] = field(default_factory=list)  # the layer blocks a transform reads the data by, in order
    lookups: list[TargetRow] = field(default_factory=list)  # every embedding lookup (Gather over a weight)
    ties: dict[str, str] = field(default_factory=dict)  # lookup -> the lm_head whose quantized weight it reads
    # each transform unit's lines and JSON (graphcal.calibration.transforms), in the order they run
    transform_lines: list[str] = field(default_factory=list)
    transform_json: dict[str, object] = field(default_factory=dict)
    memory: dict | None = None  # the run's estimated peak memory (graphcal.calibration.footprint), as JSON
    memory_line: str = ""  # the same, one line
    pass_note: str = ""  # the activation pass run would use (calibration.streamed.choose_pass)

    @property
    def quantized(self) -> list[str]:
        return [r.target.name for r in self.rows if r.quantized]

    @property
    def ignored(self) -> list[str]:
        return [r.target.name for r in self.rows if not r.quantized]


def inspect_model(model: str | Path, config: RunConfig, *, target: str = "onnxruntime") -> Inspection:
    """Describe what `graphcal run` would write for ``model`` with ``config`` (see graphcal.config.resolve).

    Raises GraphcalError where `run` would fail before calibrating (unreadable or hostile model,
    nothing to quantize, a scheme with no ONNX form for ``target``).
    """
    loaded = load(model, config)
    try:
        return from_plan(plan(model, config, target, loaded=loaded), loaded.model)
    finally:
        loaded.close()


def from_plan(run: RunPlan, model: onnx.ModelProto) -> Inspection:
    """The report of one plan, made on ``model`` (the model it was made on, read only: prepare()'s
    ``loaded.model``)."""
    units = configured(run.config)
    settings = dict(units)
    blocks = _blocks(run, model, units)
    return Inspection(
        model=run.model_path, scheme=run.config.scheme_name, config=run.config,
        rows=[_row(t, t in run.chosen, run.config) for t in run.found], not_targets=list(run.not_targets),
        fused_groups=list(run.groups), fusion_warnings=list(run.fusion_warnings), unmatched=list(run.unmatched),
        model_opset=run.model_opset, required_opset=run.opset, output_opset=run.output_opset,
        input_size=run.input_size, expected_size=run.expected_size, size_parts=dict(run.size),
        warnings=[w for w in run.warnings if w not in run.fusion_warnings], kv_states=list(run.kv_states),
        target_runtime=str(run.target_runtime), forms=list(run.forms), blocks=blocks,
        lookups=[_row(t, t in run.lookups, run.config) for t in run.found_lookups],
        ties=dict(run.ties),
        transform_lines=[line for unit, settings in units
                         for line in unit.inspect_lines(run, run.decision(unit.settings_type), settings, blocks)],
        transform_json={unit.key: unit.inspect_json(run, run.decision(unit.settings_type), settings.get(unit), blocks)
                        for unit in REGISTRY.values()},
    )


def _blocks(run: RunPlan, model: onnx.ModelProto, units) -> list[str]:
    """The layer blocks a transform takes the data in (GPTQ's sequential order, AWQ; empty when none does)."""
    if not any(unit.reads_data_per_block(run, d) and (d is None or getattr(d, "mappings", True))
               for unit, _ in units for d in [run.decision(unit.settings_type)]):
        return []

    found = blocks(model, list(run.chosen), run.groups)  # as Blockwise forms them: fused units kept whole
    return [f"{b.name} ({len(b.targets)} layer{'s' if len(b.targets) != 1 else ''})" for b in found]


def _row(t: Target, chosen: bool, config: RunConfig) -> TargetRow:
    if chosen:
        scheme = config.scheme_for(t)
        group = next(name for name, s in config.groups.items() if s is scheme)
        return TargetRow(t, True, group, f"matches target {_first_match(t, config.patterns)!r}")
    hit = _first_match(t, config.ignore)
    if hit is not None:
        return TargetRow(t, False, None, f"matches ignore {hit!r}")
    if t.op_type == "Gather":  # lookups are quantized only when targeted: say how
        return TargetRow(t, False, None, f"matches no target pattern (quantize it with --scheme-for {t.name}=W8A16 or "
                                         "--scheme-for Embedding=W8A16)")
    return TargetRow(t, False, None, "matches no target pattern")


def _first_match(t: Target, patterns: list[str]) -> str | None:
    return next((p for p in patterns if matches(t, p)), None)


# -- reports -----------------------------------------------------------------------------------

def to_dict(report: Inspection) -> dict:
    """The report as plain JSON-ready data."""
    groups = {name: s.model_dump(mode="json", exclude_none=True) for name, s in report.config.groups.items()}
    return {
        "model": str(report.model),
        "scheme": report.scheme,
        "scheme_groups": groups,
        "targets": [
            {
                "module": r.target.name, "op_type": r.target.op_type, "node": r.target.node,
                "weight": r.target.weight, "weight_shape": [r.target.out_features, r.target.in_features],
                "layout": r.target.layout, "status": "quantized" if r.quantized else "ignored",
                "group": r.group, "reason": r.reason,
            }
            for r in report.rows
        ],
        "quantized": report.quantized,
        "ignored": report.ignored,
        "lookups": [
            {"module": r.target.name, "node": r.target.node, "weight": r.target.weight,
             "weight_shape": [r.target.out_features, r.target.in_features],
             "status": "quantized" if r.quantized else "float", "group": r.group, "reason": r.reason,
             "tied_to": report.ties.get(r.target.name)}
            for r in report.lookups
        ],
        "not_targets": [{"node": s.node, "reason": s.reason} for s in report.not_targets],
        "fused_groups": [{"parent": g.parent, "members": list(g.members)} for g in report.fused_groups],
        "fusion_warnings": report.fusion_warnings,
        "kv_states": [{"attention": k.name, "key": k.key, "value": k.value} for k in report.kv_states],
        "runtime": report.target_runtime,
        "unmatched_patterns": report.unmatched,
        "warnings": report.warnings,
        "onnxruntime_kernels": report.forms,
        **report.transform_json,
        "opset": {"model": report.model_opset, "required": report.required_opset, "output": report.output_opset},
        "size": {
            "input_bytes": report.input_size,
            "expected_bytes": report.expected_size,
            "ratio": round(report.expected_size / report.input_size, 4),
            "parts": {k: v for k, v in report.size_parts.items() if k != "input"},
        },
        **({"memory": report.memory} if report.memory is not None else {}),
        **({"pass": report.pass_note} if report.pass_note else {}),
    }


def format_text(report: Inspection) -> str:
    """The report as a plain-text table."""
    lines = [f"model    {report.model} (opset {report.model_opset}, {report.input_size:,} bytes)"]
    for name, s in report.config.groups.items():
        lines.append(f"scheme   {report.scheme} ({name}): {_describe(s)}")
    n, total = len(report.quantized), len(report.rows)
    lines.append(f"targets  {n} of {total} weight MatMul/Gemm quantized, {total - n} left in float"
                 + (f"; {len(report.not_targets)} MatMul/Gemm take no weight" if report.not_targets else ""))
    lines.append("")
    header = ("module", "op", "node", "weight [out, in]", "layout", "status", "group")
    table = [header] + [
        (r.target.name, r.target.op_type, r.target.node, f"[{r.target.out_features}, {r.target.in_features}]",
         r.target.layout, "quantized" if r.quantized else "ignored", r.group or "-")
        for r in report.rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    lines.append("")
    for r in report.lookups:
        tie = f"; reads {report.ties[r.target.name]}'s quantized weight (tied)" if r.target.name in report.ties else ""
        lines.append(f"lookup   {r.target.name} (node {r.target.node}, table [{r.target.out_features}, "
                     f"{r.target.in_features}]): " + (f"quantized, {r.group}{tie}" if r.quantized else
                                                     f"float: {r.reason}"))
    if report.fused_groups:
        lines.append("fused groups (one global scale each under tensor_group schemes):")
        lines += [f"  {g.parent}: {', '.join(m.rpartition('.')[2] for m in g.members)}" for g in report.fused_groups]
    else:
        lines.append("fused groups: none")
    lines += [f"  warning: {w}" for w in report.fusion_warnings]
    if report.config.kv_cache is not None:
        lines.append(f"kv cache {len(report.kv_states)} attention module(s): "
                     + (", ".join(k.name for k in report.kv_states) or "none found"))
    lines += report.transform_lines
    lines.append(f"ignored  {', '.join(f'{r.target.name} ({r.reason})' for r in report.rows if not r.quantized) or 'none'}")
    lines.append(f"opset    model {report.model_opset}, scheme needs {report.required_opset}, "
                 f"output {report.output_opset}" + (" (converted)" if report.output_opset > report.model_opset else ""))
    if report.forms:
        lines.append("kernels  in onnxruntime (CPU, default settings): " + "; ".join(report.forms))
    lines.append(f"size     input {report.input_size:,} bytes -> expected {report.expected_size:,} bytes "
                 f"({report.expected_size / report.input_size:.2f}x)")
    if report.pass_note:
        lines.append(f"pass     {report.pass_note}")
    if report.memory_line:
        lines.append(f"memory   {report.memory_line}")
    return "\n".join(lines)


def _describe(scheme) -> str:
    parts = []
    for label, args in (("weights", scheme.weights), ("inputs", scheme.input_activations),
                        ("outputs", scheme.output_activations)):
        if args is None:
            continue
        text = f"{enum_value(args.type)}{args.num_bits} {enum_value(args.strategy)}"
        if args.group_size:
            text += f" {args.group_size}"
        if args.block_structure:
            text += f" {args.block_structure[0]}x{args.block_structure[1]}"
        if not args.symmetric:
            text += " asymmetric"
        if label != "weights":
            text += {True: " dynamic", False: " static", "local": " local"}.get(args.dynamic, f" dynamic={args.dynamic}")
        parts.append(f"{label} {text}")
    return ", ".join(parts)
