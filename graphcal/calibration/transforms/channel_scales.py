"""Channel scales: what SmoothQuant and AWQ hand the later stages, and how each stage applies them.

Both algorithms pick, for each mapping (a smooth layer and the balance layers reading its output,
graph.scaling.Mapping), a per-channel scale s; the model computes the same function with the smooth
layer's output divided by s and the balance weights' input columns multiplied by s. They differ only
in how s is chosen (:class:`ScaleMethod`), and the output model records which one made them.

Nothing that is not finite is ever written: a scale that is not finite and positive, or a value
it makes (a smoothed weight, a norm constant divided by s, 1/s in the activation's dtype) that
overflows, is a GraphcalError naming the mapping (:func:`check_scales`, :func:`refuse_nonfinite`).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, replace

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from graphcal.arrays import to_numpy, to_torch
from graphcal.calibration.decisions import RunPlan
from graphcal.errors import GraphcalError
from graphcal.graph.index import GraphIndex
from graphcal.graph.scaling import Mapping, divide_params, explicit_mul, replace_weight, tap_nodes
from graphcal.graph.targets import torch_weight
from graphcal.observers.helpers import all_finite
from graphcal.types import Target


class ScaleMethod(enum.Enum):
    """The algorithm that chose a run's channel scales."""

    SMOOTHQUANT = "smoothquant"
    AWQ = "awq"

    @property
    def metadata_key(self) -> str:
        """The output model's metadata_props key recording the mappings (JSON)."""
        return f"graphcal.{self.value}"


METADATA_KEY = ScaleMethod.SMOOTHQUANT.metadata_key  # "graphcal.smoothquant"
AWQ_METADATA_KEY = ScaleMethod.AWQ.metadata_key  # "graphcal.awq"


def scaled_layers(mappings: list[Mapping]) -> set[str]:
    """The layers ``mappings`` rescale: the balance layers, and a linear smooth layer."""
    return {name for m in mappings for name in (*m.balance, *([m.candidate.linear] if m.candidate.linear else []))}


def taps_of(mappings: list[Mapping]) -> dict[str, str]:
    """Target name -> the scaled activation its observers tap (graph.scaling.Mapping.tapped)."""
    return {b: m.tapped for m in mappings for b in m.balance}


