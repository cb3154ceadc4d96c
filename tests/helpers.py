"""Test helpers: compressed-tensors references, error metrics, the QDQ writer as the pipeline drives it.

Models run through graphcal.runtime.run_model (onnxruntime on CPU at ORT_ENABLE_BASIC, or
onnx.reference for fp4 / e8m0 models)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

#: the repository root, and its shipped test models (every test file finds its data from here, at any depth)
REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models"
# llm-compressor's own outputs for SmoothQuant, GPTQ and AWQ (shared/ beside the repository)
ALGORITHM_VECTORS = REPO.parent / "shared" / "reference" / "algorithm_vectors.pt"


def int8_kernels_saturate() -> bool:
    """Whether onnxruntime's u8 x s8 integer GEMM on this CPU differs from exact integer arithmetic
    (numpy's int32 matmul) on random full-range data: on x86 without AVX-VNNI, MLAS's AVX2 kernel adds
    products in pairs in int16 with saturation. Tests comparing onnxruntime's integer kernels with
    the Q/DQ spec need a CPU where it does not (graphcal.devices.int8_gemm_saturates asks the same
    of a single extreme case; tests/test_saturation.py checks the two agree)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (16, 256), dtype=np.uint8)
    b = rng.integers(-127, 128, (256, 32), dtype=np.int8)
    graph = helper.make_graph([helper.make_node("MatMulInteger", ["a", "b"], ["y"])], "exact",
                              [helper.make_tensor_value_info("a", TensorProto.UINT8, [16, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
                              [numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"a": a})[0]
    return not np.array_equal(got, a.astype(np.int32) @ b.astype(np.int32))


INT8_SATURATES = int8_kernels_saturate()
#: why a comparison of onnxruntime's integer kernels with the Q/DQ spec is left out on this CPU
SATURATION_REASON = ("onnxruntime's u8 x s8 kernels saturate on this CPU (x86 without AVX-VNNI): their numbers are "
                     "not the Q/DQ spec's here (graphcal warns; tests/test_saturation.py)")


def ulps_apart(got: torch.Tensor, want: torch.Tensor) -> int:
    """The most units in the last place between ``got`` and ``want``, element by element (same dtype
    and shape: float32 or float64; opposite signs count as far apart unless both are zero)."""
    assert got.dtype == want.dtype and got.dtype in (torch.float32, torch.float64) and got.shape == want.shape
    bits = torch.int32 if got.dtype == torch.float32 else torch.int64
    a, b = got.contiguous().view(bits).long(), want.contiguous().view(bits).long()
    # the bits of same-signed floats are ordered like the floats: their difference counts ulps
    same_sign = (a < 0) == (b < 0)
    far = torch.iinfo(torch.int64).max
    distance = torch.where(same_sign, (a - b).abs(), torch.where(got == want, 0, far))
    return int(distance.max()) if distance.numel() else 0


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int) -> None:
    """``got`` equals ``want`` to at most ``ulps`` units in the last place (:func:`ulps_apart`). For
    torch's vectorized transcendentals and reductions, whose last bit depends on the CPU's
    instruction set (AVX2 / AVX-512): the reference vectors were made on another CPU."""
    worst = ulps_apart(got, want)
    assert worst <= ulps, f"{worst} ulps apart (max |difference| {float((got - want).abs().max()):.3g})"


def sqnr_db(ref: np.ndarray, got: np.ndarray) -> float:
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    return float(10 * np.log10((ref**2).sum() / max(((ref - got) ** 2).sum(), 1e-300)))


def load_written(out_dir: Path):
    """(QuantizationConfig, qparams dict) from a graphcal output folder, via compressed-tensors."""
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    config = QuantizationConfig.model_validate(json.loads((out_dir / "quantization_config.json").read_text()))
    return config, load_file(str(out_dir / "qparams.safetensors"))


def ct_torch_reference(builder, out_dir: Path, feeds: dict) -> np.ndarray:
    """The torch model with graphcal's written config and qparams applied by compressed-tensors.

    compressed-tensors' own apply_quantization_config wraps every targeted Linear with its
    fake quantization (weights and inputs, dynamic or static); the qparams are loaded from
    qparams.safetensors. Returns the first output.
    """
    from compressed_tensors.quantization import apply_quantization_config

    model, _, output_names, _ = builder()
    config, params = load_written(out_dir)
    apply_quantization_config(model, config, show_progress=False)
    named = dict(model.named_parameters())
    for key, value in params.items():
        assert key in named, f"{key} is not a compressed-tensors parameter of the torch model"
        named[key].data = value.to(named[key].dtype).reshape(named[key].shape)
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v) for k, v in feeds.items()})
    first = getattr(out, output_names[0]) if hasattr(out, output_names[0]) else out[0]
    return first.numpy()


