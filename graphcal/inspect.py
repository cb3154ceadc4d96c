"""What `graphcal run` would do to a model, found without calibrating and without writing anything.

Targets, selection, scheme groups, fused groups, warnings and the opset come from the same
functions ``pipeline.calibrate`` uses, called in the same order, so `inspect` and `run` agree.
The size of the written model is estimated by :func:`expected_model_size` from the weights'
shapes and data types; no weight is read and no observer runs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from graphcal.config import DEFAULT_IGNORE, DEFAULT_TARGETS, RunConfig, build_config
from graphcal.errors import GraphcalError
from graphcal.fusion import find_fused_groups
from graphcal.graph.io import default_opset, load_model_info
from graphcal.graph.qdq import items_opset
from graphcal.graph.targets import find_targets, matches, select
from graphcal.types import FusedGroup, QuantizedTarget, Target

# Scale dtypes stored as one byte per scale (NVFP4's fp8 scales, MX's uint8 exponents).
_ONE_BYTE_SCALES = {"float8_e4m3fn", "uint8"}


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

    @property
    def quantized(self) -> list[str]:
        return [r.target.name for r in self.rows if r.quantized]

    @property
    def ignored(self) -> list[str]:
        return [r.target.name for r in self.rows if not r.quantized]


def inspect_model(
    model: str | Path,
    *,
    scheme: str = "W8A8",
    config: RunConfig | None = None,
    targets: tuple[str, ...] | list[str] = DEFAULT_TARGETS,
    ignore: tuple[str, ...] | list[str] = DEFAULT_IGNORE,
    target: str = "onnxruntime",
) -> Inspection:
    """Describe what ``calibrate(model, ..., scheme=scheme, targets=targets, ignore=ignore)`` would write.

    Raises GraphcalError where `run` would fail before calibrating (unreadable model, nothing
    to quantize, a scheme the Q/DQ writer cannot express yet).
    """
    model_path = Path(model)
    config = config or build_config(scheme, list(targets), list(ignore))
    onnx_model = load_model_info(model_path, lazy=True)[0]  # no weight data needed
    found, skipped = find_targets(onnx_model)
    if not found:
        raise GraphcalError(f"{model_path}: no MatMul/Gemm node takes a weight; nothing to quantize")
    chosen, unmatched = select(found, config.patterns, config.ignore)
    unmatched = [p for p in unmatched if p not in DEFAULT_IGNORE]  # as run: a default that fits no model is no news
    warnings = [f"target or ignore pattern {p!r} matches no MatMul/Gemm" for p in unmatched]
    if not chosen:
        raise GraphcalError(f"{model_path}: no target left to quantize (targets {config.patterns}, ignore {config.ignore})")
    items = [QuantizedTarget(t, config.scheme_for(t)) for t in chosen]
    need = items_opset(items, runtime=target)  # raises, as run does, for a scheme with no ONNX form
    groups, fusion_warnings = find_fused_groups(chosen)
    model_opset = default_opset(onnx_model)
    rows = [_row(t, t in chosen, config) for t in found]
    del onnx_model  # expected_model_size reads the file again, without the weights' data
    parts = size_parts(model_path, items)
    return Inspection(
        model=model_path, scheme=config.scheme_name, config=config, rows=rows, not_targets=skipped,
        fused_groups=groups, fusion_warnings=fusion_warnings, unmatched=unmatched,
        model_opset=model_opset, required_opset=need, output_opset=max(model_opset, need),
        input_size=parts["input"], expected_size=sum(parts.values()), size_parts=parts, warnings=warnings,
    )


def _row(t: Target, chosen: bool, config: RunConfig) -> TargetRow:
    if chosen:
        scheme = config.scheme_for(t)
        group = next(name for name, s in config.groups.items() if s is scheme)
        return TargetRow(t, True, group, f"matches target {_first_match(t, config.patterns)!r}")
    hit = _first_match(t, config.ignore)
    if hit is not None:
        return TargetRow(t, False, None, f"matches ignore {hit!r}")
    return TargetRow(t, False, None, "matches no target pattern")


def _first_match(t: Target, patterns: list[str]) -> str | None:
    return next((p for p in patterns if matches(t, p)), None)


# -- expected size ---------------------------------------------------------------------------

def expected_model_size(model_path: str | os.PathLike, items: list[QuantizedTarget]) -> int:
    """Expected bytes on disk of the model.onnx (plus its .data file, if any) `run` writes for ``items``.

    The rule, per quantized target (torch weight ``[out, in]``, weight args ``w``):

    - minus the float weight: elements x the element size of the initializer's data type
      (an initializer is counted once, and only when no other node still reads it);
    - plus the quantized weight: ``ceil(w.num_bits * out * in / 8)`` bytes (int4/fp4 pack two
      per byte);
    - plus the scales: one per tensor (``tensor``), per output channel (``channel``), per group
      of ``group_size`` along ``in`` (``group``, ``tensor_group``: ``out * ceil(in / group_size)``),
      or per ``[rows, cols]`` block (``block``: the writer expands MatMul block scales per row,
      ``out * ceil(in / cols)``; a Gemm with transB=1 keeps ``ceil(out / rows) * ceil(in / cols)``).
      A scale is 4 bytes (fp32), or 1 byte when ``w.scale_dtype`` is float8_e4m3fn or uint8 (MX);
      ``tensor_group`` also stores one fp32 global scale;
    - plus zero points when ``w.symmetric`` is false: as many as scales, at the weight's bit width.

    Graph records (the new Q/DQ nodes, initializer headers, value_info the version converter
    adds) are not counted: a few KB per layer, up to ~10% of the shipped tiny models' output and
    noise on real ones.

    The input size is the model file plus its external data files.
    """
    return sum(size_parts(model_path, items).values())


def size_parts(model_path: str | os.PathLike, items: list[QuantizedTarget]) -> dict[str, int]:
    """The terms of :func:`expected_model_size`, in bytes (the removed weights are negative)."""
    model_path = Path(model_path)
    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as e:  # load_model has already accepted the file when inspect calls this
        raise GraphcalError(f"{model_path} is not a readable ONNX model ({e})") from e
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    parts = {"input": _on_disk_size(model_path, graph), "float_weights": 0, "quantized_weights": 0,
             "scales": 0, "zero_points": 0}
    for name in _removed_by_writer(graph, [item.target for item in items]):
        init = inits[name]
        parts["float_weights"] -= math.prod(init.dims) * _element_size(init.data_type)
    for item in items:
        t, w = item.target, item.scheme.weights
        n_scales = _scale_count(t, w)
        parts["quantized_weights"] += _packed(w.num_bits, t.out_features * t.in_features)
        parts["scales"] += n_scales * _scale_size(w) + (4 if w.strategy == "tensor_group" else 0)
        if not w.symmetric:
            parts["zero_points"] += _packed(w.num_bits, n_scales)
    return parts


def _on_disk_size(model_path: Path, graph: onnx.GraphProto) -> int:
    locations = set()
    for t in graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            locations.update(e.value for e in t.external_data if e.key == "location")
    return model_path.stat().st_size + sum(
        (model_path.parent / loc).stat().st_size for loc in sorted(locations) if (model_path.parent / loc).is_file()
    )


def _element_size(data_type: int) -> int:
    return onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize


def _packed(num_bits: int, count: int) -> int:
    return math.ceil(num_bits * count / 8)


def _scale_count(t: Target, w) -> int:
    out, inp = t.out_features, t.in_features
    if w.strategy == "tensor":
        return 1
    if w.strategy == "channel":
        return out
    if w.strategy in ("group", "tensor_group"):
        return out * math.ceil(inp / w.group_size)
    if w.strategy == "block":
        rows, cols = w.block_structure
        if t.layout == "in_out":  # MatMul: block scales expanded per row
            return out * math.ceil(inp / cols)
        return math.ceil(out / rows) * math.ceil(inp / cols)
    raise GraphcalError(f"{t.name}: weight strategy {w.strategy} has no known size")


def _scale_size(w) -> int:
    dtype = getattr(w, "scale_dtype", None)
    return 1 if dtype is not None and str(dtype).removeprefix("torch.") in _ONE_BYTE_SCALES else 4


def _removed_by_writer(graph: onnx.GraphProto, targets: list[Target]) -> list[str]:
    """Initializers nothing reads once every target reads its dequantized weight (tied weights stay)."""
    from graphcal.graph.qdq import dead_weight_paths

    by_node = {t.node for t in targets}
    detached = {n.input[1] for n in graph.node if n.name in by_node} | {t.weight for t in targets}

    def rewired(node):  # as the writer leaves it: a target's B input reads the dequantized weight instead
        return [i for k, i in enumerate(node.input) if not (k == 1 and node.name in by_node)]

    return sorted(dead_weight_paths(graph, detached, rewired)[1])


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
        "not_targets": [{"node": s.node, "reason": s.reason} for s in report.not_targets],
        "fused_groups": [{"parent": g.parent, "members": list(g.members)} for g in report.fused_groups],
        "fusion_warnings": report.fusion_warnings,
        "unmatched_patterns": report.unmatched,
        "warnings": report.warnings,
        "opset": {"model": report.model_opset, "required": report.required_opset, "output": report.output_opset},
        "size": {
            "input_bytes": report.input_size,
            "expected_bytes": report.expected_size,
            "ratio": round(report.expected_size / report.input_size, 4),
            "parts": {k: v for k, v in report.size_parts.items() if k != "input"},
        },
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
    if report.fused_groups:
        lines.append("fused groups (one global scale each under tensor_group schemes):")
        lines += [f"  {g.parent}: {', '.join(m.rpartition('.')[2] for m in g.members)}" for g in report.fused_groups]
    else:
        lines.append("fused groups: none")
    lines += [f"  warning: {w}" for w in report.fusion_warnings]
    lines.append(f"ignored  {', '.join(f'{r.target.name} ({r.reason})' for r in report.rows if not r.quantized) or 'none'}")
    lines.append(f"opset    model {report.model_opset}, scheme needs {report.required_opset}, "
                 f"output {report.output_opset}" + (" (converted)" if report.output_opset > report.model_opset else ""))
    lines.append(f"size     input {report.input_size:,} bytes -> expected {report.expected_size:,} bytes "
                 f"({report.expected_size / report.input_size:.2f}x)")
    return "\n".join(lines)


def _describe(scheme) -> str:
    parts = []
    for label, args in (("weights", scheme.weights), ("inputs", scheme.input_activations),
                        ("outputs", scheme.output_activations)):
        if args is None:
            continue
        text = f"{args.type}{args.num_bits} {args.strategy}"
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
