"""Min/max observers against llm-compressor's test vectors (observers.md 9.1, 9.3)."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs

from graphcal.observers import Observer


def load(name, base_name, args, **kw):
    return Observer.load_from_registry(name, base_name=base_name, args=args, **kw)


# ---------------------------------------------------------------- 9.1 test_min_max.py
@pytest.mark.parametrize("symmetric,scale,zero_point", [(True, 0.0078, 0), (False, 0.0039, -128)])
def test_ones_scale_and_zero_point(symmetric, scale, zero_point):
    obs = load("minmax", "weight", QuantizationArgs(num_bits=8, symmetric=symmetric))
    obs(torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0]))
    qp = obs.get_qparams()
    assert round(qp["scale"].item(), 4) == scale
    assert qp["zero_point"].item() == zero_point
    assert qp["zero_point"].dtype == torch.int8


def test_random_tensor_symmetric_scale_bound():
    torch.manual_seed(0)
    obs = load("minmax", "weight", QuantizationArgs(num_bits=8, symmetric=True))
    obs(torch.rand(4, 4) * 127)
    qp = obs.get_qparams()
    assert qp["scale"].item() <= 1.0039 and qp["zero_point"].item() == 0


def test_ema_sequence():
    obs = load("minmax", "input", QuantizationArgs(num_bits=8, symmetric=True, strategy="tensor"))
    batches = [[1] * 5, [1] * 5, [127, 1, 1, 1, 1], [1] * 5, [-128, 1, 1, 1, 1]]
    expected_max = [1, 1, 2.26, 2.26, 2.26]
    expected_min = [1, 1, 1, 1, -0.29]
    # upstream tracks the running max of max_vals and running min of min_vals
    running_max, running_min = -float("inf"), float("inf")
    for batch, emax, emin in zip(batches, expected_max, expected_min):
        obs(torch.tensor([batch], dtype=torch.float32))
        running_max = max(running_max, obs.max_vals.max().item())
        running_min = min(running_min, obs.min_vals.min().item())
        assert running_max == pytest.approx(emax, abs=1e-6)
        assert running_min == pytest.approx(emin, abs=1e-6)
    # the EMA itself decays back toward the ones: 2.26 * 0.99 + 1 * 0.01 ... then -128 pulls
    assert obs.max_vals.item() == pytest.approx((2.26 * 0.99 + 0.01) * 0.99 + 0.01, abs=1e-5)


# ---------------------------------------------------------------- 9.3 test_observers.py
SEQUENCES = {
    "memoryless_minmax": ([0, -3, -1], [0, 1, 3], {}),
    "static_minmax": ([0, -3, -3], [0, 1, 3], {}),
    "minmax": ([0, -0.3, -0.37], [0, 0.1, 0.39], {"averaging_constant": 0.1}),
    "memoryless_mse": ([0, -3, -1], [0, 1, 3], {}),
    "mse": ([0, -0.3, -0.37], [0, 0.1, 0.39], {"averaging_constant": 0.1}),
}


@pytest.mark.parametrize("name", sorted(SEQUENCES))
def test_observer_min_max_vals(name):
    mins, maxs, kw = SEQUENCES[name]
    args = QuantizationArgs(strategy="tensor")
    obs = load(name, "input", args, **kw)
    for batch, emin, emax in zip([[0.0, 0.0], [-3.0, 1.0], [-1.0, 3.0]], mins, maxs):
        obs(torch.tensor(batch))
        torch.testing.assert_close(obs.min_vals, torch.tensor([float(emin)]))
        torch.testing.assert_close(obs.max_vals, torch.tensor([float(emax)]))
    if "minmax" == name or "mse" == name:
        assert obs.get_qparams()["scale"].item() == pytest.approx(0.39 / 127.5, rel=1e-6)


def test_first_ema_batch_is_not_lerped_from_zero():
    obs = load("minmax", "input", QuantizationArgs())
    obs(torch.tensor([[[2.0, 5.0]]]))
    assert obs.min_vals.item() == 2.0 and obs.max_vals.item() == 5.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision_stats_keep_dtype(dtype):
    torch.manual_seed(1)
    a = torch.randn(2, 3, 8).to(dtype)
    b = torch.randn(2, 3, 8).to(dtype)
    args = QuantizationArgs(strategy="group", group_size=4)
    static = load("static_minmax", "input", args)
    ema = load("minmax", "input", args, averaging_constant=0.25)
    for obs in (static, ema):
        obs(a)
        obs(b)
        assert obs.min_vals.dtype == dtype
    ga = a.reshape(-1, 2, 4)
    gb = b.reshape(-1, 2, 4)
    expected = torch.maximum(ga.amax(dim=(0, 2)), gb.amax(dim=(0, 2)))
    assert torch.equal(static.max_vals, expected)
    lerp = ga.amin(dim=(0, 2)) * 0.75 + gb.amin(dim=(0, 2)) * 0.25  # computed in `dtype`
    assert torch.equal(ema.min_vals, lerp)
    qp = static.get_qparams()
    assert qp["scale"].dtype == dtype  # ct: scale dtype follows the statistics


def test_memoryless_forgets_previous_batches():
    obs = load("memoryless_minmax", "output", QuantizationArgs(strategy="tensor"))
    obs(torch.full((1, 2, 3), 9.0))
    obs(torch.full((1, 2, 3), -1.0))
    assert obs.max_vals.item() == -1.0
