"""GPTQ's sweep (graphcal/algorithms/gptq/math.py): its per-column rounding against compressed-tensors', and
on CUDA each block's column loop replayed from a CUDA graph against the eager loop.

* CPU: the sweep's fake quantization (the grid's conversions done once, :class:`_Grid`, the rounding
  chosen once, one column at a time through :func:`_fake_quantize_into`) equals compressed-tensors'
  ``_quantize_dequantize`` **bit for bit** (sign of zero included) on hostile weights: exact ties
  (``x.5`` on int grids, the fp4/fp8 rounding boundaries) on power-of-two grids, values past the
  range, zeros, signed zeros and tiny values, for every strategy GPTQ takes, int4/int8 symmetric and
  asymmetric, fp8, fp4 (NVFP4) and fp6, with fp32 and bf16 scales; and the whole weight equals
  compressed-tensors' ``fake_quantize`` (which dispatches on the strategy). A capture asked for
  where there is no CUDA falls back to the eager loop: the same result, the reason logged once.
* ``gpu``: ``quantize_weight`` with the column loop captured equals the eager CUDA loop bit for bit
  (weight, loss, per-row loss) on channel, group, tensor_group and block grids, with and without
  actorder, a partial last block, a dead column, the Cholesky fallback, and a capture that raises;
  the capture is checked to have been used. Against the CPU: with a diagonal Hessian (no cross-column
  update) the result is compressed-tensors' ``fake_quantize`` on the GPU, exactly; with a full one
  the codes agree on > 99% of the weights and the loss within 2e-2 relative (the tolerances
  tests/calibration/test_cuda.py states for CUDA against the CPU).

The end-to-end numbers (llm-compressor's vectors) are tests/algorithms/test_gptq.py's and
test_gptq_actorder.py's.
"""

from __future__ import annotations

import logging

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.lifecycle.forward_helpers import _quantize_dequantize
from compressed_tensors.quantization.utils import calculate_range
from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

from graphcal.algorithms.gptq import math as gptq
from graphcal.algorithms.gptq import sweep as gsweep
from graphcal.observers import Observer

ARGS = {
    "int4_tensor_sym": dict(num_bits=4, strategy="tensor"),
    "int8_tensor_asym": dict(num_bits=8, strategy="tensor", symmetric=False),
    "int8_channel_sym": dict(num_bits=8, strategy="channel"),
    "int4_channel_asym": dict(num_bits=4, strategy="channel", symmetric=False),
    "int4_group_sym": dict(num_bits=4, strategy="group", group_size=16),
    "int4_group_asym": dict(num_bits=4, strategy="group", group_size=16, symmetric=False),
    "int8_group_asym": dict(num_bits=8, strategy="group", group_size=32, symmetric=False),
    "int4_block_asym": dict(num_bits=4, strategy="block", block_structure=[8, 16], symmetric=False),
    "int8_block_sym": dict(num_bits=8, strategy="block", block_structure=[6, 12]),
    "fp8_tensor": dict(num_bits=8, type="float", strategy="tensor"),
    "fp8_channel": dict(num_bits=8, type="float", strategy="channel"),
    "fp8_block": dict(num_bits=8, type="float", strategy="block", block_structure=[8, 16]),
    "nvfp4": dict(num_bits=4, type="float", strategy="tensor_group", group_size=16, scale_dtype=torch.float8_e4m3fn),
    "fp4_group": dict(num_bits=4, type="float", strategy="group", group_size=16),
    "fp6_group": dict(num_bits=6, type="float", strategy="group", group_size=16),
}
FP4_EDGES = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0]
FP8_EDGES = [1.0625, 1.1875, 2.125, 0.0078125 * 1.5, 3.25, 448.0, 464.0, 480.0]  # midpoints, the max, past it
FP6_EDGES = [0.0625, 0.1875, 1.9375, 2.125, 4.25, 7.25, 7.5, 7.75]


def _args(name: str) -> QuantizationArgs:
    return QuantizationArgs(**ARGS[name])


def _grid(weight: torch.Tensor, args: QuantizationArgs, pow2: bool):
    """The memoryless min-max grid of ``weight`` (``pow2``: scales rounded to powers of two, global scale 1,
    so that ties are exact), as (scale, the zero point GPTQ uses: None when symmetric, global_scale, the
    observer's zero point)."""
    observer = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)
    observer(weight)
    qp = observer.get_qparams()
    scale, zp, gs = qp["scale"], qp["zero_point"], qp["global_scale"]
    if pow2:
        scale = torch.exp2(torch.round(torch.log2(scale.float().clamp_min(2.0 ** -9)))).to(scale.dtype)
        gs = None if gs is None else torch.ones_like(gs)
    return scale, None if args.symmetric else zp, gs, zp


