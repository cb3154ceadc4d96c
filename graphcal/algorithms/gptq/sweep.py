"""GPTQ's blocked sweep: the grid expanded to one scale per column, the per-column rounding (compressed-tensors'
``_quantize_dequantize`` with everything that does not depend on the column taken out of the loop), and the
column loop of each block, eager on the CPU and captured once per weight as a CUDA graph replayed per block on
CUDA (the same kernels in the same order: bit for bit the eager loop). :func:`graphcal.algorithms.gptq.math.quantize_weight`
runs it; the steps are in that module's docstring."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy
from compressed_tensors.quantization.utils import calculate_range

from graphcal.types import enum_value

log = logging.getLogger("graphcal")


def column_qparams(shape: tuple[int, int], scale: torch.Tensor, zero_point: torch.Tensor | None,
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


def cast_to_fp4(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``cast_to_fp4`` (its torch body; its Triton kernel gives the same values) as
    whole-tensor ``where`` s: no boolean-mask writes, so it runs inside a CUDA graph capture."""
    sign = torch.sign(x)
    a = torch.abs(x)
    r = torch.where(a <= 0.25, 0.0, torch.where(a < 0.75, 0.5, torch.where(a <= 1.25, 1.0, torch.where(
        a < 1.75, 1.5, torch.where(a <= 2.5, 2.0, torch.where(a < 3.5, 3.0, torch.where(a <= 5.0, 4.0, 6.0)))))))
    return r * sign


def cast_to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).to(x.dtype)


def rounder(args: QuantizationArgs):
    """``round_to_quantized_type_args``'s rounding for ``args``, chosen once (the clamp is the caller's):
    an in-place-safe function of an fp32 tensor giving the rounded fp32 tensor."""
    kind = enum_value(args.type)
    if kind == "int":
        return torch.round_
    if kind == "float":
        if args.num_bits == 8:
            return cast_to_fp8
        if args.num_bits == 6:
            from compressed_tensors.quantization.utils.fp6_utils import cast_to_fp6  # plain torch ops on every device
            return cast_to_fp6
        if args.num_bits == 4:
            return cast_to_fp4
        raise ValueError(f"GPTQ cannot round to {args.num_bits}-bit floats: only 4, 6 and 8 are supported")
    raise ValueError(f"Invalid quantization type {kind}")


@dataclass(frozen=True)
class Grid:
    """The sweep's grid, one row per (permuted) column ``[cols, rows]``, every conversion of
    compressed-tensors' ``_quantize_dequantize`` done once here instead of once per column:

    ``divisor``: the scale as ``w / scale`` promotes it (fp32); ``zp_add``: the zero point in fp32 (added
    to ``w / s``); ``scale``/``zp_sub``: both in the scale dtype, for ``(q - zp) * s``; zero points None
    on symmetric grids; ``q_min``/``q_max``: ``calculate_range``'s ends as Python floats (the same fp32
    values); ``rnd``: the type's rounding (:func:`rounder`)."""

    divisor: torch.Tensor
    zp_add: torch.Tensor | None
    scale: torch.Tensor
    zp_sub: torch.Tensor | None
    q_min: float
    q_max: float
    rnd: object

    @classmethod
    def of(cls, col_scale: torch.Tensor, col_zp: torch.Tensor | None, args: QuantizationArgs) -> Grid:
        """From the per-element ``[rows, cols]`` scale (already over the global scale) and zero point."""
        st = col_scale.t().contiguous()
        divisor = st if st.dtype == torch.float32 else st.float()
        zt = None if col_zp is None else col_zp.t().contiguous()
        q_min, q_max = calculate_range(args, "cpu")
        return cls(divisor=divisor, zp_add=None if zt is None else zt.to(torch.float32),
                   scale=st, zp_sub=None if zt is None else zt.to(st.dtype),
                   q_min=float(q_min), q_max=float(q_max), rnd=rounder(args))

    def block(self, i1: int, i2: int) -> tuple:
        """The rows of columns ``i1:i2``: ``(divisor, zp_add, scale, zp_sub)`` (views)."""
        return tuple(None if t is None else t[i1:i2] for t in (self.divisor, self.zp_add, self.scale, self.zp_sub))


def fake_quantize_into(w: torch.Tensor, divisor: torch.Tensor, zp_add: torch.Tensor | None, scale: torch.Tensor,
                        zp_sub: torch.Tensor | None, grid: Grid, out: torch.Tensor, scratch: torch.Tensor) -> None:
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


def sweep_block(W1: torch.Tensor, Hinv1: torch.Tensor, divisor: torch.Tensor, zp_add: torch.Tensor | None,
                 scale: torch.Tensor, zp_sub: torch.Tensor | None, grid: Grid, Q1: torch.Tensor, E1: torch.Tensor,
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
        fake_quantize_into(w_[i], d_[i], za_[i], s_[i], zs_[i], grid, q_[i], row)
        torch.sub(w_[i], q_[i], out=e_[i]).div_(hd_[i])
        n = width - i - 1
        if n:  # the column itself is done: llm-compressor updates it too, and never reads it again
            W1[i + 1:].sub_(torch.mul(h_[i][i + 1:], eu_[i], out=scratch[:n]))


class BlockGraph:
    """One block's column loop captured as a CUDA graph over static buffers (``width`` columns of ``rows``
    rows), replayed for every block of that width: the eager loop's kernels in its order.

    Made from the sweep's first full block: its inputs go into the buffers and the loop runs eagerly
    once there, off the capture (the warm-up torch advises for lazy initialisations), which is that
    block's result (``Q1``, ``E1``); the capture that follows records the kernels without running them."""

    def __init__(self, width: int, rows: int, grid: Grid, device: torch.device, first: tuple):
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
            sweep_block(self.W1, self.Hinv1, self.divisor, self.zp_add, self.scale, self.zp_sub, grid, self.Q1,
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


CAPTURE_FAILED_LOGGED = False


def block_graph(width: int, rows: int, grid: Grid, device: torch.device, first: tuple) -> BlockGraph | None:
    """The captured block loop (its first block done), or None where capture fails (why logged once,
    at debug level: the eager loop gives the same numbers)."""
    global CAPTURE_FAILED_LOGGED
    try:
        return BlockGraph(width, rows, grid, device, first)
    except Exception as e:  # noqa: BLE001 - any failure to capture means the eager loop, never a crash
        if not CAPTURE_FAILED_LOGGED:
            CAPTURE_FAILED_LOGGED = True
            log.debug("GPTQ: the column loop is not captured as a CUDA graph (%s: %s); it runs eagerly",
                      type(e).__name__, e)
        return None


def sweep(Wt: torch.Tensor, Hinv: torch.Tensor, grid: Grid, block_size: int, capture: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocked sweep on the transposed weight ``Wt`` ``[cols, rows]`` (overwritten): ``(Qt, row losses)``.

    Each block: its column loop (:func:`sweep_block`: eager, or with ``capture`` replayed from one
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
            graph = block_graph(block_size, rows, grid, Wt.device, inputs)
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
            sweep_block(*inputs, grid, Qt[i1:i2], E1, scratch)
        losses += torch.sum((E1 ** 2).t().contiguous(), 1) / 2  # summed as llm-compressor sums [rows, block]
        if i2 < cols:
            Wt[i2:] -= E1.t().matmul(Hinv[i1:i2, i2:]).t()
    return Qt, losses
