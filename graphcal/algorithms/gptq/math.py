"""GPTQ: llm-compressor's GPTQModifier weight quantization, in plain fp32 torch.

    activations of a Linear input (or their Gram matrix, computed in the graph)
      --Hessian: H = (2 / N_sequences) * sum over tokens of x x^T, fp32-->
    H [in, in]
      --quantize_weight: actorder, dead columns, damping, Cholesky, blocked sweep-->
    the weight on its fixed grid (dequantized values) and the loss 1/2 * sum e^2

The grid (scale, zero point, global scale) is not computed here: it is the weight observer's
(default memoryless_minmax), taken once from the weight as it is before GPTQ, and it is never
recomputed during or after the sweep (llm-compressor 0.14). With activation ordering every column
keeps the scale of its original group.

:func:`quantize_weight` follows llm-compressor 0.14's eager path (``quantize_weight`` with
``gptq_block_update``) step by step in fp32 torch, which reproduces its codes bit for bit on CPU
(single-threaded; BLAS summation order can move a Hessian by ~1e-7 and flip a code), and its loss
bit for bit on the same instruction set (torch's vectorized fp32 sum adds in another order on AVX2
than on AVX-512: 5e-6 apart):

1. actorder ``weight``/``static``: ``perm = argsort(diag(H), descending=True)`` (torch's unstable
   argsort of the undamped diagonal), both axes of H and the columns of W permuted;
2. dead columns (``diag(H) == 0``): ``H_jj = 1`` and the column of W zeroed, after permuting;
3. damping: ``H += dampening_frac * mean(diag(H)) * I`` (the mean counts the 1s just written);
4. ``Hinv`` = upper Cholesky factor of ``H^-1``; when the Cholesky of H fails, ``Hinv = I`` and the
   result is round-to-nearest on the same grid (``rtn_fallback``);
5. blocks of ``block_size`` columns, column by column: ``q = fake_quantize(w)`` exactly as
   compressed-tensors' ``_quantize_dequantize`` (``round(clamp(w / s + zp))``, then ``(q - zp) * s``
   in the scale dtype, ``s = scale / global_scale``), ``e = (w - q) / Hinv_kk``, the rest of the
   block updated by ``e Hinv_k,k:``, and after the block the later columns by ``E Hinv_block,rest``
   (every conversion of the grid done once before the sweep, :class:`_Grid`; on CUDA each full block's
   column loop replayed from one CUDA graph, the eager loop's kernels in its order);
6. the permutation undone; ``loss = 1/2 * sum over rows and columns of e^2``.

:class:`Hessian` accumulates H the way llm-compressor's forward hook does (``add_activations``), or
from Gram matrices computed elsewhere (``add_gram``, e.g. ``MatMul(X^T, X)`` inside onnxruntime);
``sum`` and ``count`` are plain sums, so data-parallel ranks add them.

Source: shared/reference/algorithms.md section 3 (GPTQModifier: parameters, activation ordering,
Hessian, grid, algorithm) and section 7 (bit-exactness); observers.md for the qparam arithmetic.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy

from graphcal.algorithms.gptq.sweep import Grid, column_qparams, sweep

__all__ = [
    "ACTORDERS",
    "SUPPORTED_STRATEGIES",
    "GPTQResult",
    "Hessian",
    "check_actorder",
    "quantize_weight",
]

#: activation orderings GPTQ accepts ("static" is compressed-tensors' alias of "weight")
ACTORDERS = ("weight", "static")
#: weight strategies quantize_weight handles
SUPPORTED_STRATEGIES = (
    QuantizationStrategy.TENSOR,
    QuantizationStrategy.CHANNEL,
    QuantizationStrategy.GROUP,
    QuantizationStrategy.TENSOR_GROUP,
    QuantizationStrategy.BLOCK,
)

_SQRT2 = math.sqrt(2)  # the Python float llm-compressor multiplies activations by


def check_actorder(value: object) -> str | None:
    """``None`` or ``"weight"`` (``"static"`` is its alias); anything else raises llm-compressor's ValueError."""
    if value is None:
        return None
    name = getattr(value, "value", value)  # compressed-tensors' ActivationOrdering enum
    if isinstance(name, str) and name in ACTORDERS:
        return "weight"
    raise ValueError(f"Invalid activation ordering {name}. Only 'weight' and 'static' are supported for GPTQ.")