def _hostile(weight: torch.Tensor, scale, zp, gs, args: QuantizationArgs, gen: torch.Generator) -> torch.Tensor:
    """``weight`` with a third of its entries replaced by values on the rounding's edges (on the element's
    own grid: ties, boundaries, the ends of the range and past them), zeros, -0.0 and tiny values."""
    rows, cols = weight.shape
    col_scale, col_zp = gsweep.column_qparams((rows, cols), scale, zp, args)
    s = col_scale.float() / (gs.float() if gs is not None else 1.0)
    if args.type == "int":
        q_min, q_max = (float(v) for v in calculate_range(args, "cpu"))
        k = torch.randint(int(q_min) - 3, int(q_max) + 3, (rows, cols), generator=gen).float()
        units = k + 0.5 * torch.randint(0, 2, (rows, cols), generator=gen)  # x.5 ties and whole codes
        units = units - (col_zp.float() if col_zp is not None else 0.0)
    else:
        edges = torch.tensor({4: FP4_EDGES, 6: FP6_EDGES, 8: FP8_EDGES}[args.num_bits])
        units = edges[torch.randint(0, len(edges), (rows, cols), generator=gen)]
        units = units * torch.where(torch.rand(rows, cols, generator=gen) < 0.5, -1.0, 1.0)
    edge = units * s
    out = weight.clone()
    pick = torch.rand(rows, cols, generator=gen)
    out = torch.where(pick < 0.33, edge, out)
    out = torch.where((pick >= 0.33) & (pick < 0.36), torch.zeros_like(out), out)
    out = torch.where((pick >= 0.36) & (pick < 0.39), torch.full_like(out, -0.0), out)
    out = torch.where((pick >= 0.39) & (pick < 0.42), out * 1e-30, out)
    out = torch.where((pick >= 0.42) & (pick < 0.45), out * 1e3, out)  # far past the range
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous().view(torch.int32)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=["fp32_scale", "bf16_scale"])
@pytest.mark.parametrize("pow2", [True, False], ids=["ties", "observer_grid"])
@pytest.mark.parametrize("name", list(ARGS))
def test_column_rounding_is_compressed_tensors_bit_for_bit(name, pow2, scale_dtype):
    args = _args(name)
    if scale_dtype != torch.float32 and args.scale_dtype is not None:
        pytest.skip("the scheme fixes its scale dtype")
    gen = torch.Generator().manual_seed(list(ARGS).index(name))
    rows, cols = 24, 64
    weight = torch.randn(rows, cols, generator=gen) * 0.1
    scale, zp, gs, observer_zp = _grid(weight, args, pow2)
    if args.scale_dtype is None:
        scale = scale.to(scale_dtype)
    w = _hostile(weight, scale, zp, gs, args, gen)

    col_scale, col_zp = gsweep.column_qparams((rows, cols), scale, zp, args)
    if gs is not None:
        col_scale = col_scale / gs
    grid = gsweep.Grid.of(col_scale, col_zp, args)
    wt = w.t().contiguous()
    out, row = torch.empty_like(wt), torch.empty(rows)
    for k in range(cols):
        d, za, s, zs = (None if t is None else t[0] for t in grid.block(k, k + 1))
        gsweep.fake_quantize_into(wt[k], d, za, s, zs, grid, out[k], row)

    # compressed-tensors' fused quantize-dequantize, elementwise on the same per-element qparams
    q_min, q_max = calculate_range(args, "cpu")
    ref = _quantize_dequantize(wt.clone(), col_scale.t().contiguous(), None if col_zp is None else col_zp.t().contiguous(),
                               q_min, q_max, args)
    assert torch.equal(_bits(out), _bits(ref)), (out - ref.float()).abs().max()
    # and compressed-tensors' strategy-aware fake_quantize of the whole weight (with the observer's zero
    # point, 0 on symmetric grids: the same values, a zero's sign aside)
    full = fake_quantize(w, scale, observer_zp, args, global_scale=gs)
    assert torch.equal(out.t(), full.float())


def test_fp4_rounding_is_compressed_tensors_cast_to_fp4():
    edges = torch.tensor(FP4_EDGES)
    near = torch.cat([edges, torch.nextafter(edges, torch.full_like(edges, 10.0)),
                      torch.nextafter(edges, torch.full_like(edges, -10.0)), torch.rand(1000) * 6.5])
    x = torch.cat([near, -near, torch.tensor([-0.0, 0.0, 1e-38, -1e-38])])
    assert torch.equal(_bits(gsweep.cast_to_fp4(x.clone())), _bits(cast_to_fp4(x.clone())))


def _case(rows=40, cols=320, seed=0, name="int4_group_asym", diagonal=False):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=gen) * 0.1
    if diagonal:
        hessian = torch.diag(torch.rand(cols, generator=gen) + 0.5)
    else:
        x = torch.randn(4 * cols, cols, generator=gen)
        hessian = 2 * x.T @ x / x.shape[0]
    args = _args(name)
    observer = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)
    observer(weight)
    qp = observer.get_qparams()
    return weight, hessian, qp["scale"], qp["zero_point"], qp["global_scale"], args


