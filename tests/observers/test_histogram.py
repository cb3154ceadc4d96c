"""Histogram observers: percentile and entropy against onnxruntime's calibrators, histogram_mse
against the exact search, and the histogram's exact merging (batches, ranks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from onnxruntime.quantization.calibrate import HistogramCollector

from graphcal.observers import Observer
from graphcal.observers.histogram import (
    add_to_histogram,
    entropy_window,
    merge_histograms,
    percentile_edge,
)

SYM = QuantizationArgs(num_bits=8, symmetric=True, strategy="tensor")
ASYM = QuantizationArgs(num_bits=8, symmetric=False, strategy="tensor")


def load(name, args=SYM, base_name="input", **kw):
    return Observer.load_from_registry(name, base_name=base_name, args=args, **kw)


def batches(seed, n=4, shape=(2, 64, 96), skew=0.0):
    """Heavy-tailed activations whose range grows from batch to batch (so histograms widen)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(shape, generator=g) * torch.rand(shape[-1], generator=g).pow(2) * (1 + i)
        x.view(-1)[torch.randint(0, x.numel(), (5,), generator=g)] *= 2 + 3 * i  # outliers, wider each batch
        out.append(x + skew)
    return out


def ort_collector(method, xs, symmetric, num_bins, quantized_bins=128, percentile=99.999):
    collector = HistogramCollector(method, symmetric, num_bins, quantized_bins, percentile, "same")
    for x in xs:
        collector.collect({"t": x.numpy()})
    return collector


# ---------------------------------------------------------------- the rules, on onnxruntime's own histograms
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("percentile", [99.0, 99.9, 99.999])
def test_percentile_edge_is_onnxruntimes_rule(seed, percentile, capsys):
    xs = batches(seed)
    for symmetric in (True, False):
        collector = ort_collector("percentile", xs, symmetric, 2048, percentile=percentile)
        hist, edges, lo, hi = collector.histogram_dict["t"][:4]
        want = collector.compute_percentile()["t"][:2]
        if symmetric:
            right = percentile_edge(hist, edges, percentile / 100.0)
            got = (max(-right, float(lo)), min(right, float(hi)))
        else:
            cut = (100.0 - percentile) / 200.0
            got = (max(percentile_edge(hist, edges, cut), float(lo)), min(percentile_edge(hist, edges, 1 - cut), float(hi)))
        assert got == (float(want[0]), float(want[1]))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_bins, quantized_bins", [(256, 128), (512, 128), (400, 64)])
def test_entropy_window_is_onnxruntimes_rule(seed, num_bins, quantized_bins, capsys):
    xs = batches(seed, skew=0.3 * seed)
    collector = ort_collector("entropy", xs, False, num_bins, quantized_bins)
    histogram = collector.histogram_dict["t"]
    hist, edges = histogram[0], histogram[1]
    assert hist.size > num_bins  # the range grew: onnxruntime added bins, more windows to try
    want = collector.get_entropy_threshold(histogram, quantized_bins)
    got = entropy_window(hist, edges, quantized_bins)
    lo, hi = float(histogram[2]), float(histogram[3])
    assert (max(got[0], lo), min(got[1], hi)) == (float(want[0]), float(want[1]))


# ---------------------------------------------------------------- the observers, on the same tensors as onnxruntime
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("args", [SYM, ASYM], ids=["symmetric", "asymmetric"])
def test_percentile_observer_agrees_with_onnxruntime(seed, args, capsys):
    """The same rule on a histogram of other bins: within a bin width of the coarser histogram. The
    first batch holds a 0 and the largest |x|: onnxruntime's |x| histogram spans [min |x|, max |x|]
    of its first batch and drops later values outside it, graphcal's keeps every value."""
    xs = batches(seed, skew=0.2)[::-1]
    xs[0].view(-1)[0] = 0.0
    obs = load("percentile", args, percentile=99.99)
    for x in xs:
        obs(x)
    obs._finalize()
    collector = ort_collector("percentile", xs, args.symmetric, 2048, percentile=99.99)
    hist, edges = collector.histogram_dict["t"][:2]
    assert hist.sum() == sum(x.numel() for x in xs)  # onnxruntime dropped nothing
    low, high = (float(v) for v in collector.compute_percentile()["t"][:2])
    width = max(float(edges[1] - edges[0]), float(obs.hist_width))
    assert obs.max_vals.item() == pytest.approx(high, abs=width)
    assert obs.min_vals.item() == pytest.approx(low, abs=width)


