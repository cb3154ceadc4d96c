"""The run's observers, and which tapped tensor feeds which observer how.

For every chosen target a weight observer; for every activation it reads with static (or
NVFP4 "local") input args an input observer, shared by targets that read the same activation
with the same args (q/k/v), so each tap is reduced once per batch; for every key/value state
of a kv-cache scheme a k and a v observer. Each observer that sees activations is a
:class:`Consumer` of one tensor, with a :class:`Feed` saying how the tensor reaches it and the
in-graph reduction that can stand in for the whole tensor when the observer needs only
extrema (:class:`graphcal.graph.taps.TapRequest`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from graphcal.calibration.decisions import RunPlan
from graphcal.config import observer_name
from graphcal.errors import GraphcalError
from graphcal.graph.taps import Reduction, TapRequest
from graphcal.observers import make_observer, share_global_scale
from graphcal.types import KVState, QParams, QuantizedKV, QuantizedTarget, Target, enum_value


class Feed(enum.Enum):
    """How a tapped tensor reaches an observer."""

    INPUT = "input"  # an input observer: the activation as (batch, seq, hidden)
    KV = "kv"  # a key/value observer: the state as (batch, kv_heads, seq, head_dim)
    IMPORTANCE = "importance"  # a weight observer's activation statistics (imatrix)
    HESSIAN = "hessian"  # GPTQ's Hessian of a layer input (one-pass order): x^T x, reduced in the graph


@runtime_checkable
class Observed(Protocol):
    """What a tapped tensor feeds. ``takes_extrema``: the batch min/max reduced in the graph are
    all it needs; ``sync_ops`` / ``state_dict_stats``: its statistics under torchrun. The feeds
    used depend on the consumer's Feed: ``__call__`` (whole activations), ``observe_extrema``,
    ``accumulate_importance`` (imatrix), ``add_gram`` / ``add_activations`` (Hessians)."""

    takes_extrema: bool
    observer_name: str
    sync_ops: dict

    def state_dict_stats(self) -> dict: ...


@dataclass(frozen=True, eq=False)
class Consumer:
    """One observer fed by one tapped tensor; ``reducible`` is the in-graph reduction that can
    replace the whole tensor for an observer that takes extrema (None: it needs the tensor)."""

    tensor: str
    feed: Feed
    observer: Observed
    reducible: TapRequest | None

    def request(self, in_graph: bool) -> TapRequest:
        """What leaves onnxruntime for this consumer."""
        if in_graph and self.reducible is not None and (self.observer.takes_extrema or self.feed is Feed.HESSIAN):
            return self.reducible
        return TapRequest(self.tensor)


class Consumers:
    """Observers fed by tapped tensors, as the activation pass reads them (``consumers``)."""

    consumers: list[Consumer]

    def by_tensor(self) -> dict[str, list[Consumer]]:
        """Consumers grouped by tensor, in the order they were made (the same on every rank)."""
        out: dict[str, list[Consumer]] = {}
        for c in self.consumers:
            out.setdefault(c.tensor, []).append(c)
        return out

    def requests(self, in_graph: bool) -> list[TapRequest]:
        """Every tap the activation pass must fetch, once each."""
        return list(dict.fromkeys(c.request(in_graph) for c in self.consumers))

    def activation_observers(self) -> list:
        """Every observer a tap feeds, once each, in the same order on every rank."""
        return list({id(c.observer): c.observer for c in self.consumers}.values())


class ObserverSet(Consumers):
    """Every observer of a run, built from its plan.

    ``taps`` (target name -> tensor) names what a target's input and importance observers tap
    instead of its activation: under channel scales, the scaled activation ``x / s``. Where the plan
    asks for the pass's Hessians (``RunPlan.pass_hessians``: a transform unit's rounding takes them,
    GPTQ's one-pass order), every activation a chosen target reads gets one (``hessians``, target
    name -> graphcal.algorithms.gptq.hessian.HessianObserver, shared by the targets reading one tensor).
    """

    def __init__(self, plan: RunPlan, taps: dict[str, str] | None = None):
        taps = taps or {}
        self.kv_args = plan.config.kv_cache
        self.weight_observers: dict[str, object] = {}
        self.input_observers: dict[str, object] = {}  # target name -> observer (possibly shared)
        self.kv_observers: dict[tuple[KVState, str], object] = {}  # (attention, "k" | "v") -> observer
        self.consumers: list[Consumer] = []
        self.hessians: dict[str, object] = {}
        self._input_qparams: dict[int, QParams] = {}
        shared: dict[tuple, object] = {}
        if plan.pass_hessians:
            from graphcal.algorithms.gptq.hessian import HessianObserver  # lazy: GPTQ's math loads with GPTQ only

            by_tensor: dict[str, object] = {}
            for t in plan.chosen:
                activation = taps.get(t.name, t.activation)
                if activation not in by_tensor:
                    by_tensor[activation] = HessianObserver(t.in_features)
                    self.consumers.append(Consumer(activation, Feed.HESSIAN, by_tensor[activation],
                                                   TapRequest(activation, Reduction.GRAM, t.in_features)))
                self.hessians[t.name] = by_tensor[activation]
        for t in plan.chosen:
            scheme = plan.schemes[t.name]
            wobs = self.weight_observers[t.name] = _weight_observer(scheme)
            activation = taps.get(t.name, t.activation)
            if getattr(wobs, "needs_activations", False):
                self.consumers.append(Consumer(activation, Feed.IMPORTANCE, wobs, None))
            iargs = scheme.input_activations
            name = observer_name(iargs, "input")
            if name is None:
                continue
            key = (activation, name, iargs.model_dump_json())
            if key not in shared:
                shared[key] = make_observer(name, "input", iargs.model_copy(deep=True))
                self.consumers.append(Consumer(activation, Feed.INPUT, shared[key],
                                               _input_reduction(iargs, t, activation)))
            self.input_observers[t.name] = shared[key]
        for t in plan.lookups:  # embedding tables: weight observers only (their input is token ids)
            self.weight_observers[t.name] = _weight_observer(plan.schemes[t.name])
        for state in plan.kv_states:
            for base, tensor in (("k", state.key), ("v", state.value)):
                args = self.kv_args.model_copy(deep=True)
                obs = make_observer(observer_name(args, base), base, args)
                self.kv_observers[state, base] = obs
                per_head = enum_value(args.strategy) == "attn_head"
                self.consumers.append(Consumer(tensor, Feed.KV, obs, TapRequest(
                    tensor, Reduction.HEAD if per_head else Reduction.ALL)))

    def share_global_scales(self, members: list[str]) -> None:
        """Let the weight observers of one fused group share one global scale (tensor_group only)."""
        observers = [self.weight_observers[n] for n in members]
        if len(observers) > 1 and all(enum_value(o.args.strategy) == "tensor_group" for o in observers):
            share_global_scale(observers)

    def qparams(self, t: Target, scheme) -> QuantizedTarget:
        """The target's weight qparams (its weight observed) and its input's (shared ones computed once)."""
        qp = {"weight": to_qparams(self.weight_observers[t.name].get_qparams())}
        obs = self.input_observers.get(t.name)
        if obs is not None:
            if id(obs) not in self._input_qparams:
                if not obs.has_statistics:
                    raise GraphcalError(f"{t.name}: no activation reached its input observer")
                self._input_qparams[id(obs)] = to_qparams(obs.get_qparams())
            qp["input"] = self._input_qparams[id(obs)]
        return QuantizedTarget(t, scheme, qp)

    def kv_qparams(self) -> list[QuantizedKV]:
        out: dict[KVState, QuantizedKV] = {}
        for (state, base), obs in self.kv_observers.items():
            if not obs.has_statistics:
                raise GraphcalError(f"{state.name}: no {base} states reached the kv-cache observer")
            out.setdefault(state, QuantizedKV(state, self.kv_args)).qparams[base] = to_qparams(obs.get_qparams())
        return list(out.values())


def _weight_observer(scheme):
    """A weight observer for ``scheme`` (its own copy of the weight args)."""
    wargs = scheme.weights.model_copy(deep=True)
    return make_observer(observer_name(wargs, "weight"), "weight", wargs)


def _input_reduction(args, t: Target, activation: str) -> TapRequest | None:
    """How an input observer's batch extrema can be reduced in the graph (None: whole tensor)."""
    strategy = enum_value(args.strategy)
    if strategy == "tensor":
        return TapRequest(activation, Reduction.ALL)
    if strategy in ("group", "tensor_group") and args.group_size and t.in_features % args.group_size == 0:
        return TapRequest(activation, Reduction.GROUP, t.in_features // args.group_size, args.group_size)
    return None


def to_qparams(d: dict) -> QParams:
    """An observer's qparams, on the host (the writer and the metadata work there)."""
    def host(v: torch.Tensor | None) -> torch.Tensor | None:
        return None if v is None else v.cpu()

    return QParams(scale=host(d["scale"]), zero_point=host(d["zero_point"]), global_scale=host(d.get("global_scale")))
