"""Data-parallel calibration under torchrun: shard the batches, gather the statistics.

    torchrun --nproc-per-node N -m graphcal run model.onnx --data calib.npz ... -o out/

Every rank builds the same plan from the same model and options, runs its own onnxruntime
session (on ``cuda:LOCAL_RANK`` when CUDA is used) over batches ``rank, rank + N, ...`` of the
same batching a single process uses, and observes them locally. After the loop the ranks
exchange their activation statistics once (all_gather of a few KB per observer) and
fold them in rank order with each observer's reduce op (min/max for static_minmax, sum for
imatrix, avg for moving averages); every rank also learns whether another failed, so a failure
ends all ranks with an error instead of a hang. Weights are not synced: rank 0 observes them
and alone writes the outputs. Collectives time out after ``GRAPHCAL_DIST_TIMEOUT`` seconds
(default 600).

The process group is gloo unless ``GRAPHCAL_DIST_BACKEND=nccl``: the exchange is one small
message, which gloo carries between GPU hosts as well, and a gloo timeout is an exception that
becomes a one-line error, where NCCL's watchdog aborts the process. With ``nccl`` each rank
binds ``cuda:LOCAL_RANK`` first (NCCL's object collectives travel through the current device).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from datetime import timedelta

from graphcal.errors import GraphcalError, first_line

TIMEOUT_ENV = "GRAPHCAL_DIST_TIMEOUT"
BACKEND_ENV = "GRAPHCAL_DIST_BACKEND"
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class Dist:
    """This process's place in a torchrun job."""

    rank: int
    world: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def from_env() -> Dist | None:
    """Join the torchrun job described by the environment (WORLD_SIZE > 1), or None for one process."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return None
    import torch.distributed as dist  # lazy: only under torchrun

    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    name = backend()
    if not dist.is_initialized():
        options = {}
        if name == "nccl":
            import torch  # lazy: torch takes seconds to import; graphcal --help does without

            if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
                raise GraphcalError(f"rank {rank}: {BACKEND_ENV}=nccl needs a CUDA GPU for LOCAL_RANK {local_rank} "
                                    f"(this process sees {torch.cuda.device_count() if torch.cuda.is_available() else 0})")
            torch.cuda.set_device(local_rank)
            options["device_id"] = torch.device("cuda", local_rank)
        try:
            dist.init_process_group(name, timeout=timedelta(seconds=timeout_seconds()), **options)
        except Exception as e:  # noqa: BLE001 -- rendezvous failures come in many types
            raise GraphcalError(f"rank {rank}: cannot join the torchrun job ({first_line(e)})") from e
    return Dist(rank=rank, world=world, local_rank=local_rank)


def backend() -> str:
    """The process group's backend: ``GRAPHCAL_DIST_BACKEND`` (gloo, the default, or nccl)."""
    value = os.environ.get(BACKEND_ENV, "gloo").strip().lower() or "gloo"
    if value not in BACKENDS:
        raise GraphcalError(f"{BACKEND_ENV} must be one of {', '.join(BACKENDS)}, got {value!r}")
    return value


def timeout_seconds() -> int:
    value = os.environ.get(TIMEOUT_ENV, "600")
    try:
        seconds = int(value)
    except ValueError:
        raise GraphcalError(f"{TIMEOUT_ENV} must be a whole number of seconds, got {value!r}") from None
    if seconds <= 0:
        raise GraphcalError(f"{TIMEOUT_ENV} must be positive, got {seconds}")
    return seconds