class Hessian:
    """The GPTQ Hessian of one module input: ``value() = (2 / count) * sum over tokens of x x^T`` (fp32).

    ``sum`` holds ``sum of (sqrt2 x)(sqrt2 x)^T`` and ``count`` the number of sequences (the batch
    dimension, not tokens), as llm-compressor accumulates them; ranks combine with :meth:`merge`
    (or by summing both attributes). Everything stays on the device of the first tensor added.
    """

    def __init__(self) -> None:
        self.sum: torch.Tensor | None = None
        self.count: int = 0

    @property
    def columns(self) -> int | None:
        return None if self.sum is None else self.sum.shape[0]

    def _accumulate(self, product: torch.Tensor, alpha: int = 1) -> None:
        """``sum += alpha * product`` in the sum's memory (no ``alpha * product`` matrix beside it)."""
        if self.sum is None:
            self.sum = torch.zeros(product.shape, dtype=torch.float32, device=product.device)
        elif product.shape != self.sum.shape:
            raise ValueError(f"Hessian is {tuple(self.sum.shape)}, got a {tuple(product.shape)} contribution")
        self.sum.add_(product.to(self.sum.device), alpha=alpha)

    @torch.no_grad()
    def add_activations(self, x: torch.Tensor) -> None:
        """One batch of a Linear input ``[..., in]``, as llm-compressor's forward hook adds it.

        2-D input is one sample; more than 3 dims are viewed as ``(B, -1, in)``; ``count`` grows by
        the batch dimension; ``X = sqrt2 * x.float()`` as ``[in, tokens]`` and ``sum += X X^T`` in fp32.
        """
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"activations must be a floating-point tensor, got {type(x).__name__}")
        if x.ndim < 2:
            raise ValueError(f"activations must have at least 2 dims [tokens, in], got shape {tuple(x.shape)}")
        if self.sum is not None and x.shape[-1] != self.sum.shape[0]:
            raise ValueError(f"Hessian has {self.sum.shape[0]} columns, got activations of shape {tuple(x.shape)}")
        if x.ndim == 2:
            x = x.unsqueeze(0)
        elif x.ndim > 3:
            x = x.reshape(x.shape[0], -1, x.shape[-1])
        sequences = x.shape[0]
        flat = x.reshape(-1, x.shape[-1]).t()
        flat = _SQRT2 * flat.float()
        self._accumulate(flat.matmul(flat.t()))
        self.count += sequences

    @torch.no_grad()
    def add_gram(self, gram: torch.Tensor, sequences: int) -> None:
        """A batch's ``sum over tokens of x x^T`` (``[in, in]``, e.g. ``X^T X``) over ``sequences`` sequences.

        Doubled to match :meth:`add_activations` (which scales x by sqrt2); equal to it up to the
        summation order of the product (~1e-7 relative in fp32).
        """
        gram = torch.as_tensor(gram)
        if gram.ndim != 2 or gram.shape[0] != gram.shape[1]:
            raise ValueError(f"gram must be a square [in, in] matrix, got shape {tuple(gram.shape)}")
        if isinstance(sequences, bool) or not isinstance(sequences, numbers.Integral) or sequences < 0:
            raise ValueError(f"sequences must be an integer >= 0, got {sequences!r}")
        # sum + 2 * gram without the doubled matrix: 2 * g is exact in fp32, so one rounding either way
        self._accumulate(gram.float(), alpha=2)
        self.count += int(sequences)

    def merge(self, *others: Hessian) -> Hessian:
        """Add other accumulators' sums and counts into this one (data-parallel ranks); returns self."""
        for other in others:
            if other.sum is not None:
                self._accumulate(other.sum)
            self.count += other.count
        return self

    def value(self) -> torch.Tensor:
        """``sum / count``: the Hessian GPTQ quantizes with (fp32, ``[in, in]``)."""
        if self.sum is None or self.count == 0:
            raise ValueError("Hessian has no samples: nothing was added (or only zero sequences)")
        return self.sum / self.count

    def take(self) -> torch.Tensor:
        """:meth:`value` computed in the sum's own memory (the same division): the accumulator is spent
        after (``sum`` None), for a caller that holds it for nothing else."""
        if self.sum is None or self.count == 0:
            raise ValueError("Hessian has no samples: nothing was added (or only zero sequences)")
        value, self.sum = self.sum.div_(self.count), None
        return value

    def __repr__(self) -> str:
        return f"Hessian(columns={self.columns}, count={self.count})"


PERMUTE_ROWS = 1024  # rows of H whose columns :func:`_permuted` permutes at once (one such slab is the scratch)


