"""What a model takes and whether data fits it: the graph's inputs, and the checks every source of batches passes.

A Source (graphcal.data.source) describes one file (or mapping, or reader batch) of arrays by its headers alone
(name -> shape and dtype); :func:`validate` checks it against the graph's inputs before anything is
read: names, dtypes, ranks, fixed dimensions, and that the inputs agree on the batch and on shared
symbolic dimensions. :func:`check_finite` refuses NaN and Inf in a batch once it is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx

from graphcal.data.source import Source
from graphcal.errors import GraphcalError


@dataclass(frozen=True)
class InputSpec:
    """A graph input: name, numpy dtype and shape (ints for fixed dims, str/None for free ones)."""

    name: str
    dtype: np.dtype
    shape: tuple[int | str | None, ...]


def graph_inputs(model: onnx.ModelProto) -> list[InputSpec]:
    """The inputs a caller must feed (graph inputs that are not initializers)."""
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for value in model.graph.input:
        if value.name in inits:
            continue
        tt = value.type.tensor_type
        if not value.type.HasField("tensor_type"):
            raise GraphcalError(f"model input {value.name!r} is not a tensor; graphcal feeds tensors only")
        dims = tuple(
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim
        )
        specs.append(InputSpec(value.name, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)), dims))
    return specs


def check_arrays(arrays: Mapping[str, np.ndarray]) -> dict:
    out = {}
    for key, value in arrays.items():
        value = np.asarray(value)
        if value.dtype.hasobject:
            raise GraphcalError(f"array {key!r} holds Python objects; graphcal reads numeric arrays only")
        out[key] = (value.shape, value.dtype)
    return out


def validate(source: Source, inputs: list[InputSpec], fixed_batch: int | None) -> None:
    where = source.label
    found = source.headers
    names = {s.name for s in inputs}
    missing = [n for n in names if n not in found]
    unknown = [k for k in found if k not in names]
    expected = ", ".join(sorted(names))
    if missing:
        raise GraphcalError(f"{where}: no array for model input(s) {', '.join(sorted(missing))} (the model takes: {expected})")
    if unknown:
        raise GraphcalError(f"{where}: array(s) {', '.join(sorted(unknown))} are not model inputs (the model takes: {expected})")
    batch: int | None = None
    symbols: dict[str, tuple[int, str]] = {}
    for spec in inputs:
        shape, dtype = found[spec.name]
        if dtype != spec.dtype:
            raise GraphcalError(
                f"{where}: input {spec.name!r} is {dtype}, the model expects {spec.dtype} "
                f"(convert with .astype(np.{spec.dtype.name}))"
            )
        if len(shape) != len(spec.shape):
            raise GraphcalError(
                f"{where}: input {spec.name!r} has rank {len(shape)} {tuple(shape)}, the model expects rank "
                f"{len(spec.shape)} {format_shape(spec.shape)}; the first dimension is the sample (batch) dimension"
            )
        if not shape:
            continue
        if batch is None:
            batch = shape[0]
        elif shape[0] != batch:
            raise GraphcalError(
                f"{where}: inputs disagree on the number of samples ({spec.name!r} has {shape[0]}, others {batch})"
            )
        for axis, (have, want) in enumerate(zip(shape, spec.shape)):
            if axis == 0 and fixed_batch:
                continue
            if isinstance(want, int) and want > 0 and have != want:
                raise GraphcalError(
                    f"{where}: input {spec.name!r} has size {have} on axis {axis}, the model fixes it at {want}"
                )
            if isinstance(want, str) and axis > 0:
                seen = symbols.setdefault(want, (have, spec.name))
                if seen[0] != have:
                    raise GraphcalError(
                        f"{where}: inputs {seen[1]!r} and {spec.name!r} share dimension {want!r} "
                        f"but have sizes {seen[0]} and {have}"
                    )
    if not any(found[s.name][0] for s in inputs):
        raise GraphcalError(f"{where}: every input is a scalar; graphcal needs a sample dimension")


def fixed_batch(inputs: list[InputSpec]) -> int | None:
    for spec in inputs:
        if spec.shape and isinstance(spec.shape[0], int) and spec.shape[0] > 0:
            return spec.shape[0]
    return None


def slice_rows(array: np.ndarray, start: int, stop: int) -> np.ndarray:
    return array if array.ndim == 0 else array[start:stop]


def check_finite(batch: dict[str, np.ndarray], where: str, start: int) -> None:
    for name, value in batch.items():
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            bad = int(np.argwhere(~np.isfinite(value))[0][0]) + start if value.ndim else start
            raise GraphcalError(f"{where}: input {name!r} holds NaN or Inf (sample {bad}); clean the data first")


def format_shape(shape) -> str:
    return "[" + ", ".join(str(d) if d not in (None, "") else "?" for d in shape) + "]"


def batch_samples(batch: dict) -> int:
    """How many samples a batch holds (its inputs' leading dimension)."""
    first = next(iter(batch.values()), None)
    return int(first.shape[0]) if first is not None and getattr(first, "ndim", 0) else 1