@dataclass
class ChannelScales:
    """Per-channel scales s of a pre-transform's mappings (SmoothQuant's or AWQ's), and how each later
    stage applies them: observers of a scaled activation see x * (1/s) (:meth:`prelude`, :meth:`taps`),
    the weight pass multiplies each balance weight's input columns by s (:meth:`weight`), and
    :meth:`fold` writes the rest into the output graph."""

    mappings: list[Mapping]
    scales: dict[str, torch.Tensor]  # activation -> s (clamped)
    unclamped: dict[str, torch.Tensor] = field(default_factory=dict)
    ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # smooth output -> (min, max)
    strengths: dict[str, float] = field(default_factory=dict)  # activation -> the strength its scales were made with
    columns: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # balance target -> s to multiply columns by
    rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # linear smooth target -> s to divide rows by
    method: ScaleMethod = ScaleMethod.SMOOTHQUANT  # which algorithm made them (its metadata_props key)
    record: dict | None = None  # what the metadata records (None: SmoothQuant's settings, from the run)
    clips: dict[str, torch.Tensor] = field(default_factory=dict)  # target -> AWQ's clip bound per row and group

    def __post_init__(self):
        for m in self.mappings:
            s = self.scales[m.candidate.activation]
            check_scales(m, s, self.method)
            for b in m.balance:
                self.columns.setdefault(b, []).append(s)
            if m.candidate.linear is not None:
                self.rows.setdefault(m.candidate.linear, []).append(s)

    def taps(self) -> dict[str, str]:
        """Target name -> the scaled activation its observers tap (graph.scaling.Mapping.tapped)."""
        return taps_of(self.mappings)

    def describe(self) -> list[str]:
        """Each mapping as scaled (graph.scaling.Mapping.describe)."""
        return [m.describe() for m in self.mappings]

    def prelude(self, types) -> tuple[list, list]:
        """The tap-side ``Mul(x, 1/s)`` nodes for the calibration pass (graph.taps.build_tapped)."""
        return tap_nodes(self.mappings, {m.candidate.activation: self._inverse(m, types) for m in self.mappings})

    def _inverse(self, m: Mapping, types) -> np.ndarray:
        """1/s as the graph multiplies by it (in the activation's dtype)."""
        dtype = _np_dtype(types, m.candidate.activation)
        with np.errstate(over="ignore"):  # an overflow is refused just below
            inverse = (1.0 / self.scales[m.candidate.activation].double()).numpy().astype(dtype)
        smallest = float(self.scales[m.candidate.activation].min())
        refuse_nonfinite(m, self.method, inverse, f"1/s in {np.dtype(dtype).name} (s down to {smallest:g})")
        return inverse

    def weight(self, t: Target, w: torch.Tensor) -> torch.Tensor:
        """A target's torch [out, in] weight, smoothed: input columns times s, output rows over s
        (in llm-compressor's order: each mapping in turn, the result cast back to the weight's dtype)."""
        if t.name not in self.columns and t.name not in self.rows:
            return w
        dtype = w.dtype
        for s in self.columns.get(t.name, []):
            w = (w * s[None, :]).to(dtype)
        for s in self.rows.get(t.name, []):
            w = (w / s[:, None]).to(dtype)
        if w.is_floating_point() and not all_finite(w):  # (the weight pass refuses a weight non-finite before)
            m = next(m for m in self.mappings if t.name in m.balance or t.name == m.candidate.linear)
            refuse_nonfinite(m, self.method, w, f"{t.name}'s weight scaled by s ({str(dtype).removeprefix('torch.')})")
        return w

    def observed(self, t: Target, w: torch.Tensor) -> torch.Tensor:
        """What the weight observer sees of ``t``'s smoothed weight ``w``: ``w`` clamped to AWQ's clip
        bounds where ``--awq-clip`` chose them (so the grid ends at the bound), else ``w``. The weight
        itself is rounded unclamped on that grid: to nearest that saturates at the bound as the clamp
        would, and GPTQ carries what saturates into the columns after."""
        if t.name not in self.clips:
            return w
        from graphcal.algorithms.awq.clip import clip  # lazy: AWQ's math loads with AWQ only (clips are AWQ's)

        return clip(w, self.clips[t.name])

    def column_scale(self, t: Target) -> torch.Tensor | None:
        """What ``t``'s input columns are multiplied by (the product of its mappings' s; None: nothing)."""
        scales = self.columns.get(t.name)
        if not scales:
            return None
        out = scales[0].double()
        for s in scales[1:]:
            out = out * s.double()
        return out

    def smooth_hessian(self, t: Target, h: torch.Tensor) -> torch.Tensor:
        """The Hessian of ``t``'s smoothed input x/s from that of x: diag(1/s) H diag(1/s)."""
        s = self.column_scale(t)
        if s is None:
            return h
        inverse = (1.0 / s).to(h.device)
        return (h.double() * inverse[:, None] * inverse[None, :]).to(h.dtype)

    def unsmooth(self, t: Target, w: torch.Tensor) -> torch.Tensor:
        """The weight that computes in the unsmoothed graph what ``w`` (smoothed, as :meth:`weight`
        gives it) computes in the smoothed one: columns over s, rows times s."""
        dtype = w.dtype
        s = self.column_scale(t)
        out = w.double()
        if s is not None:
            out = out / s.to(w.device)[None, :]
        for r in self.rows.get(t.name, []):
            out = out * r.double().to(w.device)[:, None]
        return out.to(dtype)

    def target(self, t: Target) -> Target:
        """The target as the output graph has it: behind an explicit Mul it reads the Mul's output."""
        for m in self.mappings:
            if m.explicit and t.name in m.balance:
                return replace(t, activation=m.tapped)
        return t

    def fold(self, model: onnx.ModelProto, run: RunPlan, quantized: set[str], types: dict) -> None:
        """Write the smoothing into ``model`` (the run's working model, edited into the output) where the weight
        pass does not: norm scales and biases, linear biases and constant scales divided by s, explicit Muls, and the float weights
        of balance or linear smooth layers that stay unquantized (``quantized``: those that do not);
        the model's metadata_props record the mappings (``graphcal.smoothquant``, JSON).
        ``types`` gains the explicit Muls' outputs."""
        record = self.record
        if record is None:
            settings = run.config.smoothing
            record = {"strength": "auto" if settings.search else settings.strength, "algorithm": settings.algorithm,
                      "scope": settings.scope,
                      "mappings": [{"smooth": m.smooth, "kind": "mul" if m.explicit else m.candidate.kind,
                                    "balance": list(m.balance), "strength": self.strengths.get(m.candidate.activation)}
                                   for m in self.mappings]}
        model.metadata_props.add(key=self.method.metadata_key, value=json.dumps(record, separators=(",", ":")))
        before = {i.name for i in model.graph.initializer}
        for m in (m for m in self.mappings if m.candidate.params):  # one at a time: an overflow names its mapping
            s = self.scales[m.candidate.activation].numpy()
            with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused just below
                divide_params(model, list(m.candidate.params), {p: s for p in m.candidate.params}, run.base_dir)
            for init in model.graph.initializer:
                if init.name not in before:
                    before.add(init.name)
                    value = numpy_helper.to_array(init)
                    if value.dtype.kind == "f":
                        refuse_nonfinite(m, self.method, value, f"{init.name} (a constant divided by s)")
        for m in self.mappings:
            if m.explicit:
                x = m.candidate.activation
                nodes = {t.node for t in run.found if t.name in m.balance}
                explicit_mul(model, m, self._inverse(m, types), nodes)
                if x in types:
                    types[m.tapped] = types[x]
        by_name = {t.name: t for t in run.found}
        for name in dict.fromkeys([*self.columns, *self.rows]):
            if name not in quantized:
                self.write_float(model, by_name[name], run.base_dir)

    def replaced_initializers(self, model: onnx.ModelProto, run: RunPlan, quantized: set[str]) -> set[str]:
        """The initializers :meth:`fold` replaces in ``model`` (and may drop): the constants it divides
        by s and the float weights of layers left unquantized (``quantized``: those that are not),
        with the initializers behind them (through a Constant, Identity or Cast)."""
        index = GraphIndex(model.graph)
        start = [p.value for m in self.mappings for p in m.candidate.params]
        by_name = {t.name: t for t in run.found}
        start += [by_name[n].weight for n in dict.fromkeys([*self.columns, *self.rows]) if n not in quantized]
        out, todo, seen = set(), list(start), set()
        while todo:
            value = todo.pop()
            if value in seen:
                continue
            seen.add(value)
            if value in index.initializers:
                out.add(value)
            elif (node := index.producer_node(value)) is not None:
                todo.extend(i for i in node.input if i)
        return out

    def write_float(self, model, t: Target, base_dir: str | None) -> None:
        """Store a target's smoothed weight in float in ``model`` (a layer left unquantized)."""
        w = to_torch(torch_weight(model, t, base_dir))
        replace_weight(model, t, to_numpy(self.weight(t, w)), base_dir)


