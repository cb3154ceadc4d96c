"""Reshape observed tensors so that every quantization parameter owns one slice.

``flatten_for_calibration`` returns a view shaped ``(num_obs, *qparam_shape, group_size)``:
reducing it over dims ``(0, -1)`` yields one statistic per quantization parameter, with
the same shape compressed-tensors gives the parameter when it initialises it.
"""

from __future__ import annotations

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy
from compressed_tensors.quantization.utils import maybe_pad_tensor_for_block_quant

__all__ = [
    "WEIGHT_BASE_NAME",
    "ACTIVATION_BASE_NAMES",
    "ATTENTION_BASE_NAMES",
    "BASE_NAMES",
    "REDUCE_DIMS",
    "memory_order",
    "flatten_for_calibration",
]

WEIGHT_BASE_NAME = "weight"
ACTIVATION_BASE_NAMES = ("input", "output")
ATTENTION_BASE_NAMES = ("q", "k", "v")
BASE_NAMES = (WEIGHT_BASE_NAME, *ACTIVATION_BASE_NAMES, *ATTENTION_BASE_NAMES)

#: dims of a flattened tensor that a statistic is reduced over
REDUCE_DIMS = (0, -1)


def memory_order(x: torch.Tensor) -> list[int]:
    """``x``'s dims from the largest stride to the smallest: ``x.permute(memory_order(x))`` reads it as
    it lies in memory (a transposed view becomes contiguous again)."""
    return sorted(range(x.ndim), key=lambda d: (-x.stride(d), d))

_S = QuantizationStrategy


def _strategy(args: QuantizationArgs) -> QuantizationStrategy:
    return QuantizationStrategy(args.strategy)


def _unsupported(strategy: QuantizationStrategy, base_name: str, what: str) -> ValueError:
    return ValueError(
        f"strategy {strategy.value!r} is not supported for {base_name!r} ({what}) calibration"
    )


def _split_groups(value: torch.Tensor, group_size: int, what: str) -> torch.Tensor:
    columns = value.shape[-1]
    if columns % group_size != 0:
        raise ValueError(
            f"{what}: last dimension {columns} is not divisible by group_size {group_size}"
        )
    return value.unflatten(-1, (-1, group_size))


def _flatten_weight(value: torch.Tensor, args: QuantizationArgs) -> torch.Tensor:
    strategy = _strategy(args)
    if strategy == _S.TENSOR:
        return value.reshape(1, 1, -1)
    if strategy == _S.CHANNEL:
        return value.unsqueeze(-2).unsqueeze(0)
    if strategy in (_S.GROUP, _S.TENSOR_GROUP):
        return _split_groups(value, args.group_size, "weight").unsqueeze(0)
    if strategy == _S.BLOCK:
        if value.ndim != 2:
            raise ValueError(f"block strategy needs a 2-D weight, got shape {tuple(value.shape)}")
        block_rows, block_cols = args.block_structure
        padded = maybe_pad_tensor_for_block_quant(value, args.block_structure)
        rows, cols = padded.shape
        blocks = padded.reshape(rows // block_rows, block_rows, cols // block_cols, block_cols)
        return blocks.transpose(1, 2).flatten(-2, -1).unsqueeze(0)
    raise _unsupported(strategy, WEIGHT_BASE_NAME, "weight")


def _flatten_activation(
    value: torch.Tensor, base_name: str, args: QuantizationArgs
) -> torch.Tensor:
    strategy = _strategy(args)
    if strategy == _S.TENSOR:
        return value.reshape(-1, 1, value.shape[-1])
    if strategy == _S.TOKEN:
        return value
    if strategy in (_S.GROUP, _S.TENSOR_GROUP):
        if value.ndim < 3:
            raise ValueError(
                f"{strategy.value} activation calibration needs an input of at least 3 dims "
                f"(batch, seq, hidden); got shape {tuple(value.shape)}"
            )
        return _split_groups(value.flatten(0, 1), args.group_size, base_name)
    raise _unsupported(strategy, base_name, "activation")


def _flatten_attention(
    value: torch.Tensor, base_name: str, args: QuantizationArgs
) -> torch.Tensor:
    strategy = _strategy(args)
    if strategy not in (_S.TENSOR, _S.ATTN_HEAD):
        raise _unsupported(strategy, base_name, "attention state")
    if value.ndim != 4:
        raise ValueError(
            "attention states must be (batch, heads, seq, head_dim); "
            f"got shape {tuple(value.shape)}"
        )
    per_token = value.transpose(1, 2).flatten(0, 1)  # (B*S, heads, D)
    if strategy == _S.TENSOR:
        return per_token.flatten(-2, -1).unsqueeze(-2)  # (B*S, 1, heads*D)
    return per_token.unsqueeze(-2).unsqueeze(-2)  # (B*S, heads, 1, 1, D)


def flatten_for_calibration(
    value: torch.Tensor, base_name: str, args: QuantizationArgs
) -> torch.Tensor:
    """Reshape ``value`` to ``(num_obs, *qparam_shape, group_size)`` (no copy unless padded).

    weight ``[out, in]``: tensor ``(1, 1, out*in)``, channel ``(1, out, 1, in)``,
    group/tensor_group ``(1, out, in/gs, gs)``, block ``(1, br, bc, bh*bw)`` (zero-padded).
    input/output ``(B, S, H)``: tensor ``(B*S, 1, H)``, token unchanged,
    group/tensor_group ``(B*S, H/gs, gs)``.
    q/k/v ``(B, heads, S, D)``: tensor ``(B*S, 1, heads*D)``, attn_head ``(B*S, heads, 1, 1, D)``.
    Raises ``ValueError`` for unsupported strategy/base-name combinations.
    """
    if base_name == WEIGHT_BASE_NAME:
        return _flatten_weight(value, args)
    if base_name in ACTIVATION_BASE_NAMES:
        return _flatten_activation(value, base_name, args)
    if base_name in ATTENTION_BASE_NAMES:
        return _flatten_attention(value, base_name, args)
    raise ValueError(f"unknown base_name {base_name!r}; expected one of {BASE_NAMES}")


def extrema(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``x``'s min and max (NaN carried along), read once in memory order (None: empty)."""
    if x.numel() == 0:
        return None
    if not x.is_contiguous():  # e.g. a weight seen through a transpose: read it as it lies
        x = x.permute(memory_order(x))
    return torch.aminmax(x)


def all_finite(x: torch.Tensor) -> bool:
    """No NaN or Inf in ``x``: its min and max (which carry NaN along) are finite. One read of
    ``x`` and no mask of its size (``isfinite(x).all()`` cost 30x more on a big tap)."""
    return finite_extrema(extrema(x))


def finite_extrema(span: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
    """Whether a tensor's extrema (None: it is empty) are finite: NaN and Inf carry through them."""
    return span is None or bool(torch.isfinite(torch.stack(span)).all())
