"""Fused observer groups (q/k/v, gate/up, ...) that share one global scale."""

from __future__ import annotations

from collections.abc import Iterable

from compressed_tensors.quantization import QuantizationStrategy

from graphcal.observers.base import Observer

__all__ = ["FusionGroup", "fuse_observers"]


class FusionGroup:
    """Members share the global scale of their joint absmax.

    Statistics are dropped only once every member has called ``get_qparams``.
    """

    def __init__(self, members: tuple[Observer, ...]):
        self.members = members
        self._released: set[int] = set()

    def release(self, observer: Observer) -> None:
        self._released.add(id(observer))
        if len(self._released) == len(self.members):
            for member in self.members:
                member.reset()
            self._released.clear()

    def __repr__(self) -> str:
        return f"FusionGroup({[m.base_name for m in self.members]}, released={len(self._released)})"


def fuse_observers(observers: Iterable[Observer]) -> FusionGroup:
    """Fuse tensor_group observers so they share one global scale; returns the group.

    Raises ``ValueError`` if the list is empty, holds duplicates or an observer that is
    already fused, or if any observer's strategy is not TENSOR_GROUP.
    """
    members = tuple(observers)
    if not members:
        raise ValueError("fuse_observers needs at least one observer")
    for obs in members:
        if not isinstance(obs, Observer):
            raise TypeError(f"fuse_observers takes observers, got {type(obs).__name__}")
    if len({id(obs) for obs in members}) != len(members):
        raise ValueError("fuse_observers got the same observer twice")
    bad = [obs for obs in members if obs.strategy != QuantizationStrategy.TENSOR_GROUP]
    if bad:
        raise ValueError(
            "all observers of a fused group must use the TENSOR_GROUP strategy; got "
            + ", ".join(f"{o.observer_name}({o.base_name!r}): {o.strategy.value}" for o in bad)
        )
    if any(obs._fusion is not None for obs in members):
        raise ValueError("an observer in this group is already fused into another group")
    group = FusionGroup(members)
    for obs in members:
        obs._fusion = group
    return group
