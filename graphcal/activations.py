"""The activation pass: the tapped graph runs once per batch and feeds the observers.

The tapped graph (:func:`graphcal.graph.taps.build_tapped`) is a weightless copy of the model
plus the taps; the session reads the model's own initializers beside it. Each batch's taps
reach torch by DLPack (on the GPU under CUDA), each goes to its consumers
(:class:`graphcal.observe.Consumer`), and the batch is dropped. Under torchrun each rank runs
its share of the batches and the ranks then exchange their statistics once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from graphcal.distributed import gather_statistics
from graphcal.errors import GraphcalError
from graphcal.graph.taps import Reduction, build_tapped
from graphcal.observe import Feed, ObserverSet
from graphcal.plan import RunPlan
from graphcal.runtime import open_runtime

log = logging.getLogger("graphcal")

# reduced extrema -> the observers' qparam shapes (flatten_for_calibration's reduce over dims 0, -1)
_QPARAM_SHAPE = {Reduction.ALL: lambda v: (1,), Reduction.GROUP: lambda v: (v.numel(),),
                 Reduction.HEAD: lambda v: (v.numel(), 1, 1)}


@dataclass(frozen=True)
class PassResult:
    """What the pass did: the provider that ran (None: no pass was needed) and the batches this rank ran."""

    provider: str | None
    batches: int


def run_activation_pass(plan: RunPlan, observers: ObserverSet, calib, *, device: str, device_id: int = 0,
                        dist=None, progress: bool = False, reduce_in_graph: bool = True) -> PassResult:
    """Stream ``calib`` through the tapped model and feed every activation observer.

    With ``reduce_in_graph``, observers that take extrema get them from ReduceMin/ReduceMax in
    the graph, so whole activations leave onnxruntime only for observers that need them. Without
    any activation observer the data is still read once, cheaply, so NaN/Inf in it is refused.
    """
    if not observers.consumers:
        calib.check_values()
        return PassResult(None, 0)
    tapped = build_tapped(plan.model, observers.requests(reduce_in_graph), dict(plan.types))
    provider, batches, error = None, 0, None
    try:
        runtime = open_runtime(tapped.model, tapped.fetch, device, device_id=device_id,
                               external_folder=plan.base_dir, weights=plan.model.graph.initializer)
        provider = runtime.provider
        whole = sum(r.reduction is Reduction.WHOLE for r in tapped.outputs)
        log.info("calibration pass on onnxruntime %s (taps to torch on %s): %d whole tensors and %d "
                 "reductions fetched per batch", provider, runtime.device, whole, len(tapped.outputs) - whole)
        try:
            batches = _feed_batches(runtime, calib, observers, tapped, reduce_in_graph,
                                    progress and (dist is None or dist.is_main), dist)
        finally:
            runtime.close()
    except Exception as e:  # noqa: BLE001 -- under torchrun every rank must hear of it
        if dist is None:
            raise
        error = e
    if dist is not None:
        gather_statistics(dist, observers.activation_observers(), error)
    return PassResult(provider, batches)


def _feed_batches(runtime, calib, observers: ObserverSet, tapped, in_graph: bool, progress: bool, dist=None) -> int:
    """Run every batch (under torchrun: every world-th, from this rank) and feed the observers."""
    from tqdm import tqdm

    routes = observers.by_tensor()
    count = 0
    known = calib.num_batches if calib.num_batches else None  # a reader's count is known only afterwards
    total = known if dist is None or known is None else len(range(dist.rank, known, dist.world))
    # disable=None: a bar only on a terminal, so logs and pipes stay clean
    bar = tqdm(total=total, desc="calibrating", unit="batch", disable=None if progress else True, leave=False)
    with torch.no_grad(), bar:
        for index, batch in enumerate(calib.batches()):
            if dist is not None and index % dist.world != dist.rank:
                continue
            values = runtime.run(batch)
            for tensor, consumers in routes.items():
                x = values.get(tensor)
                probe = tapped.finite.get(tensor)
                finite = (all_finite(x) if x is not None and x.is_floating_point()
                          else probe is None or bool(torch.isfinite(values[probe]).all()))
                if not finite:
                    raise GraphcalError(
                        f"tap {tensor!r} holds NaN or Inf in batch {index} (observer "
                        f"{consumers[0].observer.observer_name}); the model or the data produce non-finite activations"
                    )
                for c in consumers:
                    request = c.request(in_graph)
                    try:
                        if request.reduction is not Reduction.WHOLE:
                            lo, hi = (values[name] for name in tapped.outputs[request])
                            shape = _QPARAM_SHAPE[request.reduction](lo)
                            c.observer.observe_extrema(lo.reshape(shape), hi.reshape(shape))
                        elif c.feed is Feed.IMPORTANCE:
                            c.observer.accumulate_importance(x)
                        elif c.feed is Feed.KV:
                            c.observer(x)
                        else:
                            c.observer(_as_bsh(x))
                    except ValueError as e:  # e.g. a group size that does not divide the hidden size
                        raise GraphcalError(f"tap {tensor!r} {tuple(x.shape) if x is not None else ''}: {e}") from e
            count += 1
            bar.update(1)
    return count


def all_finite(x: torch.Tensor) -> bool:
    """No NaN or Inf in ``x``: its min and max (which carry NaN along) are finite. One read of
    ``x`` and no mask of its size (``isfinite(x).all()`` cost 30x more on a big tap)."""
    if x.numel() == 0:
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(x))).all())



def _as_bsh(x: torch.Tensor) -> torch.Tensor:
    """Activations as (batch, seq, hidden), the layout llm-compressor's observers see."""
    if x.ndim == 2:
        return x.unsqueeze(0)
    if x.ndim > 3:
        return x.reshape(-1, x.shape[-2], x.shape[-1])
    return x
