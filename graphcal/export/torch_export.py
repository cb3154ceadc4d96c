"""Torch modules to ONNX, keeping the torch module names: :func:`export_torch`.

It serves ``graphcal export`` (graphcal.export.pretrained) and ``tools/make_models.py`` (the tiny
reference models in ``models/``, built by ``tools/builders.py``, outside the package).
torch is imported lazily inside the functions, so importing this module does not need it.

Node and initializer names keep the torch module paths (``model.layers.0.self_attn.q_proj``):
the module being exported is never wrapped in another ``nn.Module`` (that would prefix every name
with the wrapper's attribute). Instead :func:`export_torch` temporarily sets an instance-level
``forward`` that calls the original one with keyword arguments and returns only the named outputs.
"""

from __future__ import annotations

import inspect
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from graphcal.graph import io as graph_io
from graphcal.output.process import on_abort

#: Dynamic axes of the tiny models' [batch, seq] inputs and outputs (legacy exporter).
BATCH_SEQ_AXES = {0: "batch", 1: "seq"}


def example_ids(vocab_size: int, batch: int, seq: int, seed: int):
    """Seeded random int64 ``[batch, seq]`` token ids in ``[0, vocab_size)``: the example inputs
    exports are traced with (here and in ``tools/builders.py``)."""
    import torch  # lazy: torch takes seconds to import; graphcal --help does without

    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, vocab_size, (batch, seq), generator=g, dtype=torch.int64)


def _select_outputs(result: Any, output_names: list[str]) -> tuple:
    """Pick the tensors named by ``output_names`` out of a forward's return value."""
    out = []
    for name in output_names:
        if isinstance(result, dict) or hasattr(result, "keys"):
            value = result[name]
        elif hasattr(result, name):
            value = getattr(result, name)
        else:
            raise KeyError(f"forward's result has no output {name!r}")
        if value is None:
            raise KeyError(f"forward's output {name!r} is None")
        out.append(value)
    return tuple(out)


def export_torch(
    module,
    example_inputs: dict,
    path: str | os.PathLike,
    *,
    output_names: list[str] | tuple[str, ...],
    dynamic_axes: dict | None = None,
    dynamo: bool = False,
    constant_folding: bool = True,
    opset: int = 17,
) -> Path:
    """Export ``module`` to the ONNX file ``path`` and return its path.

    ``module``'s forward is called with ``example_inputs``' keys as keyword arguments; the graph's
    inputs are named (and ordered) like the dict. The graph's outputs are the tensors of the
    forward's result named by ``output_names`` (attributes of a HF ``ModelOutput``, or dict keys).

    ``dynamo=False`` uses the legacy TorchScript exporter (``do_constant_folding``, ``dynamic_axes``
    apply): with constant folding, Linear weights become pre-transposed ``[in, out]`` initializers
    named ``onnx::MatMul_NNN`` and nodes are named ``/model/layers.0/self_attn/q_proj/MatMul``;
    without it, the ``[out, in]`` weight keeps its torch name and feeds a ``Transpose``.

    ``dynamo=True`` uses the torch.export-based exporter at opset >= 18. Nodes are named
    ``node_linear_N`` (bias-free Linear) / ``node_MatMul_N`` and carry the module path in their
    ``pkg.torch.onnx.name_scopes`` metadata. ``constant_folding`` maps to the exporter's
    ``optimize`` (on: Transpose(weight) folded into an initializer named ``val_N``; off: the
    torch-named weight feeds a Transpose). Shapes are static unless ``dynamic_axes`` is given
    (torch translates it to ``dynamic_shapes`` and names the graph's dims after it).

    The file is written in one piece (weights inside the protobuf, no external data) and is
    byte-for-byte deterministic for a given torch version when the module's weights are.
    """
    import onnx  # lazy: kept off the CLI's start-up path
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    output_names = list(output_names)
    input_names = list(example_inputs)
    if not input_names:
        raise ValueError("example_inputs is empty")

    original_forward = module.forward  # bound method of the class' forward
    had_instance_forward = "forward" in vars(module)

    def forward(*args, **kwargs):
        # The exporters pass the example inputs positionally (legacy) or by keyword (dynamo).
        kw = dict(zip(input_names, args))
        kw.update(kwargs)
        return _select_outputs(original_forward(**kw), output_names)

    # The legacy exporter traces through inspect.signature(module.forward); give the instance
    # forward the input names so keyword / positional mapping and input naming line up.
    forward.__signature__ = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in input_names]
    )

    was_training = module.training
    module.eval()
    module.forward = forward
    try:
        args = tuple(example_inputs[n] for n in input_names)
        with torch.no_grad(), tempfile.TemporaryDirectory() as tmp, on_abort(
                lambda: shutil.rmtree(tmp, ignore_errors=True)):  # removed too when a signal stops the export
            tmp_path = Path(tmp) / "model.onnx"
            if dynamo:
                if opset < 18:
                    raise ValueError("the dynamo exporter needs opset >= 18")
                program = torch.onnx.export(
                    module,
                    (),
                    kwargs=dict(example_inputs),
                    dynamo=True,
                    opset_version=opset,
                    input_names=input_names,
                    output_names=output_names,
                    dynamic_axes=dynamic_axes,  # translated to dynamic_shapes by torch
                    optimize=constant_folding,
                    verify=False,
                    verbose=False,
                    external_data=False,
                )
                model = program.model_proto
            else:
                torch.onnx.export(
                    module,
                    args,
                    str(tmp_path),
                    dynamo=False,
                    export_params=True,
                    do_constant_folding=constant_folding,
                    opset_version=opset,
                    input_names=input_names,
                    output_names=output_names,
                    dynamic_axes=dynamic_axes,
                )
                model = onnx.load(str(tmp_path))
    finally:
        if had_instance_forward:
            module.forward = original_forward
        else:
            del module.forward
        module.train(was_training)

    _normalise(model)

    if graph_io.past_protobuf_limit(model):  # past protobuf's 2 GB: weights in <name>.data beside the graph
        graph_io.save_with_external_data(model, path)
        return path
    data = model.SerializeToString(deterministic=True)
    path.write_bytes(data)
    return path


def _normalise(model) -> None:
    """Make an exported ModelProto loadable by onnxruntime and free of run-dependent fields."""
    from graphcal.graph.io import MAX_ORT_IR  # the one IR cap: what onnxruntime loads

    model.ir_version = min(model.ir_version, MAX_ORT_IR)
    # producer_version is the torch version: deterministic for a given torch, keep it.
    # The dynamo exporter may leave doc strings holding stack traces (file paths); drop them.
    model.doc_string = ""
    model.graph.doc_string = ""
    for node in model.graph.node:
        node.doc_string = ""
    for fn in model.functions:
        fn.doc_string = ""
        for node in fn.node:
            node.doc_string = ""
