"""Write Q/DQ into the model from calibrated qparams, in compressed-tensors' conventions.

Every number follows compressed-tensors: weights are quantized with its own ``quantize`` and the
stored tensor is exactly what it computes; activation subgraphs redo its dynamic-scale math op
for op. One module per job, data flowing one way:

- :mod:`.policy`: what can be written for which target :class:`TargetRuntime` (onnxruntime: the forms
  its optimizer turns into fast kernels; tensorrt: only what TensorRT builds; qdq: standard Q/DQ
  written literally), at which opset, how each type is stored, and which form each target gets;
- :mod:`.weights`, :mod:`.activations`, :mod:`.kv`: the ONNX forms of weights, input
  activations and key/value states, built into :mod:`.edits` (nodes and initializers to add);
- :mod:`.opset`: the model raised to the opset its schemes need; :mod:`.cleanup`: weight paths
  left unread;
- :mod:`.writer`: :class:`QDQWriter`, the one entry point, which alone changes the graph.
"""

from graphcal.graph.qdq.cleanup import dead_weight_paths
from graphcal.graph.qdq.opset import ir_for_opset
from graphcal.graph.qdq.policy import TargetRuntime, form_notes, items_opset, required_kv_opset, runtime_notes
from graphcal.graph.qdq.writer import QDQWriter

__all__ = ["QDQWriter", "TargetRuntime", "dead_weight_paths", "form_notes", "ir_for_opset", "items_opset", "required_kv_opset",
           "runtime_notes"]
