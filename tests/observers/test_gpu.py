"""CPU/CUDA agreement of the (eager) observers; skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs

from graphcal.observers import Observer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ARGS = [
    QuantizationArgs(num_bits=8, strategy="channel"),
    QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=32),
    QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16,
                     scale_dtype=torch.float8_e4m3fn),
]


def run(name, w, args, device, x=None):
    obs = Observer.load_from_registry(name, base_name="weight", args=args)
    if x is not None:
        obs.accumulate_importance(x.to(device))
    obs(w.to(device))
    qp = obs.get_qparams()
    return {k: (v.cpu() if v is not None else None) for k, v in qp.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("args", ARGS, ids=lambda a: a.strategy)
def test_minmax_identical_on_cuda(args, dtype):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)).to(dtype)
    cpu, gpu = run("memoryless_minmax", w, args, "cpu"), run("memoryless_minmax", w, args, "cuda")
    for key in ("scale", "zero_point"):
        assert torch.equal(cpu[key], gpu[key])


@pytest.mark.parametrize("name", ["memoryless_mse", "imatrix_mse", "nvfp4_expanded_mse"])
@pytest.mark.parametrize("args", ARGS, ids=lambda a: a.strategy)
def test_searches_agree_on_cuda(name, args):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=g)
    x = torch.randn(4, 8, 256, generator=g)
    if name == "nvfp4_expanded_mse" and args.type != "float":
        pytest.skip("expanded search is meant for fp4")
    cpu = run(name, w, args, "cpu", x if "imatrix" in name else None)
    gpu = run(name, w, args, "cuda", x if "imatrix" in name else None)
    # eager ops on both devices: identical but for summation-order ties
    same = (cpu["scale"].float() == gpu["scale"].float()).float().mean().item()
    assert same >= 0.95
