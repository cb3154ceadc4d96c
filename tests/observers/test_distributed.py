"""Data-parallel reduction of activation statistics without processes: sync_ops,
state_dict_stats/load_stats and merge (observers.md 1, 2, 9.6)."""

from __future__ import annotations

from functools import reduce

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs

from graphcal.observers import Observer

TENSOR = QuantizationArgs(num_bits=8, strategy="tensor")
GROUP = QuantizationArgs(num_bits=8, strategy="group", group_size=4)


def load(name, base_name="input", args=TENSOR, **kw):
    return Observer.load_from_registry(name, base_name=base_name, args=args, **kw)


def batches(n=3, shape=(2, 5, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) * (i + 1) for i in range(n)]


@pytest.mark.parametrize(
    "name,expected",
    [
        ("memoryless_minmax", {}),
        ("static_minmax", {"min_vals": "min", "max_vals": "max"}),
        ("minmax", {"min_vals": "avg", "max_vals": "avg"}),
        ("memoryless_mse", {}),
        ("mse", {"min_vals": "avg", "max_vals": "avg"}),
        ("nvfp4_expanded_mse", {}),
        ("imatrix_mse", {}),
    ],
)
def test_sync_ops(name, expected):
    assert load(name, "input").sync_ops == expected
    if "imatrix" in name:
        assert load(name, "weight").sync_ops == {"_imatrix_sum": "sum", "_imatrix_count": "sum"}
    else:
        assert load(name, "weight").sync_ops == {}  # weights are identical on every rank


@pytest.mark.parametrize("args", [TENSOR, GROUP], ids=["tensor", "group"])
def test_static_merge_equals_observing_everything(args):
    ranks = [batches(seed=s) for s in range(3)]
    per_rank = []
    for data in ranks:
        obs = load("static_minmax", args=args)
        for b in data:
            obs(b)
        per_rank.append(obs)
    merged = per_rank[0].merge(*per_rank[1:])
    everything = torch.cat([b for data in ranks for b in data])
    single = load("static_minmax", args=args)
    single(everything)
    assert torch.equal(merged.min_vals, single.min_vals)
    assert torch.equal(merged.max_vals, single.max_vals)
    assert torch.equal(merged.get_qparams()["scale"], single.get_qparams()["scale"])


def test_static_merge_attention_heads():
    args = QuantizationArgs(num_bits=8, strategy="attn_head")
    a, b = (torch.randn(1, 4, 3, 8) * s for s in (1.0, 2.0))
    oa, ob = load("static_minmax", "k", args), load("static_minmax", "k", args)
    oa(a)
    ob(b)
    oa.merge(ob)
    expected = torch.maximum(a.amax(dim=(0, 2, 3)), b.amax(dim=(0, 2, 3))).reshape(4, 1, 1)
    assert torch.equal(oa.max_vals, expected)


def test_minmax_merge_is_average_of_rank_emas():
    ranks = [batches(seed=s) for s in range(2)]
    obs = []
    expected_max = []
    for data in ranks:
        o = load("minmax", averaging_constant=0.2)
        ema = None
        for b in data:
            o(b)
            batch_max = b.max().reshape(1)
            ema = batch_max if ema is None else ema * 0.8 + batch_max * 0.2
        obs.append(o)
        expected_max.append(ema)
    obs[0].merge(obs[1])
    torch.testing.assert_close(obs[0].max_vals, (expected_max[0] + expected_max[1]) / 2)


def test_imatrix_merge_sums_importance():
    xs = batches(n=4, shape=(3, 2, 16))
    a, b, single = (load("imatrix_mse", "weight", QuantizationArgs(strategy="channel")) for _ in range(3))
    for x in xs[:3]:
        a.accumulate_importance(x)
    b.accumulate_importance(xs[3])
    single.accumulate_importance(torch.cat(xs))
    a.merge(b)
    assert a._imatrix_count.item() == single._imatrix_count.item() == 24
    ref = sum((x.float() ** 2).reshape(-1, 16).sum(0) for x in xs)
    torch.testing.assert_close(a._imatrix_sum, ref)
    torch.testing.assert_close(single._imatrix_sum, ref)


def all_reduce(stats: list[dict[str, torch.Tensor]], ops: dict[str, str]) -> dict[str, torch.Tensor]:
    """What torch.distributed.all_reduce leaves on every rank, for each synced attribute."""
    out = {}
    for attr, op in ops.items():
        values = [s[attr] for s in stats]
        if op == "min":
            out[attr] = reduce(torch.minimum, values)
        elif op == "max":
            out[attr] = reduce(torch.maximum, values)
        elif op == "sum":
            out[attr] = torch.stack(values).sum(0)
        else:
            out[attr] = torch.stack(values).sum(0) / len(values)
    return out


@pytest.mark.parametrize("name", ["static_minmax", "minmax", "mse"])
def test_state_dict_round_trip_matches_merge(name):
    ranks = []
    for seed in range(3):
        o = load(name, args=GROUP)
        for b in batches(n=2, seed=seed):
            o(b)
        ranks.append(o)
    reduced = all_reduce([o.state_dict_stats() for o in ranks], ranks[0].sync_ops)
    target = load(name, args=GROUP)
    target.load_stats({**ranks[0].state_dict_stats(), **reduced})
    merged = ranks[0].merge(*ranks[1:])
    for attr in ("min_vals", "max_vals"):
        torch.testing.assert_close(getattr(target, attr), getattr(merged, attr))


def test_memoryless_merge_keeps_local_statistics():
    a, b = load("memoryless_minmax"), load("memoryless_minmax")
    a(torch.ones(1, 2, 2))
    b(torch.full((1, 2, 2), 7.0))
    a.merge(b)
    assert a.max_vals.item() == 1.0


def test_merge_into_empty_observer_and_errors():
    a, b = load("static_minmax"), load("static_minmax")
    b(torch.ones(1, 1, 3))
    a.merge(b)
    assert a.max_vals.item() == 1.0
    with pytest.raises(TypeError):
        a.merge(load("minmax"))
    with pytest.raises(TypeError):
        a.merge(load("static_minmax", "output"))
    with pytest.raises(KeyError):
        a.load_stats({"running_mean": torch.zeros(1)})
