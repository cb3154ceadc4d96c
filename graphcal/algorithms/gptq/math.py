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

import logging
import math
import numbers
from dataclasses import dataclass

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy
from compressed_tensors.quantization.utils import calculate_range

from graphcal.types import enum_value

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

log = logging.getLogger("graphcal")

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

    def _accumulate(self, product: torch.Tensor) -> None:
        if self.sum is None:
            self.sum = torch.zeros(product.shape, dtype=torch.float32, device=product.device)
        elif product.shape != self.sum.shape:
            raise ValueError(f"Hessian is {tuple(self.sum.shape)}, got a {tuple(product.shape)} contribution")
        self.sum += product.to(self.sum.device)

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
        self._accumulate(2 * gram.float())
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

    def __repr__(self) -> str:
        return f"Hessian(columns={self.columns}, count={self.count})"


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


def _column_qparams(shape: tuple[int, int], scale: torch.Tensor, zero_point: torch.Tensor | None,
                    args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point expanded to one value per weight element ``[rows, cols]`` (original order)."""
    rows, cols = shape
    strategy = QuantizationStrategy(args.strategy)

    def expand(t: torch.Tensor, what: str) -> torch.Tensor:
        if strategy == QuantizationStrategy.TENSOR:
            if t.numel() != 1:
                raise ValueError(f"tensor strategy needs one {what}, got shape {tuple(t.shape)}")
            return t.reshape(1, 1).expand(rows, cols)
        if strategy == QuantizationStrategy.CHANNEL:
            if t.numel() != rows:
                raise ValueError(f"channel strategy needs a [{rows}, 1] {what}, got shape {tuple(t.shape)}")
            return t.reshape(rows, 1).expand(rows, cols)
        if strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP):
            group_size = args.group_size
            if cols % group_size != 0:
                raise ValueError(f"{cols} columns are not divisible by group_size {group_size}")
            groups = cols // group_size
            if tuple(t.shape) != (rows, groups):
                raise ValueError(f"{strategy.value} strategy needs a [{rows}, {groups}] {what}, got shape {tuple(t.shape)}")
            return t.repeat_interleave(group_size, dim=1)
        # BLOCK: one value per [block_rows, block_cols] tile, the last tiles possibly partial
        block_rows, block_cols = args.block_structure
        tiles = (math.ceil(rows / block_rows), math.ceil(cols / block_cols))
        if tuple(t.shape) != tiles:
            raise ValueError(f"block strategy needs a [{tiles[0]}, {tiles[1]}] {what}, got shape {tuple(t.shape)}")
        return t.repeat_interleave(block_rows, dim=0)[:rows].repeat_interleave(block_cols, dim=1)[:, :cols]

    return expand(scale, "scale"), None if zero_point is None else expand(zero_point, "zero point")


def _cast_to_fp4(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``cast_to_fp4`` (its torch body; its Triton kernel gives the same values) as
    whole-tensor ``where`` s: no boolean-mask writes, so it runs inside a CUDA graph capture."""
    sign = torch.sign(x)
    a = torch.abs(x)
    r = torch.where(a <= 0.25, 0.0, torch.where(a < 0.75, 0.5, torch.where(a <= 1.25, 1.0, torch.where(
        a < 1.75, 1.5, torch.where(a <= 2.5, 2.0, torch.where(a < 3.5, 3.0, torch.where(a <= 5.0, 4.0, 6.0)))))))
    return r * sign


def _cast_to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).to(x.dtype)


def _rounder(args: QuantizationArgs):
    """``round_to_quantized_type_args``'s rounding for ``args``, chosen once (the clamp is the caller's):
    an in-place-safe function of an fp32 tensor giving the rounded fp32 tensor."""
    kind = enum_value(args.type)
    if kind == "int":
        return torch.round_
    if kind == "float":
        if args.num_bits == 8:
            return _cast_to_fp8
        if args.num_bits == 6:
            from compressed_tensors.quantization.utils.fp6_utils import cast_to_fp6  # plain torch ops on every device
            return cast_to_fp6
        if args.num_bits == 4:
            return _cast_to_fp4
        raise ValueError(f"GPTQ cannot round to {args.num_bits}-bit floats: only 4, 6 and 8 are supported")
    raise ValueError(f"Invalid quantization type {kind}")


