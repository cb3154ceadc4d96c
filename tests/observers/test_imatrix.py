"""imatrix observers: accumulation, the weighted search against a brute-force reference,
fallbacks and their strict errors (observers.md 4 and 9.6)."""

from __future__ import annotations

import warnings

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

from graphcal.observers import IMatrixFallbackWarning, Observer

from .test_mse import reference_search

INT4_CHANNEL = dict(num_bits=4, symmetric=True, strategy="channel")


def load(name="imatrix_mse", base_name="weight", args=None, **kw):
    args = args or QuantizationArgs(**INT4_CHANNEL)
    return Observer.load_from_registry(name, base_name=base_name, args=args, **kw)


def weight(rows=16, cols=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    w[torch.arange(0, rows, 2), torch.randint(0, cols, (rows // 2,), generator=g)] *= 5
    return w


def activations(cols=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 5, cols, generator=g) * torch.linspace(0.1, 3.0, cols)


def normalised_importance(x: torch.Tensor, rows: int) -> torch.Tensor:
    flat = x.float().reshape(-1, x.shape[-1])
    imp = (flat**2).sum(0) / flat.shape[0]
    imp = imp / (imp.mean() + torch.finfo(torch.float32).tiny)
    return imp.expand(rows, -1)


def imatrix_reference(w, args, imp, **kw):
    params = dict(maxshrink=0.95, grid=20, norm=3.0, patience=5)
    params.update(kw)
    return reference_search(w, args, importance=imp, endpoint=True, error_dtype=torch.float32, **params)


def test_accumulation_matches_upstream_hook_vector():
    obs = load(args=QuantizationArgs(**INT4_CHANNEL))
    x = torch.ones(2, 3, 8)
    x[..., 0] = 2
    obs.accumulate_importance(x)
    assert obs._imatrix_count.item() == 6 and obs._imatrix_count.dtype == torch.int64
    assert obs._imatrix_sum.tolist() == [24, 6, 6, 6, 6, 6, 6, 6]
    assert obs._imatrix_sum.dtype == torch.float32
    obs.accumulate_importance(torch.ones(8, dtype=torch.bfloat16))  # 1-D: one more token
    assert obs._imatrix_count.item() == 7 and obs._imatrix_sum[1].item() == 7
    with pytest.raises(ValueError, match="size mismatch"):
        obs.accumulate_importance(torch.ones(1, 9))


@pytest.mark.parametrize(
    "strategy,extra", [("channel", {}), ("group", {"group_size": 16}), ("tensor_group", {"group_size": 16})]
)
def test_weighted_search_matches_brute_force(strategy, extra):
    w, x = weight(), activations()
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy=strategy, **extra)
    obs = load(args=args)
    obs.accumulate_importance(x[:1])
    obs.accumulate_importance(x[1:])
    obs(w)
    qp = obs.get_qparams()
    ref_min, ref_max = imatrix_reference(w, args, normalised_importance(x, w.shape[0]))
    expected_gs = None
    if strategy == "tensor_group":
        absmax = torch.maximum(ref_max.max(), -ref_min.min())
        expected_gs = generate_gparam(-absmax, absmax)
        assert torch.equal(qp["global_scale"], expected_gs)
    expected_scale, _ = calculate_qparams(ref_min, ref_max, args, global_scale=expected_gs)
    assert torch.equal(qp["scale"], expected_scale)
    uniform = imatrix_reference(w, args, None)
    assert not torch.equal(uniform[1], ref_max)  # the importance really changed the result


def test_nvfp4_expanded_imatrix_matches_brute_force():
    w, x = weight(), activations()
    args = QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="tensor_group",
                            group_size=16, scale_dtype=torch.float8_e4m3fn)
    obs = load("nvfp4_expanded_imatrix", args=args)
    obs.accumulate_importance(x)
    obs(w)
    obs._finalize()
    ref_min, ref_max = imatrix_reference(
        w, args, normalised_importance(x, w.shape[0]),
        maxshrink=1 - 0.8 / 1.8, grid=200, norm=2.4, patience=1000, expand=1.8,
    )
    assert torch.equal(obs.min_vals, ref_min) and torch.equal(obs.max_vals, ref_max)


def test_ones_importance_equals_memoryless_mse_grid_20():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="channel")
    imx = load(args=args, norm=2.4, maxshrink=0.2)
    imx.accumulate_importance(torch.ones(4, 64))
    imx(w)
    mse = load("memoryless_mse", args=args, grid=20)
    mse(w)
    a, b = imx.get_qparams(), mse.get_qparams()
    torch.testing.assert_close(a["scale"], b["scale"])
    assert torch.equal(a["zero_point"], b["zero_point"])


def test_skewed_importance_changes_scales():
    # upstream: importance [1000]*4 + [.01]*4 on an 8-wide layer. Each result is the weighted
    # brute-force search's (importance sum / count, normalised by its mean) through
    # compressed-tensors' calculate_qparams; that the two differ is upstream's own assertion.
    w = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="channel")
    scales = []
    for sq in (torch.ones(8), torch.tensor([1000.0] * 4 + [0.01] * 4)):
        obs = load(args=args)
        obs.load_stats({"_imatrix_sum": sq, "_imatrix_count": torch.tensor(1)})
        obs(w)
        scales.append(obs.get_qparams()["scale"])
        imp = (sq / (sq.mean() + torch.finfo(torch.float32).tiny)).expand(w.shape[0], -1)
        expected, _ = calculate_qparams(*imatrix_reference(w, args, imp), args)
        assert torch.equal(scales[-1], expected)
    assert not torch.equal(*scales)


