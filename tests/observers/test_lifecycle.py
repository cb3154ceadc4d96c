"""llm-compressor's calibration lifecycle vectors (observers.md 9.4).

Observers as llm-compressor's ``initialize_observer`` picks them: ``memoryless_minmax`` for
weights, ``minmax`` for input/q/k/v. The qparams are applied with compressed-tensors'
``fake_quantize`` (and ``compute_dynamic_scales_and_zp`` for the locally dynamic case).
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

from graphcal.observers import Observer

WEIGHT = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)
INT4 = {"num_bits": 4, "type": "int", "symmetric": True}
FP4 = {"num_bits": 4, "type": "float", "symmetric": True}

WEIGHT_CASES = {
    "tensor": dict(
        args={**INT4, "strategy": "tensor"},
        min=[0], max=[23], scales=[3.0625], loss=0.85,
        row0=[0, 0, 3.0625, 3.0625, 3.0625, 6.125],
    ),
    "channel": dict(
        args={**INT4, "strategy": "channel"},
        min=[[0], [6], [12], [18]], max=[[5], [11], [17], [23]],
        scales=[0.66797, 1.46875, 2.26563, 3.0625], loss=0.45,
        row0=[0, 1.3359, 2, 2.6719, 4, 4.6875],
    ),
    "group": dict(
        args={**INT4, "strategy": "group", "group_size": 3},
        min=[[0, 3], [6, 9], [12, 15], [18, 21]], max=[[2, 5], [8, 11], [14, 17], [20, 23]],
        scales=None, loss=0.45,
        row0=[0, 1.0703, 1.875, 2.6719, 4, 4.6875],
    ),
    "tensor_group": dict(
        args={**FP4, "strategy": "tensor_group", "group_size": 3, "scale_dtype": torch.float8_e4m3fn},
        min=[[0, 3], [6, 9], [12, 15], [18, 21]], max=[[2, 5], [8, 11], [14, 17], [20, 23]],
        scales=[40, 96, 160, 208, 288, 320, 384, 448], loss=1.1,
        row0=[0, 1.0234, 2.0469, 3.2812, 3.2812, 4.9375],
        last_row=[19.75, 19.75, 19.75, 23, 23, 23], global_scale=117.0,
    ),
    "block": dict(
        args={**INT4, "strategy": "block", "block_structure": [2, 3]},
        min=[[0, 3], [12, 15]], max=[[8, 11], [20, 23]],
        scales=[1.0703, 1.46875, 2.6719, 3.0625], loss=0.5,
        row0=[0, 1.0703, 2.1406, 2.9375, 4.4062, 4.4062],
    ),
}


def close(actual: torch.Tensor, expected, atol=1e-3):
    torch.testing.assert_close(actual.float().flatten(), torch.tensor(expected, dtype=torch.float32).flatten(),
                               atol=atol, rtol=0)


@pytest.mark.parametrize("case", sorted(WEIGHT_CASES))
def test_weight_lifecycle(case):
    spec = WEIGHT_CASES[case]
    args = QuantizationArgs(**spec["args"])
    obs = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=args)
    obs(WEIGHT)
    close(obs.min_vals, spec["min"], atol=0)
    close(obs.max_vals, spec["max"], atol=0)
    qp = obs.get_qparams()
    if spec["scales"] is not None:
        close(qp["scale"], spec["scales"])
    if "global_scale" in spec:
        assert qp["global_scale"].item() == spec["global_scale"]
    else:
        assert qp["global_scale"] is None
    # output of Linear(eye(6)).T is the fake-quantized weight itself
    qdq = fake_quantize(WEIGHT, qp["scale"], qp["zero_point"], args, global_scale=qp["global_scale"])
    close(qdq[0], spec["row0"])
    if "last_row" in spec:
        close(qdq[-1], spec["last_row"])
    assert torch.nn.functional.mse_loss(qdq.float(), WEIGHT.float()).item() <= spec["loss"]


ACT = torch.arange(12, dtype=torch.bfloat16).reshape(1, 2, 6)
ACT_QDQ_INT4 = [[0, 1.4688, 1.4688, 2.9375, 4.4062, 4.4062], [5.875, 7.3438, 7.3438, 8.8125, 10.25, 10.25]]


def test_input_int4_tensor():
    args = QuantizationArgs(**INT4, strategy="tensor")
    obs = Observer.load_from_registry("minmax", base_name="input", args=args)
    obs(ACT)
    close(obs.min_vals, [0], atol=0)
    close(obs.max_vals, [11], atol=0)
    qp = obs.get_qparams()
    assert qp["scale"].item() == 1.46875
    qdq = fake_quantize(ACT, qp["scale"], qp["zero_point"], args)
    close(qdq[0], ACT_QDQ_INT4)
    assert torch.nn.functional.mse_loss(qdq.float(), ACT.float()).item() <= 0.2


def test_input_fp4_locally_dynamic_global_scale():
    args = QuantizationArgs(**FP4, strategy="tensor_group", group_size=3, dynamic="local",
                            scale_dtype=torch.float8_e4m3fn)
    obs = Observer.load_from_registry("minmax", base_name="input", args=args)
    obs(ACT)
    global_scale = obs.get_qparams()["global_scale"]
    assert global_scale.item() == 244.0
    scale, zp = compute_dynamic_scales_and_zp(ACT, args, module=None, global_scale=global_scale)
    qdq = fake_quantize(ACT, scale, zp, args, global_scale=global_scale)
    close(qdq[0], [[0, 0.9844, 1.9688, 3.4062, 3.4062, 5.125], [5.25, 7.875, 7.875, 7.3438, 11, 11]])
    assert torch.nn.functional.mse_loss(qdq.float(), ACT.float()).item() <= 0.5


def test_attention_k_int4_tensor():
    args = QuantizationArgs(**INT4, strategy="tensor")
    states = torch.arange(12, dtype=torch.bfloat16).reshape(1, 2, 2, 3)
    obs = Observer.load_from_registry("minmax", base_name="k", args=args)
    obs(states)
    close(obs.min_vals, [0], atol=0)
    close(obs.max_vals, [11], atol=0)
    qp = obs.get_qparams()
    qdq = fake_quantize(states, qp["scale"], qp["zero_point"], args)
    close(qdq.flatten(), ACT_QDQ_INT4)
    assert torch.nn.functional.mse_loss(qdq.float(), states.float()).item() <= 0.19
