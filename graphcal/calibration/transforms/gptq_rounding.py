"""GPTQ's pieces that its one-process orders (calibration.transforms.gptq) and its weight-parallel order
under torchrun (calibration.transforms.gptq_ranks) share: a fused unit rounded on one Hessian, the units
grouped by the Hessian they read, a block's layer inputs reduced to x^T x, and the log of what GPTQ did."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from graphcal.calibration.blockwise import Blockwise
from graphcal.calibration.seams import Member
from graphcal.errors import GraphcalError
from graphcal.graph.taps import Reduction, TapRequest, gram
from graphcal.types import QuantizedTarget, enum_value


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


def gptq_weights(members: list[Member], hessian: torch.Tensor, settings, record: GPTQLog) -> dict[str, torch.Tensor]:
    """Layers that read one input (q/k/v, gate/up), rounded by GPTQ with its Hessian. Layers with the
    same channel or group args and no global scale are stacked along their rows and swept once:
    GPTQ treats rows independently (each row's updates use the same inverse Hessian), so the result
    is each layer's own, for one factorisation and one sweep (llm-compressor's batched_quantization)."""
    from graphcal.algorithms.gptq.math import quantize_weight  # lazy: GPTQ's math loads with GPTQ only

    def stackable(item: QuantizedTarget) -> bool:
        qp, args = item.qparams["weight"], item.scheme.weights
        return qp.global_scale is None and enum_value(args.strategy) in ("channel", "group")

    first = members[0].item.scheme.weights
    batches = [members]
    if len(members) > 1 and not all(stackable(m.item) and m.item.scheme.weights == first
                                    and m.weight.dtype == members[0].weight.dtype for m in members):
        batches = [[m] for m in members]
    out: dict[str, torch.Tensor] = {}
    for batch in batches:
        names = ", ".join(m.target.name for m in batch)
        grids = [m.item.qparams["weight"] for m in batch]
        w = torch.cat([m.weight for m in batch]) if len(batch) > 1 else batch[0].weight
        scale = torch.cat([g.scale for g in grids]) if len(batch) > 1 else grids[0].scale
        zps = [g.zero_point for g in grids]
        zp = None if zps[0] is None else (torch.cat(zps) if len(batch) > 1 else zps[0])
        try:
            result = quantize_weight(w, hessian.to(w.device), scale, zp, grids[0].global_scale,
                                     batch[0].item.scheme.weights, block_size=settings.block_size,
                                     dampening_frac=settings.dampening_frac)
        except ValueError as e:
            raise GraphcalError(f"{names}: GPTQ: {e}") from e
        except torch.linalg.LinAlgError as e:  # the inverse's Cholesky on a badly conditioned Hessian
            raise GraphcalError(f"{names}: GPTQ: the Hessian's inverse is not positive definite; raise "
                                "--dampening-frac") from e
        start = 0
        for m in batch:
            rows = m.weight.shape[0]
            out[m.target.name] = result.weight[start:start + rows].to(m.weight.device)
            record.losses[m.target.name] = (float(result.row_loss[start:start + rows].sum()) if len(batch) > 1
                                            else result.loss)
            if result.rtn_fallback:
                record.rtn_fallback.append(m.target.name)
            start += rows
    return out


def by_input(members: list[Member], key) -> list[list[Member]]:
    """``members`` grouped by the Hessian they use (``key(target)``), in order."""
    groups: dict = {}
    for m in members:
        groups.setdefault(key(m.target), []).append(m)
    return list(groups.values())


def block_grams(walk: Blockwise, k: int, columns: dict[str, int], sink) -> str:
    """Block ``k``'s subgraph run on the walk's batches (every world-th under torchrun), each layer
    input ``x`` of ``columns`` (its width) reduced to ``x^T x`` in the graph: ``sink(x, batch index,
    gram, sequences)`` per batch and input, in batch order. Returns the provider that ran it."""
    block = walk.blocks[k]
    requests = [TapRequest(x, Reduction.GRAM, n) for x, n in columns.items()]
    runtime, tapped = walk.session([], list(block.inputs), requests=requests)
    try:
        for i, feeds in walk.batches(k):
            values = runtime.run(feeds)
            for r in requests:
                if not bool(torch.isfinite(values[tapped.finite[r.tensor]]).all()):  # the tap's NaN/Inf probe
                    raise GraphcalError(f"tap {r.tensor!r} holds NaN or Inf in block {block.name}; the model "
                                        "or the data produce non-finite activations")
                sink(r.tensor, i, *gram([values[n] for n in tapped.outputs[r]], r.groups))
            del values  # this batch's Grams let go before the next batch's are made
    finally:
        runtime.close()
    return runtime.provider


def walk_units(walk: Blockwise, chosen, all_units: list[list]) -> Iterator[tuple[int, list[list]]]:
    """(k, block ``k``'s fused units) for each block of ``walk``, the units of ``all_units`` whose members
    lie in it. GraphcalError before the first block for a chosen target in no block, and before a
    block's units for a unit that straddles it (graph.blocks keeps units whole: a graphcal bug). The
    plan is every rank's: under torchrun every rank stops alike."""
    in_blocks = {t.name for b in walk.blocks for t in b.targets}
    missing = [t.name for t in chosen if t.name not in in_blocks]
    if missing:
        raise GraphcalError(f"GPTQ: {len(missing)} target(s) are in no layer block: {', '.join(missing[:3])}")
    for k, block in enumerate(walk.blocks):
        names = {t.name for t in block.targets}
        units = [u for u in all_units if any(t.name in names for t in u)]
        straddling = [u for u in units if not all(t.name in names for t in u)]
        if straddling:
            raise GraphcalError(f"GPTQ: the fused unit {', '.join(t.name for t in straddling[0])} straddles layer "
                                f"block {block.name}; this is a graphcal bug: please report it")
        yield k, units