@dataclass(frozen=True)
class _Grid:
    """The sweep's grid, one row per (permuted) column ``[cols, rows]``, every conversion of
    compressed-tensors' ``_quantize_dequantize`` done once here instead of once per column:

    ``divisor``: the scale as ``w / scale`` promotes it (fp32); ``zp_add``: the zero point in fp32 (added
    to ``w / s``); ``scale``/``zp_sub``: both in the scale dtype, for ``(q - zp) * s``; zero points None
    on symmetric grids; ``q_min``/``q_max``: ``calculate_range``'s ends as Python floats (the same fp32
    values); ``rnd``: the type's rounding (:func:`_rounder`)."""

    divisor: torch.Tensor
    zp_add: torch.Tensor | None
    scale: torch.Tensor
    zp_sub: torch.Tensor | None
    q_min: float
    q_max: float
    rnd: object

    @classmethod
    def of(cls, col_scale: torch.Tensor, col_zp: torch.Tensor | None, args: QuantizationArgs) -> _Grid:
        """From the per-element ``[rows, cols]`` scale (already over the global scale) and zero point."""
        st = col_scale.t().contiguous()
        divisor = st if st.dtype == torch.float32 else st.float()
        zt = None if col_zp is None else col_zp.t().contiguous()
        q_min, q_max = calculate_range(args, "cpu")
        return cls(divisor=divisor, zp_add=None if zt is None else zt.to(torch.float32),
                   scale=st, zp_sub=None if zt is None else zt.to(st.dtype),
                   q_min=float(q_min), q_max=float(q_max), rnd=_rounder(args))

    def block(self, i1: int, i2: int) -> tuple:
        """The rows of columns ``i1:i2``: ``(divisor, zp_add, scale, zp_sub)`` (views)."""
        return tuple(None if t is None else t[i1:i2] for t in (self.divisor, self.zp_add, self.scale, self.zp_sub))


def _fake_quantize_into(w: torch.Tensor, divisor: torch.Tensor, zp_add: torch.Tensor | None, scale: torch.Tensor,
                        zp_sub: torch.Tensor | None, grid: _Grid, out: torch.Tensor, scratch: torch.Tensor) -> None:
    """compressed-tensors' ``_quantize_dequantize`` of one column ``w`` into ``out`` (fp32): ``round(clamp(w / s
    + zp))``, then ``(q - zp) * s`` in the scale dtype; the same float operations in the same order
    (``scratch``: a row to compute in)."""
    x = torch.div(w, divisor, out=scratch)
    if zp_add is not None:
        x.add_(zp_add)
    x = grid.rnd(x.clamp_(grid.q_min, grid.q_max))
    if scale.dtype == torch.float32:
        if zp_sub is not None:
            x = x.sub_(zp_sub)
        torch.mul(x, scale, out=out)
    else:
        d = x.to(scale.dtype)
        if zp_sub is not None:
            d = d - zp_sub
        out.copy_(d * scale)


def _sweep_block(W1: torch.Tensor, Hinv1: torch.Tensor, divisor: torch.Tensor, zp_add: torch.Tensor | None,
                 scale: torch.Tensor, zp_sub: torch.Tensor | None, grid: _Grid, Q1: torch.Tensor, E1: torch.Tensor,
                 scratch: torch.Tensor) -> None:
    """One block's column loop, on the transposed layout (each column a row): column ``i`` rounded into
    ``Q1[i]``, its error ``(w - q) / Hinv_ii`` into ``E1[i]``, and the block's later columns updated by
    ``Hinv_i,i+1: e`` (an outer product, then subtracted: llm-compressor's two roundings). ``W1`` is
    overwritten; ``scratch`` is ``[width, rows]`` of working space. The same kernels in the same
    order whatever the buffers, so a CUDA graph of it replays the eager loop bit for bit."""
    width = W1.shape[0]
    none = (None,) * width
    w_, q_, e_ = W1.unbind(0), Q1.unbind(0), E1.unbind(0)  # every row's view made at once
    d_, s_ = divisor.unbind(0), scale.unbind(0)
    za_ = none if zp_add is None else zp_add.unbind(0)
    zs_ = none if zp_sub is None else zp_sub.unbind(0)
    h_, hd_, eu_ = Hinv1.unsqueeze(2).unbind(0), Hinv1.diagonal().unbind(0), E1.unsqueeze(1).unbind(0)
    row = scratch[0]
    for i in range(width):
        _fake_quantize_into(w_[i], d_[i], za_[i], s_[i], zs_[i], grid, q_[i], row)
        torch.sub(w_[i], q_[i], out=e_[i]).div_(hd_[i])
        n = width - i - 1
        if n:  # the column itself is done: llm-compressor updates it too, and never reads it again
            W1[i + 1:].sub_(torch.mul(h_[i][i + 1:], eu_[i], out=scratch[:n]))


