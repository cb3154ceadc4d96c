"""MSE observers: llm-compressor's vectors (observers.md 9.2) and a brute-force reference.

The reference below scores each candidate range by fake-quantizing the whole weight with
compressed-tensors in its own strategy (group/channel/tensor layout, not the observer's
flattened broadcast), then applies the documented rules: p = 1 - i/grid for
i < int(maxshrink*grid), strict ``<`` per qparam, one global patience counter.
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

from graphcal.observers import Observer


def load(name, args, base_name="weight", **kw):
    return Observer.load_from_registry(name, base_name=base_name, args=args, **kw)


# ---------------------------------------------------------------- reference
def _per_qparam(t: torch.Tensor, args: QuantizationArgs, reduce: str) -> torch.Tensor:
    """Reduce a 2-D weight-shaped tensor to its qparam shape (amin/amax/sum)."""
    rows, cols = t.shape
    if args.strategy == "block":
        bh, bw = args.block_structure
        padded = torch.zeros(-(-rows // bh) * bh, -(-cols // bw) * bw, dtype=t.dtype)
        padded[:rows, :cols] = t
        view = padded.reshape(padded.shape[0] // bh, bh, padded.shape[1] // bw, bw)
        if reduce == "sum":
            return view.sum(dim=(1, 3))
        return getattr(torch, reduce)(view, dim=(1, 3))
    if args.strategy == "tensor":
        view, dims, keep = t.reshape(-1), (0,), True
    elif args.strategy == "channel":
        view, dims, keep = t, (1,), True
    else:  # group / tensor_group
        view, dims, keep = t.reshape(rows, cols // args.group_size, args.group_size), (2,), False
    if reduce == "sum":
        return view.sum(dim=dims, keepdim=keep)
    return getattr(torch, reduce)(view, dim=dims, keepdim=keep)


def reference_search(w, args, *, maxshrink=0.2, grid=100.0, norm=2.4, patience=5, expand=1.0,
                     importance=None, endpoint=False, error_dtype=None):
    """Brute-force min/max search on a 2-D weight (see module docstring)."""
    if args.strategy == "tensor_group":
        args = args.model_copy(update={"scale_dtype": None})
    min0 = _per_qparam(w, args, "amin") * expand
    max0 = _per_qparam(w, args, "amax") * expand
    steps = int(maxshrink * grid)
    if endpoint:  # imatrix variant
        steps = max(1, steps) + 1
    best_err = None
    best_min, best_max = min0.clone(), max0.clone()
    stalled = 0
    for i in range(steps):
        p = 1 - i / grid
        cmin, cmax = min0 * p, max0 * p
        scale, zp = calculate_qparams(cmin, cmax, args)
        fq = fake_quantize(w, scale, zp, args).to(w.dtype)
        if error_dtype is not None:
            diff = (fq.to(error_dtype) - w.to(error_dtype)).abs() ** norm
        else:
            diff = (fq - w).abs() ** norm
        if importance is not None:
            diff = diff * importance
        err = _per_qparam(diff, args, "sum")
        if best_err is None:
            best_err = torch.full_like(err, torch.finfo(err.dtype).max)
        better = err < best_err
        if better.any():
            best_err = torch.where(better, err, best_err)
            best_min = torch.where(better, cmin, best_min)
            best_max = torch.where(better, cmax, best_max)
            stalled = 0
        else:
            stalled += 1
            if patience and stalled >= patience:
                break
    return best_min, best_max


def qdq_loss(w, args, qp):
    fq = fake_quantize(w, qp["scale"], qp["zero_point"], args, global_scale=qp["global_scale"])
    return torch.sum((w - fq) ** 2) / w.numel()


# ---------------------------------------------------------------- 9.2 vectors
LOSSES = {
    ("tensor", True): 4.8103e-06, ("tensor", False): 1.1258e-06,
    ("channel", True): 2.5675e-06, ("channel", False): 2.3696e-07,
    ("group", True): 3.1282e-06, ("group", False): 1.3794e-07,
    ("block", True): 2.8968e-06, ("block", False): 5.6068e-07,
}
EXTRA = {"tensor": {}, "channel": {}, "group": {"group_size": 2}, "block": {"block_structure": [3, 2]}}


@pytest.mark.parametrize("strategy,symmetric", sorted(LOSSES))
def test_upstream_mse_losses(strategy, symmetric):
    t = torch.arange(24).reshape(6, 4) / 24
    args = QuantizationArgs(num_bits=8, symmetric=symmetric, strategy=strategy, **EXTRA[strategy])
    obs = load("mse", args)
    obs(t)
    raw_min, raw_max = obs.min_vals.clone(), obs.max_vals.clone()
    loss = qdq_loss(t, args, obs.get_qparams())
    assert loss.item() == pytest.approx(LOSSES[strategy, symmetric], abs=1e-10)
    # p = 1 wins in all eight cases: the searched range equals the raw one
    mm = load("memoryless_minmax", args)
    mm(t)
    assert torch.equal(raw_min, mm.min_vals) and torch.equal(raw_max, mm.max_vals)


def test_random_symmetric_scale_bound():
    torch.manual_seed(0)
    obs = load("mse", QuantizationArgs(num_bits=8, symmetric=True))
    obs(torch.rand(4, 4) * 127)
    qp = obs.get_qparams()
    assert qp["scale"].item() <= 1.0039 and qp["zero_point"].item() == 0


def test_fp4_tensor_group_bf16():
    w = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6) / 24
    args = QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=3)
    obs = load("mse", args)
    obs(w)
    qp = obs.get_qparams()
    assert qp["global_scale"].dtype == torch.float32
    assert qp["global_scale"].item() == 2912.0  # 2688 / 0.921875, rounded in bf16
    torch.testing.assert_close(qp["scale"][0].float(), torch.tensor([40.523, 91.0]), atol=1e-3, rtol=0)
    fq = fake_quantize(w, qp["scale"], qp["zero_point"], args, global_scale=qp["global_scale"])
    loss = torch.nn.functional.mse_loss(fq.float(), w.float()).item()
    assert loss <= 0.0015
    assert loss == pytest.approx(0.000847, abs=5e-6)


# ---------------------------------------------------------------- shrinking cases
def outlier_weight(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 64, generator=g)
    rows = torch.arange(0, 16, 2)
    cols = torch.randint(0, 64, (8,), generator=g)
    w[rows, cols] = 6.0 * torch.sign(torch.randn(8, generator=g))
    return w.to(dtype)


CASES = [
    ("channel", True, {}), ("channel", False, {}),
    ("group", True, {"group_size": 16}), ("group", False, {"group_size": 16}),
    ("tensor", True, {}), ("tensor", False, {}),
]


@pytest.mark.parametrize("strategy,symmetric,extra", CASES)
@pytest.mark.parametrize("patience", [1, 5, 1000])
def test_memoryless_mse_matches_brute_force(strategy, symmetric, extra, patience):
    w = outlier_weight()
    args = QuantizationArgs(num_bits=4, symmetric=symmetric, strategy=strategy, **extra)
    obs = load("memoryless_mse", args, patience=patience)
    obs(w)
    ref_min, ref_max = reference_search(w, args, patience=patience)
    assert torch.equal(obs.min_vals, ref_min) and torch.equal(obs.max_vals, ref_max)
    if strategy != "tensor":
        raw_max = _per_qparam(w, args, "amax")
        shrunk = obs.max_vals != raw_max
        assert shrunk.any()  # the search really moves away from p = 1
    qp = obs.get_qparams()
    expected_scale, expected_zp = calculate_qparams(ref_min, ref_max, args)
    assert torch.equal(qp["scale"], expected_scale) and torch.equal(qp["zero_point"], expected_zp)


@pytest.mark.parametrize("symmetric", [True, False])
def test_padded_blocks_match_brute_force(symmetric):
    # (10, 14) in 4x4 blocks: padded with zeros to (12, 16), qparams (3, 4)
    w = outlier_weight()[:10, :14] + 0.5
    args = QuantizationArgs(num_bits=4, symmetric=symmetric, strategy="block", block_structure=[4, 4])
    obs = load("memoryless_mse", args)
    obs(w)
    ref_min, ref_max = reference_search(w, args)
    assert obs.min_vals.shape == (3, 4)
    assert torch.equal(obs.min_vals, ref_min) and torch.equal(obs.max_vals, ref_max)
    assert (obs.max_vals != _per_qparam(w, args, "amax")).any()
    assert (ref_min[-1] <= 0).all()  # the padding zeros are part of the bottom blocks
    qp = obs.get_qparams()
    fq = fake_quantize(w, qp["scale"], qp["zero_point"], args)
    assert fq.shape == w.shape


def test_global_patience_changes_the_result():
    # this data is bumpy enough that stopping after one stalled step matters
    w = outlier_weight()
    args = QuantizationArgs(num_bits=4, symmetric=False, strategy="tensor")
    results = []
    for patience in (1, 1000):
        obs = load("memoryless_mse", args, patience=patience)
        obs(w)
        results.append(obs.max_vals)
        assert torch.equal(obs.max_vals, reference_search(w, args, patience=patience)[1])
    assert not torch.equal(*results)


def test_patience_is_global_not_per_qparam():
    # A per-row stall counter (each row searched on its own with patience 1) gives other
    # rows than one counter that resets whenever any row improves.
    w = outlier_weight()
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="channel")
    obs = load("memoryless_mse", args, patience=1)
    obs(w)
    row_args = QuantizationArgs(num_bits=4, symmetric=True, strategy="tensor")
    per_row = torch.stack([reference_search(w[r : r + 1], row_args, patience=1)[1] for r in range(16)])
    assert not torch.equal(obs.max_vals, per_row)
    assert torch.equal(obs.max_vals, reference_search(w, args, patience=1)[1])


def test_last_factor_is_0_81_not_0_80():
    g = torch.Generator().manual_seed(0)
    w = torch.rand(1, 4000, generator=g) * 2 - 1
    w[0, 0] = 3.0  # a lone outlier: the optimum lies far below 0.8
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="tensor")
    wide = load("memoryless_mse", args, maxshrink=0.6, patience=1000)
    wide(w)
    assert wide.max_vals.item() < 3.0 * 0.8
    obs = load("memoryless_mse", args)
    obs(w)
    assert torch.equal(obs.max_vals, torch.tensor([3.0]) * (1 - 19 / 100))
    assert torch.equal(obs.min_vals, w.min().reshape(1) * (1 - 19 / 100))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision_matches_brute_force(dtype):
    w = outlier_weight(dtype)
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=16)
    obs = load("memoryless_mse", args)
    obs(w)
    assert obs.min_vals.dtype == dtype
    ref_min, ref_max = reference_search(w, args)
    assert torch.equal(obs.min_vals, ref_min) and torch.equal(obs.max_vals, ref_max)


def test_moving_average_mse_is_ema_of_searched_ranges():
    a = outlier_weight(seed=1).reshape(2, 8, 64)
    b = outlier_weight(seed=2).reshape(2, 8, 64) * 0.5
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=16)
    obs = load("mse", args, base_name="input", averaging_constant=0.3)
    obs(a)
    obs(b)
    # activation (2, 8, 64) flattens to (16, 4, 16): group g is column block g of all 16
    # tokens, searched like one tensor
    ra = reference_search_act(a, args)
    rb = reference_search_act(b, args)
    torch.testing.assert_close(obs.min_vals, ra[0] * 0.7 + rb[0] * 0.3, rtol=0, atol=0)
    torch.testing.assert_close(obs.max_vals, ra[1] * 0.7 + rb[1] * 0.3, rtol=0, atol=0)


def reference_search_act(x, args, **kw):
    """Per-group search for a (B, S, H) activation: group g holds column block g of every token."""
    h = x.shape[-1]
    gs = args.group_size
    mins, maxs = [], []
    for g in range(h // gs):
        block = x[..., g * gs : (g + 1) * gs].reshape(1, -1)
        tensor_args = args.model_copy(update={"strategy": "tensor", "group_size": None})
        mn, mx = reference_search(block, tensor_args, **kw)
        mins.append(mn)
        maxs.append(mx)
    return torch.cat(mins), torch.cat(maxs)


# ---------------------------------------------------------------- expanded NVFP4
@pytest.mark.parametrize("name", ["nvfp4_expanded_mse", "fouroversix"])
def test_nvfp4_expanded_matches_brute_force(name, recwarn):
    w = outlier_weight()
    args = QuantizationArgs(
        num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16,
        scale_dtype=torch.float8_e4m3fn,
    )
    obs = load(name, args)
    obs(w)
    ref_min, ref_max = reference_search(
        w, args, maxshrink=1 - 0.8 / 1.8, grid=200, patience=1000, expand=1.8
    )
    assert torch.equal(obs.min_vals, ref_min) and torch.equal(obs.max_vals, ref_max)
    # the expanded start is really searched: some groups end above their observed range
    assert (obs.max_vals > _per_qparam(w, args, "amax")).any()
    qp = obs.get_qparams()
    absmax = torch.maximum(ref_max.max(), -ref_min.min())
    gs = generate_gparam(-absmax, absmax)
    scale, zp = calculate_qparams(ref_min, ref_max, args, global_scale=gs)
    assert torch.equal(qp["global_scale"], gs)
    assert torch.equal(qp["scale"], scale) and torch.equal(qp["zero_point"], zp)


# ---------------------------------------------------------------- upstream mse-vs-minmax
@pytest.mark.parametrize("std", [0.05, 0.2, 1.0])
@pytest.mark.parametrize(
    "num_bits,strategy,extra",
    [(8, "tensor", {}), (8, "channel", {}), (4, "tensor_group", {"group_size": 32}), (4, "channel", {})],
)
@pytest.mark.parametrize("symmetric", [True, False])
def test_mse_not_worse_than_minmax(std, num_bits, strategy, extra, symmetric):
    torch.manual_seed(42)
    w = torch.randn(128, 256) * std
    args = QuantizationArgs(num_bits=num_bits, symmetric=symmetric, strategy=strategy, **extra)
    losses = {}
    for name in ("memoryless_minmax", "memoryless_mse"):
        obs = load(name, args)
        obs(w)
        losses[name] = qdq_loss(w, args, obs.get_qparams()).item()
    if strategy == "tensor" and symmetric:
        assert losses["memoryless_mse"] <= losses["memoryless_minmax"] + 1e-8
    else:
        assert losses["memoryless_mse"] <= losses["memoryless_minmax"] * 1.10


# ---------------------------------------------------------------- large tensors, in-place scoring
def _eager_scores(observed, args, norm, factors):
    """llm-compressor's eager scoring, allocation by allocation: compressed-tensors' fake_quantize
    with the search args (strategy token, plain broadcast), then sum |q - x|^norm over dims (0, -1)."""
    from graphcal.observers.mse import search_args

    cargs = search_args(args)
    min0, max0 = torch.amin(observed, dim=(0, -1)), torch.amax(observed, dim=(0, -1))
    out = []
    for p in factors:
        scale, zp = calculate_qparams(min0 * p, max0 * p, cargs)
        q = fake_quantize(observed, scale.unsqueeze(-1), zp.unsqueeze(-1), cargs).to(observed.dtype)
        out.append((q - observed).abs().pow(norm).sum(dim=(0, -1)))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("base_name, strategy, extra", [
    ("input", "tensor", {}), ("input", "group", {"group_size": 128}),
    ("k", "attn_head", {}), ("weight", "channel", {}), ("weight", "block", {"block_structure": [128, 128]}),
])
def test_batched_scores_agree_with_the_eager_scores(dtype, symmetric, base_name, strategy, extra):
    """On activation-sized tensors (many chunks, strided views) the chunked, candidate-batched error
    of every candidate is llm-compressor's eager one: bit for bit in bf16 (scored its way), within a
    few millionths in fp32 (exp/log for the 2.4 power, sums chunk by chunk)."""
    from graphcal.observers.helpers import flatten_for_calibration
    from graphcal.observers.mse import Scores, search_args

    g = torch.Generator().manual_seed(3)
    shape = {"input": (4, 256, 512), "k": (2, 4, 256, 64), "weight": (384, 640)}[base_name]
    x = (torch.randn(shape, generator=g) * torch.rand(shape[-1], generator=g) * 4).to(dtype)
    args = QuantizationArgs(num_bits=8, symmetric=symmetric, strategy=strategy, **extra)
    observed = flatten_for_calibration(x, base_name, args)
    factors = [1 - i / 100 for i in range(0, 20, 3)]
    expected = torch.stack(_eager_scores(observed, args, 2.4, factors))
    cargs = search_args(args)
    min0, max0 = torch.amin(observed, dim=(0, -1)), torch.amax(observed, dim=(0, -1))
    scale, zp = calculate_qparams(torch.stack([min0 * p for p in factors]),
                                  torch.stack([max0 * p for p in factors]), cargs)
    got = Scores(observed, 2.4, None, observed.dtype)(scale, zp, cargs)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=5e-6, atol=0)
        assert not torch.equal(got, expected)  # really the fast route, not the eager one
    else:
        assert torch.equal(got, expected)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("base_name, strategy, extra", [
    ("input", "tensor", {}), ("input", "group", {"group_size": 64}),
    ("weight", "channel", {}), ("weight", "group", {"group_size": 32}),
])
def test_fast_search_picks_the_eager_search_ranges(seed, symmetric, base_name, strategy, extra):
    """The observer on heavy-tailed, activation-sized tensors keeps llm-compressor's candidate for every
    qparam: the eager search below is its code path (fake_quantize, pow, one sum per candidate)."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, 128, 384) if base_name == "input" else (256, 384)
    x = torch.randn(shape, generator=g) * torch.rand(shape[-1], generator=g).pow(3) * 8
    x.view(-1)[torch.randint(0, x.numel(), (20,), generator=g)] *= 12  # outliers, so ranges shrink
    args = QuantizationArgs(num_bits=int(4 + 4 * (seed % 2)), symmetric=symmetric, strategy=strategy, **extra)
    obs = load("memoryless_mse", args, base_name=base_name, patience=5 if seed < 3 else 1000)
    obs(x)
    from graphcal.observers.helpers import flatten_for_calibration

    observed = flatten_for_calibration(x, base_name, args)
    ref_min, ref_max = _eager_search(observed, args, patience=5 if seed < 3 else None)
    assert torch.equal(obs.min_vals, ref_min) and torch.equal(obs.max_vals, ref_max)