def test_importance_after_weight_is_still_used():
    w, x = weight(), activations()
    before = load()
    before.accumulate_importance(x)
    before(w)
    after = load()
    after(w)
    after.accumulate_importance(x)
    assert torch.equal(before.get_qparams()["scale"], after.get_qparams()["scale"])


def uniform_scale(w, args):
    obs = load(args=args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obs(w)
        return obs.get_qparams()["scale"]


BAD_IMPORTANCE = {
    "non-finite": torch.tensor([float("nan")] + [1.0] * 63),
    "negative": torch.tensor([-1.0] + [1.0] * 63),
    "all zeros": torch.zeros(64),
    "size mismatch": torch.ones(32),
}


@pytest.mark.parametrize("reason", sorted(BAD_IMPORTANCE))
def test_bad_importance_falls_back_to_uniform(reason):
    w = weight()
    args = QuantizationArgs(**INT4_CHANNEL)
    obs = load(args=args)
    obs.load_stats({"_imatrix_sum": BAD_IMPORTANCE[reason], "_imatrix_count": torch.tensor(3)})
    obs(w)
    with pytest.warns(IMatrixFallbackWarning, match=reason):
        scale = obs.get_qparams()["scale"]
    ref_min, ref_max = imatrix_reference(w, args, None)
    assert torch.equal(scale, calculate_qparams(ref_min, ref_max, args)[0])
    strict = load(args=args, strict=True)
    strict.load_stats({"_imatrix_sum": BAD_IMPORTANCE[reason], "_imatrix_count": torch.tensor(3)})
    strict(w)
    with pytest.raises(ValueError, match=reason):
        strict.get_qparams()


def test_no_importance_falls_back():
    w = weight()
    obs = load()
    obs(w)
    with pytest.warns(IMatrixFallbackWarning, match="no importance"):
        obs.get_qparams()
    strict = load(strict=True)
    strict(w)
    with pytest.raises(ValueError, match="no importance"):
        strict.get_qparams()


def test_tensor_strategy_falls_back():
    args = QuantizationArgs(num_bits=4, strategy="tensor")
    obs = load(args=args)
    obs.accumulate_importance(activations())
    obs(weight())
    with pytest.warns(IMatrixFallbackWarning, match="TENSOR strategy"):
        obs.get_qparams()
    strict = load(args=args, strict=True)
    strict(weight())
    with pytest.raises(ValueError, match="TENSOR strategy"):
        strict.get_qparams()


def test_block_strategy_falls_back():
    args = QuantizationArgs(num_bits=4, strategy="block", block_structure=[4, 16])
    obs = load(args=args)
    obs.accumulate_importance(activations())
    obs(weight())
    with pytest.warns(IMatrixFallbackWarning, match="block"):
        obs.get_qparams()


def test_activation_observer_falls_back():
    x = activations().reshape(1, 10, 64)
    obs = load(base_name="input", args=QuantizationArgs(num_bits=8, strategy="tensor"))
    assert obs.sync_ops == {} and not obs.needs_activations
    with pytest.warns(IMatrixFallbackWarning, match="weight observers"):
        obs(x)
    ref = imatrix_reference(x.reshape(1, -1), QuantizationArgs(num_bits=8, strategy="tensor"), None)
    assert torch.equal(obs.max_vals, ref[1])
    strict = load(base_name="input", args=QuantizationArgs(num_bits=8, strategy="tensor"), strict=True)
    with pytest.raises(ValueError, match="weight observers"):
        strict(x)


def test_stats_deleted_after_get_qparams_and_reobserve():
    w, x = weight(), activations()
    obs = load()
    obs.accumulate_importance(x)
    obs(w)
    assert obs.has_statistics and obs.sync_ops == {"_imatrix_sum": "sum", "_imatrix_count": "sum"}
    first = obs.get_qparams()["scale"]
    assert not obs.has_statistics and obs.state_dict_stats() == {}
    obs.accumulate_importance(x)
    obs(w)
    assert torch.equal(obs.get_qparams()["scale"], first)


@pytest.mark.parametrize("maxshrink,last_p", [(0.2, 0.8), (0.01, 0.95)])
def test_search_includes_endpoint_and_at_least_one_step(maxshrink, last_p):
    # a lone outlier: shrinking keeps paying off past every factor tried, so the search
    # ends on its last factor: 1 - max(1, int(maxshrink*grid))/grid (endpoint included)
    g = torch.Generator().manual_seed(0)
    w = torch.rand(1, 4000, generator=g) * 2 - 1
    w[0, 0] = 3.0
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="channel")
    obs = load(args=args, maxshrink=maxshrink, patience=0)
    obs.accumulate_importance(torch.ones(2, 4000))
    obs(w)
    obs._finalize()
    assert torch.equal(obs.max_vals, torch.tensor([[3.0]]) * last_p)
    mse = load("memoryless_mse", args=args, grid=20, maxshrink=maxshrink)
    mse(w)
    if maxshrink == 0.2:  # the plain MSE search stops one factor earlier
        assert torch.equal(mse.max_vals, torch.tensor([[3.0]]) * 0.85)
