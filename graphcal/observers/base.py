"""Observer base class: registry, statistics bookkeeping and qparam computation.

An observer accumulates per-qparam ``min_vals`` / ``max_vals`` from the tensors it is fed
and turns them into compressed-tensors qparams with ``calculate_qparams``. Subclasses only
decide how one batch is reduced (``_batch_min_max``) and how it is folded into the running
statistics (``_combine``).

Observers whose modules vLLM and TensorRT run as one fused matrix (q/k/v, gate/up, ...; found
by :func:`graphcal.graph.fusion.find_fused_groups`) must agree on one global scale:
:func:`share_global_scale` makes a set of tensor_group observers use the global scale of their
joint absmax, as llm-compressor's ``FusionHandler`` does, and releases their statistics only once
every member has produced its qparams.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterable
from functools import reduce
from typing import Any, ClassVar

import numpy as np
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from compressed_tensors.registry import RegistryMixin, standardize_lookup_name

from graphcal.observers.helpers import (
    BASE_NAMES,
    REDUCE_DIMS,
    WEIGHT_BASE_NAME,
    flatten_for_calibration,
    memory_order,
)

__all__ = ["Observer", "MissingStatisticsError", "SYNC_OPS", "share_global_scale"]

#: reductions a statistic may need across data-parallel ranks
SYNC_OPS = ("min", "max", "avg", "sum")

#: registry aliases that still work but warn (alias -> canonical name)
_WARNING_ALIASES: dict[str, str] = {}


class MissingStatisticsError(AssertionError):
    """``get_qparams`` was called before the observer saw any data."""


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def check_real(name: str, value: Any, *, low: float | None = None, high: float | None = None,
               low_open: bool = False) -> float:
    """Validate a finite real kwarg within ``[low, high]`` (``(low, high]`` if ``low_open``)."""
    if not _is_real(value) or not math.isfinite(value):
        raise ValueError(f"observer kwarg {name!r} must be a finite number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        bound = f"> {low}" if low_open else f">= {low}"
        raise ValueError(f"observer kwarg {name!r} must be {bound}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"observer kwarg {name!r} must be <= {high}, got {value!r}")
    return value


def check_int(name: str, value: Any, *, low: int = 0) -> int:
    """Validate an integer kwarg ``>= low`` (integral floats are accepted)."""
    if _is_real(value) and math.isfinite(value) and float(value).is_integer() and value >= low:
        return int(value)
    raise ValueError(f"observer kwarg {name!r} must be an integer >= {low}, got {value!r}")


def ema(old: torch.Tensor, new: torch.Tensor, constant: float) -> torch.Tensor:
    """``old * (1 - c) + new * c`` in the statistics' dtype."""
    return old * (1 - constant) + new * constant