def gather_statistics(d: Dist, observers: list, error: BaseException | None, counts: tuple[int, ...] | None = None):
    """Fold every rank's activation statistics into ``observers`` (the same list, in the same
    order, on every rank), or raise on every rank if any rank failed before this point.
    ``counts`` (e.g. the padded and all positions a rank saw) are summed over the ranks and returned."""
    import torch.distributed as dist  # lazy: only under torchrun

    payload = {
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "stats": None if error is not None else [
            {k: v.detach().cpu() for k, v in obs.state_dict_stats().items() if k in obs.sync_ops}
            for obs in observers
        ],
        "counts": counts,
    }
    gathered: list = [None] * d.world
    try:
        dist.all_gather_object(gathered, payload)
    except Exception as e:  # noqa: BLE001 -- gloo raises RuntimeError and friends on timeouts
        raise GraphcalError(f"rank {d.rank}: the other ranks did not answer within {timeout_seconds()} s "
                            f"({first_line(e)}); a rank died or is stuck") from e
    if error is not None:
        error.graphcal_exchanged = True  # every rank knows: report, then settle() before exiting
        raise error
    failed = [(r, p["error"]) for r, p in enumerate(gathered) if p["error"] is not None]
    if failed:
        rank, message = failed[0]
        failure = GraphcalError(f"rank {rank} failed: {message}")
        failure.graphcal_exchanged = True
        raise failure
    total = None if counts is None else tuple(sum(c) for c in zip(*(p["counts"] for p in gathered)))
    if not d.is_main:
        return total  # only rank 0 computes qparams and writes
    for i, obs in enumerate(observers):  # fold in rank order, as merge() documents
        peers = []
        for r in range(1, d.world):
            stats = gathered[r]["stats"][i]
            if stats:
                peer = copy.deepcopy(obs)
                peer.reset()
                peer.load_stats({k: v.to(_device_of(obs)) for k, v in stats.items()})
                peers.append(peer)
        if peers:
            obs.merge(*peers)
    return total


def settle(error: BaseException, seconds: float = 10.0) -> None:
    """After a failure every rank heard of at the exchange (and has reported): wait, at most
    ``seconds``, until the other ranks have reported theirs too. Without it the first rank to
    exit makes torchrun stop the others before they print. gloo only (NCCL has no bounded
    barrier); a no-op for other errors and outside a job."""
    if not getattr(error, "graphcal_exchanged", False):
        return
    import torch.distributed as dist  # lazy: only under torchrun

    try:
        if dist.is_initialized() and dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=seconds), wait_all_ranks=True)
    except Exception:  # noqa: BLE001 -- a rank that is gone already: nothing left to wait for
        pass


def _device_of(obs):
    for value in obs.state_dict_stats().values():
        return value.device
    return "cpu"


# -- exchanges of the weight-parallel rounding (calibration.transforms.gptq_ranks) --------------------


def exchange(d: Dist, error: BaseException | None, payload=None) -> list:
    """Every rank's ``payload`` (a small picklable object), in rank order, or raise on every rank if
    any rank failed before this point (``error``: this rank's): the check-in of a step that every
    rank takes together, as :func:`gather_statistics` is the activation pass's."""
    import torch.distributed as dist  # lazy: only under torchrun

    gathered: list = [None] * d.world
    mine = {"error": None if error is None else f"{type(error).__name__}: {error}",
            "payload": None if error is not None else payload}
    _collective(d, lambda: dist.all_gather_object(gathered, mine))
    raise_first(d, error, [p["error"] for p in gathered])
    return [p["payload"] for p in gathered]


def gather_to(d: Dist, obj, dst: int) -> list | None:
    """Every rank's ``obj`` on rank ``dst`` (in rank order; None on the others)."""
    import torch.distributed as dist  # lazy: only under torchrun

    out = [None] * d.world if d.rank == dst else None
    _collective(d, lambda: dist.gather_object(obj, out, dst=dst))
    return out


def broadcast_from(d: Dist, obj, src: int):
    """Rank ``src``'s ``obj`` on every rank."""
    import torch.distributed as dist  # lazy: only under torchrun

    box = [obj if d.rank == src else None]
    _collective(d, lambda: dist.broadcast_object_list(box, src=src))
    return box[0]


def raise_first(d: Dist, error: BaseException | None, errors: list[str | None]) -> None:
    """After an exchange that carried every rank's error (its text, None: none; ``error``: this
    rank's own): raise it here, or the first failing rank's, marked as heard by every rank."""
    if error is not None:
        error.graphcal_exchanged = True  # every rank knows: report, then settle() before exiting
        raise error
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        failure = GraphcalError(f"rank {rank} failed: {message}")
        failure.graphcal_exchanged = True
        raise failure


def _collective(d: Dist, call) -> None:
    try:
        call()
    except Exception as e:  # noqa: BLE001 -- gloo raises RuntimeError and friends on timeouts
        raise GraphcalError(f"rank {d.rank}: the other ranks did not answer within {timeout_seconds()} s "
                            f"({first_line(e)}); a rank died or is stuck") from e
