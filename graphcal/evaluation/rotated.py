"""A reference rotated as the quantized model was (``--rotate``), so that layers compare one by one.

A rotated model computes the fp32 model's outputs, but the residual stream between its layers is in
another basis: the layers writing the stream (o_proj, down_proj) give rotated outputs, and a layer
swapped in from the other model (--sensitivity, --fallback) would read and write the wrong basis.
Where the quantized models carry graphcal's rotation record and the fp32 reference does not, eval
rotates the reference in memory by the same matrices (:func:`rotate_like`: the fp32 function is
unchanged) before any layer is compared or swapped.
"""

from __future__ import annotations

import json
import logging

import onnx

from graphcal.algorithms.rotation.fold import rotate_like, rotation_record
from graphcal.errors import UsageError

log = logging.getLogger("graphcal")
_SAME = ("matrix", "heads", "kind", "seed")  # what makes two rotations the same


def rotation_key(record: dict | None) -> str | None:
    """What makes two rotation records the same rotation (None: not rotated)."""
    return None if record is None else json.dumps([record.get(k) for k in _SAME])


def rotated_as(reference: onnx.ModelProto, base_dir: str, *candidates: onnx.ModelProto | None) -> onnx.ModelProto:
    """``reference``, rotated in place as ``candidates`` were where they were and it was not; a
    one-line UsageError where the candidates were rotated differently from each other or from it."""
    records = [rotation_record(c) for c in candidates if c is not None]
    if not any(records):
        return reference
    keys = {rotation_key(r) for r in records}
    if len(keys) > 1:
        raise UsageError("the quantized models were rotated differently (--rotate); mix models rotated alike")
    record = next(r for r in records if r)
    own = rotation_record(reference)
    if own is not None:
        if rotation_key(own) != rotation_key(record):
            raise UsageError(f"the reference was rotated otherwise ({own.get('matrix')}) than the quantized model "
                             f"({record.get('matrix')}); compare a model with its own fp32 form")
        return reference
    rotate_like(reference, base_dir, record)
    log.info("eval: the reference rotated as the quantized model was (%s) to compare layer by layer",
             record.get("matrix"))
    return reference