def reduce_min_max(observed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """amin and amax over ``REDUCE_DIMS``, read in memory order: a weight that is a transposed view
    (the [in, out] a MatMul stores, seen as [out, in]) is reduced as it lies, not across its
    strides (40x faster for groups of 16). Min and max do not depend on the order they read in."""
    ndim = observed.ndim
    reduced = {d % ndim for d in REDUCE_DIMS}
    order = memory_order(observed)
    if order == list(range(ndim)):
        return torch.amin(observed, dim=REDUCE_DIMS), torch.amax(observed, dim=REDUCE_DIMS)
    laid = observed.permute(order)
    dims = [i for i, d in enumerate(order) if d in reduced]
    kept = [d for d in order if d not in reduced]  # the result's dims, in memory order
    back = sorted(range(len(kept)), key=lambda i: kept[i])
    return torch.amin(laid, dim=dims).permute(back), torch.amax(laid, dim=dims).permute(back)


class Observer(RegistryMixin):
    """Accumulates statistics of one tensor role and computes its qparams.

    ``Observer.load_from_registry(name, base_name=..., args=..., **observer_kwargs)``;
    ``base_name`` is one of weight/input/output/q/k/v. The effective kwargs are
    ``{**args.observer_kwargs, **observer_kwargs}`` over the class defaults; ``args`` itself
    is left untouched (llm-compressor merges them into the shared args in place).
    """

    registry_requires_subclass = True

    #: registered (canonical) name, set by ``register_observer``
    observer_name: ClassVar[str] = "observer"
    #: accepted observer kwargs and their defaults
    default_kwargs: ClassVar[dict[str, Any]] = {}
    #: attributes holding the raw statistics
    _stats_attrs: ClassVar[tuple[str, ...]] = ("min_vals", "max_vals")
    #: attribute -> reduction across ranks, for activation observers
    _act_sync: ClassVar[dict[str, str]] = {}

    def __init__(self, base_name: str, args: QuantizationArgs, **observer_kwargs: Any):
        if base_name not in BASE_NAMES:
            raise ValueError(f"unknown base_name {base_name!r}; expected one of {BASE_NAMES}")
        if not isinstance(args, QuantizationArgs):
            raise TypeError(f"args must be a QuantizationArgs, got {type(args).__name__}")
        merged = {**args.observer_kwargs, **observer_kwargs}
        unknown = sorted(set(merged) - set(self.default_kwargs))
        if unknown:
            accepted = ", ".join(sorted(self.default_kwargs)) or "none"
            raise ValueError(
                f"observer {self.observer_name!r} got unknown observer kwarg(s) "
                f"{', '.join(map(repr, unknown))}; accepted kwargs: {accepted}"
            )
        kwargs = {**self.default_kwargs, **merged}
        self.kwargs: dict[str, Any] = self._validate_kwargs(kwargs)
        self.base_name = base_name
        self.args = args
        self._shared_scale: _SharedGlobalScale | None = None
        for attr in self._stats_attrs:
            setattr(self, attr, None)

    # ------------------------------------------------------------------ registry
    @classmethod
    def register_observer(cls, name: str, alias: str | list[str] | None = None,
                          warn_alias: bool = False):
        """Class decorator: register under ``name`` (``_``/``-`` insensitive)."""

        def decorator(subclass: type[Observer]) -> type[Observer]:
            subclass.observer_name = name
            cls.register_value(subclass, name=name, alias=alias)
            if warn_alias and alias is not None:
                for item in [alias] if isinstance(alias, str) else alias:
                    _WARNING_ALIASES[standardize_lookup_name(item)] = name
            return subclass

        return decorator

    @classmethod
    def load_from_registry(cls, name: str, **constructor_kwargs: Any) -> Observer:
        """Build the observer registered as ``name`` with ``base_name``, ``args``, kwargs."""
        canonical = _WARNING_ALIASES.get(standardize_lookup_name(name))
        if canonical is not None:
            warnings.warn(
                f"observer name {name!r} is an alias of {canonical!r}; use {canonical!r}",
                UserWarning,
                stacklevel=2,
            )
        return super().load_from_registry(name, **constructor_kwargs)

    # ------------------------------------------------------------------ config
    def _validate_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return kwargs

    @property
    def is_weight(self) -> bool:
        return self.base_name == WEIGHT_BASE_NAME

    @property
    def strategy(self) -> QuantizationStrategy:
        return QuantizationStrategy(self.args.strategy)

    @property
    def needs_activations(self) -> bool:
        """True if the caller must feed ``accumulate_importance`` (imatrix weights)."""
        return False

    def accumulate_importance(self, x: torch.Tensor) -> None:
        raise TypeError(f"observer {self.observer_name!r} does not use activation importance")

    # ------------------------------------------------------------------ statistics
    @property
    def has_statistics(self) -> bool:
        return all(getattr(self, attr, None) is not None for attr in self._stats_attrs)

    @property
    def sync_ops(self) -> dict[str, str]:
        """Statistic attribute -> "min" | "max" | "avg" | "sum" ({} for weights)."""
        return {} if self.is_weight else dict(self._act_sync)

    def state_dict_stats(self) -> dict[str, torch.Tensor]:
        """The raw statistics that are present, by attribute name."""
        return {a: getattr(self, a) for a in self._stats_attrs if getattr(self, a) is not None}

    def load_stats(self, stats: dict[str, torch.Tensor]) -> None:
        """Replace statistics (e.g. after an all-reduce); unknown keys raise ``KeyError``."""
        unknown = sorted(set(stats) - set(self._stats_attrs))
        if unknown:
            raise KeyError(f"unknown statistics {unknown}; expected {list(self._stats_attrs)}")
        for attr, value in stats.items():
            setattr(self, attr, value)

    def merge(self, *others: Observer) -> Observer:
        """Fold other observers' statistics in with ``sync_ops`` semantics (avg over all)."""
        self._check_peers(others)
        for attr, op in self.sync_ops.items():
            values = [getattr(o, attr) for o in (self, *others) if getattr(o, attr) is not None]
            if not values:
                continue
            if op == "min":
                merged = reduce(torch.minimum, values)
            elif op == "max":
                merged = reduce(torch.maximum, values)
            elif op == "sum":
                merged = reduce(torch.add, values)
            elif op == "avg":
                merged = reduce(torch.add, values) / len(values)
            else:  # pragma: no cover - guarded by _act_sync definitions
                raise ValueError(f"unknown sync op {op!r}")
            setattr(self, attr, merged)
        return self

    def _check_peers(self, others) -> None:
        """Only observers of this class and base name merge into this one."""
        for other in others:
            if type(other) is not type(self) or other.base_name != self.base_name:
                raise TypeError(
                    f"cannot merge {type(other).__name__}({other.base_name!r}) into "
                    f"{type(self).__name__}({self.base_name!r})"
                )

    def reset(self) -> None:
        """Drop all statistics."""
        for attr in self._stats_attrs:
            setattr(self, attr, None)

    # ------------------------------------------------------------------ observing
    @torch.no_grad()
    def __call__(self, x: torch.Tensor, extrema: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Observe ``x``: weight ``[out, in]``, activation ``(B, S, H)``, q/k/v ``(B, h, S, D)``.

        ``extrema``: ``x``'s min and max where the caller has them already (the activation pass reads
        them to refuse NaN/Inf); observers that need a tensor's extrema take them instead of reading
        ``x`` again, the others ignore them."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"observers take torch tensors, got {type(x).__name__}")
        if x.numel() == 0:
            return
        if self.is_weight and self.has_statistics:
            return  # weights are observed once
        if not x.is_floating_point():
            raise TypeError(f"observers take floating-point tensors, got {x.dtype}")
        observed = flatten_for_calibration(x, self.base_name, self.args)
        if extrema is None:
            self._update(observed)
        else:
            self._update_spanned(observed, *extrema)

    forward = __call__

    @torch.no_grad()
    def observe_extrema(self, min_vals: torch.Tensor, max_vals: torch.Tensor) -> None:
        """Fold in one batch's min/max, already reduced to the qparam shape (in-graph reductions).

        Only observers whose statistics are the batch extrema take this (``takes_extrema``);
        the result is the same as observing the batch itself.
        """
        if not self.takes_extrema:
            raise TypeError(f"observer {self.observer_name!r} needs whole tensors, not extrema")
        self._combine(min_vals, max_vals)

    @property
    def takes_extrema(self) -> bool:
        """Whether the statistics are exactly the batch min/max (min/max observers on activations)."""
        return False

    def _update(self, observed: torch.Tensor) -> None:
        self._combine(*self._batch_min_max(observed))

    def _update_spanned(self, observed: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        """:meth:`_update` given the tensor's min and max; by default they are not used."""
        self._update(observed)

    def _batch_min_max(self, observed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return reduce_min_max(observed)

    def _combine(self, min_vals: torch.Tensor, max_vals: torch.Tensor) -> None:
        self.min_vals, self.max_vals = min_vals, max_vals

    def _finalize(self) -> None:
        """Hook run before qparams are computed (deferred searches)."""

    # ------------------------------------------------------------------ qparams
    def _require_statistics(self) -> None:
        if not self.has_statistics:
            raise MissingStatisticsError(
                f"No statistics available for the {self.base_name!r} observer "
                f"({self.observer_name}); observe data before calling get_qparams()"
            )

    @property
    def global_scale_peers(self) -> tuple[Observer, ...]:
        """The observers whose joint absmax gives this one's global scale (itself included).

        ``(self,)`` unless :func:`share_global_scale` put it in a group.
        """
        return self._shared_scale.members if self._shared_scale is not None else (self,)

    def get_global_scale(self) -> torch.Tensor | None:
        """fp32 ``(1,)`` global scale over ``global_scale_peers`` (tensor_group only, else None)."""
        if self.strategy != QuantizationStrategy.TENSOR_GROUP:
            return None
        members = self.global_scale_peers
        for member in members:
            if not member.has_statistics:
                raise MissingStatisticsError(
                    f"No statistics available for a fused peer ({member.base_name!r}, "
                    f"{member.observer_name}); observe every member of a fused group before "
                    "calling get_qparams()"
                )
            member._finalize()
        absmax = reduce(
            torch.maximum,
            [torch.maximum(m.max_vals.max(), -m.min_vals.min()) for m in members],
        )
        return generate_gparam(-absmax, absmax)

    def get_qparams(self) -> dict[str, torch.Tensor | None]:
        """``{"scale", "zero_point", "global_scale"}`` shaped like the qparams; drops stats.

        Observers sharing a global scale drop their statistics once every member has called this.
        """
        self._require_statistics()
        self._finalize()
        global_scale = self.get_global_scale()
        scale, zero_point = calculate_qparams(
            self.min_vals, self.max_vals, self.args, global_scale=global_scale
        )
        if self._shared_scale is not None:
            self._shared_scale.release(self)
        else:
            self.reset()
        return {"scale": scale, "zero_point": zero_point, "global_scale": global_scale}

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.observer_name!r}, base_name={self.base_name!r}, "
            f"strategy={self.strategy.value!r}, has_statistics={self.has_statistics})"
        )


class _SharedGlobalScale:
    """The state behind :func:`share_global_scale`: the members and who has produced qparams.

    Private to this module: callers see only ``share_global_scale`` and ``global_scale_peers``.
    """

    def __init__(self, members: tuple[Observer, ...]):
        self.members = members
        self._released: set[int] = set()

    def release(self, observer: Observer) -> None:
        """``observer`` has its qparams; once every member has, drop all their statistics."""
        self._released.add(id(observer))
        if len(self._released) == len(self.members):
            for member in self.members:
                member.reset()
            self._released.clear()

    def __repr__(self) -> str:
        return f"_SharedGlobalScale({[m.base_name for m in self.members]}, released={len(self._released)})"


def share_global_scale(observers: Iterable[Observer]) -> None:
    """Make tensor_group ``observers`` share one global scale, that of their joint absmax.

    Every member's ``get_global_scale`` (and so ``get_qparams``) then reads all members'
    statistics, and the statistics are dropped only once every member has called
    ``get_qparams``; a new round of observing starts after that. A single observer is a
    valid (trivial) group.

    Raises ``TypeError`` for anything that is not an :class:`Observer`, and ``ValueError`` if
    ``observers`` is empty, holds one observer twice, holds an observer whose strategy is not
    TENSOR_GROUP, or holds one that already shares its global scale.
    """
    members = tuple(observers)
    if not members:
        raise ValueError("share_global_scale needs at least one observer")
    for obs in members:
        if not isinstance(obs, Observer):
            raise TypeError(f"share_global_scale takes observers, got {type(obs).__name__}")
    if len({id(obs) for obs in members}) != len(members):
        raise ValueError("share_global_scale got the same observer twice")
    bad = [obs for obs in members if obs.strategy != QuantizationStrategy.TENSOR_GROUP]
    if bad:
        raise ValueError(
            "observers sharing a global scale must all use the TENSOR_GROUP strategy; got "
            + ", ".join(f"{o.observer_name}({o.base_name!r}): {o.strategy.value}" for o in bad)
        )
    taken = [obs for obs in members if obs._shared_scale is not None]
    if taken:
        raise ValueError(
            "an observer shares at most one global scale; already sharing one: "
            + ", ".join(f"{o.observer_name}({o.base_name!r})" for o in taken)
        )
    shared = _SharedGlobalScale(members)
    for obs in members:
        obs._shared_scale = shared
