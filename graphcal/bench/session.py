"""onnxruntime sessions as a deployment opens them: default options (only the log level raised), and one call to time.

On CUDA a timed call runs on inputs copied to the GPU once, its outputs left there (IOBinding).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from graphcal.bench.report import OPTIMIZATION
from graphcal.errors import GraphcalError, first_line

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"


def options(**extra):
    """onnxruntime's default session options, quiet: only the log level is set."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    for key, value in extra.items():
        setattr(opts, key, value)
    return opts


def open_session(path: Path, opts, providers: list[str]):
    """A session on ``path``; a model onnxruntime refuses at ORT_ENABLE_ALL is a one-line error
    (saying whether it loads at ORT_ENABLE_BASIC, where fusions are off)."""
    try:
        return ort.InferenceSession(str(path), opts, providers=providers)
    except Exception as e:  # noqa: BLE001 -- onnxruntime raises its own exception types
        detail = first_line(e)
        basic = options(graph_optimization_level=ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)
        try:
            ort.InferenceSession(str(path), basic, providers=providers)
            hint = " (it loads at ORT_ENABLE_BASIC: one of onnxruntime's fusions breaks it)"
        except Exception:  # noqa: BLE001
            hint = ""
        raise GraphcalError(f"{path} does not load in onnxruntime at {OPTIMIZATION}: {detail}{hint}") from None


def runner(session, feeds: dict[str, np.ndarray], provider: str):
    """A zero-argument call that runs ``session`` once on ``feeds``. On CUDA the inputs are
    copied to the GPU once and the outputs stay there (IOBinding), so the time is the model's,
    not the host transfers'; on CPU it is ``session.run`` as a caller makes it."""
    if provider != CUDA:
        return lambda: session.run(None, feeds)
    binding = session.io_binding()
    on_gpu = {name: ort.OrtValue.ortvalue_from_numpy(array, "cuda", 0) for name, array in feeds.items()}
    for name, value in on_gpu.items():
        binding.bind_ortvalue_input(name, value)
    for out in session.get_outputs():
        binding.bind_output(out.name, "cuda", 0)

    def run(_inputs=tuple(on_gpu.values())) -> None:  # the default keeps the GPU inputs alive with the call
        session.run_with_iobinding(binding)  # returns once the GPU has finished

    return run
