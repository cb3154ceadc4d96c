"""Child program: plain onnxruntime over the calibration batches, timed from the session's creation.

    python -m tools.infer_baseline MODEL DATA_NPZ BATCH SAMPLES

The baseline the tables hold a calibration's time and peak memory against (tools/algorithms_table.py,
tools/observers_table.py). Inputs the data lacks (a KV-cache decoder's empty past, its mask and
positions) are filled as ``graphcal run`` fills them. Prints one JSON line: ``{"seconds": ..., "samples": ...}``.
"""

import json
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort


def main(argv: list[str]) -> int:
    model, data, batch, n = argv[0], argv[1], int(argv[2]), int(argv[3])
    start = time.perf_counter()
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    arrays = dict(np.load(data))
    if names <= set(arrays):
        feeds = {k: v[:n] for k, v in arrays.items() if k in names}
        count = len(next(iter(feeds.values())))
        for i in range(0, count, batch):
            session.run(None, {k: v[i:i + batch] for k, v in feeds.items()})
    else:  # graphcal's own fill (the data module, not the calibrator: what any user of run would feed)
        from graphcal.data import graph_inputs, load_data
        from graphcal.graph.io import load_model_info

        calib = load_data(Path(data), graph_inputs(load_model_info(Path(model), lazy=True)[0]), batch_size=batch,
                          num_samples=n, model_dir=Path(model).parent)
        for feeds in calib.batches():
            session.run(None, feeds)
        count = calib.num_samples
    print(json.dumps({"seconds": time.perf_counter() - start, "samples": count}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