def ct_layer_reference(x: torch.Tensor, w: torch.Tensor, scheme, params: dict, name: str) -> torch.Tensor:
    """fake_quantize(x) @ fake_quantize(W).T with compressed-tensors' functions and the written qparams.

    Dynamic scales come from compressed-tensors' compute_dynamic_scales_and_zp; tensor_group
    schemes pass the written global scales, as compressed-tensors' forward does.
    """
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    def zp(base, scale):
        return params.get(f"{name}.{base}_zero_point", torch.zeros_like(scale).to(torch.int8))

    ws = params[f"{name}.weight_scale"]
    wq = fake_quantize(w, ws, zp("weight", ws), scheme.weights, global_scale=params.get(f"{name}.weight_global_scale"))
    a = scheme.input_activations
    gs = params.get(f"{name}.input_global_scale")
    if a is None:
        xq = x
    elif a.dynamic:
        s, z = compute_dynamic_scales_and_zp(x, a, None, global_scale=gs)
        xq = fake_quantize(x, s, z, a, global_scale=gs)
    else:
        s = params[f"{name}.input_scale"]
        xq = fake_quantize(x, s, zp("input", s), a, global_scale=gs)
    return xq @ wq.T


def write_qdq(model: onnx.ModelProto, items: list, runtime: str = "onnxruntime", matmulnbits: int | None = None
              ) -> onnx.ModelProto:
    """The Q/DQ model for ``items``, written as graphcal.calibration.pipeline writes it: a QDQWriter at the opset
    ``items_opset`` gives, each weight read and quantized, then each input, then ``finish()``. It
    writes into a copy (the pipeline writes into a model it loaded itself), so ``model`` stays
    usable for references."""
    from graphcal.graph.qdq import QDQWriter, items_opset
    from graphcal.graph.targets import torch_weight

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    writer = QDQWriter(copy, items_opset(items, target_runtime=runtime), runtime, matmulnbits=matmulnbits)
    for item in items:
        writer.quantize_weight(item, torch.from_numpy(torch_weight(writer.model, item.target)))
    for item in items:
        writer.quantize_input(item)
    return writer.finish()


# `python -c PAUSED_RUN ARGS...` is `graphcal ARGS...` stopped at one named point of its write:
# there it touches $GC_PAUSED and waits for $GC_GO to exist (at most 60 s), so a test can act on
# the run (SIGKILL, SIGTERM, a second run) at that point and nowhere else, whatever the machine's speed.
# The points, in the order a run reaches them (graphcal.output.OutputSlot.write):
#   write       -- calibrated, -o locked and checked, nothing written yet (before OutputSlot._write_tmp)
#   save_model  -- the temporary folder beside -o holds its marker and model.onnx, nothing else
#   swap        -- the temporary folder is complete (all files and the manifest), -o untouched (before _swap)
#   moved_aside -- the previous -o has been renamed to .NAME.old-*, the new folder is not moved in yet
# (the last is reached by wrapping os.rename in the child: graphcal.output has no hook there).
PAUSED_RUN = """
import os, re, sys, time
from pathlib import Path

def pause():
    Path(os.environ["GC_PAUSED"]).touch()
    deadline = time.monotonic() + 60
    while not Path(os.environ["GC_GO"]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)

stage = os.environ["GC_PAUSE_AT"]
if stage == "save_model":
    import graphcal.calibration.pipeline as pipeline
    real = pipeline.save_model
    def save_model(*args, **kwargs):
        files = real(*args, **kwargs)
        pause()
        return files
    pipeline.save_model = save_model
elif stage in ("write", "swap"):
    from graphcal.output import OutputSlot
    method = {"write": "_write_tmp", "swap": "_swap"}[stage]
    real = getattr(OutputSlot, method)
    def paused(self, *args, **kwargs):
        pause()
        return real(self, *args, **kwargs)
    setattr(OutputSlot, method, paused)
elif stage == "moved_aside":
    real = os.rename
    def rename(src, dst, *args, **kwargs):
        real(src, dst, *args, **kwargs)
        if re.fullmatch(r"\\..+\\.old-\\d+-[0-9a-f]{8}", os.path.basename(os.fspath(dst))):
            pause()
    os.rename = rename
else:
    raise SystemExit(f"unknown pause point {stage!r}")
from graphcal.cli import main
sys.argv = ["graphcal", *sys.argv[1:]]
main()
"""
PAUSE_POINTS = ("write", "save_model", "swap", "moved_aside")


