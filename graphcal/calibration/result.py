"""What a run did and wrote (:class:`CalibrationResult`), and its summary as `graphcal run` prints it:
the text lines and the ``--json`` object, beside the record they describe."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from graphcal.output.metadata import qparam_tensors
from graphcal.types import QuantizedTarget


@dataclass
class CalibrationResult:
    """What a run did and wrote."""

    output_dir: Path
    files: list[Path]
    targets: list[QuantizedTarget]
    ignored: list[str]
    provider: str | None  # None when no activation pass was needed
    num_samples: int
    num_batches: int
    seconds: float
    warnings: list[str] = field(default_factory=list)
    forms: list[str] = field(default_factory=list)  # what onnxruntime runs (plan.RunPlan.forms)
    rank: int = 0  # under torchrun: this process's rank (only rank 0 writes)
    world: int = 1
    padding_share: float | None = None  # positions with attention_mask == 0 (None: no attention_mask)
    exclude_padding: bool = False  # padded positions were left out of the activation statistics
    # each transform unit's frozen result record by its key (graphcal.calibration.transforms: "rotation",
    # "smoothquant", "awq", "gptq"); a unit that did nothing has none
    transforms: dict[str, object] = field(default_factory=dict)
    float_bytes: int = 0  # bytes of the written model's float initializers (sizing.float_weight_bytes)
    model_bytes: int = 0  # bytes of the written model on disk (model.onnx and its data file)
    scheme: str = "W8A8"  # the scheme as the summary names it (scheme_label)
    pass_note: str = ""  # the activation pass: "streamed block by block (N blocks)" or "whole-graph (why)"
    pass_seconds: float = 0.0  # the activation pass's wall time (SmoothQuant's ranges included)

    @property
    def qparams(self) -> dict[str, torch.Tensor]:
        return qparam_tensors(self.targets)

    @property
    def read_data_blockwise(self) -> bool:
        """A transform read the calibration data besides the activation pass (AWQ's search, GPTQ's Hessians)."""
        return any(getattr(r, "read_data", False) for r in self.transforms.values())

    def transform_lines(self) -> list[str]:
        """What each transform did, as `graphcal run` prints it (its unit's words), in the order they ran."""
        from graphcal.calibration.transforms import REGISTRY  # lazy: the units load torch and onnx

        return [line for unit in REGISTRY.values() for line in unit.result_lines(self.transforms.get(unit.key))]

    def transform_json(self) -> dict:
        """What each transform did, as `graphcal run --json` prints it: one key per unit."""
        from graphcal.calibration.transforms import REGISTRY  # lazy: the units load torch and onnx

        return {unit.key: unit.result_json(self.transforms.get(unit.key)) for unit in REGISTRY.values()}

    def as_dict(self) -> dict:
        """The summary `graphcal run --json` prints, each transform's keys with it."""
        return {
            "quantized": [i.target.name for i in self.targets], "ignored": self.ignored,
            "provider": self.provider, "samples": self.num_samples, "batches": self.num_batches,
            "ranks": self.world, "seconds": round(self.seconds, 3), "files": [str(f) for f in self.files],
            "warnings": self.warnings, "onnxruntime_kernels": self.forms,
            "padding_share": self.padding_share, "exclude_padding": self.exclude_padding,
            "model_bytes": self.model_bytes, "float_bytes": self.float_bytes, "pass": self.pass_note,
            "pass_seconds": round(self.pass_seconds, 3),
            **self.transform_json(),
        }

    def summary_lines(self) -> list[str]:
        """The summary `graphcal run` prints, line by line; what the transforms did (each in its unit's
        words) goes after the size line, before the pass's."""
        lines = []
        lookups = sum(1 for i in self.targets if i.target.op_type == "Gather")
        n = len(self.targets) - lookups
        lines.append(f"quantized {n} MatMul/Gemm target{'s' if n != 1 else ''}"
                     + (f" and {lookups} embedding lookup{'s' if lookups != 1 else ''}" if lookups else "")
                     + f" with {self.scheme}" + (f"; left in float: {', '.join(self.ignored)}" if self.ignored else ""))
        if self.model_bytes:
            lines.append(f"written model: {self.model_bytes / 1e6:.1f} MB, of which {self.float_bytes / 1e6:.1f} MB "
                         f"({self.float_bytes / self.model_bytes:.0%}) is still float (weights left unquantized, "
                         "norms, biases, scales)")
        lines += self.transform_lines()
        searched = self.read_data_blockwise  # AWQ and GPTQ read the data without an activation pass
        if self.provider is None and searched:
            lines.append(f"calibrated on {self.num_samples} samples in {self.num_batches} batches (GPTQ / AWQ; the "
                         "scheme has no static activations to observe)")
        elif self.provider is None:
            lines.append("calibration pass: not needed (the scheme has no static activations to observe)")
        else:
            ranks = f" across {self.world} ranks" if self.world > 1 else ""
            lines.append(f"calibrated on {self.num_samples} samples in {self.num_batches} batches{ranks} "
                         f"with onnxruntime {self.provider}" + (f", {self.pass_note}" if self.pass_note else ""))
        if self.padding_share is not None:
            if self.provider is None and searched:
                what = "GPTQ's Hessians and AWQ's means count them, as llm-compressor's do"
            elif self.provider is None:
                what = "no activation statistics are taken for this scheme"
            elif self.exclude_padding:
                what = "left out of the statistics"
            else:
                what = "--exclude-padding leaves them out of the statistics"
            lines.append(f"calibration data: {self.padding_share:.1%} of positions are padding (attention_mask == 0); "
                         + what)
        if self.forms:
            lines.append("in onnxruntime (CPU, default settings) the quantized layers run as:")
            lines += [f"  {line}" for line in self.forms]
            lines.append("  measure it: graphcal bench MODEL OUTPUT/model.onnx --data HELDOUT.npz (docs/speed.md has "
                         "numbers)")
        lines.append(f"done in {self.seconds:.1f} s; wrote:")
        lines += [f"  {f}" for f in self.files]
        return lines


def scheme_label(scheme: str | None, recipe: str | os.PathLike | None, config_name: str | None = None) -> str:
    """The scheme as the summary names it: "recipe NAME" (a recipe and no --scheme), a preset's
    name, "a custom scheme" (JSON); ``config_name``: a resolved RunConfig's, given instead of both."""
    if recipe is not None and scheme is None:
        return f"recipe {Path(recipe).name}"
    if scheme is None and config_name is not None:
        return {"custom": "a custom scheme", "recipe": "a recipe"}.get(config_name, config_name)
    scheme = scheme or "W8A8"
    return "a custom scheme" if scheme.lstrip().startswith("{") else scheme.upper()