@pytest.mark.parametrize("args", [
    QuantizationArgs(num_bits=8, symmetric=True, strategy="channel"),
    QuantizationArgs(num_bits=4, symmetric=False, strategy="channel"),
    QuantizationArgs(num_bits=8, type="float", strategy="channel"),
], ids=["int8-sym", "int4-asym", "fp8"])
@pytest.mark.parametrize("importance", [False, True])
@pytest.mark.parametrize("piece", [5000, 300])
def test_transposed_weights_are_scored_as_they_lie(args, importance, piece):
    """A MatMul weight is stored [in, out] and observed through a transpose as [out, in]: Scores reads
    it as it lies, (N, G, Q) with the qparams last, in chunks of whole rows (5000 elements: 13 rows of
    384) or of part of a row (300: every row in two pieces). Every candidate's error is still llm-compressor's eager one, weighted by
    an importance where there is one, and the search keeps the eager search's candidates."""
    import graphcal.observers.mse as mse
    from graphcal.observers.helpers import flatten_for_calibration

    g = torch.Generator().manual_seed(7)
    stored = torch.randn(640, 384, generator=g) * torch.rand(384, generator=g).pow(2) * 3  # [in, out]
    stored.view(-1)[torch.randint(0, stored.numel(), (30,), generator=g)] *= 10
    observed = flatten_for_calibration(stored.T, "weight", args)  # (1, out, 1, in), strided
    imp = torch.rand(1, 1, 1, 640, generator=g) + 0.1 if importance else None
    factors = [1 - i / 100 for i in range(0, 20, 2)]
    cargs = mse.search_args(args)
    min0, max0 = torch.amin(observed, dim=(0, -1)), torch.amax(observed, dim=(0, -1))
    scale, zp = calculate_qparams(torch.stack([min0 * p for p in factors]),
                                  torch.stack([max0 * p for p in factors]), cargs)
    expected = []
    for i in range(len(factors)):
        q = fake_quantize(observed, scale[i].unsqueeze(-1), zp[i].unsqueeze(-1), cargs)
        err = (q - observed).abs().pow(2.4)
        expected.append((err if imp is None else imp * err).sum(dim=(0, -1)))
    chunk = mse.CHUNK_ELEMENTS["cpu"]
    try:
        mse.CHUNK_ELEMENTS["cpu"] = mse.MAX_CANDIDATES * piece
        scores = mse.Scores(observed, 2.4, imp, torch.float32)
    finally:
        mse.CHUNK_ELEMENTS["cpu"] = chunk
    assert scores._qlast and len(scores._chunks) > 10  # the path under test, in many pieces
    got = scores(scale, zp, cargs)
    torch.testing.assert_close(got, torch.stack(expected), rtol=5e-6, atol=0)
    best = mse.shrink_search(observed, args, [1 - i / 100 for i in range(20)], norm=2.4, patience=5,
                             importance=imp)
    dense = mse.shrink_search(observed.contiguous(), args, [1 - i / 100 for i in range(20)], norm=2.4,
                              patience=5, importance=imp)
    assert torch.equal(best[0], dense[0]) and torch.equal(best[1], dense[1])
    if imp is None:
        ref = _eager_search(observed, args, patience=5)
        assert torch.equal(best[0], ref[0]) and torch.equal(best[1], ref[1])


