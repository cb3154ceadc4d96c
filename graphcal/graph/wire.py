"""An inline model read without its large weights: each stays in the .onnx file, referenced where it lies.

A model that keeps its weights inline is one protobuf; parsing it holds every weight in memory, and
onnxruntime then makes its own copy, so a run or an eval kept two (issue: 1.8x plain inference on a
540 MB model, where external-data models stay near 1x). :func:`strip_inline_weights` walks the
file's protobuf wire format (ModelProto.graph, GraphProto.initializer, TensorProto.raw_data) over a
read-only map of it, and builds the model's bytes with every large ``raw_data`` replaced by an
external-data reference to the model file itself (``location`` its name, ``offset``, ``length``):
the form ONNX defines for weights in a file, which onnxruntime and graphcal's lazy readers already
take. Nothing but the graph's structure is copied; the weights' pages are never touched here.

Only the three message levels are walked; everything else (nodes, Constant attributes, subgraphs,
typed data fields) is copied as it is. A tensor is left inline when it is not a plain single
``raw_data`` (already external, given twice, values in a typed field too) or when its length is not
what its dims need: the ordinary checks (graph.stored) name what is wrong with it. The file comes
from strangers: every length is checked against the end of its message, and anything that does not
parse gives None, and the caller reads the file the ordinary way (whose errors name the problem);
a large tensor whose other fields do not parse is refused naming it.
"""

from __future__ import annotations

import mmap
import os

import onnx
from google.protobuf.message import DecodeError

from graphcal.errors import GraphcalError, first_line, shown
from graphcal.graph.external import expected_bytes

_GRAPH, _INITIALIZER, _RAW_DATA, _EXTERNAL_DATA, _DATA_LOCATION, _NAME = 7, 5, 9, 13, 14, 8
# TensorProto fields that keep values elsewhere than raw_data: a tensor holding any is left as it is
# (graph.stored refuses one that holds its values twice, naming both fields)
_ELSEWHERE = frozenset({_EXTERNAL_DATA, _DATA_LOCATION, 4, 5, 6, 7, 10, 11})  # + float/int32/string/int64/double/uint64_data
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5


class _Malformed(Exception):
    """The bytes are not the protobuf the walk expects: read the file the ordinary way instead."""


def strip_inline_weights(fd: int, location: str, min_bytes: int) -> tuple[bytes, int] | None:
    """(the model's bytes with each inline weight of ``min_bytes`` or more referenced in place in the
    file ``location`` names, how many were), or None when nothing was or the walk failed.
    ``fd`` is the open model file."""
    size = os.fstat(fd).st_size
    if size == 0:
        return None
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            walk = _Walk(view, location, min_bytes)
            out = walk.message(0, size, {_GRAPH: walk.graph})
            return (out, walk.stripped) if walk.stripped else None
        except (_Malformed, ValueError, OverflowError):
            return None
        finally:
            view.release()


class _Walk:
    def __init__(self, buf: memoryview, location: str, min_bytes: int):
        self.buf, self.location, self.min_bytes, self.stripped = buf, location, min_bytes, 0

    def varint(self, pos: int, end: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            if pos >= end or shift > 63:
                raise _Malformed
            byte = self.buf[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value, pos
            shift += 7

    def fields(self, start: int, end: int):
        """(field number, wire type, start of the field, start of its value, end of the field)."""
        pos = start
        while pos < end:
            key, value_at = self.varint(pos, end)
            number, wire = key >> 3, key & 7
            if number == 0:
                raise _Malformed
            if wire == _VARINT:
                stop = self.varint(value_at, end)[1]
            elif wire == _FIXED64:
                stop = value_at + 8
            elif wire == _FIXED32:
                stop = value_at + 4
            elif wire == _LEN:
                length, value_at = self.varint(value_at, end)
                stop = value_at + length
            else:  # groups (deprecated) never occur in ONNX
                raise _Malformed
            if stop > end:
                raise _Malformed
            yield number, wire, pos, value_at, stop
            pos = stop

    def message(self, start: int, end: int, nested: dict) -> bytes:
        """The message's bytes, its length-delimited fields named in ``nested`` rebuilt by their walker."""
        out = bytearray()
        for number, wire, at, value_at, stop in self.fields(start, end):
            if wire == _LEN and number in nested:
                inner = nested[number](value_at, stop)
                out += _varint(number << 3 | _LEN) + _varint(len(inner)) + inner
            else:
                out += self.buf[at:stop]
        return bytes(out)

    def graph(self, start: int, end: int) -> bytes:
        return self.message(start, end, {_INITIALIZER: self.tensor})

    def tensor(self, start: int, end: int) -> bytes:
        fields = list(self.fields(start, end))
        raw = [f for f in fields if f[0] == _RAW_DATA]
        if (len(raw) != 1 or raw[0][4] - raw[0][3] < self.min_bytes
                or any(f[0] in _ELSEWHERE for f in fields)):
            return bytes(self.buf[start:end])  # small, already external, or not one plain raw_data: as it is
        _, wire, _, value_at, stop = raw[0]
        if wire != _LEN:
            raise _Malformed
        rest = b"".join(bytes(self.buf[f[2]:f[4]]) for f in fields if f[0] != _RAW_DATA)
        try:
            tensor = onnx.TensorProto.FromString(rest)
        except DecodeError as e:
            raise GraphcalError(f"initializer {self.name(fields)} is not a readable ONNX tensor ({first_line(e)})") from None
        try:
            if expected_bytes(tensor) != stop - value_at:
                return bytes(self.buf[start:end])  # the ordinary read names what is wrong with it
        except Exception:  # noqa: BLE001 -- a type or dims that cannot be external: left as it is
            return bytes(self.buf[start:end])
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", str(value_at)), ("length", str(stop - value_at))):
            tensor.external_data.add(key=key, value=value)
        self.stripped += 1
        return tensor.SerializeToString()


    def name(self, fields) -> str:
        """A tensor's name for messages, read from its own fields (it did not parse as a whole)."""
        for number, wire, _, value_at, stop in fields:
            if number == _NAME and wire == _LEN:
                return repr(shown(bytes(self.buf[value_at:stop]).decode("utf-8", "replace")))
        return "<unnamed>"


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)
