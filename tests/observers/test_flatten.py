"""flatten_for_calibration: shapes against compressed-tensors' own qparam initialisation,
per-qparam contents against direct slicing, padding, errors and dtypes."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.initialize import initialize_qparams
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcal.observers import flatten_for_calibration

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def ct_init_shape(base_name: str, args: QuantizationArgs, observed_shape, dtype=torch.float32):
    """Shape compressed-tensors gives ``{base_name}_scale`` (the reference for qparam shapes)."""
    module = torch.nn.Linear(2, 2)
    initialize_qparams(module, base_name, args, observed_shape=observed_shape, observed_dtype=dtype)
    return tuple(getattr(module, f"{base_name}_scale").shape)


WEIGHT_CASES = [
    ("tensor", {}, (1,)),
    ("channel", {}, (10, 1)),
    ("group", {"group_size": 4}, (10, 2)),
    ("tensor_group", {"group_size": 4}, (10, 2)),
    ("block", {"block_structure": [5, 4]}, (2, 2)),
    ("block", {"block_structure": [3, 3]}, (4, 3)),  # needs padding
]


@pytest.mark.parametrize("strategy,extra,expected", WEIGHT_CASES)
def test_weight_qparam_shape_matches_ct_init(strategy, extra, expected):
    # upstream test_helpers: Linear(8 -> 10), weight (10, 8)
    args = QuantizationArgs(num_bits=4, strategy=strategy, **extra)
    weight = torch.randn(10, 8)
    flat = flatten_for_calibration(weight, "weight", args)
    assert tuple(flat.shape[1:-1]) == expected
    assert tuple(flat.shape[1:-1]) == ct_init_shape("weight", args, weight.shape)
    assert flat.shape[0] == 1


@pytest.mark.parametrize(
    "strategy,extra,expected",
    [("tensor", {}, (1,)), ("tensor_group", {"group_size": 4}, (2,)), ("group", {"group_size": 2}, (4,))],
)
def test_input_qparam_shape_matches_ct_init(strategy, extra, expected):
    args = QuantizationArgs(num_bits=4, strategy=strategy, **extra)
    x = torch.randn(3, 5, 8)
    flat = flatten_for_calibration(x, "input", args)
    reduced = torch.amin(flat, dim=(0, -1))
    shape = tuple(reduced.shape) if reduced.ndim else (1,)
    assert shape == expected == ct_init_shape("input", args, (8,))
    assert flat.shape[0] == 15


def test_attention_shapes_match_ct_init():
    heads, dim = 4, 6
    x = torch.randn(2, heads, 7, dim)
    tensor = flatten_for_calibration(x, "k", QuantizationArgs(strategy="tensor"))
    assert tuple(tensor.shape) == (14, 1, heads * dim)
    args = QuantizationArgs(strategy="attn_head")
    head = flatten_for_calibration(x, "k", args)
    assert tuple(head.shape) == (14, heads, 1, 1, dim)
    assert tuple(head.shape[1:-1]) == ct_init_shape("k", args, (heads, None, dim))


def test_weight_contents_per_qparam():
    w = torch.randn(6, 8)
    ch = flatten_for_calibration(w, "weight", QuantizationArgs(strategy="channel"))
    torch.testing.assert_close(torch.amax(ch, dim=(0, -1)), w.amax(dim=1, keepdim=True), rtol=0, atol=0)
    grp = flatten_for_calibration(w, "weight", QuantizationArgs(strategy="group", group_size=4))
    expected = torch.stack([w[:, :4].amin(dim=1), w[:, 4:].amin(dim=1)], dim=1)
    torch.testing.assert_close(torch.amin(grp, dim=(0, -1)), expected, rtol=0, atol=0)
    ten = flatten_for_calibration(w, "weight", QuantizationArgs(strategy="tensor"))
    assert torch.amax(ten, dim=(0, -1)).item() == w.max().item()


def test_block_padding_zero_fills_and_matches_slices():
    w = torch.randn(5, 7) + 10.0  # strictly positive, so padding zeros are visible in the min
    args = QuantizationArgs(strategy="block", block_structure=[2, 3])
    flat = flatten_for_calibration(w, "weight", args)
    assert tuple(flat.shape) == (1, 3, 3, 6)
    padded = torch.zeros(6, 9)
    padded[:5, :7] = w
    for r in range(3):
        for c in range(3):
            block = padded[2 * r : 2 * r + 2, 3 * c : 3 * c + 3].reshape(-1)
            torch.testing.assert_close(flat[0, r, c], block, rtol=0, atol=0)
    mins = torch.amin(flat, dim=(0, -1))
    assert mins[2, 0] == 0.0 and mins[0, 2] == 0.0  # blocks touching the padding
    assert mins[0, 0] > 0.0


def test_attention_contents_per_head():
    x = torch.randn(2, 3, 5, 4)
    flat = flatten_for_calibration(x, "q", QuantizationArgs(strategy="attn_head"))
    expected = x.amax(dim=(0, 2, 3)).reshape(3, 1, 1)
    torch.testing.assert_close(torch.amax(flat, dim=(0, -1)), expected, rtol=0, atol=0)


def test_activation_group_contents_and_token():
    x = torch.randn(2, 3, 8)
    flat = flatten_for_calibration(x, "output", QuantizationArgs(strategy="group", group_size=4))
    assert tuple(flat.shape) == (6, 2, 4)
    torch.testing.assert_close(flat[4, 1], x[1, 1, 4:], rtol=0, atol=0)
    token = flatten_for_calibration(
        x, "input", QuantizationArgs(strategy="token", dynamic=True)
    )
    assert token.shape == x.shape


@pytest.mark.parametrize(
    "base_name,shape,args",
    [
        ("weight", (4, 4), QuantizationArgs(strategy="token", dynamic=True)),
        ("weight", (4, 4), QuantizationArgs(strategy="attn_head")),
        ("input", (1, 4, 4), QuantizationArgs(strategy="channel")),
        ("input", (1, 4, 4), QuantizationArgs(strategy="block", block_structure=[2, 2])),
        ("input", (1, 4, 4), QuantizationArgs(strategy="attn_head")),
        ("input", (4, 4), QuantizationArgs(strategy="group", group_size=2)),
        ("k", (1, 2, 3, 4), QuantizationArgs(strategy="channel")),
        ("v", (1, 2, 3, 4), QuantizationArgs(strategy="group", group_size=2)),
        ("q", (2, 3, 4), QuantizationArgs(strategy="attn_head")),
        ("weight", (4, 6), QuantizationArgs(strategy="group", group_size=4)),
        ("bias", (4, 4), QuantizationArgs(strategy="tensor")),
    ],
)
def test_unsupported_combinations_raise(base_name, shape, args):
    with pytest.raises(ValueError):
        flatten_for_calibration(torch.zeros(shape), base_name, args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "base_name,shape,args",
    [
        ("weight", (6, 8), QuantizationArgs(strategy="block", block_structure=[4, 3])),
        ("weight", (6, 8), QuantizationArgs(strategy="tensor_group", group_size=4)),
        ("input", (2, 3, 8), QuantizationArgs(strategy="tensor")),
        ("v", (1, 2, 3, 4), QuantizationArgs(strategy="attn_head")),
    ],
)
def test_dtype_preserved(dtype, base_name, shape, args):
    x = torch.randn(shape).to(dtype)
    flat = flatten_for_calibration(x, base_name, args)
    assert flat.dtype == dtype
    assert torch.amax(flat, dim=(0, -1)).max().item() == x.max().item()


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 12),
    cols=st.integers(1, 12),
    bh=st.integers(1, 5),
    bw=st.integers(1, 5),
)
def test_block_shape_and_maxima_any_size(rows, cols, bh, bw):
    w = torch.rand(rows, cols) + 1.0
    args = QuantizationArgs(strategy="block", block_structure=[bh, bw])
    flat = flatten_for_calibration(w, "weight", args)
    assert tuple(flat.shape[1:-1]) == ct_init_shape("weight", args, w.shape)
    assert flat.shape[-1] == bh * bw
    maxima = torch.amax(flat, dim=(0, -1))
    for r in range(maxima.shape[0]):
        for c in range(maxima.shape[1]):
            assert maxima[r, c] == w[r * bh : (r + 1) * bh, c * bw : (c + 1) * bw].max()
