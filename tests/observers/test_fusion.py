"""Fused groups share one global scale from the joint absmax (observers.md 5, 9.6)."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import calculate_qparams

from graphcal.observers import MissingStatisticsError, Observer, fuse_observers

from .test_mse import reference_search

NVFP4 = dict(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16,
             scale_dtype=torch.float8_e4m3fn)


def nvfp4_args():
    return QuantizationArgs(**NVFP4)


def group_min_max(w: torch.Tensor, gs: int = 16):
    g = w.reshape(w.shape[0], -1, gs)
    return g.amin(-1), g.amax(-1)


def qkv(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 32, generator=g) * s).to(dtype) for s in (1.0, 3.0, 0.5)]


def observers(name="static_minmax", n=3):
    return [Observer.load_from_registry(name, base_name="weight", args=nvfp4_args()) for _ in range(n)]


def test_fused_members_share_global_scale_of_joint_absmax():
    weights = qkv()
    obs = observers()
    fuse_observers(obs)
    for o, w in zip(obs, weights):
        o(w)
    qps = [o.get_qparams() for o in obs]
    joint = torch.cat([w.flatten() for w in weights]).abs().max()
    expected = torch.tensor([2688.0]) / joint
    for qp, w in zip(qps, weights):
        assert torch.equal(qp["global_scale"], expected)
        mn, mx = group_min_max(w)
        assert torch.equal(qp["scale"], calculate_qparams(mn, mx, nvfp4_args(), global_scale=expected)[0])
    # unfused, the small v projection would get its own (larger) global scale
    alone = observers(n=1)[0]
    alone(weights[2])
    assert alone.get_qparams()["global_scale"].item() > expected.item() * 2


def test_bf16_global_scale_rounds_in_bf16():
    w = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)
    args = [QuantizationArgs(**{**NVFP4, "group_size": 3}) for _ in range(2)]
    obs = [Observer.load_from_registry("memoryless_minmax", base_name="weight", args=a) for a in args]
    fuse_observers(obs)
    obs[0](w / 2)
    obs[1](w)
    assert obs[0].get_qparams()["global_scale"].item() == 117.0  # 2688/23 = 116.87 in bf16


def test_fused_mse_uses_searched_ranges():
    weights = qkv()
    weights[1][0, 0] = 20.0  # an outlier the search clips
    obs = observers("memoryless_mse")
    fuse_observers(obs)
    for o, w in zip(obs, weights):
        o(w)
    qp = obs[0].get_qparams()
    refs = [reference_search(w, nvfp4_args()) for w in weights]
    absmax = max(max(r[1].max().item(), -r[0].min().item()) for r in refs)
    raw = max(w.abs().max().item() for w in weights)
    assert absmax < raw  # the search shrank the largest group
    assert qp["global_scale"].item() == pytest.approx(2688.0 / absmax, rel=1e-6)


def test_stats_dropped_only_after_every_member():
    weights = qkv()
    obs = observers()
    fuse_observers(obs)
    for o, w in zip(obs, weights):
        o(w)
    first = obs[0].get_qparams()
    assert all(o.has_statistics for o in obs)
    obs[0](weights[0] * 100)  # weights observe once: still the old statistics
    obs[1].get_qparams()
    assert all(o.has_statistics for o in obs)
    obs[2].get_qparams()
    assert not any(o.has_statistics for o in obs)
    for o, w in zip(obs, weights):  # a new round works
        o(w)
    again = obs[0].get_qparams()
    assert torch.equal(again["global_scale"], first["global_scale"])


def test_peer_without_statistics_raises():
    obs = observers()
    fuse_observers(obs)
    obs[0](qkv()[0])
    with pytest.raises(MissingStatisticsError, match="fused"):
        obs[0].get_qparams()


def test_two_member_group_like_gemma_v_proj_none():
    weights = qkv()[:2]
    obs = observers(n=2)
    fuse_observers(obs)
    for o, w in zip(obs, weights):
        o(w)
    joint = torch.cat([w.flatten() for w in weights]).abs().max()
    assert torch.equal(obs[1].get_qparams()["global_scale"], torch.tensor([2688.0]) / joint)


def test_fuse_errors():
    group_args = QuantizationArgs(num_bits=4, strategy="group", group_size=16)
    plain = Observer.load_from_registry("static_minmax", base_name="weight", args=group_args)
    with pytest.raises(ValueError, match="TENSOR_GROUP"):
        fuse_observers([*observers(n=2), plain])
    with pytest.raises(ValueError):
        fuse_observers([])
    one = observers(n=1)[0]
    with pytest.raises(ValueError, match="twice"):
        fuse_observers([one, one])
    fuse_observers([one])
    with pytest.raises(ValueError, match="already fused"):
        fuse_observers([one, observers(n=1)[0]])


def test_non_fused_tensor_group_has_global_scale():
    # upstream test_distributed: TENSOR_GROUP StaticMinMax on +-5 gets a global scale
    obs = Observer.load_from_registry("static_minmax", base_name="input", args=nvfp4_args())
    obs(torch.tensor([[[-5.0] * 16, [5.0] * 16]]))
    gs = obs.get_global_scale()
    assert gs is not None and gs.item() == pytest.approx(2688.0 / 5.0)
    channel = Observer.load_from_registry("static_minmax", base_name="weight",
                                          args=QuantizationArgs(strategy="channel"))
    channel(torch.ones(2, 2))
    assert channel.get_global_scale() is None
