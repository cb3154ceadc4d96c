"""One onnxruntime session over the tapped model: provider choice, and tensors handed to torch.

onnxruntime-gpu falls back to CPU silently when CUDA cannot load, so the provider that
really runs is read back from the session and reported, never assumed.

Every batch runs through an IOBinding whose outputs onnxruntime allocates on the session's
device; each output reaches torch through DLPack, without a copy. On CUDA the taps therefore
stay on the GPU from onnxruntime to the observers (no host round trip); on CPU the same path
saves the copy into numpy that ``session.run`` makes. Where torch has no CUDA (a CPU-only torch
beside onnxruntime-gpu), the outputs are bound to host memory instead.

``GRAPHCAL_STARTUP_PROBE=FILE`` (tools/startup.py, tests/test_startup.py): the first batch handed to
onnxruntime writes the time and the modules loaded to FILE and ends the process there, before the
batch runs: what a command imported and how long it took to start.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from graphcal.devices import CPU, CUDA, TORCH_TYPES, bf16_cpu_refusal, bind_torch_input, check_device_choice, observer_device, wants_cuda
from graphcal.errors import GraphcalError, first_line
from graphcal.graph import io as graph_io
from graphcal.graph.external import is_external, own_ref, read_tensor_buffer, rebase
from graphcal.limits import confinement

#: the environment variable naming the startup probe's file (see the module's docstring)
STARTUP_PROBE = "GRAPHCAL_STARTUP_PROBE"


def startup_probe() -> None:
    """Under ``GRAPHCAL_STARTUP_PROBE=FILE``: write ``{"time": time.time(), "modules": [...]}`` to FILE and end
    the process at once (exit 0, nothing cleaned up). Called as a batch is about to be handed to onnxruntime."""
    path = os.environ.get(STARTUP_PROBE)
    if not path:
        return
    Path(path).write_text(json.dumps({"time": time.time(), "modules": sorted(sys.modules)}))
    os._exit(0)


@dataclass
class Runtime:
    """A session that runs the tapped graph once per batch and returns the taps as torch tensors."""

    session: ort.InferenceSession
    outputs: list[str]
    provider: str
    device: torch.device = torch.device("cpu")  # where the taps are handed to torch
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, repr=False)
    _weights: list = field(default_factory=list, repr=False)  # buffers the session reads (see open_runtime)

    @property
    def inputs(self) -> set[str]:
        """The graph inputs the session takes (a pruned graph may take fewer than the model)."""
        return {i.name for i in self.session.get_inputs()}

    def run(self, feeds: dict[str, np.ndarray | torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run one batch; every output comes back as a torch tensor on ``self.device``, sharing
        onnxruntime's memory (it lives as long as the tensor does). A feed may be a torch tensor,
        on the host or on the GPU: onnxruntime reads it where it lies (:func:`bind_torch_input`)."""
        startup_probe()
        binding = self.session.io_binding()
        held, gpus = [], set()  # the bound tensors, alive until the run is over
        for name, value in feeds.items():
            if isinstance(value, torch.Tensor):
                held.append(bind_torch_input(binding, name, value))
                if value.device.type == "cuda":
                    gpus.add(value.device)
            else:
                binding.bind_cpu_input(name, value)  # copied to the device by onnxruntime where needed
        if self.device.type == "cuda":
            gpus.add(self.device)
        # onnxruntime runs on its own stream: what torch queued must be done first, both the inputs it
        # made and its reads of earlier outputs (whose memory onnxruntime may hand out again once dropped)
        for gpu in gpus:
            torch.cuda.current_stream(gpu).synchronize()
        for name in self.outputs:
            binding.bind_output(name, self.device.type, self.device.index or 0)
        try:
            self.session.run_with_iobinding(binding)  # returns once the device has finished the batch
        except Exception as e:  # onnxruntime raises RuntimeError and its own types from a kernel
            detail = first_line(e).removeprefix("Error in execution: ")
            raise GraphcalError(f"onnxruntime failed on a batch: {detail}") from e
        return {name: torch.from_dlpack(value) for name, value in zip(self.outputs, binding.get_outputs())}

    @property
    def torch_outputs(self) -> bool:
        """Whether every output has an element type torch takes (:meth:`run`); float8 and int4 do not."""
        return all(o.type in TORCH_TYPES for o in self.session.get_outputs() if o.name in self.outputs)

    def run_shared(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """:meth:`run` with every output as a numpy array over onnxruntime's own memory (on the CPU,
        through DLPack): no copy of a large output (a vocabulary's logits) beside onnxruntime's.
        An output numpy cannot view (bfloat16) comes as a copy."""
        out = {}
        for name, value in self.run(feeds).items():
            try:
                out[name] = value.numpy()
            except TypeError:  # a torch dtype numpy lacks
                out[name] = value.float().numpy()
        return out

    def run_numpy(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch through ``session.run``: every output as a numpy array on the host, of
        any element type onnxruntime returns (float8 and int4 included, which torch cannot take)."""
        startup_probe()
        try:
            values = self.session.run(self.outputs, feeds)
        except Exception as e:  # onnxruntime raises RuntimeError and its own types from a kernel
            detail = first_line(e).removeprefix("Error in execution: ")
            raise GraphcalError(f"onnxruntime failed on a batch: {detail}") from e
        return dict(zip(self.outputs, values))

    def close(self) -> None:
        """Drop the session (and its copy of the weights) and hand the memory back before the weight phase."""
        self.session = None
        self._weights = []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        trim_heap()


def trim_heap() -> None:
    """Return freed heap pages to the OS (glibc keeps them otherwise); a no-op elsewhere.

    The session goes by reference count; a gc.collect() here changed nothing on the bench
    decoder's peak and cost 0.19 s (the whole process's objects) on every run."""
    import ctypes  # lazy: stdlib, needed on this rare path only

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def open_runtime(
    model: onnx.ModelProto,
    outputs: list[str],
    device: str = "auto",
    optimization: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    device_id: int = 0,
    external_folder: str | os.PathLike | None = None,
    weights: Sequence[onnx.TensorProto] = (),
    renamed_weights: Sequence[tuple[str, onnx.TensorProto]] = (),
    priority_order: bool = False,
) -> Runtime:
    """Create the session on ``device`` ("auto" | "cpu" | "cuda"; GPU ``device_id``) and check which provider runs.

    ``weights`` are initializers that live beside ``model`` (the weightless tapped graph reads
    the original model's initializers, which are never copied into it); ``renamed_weights`` are
    more of them, each under the name the graph reads it by (eval's two models in one graph).
    ``priority_order`` runs nodes in onnxruntime's priority order (node order where it can; the
    tapped calibration pass), else in its default order (depth first back from the outputs; graph.compare
    builds for that). Neither suits every graph: on a model with activation Q/DQ, onnxruntime adds
    DequantizeLinear copies at the highest node indices and priority order then dequantizes every
    weight up front."""
    check_device_choice(device)
    want_cuda = wants_cuda(device)
    providers = [(CUDA, {"device_id": device_id}), CPU] if want_cuda else [CPU]
    if want_cuda and hasattr(ort, "preload_dlls"):
        try:
            ort.preload_dlls()  # CUDA/cuDNN from the nvidia-* pip packages, when present
        except Exception:
            pass
    opts = ort.SessionOptions()
    opts.graph_optimization_level = optimization
    # The memory pattern planner keeps a tapped graph's activations apart (extra consumers):
    # measured on the bench decoder, off is both faster and 0.9 GB smaller (docs/benchmarks.md).
    opts.enable_mem_pattern = False
    if _fp16_group_query_attention(model):
        # onnxruntime's CPU planner may hand an fp16 GroupQueryAttention's present output the past
        # input's buffer (in place), which fails for an empty past ({B, H, 0, D} != {B, H, S, D}) in a
        # tapped graph: onnxruntime-genai's CUDA fp16 builds, run on the CPU. No buffer reuse there.
        opts.enable_mem_reuse = False
    if priority_order:
        opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    opts.log_severity_level = 4 if device == "auto" else 3  # keep CUDA probing quiet in auto mode
    tmp, keep = None, []
    graph, names, values = _inline_weights_apart(model, weights, renamed_weights)
    if not graph_io.past_protobuf_limit(graph):  # the graph as bytes; its weights handed over in memory
        if names:
            opts.add_external_initializers(names, values)
            keep = values  # onnxruntime reads these buffers for the session's lifetime
        source: str | bytes = graph.SerializeToString()
        if external_folder is not None:  # weights stay in the model's own data files: onnxruntime reads them there
            opts.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                          _data_folder(graph, external_folder))
    else:  # a graph over 2 GB even without its weights: one file with external data, model untouched
        tmp = tempfile.TemporaryDirectory(prefix="graphcal-")
        path = Path(tmp.name) / "tapped.onnx"
        whole = onnx.ModelProto()
        whole.CopyFrom(model)
        whole.graph.initializer.extend(weights)
        graph_io.save_with_external_data(whole, path, base_dir=external_folder)
        del whole
        source = str(path)  # its data file lies beside it, with every weight copied over
    del graph
    try:
        session = ort.InferenceSession(source, sess_options=opts, providers=providers)
    except Exception as e:  # onnxruntime raises its own exception types
        if tmp is not None:
            tmp.cleanup()
        refusal = None if want_cuda else bf16_cpu_refusal(e, model)
        if refusal is not None:
            raise GraphcalError(refusal) from e
        raise GraphcalError(f"onnxruntime cannot load the model: {first_line(e)}") from e
    active = session.get_providers()[0]
    if device == "cuda" and active != CUDA:
        raise GraphcalError(
            "--device cuda: onnxruntime could not start its CUDA provider (CUDA 12/13 and cuDNN 9 libraries "
            "must be loadable); run with --device cpu or fix the CUDA install"
        )
    return Runtime(session, list(outputs), active, observer_device(active, device, device_id), tmp, keep)


# --------------------------------------------------------------------------------------------
# Running a whole model for its values: graphcal eval, tools/accuracy.py and the tests.
# --------------------------------------------------------------------------------------------

ONNXRUNTIME, REFERENCE = "onnxruntime", "onnx.reference"


@dataclass
class ModelRunner:
    """A model opened once to run many batches: ``run(feeds)`` -> ``{output name: numpy array}``.

    ``kind`` is ``"onnxruntime"`` (at the level :func:`open_model_runner` was given, on ``provider``)
    or ``"onnx.reference"`` (onnx's ReferenceEvaluator, for the fp4 / e8m0 models onnxruntime cannot
    run; ``provider`` None). Outputs are numpy arrays on the host, or torch tensors on the session's
    GPU where it runs on one (``device``: see :func:`open_model_runner`)."""

    outputs: list[str]
    kind: str
    _run: Callable[[dict], dict[str, np.ndarray]] = field(repr=False)
    provider: str | None = None
    device: torch.device = torch.device("cpu")  # where the outputs lie

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._run(feeds)


def open_model_runner(
    model: onnx.ModelProto | str | os.PathLike,
    outputs: Sequence[str] | None = None,
    *,
    optimization: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    external_folder: str | os.PathLike | None = None,
    shared: bool = False,
    device: str = "cpu",
    device_id: int = 0,
) -> ModelRunner:
    """Open ``model`` (a ModelProto or an .onnx path) to fetch ``outputs`` (default: the graph's outputs).

    onnxruntime on its CPU provider through :func:`open_runtime` (same session set-up as the
    calibration pass, load errors as one line) at ``optimization``; ORT_ENABLE_BASIC, the default,
    applies no QDQ fusions, so Q/DQ numerics are the ONNX spec's. Models onnxruntime cannot run
    (``graph.io.runs_in_onnxruntime`` false: fp4 / e8m0 tensors) go to onnx.reference's
    ReferenceEvaluator instead, where ``optimization`` does not apply. A path's external data is
    loaded with the model, into memory; a ModelProto's weights left on disk are read by onnxruntime
    from ``external_folder``. ``shared``: outputs over onnxruntime's memory (:meth:`Runtime.run_shared`).

    ``device`` ("cpu" | "auto" | "cuda", GPU ``device_id``) is :func:`open_runtime`'s: where the session
    runs on a GPU and torch can use it, every output stays there, a torch tensor handed over by DLPack
    (:meth:`Runtime.run`), whatever ``shared`` says; on the CPU (or a CPU-only torch) outputs are numpy."""
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model))
    names = list(outputs) if outputs is not None else [o.name for o in model.graph.output]
    if not graph_io.runs_in_onnxruntime(model):
        from onnx.reference import ReferenceEvaluator  # lazy: only models onnxruntime cannot run

        evaluator = ReferenceEvaluator(model)
        return ModelRunner(names, REFERENCE, lambda feeds: dict(zip(names, evaluator.run(names, feeds))))
    runtime = open_runtime(model, names, device=device, optimization=optimization, external_folder=external_folder,
                           device_id=device_id)
    return runtime_runner(runtime, shared)


def runtime_runner(runtime: Runtime, shared: bool = False) -> ModelRunner:
    """A :class:`ModelRunner` over an open :class:`Runtime`: torch tensors on its GPU where the
    outputs lie there, else numpy (``shared``: over onnxruntime's memory)."""
    if runtime.device.type != "cpu":
        run = runtime.run
    else:
        run = runtime.run_shared if shared else runtime.run_numpy
    return ModelRunner(list(runtime.outputs), ONNXRUNTIME, run, runtime.provider, runtime.device)


def run_model(
    model: onnx.ModelProto | str | os.PathLike,
    feeds: dict[str, np.ndarray],
    outputs: Sequence[str] | None = None,
    *,
    optimization: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
) -> dict[str, np.ndarray]:
    """Run ``model`` once on ``feeds``: ``{output name: numpy array}`` for ``outputs`` (default: the
    graph's outputs), by onnxruntime on CPU at ``optimization`` or by onnx.reference for fp4 / e8m0
    models (see :func:`open_model_runner`)."""
    return open_model_runner(model, outputs, optimization=optimization).run(feeds)


INJECT_MIN_BYTES = 1024  # inline weights from this size on reach onnxruntime as buffers, not protobuf bytes
IN_MEMORY = "graphcal-in-memory"  # the location of a weight handed to onnxruntime as a buffer


def _inline_weights_apart(model: onnx.ModelProto, weights: Sequence[onnx.TensorProto] = (),
                          renamed: Sequence[tuple[str, onnx.TensorProto]] = ()
                          ) -> tuple[onnx.ModelProto, list[str], list[ort.OrtValue]]:
    """The model with its large inline weights replaced by stubs, and those weights as OrtValues
    over their bytes (for ``SessionOptions.add_external_initializers``, which onnxruntime takes
    in place of the stubs). Serializing a model with its weights costs as much as copying them
    twice (1.2 s of session start on the 369 MB bench decoder); the stubbed graph is a few MB.
    Weights that already live in a model's external files, sub-byte and string tensors stay as they are;
    those in graphcal's own data file (the rotated weights: graph.external.own_ref, a file outside the
    model's folder, which onnxruntime would refuse) are read into a buffer each and handed over too."""
    graph = graph_io.hollow_copy(model)
    names, values = [], []
    pairs = itertools.chain(((i.name, i) for i in itertools.chain(model.graph.initializer, weights)), renamed)
    for name, init in pairs:
        bits = graph_io.element_bits(init.data_type)
        own = own_ref(init) is not None
        injectable = ((own or init.data_location != onnx.TensorProto.EXTERNAL and init.HasField("raw_data"))
                      and bits is not None and bits % 8 == 0)
        itemsize = bits // 8 if injectable else 0
        if not injectable or not own and int(np.prod(init.dims)) * itemsize < INJECT_MIN_BYTES:
            if name != init.name:
                copy = onnx.TensorProto()
                copy.CopyFrom(init)  # a small one (or one onnxruntime reads from its file): copied under its name
                copy.name = name
                init = copy
            graph.graph.initializer.append(init)
            continue
        data = read_tensor_buffer(init, "") if own else init.raw_data  # its own file read now, whatever its size
        raw = np.frombuffer(data, dtype=f"<u{itemsize}").reshape(tuple(init.dims))  # one copy, read-only
        values.append(ort.OrtValue.ortvalue_from_numpy_with_onnx_type(raw, init.data_type))
        names.append(name)
        stub = graph.graph.initializer.add(name=name, data_type=init.data_type, dims=init.dims)
        stub.data_location = onnx.TensorProto.EXTERNAL
        stub.external_data.add(key="location", value=IN_MEMORY)  # never read: the buffer replaces it
    return graph, names, values



def _data_folder(graph: onnx.ModelProto, folder: str | os.PathLike) -> str:
    """The folder onnxruntime reads ``graph``'s weights left on disk from: the model's ``folder``, or
    for a Hugging Face cache snapshot its repository, the references in ``graph`` (graphcal's copy)
    rewritten relative to it. onnxruntime refuses a data file whose link leads out of the folder it is
    given, and a snapshot's files are links into the repository's blobs (graphcal.limits.confinement)."""
    roots = confinement(folder)
    if len(roots) == 1:
        return str(folder)
    repository = os.path.commonpath(roots)
    for t in graph.graph.initializer:
        if is_external(t) and not any(e.key == "location" and e.value == IN_MEMORY for e in t.external_data):
            rebase(t, folder, repository)
    return repository


def _fp16_group_query_attention(model) -> bool:
    """``model`` (a ModelProto) has a GroupQueryAttention whose past key is an fp16 graph input."""
    if not isinstance(model, onnx.ModelProto):
        return False
    fp16 = {i.name for i in model.graph.input if i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16}
    return any(n.op_type == "GroupQueryAttention" and len(n.input) > 3 and n.input[3] in fp16 for n in model.graph.node)


def check_loads(path: str | os.PathLike) -> None:
    """onnxruntime (CPU, ORT_ENABLE_BASIC) opens the model file graphcal wrote, as it opened the input:
    the check for what onnx's checker has no schema for (graph.io.unchecked_ops). Its complaint is a
    GraphcalError; nothing is run."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opts.log_severity_level = 3
    try:
        ort.InferenceSession(str(path), sess_options=opts, providers=[CPU])
    except Exception as e:  # onnxruntime raises its own exception types
        if bf16_cpu_refusal(e, onnx.load(str(path), load_external_data=False)) is not None:
            return  # the graph's types resolved; the CPU provider has no bfloat16 kernels (a CUDA model)
        raise GraphcalError(f"onnxruntime cannot load the written model, so it was not kept ({first_line(e)}); "
                            "this is a graphcal bug: please report it") from e
    trim_heap()