def test_percentile_observer_on_one_batch_is_onnxruntimes_threshold(capsys):
    """One batch holding 0 and |x| up to a power of two times the bin count: both histograms have the
    same bins over [0, max |x|], so the thresholds are equal."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 128, 64, generator=g)
    x.view(-1)[0] = 8.0  # 2048 bins of 2**-8
    x.view(-1)[1] = 0.0
    obs = load("percentile", SYM, bins=2048, percentile=99.9)
    obs(x)
    obs._finalize()
    collector = ort_collector("percentile", [x], True, 2048, percentile=99.9)
    want = float(collector.compute_percentile()["t"][1])
    assert obs.max_vals.item() == want


@pytest.mark.parametrize("seed", range(3))
def test_entropy_observer_on_one_batch_is_onnxruntimes_threshold(seed, capsys):
    """One batch with max |x| a power of two times the bin count: onnxruntime's signed histogram over
    [-max, max] has graphcal's bins, so the KL search gives the same threshold."""
    x = batches(seed, n=1)[0]
    x = x / x.abs().max() * 8.0  # 512 signed bins of 2**-5
    obs = load("entropy", SYM, bins=256)
    obs(x)
    obs._finalize()
    collector = ort_collector("entropy", [x], True, 512)
    histogram = collector.histogram_dict["t"]
    assert np.array_equal(histogram[0], obs.hist.numpy().astype(np.int64))
    want = collector.get_entropy_threshold(histogram, 128)
    assert (obs.min_vals.item(), obs.max_vals.item()) == (float(want[0]), float(want[1]))


# ---------------------------------------------------------------- histogram_mse against the exact search
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("args", [SYM, ASYM, QuantizationArgs(num_bits=4, symmetric=True, strategy="tensor")],
                         ids=["int8", "int8-asym", "int4"])
def test_histogram_mse_is_the_exact_search_over_all_batches(seed, args):
    xs = batches(seed, skew=0.1 if not args.symmetric else 0.0)
    approx = load("histogram_mse", args)
    for x in xs:
        approx(x)
    exact = load("memoryless_mse", args)
    exact(torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]).unsqueeze(0))
    a, e = approx.get_qparams()["scale"].item(), exact.get_qparams()["scale"].item()
    assert a == pytest.approx(e, rel=0.011)  # the same candidate, or its neighbour on the 1% grid


def test_histogram_mse_shrinks_an_outlier_range_like_the_exact_search():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 128, 64, generator=g)
    x.view(-1)[:4] = torch.tensor([40.0, -38.0, 35.0, 30.0])
    args = QuantizationArgs(num_bits=4, symmetric=True, strategy="tensor")
    approx, exact, minmax = load("histogram_mse", args), load("memoryless_mse", args), load("static_minmax", args)
    for o in (approx, exact, minmax):
        o(x)
    sa, se, sm = (o.get_qparams()["scale"].item() for o in (approx, exact, minmax))
    assert sa < sm and sa == pytest.approx(se, rel=0.011)


# ---------------------------------------------------------------- the histogram: exact merges, flat memory
def test_coarsening_is_exact():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10000, generator=g)
    absmax = x.abs().max().item()
    fine, w = add_to_histogram(None, 0.0, x, absmax, 64)
    coarse, w2 = add_to_histogram(None, 0.0, x * 0, 0.0, 64)  # an all-zero start, then widened
    coarse, w2 = add_to_histogram(coarse, w2, x, absmax, 64)
    merged, wm = merge_histograms([(fine, w), (torch.zeros_like(coarse), w2)])
    assert wm == w2 >= w
    direct = torch.zeros_like(coarse)
    index = torch.floor(x / wm).add(64).clamp(0, 127).long()
    direct += torch.bincount(index, minlength=128).double()
    assert torch.equal(merged, direct)
    assert torch.equal(coarse - merged, torch.bincount(torch.full((10000,), 64), minlength=128).double())


@pytest.mark.parametrize("name", ["percentile", "entropy", "histogram_mse"])
def test_extrema_handed_in_are_taken_not_read_again(name, monkeypatch):
    """The activation pass reads each tap's min and max to refuse NaN/Inf and hands them over: a
    histogram observer then bins the tap without reading its extrema again, to the same state."""
    xs = batches(2)
    own, handed = load(name), load(name)
    for x in xs:
        own(x)
    real = torch.aminmax
    spans = [real(x) for x in xs]
    reads = []
    monkeypatch.setattr(torch, "aminmax", lambda *a, **k: reads.append(1) or real(*a, **k))
    for x, span in zip(xs, spans):
        handed(x, extrema=span)
    assert not reads
    assert torch.equal(own.hist, handed.hist) and torch.equal(own.lo, handed.lo) and torch.equal(own.hi, handed.hi)
    monkeypatch.setattr(torch, "aminmax", real)
    assert torch.equal(own.get_qparams()["scale"], handed.get_qparams()["scale"])


