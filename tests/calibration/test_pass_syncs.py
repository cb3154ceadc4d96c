"""The activation pass reads from the device once per batch at most (none for min/max observers), and
still refuses a NaN or Inf with its tap, batch and observer.

References: the error text the pass has always given (tests/cli/test_errors.py), llm-compressor's
search loop written out below (one host read per candidate) for the MSE search, ``torch.bincount``
for the histogram's counts, and on a GPU the CPU run's scales.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from onnx import TensorProto, helper, numpy_helper

import graphcal.calibration.activations as activations
from graphcal import calibrate
from graphcal.calibration.observe import ObserverSet
from graphcal.calibration.prepare import prepare
from graphcal.config import Options, resolve
from graphcal.errors import GraphcalError
from graphcal.observers.histogram import bin_counts
from graphcal.observers.mse import shrink_search
from tests.helpers import load_written

SYNCS = ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy")
PASS = str(Path(activations.__file__))
OBSERVERS = {str(Path(activations.__file__).parents[1] / "observers" / f) for f in ("base.py", "min_max.py", "mse.py",
                                                                                      "histogram.py")}


def _asker(frame) -> str:
    """Who a read is for: "observer" (an observer's own work, however the pass called it), "pass"
    (the activation pass, helpers it calls included), else "other"."""
    while frame is not None:
        if frame.f_code.co_filename in OBSERVERS:
            return "observer"
        if frame.f_code.co_filename == PASS:
            return "pass"
        frame = frame.f_back
    return "other"


@pytest.fixture
def syncs(monkeypatch):
    """Every read of a tensor to the host, counted by who asked for it (:func:`_asker`)."""
    counts: Counter = Counter()
    for name in SYNCS:
        method = getattr(torch.Tensor, name)

        def counted(self, *args, _method=method, **kwargs):
            counts[_asker(sys._getframe(1))] += 1
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


def _log_model(path: Path) -> Path:
    """h = log(x), y = h @ w, z = log(y): NaN where x < 0 (or y < 0), -Inf where x == 0."""
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    w2 = numpy_helper.from_array(np.ones((4, 4), np.float32), "w2")
    graph = helper.make_graph(
        [helper.make_node("Log", ["x"], ["h"], name="log"),
         helper.make_node("MatMul", ["h", "w"], ["y"], name="/fc/MatMul"),
         helper.make_node("Log", ["y"], ["z"], name="log2"),
         helper.make_node("MatMul", ["z", "w2"], ["out"], name="/fc2/MatMul")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 4])], [w, w2])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


@pytest.mark.parametrize("observer", ["static_minmax", "minmax", "mse", "histogram_mse"])
@pytest.mark.parametrize("bad, batch", [((3, 0), 1), ((13, 2), 6), ((1, 1), 0)])
def test_a_non_finite_tap_is_refused_with_its_tap_batch_and_observer(tmp_path, monkeypatch, observer, bad, batch):
    monkeypatch.setattr(activations, "CHECK_EVERY", 4)  # deferred checks read back within the pass too
    model = _log_model(tmp_path / "m.onnx")
    x = np.full((16, 4), 2.0, np.float32)
    x[bad] = -1.0  # NaN in h from this batch (of 2 samples) on, and in z
    x[15, 3] = 0.0  # -Inf in h in the last batch: later, not the one reported
    with pytest.raises(GraphcalError) as caught:
        calibrate(model, {"x": x}, tmp_path / "o", scheme="W8A8_STATIC", observer=observer, batch_size=2)
    assert str(caught.value).startswith(f"tap 'h' holds NaN or Inf in batch {batch} (observer {observer});")


def _pass_syncs(syncs: Counter, llama_dir: Path, batches: int, observer: str | None, **kwargs) -> int:
    """The host reads the activation pass itself makes over ``batches`` batches of tiny-llama."""
    data = {k: v[:2 * batches] for k, v in np.load(llama_dir / "calib.npz").items()}
    ready = prepare(llama_dir / "model.onnx", resolve(Options(scheme="W8A8_STATIC", observer=observer)), data=data,
                    batch_size=2, device="cpu")
    observers = ObserverSet(ready.plan, {})
    syncs.clear()
    activations.run_activation_pass(ready.plan, ready.loaded, observers, ready.calib, device="cpu",
                                    inputs=ready.inputs, **kwargs)
    return syncs["pass"]


@pytest.mark.parametrize("observer, kwargs, per_batch", [
    ("static_minmax", {}, 0),  # in-graph reductions: finiteness kept on the device, read at the end
    ("minmax", {"reduce_in_graph": False}, 0),  # whole taps into min/max observers: the same
    ("static_minmax", {"exclude_padding": True}, 0),  # padding rows found on the host, once a batch
    ("mse", {}, 1),  # whole taps into a search: one read of every tap's finiteness, before they are fed
    ("histogram_mse", {}, 1),
])
def test_the_pass_reads_from_the_device_once_per_batch_at_most(syncs, llama_dir, observer, kwargs, per_batch):
    """A read per tap per batch (8 taps on tiny-llama) fails this."""
    few, many = (_pass_syncs(syncs, llama_dir, n, observer, **kwargs) for n in (2, 6))
    assert many - few == per_batch * 4, (few, many)
    assert few <= 2 * per_batch + 1


def _eager_search(errors: list[torch.Tensor], min0, max0, patience):
    """llm-compressor's loop: candidate by candidate, a host read of each improvement."""
    best_err = torch.full(min0.shape, torch.finfo(torch.float32).max)
    best_min, best_max, stalled = min0.clone(), max0.clone(), 0
    for i, err in enumerate(errors):
        improved = err < best_err
        if bool(improved.any()):
            best_err = torch.where(improved, err, best_err)
            best_min, best_max = torch.where(improved, min0 * (1 - i / 100), best_min), torch.where(
                improved, max0 * (1 - i / 100), best_max)
            stalled = 0
        else:
            stalled += 1
            if patience is not None and stalled >= patience:
                break
    return best_min, best_max


@pytest.mark.parametrize("patience", [None, 0, 1, 3, 5, 12])
@pytest.mark.parametrize("case", ["random", "first_nan", "stalls"])
def test_the_mse_search_reads_each_batch_of_candidates_once_and_keeps_the_eager_choice(patience, case):
    g = torch.Generator().manual_seed(patience or 0)
    steps, q = 20, 6
    errors = [torch.rand(q, generator=g) for _ in range(steps)]
    if case == "first_nan":  # no candidate improves on the first: patience may stop inside the first batch
        errors[0] = torch.full((q,), float("nan"))
        errors[patience or 0] = torch.zeros(q) if patience else errors[0]
    if case == "stalls":
        errors = [torch.full((q,), 1.0 - 0.01 * min(i, 2)) for i in range(steps)]
    min0, max0 = -torch.rand(q, generator=g) - 0.1, torch.rand(q, generator=g) + 0.1
    calls = iter(range(steps))
    reads = Counter()

    class Errors:  # the errors given: a search whose every step is known
        dtype = torch.float32

        def __call__(self, scale, zero_point, args):
            reads["scored"] += 1
            return torch.stack([errors[next(calls)] for _ in range(scale.shape[0])])

    real = torch.Tensor.tolist

    def tolist(self):
        reads["tolist"] += 1
        return real(self)

    args = QuantizationArgs(num_bits=8, strategy="tensor", symmetric=True)
    torch.Tensor.tolist = tolist
    try:
        got = shrink_search(torch.zeros(1, q, 1), args, [1 - i / 100 for i in range(steps)], norm=2.4,
                            patience=patience, extrema=(min0, max0), scores=Errors())
    finally:
        torch.Tensor.tolist = real
    want = _eager_search(errors, min0, max0, patience)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert reads["tolist"] == reads["scored"]  # one read per batch of candidates, not one per candidate
    if patience is None:
        assert reads["scored"] == -(-steps // 8)


def test_histogram_counts_by_index_add_are_bincount():
    g = torch.Generator().manual_seed(0)
    index = torch.randint(0, 2048, (50_000,), generator=g, dtype=torch.int32)
    index[:5000] = 1024  # one hot bin, as activations near zero make
    assert torch.equal(bin_counts(index, 2048, add=True), torch.bincount(index, minlength=2048))
    assert torch.equal(bin_counts(index, 2048), torch.bincount(index, minlength=2048))


cuda = pytest.mark.skipif(not torch.cuda.is_available() or "CUDAExecutionProvider" not in ort.get_available_providers(),
                          reason="needs a CUDA GPU, a CUDA torch and onnxruntime-gpu")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("observer", ["static_minmax", "mse", "histogram_mse", "percentile"])
def test_on_cuda_no_tap_leaves_the_gpu_and_the_scales_are_the_cpu_runs(llama_dir, tmp_path, monkeypatch, observer):
    import graphcal.calibration.pipeline as pipeline

    moved = []
    real_pass = pipeline.run_activation_pass

    def guarded(*args, **kwargs):
        with pytest.MonkeyPatch.context() as inside:
            for name in ("cpu", "numpy"):
                method = getattr(torch.Tensor, name)

                def refuse(self, *a, _method=method, _name=name, **k):
                    if self.is_cuda:
                        moved.append((_name, tuple(self.shape)))
                    return _method(self, *a, **k)

                inside.setattr(torch.Tensor, name, refuse)
            return real_pass(*args, **kwargs)

    monkeypatch.setattr(pipeline, "run_activation_pass", guarded)
    data = dict(np.load(llama_dir / "calib.npz"))
    for device in ("cpu", "cuda"):
        calibrate(llama_dir / "model.onnx", data, tmp_path / device, scheme="W8A8_STATIC", observer=observer,
                  device=device, batch_size=4)
    assert not moved, f"taps copied to the host during the pass: {moved[:5]}"
    _, on_cpu = load_written(tmp_path / "cpu")
    _, on_gpu = load_written(tmp_path / "cuda")
    assert on_cpu.keys() == on_gpu.keys()
    for key in on_cpu:  # onnxruntime's CUDA kernels round differently (TF32): close, not equal
        torch.testing.assert_close(on_gpu[key].float(), on_cpu[key].float(), rtol=2e-2, atol=1e-6, msg=key)
