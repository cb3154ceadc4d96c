"""Child program: onnxruntime's quantize_static on the weight MatMul/Gemm nodes, timed around the call.

    python -m tools.ort_static MODEL DATA_NPZ OUT_MODEL BATCH SAMPLES METHOD

QDQ, uint8 asymmetric activations, int8 per-channel weights (its defaults for x86), with calibration
``METHOD`` (MinMax, Percentile, Entropy), on the MatMul/Gemm nodes whose second input is a weight.
The time covers the session, calibration and writing. Prints one JSON line: ``{"seconds": ...}``.
tools/observers_table.py runs it as the peer users know.
"""

import json
import sys
import time

import numpy as np
import onnx
from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static


def main(argv: list[str]) -> int:
    model, data, out, batch, n, method = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4]), argv[5]
    graph = onnx.load(model, load_external_data=False).graph
    names = {i.name for i in graph.input}
    weights = {i.name for i in graph.initializer}
    layers = [node.name for node in graph.node if node.op_type in ("MatMul", "Gemm") and node.input[1] in weights]
    feeds = {k: v[:n] for k, v in np.load(data).items() if k in names}
    count = len(next(iter(feeds.values())))

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{k: v[i:i + batch] for k, v in feeds.items()} for i in range(0, count, batch)])

        def get_next(self):
            return next(self.batches, None)

    start = time.perf_counter()
    quantize_static(model, out, Reader(), quant_format=QuantFormat.QDQ, per_channel=True, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul", "Gemm"], nodes_to_quantize=layers,
                    calibrate_method=getattr(CalibrationMethod, method))
    print(json.dumps({"seconds": time.perf_counter() - start}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