def test_capture_off_cuda_falls_back_to_the_eager_loop(monkeypatch, caplog):
    monkeypatch.setattr(gsweep, "CAPTURE_FAILED_LOGGED", False)
    case = _case()
    eager = gptq.quantize_weight(*case, block_size=64, capture=False)
    with caplog.at_level(logging.DEBUG, logger="graphcal"):
        tried = gptq.quantize_weight(*case, block_size=64, capture=True)  # no CUDA here: capture raises
        again = gptq.quantize_weight(*case, block_size=64, capture=True)
    assert torch.equal(tried.weight, eager.weight) and tried.loss == eager.loss
    assert torch.equal(tried.row_loss, eager.row_loss) and torch.equal(again.weight, eager.weight)
    said = [r for r in caplog.records if "not captured as a CUDA graph" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.DEBUG  # once, at debug level


# --- on CUDA -----------------------------------------------------------------------------------------------

GPU_CASES = {  # (args, actorder, cols, block_size, what)
    "channel_int8": ("int8_channel_sym", None, 256, 64),
    "group_asym_actorder": ("int4_group_asym", "static", 256, 64),
    "group_partial_last_block": ("int4_group_sym", None, 320, 128),  # 2.5 blocks
    "nvfp4_actorder": ("nvfp4", "static", 256, 64),
    "fp8_block_partial": ("fp8_block", "static", 208, 64),
    "int4_block_asym": ("int4_block_asym", None, 256, 64),
}


def _on(case, device):
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in case)


def _spy(monkeypatch):
    made = []
    original = gsweep.block_graph

    def recording(*a, **k):
        made.append(original(*a, **k))
        return made[-1]

    monkeypatch.setattr(gsweep, "block_graph", recording)
    return made


def _same(a, b):
    assert torch.equal(a.weight, b.weight)
    assert a.loss == b.loss and torch.equal(a.row_loss, b.row_loss) and a.rtn_fallback == b.rtn_fallback


@pytest.mark.gpu
@pytest.mark.parametrize("key", list(GPU_CASES))
def test_captured_sweep_is_the_eager_cuda_loop_bit_for_bit(monkeypatch, key):
    name, actorder, cols, block_size = GPU_CASES[key]
    case = _case(cols=cols, name=name)
    cuda = _on(case, "cuda")
    made = _spy(monkeypatch)
    captured = gptq.quantize_weight(*cuda, block_size=block_size, actorder=actorder)  # default on CUDA: captured
    assert made and made[0] is not None, "the column loop was not captured"
    eager = gptq.quantize_weight(*cuda, block_size=block_size, actorder=actorder, capture=False)
    _same(captured, eager)
    assert captured.weight.device.type == "cuda"

    cpu = gptq.quantize_weight(*case, block_size=block_size, actorder=actorder)
    agree = (captured.weight.cpu() == cpu.weight).float().mean().item()
    assert agree > 0.99, f"only {agree:.1%} of the weights agree with the CPU's"
    assert captured.loss == pytest.approx(cpu.loss, rel=2e-2, abs=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["int4_group_asym", "int8_channel_sym", "nvfp4", "fp8_block", "fp6_group"])
def test_captured_sweep_with_a_diagonal_hessian_is_fake_quantize_on_the_gpu(monkeypatch, name):
    weight, hessian, scale, zp, gs, args = _on(_case(cols=256, name=name, diagonal=True), "cuda")
    made = _spy(monkeypatch)
    result = gptq.quantize_weight(weight, hessian, scale, zp, gs, args, block_size=64, capture=True)
    assert made and made[0] is not None
    assert torch.equal(result.weight, fake_quantize(weight, scale, zp, args, global_scale=gs))


@pytest.mark.gpu
def test_dead_column_and_cholesky_fallback_captured(monkeypatch):
    weight, hessian, *rest = _case(cols=256)
    dead = hessian.clone()
    dead[:, 7] = 0
    dead[7, :] = 0
    for h, fallback in ((dead, False), (-torch.eye(256), True)):  # -I: the Cholesky fails, Hinv = I
        case = _on((weight, h, *rest), "cuda")
        made = _spy(monkeypatch)
        captured = gptq.quantize_weight(*case, block_size=64, actorder="static", capture=True)
        assert made[-1] is not None
        eager = gptq.quantize_weight(*case, block_size=64, actorder="static", capture=False)
        _same(captured, eager)
        assert captured.rtn_fallback is fallback
        if not fallback:
            assert not captured.weight[:, 7].any()  # the dead column comes out zero


@pytest.mark.gpu
def test_a_capture_that_raises_falls_back_to_the_eager_cuda_loop(monkeypatch):
    case = _on(_case(cols=256), "cuda")
    eager = gptq.quantize_weight(*case, block_size=64, capture=False)

    def refuse(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", refuse)
    made = _spy(monkeypatch)
    result = gptq.quantize_weight(*case, block_size=64)
    assert made == [None]
    _same(result, eager)
    again = gptq.quantize_weight(*case, block_size=64)  # the device still works after the failed capture
    _same(again, eager)
