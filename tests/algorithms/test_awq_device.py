"""AWQ where the session runs: block tensors, parent runs and losses stay on the device (issue 49).

On the CPU the device-generic path (torch tensors bound to onnxruntime from their memory, outputs
back by DLPack, losses as 0-d tensors read once per mapping) is checked against the host
formulation it replaced, written out here: ``session.run`` into numpy for every block and parent
run, each loss read with ``.item()``. Bit for bit. The llm-compressor vectors
(tests/algorithms/test_awq.py) cover the math itself. The ``gpu`` tests run the whole ``run
--algorithm awq`` on CUDA against the CPU run, and check that no parent output reaches the host.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import graphcal.calibration.transforms.awq as awq_stage
from graphcal.algorithms.awq import math as awq
from graphcal.algorithms.awq.gram import Gram, LayerLoss
from graphcal.runtime import Runtime, open_runtime
from tests.helpers import load_written, run_cli

CUDA = pytest.mark.skipif(not torch.cuda.is_available() or "CUDAExecutionProvider" not in ort.get_available_providers(),
                          reason="needs a CUDA GPU, a CUDA torch and onnxruntime-gpu")


def _transpose_model(elem: int) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", elem, None)
    graph = helper.make_graph([helper.make_node("Transpose", ["x"], ["y"])], "t", [x],
                              [helper.make_tensor_value_info("y", elem, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


@pytest.mark.parametrize("dtype, elem", [(torch.float32, TensorProto.FLOAT), (torch.float16, TensorProto.FLOAT16),
                                         (torch.bfloat16, TensorProto.BFLOAT16), (torch.int64, TensorProto.INT64)])
def test_torch_feeds_are_read_where_they_lie(dtype, elem):
    """A torch feed (not contiguous, bfloat16 that numpy lacks, empty) gives what numpy's feed gives."""
    runtime = open_runtime(_transpose_model(elem), ["y"], "cpu")
    x = (torch.randn(5, 3) * 50).to(dtype)
    got = runtime.run({"x": x.T})["y"]
    assert torch.equal(got, x)  # (x.T).T, read through the stride-free copy
    if dtype is not torch.bfloat16:
        assert np.array_equal(runtime.run_numpy({"x": x.T.numpy()})["y"], x.numpy())
    assert runtime.run({"x": torch.zeros(0, 4, dtype=dtype)})["y"].shape == (4, 0)


def test_the_streamed_loss_is_the_host_loss():
    """mean_squared_error (0-d, fp32, on the references' device, outputs streamed) equals the loss summed
    batch by batch on the host in fp32 and read once, and refuses a batch count that differs."""
    g = torch.Generator().manual_seed(0)
    refs = [torch.randn(2, 7, 16, generator=g) for _ in range(3)]
    outs = [r + 1e-3 * torch.randn(r.shape, generator=g) for r in refs]
    total = torch.zeros((), dtype=torch.float32)
    for r, o in zip(refs, outs):
        total = total + torch.nn.functional.mse_loss(r.float(), o.float(), reduction="sum").cpu()
    want = (total / sum(r.numel() for r in refs)).item()
    got = awq.mean_squared_error(refs, iter(outs))
    assert got.dim() == 0 and got.dtype == torch.float32 and got.item() == want and awq.loss(refs, outs) == want
    with pytest.raises(ValueError, match="yielded 2 batches, the reference 3"):
        awq.mean_squared_error(refs, iter(outs[:2]))


def test_the_grid_read_once_picks_what_a_read_per_point_picks():
    """search() reads the grid's losses in one go: the same losses, the first strict minimum, nan never."""
    g = torch.Generator().manual_seed(1)
    x = [torch.randn(4, 8, 32, generator=g) for _ in range(2)]
    weights = {"a": torch.randn(24, 32, generator=g), "b": torch.randn(16, 32, generator=g)}
    from compressed_tensors.quantization import QuantizationArgs

    args = {n: QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=16) for n in weights}
    stats, gram = awq.AbsMean(), Gram()
    for v in x:
        stats.update(v)
        gram.update(v)
    result = awq.search(stats.value(), weights, args, LayerLoss(gram), n_grid=10)
    per_point = LayerLoss(gram)
    per_point.prepare(weights)
    w_mean = awq.weight_mean(list(weights.values()), list(args.values()))
    want = [per_point(awq.quantize_scaled(weights, args, awq.candidate_scales(stats.value(), w_mean, r, d)))
            for r, d in awq.grid(True, 10)]
    assert list(result.losses) == want
    assert result.best_index == min(range(len(want)), key=lambda i: (want[i], i))


class _HostParent(awq_stage._Parent):
    """The formulation the device path replaced: each parent run through ``session.run``, every feed
    copied into numpy, the output copied back out of it."""

    def __call__(self, weights):
        fed = {}
        for t in self.balance:
            w = weights.get(t.name, self.current[t.name])
            name, value = self.walk.feed_weight(t, w)
            fed[name] = value.cpu().numpy() if isinstance(value, torch.Tensor) else value
        for feeds in self.feeds:
            host = {n: v.cpu().numpy() if isinstance(v, torch.Tensor) else v for n, v in feeds.items()}
            host.update({n: v for n, v in fed.items() if n in self.inputs})
            yield torch.from_numpy(self.runtime.session.run([self.output], host)[0])


