"""GPTQ as a stage: Hessians from the calibration data, then each weight rounded by graphcal.algorithms.gptq.math.

Two orders, as llm-compressor has them:

* **one-pass** (graphcal's; llm-compressor's ``pipeline="basic"``): the calibration pass reduces
  every quantized layer's input to ``x^T x`` inside onnxruntime (:class:`HessianObserver`, a
  GRAM tap), so no activation leaves the session; the weight pass then quantizes each weight with
  its Hessian. One pass over the data; every Hessian is held until the weight pass.
* **sequential** (llm-compressor's default): :func:`sequential_gptq` takes the graph layer block
  by layer block (graph.blocks). Each block's subgraph runs on the cached outputs of the blocks
  before it, which were computed with their weights already quantized, so every Hessian sees
  the error of the layers before it; the block's weights are quantized, and the block runs again
  with them to give the next block its inputs. Two runs of each block in all (two passes over the
  data, as llm-compressor's calibration and propagation passes); one block's Hessians and the
  blocks' boundary tensors (the residual stream) are held at a time.

Either way the grid is the scheme's observer on the weight before GPTQ (llm-compressor fixes it
there), and the weight pass writes GPTQ's on-grid weight with those qparams. Under SmoothQuant
or AWQ the weights are the smoothed ones and the Hessians those of the smoothed inputs x/s
(tapped as x * (1/s) in the one-pass order; diag(1/s) H diag(1/s) in the sequential one).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from graphcal.errors import GraphcalError
from graphcal.types import QuantizedTarget, Target, enum_value

log = logging.getLogger("graphcal")


class HessianObserver:
    """The Hessian of one tapped activation, fed ``x^T x`` per batch (or whole activations), and
    gathered across torchrun ranks like an observer's statistics."""

    takes_extrema = False
    observer_name = "GPTQ Hessian"
    sync_ops = {"hessian_sum": None, "hessian_count": None}

    def __init__(self, columns: int):
        from graphcal.algorithms.gptq.math import Hessian

        self.columns = columns
        self.hessian = Hessian()
        self._value: torch.Tensor | None = None

    def add_gram(self, gram: torch.Tensor, sequences: int) -> None:
        self.hessian.add_gram(gram.cpu(), sequences)  # held in host memory (counted by check_one_pass)

    def add_activations(self, x: torch.Tensor) -> None:
        self.hessian.add_activations(x)
        self.hessian.sum = self.hessian.sum.cpu()

    @property
    def has_statistics(self) -> bool:
        return self.hessian.sum is not None and self.hessian.count > 0

    def value(self) -> torch.Tensor:
        """H / number of sequences (computed once; q/k/v share it)."""
        if self._value is None:
            self._value = self.hessian.value()
        return self._value

    def release(self) -> None:
        """Let the Hessian go once every layer reading it is quantized."""
        self.hessian.sum, self._value = None, None

    # torchrun (graphcal.calibration.distributed.gather_statistics)
    def state_dict_stats(self) -> dict:
        if self.hessian.sum is None:
            return {}
        return {"hessian_sum": self.hessian.sum, "hessian_count": torch.tensor(self.hessian.count)}

    def reset(self) -> None:
        from graphcal.algorithms.gptq.math import Hessian

        self.hessian, self._value = Hessian(), None

    def load_stats(self, stats: dict) -> None:
        self.hessian.sum = stats["hessian_sum"].float()
        self.hessian.count = int(stats["hessian_count"])

    def merge(self, *others: HessianObserver) -> None:
        self.hessian.merge(*(o.hessian for o in others))
        self._value = None


@dataclass
class GPTQLog:
    """What GPTQ did to each layer: its loss (1/2 sum e^2, llm-compressor's) and the layers whose
    Hessian was not positive definite (rounded to nearest on the same grid, with a warning)."""

    losses: dict[str, float] = field(default_factory=dict)
    rtn_fallback: list[str] = field(default_factory=list)

    def warnings(self) -> list[str]:
        if not self.rtn_fallback:
            return []
        shown = ", ".join(self.rtn_fallback[:3]) + (f" and {len(self.rtn_fallback) - 3} more"
                                                     if len(self.rtn_fallback) > 3 else "")
        return [f"GPTQ: the Hessian of {len(self.rtn_fallback)} layer(s) is not positive definite even after "
                f"dampening ({shown}); rounded to nearest on the same grid (raise --dampening-frac)"]


