"""A data file of the run's own: tensors graphcal makes before the plan (the rotated weights, --rotate),
written one at a time and read back lazily by every later stage, as a model's external data is.

    OwnData(folder): a folder made on the first write inside ``folder()`` (the output's temporary folder,
      OutputSlot.early_folder; None: the system's temporary folder, for inspect and torchrun's other ranks)
      put(array) -> Piece: the array's bytes (numpy_helper.from_array's, so the tensor is the one an
        in-memory fold would have made) appended to ``weights.data``; the array is the caller's to drop
      Piece.tensor(name): the TensorProto the model keeps: name, type, dims, and a reference by absolute
        path to its bytes, registered with graph.external (register_own) so that its readers, and only
        for this file and these ranges, take it outside the model's folder
      finish(): the file closed and its identity recorded (graph.identity: every later read checks it)
      close(): the folder removed and the registrations dropped (at the end of the run, on an error,
        Ctrl-C or SIGTERM; an abort from another thread and the slot's release remove it too)
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from graphcal.errors import GraphcalError
from graphcal.graph import identity
from graphcal.graph.external import external_stub, forget_own, register_own
from graphcal.output.process import register_abort, unregister_abort

log = logging.getLogger("graphcal")

DATA_FILE = "weights.data"


@dataclass(frozen=True)
class Piece:
    """One tensor's type and dims (``proto``, without data) and its bytes' place in the file at ``path``."""

    proto: onnx.TensorProto
    path: str
    offset: int
    length: int

    def tensor(self, name: str) -> onnx.TensorProto:
        """The initializer the model keeps, under ``name``: a reference to its bytes."""
        self.proto.name = name
        return external_stub(self.proto, self.path, self.offset, self.length)


class OwnData:
    """The run's own data file, in a folder made inside ``folder()`` on the first :meth:`put`."""

    def __init__(self, folder: Callable[[], Path] | None, prefix: str = "graphcal-own-"):
        self._parent, self._prefix = folder, prefix
        self._folder: Path | None = None
        self._file = None
        self._abort: int | None = None
        self._finalizer = None
        self.offset = 0  # bytes written
        self.count = 0  # tensors written

    @property
    def path(self) -> Path | None:
        return self._folder / DATA_FILE if self._folder is not None else None

    def _open(self) -> None:
        parent = self._parent() if self._parent is not None else None
        try:
            folder = Path(tempfile.mkdtemp(prefix=self._prefix, dir=parent))
        except OSError as e:
            raise GraphcalError(f"could not make a folder for the rotated weights in {parent or tempfile.gettempdir()}: "
                                f"{e.strerror or e}") from e
        self._folder = folder
        self._abort = register_abort(lambda: shutil.rmtree(folder, ignore_errors=True))
        self._finalizer = weakref.finalize(self, _remove, folder, str(folder / DATA_FILE))  # dropped unclosed: still removed
        self._file = open(folder / DATA_FILE, "xb")  # noqa: SIM115 -- kept open until finish()
        log.info("the rotated weights go to %s, read back as each stage needs them", folder)

    def put(self, array: np.ndarray) -> Piece:
        """``array`` as an initializer's bytes (numpy_helper.from_array's) appended to the file. The caller
        drops ``array``; the file keeps the only copy."""
        proto = numpy_helper.from_array(np.ascontiguousarray(array))
        if self._file is None:
            self._open()
        elif self._file.closed:
            raise RuntimeError("the run's own data file is finished")
        raw = proto.raw_data
        try:
            self._file.write(raw)
        except OSError as e:
            raise GraphcalError(f"could not write the rotated weights to {self._folder}: {e.strerror or e}; free disk "
                                "space there") from e
        path = str(os.path.realpath(self._folder / DATA_FILE))
        piece = Piece(onnx.TensorProto(dims=proto.dims, data_type=proto.data_type), path, self.offset, len(raw))
        register_own(path, self.offset, len(raw))
        self.offset += len(raw)
        self.count += 1
        return piece

    def finish(self) -> None:
        """Close the file; from here it is read only, each read checking it is the file written (graph.identity)."""
        if self._file is not None and not self._file.closed:
            self._file.flush()
            identity.forget([self._file.name])
            identity.record(self._file.fileno(), self._file.name)
            self._file.close()

    def close(self) -> None:
        """Remove the folder and what it holds; the tensors pointing into it cannot be read after this."""
        if self._file is not None and not self._file.closed:
            self._file.close()
        unregister_abort(self._abort)
        self._abort = None
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None

    def __enter__(self) -> OwnData:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _remove(folder: Path, data: str) -> None:
    forget_own(data)
    identity.forget([data])
    with contextlib.suppress(OSError):
        shutil.rmtree(folder, ignore_errors=True)