def check_scales(m: Mapping, s: torch.Tensor, method: ScaleMethod = ScaleMethod.SMOOTHQUANT, why: str = "") -> None:
    """Every scale of mapping ``m`` finite and positive, else a GraphcalError naming it (``why``: the cause, if known)."""
    bad = ~(torch.isfinite(s) & (s > 0))
    if bool(bad.any()):
        channel = int(bad.nonzero()[0, 0])
        raise GraphcalError(f"{_name(method)} {m.describe()}: {int(bad.sum())} of {s.numel()} channel scale(s) are not "
                            f"finite and positive (channel {channel}: {float(s[channel]):g})"
                            f"{'; ' + why if why else ''}; graphcal writes no such scale")


def refuse_nonfinite(m: Mapping, method: ScaleMethod, value, what: str) -> None:
    """A GraphcalError naming mapping ``m`` when ``value`` (numpy or torch), made from its scales, is not all finite."""
    finite = torch.isfinite(value) if isinstance(value, torch.Tensor) else np.isfinite(value)
    if not bool(finite.all()):
        raise GraphcalError(f"{_name(method)} {m.describe()}: {what} is not finite in {int((~finite).sum())} "
                            f"value(s) (the scales overflow its type); graphcal writes no such value: {_advice(method)}")


def _advice(method: ScaleMethod) -> str:
    if method is ScaleMethod.SMOOTHQUANT:
        return "leave this mapping out (a SmoothQuantModifier's mappings or ignore), or try a smaller strength"
    return "leave this layer out of AWQ's mappings"


def _name(method: ScaleMethod) -> str:
    return "SmoothQuant" if method is ScaleMethod.SMOOTHQUANT else "AWQ"


def _np_dtype(types, tensor: str):
    t = types.get(tensor) if types is not None else None
    if t is None or not t.elem_type:
        return np.float32
    return onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