@pytest.mark.parametrize("chunk, count", [(1 << 18, 1 << 22), (1000, 3500), (1000, 1000), (700, 100000)])
def test_counts_are_each_values_bin_however_the_tap_is_cut(chunk, count, monkeypatch):
    """Binned in steps of ``chunk`` values and counted ``count`` at a time (ragged ends, a count per step,
    one count for all), every value lands in its bin ``floor(x / width) + bins``, worked out here in
    float64 by numpy, and no value is counted twice or lost."""
    import graphcal.observers.histogram as histogram

    monkeypatch.setattr(histogram, "CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(histogram, "COUNT_ELEMENTS", count)
    monkeypatch.setattr(histogram, "_SCRATCH", {})
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 1111, 7, generator=g) * 3
    absmax = float(x.abs().max())
    counts, width = add_to_histogram(None, 0.0, x, absmax, 256)
    index = np.clip(np.floor(x.numpy().astype(np.float64).ravel() / width) + 256, 0, 511).astype(np.int64)
    assert counts.dtype == torch.float64 and counts.sum() == x.numel()
    assert np.array_equal(counts.numpy(), np.bincount(index, minlength=512).astype(np.float64))


@pytest.mark.parametrize("name", ["percentile", "entropy", "histogram_mse"])
def test_ranks_merge_to_the_single_process_result(name):
    """What torchrun does: each rank observes its batches, rank 0 merges: the same histogram, counts
    and range as one observer fed every batch."""
    xs = batches(3, n=6)
    whole = load(name)
    for x in xs:
        whole(x)
    ranks = [load(name) for _ in range(3)]
    for i, x in enumerate(xs):
        ranks[i % 3](x)
    size = ranks[0].hist.numel()
    merged = ranks[0].merge(*ranks[1:])
    assert merged.hist.numel() == size == whole.hist.numel()  # flat: the bin count never grows
    assert torch.equal(merged.hist, whole.hist) and float(merged.hist_width) == float(whole.hist_width)
    assert torch.equal(merged.get_qparams()["scale"], whole.get_qparams()["scale"])


def test_memory_is_flat_as_samples_grow():
    obs = load("percentile")
    sizes = []
    for x in batches(0, n=8):
        obs(x)
        sizes.append(obs.hist.numel())
    assert len(set(sizes)) == 1 and obs.hist.sum().item() == 8 * 2 * 64 * 96


# ---------------------------------------------------------------- what they refuse
@pytest.mark.parametrize("name", ["percentile", "entropy", "histogram_mse"])
def test_refused_strategies_and_weights(name):
    with pytest.raises(ValueError, match="'tensor' strategy only"):
        load(name, QuantizationArgs(num_bits=8, strategy="group", group_size=16))
    with pytest.raises(ValueError, match="activations only"):
        load(name, QuantizationArgs(num_bits=8, strategy="channel"), base_name="weight")
    with pytest.raises(ValueError, match="bins"):
        load(name, bins=3)


def test_kwargs_are_checked():
    with pytest.raises(ValueError, match="percentile"):
        load("percentile", percentile=101)
    with pytest.raises(ValueError, match="quantized_bins"):
        load("entropy", bins=64, quantized_bins=128)
    with pytest.raises(ValueError, match="norm"):
        load("histogram_mse", norm=0)


def test_weights_take_min_max_or_the_exact_mse():
    from graphcal.config import observer_name

    for name, weight in (("percentile", "memoryless_minmax"), ("entropy", "memoryless_minmax"),
                         ("histogram_mse", "memoryless_mse")):
        assert observer_name(QuantizationArgs(num_bits=8, observer=name), "weight") == weight


def test_a_subnormal_range_is_binned():
    """A first batch of subnormal-sized values: the width stops at 2**-100 (1 / width stays finite)."""
    x = torch.tensor([0.0, 1e-39, -3e-39, 5e-40])
    counts, width = add_to_histogram(None, 0.0, x, float(x.abs().max()), 4096)
    assert width == 2.0 ** -100 and counts.sum().item() == 4 and counts[4096].item() == 3  # 0 and the two positives
    obs = load("percentile")
    obs(x.reshape(1, 1, -1))
    assert torch.isfinite(obs.get_qparams()["scale"]).all()