def gptq_weights(members: list[tuple[Target, torch.Tensor, QuantizedTarget]], hessian: torch.Tensor, settings,
                 record: GPTQLog) -> dict[str, torch.Tensor]:
    """Layers that read one input (q/k/v, gate/up), rounded by GPTQ with its Hessian. Layers with the
    same channel or group args and no global scale are stacked along their rows and swept once:
    GPTQ treats rows independently (each row's updates use the same inverse Hessian), so the result
    is each layer's own, for one factorisation and one sweep (llm-compressor's batched_quantization)."""
    from graphcal.algorithms.gptq.math import quantize_weight

    def stackable(item: QuantizedTarget) -> bool:
        qp, args = item.qparams["weight"], item.scheme.weights
        return qp.global_scale is None and enum_value(args.strategy) in ("channel", "group")

    first = members[0][2].scheme.weights
    batches = [members]
    if len(members) > 1 and not all(stackable(m[2]) and m[2].scheme.weights == first and m[1].dtype == members[0][1].dtype
                                    for m in members):
        batches = [[m] for m in members]
    out: dict[str, torch.Tensor] = {}
    for batch in batches:
        names = ", ".join(t.name for t, _, _ in batch)
        w = torch.cat([m[1] for m in batch]) if len(batch) > 1 else batch[0][1]
        scale = torch.cat([m[2].qparams["weight"].scale for m in batch]) if len(batch) > 1 else batch[0][2].qparams["weight"].scale
        zps = [m[2].qparams["weight"].zero_point for m in batch]
        zp = None if zps[0] is None else (torch.cat(zps) if len(batch) > 1 else zps[0])
        qp = batch[0][2].qparams["weight"]
        try:
            result = quantize_weight(w, hessian.to(w.device), scale, zp, qp.global_scale, batch[0][2].scheme.weights,
                                     block_size=settings.block_size, dampening_frac=settings.dampening_frac)
        except ValueError as e:
            raise GraphcalError(f"{names}: GPTQ: {e}") from e
        except torch.linalg.LinAlgError as e:  # the inverse's Cholesky on a badly conditioned Hessian
            raise GraphcalError(f"{names}: GPTQ: the Hessian's inverse is not positive definite; raise "
                                "--dampening-frac") from e
        start = 0
        for t, wt, _ in batch:
            rows = wt.shape[0]
            out[t.name] = result.weight[start:start + rows].to(wt.device)
            record.losses[t.name] = float(result.row_loss[start:start + rows].sum()) if len(batch) > 1 else result.loss
            if result.rtn_fallback:
                record.rtn_fallback.append(t.name)
            start += rows
    return out


