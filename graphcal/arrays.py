"""numpy <-> torch for every float type the graphs hold, bfloat16 included.

numpy has no bfloat16: onnx.numpy_helper reads and writes bf16 tensors as ml_dtypes' ``bfloat16``,
which ``torch.from_numpy`` and ``Tensor.numpy()`` refuse. Both directions here pass its bits through
uint16 (no rounding, no copy); every other dtype goes the plain way.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def to_torch(array: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy(array)`` (sharing its memory), a bfloat16 array as torch.bfloat16."""
    if array.dtype == BFLOAT16:
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """``tensor.numpy()`` (a host tensor, sharing its memory), a torch.bfloat16 one as ml_dtypes' bfloat16."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy().view(BFLOAT16)
    return tensor.numpy()


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy type of a torch float type (torch.bfloat16: ml_dtypes' bfloat16)."""
    return BFLOAT16 if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype
