"""graphcal: offline quantization calibration for ONNX graphs.

Finds the MatMul/Gemm weight targets of an ONNX model, streams calibration data through
onnxruntime, observes activations and weights with llm-compressor's observers, and writes a
QDQ ONNX model plus compressed-tensors metadata.
"""

from graphcal.errors import GraphcalError, UsageError

__version__ = "0.1.0"
__all__ = ["calibrate", "Options", "load_data", "GraphcalError", "UsageError", "__version__"]


def __getattr__(name):  # keep `import graphcal` light: torch/onnx load on first use
    if name == "calibrate":
        from graphcal.calibration.pipeline import calibrate  # lazy: keeps `import graphcal` light (torch, onnx load on first use)

        return calibrate
    if name == "Options":
        from graphcal.config import Options  # lazy: the record of every `graphcal run` option (config loads torch, onnx)

        return Options
    if name == "load_data":
        from graphcal.data import load_data  # lazy: keeps `import graphcal` light (torch, onnx load on first use)

        return load_data
    raise AttributeError(name)