class _BlockGraph:
    """One block's column loop captured as a CUDA graph over static buffers (``width`` columns of ``rows``
    rows), replayed for every block of that width: the eager loop's kernels in its order.

    Made from the sweep's first full block: its inputs go into the buffers and the loop runs eagerly
    once there, off the capture (the warm-up torch advises for lazy initialisations), which is that
    block's result (``Q1``, ``E1``); the capture that follows records the kernels without running them."""

    def __init__(self, width: int, rows: int, grid: _Grid, device: torch.device, first: tuple):
        def buf(dtype=torch.float32):
            return torch.empty(width, rows, dtype=dtype, device=device)

        self.W1, self.Hinv1 = buf(), torch.empty(width, width, dtype=torch.float32, device=device)
        self.divisor = buf()
        self.scale = self.divisor if grid.scale is grid.divisor else buf(grid.scale.dtype)
        self.zp_add = None if grid.zp_add is None else buf()
        self.zp_sub = None if grid.zp_sub is None else buf(grid.zp_sub.dtype)
        self.Q1, self.E1, self.scratch = buf(), buf(), buf()
        self.graph = None
        self._load(*first)

        def body():
            _sweep_block(self.W1, self.Hinv1, self.divisor, self.zp_add, self.scale, self.zp_sub, grid, self.Q1,
                         self.E1, self.scratch)

        # capture_begin/end on a side stream rather than torch.cuda.graph(), which empties the allocator's
        # cache before every capture (one capture per weight); thread_local: another thread's CUDA calls
        # (onnxruntime's) are not refused while this one captures
        with torch.cuda.device(device):
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                body()  # the first block, eagerly
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    body()
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(device).wait_stream(side)
        self.graph = graph

    def _load(self, W1, Hinv1, divisor, zp_add, scale, zp_sub) -> None:
        self.W1.copy_(W1)
        self.Hinv1.copy_(Hinv1)
        self.divisor.copy_(divisor)
        if self.scale is not self.divisor:
            self.scale.copy_(scale)
        if self.zp_add is not None:
            self.zp_add.copy_(zp_add)
            self.zp_sub.copy_(zp_sub)

    def run(self, *inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's ``(W1, Hinv1, divisor, zp_add, scale, zp_sub)`` copied into the static buffers and
        the graph replayed: ``(Q1, E1)``, static (valid until the next run)."""
        self._load(*inputs)
        self.graph.replay()
        return self.Q1, self.E1


_CAPTURE_FAILED_LOGGED = False


def _block_graph(width: int, rows: int, grid: _Grid, device: torch.device, first: tuple) -> _BlockGraph | None:
    """The captured block loop (its first block done), or None where capture fails (why logged once,
    at debug level: the eager loop gives the same numbers)."""
    global _CAPTURE_FAILED_LOGGED
    try:
        return _BlockGraph(width, rows, grid, device, first)
    except Exception as e:  # noqa: BLE001 - any failure to capture means the eager loop, never a crash
        if not _CAPTURE_FAILED_LOGGED:
            _CAPTURE_FAILED_LOGGED = True
            log.debug("GPTQ: the column loop is not captured as a CUDA graph (%s: %s); it runs eagerly",
                      type(e).__name__, e)
        return None


def _sweep(Wt: torch.Tensor, Hinv: torch.Tensor, grid: _Grid, block_size: int, capture: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocked sweep on the transposed weight ``Wt`` ``[cols, rows]`` (overwritten): ``(Qt, row losses)``.

    Each block: its column loop (:func:`_sweep_block`: eager, or with ``capture`` replayed from one
    capture for all the sweep's full blocks; a partial last block eager), then the loss ``sum e^2 / 2``
    per row (as llm-compressor sums ``[rows, block]``) and the later columns updated by
    ``E Hinv_block,rest`` (the same matmul in the same orientation as llm-compressor's)."""
    cols, rows = Wt.shape
    Qt = torch.empty_like(Wt)
    losses = torch.zeros(rows, dtype=torch.float32, device=Wt.device)
    graph, scratch = None, None
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        inputs = (Wt[i1:i2], Hinv[i1:i2, i1:i2], *grid.block(i1, i2))
        full = i2 - i1 == block_size
        if capture and full and graph is None:
            capture = False  # one try per sweep
            graph = _block_graph(block_size, rows, grid, Wt.device, inputs)
            Q1, E1 = (graph.Q1, graph.E1) if graph is not None else (None, None)
        elif graph is not None and full:
            Q1, E1 = graph.run(*inputs)
        else:
            Q1 = None
        if Q1 is not None:
            Qt[i1:i2].copy_(Q1)
        else:
            if scratch is None:
                scratch = torch.empty(min(block_size, cols), rows, dtype=torch.float32, device=Wt.device)
            E1 = torch.empty(i2 - i1, rows, dtype=torch.float32, device=Wt.device)
            _sweep_block(*inputs, grid, Qt[i1:i2], E1, scratch)
        losses += torch.sum((E1 ** 2).t().contiguous(), 1) / 2  # summed as llm-compressor sums [rows, block]
        if i2 < cols:
            Wt[i2:] -= E1.t().matmul(Hinv[i1:i2, i2:]).t()
    return Qt, losses


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

    col_scale, col_zp = _column_qparams((rows, cols), scale.to(device), None if zero_point is None else zero_point.to(device), args)
    if global_scale is not None:
        col_scale = col_scale / global_scale.to(device)
    if args.symmetric:
        col_zp = None  # symmetric grids are quantized without a zero point

    W = weight.to(torch.float32).clone()
    H = hessian.to(device=device, dtype=torch.float32).clone()

    # 1. activation ordering, on the undamped diagonal; columns keep their original qparams
    perm = None
    if order is not None:
        perm = torch.argsort(torch.diag(H), descending=True)
        W = W[:, perm]
        H = H[perm][:, perm]
        col_scale = col_scale[:, perm]
        col_zp = None if col_zp is None else col_zp[:, perm]

    # 2. dead columns, after permuting
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0

    # 3. damping with the mean diagonal after the dead-column fix
    damp = dampening_frac * torch.mean(torch.diag(H))
    diag = torch.arange(cols, device=device)
    H[diag, diag] += damp

    # 4. upper Cholesky factor of H^-1 (identity when H is not positive definite)
    L, info = torch.linalg.cholesky_ex(H)
    rtn_fallback = bool(info.item() != 0)
    if rtn_fallback:
        Hinv = torch.eye(cols, dtype=torch.float32, device=device)
    else:
        Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)

    # 5. blocked sweep, on the transposed weight (each column a contiguous row of Wt: the per-column
    #    steps read and write contiguous memory); on CUDA each full block's column loop is one CUDA graph
    if capture is None:  # worth a capture from two full blocks on (the first runs eagerly as its warm-up)
        capture = device.type == "cuda" and cols >= 2 * block_size
    Qt, losses = _sweep(W.t().contiguous(), Hinv, _Grid.of(col_scale, col_zp, args), block_size, bool(capture))
    Q = Qt.t()

    # 6. original column order
    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    return GPTQResult(weight=Q.to(weight.dtype), loss=float(torch.sum(losses).item()), rtn_fallback=rtn_fallback, perm=perm,
                      row_loss=losses)
