"""The model raised to the opset its schemes need, and the IR version that goes with it.

The opset is raised only as far as the schemes need (onnx's version converter); the IR version
becomes the lowest onnx pairs with that opset, within what onnxruntime loads (``MAX_ORT_IR``).
"""

from __future__ import annotations

import onnx
from onnx import helper

from graphcal.errors import GraphcalError, first_line
from graphcal.graph.io import MAX_ORT_IR, UNCHECKED_DOMAIN, default_opset, hollow_copy, set_domain, unchecked_ops

HALF_SCALES_OPSET = 19  # Q/DQ take float16 and bfloat16 inputs and scales (float32 only before)


def float_type_opset(elem_types) -> int:
    """The opset the Q/DQ of a model computing in these float element types need (the writer gives
    every scale the weight's or the activation's type): 19 when any is float16 or bfloat16, else 13."""
    half = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    return HALF_SCALES_OPSET if any(t in half for t in elem_types) else 13


def ir_for_opset(opset: int) -> int:
    """The lowest IR version onnx pairs with ``opset``, capped at what onnxruntime loads."""
    irs = [ir for _release, ir, op, *_ in helper.VERSION_TABLE if op >= opset]
    return min(min(irs, default=MAX_ORT_IR), MAX_ORT_IR)


def upgrade_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """``model`` converted to ``opset`` in place: onnx's version converter runs on a hollow copy
    (weights as dims-only stubs), and its graph replaces the model's while the weights stay put,
    so a big model is never copied. Falls back to converting the whole model if the hollow one
    cannot be converted (an adapter that reads weight values)."""
    from onnx import version_converter  # lazy: only when the opset must be raised

    hollow = hollow_copy(model)
    hollow.graph.initializer.extend(
        onnx.TensorProto(name=t.name, dims=t.dims, data_type=t.data_type) for t in model.graph.initializer)
    # ops onnx has no schema for (onnxruntime's SimplifiedLayerNormalization in the default domain, as
    # onnxruntime-genai's builder writes it) would stop the converter: it sees them in a domain of
    # their own, which it leaves alone, and they come back to the default domain after
    unchecked = unchecked_ops(hollow)
    if unchecked:
        set_domain(hollow, unchecked, "", UNCHECKED_DOMAIN)
        hollow.opset_import.append(helper.make_opsetid(UNCHECKED_DOMAIN, 1))
    try:
        converted = version_converter.convert_version(hollow, opset)
    except Exception:  # noqa: BLE001 -- retried below on the whole model, which reports the real error
        converted = None
    if converted is not None and unchecked:
        set_domain(converted, unchecked, UNCHECKED_DOMAIN, "")
        imports = [o for o in converted.opset_import if o.domain != UNCHECKED_DOMAIN]
        del converted.opset_import[:]
        converted.opset_import.extend(imports)
    if converted is None:
        try:
            upgraded = version_converter.convert_version(model, opset)
        except Exception as e:
            raise GraphcalError(
                f"the scheme needs opset {opset} but the model (opset {default_opset(model)}) could not be converted: "
                f"{first_line(e)}; re-export the model at opset {opset}"
            ) from e
        upgraded.ir_version = max(upgraded.ir_version, ir_for_opset(opset))
        return upgraded
    kept = {t.name for t in model.graph.initializer}
    graph = model.graph
    for name in ("node", "input", "output", "value_info"):
        field = getattr(graph, name)
        del field[:]
        field.extend(getattr(converted.graph, name))
    graph.initializer.extend(t for t in converted.graph.initializer if t.name not in kept)  # constants it added
    del model.opset_import[:]
    model.opset_import.extend(converted.opset_import)
    model.ir_version = max(converted.ir_version, ir_for_opset(opset))
    return model