def _awq_run(llama_dir, tmp_path, name, *flags):
    out = tmp_path / name
    result = run_cli("run", llama_dir / "model.onnx", "--data", llama_dir / "calib.npz", "--scheme", "W4A16",
                     "--group-size", "32", "--algorithm", "awq", *flags, "-o", out, "-q")
    assert result.exit_code == 0, result.output
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    record = json.loads(next(p.value for p in model.metadata_props if p.key == "graphcal.awq"))
    return record, load_written(out)[1]


def test_the_device_path_on_the_cpu_is_the_host_path_bit_for_bit(llama_dir, tmp_path, monkeypatch):
    """tiny-llama's AWQ (with the clip search) through the device-generic path, device cpu, against the
    same run with every parent run on the host through ``session.run``: the same record (ratios,
    errors, clip bounds' errors) and the same written qparams, bit for bit."""
    device_record, device_written = _awq_run(llama_dir, tmp_path, "device", "--awq-clip", "--device", "cpu")
    monkeypatch.setattr(awq_stage, "_Parent", _HostParent)
    host_record, host_written = _awq_run(llama_dir, tmp_path, "host", "--awq-clip", "--device", "cpu")
    assert device_record == host_record and device_record["mappings"] and device_record["clip"]
    assert device_written.keys() == host_written.keys()
    for key, value in device_written.items():
        assert torch.equal(value, host_written[key]), key


def _no_host_copies(monkeypatch):
    """Within AWQ's search, a parent or block output read into numpy raises; returns the parents'
    output devices seen."""
    seen, inside = [], []

    def refuse(what):
        def spy(*args, **kwargs):
            if inside:
                raise AssertionError(f"AWQ made a host copy through {what}")
            return real[what](*args, **kwargs)
        return spy

    real = {"Runtime.run_numpy": Runtime.run_numpy, "InferenceSession.run": ort.InferenceSession.run,
            "Tensor.numpy": torch.Tensor.numpy}
    monkeypatch.setattr(Runtime, "run_numpy", refuse("Runtime.run_numpy"))
    monkeypatch.setattr(ort.InferenceSession, "run", refuse("InferenceSession.run"))
    monkeypatch.setattr(torch.Tensor, "numpy", refuse("Tensor.numpy"))
    smoothing, call = awq_stage.awq_smoothing, awq_stage._Parent.__call__

    def searched(*args, **kwargs):
        inside.append(True)
        try:
            return smoothing(*args, **kwargs)
        finally:
            inside.clear()

    def parent_call(self, weights):
        for y in call(self, weights):
            seen.append(y.device.type)
            yield y

    monkeypatch.setattr(awq_stage, "awq_smoothing", searched)
    monkeypatch.setattr(awq_stage._Parent, "__call__", parent_call)
    return seen


def test_no_parent_output_reaches_numpy_on_the_cpu_path(llama_dir, tmp_path, monkeypatch):
    """The same code path as CUDA's, on the CPU: no ``session.run``, no tensor read into numpy."""
    seen = _no_host_copies(monkeypatch)
    record, _ = _awq_run(llama_dir, tmp_path, "cpu", "--device", "cpu")
    assert record["mappings"] and seen and set(seen) == {"cpu"}


@pytest.mark.gpu
@CUDA
def test_awq_on_cuda_keeps_the_parent_outputs_on_the_gpu(llama_dir, tmp_path, monkeypatch):
    """On CUDA every parent output is a GPU tensor and nothing of AWQ's search goes through numpy."""
    seen = _no_host_copies(monkeypatch)
    record, _ = _awq_run(llama_dir, tmp_path, "cuda", "--awq-clip", "--device", "cuda")
    assert record["mappings"] and record["clip"] and seen and set(seen) == {"cuda"}


@pytest.mark.gpu
@CUDA
def test_awq_on_cuda_chooses_the_cpu_ratios_and_writes_its_weights(llama_dir, tmp_path):
    """The whole ``run --algorithm awq`` on CUDA against the CPU run: each mapping's ratio the CPU's
    (or, where the two differ, a tie within the CUDA kernels' rounding, 2e-2 as tests/calibration/
    test_cuda.py states), its errors within 2e-2, and the written qparams of the layers whose ratios
    agree within 2e-2 of the CPU's."""
    cuda, cuda_written = _awq_run(llama_dir, tmp_path, "cuda", "--device", "cuda")
    cpu, cpu_written = _awq_run(llama_dir, tmp_path, "cpu", "--device", "cpu")
    assert [m["balance"] for m in cuda["mappings"]] == [m["balance"] for m in cpu["mappings"]] and cpu["mappings"]
    agree = set()
    for got, want in zip(cuda["mappings"], cpu["mappings"]):
        assert got["initial_error"] == pytest.approx(want["initial_error"], rel=2e-2)
        assert got["best_error"] == pytest.approx(want["best_error"], rel=2e-2)
        if got["ratio"] == want["ratio"]:
            agree.update(got["balance"])
    assert len(agree) >= len({b for m in cpu["mappings"] for b in m["balance"]}) // 2, (cuda, cpu)
    compared = 0
    for key, value in cuda_written.items():
        if key.rsplit(".", 1)[0] in agree and key.endswith("weight_scale"):
            torch.testing.assert_close(value.float(), cpu_written[key].float(), rtol=2e-2, atol=0)
            compared += 1
    assert compared