def _permuted(H: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``H[perm][:, perm]`` as one new matrix: the rows gathered, then each slab of rows' columns
    permuted in place (a slab's copy the only scratch, not a second whole matrix)."""
    out = H.index_select(0, perm)
    for a in range(0, out.shape[0], PERMUTE_ROWS):
        slab = out[a:a + PERMUTE_ROWS]
        slab.copy_(slab.index_select(1, perm))
    return out


@dataclass(frozen=True)
class GPTQResult:
    """``weight``: on the grid (dequantized), the input weight's dtype, original column order;
    ``loss``: ``1/2 * sum e^2``; ``rtn_fallback``: the Cholesky failed and GPTQ fell back to RTN;
    ``perm``: the activation order (column ``k`` of the sweep is original column ``perm[k]``), None without."""

    weight: torch.Tensor
    loss: float
    rtn_fallback: bool
    perm: torch.Tensor | None = None
    row_loss: torch.Tensor | None = None  # 1/2 * sum of e^2 per row (layers stacked along rows: split it)


def _validate(weight: torch.Tensor, hessian: torch.Tensor, args: QuantizationArgs, block_size: int,
              dampening_frac: float) -> None:
    if not isinstance(args, QuantizationArgs):
        raise ValueError(f"args must be a compressed-tensors QuantizationArgs, got {type(args).__name__}")
    strategy = QuantizationStrategy(args.strategy)
    if strategy not in SUPPORTED_STRATEGIES:
        supported = ", ".join(s.value for s in SUPPORTED_STRATEGIES)
        raise ValueError(f"GPTQ cannot quantize weights with strategy {strategy.value!r}; supported: {supported}")
    if args.dynamic is not False:
        raise ValueError(f"GPTQ needs static weight qparams, got dynamic={args.dynamic!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    if isinstance(dampening_frac, bool) or not isinstance(dampening_frac, (int, float)) or not math.isfinite(dampening_frac) \
            or dampening_frac < 0:
        raise ValueError(f"dampening_frac must be a finite number >= 0, got {dampening_frac!r}")
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D floating-point tensor [out, in], got {getattr(weight, 'shape', weight)!r}")
    cols = weight.shape[1]
    if not isinstance(hessian, torch.Tensor) or tuple(hessian.shape) != (cols, cols):
        raise ValueError(f"hessian must be [{cols}, {cols}] for a weight of shape {tuple(weight.shape)}, "
                         f"got {tuple(getattr(hessian, 'shape', ()))}")


@torch.no_grad()
def quantize_weight(weight: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                    global_scale: torch.Tensor | None, args: QuantizationArgs, *, block_size: int = 128,
                    dampening_frac: float = 0.01, actorder: str | None = None,
                    capture: bool | None = None) -> GPTQResult:
    """GPTQ-quantize ``weight`` ``[out, in]`` with the Hessian ``[in, in]`` on the fixed grid ``scale``/``zero_point``
    (shaped as compressed-tensors' qparams for ``args.strategy``) and ``global_scale`` (tensor_group, else None).

    ``actorder`` overrides ``args.actorder`` when given (``"weight"``/``"static"``; anything else raises).
    Runs in fp32 on the weight's device; see the module docstring for the steps. ``capture``: replay
    each block's column loop from one CUDA graph (None: on CUDA from two full blocks on; True: try on any device; False: the
    eager loop); where capture fails the loop runs eagerly, with the same numbers.
    """
    _validate(weight, hessian, args, block_size, dampening_frac)
    order = check_actorder(actorder if actorder is not None else args.actorder)
    rows, cols = weight.shape
    device = weight.device

    col_scale, col_zp = column_qparams((rows, cols), scale.to(device), None if zero_point is None else zero_point.to(device), args)
    if global_scale is not None:
        col_scale = col_scale / global_scale.to(device)
    if args.symmetric:
        col_zp = None  # symmetric grids are quantized without a zero point

    # The working copies (the caller's weight and Hessian are never written): the weight transposed,
    # each column a contiguous row (the sweep's layout), and the Hessian, each made once, permuted as
    # they are made; every copy let go as soon as the next step no longer reads it. Only data moves
    # here: the values are those of permuting W's columns and H's rows then columns.
    H = hessian.to(device=device, dtype=torch.float32)
    Wt = torch.empty((cols, rows), dtype=torch.float32, device=device)
    W = weight.to(torch.float32).t()

    # 1. activation ordering, on the undamped diagonal; columns keep their original qparams
    perm = None
    if order is not None:
        perm = torch.argsort(torch.diag(H), descending=True)
        torch.index_select(W, 0, perm, out=Wt)
        H = _permuted(H, perm)
        col_scale = col_scale[:, perm]
        col_zp = None if col_zp is None else col_zp[:, perm]
    else:
        Wt.copy_(W)
        H = H.clone()
    del W

    # 2. dead columns, after permuting
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    Wt[dead] = 0

    # 3. damping with the mean diagonal after the dead-column fix
    damp = dampening_frac * torch.mean(torch.diag(H))
    diag = torch.arange(cols, device=device)
    H[diag, diag] += damp

    # 4. upper Cholesky factor of H^-1 (identity when H is not positive definite)
    #    (H, then its factor, then H^-1 let go as soon as the next step has what it needs)
    L, info = torch.linalg.cholesky_ex(H)
    del H
    rtn_fallback = bool(info.item() != 0)
    if rtn_fallback:
        del L
        Hinv = torch.eye(cols, dtype=torch.float32, device=device)
    else:
        Hinv = torch.cholesky_inverse(L)
        del L
        Hinv = torch.linalg.cholesky(Hinv, upper=True)

    # 5. blocked sweep, on the transposed weight (each column a contiguous row of Wt: the per-column
    #    steps read and write contiguous memory); on CUDA each full block's column loop is one CUDA graph
    if capture is None:  # worth a capture from two full blocks on (the first runs eagerly as its warm-up)
        capture = device.type == "cuda" and cols >= 2 * block_size
    grid = Grid.of(col_scale, col_zp, args)
    del col_scale, col_zp  # the grid holds its own transposed copy
    Qt, losses = sweep(Wt, Hinv, grid, block_size, bool(capture))
    del Wt, Hinv, grid
    Q = Qt.t()

    # 6. original column order
    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    return GPTQResult(weight=Q.to(weight.dtype), loss=float(torch.sum(losses).item()), rtn_fallback=rtn_fallback, perm=perm,
                      row_loss=losses)
