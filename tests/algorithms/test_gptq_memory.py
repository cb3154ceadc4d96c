"""Sequential GPTQ's memory per block: what a block's rounding holds (no session, each Hessian only until
its last layer is rounded), the working copies of quantize_weight (the same numbers as the plain
expressions, the caller's tensors untouched), and the pre-flight estimate of one block's weights."""

from __future__ import annotations

import re
import weakref

import numpy as np
import onnx
import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs

import graphcal.calibration.blockwise as blockwise
import graphcal.calibration.transforms.gptq as gptq_stage
from graphcal import calibrate
from graphcal.algorithms.gptq import hessian as hessian_module
from graphcal.algorithms.gptq.math import Hessian, _permuted, quantize_weight
from graphcal.calibration import footprint
from graphcal.calibration.prepare import prepare
from graphcal.config import Options, resolve
from tests.helpers import MODELS

LLAMA = MODELS / "tiny-llama"


def _layer(name: str) -> int:
    return int(re.search(r"layers\.(\d+)\.", name).group(1))


def test_a_blocks_rounding_holds_no_session_and_each_hessian_until_its_last_layer(tmp_path, monkeypatch):
    """Every layer GPTQ rounds: no onnxruntime session of the walk open, and the Hessians held are
    exactly those of its block's layers not rounded yet (its own included): each goes once its last
    reader is rounded, not at the block's end."""
    open_sessions: set[int] = set()
    real_open = blockwise.open_runtime

    def opening(*args, **kwargs):
        runtime = real_open(*args, **kwargs)
        open_sessions.add(id(runtime))
        real_close = runtime.close

        def close():
            open_sessions.discard(id(runtime))
            real_close()
        runtime.close = close
        return runtime

    monkeypatch.setattr(blockwise, "open_runtime", opening)
    alive: weakref.WeakSet = weakref.WeakSet()
    real_init = hessian_module.HessianObserver.__init__

    def made(self, columns):
        real_init(self, columns)
        alive.add(self)

    monkeypatch.setattr(hessian_module.HessianObserver, "__init__", made)
    calls: list[tuple[int, str, int, int]] = []  # (layer block, the input read, Hessians held, sessions open)
    real_round = gptq_stage.gptq_weights

    def rounding(members, hessian, settings, record):
        held = sum(1 for o in list(alive) if o.hessian.sum is not None or o._value is not None)
        first = members[0].target
        calls.append((_layer(first.name), first.activation, held, len(open_sessions)))
        return real_round(members, hessian, settings, record)

    monkeypatch.setattr(gptq_stage, "gptq_weights", rounding)
    calibrate(LLAMA / "model.onnx", LLAMA / "calib.npz", tmp_path / "out", scheme="W4A16", algorithm="gptq")
    assert calls and len({c[0] for c in calls}) >= 2
    for i, (layer, _, held, sessions) in enumerate(calls):
        assert sessions == 0, "a session of the walk is open while GPTQ rounds"
        left = {c[1] for c in calls[i:] if c[0] == layer}  # this block's inputs still to be read
        assert held == len(left), (calls[i], left)
    assert not open_sessions


def test_take_is_value_in_place():
    torch.manual_seed(0)
    h = Hessian()
    for _ in range(3):
        x = torch.randn(5, 17, 24)
        h.add_gram(x.reshape(-1, 24).T @ x.reshape(-1, 24), 5)
    want = h.value()
    spent = h.sum
    got = h.take()
    assert got.data_ptr() == spent.data_ptr() and h.sum is None  # divided where the sum lay
    assert torch.equal(got, want)
    with pytest.raises(ValueError):
        h.take()


def test_add_gram_equals_the_doubled_sum():
    """``sum.add_(g, alpha=2)`` against ``sum += 2 * g`` (2 * g is exact): the same bits."""
    torch.manual_seed(1)
    grams = [torch.randn(33, 33) * 10 ** k for k in range(-3, 4)]
    h, want = Hessian(), torch.zeros(33, 33)
    for g in grams:
        h.add_gram(g, 2)
        want += 2 * g.float()
    assert torch.equal(h.sum, want) and h.count == 2 * len(grams)


@pytest.mark.parametrize("rows", [1, 7, 1030])
def test_permuted_is_rows_then_columns(rows, monkeypatch):
    monkeypatch.setattr("graphcal.algorithms.gptq.math.PERMUTE_ROWS", 4)  # several slabs, a partial last one
    H = torch.randn(rows, rows)
    perm = torch.randperm(rows)
    assert torch.equal(_permuted(H, perm), H[perm][:, perm])


@pytest.mark.parametrize("actorder", [None, "weight"])
@pytest.mark.parametrize("transposed", [False, True])
def test_quantize_weight_leaves_its_inputs_alone(actorder, transposed):
    """The working copies are its own: the weight (also a transposed view, as the weight pass hands a
    MatMul's) and the Hessian are as they were, and a second call gives the same bits."""
    torch.manual_seed(2)
    rows, cols = 12, 64
    w = torch.randn(cols, rows).t() if transposed else torch.randn(rows, cols)
    x = torch.randn(256, cols)
    H = x.T @ x / 256
    H[3, :] = 0  # a dead column
    H[:, 3] = 0
    args = QuantizationArgs(num_bits=4, strategy="group", group_size=16, symmetric=True)
    scale = w.abs().reshape(rows, cols // 16, 16).amax(-1) / 7
    w0, H0 = w.clone(), H.clone()
    a = quantize_weight(w, H, scale, None, None, args, block_size=16, actorder=actorder)
    assert torch.equal(w, w0) and torch.equal(H, H0)
    b = quantize_weight(w0, H0, scale, None, None, args, block_size=16, actorder=actorder)
    assert torch.equal(a.weight, b.weight) and a.loss == b.loss


def _block_of_initializer(model: onnx.ModelProto) -> dict[str, int]:
    """Each MatMul weight's layer, from the node that reads it (the test's own walk of the graph)."""
    inits = {t.name for t in model.graph.initializer}
    out = {}
    for n in model.graph.node:
        m = re.search(r"layers\.(\d+)[./]", n.name)
        if m and n.op_type in ("MatMul", "Gemm") and len(n.input) > 1 and n.input[1] in inits:
            out[n.input[1]] = int(m.group(1))
    return out


def test_sequential_gptq_estimate_counts_one_blocks_weights():
    """The pre-flight estimate of a sequential GPTQ run holds the heaviest block's weights (the first
    block's with the embedding its subgraph reads), not every initializer."""
    model = onnx.load(LLAMA / "model.onnx", load_external_data=False)
    size = {t.name: int(np.prod(t.dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
            for t in model.graph.initializer}
    layer_of = _block_of_initializer(model)
    per_layer: dict[int, int] = {}
    for name, layer in layer_of.items():
        per_layer[layer] = per_layer.get(layer, 0) + size[name]
    embedding = max(v for k, v in size.items() if k not in layer_of)
    one_block = max(max(per_layer.values()), per_layer[0] + embedding)
    every = sum(size.values())
    assert one_block < every
    ready = prepare(LLAMA / "model.onnx", resolve(Options(scheme="W4A16", algorithm="gptq")), data=LLAMA / "calib.npz")
    fp = footprint.for_run(ready)
    assert fp.pass_kind == "blockwise"
    session, rounding = footprint.blockwise_phases(ready.loaded.model, ready.plan, fp.batch, fp.seq,
                                                   ready.calib.num_samples, 0)
    assert session["weights in onnxruntime"] == one_block
    assert "weights in onnxruntime" not in rounding  # no session is open while a block is rounded
    assert fp.parts.get("weights in onnxruntime", one_block) == one_block