class OnePass:
    """The weight pass's rounding for the one-pass order: each weight with the Hessian of the
    activation it reads (from the calibration pass), which goes once its last reader is done."""

    def __init__(self, hessians: dict[str, HessianObserver], settings):
        self.hessians, self.settings, self.log = hessians, settings, GPTQLog()
        self._left: dict[int, int] = {}
        for obs in hessians.values():
            self._left[id(obs)] = self._left.get(id(obs), 0) + 1

    def __call__(self, members: list[tuple[Target, torch.Tensor, QuantizedTarget]]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for reading in _by_input(members, lambda t: id(self.hessians[t.name])):
            obs = self.hessians[reading[0][0].name]
            if not obs.has_statistics:
                raise GraphcalError(f"{reading[0][0].name}: no activation reached its GPTQ Hessian")
            out.update(gptq_weights(reading, obs.value(), self.settings, self.log))
            self._left[id(obs)] -= len(reading)
            if not self._left[id(obs)]:
                obs.release()
        return out


def _by_input(members: list, key) -> list[list]:
    """``members`` grouped by the Hessian they use (``key(target)``), in order."""
    groups: dict = {}
    for m in members:
        groups.setdefault(key(m[0]), []).append(m)
    return list(groups.values())


def hessian_bytes(targets: list[Target]) -> int:
    """The fp32 Hessians of the distinct activations ``targets`` read, in bytes (held at once in the
    one-pass order)."""
    seen = {t.activation: t.in_features for t in targets}
    return sum(4 * n * n for n in seen.values())


def check_one_pass(run, world: int = 1) -> None:
    """Refuse the one-pass order when its Hessians (every distinct layer input's, fp32, held at once)
    would take more than half the memory available. Under torchrun (``world`` ranks) the exchange
    hands rank 0 every rank's copy and merges through one more: world + 1 copies there."""
    from graphcal.limits import check_fits

    copies = 1 if world <= 1 else world + 1
    check_fits(copies * hessian_bytes(list(run.chosen)), "GPTQ's one-pass Hessians"
               + (f" ({copies} copies across the exchange of {world} ranks)" if copies > 1 else ""),
               hint="--gptq-order sequential holds one layer block's Hessians at a time")


class Rounded:
    """The weight pass's rounding for the sequential order: the weights GPTQ already put on the grid."""

    def __init__(self, weights: dict[str, torch.Tensor], record: GPTQLog):
        self.weights, self.log = weights, record

    def __call__(self, members: list[tuple[Target, torch.Tensor, QuantizedTarget]]) -> dict[str, torch.Tensor]:
        return {t.name: self.weights.pop(t.name) for t, _, _ in members}


def sequential_gptq(run, observers, calib, *, device: str, device_id: int = 0, progress: bool = False,
                    smoothed=None, torch_device: torch.device | None = None) -> Rounded:
    """GPTQ layer block by layer block (llm-compressor's sequential pipeline with propagate_error):
    each block's Hessians from its inputs as the quantized blocks before it made them, its weights
    quantized, then the block run again with them for the next block's inputs."""
    import copy

    from graphcal.calibration.blockwise import Blockwise
    from graphcal.calibration.weights import observe_unit, units
    from graphcal.graph.taps import Reduction, TapRequest, gram
    from graphcal.graph.targets import torch_weight
    from graphcal.progress import Progress

    settings = run.config.gptq
    device_t = torch_device or torch.device("cpu")
    # the grid is taken here as the weight pass takes it again (the same observers, the same weights):
    # on copies, so the run's observers are left as they were (a global scale is shared once)
    observers = copy.deepcopy(observers)
    walk = Blockwise(run, calib, device=device, device_id=device_id)
    record, rounded = GPTQLog(), {}
    by_name = {t.name: t for t in run.chosen}
    all_units = units(run)
    bar = Progress("GPTQ blocks", len(walk.blocks), "block", bar=progress)
    with bar, torch.no_grad():
        for k, block in enumerate(walk.blocks):
            # 1. the Hessians of the block's inputs, from what the (quantized) blocks before it made
            hessians: dict[str, HessianObserver] = {}
            for t in block.targets:
                hessians.setdefault(t.activation, HessianObserver(t.in_features))
            requests = [TapRequest(x, Reduction.GRAM, h.columns) for x, h in hessians.items()]
            runtime, tapped = walk.session([], list(block.inputs), requests=requests)
            try:
                for _, feeds in walk.batches(k):
                    values = runtime.run(feeds)
                    for r in requests:
                        if not bool(torch.isfinite(values[tapped.finite[r.tensor]]).all()):  # the tap's NaN/Inf probe
                            raise GraphcalError(f"tap {r.tensor!r} holds NaN or Inf in block {block.name}; the model "
                                                "or the data produce non-finite activations")
                        hessians[r.tensor].add_gram(*gram([values[n] for n in tapped.outputs[r]], r.groups))
            finally:
                runtime.close()
            # 2. the block's weights: observed (the grid), then GPTQ on it
            effective: dict[str, torch.Tensor] = {}
            members = {t.name for t in block.targets}
            for unit in [u for u in all_units if u[0].name in members]:
                weights = {t.name: torch.from_numpy(torch_weight(run.model, t, run.base_dir)) for t in unit}
                if smoothed is not None:
                    weights = {t.name: smoothed.weight(t, weights[t.name]) for t in unit}
                members = [(t, w.to(device_t), item)
                           for t, w, item in observe_unit(run, observers, unit, weights, device_t, smoothed)]

                def key(t: Target):  # one Hessian: the same input, smoothed by the same scales
                    s = smoothed.column_scale(t) if smoothed is not None else None
                    return t.activation, None if s is None else tuple(s.tolist())

                for reading in _by_input(members, key):
                    t0 = reading[0][0]
                    h = hessians[t0.activation].value().to(device_t)
                    if smoothed is not None:
                        h = smoothed.smooth_hessian(t0, h)
                    for name, q in gptq_weights(reading, h, settings, record).items():
                        t = by_name[name]
                        rounded[name] = q.cpu()
                        effective[name] = smoothed.unsmooth(t, rounded[name]) if smoothed is not None else rounded[name]
            del hessians
            # 3. the block again with its quantized weights: the next blocks' inputs
            needed = walk.needed(k)
            if needed:
                walk.keep(k, walk.run_block(k, needed, effective))
            bar.update(1)
    missing = [t.name for t in run.chosen if t.name not in rounded]
    if missing:
        raise GraphcalError(f"GPTQ: {len(missing)} target(s) were in no layer block: {', '.join(missing[:3])}")
    return Rounded(rounded, record)
