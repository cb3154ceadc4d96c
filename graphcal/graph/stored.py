"""What a stored tensor holds agrees with its type and dims, checked when the model is loaded.

A TensorProto names its type (``data_type``) and shape (``dims``), and keeps its values in one
field: ``raw_data``, the typed field its type has (``float_data``, ``int32_data``, ...), or external
data. A stranger's model may name a type ONNX does not define, keep too few or too many values,
keep them twice (``raw_data`` and ``float_data``: onnxruntime reads one, onnx's checker refuses
the model) or in a field of another type. Each is refused in one line naming the tensor, before
any pass reads it (numpy's reshape, or a type table, would otherwise fail deep inside a stage).
External tensors are graph.external's to check (their ``length`` against their dims); here they
may only hold no values inline besides.
"""

from __future__ import annotations

import math

import onnx
from onnx.helper import tensor_dtype_to_field

from graphcal.errors import GraphcalError, shown
from graphcal.graph.external import all_tensors, element_bits, expected_bytes, is_external

_TYPED = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")
_COMPLEX = frozenset({onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128})


def check_tensors(model: onnx.ModelProto, where: str) -> None:
    """Raise GraphcalError (prefixed with ``where``) for the first tensor whose stored values do not
    agree with its type and dims (every tensor: initializers, sparse ones, attributes, subgraphs)."""
    for t in all_tensors(model):
        try:
            check_tensor(t)
        except GraphcalError as e:
            raise GraphcalError(f"{where}: {e}") from None


def check_tensor(t: onnx.TensorProto) -> None:
    """One tensor: a type ONNX defines, its values in one field that suits the type, as many as its dims need."""
    name = repr(shown(t.name)) if t.name else "<unnamed>"
    type_name = _type_name(t.data_type)
    if type_name is None:
        raise GraphcalError(f"tensor {name} has data type {t.data_type}, which ONNX does not define")
    if any(d < 0 for d in t.dims):
        raise GraphcalError(f"tensor {name} has a negative dimension {list(t.dims)}")
    fields = (["raw_data"] if t.HasField("raw_data") else []) + [f for f in _TYPED if len(getattr(t, f))]
    if is_external(t):
        if fields:
            raise GraphcalError(f"tensor {name} keeps its values in external data and in {fields[0]} too; "
                                "an ONNX tensor keeps them in one place")
        return
    if len(fields) > 1:
        raise GraphcalError(f"tensor {name} keeps its values twice ({' and '.join(fields)}; onnxruntime would read "
                            "one, onnx's checker refuses it); an ONNX tensor keeps them in one field")
    count = math.prod(t.dims)
    if not fields:
        if count:
            raise GraphcalError(f"tensor {name} holds no values, but its dims {list(t.dims)} need {count:,}")
        return
    field = fields[0]
    if field == "raw_data":
        if t.data_type == onnx.TensorProto.STRING:
            raise GraphcalError(f"tensor {name} is a STRING tensor with raw_data; ONNX keeps strings in string_data")
        need, have, unit = expected_bytes(t), len(t.raw_data), "bytes"
    else:
        proper = tensor_dtype_to_field(t.data_type)
        if field != proper:
            raise GraphcalError(f"tensor {name} keeps its {type_name} values in {field}; ONNX keeps them in {proper} "
                                "or raw_data")
        need, have, unit = _typed_count(t.data_type, count), len(getattr(t, field)), "values"
    if have != need:
        raise GraphcalError(f"tensor {name} holds {have:,} {unit} in {field}, but its dims {list(t.dims)} "
                            f"and type {type_name} need {need:,}")


def _type_name(data_type: int) -> str | None:
    """The ONNX name of a tensor type (FLOAT, STRING, ...), or None for a type ONNX does not define."""
    if data_type == onnx.TensorProto.UNDEFINED:
        return None
    try:
        name = onnx.TensorProto.DataType.Name(data_type)
    except ValueError:
        return None
    if data_type != onnx.TensorProto.STRING and element_bits(data_type) is None:
        return None  # a type this onnx names but cannot hold values of
    return name


def _typed_count(data_type: int, count: int) -> int:
    """Entries of the typed field ``count`` elements take: two per complex number; sub-byte types packed
    into bytes (one byte an entry, as onnx.helper.make_tensor writes them); one per element otherwise."""
    if data_type in _COMPLEX:
        return 2 * count
    bits = element_bits(data_type)
    if bits is not None and bits < 8:
        return -(-count * bits // 8)
    return count