def _eager_search(observed, args, *, patience, maxshrink=0.2, grid=100.0, norm=2.4):
    """llm-compressor's eager loop on a flattened tensor: one candidate at a time."""
    factors = [1 - i / grid for i in range(int(maxshrink * grid))]
    min0, max0 = torch.amin(observed, dim=(0, -1)), torch.amax(observed, dim=(0, -1))
    best = torch.full(min0.shape, torch.finfo(observed.dtype).max)
    best_min, best_max, stalled = min0.clone(), max0.clone(), 0
    for p, err in zip(factors, _eager_scores(observed, args, norm, factors)):
        better = err < best
        if better.any():
            best = torch.where(better, err, best)
            best_min, best_max = torch.where(better, min0 * p, best_min), torch.where(better, max0 * p, best_max)
            stalled = 0
        else:
            stalled += 1
            if patience is not None and stalled >= patience:
                break
    return best_min, best_max


def test_float_candidates_are_fake_quantized_by_compressed_tensors():
    from graphcal.observers.mse import Scores, search_args

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 96, 64, generator=g).reshape(-1, 1, 64)
    fp8 = search_args(QuantizationArgs(num_bits=8, type="float", strategy="tensor"))
    factors = [1.0, 0.97, 0.9]
    scale, zp = calculate_qparams(torch.stack([x.amin().reshape(1) * p for p in factors]),
                                  torch.stack([x.amax().reshape(1) * p for p in factors]), fp8)
    got = Scores(x, 2.0, None, torch.float32)(scale, zp, fp8)  # norm 2: pow by multiplication
    want = torch.stack([((fake_quantize(x, scale[i].unsqueeze(-1), zp[i].unsqueeze(-1), fp8) - x) ** 2).sum((0, -1))
                        for i in range(3)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
