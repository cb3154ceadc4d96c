"""Calibration data: .npz files (or a folder of them, or a CalibrationDataReader) -> validated batches.

An .npz holds one array per model input, keyed by input name, whose first dimension is the
sample dimension and doubles as the model's batch dimension: ``input_ids`` of shape
``(num_samples, seq)`` for a model input ``[batch, seq]``. A folder holds several such files
(one or more batches each, e.g. different sequence lengths); batches never span files.

The package, by job:

- ``inputs``: the graph's inputs (:class:`InputSpec`) and the checks data passes against them,
  from the array headers alone (names, dtypes, ranks, fixed and shared symbolic dimensions);
- ``source``: one source of arrays (a file, a mapping, a reader's batch) as its headers describe it;
- ``npz``: reading .npz files, bounded (regular files only, headers checked against the zip,
  one batch within half the available memory, rows streamed);
- ``reader``: an onnxruntime ``CalibrationDataReader`` as calibration data;
- ``fill``: for a model with a KV cache, the inputs token data lacks (past tensors of length 0,
  attention_mask, position_ids), filled as a prefill from an empty cache has them;
- ``calibration``: :class:`Calibration`, the one type the stages see, whatever the data came from;
- ``load``: :func:`load_data` and :class:`CalibrationData`, the batches a run streams;
- ``padding``: the ``attention_mask`` input that --exclude-padding reads;
- ``held_out``: the last samples set aside, for `run --size-budget` to choose its mix on.

This module re-exports the names the rest of graphcal imports.
"""

from graphcal.data.calibration import Calibration
from graphcal.data.inputs import InputSpec, batch_samples, graph_inputs
from graphcal.data.load import DEFAULT_BATCH_SIZE, CalibrationData, data_label, data_paths, load_data
from graphcal.data.padding import MASK_INPUT, check_padding_input
from graphcal.data.reader import ReaderData

__all__ = ["DEFAULT_BATCH_SIZE", "MASK_INPUT", "Calibration", "CalibrationData", "InputSpec", "ReaderData", "batch_samples",
           "check_padding_input", "data_label", "data_paths", "graph_inputs", "load_data"]
