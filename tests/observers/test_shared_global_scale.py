"""Observers of a fused group share one global scale from the joint absmax (observers.md 5, 9.6)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

import graphcal.observers
import graphcal.observers.base
from graphcal.observers import MissingStatisticsError, Observer, share_global_scale

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


def shared_and_observed(weights, name="static_minmax"):
    """One observer per weight, sharing one global scale, each having observed its weight."""
    obs = observers(name, len(weights))
    share_global_scale(obs)
    for o, w in zip(obs, weights):
        o(w)
    return obs


def test_fused_members_share_global_scale_of_joint_absmax():
    weights = qkv()
    obs = shared_and_observed(weights)
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
    share_global_scale(obs)
    obs[0](w / 2)
    obs[1](w)
    assert obs[0].get_qparams()["global_scale"].item() == 117.0  # 2688/23 = 116.87 in bf16


def test_fused_mse_uses_searched_ranges():
    weights = qkv()
    weights[1][0, 0] = 20.0  # an outlier the search clips
    obs = shared_and_observed(weights, "memoryless_mse")
    qp = obs[0].get_qparams()
    refs = [reference_search(w, nvfp4_args()) for w in weights]
    absmax = max(max(r[1].max().item(), -r[0].min().item()) for r in refs)
    raw = max(w.abs().max().item() for w in weights)
    assert absmax < raw  # the search shrank the largest group
    assert qp["global_scale"].item() == pytest.approx(2688.0 / absmax, rel=1e-6)


def test_stats_dropped_only_after_every_member():
    weights = qkv()
    obs = shared_and_observed(weights)
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
    share_global_scale(obs)
    obs[0](qkv()[0])
    with pytest.raises(MissingStatisticsError, match="fused"):
        obs[0].get_qparams()


def test_two_member_group_like_gemma_v_proj_none():
    weights = qkv()[:2]
    obs = observers(n=2)
    share_global_scale(obs)
    for o, w in zip(obs, weights):
        o(w)
    joint = torch.cat([w.flatten() for w in weights]).abs().max()
    assert torch.equal(obs[1].get_qparams()["global_scale"], torch.tensor([2688.0]) / joint)


def test_bad_groups_are_refused_with_clear_errors():
    group_args = QuantizationArgs(num_bits=4, strategy="group", group_size=16)
    plain = Observer.load_from_registry("static_minmax", base_name="weight", args=group_args)
    mixed = [*observers(n=2), plain]
    with pytest.raises(ValueError, match=r"TENSOR_GROUP strategy; got static_minmax\('weight'\): group"):
        share_global_scale(mixed)
    with pytest.raises(ValueError, match="at least one observer"):
        share_global_scale([])
    with pytest.raises(TypeError, match="takes observers, got Tensor"):
        share_global_scale([observers(n=1)[0], torch.ones(1)])
    one = observers(n=1)[0]
    with pytest.raises(ValueError, match="same observer twice"):
        share_global_scale([one, one])
    share_global_scale([one])  # a group of one is valid
    other = observers(n=1)[0]
    with pytest.raises(ValueError, match=r"at most one global scale; already sharing one: static_minmax\('weight'\)"):
        share_global_scale([one, other])
    with pytest.raises(ValueError, match="already sharing one"):
        share_global_scale([one])
    # a refused call leaves every observer as it was
    assert all(o.global_scale_peers == (o,) for o in (*mixed, other))
    share_global_scale(mixed[:2])
    share_global_scale([other])


def test_shared_members_get_compressed_tensors_global_scale_of_joint_absmax():
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(16, 48, generator=g) * s for s in (0.7, 2.5, 1.3)]
    weights[2][3, 5] = -20.0  # the joint absmax is a negative value of the last member
    obs = [Observer.load_from_registry(name, base_name="weight", args=nvfp4_args())
           for name in ("memoryless_minmax", "static_minmax", "memoryless_minmax")]
    share_global_scale(obs)
    assert all(o.global_scale_peers == tuple(obs) for o in obs)
    for o, w in zip(obs, weights):
        o(w)
    joint = torch.stack(weights).flatten()
    expected = generate_gparam(joint.min(), joint.max())
    assert expected.item() == pytest.approx(2688.0 / 20.0) and expected.dtype == torch.float32
    for o, w in zip(obs, weights):
        qp = o.get_qparams()
        assert torch.equal(qp["global_scale"], expected)
        mn, mx = group_min_max(w)
        assert torch.equal(qp["scale"], calculate_qparams(mn, mx, nvfp4_args(), global_scale=expected)[0])


def test_base_imports_no_other_observer_module_but_helpers():
    # no import cycle: base stands alone, and nothing it imports comes back to it
    tree = ast.parse(Path(graphcal.observers.base.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in imported if m.startswith("graphcal")} == {"graphcal.observers.helpers"}
    helpers = ast.parse(Path(graphcal.observers.base.__file__).with_name("helpers.py").read_text())
    assert not any(
        (n.module or "").startswith("graphcal") for n in ast.walk(helpers) if isinstance(n, ast.ImportFrom)
    )
    subprocess.run([sys.executable, "-c", "import graphcal.observers.base"], check=True)


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
