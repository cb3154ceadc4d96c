"""ONNX graph stages: load/save, find targets, add taps, write Q/DQ."""
