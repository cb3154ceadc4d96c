"""The output's external data written tensor by tensor, as the weight phase makes each tensor.

A :class:`DataSpill` owns the output's data file (``model.onnx.data``, in the output's temporary
folder: graphcal.output.OutputSlot.early_folder). :meth:`DataSpill.take` appends a tensor's raw
bytes to it and gives a new proto holding only the external reference (location, offset, length)
in its place (the old one freed, its bytes with it), so the model held during the weight phase is its
skeleton plus small tensors, whatever the model's size. :func:`graphcal.graph.io.save_with_external_data`
then appends the tensors still in memory or in the input's data files to the same file and writes the graph. Only models whose output is in
external data anyway take this path (:func:`streams`), and only large ones: a smaller output is
written as before, byte for byte.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import onnx

from graphcal.graph.external import external_stub, is_external

STREAM_MIN_BYTES = 256 << 20  # input data files at least this large: the output's data is written as it is made
SPILL_MIN_BYTES = 1024  # tensors this large go to the data file (graph.io.save_with_external_data's threshold)


def streams(data_bytes: int) -> bool:
    """Whether an output whose input keeps ``data_bytes`` bytes of external data is written tensor by tensor."""
    return data_bytes > 0 and data_bytes >= STREAM_MIN_BYTES


class DataSpill:
    """The data file at ``path`` (created new), named ``path.name`` in the references it writes."""

    def __init__(self, path: Path, threshold: int = SPILL_MIN_BYTES):
        self.path, self.threshold = Path(path), threshold
        self.file = open(self.path, "xb")  # noqa: SIM115 -- kept open for the whole weight phase
        self.offset = 0
        self.names: set[str] = set()  # the tensors whose references point into this file

    def take(self, tensors: Iterable[onnx.TensorProto]) -> list[onnx.TensorProto]:
        """Each of ``tensors`` holding at least ``threshold`` raw bytes in memory: its bytes appended
        to the file. Returns the tensors as the model keeps them: each one written replaced by a new
        proto holding only its name, type, dims and reference, the others as they are. A new proto,
        not the old one cleared: protobuf's upb runtime keeps a message's bytes in its arena until the
        message itself is freed (ClearField frees nothing), so the caller drops the old one."""
        kept = []
        for t in tensors:
            if is_external(t) or not t.HasField("raw_data") or t.ByteSize() < self.threshold:
                kept.append(t)
                continue
            raw = t.raw_data
            if len(raw) < self.threshold:
                kept.append(t)
                continue
            self.file.write(raw)
            stub = external_stub(t, self.path.name, self.offset, len(raw))
            self.offset += len(raw)
            self.names.add(t.name)
            kept.append(stub)
        return kept

    def close(self) -> None:
        """Flush and close the file (the saver appends to it by name)."""
        if not self.file.closed:
            self.file.close()