def paused_run(args: list[str], point: str, folder: Path) -> tuple[subprocess.Popen, Path]:
    """Start ``graphcal *args`` in a subprocess and return it once it waits at ``point`` (one of
    :data:`PAUSE_POINTS`), with the file whose creation lets it go on. ``folder`` holds the two
    signal files (``paused``, ``go``)."""
    assert point in PAUSE_POINTS, point
    paused, go = folder / "paused", folder / "go"
    env = {**os.environ, "GC_PAUSE_AT": point, "GC_PAUSED": str(paused), "GC_GO": str(go)}
    proc = subprocess.Popen([sys.executable, "-c", PAUSED_RUN, *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not paused.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"the run never reached {point}"
        time.sleep(0.05)
    return proc, go



@contextlib.contextmanager
def time_box(seconds: float):
    """Fail (TimeoutError) instead of hanging when the block runs past ``seconds`` (POSIX; main thread)."""
    import signal

    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_cli(*args, **kwargs):
    """``graphcal ARGS`` in this process, as every test runs the CLI: click's CliRunner on graphcal.cli.cli,
    each argument passed as ``str`` (paths welcome). ``kwargs`` go to ``CliRunner.invoke`` (``input``,
    ``env``, ``catch_exceptions``). Returns click's Result: ``exit_code``, ``output`` (stdout and stderr),
    ``stdout``, ``stderr``, ``exception``."""
    from click.testing import CliRunner

    from graphcal.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args], **kwargs)


def run_cli_process(*args, timeout: float = 300, cwd=None, env=None) -> subprocess.CompletedProcess:
    """``python -m graphcal ARGS`` in a child process, for the tests that need a real one (the exit code and
    stderr that ``main`` gives, a fresh interpreter, a hang guard): text stdout and stderr captured, killed
    past ``timeout`` seconds (TimeoutExpired fails the test), this checkout first on PYTHONPATH, ``env``
    added to os.environ."""
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "graphcal", *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


LAYER_NODES = ("/fc1/MatMul", "/fc3/MatMul", "/fc2/Gemm")  # the ``layers`` fixture's weight nodes


def run_layers(layers, tmp_path, scheme, *extra) -> tuple:
    """`graphcal run --json` on the ``layers`` fixture's model: (written model path, JSON summary)."""
    folder, _ = layers
    out = tmp_path / "out"
    result = run_cli("run", folder / "model.onnx", "--data", folder / "calib.npz", "--scheme", scheme, "-o", out,
                     "--device", "cpu", "--json", *extra)
    assert result.exit_code == 0, result.output
    return out / "model.onnx", json.loads(result.stdout)


# Known, harmless exporter chatter (HF mask code under the tracer, aten::index, torch pytree): the
# pytestmark of test modules that export transformers models.
EXPORTER_CHATTER = [
    pytest.mark.filterwarnings("ignore:Converting a tensor to a Python boolean"),
    pytest.mark.filterwarnings("ignore:Exporting aten.*index operator of advanced indexing"),
    pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\)"),
]


def reference_llama(case: dict, folder: Path) -> tuple[Path, dict, np.ndarray]:
    """The llm-compressor reference vectors' tiny random Llama (an ``e2e`` case), exported to ONNX with
    graphcal's exporter: (model path, the case's feeds as arrays, the torch model's logits)."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from graphcal.export import BATCH_SEQ_AXES, export_torch

    inp = case["inputs"]
    config = LlamaConfig(use_cache=False, **inp["llama_config"])
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(inp["init_state_dict"], strict=True)
    feeds = {"input_ids": inp["input_ids"], "attention_mask": inp["attention_mask"]}
    axes = {n: dict(BATCH_SEQ_AXES) for n in ("input_ids", "attention_mask", "logits")}
    path = export_torch(model, feeds, folder / "model.onnx", output_names=["logits"], dynamic_axes=axes)
    with torch.no_grad():
        logits = model(**feeds).logits.numpy()
    return path, {k: v.numpy() for k, v in feeds.items()}, logits


# llm-compressor's recipe for a whole model in int4 g32: config groups for Linear and Embedding, nothing ignored
WHOLE_INT4_RECIPE = """quant_stage:
  quant_modifiers:
    QuantizationModifier:
      ignore: []
      config_groups:
        body:
          targets: [Linear]
          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}
        table:
          targets: [Embedding]
          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}
"""


def signal_paused_run(script: str, args: list, tmp_path: Path, sig: int, what: str, check=None):
    """``python -c script ARGS`` (a CLI run patched to create the file ``$GC_PAUSED`` and wait at some point),
    sent ``sig`` once that file exists (within 120 s; ``what`` says where in the message), after ``check()``
    (assertions on what the paused run holds): (its exit code, its stderr)."""
    paused = tmp_path / "paused"
    proc = subprocess.Popen([sys.executable, "-c", script, *map(str, args)],
                            env={**os.environ, "PYTHONPATH": str(REPO), "GC_PAUSED": str(paused)}, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not paused.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"the run never reached {what}"
            time.sleep(0.05)
        if check is not None:
            check()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, err
