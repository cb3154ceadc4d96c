"""Which device runs: ``--device`` checked against the onnxruntime and the GPU at hand, where torch
observes, how a torch tensor is bound for onnxruntime where it lies, and what this CPU's onnxruntime
integer kernels compute (each asked of onnxruntime itself)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from graphcal.errors import GraphcalError, UsageError, first_line

DEVICES = ("auto", "cpu", "cuda")
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


#: onnxruntime's tensor types torch holds: the ONNX element type of each torch dtype
ONNX_TYPE = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
             torch.bfloat16: onnx.TensorProto.BFLOAT16, torch.float64: onnx.TensorProto.DOUBLE,
             torch.int64: onnx.TensorProto.INT64, torch.int32: onnx.TensorProto.INT32, torch.int16: onnx.TensorProto.INT16,
             torch.int8: onnx.TensorProto.INT8, torch.uint8: onnx.TensorProto.UINT8, torch.bool: onnx.TensorProto.BOOL}
TORCH_TYPES = {f"tensor({t})" for t in ("float", "float16", "bfloat16", "double", "int64", "int32", "int16", "int8",
                                        "uint8", "bool")}


def bind_torch_input(binding: ort.IOBinding, name: str, value: torch.Tensor) -> torch.Tensor:
    """Bind ``value`` as input ``name`` from its own memory (host or GPU; no copy unless it is not
    contiguous). Returns the tensor bound, which must stay alive until the run is over."""
    value = value.detach().contiguous()
    if value.dtype not in ONNX_TYPE:
        raise GraphcalError(f"input {name!r}: onnxruntime takes no torch {value.dtype}")
    shape, device = list(value.shape), value.device
    if value.numel() == 0:  # no memory of its own (a null pointer): any buffer does, nothing is read
        value = torch.empty(1, dtype=value.dtype, device=device)
    binding.bind_input(name, "cuda" if device.type == "cuda" else "cpu", device.index or 0, ONNX_TYPE[value.dtype],
                       shape, value.data_ptr())
    return value


def check_device_choice(device: str) -> None:
    """A known ``--device``, and for ``cuda`` an onnxruntime that has the CUDA provider at all."""
    if device not in DEVICES:
        raise UsageError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda" and CUDA not in ort.get_available_providers():
        raise GraphcalError(
            "--device cuda: this onnxruntime has no CUDA provider; install onnxruntime-gpu (not onnxruntime)"
        )


def check_device(device: str) -> None:
    """Refuse ``--device cuda`` up front when onnxruntime cannot run on a GPU here, whatever the
    scheme (a dynamic scheme opens no session of its own, so nothing else would notice): a
    one-node session must start on the CUDA provider."""
    check_device_choice(device)
    if device != "cuda":
        return
    from onnx import TensorProto, helper  # lazy: kept off the CLI's start-up path

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    probe = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe", [x],
                                                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]),
                              opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    import contextlib  # lazy: stdlib, needed on this rare path only
    import io

    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    ort.set_default_logger_severity(4)  # the provider bridge logs its load failure there; the error below says it
    try:
        if hasattr(ort, "preload_dlls"):
            with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(Exception):
                ort.preload_dlls()  # prints what it cannot find; the session below says whether CUDA works
        try:
            active = ort.InferenceSession(probe.SerializeToString(), opts,
                                          providers=[CUDA, CPU]).get_providers()[0]
        except Exception:  # noqa: BLE001 -- any failure to start means no usable GPU
            active = None
    finally:
        ort.set_default_logger_severity(2)
    if active != CUDA:
        raise GraphcalError(
            "--device cuda: onnxruntime could not start its CUDA provider (no usable GPU, or CUDA 12/13 and cuDNN 9 "
            "libraries not loadable); run with --device cpu or fix the CUDA install"
        )


def observer_device(provider: str | None, device: str, device_id: int = 0) -> torch.device:
    """Where torch observes: the GPU the session ran on (or, with no activation pass, the GPU
    ``device`` asks for), when torch can use it; the CPU otherwise."""
    if provider is not None:
        gpu = provider == CUDA
    else:
        gpu = wants_cuda(device)
    return torch.device("cuda", device_id) if gpu and torch.cuda.is_available() else torch.device("cpu")


def wants_cuda(device: str) -> bool:
    """Whether ``--device`` means a run on CUDA: ``cuda``, or ``auto`` with a usable GPU."""
    return device == "cuda" or (device == "auto" and cuda_usable())


def cuda_usable() -> bool:
    """Whether a CUDA GPU is visible, without importing CUDA into onnxruntime."""
    if CUDA not in ort.get_available_providers():
        return False
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return torch.cuda.is_available() or Path("/dev/nvidiactl").exists()


# --------------------------------------------------------------------------------------------
# What this CPU's onnxruntime integer kernels compute
# --------------------------------------------------------------------------------------------

INT8_SATURATION_NOTE = (
    "onnxruntime's u8 x s8 integer kernels on this CPU (x86 without AVX-VNNI) add products in pairs in 16 bits "
    "and saturate: int8-activation layers written for them (MatMulIntegerToFloat, DynamicQuantizeMatMul, QGemm) "
    "lose accuracy on such CPUs; --matmulnbits keeps the numbers there (docs/usage.md#cpus-without-avx-vnni)")


def int8_gemm_saturates() -> bool:
    """Whether onnxruntime's u8 x s8 integer GEMM on this machine's CPU saturates: MLAS's AVX2
    kernel (x86 without AVX-VNNI) sums pairs of u8 x s8 products in int16 (vpmaddubsw), so 255 x 127
    twice gives 32767 instead of 64770. Asked of onnxruntime itself, once, on a 1 x 64 x 1 MatMulInteger."""
    global _SATURATES
    if _SATURATES is None:
        from onnx import TensorProto, helper, numpy_helper  # lazy: kept off the CLI's start-up path

        k = 64
        graph = helper.make_graph(
            [helper.make_node("MatMulInteger", ["a", "b"], ["y"])], "saturation",
            [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, k])],
            [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
            [numpy_helper.from_array(np.full((k, 1), 127, np.int8), "b")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
        try:
            session = ort.InferenceSession(model.SerializeToString(), providers=[CPU])
            got = int(session.run(None, {"a": np.full((1, k), 255, np.uint8)})[0].item())
        except Exception:  # noqa: BLE001 -- a build without the kernel: nothing to warn about
            got = 255 * 127 * k
        _SATURATES = got != 255 * 127 * k
    return _SATURATES


_SATURATES: bool | None = None


BF16 = onnx.TensorProto.BFLOAT16
BF16_ON_CPU = ("its data pass needs bfloat16 kernels, which only onnxruntime's CUDA provider has: run with --device cuda, "
               "or convert the model to float32 or float16 first (a weight-only scheme rounded to nearest, such as "
               "W4A16 without --algorithm, takes no data pass and runs here)")
_NO_KERNEL = "Could not find an implementation for "


def bf16_cpu_refusal(error: Exception, model) -> str | None:
    """The one line for onnxruntime refusing ``model`` (a ModelProto) for a kernel it lacks (NOT_IMPLEMENTED:
    the graph's types resolved, the provider has no kernel for them) where the model computes in bfloat16;
    None for any other error."""
    if "NOT_IMPLEMENTED" not in str(error) or not hasattr(model, "graph"):
        return None
    graph = model.graph
    if not (any(i.data_type == BF16 for i in graph.initializer)
            or any(v.type.tensor_type.elem_type == BF16 for v in (*graph.input, *graph.output))):
        return None
    line = first_line(error)
    found = line.find(_NO_KERNEL)
    kernel = "no kernel for " + line[found + len(_NO_KERNEL):] if found >= 0 else line
    return f"onnxruntime's CPU provider cannot run this bfloat16 model ({kernel}): {BF16_ON_CPU}"
